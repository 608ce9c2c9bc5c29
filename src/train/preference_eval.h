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

// The pass's host rows for micro-batches of B rows of T tokens, Tl of them on this rank: the
// run sizes them once at setup and holds them (plan.h's preference_host_bytes counts them).
struct PreferenceEvalRows {
  PreferenceEvalRows(int64_t B, int64_t T, int64_t Tl)
      : local(size_t(B * Tl)),
        row(size_t(B * T)),
        targets(size_t(B * T)),
        row_index(size_t(B * Tl)) {}
  std::vector<double> local;       // [B*Tl] this rank's tokens' logps
  std::vector<double> row;         // [B*T] the same at their row positions
  std::vector<int32_t> targets;    // [B*T] this rank's targets at their row positions
  std::vector<int64_t> row_index;  // [B*Tl] a local token's row position
  int64_t host_bytes() const {
    return int64_t((local.capacity() + row.capacity()) * sizeof(double) +
                   targets.capacity() * sizeof(int32_t) + row_index.capacity() * sizeof(int64_t));
  }
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
};
PreferenceEval evaluate_preference(const PreferenceEvalPass& pass);

}  // namespace shardlm::trainer_detail
