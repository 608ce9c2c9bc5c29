// Tests of the CPU SwiGLU kernels (swiglu.cpp) against an f64 reference: forward on odd shapes,
// backward against central finite differences, overwrite semantics of dgate/dup, and saturation
// without NaN for large |gate|.
#include <cmath>
#include <vector>

#include "gated_checks.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/ops.h"
#include "test_util.h"

namespace shardlm {
namespace {

// f32 exp is within a few ulps; the products add a few more roundings.
constexpr double kF32Atol = 1e-6;
constexpr double kF32Rtol = 1e-5;

double ref_sigmoid(double g) { return 1.0 / (1.0 + std::exp(-g)); }
double ref_silu(double g) { return g * ref_sigmoid(g); }

const test::GatedKernel kSwiglu = {cpu::swiglu_forward, cpu::swiglu_backward, ref_silu, kF32Atol,
                                   kF32Rtol};

TEST(SwigluForward, MatchesF64) { test::expect_gated_forward_matches_f64(kSwiglu); }

TEST(SwigluBackward, MatchesFiniteDifferences) {
  test::expect_gated_backward_matches_finite_differences(kSwiglu);
}

TEST(Swiglu, SaturatesWithoutNaN) {
  std::vector<float> gate = {-1000.f, -100.f, -20.f, 0.f, 20.f, 100.f, 1000.f};
  const int64_t n = static_cast<int64_t>(gate.size());
  std::vector<float> up(n, 1.5f), dh(n, 1.0f), h(n), dgate(n), dup(n);
  const Shape s{1, n};
  cpu::swiglu_forward(test::view(gate, s), test::view(up, s), test::view(h, s));
  cpu::swiglu_backward(test::view(gate, s), test::view(up, s), test::view(dh, s),
                       test::view(dgate, s), test::view(dup, s));
  std::vector<double> want_h(n), want_dgate(n), want_dup(n);
  for (int64_t k = 0; k < n; ++k) {
    const double g = gate[k], sg = ref_sigmoid(g);
    want_h[k] = g * sg * 1.5;
    want_dup[k] = g * sg;
    want_dgate[k] = 1.5 * sg * (1 + g * (1 - sg));
  }
  EXPECT_CLOSE(h, want_h, kF32Atol, kF32Rtol);
  EXPECT_CLOSE(dup, want_dup, kF32Atol, kF32Rtol);
  EXPECT_CLOSE(dgate, want_dgate, kF32Atol, kF32Rtol);
}

// The kernel's own vectorized exp: a dense sweep of gate over [-100, 100] (past both clamps)
// must match f64 everywhere, and a NaN gate must give NaN rather than a plausible number.
TEST(Swiglu, DenseGateSweepMatchesF64) {
  const int64_t n = 20001;
  std::vector<float> gate(n), up(n, -0.75f), dh(n, 1.25f), h(n), dgate(n), dup(n);
  for (int64_t k = 0; k < n; ++k) gate[k] = -100.0f + 0.01f * static_cast<float>(k);
  const Shape s{1, n};
  cpu::swiglu_forward(test::view(gate, s), test::view(up, s), test::view(h, s));
  cpu::swiglu_backward(test::view(gate, s), test::view(up, s), test::view(dh, s),
                       test::view(dgate, s), test::view(dup, s));
  std::vector<double> want_h(n), want_dgate(n), want_dup(n);
  for (int64_t k = 0; k < n; ++k) {
    const double g = gate[k], sg = ref_sigmoid(g);
    want_h[k] = g * sg * -0.75;
    want_dup[k] = 1.25 * g * sg;
    want_dgate[k] = 1.25 * -0.75 * sg * (1 + g * (1 - sg));
  }
  EXPECT_CLOSE(h, want_h, kF32Atol, kF32Rtol);
  EXPECT_CLOSE(dup, want_dup, kF32Atol, kF32Rtol);
  EXPECT_CLOSE(dgate, want_dgate, kF32Atol, kF32Rtol);

  std::vector<float> nan_gate = {NAN}, one = {1.0f}, out = {0.0f};
  cpu::swiglu_forward(test::view(nan_gate, Shape{1, 1}), test::view(one, Shape{1, 1}),
                      test::view(out, Shape{1, 1}));
  EXPECT_TRUE(std::isnan(out[0]));
}

TEST(Swiglu, RejectsMismatchedShapes) {
  cpu::CpuBackend be;  // through the entry points, which check the arguments
  std::vector<float> a(12), b(12), c(12), d(12), e(12);
  EXPECT_THROW(be.swiglu_forward(test::view(a, Shape{3, 4}), test::view(b, Shape{4, 3}),
                                 test::view(c, Shape{3, 4})),
               Error);
  EXPECT_THROW(be.swiglu_backward(test::view(a, Shape{3, 4}), test::view(b, Shape{3, 4}),
                                  test::view(c, Shape{3, 4}), test::view(d, Shape{3, 4}),
                                  test::view(e, Shape{12})),
               Error);
}

}  // namespace
}  // namespace shardlm
