// Topology: the dp x pp x cp x tp grid of ranks, validated against the world size, and the
// mapping between a rank and its coordinates on each axis. Pure arithmetic: it knows no
// communicator and holds no global state; Communicator::split(color(axis), key(axis)) turns
// an axis into a sub-communicator.
#pragma once

#include <array>
#include <cstdint>
#include <string_view>
#include <vector>

namespace shardlm {

// The axes of the rank grid ("axis" for the device grid, "dim" for tensor dimensions).
enum class Axis { kDp, kPp, kCp, kTp };
inline constexpr std::array<Axis, 4> kAxes = {Axis::kDp, Axis::kPp, Axis::kCp, Axis::kTp};

// "dp", "pp", "cp", "tp".
std::string_view axis_name(Axis axis);

// Sizes of the grid's axes. dp = -1 means "derive it": world_size / (pp * cp * tp).
struct ParallelDims {
  int64_t dp = -1;  // data parallel (replicas; ZeRO shards over it)
  int64_t pp = 1;   // pipeline stages (parallel.pp)
  int64_t cp = 1;   // context parallel: the sequence split (parallel.cp)
  int64_t tp = 1;   // tensor parallel: each layer's matrices split (parallel.tp)
};

// One rank's position on the grid: each coordinate in [0, size(axis)).
struct RankCoords {
  int64_t dp = 0, pp = 0, cp = 0, tp = 0;
  int64_t& operator[](Axis axis);
  const int64_t& operator[](Axis axis) const;
  bool operator==(const RankCoords&) const = default;
};

// Ranks are laid out with tp varying fastest, then cp, then dp, then pp (slowest):
//
//   rank = ((pp * dp_size + dp) * cp_size + cp) * tp_size + tp
//
// so consecutive ranks, which launchers place on the same node, form the tp groups first.
// The order follows each axis's traffic: tp all-reduces activations in every layer, forward
// and backward, and needs the fastest links (NVLink, inside a node); cp exchanges keys and
// values (all-to-all or a ring) once per attention layer; dp reduces gradients once per step,
// overlapped with the backward; pp sends only boundary activations point to point and can
// cross the slowest links. Megatron-Core uses the same tp-cp-dp-pp order.
class Topology {
 public:
  // Throws Error(kConfig) when the sizes do not multiply to world_size (the message names the
  // product and what to change), when a size is < 1 (dp may be -1), or rank is out of range.
  Topology(ParallelDims dims, int64_t world_size, int64_t rank);

  int64_t world_size() const { return world_size_; }
  int64_t rank() const { return rank_; }
  // The resolved sizes (dp derived when it was -1).
  const ParallelDims& dims() const { return dims_; }

  int64_t size(Axis axis) const;
  // This rank's coordinate on `axis`, in [0, size(axis)).
  int64_t coord(Axis axis) const { return coords_[axis]; }
  const RankCoords& coords() const { return coords_; }

  RankCoords coords_of(int64_t rank) const;
  int64_t rank_of(const RankCoords& coords) const;
  // Distance between ranks that differ by one on `axis` (tp: 1, cp: tp, dp: cp*tp, ...).
  int64_t stride(Axis axis) const;

  // The ranks that share every coordinate with `rank` except `axis`, ordered by their
  // coordinate on `axis` (so group[i] has coordinate i): size(axis) ranks.
  std::vector<int64_t> group_ranks(Axis axis, int64_t rank) const;
  std::vector<int64_t> group_ranks(Axis axis) const { return group_ranks(axis, rank_); }

  // For Communicator::split: every member of this rank's `axis` group passes the same color,
  // a dense index in [0, world_size / size(axis)) that differs between groups, and its
  // coordinate on the axis as the key, so that the sub-communicator's rank is coord(axis).
  int64_t color(Axis axis) const { return color_of(axis, rank_); }
  int64_t key(Axis axis) const { return coord(axis); }
  int64_t color_of(Axis axis, int64_t rank) const;

 private:
  void check_rank(int64_t rank, std::string_view what) const;

  ParallelDims dims_;
  int64_t world_size_ = 1;
  int64_t rank_ = 0;
  RankCoords coords_;
};

}  // namespace shardlm
