// CudaBackend: the Backend table on one NVIDIA GPU, behind the entry points that check every
// op's shapes and dtypes (backend.h); its own rules are that tensors live in device memory and
// head dims fit the attention kernels. Kernels are the .cu files of this directory (launch.h),
// GEMMs go to cuBLASLt (f32 accumulation, true f32 for f32 operands), attention to cuDNN's
// fused SDPA where it takes the call (cudnn_attention.h; select_attention) and to the own
// kernels otherwise. Everything is enqueued on
// one compute stream (copy_async: on a copy stream, ordered by events); an op returns once its
// work is enqueued, except where the host must see a result (sum_squares, lm_head_loss, id
// checks) or a host buffer takes part (copies and conversions to or from host memory), which
// synchronise.
//
// Memory: the device pool is plain cudaMalloc, the host pool pinned (cudaMallocHost); both
// zero-initialised at allocation, and nothing is allocated by an op. The backend itself holds a
// fixed cuBLASLt workspace and a few scratch words (fixed_device_bytes()).
//
// Tensors: activations and weights f32 or bf16 (one dtype per op), arithmetic in f32 (f64 for
// the row reductions the CPU reference does in f64); parameter gradients, lse, rstd and the
// optimizer's tensors f32. No CUDA header here: the C++ side of the engine includes this file.
#pragma once

#include <memory>

#include "shardlm/backend/backend.h"

namespace shardlm::cuda {

// The CUDA devices this process sees; 0 when none is usable.
int visible_devices();

class CudaBackend final : public Backend {
 public:
  // device_shared: other ranks of the run use this GPU too (driver_device_bytes).
  explicit CudaBackend(int device = 0, bool device_shared = false);
  ~CudaBackend() override;
  CudaBackend(const CudaBackend&) = delete;
  CudaBackend& operator=(const CudaBackend&) = delete;

  std::string name() const override { return "cuda"; }
  void* allocate(size_t bytes, MemPool pool) override;
  void deallocate(void* ptr, size_t bytes, MemPool pool) override;
  void synchronize() override;
  // Every stream or event synchronisation so far (synchronize() counts once, its copy stream
  // included).
  int64_t host_waits() const override;
  // bf16: the tensor cores' dense rate is the device's GEMM peak (every GPU this build targets
  // has bf16 tensor cores).
  DType peak_gemm_dtype(DType /*activation_dtype*/) const override { return DType::kBF16; }
  // The compute stream (a cudaStream_t) every op is enqueued on.
  void* device_stream() override;
  // "auto" and "cudnn": cuDNN's SDPA (cudnn_attention.h) for the calls it takes, the own
  // kernels for the rest; "own": the own kernels only. "cudnn" fails when cuDNN is unavailable.
  std::string select_attention(std::string_view impl) override;
  // Attention ops (forward and backward) cuDNN ran since construction.
  int64_t cudnn_attention_calls() const;
  // Why cuDNN declines this bf16 problem (cudnn_attention.h's SdpaShape); empty if it takes it.
  std::string cudnn_attention_declined(int64_t B, int64_t Tq, int64_t Tk, int64_t Hq, int64_t Hkv,
                                       int64_t Dh, bool causal);
  // The same for packed documents (`count` of at most max_len tokens in B rows of T) as the
  // ragged bucket they run in (sdpa_buckets.h's ragged_groups).
  std::string cudnn_ragged_declined(int64_t B, int64_t T, int64_t Hq, int64_t Hkv, int64_t Dh,
                                    int64_t count, int64_t max_len, int64_t window = 0);
  // Attention calls that found no graph built for their shape (a bucket the workspace query
  // missed; they ran on the own kernel). 0 in a run whose plan covered every bucket.
  int64_t cudnn_attention_unbuilt_calls() const;
  // Device bytes the backend holds outside the ledger (cuBLASLt workspace, scratch).
  size_t fixed_device_bytes() const;
  // The driver's used bytes now minus at the end of construction (the CUDA context,
  // fixed_device_bytes() and the kernels cuDNN loads while the workspace queries build its
  // graphs excluded). Every cudaMalloc is rounded up by the driver, so this is
  // the ledger's device total plus the rounding (and whatever else the process allocated).
  // Source "cudaMemGetInfo" (the device's used bytes) on a GPU of its own; on a shared one
  // "nvml_process" (this process's usedGpuMemory from NVML, nvml_process_memory.h), or no
  // figure and the reason where NVML has none.
  DriverDeviceBytes driver_device_bytes() const override;

  void wait_fence(uint64_t fence) override;
  void host_wait_fence(uint64_t fence) override;
  // Timing events on the compute stream, kMarksKept of them reused in turn (made on first use).
  uint64_t mark() override;
  double seconds_between(uint64_t a, uint64_t b) override;
  size_t attention_workspace_bytes(int64_t B, int64_t T, int64_t Hq, int64_t Hkv,
                                   int64_t Dh) const override;
  size_t attention_block_workspace_bytes(int64_t B, int64_t Tq, int64_t Tk, int64_t Hq, int64_t Hkv,
                                         int64_t Dh) const override;
  size_t attention_plan_workspace_bytes(int64_t B, int64_t T, int64_t Hq, int64_t Hkv, int64_t Dh,
                                        std::span<const int64_t> windows) const override;
  size_t attention_block_plan_workspace_bytes(int64_t B, int64_t Tq, int64_t Tk, int64_t Hq,
                                              int64_t Hkv, int64_t Dh,
                                              std::span<const int64_t> windows) const override;
  size_t attention_decode_workspace_bytes(int64_t B, int64_t Tq, int64_t Tmax, int64_t Hq,
                                          int64_t Dh) const override;
  size_t xent_slice_workspace_bytes(int64_t n) const override;

  struct Impl;

 private:
  void do_zero(const Tensor& x) override;
  void do_copy(const Tensor& src, const Tensor& dst) override;
  // One kernel between device tensors; a copy per block where host memory takes part.
  void do_copy_blocks(const Tensor& src, const Tensor& dst, const BlockCopy& layout) override;
  // On the copy stream, after an event on the compute stream; fences are events on it.
  uint64_t do_copy_async(const Tensor& src, const Tensor& dst) override;
  void do_convert(const Tensor& src, const Tensor& dst) override;
  void do_add(const Tensor& a, const Tensor& b, const Tensor& out) override;
  void do_scale(const Tensor& x, float s) override;
  void do_scale_rows(const Tensor& x, const Tensor& s) override;
  double do_sum_squares(const Tensor& x) override;
  void do_sum_squares_segments(std::span<const Tensor> xs, std::span<double> sums) override;
  void do_nf4_dequantize(const Tensor& codes, const Tensor& absmax, const Tensor& out) override;
  void do_dropout(const Tensor& x, const Tensor& out, float p, uint64_t seed, int64_t first,
                  int64_t width, int64_t row_stride) override;
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
  LossResult do_xent_slice_finish(const Tensor& logits, const Tensor& targets, int64_t vocab_begin,
                                  const Tensor& row_max, const Tensor& stats, float grad_scale,
                                  bool want_grad, Workspace ws, float softcap) override;
  void do_adamw_step(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v,
                     const AdamWHyper& hyper) override;
  void do_adamw_step_segments(std::span<const AdamWSegment> segments,
                              const AdamWHyper& hyper) override;
  // cuda_preference_ops.cpp
  void do_segment_logp_sums(const Tensor& row_max, const Tensor& stats, const Tensor& segments,
                            const Tensor& sums) override;
  void do_preference_coefficients(const PreferenceLossSpec& loss, const Tensor& policy,
                                  const Tensor& reference, double norm, const Tensor& coef,
                                  const Tensor& metrics) override;
  void do_gather_segment_weights(const Tensor& coef, const Tensor& segments,
                                 const Tensor& weights) override;

  std::unique_ptr<Impl> impl_;
};

}  // namespace shardlm::cuda
