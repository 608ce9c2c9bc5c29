// NF4 dequantization on the device (Backend::nf4_dequantize): the frozen base's 4-bit codes
// into the f32 or bf16 workspace a projection's GEMM reads. One thread per 8 elements (a 4-byte
// word of codes, a 16-byte-aligned pack of outputs) where the pointers allow, else per byte.
// Each value is code * absmax in f32, rounded to nearest even for bf16: the CPU's bits.
#include <cstdint>
#include <type_traits>

#include "kernels/cuda/common.cuh"
#include "shardlm/quant/nf4_code.h"

namespace shardlm::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kBlock = 64;  // elements per absmax (quant/nf4.h)

// bitsandbytes' NF4 code book (quant/nf4.h's nf4::code()).
__constant__ float kNf4[16] = {SHARDLM_NF4_CODE_VALUES};

// codes [n/8] words, absmax [n/64] -> out [n] in packs of 8 (n % 8 == 0; the 8 share a block).
template <typename T>
__global__ void nf4_dequantize_packed(const uint32_t* codes, const float* absmax, T* out,
                                      int64_t words) {
  for (int64_t w = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; w < words;
       w += int64_t(gridDim.x) * blockDim.x) {
    const uint32_t word = codes[w];  // bytes in memory order: byte j holds elements 2j, 2j + 1
    const float scale = absmax[(w * 8) / kBlock];
    float v[kPack];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const uint32_t byte = (word >> (8 * j)) & 0xffu;
      v[2 * j] = kNf4[byte >> 4] * scale;
      v[2 * j + 1] = kNf4[byte & 0x0fu] * scale;
    }
    store_pack(out + w * 8, v);
  }
}

// codes [ceil(n/2)] bytes, one thread per byte.
template <typename T>
__global__ void nf4_dequantize_bytes(const uint8_t* codes, const float* absmax, T* out, int64_t n) {
  const int64_t bytes = (n + 1) / 2;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < bytes;
       i += int64_t(gridDim.x) * blockDim.x) {
    const uint8_t byte = codes[i];
    const int64_t e = 2 * i;
    store(out, e, kNf4[byte >> 4] * absmax[e / kBlock]);
    if (e + 1 < n) store(out, e + 1, kNf4[byte & 0x0f] * absmax[(e + 1) / kBlock]);
  }
}

}  // namespace

cudaError_t launch_nf4_dequantize(const void* codes, const float* absmax, void* out, Elem t,
                                  int64_t n, cudaStream_t s) {
  if (n == 0) return cudaSuccess;
  const bool packed = n % 8 == 0 && (reinterpret_cast<uintptr_t>(codes) & 3) == 0 && aligned16(out);
  return dispatch(t, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    if (packed) {
      const int64_t words = n / 8;
      nf4_dequantize_packed<T><<<grid_for(words, kThreads), kThreads, 0, s>>>(
          static_cast<const uint32_t*>(codes), absmax, static_cast<T*>(out), words);
    } else {
      nf4_dequantize_bytes<T><<<grid_for((n + 1) / 2, kThreads), kThreads, 0, s>>>(
          static_cast<const uint8_t*>(codes), absmax, static_cast<T*>(out), n);
    }
    return cudaGetLastError();
  });
}

}  // namespace shardlm::cuda
