// CudaBackend's losses: the fused, token-chunked LM head + cross-entropy and the
// vocabulary-parallel cross-entropy over a slice of the logits (kernels: loss.cu).
#include <algorithm>
#include <cmath>
#include <cstring>

#include "kernels/cuda/backend_impl.h"

namespace shardlm::cuda {

namespace {
// Workspace: f32 logits [chunk, V], their copy in bf16 [chunk, V] (bf16 operands only), f64
// (loss, valid) per row [chunk, 2], the running totals [2].
size_t loss_logits_bytes(int64_t chunk, int64_t V) { return align_up(size_t(chunk) * V * 4); }
size_t loss_copy_bytes(int64_t chunk, int64_t V) { return align_up(size_t(chunk) * V * 2); }
size_t loss_rows_bytes(int64_t chunk) { return align_up(size_t(chunk) * 2 * sizeof(double)); }

}  // namespace

size_t CudaBackend::lm_head_loss_workspace_bytes(int64_t chunk_tokens, int64_t V) const {
  SHARDLM_CHECK(chunk_tokens >= 1 && V >= 1,
                "lm_head_loss needs chunk_tokens >= 1 and V >= 1, got {} and {}", chunk_tokens, V);
  return loss_logits_bytes(chunk_tokens, V) + loss_copy_bytes(chunk_tokens, V) +
         loss_rows_bytes(chunk_tokens) + align_up(2 * sizeof(double));
}

LossResult CudaBackend::lm_head_loss(const Tensor& h, const Tensor& w, const Tensor& targets,
                                     int64_t chunk_tokens, float grad_scale, const Tensor& dh,
                                     const Tensor& dw, Workspace ws) {
  constexpr std::string_view op = "lm_head_loss";
  const Elem t = elem(h, op, "h");
  elem(w, op, "w");
  same_type(h, w, op, "h", "w");
  SHARDLM_CHECK(h.rank() == 2 && w.rank() == 2 && h.dim(1) == w.dim(1),
                "{}: expects h [N, D] and w [V, D], got {} and {}", op, h.shape().str(),
                w.shape().str());
  need(targets, DType::kI32, 1, op, "targets");
  SHARDLM_CHECK(targets.dim(0) == h.dim(0), "{}: expects targets [{}], got {}", op, h.dim(0),
                targets.shape().str());
  Elem gw = Elem::kF32;
  if (!dh.empty()) {
    elem(dh, op, "dh");
    same_type(h, dh, op, "h", "dh");
    check_same_shape(h, dh, op, "h", "dh");
  }
  if (!dw.empty()) {
    gw = elem(dw, op, "dw");
    SHARDLM_CHECK(gw == Elem::kF32 || dw.dtype() == w.dtype(), "{}: dw must be f32 or {}", op,
                  dtype_name(w.dtype()));
    check_same_shape(w, dw, op, "w", "dw");
  }
  const int64_t N = h.dim(0), D = h.dim(1), V = w.dim(0);
  const size_t need_ws = lm_head_loss_workspace_bytes(chunk_tokens, V);
  SHARDLM_CHECK(ws.bytes >= need_ws && ws.data != nullptr,
                "{}: workspace has {} bytes, needs {}; size it with lm_head_loss_workspace_bytes",
                op, ws.bytes, need_ws);
  Impl& m = *impl_;
  m.check_ids(targets, V, true, op, "target id");  // before dh / dw are touched
  LossResult result;
  if (N == 0) return result;
  auto* logits = reinterpret_cast<float*>(ws.data);
  void* copy = ws.data + loss_logits_bytes(chunk_tokens, V);
  auto* rows_f64 =
      reinterpret_cast<double*>(static_cast<std::byte*>(copy) + loss_copy_bytes(chunk_tokens, V));
  auto* acc = reinterpret_cast<double*>(reinterpret_cast<std::byte*>(rows_f64) +
                                        loss_rows_bytes(chunk_tokens));
  cuda_ok(cudaMemsetAsync(acc, 0, 2 * sizeof(double), m.stream), op);
  const bool want_grad = !dh.empty() || !dw.empty();
  const size_t eb = dtype_size(h.dtype());
  for (int64_t begin = 0; begin < N; begin += chunk_tokens) {
    const int64_t rows = std::min(chunk_tokens, N - begin);
    const void* h_chunk = static_cast<const std::byte*>(h.data()) + begin * D * eb;
    // logits^T [V, rows] = W [V, D] h_chunk^T [D, rows], f32 out
    m.gemm(true, false, V, rows, D, w.data(), t, D, h_chunk, t, D, logits, Elem::kF32, V, 0.f,
           nullptr, op);
    cuda_ok(launch_softmax_xent(logits, t == Elem::kBF16 ? copy : nullptr, t, targets.i32() + begin,
                                rows, V, grad_scale, want_grad, rows_f64, acc, m.stream),
            op);
    const void* dlogits = t == Elem::kBF16 ? copy : static_cast<const void*>(logits);
    if (!dh.empty()) {
      // dh_chunk^T [D, rows] = W^T [D, V] dlogits^T [V, rows]
      void* dh_chunk = static_cast<std::byte*>(dh.data()) + begin * D * eb;
      m.gemm(false, false, D, rows, V, w.data(), t, D, dlogits, t, V, dh_chunk, t, D, 0.f, nullptr,
             op);
    }
    if (!dw.empty()) {
      // dW^T [D, V] += h_chunk^T [D, rows] dlogits [rows, V]
      m.gemm(false, true, D, V, rows, h_chunk, t, D, dlogits, t, V, dw.data(), gw, D, 1.f, nullptr,
             op);
    }
  }
  cuda_ok(cudaMemcpyAsync(m.h_scratch, acc, 2 * sizeof(double), cudaMemcpyDeviceToHost, m.stream),
          op);
  m.sync();
  result.loss_sum = m.h_scratch[0];
  result.n_valid = int64_t(std::llround(m.h_scratch[1]));
  return result;
}

// ---- vocabulary-parallel cross-entropy over a slice of the logits ------------------------------

namespace {
// logits [n, Vs] f32; row_max [n] f32; targets [n] i32 and stats [n, 2] f32 when given
void check_xent_slice(const Tensor& logits, const Tensor& row_max, const Tensor* targets,
                      const Tensor* stats, std::string_view op) {
  need(logits, DType::kF32, 2, op, "logits");
  need(row_max, DType::kF32, 1, op, "row_max");
  const int64_t n = logits.dim(0);
  SHARDLM_CHECK(row_max.dim(0) == n, "{}: row_max must be [{}] like the logits' rows, got {}", op,
                n, row_max.shape().str());
  if (targets != nullptr) {
    need(*targets, DType::kI32, 1, op, "targets");
    SHARDLM_CHECK(targets->dim(0) == n, "{}: targets must be [{}], got {}", op, n,
                  targets->shape().str());
  }
  if (stats != nullptr) {
    need(*stats, DType::kF32, 2, op, "stats");
    SHARDLM_CHECK(stats->dim(0) == n && stats->dim(1) == 2, "{}: stats must be [{}, 2], got {}", op,
                  n, stats->shape().str());
  }
}
}  // namespace

void CudaBackend::xent_slice_max(const Tensor& logits, const Tensor& row_max) {
  constexpr std::string_view op = "xent_slice_max";
  check_xent_slice(logits, row_max, nullptr, nullptr, op);
  cuda_ok(launch_xent_slice_max(logits.f32(), row_max.f32(), logits.dim(0), logits.dim(1),
                                impl_->stream),
          op);
}

void CudaBackend::xent_slice_stats(const Tensor& logits, const Tensor& targets, int64_t vocab_begin,
                                   int64_t vocab, const Tensor& row_max, const Tensor& stats) {
  constexpr std::string_view op = "xent_slice_stats";
  check_xent_slice(logits, row_max, &targets, &stats, op);
  SHARDLM_CHECK(vocab_begin >= 0 && vocab_begin + logits.dim(1) <= vocab,
                "{}: the slice [{}, {}) is not inside the vocabulary [0, {})", op, vocab_begin,
                vocab_begin + logits.dim(1), vocab);
  impl_->check_ids(targets, vocab, true, op, "target id");  // before any write
  cuda_ok(launch_xent_slice_stats(logits.f32(), targets.i32(), vocab_begin, row_max.f32(),
                                  stats.f32(), logits.dim(0), logits.dim(1), impl_->stream),
          op);
}

// Workspace: f64 (loss, valid) per row [n, 2], the totals [2].
size_t CudaBackend::xent_slice_workspace_bytes(int64_t n) const {
  return loss_rows_bytes(n) + align_up(2 * sizeof(double));
}

LossResult CudaBackend::xent_slice_finish(const Tensor& logits, const Tensor& targets,
                                          int64_t vocab_begin, const Tensor& row_max,
                                          const Tensor& stats, float grad_scale, bool want_grad,
                                          Workspace ws) {
  constexpr std::string_view op = "xent_slice_finish";
  check_xent_slice(logits, row_max, &targets, &stats, op);
  const int64_t n = logits.dim(0);
  SHARDLM_CHECK(ws.data != nullptr && ws.bytes >= xent_slice_workspace_bytes(n),
                "{}: workspace has {} bytes, needs {}; size it with xent_slice_workspace_bytes", op,
                ws.bytes, xent_slice_workspace_bytes(n));
  Impl& m = *impl_;
  auto* rows_f64 = reinterpret_cast<double*>(ws.data);
  auto* acc = reinterpret_cast<double*>(ws.data + loss_rows_bytes(n));
  cuda_ok(
      launch_xent_slice_finish(logits.f32(), targets.i32(), vocab_begin, row_max.f32(), stats.f32(),
                               grad_scale, want_grad, rows_f64, acc, n, logits.dim(1), m.stream),
      op);
  cuda_ok(cudaMemcpyAsync(m.h_scratch, acc, 2 * sizeof(double), cudaMemcpyDeviceToHost, m.stream),
          op);
  m.sync();
  return {m.h_scratch[0], int64_t(std::llround(m.h_scratch[1]))};
}

}  // namespace shardlm::cuda
