// LlamaModel's per-family ops: the RMSNorm with Llama's w or Gemma's (1 + w) weights (alone or
// after the residual add), the
// MLP's gated activation (SwiGLU or GeGLU), each layer's rotary frequencies (Gemma's local
// layers have a base of their own) and Gemma's embedding multiplier.
#include <cmath>

#include "llama_views.h"

namespace shardlm {

// x, y [n, D]; w [D]; rstd [n]
void LlamaModel::norm_forward(const Tensor& x, const Tensor& w, const Tensor& y,
                              const Tensor& rstd) {
  be_.rmsnorm_forward(x, w, float(cfg_.norm_eps), y, rstd, cfg_.norm_offset());
}

// x, residual, y [n, D]; w [D]; rstd [n]
void LlamaModel::add_norm_forward(const Tensor& x, const Tensor& residual, const Tensor& w,
                                  const Tensor& y, const Tensor& rstd) {
  be_.add_rmsnorm_forward(x, residual, w, float(cfg_.norm_eps), y, rstd, cfg_.norm_offset());
}

// dy [n, D]; dx [n, D] accumulates; dw [D] f32 accumulates
void LlamaModel::norm_backward(const Tensor& x, const Tensor& w, const Tensor& rstd,
                               const Tensor& dy, const Tensor& dx, const Tensor& dw) {
  be_.rmsnorm_backward(x, w, rstd, dy, dx, dw, cfg_.norm_offset());
}

// gate, up, h [n, F]
void LlamaModel::gated_forward(const Tensor& gate, const Tensor& up, const Tensor& h) {
  if (cfg_.mlp_activation == "gelu_tanh") return be_.geglu_forward(gate, up, h);
  be_.swiglu_forward(gate, up, h);
}

// dh [n, F]; dgate, dup [n, F] overwritten
void LlamaModel::gated_backward(const Tensor& gate, const Tensor& up, const Tensor& dh,
                                const Tensor& dgate, const Tensor& dup) {
  if (cfg_.mlp_activation == "gelu_tanh") return be_.geglu_backward(gate, up, dh, dgate, dup);
  be_.swiglu_backward(gate, up, dh, dgate, dup);
}

// [R/2] f32, R = rotary_dim() (partial rotary: R < Dh)
Tensor LlamaModel::layer_inv_freq(int l) const {
  const int64_t half = cfg_.rotary_dim() / 2;
  return (cfg_.local_layer(l) ? inv_freq_local_ : inv_freq_).view(DType::kF32, {half});
}

float LlamaModel::embedding_multiplier() const {
  const auto scale = static_cast<float>(std::sqrt(double(cfg_.dim)));
  return opt_.activation_dtype == DType::kBF16 ? bf16_to_f32(f32_to_bf16(scale)) : scale;
}

}  // namespace shardlm
