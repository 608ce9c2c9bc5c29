// The non-GEMM parts of the vocabulary-parallel cross-entropy on the CPU (backend.h,
// xent_slice_*): per row of a rank's logits slice [n, Vs], its max, then its sum of
// exp(logit - max) and the target's logit where the slice holds it, and finally the loss and
// the in-place softmax gradient from the statistics reduced over the ranks. Rows in parallel
// (OpenMP); sums of exponentials and the loss in f64, like lm_head_loss. No allocation.
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "kernels/cpu/ops.h"

namespace shardlm::cpu {

// logits [n, Vs]; row_max [n] overwritten
void xent_slice_max(const Tensor& logits, const Tensor& row_max) {
  const int64_t n = logits.dim(0), vs = logits.dim(1);
  const float* pl = logits.f32();
  float* pm = row_max.f32();
#pragma omp parallel for schedule(static) if (n * vs > 32768)
  for (int64_t r = 0; r < n; ++r) {
    const float* row = pl + r * vs;
    float mx = -INFINITY;
    for (int64_t j = 0; j < vs; ++j) mx = std::max(mx, row[j]);
    pm[r] = mx;
  }
}

// logits [n, Vs] of ids [vocab_begin, vocab_begin + Vs); targets [n]; row_max [n] (reduced);
// stats [n, 2] overwritten: (sum of exp(logit - max), target logit or 0)
void xent_slice_stats(const Tensor& logits, const Tensor& targets, int64_t vocab_begin,
                      int64_t vocab, const Tensor& row_max, const Tensor& stats) {
  const int64_t n = logits.dim(0), vs = logits.dim(1);
  const int32_t* pt = targets.i32();
  for (int64_t r = 0; r < n; ++r) {
    SHARDLM_CHECK_KIND(ErrorKind::kData, pt[r] == kIgnoreIndex || (pt[r] >= 0 && pt[r] < vocab),
                       "target id {} at token {} is outside the vocabulary [0, {}) and is not "
                       "the ignore index {}; check the tokenizer / data vocab size",
                       pt[r], r, vocab, kIgnoreIndex);
  }
  const float* pl = logits.f32();
  const float* pm = row_max.f32();
  float* ps = stats.f32();
#pragma omp parallel for schedule(static) if (n * vs > 32768)
  for (int64_t r = 0; r < n; ++r) {
    const int32_t t = pt[r];
    if (t == kIgnoreIndex) {
      ps[2 * r] = ps[2 * r + 1] = 0.0f;
      continue;
    }
    const float* row = pl + r * vs;
    double sum_exp = 0.0;  // exp(x - max) is in (0, 1]: f64 keeps ~1e5 terms exact enough
    for (int64_t j = 0; j < vs; ++j) sum_exp += std::exp(row[j] - pm[r]);
    const int64_t local = int64_t{t} - vocab_begin;
    ps[2 * r] = static_cast<float>(sum_exp);
    ps[2 * r + 1] = local >= 0 && local < vs ? row[local] : 0.0f;
  }
}

// logits [n, Vs] in place -> dlogits (want_grad); row_max [n], stats [n, 2] reduced
LossResult xent_slice_finish(const Tensor& logits, const Tensor& targets, int64_t vocab_begin,
                             const Tensor& row_max, const Tensor& stats, float grad_scale,
                             bool want_grad) {
  const int64_t n = logits.dim(0), vs = logits.dim(1);
  const int32_t* pt = targets.i32();
  const float* pm = row_max.f32();
  const float* ps = stats.f32();
  float* pl = logits.f32();
  double loss = 0.0;
  int64_t valid = 0;
#pragma omp parallel for schedule(static) reduction(+ : loss, valid) if (n * vs > 32768)
  for (int64_t r = 0; r < n; ++r) {
    float* row = pl + r * vs;
    const int32_t t = pt[r];
    if (t == kIgnoreIndex) {
      if (want_grad) std::fill(row, row + vs, 0.0f);
      continue;
    }
    const double sum_exp = ps[2 * r];
    loss += std::log(sum_exp) + static_cast<double>(pm[r]) - static_cast<double>(ps[2 * r + 1]);
    ++valid;
    if (!want_grad) continue;
    // dlogits = (softmax - onehot(target)) * grad_scale on this slice
    const float p_scale = static_cast<float>(grad_scale / sum_exp);
    for (int64_t j = 0; j < vs; ++j) row[j] = std::exp(row[j] - pm[r]) * p_scale;
    const int64_t local = int64_t{t} - vocab_begin;
    if (local >= 0 && local < vs) row[local] -= grad_scale;
  }
  return {loss, valid};
}

}  // namespace shardlm::cpu
