// The contracts of the memory-movement ops: zero, copy, copy_async and convert. Any pools on
// either side; the element count, not the shape, must agree.
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

}  // namespace

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
