// The helpers of the Backend entry points' argument checks (src/backend/contracts/*.cpp), so
// that every op reports a bad argument the same way ("op: name must be ..."). Checks only, no
// computation; private to the contract files.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

#include "shardlm/backend/backend.h"
#include "shardlm/core/check.h"
#include "shardlm/core/tensor.h"

namespace shardlm::contract {

// Rank (< 0: any), and backed by memory unless it has no elements.
inline void check_rank_and_data(const Tensor& t, int rank, std::string_view op,
                                std::string_view name) {
  SHARDLM_CHECK(rank < 0 || t.rank() == rank, "{}: {} must have rank {}, got shape {}", op, name,
                rank, t.shape().str());
  SHARDLM_CHECK(!t.empty() || t.numel() == 0, "{}: {} {} has no data; pass an allocated tensor", op,
                name, t.shape().str());
}

// A required tensor of one dtype.
inline void check_tensor(const Tensor& t, DType dtype, int rank, std::string_view op,
                         std::string_view name) {
  SHARDLM_CHECK(t.dtype() == dtype, "{}: {} must be {}, got {}", op, name, dtype_name(dtype),
                dtype_name(t.dtype()));
  check_rank_and_data(t, rank, op, name);
}

// A required tensor of a float dtype: f32 or bf16 (which a backend computes on is its own rule).
inline void check_float(const Tensor& t, int rank, std::string_view op, std::string_view name) {
  SHARDLM_CHECK(t.dtype() == DType::kF32 || t.dtype() == DType::kBF16,
                "{}: {} must be f32 or bf16, got {}", op, name, dtype_name(t.dtype()));
  check_rank_and_data(t, rank, op, name);
}

// A float tensor of `ref`'s dtype: one dtype per op for its activations and weights.
inline void check_like(const Tensor& t, const Tensor& ref, int rank, std::string_view op,
                       std::string_view name, std::string_view ref_name) {
  check_float(t, rank, op, name);
  SHARDLM_CHECK(t.dtype() == ref.dtype(), "{}: {} is {} but {} is {}; one dtype per op", op, name,
                dtype_name(t.dtype()), ref_name, dtype_name(ref.dtype()));
}

// Two tensors that must have the same shape (elementwise operands, a tensor and its gradient).
inline void check_same_shape(const Tensor& a, const Tensor& b, std::string_view op,
                             std::string_view a_name, std::string_view b_name) {
  SHARDLM_CHECK(a.shape() == b.shape(), "{}: {} {} and {} {} must have the same shape", op, a_name,
                a.shape().str(), b_name, b.shape().str());
}

// An output that does not share memory with an input (a GEMM reads its inputs while it writes).
inline void check_disjoint(const Tensor& out, const Tensor& in, std::string_view op,
                           std::string_view out_name, std::string_view in_name) {
  const auto* o = static_cast<const std::byte*>(out.data());
  const auto* i = static_cast<const std::byte*>(in.data());
  const bool overlap = o != nullptr && i != nullptr && out.pool() == in.pool() &&
                       o < i + in.bytes() && i < o + out.bytes();
  SHARDLM_CHECK(!overlap, "{}: {} {} shares memory with {} {}; give the output its own buffer", op,
                out_name, out.shape().str(), in_name, in.shape().str());
}

// The scratch an op needs (`need`, from the backend's query `sizing`), which depends on the
// backend's workspace_threads() where that is more than 1.
inline void check_workspace(const Workspace& ws, size_t need, int threads, std::string_view op,
                            std::string_view sizing) {
  SHARDLM_CHECK(ws.bytes >= need && (ws.data != nullptr || need == 0),
                "{}: workspace has {} bytes, needs {}{}; size it with {}()", op, ws.bytes, need,
                threads > 1 ? fmt::format(" for {} threads", threads) : std::string(), sizing);
}

}  // namespace shardlm::contract
