// The CPU flash attention's own checks and its workspace queries, shared by the forward and the
// backward (attention_forward.cpp, attention_backward.cpp). One workspace serves both
// directions, so the queries return the larger need. Checks only: no kernel code here.
#include <omp.h>

#include <algorithm>
#include <limits>
#include <string_view>

#include "kernels/cpu/attention_common.h"
#include "kernels/cpu/ops.h"

namespace shardlm::cpu {

using namespace attn;  // NOLINT: the attention helpers are this file's vocabulary

AttnDims attn::check_attention(const Tensor& q, const Tensor& k, const Tensor& seg_start,
                               int64_t q_offset, int64_t k_offset, int64_t window, float softcap,
                               std::string_view op) {
  const AttnDims d{q.dim(0), q.dim(1), k.dim(1), q.dim(2), k.dim(2),
                   q.dim(3), q_offset, k_offset, window,   softcap};
  // Lanes past a tile's end compute indices up to one vector beyond the block.
  constexpr int64_t kMaxIndex = std::numeric_limits<int32_t>::max() - 8;
  SHARDLM_CHECK(q_offset <= kMaxIndex - d.Tq && k_offset <= kMaxIndex - d.Tk,
                "{}: query block [{}, {}) or key block [{}, {}) does not fit the i32 positions of "
                "seg_start",
                op, q_offset, q_offset + d.Tq, k_offset, k_offset + d.Tk);
  if (seg_start.empty()) return d;
  const int32_t* seg = seg_start.i32();
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

size_t attention_block_workspace_bytes(int64_t B, int64_t Tq, int64_t Tk, int64_t Hq, int64_t Hkv,
                                       int64_t Dh) {
  const AttnDims d{B, Tq, Tk, Hq, Hkv, Dh, 0, 0, 0, 0.0f};
  const int threads = omp_get_max_threads();
  return std::max(forward_workspace_bytes(d, threads), backward_workspace_bytes(d, threads));
}

size_t attention_workspace_bytes(int64_t B, int64_t T, int64_t Hq, int64_t Hkv, int64_t Dh) {
  return attention_block_workspace_bytes(B, T, T, Hq, Hkv, Dh);
}

}  // namespace shardlm::cpu
