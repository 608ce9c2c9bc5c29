// Argument checks and workspace queries of the CPU flash attention, shared by the forward and
// the backward (attention_forward.cpp, attention_backward.cpp). One workspace serves both
// directions, so the queries return the larger need. Checks only: no kernel code here.
#include <omp.h>

#include <algorithm>
#include <limits>
#include <string_view>

#include "kernels/cpu/attention_common.h"
#include "kernels/cpu/ops.h"
#include "kernels/kernel_checks.h"

namespace shardlm::cpu {

using namespace attn;  // NOLINT: the attention helpers are this file's vocabulary

AttnDims attn::check_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                               const Tensor& seg_start, int64_t q_offset, int64_t k_offset,
                               const Tensor& out, const Tensor& lse, std::string_view op) {
  check_tensor(q, DType::kF32, 4, op, "q [B, Tq, Hq, Dh]");
  check_tensor(k, DType::kF32, 4, op, "k [B, Tk, Hkv, Dh]");
  check_tensor(v, DType::kF32, 4, op, "v [B, Tk, Hkv, Dh]");
  check_same_shape(v, k, op, "v", "k");
  check_tensor(out, DType::kF32, 4, op, "out [B, Tq, Hq, Dh]");
  check_same_shape(out, q, op, "out", "q");
  check_tensor(lse, DType::kF32, 3, op, "lse [B, Hq, Tq]");
  check_tensor(seg_start, DType::kI32, 2, op, "seg_start [B, Tq]");
  const AttnDims d{q.dim(0), q.dim(1), k.dim(1), q.dim(2), k.dim(2), q.dim(3), q_offset, k_offset};
  SHARDLM_CHECK(k.dim(0) == d.B && k.dim(3) == d.Dh,
                "{}: k is {} but q is {}; k must be [B, Tk, Hkv, Dh] with q's B and Dh", op,
                k.shape().str(), q.shape().str());
  SHARDLM_CHECK(d.Hkv > 0 && d.Hq % d.Hkv == 0,
                "{}: Hq = {} must be a multiple of Hkv = {} (grouped-query attention)", op, d.Hq,
                d.Hkv);
  SHARDLM_CHECK(d.Dh > 0, "{}: head dim Dh must be positive, got {}", op, d.Dh);
  SHARDLM_CHECK(q_offset >= 0 && k_offset >= 0,
                "{}: q_offset = {} and k_offset = {} must be >= 0 (full-row indices of the blocks' "
                "first tokens)",
                op, q_offset, k_offset);
  // Lanes past a tile's end compute indices up to one vector beyond the block.
  constexpr int64_t kMaxIndex = std::numeric_limits<int32_t>::max() - 8;
  SHARDLM_CHECK(q_offset <= kMaxIndex - d.Tq && k_offset <= kMaxIndex - d.Tk,
                "{}: query block [{}, {}) or key block [{}, {}) does not fit the i32 positions of "
                "seg_start",
                op, q_offset, q_offset + d.Tq, k_offset, k_offset + d.Tk);
  SHARDLM_CHECK(lse.dim(0) == d.B && lse.dim(1) == d.Hq && lse.dim(2) == d.Tq,
                "{}: lse is {} but must be [B, Hq, Tq] = [{}, {}, {}]", op, lse.shape().str(), d.B,
                d.Hq, d.Tq);
  SHARDLM_CHECK(seg_start.dim(0) == d.B && seg_start.dim(1) == d.Tq,
                "{}: seg_start is {} but must be [B, Tq] = [{}, {}]", op, seg_start.shape().str(),
                d.B, d.Tq);
  const int32_t* seg = seg_start.numel() == 0 ? nullptr : seg_start.i32();
  for (int64_t b = 0; b < d.B; ++b) {
    for (int64_t t = 0; t < d.Tq; ++t) {
      const int32_t s = seg[b * d.Tq + t];
      SHARDLM_CHECK(s >= 0 && s <= q_offset + t,
                    "{}: seg_start[{}, {}] = {} must lie in [0, {}] (a token's document "
                    "starts at or before it; full-row indices)",
                    op, b, t, s, q_offset + t);
    }
  }
  return d;
}

void attn::check_full_row(const AttnDims& d, const Tensor& q, const Tensor& k,
                          std::string_view op) {
  SHARDLM_CHECK(d.Tk == d.Tq,
                "{}: k is {} but q is {}; k must be [B, T, Hkv, Dh] with q's T (a block of keys "
                "goes to attention_block_*)",
                op, k.shape().str(), q.shape().str());
}

size_t attention_block_workspace_bytes(int64_t B, int64_t Tq, int64_t Tk, int64_t Hq, int64_t Hkv,
                                       int64_t Dh) {
  const AttnDims d{B, Tq, Tk, Hq, Hkv, Dh, 0, 0};
  const int threads = omp_get_max_threads();
  return std::max(forward_workspace_bytes(d, threads), backward_workspace_bytes(d, threads));
}

size_t attention_workspace_bytes(int64_t B, int64_t T, int64_t Hq, int64_t Hkv, int64_t Dh) {
  return attention_block_workspace_bytes(B, T, T, Hq, Hkv, Dh);
}

}  // namespace shardlm::cpu
