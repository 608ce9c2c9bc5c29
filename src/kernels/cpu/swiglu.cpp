// The gated activations on the CPU: SwiGLU, h = silu(gate) * up with silu(g) = g * sigmoid(g),
// and GeGLU, h = gelu_tanh(gate) * up, and their backwards (dgate, dup overwritten). Purely
// elementwise over [N, F], OpenMP over flat chunks. sigmoid is 1 / (1 + exp(-g)) with an inline,
// vectorizable exp. All tensors are f32 or bf16 (one dtype), the arithmetic f32. No allocation.
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>

#include "kernels/cpu/element.h"
#include "kernels/cpu/ops.h"

namespace shardlm::cpu {
namespace {

// exp(x) with x clamped to [-87, 88] (so 2^n stays a normal float), Cephes' polynomial on the
// reduced argument, within 2 ulp of the true value. Plain arithmetic so that the calling loops
// vectorize: libm's expf has no SIMD variant without -ffast-math, and it made SwiGLU 5x slower.
inline float exp_clamped(float x) {
  x = std::min(std::max(x, -87.0f), 88.0f);
  // Adding 1.5 * 2^23 rounds x / ln2 to the nearest integer n, which lands in the low mantissa
  // bits (std::floor does not vectorize here).
  constexpr float kRoundShift = 12582912.0f;
  const float shifted = std::fma(x, 1.44269504088896341f, kRoundShift);
  const float n = shifted - kRoundShift;
  const int32_t n_int = std::bit_cast<int32_t>(shifted) - std::bit_cast<int32_t>(kRoundShift);
  float r = std::fma(n, -0.693359375f, x);  // x - n ln2, with ln2 in two parts
  r = std::fma(n, 2.12194440e-4f, r);
  float p = 1.9875691500e-4f;
  p = std::fma(p, r, 1.3981999507e-3f);
  p = std::fma(p, r, 8.3334519073e-3f);
  p = std::fma(p, r, 4.1665795894e-2f);
  p = std::fma(p, r, 1.6666665459e-1f);
  p = std::fma(p, r, 5.0000001201e-1f);
  const float y = std::fma(p, r * r, r) + 1.0f;
  return y * std::bit_cast<float>((n_int + 127) << 23);
}

// Saturates to exactly 0 or 1 only in the limit; never NaN for finite g.
inline float sigmoid(float g) { return 1.0f / (1.0f + exp_clamped(-g)); }

// gelu_tanh(g) = 0.5 g (1 + tanh(u)) with u = sqrt(2/pi) (g + 0.044715 g^3); 1 + tanh(u) =
// 2 sigmoid(2u), so gelu_tanh(g) = g sigmoid(2u) (the exp's clamp saturates it exactly).
constexpr float kGeluK = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float kGeluC = 0.044715f;
inline float gelu_tanh(float g) { return g * sigmoid(2.0f * kGeluK * (g + kGeluC * g * g * g)); }
// d gelu_tanh / dg = s + g * 2 s (1 - s) * du/dg, s = sigmoid(2u), du/dg = k (1 + 3 c g^2).
inline float gelu_tanh_grad(float g) {
  const float s = sigmoid(2.0f * kGeluK * (g + kGeluC * g * g * g));
  return s + 2.0f * g * s * (1.0f - s) * kGeluK * (1.0f + 3.0f * kGeluC * g * g);
}

// The gate activations of the gated MLPs: h = act(g) * u, and the gradients of dh through it
// (each in the arithmetic order it always had, so results stay bitwise).
// dsilu/dg = s + g s (1 - s) = s (1 + g (1 - s)) with s = sigmoid(g).
struct Silu {
  static float h(float g, float u) { return g * sigmoid(g) * u; }
  static void grads(float g, float u, float d, float& dgate, float& dup) {
    const float s = sigmoid(g);
    dup = d * g * s;
    dgate = d * u * s * (1.0f + g * (1.0f - s));
  }
};
// dup = dh gelu_tanh(g); dgate = dh up gelu_tanh'(g).
struct GeluTanh {
  static float h(float g, float u) { return gelu_tanh(g) * u; }
  static void grads(float g, float u, float d, float& dgate, float& dup) {
    dup = d * gelu_tanh(g);
    dgate = d * u * gelu_tanh_grad(g);
  }
};

// gate, up, h: [N, F]; h overwritten
template <typename Act>
void gated_forward(const Tensor& gate, const Tensor& up, const Tensor& h) {
  const int64_t n = gate.numel();
  if (n == 0) return;
  with_float(gate, [&](auto tag) {
    using T = decltype(tag);
    const T* pg = elems<T>(gate);
    const T* pu = elems<T>(up);
    T* ph = elems<T>(h);
#pragma omp parallel for simd schedule(static) if (n > 16384)
    for (int64_t i = 0; i < n; ++i) store(ph + i, Act::h(load(pg + i), load(pu + i)));
  });
}

// gate, up, dh: [N, F]; dgate, dup: [N, F] overwritten.
template <typename Act>
void gated_backward(const Tensor& gate, const Tensor& up, const Tensor& dh, const Tensor& dgate,
                    const Tensor& dup) {
  const int64_t n = gate.numel();
  if (n == 0) return;
  with_float(gate, [&](auto tag) {
    using T = decltype(tag);
    const T* pg = elems<T>(gate);
    const T* pu = elems<T>(up);
    const T* pdh = elems<T>(dh);
    T* pdg = elems<T>(dgate);
    T* pdu = elems<T>(dup);
#pragma omp parallel for simd schedule(static) if (n > 16384)
    for (int64_t i = 0; i < n; ++i) {
      float dg, du;
      Act::grads(load(pg + i), load(pu + i), load(pdh + i), dg, du);
      store(pdu + i, du);
      store(pdg + i, dg);
    }
  });
}

}  // namespace

void swiglu_forward(const Tensor& gate, const Tensor& up, const Tensor& h) {
  gated_forward<Silu>(gate, up, h);
}

void swiglu_backward(const Tensor& gate, const Tensor& up, const Tensor& dh, const Tensor& dgate,
                     const Tensor& dup) {
  gated_backward<Silu>(gate, up, dh, dgate, dup);
}

void geglu_forward(const Tensor& gate, const Tensor& up, const Tensor& h) {
  gated_forward<GeluTanh>(gate, up, h);
}

void geglu_backward(const Tensor& gate, const Tensor& up, const Tensor& dh, const Tensor& dgate,
                    const Tensor& dup) {
  gated_backward<GeluTanh>(gate, up, dh, dgate, dup);
}

}  // namespace shardlm::cpu
