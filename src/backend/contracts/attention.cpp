// The contracts of the attention ops: attention_forward, attention_backward,
// attention_block_forward, attention_block_backward, attention_merge and attention_decode;
// and the choice of attention implementation for a backend with only its own kernels.
// Document starts are data: their range is the backend's to check where it reads them.
#include <cmath>
#include <limits>

#include "backend/contracts/checks.h"

namespace shardlm {
namespace {

using namespace contract;  // NOLINT: the contract helpers are this file's vocabulary

struct AttnShape {
  int64_t B, Tq, Tk, Hq, Hkv, Dh;
};

// The names of q, k and v in messages: short, and with their shapes.
struct QkvNames {
  std::string_view k, v, q_shaped, k_shaped, v_shaped;
};
constexpr QkvNames kFlashNames{"k", "v", "q [B, Tq, Hq, Dh]", "k [B, Tk, Hkv, Dh]",
                               "v [B, Tk, Hkv, Dh]"};
constexpr QkvNames kCacheNames{"k_cache", "v_cache", "q [B, Tq, Hq, Dh]",
                               "k_cache [B, Tmax, Hkv, Dh]", "v_cache [B, Tmax, Hkv, Dh]"};

// q [B, Tq, Hq, Dh]; k, v [B, Tk, Hkv, Dh] with Hq a multiple of Hkv; one float dtype
AttnShape check_qkv(const Tensor& q, const Tensor& k, const Tensor& v, std::string_view op,
                    const QkvNames& n) {
  check_float(q, 4, op, n.q_shaped);
  check_like(k, q, 4, op, n.k_shaped, "q");
  check_like(v, q, 4, op, n.v_shaped, "q");
  check_same_shape(v, k, op, n.v, n.k);
  const AttnShape s{q.dim(0), q.dim(1), k.dim(1), q.dim(2), k.dim(2), q.dim(3)};
  SHARDLM_CHECK(k.dim(0) == s.B && k.dim(3) == s.Dh,
                "{}: {} is {} but q is {}; it must be {} with q's B and Dh", op, n.k,
                k.shape().str(), q.shape().str(), n.k_shaped.substr(n.k.size() + 1));
  SHARDLM_CHECK(s.Hkv > 0 && s.Hq % s.Hkv == 0,
                "{}: Hq = {} must be a multiple of Hkv = {} (grouped-query attention)", op, s.Hq,
                s.Hkv);
  SHARDLM_CHECK(s.Dh > 0, "{}: head dim Dh must be positive, got {}", op, s.Dh);
  return s;
}

// The tensors every flash-attention op takes: q, k, v, seg_start [B, Tq] i32 (or empty), out
// like q and lse [B, Hq, Tq] f32; offsets >= 0 (full-row indices of the blocks' first tokens).
AttnShape check_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                          const Tensor& seg_start, int64_t q_offset, int64_t k_offset,
                          const Tensor& out, const Tensor& lse, std::string_view op) {
  const AttnShape s = check_qkv(q, k, v, op, kFlashNames);
  check_like(out, q, 4, op, "out [B, Tq, Hq, Dh]", "q");
  check_same_shape(out, q, op, "out", "q");
  check_tensor(lse, DType::kF32, 3, op, "lse [B, Hq, Tq]");
  SHARDLM_CHECK(q_offset >= 0 && k_offset >= 0,
                "{}: q_offset = {} and k_offset = {} must be >= 0 (full-row indices of the blocks' "
                "first tokens)",
                op, q_offset, k_offset);
  SHARDLM_CHECK(lse.dim(0) == s.B && lse.dim(1) == s.Hq && lse.dim(2) == s.Tq,
                "{}: lse is {} but must be [B, Hq, Tq] = [{}, {}, {}]", op, lse.shape().str(), s.B,
                s.Hq, s.Tq);
  if (seg_start.empty()) return s;  // one document per row
  check_tensor(seg_start, DType::kI32, 2, op, "seg_start [B, Tq]");
  SHARDLM_CHECK(seg_start.dim(0) == s.B && seg_start.dim(1) == s.Tq,
                "{}: seg_start is {} but must be [B, Tq] = [{}, {}]", op, seg_start.shape().str(),
                s.B, s.Tq);
  return s;
}

// The full-row ops: keys and queries are the same tokens.
void check_full_row(const AttnShape& s, const Tensor& q, const Tensor& k, std::string_view op) {
  SHARDLM_CHECK(s.Tk == s.Tq,
                "{}: k is {} but q is {}; k must be [B, T, Hkv, Dh] with q's T (a block of keys "
                "goes to attention_block_*)",
                op, k.shape().str(), q.shape().str());
}

// Gradients of the backward: dout and dq like q, dk and dv like k.
void check_gradients(const Tensor& q, const Tensor& k, const Tensor& dout, const Tensor& dq,
                     const Tensor& dk, const Tensor& dv, std::string_view op) {
  check_like(dout, q, 4, op, "dout [B, Tq, Hq, Dh]", "q");
  check_same_shape(dout, q, op, "dout", "q");
  check_like(dq, q, 4, op, "dq [B, Tq, Hq, Dh]", "q");
  check_same_shape(dq, q, op, "dq", "q");
  check_like(dk, q, 4, op, "dk [B, Tk, Hkv, Dh]", "q");
  check_same_shape(dk, k, op, "dk", "k");
  check_like(dv, q, 4, op, "dv [B, Tk, Hkv, Dh]", "q");
  check_same_shape(dv, k, op, "dv", "k");
}

// Document spans given with a call: with seg_start (they restate it), i32 in seg_start's memory,
// room for count + 1 starts, and a longest document within a row. Their values are data, the
// backend's to check where it reads them.
void check_spans(const DocumentSpans& docs, const Tensor& seg_start, const AttnShape& s,
                 std::string_view op) {
  if (docs.count == 0 && docs.starts.empty()) return;
  SHARDLM_CHECK(!seg_start.empty(),
                "{}: document spans given without seg_start; pass the documents' seg_start too",
                op);
  check_tensor(docs.starts, DType::kI32, 1, op, "docs.starts [>= count + 1]");
  SHARDLM_CHECK(docs.starts.pool() == seg_start.pool(),
                "{}: docs.starts and seg_start must be in the same memory", op);
  SHARDLM_CHECK(docs.count >= 1 && docs.count <= s.B * s.Tq && docs.starts.numel() > docs.count,
                "{}: docs.count = {} must be in [1, B * T = {}] with docs.starts holding count + 1 "
                "starts (it holds {})",
                op, docs.count, s.B * s.Tq, docs.starts.numel());
  SHARDLM_CHECK(docs.max_len >= 1 && docs.max_len <= s.Tq,
                "{}: docs.max_len = {} must be in [1, T = {}] (documents never cross a row)", op,
                docs.max_len, s.Tq);
}

void check_window(int64_t window, std::string_view op) {
  SHARDLM_CHECK(window >= 0 && window <= std::numeric_limits<int32_t>::max(),
                "{}: window = {} must be 0 (no sliding window) or a positive key count that fits "
                "i32",
                op, window);
}

void check_softcap(float softcap, std::string_view op) {
  SHARDLM_CHECK(std::isfinite(softcap) && softcap >= 0.0f,
                "{}: softcap = {} must be 0 (no soft-capping) or a positive finite cap on the "
                "scaled scores",
                op, softcap);
}

}  // namespace

std::string Backend::select_attention(std::string_view impl) {
  SHARDLM_CHECK_KIND(ErrorKind::kConfig, impl == "auto" || impl == "own",
                     "train.attention = \"{}\": the {} backend has only its own attention "
                     "kernels; use \"auto\" or \"own\"{}",
                     impl, name(),
                     impl == "cudnn" ? " (cuDNN's needs train.device = \"cuda\")" : "");
  return "own kernels";
}

void Backend::attention_forward(const Tensor& q, const Tensor& k, const Tensor& v,
                                const Tensor& seg_start, const Tensor& out, const Tensor& lse,
                                Workspace ws, const DocumentSpans& docs, int64_t window,
                                float softcap) {
  constexpr std::string_view op = "attention_forward";
  const AttnShape s = check_attention(q, k, v, seg_start, 0, 0, out, lse, op);
  check_window(window, op);
  check_softcap(softcap, op);
  check_full_row(s, q, k, op);
  check_spans(docs, seg_start, s, op);
  check_workspace(ws, attention_workspace_bytes(s.B, s.Tq, s.Hq, s.Hkv, s.Dh), workspace_threads(),
                  op, "attention_workspace_bytes");
  do_attention_forward(q, k, v, seg_start, out, lse, ws, docs, window, softcap);
}

void Backend::attention_backward(const Tensor& q, const Tensor& k, const Tensor& v,
                                 const Tensor& seg_start, const Tensor& out, const Tensor& lse,
                                 const Tensor& dout, const Tensor& dq, const Tensor& dk,
                                 const Tensor& dv, Workspace ws, const DocumentSpans& docs,
                                 int64_t window, float softcap) {
  constexpr std::string_view op = "attention_backward";
  const AttnShape s = check_attention(q, k, v, seg_start, 0, 0, out, lse, op);
  check_window(window, op);
  check_softcap(softcap, op);
  check_full_row(s, q, k, op);
  check_spans(docs, seg_start, s, op);
  check_gradients(q, k, dout, dq, dk, dv, op);
  check_workspace(ws, attention_workspace_bytes(s.B, s.Tq, s.Hq, s.Hkv, s.Dh), workspace_threads(),
                  op, "attention_workspace_bytes");
  do_attention_backward(q, k, v, seg_start, out, lse, dout, dq, dk, dv, ws, docs, window, softcap);
}

void Backend::attention_block_forward(const Tensor& q, const Tensor& k, const Tensor& v,
                                      const Tensor& seg_start, int64_t q_offset, int64_t k_offset,
                                      const Tensor& out, const Tensor& lse, Workspace ws,
                                      int64_t window, float softcap) {
  constexpr std::string_view op = "attention_block_forward";
  const AttnShape s = check_attention(q, k, v, seg_start, q_offset, k_offset, out, lse, op);
  check_window(window, op);
  check_softcap(softcap, op);
  check_workspace(ws, attention_block_workspace_bytes(s.B, s.Tq, s.Tk, s.Hq, s.Hkv, s.Dh),
                  workspace_threads(), op, "attention_block_workspace_bytes");
  do_attention_block_forward(q, k, v, seg_start, q_offset, k_offset, out, lse, ws, window, softcap);
}

void Backend::attention_block_backward(const Tensor& q, const Tensor& k, const Tensor& v,
                                       const Tensor& seg_start, int64_t q_offset, int64_t k_offset,
                                       const Tensor& out, const Tensor& lse, const Tensor& dout,
                                       const Tensor& dq, const Tensor& dk, const Tensor& dv,
                                       Workspace ws, int64_t window, float softcap) {
  constexpr std::string_view op = "attention_block_backward";
  const AttnShape s = check_attention(q, k, v, seg_start, q_offset, k_offset, out, lse, op);
  check_window(window, op);
  check_softcap(softcap, op);
  check_gradients(q, k, dout, dq, dk, dv, op);
  check_workspace(ws, attention_block_workspace_bytes(s.B, s.Tq, s.Tk, s.Hq, s.Hkv, s.Dh),
                  workspace_threads(), op, "attention_block_workspace_bytes");
  do_attention_block_backward(q, k, v, seg_start, q_offset, k_offset, out, lse, dout, dq, dk, dv,
                              ws, window, softcap);
}

void Backend::attention_merge(const Tensor& out, const Tensor& lse, const Tensor& out_b,
                              const Tensor& lse_b) {
  constexpr std::string_view op = "attention_merge";
  SHARDLM_CHECK(out.rank() == 3 || out.rank() == 4,
                "{}: out must be [N, Hq, Dh] or [B, T, Hq, Dh], got shape {}", op,
                out.shape().str());
  check_float(out, out.rank(), op, "out [N, Hq, Dh] or [B, T, Hq, Dh]");
  check_like(out_b, out, out.rank(), op, "out_b (out's shape)", "out");
  check_same_shape(out_b, out, op, "out_b", "out");
  check_tensor(lse, DType::kF32, 3, op, "lse [B, Hq, T]");
  check_tensor(lse_b, DType::kF32, 3, op, "lse_b [B, Hq, T]");
  check_same_shape(lse_b, lse, op, "lse_b", "lse");
  const int64_t B = lse.dim(0), Hq = lse.dim(1), T = lse.dim(2);
  const int rank = out.rank();
  const bool tokens_match = rank == 4 ? out.dim(0) == B && out.dim(1) == T : out.dim(0) == B * T;
  SHARDLM_CHECK(tokens_match && out.dim(rank - 2) == Hq,
                "{}: out is {} but lse is {}; out must be [B * T, Hq, Dh] or [B, T, Hq, Dh] with "
                "lse's B, Hq, T",
                op, out.shape().str(), lse.shape().str());
  do_attention_merge(out, lse, out_b, lse_b);
}

void Backend::attention_decode(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                               int64_t cache_len, const Tensor& out, Workspace ws, float softcap) {
  constexpr std::string_view op = "attention_decode";
  check_softcap(softcap, op);
  const AttnShape s = check_qkv(q, k_cache, v_cache, op, kCacheNames);
  check_like(out, q, 4, op, "out [B, Tq, Hq, Dh]", "q");
  check_same_shape(out, q, op, "out", "q");
  SHARDLM_CHECK(cache_len >= 0 && cache_len + s.Tq <= s.Tk,
                "{}: queries at positions [{}, {}) do not fit a cache of Tmax = {} positions; "
                "reset the cache or allocate a longer one",
                op, cache_len, cache_len + s.Tq, s.Tk);
  check_workspace(ws, attention_decode_workspace_bytes(s.B, s.Tq, s.Tk, s.Hq, s.Dh),
                  workspace_threads(), op, "attention_decode_workspace_bytes");
  do_attention_decode(q, k_cache, v_cache, cache_len, out, ws, softcap);
}

}  // namespace shardlm
