// Tests of the CPU GeGLU kernels (swiglu.cpp's geglu_*: Gemma's tanh-approximated GELU times up)
// against an f64 reference: forward on odd shapes, backward against central finite differences,
// overwrite semantics of dgate/dup, and saturation without NaN for large |gate|.
#include <cmath>
#include <numbers>
#include <vector>

#include "gated_checks.h"
#include "kernels/cpu/ops.h"
#include "test_util.h"

namespace shardlm {
namespace {

// f32 exp is within a few ulps; tanh through it and the products add a few more roundings.
constexpr double kF32Atol = 2e-6;
constexpr double kF32Rtol = 2e-5;

// PyTorch's gelu(approximate="tanh") in f64.
double ref_gelu_tanh(double g) {
  const double k = std::sqrt(2.0 / std::numbers::pi);
  return 0.5 * g * (1.0 + std::tanh(k * (g + 0.044715 * g * g * g)));
}

const test::GatedKernel kGeglu = {cpu::geglu_forward, cpu::geglu_backward, ref_gelu_tanh, kF32Atol,
                                  kF32Rtol};

TEST(GegluForward, MatchesF64) { test::expect_gated_forward_matches_f64(kGeglu); }

TEST(GegluBackward, MatchesFiniteDifferences) {
  test::expect_gated_backward_matches_finite_differences(kGeglu);
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
