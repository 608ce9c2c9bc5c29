// Tests for cpu::lm_head_loss: loss, n_valid, dh and dw against an f64 reference that does
// materialise the [N, V] logits, gradients against central finite differences, invariance to
// chunk size, bf16 storage (sums still f32), workspace size independent of N, and the error
// paths (bad target, small ws).
// Tolerances (f32 kernel vs f64 reference): loss_sum rtol 1e-5; dh, dw atol 2e-5 rtol 1e-4.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "kernels/bf16_check.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/ops.h"
#include "test_util.h"
#include "xent_ref.h"

namespace shardlm {
namespace {

using test::view;

// The conversion scratch a CpuBackend passes the kernel (the f32 products never read it).
cpu::GemmScratch scratch() {
  static std::vector<float> panels(cpu::kGemmScratchFloats);
  return {panels.data(), panels.size()};
}

constexpr double kLossRtol = 1e-5;
constexpr double kGradAtol = 2e-5;
constexpr double kGradRtol = 1e-4;

// Sum over valid tokens of logsumexp(h_i W^T) - (h_i W^T)[t_i], all in f64.
// h [N, D]; w [V, D]; targets [N]
double ref_loss(const std::vector<double>& h, const std::vector<double>& w,
                const std::vector<int32_t>& targets, int64_t N, int64_t D, int64_t V) {
  std::vector<double> logits(N * V);  // [N, V]
  for (int64_t i = 0; i < N; ++i)
    for (int64_t j = 0; j < V; ++j) {
      double s = 0;
      for (int64_t k = 0; k < D; ++k) s += h[i * D + k] * w[j * D + k];
      logits[i * V + j] = s;
    }
  return test::cross_entropy_sum_ref(logits, targets, N, V);
}

// Analytic f64 gradients of grad_scale * ref_loss. dh [N, D]; dw [V, D] (both overwritten).
void ref_grad(const std::vector<double>& h, const std::vector<double>& w,
              const std::vector<int32_t>& targets, int64_t N, int64_t D, int64_t V,
              double grad_scale, std::vector<double>& dh, std::vector<double>& dw) {
  dh.assign(N * D, 0.0);
  dw.assign(V * D, 0.0);
  std::vector<double> p(V);  // [V]
  for (int64_t i = 0; i < N; ++i) {
    if (targets[i] == kIgnoreIndex) continue;
    for (int64_t j = 0; j < V; ++j) {
      double s = 0;
      for (int64_t k = 0; k < D; ++k) s += h[i * D + k] * w[j * D + k];
      p[j] = s;
    }
    const double mx = *std::max_element(p.begin(), p.end());
    double sum = 0;
    for (auto& x : p) sum += (x = std::exp(x - mx));
    for (int64_t j = 0; j < V; ++j) {
      const double dl = grad_scale * (p[j] / sum - (j == targets[i] ? 1.0 : 0.0));
      for (int64_t k = 0; k < D; ++k) {
        dh[i * D + k] += dl * w[j * D + k];
        dw[j * D + k] += dl * h[i * D + k];
      }
    }
  }
}

// Targets in [0, V) with roughly every fifth token ignored (never all, unless N is tiny).
std::vector<int32_t> make_targets(int64_t N, int64_t V, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int32_t> t(N);
  for (int64_t i = 0; i < N; ++i) {
    t[i] = static_cast<int32_t>(rng() % V);
    if (N > 1 && rng() % 5 == 0) t[i] = kIgnoreIndex;
  }
  return t;
}

struct KernelOut {
  LossResult loss;
  std::vector<float> dh;  // [N, D]
  std::vector<float> dw;  // [V, D], accumulated onto dw_init
};

KernelOut run_kernel(std::vector<float>& h, std::vector<float>& w, std::vector<int32_t>& targets,
                     int64_t N, int64_t D, int64_t V, int64_t chunk, float grad_scale,
                     const std::vector<float>& dw_init) {
  KernelOut out;
  out.dh.assign(N * D, 123.0f);  // garbage: dh must be overwritten
  out.dw = dw_init;
  std::vector<std::byte> ws(cpu::lm_head_loss_workspace_bytes(chunk, V));
  out.loss = cpu::lm_head_loss(view(h, {N, D}), view(w, {V, D}), view(targets, {N}), chunk,
                               grad_scale, view(out.dh, {N, D}), view(out.dw, {V, D}),
                               Workspace{ws.data(), ws.size()}, scratch());
  return out;
}

std::vector<double> sum_f64(const std::vector<float>& base, const std::vector<double>& d) {
  std::vector<double> r(base.size());
  for (size_t i = 0; i < r.size(); ++i) r[i] = double(base[i]) + d[i];
  return r;
}

// ---- loss and gradients over a grid of odd shapes and chunk sizes ------------------------------

using ShapeParam = std::tuple<int64_t, int64_t, int64_t, int64_t>;  // N, D, V, chunk

class LmHeadLossShapes : public ::testing::TestWithParam<ShapeParam> {};

TEST_P(LmHeadLossShapes, MatchesF64Reference) {
  const auto [N, D, V, chunk_or_zero] = GetParam();
  const int64_t chunk = chunk_or_zero == 0 ? N + 3 : chunk_or_zero;  // 0 means "more than N"
  auto h = test::random_vec(N * D, 1 + N * 7 + D, -1.f, 1.f);
  auto w = test::random_vec(V * D, 2 + V * 3 + D, -1.f, 1.f);
  auto targets = make_targets(N, V, 3 + N + V);
  const auto dw_init = test::random_vec(V * D, 4, -0.5f, 0.5f);
  const float grad_scale = 0.75f;

  const KernelOut out = run_kernel(h, w, targets, N, D, V, chunk, grad_scale, dw_init);

  const auto h64 = test::to_f64(h), w64 = test::to_f64(w);
  const double loss = ref_loss(h64, w64, targets, N, D, V);
  const int64_t n_valid =
      std::count_if(targets.begin(), targets.end(), [](int32_t t) { return t != kIgnoreIndex; });
  EXPECT_EQ(out.loss.n_valid, n_valid);
  EXPECT_NEAR(out.loss.loss_sum, loss, kLossRtol * (1.0 + std::abs(loss)));

  std::vector<double> dh_ref, dw_ref;
  ref_grad(h64, w64, targets, N, D, V, grad_scale, dh_ref, dw_ref);
  EXPECT_CLOSE(out.dh, dh_ref, kGradAtol, kGradRtol);
  EXPECT_CLOSE(out.dw, sum_f64(dw_init, dw_ref), kGradAtol, kGradRtol);
}

INSTANTIATE_TEST_SUITE_P(Grid, LmHeadLossShapes,
                         ::testing::Combine(::testing::Values(1, 7, 37),
                                            ::testing::Values(3, 16, 33),
                                            ::testing::Values(5, 259, 1000),
                                            ::testing::Values(1, 4, 16, 0)));

// ---- gradients against finite differences of the f64 loss --------------------------------------

TEST(LmHeadLoss, GradientsMatchFiniteDifferences) {
  for (const auto& [N, D, V] : {std::tuple<int64_t, int64_t, int64_t>{7, 16, 259}, {5, 3, 5}}) {
    SCOPED_TRACE(::testing::Message() << "N=" << N << " D=" << D << " V=" << V);
    auto h = test::random_vec(N * D, 11, -1.f, 1.f);
    auto w = test::random_vec(V * D, 12, -1.f, 1.f);
    auto targets = make_targets(N, V, 13);
    targets[1] = kIgnoreIndex;
    const auto dw_init = test::random_vec(V * D, 14, -0.5f, 0.5f);
    const float grad_scale = 1.5f;

    const KernelOut out = run_kernel(h, w, targets, N, D, V, 3, grad_scale, dw_init);

    auto h64 = test::to_f64(h), w64 = test::to_f64(w);
    auto loss = [&] { return ref_loss(h64, w64, targets, N, D, V); };
    auto fd_dh = test::finite_difference(h64, loss);
    auto fd_dw = test::finite_difference(w64, loss);
    for (auto& g : fd_dh) g *= grad_scale;
    for (auto& g : fd_dw) g *= grad_scale;
    EXPECT_CLOSE(out.dh, fd_dh, kGradAtol, kGradRtol);
    EXPECT_CLOSE(out.dw, sum_f64(dw_init, fd_dw), kGradAtol, kGradRtol);
    for (int64_t k = 0; k < D; ++k) EXPECT_EQ(out.dh[1 * D + k], 0.0f);  // ignored row
  }
}

TEST(LmHeadLoss, ChunkSizeDoesNotChangeResults) {
  const int64_t N = 37, D = 33, V = 259;
  auto h = test::random_vec(N * D, 21, -2.f, 2.f);
  auto w = test::random_vec(V * D, 22, -1.f, 1.f);
  auto targets = make_targets(N, V, 23);
  const auto dw_init = test::random_vec(V * D, 24);
  const KernelOut base = run_kernel(h, w, targets, N, D, V, N, 1.0f, dw_init);
  for (int64_t chunk : {1, 2, 5, 16, 36, 100}) {
    SCOPED_TRACE(::testing::Message() << "chunk=" << chunk);
    const KernelOut out = run_kernel(h, w, targets, N, D, V, chunk, 1.0f, dw_init);
    EXPECT_EQ(out.loss.n_valid, base.loss.n_valid);
    EXPECT_NEAR(out.loss.loss_sum, base.loss.loss_sum, 1e-6 * std::abs(base.loss.loss_sum));
    EXPECT_CLOSE(out.dh, base.dh, 1e-6, 1e-5);
    EXPECT_CLOSE(out.dw, base.dw, 1e-6, 1e-5);
  }
}

// bf16 h, w and dh on a shape whose D and V span several GEMM panels (no multiple of one), in
// three chunks. The logits stay f32, so the loss and an f32 dw accumulated over the chunks are
// as accurate as with f32 storage of the same values; dh is the f64 result rounded once. A bf16
// dw rounds once per chunk (checked here with one chunk; the op table takes several).
TEST(LmHeadLoss, Bf16StorageSumsInF32) {
  const int64_t N = 37, D = 2 * cpu::kGemmPanel + 5, V = 2 * cpu::kGemmPanel + 9, chunk = 16;
  test::Bf16Values h = test::bf16_random(N * D, 91), w = test::bf16_random(V * D, 92, -.1f, .1f),
                   dw16 = test::bf16_random(V * D, 93, -.5f, .5f);
  auto targets = make_targets(N, V, 94);
  const auto dw_init = test::random_vec(V * D, 95, -0.5f, 0.5f);
  std::vector<float> dw = dw_init;
  std::vector<uint16_t> dh(N * D, 0x7fc0);  // NaN: must be overwritten
  std::vector<std::byte> ws(cpu::lm_head_loss_workspace_bytes(chunk, V));
  const LossResult r = cpu::lm_head_loss(h.view({N, D}), w.view({V, D}), view(targets, {N}), chunk,
                                         0.75f, Tensor(dh.data(), DType::kBF16, {N, D}),
                                         view(dw, {V, D}), {ws.data(), ws.size()}, scratch());

  const double loss = ref_loss(h.f64, w.f64, targets, N, D, V);
  EXPECT_NEAR(r.loss_sum, loss, kLossRtol * (1.0 + std::abs(loss)));
  std::vector<double> dh_ref, dw_ref;
  ref_grad(h.f64, w.f64, targets, N, D, V, 0.75, dh_ref, dw_ref);
  EXPECT_TRUE(test::rounded_once(dh, dh_ref, kGradAtol, kGradRtol));
  EXPECT_CLOSE(dw, sum_f64(dw_init, dw_ref), kGradAtol, kGradRtol);

  // One chunk of all N tokens: the bf16 dw is its old value plus the product, rounded once.
  std::vector<double> want_dw16 = dw16.f64;
  for (size_t i = 0; i < want_dw16.size(); ++i) want_dw16[i] += dw_ref[i];
  std::vector<std::byte> ws_all(cpu::lm_head_loss_workspace_bytes(N, V));
  cpu::lm_head_loss(h.view({N, D}), w.view({V, D}), view(targets, {N}), N, 0.75f, Tensor(),
                    dw16.view({V, D}), {ws_all.data(), ws_all.size()}, scratch());
  EXPECT_TRUE(test::rounded_once(dw16.bits, want_dw16, kGradAtol, kGradRtol));
}

TEST(LmHeadLoss, LossOnlyLeavesGradientsAlone) {
  const int64_t N = 9, D = 16, V = 259, chunk = 4;
  auto h = test::random_vec(N * D, 31);
  auto w = test::random_vec(V * D, 32);
  auto targets = make_targets(N, V, 33);
  std::vector<std::byte> ws(cpu::lm_head_loss_workspace_bytes(chunk, V));
  const LossResult r =
      cpu::lm_head_loss(view(h, {N, D}), view(w, {V, D}), view(targets, {N}), chunk, 1.0f, Tensor(),
                        Tensor(), Workspace{ws.data(), ws.size()}, scratch());
  const double loss = ref_loss(test::to_f64(h), test::to_f64(w), targets, N, D, V);
  EXPECT_NEAR(r.loss_sum, loss, kLossRtol * (1.0 + loss));

  // dh only: dw stays untouched by construction (not passed); dh matches the reference.
  std::vector<float> dh(N * D, 7.0f);
  cpu::lm_head_loss(view(h, {N, D}), view(w, {V, D}), view(targets, {N}), chunk, 1.0f,
                    view(dh, {N, D}), Tensor(), Workspace{ws.data(), ws.size()}, scratch());
  std::vector<double> dh_ref, dw_ref;
  ref_grad(test::to_f64(h), test::to_f64(w), targets, N, D, V, 1.0, dh_ref, dw_ref);
  EXPECT_CLOSE(dh, dh_ref, kGradAtol, kGradRtol);
}

TEST(LmHeadLoss, AllTargetsIgnored) {
  const int64_t N = 6, D = 8, V = 33;
  auto h = test::random_vec(N * D, 41);
  auto w = test::random_vec(V * D, 42);
  std::vector<int32_t> targets(N, kIgnoreIndex);
  const auto dw_init = test::random_vec(V * D, 43);
  const KernelOut out = run_kernel(h, w, targets, N, D, V, 4, 1.0f, dw_init);
  EXPECT_EQ(out.loss.loss_sum, 0.0);
  EXPECT_EQ(out.loss.n_valid, 0);
  for (float x : out.dh) EXPECT_EQ(x, 0.0f);
  EXPECT_EQ(out.dw, dw_init);
}

// ---- memory: the workspace scales with chunk_tokens, never with N -------------------------------

TEST(LmHeadLoss, WorkspaceScalesWithChunkNotTokens) {
  const int64_t V = 259;
  EXPECT_EQ(cpu::lm_head_loss_workspace_bytes(512, V), size_t(512) * V * sizeof(float));
  EXPECT_EQ(cpu::lm_head_loss_workspace_bytes(1024, V),
            2 * cpu::lm_head_loss_workspace_bytes(512, V));

  // The same 512-row workspace serves N = 16 and N = 16384.
  const int64_t D = 16, chunk = 512;
  const size_t ws_bytes = cpu::lm_head_loss_workspace_bytes(chunk, V);
  std::vector<std::byte> ws(ws_bytes);
  for (int64_t N : {int64_t{16}, int64_t{16384}}) {
    SCOPED_TRACE(::testing::Message() << "N=" << N);
    auto h = test::random_vec(N * D, 51 + N);
    auto w = test::random_vec(V * D, 52);
    auto targets = make_targets(N, V, 53 + N);
    std::vector<float> dh(N * D), dw(V * D, 0.0f);
    const LossResult r = cpu::lm_head_loss(view(h, {N, D}), view(w, {V, D}), view(targets, {N}),
                                           chunk, 1.0f / N, view(dh, {N, D}), view(dw, {V, D}),
                                           Workspace{ws.data(), ws.size()}, scratch());
    if (N > chunk) {
      EXPECT_EQ(ws_bytes * (N / chunk), size_t(N) * V * sizeof(float));
    }
    const auto h64 = test::to_f64(h), w64 = test::to_f64(w);
    const double loss = ref_loss(h64, w64, targets, N, D, V);
    EXPECT_NEAR(r.loss_sum, loss, kLossRtol * (1.0 + loss));
    std::vector<double> dh_ref, dw_ref;
    ref_grad(h64, w64, targets, N, D, V, 1.0 / N, dh_ref, dw_ref);
    EXPECT_CLOSE(dh, dh_ref, kGradAtol, kGradRtol);
    EXPECT_CLOSE(dw, dw_ref, kGradAtol, kGradRtol);
  }
}

// ---- error paths ---------------------------------------------------------------------------

TEST(LmHeadLoss, OutOfRangeTargetIsADataErrorNamingTheId) {
  const int64_t N = 4, D = 4, V = 10;
  auto h = test::random_vec(N * D, 61);
  auto w = test::random_vec(V * D, 62);
  std::vector<float> dw(V * D, 0.0f);
  std::vector<std::byte> ws(cpu::lm_head_loss_workspace_bytes(2, V));
  for (int32_t bad : {10, -2, 4711}) {
    std::vector<int32_t> targets = {1, kIgnoreIndex, bad, 3};
    try {
      cpu::lm_head_loss(view(h, {N, D}), view(w, {V, D}), view(targets, {N}), 2, 1.0f, Tensor(),
                        view(dw, {V, D}), Workspace{ws.data(), ws.size()}, scratch());
      ADD_FAILURE() << "target " << bad << " was accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kData);
      EXPECT_NE(std::string(e.what()).find(std::to_string(bad)), std::string::npos) << e.what();
    }
    for (float x : dw) ASSERT_EQ(x, 0.0f);  // nothing accumulated before the check
  }
}

TEST(LmHeadLoss, TooSmallWorkspaceIsRejected) {
  cpu::CpuBackend be;  // through the entry points, which check the arguments
  const int64_t N = 4, D = 4, V = 10, chunk = 2;
  auto h = test::random_vec(N * D, 71);
  auto w = test::random_vec(V * D, 72);
  std::vector<int32_t> targets = {1, 2, 3, 4};
  std::vector<std::byte> ws(cpu::lm_head_loss_workspace_bytes(chunk, V) - 4);
  EXPECT_THROW(be.lm_head_loss(view(h, {N, D}), view(w, {V, D}), view(targets, {N}), chunk, 1.0f,
                               Tensor(), Tensor(), Workspace{ws.data(), ws.size()}),
               Error);
}

}  // namespace
}  // namespace shardlm
