// Linear layer y = x W^T (+ b) (+ residual) and its backward on the CPU, x, w, dy and the outputs
// f32 or bf16 (one dtype; dw f32 or that dtype; db f32); y and dx overwritten or accumulated
// (sgemm's beta), y also summed onto a residual (gemm.h).
// The three matrix products go to gemm.h (OpenBLAS sgemm, which threads itself, so it is never
// called from inside an OpenMP region); only the bias-gradient row sum is ours. No allocation: bf16
// operands are converted in the caller's GemmScratch.
#include <algorithm>
#include <limits>

#include "kernels/cpu/element.h"
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

// db [out] += sum over the n rows of dy [n, out], each column block summed in f64 over rows in
// order.
template <typename T>
void bias_grad(const T* pdy, int64_t n, int64_t out, float* pdb) {
  const int64_t blocks = (out + kColumnBlock - 1) / kColumnBlock;
#pragma omp parallel for schedule(static) if (n * out > 32768)
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const int64_t j0 = blk * kColumnBlock;
    const int64_t width = std::min(kColumnBlock, out - j0);
    double acc[kColumnBlock] = {};
    for (int64_t r = 0; r < n; ++r) {
      const T* row = pdy + r * out + j0;
#pragma omp simd
      for (int64_t j = 0; j < width; ++j) acc[j] += double(load(row + j));
    }
    for (int64_t j = 0; j < width; ++j) pdb[j0 + j] = float(double(pdb[j0 + j]) + acc[j]);
  }
}

}  // namespace

// x [N, in]; w [out, in]; b [out] or empty; y [N, out] overwritten or accumulated (y_mode);
// residual [N, out] or empty, apart from y (overwritten y only)
void linear_forward(const Tensor& x, const Tensor& w, const Tensor& b, const Tensor& y,
                    GemmScratch scratch, OutputMode y_mode, const Tensor& residual) {
  check_linear(x, w, "linear_forward");
  // y = (y or residual or 0) + x W^T + b, rounded once
  gemm(x, false, w, true, y, y_mode == OutputMode::kAccumulate, b, scratch, residual);
}

// x [N, in]; w [out, in]; dy [N, out];
// dx [N, in] overwritten or accumulated (dx_mode; or empty); dw [out, in] accumulates (or
// empty: frozen, no dW GEMM); db [out] accumulates (or empty)
void linear_backward(const Tensor& x, const Tensor& w, const Tensor& dy, const Tensor& dx,
                     const Tensor& dw, const Tensor& db, GemmScratch scratch, OutputMode dx_mode) {
  const auto [n, in, out] = check_linear(x, w, "linear_backward");
  // dx (+)= dy W: [N, out] x [out, in]
  if (!dx.empty())
    gemm(dy, false, w, false, dx, dx_mode == OutputMode::kAccumulate, Tensor(), scratch);
  // dw += dy^T x: [out, N] x [N, in], summed in f32 over all N before a bf16 dw rounds
  if (!dw.empty()) gemm(dy, true, x, false, dw, true, Tensor(), scratch);
  if (!db.empty() && n > 0 && out > 0) {
    with_float(dy, [&](auto tag) {
      using T = decltype(tag);
      bias_grad(elems<T>(dy), n, out, db.f32());
    });
  }
}

}  // namespace shardlm::cpu
