// Elementwise CPU kernels: zero, copy, strided block copy, f32 <-> bf16 conversion, add, scale,
// and the f64 sum of squares used for gradient-norm clipping. add, scale and sum_squares take f32
// or bf16 storage and compute in f32 (f64 for the sum). Flat loops over numel, OpenMP-parallel
// over fixed chunks; no allocation. sum_squares gives the same bits for any thread count.
#include <algorithm>
#include <cstring>

#include "kernels/cpu/element.h"
#include "kernels/cpu/ops.h"

namespace shardlm::cpu {
namespace {

// Elements per parallel work item: large enough that a fork/join is worth it.
constexpr int64_t kChunk = int64_t{1} << 15;

int64_t num_chunks(int64_t n) { return (n + kChunk - 1) / kChunk; }

// Copies bytes with the chunks spread over threads (one thread cannot saturate memory bandwidth).
void parallel_memcpy(std::byte* dst, const std::byte* src, int64_t bytes) {
  const int64_t chunks = num_chunks(bytes);
#pragma omp parallel for schedule(static) if (chunks > 1)
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t begin = c * kChunk;
    std::memcpy(dst + begin, src + begin, static_cast<size_t>(std::min(kChunk, bytes - begin)));
  }
}

}  // namespace

// x: any shape, any dtype
void zero(const Tensor& x) {
  if (x.numel() == 0) return;
  auto* p = static_cast<std::byte*>(x.data());
  const int64_t bytes = static_cast<int64_t>(x.bytes());
  const int64_t chunks = num_chunks(bytes);
#pragma omp parallel for schedule(static) if (chunks > 1)
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t begin = c * kChunk;
    std::memset(p + begin, 0, static_cast<size_t>(std::min(kChunk, bytes - begin)));
  }
}

// src, dst: same dtype and numel, any shapes and pools; the same memory or none in common
void copy(const Tensor& src, const Tensor& dst) {
  if (src.numel() == 0 || src.data() == dst.data()) return;
  parallel_memcpy(static_cast<std::byte*>(dst.data()), static_cast<const std::byte*>(src.data()),
                  static_cast<int64_t>(src.bytes()));
}

// Blocks of `layout` (Backend::copy_blocks), one memcpy each, the blocks spread over the threads.
void copy_blocks(const Tensor& src, const Tensor& dst, const BlockCopy& layout) {
  const int64_t e = int64_t(dtype_size(src.dtype()));
  const int64_t n1 = layout.n[1], n2 = layout.n[2];
  const int64_t count = layout.n[0] * n1 * n2, bytes = layout.block * e;
  const auto* s = static_cast<const std::byte*>(src.data());
  auto* d = static_cast<std::byte*>(dst.data());
#pragma omp parallel for schedule(static) if (count * bytes > kChunk)
  for (int64_t b = 0; b < count; ++b) {
    const int64_t i = b / (n1 * n2), j = b / n2 % n1, l = b % n2;
    const int64_t from = i * layout.src[0] + j * layout.src[1] + l * layout.src[2];
    const int64_t to = i * layout.dst[0] + j * layout.dst[1] + l * layout.dst[2];
    std::memcpy(d + to * e, s + from * e, size_t(bytes));
  }
}

// src, dst: same numel, f32 or bf16; f32 -> bf16 rounds to nearest even, bf16 -> f32 is exact
void convert(const Tensor& src, const Tensor& dst) {
  if (src.dtype() == dst.dtype()) {
    copy(src, dst);
    return;
  }
  const int64_t n = src.numel();
  if (n == 0) return;
  if (src.dtype() == DType::kF32) {
    const float* s = src.f32();
    uint16_t* d = dst.bf16();
#pragma omp parallel for schedule(static) if (n > kChunk)
    for (int64_t i = 0; i < n; ++i) d[i] = f32_to_bf16(s[i]);
  } else {
    const uint16_t* s = src.bf16();
    float* d = dst.f32();
#pragma omp parallel for schedule(static) if (n > kChunk)
    for (int64_t i = 0; i < n; ++i) d[i] = bf16_to_f32(s[i]);
  }
}

// a, b, out: [n] f32 or bf16, one dtype, same numel; out may alias a or b
void add(const Tensor& a, const Tensor& b, const Tensor& out) {
  const int64_t n = a.numel();
  if (n == 0) return;
  with_float(a, [&](auto tag) {
    using T = decltype(tag);
    const T* pa = elems<T>(a);
    const T* pb = elems<T>(b);
    T* po = elems<T>(out);
#pragma omp parallel for simd schedule(static) if (n > kChunk)
    for (int64_t i = 0; i < n; ++i) store(po + i, load(pa + i) + load(pb + i));
  });
}

// x: [n] f32 or bf16, scaled in place
void scale(const Tensor& x, float s) {
  const int64_t n = x.numel();
  if (n == 0) return;
  with_float(x, [&](auto tag) {
    using T = decltype(tag);
    T* p = elems<T>(x);
#pragma omp parallel for simd schedule(static) if (n > kChunk)
    for (int64_t i = 0; i < n; ++i) store(p + i, load(p + i) * s);
  });
}

// x: [n, m] f32 or bf16, row r scaled in place by s[r] (f32)
void scale_rows(const Tensor& x, const Tensor& s) {
  const int64_t n = x.dim(0), m = x.dim(1);
  if (n == 0 || m == 0) return;
  const float* ps = s.f32();
  with_float(x, [&](auto tag) {
    using T = decltype(tag);
    T* p = elems<T>(x);
#pragma omp parallel for schedule(static) if (n * m > kChunk)
    for (int64_t r = 0; r < n; ++r)
      for (int64_t j = 0; j < m; ++j) store(p + r * m + j, load(p + r * m + j) * ps[r]);
  });
}

// x: [n] f32 or bf16, squared and summed in f64. The split into parts depends only on n, and
// the part sums are added in order, so the result does not depend on the thread count.
double sum_squares(const Tensor& x) {
  const int64_t n = x.numel();
  if (n == 0) return 0.0;
  constexpr int64_t kMaxParts = 256;
  const int64_t parts = std::clamp<int64_t>(n / kChunk, 1, kMaxParts);
  const int64_t part_size = (n + parts - 1) / parts;
  double partial[kMaxParts];
  with_float(x, [&](auto tag) {
    using T = decltype(tag);
    const T* p = elems<T>(x);
#pragma omp parallel for schedule(static) if (parts > 1)
    for (int64_t k = 0; k < parts; ++k) {
      const int64_t begin = std::min(n, k * part_size);
      const int64_t end = std::min(n, begin + part_size);
      double acc = 0.0;
#pragma omp simd reduction(+ : acc)
      for (int64_t i = begin; i < end; ++i) {
        const double v = load(p + i);
        acc += v * v;
      }
      partial[k] = acc;
    }
  });
  double total = 0.0;
  for (int64_t k = 0; k < parts; ++k) total += partial[k];
  return total;
}

}  // namespace shardlm::cpu
