// Tensor: a non-owning, contiguous, row-major view (pointer, dtype, shape, pool).
// Owning storage is a Buffer (buffer.h); views never free anything.
#pragma once

#include <cstddef>
#include <cstdint>

#include "shardlm/core/check.h"
#include "shardlm/core/device.h"
#include "shardlm/core/dtype.h"
#include "shardlm/core/shape.h"

namespace shardlm {

class Tensor {
 public:
  Tensor() = default;
  Tensor(void* data, DType dtype, Shape shape, MemPool pool = MemPool::kDevice)
      : data_(data), dtype_(dtype), shape_(shape), pool_(pool) {}

  void* data() const { return data_; }
  DType dtype() const { return dtype_; }
  const Shape& shape() const { return shape_; }
  MemPool pool() const { return pool_; }
  int64_t numel() const { return shape_.numel(); }
  size_t bytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype_); }
  bool empty() const { return data_ == nullptr; }
  int64_t dim(int i) const { return shape_[i]; }
  int rank() const { return shape_.rank(); }

  float* f32() const {
    SHARDLM_CHECK(dtype_ == DType::kF32, "expected an f32 tensor, got {}", dtype_name(dtype_));
    return static_cast<float*>(data_);
  }
  uint16_t* bf16() const {
    SHARDLM_CHECK(dtype_ == DType::kBF16, "expected a bf16 tensor, got {}", dtype_name(dtype_));
    return static_cast<uint16_t*>(data_);
  }
  int32_t* i32() const {
    SHARDLM_CHECK(dtype_ == DType::kI32, "expected an i32 tensor, got {}", dtype_name(dtype_));
    return static_cast<int32_t*>(data_);
  }
  double* f64() const {
    SHARDLM_CHECK(dtype_ == DType::kF64, "expected an f64 tensor, got {}", dtype_name(dtype_));
    return static_cast<double*>(data_);
  }
  int64_t* i64() const {
    SHARDLM_CHECK(dtype_ == DType::kI64, "expected an i64 tensor, got {}", dtype_name(dtype_));
    return static_cast<int64_t*>(data_);
  }

  // Same bytes seen with another shape of equal element count.
  Tensor view(Shape shape) const {
    SHARDLM_CHECK(shape.numel() == numel(), "cannot view {} as {}", shape_.str(), shape.str());
    return Tensor(data_, dtype_, shape, pool_);
  }
  // Rows [begin, begin+count) along dim 0.
  Tensor rows(int64_t begin, int64_t count) const;

 private:
  void* data_ = nullptr;
  DType dtype_ = DType::kF32;
  Shape shape_;
  MemPool pool_ = MemPool::kDevice;
};

}  // namespace shardlm
