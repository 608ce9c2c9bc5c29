// Topology: validation of the dp x pp x cp x tp grid against the world size and the
// rank <-> coordinates arithmetic (tp fastest, then cp, dp, pp; see topology.h for why).
// No communicators and no state beyond the grid: two Topologies can live in one process.
#include "shardlm/parallel/topology.h"

#include <fmt/format.h>

#include <string>

#include "shardlm/core/check.h"

namespace shardlm {
namespace {

// Slowest-varying first: the order of the mixed-radix digits of a rank.
constexpr std::array<Axis, 4> kMajorToMinor = {Axis::kPp, Axis::kDp, Axis::kCp, Axis::kTp};

int64_t dim_of(const ParallelDims& dims, Axis axis) {
  switch (axis) {
    case Axis::kDp:
      return dims.dp;
    case Axis::kPp:
      return dims.pp;
    case Axis::kCp:
      return dims.cp;
    case Axis::kTp:
      break;
  }
  return dims.tp;
}

// The size's name in the config ("parallel.tp"); dp has no key, it is derived.
std::string size_name(Axis axis) {
  if (axis == Axis::kDp) return "the data-parallel size";
  return fmt::format("parallel.{}", axis_name(axis));
}

// "parallel.tp (2) x parallel.cp (2) x parallel.pp (1) = 4", with dp first when it is given;
// `product` is -1 when it overflows int64.
std::string product_text(const ParallelDims& d, bool with_dp, int64_t product) {
  std::string out;
  if (with_dp) out = fmt::format("the data-parallel size ({}) x ", d.dp);
  out += fmt::format("parallel.tp ({}) x parallel.cp ({}) x parallel.pp ({}) = ", d.tp, d.cp, d.pp);
  out += product < 0 ? std::string("more than 2^63") : std::to_string(product);
  return out;
}

// a * b, or -1 when it overflows (both are >= 1).
int64_t times(int64_t a, int64_t b) {
  int64_t out = 0;
  if (a < 0 || b < 0 || __builtin_mul_overflow(a, b, &out)) return -1;
  return out;
}

}  // namespace

std::string_view axis_name(Axis axis) {
  switch (axis) {
    case Axis::kDp:
      return "dp";
    case Axis::kPp:
      return "pp";
    case Axis::kCp:
      return "cp";
    case Axis::kTp:
      break;
  }
  return "tp";
}

const int64_t& RankCoords::operator[](Axis axis) const {
  switch (axis) {
    case Axis::kDp:
      return dp;
    case Axis::kPp:
      return pp;
    case Axis::kCp:
      return cp;
    case Axis::kTp:
      break;
  }
  return tp;
}

int64_t& RankCoords::operator[](Axis axis) {
  return const_cast<int64_t&>(static_cast<const RankCoords&>(*this)[axis]);
}

Topology::Topology(ParallelDims dims, int64_t world_size, int64_t rank)
    : dims_(dims), world_size_(world_size), rank_(rank) {
  if (world_size < 1)
    SHARDLM_FAIL(ErrorKind::kConfig, "the world size must be >= 1 process, got {}", world_size);
  for (Axis axis : {Axis::kTp, Axis::kCp, Axis::kPp})
    if (dim_of(dims_, axis) < 1)
      SHARDLM_FAIL(ErrorKind::kConfig, "{} must be >= 1, got {}", size_name(axis),
                   dim_of(dims_, axis));
  if (dims_.dp < 1 && dims_.dp != -1)
    SHARDLM_FAIL(ErrorKind::kConfig,
                 "the data-parallel size must be >= 1, or -1 to derive it from the world size; "
                 "got {}",
                 dims_.dp);

  const int64_t model_ranks = times(times(dims_.tp, dims_.cp), dims_.pp);  // one replica
  if (dims_.dp == -1) {
    if (model_ranks < 0 || world_size % model_ranks != 0)
      SHARDLM_FAIL(ErrorKind::kConfig,
                   "{} does not divide the world size {}; launch a multiple of {} processes, "
                   "or choose parallel.tp, parallel.cp and parallel.pp whose product divides {}",
                   product_text(dims_, false, model_ranks), world_size,
                   model_ranks < 0 ? std::string("that many") : std::to_string(model_ranks),
                   world_size);
    dims_.dp = world_size / model_ranks;
  } else if (const int64_t total = times(dims_.dp, model_ranks); total != world_size) {
    if (model_ranks > 0 && world_size % model_ranks == 0)
      SHARDLM_FAIL(ErrorKind::kConfig,
                   "{} does not equal the world size {}; set the data-parallel size to {} (or -1 "
                   "to derive it), or launch {} processes",
                   product_text(dims_, true, total), world_size, world_size / model_ranks,
                   total < 0 ? std::string("that many") : std::to_string(total));
    SHARDLM_FAIL(ErrorKind::kConfig,
                 "{} does not equal the world size {}; launch {} processes, or choose "
                 "parallel.tp, parallel.cp and parallel.pp whose product divides {}",
                 product_text(dims_, true, total), world_size,
                 total < 0 ? std::string("that many") : std::to_string(total), world_size);
  }
  check_rank(rank, "this process's rank");
  coords_ = coords_of(rank);
}

void Topology::check_rank(int64_t rank, std::string_view what) const {
  if (rank < 0 || rank >= world_size_)
    SHARDLM_FAIL(ErrorKind::kConfig, "{} {} is outside the world of {} processes (0..{})", what,
                 rank, world_size_, world_size_ - 1);
}

int64_t Topology::size(Axis axis) const { return dim_of(dims_, axis); }

int64_t Topology::stride(Axis axis) const {
  int64_t s = 1;
  for (auto it = kMajorToMinor.rbegin(); *it != axis; ++it) s *= size(*it);
  return s;
}

RankCoords Topology::coords_of(int64_t rank) const {
  check_rank(rank, "rank");
  RankCoords c;
  for (auto it = kMajorToMinor.rbegin(); it != kMajorToMinor.rend(); ++it) {
    c[*it] = rank % size(*it);
    rank /= size(*it);
  }
  return c;
}

int64_t Topology::rank_of(const RankCoords& coords) const {
  int64_t rank = 0;
  for (Axis axis : kMajorToMinor) {
    SHARDLM_CHECK(coords[axis] >= 0 && coords[axis] < size(axis),
                  "coordinate {} on axis {} is outside [0, {})", coords[axis], axis_name(axis),
                  size(axis));
    rank = rank * size(axis) + coords[axis];
  }
  return rank;
}

std::vector<int64_t> Topology::group_ranks(Axis axis, int64_t rank) const {
  RankCoords c = coords_of(rank);
  std::vector<int64_t> ranks(static_cast<size_t>(size(axis)));
  for (int64_t i = 0; i < size(axis); ++i) {
    c[axis] = i;
    ranks[static_cast<size_t>(i)] = rank_of(c);
  }
  return ranks;
}

int64_t Topology::color_of(Axis axis, int64_t rank) const {
  check_rank(rank, "rank");
  // Drop the axis's digit from the rank: the ranks above it, renumbered densely.
  const int64_t below = stride(axis);
  return rank / (below * size(axis)) * below + rank % below;
}

}  // namespace shardlm
