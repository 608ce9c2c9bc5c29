// CudaBackend's GEMM family: cuBLASLt matmuls (Impl::gemm, one cached plan per shape), linear
// layers (their residual and accumulated outputs as the GEMM's C operand, beta 1) and token
// embeddings (whole and vocabulary-parallel slices).
#include <algorithm>
#include <cmath>
#include <cstring>

#include "kernels/cuda/backend_impl.h"

namespace shardlm::cuda {

namespace {

// cuBLASLt's (type, rows, cols, ld) layout of a column-major matrix.
cublasLtMatrixLayout_t make_layout(Elem t, int64_t rows, int64_t cols, int64_t ld,
                                   std::string_view what) {
  cublasLtMatrixLayout_t layout = nullptr;
  lt_ok(cublasLtMatrixLayoutCreate(&layout, lt_type(t), uint64_t(rows), uint64_t(cols), ld), what);
  return layout;
}

// The algorithm cuBLASLt's heuristic ranks first for the plan's descriptors, within the
// workspace and for operands only as aligned as the key says.
cublasLtMatmulAlgo_t choose_algorithm(cublasLtHandle_t lt, const GemmPlan& p, const GemmKey& key,
                                      std::string_view what) {
  cublasLtMatmulPreference_t pref = nullptr;
  lt_ok(cublasLtMatmulPreferenceCreate(&pref), what);
  struct Release {
    cublasLtMatmulPreference_t pref;
    ~Release() { cublasLtMatmulPreferenceDestroy(pref); }
  } release{pref};
  const size_t ws = kLtWorkspaceBytes;
  const auto set = [&](cublasLtMatmulPreferenceAttributes_t attr, const auto& value) {
    lt_ok(cublasLtMatmulPreferenceSetAttribute(pref, attr, &value, sizeof(value)), what);
  };
  set(CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, ws);
  set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, key.align_a);
  set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, key.align_b);
  set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, key.align_c);
  set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, key.align_d);
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  const cublasStatus_t status =
      cublasLtMatmulAlgoGetHeuristic(lt, p.op, p.a, p.b, p.c, p.c, pref, 1, &result, &found);
  // NOT_SUPPORTED is cuBLASLt's "no heuristic for this configuration" (cublasLt.h): the same
  // answer as no algorithm found, so it gets the message that names the shape.
  if (status != CUBLAS_STATUS_NOT_SUPPORTED) lt_ok(status, what);
  SHARDLM_CHECK(status == CUBLAS_STATUS_SUCCESS && found > 0,
                "{}: cuBLASLt has no algorithm for {}x{}x{} (types {}/{}/{}, alignments "
                "{}/{}/{}/{} bytes{})",
                what, key.m, key.n, key.k, key.a_type, key.b_type, key.c_type, key.align_a,
                key.align_b, key.align_c, key.align_d,
                status == CUBLAS_STATUS_SUCCESS ? "" : "; CUBLAS_STATUS_NOT_SUPPORTED");
  return result.algo;
}

// The descriptors, layouts and algorithm of one GEMM shape. The compute type is
// CUBLAS_COMPUTE_32F with f32 scalars for every type pair used here: f32 operands (true f32,
// no TF32), bf16 operands with a bf16 output, and bf16 operands with an f32 output (the dW and
// LM-head products that accumulate in f32). The bf16 pairs are cuBLASLt's tensor-core path:
// its cublasLtMatmul data-type table lists A/B CUDA_R_16BF with C/D CUDA_R_16BF or CUDA_R_32F
// under CUBLAS_COMPUTE_32F / CUDA_R_32F, and the bias of CUBLASLT_EPILOGUE_BIAS has D's type.
GemmPlan make_gemm_plan(cublasLtHandle_t lt, const GemmKey& key, std::string_view what) {
  GemmPlan p;
  lt_ok(cublasLtMatmulDescCreate(&p.op, CUBLAS_COMPUTE_32F, CUDA_R_32F), what);
  const auto set = [&](cublasLtMatmulDescAttributes_t attr, const auto& value) {
    lt_ok(cublasLtMatmulDescSetAttribute(p.op, attr, &value, sizeof(value)), what);
  };
  set(CUBLASLT_MATMUL_DESC_TRANSA, key.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N);
  set(CUBLASLT_MATMUL_DESC_TRANSB, key.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N);
  if (key.bias) {
    set(CUBLASLT_MATMUL_DESC_EPILOGUE, CUBLASLT_EPILOGUE_BIAS);
    set(CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, lt_type(Elem(key.c_type)));
  }
  p.a = make_layout(Elem(key.a_type), key.trans_a ? key.k : key.m, key.trans_a ? key.m : key.k,
                    key.lda, what);
  p.b = make_layout(Elem(key.b_type), key.trans_b ? key.n : key.k, key.trans_b ? key.k : key.n,
                    key.ldb, what);
  // C and D share one layout: a residual has D's type and leading dimension.
  p.c = make_layout(Elem(key.c_type), key.m, key.n, key.ldc, what);
  p.algo = choose_algorithm(lt, p, key, what);
  return p;
}

}  // namespace

void CudaBackend::Impl::gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, const void* A,
                             Elem at, int64_t lda, const void* B, Elem bt, int64_t ldb, void* C,
                             Elem ct, int64_t ldc, float beta, const void* bias,
                             std::string_view what, const void* residual) {
  if (m == 0 || n == 0) return;
  SHARDLM_CHECK(k > 0, "{}: inner dimension is 0", what);
  SHARDLM_CHECK_KIND(ErrorKind::kInternal, residual == nullptr || (residual != C && beta == 1.f),
                     "{}: a residual is summed with beta 1 into a buffer of its own", what);
  const void* c_in = residual != nullptr ? residual : C;
  // In-place (C == D) and out-of-place calls get plans of their own: the heuristic chooses
  // without seeing the pointers, and cuBLASLt promises no algorithm valid for one is for both.
  const GemmKey key{.trans_a = ta,
                    .trans_b = tb,
                    .m = m,
                    .n = n,
                    .k = k,
                    .a_type = int(at),
                    .b_type = int(bt),
                    .c_type = int(ct),
                    .lda = lda,
                    .ldb = ldb,
                    .ldc = ldc,
                    .bias = bias != nullptr,
                    .beta_zero = beta == 0.f,
                    .c_apart = residual != nullptr,
                    .align_a = pointer_alignment(A),
                    .align_b = pointer_alignment(B),
                    .align_c = pointer_alignment(c_in),
                    .align_d = pointer_alignment(C)};
  GemmPlan& plan = gemm_plans.get(key, [&] { return make_gemm_plan(lt, key, what); });
  if (bias != nullptr)
    lt_ok(cublasLtMatmulDescSetAttribute(plan.op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias,
                                         sizeof(bias)),
          what);
  const float alpha = 1.f;
  lt_ok(cublasLtMatmul(lt, plan.op, &alpha, A, plan.a, B, plan.b, &beta, c_in, plan.c, C, plan.c,
                       &plan.algo, lt_ws, kLtWorkspaceBytes, stream),
        what);
}

// ---- linear ------------------------------------------------------------------------------------

void CudaBackend::do_linear_forward(const Tensor& x, const Tensor& w, const Tensor& b,
                                    const Tensor& y, OutputMode y_mode, const Tensor& residual) {
  constexpr std::string_view op = "linear_forward";
  const Elem t = elem(x, op, "x");
  on_device(w, op, "w");
  on_device(y, op, "y");
  if (!b.empty()) on_device(b, op, "b");
  if (!residual.empty()) on_device(residual, op, "residual");
  const int64_t N = x.dim(0), in = x.dim(1), out = w.dim(0);
  const bool accumulate = y_mode == OutputMode::kAccumulate;
  if (in == 0) {
    // cuBLASLt takes no empty inner dimension, and no kernel here broadcasts a bias alone.
    SHARDLM_CHECK(b.empty() || N == 0 || out == 0,
                  "linear_forward: in = 0 with a bias is not implemented on CUDA (x {}, b {})",
                  x.shape().str(), b.shape().str());
    if (!residual.empty()) {
      do_copy(residual, y);
    } else if (!accumulate) {
      do_zero(y);
    }
    return;
  }
  // y^T [out, N] = W [out, in] x^T [in, N] in column-major terms, + beta (y or the residual)
  // as the matmul's C: beta 1 accumulates, or reads the residual and writes y (D).
  impl_->gemm(true, false, out, N, in, w.data(), t, in, x.data(), t, in, y.data(), t, out,
              accumulate || !residual.empty() ? 1.f : 0.f, b.empty() ? nullptr : b.data(), op,
              residual.empty() ? nullptr : residual.data());
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
  // Out-of-vocabulary ids give zero rows; the next result read raises them.
  impl_->flag_ids(tokens, vocab, false, IdCheck::kEmbeddingForward, op, "token id");
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
  // Out-of-vocabulary ids are skipped; the next result read raises them.
  impl_->flag_ids(tokens, vocab, false, IdCheck::kEmbeddingBackward, op, "token id");
  cuda_ok(launch_embedding_backward(tokens.i32(), dout.data(), t, dtable.f32(), tokens.dim(0),
                                    dtable.dim(1), vocab_begin, dtable.dim(0), impl_->stream),
          op);
}

}  // namespace shardlm::cuda
