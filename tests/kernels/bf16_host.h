// bf16 host vectors for the kernel tests that run a kernel on bf16 storage: rounding f32 values
// to what bf16 holds (nearest even, core/dtype.h), bf16 tensor views beside test_util.h's f32
// and i32 ones, and back to f32. Tests only.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "shardlm/core/dtype.h"
#include "shardlm/core/tensor.h"

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

}  // namespace shardlm::test
