// ProfilingBackend: times each forwarded op into its family's total.
#include "shardlm/backend/profiling.h"

#include <chrono>

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

template <typename F>
auto ProfilingBackend::timed(OpFamily f, F&& fn) {
  struct Scope {
    ProfilingBackend* self;
    int i;
    std::chrono::steady_clock::time_point t0 = std::chrono::steady_clock::now();
    ~Scope() {
      self->inner_->synchronize();  // a queued op's time is its execution, not its launch
      self->seconds_[i] +=
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      ++self->calls_[i];
    }
  } scope{this, static_cast<int>(f)};
  return fn();
}

void ProfilingBackend::do_zero(const Tensor& x) {
  timed(OpFamily::kElementwise, [&] { inner_->zero(x); });
}
void ProfilingBackend::do_copy(const Tensor& src, const Tensor& dst) {
  timed(OpFamily::kElementwise, [&] { inner_->copy(src, dst); });
}
void ProfilingBackend::do_copy_blocks(const Tensor& src, const Tensor& dst,
                                      const BlockCopy& layout) {
  timed(OpFamily::kElementwise, [&] { inner_->copy_blocks(src, dst, layout); });
}
uint64_t ProfilingBackend::do_copy_async(const Tensor& src, const Tensor& dst) {
  return timed(OpFamily::kElementwise, [&] { return inner_->copy_async(src, dst); });
}
void ProfilingBackend::do_convert(const Tensor& src, const Tensor& dst) {
  timed(OpFamily::kElementwise, [&] { inner_->convert(src, dst); });
}
void ProfilingBackend::do_add(const Tensor& a, const Tensor& b, const Tensor& out) {
  timed(OpFamily::kElementwise, [&] { inner_->add(a, b, out); });
}
void ProfilingBackend::do_dropout(const Tensor& x, const Tensor& out, float p, uint64_t seed,
                                  int64_t first, int64_t width, int64_t row_stride) {
  const bool whole = width == x.numel() && row_stride == width;
  timed(OpFamily::kElementwise,
        [&] { inner_->dropout(x, out, p, seed, first, whole ? 0 : row_stride); });
}

void ProfilingBackend::do_scale(const Tensor& x, float s) {
  timed(OpFamily::kElementwise, [&] { inner_->scale(x, s); });
}
double ProfilingBackend::do_sum_squares(const Tensor& x) {
  return timed(OpFamily::kOptimizer, [&] { return inner_->sum_squares(x); });
}
void ProfilingBackend::do_sum_squares_segments(std::span<const Tensor> xs, std::span<double> sums) {
  timed(OpFamily::kOptimizer, [&] { inner_->sum_squares_segments(xs, sums); });
}
// The base's dequantization is part of its projections' cost.
void ProfilingBackend::do_nf4_dequantize(const Tensor& codes, const Tensor& absmax,
                                         const Tensor& out) {
  timed(OpFamily::kLinear, [&] { inner_->nf4_dequantize(codes, absmax, out); });
}
void ProfilingBackend::do_linear_forward(const Tensor& x, const Tensor& w, const Tensor& b,
                                         const Tensor& y, OutputMode y_mode,
                                         const Tensor& residual) {
  timed(OpFamily::kLinear, [&] { inner_->linear_forward(x, w, b, y, y_mode, residual); });
}
void ProfilingBackend::do_linear_backward(const Tensor& x, const Tensor& w, const Tensor& dy,
                                          const Tensor& dx, const Tensor& dw, const Tensor& db,
                                          OutputMode dx_mode) {
  timed(OpFamily::kLinear, [&] { inner_->linear_backward(x, w, dy, dx, dw, db, dx_mode); });
}
void ProfilingBackend::do_embedding_forward(const Tensor& tokens, const Tensor& table,
                                            const Tensor& out) {
  timed(OpFamily::kEmbedding, [&] { inner_->embedding_forward(tokens, table, out); });
}
void ProfilingBackend::do_embedding_backward(const Tensor& tokens, const Tensor& dout,
                                             const Tensor& dtable) {
  timed(OpFamily::kEmbedding, [&] { inner_->embedding_backward(tokens, dout, dtable); });
}
void ProfilingBackend::do_embedding_forward_slice(const Tensor& tokens, const Tensor& table,
                                                  int64_t vocab_begin, int64_t vocab,
                                                  const Tensor& out) {
  timed(OpFamily::kEmbedding,
        [&] { inner_->embedding_forward_slice(tokens, table, vocab_begin, vocab, out); });
}
void ProfilingBackend::do_embedding_backward_slice(const Tensor& tokens, const Tensor& dout,
                                                   int64_t vocab_begin, int64_t vocab,
                                                   const Tensor& dtable) {
  timed(OpFamily::kEmbedding,
        [&] { inner_->embedding_backward_slice(tokens, dout, vocab_begin, vocab, dtable); });
}
void ProfilingBackend::do_rmsnorm_forward(const Tensor& x, const Tensor& w, float eps,
                                          const Tensor& y, const Tensor& rstd, float w_offset) {
  timed(OpFamily::kNorm, [&] { inner_->rmsnorm_forward(x, w, eps, y, rstd, w_offset); });
}
void ProfilingBackend::do_rmsnorm_backward(const Tensor& x, const Tensor& w, const Tensor& rstd,
                                           const Tensor& dy, const Tensor& dx, const Tensor& dw,
                                           float w_offset) {
  timed(OpFamily::kNorm, [&] { inner_->rmsnorm_backward(x, w, rstd, dy, dx, dw, w_offset); });
}
void ProfilingBackend::do_rope_forward(const Tensor& x, const Tensor& positions,
                                       const Tensor& inv_freq) {
  timed(OpFamily::kRope, [&] { inner_->rope_forward(x, positions, inv_freq); });
}
void ProfilingBackend::do_rope_backward(const Tensor& dx, const Tensor& positions,
                                        const Tensor& inv_freq) {
  timed(OpFamily::kRope, [&] { inner_->rope_backward(dx, positions, inv_freq); });
}
void ProfilingBackend::do_rope_qk_forward(const Tensor& q, const Tensor& k, const Tensor& positions,
                                          const Tensor& inv_freq) {
  timed(OpFamily::kRope, [&] { inner_->rope_qk_forward(q, k, positions, inv_freq); });
}
void ProfilingBackend::do_rope_qk_backward(const Tensor& dq, const Tensor& dk,
                                           const Tensor& positions, const Tensor& inv_freq) {
  timed(OpFamily::kRope, [&] { inner_->rope_qk_backward(dq, dk, positions, inv_freq); });
}
void ProfilingBackend::do_swiglu_forward(const Tensor& gate, const Tensor& up, const Tensor& h) {
  timed(OpFamily::kSwiglu, [&] { inner_->swiglu_forward(gate, up, h); });
}
void ProfilingBackend::do_swiglu_backward(const Tensor& gate, const Tensor& up, const Tensor& dh,
                                          const Tensor& dgate, const Tensor& dup) {
  timed(OpFamily::kSwiglu, [&] { inner_->swiglu_backward(gate, up, dh, dgate, dup); });
}
void ProfilingBackend::do_geglu_forward(const Tensor& gate, const Tensor& up, const Tensor& h) {
  timed(OpFamily::kSwiglu, [&] { inner_->geglu_forward(gate, up, h); });
}
void ProfilingBackend::do_geglu_backward(const Tensor& gate, const Tensor& up, const Tensor& dh,
                                         const Tensor& dgate, const Tensor& dup) {
  timed(OpFamily::kSwiglu, [&] { inner_->geglu_backward(gate, up, dh, dgate, dup); });
}
void ProfilingBackend::do_attention_forward(const Tensor& q, const Tensor& k, const Tensor& v,
                                            const Tensor& seg_start, const Tensor& out,
                                            const Tensor& lse, Workspace ws,
                                            const DocumentSpans& docs, int64_t window,
                                            float softcap) {
  timed(OpFamily::kAttention, [&] {
    inner_->attention_forward(q, k, v, seg_start, out, lse, ws, docs, window, softcap);
  });
}
void ProfilingBackend::do_attention_backward(const Tensor& q, const Tensor& k, const Tensor& v,
                                             const Tensor& seg_start, const Tensor& out,
                                             const Tensor& lse, const Tensor& dout,
                                             const Tensor& dq, const Tensor& dk, const Tensor& dv,
                                             Workspace ws, const DocumentSpans& docs,
                                             int64_t window, float softcap) {
  timed(OpFamily::kAttention, [&] {
    inner_->attention_backward(q, k, v, seg_start, out, lse, dout, dq, dk, dv, ws, docs, window,
                               softcap);
  });
}
void ProfilingBackend::do_attention_block_forward(const Tensor& q, const Tensor& k, const Tensor& v,
                                                  const Tensor& seg_start, int64_t q_offset,
                                                  int64_t k_offset, const Tensor& out,
                                                  const Tensor& lse, Workspace ws, int64_t window,
                                                  float softcap) {
  timed(OpFamily::kAttention, [&] {
    inner_->attention_block_forward(q, k, v, seg_start, q_offset, k_offset, out, lse, ws, window,
                                    softcap);
  });
}
void ProfilingBackend::do_attention_block_backward(
    const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& seg_start, int64_t q_offset,
    int64_t k_offset, const Tensor& out, const Tensor& lse, const Tensor& dout, const Tensor& dq,
    const Tensor& dk, const Tensor& dv, Workspace ws, int64_t window, float softcap) {
  timed(OpFamily::kAttention, [&] {
    inner_->attention_block_backward(q, k, v, seg_start, q_offset, k_offset, out, lse, dout, dq, dk,
                                     dv, ws, window, softcap);
  });
}
void ProfilingBackend::do_attention_merge(const Tensor& out, const Tensor& lse, const Tensor& out_b,
                                          const Tensor& lse_b) {
  timed(OpFamily::kAttention, [&] { inner_->attention_merge(out, lse, out_b, lse_b); });
}
void ProfilingBackend::do_attention_decode(const Tensor& q, const Tensor& k_cache,
                                           const Tensor& v_cache, int64_t cache_len,
                                           const Tensor& out, Workspace ws, float softcap) {
  timed(OpFamily::kAttention,
        [&] { inner_->attention_decode(q, k_cache, v_cache, cache_len, out, ws, softcap); });
}
LossResult ProfilingBackend::do_lm_head_loss(const Tensor& h, const Tensor& w,
                                             const Tensor& targets, int64_t chunk_tokens,
                                             float grad_scale, const Tensor& dh, const Tensor& dw,
                                             Workspace ws, float softcap) {
  return timed(OpFamily::kLmHeadLoss, [&] {
    return inner_->lm_head_loss(h, w, targets, chunk_tokens, grad_scale, dh, dw, ws, softcap);
  });
}
void ProfilingBackend::do_xent_slice_max(const Tensor& logits, const Tensor& row_max,
                                         float softcap) {
  timed(OpFamily::kLmHeadLoss, [&] { inner_->xent_slice_max(logits, row_max, softcap); });
}
void ProfilingBackend::do_xent_slice_stats(const Tensor& logits, const Tensor& targets,
                                           int64_t vocab_begin, int64_t vocab,
                                           const Tensor& row_max, const Tensor& stats,
                                           float softcap) {
  timed(OpFamily::kLmHeadLoss, [&] {
    inner_->xent_slice_stats(logits, targets, vocab_begin, vocab, row_max, stats, softcap);
  });
}
void ProfilingBackend::do_xent_slice_fold(const Tensor& logits, const Tensor& targets,
                                          int64_t vocab_begin, int64_t vocab, const Tensor& row_max,
                                          const Tensor& stats, bool first, float softcap) {
  timed(OpFamily::kLmHeadLoss, [&] {
    inner_->xent_slice_fold(logits, targets, vocab_begin, vocab, row_max, stats, first, softcap);
  });
}
LossResult ProfilingBackend::do_xent_slice_finish(const Tensor& logits, const Tensor& targets,
                                                  int64_t vocab_begin, const Tensor& row_max,
                                                  const Tensor& stats, float grad_scale,
                                                  bool want_grad, Workspace ws, float softcap) {
  return timed(OpFamily::kLmHeadLoss, [&] {
    return inner_->xent_slice_finish(logits, targets, vocab_begin, row_max, stats, grad_scale,
                                     want_grad, ws, softcap);
  });
}
void ProfilingBackend::do_adamw_step(const Tensor& param, const Tensor& grad, const Tensor& m,
                                     const Tensor& v, const AdamWHyper& hyper) {
  timed(OpFamily::kOptimizer, [&] { inner_->adamw_step(param, grad, m, v, hyper); });
}
void ProfilingBackend::do_adamw_step_segments(std::span<const AdamWSegment> segments,
                                              const AdamWHyper& hyper) {
  timed(OpFamily::kOptimizer, [&] { inner_->adamw_step_segments(segments, hyper); });
}

}  // namespace shardlm
