// Tests of the CPU RMSNorm kernels (rmsnorm.cpp), weights w or (1 + w), against an f64
// reference: forward y and rstd on odd shapes and scales, backward dx and dw against central
// finite differences, the accumulate contract of dx and dw, and bit-identical dw for any thread
// count; in bf16, dx rounded once after its f32 accumulation and dw accumulated in f32.
#include <omp.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "kernels/bf16_check.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/ops.h"
#include "test_util.h"

namespace shardlm {
namespace {

// f32 outputs of f64-accumulated row reductions: a few f32 roundings per element.
constexpr double kF32Atol = 1e-6;
constexpr double kF32Rtol = 1e-5;
// Gradients: the f32 combination r*w*dy - c*x cancels, and dw sums N rows in f64.
constexpr double kGradAtol = 1e-5;
constexpr double kGradRtol = 1e-4;
constexpr float kEps = 1e-5f;

struct Dims {
  int64_t n, d;
};
const std::vector<Dims> kShapes = {{1, 1},  {1, 130}, {7, 5},    {7, 64},
                                   {33, 1}, {33, 5},  {33, 130}, {2, 64}};

struct RefOut {
  std::vector<double> y, rstd;
};

// off: the weights' offset (1 for Gemma's (1 + w), w around 0).
RefOut ref_forward(const std::vector<double>& x, const std::vector<double>& w, Dims s, double off) {
  RefOut o{std::vector<double>(s.n * s.d), std::vector<double>(s.n)};
  for (int64_t r = 0; r < s.n; ++r) {
    double ss = 0;
    for (int64_t j = 0; j < s.d; ++j) ss += x[r * s.d + j] * x[r * s.d + j];
    o.rstd[r] = 1.0 / std::sqrt(ss / double(s.d) + double(kEps));
    for (int64_t j = 0; j < s.d; ++j) o.y[r * s.d + j] = x[r * s.d + j] * o.rstd[r] * (off + w[j]);
  }
  return o;
}

TEST(RmsnormForward, MatchesF64) {
  for (Dims s : kShapes)
    for (float off : {0.f, 1.f})
      for (float amplitude : {1e-2f, 1.0f, 100.0f}) {
        std::vector<float> x = test::random_vec(s.n * s.d, 1, -amplitude, amplitude);
        std::vector<float> w = test::random_vec(s.d, 2, 0.5f - off, 1.5f - off);
        std::vector<float> y(x.size(), NAN), rstd(s.n, NAN);
        cpu::rmsnorm_forward(test::view(x, Shape{s.n, s.d}), test::view(w, Shape{s.d}), kEps,
                             test::view(y, Shape{s.n, s.d}), test::view(rstd, Shape{s.n}), off);
        const RefOut ref = ref_forward(test::to_f64(x), test::to_f64(w), s, off);
        EXPECT_CLOSE(y, ref.y, kF32Atol, kF32Rtol) << "N=" << s.n << " D=" << s.d << " off " << off;
        EXPECT_CLOSE(rstd, ref.rstd, 0.0, kF32Rtol) << "N=" << s.n << " D=" << s.d;
      }
}

// loss = sum(r * y(x, w)); dx and dw start nonzero and the kernel must add the gradient to them,
// on two consecutive calls; weights w and (1 + w).
TEST(RmsnormBackward, MatchesFiniteDifferencesAndAccumulates) {
  for (Dims s : kShapes)
    for (float off : {0.f, 1.f}) {
      std::vector<float> x = test::random_vec(s.n * s.d, 11, -2, 2);
      std::vector<float> w = test::random_vec(s.d, 12, 0.5f - off, 1.5f - off);
      std::vector<float> r = test::random_vec(s.n * s.d, 13);
      auto x64 = test::to_f64(x), w64 = test::to_f64(w);
      const auto r64 = test::to_f64(r);
      auto loss = [&] {
        const RefOut o = ref_forward(x64, w64, s, off);
        double l = 0;
        for (size_t k = 0; k < r64.size(); ++k) l += r64[k] * o.y[k];
        return l;
      };
      const auto gx = test::finite_difference(x64, loss);
      const auto gw = test::finite_difference(w64, loss);

      std::vector<float> y(x.size()), rstd(s.n);
      cpu::rmsnorm_forward(test::view(x, Shape{s.n, s.d}), test::view(w, Shape{s.d}), kEps,
                           test::view(y, Shape{s.n, s.d}), test::view(rstd, Shape{s.n}), off);
      const std::vector<float> dx0 = test::random_vec(x.size(), 14),
                               dw0 = test::random_vec(s.d, 15);
      std::vector<float> dx = dx0, dw = dw0;
      for (int call = 1; call <= 2; ++call) {
        cpu::rmsnorm_backward(test::view(x, Shape{s.n, s.d}), test::view(w, Shape{s.d}),
                              test::view(rstd, Shape{s.n}), test::view(r, Shape{s.n, s.d}),
                              test::view(dx, Shape{s.n, s.d}), test::view(dw, Shape{s.d}), off);
        std::vector<double> want_dx(x.size()), want_dw(s.d);
        for (size_t k = 0; k < x.size(); ++k) want_dx[k] = dx0[k] + call * gx[k];
        for (int64_t j = 0; j < s.d; ++j) want_dw[j] = dw0[j] + call * gw[j];
        EXPECT_CLOSE(dx, want_dx, kGradAtol, kGradRtol)
            << "N=" << s.n << " D=" << s.d << " off " << off << " call " << call;
        EXPECT_CLOSE(dw, want_dw, kGradAtol * s.n, kGradRtol)
            << "N=" << s.n << " D=" << s.d << " call " << call;
      }
    }
}

TEST(RmsnormBackward, DwIsDeterministicAcrossThreadCounts) {
  const int64_t n = 513, d = 200;
  std::vector<float> x = test::random_vec(n * d, 21), w = test::random_vec(d, 22);
  std::vector<float> dy = test::random_vec(n * d, 23), y(n * d), rstd(n);
  cpu::rmsnorm_forward(test::view(x, Shape{n, d}), test::view(w, Shape{d}), kEps,
                       test::view(y, Shape{n, d}), test::view(rstd, Shape{n}), 0.f);
  std::vector<float> first_dx, first_dw;
  const int saved = omp_get_max_threads();
  for (int threads : {1, 2, 3, 4}) {
    omp_set_num_threads(threads);
    std::vector<float> dx(n * d, 0.0f), dw(d, 0.0f);
    cpu::rmsnorm_backward(test::view(x, Shape{n, d}), test::view(w, Shape{d}),
                          test::view(rstd, Shape{n}), test::view(dy, Shape{n, d}),
                          test::view(dx, Shape{n, d}), test::view(dw, Shape{d}), 0.f);
    if (first_dw.empty()) {
      first_dx = dx;
      first_dw = dw;
    } else {
      EXPECT_EQ(dx, first_dx) << "threads = " << threads;
      EXPECT_EQ(dw, first_dw) << "threads = " << threads;
    }
  }
  omp_set_num_threads(saved);
}

TEST(Rmsnorm, RejectsMismatchedShapes) {
  cpu::CpuBackend be;  // through the entry points, which check the arguments
  std::vector<float> x(6 * 4), w(4), w3(3), y(6 * 4), rstd(6), rstd5(5);
  const Tensor tx = test::view(x, Shape{6, 4}), ty = test::view(y, Shape{6, 4});
  EXPECT_THROW(
      be.rmsnorm_forward(tx, test::view(w3, Shape{3}), kEps, ty, test::view(rstd, Shape{6})),
      Error);
  EXPECT_THROW(
      be.rmsnorm_forward(tx, test::view(w, Shape{4}), kEps, ty, test::view(rstd5, Shape{5})),
      Error);
  EXPECT_THROW(be.rmsnorm_forward(tx, test::view(w, Shape{4}), kEps, test::view(y, Shape{4, 6}),
                                  test::view(rstd, Shape{6})),
               Error);
  EXPECT_THROW(be.rmsnorm_backward(tx, test::view(w, Shape{4}), test::view(rstd, Shape{6}), ty,
                                   test::view(y, Shape{24}), test::view(w, Shape{4})),
               Error);
}

// bf16 storage of x, w, dy and dx (rstd and dw f32): each dx element is its f64 value (the old
// dx plus the gradient of the stored inputs) rounded once to bf16, up to f32 error; rounding the
// gradient to bf16 before adding it would miss by up to a further half ulp. dw holds f32
// accuracy: a bf16 rounding anywhere in its sum would cost ~1e-3 relative.
TEST(RmsnormBackward, Bf16DxIsRoundedOnceAndDwAccumulatesInF32) {
  const int64_t n = 257, d = 200;
  using test::to_bf16;
  std::vector<uint16_t> x = to_bf16(test::random_vec(n * d, 31, -2, 2));
  std::vector<uint16_t> w = to_bf16(test::random_vec(d, 32, 0.5f, 1.5f));
  std::vector<uint16_t> dy = to_bf16(test::random_vec(n * d, 33));
  const std::vector<uint16_t> dx0 = to_bf16(test::random_vec(n * d, 34));
  const std::vector<float> dw0 = test::random_vec(d, 35);
  std::vector<uint16_t> y(n * d), dx = dx0;
  std::vector<float> rstd(n), dw = dw0;
  cpu::CpuBackend be;  // through the entry points: the contract admits this mix of dtypes
  be.rmsnorm_forward(test::view(x, {n, d}), test::view(w, {d}), kEps, test::view(y, {n, d}),
                     test::view(rstd, {n}));
  be.rmsnorm_backward(test::view(x, {n, d}), test::view(w, {d}), test::view(rstd, {n}),
                      test::view(dy, {n, d}), test::view(dx, {n, d}), test::view(dw, {d}));

  auto at = [](const std::vector<uint16_t>& v, int64_t j) { return double(bf16_to_f32(v[j])); };
  std::vector<double> want_dw(dw0.begin(), dw0.end());
  int64_t dx_misses = 0;
  for (int64_t r = 0; r < n; ++r) {
    const double rs = rstd[r];
    double dot = 0;
    for (int64_t j = 0; j < d; ++j) dot += at(dy, r * d + j) * at(w, j) * at(x, r * d + j);
    const double c = rs * rs * rs * dot / double(d);
    for (int64_t j = 0; j < d; ++j) {
      const int64_t k = r * d + j;
      const double a = rs * at(w, j) * at(dy, k), b = c * at(x, k);
      const double want = at(dx0, k) + (a - b);
      const double slack = 1e-6 * (std::abs(at(dx0, k)) + std::abs(a) + std::abs(b));
      const double half_ulp = test::bf16_half_ulp(std::abs(want) + slack);
      if (std::abs(at(dx, k) - want) > half_ulp + slack && ++dx_misses <= 3)
        ADD_FAILURE() << "dx[" << r << ", " << j << "] = " << at(dx, k) << ", want " << want
                      << " rounded once (half an ulp: " << half_ulp << ")";
      want_dw[j] += at(dy, k) * at(x, k) * rs;
    }
  }
  EXPECT_EQ(dx_misses, 0);
  EXPECT_CLOSE(dw, want_dw, 1e-5, 1e-5);
}

}  // namespace
}  // namespace shardlm
