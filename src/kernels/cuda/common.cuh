// Device helpers shared by the CUDA kernels: element loads/stores in f32 or bf16 (arithmetic is
// always f32 or f64), one element at a time or in packs of 16-byte accesses, launch shapes, warp
// and block reductions. No engine headers.
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

// A pack: kPack consecutive elements moved with 16-byte accesses (one for bf16, two for f32),
// converted to f32 registers. A kernel takes the packed path only where every pointer it packs
// is 16-byte aligned (aligned16) and its extents are multiples of kPack, else the same kernel
// with packs of one element (the scalar path).
inline constexpr int kPack = 8;

inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }
template <typename... P>
inline bool all_aligned16(const P*... p) {
  return (aligned16(p) && ...);
}

__device__ __forceinline__ void load_pack(const float* p, float (&v)[kPack]) {
  const float4 a = reinterpret_cast<const float4*>(p)[0];
  const float4 b = reinterpret_cast<const float4*>(p)[1];
  v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
}
__device__ __forceinline__ void load_pack(const __nv_bfloat16* p, float (&v)[kPack]) {
  const uint4 raw = *reinterpret_cast<const uint4*>(p);
  const auto* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
  for (int k = 0; k < kPack / 2; ++k) {
    const float2 f = __bfloat1622float2(h[k]);
    v[2 * k] = f.x, v[2 * k + 1] = f.y;
  }
}
__device__ __forceinline__ void store_pack(float* p, const float (&v)[kPack]) {
  reinterpret_cast<float4*>(p)[0] = make_float4(v[0], v[1], v[2], v[3]);
  reinterpret_cast<float4*>(p)[1] = make_float4(v[4], v[5], v[6], v[7]);
}
// Each element rounded to nearest even, as store() does.
__device__ __forceinline__ void store_pack(__nv_bfloat16* p, const float (&v)[kPack]) {
  uint4 raw;
  auto* h = reinterpret_cast<__nv_bfloat162*>(&raw);
#pragma unroll
  for (int k = 0; k < kPack / 2; ++k) h[k] = __floats2bfloat162_rn(v[2 * k], v[2 * k + 1]);
  *reinterpret_cast<uint4*>(p) = raw;
}

// W elements from p[0..W): a pack when W == kPack (p aligned), else one at a time.
template <int W, typename T>
__device__ __forceinline__ void load_n(const T* p, float (&v)[W]) {
  if constexpr (W == kPack) {
    load_pack(p, v);
  } else {
#pragma unroll
    for (int j = 0; j < W; ++j) v[j] = load(p, j);
  }
}
template <int W, typename T>
__device__ __forceinline__ void store_n(T* p, const float (&v)[W]) {
  if constexpr (W == kPack) {
    store_pack(p, v);
  } else {
#pragma unroll
    for (int j = 0; j < W; ++j) store(p, j, v[j]);
  }
}

// v[0..kPack) added to p[0..kPack) atomically element by element (p 16-byte aligned): two
// float4 atomics where the GPU has them (compute capability 9.0 on, global memory; each
// element's add is atomic, not the four together), else one per element.
__device__ __forceinline__ void atomic_add_pack(float* p, const float (&v)[kPack]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  atomicAdd(reinterpret_cast<float4*>(p), make_float4(v[0], v[1], v[2], v[3]));
  atomicAdd(reinterpret_cast<float4*>(p) + 1, make_float4(v[4], v[5], v[6], v[7]));
#else
#pragma unroll
  for (int k = 0; k < kPack; ++k) atomicAdd(p + k, v[k]);
#endif
}

// A pack of kPack elements copied as they are (16-byte words, no conversion: bit for bit, NaN
// payloads included); both pointers 16-byte aligned.
template <typename T>
__device__ __forceinline__ void copy_pack(const T* src, T* dst) {
  constexpr int kWords = int(sizeof(T)) * kPack / 16;
#pragma unroll
  for (int k = 0; k < kWords; ++k)
    reinterpret_cast<uint4*>(dst)[k] = reinterpret_cast<const uint4*>(src)[k];
}
template <typename T>
__device__ __forceinline__ void zero_pack(T* dst) {
  constexpr int kWords = int(sizeof(T)) * kPack / 16;
#pragma unroll
  for (int k = 0; k < kWords; ++k) reinterpret_cast<uint4*>(dst)[k] = make_uint4(0, 0, 0, 0);
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
