// CudaBackend's per-row ops: RMSNorm, rotary position embedding and SwiGLU.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "kernels/cuda/backend_impl.h"

namespace shardlm::cuda {

void CudaBackend::rmsnorm_forward(const Tensor& x, const Tensor& w, float eps, const Tensor& y,
                                  const Tensor& rstd) {
  constexpr std::string_view op = "rmsnorm_forward";
  const Elem t = elem(x, op, "x");
  elem(w, op, "w");
  elem(y, op, "y");
  same_type(x, w, op, "x", "w");
  same_type(x, y, op, "x", "y");
  need(rstd, DType::kF32, 1, op, "rstd");
  SHARDLM_CHECK(x.rank() == 2 && w.rank() == 1 && w.dim(0) == x.dim(1) && rstd.dim(0) == x.dim(0),
                "{}: expects x [N, D], w [D], rstd [N], got {}, {}, {}", op, x.shape().str(),
                w.shape().str(), rstd.shape().str());
  check_same_shape(x, y, op, "x", "y");
  cuda_ok(launch_rmsnorm_forward(x.data(), w.data(), t, eps, y.data(), rstd.f32(), x.dim(0),
                                 x.dim(1), impl_->stream),
          op);
}

void CudaBackend::rmsnorm_backward(const Tensor& x, const Tensor& w, const Tensor& rstd,
                                   const Tensor& dy, const Tensor& dx, const Tensor& dw) {
  constexpr std::string_view op = "rmsnorm_backward";
  const Elem t = elem(x, op, "x");
  elem(w, op, "w");
  elem(dy, op, "dy");
  elem(dx, op, "dx");
  same_type(x, w, op, "x", "w");
  same_type(x, dy, op, "x", "dy");
  same_type(x, dx, op, "x", "dx");
  need(rstd, DType::kF32, 1, op, "rstd");
  need(dw, DType::kF32, 1, op, "dw");
  SHARDLM_CHECK(x.rank() == 2 && w.rank() == 1 && w.dim(0) == x.dim(1) && rstd.dim(0) == x.dim(0),
                "{}: expects x [N, D], w [D], rstd [N], got {}, {}, {}", op, x.shape().str(),
                w.shape().str(), rstd.shape().str());
  check_same_shape(x, dy, op, "x", "dy");
  check_same_shape(x, dx, op, "x", "dx");
  check_same_shape(w, dw, op, "w", "dw");
  cuda_ok(launch_rmsnorm_backward(x.data(), w.data(), t, rstd.f32(), dy.data(), dx.data(), dw.f32(),
                                  x.dim(0), x.dim(1), impl_->stream),
          op);
}

namespace {
void rope(CudaBackend::Impl& m, const Tensor& x, const Tensor& positions, const Tensor& inv_freq,
          float direction, std::string_view op) {
  const Elem t = elem(x, op, "x");
  need(positions, DType::kI32, 1, op, "positions");
  need(inv_freq, DType::kF32, 1, op, "inv_freq");
  SHARDLM_CHECK(x.rank() == 3 && x.dim(2) % 2 == 0, "{}: x must be [N, H, Dh] with Dh even, got {}",
                op, x.shape().str());
  SHARDLM_CHECK(positions.dim(0) == x.dim(0), "{}: positions is {} but x is {}", op,
                positions.shape().str(), x.shape().str());
  SHARDLM_CHECK(inv_freq.dim(0) == x.dim(2) / 2, "{}: inv_freq is {}, expected [{}]", op,
                inv_freq.shape().str(), x.dim(2) / 2);
  cuda_ok(launch_rope(x.data(), t, positions.i32(), inv_freq.f32(), x.dim(0), x.dim(1), x.dim(2),
                      direction, m.stream),
          op);
}
}  // namespace

void CudaBackend::rope_forward(const Tensor& x, const Tensor& positions, const Tensor& inv_freq) {
  rope(*impl_, x, positions, inv_freq, 1.f, "rope_forward");
}
void CudaBackend::rope_backward(const Tensor& dx, const Tensor& positions, const Tensor& inv_freq) {
  rope(*impl_, dx, positions, inv_freq, -1.f, "rope_backward");
}

void CudaBackend::swiglu_forward(const Tensor& gate, const Tensor& up, const Tensor& h) {
  constexpr std::string_view op = "swiglu_forward";
  const Elem t = elem(gate, op, "gate");
  elem(up, op, "up");
  elem(h, op, "h");
  same_type(gate, up, op, "gate", "up");
  same_type(gate, h, op, "gate", "h");
  check_same_shape(gate, up, op, "gate", "up");
  check_same_shape(gate, h, op, "gate", "h");
  cuda_ok(launch_swiglu_forward(gate.data(), up.data(), h.data(), t, gate.numel(), impl_->stream),
          op);
}

void CudaBackend::swiglu_backward(const Tensor& gate, const Tensor& up, const Tensor& dh,
                                  const Tensor& dgate, const Tensor& dup) {
  constexpr std::string_view op = "swiglu_backward";
  const Elem t = elem(gate, op, "gate");
  for (const auto& [x, name] :
       {std::pair{&up, "up"}, {&dh, "dh"}, {&dgate, "dgate"}, {&dup, "dup"}}) {
    elem(*x, op, name);
    same_type(gate, *x, op, "gate", name);
    check_same_shape(gate, *x, op, "gate", name);
  }
  cuda_ok(launch_swiglu_backward(gate.data(), up.data(), dh.data(), dgate.data(), dup.data(), t,
                                 gate.numel(), impl_->stream),
          op);
}

}  // namespace shardlm::cuda
