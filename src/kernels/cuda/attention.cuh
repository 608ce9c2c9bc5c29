// Flash attention on CUDA: the seam between the CUDA backend (cuda_backend.*, which owns the
// streams and calls these on its compute stream) and the attention kernels (attention*.cu).
// Semantics, shapes and masking are exactly those of the Backend methods of the same names
// (shardlm/backend/backend.h); the CPU backend is the reference. q, k, v, out, dout, dq, dk, dv
// are bf16 (the fast path) or f32 (all of one call the same dtype); lse is f32; seg_start,
// positions i32. All pointers are device memory. Nothing is allocated: scratch comes in `ws`,
// sized by the matching *_workspace_bytes function. Launches are asynchronous on `stream`.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "shardlm/backend/backend.h"

namespace shardlm::cuda {

size_t attention_workspace_bytes(int64_t B, int64_t T, int64_t Hq, int64_t Hkv, int64_t Dh);
void attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& seg_start,
                       const Tensor& out, const Tensor& lse, Workspace ws, cudaStream_t stream);
void attention_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& seg_start,
                        const Tensor& out, const Tensor& lse, const Tensor& dout, const Tensor& dq,
                        const Tensor& dk, const Tensor& dv, Workspace ws, cudaStream_t stream);

size_t attention_block_workspace_bytes(int64_t B, int64_t Tq, int64_t Tk, int64_t Hq, int64_t Hkv,
                                       int64_t Dh);
void attention_block_forward(const Tensor& q, const Tensor& k, const Tensor& v,
                             const Tensor& seg_start, int64_t q_offset, int64_t k_offset,
                             const Tensor& out, const Tensor& lse, Workspace ws,
                             cudaStream_t stream);
void attention_block_backward(const Tensor& q, const Tensor& k, const Tensor& v,
                              const Tensor& seg_start, int64_t q_offset, int64_t k_offset,
                              const Tensor& out, const Tensor& lse, const Tensor& dout,
                              const Tensor& dq, const Tensor& dk, const Tensor& dv, Workspace ws,
                              cudaStream_t stream);
void attention_merge(const Tensor& out, const Tensor& lse, const Tensor& out_b, const Tensor& lse_b,
                     cudaStream_t stream);

size_t attention_decode_workspace_bytes(int64_t B, int64_t Tq, int64_t Tmax, int64_t Hq,
                                        int64_t Dh);
void attention_decode(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                      int64_t cache_len, const Tensor& out, Workspace ws, cudaStream_t stream);

}  // namespace shardlm::cuda
