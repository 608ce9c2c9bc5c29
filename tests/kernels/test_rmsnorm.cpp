// Tests of the CPU RMSNorm kernels (rmsnorm.cpp), weights w or (1 + w), against an f64
// reference: forward y and rstd on odd shapes and scales, backward dx and dw against central
// finite differences, the accumulate contract of dx and dw, and bit-identical dw for any thread
// count; in bf16, dx rounded once after its f32 accumulation and dw accumulated in f32. The fused
// residual add and norm: the unfused ops' bits, and its backward against finite differences.
#include <omp.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
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

// The fused residual add and norm gives add's and rmsnorm_forward's bits (sum, y and rstd) in f32
// and bf16, at any thread count, on row widths that do and do not fill a vector.
TEST(AddRmsnormForward, GivesTheBitsOfAddThenTheNorm) {
  const int saved = omp_get_max_threads();
  for (Dims s : {Dims{513, 200}, Dims{33, 130}, Dims{7, 5}, Dims{1, 2048}})
    for (DType dt : {DType::kF32, DType::kBF16})
      for (int threads : {1, 3}) {
        omp_set_num_threads(threads);
        const int64_t n = s.n, d = s.d;
        // Raw storage of either dtype: f32 words, or bf16 halves in the low part of the buffer.
        auto make = [&](int64_t count, uint64_t seed, float lo, float hi) {
          std::vector<float> v = test::random_vec(count, seed, lo, hi);
          if (dt == DType::kBF16) {
            std::vector<uint16_t> b = test::to_bf16(v);
            std::memcpy(v.data(), b.data(), b.size() * 2);
          }
          return v;
        };
        const std::vector<float> x = make(n * d, 41, -2, 2), res0 = make(n * d, 42, -3, 3);
        std::vector<float> w = make(d, 43, 0.5f, 1.5f);
        auto t = [&](std::vector<float>& v, Shape sh) {
          return Tensor(v.data(), dt, sh, MemPool::kHost);
        };
        std::vector<float> xa = x, ra = res0, ya(n * d), rsa(n), xb = x, rb = res0, yb(n * d),
                           rsb(n);
        cpu::CpuBackend be;
        be.add(t(ra, {n, d}), t(xa, {n, d}), t(ra, {n, d}));
        be.rmsnorm_forward(t(ra, {n, d}), t(w, {d}), kEps, t(ya, {n, d}), test::view(rsa, Shape{n}),
                           0.5f);
        be.add_rmsnorm_forward(t(xb, {n, d}), t(rb, {n, d}), t(w, {d}), kEps, t(yb, {n, d}),
                               test::view(rsb, Shape{n}), 0.5f);
        const std::string what = "N=" + std::to_string(n) + " D=" + std::to_string(d) + " " +
                                 std::string(dtype_name(dt)) + " threads " +
                                 std::to_string(threads);
        EXPECT_EQ(std::memcmp(ra.data(), rb.data(), ra.size() * 4), 0) << what << ": residual";
        EXPECT_EQ(std::memcmp(ya.data(), yb.data(), ya.size() * 4), 0) << what << ": y";
        EXPECT_EQ(std::memcmp(rsa.data(), rsb.data(), rsa.size() * 4), 0) << what << ": rstd";
        EXPECT_EQ(std::memcmp(xa.data(), xb.data(), xa.size() * 4), 0) << what << ": x is read";
      }
  omp_set_num_threads(saved);
}

// Its backward is rmsnorm_backward on the stored sum: loss = sum(g * y(res + x)) has the same
// gradient with respect to res and to x, and rmsnorm_backward's accumulating dx, started from
// the gradient that reaches the residual stream from above, is it plus that gradient.
TEST(AddRmsnormForward, BackwardIsTheNormsOnTheSumAndMatchesFiniteDifferences) {
  for (Dims s : kShapes)
    for (float off : {0.f, 1.f}) {
      std::vector<float> x = test::random_vec(s.n * s.d, 51, -2, 2);
      std::vector<float> res = test::random_vec(s.n * s.d, 52, -2, 2);
      std::vector<float> w = test::random_vec(s.d, 53, 0.5f - off, 1.5f - off);
      std::vector<float> g = test::random_vec(s.n * s.d, 54);
      auto x64 = test::to_f64(x), res64 = test::to_f64(res);
      const auto w64 = test::to_f64(w), g64 = test::to_f64(g);
      auto loss = [&] {
        std::vector<double> sum(x64.size());
        for (size_t k = 0; k < sum.size(); ++k) sum[k] = res64[k] + x64[k];
        const RefOut o = ref_forward(sum, w64, s, off);
        double l = 0;
        for (size_t k = 0; k < g64.size(); ++k) l += g64[k] * o.y[k];
        return l;
      };
      const auto gx = test::finite_difference(x64, loss);
      const auto gres = test::finite_difference(res64, loss);

      cpu::CpuBackend be;
      std::vector<float> y(x.size()), rstd(s.n), dw(s.d, 0.f);
      be.add_rmsnorm_forward(test::view(x, Shape{s.n, s.d}), test::view(res, Shape{s.n, s.d}),
                             test::view(w, Shape{s.d}), kEps, test::view(y, Shape{s.n, s.d}),
                             test::view(rstd, Shape{s.n}), off);
      const std::vector<float> d_above = test::random_vec(x.size(), 55);
      std::vector<float> d_stream = d_above;
      be.rmsnorm_backward(test::view(res, Shape{s.n, s.d}), test::view(w, Shape{s.d}),
                          test::view(rstd, Shape{s.n}), test::view(g, Shape{s.n, s.d}),
                          test::view(d_stream, Shape{s.n, s.d}), test::view(dw, Shape{s.d}), off);
      std::vector<double> want_x(x.size()), want_res(x.size());
      for (size_t k = 0; k < x.size(); ++k) {
        want_x[k] = d_above[k] + gx[k];
        want_res[k] = d_above[k] + gres[k];
      }
      EXPECT_CLOSE(d_stream, want_x, kGradAtol, kGradRtol)
          << "N=" << s.n << " D=" << s.d << " off " << off << ": d x";
      EXPECT_CLOSE(d_stream, want_res, kGradAtol, kGradRtol)
          << "N=" << s.n << " D=" << s.d << " off " << off << ": d residual";
    }
}

TEST(AddRmsnormForward, RejectsMismatchedShapesAndSharedOutputs) {
  cpu::CpuBackend be;
  std::vector<float> x(6 * 4), res(6 * 4), w(4), y(6 * 4), rstd(6), x5(5 * 4);
  const Tensor tx = test::view(x, Shape{6, 4}), tres = test::view(res, Shape{6, 4}),
               tw = test::view(w, Shape{4}), ty = test::view(y, Shape{6, 4}),
               tr = test::view(rstd, Shape{6});
  EXPECT_THROW(be.add_rmsnorm_forward(test::view(x5, Shape{5, 4}), tres, tw, kEps, ty, tr), Error);
  EXPECT_THROW(be.add_rmsnorm_forward(tx, tres, tw, kEps, tres, tr), Error);  // y is the residual
  EXPECT_THROW(be.add_rmsnorm_forward(tx, tres, tw, kEps, tx, tr), Error);    // y is x
  EXPECT_THROW(be.add_rmsnorm_forward(tres, tres, tw, kEps, ty, tr), Error);  // x is the residual
  EXPECT_NO_THROW(be.add_rmsnorm_forward(tx, tres, tw, kEps, ty, tr));
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
