// Elementwise CUDA kernels: conversion, add, scale, dropout, f64 sum of squares, SwiGLU, GeGLU, id
// checks, embedding and the bias gradient. Grid-stride loops; f32 arithmetic (f64 where the CPU
// reference reduces in f64); bf16 or f32 storage of activations. The maps (convert, add, scale,
// dropout, SwiGLU, GeGLU, the embedding forward and backward) move packs of 16-byte accesses
// where their pointers and row widths allow (map_kernel), as does the bias gradient's column
// sum; else the same arithmetic one element at a time.
// RMSNorm and RoPE: norm_rope.cu; AdamW: adamw.cu.
#include <algorithm>
#include <type_traits>

#include "kernels/cuda/common.cuh"

namespace shardlm::cuda {
namespace {

constexpr int kThreads = 256;

#define GRID_STRIDE(i, n)                                                   \
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < (n); \
       i += int64_t(gridDim.x) * blockDim.x)

// Runs op.apply<W>(i) over [0, n): packs of V elements, then the last n % V one at a time.
// op.apply<W>(i) reads and writes elements [i, i + W) of its tensors only, so an output may
// alias an input.
template <int V, typename Op>
__global__ void map_kernel(Op op, int64_t n) {
  const int64_t packs = n / V;
  GRID_STRIDE(i, packs) op.template apply<V>(i * V);
  if constexpr (V > 1) {
    const int64_t lane = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
    if (lane < n - packs * V) op.template apply<1>(packs * V + lane);
  }
}

// Packed when every pointer the op moves is 16-byte aligned (the caller says), else scalar.
template <typename Op>
cudaError_t launch_map(const Op& op, int64_t n, bool packed, cudaStream_t s) {
  if (n == 0) return cudaSuccess;
  if (packed)
    map_kernel<kPack><<<grid_for(n / kPack, kThreads), kThreads, 0, s>>>(op, n);
  else
    map_kernel<1><<<grid_for(n, kThreads), kThreads, 0, s>>>(op, n);
  return cudaGetLastError();
}

// dst = src in dst's type
template <typename S, typename D>
struct ConvertOp {
  const S* src;
  D* dst;
  template <int W>
  __device__ void apply(int64_t i) const {
    float v[W];
    load_n<W>(src + i, v);
    store_n<W>(dst + i, v);
  }
};

// out = a + b
template <typename T>
struct AddOp {
  const T *a, *b;
  T* out;
  template <int W>
  __device__ void apply(int64_t i) const {
    float x[W], y[W];
    load_n<W>(a + i, x);
    load_n<W>(b + i, y);
#pragma unroll
    for (int j = 0; j < W; ++j) x[j] += y[j];
    store_n<W>(out + i, x);
  }
};

// x *= f
template <typename T>
struct ScaleOp {
  T* x;
  float f;
  template <int W>
  __device__ void apply(int64_t i) const {
    float v[W];
    load_n<W>(x + i, v);
#pragma unroll
    for (int j = 0; j < W; ++j) v[j] *= f;
    store_n<W>(x + i, v);
  }
};

// x [n / cols, cols]: element i times factors[i / cols]
template <typename T>
__global__ void scale_rows_kernel(T* x, const float* factors, int64_t n, int64_t cols) {
  GRID_STRIDE(i, n) { store(x, i, load(x, i) * factors[i / cols]); }
}

// SplitMix64's finaliser, as the CPU dropout kernel hashes (seed, element).
__host__ __device__ inline uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

// Kept when the hash's top 24 bits, as a fraction of 2^24, are >= p (threshold = p * 2^24).
// x [n / width, width] (one row when width == n): element i is element (i / width, i % width)
// of a matrix with rows row_stride apart, hashed at that position.
template <typename T>
struct DropoutOp {
  const T* x;
  T* out;
  uint32_t threshold;
  float keep_scale;
  uint64_t key;
  int64_t first, width, row_stride;
  template <int W>
  __device__ void apply(int64_t i) const {
    float v[W];
    load_n<W>(x + i, v);
#pragma unroll
    for (int j = 0; j < W; ++j) {
      const int64_t at = first + ((i + j) / width) * row_stride + (i + j) % width;
      const uint32_t r = uint32_t(mix64(key ^ uint64_t(at)) >> 40);
      v[j] = r >= threshold ? v[j] * keep_scale : 0.f;
    }
    store_n<W>(out + i, v);
  }
};

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

// The gate activations of the gated MLPs: h = act(g) * u, and the gradients of dh through it
// (each in the arithmetic order it always had).
// silu: dup = dh * silu(gate); dgate = dh * up * silu'(gate)
struct Silu {
  __device__ static float h(float g, float u) { return g * sigmoid(g) * u; }
  __device__ static void grads(float g, float u, float d, float& dgate, float& dup) {
    const float sg = sigmoid(g);
    const float silu = g * sg;
    dgate = d * u * sg * (1.0f + g * (1.0f - sg));
    dup = d * silu;
  }
};

// gelu_tanh(g) = 0.5 g (1 + tanh(u)) = g sigmoid(2u), u = sqrt(2/pi) (g + 0.044715 g^3)
constexpr float kGeluK = 0.7978845608028654f;
constexpr float kGeluC = 0.044715f;
__device__ __forceinline__ float gelu_sigmoid(float g) {
  return sigmoid(2.0f * kGeluK * (g + kGeluC * g * g * g));
}

// dup = dh * gelu_tanh(gate); dgate = dh * up * gelu_tanh'(gate), with gelu_tanh'(g) =
// s + 2 g s (1 - s) sqrt(2/pi) (1 + 3 * 0.044715 g^2), s = sigmoid(2u)
struct GeluTanh {
  __device__ static float h(float g, float u) { return g * gelu_sigmoid(g) * u; }
  __device__ static void grads(float g, float u, float d, float& dgate, float& dup) {
    const float s = gelu_sigmoid(g);
    const float grad = s + 2.0f * g * s * (1.0f - s) * kGeluK * (1.0f + 3.0f * kGeluC * g * g);
    const float gelu = g * s;
    dgate = d * u * grad;
    dup = d * gelu;
  }
};

// h = act(gate) * up
template <typename T, typename Act>
struct GatedForwardOp {
  const T *gate, *up;
  T* h;
  template <int W>
  __device__ void apply(int64_t i) const {
    float g[W], u[W];
    load_n<W>(gate + i, g);
    load_n<W>(up + i, u);
#pragma unroll
    for (int j = 0; j < W; ++j) g[j] = Act::h(g[j], u[j]);
    store_n<W>(h + i, g);
  }
};

template <typename T, typename Act>
struct GatedBackwardOp {
  const T *gate, *up, *dh;
  T *dgate, *dup;
  template <int W>
  __device__ void apply(int64_t i) const {
    float g[W], u[W], d[W];
    load_n<W>(gate + i, g);
    load_n<W>(up + i, u);
    load_n<W>(dh + i, d);
#pragma unroll
    for (int j = 0; j < W; ++j) {
      float dg, du;
      Act::grads(g[j], u[j], d[j], dg, du);
      g[j] = dg;
      u[j] = du;
    }
    store_n<W>(dgate + i, g);
    store_n<W>(dup + i, u);
  }
};

// The first bad id's position and value in one word (position in the high half), so that one
// atomicMin keeps both of the same token: a separate store of the value could land after a later
// token's and name that one.
__global__ void check_ids_kernel(const int32_t* ids, int64_t n, int64_t V, bool allow_ignore,
                                 unsigned long long* bad) {
  GRID_STRIDE(i, n) {
    const int32_t t = ids[i];
    const bool ok = (t >= 0 && t < V) || (allow_ignore && t == -1);
    if (!ok) {
      const unsigned long long pos = i < 0xfffffffe ? (unsigned long long)(i) : 0xfffffffeull;
      atomicMin(bad, (pos << 32) | (unsigned long long)(uint32_t(t)));
    }
  }
}

// Where element i of the activations [N, D] lies in this rank's table [rows, D]: row
// tokens[i / D] - begin, column i % D; -1 where that row is another rank's
// (vocabulary-parallel). The forward and the backward map each element, or each pack (which
// lies in one row: packed only when D is a multiple of kPack), through it.
struct EmbeddingRows {
  const int32_t* tokens;
  int64_t D, begin, rows;
  __device__ int64_t table_index(int64_t i) const {
    const int64_t local = int64_t(tokens[i / D]) - begin;
    return local >= 0 && local < rows ? local * D + i % D : -1;
  }
};

// out [N, D] row r = table row tokens[r] - begin, copied; zeros where that row is another
// rank's.
template <typename T>
struct EmbeddingForwardOp {
  EmbeddingRows at;
  const T* table;
  T* out;
  template <int W>
  __device__ void apply(int64_t i) const {
    if constexpr (W == kPack) {
      const int64_t t = at.table_index(i);
      if (t >= 0)
        copy_pack(table + t, out + i);
      else
        zero_pack(out + i);
    } else {
#pragma unroll
      for (int j = 0; j < W; ++j) {
        const int64_t t = at.table_index(i + j);
        if (t >= 0)
          out[i + j] = table[t];
        else
          store(out, i + j, 0.f);
      }
    }
  }
};

// dtable [rows, D] (f32) row tokens[r] - begin += dout row r, atomically (tokens repeat).
template <typename T>
struct EmbeddingBackwardOp {
  EmbeddingRows at;
  const T* dout;
  float* dtable;
  template <int W>
  __device__ void apply(int64_t i) const {
    if constexpr (W == kPack) {
      const int64_t t = at.table_index(i);
      if (t < 0) return;
      float v[kPack];
      load_pack(dout + i, v);
      atomic_add_pack(dtable + t, v);
    } else {
#pragma unroll
      for (int j = 0; j < W; ++j) {
        const int64_t t = at.table_index(i + j);
        if (t >= 0) atomicAdd(&dtable[t], load(dout, i + j));
      }
    }
  }
};

// Bias gradient: blocks of kRowsPerBlock rows, one thread per W columns (W = kPack: one pack,
// when cols is a multiple of kPack and the pointers are aligned), each column summed over the
// block's rows in order, the block's partial added atomically.
constexpr int64_t kRowsPerBlock = 64;
template <int W, typename T>
__global__ void column_sum_kernel(const T* dy, float* db, int64_t N, int64_t cols) {
  const int64_t j = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) * W;
  if (j >= cols) return;
  for (int64_t r0 = blockIdx.y * kRowsPerBlock; r0 < N; r0 += int64_t(gridDim.y) * kRowsPerBlock) {
    const int64_t r1 = min(N, r0 + kRowsPerBlock);
    float acc[W] = {};
    for (int64_t r = r0; r < r1; ++r) {
      float v[W];
      load_n<W>(dy + r * cols + j, v);
#pragma unroll
      for (int k = 0; k < W; ++k) acc[k] += v[k];
    }
    if constexpr (W == kPack)
      atomic_add_pack(db + j, acc);
    else
      atomicAdd(&db[j], acc[0]);
  }
}

}  // namespace

cudaError_t launch_convert(const void* src, Elem src_t, void* dst, Elem dst_t, int64_t n,
                           cudaStream_t s) {
  const bool packed = all_aligned16(src, dst);
  return dispatch(src_t, [&](auto* src_tag) {
    using S = std::remove_pointer_t<decltype(src_tag)>;
    return dispatch(dst_t, [&](auto* dst_tag) {
      using D = std::remove_pointer_t<decltype(dst_tag)>;
      return launch_map(ConvertOp<S, D>{static_cast<const S*>(src), static_cast<D*>(dst)}, n,
                        packed, s);
    });
  });
}

cudaError_t launch_add(const void* a, const void* b, void* out, Elem t, int64_t n, cudaStream_t s) {
  return dispatch(t, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const AddOp<T> op{static_cast<const T*>(a), static_cast<const T*>(b), static_cast<T*>(out)};
    return launch_map(op, n, all_aligned16(a, b, out), s);
  });
}

cudaError_t launch_scale(void* x, Elem t, float factor, int64_t n, cudaStream_t s) {
  return dispatch(t, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    return launch_map(ScaleOp<T>{static_cast<T*>(x), factor}, n, aligned16(x), s);
  });
}

cudaError_t launch_scale_rows(void* x, Elem t, const float* factors, int64_t rows, int64_t cols,
                              cudaStream_t s) {
  const int64_t n = rows * cols;
  if (n == 0) return cudaSuccess;
  return dispatch(t, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    scale_rows_kernel<<<grid_for(n, kThreads), kThreads, 0, s>>>(static_cast<T*>(x), factors, n,
                                                                 cols);
    return cudaGetLastError();
  });
}

cudaError_t launch_dropout(const void* x, void* out, Elem t, int64_t n, float p, uint64_t seed,
                           int64_t first, int64_t width, int64_t row_stride, cudaStream_t s) {
  if (n == 0) return cudaSuccess;
  const uint32_t threshold = uint32_t(double(p) * double(1u << 24));
  // A pack stays in one row: one row only, or rows of whole packs.
  const bool packed = all_aligned16(x, out) && (width == n || width % kPack == 0);
  return dispatch(t, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const DropoutOp<T> op{static_cast<const T*>(x),
                          static_cast<T*>(out),
                          threshold,
                          1.f / (1.f - p),
                          mix64(seed),
                          first,
                          width,
                          row_stride};
    return launch_map(op, n, packed, s);
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

namespace {

template <typename Act>
cudaError_t launch_gated_forward(const void* gate, const void* up, void* h, Elem t, int64_t n,
                                 cudaStream_t s) {
  return dispatch(t, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const GatedForwardOp<T, Act> op{static_cast<const T*>(gate), static_cast<const T*>(up),
                                    static_cast<T*>(h)};
    return launch_map(op, n, all_aligned16(gate, up, h), s);
  });
}

template <typename Act>
cudaError_t launch_gated_backward(const void* gate, const void* up, const void* dh, void* dgate,
                                  void* dup, Elem t, int64_t n, cudaStream_t s) {
  return dispatch(t, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const GatedBackwardOp<T, Act> op{static_cast<const T*>(gate), static_cast<const T*>(up),
                                     static_cast<const T*>(dh), static_cast<T*>(dgate),
                                     static_cast<T*>(dup)};
    return launch_map(op, n, all_aligned16(gate, up, dh, dgate, dup), s);
  });
}

}  // namespace

cudaError_t launch_swiglu_forward(const void* gate, const void* up, void* h, Elem t, int64_t n,
                                  cudaStream_t s) {
  return launch_gated_forward<Silu>(gate, up, h, t, n, s);
}

cudaError_t launch_swiglu_backward(const void* gate, const void* up, const void* dh, void* dgate,
                                   void* dup, Elem t, int64_t n, cudaStream_t s) {
  return launch_gated_backward<Silu>(gate, up, dh, dgate, dup, t, n, s);
}

cudaError_t launch_geglu_forward(const void* gate, const void* up, void* h, Elem t, int64_t n,
                                 cudaStream_t s) {
  return launch_gated_forward<GeluTanh>(gate, up, h, t, n, s);
}

cudaError_t launch_geglu_backward(const void* gate, const void* up, const void* dh, void* dgate,
                                  void* dup, Elem t, int64_t n, cudaStream_t s) {
  return launch_gated_backward<GeluTanh>(gate, up, dh, dgate, dup, t, n, s);
}

cudaError_t launch_flag_ids(const int32_t* ids, int64_t n, int64_t V, bool allow_ignore,
                            uint64_t* bad, cudaStream_t s) {
  static_assert(sizeof(uint64_t) == sizeof(unsigned long long));
  if (n == 0) return cudaSuccess;
  check_ids_kernel<<<grid_for(n, kThreads), kThreads, 0, s>>>(
      ids, n, V, allow_ignore, reinterpret_cast<unsigned long long*>(bad));
  return cudaGetLastError();
}

cudaError_t launch_embedding_forward(const int32_t* tokens, const void* table, void* out, Elem t,
                                     int64_t N, int64_t D, int64_t vocab_begin, int64_t rows,
                                     cudaStream_t s) {
  if (N * D == 0) return cudaSuccess;
  const bool packed = D % kPack == 0 && all_aligned16(table, out);
  return dispatch(t, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const EmbeddingForwardOp<T> op{
        {tokens, D, vocab_begin, rows}, static_cast<const T*>(table), static_cast<T*>(out)};
    return launch_map(op, N * D, packed, s);
  });
}

cudaError_t launch_embedding_backward(const int32_t* tokens, const void* dout, Elem t,
                                      float* dtable, int64_t N, int64_t D, int64_t vocab_begin,
                                      int64_t rows, cudaStream_t s) {
  if (N * D == 0) return cudaSuccess;
  const bool packed = D % kPack == 0 && all_aligned16(dout, dtable);
  return dispatch(t, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const EmbeddingBackwardOp<T> op{
        {tokens, D, vocab_begin, rows}, static_cast<const T*>(dout), dtable};
    return launch_map(op, N * D, packed, s);
  });
}

cudaError_t launch_column_sum(const void* dy, Elem t, float* db, int64_t N, int64_t cols,
                              cudaStream_t s) {
  if (N == 0 || cols == 0) return cudaSuccess;
  const bool packed = cols % kPack == 0 && all_aligned16(dy, db);
  const int64_t threads_x = packed ? cols / kPack : cols;
  return dispatch(t, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const dim3 grid(unsigned((threads_x + kThreads - 1) / kThreads),
                    unsigned(std::min<int64_t>((N + kRowsPerBlock - 1) / kRowsPerBlock, 65535)));
    const T* d = static_cast<const T*>(dy);
    if (packed)
      column_sum_kernel<kPack><<<grid, kThreads, 0, s>>>(d, db, N, cols);
    else
      column_sum_kernel<1><<<grid, kThreads, 0, s>>>(d, db, N, cols);
    return cudaGetLastError();
  });
}

}  // namespace shardlm::cuda
