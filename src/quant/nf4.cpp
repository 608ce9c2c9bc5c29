// NF4 quantization and dequantization on the host (include/shardlm/quant/nf4.h), written to give
// bitsandbytes' results bit for bit: its quantize_4bit and dequantize_4bit (CPU path) for the
// 4-bit codes, its CPU quantize_blockwise for the double-quantized absmax.
#include "shardlm/quant/nf4.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "shardlm/core/check.h"
#include "shardlm/quant/nf4_code.h"

namespace shardlm::nf4 {

namespace {

// Index of the NF4 value nearest to v in [-1, 1]: the number of midpoints below v, so a value on
// a midpoint takes the lower code (torch.bucketize with right=False, as bitsandbytes).
inline uint8_t nearest_nf4(float v) {
  static const std::array<float, 15> midpoints = [] {
    std::array<float, 15> m{};
    for (int i = 0; i < 15; ++i) m[i] = (code()[i] + code()[i + 1]) / 2.0f;
    return m;
  }();
  uint8_t index = 0;
  for (const float m : midpoints) index += m < v ? 1 : 0;
  return index;
}

// Bitsandbytes' CPU blockwise 8-bit quantizer: [-1, 1] discretized into 65536 points, each
// mapped once to the nearest dynamic code value (the first whose upper midpoint is not below
// it).
constexpr int kLutSize = 65536;
const std::vector<uint8_t>& dynamic_lut() {
  static const std::vector<uint8_t> lut = [] {
    const auto& c = dynamic_code();
    std::array<float, 255> midpoints{};
    for (int i = 0; i < 255; ++i) midpoints[i] = 0.5f * (c[i] + c[i + 1]);
    std::vector<uint8_t> t(kLutSize);
    int index = 0;
    for (int i = 0; i < kLutSize; ++i) {
      const float v = -1.0f + (2.0f * float(i)) / float(kLutSize - 1);
      while (index < 255 && midpoints[index] < v) ++index;
      t[i] = static_cast<uint8_t>(index);
    }
    return t;
  }();
  return lut;
}

inline uint16_t lut_index(float v) {
  v = std::clamp(v, -1.0f, 1.0f);
  const float scaled = (v + 1.0f) * 0.5f * float(kLutSize - 1);
  return static_cast<uint16_t>(scaled + 0.5f);
}

}  // namespace

const std::array<float, 16>& code() {
  // QLoRA's NormalFloat values: quantiles of N(0, 1) scaled to [-1, 1], with an exact zero.
  static const std::array<float, 16> kCode = {SHARDLM_NF4_CODE_VALUES};
  return kCode;
}

void quantize(const float* x, int64_t n, uint8_t* packed, float* absmax) {
  SHARDLM_CHECK(n >= 0, "nf4::quantize: n must be >= 0, got {}", n);
  std::fill(packed, packed + packed_bytes(n), uint8_t{0x77});  // an odd tail's pad is code 7
  for (int64_t b = 0; b < num_blocks(n); ++b) {
    const int64_t begin = b * kBlock, end = std::min(begin + kBlock, n);
    float m = 0.0f;
    for (int64_t i = begin; i < end; ++i) m = std::max(m, std::fabs(x[i]));
    absmax[b] = m;
    const float inv = 1.0f / std::max(m, 1e-38f);
    for (int64_t i = begin; i < end; ++i) {
      const uint8_t q = nearest_nf4(std::clamp(x[i] * inv, -1.0f, 1.0f));
      uint8_t& byte = packed[i / 2];
      byte = (i % 2 == 0) ? uint8_t((q << 4) | (byte & 0x0f)) : uint8_t((byte & 0xf0) | q);
    }
  }
}

void dequantize(const uint8_t* packed, const float* absmax, int64_t begin, int64_t n, float* out) {
  SHARDLM_CHECK(begin % 2 == 0 && begin >= 0 && n >= 0,
                "nf4::dequantize: begin must be even and >= 0 (whole bytes), got {} (n {})", begin,
                n);
  const auto& c = code();
  const uint8_t* bytes = packed + begin / 2;
  for (int64_t i = 0; i < n; ++i) {
    const uint8_t byte = bytes[i / 2];
    const uint8_t q = (i % 2 == 0) ? uint8_t(byte >> 4) : uint8_t(byte & 0x0f);
    out[i] = c[q] * absmax[(begin + i) / kBlock];
  }
}

float absmax_offset(const float* absmax, int64_t blocks) {
  SHARDLM_CHECK(blocks > 0, "nf4::absmax_offset: needs at least one absmax value, got {}", blocks);
  double sum = 0;
  for (int64_t i = 0; i < blocks; ++i) sum += absmax[i];
  return static_cast<float>(sum / double(blocks));
}

void quantize_absmax(const float* absmax, int64_t blocks, float offset, uint8_t* codes,
                     float* absmax2) {
  const auto& lut = dynamic_lut();
  for (int64_t b = 0; b < num_absmax_blocks(blocks); ++b) {
    const int64_t begin = b * kAbsmaxBlock, end = std::min(begin + kAbsmaxBlock, blocks);
    float m = 0.0f;
    for (int64_t i = begin; i < end; ++i) m = std::max(m, std::fabs(absmax[i] - offset));
    absmax2[b] = m;
    if (m == 0.0f) {
      std::fill(codes + begin, codes + end, uint8_t{0});
      continue;
    }
    const float inv = 1.0f / m;
    for (int64_t i = begin; i < end; ++i) codes[i] = lut[lut_index((absmax[i] - offset) * inv)];
  }
}

void dequantize_absmax(const uint8_t* codes, const float* absmax2, float offset, int64_t blocks,
                       float* absmax) {
  const auto& c = dynamic_code();
  for (int64_t i = 0; i < blocks; ++i) absmax[i] = c[codes[i]] * absmax2[i / kAbsmaxBlock] + offset;
}

}  // namespace shardlm::nf4
