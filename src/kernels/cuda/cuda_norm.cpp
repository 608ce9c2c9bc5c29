// CudaBackend's per-row ops: RMSNorm, rotary position embedding (one tensor, or q and k in one
// launch), SwiGLU and GeGLU; kernels in norm_rope.cu and elementwise.cu.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "kernels/cuda/backend_impl.h"

namespace shardlm::cuda {

void CudaBackend::do_rmsnorm_forward(const Tensor& x, const Tensor& w, float eps, const Tensor& y,
                                     const Tensor& rstd, float w_offset) {
  constexpr std::string_view op = "rmsnorm_forward";
  const Elem t = elem(x, op, "x");
  on_device(w, op, "w");
  on_device(y, op, "y");
  on_device(rstd, op, "rstd");
  cuda_ok(launch_rmsnorm_forward(x.data(), w.data(), w_offset, t, eps, y.data(), rstd.f32(),
                                 x.dim(0), x.dim(1), impl_->stream),
          op);
}

void CudaBackend::do_add_rmsnorm_forward(const Tensor& x, const Tensor& residual, const Tensor& w,
                                         float eps, const Tensor& y, const Tensor& rstd,
                                         float w_offset) {
  constexpr std::string_view op = "add_rmsnorm_forward";
  const Elem t = elem(residual, op, "residual");
  for (const auto& [tensor, name] : {std::pair{&x, "x"}, {&w, "w"}, {&y, "y"}, {&rstd, "rstd"}})
    on_device(*tensor, op, name);
  cuda_ok(
      launch_add_rmsnorm_forward(x.data(), residual.data(), w.data(), w_offset, t, eps, y.data(),
                                 rstd.f32(), residual.dim(0), residual.dim(1), impl_->stream),
      op);
}

void CudaBackend::do_rmsnorm_backward(const Tensor& x, const Tensor& w, const Tensor& rstd,
                                      const Tensor& dy, const Tensor& dx, const Tensor& dw,
                                      float w_offset) {
  constexpr std::string_view op = "rmsnorm_backward";
  const Elem t = elem(x, op, "x");
  for (const auto& [u, name] :
       {std::pair{&w, "w"}, {&rstd, "rstd"}, {&dy, "dy"}, {&dx, "dx"}, {&dw, "dw"}})
    on_device(*u, op, name);
  cuda_ok(launch_rmsnorm_backward(x.data(), w.data(), w_offset, t, rstd.f32(), dy.data(), dx.data(),
                                  dw.f32(), x.dim(0), x.dim(1), impl_->stream),
          op);
}

namespace {
// q [N, Hq, Dh] and k [N, Hk, Dh] (k empty: q alone) rotated by one launch; inv_freq [R/2].
void rope(CudaBackend::Impl& m, const Tensor& q, const Tensor& k, const Tensor& positions,
          const Tensor& inv_freq, RopePairs pairs, float direction, std::string_view op) {
  const Elem t = elem(q, op, "q");
  if (!k.empty()) on_device(k, op, "k");
  on_device(positions, op, "positions");
  on_device(inv_freq, op, "inv_freq");
  const RopeDims dims{q.dim(0), q.dim(2), inv_freq.dim(0), pairs == RopePairs::kInterleaved};
  cuda_ok(launch_rope(q.data(), q.dim(1), k.empty() ? nullptr : k.data(), k.empty() ? 0 : k.dim(1),
                      t, positions.i32(), inv_freq.f32(), dims, direction, m.stream),
          op);
}
}  // namespace

void CudaBackend::do_rope_forward(const Tensor& x, const Tensor& positions, const Tensor& inv_freq,
                                  RopePairs pairs) {
  rope(*impl_, x, Tensor(), positions, inv_freq, pairs, 1.f, "rope_forward");
}
void CudaBackend::do_rope_backward(const Tensor& dx, const Tensor& positions,
                                   const Tensor& inv_freq, RopePairs pairs) {
  rope(*impl_, dx, Tensor(), positions, inv_freq, pairs, -1.f, "rope_backward");
}
void CudaBackend::do_rope_qk_forward(const Tensor& q, const Tensor& k, const Tensor& positions,
                                     const Tensor& inv_freq, RopePairs pairs) {
  rope(*impl_, q, k, positions, inv_freq, pairs, 1.f, "rope_qk_forward");
}
void CudaBackend::do_rope_qk_backward(const Tensor& dq, const Tensor& dk, const Tensor& positions,
                                      const Tensor& inv_freq, RopePairs pairs) {
  rope(*impl_, dq, dk, positions, inv_freq, pairs, -1.f, "rope_qk_backward");
}

void CudaBackend::do_swiglu_forward(const Tensor& gate, const Tensor& up, const Tensor& h) {
  constexpr std::string_view op = "swiglu_forward";
  const Elem t = elem(gate, op, "gate");
  on_device(up, op, "up");
  on_device(h, op, "h");
  cuda_ok(launch_swiglu_forward(gate.data(), up.data(), h.data(), t, gate.numel(), impl_->stream),
          op);
}

void CudaBackend::do_swiglu_backward(const Tensor& gate, const Tensor& up, const Tensor& dh,
                                     const Tensor& dgate, const Tensor& dup) {
  constexpr std::string_view op = "swiglu_backward";
  const Elem t = elem(gate, op, "gate");
  for (const auto& [x, name] :
       {std::pair{&up, "up"}, {&dh, "dh"}, {&dgate, "dgate"}, {&dup, "dup"}})
    on_device(*x, op, name);
  cuda_ok(launch_swiglu_backward(gate.data(), up.data(), dh.data(), dgate.data(), dup.data(), t,
                                 gate.numel(), impl_->stream),
          op);
}

void CudaBackend::do_geglu_forward(const Tensor& gate, const Tensor& up, const Tensor& h) {
  constexpr std::string_view op = "geglu_forward";
  const Elem t = elem(gate, op, "gate");
  on_device(up, op, "up");
  on_device(h, op, "h");
  cuda_ok(launch_geglu_forward(gate.data(), up.data(), h.data(), t, gate.numel(), impl_->stream),
          op);
}

void CudaBackend::do_geglu_backward(const Tensor& gate, const Tensor& up, const Tensor& dh,
                                    const Tensor& dgate, const Tensor& dup) {
  constexpr std::string_view op = "geglu_backward";
  const Elem t = elem(gate, op, "gate");
  for (const auto& [x, name] :
       {std::pair{&up, "up"}, {&dh, "dh"}, {&dgate, "dgate"}, {&dup, "dup"}})
    on_device(*x, op, name);
  cuda_ok(launch_geglu_backward(gate.data(), up.data(), dh.data(), dgate.data(), dup.data(), t,
                                gate.numel(), impl_->stream),
          op);
}

}  // namespace shardlm::cuda
