// Dropout with a counter-based mask (LoRA's input dropout): element i is kept when a hash of
// (seed, i) clears p, so the mask is never stored and a recomputation in backward (activation
// checkpointing) repeats it bit for bit, for any thread count. f32 or bf16 storage, f32
// arithmetic: the mask does not depend on the dtype.
#include <algorithm>

#include "kernels/cpu/element.h"
#include "kernels/cpu/ops.h"

namespace shardlm::cpu {
namespace {

// SplitMix64's finaliser: a bijection of 64-bit words with good avalanche.
uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

}  // namespace

// x, out: [n] f32 or bf16, one dtype (out may alias x); element i, drawn as element
// first + (i / width) * row_stride + i % width (width = 0: the whole tensor, first + i), kept
// with probability 1 - p.
void dropout(const Tensor& x, const Tensor& out, float p, uint64_t seed, int64_t first,
             int64_t width, int64_t row_stride) {
  const int64_t n = x.numel();
  if (width == 0) width = row_stride = std::max<int64_t>(n, 1);
  const float keep_scale = 1.f / (1.f - p);
  // keep when the top 24 bits, as a fraction of 2^24, are >= p
  const uint32_t threshold = uint32_t(double(p) * double(1u << 24));
  const uint64_t key = mix64(seed);
  with_float(x, [&](auto tag) {
    using T = decltype(tag);
    const T* px = elems<T>(x);
    T* po = elems<T>(out);
#pragma omp parallel for schedule(static) if (n > 32768)
    for (int64_t i = 0; i < n; ++i) {
      const int64_t at = first + (i / width) * row_stride + i % width;
      const uint32_t r = uint32_t(mix64(key ^ uint64_t(at)) >> 40);
      store(po + i, r >= threshold ? load(px + i) * keep_scale : 0.f);
    }
  });
}

}  // namespace shardlm::cpu
