// Element types of tensors and the bf16 <-> f32 conversions (round to nearest even).
// Pure value code: no allocation, no backend.
#pragma once

#include <cstdint>
#include <cstring>
#include <string_view>

namespace shardlm {

// f64 and i64 are for communicated scalars (loss sums, token counts, norms): no kernel takes
// them. u8 holds packed 4-bit weight codes (NF4: two per byte) and 8-bit absmax codes.
enum class DType : uint8_t { kF32, kBF16, kI32, kF64, kI64, kU8 };

constexpr size_t dtype_size(DType t) {
  switch (t) {
    case DType::kF32:
      return 4;
    case DType::kBF16:
      return 2;
    case DType::kU8:
      return 1;
    case DType::kI32:
      return 4;
    case DType::kF64:
    case DType::kI64:
      return 8;
  }
  return 0;
}

std::string_view dtype_name(DType t);

// Round-to-nearest-even f32 -> bf16; NaN stays NaN (quiet), infinities stay infinite.
inline uint16_t f32_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7f800000u) == 0x7f800000u && (bits & 0x007fffffu) != 0) {
    return static_cast<uint16_t>((bits >> 16) | 0x0040u);  // quiet NaN, keep sign
  }
  const uint32_t rounding_bias = 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>((bits + rounding_bias) >> 16);
}

inline float bf16_to_f32(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

}  // namespace shardlm
