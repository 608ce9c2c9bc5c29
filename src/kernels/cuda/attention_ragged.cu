// The device index of packed documents for cuDNN's ragged (variable-length) SDPA: from the
// documents' token starts (Backend's DocumentSpans), each sequence's length and the element
// offsets of its first token in q/out, k/v and the token-major stats, padded with empty
// sequences up to the graph's bucketed count (one thread per sequence; the spans stay on the
// device, nothing is read back); and the stats' transposes between that layout and lse's.
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/launch.h"

namespace shardlm::cuda {
namespace {

// starts [count + 1]; seq_len [docs]; q_off, kv_off, lse_off [docs + 1]: documents first ..
// first + docs - 1
__global__ void ragged_index_kernel(const int32_t* starts, int64_t count, int64_t first,
                                    int64_t docs, int64_t Hq, int64_t Hkv, int64_t Dh,
                                    int32_t* seq_len, int32_t* q_off, int32_t* kv_off,
                                    int32_t* lse_off) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i > docs) return;
  const int64_t d = first + i;
  const int64_t tok = starts[d < count ? d : count];  // past count: the end of the tokens
  if (i < docs) seq_len[i] = d < count ? int32_t(starts[d + 1] - tok) : 0;
  q_off[i] = int32_t(tok * Hq * Dh);
  kv_off[i] = int32_t(tok * Hkv * Dh);
  lse_off[i] = int32_t(tok * Hq);
}

// stats [B * T, H] token-major <-> lse [B, H, T]; one thread per element, the token-major side
// coalesced.
__global__ void lse_layout_kernel(const float* src, float* dst, int64_t B, int64_t T, int64_t H,
                                  bool to_head_major) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= B * T * H) return;
  const int64_t tok = i / H, h = i % H;
  const int64_t head_major = (tok / T * H + h) * T + tok % T;
  if (to_head_major)
    dst[head_major] = src[i];
  else
    dst[i] = src[head_major];
}

}  // namespace

cudaError_t launch_ragged_index(const int32_t* starts, int64_t count, int64_t first, int64_t docs,
                                int64_t Hq, int64_t Hkv, int64_t Dh, int32_t* seq_len,
                                int32_t* q_off, int32_t* kv_off, int32_t* lse_off, cudaStream_t s) {
  constexpr int kThreads = 256;
  const unsigned blocks = unsigned((docs + 1 + kThreads - 1) / kThreads);
  ragged_index_kernel<<<blocks, kThreads, 0, s>>>(starts, count, first, docs, Hq, Hkv, Dh, seq_len,
                                                  q_off, kv_off, lse_off);
  return cudaGetLastError();
}

cudaError_t launch_lse_layout(const float* src, float* dst, int64_t B, int64_t T, int64_t H,
                              bool to_head_major, cudaStream_t s) {
  constexpr int kThreads = 256;
  const int64_t n = B * T * H;
  if (n == 0) return cudaSuccess;
  lse_layout_kernel<<<unsigned((n + kThreads - 1) / kThreads), kThreads, 0, s>>>(src, dst, B, T, H,
                                                                                 to_head_major);
  return cudaGetLastError();
}

}  // namespace shardlm::cuda
