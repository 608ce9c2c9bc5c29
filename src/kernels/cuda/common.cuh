// Device helpers shared by the CUDA kernels: element loads/stores in f32 or bf16 (arithmetic is
// always f32 or f64), launch shapes, warp and block reductions. No engine headers.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/launch.h"

namespace shardlm::cuda {

template <typename T>
__device__ __forceinline__ float load(const T* p, int64_t i);
template <>
__device__ __forceinline__ float load<float>(const float* p, int64_t i) {
  return p[i];
}
template <>
__device__ __forceinline__ float load<__nv_bfloat16>(const __nv_bfloat16* p, int64_t i) {
  return __bfloat162float(p[i]);
}

template <typename T>
__device__ __forceinline__ void store(T* p, int64_t i, float x);
template <>
__device__ __forceinline__ void store<float>(float* p, int64_t i, float x) {
  p[i] = x;
}
template <>
__device__ __forceinline__ void store<__nv_bfloat16>(__nv_bfloat16* p, int64_t i, float x) {
  p[i] = __float2bfloat16_rn(x);
}

__device__ __forceinline__ float warp_sum(float x) {
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}
__device__ __forceinline__ double warp_sum(double x) {
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}
__device__ __forceinline__ float warp_max(float x) {
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}

// Sum over a block of at most 1024 threads (a multiple of 32); every thread gets the result.
// `shared` holds 32 values.
template <typename V>
__device__ __forceinline__ V block_sum(V x, V* shared) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  x = warp_sum(x);
  __syncthreads();  // shared may still be read by a previous call
  if (lane == 0) shared[warp] = x;
  __syncthreads();
  const int warps = (blockDim.x + 31) >> 5;
  V total = 0;
  for (int i = 0; i < warps; ++i) total += shared[i];  // fixed order: deterministic
  return total;
}

__device__ __forceinline__ float block_max(float x, float* shared) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  x = warp_max(x);
  __syncthreads();
  if (lane == 0) shared[warp] = x;
  __syncthreads();
  const int warps = (blockDim.x + 31) >> 5;
  float m = shared[0];
  for (int i = 1; i < warps; ++i) m = fmaxf(m, shared[i]);
  return m;
}

inline unsigned grid_for(int64_t n, int threads, int64_t max_blocks = 65535LL * 8) {
  int64_t blocks = (n + threads - 1) / threads;
  if (blocks < 1) blocks = 1;
  if (blocks > max_blocks) blocks = max_blocks;
  return static_cast<unsigned>(blocks);
}

// Calls f.template operator()<T>() with T the element type named by t.
template <typename F>
cudaError_t dispatch(Elem t, F&& f) {
  if (t == Elem::kBF16) return f(static_cast<__nv_bfloat16*>(nullptr));
  return f(static_cast<float*>(nullptr));
}

}  // namespace shardlm::cuda
