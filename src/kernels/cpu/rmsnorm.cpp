// RMSNorm on the CPU: y = x * rstd * w with rstd = 1 / sqrt(mean(x^2) + eps) saved per row.
// Row reductions accumulate in f64. The backward runs two passes: dx row by row (it ACCUMULATES
// into the residual gradient), then dw over column blocks summed over rows in order, so dw is
// race-free and bit-identical for any thread count. No allocation.
#include <algorithm>
#include <cmath>

#include "kernels/cpu/ops.h"

namespace shardlm::cpu {
namespace {

// Columns of dw per work item (an f64 stack accumulator).
constexpr int64_t kColumnBlock = 64;

}  // namespace

// x [N, D]; w [D]; y [N, D] overwritten; rstd [N] overwritten
void rmsnorm_forward(const Tensor& x, const Tensor& w, float eps, const Tensor& y,
                     const Tensor& rstd) {
  const int64_t n = x.dim(0);
  const int64_t d = x.dim(1);
  if (n == 0) return;
  const float* px = x.f32();
  const float* pw = w.f32();
  float* py = y.f32();
  float* pr = rstd.f32();
#pragma omp parallel for schedule(static) if (n * d > 16384)
  for (int64_t r = 0; r < n; ++r) {
    const float* xr = px + r * d;
    float* yr = py + r * d;
    double ss = 0.0;
#pragma omp simd reduction(+ : ss)
    for (int64_t j = 0; j < d; ++j) ss += double(xr[j]) * double(xr[j]);
    const float rs = static_cast<float>(1.0 / std::sqrt(ss / double(d) + double(eps)));
    pr[r] = rs;
#pragma omp simd
    for (int64_t j = 0; j < d; ++j) yr[j] = xr[j] * rs * pw[j];
  }
}

// x [N, D]; w [D]; rstd [N] from the forward; dy [N, D];
// dx [N, D] accumulates; dw [D] accumulates.
// With r = rstd: dx_j += r w_j dy_j - x_j r^3 / D * sum_k dy_k w_k x_k;  dw_j += sum_n dy_j x_j r.
void rmsnorm_backward(const Tensor& x, const Tensor& w, const Tensor& rstd, const Tensor& dy,
                      const Tensor& dx, const Tensor& dw) {
  const int64_t n = x.dim(0);
  const int64_t d = x.dim(1);
  if (n == 0 || d == 0) return;
  const float* px = x.f32();
  const float* pw = w.f32();
  const float* pr = rstd.f32();
  const float* pdy = dy.f32();
  float* pdx = dx.f32();
  float* pdw = dw.f32();

#pragma omp parallel for schedule(static) if (n * d > 16384)
  for (int64_t r = 0; r < n; ++r) {
    const float* xr = px + r * d;
    const float* dyr = pdy + r * d;
    float* dxr = pdx + r * d;
    double dot = 0.0;
#pragma omp simd reduction(+ : dot)
    for (int64_t j = 0; j < d; ++j) dot += double(dyr[j]) * double(pw[j]) * double(xr[j]);
    const double rs = pr[r];
    const float a = static_cast<float>(rs);
    const float c = static_cast<float>(rs * rs * rs * dot / double(d));
#pragma omp simd
    for (int64_t j = 0; j < d; ++j) dxr[j] += a * pw[j] * dyr[j] - c * xr[j];
  }

  const int64_t blocks = (d + kColumnBlock - 1) / kColumnBlock;
#pragma omp parallel for schedule(static) if (n * d > 16384)
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const int64_t j0 = blk * kColumnBlock;
    const int64_t width = std::min(kColumnBlock, d - j0);
    double acc[kColumnBlock] = {};
    for (int64_t r = 0; r < n; ++r) {
      const float* xr = px + r * d + j0;
      const float* dyr = pdy + r * d + j0;
      const float rs = pr[r];
#pragma omp simd
      for (int64_t j = 0; j < width; ++j) acc[j] += double(dyr[j] * xr[j] * rs);
    }
    for (int64_t j = 0; j < width; ++j) pdw[j0 + j] = float(double(pdw[j0 + j]) + acc[j]);
  }
}

}  // namespace shardlm::cpu
