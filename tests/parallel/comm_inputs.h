// What the Communicator tests (test_comm.cpp, test_comm_bf16.cpp) share: inputs that any rank can
// generate for every rank from (seed, rank, index), so each rank knows the exact expected result
// of a collective; host tensor views; and a comparison that reports the number of differing
// elements and the first one instead of a million lines. Tests only.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "parallel/mpi_test_env.h"
#include "shardlm/comm/communicator.h"

namespace shardlm::test {

inline uint64_t mix(uint64_t x) {  // splitmix64
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Integer-valued, in [-64, 64): exact under any order of summation over a few ranks, in f32 and
// (as long as every partial sum stays within [-256, 256]) in bf16.
inline float input_f32(uint64_t seed, int rank, int64_t i) {
  const uint64_t h = mix(seed * 0x100000001b3ull ^ mix(static_cast<uint64_t>(rank) << 40 ^ i));
  return static_cast<float>(static_cast<int>(h % 128) - 64);
}

inline std::vector<float> inputs_f32(uint64_t seed, int rank, int64_t n) {
  std::vector<float> v(n);
  for (int64_t i = 0; i < n; ++i) v[i] = input_f32(seed, rank, i);
  return v;
}

inline Tensor f32_view(std::vector<float>& v) {
  return Tensor(v.data(), DType::kF32, {static_cast<int64_t>(v.size())});
}
inline Tensor bf16_view(std::vector<uint16_t>& v) {
  return Tensor(v.data(), DType::kBF16, {static_cast<int64_t>(v.size())});
}

template <typename T>
::testing::AssertionResult same(const std::vector<T>& got, const std::vector<T>& want) {
  if (got.size() != want.size()) {
    return ::testing::AssertionFailure() << "size " << got.size() << " != " << want.size();
  }
  size_t bad = 0, first = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (got[i] != want[i] && bad++ == 0) first = i;
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << bad << " of " << got.size() << " elements differ on rank " << world().rank()
         << "; first at " << first << ": got " << got[first] << ", want " << want[first];
}

}  // namespace shardlm::test
