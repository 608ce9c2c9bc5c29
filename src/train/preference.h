// Private to src/train: the preference objectives (train.objective = "dpo" or "simpo"): each
// pair's loss, its derivative with respect to the two sequences' summed log-probabilities (the
// per-token weights of the model's weighted backward, LlamaModel::forward_backward_weighted),
// TRL's per-step metrics, and the step runner that computes them micro-batch by micro-batch.
//
// A pair is one item of whole-sample packing: its chosen then its rejected sequence in one row
// (Dataset::window_documents). Each pair's loss, derivatives and metrics are
// preference_loss.h's (shared with the backend's preference ops). The step's loss is the mean
// over its pairs (TRL's per_sequence_loss.mean()); the metrics are means over the pairs too,
// margins the difference of the rewards, accuracies the share with chosen > rejected.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "shardlm/backend/preference_loss.h"
#include "shardlm/config/config.h"
#include "shardlm/plan/plan.h"
#include "step_runner.h"

namespace shardlm::trainer_detail {

// The loss spec the backend's preference_coefficients takes.
using PreferenceLoss = PreferenceLossSpec;
// From train.objective and train.dpo.* / train.simpo.* (objective != "sft").
PreferenceLoss preference_loss(const TrainConfig& train);

// One sequence of a pair within a micro-batch's rows: positions [begin, end) of the flat
// [B*T] batch.
struct SequenceSpan {
  int64_t begin = 0, end = 0;
};
struct PairSpans {
  SequenceSpan chosen, rejected;
  int64_t window = 0, nth = 0;  // the pair is window `window`'s nth (ReferenceTable's index)
};
static_assert(sizeof(PairSpans) == kPreferencePairBytes, "plan.h counts a pair's bytes");
// The pairs of rows order[first .. first + B) (rows past the order: none), as placed by fill(),
// into `pairs` (cleared first), which holds its capacity: a list reserved for
// max_micro_batch_pairs(B, T) (plan.h) pairs never grows, so its bytes are the planned ones.
void micro_batch_pairs(const Dataset& data, const std::vector<int64_t>& order, int64_t first,
                       int64_t B, std::vector<PairSpans>& pairs);
// A pair list reserved for a micro-batch of B rows of `data`.
std::vector<PairSpans> pair_list(const Dataset& data, int64_t B);

// The summed log-probabilities and completion tokens of one pair.
using PairLogps = PreferencePair;
// The pair's loss and metrics, and d loss / d pi_c and d loss / d pi_r.
struct PairResult {
  PreferenceSums sums;
  double d_chosen = 0, d_rejected = 0;
};
PairResult pair_result(const PreferenceLoss& loss, const PairLogps& p);

// The sum of logps over a span's positions that have a target, and their count.
void sum_span(const SequenceSpan& span, std::span<const double> logps,
              std::span<const int32_t> targets, double& sum, int64_t& count);

// Where each of a rank's B * Tl tokens [B*Tl] sits in a micro-batch's full rows [B*T]: under
// context parallelism (cp, this rank cp_rank of its group) the layout's split of each row, else
// the identity.
std::vector<int64_t> rank_row_positions(const ContextParallel* cp, int64_t cp_rank, int64_t B,
                                        int64_t T, int64_t Tl);
// targets [B*T]: the micro-batch fill_batch loaded last, its full-row targets at the positions
// this rank holds (`positions`, rank_row_positions'), kIgnoreIndex elsewhere, so that a pair's
// sums over its spans count this rank's tokens. Read from fill_batch's host rows: the staging's
// (targets second) or, under cp, the full rows it sharded.
void rank_row_targets(ContextParallel* cp, InputStaging& staging, int64_t B, int64_t T,
                      std::span<const int64_t> positions, std::span<int32_t> targets);

// The step runner of a preference objective (one rank; preference_runner.cpp): per
// micro-batch, the reference's sums (dpo: the adapters-off forward), then the policy's forward,
// the pairs' coefficients scaled by 1 / (the step's pairs), and the weighted backward, the
// pairs' arithmetic on the device (the backend's segment_logp_sums, preference_coefficients and
// gather_segment_weights): the host sends each token's sequence id up and reads the step's
// metrics once, at its end. Under context parallelism (parts.cp and parts.cp_group) the rank
// holds B rows of Tl tokens: each sequence's sum and count over its own tokens are summed over
// the cp group on the device before the coefficients. With `pipe` (pp > 1;
// stage_output_elems: one micro-batch's hidden state between stages), DPO's reference is a
// forward-only sweep of the step's micro-batches through the stages first, then 1F1B, each
// micro-batch's weighted backward starting on the last stage. With `reference` (full
// fine-tuning dpo; it outlives the runner) DPO uploads each pair's precomputed reference sums
// instead of running the adapters-off forward. Its device buffers and pinned upload slots
// (plan/preference_step.h) are charged to `ledger`.
struct ReferenceTable;
std::unique_ptr<StepRunner> make_preference_runner(const StepParts& parts, MemoryLedger& ledger,
                                                   const PreferenceLoss& loss,
                                                   PipelineExecutor* pipe = nullptr,
                                                   int64_t stage_output_elems = 0,
                                                   const ReferenceTable* reference = nullptr);

}  // namespace shardlm::trainer_detail
