// ParallelGrid: the run's groups, split from the world in one place, and its f64/i64 scalar
// reductions.
#include "shardlm/parallel/grid.h"

#include <vector>

#include "shardlm/core/check.h"

namespace shardlm {

ParallelGrid::ParallelGrid(const Topology& topology, Communicator& world, const GridGroups& groups)
    : topology_(topology), world_(world) {
  SHARDLM_CHECK(topology.world_size() == world.size() && topology.rank() == world.rank(),
                "ParallelGrid: the topology is for rank {} of {}, the world is rank {} of {}",
                topology.rank(), topology.world_size(), world.rank(), world.size());
  const auto split_axis = [&](Axis axis) {
    return world.split(int(topology.color(axis)), int(topology.key(axis)), axis_name(axis));
  };
  const int64_t tp = size(Axis::kTp), pp = size(Axis::kPp);
  if (tp > 1) tp_ = split_axis(Axis::kTp);
  if (pp > 1) {
    pp_ = split_axis(Axis::kPp);
    connect_neighbours(*pp_, /*ring=*/false);  // activations and gradients to the next stages
    if (groups.tied_embeddings) {
      // The first and last stages' ranks at the same (dp, cp, tp) place share the matrix; a
      // middle stage's rank gets a color of its own.
      const int per_stage = int(world.size() / pp), place = world.rank() % per_stage;
      const int64_t stage = coord(Axis::kPp);
      const bool ends = stage == 0 || stage == pp - 1;
      tied_ = world.split(ends ? place : per_stage + world.rank(), int(stage), "tied");
    }
  }
  if (tp > 1 || pp > 1) {
    // Ranked by world rank: the order ZeRO's shards (and so its checkpoints) follow.
    zero_ = world.split(int(coord(Axis::kPp) * tp + coord(Axis::kTp)), world.rank(), "zero");
  }
  if (size(Axis::kCp) > 1) {
    cp_ = split_axis(Axis::kCp);
    if (groups.cp_ulysses > 0) context_ = std::make_unique<ContextGroups>(*cp_, groups.cp_ulysses);
  }
  if (groups.base_group)
    base_ = zero().split(0, zero().rank(), "lora_base");  // ZeRO's ranks, in order
}

const ContextGroups& ParallelGrid::context() const {
  SHARDLM_CHECK(context_ != nullptr,
                "ParallelGrid: no context-parallel groups (cp = {}; made with cp_ulysses)",
                size(Axis::kCp));
  return *context_;
}

int64_t ParallelGrid::transport_device_bytes() const {
  return sum_over_groups(&Communicator::transport_device_bytes);
}

int64_t ParallelGrid::comm_host_waits() const { return sum_over_groups(&Communicator::host_waits); }

int64_t ParallelGrid::sum_over_groups(int64_t (Communicator::*count)() const) const {
  int64_t total = (world_.*count)();
  for (const auto* group : {&cp_, &tp_, &pp_, &zero_, &tied_, &base_})
    if (*group) total += ((**group).*count)();
  if (context_) total += context_->sum_over_owned(count);
  return total;
}

Communicator& ParallelGrid::base_shards() const {
  SHARDLM_CHECK(base_ != nullptr, "ParallelGrid: no base_shards group (made with base_group)");
  return *base_;
}

bool ParallelGrid::has(Axis axis) const {
  switch (axis) {
    case Axis::kCp:
      return cp_ != nullptr;
    case Axis::kTp:
      return tp_ != nullptr;
    case Axis::kPp:
      return pp_ != nullptr;
    case Axis::kDp:
      return false;
  }
  return false;
}

Communicator& ParallelGrid::group(Axis axis) const {
  SHARDLM_CHECK(has(axis), "ParallelGrid: no {} group ({} = {}{})", axis_name(axis),
                axis_name(axis), size(axis),
                axis == Axis::kDp ? "; data-parallel ranks reduce through zero()" : "");
  return axis == Axis::kCp ? *cp_ : axis == Axis::kTp ? *tp_ : *pp_;
}

void ParallelGrid::sum(std::span<double> values) const {
  world_.all_reduce(Tensor(values.data(), DType::kF64, {int64_t(values.size())}, MemPool::kHost));
}

void ParallelGrid::sum(std::span<int64_t> values) const {
  world_.all_reduce(Tensor(values.data(), DType::kI64, {int64_t(values.size())}, MemPool::kHost));
}

bool ParallelGrid::any(bool flag) const {
  int64_t word = flag ? 1 : 0;
  world_.all_reduce(Tensor(&word, DType::kI64, {1}, MemPool::kHost), ReduceOp::kMax);
  return word != 0;
}

double ParallelGrid::grad_norm_sq(GradNormParts parts) const {
  if (has(Axis::kTp)) ordered_sum(*tp_, std::span<double>(&parts.split, 1));
  double sq = parts.split + parts.replicated;
  if (has(Axis::kPp)) ordered_sum(*pp_, std::span<double>(&sq, 1));
  return sq;
}

StepTotals ParallelGrid::step_totals(double loss_sum, double pairs) const {
  const double tp = double(size(Axis::kTp));
  double totals[2] = {loss_sum / tp,
                      pairs / double(size(Axis::kCp) * size(Axis::kTp) * size(Axis::kPp))};
  sum(totals);
  return {totals[0], totals[1]};
}

}  // namespace shardlm
