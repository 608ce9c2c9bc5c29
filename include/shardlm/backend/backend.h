// Backend: the table of operations a device must provide (the CPU and CUDA backends).
// Each op family has its forward and backward side by side. Ops never allocate: scratch
// memory comes in as a Workspace sized by the matching *_workspace_bytes() query, so the
// caller can allocate it once through the ledger.
//
// Every op with a shape/dtype contract is a non-virtual entry point: it checks its arguments
// (dtypes, ranks, shapes against each other, workspace size; src/backend/contracts/, one file
// per op family) and then calls the backend's protected do_<op>, so a backend implements only
// the computation and cannot skip a check. A backend keeps only its own restrictions (CUDA:
// device memory) and the checks that read tensor data (ids, document starts).
//
// Conventions for every op:
//   - activations are row-major with tokens as rows: N = B*T tokens;
//   - float tensors are f32 or bf16, one dtype per op for activations and weights (statistics
//     such as rstd and lse are f32); compute is f32, bf16 values rounded to nearest even on
//     store;
//   - gradients of PARAMETERS (dw, db, dtable) ACCUMULATE (+=), so gradient accumulation
//     over micro-batches needs no extra buffer; gradients of ACTIVATIONS are OVERWRITTEN
//     unless the op's comment says "accumulates";
//   - an empty Tensor (data()==nullptr) for an optional output means "do not compute it".
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>

#include "shardlm/backend/preference_loss.h"
#include "shardlm/core/buffer.h"
#include "shardlm/core/check.h"
#include "shardlm/core/tensor.h"

namespace shardlm {

struct Workspace {
  std::byte* data = nullptr;
  size_t bytes = 0;
};

// A micro-batch's packed documents as ranges of its flattened [B*T] tokens, for attention
// implementations that take variable-length sequences (cuDNN's ragged SDPA): starts
// [>= count + 1] i32 in the backend's memory, document d = tokens [starts[d], starts[d + 1]),
// in order, covering every token, never crossing a row; no document longer than max_len (the
// longest, or a bound on it: a kernel may size its launch by it). They say what
// seg_start says, in the form such kernels read; count and max_len live on the host (the loader
// knows them when it fills the batch), so choosing a kernel reads nothing from the device.
// count == 0: not given; seg_start alone describes the documents.
struct DocumentSpans {
  Tensor starts;
  int64_t count = 0;
  int64_t max_len = 0;
};

// The spans of rows of T tokens whose document starts are seg [n] (host; n a multiple of T):
// writes starts [n + 1] (a document begins at each token whose start is its own index in the
// row; starts[count] = n) and returns {count, longest}.
inline std::pair<int64_t, int64_t> document_starts(const int32_t* seg, int64_t n, int64_t T,
                                                   int32_t* starts) {
  int64_t count = 0, longest = 0;
  for (int64_t i = 0; i < n; ++i)
    if (seg[i] == i % T) starts[count++] = int32_t(i);
  starts[count] = int32_t(n);
  for (int64_t d = 0; d < count; ++d)
    longest = std::max<int64_t>(longest, starts[d + 1] - starts[d]);
  return {count, longest};
}

struct AdamWHyper {
  float lr = 1e-3f;
  float beta1 = 0.9f;
  float beta2 = 0.95f;
  float eps = 1e-8f;
  float weight_decay = 0.0f;  // decoupled: w -= lr * wd * w
  int64_t step = 1;           // 1-based, for bias correction
  float grad_scale = 1.0f;    // gradients are multiplied by this before use (clipping)
};

// One stretch of an optimizer step (adamw_step_segments): param, grad, m, v [n] f32, as
// adamw_step's, with the weight decay of this stretch.
struct AdamWSegment {
  Tensor param, grad, m, v;
  float weight_decay = 0.0f;
};

// The block layout of Backend::copy_blocks: n[0] x n[1] x n[2] blocks of `block` contiguous
// elements; block (i, j, l) starts at element i * src[0] + j * src[1] + l * src[2] of the source
// and i * dst[0] + j * dst[1] + l * dst[2] of the destination. Strides are in elements, >= 0.
struct BlockCopy {
  int64_t n[3] = {1, 1, 1};
  int64_t block = 0;
  int64_t src[3] = {0, 0, 0};
  int64_t dst[3] = {0, 0, 0};
};

struct LossResult {
  double loss_sum = 0.0;  // sum of per-token cross-entropy over non-ignored targets (nats)
  int64_t n_valid = 0;    // number of non-ignored targets
};

inline constexpr int32_t kIgnoreIndex = -1;

// The first key (full-row index) query t sees under the attention ops' mask: its document's
// start, or under a sliding window of `window` keys (> 0) the key window - 1 before it,
// whichever is later; the query sees keys [first_visible_key, t]. transformers' sliding-window
// mask (masking_utils.sliding_window_overlay) keeps kv_idx > q_idx - window on top of the
// causal kv_idx <= q_idx: the same set.
inline int64_t first_visible_key(int64_t doc_start, int64_t t, int64_t window) {
  return window > 0 && t - window + 1 > doc_start ? t - window + 1 : doc_start;
}

// The driver's count of the device memory a backend took since it was created (its own fixed
// buffers excluded): Backend::driver_device_bytes, the independent check of the ledger.
struct DriverDeviceBytes {
  int64_t bytes = -1;       // -1: no figure (see `unavailable`)
  std::string source;       // where it comes from ("cudaMemGetInfo", "nvml_process"); empty: none
  std::string unavailable;  // why a device that has a driver gives no figure; empty otherwise
};

// An op output that is written (the default) or added to: an accumulating GEMM (BLAS and
// cuBLASLt beta = 1) sums its product into the tensor it belongs to, with no buffer for the term
// and one rounding of the sum.
enum class OutputMode : bool { kOverwrite, kAccumulate };

// Which dims of a head's rotated part R = 2 * inv_freq.dim(0) turn together by pos * inv_freq[i]:
// kHalf, Hugging Face's rotate_half (Llama): dims i and i + R/2; kInterleaved (GLM's
// rotate_half): dims 2i and 2i + 1.
enum class RopePairs : bool { kHalf, kInterleaved };

class Backend : public Allocator {
 public:
  ~Backend() override = default;
  virtual std::string name() const = 0;
  // How many threads the *_workspace_bytes queries size per-thread scratch for (the CPU
  // backend: its OpenMP threads, so a plan holds for the same OMP_NUM_THREADS); 1 where
  // scratch does not depend on a thread count.
  virtual int workspace_threads() const { return 1; }
  // Returns once every op issued so far has finished (a device backend queues its ops; the CPU
  // backend runs them before returning). For timing, not for correctness: an op whose result
  // the host reads (a copy to host memory, sum_squares, lm_head_loss) synchronises itself.
  virtual void synchronize() {}
  // How many times the host has waited for the device so far (synchronize(), a result the host
  // reads, a copy from or to host memory, a host fence wait), for the step's count of them
  // (metrics `host_waits`) and the tests that bound it; -1 where ops finish before they return
  // (nothing is counted).
  virtual int64_t host_waits() const { return -1; }
  // The operand dtype of this backend's fastest dense GEMM, whose measured rate is the trainer's
  // MFU denominator (measure_gemm_flops): bf16 on a GPU with tensor cores whatever the run's
  // activation dtype, so that an f32 run is not measured against the slower f32 rate; the
  // activation dtype itself where bf16 has no faster path (the CPU backend's BLAS).
  virtual DType peak_gemm_dtype(DType activation_dtype) const { return activation_dtype; }
  // Device memory the driver reports as taken since the backend was created (its own fixed
  // buffers excluded), for cross-checking the ledger; bytes -1 where the device has no such
  // report (no source) or it is unavailable here (the reason in `unavailable`).
  virtual DriverDeviceBytes driver_device_bytes() const { return {}; }
  // The queue this backend's device work runs on, as an opaque handle (a cudaStream_t on CUDA),
  // for a communicator that must order its own stream after the ops issued so far
  // (Communicator::set_compute_stream); nullptr where every op has finished when it returns.
  virtual void* device_stream() { return nullptr; }
  // Chooses the attention implementation (train.attention), before the workspace queries whose
  // sizes follow it, and returns the run's start-up words for it. "auto": the fastest this
  // backend has for each call; "own": its own kernels (the reference); "cudnn": cuDNN's fused
  // SDPA for the calls it takes (CUDA built with cuDNN), the own kernel for the rest. A backend
  // with only its own kernels takes "auto" and "own".
  virtual std::string select_attention(std::string_view impl);

  // ---- memory movement -------------------------------------------------------------------
  // x: any shape and dtype
  void zero(const Tensor& x);
  // same dtype & numel, any shapes and pools; src and dst are the same memory or do not overlap
  void copy(const Tensor& src, const Tensor& dst);
  // Copies that overlap compute (checkpoint offload and prefetch): copy_async starts copying
  // src to dst (as copy) on the backend's copy stream, after the compute work issued so far,
  // and returns a fence (> 0, increasing; 0 = none). wait_fence(f) makes the compute work
  // issued afterwards wait for copy f and every copy started before it, on the device: the
  // host does not block. Until then neither buffer may be written (nor a host dst read by the
  // host). The CPU backend copies at once and its fences are already passed.
  uint64_t copy_async(const Tensor& src, const Tensor& dst);
  virtual void wait_fence(uint64_t /*fence*/) {}
  // Blocks the host until copy `fence` and every copy started before it have finished: then
  // the host may read a host dst, and either buffer may be written.
  virtual void host_wait_fence(uint64_t /*fence*/) {}

  // ---- device time ---------------------------------------------------------------------
  // mark() records a point in the backend's queue after the work issued so far, without
  // waiting; seconds_between(a, b) waits for mark b and returns the time from mark a to mark b
  // as the device ran them: a stretch of work timed with no synchronisation in it (the
  // pipeline's per-stage busy time). The last kMarksKept marks can be read. A backend whose
  // ops finish before they return marks the host clock (the default).
  static constexpr uint64_t kMarksKept = 1024;
  virtual uint64_t mark();
  virtual double seconds_between(uint64_t a, uint64_t b);
  // Strided block copy, one call for a whole gather or scatter (context parallelism's head
  // packing and token reordering around its all-to-alls, and its input sharding): every block of
  // `layout` from src to dst, exactly. src, dst: one dtype, any pools (a device backend reads and
  // writes host memory as copy does), no memory in common; every block inside its tensor. A src
  // stride may be 0 (a block read several times: replicated kv heads); dst blocks nest without
  // overlap (sorted by stride, each stride at least the extent of the dims inside it).
  void copy_blocks(const Tensor& src, const Tensor& dst, const BlockCopy& layout);
  // Element-type conversion (f32 <-> bf16, or a copy within one), same numel.
  void convert(const Tensor& src, const Tensor& dst);
  // out = a + b (out may alias a or b). [n], one float dtype
  void add(const Tensor& a, const Tensor& b, const Tensor& out);
  // x *= s. [n]
  void scale(const Tensor& x, float s);
  // x[r, :] *= s[r], in f32 and rounded once. x [n, m] f32 or bf16; s [n] f32 (per-token weights
  // on a loss's gradient rows: a preference objective's per-sequence coefficients).
  void scale_rows(const Tensor& x, const Tensor& s);
  // sum of squares in f64 accumulation. [n]
  double sum_squares(const Tensor& x);
  // sums[i] = sum_squares(xs[i]) for every tensor of a list (each f32 or bf16, any size), with
  // one wait for the results however many there are: the gradient norm and the non-finite
  // check over the ZeRO step's segments read them all at once. sums.size() == xs.size().
  void sum_squares_segments(std::span<const Tensor> xs, std::span<double> sums);

  // ---- dropout with a counter-based mask (LoRA's input dropout) ------------------------------
  // out[i] = x[i] / (1 - p) where element (first + i) is kept, else 0; the mask is a pure
  // function of (seed, first + i), so a recomputation gives the same bits. x, out [n] of one
  // float dtype (out may alias x); p in [0, 1). row_stride > 0: x [rows, w] is a block of
  // columns of a wider [rows, row_stride] matrix (a tensor-parallel shard of a row-parallel
  // projection's input), element (i, j) masked as element first + i * row_stride + j, as the
  // whole matrix would be. A backend without the kernel refuses (do_dropout's default).
  void dropout(const Tensor& x, const Tensor& out, float p, uint64_t seed, int64_t first,
               int64_t row_stride = 0);

  // ---- NF4 dequantization (QLoRA's frozen base; the format is quant/nf4.h's) -----------------
  // out [n] (any shape) f32 or bf16 = NF4 code value * its block's absmax, in f32 (rounded to
  // nearest even for bf16): bit for bit quant/nf4.h's dequantize. codes [ceil(n/2)] u8, two per
  // byte with the first element in the high nibble; absmax [ceil(n/64)] f32.
  void nf4_dequantize(const Tensor& codes, const Tensor& absmax, const Tensor& out);

  // ---- linear: y = x W^T (+ b) (+ residual) ---------------------------------------------------
  // x [N, in], w [out, in], b [out] or empty, y [N, out]; one float dtype. y_mode kAccumulate:
  // y += x W^T (+ b), summed in f32 with y's old value and rounded once. y overlaps neither x
  // nor w. residual [N, out] of y's dtype, or empty: y = residual + x W^T (+ b), summed in f32
  // and rounded once (the residual stream's add as the GEMM's epilogue, in place of a second
  // pass over y); only with kOverwrite. residual is either y itself (then the same as
  // kAccumulate) or overlaps none of y, x and w.
  void linear_forward(const Tensor& x, const Tensor& w, const Tensor& b, const Tensor& y,
                      OutputMode y_mode = OutputMode::kOverwrite,
                      const Tensor& residual = Tensor());
  // dy [N, out]; dx [N, in] (overwritten, or empty; dx_mode kAccumulate: dx += dy W, summed in
  // f32 with dx's old value and rounded once); dw [out, in] accumulates (or empty: a frozen
  // weight, whose dW GEMM is skipped), f32 or x's dtype; db [out] f32 accumulates (or empty).
  void linear_backward(const Tensor& x, const Tensor& w, const Tensor& dy, const Tensor& dx,
                       const Tensor& dw, const Tensor& db,
                       OutputMode dx_mode = OutputMode::kOverwrite);

  // ---- token embedding -------------------------------------------------------------------
  // An id outside the vocabulary is a data error naming its position and value (the first bad
  // one). The CPU backend raises it before writing; a device backend that queues its ops (CUDA)
  // does not wait for the check: the op gives zero rows for (or skips) the bad ids and the next
  // result the host reads (lm_head_loss, read_loss, sum_squares, sum_squares_segments:
  // a step's loss and gradient norm, before the optimizer) raises it.
  // tokens [N] i32 in [0, V); table [V, D]; out [N, D] of table's dtype
  void embedding_forward(const Tensor& tokens, const Tensor& table, const Tensor& out);
  // dout [N, D]; dtable [V, D] f32 accumulates
  void embedding_backward(const Tensor& tokens, const Tensor& dout, const Tensor& dtable);

  // ---- vocabulary-parallel token embedding (tensor parallelism) -----------------------------
  // A rank holds the rows of ids [vocab_begin, vocab_begin + Vs) of a vocabulary of `vocab` ids.
  // tokens [N] i32 in [0, vocab) (any other id is a data error, raised as the embedding's above);
  // table [Vs, D]; out [N, D]: the table row of an id this rank holds, zeros for the others
  // (the sum over the ranks is the whole embedding).
  void embedding_forward_slice(const Tensor& tokens, const Tensor& table, int64_t vocab_begin,
                               int64_t vocab, const Tensor& out);
  // dout [N, D]; dtable [Vs, D] f32 accumulates the rows of the ids this rank holds (others
  // skipped)
  void embedding_backward_slice(const Tensor& tokens, const Tensor& dout, int64_t vocab_begin,
                                int64_t vocab, const Tensor& dtable);

  // ---- RMSNorm: y = x / sqrt(mean(x^2) + eps) * (w_offset + w) -----------------------------
  // x [N, D] (D > 0 unless N = 0), w [D], y [N, D]; rstd [N] f32 (saved for backward); eps >= 0.
  // w_offset: 0 for Llama's norms, 1 for Gemma's (1 + w), added to w in f32.
  void rmsnorm_forward(const Tensor& x, const Tensor& w, float eps, const Tensor& y,
                       const Tensor& rstd, float w_offset = 0.f);
  // dy [N, D]; dx [N, D] ACCUMULATES (the residual stream's gradient flows through it);
  // dw [D] f32 accumulates (the same for any w_offset).
  void rmsnorm_backward(const Tensor& x, const Tensor& w, const Tensor& rstd, const Tensor& dy,
                        const Tensor& dx, const Tensor& dw, float w_offset = 0.f);
  // The residual add and the next norm in one pass: residual += x, summed in f32 and rounded
  // once (as add), then y = rmsnorm(residual) as rmsnorm_forward computes it from the rounded
  // sum; the same bits as add then rmsnorm_forward on the CPU. x, residual, y [N, D] of w's
  // dtype, y apart from both; rstd [N] f32. Its backward is rmsnorm_backward on the sum: the
  // add passes its gradient on unchanged, which that op's accumulating dx already does.
  void add_rmsnorm_forward(const Tensor& x, const Tensor& residual, const Tensor& w, float eps,
                           const Tensor& y, const Tensor& rstd, float w_offset = 0.f);

  // ---- rotary position embedding, in place, Hugging Face's conventions --------------------
  // The first R = 2 * inv_freq.dim(0) dims of each head rotate (R < Dh: partial rotary, GLM's;
  // the other Dh - R pass through untouched); pair i (RopePairs says which dims) turns by
  // angle pos * inv_freq[i].
  // x [N, H, Dh] (Dh even); positions [N] i32; inv_freq [R/2] f32 with 2 <= R <= Dh
  void rope_forward(const Tensor& x, const Tensor& positions, const Tensor& inv_freq,
                    RopePairs pairs = RopePairs::kHalf);
  // dx [N, H, Dh] in place: applies the inverse rotation to the incoming gradient.
  void rope_backward(const Tensor& dx, const Tensor& positions, const Tensor& inv_freq,
                     RopePairs pairs = RopePairs::kHalf);
  // An attention layer's two rotations in one call: q [N, Hq, Dh] and k [N, Hk, Dh] of one float
  // dtype, each rotated in place as rope_forward rotates it (bit for bit), with one positions
  // [N] i32 and inv_freq [R/2] f32; q and k do not share memory. A backend forms each token's
  // angles once for both (one pass, one launch).
  void rope_qk_forward(const Tensor& q, const Tensor& k, const Tensor& positions,
                       const Tensor& inv_freq, RopePairs pairs = RopePairs::kHalf);
  // dq [N, Hq, Dh], dk [N, Hk, Dh] in place: rope_backward on each, in one call.
  void rope_qk_backward(const Tensor& dq, const Tensor& dk, const Tensor& positions,
                        const Tensor& inv_freq, RopePairs pairs = RopePairs::kHalf);

  // ---- SwiGLU: h = silu(gate) * up -----------------------------------------------------
  // gate, up, h: [N, F]
  void swiglu_forward(const Tensor& gate, const Tensor& up, const Tensor& h);
  // dh [N, F]; dgate, dup [N, F] overwritten
  void swiglu_backward(const Tensor& gate, const Tensor& up, const Tensor& dh, const Tensor& dgate,
                       const Tensor& dup);

  // ---- GeGLU (Gemma): h = gelu_tanh(gate) * up ----------------------------------------------
  // gelu_tanh(g) = 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))), PyTorch's
  // gelu(approximate="tanh"). Shapes and modes as swiglu_forward / swiglu_backward.
  void geglu_forward(const Tensor& gate, const Tensor& up, const Tensor& h);
  void geglu_backward(const Tensor& gate, const Tensor& up, const Tensor& dh, const Tensor& dgate,
                      const Tensor& dup);

  // ---- causal attention with online softmax, O(T) memory ------------------------------------
  // Grouped-query: query head h reads kv head h / (Hq / Hkv). Scale 1/sqrt(Dh).
  // Document masking: query t of batch row b attends key s iff seg_start[b,t] <= s <= t. An
  // empty seg_start (no data) means one document per row, the causal mask alone: the form
  // cuDNN's fused attention takes (train.attention).
  // q [B, T, Hq, Dh]; k, v [B, T, Hkv, Dh] (Hq a multiple of Hkv > 0, Dh > 0); seg_start
  // [B, T] i32; out [B, T, Hq, Dh]; lse [B, Hq, T] f32 (log-sum-exp of scaled scores, for
  // backward). ws: at least attention_workspace_bytes, for the forward and the backward.
  // docs (optional, with seg_start): the same documents as spans, for a backend whose fastest
  // kernel takes variable-length sequences; the CPU backend checks them against seg_start.
  // window (optional, >= 0): sliding-window attention, 0 = none. Query t then sees key s iff
  // also t - s < window (transformers' sliding_window_overlay: kv_idx > q_idx - window), on
  // top of the causal and document masks: a token sees itself and the window - 1 before it.
  // softcap (optional, >= 0): Gemma 2's attention logit soft-capping, 0 = none. Each scaled
  // score s becomes softcap * tanh(s / softcap) before the mask and the softmax (transformers'
  // eager Gemma 2), in every attention op here, decode included; lse is of the capped scores,
  // so blocks merge unchanged, and the backward multiplies d s' by 1 - tanh^2.
  virtual size_t attention_workspace_bytes(int64_t B, int64_t T, int64_t Hq, int64_t Hkv,
                                           int64_t Dh) const = 0;
  void attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& seg_start,
                         const Tensor& out, const Tensor& lse, Workspace ws,
                         const DocumentSpans& docs = {}, int64_t window = 0, float softcap = 0.0f);
  // dout [B, T, Hq, Dh]; dq [B, T, Hq, Dh], dk, dv [B, T, Hkv, Dh] overwritten
  void attention_backward(const Tensor& q, const Tensor& k, const Tensor& v,
                          const Tensor& seg_start, const Tensor& out, const Tensor& lse,
                          const Tensor& dout, const Tensor& dq, const Tensor& dk, const Tensor& dv,
                          Workspace ws, const DocumentSpans& docs = {}, int64_t window = 0,
                          float softcap = 0.0f);

  // ---- block attention (context parallelism: a query block against one key block) ---------
  // Query t of batch row b sits at index q_offset + t of its full row, key s at k_offset + s;
  // query t sees key s iff seg_start[b, t] <= k_offset + s <= q_offset + t (causal, document
  // masked; seg_start holds full-row indices; empty: one document per row), and under a sliding
  // window (> 0) also q_offset + t - (k_offset + s) < window. GQA and scale as attention_forward.
  // q [B, Tq, Hq, Dh]; k, v [B, Tk, Hkv, Dh]; seg_start [B, Tq] i32 with
  // 0 <= seg_start[b, t] <= q_offset + t; out [B, Tq, Hq, Dh]; lse [B, Hq, Tq]; offsets >= 0.
  // A query that sees no key of the block gets out = 0 and lse = -inf.
  virtual size_t attention_block_workspace_bytes(int64_t B, int64_t Tq, int64_t Tk, int64_t Hq,
                                                 int64_t Hkv, int64_t Dh) const = 0;
  // The attention scratch a run plans (the model's and context parallelism's workspace), for
  // layers with the sliding windows `windows` (ModelConfig::attention_windows(); 0 = none): at
  // least attention_workspace_bytes (block: attention_block_workspace_bytes) of the same shape.
  // A backend that prepares per-problem kernels before the step (CUDA: cuDNN's graphs, one per
  // window and bucket) prepares every one the run can meet here, so that no step builds or
  // allocates one. Default: the plain query (scratch no window changes).
  virtual size_t attention_plan_workspace_bytes(int64_t B, int64_t T, int64_t Hq, int64_t Hkv,
                                                int64_t Dh,
                                                std::span<const int64_t> windows) const {
    (void)windows;
    return attention_workspace_bytes(B, T, Hq, Hkv, Dh);
  }
  virtual size_t attention_block_plan_workspace_bytes(int64_t B, int64_t Tq, int64_t Tk, int64_t Hq,
                                                      int64_t Hkv, int64_t Dh,
                                                      std::span<const int64_t> windows) const {
    (void)windows;
    return attention_block_workspace_bytes(B, Tq, Tk, Hq, Hkv, Dh);
  }
  void attention_block_forward(const Tensor& q, const Tensor& k, const Tensor& v,
                               const Tensor& seg_start, int64_t q_offset, int64_t k_offset,
                               const Tensor& out, const Tensor& lse, Workspace ws,
                               int64_t window = 0, float softcap = 0.0f);
  // The block's share of the gradients, given the FINAL out and lse of the queries (merged over
  // every key block they see): dq [B, Tq, Hq, Dh] overwritten with the contribution of this key
  // block; dk, dv [B, Tk, Hkv, Dh] overwritten with these queries' contribution.
  void attention_block_backward(const Tensor& q, const Tensor& k, const Tensor& v,
                                const Tensor& seg_start, int64_t q_offset, int64_t k_offset,
                                const Tensor& out, const Tensor& lse, const Tensor& dout,
                                const Tensor& dq, const Tensor& dk, const Tensor& dv, Workspace ws,
                                int64_t window = 0, float softcap = 0.0f);
  // Online-softmax merge of a block's result into a running one: out, lse [as above] become
  // the attention over the union of both key sets. -inf lse on either side is handled (a side
  // that saw nothing contributes nothing). out [N, Hq, Dh] or [B, T, Hq, Dh] (N = B * T);
  // lse [B, Hq, T] f32; out_b, lse_b of the same shapes, out_b of out's dtype.
  void attention_merge(const Tensor& out, const Tensor& lse, const Tensor& out_b,
                       const Tensor& lse_b);

  // ---- attention of new queries against a KV cache (incremental decoding) -------------------
  // Query i sits at absolute position cache_len + i and sees cache rows [0, cache_len + i]
  // (causal among the new queries, one document). The caches already hold the keys and values
  // of positions [0, cache_len + Tq); later rows are never read. GQA and scale as above; no lse
  // (inference only). Memory O(Tmax).
  // q [B, Tq, Hq, Dh]; k_cache, v_cache [B, Tmax, Hkv, Dh]; out [B, Tq, Hq, Dh] overwritten;
  // 0 <= cache_len <= Tmax - Tq
  virtual size_t attention_decode_workspace_bytes(int64_t B, int64_t Tq, int64_t Tmax, int64_t Hq,
                                                  int64_t Dh) const = 0;
  void attention_decode(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                        int64_t cache_len, const Tensor& out, Workspace ws, float softcap = 0.0f);

  // ---- fused LM head + cross-entropy, chunked over tokens ------------------------------------
  // Never materialises [N, V] logits: processes chunk_tokens rows at a time. When dh / dw are
  // given, the gradient of (grad_scale * loss_sum) is produced in the same pass.
  // h [N, D] (D >= 1); w [V, D]; targets [N] i32 (kIgnoreIndex = skip; any other id outside
  // [0, V) is a data error: raised by the CPU backend before any write, by a queueing device
  // backend at this op's own read of the loss, the row left out of the loss and the gradients);
  // dh [N, D] overwritten (or empty); dw [V, D] accumulates (or empty), f32 or w's dtype.
  // chunk_tokens >= 1 and V >= 1; the workspace for h and w of dtype t (a backend may keep the
  // logits in it: the CUDA backend's are bf16 for bf16 operands, with f32 statistics).
  // softcap (optional, >= 0; 0 = none): Gemma 2's final-logit soft-capping, each logit
  // softcap * tanh(logit / softcap) before the softmax, its gradient times 1 - tanh^2. The
  // xent_slice_* ops below take the same cap and apply it to every logit they read (the logits
  // in memory stay uncapped until xent_slice_finish turns them into gradients).
  size_t lm_head_loss_workspace_bytes(int64_t chunk_tokens, int64_t V, DType t) const;
  LossResult lm_head_loss(const Tensor& h, const Tensor& w, const Tensor& targets,
                          int64_t chunk_tokens, float grad_scale, const Tensor& dh,
                          const Tensor& dw, Workspace ws, float softcap = 0.0f);

  // ---- vocabulary-parallel cross-entropy: the non-GEMM parts over a slice of the logits -----
  // A rank holds logits [n, Vs] (f32 or bf16) of the vocabulary ids [vocab_begin, vocab_begin +
  // Vs) of a vocabulary of `vocab` ids (h W_shard^T, a linear_forward); the caller reduces the
  // row statistics over the ranks between the calls (all-reduce max after xent_slice_max, sum
  // after xent_slice_stats). targets [n] i32 in [0, vocab) or kIgnoreIndex.
  // row_max [n] f32 overwritten: the max of each row of the slice.
  void xent_slice_max(const Tensor& logits, const Tensor& row_max, float softcap = 0.0f);
  // stats [n, 2] f32 overwritten: (sum_j exp(logits[r, j] - row_max[r]), accumulated in f64;
  // the target's logit where this slice holds it, else 0); ignored rows (0, 0). A target
  // outside [0, vocab) that is not kIgnoreIndex is a data error. Every backend gives its row
  // (0, 0) as an ignored one's (xent_slice_finish then leaves it out: a row with a target sums
  // at least 1); the CPU backend raises it after the write, a queueing device backend does not
  // wait for the check and raises it at the next result the host reads, as the embedding's.
  void xent_slice_stats(const Tensor& logits, const Tensor& targets, int64_t vocab_begin,
                        int64_t vocab, const Tensor& row_max, const Tensor& stats,
                        float softcap = 0.0f);
  // Running statistics over slices walked one after another (the LM head in pieces of rows):
  // logits [n, Vs] (f32 or bf16) of ids [vocab_begin, vocab_begin + Vs) of a vocabulary of
  // `vocab` ids; targets [n] i32 in [0, vocab) or kIgnoreIndex; row_max [n] f32 and stats [n, 2]
  // f32 hold the statistics of the slices before (first = true: none; both overwritten without
  // being read). Afterwards row_max[r] = M = max(old row_max, this slice's max) and
  // stats[r] = (old sum * exp(old max - M) + sum_j exp(logits[r, j] - M) (the slice's sum in
  // f64), old target logit + this slice's target logit where it holds the target). Ignored rows:
  // stats (0, 0), row_max = M. After the last slice they are what xent_slice_max +
  // xent_slice_stats over the whole row give (up to rounding), ready for xent_slice_finish on
  // each slice. A target outside [0, vocab) that is not kIgnoreIndex is a data error, raised as
  // xent_slice_stats raises it (a queueing device backend: at the next result read, the row
  // folded as an ignored one).
  void xent_slice_fold(const Tensor& logits, const Tensor& targets, int64_t vocab_begin,
                       int64_t vocab, const Tensor& row_max, const Tensor& stats, bool first,
                       float softcap = 0.0f);
  // With the reduced row_max and stats: ADDS the loss sum over the non-ignored rows
  // (log(stats[r, 0]) + row_max[r] - stats[r, 1], summed in f64) and their count to loss_acc
  // [2] f64 (loss_acc[0] += the sum, loss_acc[1] += the count), or adds nothing where loss_acc
  // is empty (a slice whose rows' loss another call has counted); with want_grad the logits
  // become grad_scale * (softmax - onehot(target)) on the slice, in place (zeros on ignored
  // rows), ready for the dh and dW GEMMs. Nothing is read back: a queueing device backend does
  // not wait, so a walk over loss chunks and vocabulary pieces zeroes its accumulator, finishes
  // every slice into it and reads it once (read_loss). ws: xent_slice_workspace_bytes(n) of
  // scratch.
  virtual size_t xent_slice_workspace_bytes(int64_t n) const {
    (void)n;
    return 0;
  }
  void xent_slice_finish(const Tensor& logits, const Tensor& targets, int64_t vocab_begin,
                         const Tensor& row_max, const Tensor& stats, float grad_scale,
                         bool want_grad, const Tensor& loss_acc, Workspace ws,
                         float softcap = 0.0f);
  // The loss xent_slice_finish calls added to loss_acc [2] f64: {loss_acc[0], loss_acc[1]}
  // (the count as an integer), one read of a result by the host (a device backend: one copy
  // and one wait). The id checks a queueing device backend deferred (the embedding's, the
  // targets' of xent_slice_stats and _fold) are read in the same wait and raised here.
  LossResult read_loss(const Tensor& loss_acc);

  // ---- optimizer -------------------------------------------------------------------------
  // AdamW on f32 master weights; param, grad, m, v: [n] f32; hyper.step >= 1. grad is read,
  // not modified.
  void adamw_step(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v,
                  const AdamWHyper& hyper);
  // adamw_step on every segment, each with its own weight_decay (hyper.weight_decay is not read)
  // and hyper's other fields: per element the same arithmetic as adamw_step one segment at a
  // time. No two segments' param, m or v share memory. A device backend steps the list in a few
  // launches instead of one per segment.
  void adamw_step_segments(std::span<const AdamWSegment> segments, const AdamWHyper& hyper);

  // ---- preference objectives: each pair's sums, coefficients and token weights on the device --
  // A micro-batch of a preference objective (dpo, simpo) holds S sequences (2P of P pairs), each
  // a segment of its [N] tokens; these ops take the head's row statistics to each sequence's
  // summed log-probabilities, those to each pair's loss, metrics and coefficient
  // (preference_loss.h), and the coefficients to the token weights of the weighted head
  // backward, with nothing read on the host. None returns a result: a queueing device backend
  // queues them. Sums in f64, added in a fixed order on every backend (no atomics).
  // sums [S, 2] f64, overwritten: for each segment s, (the sum of the log-probabilities of the
  // target, in f64, and their count) over the rows i with segments[i] == s and stats[i, 0] != 0,
  // added in a fixed order: the same bits run after run (the CPU backend: in increasing i, the
  // trainer's host order; the CUDA backend: a fixed-shape block reduction). row_max [N] f32 and
  // stats [N, 2] f32 (sum of exponentials, the target's capped logit) as the xent slice ops leave
  // them; segments [N] i32 in [-1, S) (-1: no segment). log p_i = stats[i,1] - row_max[i] -
  // log(stats[i,0]), computed in f64. A segment id outside [-1, S) is an error: the CPU backend
  // raises it before writing; the CUDA backend leaves the row out and raises it at the next result
  // the host reads.
  void segment_logp_sums(const Tensor& row_max, const Tensor& stats, const Tensor& segments,
                         const Tensor& sums);
  // policy [2P, 2] f64 (segment_logp_sums' layout; sequence 2k is pair k's chosen, 2k+1 its
  // rejected), reference [2P, 2] f64 (the reference's sums; its count column unused; read by the
  // dpo kinds only) or empty (kSimpo only: an empty reference with a DPO kind is a contract
  // error). coef [2P] f32, overwritten: -(d loss_k / d pi) * norm for each sequence (pi its
  // policy sum). metrics [kPreferenceMetrics] f64 (PreferenceMetric's order): += the pairs'
  // sums (added pair by pair in increasing k, then to the existing value), pairs += P.
  void preference_coefficients(const PreferenceLossSpec& loss, const Tensor& policy,
                               const Tensor& reference, double norm, const Tensor& coef,
                               const Tensor& metrics);
  // weights [N] f32 = segments[i] >= 0 ? coef[segments[i]] : 0; coef [S] f32, segments [N] i32
  // in [-1, S) (outside: an error, raised as segment_logp_sums raises it; the CUDA backend
  // gives the row weight 0).
  void gather_segment_weights(const Tensor& coef, const Tensor& segments, const Tensor& weights);

 protected:
  // The implementations: do_<op> runs <op> on arguments its entry point above has checked.
  virtual void do_zero(const Tensor& x) = 0;
  virtual void do_copy(const Tensor& src, const Tensor& dst) = 0;
  virtual uint64_t do_copy_async(const Tensor& src, const Tensor& dst) {
    do_copy(src, dst);
    return 0;
  }
  virtual void do_copy_blocks(const Tensor& src, const Tensor& dst, const BlockCopy& layout) = 0;
  virtual void do_convert(const Tensor& src, const Tensor& dst) = 0;
  virtual void do_add(const Tensor& a, const Tensor& b, const Tensor& out) = 0;
  virtual void do_scale(const Tensor& x, float s) = 0;
  virtual void do_scale_rows(const Tensor& x, const Tensor& s) = 0;
  virtual double do_sum_squares(const Tensor& x) = 0;
  virtual void do_sum_squares_segments(std::span<const Tensor> xs, std::span<double> sums) = 0;
  // Refuses: a backend without the kernel cannot run lora.dropout.
  // width, row_stride: element i is masked as first + (i / width) * row_stride + i % width.
  virtual void do_dropout(const Tensor& x, const Tensor& out, float p, uint64_t seed, int64_t first,
                          int64_t width, int64_t row_stride);
  virtual void do_nf4_dequantize(const Tensor& codes, const Tensor& absmax, const Tensor& out) = 0;
  // residual: empty, or apart from y (the entry point turns residual == y into kAccumulate),
  // with y_mode kOverwrite.
  virtual void do_linear_forward(const Tensor& x, const Tensor& w, const Tensor& b, const Tensor& y,
                                 OutputMode y_mode, const Tensor& residual) = 0;
  virtual void do_linear_backward(const Tensor& x, const Tensor& w, const Tensor& dy,
                                  const Tensor& dx, const Tensor& dw, const Tensor& db,
                                  OutputMode dx_mode) = 0;
  // The whole vocabulary is the slice [0, V): a backend overrides these only for a faster
  // kernel of its own.
  virtual void do_embedding_forward(const Tensor& tokens, const Tensor& table, const Tensor& out);
  virtual void do_embedding_backward(const Tensor& tokens, const Tensor& dout,
                                     const Tensor& dtable);
  virtual void do_embedding_forward_slice(const Tensor& tokens, const Tensor& table,
                                          int64_t vocab_begin, int64_t vocab,
                                          const Tensor& out) = 0;
  virtual void do_embedding_backward_slice(const Tensor& tokens, const Tensor& dout,
                                           int64_t vocab_begin, int64_t vocab,
                                           const Tensor& dtable) = 0;
  virtual void do_rmsnorm_forward(const Tensor& x, const Tensor& w, float eps, const Tensor& y,
                                  const Tensor& rstd, float w_offset) = 0;
  virtual void do_rmsnorm_backward(const Tensor& x, const Tensor& w, const Tensor& rstd,
                                   const Tensor& dy, const Tensor& dx, const Tensor& dw,
                                   float w_offset) = 0;
  virtual void do_add_rmsnorm_forward(const Tensor& x, const Tensor& residual, const Tensor& w,
                                      float eps, const Tensor& y, const Tensor& rstd,
                                      float w_offset) = 0;
  virtual void do_rope_forward(const Tensor& x, const Tensor& positions, const Tensor& inv_freq,
                               RopePairs pairs) = 0;
  virtual void do_rope_backward(const Tensor& dx, const Tensor& positions, const Tensor& inv_freq,
                                RopePairs pairs) = 0;
  virtual void do_rope_qk_forward(const Tensor& q, const Tensor& k, const Tensor& positions,
                                  const Tensor& inv_freq, RopePairs pairs) = 0;
  virtual void do_rope_qk_backward(const Tensor& dq, const Tensor& dk, const Tensor& positions,
                                   const Tensor& inv_freq, RopePairs pairs) = 0;
  virtual void do_swiglu_forward(const Tensor& gate, const Tensor& up, const Tensor& h) = 0;
  virtual void do_swiglu_backward(const Tensor& gate, const Tensor& up, const Tensor& dh,
                                  const Tensor& dgate, const Tensor& dup) = 0;
  virtual void do_geglu_forward(const Tensor& gate, const Tensor& up, const Tensor& h) = 0;
  virtual void do_geglu_backward(const Tensor& gate, const Tensor& up, const Tensor& dh,
                                 const Tensor& dgate, const Tensor& dup) = 0;
  virtual void do_attention_forward(const Tensor& q, const Tensor& k, const Tensor& v,
                                    const Tensor& seg_start, const Tensor& out, const Tensor& lse,
                                    Workspace ws, const DocumentSpans& docs, int64_t window,
                                    float softcap) = 0;
  virtual void do_attention_backward(const Tensor& q, const Tensor& k, const Tensor& v,
                                     const Tensor& seg_start, const Tensor& out, const Tensor& lse,
                                     const Tensor& dout, const Tensor& dq, const Tensor& dk,
                                     const Tensor& dv, Workspace ws, const DocumentSpans& docs,
                                     int64_t window, float softcap) = 0;
  virtual void do_attention_block_forward(const Tensor& q, const Tensor& k, const Tensor& v,
                                          const Tensor& seg_start, int64_t q_offset,
                                          int64_t k_offset, const Tensor& out, const Tensor& lse,
                                          Workspace ws, int64_t window, float softcap) = 0;
  virtual void do_attention_block_backward(const Tensor& q, const Tensor& k, const Tensor& v,
                                           const Tensor& seg_start, int64_t q_offset,
                                           int64_t k_offset, const Tensor& out, const Tensor& lse,
                                           const Tensor& dout, const Tensor& dq, const Tensor& dk,
                                           const Tensor& dv, Workspace ws, int64_t window,
                                           float softcap) = 0;
  virtual void do_attention_merge(const Tensor& out, const Tensor& lse, const Tensor& out_b,
                                  const Tensor& lse_b) = 0;
  virtual void do_attention_decode(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                                   int64_t cache_len, const Tensor& out, Workspace ws,
                                   float softcap) = 0;
  virtual size_t do_lm_head_loss_workspace_bytes(int64_t chunk_tokens, int64_t V,
                                                 DType t) const = 0;
  virtual LossResult do_lm_head_loss(const Tensor& h, const Tensor& w, const Tensor& targets,
                                     int64_t chunk_tokens, float grad_scale, const Tensor& dh,
                                     const Tensor& dw, Workspace ws, float softcap) = 0;
  virtual void do_xent_slice_max(const Tensor& logits, const Tensor& row_max, float softcap) = 0;
  virtual void do_xent_slice_stats(const Tensor& logits, const Tensor& targets, int64_t vocab_begin,
                                   int64_t vocab, const Tensor& row_max, const Tensor& stats,
                                   float softcap) = 0;
  virtual void do_xent_slice_fold(const Tensor& logits, const Tensor& targets, int64_t vocab_begin,
                                  int64_t vocab, const Tensor& row_max, const Tensor& stats,
                                  bool first, float softcap) = 0;
  virtual void do_xent_slice_finish(const Tensor& logits, const Tensor& targets,
                                    int64_t vocab_begin, const Tensor& row_max, const Tensor& stats,
                                    float grad_scale, bool want_grad, const Tensor& loss_acc,
                                    Workspace ws, float softcap) = 0;
  virtual LossResult do_read_loss(const Tensor& loss_acc) = 0;
  virtual void do_adamw_step(const Tensor& param, const Tensor& grad, const Tensor& m,
                             const Tensor& v, const AdamWHyper& hyper) = 0;
  virtual void do_adamw_step_segments(std::span<const AdamWSegment> segments,
                                      const AdamWHyper& hyper) = 0;
  virtual void do_segment_logp_sums(const Tensor& row_max, const Tensor& stats,
                                    const Tensor& segments, const Tensor& sums) = 0;
  virtual void do_preference_coefficients(const PreferenceLossSpec& loss, const Tensor& policy,
                                          const Tensor& reference, double norm, const Tensor& coef,
                                          const Tensor& metrics) = 0;
  virtual void do_gather_segment_weights(const Tensor& coef, const Tensor& segments,
                                         const Tensor& weights) = 0;
};

// Creates the backend for a device kind; throws kConfig if it was not built in. device_shared:
// other processes of the run use the same device (device_shared_by_ranks), so a device-wide
// count of its memory is not this process's (driver_device_bytes then counts its own).
std::unique_ptr<Backend> make_backend(DeviceKind kind, int device_index = 0,
                                      bool device_shared = false);
// Devices of `kind` this process sees (CPU: 1; CUDA: 0 when none or not built in): a rank picks
// local rank modulo this, so that several ranks may share one device.
int visible_devices(DeviceKind kind);
// Whether another of a node's local_size ranks picks the same device as local rank
// `local_rank` when each takes local rank modulo `devices` (visible_devices).
inline bool device_shared_by_ranks(int local_rank, int local_size, int devices) {
  if (devices <= 0 || local_size <= devices) return false;
  return local_rank >= devices || local_rank + devices < local_size;
}

}  // namespace shardlm
