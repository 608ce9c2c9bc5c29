// The device index of packed documents for cuDNN's ragged (variable-length) SDPA: from the
// documents' token starts (Backend's DocumentSpans), each sequence's length and the element
// offsets of its first token in q/out, k/v and lse, padded with empty sequences up to the
// graph's bucketed count. One thread per sequence; the spans stay on the device, nothing is read
// back.
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/launch.h"

namespace shardlm::cuda {
namespace {

// starts [count + 1]; seq_len [docs]; q_off, kv_off, lse_off [docs + 1]
__global__ void ragged_index_kernel(const int32_t* starts, int64_t count, int64_t docs, int64_t T,
                                    int64_t Hq, int64_t Hkv, int64_t Dh, int32_t* seq_len,
                                    int32_t* q_off, int32_t* kv_off, int32_t* lse_off) {
  const int64_t d = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (d > docs) return;
  const int64_t tok = starts[d < count ? d : count];  // past count: the end of the tokens
  if (d < docs) seq_len[d] = d < count ? int32_t(starts[d + 1] - tok) : 0;
  q_off[d] = int32_t(tok * Hq * Dh);
  kv_off[d] = int32_t(tok * Hkv * Dh);
  lse_off[d] = int32_t(tok / T * Hq * T + tok % T);
}

}  // namespace

cudaError_t launch_ragged_index(const int32_t* starts, int64_t count, int64_t docs, int64_t T,
                                int64_t Hq, int64_t Hkv, int64_t Dh, int32_t* seq_len,
                                int32_t* q_off, int32_t* kv_off, int32_t* lse_off, cudaStream_t s) {
  constexpr int kThreads = 256;
  const unsigned blocks = unsigned((docs + 1 + kThreads - 1) / kThreads);
  ragged_index_kernel<<<blocks, kThreads, 0, s>>>(starts, count, docs, T, Hq, Hkv, Dh, seq_len,
                                                  q_off, kv_off, lse_off);
  return cudaGetLastError();
}

}  // namespace shardlm::cuda
