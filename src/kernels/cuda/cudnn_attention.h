// cuDNN's fused scaled-dot-product attention (the frontend graph API's SDPA forward and
// backward) as the CUDA backend's attention ops call it; no cuDNN header here. The build picks
// one implementation: cudnn/cudnn_attention.cpp (cuDNN 9 and its frontend found) or
// cudnn/cudnn_unavailable.cpp (either missing: every shape is declined, saying why). A declined
// shape runs on the backend's own kernel (attention.cu), which stays the reference.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "kernels/cuda/host/sdpa_buckets.h"

namespace shardlm::cuda {

// The packed documents of a ragged SdpaShape on the device, i32, `docs` (+ 1) entries each:
// seq_len [docs] tokens of each sequence; q_off, kv_off [docs + 1] element offsets of each
// sequence's first token in q/out (x Hq * Dh) and in k/v (x Hkv * Dh); lse_off [docs + 1] the
// offset of its first query's stats in the token-major [B * T, Hq] (token * Hq). Token-major,
// because cuDNN 9.14's ragged backward reads head-major stats (heads T apart) wrongly on an
// H100 (all-zero gradients), though its forward writes them right.
struct RaggedIndex {
  int32_t* seq_len = nullptr;
  int32_t* q_off = nullptr;
  int32_t* kv_off = nullptr;
  int32_t* lse_off = nullptr;
};

class CudnnAttention {
 public:
  // A cuDNN handle on `stream`. Never throws: when cuDNN is missing or does not start,
  // available() is false and status() says why.
  explicit CudnnAttention(cudaStream_t stream);
  ~CudnnAttention();
  CudnnAttention(const CudnnAttention&) = delete;
  CudnnAttention& operator=(const CudnnAttention&) = delete;

  bool available() const;
  // "cuDNN 9.19.0, frontend 1.32.0", or why cuDNN is unavailable.
  std::string status() const;
  // Why this GPU and cuDNN take no packed documents as ragged sequences (ragged_unsupported),
  // empty when they do.
  std::string ragged_refused() const;
  // The workspace bytes the forward and backward graphs of `s` need (the larger, as
  // get_workspace_size says), building both on first sight; nullopt when cuDNN declines the
  // shape (a graph does not build, or its workspace query fails). Plan and setup time only: the
  // run's whole bucket set (sdpa_buckets.h) is built here, before the first step.
  std::optional<size_t> workspace_bytes(const SdpaShape& s);
  // Why cuDNN declines `s` (empty when it takes it); builds like workspace_bytes.
  std::string declined(const SdpaShape& s);
  // Enqueue the forward (out, lse) or backward (dq, dk, dv overwritten) on the stream, with the
  // graphs workspace_bytes built: these never build one. false, with nothing enqueued, when the
  // shape is declined, was never built (counted in unbuilt_calls) or ws_bytes is short of its
  // workspace. A ragged shape (docs > 0) reads `ragged`, filled before on the same stream.
  bool forward(const SdpaShape& s, const void* q, const void* k, const void* v, void* out,
               float* lse, void* ws, size_t ws_bytes, const RaggedIndex& ragged = {});
  bool backward(const SdpaShape& s, const void* q, const void* k, const void* v, const void* out,
                const float* lse, const void* dout, void* dq, void* dk, void* dv, void* ws,
                size_t ws_bytes, const RaggedIndex& ragged = {});
  // Calls that found no built graph for their shape (a bucket the plan missed): they ran on the
  // own kernel. The GPU tests require 0.
  int64_t unbuilt_calls() const;

  struct State;

 private:
  std::unique_ptr<State> st_;
};

}  // namespace shardlm::cuda
