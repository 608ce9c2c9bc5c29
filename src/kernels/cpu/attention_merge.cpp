// attention_merge: folds one key block's attention result into a running one (ring attention),
// the online-softmax step of the flash kernel done between blocks. Elementwise over (token,
// head) rows: out and out_b f32 or bf16 (one dtype; a merged row is computed in f32 and rounded
// once), lse f32; no workspace, no allocation. The blocks themselves come from
// attention_forward.cpp.
#include <algorithm>
#include <cmath>
#include <limits>
#include <string_view>

#include "kernels/cpu/element.h"
#include "kernels/cpu/ops.h"

namespace shardlm::cpu {
namespace {

// o, o_b [B * T, Hq, Dh]; l, l_b [B, Hq, T]; o and l merged in place
template <typename T>
void merge_rows(T* o, float* l, const T* o_b, const float* l_b, int64_t B, int64_t seq_len,
                int64_t Hq, int64_t Dh) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
#pragma omp parallel for schedule(static)
  for (int64_t row = 0; row < B * seq_len; ++row) {
    const int64_t b = row / seq_len;
    const int64_t t = row % seq_len;
    for (int64_t h = 0; h < Hq; ++h) {
      const int64_t i = (b * Hq + h) * seq_len + t;
      T* o_row = o + (row * Hq + h) * Dh;
      const T* o_b_row = o_b + (row * Hq + h) * Dh;
      // A side with lse = -inf saw no key: its out is not read, so it contributes exactly nothing.
      if (l_b[i] == kNegInf) continue;
      if (l[i] == kNegInf) {
        std::copy_n(o_b_row, Dh, o_row);
        l[i] = l_b[i];
        continue;
      }
      // Weights relative to the larger lse: 1 for that side, e = exp(-|lse - lse_b|) <= 1 for
      // the other; the merged lse is max + log(1 + e).
      const float m = std::max(l[i], l_b[i]);
      const float e = std::exp(std::min(l[i], l_b[i]) - m);
      const float inv_sum = 1.0f / (1.0f + e);
      const float w = (l[i] >= l_b[i] ? 1.0f : e) * inv_sum;
      const float w_b = (l[i] >= l_b[i] ? e : 1.0f) * inv_sum;
      for (int64_t x = 0; x < Dh; ++x)
        store(o_row + x, w * load(o_row + x) + w_b * load(o_b_row + x));
      l[i] = m + std::log1p(e);
    }
  }
}

}  // namespace

// out, out_b [N, Hq, Dh] or [B, T, Hq, Dh] with N = B * T, one dtype; lse, lse_b [B, Hq, T] f32;
// out and lse overwritten with the attention over both key sets
void attention_merge(const Tensor& out, const Tensor& lse, const Tensor& out_b,
                     const Tensor& lse_b) {
  const int64_t B = lse.dim(0), Hq = lse.dim(1), T = lse.dim(2);
  const int64_t Dh = out.dim(out.rank() - 1);
  if (lse.numel() == 0) return;  // no (token, head) rows
  with_float(out, [&](auto tag) {
    using E = decltype(tag);
    // out has no elements when Dh = 0: its rows are never touched, only lse merges
    E* o = out.numel() == 0 ? nullptr : elems<E>(out);
    const E* o_b = out.numel() == 0 ? nullptr : elems<E>(out_b);
    merge_rows(o, lse.f32(), o_b, lse_b.f32(), B, T, Hq, Dh);
  });
}

}  // namespace shardlm::cpu
