// attention_merge: folds one key block's attention result into a running one (ring attention),
// the online-softmax step of the flash kernel done between blocks. Elementwise f32 over
// (token, head) rows; no workspace, no allocation. The blocks themselves come from
// attention_forward.cpp.
#include <algorithm>
#include <cmath>
#include <limits>
#include <string_view>

#include "kernels/cpu/ops.h"
#include "kernels/kernel_checks.h"

namespace shardlm::cpu {

// out, out_b [N, Hq, Dh] or [B, T, Hq, Dh] with N = B * T; lse, lse_b [B, Hq, T]; out and lse
// overwritten with the attention over both key sets
void attention_merge(const Tensor& out, const Tensor& lse, const Tensor& out_b,
                     const Tensor& lse_b) {
  const std::string_view op = "attention_merge";
  SHARDLM_CHECK(out.rank() == 3 || out.rank() == 4,
                "{}: out must be [N, Hq, Dh] or [B, T, Hq, Dh], got shape {}", op,
                out.shape().str());
  check_tensor(out, DType::kF32, out.rank(), op, "out [N, Hq, Dh] or [B, T, Hq, Dh]");
  check_tensor(out_b, DType::kF32, out.rank(), op, "out_b (out's shape)");
  check_same_shape(out_b, out, op, "out_b", "out");
  check_tensor(lse, DType::kF32, 3, op, "lse [B, Hq, T]");
  check_tensor(lse_b, DType::kF32, 3, op, "lse_b [B, Hq, T]");
  check_same_shape(lse_b, lse, op, "lse_b", "lse");
  const int64_t B = lse.dim(0), Hq = lse.dim(1), T = lse.dim(2);
  const int rank = out.rank();
  const int64_t Dh = out.dim(rank - 1);
  const bool tokens_match = rank == 4 ? out.dim(0) == B && out.dim(1) == T : out.dim(0) == B * T;
  SHARDLM_CHECK(tokens_match && out.dim(rank - 2) == Hq,
                "{}: out is {} but lse is {}; out must be [B * T, Hq, Dh] or [B, T, Hq, Dh] with "
                "lse's B, Hq, T",
                op, out.shape().str(), lse.shape().str());
  if (lse.numel() == 0) return;                                 // no (token, head) rows
  float* o = out.numel() == 0 ? nullptr : out.f32();            // [B * T, Hq, Dh]
  const float* o_b = out.numel() == 0 ? nullptr : out_b.f32();  // [B * T, Hq, Dh]
  float* l = lse.f32();                                         // [B, Hq, T]
  const float* l_b = lse_b.f32();                               // [B, Hq, T]
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();

#pragma omp parallel for schedule(static)
  for (int64_t row = 0; row < B * T; ++row) {
    const int64_t b = row / T;
    const int64_t t = row % T;
    for (int64_t h = 0; h < Hq; ++h) {
      const int64_t i = (b * Hq + h) * T + t;
      float* o_row = o + (row * Hq + h) * Dh;
      const float* o_b_row = o_b + (row * Hq + h) * Dh;
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
      for (int64_t x = 0; x < Dh; ++x) o_row[x] = w * o_row[x] + w_b * o_b_row[x];
      l[i] = m + std::log1p(e);
    }
  }
}

}  // namespace shardlm::cpu
