// The CPU matrix product of the linear layer and the LM head: C (+)= op(A) op(B) (+ bias), each
// of A, B, C (and the bias) f32 or bf16, arithmetic f32. OpenBLAS here has no bf16 GEMM, so
// every product is sgemm: f32 operands are handed to it in place, bf16 ones are converted to f32
// panel by panel into a fixed scratch (GemmScratch) that the CpuBackend owns. Internal to
// src/kernels/cpu; no allocation.
#pragma once

#include <cstddef>
#include <cstdint>

#include "shardlm/core/tensor.h"

namespace shardlm::cpu {

// Rows and columns of one converted panel: M, N and K are tiled by it wherever a bf16 operand
// spans the dimension. The repeated conversions (each A panel once per N tile, each B panel
// once per M tile) cost about the same with 256, 384 or 512 (a few % of one thread's sgemm
// time); the largest makes the fewest sgemm calls, each a fork/join of OpenBLAS's threads
// (costly when other processes keep the cores busy), for a 3 MiB scratch.
inline constexpr int64_t kGemmPanel = 512;

// f32 elements of the scratch a product with bf16 operands needs: one panel each of A, B, C.
inline constexpr size_t kGemmScratchFloats = size_t{3} * kGemmPanel * kGemmPanel;

// The conversion scratch: kGemmScratchFloats f32, the only memory a bf16 product touches besides
// its operands. One product at a time uses it (the CpuBackend that owns it runs ops in order).
struct GemmScratch {
  float* data = nullptr;
  size_t floats = 0;
};

// c [M, N]; a [M, K] (or [K, M] used transposed: trans_a); b [K, N] (or [N, K]: trans_b);
// bias [N] or empty, added to every row; residual [M, N] of c's dtype or empty, apart from c
// (only without accumulate). All 2-D, row-major and dense; float dtypes mixed freely.
// c = (accumulate ? c : residual or 0) + op(a) op(b) + bias, summed in f32 over the whole K
// range and rounded once where c is bf16. With a, b, c and bias all f32 this is exactly one
// cblas_sgemm (beta 0 or 1; a residual copied into c first) followed by the bias add, whatever
// the shapes. Extents within the BLAS int range (the callers check, naming their op). Never
// call from inside an OpenMP region: OpenBLAS threads itself, and the bias add is an OpenMP
// loop.
void gemm(const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, const Tensor& c,
          bool accumulate, const Tensor& bias, GemmScratch scratch,
          const Tensor& residual = Tensor());

}  // namespace shardlm::cpu
