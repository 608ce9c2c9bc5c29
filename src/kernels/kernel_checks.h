// Shape and dtype preconditions shared by the CPU and CUDA backends, so that every kernel
// reports a bad argument the same way ("op: name must be ..."). Header-only; checks only, no
// computation.
#pragma once

#include <string_view>

#include "shardlm/core/check.h"
#include "shardlm/core/tensor.h"

namespace shardlm {

// A required tensor: given dtype and rank (rank < 0: any), and backed by memory unless it has
// no elements.
inline void check_tensor(const Tensor& t, DType dtype, int rank, std::string_view op,
                         std::string_view name) {
  SHARDLM_CHECK(t.dtype() == dtype, "{}: {} must be {}, got {}", op, name, dtype_name(dtype),
                dtype_name(t.dtype()));
  SHARDLM_CHECK(rank < 0 || t.rank() == rank, "{}: {} must have rank {}, got shape {}", op, name,
                rank, t.shape().str());
  SHARDLM_CHECK(!t.empty() || t.numel() == 0, "{}: {} {} has no data; pass an allocated tensor", op,
                name, t.shape().str());
}

// Two tensors that must have the same shape (elementwise operands, a tensor and its gradient).
inline void check_same_shape(const Tensor& a, const Tensor& b, std::string_view op,
                             std::string_view a_name, std::string_view b_name) {
  SHARDLM_CHECK(a.shape() == b.shape(), "{}: {} {} and {} {} must have the same shape", op, a_name,
                a.shape().str(), b_name, b.shape().str());
}

}  // namespace shardlm
