// Elementwise and row-wise CUDA kernels: conversion, add, scale, f64 sum of squares, SwiGLU,
// RoPE, embedding, RMSNorm, bias gradient and AdamW. Grid-stride loops; f32 arithmetic (f64
// where the CPU reference reduces in f64); bf16 or f32 storage of activations.
#include <algorithm>
#include <type_traits>

#include "kernels/cuda/common.cuh"

namespace shardlm::cuda {
namespace {

constexpr int kThreads = 256;

#define GRID_STRIDE(i, n)                                                   \
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < (n); \
       i += int64_t(gridDim.x) * blockDim.x)

template <typename S, typename D>
__global__ void convert_kernel(const S* src, D* dst, int64_t n) {
  GRID_STRIDE(i, n) store(dst, i, load(src, i));
}

template <typename T>
__global__ void add_kernel(const T* a, const T* b, T* out, int64_t n) {
  GRID_STRIDE(i, n) store(out, i, load(a, i) + load(b, i));
}

template <typename T>
__global__ void scale_kernel(T* x, float f, int64_t n) {
  GRID_STRIDE(i, n) store(x, i, load(x, i) * f);
}

// SplitMix64's finaliser, as the CPU dropout kernel hashes (seed, element).
__host__ __device__ inline uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

// Kept when the hash's top 24 bits, as a fraction of 2^24, are >= p (threshold = p * 2^24).
template <typename T>
__global__ void dropout_kernel(const T* x, T* out, int64_t n, uint32_t threshold, float keep_scale,
                               uint64_t key, int64_t first) {
  GRID_STRIDE(i, n) {
    const uint32_t r = uint32_t(mix64(key ^ uint64_t(first + i)) >> 40);
    store(out, i, r >= threshold ? load(x, i) * keep_scale : 0.f);
  }
}

template <typename T>
__global__ void sum_squares_partial(const T* x, int64_t n, double* partials) {
  __shared__ double shared[32];
  double acc = 0.0;
  GRID_STRIDE(i, n) {
    const double v = load(x, i);
    acc += v * v;
  }
  acc = block_sum(acc, shared);
  if (threadIdx.x == 0) partials[blockIdx.x] = acc;
}

__global__ void sum_partials(const double* partials, int count, double* result) {
  __shared__ double shared[32];
  double acc = 0.0;
  for (int i = threadIdx.x; i < count; i += blockDim.x) acc += partials[i];
  acc = block_sum(acc, shared);
  if (threadIdx.x == 0) *result = acc;
}

__device__ __forceinline__ float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

template <typename T>
__global__ void swiglu_forward_kernel(const T* gate, const T* up, T* h, int64_t n) {
  GRID_STRIDE(i, n) {
    const float g = load(gate, i);
    store(h, i, g * sigmoid(g) * load(up, i));
  }
}

template <typename T>
__global__ void swiglu_backward_kernel(const T* gate, const T* up, const T* dh, T* dgate, T* dup,
                                       int64_t n) {
  GRID_STRIDE(i, n) {
    const float g = load(gate, i), u = load(up, i), d = load(dh, i);
    const float sg = sigmoid(g);
    const float silu = g * sg;
    store(dup, i, d * silu);
    store(dgate, i, d * u * sg * (1.0f + g * (1.0f - sg)));
  }
}

// One thread per (token, pair index i): the angle's cos/sin in f64 once, applied to every head.
template <typename T>
__global__ void rope_kernel(T* x, const int32_t* pos, const float* inv_freq, int64_t N, int64_t H,
                            int64_t Dh, float direction) {
  const int64_t half = Dh / 2;
  GRID_STRIDE(idx, N * half) {
    const int64_t t = idx / half, i = idx % half;
    double sn, cs;
    sincos(double(pos[t]) * double(inv_freq[i]), &sn, &cs);
    const float c = float(cs), s = direction * float(sn);
    T* row = x + t * H * Dh;
    for (int64_t h = 0; h < H; ++h) {
      const int64_t j = h * Dh + i;
      const float a = load(row, j), b = load(row, j + half);
      store(row, j, a * c - b * s);
      store(row, j + half, b * c + a * s);
    }
  }
}

__global__ void check_ids_kernel(const int32_t* ids, int64_t n, int64_t V, bool allow_ignore,
                                 int32_t* bad) {
  GRID_STRIDE(i, n) {
    const int32_t t = ids[i];
    const bool ok = (t >= 0 && t < V) || (allow_ignore && t == -1);
    if (!ok) {
      const int32_t mark = int32_t(i < 2147483646 ? i + 1 : 2147483647);
      if (atomicMin(&bad[0], mark) > mark) atomicExch(&bad[1], t);
    }
  }
}

template <typename T>
__global__ void embedding_forward_kernel(const int32_t* tokens, const T* table, T* out, int64_t N,
                                         int64_t D, int64_t begin, int64_t rows) {
  GRID_STRIDE(i, N * D) {
    const int64_t r = i / D, c = i % D, local = int64_t(tokens[r]) - begin;
    if (local >= 0 && local < rows)
      out[i] = table[local * D + c];
    else
      store(out, i, 0.f);  // another rank's row (vocabulary-parallel)
  }
}

template <typename T>
__global__ void embedding_backward_kernel(const int32_t* tokens, const T* dout, float* dtable,
                                          int64_t N, int64_t D, int64_t begin, int64_t rows) {
  GRID_STRIDE(i, N * D) {
    const int64_t r = i / D, c = i % D, local = int64_t(tokens[r]) - begin;
    if (local >= 0 && local < rows) atomicAdd(&dtable[local * D + c], load(dout, i));
  }
}

// One block per row; the row's sum of squares in f64 (as the CPU reference).
template <typename T>
__global__ void rmsnorm_forward_kernel(const T* x, const T* w, float eps, T* y, float* rstd,
                                       int64_t D) {
  __shared__ double shared[32];
  const int64_t r = blockIdx.x;
  const T* xr = x + r * D;
  double ss = 0.0;
  for (int64_t j = threadIdx.x; j < D; j += blockDim.x) {
    const double v = load(xr, j);
    ss += v * v;
  }
  ss = block_sum(ss, shared);
  const float rs = float(1.0 / sqrt(ss / double(D) + double(eps)));
  if (threadIdx.x == 0) rstd[r] = rs;
  T* yr = y + r * D;
  for (int64_t j = threadIdx.x; j < D; j += blockDim.x) store(yr, j, load(xr, j) * rs * load(w, j));
}

// dx: one block per row (accumulates into dx). dw: a separate column kernel.
template <typename T>
__global__ void rmsnorm_backward_dx_kernel(const T* x, const T* w, const float* rstd, const T* dy,
                                           T* dx, int64_t D) {
  __shared__ double shared[32];
  const int64_t r = blockIdx.x;
  const T *xr = x + r * D, *dyr = dy + r * D;
  T* dxr = dx + r * D;
  double dot = 0.0;
  for (int64_t j = threadIdx.x; j < D; j += blockDim.x)
    dot += double(load(dyr, j)) * double(load(w, j)) * double(load(xr, j));
  dot = block_sum(dot, shared);
  const double rs = rstd[r];
  const float a = float(rs), c = float(rs * rs * rs * dot / double(D));
  for (int64_t j = threadIdx.x; j < D; j += blockDim.x)
    store(dxr, j, load(dxr, j) + a * load(w, j) * load(dyr, j) - c * load(xr, j));
}

// dw[j] += sum over rows of dy * x * rstd: blocks of rows, one thread per column, the block's
// partial added atomically.
constexpr int64_t kRowsPerBlock = 64;
template <typename T>
__global__ void rmsnorm_backward_dw_kernel(const T* x, const float* rstd, const T* dy, float* dw,
                                           int64_t N, int64_t D) {
  const int64_t j = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (j >= D) return;
  for (int64_t r0 = blockIdx.y * kRowsPerBlock; r0 < N; r0 += int64_t(gridDim.y) * kRowsPerBlock) {
    const int64_t r1 = min(N, r0 + kRowsPerBlock);
    float acc = 0.f;
    for (int64_t r = r0; r < r1; ++r) acc += load(dy, r * D + j) * load(x, r * D + j) * rstd[r];
    atomicAdd(&dw[j], acc);
  }
}

template <typename T>
__global__ void column_sum_kernel(const T* dy, float* db, int64_t N, int64_t cols) {
  const int64_t j = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (j >= cols) return;
  for (int64_t r0 = blockIdx.y * kRowsPerBlock; r0 < N; r0 += int64_t(gridDim.y) * kRowsPerBlock) {
    const int64_t r1 = min(N, r0 + kRowsPerBlock);
    float acc = 0.f;
    for (int64_t r = r0; r < r1; ++r) acc += load(dy, r * cols + j);
    atomicAdd(&db[j], acc);
  }
}

__global__ void adamw_kernel(float* p, const float* g, float* m, float* v, int64_t n, float beta1,
                             float beta2, float omb1, float omb2, float step_size,
                             float inv_sqrt_bc2, float eps, float decay, float grad_scale) {
  GRID_STRIDE(i, n) {
    const float gi = g[i] * grad_scale;
    const float mi = beta1 * m[i] + omb1 * gi;
    const float vi = beta2 * v[i] + omb2 * gi * gi;
    m[i] = mi;
    v[i] = vi;
    const float denom = sqrtf(vi) * inv_sqrt_bc2 + eps;
    p[i] = p[i] * decay - step_size * mi / denom;
  }
}

}  // namespace

cudaError_t launch_convert(const void* src, Elem src_t, void* dst, Elem dst_t, int64_t n,
                           cudaStream_t s) {
  if (n == 0) return cudaSuccess;
  const unsigned g = grid_for(n, kThreads);
  if (src_t == Elem::kF32 && dst_t == Elem::kBF16)
    convert_kernel<<<g, kThreads, 0, s>>>(static_cast<const float*>(src),
                                          static_cast<__nv_bfloat16*>(dst), n);
  else if (src_t == Elem::kBF16 && dst_t == Elem::kF32)
    convert_kernel<<<g, kThreads, 0, s>>>(static_cast<const __nv_bfloat16*>(src),
                                          static_cast<float*>(dst), n);
  else if (src_t == Elem::kF32)
    convert_kernel<<<g, kThreads, 0, s>>>(static_cast<const float*>(src), static_cast<float*>(dst),
                                          n);
  else
    convert_kernel<<<g, kThreads, 0, s>>>(static_cast<const __nv_bfloat16*>(src),
                                          static_cast<__nv_bfloat16*>(dst), n);
  return cudaGetLastError();
}

cudaError_t launch_add(const void* a, const void* b, void* out, Elem t, int64_t n, cudaStream_t s) {
  if (n == 0) return cudaSuccess;
  return dispatch(t, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    add_kernel<<<grid_for(n, kThreads), kThreads, 0, s>>>(
        static_cast<const T*>(a), static_cast<const T*>(b), static_cast<T*>(out), n);
    return cudaGetLastError();
  });
}

cudaError_t launch_scale(void* x, Elem t, float factor, int64_t n, cudaStream_t s) {
  if (n == 0) return cudaSuccess;
  return dispatch(t, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    scale_kernel<<<grid_for(n, kThreads), kThreads, 0, s>>>(static_cast<T*>(x), factor, n);
    return cudaGetLastError();
  });
}

cudaError_t launch_dropout(const void* x, void* out, Elem t, int64_t n, float p, uint64_t seed,
                           int64_t first, cudaStream_t s) {
  if (n == 0) return cudaSuccess;
  const uint32_t threshold = uint32_t(double(p) * double(1u << 24));
  return dispatch(t, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    dropout_kernel<<<grid_for(n, kThreads), kThreads, 0, s>>>(static_cast<const T*>(x),
                                                              static_cast<T*>(out), n, threshold,
                                                              1.f / (1.f - p), mix64(seed), first);
    return cudaGetLastError();
  });
}

cudaError_t launch_sum_squares(const void* x, Elem t, int64_t n, double* partials, double* result,
                               cudaStream_t s) {
  const unsigned blocks = grid_for(n, kThreads, kSumBlocks);
  return dispatch(t, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    sum_squares_partial<<<blocks, kThreads, 0, s>>>(static_cast<const T*>(x), n, partials);
    sum_partials<<<1, kThreads, 0, s>>>(partials, int(blocks), result);
    return cudaGetLastError();
  });
}

cudaError_t launch_swiglu_forward(const void* gate, const void* up, void* h, Elem t, int64_t n,
                                  cudaStream_t s) {
  if (n == 0) return cudaSuccess;
  return dispatch(t, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    swiglu_forward_kernel<<<grid_for(n, kThreads), kThreads, 0, s>>>(
        static_cast<const T*>(gate), static_cast<const T*>(up), static_cast<T*>(h), n);
    return cudaGetLastError();
  });
}

cudaError_t launch_swiglu_backward(const void* gate, const void* up, const void* dh, void* dgate,
                                   void* dup, Elem t, int64_t n, cudaStream_t s) {
  if (n == 0) return cudaSuccess;
  return dispatch(t, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    swiglu_backward_kernel<<<grid_for(n, kThreads), kThreads, 0, s>>>(
        static_cast<const T*>(gate), static_cast<const T*>(up), static_cast<const T*>(dh),
        static_cast<T*>(dgate), static_cast<T*>(dup), n);
    return cudaGetLastError();
  });
}

cudaError_t launch_rope(void* x, Elem t, const int32_t* positions, const float* inv_freq, int64_t N,
                        int64_t H, int64_t Dh, float direction, cudaStream_t s) {
  const int64_t n = N * (Dh / 2);
  if (n == 0 || H == 0) return cudaSuccess;
  return dispatch(t, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    rope_kernel<<<grid_for(n, kThreads), kThreads, 0, s>>>(static_cast<T*>(x), positions, inv_freq,
                                                           N, H, Dh, direction);
    return cudaGetLastError();
  });
}

cudaError_t launch_check_ids(const int32_t* ids, int64_t n, int64_t V, bool allow_ignore,
                             int32_t* bad, cudaStream_t s) {
  const int32_t init[2] = {2147483647, 0};
  cudaError_t e = cudaMemcpyAsync(bad, init, sizeof(init), cudaMemcpyHostToDevice, s);
  if (e != cudaSuccess || n == 0) return e;
  check_ids_kernel<<<grid_for(n, kThreads), kThreads, 0, s>>>(ids, n, V, allow_ignore, bad);
  return cudaGetLastError();
}

cudaError_t launch_embedding_forward(const int32_t* tokens, const void* table, void* out, Elem t,
                                     int64_t N, int64_t D, int64_t vocab_begin, int64_t rows,
                                     cudaStream_t s) {
  if (N * D == 0) return cudaSuccess;
  return dispatch(t, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    embedding_forward_kernel<<<grid_for(N * D, kThreads), kThreads, 0, s>>>(
        tokens, static_cast<const T*>(table), static_cast<T*>(out), N, D, vocab_begin, rows);
    return cudaGetLastError();
  });
}

cudaError_t launch_embedding_backward(const int32_t* tokens, const void* dout, Elem t,
                                      float* dtable, int64_t N, int64_t D, int64_t vocab_begin,
                                      int64_t rows, cudaStream_t s) {
  if (N * D == 0) return cudaSuccess;
  return dispatch(t, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    embedding_backward_kernel<<<grid_for(N * D, kThreads), kThreads, 0, s>>>(
        tokens, static_cast<const T*>(dout), dtable, N, D, vocab_begin, rows);
    return cudaGetLastError();
  });
}

cudaError_t launch_rmsnorm_forward(const void* x, const void* w, Elem t, float eps, void* y,
                                   float* rstd, int64_t N, int64_t D, cudaStream_t s) {
  if (N == 0) return cudaSuccess;
  return dispatch(t, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    rmsnorm_forward_kernel<<<unsigned(N), kThreads, 0, s>>>(
        static_cast<const T*>(x), static_cast<const T*>(w), eps, static_cast<T*>(y), rstd, D);
    return cudaGetLastError();
  });
}

cudaError_t launch_rmsnorm_backward(const void* x, const void* w, Elem t, const float* rstd,
                                    const void* dy, void* dx, float* dw, int64_t N, int64_t D,
                                    cudaStream_t s) {
  if (N == 0 || D == 0) return cudaSuccess;
  return dispatch(t, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    rmsnorm_backward_dx_kernel<<<unsigned(N), kThreads, 0, s>>>(
        static_cast<const T*>(x), static_cast<const T*>(w), rstd, static_cast<const T*>(dy),
        static_cast<T*>(dx), D);
    const dim3 grid(unsigned((D + kThreads - 1) / kThreads),
                    unsigned(std::min<int64_t>((N + kRowsPerBlock - 1) / kRowsPerBlock, 65535)));
    rmsnorm_backward_dw_kernel<<<grid, kThreads, 0, s>>>(static_cast<const T*>(x), rstd,
                                                         static_cast<const T*>(dy), dw, N, D);
    return cudaGetLastError();
  });
}

cudaError_t launch_column_sum(const void* dy, Elem t, float* db, int64_t N, int64_t cols,
                              cudaStream_t s) {
  if (N == 0 || cols == 0) return cudaSuccess;
  return dispatch(t, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const dim3 grid(unsigned((cols + kThreads - 1) / kThreads),
                    unsigned(std::min<int64_t>((N + kRowsPerBlock - 1) / kRowsPerBlock, 65535)));
    column_sum_kernel<<<grid, kThreads, 0, s>>>(static_cast<const T*>(dy), db, N, cols);
    return cudaGetLastError();
  });
}

cudaError_t launch_adamw(float* p, const float* g, float* m, float* v, int64_t n, float beta1,
                         float beta2, float one_minus_beta1, float one_minus_beta2, float step_size,
                         float inv_sqrt_bc2, float eps, float decay, float grad_scale,
                         cudaStream_t s) {
  if (n == 0) return cudaSuccess;
  adamw_kernel<<<grid_for(n, kThreads), kThreads, 0, s>>>(
      p, g, m, v, n, beta1, beta2, one_minus_beta1, one_minus_beta2, step_size, inv_sqrt_bc2, eps,
      decay, grad_scale);
  return cudaGetLastError();
}

}  // namespace shardlm::cuda
