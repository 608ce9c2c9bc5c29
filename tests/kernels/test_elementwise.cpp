// Tests of the elementwise CPU kernels (elementwise.cpp): bf16 rounding on hand-picked bit
// patterns and against an independent nearest-even reference, exact copies and zeroing, add and
// scale against f64 (bf16: the f32 result rounded once), and sum_squares against f64 (bf16
// values too) and across thread counts.
#include <omp.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "kernels/bf16_check.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/ops.h"
#include "test_util.h"

namespace shardlm {
namespace {

// Odd sizes on purpose: 1, a prime, and sizes that cross the parallel chunk (32768).
const std::vector<int64_t> kSizes = {0, 1, 7, 33, 130, 32769, 100003};

Tensor bf16_view(std::vector<uint16_t>& v) {
  return Tensor(v.data(), DType::kBF16, Shape{static_cast<int64_t>(v.size())});
}

uint32_t bits_of(float f) { return std::bit_cast<uint32_t>(f); }
float float_of(uint32_t b) { return std::bit_cast<float>(b); }

// f32 -> bf16 through the kernel, one value.
uint16_t convert_one(float f) {
  std::vector<float> src = {f};
  std::vector<uint16_t> dst = {0xdeadu};
  cpu::convert(test::view(src, Shape{1}), bf16_view(dst));
  return dst[0];
}

// Independent reference: the bf16 value nearest to x, ties to the even mantissa; computed by
// comparing distances in f64 to the two bf16 neighbours (finite, non-NaN x).
uint16_t nearest_even_bf16(float x) {
  const uint32_t b = bits_of(x);
  const uint16_t lo = static_cast<uint16_t>(b >> 16);  // toward zero
  const uint16_t hi = static_cast<uint16_t>(lo + 1);   // away from zero (may become inf)
  const double vx = x;
  const double vlo = bf16_to_f32(lo);
  // The neighbour away from zero of the largest finite bf16 is inf; use 2^128 for distances.
  const double vhi =
      (hi & 0x7fffu) == 0x7f80u ? std::copysign(std::ldexp(1.0, 128), vx) : double(bf16_to_f32(hi));
  const double dlo = std::abs(vx - vlo);
  const double dhi = std::abs(vhi - vx);
  if (dlo < dhi) return lo;
  if (dhi < dlo) return hi;
  return (lo & 1u) == 0 ? lo : hi;
}

TEST(Bf16Convert, HandPickedBitPatterns) {
  struct Case {
    uint32_t f32_bits;
    uint16_t bf16_bits;
    const char* what;
  };
  const Case cases[] = {
      {0x3f800000u, 0x3f80u, "1.0 is exact"},
      {0x3f807fffu, 0x3f80u, "just below the halfway point rounds down"},
      {0x3f808000u, 0x3f80u, "tie, even lower neighbour: stays"},
      {0x3f808001u, 0x3f81u, "just above the halfway point rounds up"},
      {0x3f818000u, 0x3f82u, "tie, odd lower neighbour: rounds up to even"},
      {0xbf818000u, 0xbf82u, "negative tie rounds to even magnitude"},
      {0x00000000u, 0x0000u, "+0"},
      {0x80000000u, 0x8000u, "-0 keeps its sign"},
      {0x00008000u, 0x0000u, "subnormal tie to even (zero)"},
      {0x00018000u, 0x0002u, "subnormal tie to even (up)"},
      {0x807fffffu, 0x8080u, "largest negative subnormal rounds up to the smallest normal"},
      {0x7f800000u, 0x7f80u, "+inf"},
      {0xff800000u, 0xff80u, "-inf"},
      {0x7f7f0000u, 0x7f7fu, "largest finite bf16 is exact"},
      {0x7f7f7fffu, 0x7f7fu, "below the halfway point to 2^128 stays finite"},
      {0x7f7f8000u, 0x7f80u, "tie above the largest finite bf16 (odd) overflows to inf"},
      {0x7f7fffffu, 0x7f80u, "largest finite f32 overflows to +inf"},
      {0xff7fffffu, 0xff80u, "most negative finite f32 overflows to -inf"},
      {0x7fc00000u, 0x7fc0u, "quiet NaN"},
      {0xffc00000u, 0xffc0u, "negative quiet NaN keeps its sign"},
      {0x7f800001u, 0x7fc0u, "signalling NaN with only low bits set must not become inf"},
      {0x7fffffffu, 0x7fffu, "NaN with all mantissa bits stays NaN (no carry into the sign)"},
  };
  for (const Case& c : cases) {
    const float f = float_of(c.f32_bits);
    EXPECT_EQ(convert_one(f), c.bf16_bits) << c.what << ": f32 bits 0x" << std::hex << c.f32_bits;
    EXPECT_EQ(f32_to_bf16(f), c.bf16_bits) << c.what;
  }
}

TEST(Bf16Convert, RandomValuesAreNearestEven) {
  // Random bit patterns cover every exponent; halfway points are forced in one of four.
  std::mt19937_64 rng(7);
  std::vector<float> src;
  while (src.size() < 200000) {
    uint32_t b = static_cast<uint32_t>(rng());
    if ((rng() & 3u) == 0) b = (b & 0xffff0000u) | 0x8000u;
    const float f = float_of(b);
    if (std::isfinite(f)) src.push_back(f);
  }
  std::vector<uint16_t> dst(src.size());
  cpu::convert(test::view(src, Shape{static_cast<int64_t>(src.size())}), bf16_view(dst));
  int64_t mismatches = 0;
  for (size_t i = 0; i < src.size(); ++i) {
    if (dst[i] != nearest_even_bf16(src[i]) && ++mismatches < 5) {
      ADD_FAILURE() << "f32 0x" << std::hex << bits_of(src[i]) << " -> 0x" << dst[i]
                    << ", nearest even is 0x" << nearest_even_bf16(src[i]);
    }
  }
  EXPECT_EQ(mismatches, 0);
}

TEST(Bf16Convert, EveryBf16RoundTripsExactly) {
  std::vector<uint16_t> all(65536);
  for (uint32_t i = 0; i < 65536; ++i) all[i] = static_cast<uint16_t>(i);
  std::vector<float> wide(all.size(), -1.0f);
  std::vector<uint16_t> back(all.size());
  cpu::convert(bf16_view(all), test::view(wide, Shape{65536}));
  cpu::convert(test::view(wide, Shape{65536}), bf16_view(back));
  for (uint32_t i = 0; i < 65536; ++i) {
    EXPECT_EQ(bits_of(wide[i]), i << 16) << "bf16 -> f32 must be a 16-bit shift";
    const bool is_nan = (i & 0x7f80u) == 0x7f80u && (i & 0x7fu) != 0;
    if (is_nan) {
      EXPECT_EQ(back[i], i | 0x40u) << "NaN comes back quiet with its sign";
    } else {
      EXPECT_EQ(back[i], i) << "bf16 0x" << std::hex << i;
    }
  }
}

TEST(Convert, SameDtypeIsACopyAndUnsupportedPairsThrow) {
  cpu::CpuBackend be;  // through the entry points, which check the arguments
  for (int64_t n : kSizes) {
    std::vector<float> a = test::random_vec(n, 1), b(n, 0.0f);
    be.convert(test::view(a, Shape{n}), test::view(b, Shape{n}));
    EXPECT_EQ(a, b);
    std::vector<uint16_t> h(n), h2(n, 0);
    for (int64_t i = 0; i < n; ++i) h[i] = static_cast<uint16_t>(i * 31);
    be.convert(bf16_view(h), bf16_view(h2));
    EXPECT_EQ(h, h2);
  }
  std::vector<float> f(4);
  std::vector<int32_t> k(4);
  EXPECT_THROW(be.convert(test::view(f, Shape{4}), test::view(k, Shape{4})), Error);
  std::vector<uint16_t> small(3);
  EXPECT_THROW(be.convert(test::view(f, Shape{4}), bf16_view(small)), Error);
}

TEST(Zero, ClearsEveryByteOfAnyDtype) {
  for (int64_t n : kSizes) {
    std::vector<float> a = test::random_vec(n, 2);
    cpu::zero(test::view(a, Shape{n}));
    for (float v : a) ASSERT_EQ(bits_of(v), 0u);
    std::vector<uint16_t> h(n, 0xffffu);
    cpu::zero(bf16_view(h));
    for (uint16_t v : h) ASSERT_EQ(v, 0u);
  }
}

TEST(Copy, ExactAcrossShapesAndChecksArguments) {
  cpu::CpuBackend be;  // through the entry points, which check the arguments
  for (int64_t n : kSizes) {
    std::vector<float> a = test::random_vec(n, 3), b(n, 0.0f);
    be.copy(test::view(a, Shape{n}), test::view(b, Shape{n}));
    EXPECT_EQ(a, b);
  }
  std::vector<float> a = test::random_vec(12, 4), b(12, 0.0f);
  be.copy(test::view(a, Shape{3, 4}), test::view(b, Shape{12}));  // shapes may differ
  EXPECT_EQ(a, b);
  be.copy(test::view(a, Shape{12}), test::view(a, Shape{12}));  // self-copy is a no-op
  std::vector<float> c(11);
  EXPECT_THROW(be.copy(test::view(a, Shape{12}), test::view(c, Shape{11})), Error);
  std::vector<uint16_t> h(12);
  EXPECT_THROW(be.copy(test::view(a, Shape{12}), bf16_view(h)), Error);
  EXPECT_THROW(
      be.copy(Tensor(a.data(), DType::kF32, Shape{8}), Tensor(a.data() + 2, DType::kF32, Shape{8})),
      Error);
}

// add and scale: one f32 rounding per element, so the result must equal the f64 result rounded
// once to f32 (atol 0, rtol 2^-24).
TEST(Add, MatchesF64AndAllowsAliasing) {
  cpu::CpuBackend be;  // through the entry points, which check the arguments
  for (int64_t n : kSizes) {
    std::vector<float> a = test::random_vec(n, 5, -3, 3), b = test::random_vec(n, 6, -3, 3);
    std::vector<double> ref(n);
    for (int64_t i = 0; i < n; ++i) ref[i] = double(a[i]) + double(b[i]);
    std::vector<float> out(n, NAN);
    be.add(test::view(a, Shape{n}), test::view(b, Shape{n}), test::view(out, Shape{n}));
    EXPECT_CLOSE(out, ref, 0.0, 0x1p-24);
    be.add(test::view(a, Shape{n}), test::view(b, Shape{n}), test::view(a, Shape{n}));
    EXPECT_EQ(a, out);
  }
  std::vector<float> a(4), b(5);
  EXPECT_THROW(be.add(test::view(a, Shape{4}), test::view(b, Shape{5}), test::view(a, Shape{4})),
               Error);
}

TEST(Scale, MatchesF64) {
  for (int64_t n : kSizes) {
    std::vector<float> a = test::random_vec(n, 7, -3, 3);
    std::vector<double> ref(n);
    for (int64_t i = 0; i < n; ++i) ref[i] = double(a[i]) * 0.3f;
    cpu::scale(test::view(a, Shape{n}), 0.3f);
    EXPECT_CLOSE(a, ref, 0.0, 0x1p-24);
  }
}

// sum_squares accumulates in f64: squares of f32 are exact in f64, so only the f64 additions
// round (rtol 1e-12 is ~1e4 ulps of f64).
TEST(SumSquares, MatchesF64AndIgnoresThreadCount) {
  const std::vector<int64_t> sizes = {0, 1, 7, 33, 130, 32769, 100003, (int64_t{1} << 22) + 3};
  for (int64_t n : sizes) {
    std::vector<float> a = test::random_vec(n, 8, -2, 2);
    long double ref = 0;
    for (float v : a) ref += (long double)v * v;
    const Tensor t = test::view(a, Shape{n});
    const double got = cpu::sum_squares(t);
    EXPECT_NEAR(got, double(ref), 1e-12 * double(ref)) << "n = " << n;
    const int saved = omp_get_max_threads();
    for (int threads : {1, 2, 3, 5}) {
      omp_set_num_threads(threads);
      EXPECT_EQ(cpu::sum_squares(t), got) << "n = " << n << ", threads = " << threads;
    }
    omp_set_num_threads(saved);
  }
}

// Seeded uniform values in [lo, hi), rounded to bf16.
std::vector<uint16_t> random_bf16(int64_t n, uint64_t seed, float lo, float hi) {
  return test::to_bf16(test::random_vec(n, seed, lo, hi));
}

// bf16 add and scale: the f32 operation on the stored values, rounded once to nearest even;
// bitwise, through the entry points, also with out aliasing a.
TEST(Add, Bf16IsTheF32SumRoundedOnce) {
  cpu::CpuBackend be;
  for (int64_t n : kSizes) {
    // b is ~2^-8 of a: most sums are not bf16 values, so the rounding is exercised.
    std::vector<uint16_t> a = random_bf16(n, 9, -3, 3), b = random_bf16(n, 10, -0.01f, 0.01f);
    std::vector<uint16_t> want(n), out(n, 0xffffu);
    for (int64_t i = 0; i < n; ++i) want[i] = f32_to_bf16(bf16_to_f32(a[i]) + bf16_to_f32(b[i]));
    be.add(bf16_view(a), bf16_view(b), bf16_view(out));
    EXPECT_EQ(out, want) << "n = " << n;
    be.add(bf16_view(a), bf16_view(b), bf16_view(a));
    EXPECT_EQ(a, want) << "n = " << n << ", out aliasing a";
  }
}

TEST(Scale, Bf16IsTheF32ProductRoundedOnce) {
  cpu::CpuBackend be;
  for (int64_t n : kSizes) {
    std::vector<uint16_t> x = random_bf16(n, 11, -3, 3), want(n);
    for (int64_t i = 0; i < n; ++i) want[i] = f32_to_bf16(bf16_to_f32(x[i]) * 0.3f);
    be.scale(bf16_view(x), 0.3f);
    EXPECT_EQ(x, want) << "n = " << n;
  }
}

// bf16 values are exact in f64 and so are their squares: the sum is as accurate as for f32.
TEST(SumSquares, Bf16SumsInF64) {
  cpu::CpuBackend be;
  for (int64_t n : {int64_t{1}, int64_t{33}, int64_t{100003}, (int64_t{1} << 22) + 3}) {
    const std::vector<uint16_t> x = random_bf16(n, 12, -2, 2);
    long double ref = 0;
    for (uint16_t v : x) ref += (long double)bf16_to_f32(v) * bf16_to_f32(v);
    std::vector<uint16_t> copy = x;
    EXPECT_NEAR(be.sum_squares(bf16_view(copy)), double(ref), 1e-12 * double(ref)) << "n = " << n;
  }
}

}  // namespace
}  // namespace shardlm
