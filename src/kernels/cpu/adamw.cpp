// AdamW step on f32 master weights, as torch.optim.AdamW (decoupled weight decay, bias
// correction): one fused, OpenMP-parallel, vectorizable pass over param, m and v.
// grad is read only; the step's scalar constants are computed once in f64. A list of segments
// is stepped one segment after another with the same pass.
#include <cmath>
#include <cstdint>

#include "kernels/cpu/ops.h"

namespace shardlm::cpu {

void adamw_step(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v,
                const AdamWHyper& hyper) {
  const int64_t n = param.numel();
  float* __restrict p_data = param.f32();       // [n]
  const float* __restrict g_data = grad.f32();  // [n]
  float* __restrict m_data = m.f32();           // [n]
  float* __restrict v_data = v.f32();           // [n]

  const double bias_correction1 = 1.0 - std::pow(double(hyper.beta1), double(hyper.step));
  const double bias_correction2 = 1.0 - std::pow(double(hyper.beta2), double(hyper.step));
  const float decay = static_cast<float>(1.0 - double(hyper.lr) * hyper.weight_decay);
  const float beta1 = hyper.beta1;
  const float beta2 = hyper.beta2;
  const float one_minus_beta1 = static_cast<float>(1.0 - hyper.beta1);
  const float one_minus_beta2 = static_cast<float>(1.0 - hyper.beta2);
  const float step_size = static_cast<float>(hyper.lr / bias_correction1);
  const float inv_sqrt_bias_correction2 = static_cast<float>(1.0 / std::sqrt(bias_correction2));
  const float eps = hyper.eps;
  const float grad_scale = hyper.grad_scale;

#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const float g = g_data[i] * grad_scale;
    const float mi = beta1 * m_data[i] + one_minus_beta1 * g;
    const float vi = beta2 * v_data[i] + one_minus_beta2 * g * g;
    m_data[i] = mi;
    v_data[i] = vi;
    const float denom = std::sqrt(vi) * inv_sqrt_bias_correction2 + eps;
    p_data[i] = p_data[i] * decay - step_size * mi / denom;
  }
}

void adamw_step_segments(std::span<const AdamWSegment> segments, const AdamWHyper& hyper) {
  AdamWHyper h = hyper;
  for (const AdamWSegment& s : segments) {
    h.weight_decay = s.weight_decay;
    adamw_step(s.param, s.grad, s.m, s.v, h);
  }
}

}  // namespace shardlm::cpu
