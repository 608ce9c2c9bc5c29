// RMSNorm on the CPU: y = x * rstd * (w_offset + w) with rstd = 1 / sqrt(mean(x^2) + eps) saved per
// row, alone or after the residual add (add_rmsnorm_forward: the row's sum rounded and stored,
// then normed by the same row function). Row reductions accumulate in f64. The backward runs two
// passes: dx row by row (it ACCUMULATES into the residual gradient), then dw over column blocks
// summed over rows in order, so dw is race-free and bit-identical for any thread count. x, w, y, dy
// and dx are f32 or bf16 (one dtype), rstd and dw f32; arithmetic in f32 with f64 reductions. The
// accumulating dx is read, added to in f32 and rounded once. No allocation.
#include <algorithm>
#include <cmath>

#include "kernels/cpu/element.h"
#include "kernels/cpu/ops.h"

namespace shardlm::cpu {
namespace {

// Columns of dw per work item (an f64 stack accumulator).
constexpr int64_t kColumnBlock = 64;

// One row: xr [D]; w [D]; yr [D] overwritten; *rstd overwritten. Not inlined, so that the norm
// alone and after the add run the same machine code (the f64 reduction's vector order included):
// the fused op gives the unfused ops' bits.
template <typename T>
[[gnu::noinline]] void forward_row(const T* xr, const T* pw, float off, float eps, T* yr,
                                   float* rstd, int64_t d) {
  double ss = 0.0;
#pragma omp simd reduction(+ : ss)
  for (int64_t j = 0; j < d; ++j) {
    const double v = load(xr + j);
    ss += v * v;
  }
  const float rs = static_cast<float>(1.0 / std::sqrt(ss / double(d) + double(eps)));
  *rstd = rs;
#pragma omp simd
  for (int64_t j = 0; j < d; ++j) store(yr + j, load(xr + j) * rs * (off + load(pw + j)));
}

// x [N, D]; w [D]; y [N, D] overwritten; rstd [N] f32 overwritten
template <typename T>
void forward_rows(const T* px, const T* pw, float off, float eps, T* py, float* pr, int64_t n,
                  int64_t d) {
#pragma omp parallel for schedule(static) if (n * d > 16384)
  for (int64_t r = 0; r < n; ++r) forward_row(px + r * d, pw, off, eps, py + r * d, pr + r, d);
}

// res [N, D] += x (f32, rounded once as add rounds), then the row's norm of the stored sum.
template <typename T>
void add_forward_rows(const T* px, T* pres, const T* pw, float off, float eps, T* py, float* pr,
                      int64_t n, int64_t d) {
#pragma omp parallel for schedule(static) if (n * d > 16384)
  for (int64_t r = 0; r < n; ++r) {
    T* rr = pres + r * d;
    const T* xr = px + r * d;
#pragma omp simd
    for (int64_t j = 0; j < d; ++j) store(rr + j, load(rr + j) + load(xr + j));
    forward_row(static_cast<const T*>(rr), pw, off, eps, py + r * d, pr + r, d);
  }
}

// dx [N, D] += r w' dy - x r^3 / D * sum_k dy_k w'_k x_k with w' = off + w, row by row
template <typename T>
void backward_dx_rows(const T* px, const T* pw, float off, const float* pr, const T* pdy, T* pdx,
                      int64_t n, int64_t d) {
#pragma omp parallel for schedule(static) if (n * d > 16384)
  for (int64_t r = 0; r < n; ++r) {
    const T* xr = px + r * d;
    const T* dyr = pdy + r * d;
    T* dxr = pdx + r * d;
    double dot = 0.0;
#pragma omp simd reduction(+ : dot)
    for (int64_t j = 0; j < d; ++j)
      dot += double(load(dyr + j)) * double(off + load(pw + j)) * double(load(xr + j));
    const double rs = pr[r];
    const float a = static_cast<float>(rs);
    const float c = static_cast<float>(rs * rs * rs * dot / double(d));
#pragma omp simd
    for (int64_t j = 0; j < d; ++j)
      store(dxr + j, load(dxr + j) + (a * (off + load(pw + j)) * load(dyr + j) - c * load(xr + j)));
  }
}

// dw [D] f32 += sum over rows of dy x r, in row order per column block (an f64 accumulator)
template <typename T>
void backward_dw_columns(const T* px, const float* pr, const T* pdy, float* pdw, int64_t n,
                         int64_t d) {
  const int64_t blocks = (d + kColumnBlock - 1) / kColumnBlock;
#pragma omp parallel for schedule(static) if (n * d > 16384)
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const int64_t j0 = blk * kColumnBlock;
    const int64_t width = std::min(kColumnBlock, d - j0);
    double acc[kColumnBlock] = {};
    for (int64_t r = 0; r < n; ++r) {
      const T* xr = px + r * d + j0;
      const T* dyr = pdy + r * d + j0;
      const float rs = pr[r];
#pragma omp simd
      for (int64_t j = 0; j < width; ++j) acc[j] += double(load(dyr + j) * load(xr + j) * rs);
    }
    for (int64_t j = 0; j < width; ++j) pdw[j0 + j] = float(double(pdw[j0 + j]) + acc[j]);
  }
}

}  // namespace

// x [N, D]; w [D]; y [N, D] overwritten; rstd [N] overwritten
void rmsnorm_forward(const Tensor& x, const Tensor& w, float eps, const Tensor& y,
                     const Tensor& rstd, float w_offset) {
  const int64_t n = x.dim(0);
  const int64_t d = x.dim(1);
  if (n == 0) return;
  with_float(x, [&](auto tag) {
    using T = decltype(tag);
    forward_rows(elems<T>(x), elems<T>(w), w_offset, eps, elems<T>(y), rstd.f32(), n, d);
  });
}

// x, residual [N, D]; w [D]; y [N, D] overwritten; rstd [N] overwritten; residual += x first
void add_rmsnorm_forward(const Tensor& x, const Tensor& residual, const Tensor& w, float eps,
                         const Tensor& y, const Tensor& rstd, float w_offset) {
  const int64_t n = residual.dim(0);
  const int64_t d = residual.dim(1);
  if (n == 0) return;
  with_float(residual, [&](auto tag) {
    using T = decltype(tag);
    add_forward_rows(elems<T>(x), elems<T>(residual), elems<T>(w), w_offset, eps, elems<T>(y),
                     rstd.f32(), n, d);
  });
}

// x [N, D]; w [D]; rstd [N] from the forward; dy [N, D];
// dx [N, D] accumulates; dw [D] f32 accumulates.
// With r = rstd: dx_j += r w_j dy_j - x_j r^3 / D * sum_k dy_k w_k x_k;  dw_j += sum_n dy_j x_j r.
void rmsnorm_backward(const Tensor& x, const Tensor& w, const Tensor& rstd, const Tensor& dy,
                      const Tensor& dx, const Tensor& dw, float w_offset) {
  const int64_t n = x.dim(0);
  const int64_t d = x.dim(1);
  if (n == 0 || d == 0) return;
  with_float(x, [&](auto tag) {
    using T = decltype(tag);
    backward_dx_rows(elems<T>(x), elems<T>(w), w_offset, rstd.f32(), elems<T>(dy), elems<T>(dx), n,
                     d);
    backward_dw_columns(elems<T>(x), rstd.f32(), elems<T>(dy), dw.f32(), n, d);
  });
}

}  // namespace shardlm::cpu
