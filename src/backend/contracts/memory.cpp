// The contracts of the memory-movement ops: zero, copy, copy_async, copy_blocks and convert. Any
// pools on either side; the element count, not the shape, must agree (copy_blocks: every block
// inside its tensor).
#include <algorithm>
#include <array>

#include "backend/contracts/checks.h"

namespace shardlm {
namespace {

using namespace contract;  // NOLINT: the contract helpers are this file's vocabulary

// src, dst: same numel, backed by memory unless empty; same dtype unless converting; the same
// memory or none in common (a memcpy of partly overlapping ranges is undefined).
void check_transfer(const Tensor& src, const Tensor& dst, bool converting, std::string_view op) {
  SHARDLM_CHECK(src.numel() == dst.numel(), "{}: src {} and dst {} differ in element count", op,
                src.shape().str(), dst.shape().str());
  SHARDLM_CHECK((!src.empty() && !dst.empty()) || src.numel() == 0,
                "{}: src or dst has no data; pass allocated tensors", op);
  if (!converting) {
    SHARDLM_CHECK(src.dtype() == dst.dtype(), "{}: src is {} but dst is {}; use convert", op,
                  dtype_name(src.dtype()), dtype_name(dst.dtype()));
  }
  if (src.numel() == 0 || src.data() == dst.data() || src.dtype() != dst.dtype()) return;
  const auto* s = static_cast<const std::byte*>(src.data());
  const auto* d = static_cast<const std::byte*>(dst.data());
  const size_t bytes = src.bytes();
  SHARDLM_CHECK(d + bytes <= s || s + bytes <= d, "{}: src and dst overlap partially", op);
}

// Elements spanned by the blocks of `layout` at `stride` (one past the last element read or
// written), after checking the strides are >= 0.
int64_t block_extent(const BlockCopy& layout, const int64_t (&stride)[3], const char* side) {
  int64_t last = 0;
  for (int d = 0; d < 3; ++d) {
    SHARDLM_CHECK(stride[d] >= 0, "copy_blocks: {} stride {} is {}; strides are >= 0", side, d,
                  stride[d]);
    last += (layout.n[d] - 1) * stride[d];
  }
  return last + layout.block;
}

// dst blocks nest without overlap: the dims with more than one block, sorted by stride, each
// with a stride at least the extent of the block and the dims inside it.
void check_dst_nesting(const BlockCopy& layout) {
  std::array<int, 3> order{0, 1, 2};
  std::stable_sort(order.begin(), order.end(),
                   [&](int a, int b) { return layout.dst[a] < layout.dst[b]; });
  int64_t extent = layout.block;
  for (int d : order) {
    if (layout.n[d] == 1) continue;
    SHARDLM_CHECK(layout.dst[d] >= extent,
                  "copy_blocks: dst stride {} ({}) is below the {} elements inside it; dst blocks "
                  "would overlap",
                  d, layout.dst[d], extent);
    extent = layout.dst[d] * layout.n[d];
  }
}

}  // namespace

void Backend::copy_blocks(const Tensor& src, const Tensor& dst, const BlockCopy& layout) {
  SHARDLM_CHECK(src.dtype() == dst.dtype(), "copy_blocks: src is {} but dst is {}",
                dtype_name(src.dtype()), dtype_name(dst.dtype()));
  SHARDLM_CHECK(layout.block >= 0 && layout.n[0] >= 0 && layout.n[1] >= 0 && layout.n[2] >= 0,
                "copy_blocks: {} x {} x {} blocks of {} elements; counts are >= 0", layout.n[0],
                layout.n[1], layout.n[2], layout.block);
  if (layout.block == 0 || layout.n[0] * layout.n[1] * layout.n[2] == 0) return;
  SHARDLM_CHECK(!src.empty() && !dst.empty(), "copy_blocks: src or dst has no data");
  const int64_t src_end = block_extent(layout, layout.src, "src");
  const int64_t dst_end = block_extent(layout, layout.dst, "dst");
  SHARDLM_CHECK(src_end <= src.numel() && dst_end <= dst.numel(),
                "copy_blocks: the blocks reach element {} of src {} and {} of dst {}", src_end,
                src.shape().str(), dst_end, dst.shape().str());
  check_dst_nesting(layout);
  const auto* s = static_cast<const std::byte*>(src.data());
  const auto* d = static_cast<const std::byte*>(dst.data());
  SHARDLM_CHECK(d + dst.bytes() <= s || s + src.bytes() <= d,
                "copy_blocks: src and dst share memory");
  do_copy_blocks(src, dst, layout);
}

void Backend::zero(const Tensor& x) {
  SHARDLM_CHECK(!x.empty() || x.numel() == 0, "zero: x {} has no data", x.shape().str());
  do_zero(x);
}

void Backend::copy(const Tensor& src, const Tensor& dst) {
  check_transfer(src, dst, false, "copy");
  do_copy(src, dst);
}

uint64_t Backend::copy_async(const Tensor& src, const Tensor& dst) {
  check_transfer(src, dst, false, "copy_async");
  return do_copy_async(src, dst);
}

void Backend::convert(const Tensor& src, const Tensor& dst) {
  check_transfer(src, dst, true, "convert");
  const auto is_float = [](DType t) { return t == DType::kF32 || t == DType::kBF16; };
  SHARDLM_CHECK(is_float(src.dtype()) && is_float(dst.dtype()),
                "convert: {} -> {} is not supported; only f32 <-> bf16", dtype_name(src.dtype()),
                dtype_name(dst.dtype()));
  do_convert(src, dst);
}

}  // namespace shardlm
