// ForwardingBackend: every op as one call of the inner backend's entry point, handed to run().
#include "shardlm/backend/forwarding.h"

#include <vector>

namespace shardlm {

std::string_view op_family_name(OpFamily f) {
  switch (f) {
    case OpFamily::kLinear:
      return "linear (GEMM)";
    case OpFamily::kAttention:
      return "attention";
    case OpFamily::kLmHeadLoss:
      return "lm head + loss";
    case OpFamily::kNorm:
      return "rmsnorm";
    case OpFamily::kRope:
      return "rope";
    case OpFamily::kSwiglu:
      return "swiglu";
    case OpFamily::kEmbedding:
      return "embedding";
    case OpFamily::kOptimizer:
      return "optimizer";
    case OpFamily::kElementwise:
      return "elementwise";
  }
  return "?";
}

namespace {

HostWaits touches_host(const Tensor& a, const Tensor& b) {
  return a.pool() == MemPool::kHost || b.pool() == MemPool::kHost ? HostWaits::kYes
                                                                  : HostWaits::kNo;
}

}  // namespace

void ForwardingBackend::do_zero(const Tensor& x) {
  run(OpFamily::kElementwise, touches_host(x, x), [=, this] { inner_->zero(x); });
}
void ForwardingBackend::do_copy(const Tensor& src, const Tensor& dst) {
  run(OpFamily::kElementwise, touches_host(src, dst), [=, this] { inner_->copy(src, dst); });
}
void ForwardingBackend::do_copy_blocks(const Tensor& src, const Tensor& dst,
                                       const BlockCopy& layout) {
  run(OpFamily::kElementwise, touches_host(src, dst),
      [=, this] { inner_->copy_blocks(src, dst, layout); });
}
void ForwardingBackend::do_convert(const Tensor& src, const Tensor& dst) {
  run(OpFamily::kElementwise, touches_host(src, dst), [=, this] { inner_->convert(src, dst); });
}
void ForwardingBackend::do_add(const Tensor& a, const Tensor& b, const Tensor& out) {
  run(OpFamily::kElementwise, HostWaits::kNo, [=, this] { inner_->add(a, b, out); });
}
void ForwardingBackend::do_scale(const Tensor& x, float s) {
  run(OpFamily::kElementwise, HostWaits::kNo, [=, this] { inner_->scale(x, s); });
}

void ForwardingBackend::do_scale_rows(const Tensor& x, const Tensor& s) {
  run(OpFamily::kElementwise, HostWaits::kNo, [=, this] { inner_->scale_rows(x, s); });
}
void ForwardingBackend::do_dropout(const Tensor& x, const Tensor& out, float p, uint64_t seed,
                                   int64_t first, int64_t width, int64_t row_stride) {
  // The entry point takes row_stride = 0 for a whole tensor, which it turns into width.
  const bool whole = width == x.numel() && row_stride == width;
  run(OpFamily::kElementwise, HostWaits::kNo,
      [=, this] { inner_->dropout(x, out, p, seed, first, whole ? 0 : row_stride); });
}
double ForwardingBackend::do_sum_squares(const Tensor& x) {
  double sum = 0;
  run(OpFamily::kOptimizer, HostWaits::kYes, [&] { sum = inner_->sum_squares(x); });
  return sum;
}
void ForwardingBackend::do_sum_squares_segments(std::span<const Tensor> xs,
                                                std::span<double> sums) {
  run(OpFamily::kOptimizer, HostWaits::kYes, [&] { inner_->sum_squares_segments(xs, sums); });
}
// The base's dequantization is part of its projections' cost.
void ForwardingBackend::do_nf4_dequantize(const Tensor& codes, const Tensor& absmax,
                                          const Tensor& out) {
  run(OpFamily::kLinear, HostWaits::kNo, [=, this] { inner_->nf4_dequantize(codes, absmax, out); });
}
void ForwardingBackend::do_linear_forward(const Tensor& x, const Tensor& w, const Tensor& b,
                                          const Tensor& y, OutputMode y_mode,
                                          const Tensor& residual) {
  run(OpFamily::kLinear, HostWaits::kNo,
      [=, this] { inner_->linear_forward(x, w, b, y, y_mode, residual); });
}
void ForwardingBackend::do_linear_backward(const Tensor& x, const Tensor& w, const Tensor& dy,
                                           const Tensor& dx, const Tensor& dw, const Tensor& db,
                                           OutputMode dx_mode) {
  run(OpFamily::kLinear, HostWaits::kNo,
      [=, this] { inner_->linear_backward(x, w, dy, dx, dw, db, dx_mode); });
}
// The embedding's and the vocabulary slices' id checks are a device's flags, read at the next
// wait (the CUDA backend's): queued, a bad id's error is raised by the wait that runs the op,
// the bad row written as a device leaves it (zero rows; a target's statistics (0, 0)).
void ForwardingBackend::do_embedding_forward(const Tensor& tokens, const Tensor& table,
                                             const Tensor& out) {
  run(OpFamily::kEmbedding, HostWaits::kNo,
      [=, this] { inner_->embedding_forward(tokens, table, out); });
}
void ForwardingBackend::do_embedding_backward(const Tensor& tokens, const Tensor& dout,
                                              const Tensor& dtable) {
  run(OpFamily::kEmbedding, HostWaits::kNo,
      [=, this] { inner_->embedding_backward(tokens, dout, dtable); });
}
void ForwardingBackend::do_embedding_forward_slice(const Tensor& tokens, const Tensor& table,
                                                   int64_t vocab_begin, int64_t vocab,
                                                   const Tensor& out) {
  run(OpFamily::kEmbedding, HostWaits::kNo,
      [=, this] { inner_->embedding_forward_slice(tokens, table, vocab_begin, vocab, out); });
}
void ForwardingBackend::do_embedding_backward_slice(const Tensor& tokens, const Tensor& dout,
                                                    int64_t vocab_begin, int64_t vocab,
                                                    const Tensor& dtable) {
  run(OpFamily::kEmbedding, HostWaits::kNo,
      [=, this] { inner_->embedding_backward_slice(tokens, dout, vocab_begin, vocab, dtable); });
}
void ForwardingBackend::do_rmsnorm_forward(const Tensor& x, const Tensor& w, float eps,
                                           const Tensor& y, const Tensor& rstd, float w_offset) {
  run(OpFamily::kNorm, HostWaits::kNo,
      [=, this] { inner_->rmsnorm_forward(x, w, eps, y, rstd, w_offset); });
}
void ForwardingBackend::do_add_rmsnorm_forward(const Tensor& x, const Tensor& residual,
                                               const Tensor& w, float eps, const Tensor& y,
                                               const Tensor& rstd, float w_offset) {
  run(OpFamily::kNorm, HostWaits::kNo,
      [=, this] { inner_->add_rmsnorm_forward(x, residual, w, eps, y, rstd, w_offset); });
}
void ForwardingBackend::do_rmsnorm_backward(const Tensor& x, const Tensor& w, const Tensor& rstd,
                                            const Tensor& dy, const Tensor& dx, const Tensor& dw,
                                            float w_offset) {
  run(OpFamily::kNorm, HostWaits::kNo,
      [=, this] { inner_->rmsnorm_backward(x, w, rstd, dy, dx, dw, w_offset); });
}
void ForwardingBackend::do_rope_forward(const Tensor& x, const Tensor& positions,
                                        const Tensor& inv_freq, RopePairs pairs) {
  run(OpFamily::kRope, HostWaits::kNo,
      [=, this] { inner_->rope_forward(x, positions, inv_freq, pairs); });
}
void ForwardingBackend::do_rope_backward(const Tensor& dx, const Tensor& positions,
                                         const Tensor& inv_freq, RopePairs pairs) {
  run(OpFamily::kRope, HostWaits::kNo,
      [=, this] { inner_->rope_backward(dx, positions, inv_freq, pairs); });
}
void ForwardingBackend::do_rope_qk_forward(const Tensor& q, const Tensor& k,
                                           const Tensor& positions, const Tensor& inv_freq,
                                           RopePairs pairs) {
  run(OpFamily::kRope, HostWaits::kNo,
      [=, this] { inner_->rope_qk_forward(q, k, positions, inv_freq, pairs); });
}
void ForwardingBackend::do_rope_qk_backward(const Tensor& dq, const Tensor& dk,
                                            const Tensor& positions, const Tensor& inv_freq,
                                            RopePairs pairs) {
  run(OpFamily::kRope, HostWaits::kNo,
      [=, this] { inner_->rope_qk_backward(dq, dk, positions, inv_freq, pairs); });
}
void ForwardingBackend::do_swiglu_forward(const Tensor& gate, const Tensor& up, const Tensor& h) {
  run(OpFamily::kSwiglu, HostWaits::kNo, [=, this] { inner_->swiglu_forward(gate, up, h); });
}
void ForwardingBackend::do_swiglu_backward(const Tensor& gate, const Tensor& up, const Tensor& dh,
                                           const Tensor& dgate, const Tensor& dup) {
  run(OpFamily::kSwiglu, HostWaits::kNo,
      [=, this] { inner_->swiglu_backward(gate, up, dh, dgate, dup); });
}
void ForwardingBackend::do_geglu_forward(const Tensor& gate, const Tensor& up, const Tensor& h) {
  run(OpFamily::kSwiglu, HostWaits::kNo, [=, this] { inner_->geglu_forward(gate, up, h); });
}
void ForwardingBackend::do_geglu_backward(const Tensor& gate, const Tensor& up, const Tensor& dh,
                                          const Tensor& dgate, const Tensor& dup) {
  run(OpFamily::kSwiglu, HostWaits::kNo,
      [=, this] { inner_->geglu_backward(gate, up, dh, dgate, dup); });
}
void ForwardingBackend::do_attention_forward(const Tensor& q, const Tensor& k, const Tensor& v,
                                             const Tensor& seg_start, const Tensor& out,
                                             const Tensor& lse, Workspace ws,
                                             const DocumentSpans& docs, int64_t window,
                                             float softcap) {
  run(OpFamily::kAttention, HostWaits::kNo, [=, this] {
    inner_->attention_forward(q, k, v, seg_start, out, lse, ws, docs, window, softcap);
  });
}
void ForwardingBackend::do_attention_backward(const Tensor& q, const Tensor& k, const Tensor& v,
                                              const Tensor& seg_start, const Tensor& out,
                                              const Tensor& lse, const Tensor& dout,
                                              const Tensor& dq, const Tensor& dk, const Tensor& dv,
                                              Workspace ws, const DocumentSpans& docs,
                                              int64_t window, float softcap) {
  run(OpFamily::kAttention, HostWaits::kNo, [=, this] {
    inner_->attention_backward(q, k, v, seg_start, out, lse, dout, dq, dk, dv, ws, docs, window,
                               softcap);
  });
}
void ForwardingBackend::do_attention_block_forward(const Tensor& q, const Tensor& k,
                                                   const Tensor& v, const Tensor& seg_start,
                                                   int64_t q_offset, int64_t k_offset,
                                                   const Tensor& out, const Tensor& lse,
                                                   Workspace ws, int64_t window, float softcap) {
  run(OpFamily::kAttention, HostWaits::kNo, [=, this] {
    inner_->attention_block_forward(q, k, v, seg_start, q_offset, k_offset, out, lse, ws, window,
                                    softcap);
  });
}
void ForwardingBackend::do_attention_block_backward(
    const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& seg_start, int64_t q_offset,
    int64_t k_offset, const Tensor& out, const Tensor& lse, const Tensor& dout, const Tensor& dq,
    const Tensor& dk, const Tensor& dv, Workspace ws, int64_t window, float softcap) {
  run(OpFamily::kAttention, HostWaits::kNo, [=, this] {
    inner_->attention_block_backward(q, k, v, seg_start, q_offset, k_offset, out, lse, dout, dq, dk,
                                     dv, ws, window, softcap);
  });
}
void ForwardingBackend::do_attention_merge(const Tensor& out, const Tensor& lse,
                                           const Tensor& out_b, const Tensor& lse_b) {
  run(OpFamily::kAttention, HostWaits::kNo,
      [=, this] { inner_->attention_merge(out, lse, out_b, lse_b); });
}
void ForwardingBackend::do_attention_decode(const Tensor& q, const Tensor& k_cache,
                                            const Tensor& v_cache, int64_t cache_len,
                                            const Tensor& out, Workspace ws, float softcap) {
  run(OpFamily::kAttention, HostWaits::kNo,
      [=, this] { inner_->attention_decode(q, k_cache, v_cache, cache_len, out, ws, softcap); });
}
LossResult ForwardingBackend::do_lm_head_loss(const Tensor& h, const Tensor& w,
                                              const Tensor& targets, int64_t chunk_tokens,
                                              float grad_scale, const Tensor& dh, const Tensor& dw,
                                              Workspace ws, float softcap) {
  LossResult loss;
  run(OpFamily::kLmHeadLoss, HostWaits::kYes, [&] {
    loss = inner_->lm_head_loss(h, w, targets, chunk_tokens, grad_scale, dh, dw, ws, softcap);
  });
  return loss;
}
void ForwardingBackend::do_xent_slice_max(const Tensor& logits, const Tensor& row_max,
                                          float softcap) {
  run(OpFamily::kLmHeadLoss, HostWaits::kNo,
      [=, this] { inner_->xent_slice_max(logits, row_max, softcap); });
}
void ForwardingBackend::do_xent_slice_stats(const Tensor& logits, const Tensor& targets,
                                            int64_t vocab_begin, int64_t vocab,
                                            const Tensor& row_max, const Tensor& stats,
                                            float softcap) {
  run(OpFamily::kLmHeadLoss, HostWaits::kNo, [=, this] {
    inner_->xent_slice_stats(logits, targets, vocab_begin, vocab, row_max, stats, softcap);
  });
}
void ForwardingBackend::do_xent_slice_fold(const Tensor& logits, const Tensor& targets,
                                           int64_t vocab_begin, int64_t vocab,
                                           const Tensor& row_max, const Tensor& stats, bool first,
                                           float softcap) {
  run(OpFamily::kLmHeadLoss, HostWaits::kNo, [=, this] {
    inner_->xent_slice_fold(logits, targets, vocab_begin, vocab, row_max, stats, first, softcap);
  });
}
void ForwardingBackend::do_xent_slice_finish(const Tensor& logits, const Tensor& targets,
                                             int64_t vocab_begin, const Tensor& row_max,
                                             const Tensor& stats, float grad_scale, bool want_grad,
                                             const Tensor& loss_acc, Workspace ws, float softcap) {
  // Adds into a device accumulator: nothing for the host to wait for.
  run(OpFamily::kLmHeadLoss, HostWaits::kNo, [=, this] {
    inner_->xent_slice_finish(logits, targets, vocab_begin, row_max, stats, grad_scale, want_grad,
                              loss_acc, ws, softcap);
  });
}
LossResult ForwardingBackend::do_read_loss(const Tensor& loss_acc) {
  LossResult loss;
  run(OpFamily::kLmHeadLoss, HostWaits::kYes, [&] { loss = inner_->read_loss(loss_acc); });
  return loss;
}
void ForwardingBackend::do_adamw_step(const Tensor& param, const Tensor& grad, const Tensor& m,
                                      const Tensor& v, const AdamWHyper& hyper) {
  run(OpFamily::kOptimizer, HostWaits::kNo,
      [=, this] { inner_->adamw_step(param, grad, m, v, hyper); });
}
void ForwardingBackend::do_adamw_step_segments(std::span<const AdamWSegment> segments,
                                               const AdamWHyper& hyper) {
  // The list is the caller's: a queued step keeps a copy.
  run(OpFamily::kOptimizer, HostWaits::kNo,
      [this, list = std::vector<AdamWSegment>(segments.begin(), segments.end()), hyper] {
        inner_->adamw_step_segments(list, hyper);
      });
}
void ForwardingBackend::do_segment_logp_sums(const Tensor& row_max, const Tensor& stats,
                                             const Tensor& segments, const Tensor& sums) {
  run(OpFamily::kLmHeadLoss, HostWaits::kNo,
      [=, this] { inner_->segment_logp_sums(row_max, stats, segments, sums); });
}
void ForwardingBackend::do_preference_coefficients(const PreferenceLossSpec& loss,
                                                   const Tensor& policy, const Tensor& reference,
                                                   double norm, const Tensor& coef,
                                                   const Tensor& metrics) {
  run(OpFamily::kLmHeadLoss, HostWaits::kNo,
      [=, this] { inner_->preference_coefficients(loss, policy, reference, norm, coef, metrics); });
}
void ForwardingBackend::do_gather_segment_weights(const Tensor& coef, const Tensor& segments,
                                                  const Tensor& weights) {
  run(OpFamily::kLmHeadLoss, HostWaits::kNo,
      [=, this] { inner_->gather_segment_weights(coef, segments, weights); });
}

}  // namespace shardlm
