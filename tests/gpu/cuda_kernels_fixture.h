// The CudaKernels fixture the CUDA kernel tests share: a CUDA backend beside the CPU backend,
// device tensors up and down through the backend's convert, NaN-poisoned outputs, workspaces,
// and the normwise relative error with the tolerances each dtype is held to. Tests only.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory>
#include <random>
#include <vector>

#include "kernels/cpu/cpu_backend.h"
#include "kernels/cuda/cuda_backend.h"
#include "shardlm/core/buffer.h"

namespace shardlm::test {

inline constexpr double kTolF32 = 1e-5, kTolBF16 = 1e-2;

inline double tol(DType t) { return t == DType::kBF16 ? kTolBF16 : kTolF32; }

// ||a - b||_inf / ||b||_inf (absolute when b is all zero).
inline double rel_err(const std::vector<float>& a, const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::isnan(a[i]) != std::isnan(b[i])) return std::numeric_limits<double>::infinity();
    if (std::isinf(b[i]) || std::isinf(a[i])) {
      if (a[i] != b[i]) return std::numeric_limits<double>::infinity();
      continue;
    }
    num = std::max(num, std::fabs(double(a[i]) - double(b[i])));
    den = std::max(den, std::fabs(double(b[i])));
  }
  return den > 0 ? num / den : num;
}

inline std::vector<float> randn(size_t n, uint64_t seed, float scale = 1.f) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d(0.f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

inline std::vector<float> round_to(DType t, std::vector<float> v) {
  if (t == DType::kBF16)
    for (float& x : v) x = bf16_to_f32(f32_to_bf16(x));
  return v;
}

class CudaKernels : public ::testing::Test {
 protected:
  void SetUp() override { gpu = std::make_unique<cuda::CudaBackend>(0); }
  void TearDown() override {
    keep.clear();
    gpu.reset();
  }

  // A device tensor holding `values` converted to `dt` (through the backend's convert).
  Tensor up(const std::vector<float>& values, Shape shape, DType dt = DType::kF32) {
    Tensor t = alloc(shape, dt);
    std::vector<float> h = values;
    gpu->convert(Tensor(h.data(), DType::kF32, shape, MemPool::kHost), t);
    return t;
  }
  Tensor up_i32(const std::vector<int32_t>& values, Shape shape) {
    Tensor t = alloc(shape, DType::kI32);
    std::vector<int32_t> h = values;
    gpu->copy(Tensor(h.data(), DType::kI32, shape, MemPool::kHost), t);
    return t;
  }
  // A device tensor full of NaN.
  Tensor poisoned(Shape shape, DType dt = DType::kF32) {
    return up(std::vector<float>(shape.numel(), std::numeric_limits<float>::quiet_NaN()), shape,
              dt);
  }
  Tensor alloc(Shape shape, DType dt) {
    keep.emplace_back(*gpu, ledger, MemCategory::kActivations, MemPool::kDevice,
                      std::max<size_t>(1, shape.numel() * dtype_size(dt)));
    return keep.back().view(dt, shape);
  }
  std::vector<float> down(const Tensor& t) {
    std::vector<float> h(t.numel());
    gpu->convert(t, Tensor(h.data(), DType::kF32, t.shape(), MemPool::kHost));
    return h;
  }
  static Tensor host(std::vector<float>& v, Shape s) {
    return Tensor(v.data(), DType::kF32, s, MemPool::kHost);
  }
  static Tensor host_i32(std::vector<int32_t>& v, Shape s) {
    return Tensor(v.data(), DType::kI32, s, MemPool::kHost);
  }
  Workspace device_ws(size_t bytes) {
    keep.emplace_back(*gpu, ledger, MemCategory::kWorkspace, MemPool::kDevice,
                      std::max<size_t>(bytes, 64));
    return {keep.back().data(), keep.back().bytes()};
  }

  cpu::CpuBackend cpu;
  std::unique_ptr<cuda::CudaBackend> gpu;
  MemoryLedger ledger;
  std::vector<Buffer> keep;
  std::vector<std::vector<std::byte>> host_ws;
  Workspace cpu_ws(size_t bytes) {
    host_ws.emplace_back(std::max<size_t>(bytes, 64) + 64);
    auto* p = host_ws.back().data();
    auto* aligned =
        reinterpret_cast<std::byte*>((reinterpret_cast<uintptr_t>(p) + 63) & ~uintptr_t(63));
    return {aligned, bytes};
  }
};

inline constexpr DType kTypes[] = {DType::kF32, DType::kBF16};

}  // namespace shardlm::test
