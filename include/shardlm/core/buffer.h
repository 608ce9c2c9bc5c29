// Buffer: the one owner of engine memory. It asks an Allocator (implemented by each backend)
// for bytes and records them in the MemoryLedger under a category and pool; the destructor
// returns both. Move-only.
#pragma once

#include <cstddef>
#include <cstdint>

#include "shardlm/core/ledger.h"
#include "shardlm/core/tensor.h"

namespace shardlm {

// Raw memory source; a backend provides one per pool (device memory, pinned host memory).
class Allocator {
 public:
  virtual ~Allocator() = default;
  // Returns zero-initialised, 64-byte aligned memory, or throws Error(kOutOfMemory).
  virtual void* allocate(size_t bytes, MemPool pool) = 0;
  virtual void deallocate(void* ptr, size_t bytes, MemPool pool) = 0;
};

class Buffer {
 public:
  Buffer() = default;
  Buffer(Allocator& alloc, MemoryLedger& ledger, MemCategory cat, MemPool pool, size_t bytes);
  ~Buffer() { reset(); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  Buffer(Buffer&& o) noexcept { *this = std::move(o); }
  Buffer& operator=(Buffer&& o) noexcept;

  void reset();
  std::byte* data() const { return data_; }
  size_t bytes() const { return bytes_; }
  MemPool pool() const { return pool_; }
  MemCategory category() const { return cat_; }
  bool empty() const { return data_ == nullptr; }

  // A view of `shape` elements of `dtype` starting `byte_offset` bytes in.
  Tensor view(DType dtype, Shape shape, size_t byte_offset = 0) const;

 private:
  Allocator* alloc_ = nullptr;
  MemoryLedger* ledger_ = nullptr;
  std::byte* data_ = nullptr;
  size_t bytes_ = 0;
  MemCategory cat_ = MemCategory::kWorkspace;
  MemPool pool_ = MemPool::kDevice;
};

inline constexpr size_t kAlignBytes = 64;
inline constexpr size_t align_up(size_t n, size_t a = kAlignBytes) { return (n + a - 1) / a * a; }

}  // namespace shardlm
