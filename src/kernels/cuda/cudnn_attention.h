// cuDNN's fused scaled-dot-product attention (the frontend graph API's SDPA forward and
// backward) as the CUDA backend's attention ops call it; no cuDNN header here. The build picks
// one implementation: cudnn/cudnn_attention.cpp (cuDNN 9 and its frontend found) or
// cudnn/cudnn_unavailable.cpp (either missing: every shape is declined, saying why). A declined
// shape runs on the backend's own kernel (attention.cu), which stays the reference.
#pragma once

#include <cuda_runtime.h>

#include <compare>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

namespace shardlm::cuda {

// One bf16 SDPA problem in the Backend's layouts: q [B, Tq, Hq, Dh]; k, v [B, Tk, Hkv, Dh];
// out like q; lse [B, Hq, Tq] f32, the natural-log log-sum-exp of the scaled scores (cuDNN's
// softmax stats: the units and layout the ring and merge read), except for packed documents,
// whose stats are token-major [B * T, Hq] (the caller transposes; see RaggedIndex). Scale
// 1/sqrt(Dh). causal: query t sees key s iff s <= t (a whole row, or the diagonal block of one,
// Tq == Tk); else every key. Packed documents (docs > 0, causal, Tq == Tk = T): the B rows'
// tokens are `docs` sequences of at most max_len tokens each (cuDNN's ragged layout), each causal
// on its own, described on the device by a RaggedIndex; docs and max_len are buckets
// (launch_ragged_index pads the rest with empty sequences), so that few graphs serve every
// batch. window > 0 (causal only): a sliding window on top, query t sees key s iff also
// t - s < window (the frontend's diagonal band left bound, top-left aligned: column + window >
// row, transformers' convention); 0: none.
struct SdpaShape {
  int64_t B = 0, Tq = 0, Tk = 0, Hq = 0, Hkv = 0, Dh = 0;
  bool causal = true;
  int64_t docs = 0, max_len = 0;
  int64_t window = 0;
  auto operator<=>(const SdpaShape&) const = default;
};

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

// The largest workspace cuDNN may ask for a shape before it is declined: two f32 copies of dq
// and four f32 statistics per query row and head, rows padded to a 256-query tile, and 1 MiB.
// cuDNN 9.14's backward on an H100 asks 2 x 4 B Hq T Dh + 4 B Hq T + 256 bytes (its dq
// accumulator and softmax sums).
size_t sdpa_workspace_cap(const SdpaShape& s);

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
  // The workspace bytes the forward and backward graphs of `s` need (the larger), building and
  // caching both on first sight; nullopt when cuDNN declines the shape (a graph does not build,
  // or needs more than sdpa_workspace_cap).
  std::optional<size_t> workspace_bytes(const SdpaShape& s);
  // Why cuDNN declines `s` (empty when it takes it).
  std::string declined(const SdpaShape& s);
  // Enqueue the forward (out, lse) or backward (dq, dk, dv overwritten) on the stream. false,
  // with nothing enqueued, when the shape is declined or ws_bytes is short of its workspace.
  // A ragged shape (docs > 0) reads `ragged`, filled before on the same stream.
  bool forward(const SdpaShape& s, const void* q, const void* k, const void* v, void* out,
               float* lse, void* ws, size_t ws_bytes, const RaggedIndex& ragged = {});
  bool backward(const SdpaShape& s, const void* q, const void* k, const void* v, const void* out,
                const float* lse, const void* dout, void* dq, void* dk, void* dv, void* ws,
                size_t ws_bytes, const RaggedIndex& ragged = {});

  struct State;

 private:
  std::unique_ptr<State> st_;
};

}  // namespace shardlm::cuda
