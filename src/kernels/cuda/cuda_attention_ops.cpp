// CudaBackend's attention ops: causal (document-masked) attention, block attention and
// its merge for context parallelism, and decoding against a KV cache (kernels: attention.cu).
#include <algorithm>
#include <cmath>
#include <cstring>

#include "kernels/cuda/backend_impl.h"

namespace shardlm::cuda {

namespace {

// The launch arguments of q [B, Tq, Hq, Dh] and k, v [B, Tk, Hkv, Dh] (shapes checked by the entry
// point), after the CUDA backend's own checks: device memory and a head dim the kernels take.
AttnArgs attn_args(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& seg_start,
                   int64_t q_offset, int64_t k_offset, std::string_view op) {
  AttnArgs a;
  a.t = elem(q, op, "q");
  on_device(k, op, "k");
  on_device(v, op, "v");
  a.B = q.dim(0);
  a.Tq = q.dim(1);
  a.Hq = q.dim(2);
  a.Dh = q.dim(3);
  a.Tk = k.dim(1);
  a.Hkv = k.dim(2);
  SHARDLM_CHECK(a.Dh <= kMaxHeadDim,
                "{}: head dim {} is outside what the CUDA kernels take (1..{})", op, a.Dh,
                kMaxHeadDim);
  if (!seg_start.empty()) {
    on_device(seg_start, op, "seg_start");
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

size_t delta_bytes(int64_t B, int64_t Tq, int64_t Hq) {
  return align_up(size_t(B) * size_t(Tq) * size_t(Hq) * sizeof(float));
}

// ws holds delta_bytes: the entry point checked it against the workspace query.
void backward(CudaBackend::Impl& m, const AttnArgs& a, const Tensor& out, const Tensor& lse,
              const Tensor& dout, const Tensor& dq, const Tensor& dk, const Tensor& dv,
              Workspace ws, std::string_view op) {
  for (const auto& [x, name] : {std::pair{&out, "out"},
                                {&lse, "lse"},
                                {&dout, "dout"},
                                {&dq, "dq"},
                                {&dk, "dk"},
                                {&dv, "dv"}})
    on_device(*x, op, name);
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

void CudaBackend::do_attention_forward(const Tensor& q, const Tensor& k, const Tensor& v,
                                       const Tensor& seg_start, const Tensor& out,
                                       const Tensor& lse, Workspace ws) {
  constexpr std::string_view op = "attention_forward";
  const AttnArgs a = attn_args(q, k, v, seg_start, 0, 0, op);
  on_device(out, op, "out");
  on_device(lse, op, "lse");
  cuda_ok(launch_attention_forward(a, out.data(), lse.f32(), impl_->stream), op);
}

void CudaBackend::do_attention_backward(const Tensor& q, const Tensor& k, const Tensor& v,
                                        const Tensor& seg_start, const Tensor& out,
                                        const Tensor& lse, const Tensor& dout, const Tensor& dq,
                                        const Tensor& dk, const Tensor& dv, Workspace ws) {
  constexpr std::string_view op = "attention_backward";
  const AttnArgs a = attn_args(q, k, v, seg_start, 0, 0, op);
  backward(*impl_, a, out, lse, dout, dq, dk, dv, ws, op);
}

size_t CudaBackend::attention_block_workspace_bytes(int64_t B, int64_t Tq, int64_t Tk, int64_t Hq,
                                                    int64_t Hkv, int64_t Dh) const {
  return delta_bytes(B, Tq, Hq);
}

void CudaBackend::do_attention_block_forward(const Tensor& q, const Tensor& k, const Tensor& v,
                                             const Tensor& seg_start, int64_t q_offset,
                                             int64_t k_offset, const Tensor& out, const Tensor& lse,
                                             Workspace ws) {
  constexpr std::string_view op = "attention_block_forward";
  const AttnArgs a = attn_args(q, k, v, seg_start, q_offset, k_offset, op);
  on_device(out, op, "out");
  on_device(lse, op, "lse");
  cuda_ok(launch_attention_forward(a, out.data(), lse.f32(), impl_->stream), op);
}

void CudaBackend::do_attention_block_backward(const Tensor& q, const Tensor& k, const Tensor& v,
                                              const Tensor& seg_start, int64_t q_offset,
                                              int64_t k_offset, const Tensor& out,
                                              const Tensor& lse, const Tensor& dout,
                                              const Tensor& dq, const Tensor& dk, const Tensor& dv,
                                              Workspace ws) {
  constexpr std::string_view op = "attention_block_backward";
  const AttnArgs a = attn_args(q, k, v, seg_start, q_offset, k_offset, op);
  backward(*impl_, a, out, lse, dout, dq, dk, dv, ws, op);
}

void CudaBackend::do_attention_merge(const Tensor& out, const Tensor& lse, const Tensor& out_b,
                                     const Tensor& lse_b) {
  constexpr std::string_view op = "attention_merge";
  for (const auto& [x, name] :
       {std::pair{&out, "out"}, {&lse, "lse"}, {&out_b, "out_b"}, {&lse_b, "lse_b"}})
    on_device(*x, op, name);
  const int64_t B = lse.dim(0), Hq = lse.dim(1), T = lse.dim(2);
  const int64_t Dh = out.dim(out.rank() - 1);
  cuda_ok(launch_attention_merge(out.data(), lse.f32(), out_b.data(), lse_b.f32(),
                                 elem_of(out.dtype()), B, T, Hq, Dh, impl_->stream),
          op);
}

size_t CudaBackend::attention_decode_workspace_bytes(int64_t B, int64_t Tq, int64_t Tmax,
                                                     int64_t Hq, int64_t Dh) const {
  return 0;
}

void CudaBackend::do_attention_decode(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                                      int64_t cache_len, const Tensor& out, Workspace ws) {
  constexpr std::string_view op = "attention_decode";
  AttnArgs a = attn_args(q, k_cache, v_cache, Tensor(), cache_len, 0, op);
  const int64_t Tmax = a.Tk;
  a.Tk = cache_len + a.Tq;
  a.k_batch_stride = Tmax * a.Hkv * a.Dh;
  on_device(out, op, "out");
  cuda_ok(launch_attention_forward(a, out.data(), nullptr, impl_->stream), op);
}

}  // namespace shardlm::cuda
