// CPU kernels (OpenBLAS + OpenMP), one op family per .cpp file, each with its backward.
// Signatures and semantics are those of the Backend methods of the same name
// (include/shardlm/backend/backend.h); CpuBackend's do_<op> calls them once the entry point has
// checked the arguments' dtypes and shapes, so a kernel checks only what is its own: values it
// reads (ids, document starts) and the limits of its implementation. Storage is f32 or bf16
// (element.h; AdamW's state is f32); compute is f32 with f64 or f32 accumulation as each file
// states. No allocation here: scratch comes from the caller's Workspace, and the bf16 panels of
// the matrix products (linear, lm_head_loss) from the CpuBackend's fixed GemmScratch (gemm.h).
#pragma once

#include "kernels/cpu/gemm.h"
#include "shardlm/backend/backend.h"

namespace shardlm::cpu {

// elementwise.cpp
void zero(const Tensor& x);
void copy(const Tensor& src, const Tensor& dst);
void copy_blocks(const Tensor& src, const Tensor& dst, const BlockCopy& layout);
void convert(const Tensor& src, const Tensor& dst);
void add(const Tensor& a, const Tensor& b, const Tensor& out);
void scale(const Tensor& x, float s);
void scale_rows(const Tensor& x, const Tensor& s);
double sum_squares(const Tensor& x);

// dropout.cpp
void dropout(const Tensor& x, const Tensor& out, float p, uint64_t seed, int64_t first,
             int64_t width = 0, int64_t row_stride = 0);

// nf4.cpp
void nf4_dequantize(const Tensor& codes, const Tensor& absmax, const Tensor& out);

// linear.cpp
void linear_forward(const Tensor& x, const Tensor& w, const Tensor& b, const Tensor& y,
                    GemmScratch scratch, OutputMode y_mode = OutputMode::kOverwrite,
                    const Tensor& residual = Tensor());
void linear_backward(const Tensor& x, const Tensor& w, const Tensor& dy, const Tensor& dx,
                     const Tensor& dw, const Tensor& db, GemmScratch scratch,
                     OutputMode dx_mode = OutputMode::kOverwrite);

// embedding.cpp
void embedding_forward(const Tensor& tokens, const Tensor& table, const Tensor& out);
void embedding_backward(const Tensor& tokens, const Tensor& dout, const Tensor& dtable);
void embedding_forward_slice(const Tensor& tokens, const Tensor& table, int64_t vocab_begin,
                             int64_t vocab, const Tensor& out);
void embedding_backward_slice(const Tensor& tokens, const Tensor& dout, int64_t vocab_begin,
                              int64_t vocab, const Tensor& dtable);

// rmsnorm.cpp
void rmsnorm_forward(const Tensor& x, const Tensor& w, float eps, const Tensor& y,
                     const Tensor& rstd, float w_offset);
// residual [N, D] += x (rounded once), then y = rmsnorm(residual): add and rmsnorm_forward's bits
void add_rmsnorm_forward(const Tensor& x, const Tensor& residual, const Tensor& w, float eps,
                         const Tensor& y, const Tensor& rstd, float w_offset);
void rmsnorm_backward(const Tensor& x, const Tensor& w, const Tensor& rstd, const Tensor& dy,
                      const Tensor& dx, const Tensor& dw, float w_offset);

// rope.cpp
void rope_forward(const Tensor& x, const Tensor& positions, const Tensor& inv_freq,
                  RopePairs pairs = RopePairs::kHalf);
void rope_backward(const Tensor& dx, const Tensor& positions, const Tensor& inv_freq,
                   RopePairs pairs = RopePairs::kHalf);
void rope_qk_forward(const Tensor& q, const Tensor& k, const Tensor& positions,
                     const Tensor& inv_freq, RopePairs pairs = RopePairs::kHalf);
void rope_qk_backward(const Tensor& dq, const Tensor& dk, const Tensor& positions,
                      const Tensor& inv_freq, RopePairs pairs = RopePairs::kHalf);

// swiglu.cpp
void swiglu_forward(const Tensor& gate, const Tensor& up, const Tensor& h);
void swiglu_backward(const Tensor& gate, const Tensor& up, const Tensor& dh, const Tensor& dgate,
                     const Tensor& dup);
void geglu_forward(const Tensor& gate, const Tensor& up, const Tensor& h);
void geglu_backward(const Tensor& gate, const Tensor& up, const Tensor& dh, const Tensor& dgate,
                    const Tensor& dup);

// attention_forward.cpp, attention_backward.cpp (shared: attention_common.h)
size_t attention_workspace_bytes(int64_t B, int64_t T, int64_t Hq, int64_t Hkv, int64_t Dh);
// window: the sliding window in keys (0: none), as Backend::attention_forward.
void attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& seg_start,
                       const Tensor& out, const Tensor& lse, Workspace ws, int64_t window = 0,
                       float softcap = 0.0f);
void attention_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& seg_start,
                        const Tensor& out, const Tensor& lse, const Tensor& dout, const Tensor& dq,
                        const Tensor& dk, const Tensor& dv, Workspace ws, int64_t window = 0,
                        float softcap = 0.0f);
size_t attention_block_workspace_bytes(int64_t B, int64_t Tq, int64_t Tk, int64_t Hq, int64_t Hkv,
                                       int64_t Dh);
void attention_block_forward(const Tensor& q, const Tensor& k, const Tensor& v,
                             const Tensor& seg_start, int64_t q_offset, int64_t k_offset,
                             const Tensor& out, const Tensor& lse, Workspace ws, int64_t window = 0,
                             float softcap = 0.0f);
void attention_block_backward(const Tensor& q, const Tensor& k, const Tensor& v,
                              const Tensor& seg_start, int64_t q_offset, int64_t k_offset,
                              const Tensor& out, const Tensor& lse, const Tensor& dout,
                              const Tensor& dq, const Tensor& dk, const Tensor& dv, Workspace ws,
                              int64_t window = 0, float softcap = 0.0f);

// attention_merge.cpp
void attention_merge(const Tensor& out, const Tensor& lse, const Tensor& out_b,
                     const Tensor& lse_b);

// attention_decode.cpp
size_t attention_decode_workspace_bytes(int64_t B, int64_t Tq, int64_t Tmax, int64_t Hq,
                                        int64_t Dh);
void attention_decode(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                      int64_t cache_len, const Tensor& out, Workspace ws, float softcap = 0.0f);

// lm_head_loss.cpp (softcap: the final-logit soft cap, 0 none, as Backend::lm_head_loss)
size_t lm_head_loss_workspace_bytes(int64_t chunk_tokens, int64_t V);
LossResult lm_head_loss(const Tensor& h, const Tensor& w, const Tensor& targets,
                        int64_t chunk_tokens, float grad_scale, const Tensor& dh, const Tensor& dw,
                        Workspace ws, GemmScratch scratch, float softcap = 0.0f);

// xent_slice.cpp (softcap: as Backend's xent_slice_*)
void xent_slice_max(const Tensor& logits, const Tensor& row_max, float softcap = 0.0f);
void xent_slice_stats(const Tensor& logits, const Tensor& targets, int64_t vocab_begin,
                      int64_t vocab, const Tensor& row_max, const Tensor& stats,
                      float softcap = 0.0f);
void xent_slice_fold(const Tensor& logits, const Tensor& targets, int64_t vocab_begin,
                     int64_t vocab, const Tensor& row_max, const Tensor& stats, bool first,
                     float softcap = 0.0f);
LossResult xent_slice_finish(const Tensor& logits, const Tensor& targets, int64_t vocab_begin,
                             const Tensor& row_max, const Tensor& stats, float grad_scale,
                             bool want_grad, float softcap = 0.0f);

// adamw.cpp
void adamw_step(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v,
                const AdamWHyper& hyper);
void adamw_step_segments(std::span<const AdamWSegment> segments, const AdamWHyper& hyper);

// preference.cpp (compiled without floating-point contraction, as src/train/preference.cpp is:
// the trainer's host code gets the same bits from the same per-pair math, preference_loss.h)
void segment_logp_sums(const Tensor& row_max, const Tensor& stats, const Tensor& segments,
                       const Tensor& sums);
void preference_coefficients(const PreferenceLossSpec& loss, const Tensor& policy,
                             const Tensor& reference, double norm, const Tensor& coef,
                             const Tensor& metrics);
void gather_segment_weights(const Tensor& coef, const Tensor& segments, const Tensor& weights);

}  // namespace shardlm::cpu
