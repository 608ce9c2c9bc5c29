// Private to the CUDA backend's files: the state behind CudaBackend (streams, cuBLASLt, scratch
// and staging buffers, copy fences) and the CUDA-specific checks and error helpers every op
// family shares. cuda_backend.cpp owns the lifecycle, memory and elementwise ops;
// cuda_linear.cpp the GEMMs and embeddings; cuda_norm.cpp RMSNorm, RoPE and SwiGLU;
// cuda_attention_ops.cpp attention (cuDNN's SDPA or the own kernels); cuda_loss_ops.cpp the LM
// head and vocabulary-parallel losses.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <string_view>
#include <thread>
#include <vector>

#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/cudnn_attention.h"
#include "kernels/cuda/launch.h"
#include "kernels/cuda/nvml_process_memory.h"
#include "kernels/cuda/plan_cache.h"

namespace shardlm::cuda {

inline void cuda_ok(cudaError_t e, std::string_view what) {
  if (e != cudaSuccess) {
    SHARDLM_FAIL(ErrorKind::kInternal, "CUDA error in {}: {} ({})", what, cudaGetErrorString(e),
                 cudaGetErrorName(e));
  }
}

inline void lt_ok(cublasStatus_t s, std::string_view what) {
  if (s != CUBLAS_STATUS_SUCCESS) {
    SHARDLM_FAIL(ErrorKind::kInternal, "cuBLASLt error in {}: {} (status {}): {}", what,
                 cublasLtGetStatusName(s), int(s), cublasLtGetStatusString(s));
  }
}

inline constexpr size_t kLtWorkspaceBytes = size_t(32) << 20;  // cuBLASLt's advice for Hopper
inline constexpr int64_t kStageElems = int64_t(1) << 20;       // host<->device conversion staging
inline constexpr int kFenceEvents = 64;                        // copy_async fences kept as events
// GEMM plans kept (a training step has a few dozen shapes: the layers share theirs).
inline constexpr size_t kGemmPlanCapacity = 256;

inline Elem elem_of(DType t) { return t == DType::kBF16 ? Elem::kBF16 : Elem::kF32; }

// The CUDA backend's own rule: the kernels read and write device memory.
inline void on_device(const Tensor& t, std::string_view op, std::string_view name) {
  SHARDLM_CHECK(t.pool() == MemPool::kDevice || t.numel() == 0,
                "{}: {} lives in host memory; the CUDA backend computes on device tensors", op,
                name);
}

// The element type of a float tensor (f32 or bf16: the entry point checked it) on the device.
inline Elem elem(const Tensor& t, std::string_view op, std::string_view name) {
  on_device(t, op, name);
  return elem_of(t.dtype());
}

inline cudaDataType_t lt_type(Elem e) { return e == Elem::kBF16 ? CUDA_R_16BF : CUDA_R_32F; }

// One GEMM shape's cuBLASLt objects (cuda_linear.cpp makes them): the matmul descriptor (its
// bias pointer set per call), the A, B and C/D layouts and the algorithm the heuristic chose.
// Owns the descriptors: destroyed with the plan.
struct GemmPlan {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulAlgo_t algo{};

  GemmPlan() = default;
  GemmPlan(GemmPlan&& o) noexcept : op(o.op), a(o.a), b(o.b), c(o.c), algo(o.algo) {
    o.op = nullptr;
    o.a = o.b = o.c = nullptr;
  }
  GemmPlan(const GemmPlan&) = delete;
  GemmPlan& operator=(const GemmPlan&) = delete;
  GemmPlan& operator=(GemmPlan&&) = delete;
  ~GemmPlan() {
    if (c) cublasLtMatrixLayoutDestroy(c);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (op) cublasLtMatmulDescDestroy(op);
  }
};

// Sums read back at once by sum_squares_segments (more take another copy and wait): far more
// than the segments of a step's gradient norm (the ZeRO engine's same-decay stretches, split
// at the replicated ranges: a few per layer), so that the norm is one wait at any model size.
inline constexpr size_t kSegmentSums = 4096;

// The id checks, whose flags are read with a result instead of on their own (a wait each): the
// embedding's (forward and backward), lm_head_loss's targets, the vocabulary-parallel loss's
// (xent_slice_stats and xent_slice_fold) and the preference ops' segment ids; in the order they
// are reported.
enum class IdCheck : uint8_t {
  kEmbeddingForward,
  kLossTargets,
  kSliceTargets,
  kEmbeddingBackward,
  kSegments,
};
inline constexpr int kIdChecks = 5;

// What lm_head_loss reads back in one copy: its totals, then each IdCheck's first bad id
// (kNoBadId when none). The other results the host reads copy `bad` along with theirs.
struct ResultWords {
  double loss_sum = 0;
  double n_valid = 0;
  uint64_t bad[kIdChecks] = {};
};

// How a flagged id is named in its error: the op, the kind of id, the vocabulary and whether
// the ignore index is allowed (the last flag_ids call of that check says).
struct IdCheckText {
  std::string_view op, what;
  int64_t V = 0;
  bool allow_ignore = false;
};

struct CudaBackend::Impl {
  int device = 0;
  cudaStream_t stream = nullptr;
  cublasLtHandle_t lt = nullptr;
  void* lt_ws = nullptr;
  double* d_scratch = nullptr;     // [kSumBlocks] partials, then [kSegmentSums] results
  double* h_scratch = nullptr;     // pinned [kSegmentSums]
  ResultWords* d_words = nullptr;  // device; bad[] starts at kNoBadId
  ResultWords* h_words = nullptr;  // pinned, its copy
  IdCheckText id_text[kIdChecks];  // see flag_ids
  // The thread that queues the checked ops (the compute thread, or a queued backend's), the one
  // that reads their flags; other threads' copies (the ZeRO worker's) leave them alone.
  std::atomic<std::thread::id> flag_thread{};
  bool reads_flags() const { return flag_thread.load() == std::this_thread::get_id(); }

  // d_words' parts as device addresses (by offset: the host never dereferences device memory).
  double* d_totals() const {  // [2] loss_sum, n_valid
    static_assert(offsetof(ResultWords, n_valid) == offsetof(ResultWords, loss_sum) + 8);
    return reinterpret_cast<double*>(reinterpret_cast<std::byte*>(d_words) +
                                     offsetof(ResultWords, loss_sum));
  }
  uint64_t* d_bad() const {  // [kIdChecks]
    return reinterpret_cast<uint64_t*>(reinterpret_cast<std::byte*>(d_words) +
                                       offsetof(ResultWords, bad));
  }
  void* h_stage = nullptr;                // pinned, kStageElems * 4 bytes
  int64_t used_at_start = 0;              // driver_used() after construction (-1: unavailable)
  cudaStream_t copy_stream = nullptr;     // copy_async's, non-blocking
  cudaEvent_t copy_after = nullptr;       // recorded on stream, waited for by copy_stream
  cudaEvent_t fences[kFenceEvents] = {};  // fence f is fences[f % kFenceEvents]
  uint64_t fence_count = 0;               // the last fence issued
  std::vector<cudaEvent_t> marks;         // [kMarksKept] timing events; mark m is marks[m % n]
  uint64_t mark_count = 0;                // the last mark recorded
  std::unique_ptr<CudnnAttention> cudnn;  // its handle on `stream`; may be unavailable
  bool attention_own_only = false;        // train.attention = "own"
  int64_t cudnn_calls = 0;                // attention ops cuDNN ran (forward and backward)
  // The planned attention workspace of each query (the shape, the windows and the form), so that
  // the entry points' check in a step looks it up instead of walking the buckets and asking the
  // driver; cleared by select_attention. Behind its lock: the query may come from any thread.
  std::map<std::vector<int64_t>, size_t> attention_plans;
  std::mutex attention_plans_mu;
  PlanCache<GemmKey, GemmPlan, GemmKeyHash> gemm_plans{kGemmPlanCapacity};  // cuda_linear.cpp
  // The driver's count of this process's device memory: NVML's figure for it where other ranks
  // share the GPU (null otherwise: cudaMemGetInfo's device-wide used bytes).
  std::unique_ptr<NvmlProcessMemory> nvml;

  // Every wait of the host for the device (a stream or event synchronisation), counted for
  // Backend::host_waits; atomic: copies also come from the ZeRO worker thread.
  std::atomic<int64_t> host_waits{0};

  void sync() {
    ++host_waits;
    cuda_ok(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  }
  // The driver's count now (see nvml; -1: unavailable) (cuda_backend.cpp).
  int64_t driver_used() const;
  // Takes what the count grew by since `before` (driver_used()) into the baseline: memory the
  // ledger never holds (cuDNN's kernels).
  void exclude_driver_growth(int64_t before);
  // Ids outside [0, V) (other than kIgnoreIndex when allowed) are a data error naming the first
  // position, checked without a wait: the first bad id goes into d_words->bad[which], and the
  // next result this thread reads (lm_head_loss, xent_slice_finish, sum_squares, the gradient
  // norm's sum_squares_segments, a copy to host memory: a step's loss and norm come before the
  // optimizer applies it) raises it as the same data error. The op then runs and skips the bad
  // ids (zero rows, no loss).
  void flag_ids(const Tensor& ids, int64_t V, bool allow_ignore, IdCheck which, std::string_view op,
                std::string_view what);
  // Queues the copy of d_words->bad into h_words->bad, for a result read to take along before
  // its wait; raise_flagged_ids() after the wait raises the first flagged check, if any, after
  // setting the flags back to kNoBadId. Both only on the flagging thread (reads_flags()).
  void copy_id_flags(std::string_view op);
  void raise_flagged_ids();
  // Column-major C[m, n] = op(A)[m, k] op(B)[k, n] + beta C (+ bias[m] on every column), on
  // the compute stream with cuBLASLt, the shape's plan from gemm_plans (cuda_linear.cpp). With
  // a residual (beta 1): C = op(A) op(B) (+ bias) + residual, the residual [m, n] (leading
  // dimension ldc, type ct) a buffer apart from C.
  void gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, const void* A, Elem at, int64_t lda,
            const void* B, Elem bt, int64_t ldb, void* C, Elem ct, int64_t ldc, float beta,
            const void* bias, std::string_view what, const void* residual = nullptr);
};

}  // namespace shardlm::cuda
