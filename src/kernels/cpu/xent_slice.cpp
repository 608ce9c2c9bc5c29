// The non-GEMM parts of the vocabulary-parallel cross-entropy on the CPU (backend.h,
// xent_slice_*): per row of a rank's logits slice [n, Vs], its max, then its sum of
// exp(logit - max) and the target's logit where the slice holds it, and finally the loss and
// the in-place softmax gradient from the statistics reduced over the ranks. Also the same
// statistics folded over slices walked one after another (xent_slice_fold, online softmax).
// Rows in parallel (OpenMP); sums of exponentials and the loss in f64, like lm_head_loss. The
// logits are f32 or bf16 (read as f32; the gradient is computed in f32 and rounded once into
// them), the statistics f32. Under a final-logit soft cap (softcap > 0) every logit is capped
// as it is read, softcap * tanh(logit / softcap), and the gradient taken through the cap; the
// logits in memory are never capped. No allocation.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "kernels/cpu/element.h"
#include "kernels/cpu/ops.h"

namespace shardlm::cpu {
namespace {

// targets [n]: each in [0, vocab) or kIgnoreIndex, checked after the ops wrote their rows: a
// bad target's row has the statistics (0, 0) of an ignored one, as a device's kernels leave it
// when they flag the id for the next read (the queued backend runs these ops that late too)
void check_targets(const int32_t* pt, int64_t n, int64_t vocab) {
  for (int64_t r = 0; r < n; ++r) {
    SHARDLM_CHECK_KIND(ErrorKind::kData, pt[r] == kIgnoreIndex || (pt[r] >= 0 && pt[r] < vocab),
                       "target id {} at token {} is outside the vocabulary [0, {}) and is not "
                       "the ignore index {}; check the tokenizer / data vocab size",
                       pt[r], r, vocab, kIgnoreIndex);
  }
}

// A stored logit as the loss sees it: capped when softcap > 0.
template <typename T>
inline float logit_at(const T* p, float softcap) {
  const float x = load(p);
  return softcap > 0.0f ? softcap * std::tanh(x / softcap) : x;
}

// row [Vs] -> max(init, its elements)
template <typename T>
float max_of_row(const T* row, int64_t vs, float init, float softcap) {
  float mx = init;
  for (int64_t j = 0; j < vs; ++j) mx = std::max(mx, logit_at(row + j, softcap));
  return mx;
}

// row [Vs] -> sum_j exp(row[j] - mx) in f64: each term is in (0, 1], f64 keeps ~1e5 terms exact
// enough
template <typename T>
double sum_exp_of_row(const T* row, int64_t vs, float mx, float softcap) {
  double sum_exp = 0.0;
  for (int64_t j = 0; j < vs; ++j) sum_exp += std::exp(logit_at(row + j, softcap) - mx);
  return sum_exp;
}

// row [Vs] of ids [vocab_begin, +Vs) -> the target's logit where it holds the target, else 0
template <typename T>
float target_logit_of_row(const T* row, int64_t vs, int32_t t, int64_t vocab_begin, float softcap) {
  const int64_t local = int64_t{t} - vocab_begin;
  return local >= 0 && local < vs ? logit_at(row + local, softcap) : 0.0f;
}

// logits [n, Vs] -> row_max [n]
template <typename T>
void row_max_of(const T* pl, float* pm, int64_t n, int64_t vs, float softcap) {
#pragma omp parallel for schedule(static) if (n * vs > 32768)
  for (int64_t r = 0; r < n; ++r) pm[r] = max_of_row(pl + r * vs, vs, -INFINITY, softcap);
}

// logits [n, Vs] of ids [vocab_begin, +Vs); targets [n] (a bad one's row as an ignored one's,
// raised after); stats [n, 2] overwritten
template <typename T>
void stats_of(const T* pl, const int32_t* pt, int64_t vocab_begin, int64_t vocab, const float* pm,
              float* ps, int64_t n, int64_t vs, float softcap) {
#pragma omp parallel for schedule(static) if (n * vs > 32768)
  for (int64_t r = 0; r < n; ++r) {
    const int32_t t = pt[r];
    if (t == kIgnoreIndex || t < 0 || t >= vocab) {  // ignored, or bad (raised after)
      ps[2 * r] = ps[2 * r + 1] = 0.0f;
      continue;
    }
    const T* row = pl + r * vs;
    ps[2 * r] = static_cast<float>(sum_exp_of_row(row, vs, pm[r], softcap));
    ps[2 * r + 1] = target_logit_of_row(row, vs, t, vocab_begin, softcap);
  }
}

// logits [n, Vs] of ids [vocab_begin, +Vs); targets [n] (a bad one's row as an ignored one's,
// raised after); row_max [n] and stats [n, 2] hold the slices before (unread when first) and are
// updated in place
template <typename T>
void fold_rows(const T* pl, const int32_t* pt, int64_t vocab_begin, int64_t vocab, float* pm,
               float* ps, int64_t n, int64_t vs, bool first, float softcap) {
#pragma omp parallel for schedule(static) if (n * vs > 32768)
  for (int64_t r = 0; r < n; ++r) {
    const T* row = pl + r * vs;
    const float old_max = first ? -INFINITY : pm[r];
    const float mx = max_of_row(row, vs, old_max, softcap);
    pm[r] = mx;
    const int32_t t = pt[r];
    if (t == kIgnoreIndex || t < 0 || t >= vocab) {  // ignored, or bad (raised after)
      ps[2 * r] = ps[2 * r + 1] = 0.0f;
      continue;
    }
    // A zero old sum carries nothing, and its max may be -inf (no slice before, or empty ones):
    // skipping it keeps exp(-inf - -inf) out.
    const double old_sum = first ? 0.0 : double{ps[2 * r]};
    const double carried = old_sum == 0.0 ? 0.0 : old_sum * std::exp(double{old_max} - double{mx});
    const float old_target = first ? 0.0f : ps[2 * r + 1];
    ps[2 * r] = static_cast<float>(carried + sum_exp_of_row(row, vs, mx, softcap));
    ps[2 * r + 1] = old_target + target_logit_of_row(row, vs, t, vocab_begin, softcap);
  }
}

// A row [Vs] of uncapped logits in place -> the gradient through the cap: (softmax of the
// capped logits - onehot) * grad_scale times 1 - tanh^2, in f32 and rounded once.
template <typename T>
void capped_row_gradient(T* row, int64_t vs, int64_t local, float mx, float p_scale,
                         float grad_scale, float softcap) {
  for (int64_t j = 0; j < vs; ++j) {
    const float th = std::tanh(load(row + j) / softcap);
    float g = std::exp(softcap * th - mx) * p_scale;
    if (j == local) g -= grad_scale;
    store(row + j, g * (1.0f - th * th));
  }
}

// logits [n, Vs] in place -> dlogits (want_grad); the loss sum and the valid rows' count
template <typename T>
LossResult finish_rows(T* pl, const int32_t* pt, int64_t vocab_begin, const float* pm,
                       const float* ps, float grad_scale, bool want_grad, int64_t n, int64_t vs,
                       float softcap) {
  double loss = 0.0;
  int64_t valid = 0;
#pragma omp parallel for schedule(static) reduction(+ : loss, valid) if (n * vs > 32768)
  for (int64_t r = 0; r < n; ++r) {
    T* row = pl + r * vs;
    const int32_t t = pt[r];
    // Ignored, or a bad target's row (statistics (0, 0); a row with a target sums at least 1)
    if (t == kIgnoreIndex || ps[2 * r] == 0.0f) {
      if (want_grad) std::fill(row, row + vs, T{});  // all-zero bits: +0 in f32 and bf16
      continue;
    }
    const double sum_exp = ps[2 * r];
    loss += std::log(sum_exp) + static_cast<double>(pm[r]) - static_cast<double>(ps[2 * r + 1]);
    ++valid;
    if (!want_grad) continue;
    // dlogits = (softmax - onehot(target)) * grad_scale on this slice
    const float p_scale = static_cast<float>(grad_scale / sum_exp);
    const int64_t local = int64_t{t} - vocab_begin;
    if (softcap > 0.0f) {
      capped_row_gradient(row, vs, local, pm[r], p_scale, grad_scale, softcap);
      continue;
    }
    const bool holds_target = local >= 0 && local < vs;
    const float target_logit = holds_target ? load(row + local) : 0.0f;
    for (int64_t j = 0; j < vs; ++j) store(row + j, std::exp(load(row + j) - pm[r]) * p_scale);
    if (holds_target) {
      // The target's softmax term in f32: f32 storage holds it exactly; bf16 storage rounded
      // it, so it is recomputed and the gradient rounded once.
      const float p =
          std::is_same_v<T, float> ? load(row + local) : std::exp(target_logit - pm[r]) * p_scale;
      store(row + local, p - grad_scale);
    }
  }
  return {loss, valid};
}

}  // namespace

// logits [n, Vs]; row_max [n] overwritten
void xent_slice_max(const Tensor& logits, const Tensor& row_max, float softcap) {
  const int64_t n = logits.dim(0), vs = logits.dim(1);
  with_float(logits, [&](auto tag) {
    using T = decltype(tag);
    row_max_of(elems<T>(logits), row_max.f32(), n, vs, softcap);
  });
}

// logits [n, Vs] of ids [vocab_begin, vocab_begin + Vs); targets [n]; row_max [n] (reduced);
// stats [n, 2] overwritten: (sum of exp(logit - max), target logit or 0)
void xent_slice_stats(const Tensor& logits, const Tensor& targets, int64_t vocab_begin,
                      int64_t vocab, const Tensor& row_max, const Tensor& stats, float softcap) {
  const int64_t n = logits.dim(0), vs = logits.dim(1);
  const int32_t* pt = targets.i32();
  with_float(logits, [&](auto tag) {
    using T = decltype(tag);
    stats_of(elems<T>(logits), pt, vocab_begin, vocab, row_max.f32(), stats.f32(), n, vs, softcap);
  });
  check_targets(pt, n, vocab);
}

// logits [n, Vs] of ids [vocab_begin, vocab_begin + Vs); targets [n]; row_max [n] and
// stats [n, 2] folded in place (overwritten unread when first)
void xent_slice_fold(const Tensor& logits, const Tensor& targets, int64_t vocab_begin,
                     int64_t vocab, const Tensor& row_max, const Tensor& stats, bool first,
                     float softcap) {
  const int64_t n = logits.dim(0), vs = logits.dim(1);
  const int32_t* pt = targets.i32();
  with_float(logits, [&](auto tag) {
    using T = decltype(tag);
    fold_rows(elems<T>(logits), pt, vocab_begin, vocab, row_max.f32(), stats.f32(), n, vs, first,
              softcap);
  });
  check_targets(pt, n, vocab);
}

// logits [n, Vs] in place -> dlogits (want_grad); row_max [n], stats [n, 2] reduced
LossResult xent_slice_finish(const Tensor& logits, const Tensor& targets, int64_t vocab_begin,
                             const Tensor& row_max, const Tensor& stats, float grad_scale,
                             bool want_grad, float softcap) {
  const int64_t n = logits.dim(0), vs = logits.dim(1);
  return with_float(logits, [&](auto tag) {
    using T = decltype(tag);
    return finish_rows(elems<T>(logits), targets.i32(), vocab_begin, row_max.f32(), stats.f32(),
                       grad_scale, want_grad, n, vs, softcap);
  });
}

}  // namespace shardlm::cpu
