// Element access for the CPU kernels that take f32 or bf16 storage. Arithmetic is always f32:
// load() reads an element as f32, store() writes an f32 rounded to the storage type (bf16:
// nearest even, as convert does), and with_float() runs a kernel body templated on the storage
// type of a tensor. Internal to src/kernels/cpu; no allocation.
#pragma once

#include <cstdint>
#include <type_traits>

#include "shardlm/core/check.h"
#include "shardlm/core/dtype.h"
#include "shardlm/core/tensor.h"

namespace shardlm::cpu {

// bf16 storage is the upper half of an f32's bits.
using bf16_t = uint16_t;

inline float load(const float* p) { return *p; }
inline float load(const bf16_t* p) { return bf16_to_f32(*p); }
inline void store(float* p, float v) { *p = v; }
inline void store(bf16_t* p, float v) { *p = f32_to_bf16(v); }

// The element pointer of a float tensor as storage type T (float or bf16_t); the caller has
// dispatched on the tensor's dtype.
template <typename T>
T* elems(const Tensor& t) {
  if constexpr (std::is_same_v<T, float>) {
    return t.f32();
  } else {
    static_assert(std::is_same_v<T, bf16_t>, "float tensors are f32 or bf16");
    return t.bf16();
  }
}

// n elements of src (any storage) as f32 into dst, and back (rounding to bf16 where T is bf16).
template <typename T>
void load_row(const T* src, int64_t n, float* dst) {
  for (int64_t i = 0; i < n; ++i) dst[i] = load(src + i);
}
template <typename T>
void store_row(const float* src, int64_t n, T* dst) {
  for (int64_t i = 0; i < n; ++i) store(dst + i, src[i]);
}

// Calls body(T{}) with T = float or bf16_t after t's dtype: the one switch a kernel needs.
template <typename Body>
decltype(auto) with_float(const Tensor& t, Body&& body) {
  switch (t.dtype()) {
    case DType::kF32:
      return body(float{});
    case DType::kBF16:
      return body(bf16_t{});
    default:
      SHARDLM_FAIL(ErrorKind::kInternal, "with_float: {} is not a float dtype",
                   dtype_name(t.dtype()));
  }
}

}  // namespace shardlm::cpu
