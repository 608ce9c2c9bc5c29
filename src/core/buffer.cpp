// Buffer ownership: allocation through the backend, recorded in the ledger.
#include "shardlm/core/buffer.h"

#include <utility>

namespace shardlm {

Buffer::Buffer(Allocator& alloc, MemoryLedger& ledger, MemCategory cat, MemPool pool, size_t bytes)
    : alloc_(&alloc), ledger_(&ledger), bytes_(bytes), cat_(cat), pool_(pool) {
  if (bytes == 0) return;
  ledger.on_alloc(cat, pool, static_cast<int64_t>(bytes));  // throws before allocating
  try {
    data_ = static_cast<std::byte*>(alloc.allocate(bytes, pool));
  } catch (...) {
    ledger.on_free(cat, pool, static_cast<int64_t>(bytes));
    throw;
  }
}

Buffer& Buffer::operator=(Buffer&& o) noexcept {
  if (this != &o) {
    reset();
    alloc_ = std::exchange(o.alloc_, nullptr);
    ledger_ = std::exchange(o.ledger_, nullptr);
    data_ = std::exchange(o.data_, nullptr);
    bytes_ = std::exchange(o.bytes_, 0);
    cat_ = o.cat_;
    pool_ = o.pool_;
  }
  return *this;
}

void Buffer::reset() {
  if (data_ != nullptr) {
    alloc_->deallocate(data_, bytes_, pool_);
    ledger_->on_free(cat_, pool_, static_cast<int64_t>(bytes_));
  }
  data_ = nullptr;
  bytes_ = 0;
}

Tensor Buffer::view(DType dtype, Shape shape, size_t byte_offset) const {
  const size_t need = static_cast<size_t>(shape.numel()) * dtype_size(dtype);
  SHARDLM_CHECK(byte_offset + need <= bytes_, "view of {} B at offset {} exceeds a {} B buffer",
                need, byte_offset, bytes_);
  return Tensor(data_ + byte_offset, dtype, shape, pool_);
}

}  // namespace shardlm
