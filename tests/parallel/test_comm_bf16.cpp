// bf16 reductions under MPI (all_reduce and reduce_scatter, sum, max and min, blocking and
// async) against what communicator.h promises. Every rank generates every rank's input, so it
// knows the f64 sum, which each bf16 sum must be within ((1 + u)^(P-1) - 1) * sum |x_r| of;
// the set of values a sum can take when each pairwise combination is rounded to bf16, over
// every order of combination (the transport picks one), which each result must belong to; and
// the exact max and min. Run on the world (1, 2 or 4 ranks) and, with 4 ranks, also on ranks
// {0, 1, 2}, so an odd group size, which MPI's algorithms fold differently, is covered.
#include <gtest/gtest.h>

#include <array>
#include <bit>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <vector>

#include "parallel/comm_inputs.h"
#include "shardlm/comm/communicator.h"

namespace shardlm {
namespace {

using namespace test;

// bf16's unit roundoff (8 significand bits, round to nearest).
constexpr double kRoundoff = 0x1p-8;
constexpr uint16_t kNaN = 0x7fc0;

float as_f32(uint16_t h) { return bf16_to_f32(h); }

// Real-valued and nonzero, of either sign, magnitudes from 2^-6 to 2^7: sums over ranks cancel,
// round and straddle exponents, and stay far from bf16's subnormals and overflow.
uint16_t real_input(uint64_t seed, int rank, int64_t i) {
  const uint64_t h = mix(seed * 0x100000001b3ull ^ mix(static_cast<uint64_t>(rank) << 40 ^ i));
  const float mantissa = 1.f + static_cast<float>(h & 0xffff) / 65536.f;
  const int exponent = static_cast<int>((h >> 16) % 13) - 6;
  const float sign = (h >> 24) & 1 ? -1.f : 1.f;
  return f32_to_bf16(sign * std::ldexp(mantissa, exponent));
}

using Input = std::function<uint16_t(int rank, int64_t i)>;

std::vector<uint16_t> inputs(const Input& input, int rank, int64_t n) {
  std::vector<uint16_t> v(n);
  for (int64_t i = 0; i < n; ++i) v[i] = input(rank, i);
  return v;
}

// The distinct bf16 values one element of a reduction may take (at most 15 for 4 ranks).
struct Bf16Set {
  std::array<uint16_t, 16> values{};
  int count = 0;
  bool has(uint16_t h) const {
    for (int k = 0; k < count; ++k)
      if (values[k] == h) return true;
    return false;
  }
  void add(uint16_t h) {
    if (!has(h)) values[count++] = h;
  }
};

// Every value a sum of x[0, p) can take when each pairwise combination is done in f32 and
// rounded to bf16, over every order (every binary tree over the p ranks); p <= 4.
Bf16Set pairwise_sums(const uint16_t* x, int p) {
  std::array<Bf16Set, 16> by_subset;  // by bit mask of the ranks summed
  for (unsigned m = 1; m < (1u << p); ++m) {
    if (std::has_single_bit(m)) {
      by_subset[m].add(x[std::countr_zero(m)]);
      continue;
    }
    for (unsigned a = (m - 1) & m; a > 0; a = (a - 1) & m) {
      const unsigned b = m ^ a;
      if (a < b) continue;  // each split once
      for (int i = 0; i < by_subset[a].count; ++i)
        for (int j = 0; j < by_subset[b].count; ++j)
          by_subset[m].add(
              f32_to_bf16(as_f32(by_subset[a].values[i]) + as_f32(by_subset[b].values[j])));
    }
  }
  return by_subset[(1u << p) - 1];
}

// got[k] is the sum over the p ranks of input(r, first + k): within the bound of the f64 sum
// and one of the pairwise-rounded sums. Reports the count of misses and the first.
::testing::AssertionResult sums_ok(const std::vector<uint16_t>& got, int p, int64_t first,
                                   const Input& input) {
  int64_t bad = 0, first_bad = -1;
  std::vector<uint16_t> x(p);
  double exact_at_bad = 0, bound_at_bad = 0;
  const double growth = std::pow(1 + kRoundoff, p - 1) - 1;
  for (int64_t k = 0; k < int64_t(got.size()); ++k) {
    double exact = 0, magnitude = 0;
    for (int r = 0; r < p; ++r) {
      x[r] = input(r, first + k);
      exact += as_f32(x[r]);
      magnitude += std::abs(as_f32(x[r]));
    }
    const double bound = growth * magnitude;
    const bool in_bound = std::abs(as_f32(got[k]) - exact) <= bound;
    const bool some_order = p > 4 || pairwise_sums(x.data(), p).has(got[k]);
    if (in_bound && some_order) continue;
    if (bad++ == 0) first_bad = k, exact_at_bad = exact, bound_at_bad = bound;
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << bad << " of " << got.size() << " bf16 sums over " << p << " ranks are wrong on rank "
         << world().rank() << "; first at " << first_bad << ": got " << as_f32(got[first_bad])
         << ", exact " << exact_at_bad << ", bound " << bound_at_bad
         << " (or no order of pairwise rounding gives it)";
}

// The exact max (or min) over the p ranks of input(r, first + k), NaN losing to numbers.
std::vector<uint16_t> extreme(ReduceOp op, int p, int64_t first, int64_t n, const Input& input) {
  std::vector<uint16_t> want(n);
  for (int64_t k = 0; k < n; ++k) {
    float best = as_f32(input(0, first + k));
    for (int r = 1; r < p; ++r) {
      const float v = as_f32(input(r, first + k));
      best = op == ReduceOp::kMax ? std::fmax(best, v) : std::fmin(best, v);
    }
    want[k] = f32_to_bf16(best);
  }
  return want;
}

// The world, and with 4 ranks also {0, 1, 2} (rank 3 then checks its group of one).
std::vector<std::unique_ptr<Communicator>> groups() {
  std::vector<std::unique_ptr<Communicator>> out;
  const int me = world().rank();
  out.push_back(world().split(0, me, "all"));
  if (world().size() == 4) out.push_back(world().split(me < 3 ? 0 : 1, me, "three"));
  return out;
}

class Bf16Sizes : public ::testing::TestWithParam<int64_t> {};
INSTANTIATE_TEST_SUITE_P(CommBf16, Bf16Sizes, ::testing::Values(1, 7, 1000003));

TEST_P(Bf16Sizes, AllReduceSumIsPairwiseRoundedWithinBound) {
  const int64_t n = GetParam();
  const Input input = [](int r, int64_t i) { return real_input(1, r, i); };
  for (const auto& g : groups()) {
    std::vector<uint16_t> buf = inputs(input, g->rank(), n);
    g->all_reduce(bf16_view(buf));
    EXPECT_TRUE(sums_ok(buf, g->size(), 0, input)) << g->name();
  }
}

// Max and min return one of the inputs, so they are exact; a NaN on one rank loses (element
// i < 4 has one on rank i, so whichever operand a rank's buffer is in the combination, some
// element puts the NaN there).
TEST_P(Bf16Sizes, AllReduceMaxAndMinAreExact) {
  const int64_t n = GetParam();
  for (const ReduceOp op : {ReduceOp::kMax, ReduceOp::kMin}) {
    const Input input = [](int r, int64_t i) { return i == r ? kNaN : real_input(2, r, i); };
    for (const auto& g : groups()) {
      std::vector<uint16_t> buf = inputs(input, g->rank(), n);
      g->all_reduce(bf16_view(buf), op);
      std::vector<uint16_t> want = extreme(op, g->size(), 0, n, input);
      EXPECT_TRUE(same(buf, want)) << g->name() << " " << reduce_op_name(op);
    }
  }
}

// send [P * n]: this rank receives the reduction of every rank's chunk number rank().
TEST_P(Bf16Sizes, ReduceScatterSumAndMax) {
  const int64_t n = GetParam();
  const Input input = [](int r, int64_t i) { return real_input(3, r, i); };
  for (const auto& g : groups()) {
    const int p = g->size(), me = g->rank();
    std::vector<uint16_t> send = inputs(input, me, p * n), sum(n, kNaN), max(n, kNaN);
    g->reduce_scatter(bf16_view(send), bf16_view(sum));
    g->reduce_scatter(bf16_view(send), bf16_view(max), ReduceOp::kMax);
    EXPECT_TRUE(sums_ok(sum, p, me * n, input)) << g->name();
    EXPECT_TRUE(same(max, extreme(ReduceOp::kMax, p, me * n, n, input))) << g->name();
  }
}

// Values whose every partial sum is a bf16 (integers in [-64, 64) over at most 4 ranks stay
// within [-256, 256]) come out exact, in either collective.
TEST(CommBf16, RepresentableSumsStayExact) {
  const int64_t n = 1000003;
  const Input input = [](int r, int64_t i) { return f32_to_bf16(input_f32(4, r, i)); };
  for (const auto& g : groups()) {
    const int p = g->size(), me = g->rank();
    ASSERT_LE(p, 4) << "the inputs are exact only over at most 4 ranks";
    std::vector<uint16_t> buf = inputs(input, me, n), send = inputs(input, me, p * n), recv(n);
    std::vector<uint16_t> want_all(n), want_mine(n);
    for (int64_t i = 0; i < n; ++i) {
      float all = 0, mine = 0;
      for (int r = 0; r < p; ++r) all += input_f32(4, r, i), mine += input_f32(4, r, me * n + i);
      want_all[i] = f32_to_bf16(all);
      want_mine[i] = f32_to_bf16(mine);
    }
    g->all_reduce(bf16_view(buf));
    g->reduce_scatter(bf16_view(send), bf16_view(recv));
    EXPECT_TRUE(same(buf, want_all)) << g->name();
    EXPECT_TRUE(same(recv, want_mine)) << g->name();
  }
}

// The async forms, several in flight at once with f32 ones, completed in another order.
TEST(CommBf16, AsyncInFlightTogether) {
  const int64_t n = 100003;
  const Input sum_in = [](int r, int64_t i) { return real_input(5, r, i); };
  const Input min_in = [](int r, int64_t i) { return real_input(6, r, i); };
  for (const auto& g : groups()) {
    const int p = g->size(), me = g->rank();
    std::vector<uint16_t> sum = inputs(sum_in, me, n), send = inputs(min_in, me, p * 7), min(7);
    std::vector<float> f32 = inputs_f32(7, me, n), want_f32(n, 0.f);
    for (int r = 0; r < p; ++r)
      for (int64_t i = 0; i < n; ++i) want_f32[i] += input_f32(7, r, i);

    auto h_sum = g->all_reduce_async(bf16_view(sum));
    auto h_f32 = g->all_reduce_async(f32_view(f32));
    auto h_min = g->reduce_scatter_async(bf16_view(send), bf16_view(min), ReduceOp::kMin);
    h_min->wait();
    while (!h_sum->test()) {
    }
    h_f32->wait();
    h_sum->wait();
    EXPECT_TRUE(sums_ok(sum, p, 0, sum_in)) << g->name();
    EXPECT_TRUE(same(min, extreme(ReduceOp::kMin, p, me * 7, 7, min_in))) << g->name();
    EXPECT_TRUE(same(f32, want_f32)) << g->name();
  }
}

// With 2 ranks a sum is rounded once, to the nearest bf16 of the exact sum, ties to even: near 1
// bf16 steps by 2^-7, so 1 + 2^-8 (a tie) stays 1, 1 + 3 * 2^-8 (a tie) goes up to the even
// 1 + 2^-6, and 1 + 3 * 2^-9 goes to the nearer 1 + 2^-7 (truncation would give 1, 1 + 2^-7, 1).
TEST(CommBf16, TwoRanksRoundOnceToNearestEven) {
  auto pair = world().split(world().rank() / 2, world().rank(), "pair");
  if (pair->size() != 2) GTEST_SKIP() << "needs a group of 2";
  std::vector<uint16_t> buf(3, f32_to_bf16(1.f));
  if (pair->rank() == 1) buf = {f32_to_bf16(0x1p-8f), f32_to_bf16(0x3p-8f), f32_to_bf16(0x3p-9f)};
  pair->all_reduce(bf16_view(buf));
  EXPECT_EQ(as_f32(buf[0]), 1.f);
  EXPECT_EQ(as_f32(buf[1]), 1.f + 0x1p-6f);
  EXPECT_EQ(as_f32(buf[2]), 1.f + 0x1p-7f);
}

}  // namespace
}  // namespace shardlm
