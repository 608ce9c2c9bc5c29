// ForwardingBackend: the base of the Backend decorators (ProfilingBackend, QueuedBackend). It
// forwards every op to an inner backend's entry point through one hook, run(), which a
// decorator implements once: timing each op, or queueing it. The op families, which the
// profile reports, are named here.
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "shardlm/backend/backend.h"

namespace shardlm {

enum class OpFamily : uint8_t {
  kLinear,
  kAttention,
  kLmHeadLoss,
  kNorm,
  kRope,
  kSwiglu,
  kEmbedding,
  kOptimizer,
  kElementwise,
};
inline constexpr int kNumOpFamilies = 9;
std::string_view op_family_name(OpFamily f);

// Whether the host needs an op finished when its call returns: it returns a result (a sum, a
// loss), reads or writes host memory (a copy, a conversion or a block copy with a host-pool
// side), or checks ids (embedding, xent_slice_stats and _fold: the inner backend may raise a
// data error from the op itself, the CPU backend always does), so that the error comes from
// the caller's call.
enum class HostWaits : bool { kNo, kYes };

class ForwardingBackend : public Backend {
 public:
  explicit ForwardingBackend(std::unique_ptr<Backend> inner) : inner_(std::move(inner)) {}

  // Everything that is not an op goes to the inner backend unchanged unless a decorator says
  // otherwise (a queue of its own, its own fences).
  int workspace_threads() const override { return inner_->workspace_threads(); }
  void synchronize() override { inner_->synchronize(); }
  int64_t host_waits() const override { return inner_->host_waits(); }
  DType peak_gemm_dtype(DType activation_dtype) const override {
    return inner_->peak_gemm_dtype(activation_dtype);
  }
  void* device_stream() override { return inner_->device_stream(); }
  void deallocate(void* p, size_t bytes, MemPool pool) override {
    inner_->deallocate(p, bytes, pool);
  }
  void wait_fence(uint64_t fence) override { inner_->wait_fence(fence); }
  void host_wait_fence(uint64_t fence) override { inner_->host_wait_fence(fence); }
  uint64_t mark() override { return inner_->mark(); }
  double seconds_between(uint64_t a, uint64_t b) override { return inner_->seconds_between(a, b); }
  DriverDeviceBytes driver_device_bytes() const override { return inner_->driver_device_bytes(); }
  std::string select_attention(std::string_view impl) override {
    return inner_->select_attention(impl);
  }
  void* allocate(size_t bytes, MemPool pool) override { return inner_->allocate(bytes, pool); }
  size_t attention_workspace_bytes(int64_t B, int64_t T, int64_t Hq, int64_t Hkv,
                                   int64_t Dh) const override {
    return inner_->attention_workspace_bytes(B, T, Hq, Hkv, Dh);
  }
  size_t attention_block_workspace_bytes(int64_t B, int64_t Tq, int64_t Tk, int64_t Hq, int64_t Hkv,
                                         int64_t Dh) const override {
    return inner_->attention_block_workspace_bytes(B, Tq, Tk, Hq, Hkv, Dh);
  }
  size_t attention_plan_workspace_bytes(int64_t B, int64_t T, int64_t Hq, int64_t Hkv, int64_t Dh,
                                        std::span<const int64_t> windows) const override {
    return inner_->attention_plan_workspace_bytes(B, T, Hq, Hkv, Dh, windows);
  }
  size_t attention_block_plan_workspace_bytes(int64_t B, int64_t Tq, int64_t Tk, int64_t Hq,
                                              int64_t Hkv, int64_t Dh,
                                              std::span<const int64_t> windows) const override {
    return inner_->attention_block_plan_workspace_bytes(B, Tq, Tk, Hq, Hkv, Dh, windows);
  }
  size_t attention_decode_workspace_bytes(int64_t B, int64_t Tq, int64_t Tmax, int64_t Hq,
                                          int64_t Dh) const override {
    return inner_->attention_decode_workspace_bytes(B, Tq, Tmax, Hq, Dh);
  }
  size_t xent_slice_workspace_bytes(int64_t n) const override {
    return inner_->xent_slice_workspace_bytes(n);
  }

 protected:
  // Runs `op`, one call of inner()'s entry point with its arguments captured by value (a
  // queued op may run after the caller's references are gone). waits == kYes: `op` has run
  // when this returns (it may capture the caller's result by reference).
  virtual void run(OpFamily family, HostWaits waits, std::function<void()> op) = 0;
  Backend& inner() const { return *inner_; }

 private:
  // Each forwards to the inner backend's entry point (which checks again: it cannot reach the
  // inner do_<op>, and the checks cost nothing next to an op).
  void do_zero(const Tensor& x) override;
  void do_copy(const Tensor& src, const Tensor& dst) override;
  // The inner backend's copy stream and fences, not run(): a decorator that keeps its own
  // queue overrides it.
  uint64_t do_copy_async(const Tensor& src, const Tensor& dst) override {
    return inner_->copy_async(src, dst);
  }
  void do_copy_blocks(const Tensor& src, const Tensor& dst, const BlockCopy& layout) override;
  void do_convert(const Tensor& src, const Tensor& dst) override;
  void do_add(const Tensor& a, const Tensor& b, const Tensor& out) override;
  void do_scale(const Tensor& x, float s) override;
  void do_scale_rows(const Tensor& x, const Tensor& s) override;
  void do_dropout(const Tensor& x, const Tensor& out, float p, uint64_t seed, int64_t first,
                  int64_t width, int64_t row_stride) override;
  double do_sum_squares(const Tensor& x) override;
  void do_sum_squares_segments(std::span<const Tensor> xs, std::span<double> sums) override;
  void do_nf4_dequantize(const Tensor& codes, const Tensor& absmax, const Tensor& out) override;
  void do_linear_forward(const Tensor& x, const Tensor& w, const Tensor& b, const Tensor& y,
                         OutputMode y_mode, const Tensor& residual) override;
  void do_linear_backward(const Tensor& x, const Tensor& w, const Tensor& dy, const Tensor& dx,
                          const Tensor& dw, const Tensor& db, OutputMode dx_mode) override;
  void do_embedding_forward(const Tensor& tokens, const Tensor& table, const Tensor& out) override;
  void do_embedding_backward(const Tensor& tokens, const Tensor& dout,
                             const Tensor& dtable) override;
  void do_embedding_forward_slice(const Tensor& tokens, const Tensor& table, int64_t vocab_begin,
                                  int64_t vocab, const Tensor& out) override;
  void do_embedding_backward_slice(const Tensor& tokens, const Tensor& dout, int64_t vocab_begin,
                                   int64_t vocab, const Tensor& dtable) override;
  void do_rmsnorm_forward(const Tensor& x, const Tensor& w, float eps, const Tensor& y,
                          const Tensor& rstd, float w_offset) override;
  void do_add_rmsnorm_forward(const Tensor& x, const Tensor& residual, const Tensor& w, float eps,
                              const Tensor& y, const Tensor& rstd, float w_offset) override;
  void do_rmsnorm_backward(const Tensor& x, const Tensor& w, const Tensor& rstd, const Tensor& dy,
                           const Tensor& dx, const Tensor& dw, float w_offset) override;
  void do_rope_forward(const Tensor& x, const Tensor& positions, const Tensor& inv_freq,
                       RopePairs pairs) override;
  void do_rope_backward(const Tensor& dx, const Tensor& positions, const Tensor& inv_freq,
                        RopePairs pairs) override;
  void do_rope_qk_forward(const Tensor& q, const Tensor& k, const Tensor& positions,
                          const Tensor& inv_freq, RopePairs pairs) override;
  void do_rope_qk_backward(const Tensor& dq, const Tensor& dk, const Tensor& positions,
                           const Tensor& inv_freq, RopePairs pairs) override;
  void do_swiglu_forward(const Tensor& gate, const Tensor& up, const Tensor& h) override;
  void do_swiglu_backward(const Tensor& gate, const Tensor& up, const Tensor& dh,
                          const Tensor& dgate, const Tensor& dup) override;
  void do_geglu_forward(const Tensor& gate, const Tensor& up, const Tensor& h) override;
  void do_geglu_backward(const Tensor& gate, const Tensor& up, const Tensor& dh,
                         const Tensor& dgate, const Tensor& dup) override;
  void do_attention_forward(const Tensor& q, const Tensor& k, const Tensor& v,
                            const Tensor& seg_start, const Tensor& out, const Tensor& lse,
                            Workspace ws, const DocumentSpans& docs, int64_t window,
                            float softcap) override;
  void do_attention_backward(const Tensor& q, const Tensor& k, const Tensor& v,
                             const Tensor& seg_start, const Tensor& out, const Tensor& lse,
                             const Tensor& dout, const Tensor& dq, const Tensor& dk,
                             const Tensor& dv, Workspace ws, const DocumentSpans& docs,
                             int64_t window, float softcap) override;
  void do_attention_block_forward(const Tensor& q, const Tensor& k, const Tensor& v,
                                  const Tensor& seg_start, int64_t q_offset, int64_t k_offset,
                                  const Tensor& out, const Tensor& lse, Workspace ws,
                                  int64_t window, float softcap) override;
  void do_attention_block_backward(const Tensor& q, const Tensor& k, const Tensor& v,
                                   const Tensor& seg_start, int64_t q_offset, int64_t k_offset,
                                   const Tensor& out, const Tensor& lse, const Tensor& dout,
                                   const Tensor& dq, const Tensor& dk, const Tensor& dv,
                                   Workspace ws, int64_t window, float softcap) override;
  void do_attention_merge(const Tensor& out, const Tensor& lse, const Tensor& out_b,
                          const Tensor& lse_b) override;
  void do_attention_decode(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                           int64_t cache_len, const Tensor& out, Workspace ws,
                           float softcap) override;
  size_t do_lm_head_loss_workspace_bytes(int64_t chunk_tokens, int64_t V, DType t) const override {
    return inner_->lm_head_loss_workspace_bytes(chunk_tokens, V, t);
  }
  LossResult do_lm_head_loss(const Tensor& h, const Tensor& w, const Tensor& targets,
                             int64_t chunk_tokens, float grad_scale, const Tensor& dh,
                             const Tensor& dw, Workspace ws, float softcap) override;
  void do_xent_slice_max(const Tensor& logits, const Tensor& row_max, float softcap) override;
  void do_xent_slice_stats(const Tensor& logits, const Tensor& targets, int64_t vocab_begin,
                           int64_t vocab, const Tensor& row_max, const Tensor& stats,
                           float softcap) override;
  void do_xent_slice_fold(const Tensor& logits, const Tensor& targets, int64_t vocab_begin,
                          int64_t vocab, const Tensor& row_max, const Tensor& stats, bool first,
                          float softcap) override;
  void do_xent_slice_finish(const Tensor& logits, const Tensor& targets, int64_t vocab_begin,
                            const Tensor& row_max, const Tensor& stats, float grad_scale,
                            bool want_grad, const Tensor& loss_acc, Workspace ws,
                            float softcap) override;
  LossResult do_read_loss(const Tensor& loss_acc) override;
  void do_adamw_step(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v,
                     const AdamWHyper& hyper) override;
  void do_adamw_step_segments(std::span<const AdamWSegment> segments,
                              const AdamWHyper& hyper) override;
  // The preference ops: no result, no host memory, so queued (kNo) like any compute.
  void do_segment_logp_sums(const Tensor& row_max, const Tensor& stats, const Tensor& segments,
                            const Tensor& sums) override;
  void do_preference_coefficients(const PreferenceLossSpec& loss, const Tensor& policy,
                                  const Tensor& reference, double norm, const Tensor& coef,
                                  const Tensor& metrics) override;
  void do_gather_segment_weights(const Tensor& coef, const Tensor& segments,
                                 const Tensor& weights) override;

  std::unique_ptr<Backend> inner_;
};

}  // namespace shardlm
