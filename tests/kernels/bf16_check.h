// Helpers of the CPU kernel tests for bf16 storage: f32 vectors rounded to what bf16 holds
// (nearest even, core/dtype.h) and back, bf16 tensor views beside test_util.h's f32 and i32 ones,
// seeded bf16 tensors with their exact f64 values (the reference's input), and the check that an
// output is the f64 result rounded once to bf16. Tests only.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "shardlm/core/dtype.h"
#include "shardlm/core/tensor.h"
#include "test_util.h"

namespace shardlm::test {

using Bf16Vec = std::vector<uint16_t>;

inline constexpr uint16_t kBf16NaN = 0x7fc0;  // quiet NaN: poisons outputs until written

inline Bf16Vec to_bf16(const std::vector<float>& x) {
  Bf16Vec y(x.size());
  for (size_t i = 0; i < x.size(); ++i) y[i] = f32_to_bf16(x[i]);
  return y;
}

inline std::vector<float> from_bf16(const Bf16Vec& x) {
  std::vector<float> y(x.size());
  for (size_t i = 0; i < x.size(); ++i) y[i] = bf16_to_f32(x[i]);
  return y;
}

// x rounded in place to bf16 values, so that f32 and bf16 kernels see the same inputs.
inline void round_to_bf16(std::vector<float>& x) {
  for (float& v : x) v = bf16_to_f32(f32_to_bf16(v));
}

inline Tensor view(Bf16Vec& v, Shape s) {
  EXPECT_EQ(static_cast<int64_t>(v.size()), s.numel());
  return Tensor(v.data(), DType::kBF16, s);
}

inline std::vector<double> bf16_to_f64(const std::vector<uint16_t>& bits) {
  std::vector<double> v(bits.size());
  for (size_t i = 0; i < bits.size(); ++i) v[i] = bf16_to_f32(bits[i]);
  return v;
}

// Values stored as bf16, and the same values exactly in f64.
struct Bf16Values {
  std::vector<uint16_t> bits;
  std::vector<double> f64;
  Tensor view(Shape s) {
    EXPECT_EQ(static_cast<int64_t>(bits.size()), s.numel());
    return Tensor(bits.data(), DType::kBF16, s);
  }
  void reread() { f64 = bf16_to_f64(bits); }  // after a kernel wrote bits
};

// Uniform in [lo, hi), rounded to bf16.
inline Bf16Values bf16_random(size_t n, uint64_t seed, float lo = -1.f, float hi = 1.f) {
  Bf16Values v;
  for (float x : random_vec(n, seed, lo, hi)) v.bits.push_back(f32_to_bf16(x));
  v.reread();
  return v;
}

// Half a bf16 ulp at |v| (8 significant bits): the most one round to nearest moves v.
inline double bf16_half_ulp(double v) {
  if (v == 0) return 0;
  int exponent = 0;
  std::frexp(v, &exponent);  // |v| in [2^(e-1), 2^e): ulp 2^(e-8)
  return std::ldexp(1.0, exponent - 9);
}

// Every element of got is want rounded ONCE to bf16, up to atol + rtol * |want| (the f32 error
// of the sum): a kernel that rounded a partial sum (a K panel, the old value of an accumulating
// output) to bf16 on the way would be off by up to a further half ulp.
inline ::testing::AssertionResult rounded_once(const std::vector<uint16_t>& got,
                                               const std::vector<double>& want, double atol,
                                               double rtol = 0) {
  if (got.size() != want.size())
    return ::testing::AssertionFailure() << got.size() << " elements, want " << want.size();
  for (size_t i = 0; i < got.size(); ++i) {
    const double g = bf16_to_f32(got[i]);
    const double bound =
        bf16_half_ulp(std::max(std::abs(g), std::abs(want[i]))) + atol + rtol * std::abs(want[i]);
    if (!(std::abs(g - want[i]) <= bound))
      return ::testing::AssertionFailure() << "element " << i << " is " << g << ", want " << want[i]
                                           << " rounded once (+-" << bound << ")";
  }
  return ::testing::AssertionSuccess();
}

}  // namespace shardlm::test
