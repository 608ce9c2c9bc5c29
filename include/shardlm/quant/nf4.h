// NF4 4-bit weights in bitsandbytes' format (QLoRA): a tensor of n elements is cut into blocks of
// 64 consecutive elements (row-major order; the last block may be shorter), each scaled by its
// absolute maximum (absmax, f32) and every scaled value replaced by the index of the nearest of
// the 16 NF4 code values; two indices per byte, the first element in the high nibble. Double
// quantization stores the absmax values themselves in 8 bits: their mean (offset) is
// subtracted and each block of 256 is quantized blockwise with bitsandbytes' signed dynamic
// 8-bit code. Host-side value code (quantize at load, dequantize for export and as the kernels'
// reference); the kernels that dequantize on the device are Backend::nf4_dequantize.
#pragma once

#include <array>
#include <cstdint>

namespace shardlm::nf4 {

constexpr int64_t kBlock = 64;         // elements per absmax (bitsandbytes' blocksize)
constexpr int64_t kAbsmaxBlock = 256;  // absmax values per second-level scale (nested blocksize)

// The 16 NF4 values (bitsandbytes' get_4bit_type("nf4")), ascending, -1 to 1.
const std::array<float, 16>& code();
// bitsandbytes' create_dynamic_map(signed=True): the 256 values of its 8-bit dynamic code,
// ascending, which double quantization stores the absmax values in.
const std::array<float, 256>& dynamic_code();

// Blocks of 64 in n elements (absmax values), and bytes of their packed codes.
constexpr int64_t num_blocks(int64_t n) { return (n + kBlock - 1) / kBlock; }
constexpr int64_t packed_bytes(int64_t n) { return (n + 1) / 2; }
// Second-level blocks of 256 over `blocks` absmax values.
constexpr int64_t num_absmax_blocks(int64_t blocks) {
  return (blocks + kAbsmaxBlock - 1) / kAbsmaxBlock;
}

// x [n] f32 -> packed [packed_bytes(n)] and absmax [num_blocks(n)], as bitsandbytes'
// quantize_4bit(blocksize=64, quant_type="nf4"): each value is multiplied by 1 / absmax in f32,
// clamped to [-1, 1] and given the first code whose upper midpoint it does not exceed (a value
// on a midpoint takes the lower code). A block of zeros has absmax 0 and code 7 (0.0). An odd
// n pads the last byte's low nibble with code 7.
void quantize(const float* x, int64_t n, uint8_t* packed, float* absmax);

// packed, absmax -> out [n] f32: code[index] * absmax of its block, in f32 (bit for bit what
// bitsandbytes' dequantize_4bit returns in f32). begin: the first element's index in the
// tensor, so that a slice of whole bytes (begin even) dequantizes on its own.
void dequantize(const uint8_t* packed, const float* absmax, int64_t begin, int64_t n, float* out);

// The offset double quantization subtracts: the mean of absmax [blocks], accumulated in f64 and
// rounded to f32 (torch's f32 mean, which bitsandbytes takes, sums in f32 pairs and may differ
// from it in the last bit).
float absmax_offset(const float* absmax, int64_t blocks);

// absmax [blocks] -> codes [blocks] and absmax2 [num_absmax_blocks(blocks)], as bitsandbytes'
// quantize_blockwise(absmax - offset, blocksize=256) on the CPU: per block of 256 the
// largest |value| (absmax2), each value times 1 / absmax2 mapped to one of 65536 evenly spaced
// points on [-1, 1] and from there to the nearest dynamic code value.
void quantize_absmax(const float* absmax, int64_t blocks, float offset, uint8_t* codes,
                     float* absmax2);

// codes, absmax2, offset -> absmax [blocks]: dynamic_code[c] * absmax2 + offset in f32, as
// bitsandbytes' dequantize_4bit restores a nested quant state's absmax.
void dequantize_absmax(const uint8_t* codes, const float* absmax2, float offset, int64_t blocks,
                       float* absmax);

}  // namespace shardlm::nf4
