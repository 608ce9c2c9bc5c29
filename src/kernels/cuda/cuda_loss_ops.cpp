// CudaBackend's losses: the fused, token-chunked LM head + cross-entropy and the
// vocabulary-parallel cross-entropy over a slice of the logits, with its statistics folded over
// slices walked in turn, its chunks' losses added on the device and read once (read_loss)
// (kernels: loss.cu).
#include <algorithm>
#include <cmath>
#include <cstring>

#include "kernels/cuda/backend_impl.h"

namespace shardlm::cuda {

namespace {
// Workspace: the logits [chunk, V] in the operands' dtype (bf16 logits, as PyTorch's autocast
// has them; the softmax statistics in f32, the row losses in f64), turned into the logits'
// gradient in place; f64 (loss, valid) per row [chunk, 2]. The running totals are the backend's
// ResultWords, read back with the id flags in one copy.
size_t loss_logits_bytes(int64_t chunk, int64_t V, DType t) {
  return align_up(size_t(chunk) * V * dtype_size(t));
}
size_t loss_rows_bytes(int64_t chunk) { return align_up(size_t(chunk) * 2 * sizeof(double)); }

}  // namespace

size_t CudaBackend::do_lm_head_loss_workspace_bytes(int64_t chunk_tokens, int64_t V,
                                                    DType t) const {
  return loss_logits_bytes(chunk_tokens, V, t) + loss_rows_bytes(chunk_tokens);
}

LossResult CudaBackend::do_lm_head_loss(const Tensor& h, const Tensor& w, const Tensor& targets,
                                        int64_t chunk_tokens, float grad_scale, const Tensor& dh,
                                        const Tensor& dw, Workspace ws, float softcap) {
  constexpr std::string_view op = "lm_head_loss";
  const Elem t = elem(h, op, "h");
  on_device(w, op, "w");
  on_device(targets, op, "targets");
  if (!dh.empty()) on_device(dh, op, "dh");
  const Elem gw = dw.empty() ? Elem::kF32 : elem(dw, op, "dw");
  const int64_t N = h.dim(0), D = h.dim(1), V = w.dim(0);
  Impl& m = *impl_;
  if (N == 0) return {};
  // Bad targets are left out by the kernel and raised at this op's read, with the embedding's.
  m.flag_ids(targets, V, true, IdCheck::kLossTargets, op, "target id");
  void* logits = ws.data;
  auto* rows_f64 =
      reinterpret_cast<double*>(ws.data + loss_logits_bytes(chunk_tokens, V, h.dtype()));
  double* acc = m.d_totals();
  cuda_ok(cudaMemsetAsync(acc, 0, 2 * sizeof(double), m.stream), op);
  const bool want_grad = !dh.empty() || !dw.empty();
  const size_t eb = dtype_size(h.dtype());
  for (int64_t begin = 0; begin < N; begin += chunk_tokens) {
    const int64_t rows = std::min(chunk_tokens, N - begin);
    const void* h_chunk = static_cast<const std::byte*>(h.data()) + begin * D * eb;
    // logits^T [V, rows] = W [V, D] h_chunk^T [D, rows], in h's dtype (f32 accumulation)
    m.gemm(true, false, V, rows, D, w.data(), t, D, h_chunk, t, D, logits, t, V, 0.f, nullptr, op);
    // logits -> dlogits in place
    cuda_ok(launch_softmax_xent(logits, t, targets.i32() + begin, rows, V, grad_scale, want_grad,
                                rows_f64, acc, softcap, m.stream),
            op);
    const void* dlogits = logits;
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
  // One copy and one wait: the totals and every id check since the last read.
  cuda_ok(
      cudaMemcpyAsync(m.h_words, m.d_words, sizeof(ResultWords), cudaMemcpyDeviceToHost, m.stream),
      op);
  m.sync();
  m.raise_flagged_ids();
  LossResult result;
  result.loss_sum = m.h_words->loss_sum;
  result.n_valid = int64_t(std::llround(m.h_words->n_valid));
  return result;
}

// ---- vocabulary-parallel cross-entropy over a slice of the logits ------------------------------

namespace {
// The tensors of the xent_slice_* ops live on the device.
void xent_on_device(const Tensor& logits, const Tensor& row_max, const Tensor* targets,
                    const Tensor* stats, std::string_view op) {
  on_device(logits, op, "logits");
  on_device(row_max, op, "row_max");
  if (targets != nullptr) on_device(*targets, op, "targets");
  if (stats != nullptr) on_device(*stats, op, "stats");
}
}  // namespace

void CudaBackend::do_xent_slice_max(const Tensor& logits, const Tensor& row_max, float softcap) {
  constexpr std::string_view op = "xent_slice_max";
  xent_on_device(logits, row_max, nullptr, nullptr, op);
  cuda_ok(launch_xent_slice_max(logits.data(), elem_of(logits.dtype()), row_max.f32(),
                                logits.dim(0), logits.dim(1), softcap, impl_->stream),
          op);
}

void CudaBackend::do_xent_slice_stats(const Tensor& logits, const Tensor& targets,
                                      int64_t vocab_begin, int64_t vocab, const Tensor& row_max,
                                      const Tensor& stats, float softcap) {
  constexpr std::string_view op = "xent_slice_stats";
  xent_on_device(logits, row_max, &targets, &stats, op);
  // Bad targets are left out (stats (0, 0)) and raised at the next result read (read_loss's).
  impl_->flag_ids(targets, vocab, true, IdCheck::kSliceTargets, op, "target id");
  cuda_ok(launch_xent_slice_stats(logits.data(), elem_of(logits.dtype()), targets.i32(),
                                  vocab_begin, vocab, row_max.f32(), stats.f32(), logits.dim(0),
                                  logits.dim(1), softcap, impl_->stream),
          op);
}

void CudaBackend::do_xent_slice_fold(const Tensor& logits, const Tensor& targets,
                                     int64_t vocab_begin, int64_t vocab, const Tensor& row_max,
                                     const Tensor& stats, bool first, float softcap) {
  constexpr std::string_view op = "xent_slice_fold";
  xent_on_device(logits, row_max, &targets, &stats, op);
  // As xent_slice_stats: bad targets left out, raised at the next result read.
  impl_->flag_ids(targets, vocab, true, IdCheck::kSliceTargets, op, "target id");
  cuda_ok(launch_xent_slice_fold(logits.data(), elem_of(logits.dtype()), targets.i32(), vocab_begin,
                                 vocab, row_max.f32(), stats.f32(), first, logits.dim(0),
                                 logits.dim(1), softcap, impl_->stream),
          op);
}

// Workspace: f64 (loss, valid) per row [n, 2]; the totals are the caller's loss_acc.
size_t CudaBackend::xent_slice_workspace_bytes(int64_t n) const { return loss_rows_bytes(n); }

void CudaBackend::do_xent_slice_finish(const Tensor& logits, const Tensor& targets,
                                       int64_t vocab_begin, const Tensor& row_max,
                                       const Tensor& stats, float grad_scale, bool want_grad,
                                       const Tensor& loss_acc, Workspace ws, float softcap) {
  constexpr std::string_view op = "xent_slice_finish";
  xent_on_device(logits, row_max, &targets, &stats, op);
  if (!loss_acc.empty()) on_device(loss_acc, op, "loss_acc");
  // Queued only: the totals stay on the device until read_loss (no copy, no wait here).
  cuda_ok(launch_xent_slice_finish(logits.data(), elem_of(logits.dtype()), targets.i32(),
                                   vocab_begin, row_max.f32(), stats.f32(), grad_scale, want_grad,
                                   reinterpret_cast<double*>(ws.data),
                                   loss_acc.empty() ? nullptr : loss_acc.f64(), logits.dim(0),
                                   logits.dim(1), softcap, impl_->stream),
          op);
}

LossResult CudaBackend::do_read_loss(const Tensor& loss_acc) {
  constexpr std::string_view op = "read_loss";
  on_device(loss_acc, op, "loss_acc");
  Impl& m = *impl_;
  cuda_ok(cudaMemcpyAsync(m.h_scratch, loss_acc.data(), 2 * sizeof(double), cudaMemcpyDeviceToHost,
                          m.stream),
          op);
  // The targets' checks (xent_slice_stats, _fold) and the embedding's, in the same wait.
  m.copy_id_flags(op);
  m.sync();
  m.raise_flagged_ids();
  return {m.h_scratch[0], int64_t(std::llround(m.h_scratch[1]))};
}

}  // namespace shardlm::cuda
