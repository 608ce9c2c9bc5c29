// The launchers of the preference objectives' kernels (preference.cu), apart from launch.h so
// that only these files see preference_loss.h (standard headers only, compiled by nvcc too).
// Plain pointers, extents and a stream; each enqueues on `s` and returns cudaGetLastError().
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "shardlm/backend/preference_loss.h"

namespace shardlm::cuda {

// Backend::segment_logp_sums: sums [S, 2] f64 over row_max [n] f32, stats [n, 2] f32 and
// segments [n] i32, one block per segment adding every row in a fixed order; ids outside
// [-1, S) belong to no segment (the caller flags them).
cudaError_t launch_segment_logp_sums(const float* row_max, const float* stats,
                                     const int32_t* segments, int64_t n, int64_t S, double* sums,
                                     cudaStream_t s);
// Backend::preference_coefficients over P pairs (reference null: none), one thread in order.
cudaError_t launch_preference_coefficients(const PreferenceLossSpec& loss, const double* policy,
                                           const double* reference, int64_t P, double norm,
                                           float* coef, double* metrics, cudaStream_t s);
// Backend::gather_segment_weights: weights [n] = coef[segments[i]] for ids in [0, S), else 0.
cudaError_t launch_gather_segment_weights(const float* coef, int64_t S, const int32_t* segments,
                                          int64_t n, float* weights, cudaStream_t s);

}  // namespace shardlm::cuda
