// The launchers of the CUDA kernels: plain pointers, extents and a stream, so that the .cu
// files see no engine header (they compile with nvcc alone) and every shape and dtype check
// lives in the C++ side (cuda_backend.cpp), which reports errors the way the CPU backend does.
// Every launcher enqueues on `stream` and returns cudaGetLastError(); none synchronises.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace shardlm::cuda {

// Element type of a floating-point tensor argument; parameter gradients, lse, rstd and the
// optimizer's tensors are always f32.
enum class Elem : int { kF32 = 0, kBF16 = 1 };

// ---- elementwise ---------------------------------------------------------------------------
// Backend::copy_blocks on raw bytes: n[0] x n[1] x n[2] blocks of block_bytes, block (i, j, l)
// from src + i * src_stride[0] + j * src_stride[1] + l * src_stride[2] (bytes) to dst likewise.
// Both sides in device memory. Moves the widest word
// (16 bytes down to 1) that every pointer, block and stride is a multiple of.
cudaError_t launch_copy_blocks(const void* src, void* dst, const int64_t (&n)[3],
                               int64_t block_bytes, const int64_t (&src_stride)[3],
                               const int64_t (&dst_stride)[3], cudaStream_t s);
cudaError_t launch_convert(const void* src, Elem src_t, void* dst, Elem dst_t, int64_t n,
                           cudaStream_t s);
cudaError_t launch_add(const void* a, const void* b, void* out, Elem t, int64_t n, cudaStream_t s);
cudaError_t launch_scale(void* x, Elem t, float factor, int64_t n, cudaStream_t s);
// x [rows, cols] row r times factors[r] (f32)
cudaError_t launch_scale_rows(void* x, Elem t, const float* factors, int64_t rows, int64_t cols,
                              cudaStream_t s);
// out [n] of type t = NF4 code * absmax (quant/nf4.h's layout): codes [ceil(n/2)] bytes,
// absmax [ceil(n/64)] f32, all on the device.
cudaError_t launch_nf4_dequantize(const void* codes, const float* absmax, void* out, Elem t,
                                  int64_t n, cudaStream_t s);
// out[i] = x[i] / (1 - p) where element first + (i / width) * row_stride + i % width is kept,
// else 0: the CPU backend's counter-based mask (SplitMix64 of (seed, that element)), bit for
// bit. x, out [n] of type t (may alias); width = row_stride = n for a whole tensor.
cudaError_t launch_dropout(const void* x, void* out, Elem t, int64_t n, float p, uint64_t seed,
                           int64_t first, int64_t width, int64_t row_stride, cudaStream_t s);
// Deterministic two-pass f64 sum of squares: per-block partials (at most kSumBlocks) into
// `partials`, then one block adds them in order into *result (device).
inline constexpr int kSumBlocks = 1024;
cudaError_t launch_sum_squares(const void* x, Elem t, int64_t n, double* partials, double* result,
                               cudaStream_t s);
cudaError_t launch_swiglu_forward(const void* gate, const void* up, void* h, Elem t, int64_t n,
                                  cudaStream_t s);
cudaError_t launch_swiglu_backward(const void* gate, const void* up, const void* dh, void* dgate,
                                   void* dup, Elem t, int64_t n, cudaStream_t s);
// h = gelu_tanh(gate) * up, and its backward (elementwise.cu).
cudaError_t launch_geglu_forward(const void* gate, const void* up, void* h, Elem t, int64_t n,
                                 cudaStream_t s);
cudaError_t launch_geglu_backward(const void* gate, const void* up, const void* dh, void* dgate,
                                  void* dup, Elem t, int64_t n, cudaStream_t s);
// A rope launch's shape: N tokens of heads Dh wide whose first 2 * freqs dims rotate, in pairs
// (i, i + freqs) or, interleaved, (2i, 2i + 1).
struct RopeDims {
  int64_t N, Dh, freqs;
  bool interleaved;
};
// q [N, Hq, Dh] and k [N, Hk, Dh] (k null when Hk = 0) rotated in place by one launch with the
// same angles (norm_rope.cu); inv_freq [freqs]; direction +1 forward, -1 backward.
cudaError_t launch_rope(void* q, int64_t Hq, void* k, int64_t Hk, Elem t, const int32_t* positions,
                        const float* inv_freq, RopeDims dims, float direction, cudaStream_t s);
// *bad = min(*bad, the first id outside [0, V) (and not -1 when allow_ignore)): its index in
// the high 32 bits (clamped to 2^32 - 2), its value in the low 32. *bad is not reset first: the
// word keeps the first bad id over several launches (kNoBadId before the first, and while every
// id is valid), for a check read later with another result.
inline constexpr uint64_t kNoBadId = ~uint64_t(0);
cudaError_t launch_flag_ids(const int32_t* ids, int64_t n, int64_t V, bool allow_ignore,
                            uint64_t* bad, cudaStream_t s);
// table [rows, D] holds ids [vocab_begin, vocab_begin + rows) (the whole table: 0, V); ids
// outside it give zero rows (the vocabulary-parallel embedding).
cudaError_t launch_embedding_forward(const int32_t* tokens, const void* table, void* out, Elem t,
                                     int64_t N, int64_t D, int64_t vocab_begin, int64_t rows,
                                     cudaStream_t s);
// dtable [rows, D] f32 accumulates the ids it holds (atomic adds: summation order across
// repeated tokens is not fixed); the others are skipped.
cudaError_t launch_embedding_backward(const int32_t* tokens, const void* dout, Elem t,
                                      float* dtable, int64_t N, int64_t D, int64_t vocab_begin,
                                      int64_t rows, cudaStream_t s);
// y = x * rstd * (w_offset + w).
cudaError_t launch_rmsnorm_forward(const void* x, const void* w, float w_offset, Elem t, float eps,
                                   void* y, float* rstd, int64_t N, int64_t D, cudaStream_t s);
// residual [N, D] += x (rounded once), then y and rstd of the sum as launch_rmsnorm_forward.
cudaError_t launch_add_rmsnorm_forward(const void* x, void* residual, const void* w, float w_offset,
                                       Elem t, float eps, void* y, float* rstd, int64_t N,
                                       int64_t D, cudaStream_t s);
// dx accumulates (same dtype as x); dw f32 accumulates.
cudaError_t launch_rmsnorm_backward(const void* x, const void* w, float w_offset, Elem t,
                                    const float* rstd, const void* dy, void* dx, float* dw,
                                    int64_t N, int64_t D, cudaStream_t s);
// db [out] f32 += column sums of dy [N, out].
cudaError_t launch_column_sum(const void* dy, Elem t, float* db, int64_t N, int64_t cols,
                              cudaStream_t s);

// ---- AdamW (adamw.cu) --------------------------------------------------------------------------
// The step's constants, shared by every segment (the CPU kernel's, computed in f64 on the host).
struct AdamWConstants {
  float beta1, beta2, one_minus_beta1, one_minus_beta2;
  float step_size;     // lr / (1 - beta1^step)
  float inv_sqrt_bc2;  // 1 / sqrt(1 - beta2^step)
  float eps, grad_scale;
};
// p, m, v [n] f32 updated in place from g [n]; decay = 1 - lr * weight_decay of this segment.
struct AdamWSegmentArgs {
  float* p;
  const float* g;
  float* m;
  float* v;
  int64_t n;
  float decay;
};
// Steps `count` segments (host array) with a few launches: their descriptors are passed as
// kernel parameters, so no device memory holds them.
cudaError_t launch_adamw(const AdamWSegmentArgs* segments, int64_t count, const AdamWConstants& c,
                         cudaStream_t s);

// ---- attention ---------------------------------------------------------------------------------
// One query block against one key block (the full causal attention is q_offset = k_offset = 0,
// Tq = Tk). Query t of row b sees key s iff seg[b, t] <= k_offset + s <= q_offset + t; seg may
// be null (every query's document starts at 0). k and v rows of batch b start at
// b * k_batch_stride elements (Tk * Hkv * Dh, or Tmax * Hkv * Dh for a KV cache).
struct AttnArgs {
  const void* q = nullptr;  // [B, Tq, Hq, Dh]
  const void* k = nullptr;  // [B, Tk.., Hkv, Dh]
  const void* v = nullptr;
  const int32_t* seg = nullptr;  // [B, Tq] or null
  Elem t = Elem::kF32;
  int64_t B = 0, Tq = 0, Tk = 0, Hq = 0, Hkv = 0, Dh = 0;
  int64_t q_offset = 0, k_offset = 0, k_batch_stride = 0;
  int64_t window = 0;  // sliding window: query t also needs q_offset + t - (k_offset + s) < window
  float softcap = 0.0f;  // attention logit soft-capping of the scaled scores (0: none)
};
inline constexpr int64_t kMaxHeadDim = 256;
// out [B, Tq, Hq, Dh] (type t); lse [B, Hq, Tq] f32 or null. A query that sees no key gets
// out = 0 and lse = -inf.
cudaError_t launch_attention_forward(const AttnArgs& a, void* out, float* lse, cudaStream_t s);
// delta [B, Hq, Tq] f32 scratch (from the workspace); dq overwritten, dk/dv overwritten.
cudaError_t launch_attention_backward(const AttnArgs& a, const void* out, const float* lse,
                                      const void* dout, float* delta, void* dq, void* dk, void* dv,
                                      cudaStream_t s);
// The RaggedIndex (cudnn_attention.h) of documents first .. first + docs - 1 of packed
// documents: starts [count + 1] i32 (Backend's DocumentSpans) into seq_len [docs], q_off, kv_off,
// lse_off [docs + 1]; the sequences past count are empty, at the end of the tokens.
cudaError_t launch_ragged_index(const int32_t* starts, int64_t count, int64_t first, int64_t docs,
                                int64_t Hq, int64_t Hkv, int64_t Dh, int32_t* seq_len,
                                int32_t* q_off, int32_t* kv_off, int32_t* lse_off, cudaStream_t s);
// stats [B * T, H] f32 token-major (cuDNN's ragged stats) into lse [B, H, T] (to_head_major),
// or back.
cudaError_t launch_lse_layout(const float* src, float* dst, int64_t B, int64_t T, int64_t H,
                              bool to_head_major, cudaStream_t s);
// out/lse merged with out_b/lse_b; out, out_b [B*T, Hq, Dh] of type t, lse [B, Hq, T] f32.
cudaError_t launch_attention_merge(void* out, float* lse, const void* out_b, const float* lse_b,
                                   Elem t, int64_t B, int64_t T, int64_t Hq, int64_t Dh,
                                   cudaStream_t s);

// ---- loss
// ---------------------------------------------------------------------------------------- logits
// [rows, V] of type t in place -> dlogits * grad_scale (computed in f32, rounded once to t);
// per-row loss (f64, from f32 statistics) added in row order to acc[0], valid count to acc[1].
// Ignored rows (targets -1, and those outside [0, V), which the caller reports) get zero
// gradients and no loss.
cudaError_t launch_softmax_xent(void* logits, Elem t, const int32_t* targets, int64_t rows,
                                int64_t V, float grad_scale, bool want_grad, double* row_loss,
                                double* acc, float softcap, cudaStream_t s);
// The vocabulary-parallel loss over a slice [rows, Vs] of type t of ids [vocab_begin, +Vs)
// (backend.h xent_slice_*): row_max [rows] f32 overwritten; stats [rows, 2] f32 (sum of exp in
// f64 stored f32, target logit or 0); finish: per-row loss (f64) and valid count in row_loss
// [rows, 2], their sums added to acc[0], acc[1] (a caller's running totals; acc null: not
// added), logits -> dlogits in place when want_grad (computed in f32, rounded once to t). fold:
// row_max and stats updated in place with this slice (overwritten unread when first), the slice's
// sum of exp in f64. softcap > 0: every logit is capped as read (softcap * tanh(logit / softcap))
// and its gradient taken through the cap.
cudaError_t launch_xent_slice_max(const void* logits, Elem t, float* row_max, int64_t rows,
                                  int64_t Vs, float softcap, cudaStream_t s);
cudaError_t launch_xent_slice_stats(const void* logits, Elem t, const int32_t* targets,
                                    int64_t vocab_begin, int64_t vocab, const float* row_max,
                                    float* stats, int64_t rows, int64_t Vs, float softcap,
                                    cudaStream_t s);
cudaError_t launch_xent_slice_fold(const void* logits, Elem t, const int32_t* targets,
                                   int64_t vocab_begin, int64_t vocab, float* row_max, float* stats,
                                   bool first, int64_t rows, int64_t Vs, float softcap,
                                   cudaStream_t s);
cudaError_t launch_xent_slice_finish(void* logits, Elem t, const int32_t* targets,
                                     int64_t vocab_begin, const float* row_max, const float* stats,
                                     float grad_scale, bool want_grad, double* row_loss,
                                     double* acc, int64_t rows, int64_t Vs, float softcap,
                                     cudaStream_t s);

}  // namespace shardlm::cuda
