// Private to src/train: evaluation under a preference objective (train.objective = "dpo" or
// "simpo"), as TRL's trainers evaluate: the objective itself over the held-out pairs, not the
// completions' token cross-entropy. Each held-out pair's policy sums (and DPO's reference sums:
// the adapters-off forward with LoRA, the held-out set's table of the initial weights with full
// fine-tuning) give its loss and TRL's metrics through pair_result (preference.h), exactly as a
// training step computes them, without a backward.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <vector>

#include "preference.h"
#include "preference_reference.h"

namespace shardlm::trainer_detail {

// This rank's share of a held-out pass: the metric sums of the pairs it owns, and their count.
struct PreferenceEval {
  PreferenceSums sums;
  int64_t pairs = 0;
};

// The pass: the held-out set's micro-batches (parts.data; at most max_batches of them, 0: all)
// in window order, dealt round-robin over the dp_size replicas; every replica runs the same
// number of forwards (one without a batch of its own repeats the first and drops it), since at
// ZeRO stage 3 each gathers parameters collectively. Under context parallelism each pair's sums
// are summed over the cp group (every cp rank then holds them); under tp every tp rank holds
// them; under pipeline stages (pipe) the last stage does, DPO's reference from a forward-only
// sweep of its own first. The caller counts each pair once (the replica's first tp and cp rank
// of its last stage) and sums over the world.
struct PreferenceEvalPass {
  const StepParts& parts;  // data: the held-out set; micro_batches and seed unused
  const PreferenceLoss& loss;
  PipelineExecutor* pipe = nullptr;  // pp > 1
  int64_t stage_output_elems = 0;    // one micro-batch's hidden state between stages
  // Full fine-tuning DPO: the held-out set's reference sums (of the initial weights).
  const ReferenceTable* reference = nullptr;
  int64_t max_batches = 0;
  int64_t dp_rank = 0, dp_size = 1;
  std::function<void(int64_t, int64_t)> progress;  // (done, total) micro-batches; may be null
  PreferenceEvalRows* rows = nullptr;  // the run's, sized for parts' B, T, Tl; null: its own
  // The held-out windows in order (0, 1, ...): the run's held buffer, which the ledger counts.
  const std::vector<int64_t>* order = nullptr;
};
PreferenceEval evaluate_preference(const PreferenceEvalPass& pass);

}  // namespace shardlm::trainer_detail
