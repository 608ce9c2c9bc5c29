// Tests of the CPU linear kernels (linear.cpp) against an f64 reference: forward with and without
// bias on odd shapes, backward against central finite differences of the f64 forward and against
// the f64 analytic gradients, the accumulate (dw, db) / overwrite (dx) contract, y and dx
// accumulated (OutputMode::kAccumulate) or summed onto a residual, and bf16 storage across several
// GEMM panels (sums in f32, each output rounded once).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "kernels/bf16_check.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/ops.h"
#include "test_util.h"

namespace shardlm {
namespace {

struct Dims {
  int64_t n, in, out;
};

// f32 sgemm over K = in terms of magnitude <= 1: the error grows with K; 1e-6 * (K + 1) bounds
// it with margin (one product rounds at ~6e-8). Gradients: dx sums over out, dw/db over N.
double f32_atol(int64_t k) { return 1e-6 * double(k + 1); }
constexpr double kF32Rtol = 1e-5;

// y [N, out] = x [N, in] w^T [in, out] + b [out]
std::vector<double> ref_forward(const std::vector<double>& x, const std::vector<double>& w,
                                const std::vector<double>* b, Dims d) {
  std::vector<double> y(d.n * d.out);
  for (int64_t r = 0; r < d.n; ++r) {
    for (int64_t o = 0; o < d.out; ++o) {
      double acc = b ? (*b)[o] : 0.0;
      for (int64_t i = 0; i < d.in; ++i) acc += x[r * d.in + i] * w[o * d.in + i];
      y[r * d.out + o] = acc;
    }
  }
  return y;
}

double dot(const std::vector<double>& a, const std::vector<double>& b) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

std::vector<float> nan_vec(size_t n) { return std::vector<float>(n, NAN); }

// The conversion scratch a CpuBackend passes its linear kernels (the f32 products never read it).
cpu::GemmScratch scratch() {
  static std::vector<float> panels(cpu::kGemmScratchFloats);
  return {panels.data(), panels.size()};
}

const std::vector<Dims> kShapes = {{1, 1, 1},   {7, 5, 3},   {33, 64, 130}, {1, 130, 7},
                                   {33, 1, 64}, {7, 130, 1}, {64, 33, 5},   {130, 7, 33}};

TEST(LinearForward, MatchesF64WithAndWithoutBias) {
  for (Dims d : kShapes) {
    std::vector<float> x = test::random_vec(d.n * d.in, 1), w = test::random_vec(d.out * d.in, 2);
    std::vector<float> b = test::random_vec(d.out, 3);
    const auto x64 = test::to_f64(x), w64 = test::to_f64(w), b64 = test::to_f64(b);
    for (bool with_bias : {false, true}) {
      std::vector<float> y = nan_vec(d.n * d.out);  // y must be overwritten, NaN included
      cpu::linear_forward(test::view(x, Shape{d.n, d.in}), test::view(w, Shape{d.out, d.in}),
                          with_bias ? test::view(b, Shape{d.out}) : Tensor(),
                          test::view(y, Shape{d.n, d.out}), scratch());
      EXPECT_CLOSE(y, ref_forward(x64, w64, with_bias ? &b64 : nullptr, d), f32_atol(d.in),
                   kF32Rtol)
          << "N=" << d.n << " in=" << d.in << " out=" << d.out << " bias=" << with_bias;
    }
  }
}

// Backward on small shapes against central differences of loss = sum(r * y) in f64.
TEST(LinearBackward, MatchesFiniteDifferences) {
  const std::vector<Dims> shapes = {{1, 1, 1}, {7, 5, 3}, {3, 17, 9}, {5, 1, 6}, {2, 9, 1}};
  for (Dims d : shapes) {
    std::vector<float> x = test::random_vec(d.n * d.in, 11), w = test::random_vec(d.out * d.in, 12);
    std::vector<float> b = test::random_vec(d.out, 13), r = test::random_vec(d.n * d.out, 14);
    auto x64 = test::to_f64(x), w64 = test::to_f64(w), b64 = test::to_f64(b);
    const auto r64 = test::to_f64(r);
    auto loss = [&] { return dot(r64, ref_forward(x64, w64, &b64, d)); };
    const auto gx = test::finite_difference(x64, loss);
    const auto gw = test::finite_difference(w64, loss);
    const auto gb = test::finite_difference(b64, loss);

    std::vector<float> dx = nan_vec(x.size()), dw(w.size(), 0.0f), db(b.size(), 0.0f);
    cpu::linear_backward(test::view(x, Shape{d.n, d.in}), test::view(w, Shape{d.out, d.in}),
                         test::view(r, Shape{d.n, d.out}), test::view(dx, Shape{d.n, d.in}),
                         test::view(dw, Shape{d.out, d.in}), test::view(db, Shape{d.out}),
                         scratch());
    // Finite differences of a bilinear f64 function: error ~1e-9, far below the f32 error.
    EXPECT_CLOSE(dx, gx, f32_atol(d.out), kF32Rtol) << "dx N=" << d.n << " in=" << d.in;
    EXPECT_CLOSE(dw, gw, f32_atol(d.n), kF32Rtol) << "dw N=" << d.n << " in=" << d.in;
    EXPECT_CLOSE(db, gb, f32_atol(d.n), kF32Rtol) << "db N=" << d.n << " out=" << d.out;
  }
}

// Larger odd shapes against the f64 analytic gradients, with nonzero initial dw, db and two calls:
// dw and db accumulate (+=), dx is overwritten each time.
TEST(LinearBackward, AccumulatesDwDbAndOverwritesDx) {
  for (Dims d : kShapes) {
    std::vector<float> x = test::random_vec(d.n * d.in, 21), w = test::random_vec(d.out * d.in, 22);
    std::vector<float> dy = test::random_vec(d.n * d.out, 23);
    std::vector<float> dw0 = test::random_vec(w.size(), 24), db0 = test::random_vec(d.out, 25);
    std::vector<double> ref_dx(x.size()), ref_dw(w.size()), ref_db(d.out);
    for (int64_t r = 0; r < d.n; ++r) {
      for (int64_t o = 0; o < d.out; ++o) {
        const double g = dy[r * d.out + o];
        ref_db[o] += g;
        for (int64_t i = 0; i < d.in; ++i) {
          ref_dx[r * d.in + i] += g * w[o * d.in + i];
          ref_dw[o * d.in + i] += g * x[r * d.in + i];
        }
      }
    }
    std::vector<float> dx = nan_vec(x.size()), dw = dw0, db = db0;
    for (int call = 1; call <= 2; ++call) {
      cpu::linear_backward(test::view(x, Shape{d.n, d.in}), test::view(w, Shape{d.out, d.in}),
                           test::view(dy, Shape{d.n, d.out}), test::view(dx, Shape{d.n, d.in}),
                           test::view(dw, Shape{d.out, d.in}), test::view(db, Shape{d.out}),
                           scratch());
      std::vector<double> want_dw(w.size()), want_db(d.out);
      for (size_t i = 0; i < w.size(); ++i) want_dw[i] = dw0[i] + call * ref_dw[i];
      for (int64_t o = 0; o < d.out; ++o) want_db[o] = db0[o] + call * ref_db[o];
      EXPECT_CLOSE(dx, ref_dx, f32_atol(d.out), kF32Rtol) << "call " << call;
      EXPECT_CLOSE(dw, want_dw, 2 * f32_atol(d.n), kF32Rtol) << "call " << call;
      EXPECT_CLOSE(db, want_db, 2 * f32_atol(d.n), kF32Rtol) << "call " << call;
    }
    // Empty dx and db are skipped; dw still accumulates.
    std::vector<float> dw_only = dw0;
    cpu::linear_backward(test::view(x, Shape{d.n, d.in}), test::view(w, Shape{d.out, d.in}),
                         test::view(dy, Shape{d.n, d.out}), Tensor(),
                         test::view(dw_only, Shape{d.out, d.in}), Tensor(), scratch());
    std::vector<double> want_dw(w.size());
    for (size_t i = 0; i < w.size(); ++i) want_dw[i] = dw0[i] + ref_dw[i];
    EXPECT_CLOSE(dw_only, want_dw, f32_atol(d.n), kF32Rtol);
  }
}

// OutputMode::kAccumulate: y += x W^T + b and dx += dy W onto random old values, against f64;
// dw and db accumulate as always, and an empty dx stays untouched.
TEST(LinearAccumulate, AddsOntoYAndDxInF32) {
  constexpr OutputMode kAcc = OutputMode::kAccumulate;
  for (Dims d : kShapes) {
    std::vector<float> x = test::random_vec(d.n * d.in, 41), w = test::random_vec(d.out * d.in, 42);
    std::vector<float> b = test::random_vec(d.out, 43), dy = test::random_vec(d.n * d.out, 44);
    const std::vector<float> y0 = test::random_vec(d.n * d.out, 45),
                             dx0 = test::random_vec(d.n * d.in, 46);
    const auto x64 = test::to_f64(x), w64 = test::to_f64(w), b64 = test::to_f64(b);
    std::vector<double> want_y = ref_forward(x64, w64, &b64, d);  // [N, out]
    for (size_t i = 0; i < want_y.size(); ++i) want_y[i] += y0[i];
    std::vector<double> want_dx(dx0.begin(), dx0.end());  // [N, in]
    for (int64_t r = 0; r < d.n; ++r)
      for (int64_t o = 0; o < d.out; ++o)
        for (int64_t i = 0; i < d.in; ++i)
          want_dx[r * d.in + i] += double(dy[r * d.out + o]) * w[o * d.in + i];
    std::vector<float> y = y0, dx = dx0;
    cpu::linear_forward(test::view(x, Shape{d.n, d.in}), test::view(w, Shape{d.out, d.in}),
                        test::view(b, Shape{d.out}), test::view(y, Shape{d.n, d.out}), scratch(),
                        kAcc);
    cpu::linear_backward(test::view(x, Shape{d.n, d.in}), test::view(w, Shape{d.out, d.in}),
                         test::view(dy, Shape{d.n, d.out}), test::view(dx, Shape{d.n, d.in}),
                         Tensor(), Tensor(), scratch(), kAcc);
    EXPECT_CLOSE(y, want_y, f32_atol(d.in), kF32Rtol) << "N=" << d.n << " in=" << d.in;
    EXPECT_CLOSE(dx, want_dx, f32_atol(d.out), kF32Rtol) << "N=" << d.n << " out=" << d.out;
  }
}

// ---- bf16 storage --------------------------------------------------------------------------

using test::bf16_random;
using test::Bf16Values;
using test::rounded_once;

// bf16 x, w, b, dy, dx on a shape whose N, in and out each span several GEMM panels and are no
// multiple of the panel: y and dx are the f64 result of the stored values rounded once; an f32
// dw and db accumulate over two calls at f32 accuracy (never rounded through bf16); a bf16 dw
// adds the product to its old value in f32 and rounds once per call.
TEST(LinearBf16, SumsInF32AcrossPanelsAndRoundsOnce) {
  const Dims d{2 * cpu::kGemmPanel + 29, 2 * cpu::kGemmPanel + 35, cpu::kGemmPanel + 11};
  Bf16Values x = bf16_random(d.n * d.in, 81), w = bf16_random(d.out * d.in, 82),
             b = bf16_random(d.out, 83), dy = bf16_random(d.n * d.out, 84),
             dw16 = bf16_random(d.out * d.in, 85);
  const Shape xs{d.n, d.in}, ws{d.out, d.in}, ys{d.n, d.out};

  std::vector<uint16_t> y(d.n * d.out, 0x7fc0);  // NaN: must be overwritten
  cpu::linear_forward(x.view(xs), w.view(ws), b.view({d.out}), Tensor(y.data(), DType::kBF16, ys),
                      scratch());
  EXPECT_TRUE(rounded_once(y, ref_forward(x.f64, w.f64, &b.f64, d), f32_atol(d.in)));

  std::vector<double> ref_dx(x.f64.size()), ref_dw(w.f64.size()), ref_db(d.out);
  for (int64_t r = 0; r < d.n; ++r) {
    for (int64_t o = 0; o < d.out; ++o) {
      const double g = dy.f64[r * d.out + o];
      ref_db[o] += g;
      for (int64_t i = 0; i < d.in; ++i) {
        ref_dx[r * d.in + i] += g * w.f64[o * d.in + i];
        ref_dw[o * d.in + i] += g * x.f64[r * d.in + i];
      }
    }
  }
  const std::vector<float> dw0 = test::random_vec(w.f64.size(), 86),
                           db0 = test::random_vec(d.out, 87);
  std::vector<float> dw = dw0, db = db0;
  std::vector<uint16_t> dx(x.bits.size(), 0x7fc0);
  for (int call = 1; call <= 2; ++call) {
    cpu::linear_backward(x.view(xs), w.view(ws), dy.view(ys), Tensor(dx.data(), DType::kBF16, xs),
                         test::view(dw, ws), test::view(db, Shape{d.out}), scratch());
    std::vector<double> want_dw(dw.size()), want_db(d.out);
    for (size_t i = 0; i < dw.size(); ++i) want_dw[i] = dw0[i] + call * ref_dw[i];
    for (int64_t o = 0; o < d.out; ++o) want_db[o] = db0[o] + call * ref_db[o];
    EXPECT_TRUE(rounded_once(dx, ref_dx, f32_atol(d.out))) << "call " << call;
    EXPECT_CLOSE(dw, want_dw, 2 * f32_atol(d.n), kF32Rtol) << "call " << call;
    EXPECT_CLOSE(db, want_db, 2 * f32_atol(d.n), kF32Rtol) << "call " << call;
  }
  for (int call = 1; call <= 2; ++call) {
    std::vector<double> want = dw16.f64;
    for (size_t i = 0; i < want.size(); ++i) want[i] += ref_dw[i];
    cpu::linear_backward(x.view(xs), w.view(ws), dy.view(ys), Tensor(), dw16.view(ws), Tensor(),
                         scratch());
    EXPECT_TRUE(rounded_once(dw16.bits, want, f32_atol(d.n))) << "call " << call;
    dw16.reread();
  }
}

// bf16 y and dx accumulated across several panels: the old value is loaded with the product's
// f32 panel, summed in f32 over the whole K range and rounded once (never rounded in between).
TEST(LinearBf16, AccumulatesAcrossPanelsAndRoundsOnce) {
  constexpr OutputMode kAcc = OutputMode::kAccumulate;
  const Dims d{cpu::kGemmPanel + 29, 2 * cpu::kGemmPanel + 35, cpu::kGemmPanel + 11};
  Bf16Values x = bf16_random(d.n * d.in, 91), w = bf16_random(d.out * d.in, 92),
             dy = bf16_random(d.n * d.out, 93), y0 = bf16_random(d.n * d.out, 94),
             dx0 = bf16_random(d.n * d.in, 95);
  const Shape xs{d.n, d.in}, ws{d.out, d.in}, ys{d.n, d.out};
  std::vector<double> want_y = ref_forward(x.f64, w.f64, nullptr, d);  // [N, out]
  for (size_t i = 0; i < want_y.size(); ++i) want_y[i] += y0.f64[i];
  std::vector<double> want_dx = dx0.f64;  // [N, in]
  for (int64_t r = 0; r < d.n; ++r)
    for (int64_t o = 0; o < d.out; ++o)
      for (int64_t i = 0; i < d.in; ++i)
        want_dx[r * d.in + i] += dy.f64[r * d.out + o] * w.f64[o * d.in + i];
  cpu::linear_forward(x.view(xs), w.view(ws), Tensor(), y0.view(ys), scratch(), kAcc);
  cpu::linear_backward(x.view(xs), w.view(ws), dy.view(ys), dx0.view(xs), Tensor(), Tensor(),
                       scratch(), kAcc);
  EXPECT_TRUE(rounded_once(y0.bits, want_y, f32_atol(d.in)));
  EXPECT_TRUE(rounded_once(dx0.bits, want_dx, f32_atol(d.out)));
}

// y = residual + x W^T + b: in f32 exactly what accumulating onto a copy of the residual gives
// (the residual is sgemm's starting C), on every shape, in = 0 included (residual + b).
TEST(LinearResidual, F32IsAccumulationOntoTheResidual) {
  std::vector<Dims> shapes = kShapes;
  shapes.push_back({5, 0, 3});
  for (Dims d : shapes) {
    std::vector<float> x = test::random_vec(d.n * d.in, 101),
                       w = test::random_vec(d.out * d.in, 102), b = test::random_vec(d.out, 103),
                       res = test::random_vec(d.n * d.out, 104);
    const Shape xs{d.n, d.in}, ws{d.out, d.in}, ys{d.n, d.out};
    std::vector<float> y = nan_vec(d.n * d.out), acc = res, res_in = res;
    cpu::linear_forward(test::view(x, xs), test::view(w, ws), test::view(b, Shape{d.out}),
                        test::view(y, ys), scratch(), OutputMode::kOverwrite,
                        test::view(res_in, ys));
    cpu::linear_forward(test::view(x, xs), test::view(w, ws), test::view(b, Shape{d.out}),
                        test::view(acc, ys), scratch(), OutputMode::kAccumulate);
    EXPECT_EQ(y, acc) << d.n << "x" << d.in << "x" << d.out;
    EXPECT_EQ(res_in, res) << "the residual is read only";
    std::vector<double> x64(x.begin(), x.end()), w64(w.begin(), w.end()), b64(b.begin(), b.end());
    std::vector<double> want = ref_forward(x64, w64, &b64, d);
    for (size_t i = 0; i < want.size(); ++i) want[i] += res[i];
    EXPECT_CLOSE(y, want, f32_atol(d.in), kF32Rtol) << d.n << "x" << d.in << "x" << d.out;
  }
}

// bf16 across several panels: each tile starts from the residual's f32 values, sums the product
// and the bias in f32 over the whole K range and rounds once (where the model's old form, a
// rounded product and then add, rounded twice).
TEST(LinearResidual, Bf16RoundsOnceAcrossPanels) {
  const Dims d{cpu::kGemmPanel + 29, 2 * cpu::kGemmPanel + 35, cpu::kGemmPanel + 11};
  Bf16Values x = bf16_random(d.n * d.in, 111), w = bf16_random(d.out * d.in, 112),
             b = bf16_random(d.out, 113), res = bf16_random(d.n * d.out, 114);
  const Shape xs{d.n, d.in}, ws{d.out, d.in}, ys{d.n, d.out};
  const std::vector<uint16_t> res_bits = res.bits;
  std::vector<uint16_t> y(d.n * d.out, 0x7fc0);  // NaN: must be overwritten
  cpu::linear_forward(x.view(xs), w.view(ws), b.view({d.out}), Tensor(y.data(), DType::kBF16, ys),
                      scratch(), OutputMode::kOverwrite, res.view(ys));
  std::vector<double> want = ref_forward(x.f64, w.f64, &b.f64, d);
  for (size_t i = 0; i < want.size(); ++i) want[i] += res.f64[i];
  EXPECT_TRUE(rounded_once(y, want, f32_atol(d.in)));
  EXPECT_EQ(res.bits, res_bits) << "the residual is read only";
}

TEST(Linear, ZeroRowsIsANoOp) {
  std::vector<float> w = test::random_vec(12, 31), dw(12, 1.0f), db(3, 1.0f), b(3, 0.5f);
  cpu::linear_forward(Tensor(nullptr, DType::kF32, Shape{0, 4}), test::view(w, Shape{3, 4}),
                      test::view(b, Shape{3}), Tensor(nullptr, DType::kF32, Shape{0, 3}),
                      scratch());
  cpu::linear_backward(Tensor(nullptr, DType::kF32, Shape{0, 4}), test::view(w, Shape{3, 4}),
                       Tensor(nullptr, DType::kF32, Shape{0, 3}),
                       Tensor(nullptr, DType::kF32, Shape{0, 4}), test::view(dw, Shape{3, 4}),
                       test::view(db, Shape{3}), scratch());
  EXPECT_EQ(dw, std::vector<float>(12, 1.0f));
  EXPECT_EQ(db, std::vector<float>(3, 1.0f));
}

TEST(Linear, RejectsMismatchedShapes) {
  cpu::CpuBackend be;  // through the entry points, which check the arguments
  std::vector<float> x(6 * 4), w(3 * 4), w5(3 * 5), y(6 * 3), y2(6 * 2), b(2), dw(3 * 4);
  const Tensor tx = test::view(x, Shape{6, 4}), tw = test::view(w, Shape{3, 4});
  EXPECT_THROW(
      be.linear_forward(tx, test::view(w5, Shape{3, 5}), Tensor(), test::view(y, Shape{6, 3})),
      Error);
  EXPECT_THROW(be.linear_forward(tx, tw, Tensor(), test::view(y2, Shape{6, 2})), Error);
  EXPECT_THROW(be.linear_forward(tx, tw, test::view(b, Shape{2}), test::view(y, Shape{6, 3})),
               Error);
  EXPECT_THROW(be.linear_backward(tx, tw, test::view(y2, Shape{6, 2}), Tensor(),
                                  test::view(dw, Shape{3, 4}), Tensor()),
               Error);
  EXPECT_THROW(be.linear_backward(tx, tw, test::view(y, Shape{6, 3}), Tensor(),
                                  test::view(dw, Shape{4, 3}), Tensor()),
               Error);
}

}  // namespace
}  // namespace shardlm
