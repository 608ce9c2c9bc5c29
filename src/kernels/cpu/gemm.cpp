// The CPU GEMM of gemm.h: all-f32 products are one sgemm; products with a bf16 operand are
// tiled into panels of kGemmPanel, bf16 panels converted to f32 in the scratch, each C tile
// summed over the whole K range in f32 (in place when C is f32, in the C panel when it is bf16)
// and rounded once. A residual is the tile's starting value (sgemm's beta 1), loaded where the
// accumulated C would be: no pass of its own. The conversions run on the calling thread between
// sgemm calls (OpenBLAS threads itself); only the bias add is an OpenMP loop, never around an
// sgemm. No allocation.
#include "kernels/cpu/gemm.h"

#include <cblas.h>

#include <algorithm>

#include "kernels/cpu/element.h"

namespace shardlm::cpu {
namespace {

// Elements below which the bias add stays on one thread (the fork/join costs more).
constexpr int64_t kParallelElems = 32768;

// An sgemm operand: f32 rows with stride ld.
struct F32Block {
  float* data;
  int64_t ld;
};

CBLAS_TRANSPOSE blas_trans(bool trans) { return trans ? CblasTrans : CblasNoTrans; }

// rows x cols of src (row stride ld) as f32 into dst (row stride cols). On the calling thread:
// a panel is a few hundred microseconds of one core, a few % of the sgemm it feeds at two
// threads, while a fork/join per panel waited for a descheduled thread whenever other
// processes kept the cores busy (bf16 about twice as slow on a loaded 2-core machine).
template <typename T>
void load_block(const T* src, int64_t ld, int64_t rows, int64_t cols, float* dst) {
  for (int64_t r = 0; r < rows; ++r) load_row(src + r * ld, cols, dst + r * cols);
}

// rows x cols of src (row stride cols) rounded to T into dst (row stride ld); on the calling
// thread, as load_block.
template <typename T>
void store_block(const float* src, int64_t rows, int64_t cols, T* dst, int64_t ld) {
  for (int64_t r = 0; r < rows; ++r) store_row(src + r * cols, cols, dst + r * ld);
}

// c [rows, cols] (row stride ldc) += bias [cols] on every row, in f32.
template <typename T>
void add_bias(const T* bias, int64_t rows, int64_t cols, float* c, int64_t ldc) {
#pragma omp parallel for schedule(static) if (rows * cols > kParallelElems)
  for (int64_t r = 0; r < rows; ++r) {
    float* row = c + r * ldc;
#pragma omp simd
    for (int64_t j = 0; j < cols; ++j) row[j] += load(bias + j);
  }
}

void add_bias(const Tensor& bias, int64_t col0, int64_t rows, int64_t cols, F32Block c) {
  if (bias.empty()) return;
  with_float(bias, [&](auto tag) {
    using T = decltype(tag);
    add_bias(elems<T>(bias) + col0, rows, cols, c.data, c.ld);
  });
}

// c [rows, cols] = residual rows [r0, r0 + rows) x cols [c0, c0 + cols), in f32: the value the
// product is summed onto. On the calling thread, as load_block (a copy is memory-bound: a few %
// of the sgemm it precedes).
void load_residual(const Tensor& residual, int64_t r0, int64_t c0, int64_t rows, int64_t cols,
                   F32Block c) {
  const int64_t ld = residual.dim(1);
  with_float(residual, [&](auto tag) {
    using T = decltype(tag);
    const T* src = elems<T>(residual) + r0 * ld + c0;
    for (int64_t r = 0; r < rows; ++r) load_row(src + r * ld, cols, c.data + r * c.ld);
  });
}

void zero_block(F32Block c, int64_t rows, int64_t cols) {
  for (int64_t r = 0; r < rows; ++r) std::fill(c.data + r * c.ld, c.data + r * c.ld + cols, 0.0f);
}

// The stored block of t behind rows [r0, r0 + nr) x cols [c0, c0 + nc) of op(t) (t itself, or
// its transpose when trans), as an sgemm operand of the same transposition: t's own memory when
// t is f32, else converted into buf.
F32Block operand_block(const Tensor& t, bool trans, int64_t r0, int64_t nr, int64_t c0, int64_t nc,
                       float* buf) {
  const int64_t row0 = trans ? c0 : r0, rows = trans ? nc : nr;
  const int64_t col0 = trans ? r0 : c0, cols = trans ? nr : nc;
  const int64_t ld = t.dim(1);
  if (t.dtype() == DType::kF32) return {t.f32() + row0 * ld + col0, ld};
  load_block(elems<bf16_t>(t) + row0 * ld + col0, ld, rows, cols, buf);
  return {buf, cols};
}

// C tile += A panel . B panel, in f32; beta 0 overwrites the tile.
void sgemm_tile(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, F32Block a, F32Block b,
                float beta, F32Block c) {
  cblas_sgemm(CblasRowMajor, blas_trans(trans_a), blas_trans(trans_b), static_cast<int>(m),
              static_cast<int>(n), static_cast<int>(k), 1.0f, a.data, static_cast<int>(a.ld),
              b.data, static_cast<int>(b.ld), beta, c.data, static_cast<int>(c.ld));
}

struct Extents {
  int64_t m, n, k;
};

// The all-f32 product: one sgemm over the whole extents (onto the residual, copied into c
// first: sgemm reads and writes one C), then the bias.
void gemm_f32(const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, const Tensor& c,
              bool accumulate, const Tensor& bias, const Tensor& residual, Extents e) {
  const F32Block cb{c.f32(), e.n};
  if (!residual.empty()) load_residual(residual, 0, 0, e.m, e.n, cb);
  const bool onto_c = accumulate || !residual.empty();
  if (e.k == 0) {
    if (!onto_c) std::fill(cb.data, cb.data + e.m * e.n, 0.0f);
  } else {
    sgemm_tile(trans_a, trans_b, e.m, e.n, e.k, {a.f32(), a.dim(1)}, {b.f32(), b.dim(1)},
               onto_c ? 1.0f : 0.0f, cb);
  }
  add_bias(bias, 0, e.m, e.n, cb);
}

// The operands of one product besides its extents.
struct Product {
  const Tensor &a, &b, &c, &bias, &residual;
  bool trans_a, trans_b, accumulate;
};

// One C tile [m0, m0 + mc) x [n0, n0 + nc) over the whole K range in K panels of tk.
void gemm_tile(const Product& p, Extents e, int64_t tk, int64_t m0, int64_t mc, int64_t n0,
               int64_t nc, GemmScratch scratch) {
  const Tensor &a = p.a, &b = p.b, &c = p.c;
  float* a_buf = scratch.data;
  float* b_buf = a_buf + kGemmPanel * kGemmPanel;
  float* c_buf = b_buf + kGemmPanel * kGemmPanel;
  const bool c_bf16 = c.dtype() == DType::kBF16;
  const F32Block tile = c_bf16 ? F32Block{c_buf, nc} : F32Block{c.f32() + m0 * e.n + n0, e.n};
  if (c_bf16 && p.accumulate) load_block(elems<bf16_t>(c) + m0 * e.n + n0, e.n, mc, nc, c_buf);
  if (!p.residual.empty()) load_residual(p.residual, m0, n0, mc, nc, tile);
  const bool onto_c = p.accumulate || !p.residual.empty();
  if (e.k == 0 && !onto_c) zero_block(tile, mc, nc);
  for (int64_t k0 = 0; k0 < e.k; k0 += tk) {
    const int64_t kc = std::min(tk, e.k - k0);
    const F32Block ap = operand_block(a, p.trans_a, m0, mc, k0, kc, a_buf);
    const F32Block bp = operand_block(b, p.trans_b, k0, kc, n0, nc, b_buf);
    sgemm_tile(p.trans_a, p.trans_b, mc, nc, kc, ap, bp, onto_c || k0 > 0 ? 1.0f : 0.0f, tile);
  }
  add_bias(p.bias, n0, mc, nc, tile);
  if (c_bf16) store_block(c_buf, mc, nc, elems<bf16_t>(c) + m0 * e.n + n0, e.n);
}

// A product with a bf16 operand: a dimension is tiled by kGemmPanel where a bf16 operand spans
// it (so every converted panel fits its scratch slot) and left whole otherwise.
void gemm_panels(const Product& p, Extents e, GemmScratch scratch) {
  SHARDLM_CHECK_KIND(ErrorKind::kInternal,
                     scratch.data != nullptr && scratch.floats >= kGemmScratchFloats,
                     "gemm: the conversion scratch holds {} floats, a bf16 product needs {}",
                     scratch.floats, kGemmScratchFloats);
  const bool a_bf16 = p.a.dtype() == DType::kBF16, b_bf16 = p.b.dtype() == DType::kBF16,
             c_bf16 = p.c.dtype() == DType::kBF16;
  const int64_t tm = a_bf16 || c_bf16 ? kGemmPanel : e.m;
  const int64_t tn = b_bf16 || c_bf16 ? kGemmPanel : e.n;
  const int64_t tk = a_bf16 || b_bf16 ? kGemmPanel : std::max<int64_t>(e.k, 1);
  for (int64_t m0 = 0; m0 < e.m; m0 += tm)
    for (int64_t n0 = 0; n0 < e.n; n0 += tn)
      gemm_tile(p, e, tk, m0, std::min(tm, e.m - m0), n0, std::min(tn, e.n - n0), scratch);
}

}  // namespace

void gemm(const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, const Tensor& c,
          bool accumulate, const Tensor& bias, GemmScratch scratch, const Tensor& residual) {
  const Extents e{c.dim(0), c.dim(1), trans_a ? a.dim(0) : a.dim(1)};
  SHARDLM_CHECK_KIND(
      ErrorKind::kInternal,
      (trans_a ? a.dim(1) : a.dim(0)) == e.m && (trans_b ? b.dim(1) : b.dim(0)) == e.k &&
          (trans_b ? b.dim(0) : b.dim(1)) == e.n && (bias.empty() || bias.numel() == e.n) &&
          (residual.empty() ||
           (!accumulate && residual.shape() == c.shape() && residual.dtype() == c.dtype())),
      "gemm: a {} (trans {}), b {} (trans {}), c {}, bias {}, residual {} (accumulate {}) do not "
      "agree",
      a.shape().str(), trans_a, b.shape().str(), trans_b, c.shape().str(), bias.shape().str(),
      residual.shape().str(), accumulate);
  // Nothing to add: leaves c as it is (a bf16 c is not even read and rewritten).
  if (e.m == 0 || e.n == 0 || (e.k == 0 && accumulate && bias.empty())) return;
  if (a.dtype() == DType::kF32 && b.dtype() == DType::kF32 && c.dtype() == DType::kF32) {
    gemm_f32(a, trans_a, b, trans_b, c, accumulate, bias, residual, e);
  } else {
    gemm_panels({a, b, c, bias, residual, trans_a, trans_b, accumulate}, e, scratch);
  }
}

}  // namespace shardlm::cpu
