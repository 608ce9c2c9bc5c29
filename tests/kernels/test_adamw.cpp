// Tests for cpu::adamw_step against an f64 reference written from the torch.optim.AdamW
// algorithm: several steps, weight decay on and off, grad_scale, bias correction at step 1,
// grad left unmodified. Tolerances (f32 kernel vs f64 reference): atol 1e-6, rtol 1e-5.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <ostream>
#include <vector>

#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/ops.h"
#include "test_util.h"

namespace shardlm {
namespace {

using test::view;

constexpr double kAtol = 1e-6;
constexpr double kRtol = 1e-5;

// One AdamW step in f64. p, m, v [n] updated in place; g [n].
void ref_adamw(std::vector<double>& p, const std::vector<float>& g, std::vector<double>& m,
               std::vector<double>& v, const AdamWHyper& hp) {
  const double lr = hp.lr, b1 = hp.beta1, b2 = hp.beta2, eps = hp.eps, wd = hp.weight_decay;
  const double bc1 = 1.0 - std::pow(b1, double(hp.step));
  const double bc2 = 1.0 - std::pow(b2, double(hp.step));
  for (size_t i = 0; i < p.size(); ++i) {
    const double gi = double(g[i]) * hp.grad_scale;
    p[i] -= lr * wd * p[i];
    m[i] = b1 * m[i] + (1 - b1) * gi;
    v[i] = b2 * v[i] + (1 - b2) * gi * gi;
    const double m_hat = m[i] / bc1;
    const double v_hat = v[i] / bc2;
    p[i] -= lr * m_hat / (std::sqrt(v_hat) + eps);
  }
}

struct AdamWCase {
  float weight_decay;
  float grad_scale;
};
void PrintTo(const AdamWCase& c, std::ostream* os) {
  *os << "{weight_decay " << c.weight_decay << ", grad_scale " << c.grad_scale << "}";
}

class AdamWSteps : public ::testing::TestWithParam<AdamWCase> {};

TEST_P(AdamWSteps, MatchesF64ReferenceOverSeveralSteps) {
  const int64_t n = 1037;  // not a multiple of any vector width
  auto param = test::random_vec(n, 1);
  std::vector<float> m(n, 0.0f), v(n, 0.0f);
  auto p_ref = test::to_f64(param);
  std::vector<double> m_ref(n, 0.0), v_ref(n, 0.0);

  AdamWHyper hp;
  hp.lr = 1e-2f;
  hp.beta1 = 0.9f;
  hp.beta2 = 0.95f;
  hp.eps = 1e-8f;
  hp.weight_decay = GetParam().weight_decay;
  hp.grad_scale = GetParam().grad_scale;
  for (int64_t step = 1; step <= 6; ++step) {
    SCOPED_TRACE(::testing::Message() << "step " << step);
    hp.step = step;
    auto grad = test::random_vec(n, 100 + step, -2.f, 2.f);
    const auto grad_before = grad;
    cpu::adamw_step(view(param, {n}), view(grad, {n}), view(m, {n}), view(v, {n}), hp);
    ref_adamw(p_ref, grad, m_ref, v_ref, hp);
    EXPECT_EQ(grad, grad_before);
    EXPECT_CLOSE(param, p_ref, kAtol, kRtol);
    EXPECT_CLOSE(m, m_ref, kAtol, kRtol);
    EXPECT_CLOSE(v, v_ref, kAtol, kRtol);
  }
}

INSTANTIATE_TEST_SUITE_P(Hyper, AdamWSteps,
                         ::testing::Values(AdamWCase{0.0f, 1.0f}, AdamWCase{0.1f, 1.0f},
                                           AdamWCase{0.0f, 0.25f}, AdamWCase{0.1f, 0.25f}));

// With zero moments, bias correction makes the first update lr * g / (|g| + eps) ~ lr * sign(g),
// whatever beta1, beta2 and the gradient's magnitude.
TEST(AdamW, FirstStepMovesEachWeightByAboutLr) {
  const int64_t n = 257;
  auto param = test::random_vec(n, 2);
  const auto param0 = param;
  auto grad = test::random_vec(n, 3, -1e-2f, 1e-2f);
  std::vector<float> m(n, 0.0f), v(n, 0.0f);
  AdamWHyper hp;
  hp.lr = 1e-3f;
  hp.beta1 = 0.9f;
  hp.beta2 = 0.999f;
  hp.step = 1;
  cpu::adamw_step(view(param, {n}), view(grad, {n}), view(m, {n}), view(v, {n}), hp);
  for (int64_t i = 0; i < n; ++i) {
    if (std::abs(grad[i]) < 1e-5f) continue;  // eps matters only for vanishing gradients
    const double delta = double(param0[i]) - double(param[i]);
    EXPECT_NEAR(delta, hp.lr * (grad[i] > 0 ? 1.0 : -1.0), 1e-3 * hp.lr) << "i=" << i;
  }
}

// Decoupled decay: with a zero gradient the weights shrink by exactly (1 - lr * wd).
TEST(AdamW, WeightDecayIsDecoupledFromTheGradient) {
  const int64_t n = 33;
  auto param = test::random_vec(n, 4);
  const auto param0 = param;
  std::vector<float> grad(n, 0.0f), m(n, 0.0f), v(n, 0.0f);
  AdamWHyper hp;
  hp.lr = 0.1f;
  hp.weight_decay = 0.5f;
  hp.step = 3;
  cpu::adamw_step(view(param, {n}), view(grad, {n}), view(m, {n}), view(v, {n}), hp);
  std::vector<double> expected(n);
  for (int64_t i = 0; i < n; ++i) expected[i] = param0[i] * (1.0 - 0.1 * 0.5);
  EXPECT_CLOSE(param, expected, kAtol, kRtol);
}

TEST(AdamW, RejectsMismatchedSizesAndStepZero) {
  cpu::CpuBackend be;  // through the entry points, which check the arguments
  std::vector<float> p(4), g(3), m(4), v(4), g4(4);
  AdamWHyper hp;
  EXPECT_THROW(be.adamw_step(view(p, {4}), view(g, {3}), view(m, {4}), view(v, {4}), hp), Error);
  hp.step = 0;
  EXPECT_THROW(be.adamw_step(view(p, {4}), view(g4, {4}), view(m, {4}), view(v, {4}), hp), Error);
}

}  // namespace
}  // namespace shardlm
