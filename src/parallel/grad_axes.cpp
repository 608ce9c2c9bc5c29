// GradientAxes (parallel/grad_axes.h): the ranges each axis declares, intersected with the
// slices a rank owns.
#include "shardlm/parallel/grad_axes.h"

#include <algorithm>
#include <vector>

#include "shardlm/model/tensor_shard.h"

namespace shardlm {

namespace {

// Calls f(slice, lo, hi) for each non-empty intersection [lo, hi) of a slice with a range.
template <class F>
void for_each_overlap(std::span<const GradSlice> slices,
                      const std::vector<std::pair<int64_t, int64_t>>& ranges, F&& f) {
  for (const GradSlice& s : slices)
    for (auto [b, e] : ranges) {
      const int64_t lo = std::max(b, s.flat), hi = std::min(e, s.flat + s.grads.numel());
      if (lo < hi) f(s, lo, hi);
    }
}

Tensor slice_rows(const GradSlice& s, int64_t lo, int64_t hi) {
  return s.grads.rows(lo - s.flat, hi - lo);
}

}  // namespace

GradientAxes::GradientAxes(const ParallelGrid& grid, const ModelConfig& shard,
                           const LoraConfig& lora)
    : grid_(grid) {
  if (lora.enabled()) {
    // The adapters are neither tied nor replicated across stages: each stage trains its own.
    if (!grid.has(Axis::kTp)) return;
    // The adapters every tp rank holds whole (a column-parallel projection's A, a row-parallel
    // one's B) meet a split base: each rank's gradient is its heads' or columns' part of it.
    replicated_ = tp_replicated_ranges(make_lora_layout(shard, lora).params);
    partial_ = replicated_;
    return;
  }
  const ParamLayout layout = make_param_layout(shard);
  if (grid.has(Axis::kTp)) {
    replicated_ = tp_replicated_ranges(layout);
    partial_ = tp_partial_ranges(layout, shard.seq_shards() > 1);
  }
  if (grid.tied() != nullptr && shard.holds_embedding_matrix()) {
    SHARDLM_CHECK(layout.lm_head_unit == 0 && layout.unit_size(0) > 0,
                  "tied embeddings across stages: unit 0 must be the tied matrix");
    tied_ = {{layout.units[0].begin, layout.units[0].end}};
    tied_in_norm_ = grid.coord(Axis::kPp) == 0;  // the first stage counts it, the last not
  }
}

void GradientAxes::sum_shared(std::span<const GradSlice> slices) const {
  if (Communicator* tied = grid_.tied(); tied != nullptr && tied->size() > 1)
    for_each_overlap(slices, tied_, [&](const GradSlice& s, int64_t lo, int64_t hi) {
      tied->all_reduce(slice_rows(s, lo, hi), ReduceOp::kSum);
    });
  if (!partial_.empty()) {
    Communicator& tp = grid_.group(Axis::kTp);
    for_each_overlap(slices, partial_, [&](const GradSlice& s, int64_t lo, int64_t hi) {
      tp.all_reduce(slice_rows(s, lo, hi), ReduceOp::kSum);
    });
  }
}

GradNormParts GradientAxes::local_parts(std::span<const GradSlice> slices, Backend& backend) const {
  // The stretches in order, each split or replicated, summed by one backend call (one wait for
  // the results on a GPU), then added in that order.
  std::vector<Tensor> stretches;
  std::vector<bool> replicated;
  auto add = [&](const GradSlice& s, int64_t lo, int64_t hi, bool is_replicated) {
    stretches.push_back(slice_rows(s, lo, hi));
    replicated.push_back(is_replicated);
  };
  for (const GradSlice& s : slices) {
    const int64_t end = s.flat + s.grads.numel();
    // The tied matrix's elements (unit 0, from 0) are the other stage's to count.
    const int64_t begin =
        !tied_in_norm_ && !tied_.empty() ? std::max(s.flat, tied_[0].second) : s.flat;
    if (begin >= end) continue;
    int64_t at = begin;  // the split stretches between the replicated ranges
    for (auto [b, e] : replicated_) {
      const int64_t lo = std::max(b, begin), hi = std::min(e, end);
      if (lo >= hi) continue;
      if (at < lo) add(s, at, lo, false);
      add(s, lo, hi, true);
      at = hi;
    }
    if (at < end) add(s, at, end, false);
  }
  std::vector<double> sums(stretches.size());
  backend.sum_squares_segments(stretches, sums);
  GradNormParts parts;
  for (size_t i = 0; i < sums.size(); ++i)
    (replicated[i] ? parts.replicated : parts.split) += sums[i];
  return parts;
}

}  // namespace shardlm
