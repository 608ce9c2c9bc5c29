// CudaBackend's GEMM family: cuBLASLt matmuls (Impl::gemm), linear layers and token
// embeddings (whole and vocabulary-parallel slices).
#include <algorithm>
#include <cmath>
#include <cstring>

#include "kernels/cuda/backend_impl.h"

namespace shardlm::cuda {

void CudaBackend::Impl::gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, const void* A,
                             Elem at, int64_t lda, const void* B, Elem bt, int64_t ldb, void* C,
                             Elem ct, int64_t ldc, float beta, const void* bias,
                             std::string_view what) {
  if (m == 0 || n == 0) return;
  SHARDLM_CHECK(k > 0, "{}: inner dimension is 0", what);
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t la = nullptr, lb = nullptr, lc = nullptr;
  cublasLtMatmulPreference_t pref = nullptr;
  struct Cleanup {
    cublasLtMatmulDesc_t& op;
    cublasLtMatrixLayout_t &la, &lb, &lc;
    cublasLtMatmulPreference_t& pref;
    ~Cleanup() {
      if (pref) cublasLtMatmulPreferenceDestroy(pref);
      if (lc) cublasLtMatrixLayoutDestroy(lc);
      if (lb) cublasLtMatrixLayoutDestroy(lb);
      if (la) cublasLtMatrixLayoutDestroy(la);
      if (op) cublasLtMatmulDescDestroy(op);
    }
  } cleanup{op, la, lb, lc, pref};
  lt_ok(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F), what);
  const cublasOperation_t opa = ta ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t opb = tb ? CUBLAS_OP_T : CUBLAS_OP_N;
  lt_ok(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &opa, sizeof(opa)), what);
  lt_ok(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &opb, sizeof(opb)), what);
  if (bias != nullptr) {
    const cublasLtEpilogue_t epi = CUBLASLT_EPILOGUE_BIAS;
    const cudaDataType_t bias_type = lt_type(ct);
    lt_ok(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof(epi)),
          what);
    lt_ok(
        cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias)),
        what);
    lt_ok(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bias_type,
                                         sizeof(bias_type)),
          what);
  }
  lt_ok(cublasLtMatrixLayoutCreate(&la, lt_type(at), ta ? k : m, ta ? m : k, lda), what);
  lt_ok(cublasLtMatrixLayoutCreate(&lb, lt_type(bt), tb ? n : k, tb ? k : n, ldb), what);
  lt_ok(cublasLtMatrixLayoutCreate(&lc, lt_type(ct), m, n, ldc), what);
  lt_ok(cublasLtMatmulPreferenceCreate(&pref), what);
  const size_t ws = kLtWorkspaceBytes;
  lt_ok(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws,
                                             sizeof(ws)),
        what);
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  lt_ok(cublasLtMatmulAlgoGetHeuristic(lt, op, la, lb, lc, lc, pref, 1, &result, &found), what);
  SHARDLM_CHECK(found > 0, "{}: cuBLASLt has no algorithm for {}x{}x{}", what, m, n, k);
  const float alpha = 1.f;
  lt_ok(cublasLtMatmul(lt, op, &alpha, A, la, B, lb, &beta, C, lc, C, lc, &result.algo, lt_ws, ws,
                       stream),
        what);
}

// ---- linear ------------------------------------------------------------------------------------

void CudaBackend::do_linear_forward(const Tensor& x, const Tensor& w, const Tensor& b,
                                    const Tensor& y, OutputMode y_mode) {
  constexpr std::string_view op = "linear_forward";
  const Elem t = elem(x, op, "x");
  on_device(w, op, "w");
  on_device(y, op, "y");
  if (!b.empty()) on_device(b, op, "b");
  const int64_t N = x.dim(0), in = x.dim(1), out = w.dim(0);
  const bool accumulate = y_mode == OutputMode::kAccumulate;
  if (in == 0) {
    // cuBLASLt takes no empty inner dimension, and no kernel here broadcasts a bias alone.
    SHARDLM_CHECK(b.empty() || N == 0 || out == 0,
                  "linear_forward: in = 0 with a bias is not implemented on CUDA (x {}, b {})",
                  x.shape().str(), b.shape().str());
    if (!accumulate) do_zero(y);
    return;
  }
  // y^T [out, N] (+)= W [out, in] x^T [in, N] in column-major terms (beta 1 accumulates).
  impl_->gemm(true, false, out, N, in, w.data(), t, in, x.data(), t, in, y.data(), t, out,
              accumulate ? 1.f : 0.f, b.empty() ? nullptr : b.data(), op);
}

void CudaBackend::do_linear_backward(const Tensor& x, const Tensor& w, const Tensor& dy,
                                     const Tensor& dx, const Tensor& dw, const Tensor& db,
                                     OutputMode dx_mode) {
  constexpr std::string_view op = "linear_backward";
  const Elem t = elem(x, op, "x");
  on_device(w, op, "w");
  on_device(dy, op, "dy");
  const int64_t N = x.dim(0), in = x.dim(1), out = w.dim(0);
  if (!dx.empty()) {
    on_device(dx, op, "dx");
    const bool accumulate = dx_mode == OutputMode::kAccumulate;
    // dx^T [in, N] (+)= W^T [in, out] dy^T [out, N] (beta 1 accumulates)
    if (out == 0) {
      if (!accumulate) do_zero(dx);
    } else {
      impl_->gemm(false, false, in, N, out, w.data(), t, in, dy.data(), t, out, dx.data(), t, in,
                  accumulate ? 1.f : 0.f, nullptr, op);
    }
  }
  if (!dw.empty()) {
    const Elem gt = elem(dw, op, "dw");
    // dW^T [in, out] += x^T [in, N] dy [N, out]
    if (N > 0)
      impl_->gemm(false, true, in, out, N, x.data(), t, in, dy.data(), t, out, dw.data(), gt, in,
                  1.f, nullptr, op);
  }
  if (!db.empty()) {
    on_device(db, op, "db");
    cuda_ok(launch_column_sum(dy.data(), t, db.f32(), N, out, impl_->stream), op);
  }
}

// ---- embedding ---------------------------------------------------------------------------------

void CudaBackend::do_embedding_forward_slice(const Tensor& tokens, const Tensor& table,
                                             int64_t vocab_begin, int64_t vocab,
                                             const Tensor& out) {
  constexpr std::string_view op = "embedding_forward";
  on_device(tokens, op, "tokens");
  const Elem t = elem(table, op, "table");
  on_device(out, op, "out");
  impl_->check_ids(tokens, vocab, false, op, "token id");
  cuda_ok(launch_embedding_forward(tokens.i32(), table.data(), out.data(), t, tokens.dim(0),
                                   table.dim(1), vocab_begin, table.dim(0), impl_->stream),
          op);
}

void CudaBackend::do_embedding_backward_slice(const Tensor& tokens, const Tensor& dout,
                                              int64_t vocab_begin, int64_t vocab,
                                              const Tensor& dtable) {
  constexpr std::string_view op = "embedding_backward";
  on_device(tokens, op, "tokens");
  const Elem t = elem(dout, op, "dout");
  on_device(dtable, op, "dtable");
  impl_->check_ids(tokens, vocab, false, op, "token id");
  cuda_ok(launch_embedding_backward(tokens.i32(), dout.data(), t, dtable.f32(), tokens.dim(0),
                                    dtable.dim(1), vocab_begin, dtable.dim(0), impl_->stream),
          op);
}

}  // namespace shardlm::cuda
