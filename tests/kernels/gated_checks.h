// The checks a gated activation kernel of the CPU backend passes (SwiGLU, GeGLU: h = act(gate) *
// up), shared by their test files: forward against an f64 reference on odd shapes, backward
// against central finite differences of that reference, dgate and dup overwritten (NaN before,
// and a second call must not accumulate).
#pragma once

#include <cmath>
#include <vector>

#include "test_util.h"

namespace shardlm::test {

struct GatedKernel {
  void (*forward)(const Tensor& gate, const Tensor& up, const Tensor& h);
  void (*backward)(const Tensor& gate, const Tensor& up, const Tensor& dh, const Tensor& dgate,
                   const Tensor& dup);
  double (*activation)(double g);  // the f64 reference of act
  double atol, rtol;               // the forward's f32 tolerance
};

struct GatedDims {
  int64_t n, f;
};
inline const std::vector<GatedDims> kGatedShapes = {{1, 1},   {7, 5},  {33, 64},
                                                    {1, 130}, {33, 1}, {7, 130}};

inline std::vector<double> gated_reference(const GatedKernel& k, const std::vector<double>& gate,
                                           const std::vector<double>& up) {
  std::vector<double> h(gate.size());
  for (size_t i = 0; i < h.size(); ++i) h[i] = k.activation(gate[i]) * up[i];
  return h;
}

inline void expect_gated_forward_matches_f64(const GatedKernel& k) {
  for (GatedDims s : kGatedShapes) {
    std::vector<float> gate = random_vec(s.n * s.f, 1, -6, 6);
    std::vector<float> up = random_vec(s.n * s.f, 2, -2, 2);
    std::vector<float> h(gate.size(), NAN);
    k.forward(view(gate, Shape{s.n, s.f}), view(up, Shape{s.n, s.f}), view(h, Shape{s.n, s.f}));
    EXPECT_CLOSE(h, gated_reference(k, to_f64(gate), to_f64(up)), k.atol, k.rtol)
        << "N=" << s.n << " F=" << s.f;
  }
}

// loss = sum(r * h(gate, up)); dgate and dup start as NaN and must be overwritten.
inline void expect_gated_backward_matches_finite_differences(const GatedKernel& k) {
  for (GatedDims s : kGatedShapes) {
    std::vector<float> gate = random_vec(s.n * s.f, 11, -6, 6);
    std::vector<float> up = random_vec(s.n * s.f, 12, -2, 2);
    std::vector<float> r = random_vec(s.n * s.f, 13);
    auto g64 = to_f64(gate), u64 = to_f64(up);
    const auto r64 = to_f64(r);
    auto loss = [&] {
      const auto h = gated_reference(k, g64, u64);
      double l = 0;
      for (size_t i = 0; i < h.size(); ++i) l += r64[i] * h[i];
      return l;
    };
    const auto grad_gate = finite_difference(g64, loss);
    const auto grad_up = finite_difference(u64, loss);
    std::vector<float> dgate(gate.size(), NAN), dup(gate.size(), NAN);
    for (int call = 0; call < 2; ++call) {  // a second call must not accumulate
      k.backward(view(gate, Shape{s.n, s.f}), view(up, Shape{s.n, s.f}), view(r, Shape{s.n, s.f}),
                 view(dgate, Shape{s.n, s.f}), view(dup, Shape{s.n, s.f}));
      // Central differences with h = 1e-6 on a smooth f64 function: error ~1e-9.
      EXPECT_CLOSE(dgate, grad_gate, 1e-5, 1e-4) << "N=" << s.n << " F=" << s.f;
      EXPECT_CLOSE(dup, grad_up, 1e-5, 1e-4) << "N=" << s.n << " F=" << s.f;
    }
  }
}

}  // namespace shardlm::test
