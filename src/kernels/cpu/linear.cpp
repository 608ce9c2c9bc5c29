// Linear layer y = x W^T (+ b) and its backward on the CPU. The three matrix products go to
// OpenBLAS sgemm (which threads itself, so it is never called from inside an OpenMP region);
// only the bias add and the bias-gradient row sum are ours. No allocation.
#include <cblas.h>

#include <algorithm>
#include <limits>

#include "kernels/cpu/ops.h"

namespace shardlm::cpu {
namespace {

// Columns of db summed per work item: a stack accumulator, wide enough for contiguous loads.
constexpr int64_t kColumnBlock = 256;

struct LinearDims {
  int64_t n, in, out;
};

// x [N, in]; w [out, in]. sgemm takes int extents.
LinearDims check_linear(const Tensor& x, const Tensor& w, std::string_view op) {
  constexpr int64_t kBlasMax = std::numeric_limits<int>::max();
  SHARDLM_CHECK(x.dim(0) <= kBlasMax && x.dim(1) <= kBlasMax && w.dim(0) <= kBlasMax,
                "{}: x {} or w {} has a dimension beyond the 32-bit BLAS interface; split it", op,
                x.shape().str(), w.shape().str());
  return {x.dim(0), x.dim(1), w.dim(0)};
}

}  // namespace

// x [N, in]; w [out, in]; b [out] or empty; y [N, out] overwritten
void linear_forward(const Tensor& x, const Tensor& w, const Tensor& b, const Tensor& y) {
  const auto [n, in, out] = check_linear(x, w, "linear_forward");
  if (n == 0 || out == 0) return;
  float* py = y.f32();
  if (in == 0) {
    std::fill(py, py + n * out, 0.0f);
  } else {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, out, in, 1.0f, x.f32(), in, w.f32(), in,
                0.0f, py, out);
  }
  if (b.empty()) return;
  const float* pb = b.f32();
#pragma omp parallel for schedule(static) if (n * out > 32768)
  for (int64_t r = 0; r < n; ++r) {
    float* row = py + r * out;
#pragma omp simd
    for (int64_t j = 0; j < out; ++j) row[j] += pb[j];
  }
}

// x [N, in]; w [out, in]; dy [N, out];
// dx [N, in] overwritten (or empty); dw [out, in] accumulates (or empty: frozen, no dW GEMM);
// db [out] accumulates (or empty)
void linear_backward(const Tensor& x, const Tensor& w, const Tensor& dy, const Tensor& dx,
                     const Tensor& dw, const Tensor& db) {
  const auto [n, in, out] = check_linear(x, w, "linear_backward");

  // dx = dy W: [N, out] x [out, in]
  if (!dx.empty() && n > 0 && in > 0) {
    if (out == 0) {
      std::fill(dx.f32(), dx.f32() + n * in, 0.0f);
    } else {
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, in, out, 1.0f, dy.f32(), out,
                  w.f32(), in, 0.0f, dx.f32(), in);
    }
  }
  // dw += dy^T x: [out, N] x [N, in]
  if (!dw.empty() && n > 0 && in > 0 && out > 0) {
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, out, in, n, 1.0f, dy.f32(), out, x.f32(),
                in, 1.0f, dw.f32(), in);
  }
  // db += sum over rows of dy, each column block summed in f64 over rows in order.
  if (!db.empty() && n > 0 && out > 0) {
    const float* pdy = dy.f32();
    float* pdb = db.f32();
    const int64_t blocks = (out + kColumnBlock - 1) / kColumnBlock;
#pragma omp parallel for schedule(static) if (n * out > 32768)
    for (int64_t blk = 0; blk < blocks; ++blk) {
      const int64_t j0 = blk * kColumnBlock;
      const int64_t width = std::min(kColumnBlock, out - j0);
      double acc[kColumnBlock] = {};
      for (int64_t r = 0; r < n; ++r) {
        const float* row = pdy + r * out + j0;
#pragma omp simd
        for (int64_t j = 0; j < width; ++j) acc[j] += double(row[j]);
      }
      for (int64_t j = 0; j < width; ++j) pdb[j0 + j] = float(double(pdb[j0 + j]) + acc[j]);
    }
  }
}

}  // namespace shardlm::cpu
