// CudaBackend's attention ops: causal (document-masked) attention, block attention and
// its merge for context parallelism, and decoding against a KV cache (kernels: attention.cu).
#include <algorithm>
#include <cmath>
#include <cstring>

#include "kernels/cuda/backend_impl.h"

namespace shardlm::cuda {

namespace {

AttnArgs attn_args(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& seg_start,
                   int64_t q_offset, int64_t k_offset, std::string_view op) {
  AttnArgs a;
  a.t = elem(q, op, "q");
  elem(k, op, "k");
  elem(v, op, "v");
  same_type(q, k, op, "q", "k");
  same_type(q, v, op, "q", "v");
  SHARDLM_CHECK(q.rank() == 4 && k.rank() == 4 && k.shape() == v.shape(),
                "{}: expects q [B, Tq, Hq, Dh] and k, v [B, Tk, Hkv, Dh], got {}, {}, {}", op,
                q.shape().str(), k.shape().str(), v.shape().str());
  a.B = q.dim(0);
  a.Tq = q.dim(1);
  a.Hq = q.dim(2);
  a.Dh = q.dim(3);
  a.Tk = k.dim(1);
  a.Hkv = k.dim(2);
  SHARDLM_CHECK(k.dim(0) == a.B && k.dim(3) == a.Dh, "{}: k {} does not match q {}", op,
                k.shape().str(), q.shape().str());
  SHARDLM_CHECK(a.Hkv > 0 && a.Hq % a.Hkv == 0,
                "{}: Hq = {} query heads must be a multiple of Hkv = {} kv heads", op, a.Hq, a.Hkv);
  SHARDLM_CHECK(a.Dh > 0 && a.Dh <= kMaxHeadDim,
                "{}: head dim {} is outside what the CUDA kernels take (1..{})", op, a.Dh,
                kMaxHeadDim);
  SHARDLM_CHECK(q_offset >= 0 && k_offset >= 0, "{}: offsets must be >= 0, got {} and {}", op,
                q_offset, k_offset);
  if (!seg_start.empty()) {
    need(seg_start, DType::kI32, 2, op, "seg_start");
    SHARDLM_CHECK(seg_start.dim(0) == a.B && seg_start.dim(1) == a.Tq,
                  "{}: seg_start must be [B, Tq] = [{}, {}], got {}", op, a.B, a.Tq,
                  seg_start.shape().str());
    a.seg = seg_start.i32();
  }
  a.q = q.data();
  a.k = k.data();
  a.v = v.data();
  a.q_offset = q_offset;
  a.k_offset = k_offset;
  a.k_batch_stride = a.Tk * a.Hkv * a.Dh;
  return a;
}

void check_out_lse(const AttnArgs& a, const Tensor& q, const Tensor& out, const Tensor& lse,
                   std::string_view op) {
  elem(out, op, "out");
  same_type(q, out, op, "q", "out");
  check_same_shape(q, out, op, "q", "out");
  need(lse, DType::kF32, 3, op, "lse");
  SHARDLM_CHECK(lse.dim(0) == a.B && lse.dim(1) == a.Hq && lse.dim(2) == a.Tq,
                "{}: lse must be [B, Hq, Tq] = [{}, {}, {}], got {}", op, a.B, a.Hq, a.Tq,
                lse.shape().str());
}

size_t delta_bytes(int64_t B, int64_t Tq, int64_t Hq) {
  return align_up(size_t(B) * size_t(Tq) * size_t(Hq) * sizeof(float));
}

void backward(CudaBackend::Impl& m, const AttnArgs& a, const Tensor& q, const Tensor& k,
              const Tensor& out, const Tensor& lse, const Tensor& dout, const Tensor& dq,
              const Tensor& dk, const Tensor& dv, Workspace ws, std::string_view op) {
  check_out_lse(a, q, out, lse, op);
  for (const auto& [x, ref, name] :
       {std::tuple{&dout, &q, "dout"}, {&dq, &q, "dq"}, {&dk, &k, "dk"}, {&dv, &k, "dv"}}) {
    elem(*x, op, name);
    same_type(q, *x, op, "q", name);
    check_same_shape(*ref, *x, op,
                     name == std::string_view("dout") || name == std::string_view("dq") ? "q" : "k",
                     name);
  }
  const size_t need_ws = delta_bytes(a.B, a.Tq, a.Hq);
  SHARDLM_CHECK(ws.bytes >= need_ws && (ws.data != nullptr || need_ws == 0),
                "{}: workspace has {} bytes, needs {}", op, ws.bytes, need_ws);
  cuda_ok(launch_attention_backward(a, out.data(), lse.f32(), dout.data(),
                                    reinterpret_cast<float*>(ws.data), dq.data(), dk.data(),
                                    dv.data(), m.stream),
          op);
}

}  // namespace

size_t CudaBackend::attention_workspace_bytes(int64_t B, int64_t T, int64_t Hq, int64_t Hkv,
                                              int64_t Dh) const {
  return delta_bytes(B, T, Hq);
}

void CudaBackend::attention_forward(const Tensor& q, const Tensor& k, const Tensor& v,
                                    const Tensor& seg_start, const Tensor& out, const Tensor& lse,
                                    Workspace ws) {
  constexpr std::string_view op = "attention_forward";
  const AttnArgs a = attn_args(q, k, v, seg_start, 0, 0, op);
  SHARDLM_CHECK(a.Tk == a.Tq, "{}: q and k must cover the same tokens, got {} and {}", op,
                q.shape().str(), k.shape().str());
  check_out_lse(a, q, out, lse, op);
  cuda_ok(launch_attention_forward(a, out.data(), lse.f32(), impl_->stream), op);
}

void CudaBackend::attention_backward(const Tensor& q, const Tensor& k, const Tensor& v,
                                     const Tensor& seg_start, const Tensor& out, const Tensor& lse,
                                     const Tensor& dout, const Tensor& dq, const Tensor& dk,
                                     const Tensor& dv, Workspace ws) {
  constexpr std::string_view op = "attention_backward";
  const AttnArgs a = attn_args(q, k, v, seg_start, 0, 0, op);
  SHARDLM_CHECK(a.Tk == a.Tq, "{}: q and k must cover the same tokens, got {} and {}", op,
                q.shape().str(), k.shape().str());
  backward(*impl_, a, q, k, out, lse, dout, dq, dk, dv, ws, op);
}

size_t CudaBackend::attention_block_workspace_bytes(int64_t B, int64_t Tq, int64_t Tk, int64_t Hq,
                                                    int64_t Hkv, int64_t Dh) const {
  return delta_bytes(B, Tq, Hq);
}

void CudaBackend::attention_block_forward(const Tensor& q, const Tensor& k, const Tensor& v,
                                          const Tensor& seg_start, int64_t q_offset,
                                          int64_t k_offset, const Tensor& out, const Tensor& lse,
                                          Workspace ws) {
  constexpr std::string_view op = "attention_block_forward";
  const AttnArgs a = attn_args(q, k, v, seg_start, q_offset, k_offset, op);
  check_out_lse(a, q, out, lse, op);
  cuda_ok(launch_attention_forward(a, out.data(), lse.f32(), impl_->stream), op);
}

void CudaBackend::attention_block_backward(const Tensor& q, const Tensor& k, const Tensor& v,
                                           const Tensor& seg_start, int64_t q_offset,
                                           int64_t k_offset, const Tensor& out, const Tensor& lse,
                                           const Tensor& dout, const Tensor& dq, const Tensor& dk,
                                           const Tensor& dv, Workspace ws) {
  constexpr std::string_view op = "attention_block_backward";
  const AttnArgs a = attn_args(q, k, v, seg_start, q_offset, k_offset, op);
  backward(*impl_, a, q, k, out, lse, dout, dq, dk, dv, ws, op);
}

void CudaBackend::attention_merge(const Tensor& out, const Tensor& lse, const Tensor& out_b,
                                  const Tensor& lse_b) {
  constexpr std::string_view op = "attention_merge";
  need(out, DType::kF32, -1, op, "out");
  need(out_b, DType::kF32, -1, op, "out_b");
  need(lse, DType::kF32, 3, op, "lse");
  need(lse_b, DType::kF32, 3, op, "lse_b");
  check_same_shape(out, out_b, op, "out", "out_b");
  check_same_shape(lse, lse_b, op, "lse", "lse_b");
  const int64_t B = lse.dim(0), Hq = lse.dim(1), T = lse.dim(2);
  const int rank = out.rank();
  SHARDLM_CHECK(rank == 3 || rank == 4, "{}: out must be [B * T, Hq, Dh] or [B, T, Hq, Dh], got {}",
                op, out.shape().str());
  const int64_t Dh = out.dim(rank - 1);
  const bool tokens_match = rank == 4 ? out.dim(0) == B && out.dim(1) == T : out.dim(0) == B * T;
  SHARDLM_CHECK(tokens_match && out.dim(rank - 2) == Hq, "{}: out is {} but lse is {}", op,
                out.shape().str(), lse.shape().str());
  cuda_ok(launch_attention_merge(static_cast<float*>(out.data()), lse.f32(),
                                 static_cast<const float*>(out_b.data()), lse_b.f32(), B, T, Hq, Dh,
                                 impl_->stream),
          op);
}

size_t CudaBackend::attention_decode_workspace_bytes(int64_t B, int64_t Tq, int64_t Tmax,
                                                     int64_t Hq, int64_t Dh) const {
  return 0;
}

void CudaBackend::attention_decode(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                                   int64_t cache_len, const Tensor& out, Workspace ws) {
  constexpr std::string_view op = "attention_decode";
  AttnArgs a = attn_args(q, k_cache, v_cache, Tensor(), cache_len, 0, op);
  const int64_t Tmax = a.Tk;
  SHARDLM_CHECK(cache_len >= 0 && cache_len + a.Tq <= Tmax,
                "{}: cache_len {} + {} new queries exceed the cache's {} rows", op, cache_len, a.Tq,
                Tmax);
  a.Tk = cache_len + a.Tq;
  a.k_batch_stride = Tmax * a.Hkv * a.Dh;
  elem(out, op, "out");
  same_type(q, out, op, "q", "out");
  check_same_shape(q, out, op, "q", "out");
  cuda_ok(launch_attention_forward(a, out.data(), nullptr, impl_->stream), op);
}

}  // namespace shardlm::cuda
