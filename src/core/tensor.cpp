// Slicing of tensor views.
#include "shardlm/core/tensor.h"

namespace shardlm {

Tensor Tensor::rows(int64_t begin, int64_t count) const {
  SHARDLM_CHECK(shape_.rank() >= 1, "rows() of a rank-0 tensor");
  SHARDLM_CHECK(begin >= 0 && count >= 0 && begin + count <= shape_[0],
                "rows [{}, {}) out of range for {}", begin, begin + count, shape_.str());
  const int64_t row_elems = shape_[0] == 0 ? 0 : numel() / shape_[0];
  Shape s;
  switch (shape_.rank()) {
    case 1:
      s = Shape{count};
      break;
    case 2:
      s = Shape{count, shape_[1]};
      break;
    case 3:
      s = Shape{count, shape_[1], shape_[2]};
      break;
    case 4:
      s = Shape{count, shape_[1], shape_[2], shape_[3]};
      break;
    default:
      SHARDLM_CHECK(false, "rows() supports rank <= 4, got {}", shape_.rank());
  }
  auto* base = static_cast<std::byte*>(data_);
  return Tensor(base + begin * row_elems * dtype_size(dtype_), dtype_, s, pool_);
}

}  // namespace shardlm
