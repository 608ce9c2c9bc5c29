// CpuBackend: Backend implementation for the CPU (OpenBLAS + OpenMP kernels of ops.h).
#pragma once

#include <vector>

#include "kernels/cpu/gemm.h"
#include "shardlm/backend/backend.h"

namespace shardlm::cpu {

class CpuBackend final : public Backend {
 public:
  // The f32 panels that linear_forward, linear_backward and lm_head_loss convert their bf16
  // operands into (OpenBLAS has no bf16 GEMM here; gemm.h): allocated once by the constructor,
  // a constant size whatever the shapes, so that no op allocates. It is the CPU backend's fixed
  // overhead outside the memory ledger, as cuBLASLt's workspace is on CUDA. The ops of one
  // CpuBackend run one at a time (one compute thread), so one scratch serves them all.
  static constexpr size_t kGemmScratchBytes = kGemmScratchFloats * sizeof(float);
  static_assert(kGemmScratchBytes <= (size_t{4} << 20), "the fixed GEMM scratch is a few MiB");

  CpuBackend();
  std::string name() const override { return "cpu"; }
  int workspace_threads() const override;
  void* allocate(size_t bytes, MemPool pool) override;
  void deallocate(void* ptr, size_t bytes, MemPool pool) override;

  size_t attention_workspace_bytes(int64_t B, int64_t T, int64_t Hq, int64_t Hkv,
                                   int64_t Dh) const override;
  size_t attention_block_workspace_bytes(int64_t B, int64_t Tq, int64_t Tk, int64_t Hq, int64_t Hkv,
                                         int64_t Dh) const override;
  size_t attention_decode_workspace_bytes(int64_t B, int64_t Tq, int64_t Tmax, int64_t Hq,
                                          int64_t Dh) const override;

 private:
  void do_zero(const Tensor& x) override;
  void do_copy(const Tensor& src, const Tensor& dst) override;
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
  size_t do_lm_head_loss_workspace_bytes(int64_t chunk_tokens, int64_t V, DType t) const override;
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
  void do_segment_logp_sums(const Tensor& row_max, const Tensor& stats, const Tensor& segments,
                            const Tensor& sums) override;
  void do_preference_coefficients(const PreferenceLossSpec& loss, const Tensor& policy,
                                  const Tensor& reference, double norm, const Tensor& coef,
                                  const Tensor& metrics) override;
  void do_gather_segment_weights(const Tensor& coef, const Tensor& segments,
                                 const Tensor& weights) override;

  GemmScratch gemm_scratch() { return {gemm_scratch_.data(), gemm_scratch_.size()}; }

  std::vector<float> gemm_scratch_;  // kGemmScratchBytes
};

}  // namespace shardlm::cpu
