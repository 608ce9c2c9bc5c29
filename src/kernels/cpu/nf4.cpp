// NF4 dequantization on the CPU (Backend::nf4_dequantize): quant/nf4.h's host dequantizer over
// chunks of whole 64-element blocks in parallel, into f32 or (rounded) bf16.
#include <algorithm>
#include <array>

#include "kernels/cpu/element.h"
#include "kernels/cpu/ops.h"
#include "shardlm/quant/nf4.h"

namespace shardlm::cpu {

// codes [ceil(n/2)] u8, absmax [ceil(n/64)] f32 -> out [n] f32 | bf16
void nf4_dequantize(const Tensor& codes, const Tensor& absmax, const Tensor& out) {
  const int64_t n = out.numel();
  const auto* packed = static_cast<const uint8_t*>(codes.data());
  const float* scales = absmax.f32();
  const int64_t blocks = nf4::num_blocks(n);
  with_float(out, [&](auto tag) {
    auto* y = static_cast<decltype(tag)*>(out.data());
#pragma omp parallel for schedule(static) if (blocks > 64)
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t begin = b * nf4::kBlock, len = std::min(nf4::kBlock, n - begin);
      std::array<float, nf4::kBlock> values;  // one block [64] in f32
      nf4::dequantize(packed, scales, begin, len, values.data());
      for (int64_t i = 0; i < len; ++i) store(y + begin + i, values[i]);
    }
  });
}

}  // namespace shardlm::cpu
