// The preference objectives' ops on the CPU: each segment's summed target log-probabilities,
// each pair's coefficients and metrics (preference_loss.h's math), and the token weights.
// Serial loops in the contract's order: the sums are the trainer's host sums bit for bit. This
// file is compiled without floating-point contraction (CMakeLists.txt), as the trainer's
// preference.cpp is.
#include <algorithm>
#include <cmath>

#include "kernels/cpu/ops.h"
#include "shardlm/backend/preference_loss.h"

namespace shardlm::cpu {
namespace {

// Every id of segments [n] in [-1, S), checked before the op writes anything.
void check_segment_ids(const Tensor& segments, int64_t S, const char* op) {
  const int32_t* seg = segments.i32();
  for (int64_t i = 0; i < segments.numel(); ++i)
    SHARDLM_CHECK(seg[i] >= -1 && seg[i] < S,
                  "{}: segments[{}] = {} is outside [-1, {}) (-1: no segment; S = {} segments)", op,
                  i, seg[i], S, S);
}

}  // namespace

void segment_logp_sums(const Tensor& row_max, const Tensor& stats, const Tensor& segments,
                       const Tensor& sums) {
  const int64_t n = row_max.numel(), S = sums.dim(0);
  check_segment_ids(segments, S, "segment_logp_sums");
  const float* m = row_max.f32();  // [n]
  const float* st = stats.f32();   // [n, 2]
  const int32_t* seg = segments.i32();
  double* out = sums.f64();  // [S, 2]
  std::fill(out, out + 2 * S, 0.0);
  for (int64_t i = 0; i < n; ++i) {
    // A row without a target has the statistics (0, 0); one with a target sums to at least 1.
    if (seg[i] < 0 || st[2 * i] == 0.f) continue;
    // log softmax at the target: its (capped) logit - max - log(sum of exp(logit - max))
    out[2 * seg[i]] += double(st[2 * i + 1]) - double(m[i]) - std::log(double(st[2 * i]));
    out[2 * seg[i] + 1] += 1;
  }
}

void preference_coefficients(const PreferenceLossSpec& loss, const Tensor& policy,
                             const Tensor& reference, double norm, const Tensor& coef,
                             const Tensor& metrics) {
  preference_pairs(loss, policy.f64(), reference.empty() ? nullptr : reference.f64(),
                   policy.dim(0) / 2, norm, coef.f32(), metrics.f64());
}

void gather_segment_weights(const Tensor& coef, const Tensor& segments, const Tensor& weights) {
  check_segment_ids(segments, coef.numel(), "gather_segment_weights");
  const float* c = coef.f32();
  const int32_t* seg = segments.i32();
  float* w = weights.f32();
  for (int64_t i = 0; i < weights.numel(); ++i) w[i] = seg[i] >= 0 ? c[seg[i]] : 0.f;
}

}  // namespace shardlm::cpu
