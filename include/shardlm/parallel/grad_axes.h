// GradientAxes: what the grid's axes other than ZeRO's do to one rank's gradients before the
// optimizer, as the model's layout declares it (model/tensor_shard). ZeroEngine only shards:
// once its group's reductions are done it hands over the slices of the arena it owns, and this
// sums what other axes share and decides what counts how in the gradient norm:
//   - tied embeddings across pipeline stages (Megatron's way): the first and last stage each
//     hold the embedding matrix (unit 0); its gradients are summed over the two (the grid's
//     tied group) so both copies take the same update, and the first stage counts it;
//   - tensor parallelism: the tensors every tp rank holds whole (tp_replicated_ranges) count
//     once, the split ones on every tp rank (ParallelGrid::grad_norm_sq);
//   - the q/k norms' weights (each tp rank's heads) and, under sequence parallelism, the norms'
//     weights, whose gradients each tp rank holds a part of (tp_partial_ranges), are summed
//     over the tp group first;
//   - LoRA under tensor parallelism: the adapters every tp rank holds whole (a column-parallel
//     projection's A, a row-parallel one's B) take a partial gradient on each rank, summed
//     over the tp group first and then counted once.
#pragma once

#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include "shardlm/backend/backend.h"
#include "shardlm/model/config.h"
#include "shardlm/model/layout.h"
#include "shardlm/model/lora.h"
#include "shardlm/parallel/grid.h"

namespace shardlm {

// A stretch of one rank's reduced gradients: arena elements [flat, flat + grads.numel()).
struct GradSlice {
  int64_t flat = 0;
  Tensor grads;  // [count] f32
};

class GradientAxes {
 public:
  // shard: this rank's part of the model (tp shard, pipeline stage), whose layout the
  // gradients' arena is; with lora enabled, the arena is the shard's adapters' (no pp then).
  GradientAxes(const ParallelGrid& grid, const ModelConfig& shard, const LoraConfig& lora);

  // In place over the slices (collective over the tied group and the tp group: the ranks of
  // one grid coordinate own the same slices, so they issue the same reductions).
  void sum_shared(std::span<const GradSlice> slices) const;
  // This rank's squared-norm parts of the slices (after sum_shared): split and replicated
  // apart, the tied matrix only where this stage counts it.
  GradNormParts local_parts(std::span<const GradSlice> slices, Backend& backend) const;
  // The model's squared norm from ZeRO's group's summed parts: the grid adds the other axes.
  double norm_sq(GradNormParts parts) const { return grid_.grad_norm_sq(parts); }

 private:
  using Ranges = std::vector<std::pair<int64_t, int64_t>>;
  const ParallelGrid& grid_;
  Ranges replicated_;  // whole on every tp rank: counted once
  Ranges partial_;     // of those, each tp rank holds a part: summed over tp first
  Ranges tied_;        // the tied matrix ([0, unit 0's end)) when shared with another stage
  bool tied_in_norm_ = true;
};

}  // namespace shardlm
