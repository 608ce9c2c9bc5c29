// Row-wise CUDA kernels: RMSNorm forward (alone or after the residual add) and backward (weights
// w_offset + w), and RoPE on one
// tensor or on q and k in one launch. Each kernel is written once over packs of V elements: V =
// kPack (16-byte accesses) where every row it packs starts 16-byte aligned and its extent is a
// multiple of kPack, else V = 1 (the scalar path, any shape or view). f32 arithmetic; RMSNorm's row
// sums and RoPE's angles in f64, as the CPU reference.
#include <algorithm>
#include <type_traits>

#include "kernels/cuda/common.cuh"

namespace shardlm::cuda {
namespace {

constexpr int kThreads = 256;

// One block per row of x [N, D]; the row's sum of squares in f64. The second pass reads the row
// again from L1/L2 (a row is a few KiB), not from HBM. kAdd: the row is x + addend, summed in
// f32 and stored rounded into sum (x itself, the residual stream) by the first pass, and the norm
// is of the stored values (each thread reads back what it wrote), as add then the norm alone.
template <typename T, int V, bool kAdd>
__global__ void rmsnorm_forward_kernel(const T* x, const T* addend, T* sum, const T* w, float off,
                                       float eps, T* y, float* rstd, int64_t D) {
  __shared__ double shared[32];
  const int64_t r = blockIdx.x;
  const T* xr = x + r * D;
  double ss = 0.0;
  for (int64_t j = threadIdx.x * int64_t(V); j < D; j += int64_t(blockDim.x) * V) {
    float v[V];
    load_n<V>(xr + j, v);
    if constexpr (kAdd) {
      float a[V];
      load_n<V>(addend + r * D + j, a);
#pragma unroll
      for (int k = 0; k < V; ++k) v[k] += a[k];
      store_n<V>(sum + r * D + j, v);
      load_n<V>(sum + r * D + j, v);  // rounded as stored
    }
#pragma unroll
    for (int k = 0; k < V; ++k) ss += double(v[k]) * double(v[k]);
  }
  ss = block_sum(ss, shared);
  const float rs = float(1.0 / sqrt(ss / double(D) + double(eps)));
  if (threadIdx.x == 0) rstd[r] = rs;
  const T* nr = kAdd ? sum + r * D : xr;  // the row normed
  T* yr = y + r * D;
  for (int64_t j = threadIdx.x * int64_t(V); j < D; j += int64_t(blockDim.x) * V) {
    float v[V], g[V];
    load_n<V>(nr + j, v);
    load_n<V>(w + j, g);
#pragma unroll
    for (int k = 0; k < V; ++k) v[k] = v[k] * rs * (off + g[k]);
    store_n<V>(yr + j, v);
  }
}

// dx [N, D] accumulates: one block per row, the row's dot(dy * w, x) in f64.
template <typename T, int V>
__global__ void rmsnorm_backward_dx_kernel(const T* x, const T* w, float off, const float* rstd,
                                           const T* dy, T* dx, int64_t D) {
  __shared__ double shared[32];
  const int64_t r = blockIdx.x;
  const T *xr = x + r * D, *dyr = dy + r * D;
  T* dxr = dx + r * D;
  double dot = 0.0;
  for (int64_t j = threadIdx.x * int64_t(V); j < D; j += int64_t(blockDim.x) * V) {
    float xv[V], wv[V], dv[V];
    load_n<V>(xr + j, xv);
    load_n<V>(w + j, wv);
    load_n<V>(dyr + j, dv);
#pragma unroll
    for (int k = 0; k < V; ++k) dot += double(dv[k]) * double(off + wv[k]) * double(xv[k]);
  }
  dot = block_sum(dot, shared);
  const double rs = rstd[r];
  const float a = float(rs), c = float(rs * rs * rs * dot / double(D));
  for (int64_t j = threadIdx.x * int64_t(V); j < D; j += int64_t(blockDim.x) * V) {
    float xv[V], wv[V], dv[V], out[V];
    load_n<V>(xr + j, xv);
    load_n<V>(w + j, wv);
    load_n<V>(dyr + j, dv);
    load_n<V>(dxr + j, out);
#pragma unroll
    for (int k = 0; k < V; ++k) out[k] = out[k] + a * (off + wv[k]) * dv[k] - c * xv[k];
    store_n<V>(dxr + j, out);
  }
}

// dw [D] f32 += sum over rows of dy * x * rstd: blocks of kRowsPerBlock rows, each thread V
// adjacent columns, the block's partials added atomically.
constexpr int64_t kRowsPerBlock = 64;
template <typename T, int V>
__global__ void rmsnorm_backward_dw_kernel(const T* x, const float* rstd, const T* dy, float* dw,
                                           int64_t N, int64_t D) {
  const int64_t j = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) * V;
  if (j >= D) return;
  for (int64_t r0 = blockIdx.y * kRowsPerBlock; r0 < N; r0 += int64_t(gridDim.y) * kRowsPerBlock) {
    const int64_t r1 = min(N, r0 + kRowsPerBlock);
    float acc[V] = {};
    for (int64_t r = r0; r < r1; ++r) {
      float xv[V], dv[V];
      load_n<V>(x + r * D + j, xv);
      load_n<V>(dy + r * D + j, dv);
      const float rs = rstd[r];
#pragma unroll
      for (int k = 0; k < V; ++k) acc[k] += dv[k] * xv[k] * rs;
    }
#pragma unroll
    for (int k = 0; k < V; ++k) atomicAdd(&dw[j + k], acc[k]);
  }
}

// RoPE on one token per block: the cos/sin of a tile of the token's angles in f64, once, into
// shared memory, then every head of q [N, Hq, Dh] and k [N, Hk, Dh] (k may be absent: Hk = 0)
// rotated with them, packs of V pairs per item. Pair i of a head is (i, i + freqs) or,
// kInterleaved, (2i, 2i + 1); dims from 2 * freqs on are not touched (partial rotary).
// direction +1 forward, -1 backward.
constexpr int kRopeThreads = 128;
constexpr int kRopeTile = 256;  // frequencies per shared-memory tile (a multiple of kPack)
template <typename T, int V, bool kInterleaved>
__global__ void rope_kernel(T* q, int64_t Hq, T* k, int64_t Hk, const int32_t* pos,
                            const float* inv_freq, int64_t Dh, int64_t freqs, float direction) {
  __shared__ float cs[kRopeTile], sn[kRopeTile];
  const int64_t t = blockIdx.x;
  T* q_row = q + t * Hq * Dh;
  T* k_row = k + t * Hk * Dh;  // k is null only when Hk = 0
  const double p = pos[t];
  for (int64_t i0 = 0; i0 < freqs; i0 += kRopeTile) {
    const int width = int(min(int64_t(kRopeTile), freqs - i0));
    __syncthreads();  // the previous tile's table is no longer read
    for (int i = threadIdx.x; i < width; i += blockDim.x) {
      double s, c;
      sincos(p * double(inv_freq[i0 + i]), &s, &c);
      cs[i] = float(c);
      sn[i] = direction * float(s);
    }
    __syncthreads();
    const int packs = width / V;  // width % V == 0 on the packed path
    for (int64_t item = threadIdx.x; item < (Hq + Hk) * packs; item += blockDim.x) {
      const int64_t h = item / packs;
      const int i = int(item % packs) * V;
      T* head = h < Hq ? q_row + h * Dh : k_row + (h - Hq) * Dh;
      if constexpr (kInterleaved) {  // V pairs side by side: 2V consecutive elements
        float v[2 * V];
        load_n<2 * V>(head + 2 * (i0 + i), v);
#pragma unroll
        for (int j = 0; j < V; ++j) {
          const float c = cs[i + j], s = sn[i + j], a = v[2 * j], b = v[2 * j + 1];
          v[2 * j] = a * c - b * s;
          v[2 * j + 1] = b * c + a * s;
        }
        store_n<2 * V>(head + 2 * (i0 + i), v);
      } else {
        T* x1 = head + i0 + i;
        T* x2 = x1 + freqs;
        float a[V], b[V];
        load_n<V>(x1, a);
        load_n<V>(x2, b);
#pragma unroll
        for (int j = 0; j < V; ++j) {
          const float c = cs[i + j], s = sn[i + j], aj = a[j];
          a[j] = aj * c - b[j] * s;
          b[j] = b[j] * c + aj * s;
        }
        store_n<V>(x1, a);
        store_n<V>(x2, b);
      }
    }
  }
}

}  // namespace

cudaError_t launch_rmsnorm_forward(const void* x, const void* w, float w_offset, Elem t, float eps,
                                   void* y, float* rstd, int64_t N, int64_t D, cudaStream_t s) {
  if (N == 0) return cudaSuccess;
  const bool packed = D % kPack == 0 && all_aligned16(x, w, y);
  return dispatch(t, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const auto *xt = static_cast<const T*>(x), *wt = static_cast<const T*>(w);
    T* yt = static_cast<T*>(y);
    if (packed)
      rmsnorm_forward_kernel<T, kPack, false>
          <<<unsigned(N), kThreads, 0, s>>>(xt, nullptr, nullptr, wt, w_offset, eps, yt, rstd, D);
    else
      rmsnorm_forward_kernel<T, 1, false>
          <<<unsigned(N), kThreads, 0, s>>>(xt, nullptr, nullptr, wt, w_offset, eps, yt, rstd, D);
    return cudaGetLastError();
  });
}

cudaError_t launch_add_rmsnorm_forward(const void* x, void* residual, const void* w, float w_offset,
                                       Elem t, float eps, void* y, float* rstd, int64_t N,
                                       int64_t D, cudaStream_t s) {
  if (N == 0) return cudaSuccess;
  const bool packed = D % kPack == 0 && all_aligned16(x, residual, w, y);
  return dispatch(t, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const auto *xt = static_cast<const T*>(x), *wt = static_cast<const T*>(w);
    T *rt = static_cast<T*>(residual), *yt = static_cast<T*>(y);
    if (packed)
      rmsnorm_forward_kernel<T, kPack, true>
          <<<unsigned(N), kThreads, 0, s>>>(rt, xt, rt, wt, w_offset, eps, yt, rstd, D);
    else
      rmsnorm_forward_kernel<T, 1, true>
          <<<unsigned(N), kThreads, 0, s>>>(rt, xt, rt, wt, w_offset, eps, yt, rstd, D);
    return cudaGetLastError();
  });
}

cudaError_t launch_rmsnorm_backward(const void* x, const void* w, float w_offset, Elem t,
                                    const float* rstd, const void* dy, void* dx, float* dw,
                                    int64_t N, int64_t D, cudaStream_t s) {
  if (N == 0 || D == 0) return cudaSuccess;
  const bool packed = D % kPack == 0 && all_aligned16(x, w, dy, dx);
  return dispatch(t, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const auto *xt = static_cast<const T*>(x), *wt = static_cast<const T*>(w),
               *dyt = static_cast<const T*>(dy);
    T* dxt = static_cast<T*>(dx);
    const int v = packed ? kPack : 1;
    const dim3 grid(unsigned((D / v + kThreads - 1) / kThreads),
                    unsigned(std::min<int64_t>((N + kRowsPerBlock - 1) / kRowsPerBlock, 65535)));
    if (packed) {
      rmsnorm_backward_dx_kernel<T, kPack>
          <<<unsigned(N), kThreads, 0, s>>>(xt, wt, w_offset, rstd, dyt, dxt, D);
      rmsnorm_backward_dw_kernel<T, kPack><<<grid, kThreads, 0, s>>>(xt, rstd, dyt, dw, N, D);
    } else {
      rmsnorm_backward_dx_kernel<T, 1>
          <<<unsigned(N), kThreads, 0, s>>>(xt, wt, w_offset, rstd, dyt, dxt, D);
      rmsnorm_backward_dw_kernel<T, 1><<<grid, kThreads, 0, s>>>(xt, rstd, dyt, dw, N, D);
    }
    return cudaGetLastError();
  });
}

cudaError_t launch_rope(void* q, int64_t Hq, void* k, int64_t Hk, Elem t, const int32_t* positions,
                        const float* inv_freq, RopeDims d, float direction, cudaStream_t s) {
  if (d.N == 0 || Hq + Hk == 0 || d.freqs == 0) return cudaSuccess;
  // A pack moves kPack elements with 16-byte accesses: every head's start aligned (Dh and the
  // rows' base), and the rotated run a whole number of packs: kPack pairs of each half, or
  // kPack / 2 interleaved pairs.
  constexpr int kPairsInterleaved = kPack / 2;
  const int64_t pairs_per_pack = d.interleaved ? kPairsInterleaved : kPack;
  const bool packed = d.Dh % kPack == 0 && d.freqs % pairs_per_pack == 0 && aligned16(q) &&
                      (Hk == 0 || aligned16(k));
  return dispatch(t, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    T *qt = static_cast<T*>(q), *kt = static_cast<T*>(k);
    const auto grid = unsigned(d.N);
    if (d.interleaved && packed)
      rope_kernel<T, kPairsInterleaved, true><<<grid, kRopeThreads, 0, s>>>(
          qt, Hq, kt, Hk, positions, inv_freq, d.Dh, d.freqs, direction);
    else if (d.interleaved)
      rope_kernel<T, 1, true><<<grid, kRopeThreads, 0, s>>>(qt, Hq, kt, Hk, positions, inv_freq,
                                                            d.Dh, d.freqs, direction);
    else if (packed)
      rope_kernel<T, kPack, false><<<grid, kRopeThreads, 0, s>>>(
          qt, Hq, kt, Hk, positions, inv_freq, d.Dh, d.freqs, direction);
    else
      rope_kernel<T, 1, false><<<grid, kRopeThreads, 0, s>>>(qt, Hq, kt, Hk, positions, inv_freq,
                                                             d.Dh, d.freqs, direction);
    return cudaGetLastError();
  });
}

}  // namespace shardlm::cuda
