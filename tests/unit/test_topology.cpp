// Tests of Topology (src/parallel/topology.cpp): rank <-> coordinates round trips on every
// grid up to 48 ranks, the documented layout (tp fastest, pp slowest), group membership and
// split colors against a brute-force reference, and the validation messages.
#include "shardlm/parallel/topology.h"

#include <gtest/gtest.h>

#include <functional>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "shardlm/core/check.h"

#include "test_util.h"

namespace shardlm {
namespace {

// Every (tp, cp, pp) whose product divides world, for world = 1..max_world.
std::vector<std::pair<ParallelDims, int64_t>> all_grids(int64_t max_world) {
  std::vector<std::pair<ParallelDims, int64_t>> out;
  for (int64_t world = 1; world <= max_world; ++world)
    for (int64_t tp = 1; tp <= world; ++tp)
      for (int64_t cp = 1; tp * cp <= world; ++cp)
        for (int64_t pp = 1; tp * cp * pp <= world; ++pp)
          if (world % (tp * cp * pp) == 0) out.push_back({ParallelDims{-1, pp, cp, tp}, world});
  return out;
}

std::string describe(const ParallelDims& d, int64_t world) {
  return "world " + std::to_string(world) + " dp " + std::to_string(d.dp) + " pp " +
         std::to_string(d.pp) + " cp " + std::to_string(d.cp) + " tp " + std::to_string(d.tp);
}

TEST(Topology, DerivesDataParallelSize) {
  const Topology t(ParallelDims{-1, 2, 2, 2}, 16, 0);
  EXPECT_EQ(t.size(Axis::kDp), 2);
  EXPECT_EQ(t.dims().dp, 2);
  EXPECT_EQ(Topology(ParallelDims{}, 7, 3).size(Axis::kDp), 7);
  EXPECT_EQ(Topology(ParallelDims{1, 1, 1, 1}, 1, 0).size(Axis::kDp), 1);
}

TEST(Topology, LayoutIsTpFastestThenCpDpPp) {
  // dp 2, pp 2, cp 3, tp 2: rank = ((pp * 2 + dp) * 3 + cp) * 2 + tp.
  const Topology t(ParallelDims{2, 2, 3, 2}, 24, 0);
  EXPECT_EQ(t.stride(Axis::kTp), 1);
  EXPECT_EQ(t.stride(Axis::kCp), 2);
  EXPECT_EQ(t.stride(Axis::kDp), 6);
  EXPECT_EQ(t.stride(Axis::kPp), 12);
  EXPECT_EQ(t.coords_of(1), (RankCoords{.dp = 0, .pp = 0, .cp = 0, .tp = 1}));
  EXPECT_EQ(t.coords_of(2), (RankCoords{.dp = 0, .pp = 0, .cp = 1, .tp = 0}));
  EXPECT_EQ(t.coords_of(6), (RankCoords{.dp = 1, .pp = 0, .cp = 0, .tp = 0}));
  EXPECT_EQ(t.coords_of(12), (RankCoords{.dp = 0, .pp = 1, .cp = 0, .tp = 0}));
  EXPECT_EQ(t.coords_of(23), (RankCoords{.dp = 1, .pp = 1, .cp = 2, .tp = 1}));
  EXPECT_EQ(t.rank_of(RankCoords{.dp = 1, .pp = 0, .cp = 2, .tp = 1}), 6 + 4 + 1);
  // The tp group of a rank is consecutive ranks; the pp group strides over half the world.
  EXPECT_EQ(Topology(ParallelDims{2, 2, 3, 2}, 24, 9).group_ranks(Axis::kTp),
            (std::vector<int64_t>{8, 9}));
  EXPECT_EQ(Topology(ParallelDims{2, 2, 3, 2}, 24, 9).group_ranks(Axis::kCp),
            (std::vector<int64_t>{7, 9, 11}));
  EXPECT_EQ(Topology(ParallelDims{2, 2, 3, 2}, 24, 9).group_ranks(Axis::kDp),
            (std::vector<int64_t>{3, 9}));
  EXPECT_EQ(Topology(ParallelDims{2, 2, 3, 2}, 24, 9).group_ranks(Axis::kPp),
            (std::vector<int64_t>{9, 21}));
}

TEST(Topology, RoundTripsEveryRankOfEveryGrid) {
  const auto grids = all_grids(48);
  ASSERT_GT(grids.size(), 500u);
  for (const auto& [dims, world] : grids) {
    const Topology t(dims, world, 0);
    std::set<std::vector<int64_t>> seen;
    for (int64_t r = 0; r < world; ++r) {
      const RankCoords c = t.coords_of(r);
      for (Axis a : kAxes) {
        ASSERT_GE(c[a], 0) << describe(dims, world);
        ASSERT_LT(c[a], t.size(a)) << describe(dims, world);
      }
      ASSERT_EQ(t.rank_of(c), r) << describe(dims, world);
      seen.insert({c.dp, c.pp, c.cp, c.tp});
      // The Topology built on that rank agrees with coords_of.
      const Topology on_rank(dims, world, r);
      ASSERT_EQ(on_rank.coords(), c);
      for (Axis a : kAxes) ASSERT_EQ(on_rank.coord(a), c[a]);
    }
    EXPECT_EQ(static_cast<int64_t>(seen.size()), world) << describe(dims, world);
  }
}

// A reference built without the class's arithmetic: two ranks share an axis group iff all
// their other coordinates are equal.
TEST(Topology, GroupsPartitionTheWorldAndMatchSplitColors) {
  for (const auto& [dims, world] : all_grids(36)) {
    const Topology t(dims, world, 0);
    for (Axis axis : kAxes) {
      std::map<int64_t, std::vector<int64_t>> by_color;  // color -> ranks in key order
      for (int64_t r = 0; r < world; ++r) {
        const Topology me(dims, world, r);
        const std::vector<int64_t> group = me.group_ranks(axis);
        ASSERT_EQ(static_cast<int64_t>(group.size()), t.size(axis)) << describe(dims, world);
        ASSERT_EQ(group, t.group_ranks(axis, r));
        ASSERT_EQ(group[static_cast<size_t>(me.key(axis))], r);
        for (size_t i = 0; i < group.size(); ++i) {
          const RankCoords other = t.coords_of(group[i]);
          for (Axis a : kAxes)
            if (a == axis)
              ASSERT_EQ(other[a], static_cast<int64_t>(i));
            else
              ASSERT_EQ(other[a], me.coord(a)) << describe(dims, world);
          // Every member of a group passes the same color.
          ASSERT_EQ(t.color_of(axis, group[i]), me.color(axis)) << describe(dims, world);
        }
        by_color[me.color(axis)].push_back(r);
      }
      // Colors are dense in [0, world / size), each naming exactly one group.
      ASSERT_EQ(static_cast<int64_t>(by_color.size()), world / t.size(axis));
      EXPECT_EQ(by_color.begin()->first, 0);
      EXPECT_EQ(by_color.rbegin()->first, world / t.size(axis) - 1);
      std::vector<int> in_groups(static_cast<size_t>(world), 0);
      for (const auto& [color, members] : by_color) {
        ASSERT_EQ(static_cast<int64_t>(members.size()), t.size(axis));
        ASSERT_EQ(t.group_ranks(axis, members[0]), members) << describe(dims, world);
        for (int64_t r : members) ++in_groups[static_cast<size_t>(r)];
      }
      for (int n : in_groups) ASSERT_EQ(n, 1) << "groups must partition the world";
    }
  }
}

using test::expect_config_error;

TEST(Topology, ProductNotDividingWorldNamesTheProduct) {
  expect_config_error(
      [] {
        Topology(ParallelDims{-1, 1, 2, 2}, 6, 0);
      },
      {"parallel.tp (2) x parallel.cp (2) x parallel.pp (1) = 4",
       "does not divide the world size 6", "multiple of 4 processes"});
  expect_config_error(
      [] {
        Topology(ParallelDims{-1, 3, 1, 8}, 8, 0);
      },
      {"parallel.tp (8) x parallel.cp (1) x parallel.pp (3) = 24",
       "does not divide the world size 8"});
}

TEST(Topology, ExplicitDpMustMatchWorld) {
  expect_config_error(
      [] {
        Topology(ParallelDims{3, 1, 1, 2}, 8, 0);
      },
      {"the data-parallel size (3) x parallel.tp (2) x parallel.cp (1) x "
       "parallel.pp (1) = 6",
       "does not equal the world size 8", "set the data-parallel size to 4"});
  expect_config_error(
      [] {
        Topology(ParallelDims{2, 1, 1, 3}, 8, 0);
      },
      {"= 6 does not equal the world size 8", "launch 6 processes"});
}

TEST(Topology, RejectsBadSizesAndRanks) {
  expect_config_error(
      [] {
        Topology(ParallelDims{-1, 1, 1, 0}, 4, 0);
      },
      {"parallel.tp must be >= 1, got 0"});
  expect_config_error(
      [] {
        Topology(ParallelDims{-1, -2, 1, 1}, 4, 0);
      },
      {"parallel.pp must be >= 1, got -2"});
  expect_config_error(
      [] {
        Topology(ParallelDims{0, 1, 1, 1}, 4, 0);
      },
      {"data-parallel size must be >= 1, or -1"});
  expect_config_error([] { Topology(ParallelDims{}, 0, 0); }, {"world size must be >= 1"});
  expect_config_error([] { Topology(ParallelDims{}, 4, 4); }, {"rank 4", "(0..3)"});
  expect_config_error([] { Topology(ParallelDims{}, 4, -1); }, {"rank -1"});
  const Topology t(ParallelDims{}, 4, 0);
  expect_config_error([&] { t.coords_of(9); }, {"rank 9"});
  // Sizes whose product overflows int64 are a clear error, not undefined behaviour.
  expect_config_error(
      [] {
        Topology(ParallelDims{-1, int64_t{1} << 40, int64_t{1} << 40, 1}, 8, 0);
      },
      {"more than 2^63", "does not divide the world size 8"});
}

TEST(Topology, TwoTopologiesInOneProcess) {
  const Topology a(ParallelDims{-1, 1, 1, 2}, 4, 3);
  const Topology b(ParallelDims{-1, 2, 1, 1}, 4, 3);
  EXPECT_EQ(a.coords(), (RankCoords{.dp = 1, .pp = 0, .cp = 0, .tp = 1}));
  EXPECT_EQ(b.coords(), (RankCoords{.dp = 1, .pp = 1, .cp = 0, .tp = 0}));
  EXPECT_EQ(axis_name(Axis::kCp), "cp");
}

}  // namespace
}  // namespace shardlm
