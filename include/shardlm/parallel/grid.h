// ParallelGrid: every communicator group of a run's dp x pp x cp x tp grid, built once from
// its Topology and the world communicator and owned here by name, and the grid-wide
// reductions of a step's scalars in f64 and i64. Nothing else splits the world: a strategy asks
// the grid for its group (torchtitan's ParallelDims/build_mesh: named groups made in one place).
#pragma once

#include <cstdint>
#include <memory>
#include <span>

#include "shardlm/comm/communicator.h"
#include "shardlm/parallel/context_groups.h"
#include "shardlm/parallel/topology.h"

namespace shardlm {

// A step's loss and what it was averaged over, summed over the grid once.
struct StepTotals {
  double loss_sum = 0;  // the sum of the per-target losses of the step's rows
  double pairs = 0;     // attended (query, key) pairs of those rows (MFU's attention FLOPs)
};

// A squared gradient norm's parts, summed over ZeRO's group (each rank's shard of them):
// `split`, the parameters the tp group splits (each tp rank holds other values), and
// `replicated`, those every tp rank holds whole (tp_replicated_ranges): counted once.
struct GradNormParts {
  double split = 0;
  double replicated = 0;
};

// The groups a run needs beyond the axes'.
struct GridGroups {
  // The model's head shares the embedding matrix: under pp > 1 the first and last stages both
  // hold it and form the tied group.
  bool tied_embeddings = false;
  // Make base_shards().
  bool base_group = false;
  // cp > 1: the context layout's Ulysses degree U, whose sub-groups (context()) are made too;
  // 0 makes none.
  int64_t cp_ulysses = 0;
};

class ParallelGrid {
 public:
  // Collective over `world`: every rank builds its grid at the same point, with the same
  // topology sizes and groups.
  ParallelGrid(const Topology& topology, Communicator& world, const GridGroups& groups = {});
  ParallelGrid(const ParallelGrid&) = delete;
  ParallelGrid& operator=(const ParallelGrid&) = delete;

  const Topology& topology() const { return topology_; }
  int64_t size(Axis axis) const { return topology_.size(axis); }
  int64_t coord(Axis axis) const { return topology_.coord(axis); }

  // Every rank of the run.
  Communicator& world() const { return world_; }
  // This rank's group along `axis` (its size(axis) ranks, ranked by coord(axis)); only for an
  // axis with more than one rank (has(axis)), and never for dp (replicas share nothing but
  // ZeRO's group).
  bool has(Axis axis) const;
  Communicator& group(Axis axis) const;
  // ZeRO's group: the ranks that hold the same pipeline stage's same tp shard (dp x cp);
  // the world itself when tp = pp = 1.
  Communicator& zero() const { return zero_ ? *zero_ : world_; }
  // ZeRO's ranks again, in a communicator of their own (only with base_group): a frozen LoRA
  // base sharded by ZeRO-3 is gathered on it from the compute thread while ZeRO's worker runs
  // the adapters' collectives on zero(), whose order no other thread may interleave with
  // (parallel/zero/comm_worker.h).
  Communicator& base_shards() const;
  // pp > 1 with tied embeddings: this rank and its counterpart on the other end stage (the
  // first and last stages hold the matrix; a middle stage's rank is alone). Else null.
  Communicator* tied() const { return tied_.get(); }
  // cp > 1 with groups.cp_ulysses: the cp group and its Ulysses and ring sub-groups.
  const ContextGroups& context() const;

  // Device memory the transports of the world and of every group made here hold
  // (Communicator::transport_device_bytes): what a run's ledger and plan count for them.
  int64_t transport_device_bytes() const;
  // The trainer thread's host waits for the device's collectives on the world and every group
  // made here (Communicator::host_waits): 0 on host transports.
  int64_t comm_host_waits() const;

  // In place, over every rank: element-wise sums in f64 / i64 (exact for counts, and for
  // loss sums far beyond f32's 2^24).
  void sum(std::span<double> values) const;
  void sum(std::span<int64_t> values) const;
  // True on every rank when it is true on any (a stop request that reached the ranks at
  // different instants).
  bool any(bool flag) const;

  // The model's squared gradient norm from this rank's parts: the split part summed over the tp
  // group, the replicated one counted once, then the stages' sums added (each stage holds
  // other parameters), so every rank clips by the single-rank model's norm. Sums run in group
  // rank order over all-gathered values: every rank gets the same bits. Collective over the tp
  // and pp groups.
  double grad_norm_sq(GradNormParts parts) const;

  // The step's totals from this rank's share: every tp rank of a slice computed the same loss
  // (counted once), every cp, tp and pp rank counted its rows' pairs (counted once per
  // replica), and under pp only the last stage holds a loss (the others pass 0).
  StepTotals step_totals(double loss_sum, double pairs) const;

 private:
  // A communicator's count summed over the world and every group made here.
  int64_t sum_over_groups(int64_t (Communicator::*count)() const) const;

  Topology topology_;
  Communicator& world_;
  std::unique_ptr<Communicator> cp_, tp_, pp_, zero_, tied_, base_;
  std::unique_ptr<ContextGroups> context_;
};

}  // namespace shardlm
