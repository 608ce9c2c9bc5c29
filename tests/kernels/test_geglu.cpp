// Tests of the CPU GeGLU kernels (swiglu.cpp's geglu_*: Gemma's tanh-approximated GELU times up)
// against an f64 reference: forward on odd shapes, backward against central finite differences,
// overwrite semantics of dgate/dup, and saturation without NaN for large |gate|.
#include <cmath>
#include <numbers>
#include <vector>

#include "kernels/cpu/ops.h"
#include "test_util.h"

namespace shardlm {
namespace {

// f32 exp is within a few ulps; tanh through it and the products add a few more roundings.
constexpr double kF32Atol = 2e-6;
constexpr double kF32Rtol = 2e-5;

struct Dims {
  int64_t n, f;
};
const std::vector<Dims> kShapes = {{1, 1}, {7, 5}, {33, 64}, {1, 130}, {33, 1}, {7, 130}};

// PyTorch's gelu(approximate="tanh") in f64.
double ref_gelu_tanh(double g) {
  const double k = std::sqrt(2.0 / std::numbers::pi);
  return 0.5 * g * (1.0 + std::tanh(k * (g + 0.044715 * g * g * g)));
}

std::vector<double> ref_forward(const std::vector<double>& gate, const std::vector<double>& up) {
  std::vector<double> h(gate.size());
  for (size_t k = 0; k < h.size(); ++k) h[k] = ref_gelu_tanh(gate[k]) * up[k];
  return h;
}

TEST(GegluForward, MatchesF64) {
  for (Dims s : kShapes) {
    std::vector<float> gate = test::random_vec(s.n * s.f, 1, -6, 6);
    std::vector<float> up = test::random_vec(s.n * s.f, 2, -2, 2);
    std::vector<float> h(gate.size(), NAN);
    cpu::geglu_forward(test::view(gate, Shape{s.n, s.f}), test::view(up, Shape{s.n, s.f}),
                       test::view(h, Shape{s.n, s.f}));
    EXPECT_CLOSE(h, ref_forward(test::to_f64(gate), test::to_f64(up)), kF32Atol, kF32Rtol)
        << "N=" << s.n << " F=" << s.f;
  }
}

// loss = sum(r * h(gate, up)); dgate and dup start as NaN and must be overwritten.
TEST(GegluBackward, MatchesFiniteDifferences) {
  for (Dims s : kShapes) {
    std::vector<float> gate = test::random_vec(s.n * s.f, 11, -6, 6);
    std::vector<float> up = test::random_vec(s.n * s.f, 12, -2, 2);
    std::vector<float> r = test::random_vec(s.n * s.f, 13);
    auto g64 = test::to_f64(gate), u64 = test::to_f64(up);
    const auto r64 = test::to_f64(r);
    auto loss = [&] {
      const auto h = ref_forward(g64, u64);
      double l = 0;
      for (size_t k = 0; k < h.size(); ++k) l += r64[k] * h[k];
      return l;
    };
    const auto grad_gate = test::finite_difference(g64, loss);
    const auto grad_up = test::finite_difference(u64, loss);
    std::vector<float> dgate(gate.size(), NAN), dup(gate.size(), NAN);
    for (int call = 0; call < 2; ++call) {  // a second call must not accumulate
      cpu::geglu_backward(test::view(gate, Shape{s.n, s.f}), test::view(up, Shape{s.n, s.f}),
                          test::view(r, Shape{s.n, s.f}), test::view(dgate, Shape{s.n, s.f}),
                          test::view(dup, Shape{s.n, s.f}));
      EXPECT_CLOSE(dgate, grad_gate, 1e-5, 1e-4) << "N=" << s.n << " F=" << s.f;
      EXPECT_CLOSE(dup, grad_up, 1e-5, 1e-4) << "N=" << s.n << " F=" << s.f;
    }
  }
}

TEST(Geglu, SaturatesWithoutNaN) {
  std::vector<float> gate = {-1000.f, -100.f, -20.f, 0.f, 20.f, 100.f, 1000.f};
  const int64_t n = static_cast<int64_t>(gate.size());
  std::vector<float> up(n, 1.5f), dh(n, 1.0f), h(n), dgate(n), dup(n);
  const Shape s{1, n};
  cpu::geglu_forward(test::view(gate, s), test::view(up, s), test::view(h, s));
  cpu::geglu_backward(test::view(gate, s), test::view(up, s), test::view(dh, s),
                      test::view(dgate, s), test::view(dup, s));
  for (int64_t k = 0; k < n; ++k) {
    const double g = gate[k];
    // gelu_tanh saturates to relu far from 0; at 0 it is 0 with slope 1/2.
    const double want_h = g > 0 ? g * 1.5 : 0.0;
    const double want_dgate = g > 0 ? 1.5 : g == 0 ? 0.75 : 0.0;
    EXPECT_TRUE(std::isfinite(h[k]) && std::isfinite(dgate[k]) && std::isfinite(dup[k]));
    EXPECT_NEAR(h[k], want_h, 1e-6 * std::abs(want_h) + 1e-12) << "gate " << g;
    EXPECT_NEAR(dgate[k], want_dgate, 1e-6) << "gate " << g;
    EXPECT_NEAR(dup[k], g > 0 ? g : 0.0, 1e-6 * std::abs(g)) << "gate " << g;
  }
}

}  // namespace
}  // namespace shardlm
