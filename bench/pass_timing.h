// What the compiled bench tools share: device inputs of N(0, 1) values, and the medians of a
// kernel pair's timed forward and backward passes.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <random>
#include <vector>

#include "shardlm/backend/backend.h"
#include "shardlm/core/dtype.h"

namespace shardlm::bench {

// Fills a device tensor with N(0, 1) values (never zeros: they hide unwritten outputs).
inline void fill_random(Backend& be, const Tensor& t, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> dist(0.f, 1.f);
  std::vector<float> f32(size_t(t.numel()));
  for (float& x : f32) x = dist(rng);
  if (t.dtype() == DType::kF32) {
    be.copy(Tensor(f32.data(), DType::kF32, t.shape(), MemPool::kHost), t);
    return;
  }
  std::vector<uint16_t> bf16(f32.size());
  std::transform(f32.begin(), f32.end(), bf16.begin(), f32_to_bf16);
  be.copy(Tensor(bf16.data(), DType::kBF16, t.shape(), MemPool::kHost), t);
}

struct Timing {
  double forward_s = 0, backward_s = 0;
};

// Medians of `reps` forward and backward passes after one warm-up, the backend synchronised
// only around each pass.
template <class Forward, class Backward>
Timing time_passes(Backend& be, int reps, Forward&& forward, Backward&& backward) {
  using Clock = std::chrono::steady_clock;
  std::vector<double> fwd, bwd;
  for (int rep = 0; rep <= reps; ++rep) {  // rep 0 warms up
    be.synchronize();
    const auto t0 = Clock::now();
    forward();
    be.synchronize();
    const auto t1 = Clock::now();
    backward();
    be.synchronize();
    const auto t2 = Clock::now();
    if (rep == 0) continue;
    fwd.push_back(std::chrono::duration<double>(t1 - t0).count());
    bwd.push_back(std::chrono::duration<double>(t2 - t1).count());
  }
  const auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  return {median(fwd), median(bwd)};
}

}  // namespace shardlm::bench
