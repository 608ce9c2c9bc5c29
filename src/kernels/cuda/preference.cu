// The preference objectives' kernels: each segment's summed target log-probabilities (one block
// per segment walking every row in a fixed order, then a fixed-shape block reduction), each
// pair's coefficients and metrics (one thread, pair by pair, through preference_loss.h's math,
// the trainer's own), and the token weights gathered from the coefficients. Deterministic: no
// floating-point atomics. Segment ids outside [-1, S) are skipped here; the backend flags them
// (launch_flag_ids) and raises them at the next result read.
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/preference_launch.h"

namespace shardlm::cuda {
namespace {

constexpr int kSumThreads = 256;

// Block s: thread t adds rows t, t + blockDim, ... of segment s (a fixed order per thread),
// then the block's sum in a fixed shape (block_sum). Counts are exact in f64.
__global__ void segment_logp_sums_kernel(const float* __restrict__ row_max,
                                         const float* __restrict__ stats,
                                         const int32_t* __restrict__ segments, int64_t n,
                                         double* __restrict__ sums) {
  __shared__ double shared[32];
  const int32_t s = int32_t(blockIdx.x);
  double sum = 0, count = 0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    if (segments[i] != s) continue;
    const float e = stats[2 * i];
    if (e == 0.f) continue;  // no target: statistics (0, 0)
    // log softmax at the target: its (capped) logit - max - log(sum of exp(logit - max))
    sum += double(stats[2 * i + 1]) - double(row_max[i]) - log(double(e));
    count += 1;
  }
  sum = block_sum(sum, shared);
  count = block_sum(count, shared);
  if (threadIdx.x == 0) {
    sums[2 * s] = sum;
    sums[2 * s + 1] = count;
  }
}

// One thread: the pairs in order (preference_loss.h's preference_pairs, the CPU op's loop too).
__global__ void preference_coefficients_kernel(PreferenceLossSpec loss,
                                               const double* __restrict__ policy,
                                               const double* __restrict__ reference, int64_t P,
                                               double norm, float* __restrict__ coef,
                                               double* __restrict__ metrics) {
  preference_pairs(loss, policy, reference, P, norm, coef, metrics);
}

__device__ __forceinline__ float weight_of(const float* coef, int64_t S, int32_t s) {
  return s >= 0 && s < S ? coef[s] : 0.f;  // -1 (and a flagged bad id): no segment
}

// Four tokens a thread with 16-byte loads and stores (segments and weights aligned), the
// rest one at a time.
__global__ void gather_weights_kernel(const float* __restrict__ coef, int64_t S,
                                      const int32_t* __restrict__ segments, int64_t n,
                                      float* __restrict__ weights, bool packed) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t quads = packed ? n / 4 : 0;
  for (int64_t q = i; q < quads; q += stride) {
    const int4 s = reinterpret_cast<const int4*>(segments)[q];
    reinterpret_cast<float4*>(weights)[q] =
        make_float4(weight_of(coef, S, s.x), weight_of(coef, S, s.y), weight_of(coef, S, s.z),
                    weight_of(coef, S, s.w));
  }
  for (int64_t j = quads * 4 + i; j < n; j += stride) weights[j] = weight_of(coef, S, segments[j]);
}

}  // namespace

cudaError_t launch_segment_logp_sums(const float* row_max, const float* stats,
                                     const int32_t* segments, int64_t n, int64_t S, double* sums,
                                     cudaStream_t s) {
  if (S == 0) return cudaSuccess;
  // S blocks on the grid's x extent (2^31 - 1): far beyond a micro-batch's sequences.
  segment_logp_sums_kernel<<<unsigned(S), kSumThreads, 0, s>>>(row_max, stats, segments, n, sums);
  return cudaGetLastError();
}

cudaError_t launch_preference_coefficients(const PreferenceLossSpec& loss, const double* policy,
                                           const double* reference, int64_t P, double norm,
                                           float* coef, double* metrics, cudaStream_t s) {
  preference_coefficients_kernel<<<1, 1, 0, s>>>(loss, policy, reference, P, norm, coef, metrics);
  return cudaGetLastError();
}

cudaError_t launch_gather_segment_weights(const float* coef, int64_t S, const int32_t* segments,
                                          int64_t n, float* weights, cudaStream_t s) {
  if (n == 0) return cudaSuccess;
  const bool packed = all_aligned16(segments, weights);
  gather_weights_kernel<<<grid_for(packed ? (n + 3) / 4 : n, kSumThreads), kSumThreads, 0, s>>>(
      coef, S, segments, n, weights, packed);
  return cudaGetLastError();
}

}  // namespace shardlm::cuda
