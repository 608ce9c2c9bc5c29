// Private to src/train: a training step's forward and backward over its micro-batches, one
// class per schedule. MicroBatchRunner runs the micro-batches one after another, their
// gradients accumulating in the ZeRO engine (a plain step is one micro-batch); PipelineRunner
// runs them through the stages in 1F1B order. Both read the rank's rows of the step from the
// epoch order and return the rank's loss sum and attention pairs; reducing them over the grid,
// the optimizer step and the logging stay with TrainRun.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "input_staging.h"
#include "shardlm/model/llama.h"
#include "shardlm/parallel/context.h"
#include "shardlm/parallel/pipeline.h"
#include "shardlm/train/data.h"

namespace shardlm::trainer_detail {

// Fills the model's inputs with rows order[first .. first + B) of `data`: directly, or, under
// context parallelism, the full rows first and then this rank's share of every row. Returns
// the attention pairs of the whole rows (for the FLOP count). slot >= 0: a pipeline stage's
// micro-batch slot.
double fill_batch(LlamaModel& model, ContextParallel* cp, Dataset& data,
                  const std::vector<int64_t>& order, int64_t first, int64_t B, Backend& be,
                  InputStaging& staging, int slot = -1);

// What a runner computes with; TrainRun owns all of it.
struct StepParts {
  LlamaModel& model;
  ContextParallel* cp;  // null without context parallelism
  Dataset& data;
  Backend& backend;
  InputStaging& staging;      // a micro-batch's inputs on the host and on their way up
  int64_t B = 0;              // rows per micro-batch
  int64_t T = 0;              // tokens per row
  int64_t Tl = 0;             // tokens of each row this rank holds (T / cp)
  int64_t micro_batches = 1;  // per step (train.grad_accum)
  uint64_t seed = 0;          // train.seed: LoRA dropout's masks
  // The cp group (with cp): a preference objective sums each pair's sums over it.
  Communicator* cp_group = nullptr;
};

// One step of one rank.
struct StepWork {
  const std::vector<int64_t>& order;  // the epoch's window order
  int64_t first_row = 0;              // this rank's first row of the step, as an index into `order`
  int64_t rank_row = 0;  // the same row's index within the step (LoRA dropout's offset)
  int64_t step = 0;      // 1-based
  int64_t targets = 0;   // the whole step's targets over every rank: the gradient's normaliser
  int64_t preference_pairs = 0;  // a preference objective's normaliser: the step's pairs
};

// A preference objective's metrics summed over a step's preference pairs (preference.h).
struct PreferenceSums {
  double loss = 0, rewards_chosen = 0, rewards_rejected = 0, accuracies = 0;
  double logps_chosen = 0, logps_rejected = 0;
  void add(const PreferenceSums& o) {
    loss += o.loss;
    rewards_chosen += o.rewards_chosen;
    rewards_rejected += o.rewards_rejected;
    accuracies += o.accuracies;
    logps_chosen += o.logps_chosen;
    logps_rejected += o.logps_rejected;
  }
};

struct StepSums {
  double loss_sum = 0;        // this rank's
  double pairs = 0;           // attention pairs of this rank's rows
  PipelineStats pipeline;     // PipelineRunner: the stage's measured times
  PreferenceSums preference;  // a preference objective's (loss_sum: its loss sum too)
};

class StepRunner {
 public:
  virtual ~StepRunner() = default;
  virtual StepSums run(const StepWork& work) = 0;
  // The host memory the runner holds in its own rows from construction (a preference
  // objective's; the plain runners hold none), which TrainRun charges to the ledger.
  virtual int64_t host_bytes() const { return 0; }
};

// PipelineRunner when `pipe` is given (pp > 1; stage_output_elems: one micro-batch's hidden
// state between stages), else MicroBatchRunner.
std::unique_ptr<StepRunner> make_step_runner(const StepParts& parts, PipelineExecutor* pipe,
                                             int64_t stage_output_elems);

}  // namespace shardlm::trainer_detail
