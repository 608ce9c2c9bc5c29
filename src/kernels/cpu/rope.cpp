// Rotary position embedding on the CPU, in place, Hugging Face "rotate_half" convention: the pair
// (i, i + Dh/2) of every head is rotated by pos * inv_freq[i]. The backward is the inverse
// rotation. Angles are formed and their cos/sin taken in f64 (f32 angles lose ~1e-4 rad at
// positions in the thousands), once per (token, i), and reused across all heads, of q and k
// together when both are rotated in one call. x is f32 or bf16 (each rotated pair is computed in
// f32 and rounded once), inv_freq f32. No allocation.
#include <algorithm>
#include <cmath>

#include "kernels/cpu/element.h"
#include "kernels/cpu/ops.h"

namespace shardlm::cpu {
namespace {

// Frequencies per tile: cos/sin for one tile live on the stack while every head uses them.
constexpr int64_t kFreqTile = 64;

// The heads of one token's row that a tile's cos/sin rotate.
template <typename T>
void rotate_heads(T* row, int64_t heads, int64_t head_dim, int64_t i0, int64_t width,
                  const float* cs, const float* sn) {
  const int64_t half = head_dim / 2;
  for (int64_t h = 0; h < heads; ++h) {
    T* x1 = row + h * head_dim + i0;
    T* x2 = x1 + half;
#pragma omp simd
    for (int64_t i = 0; i < width; ++i) {
      const float a = load(x1 + i);
      const float b = load(x2 + i);
      store(x1 + i, a * cs[i] - b * sn[i]);
      store(x2 + i, b * cs[i] + a * sn[i]);
    }
  }
}

// x [N, Hx, Dh] and y [N, Hy, Dh] (Hy = 0: none) in place; positions [N] i32; inv_freq [Dh/2].
// direction = +1 rotates by +angle (forward), -1 by -angle (backward).
template <typename T>
void rotate_rows(T* px, int64_t heads_x, T* py, int64_t heads_y, const int32_t* pos,
                 const float* freq, int64_t n, int64_t head_dim, float direction) {
  const int64_t half = head_dim / 2;
#pragma omp parallel for schedule(static) if (n * (heads_x + heads_y) * head_dim > 16384)
  for (int64_t t = 0; t < n; ++t) {
    const double p = pos[t];
    for (int64_t i0 = 0; i0 < half; i0 += kFreqTile) {
      const int64_t width = std::min(kFreqTile, half - i0);
      float cs[kFreqTile];
      float sn[kFreqTile];
      for (int64_t i = 0; i < width; ++i) {
        const double angle = p * double(freq[i0 + i]);
        cs[i] = static_cast<float>(std::cos(angle));
        sn[i] = direction * static_cast<float>(std::sin(angle));
      }
      rotate_heads(px + t * heads_x * head_dim, heads_x, head_dim, i0, width, cs, sn);
      if (heads_y > 0)
        rotate_heads(py + t * heads_y * head_dim, heads_y, head_dim, i0, width, cs, sn);
    }
  }
}

// x [N, H, Dh] and y [N, Hy, Dh] (empty: none) in place, rotated in their storage type
void rotate(const Tensor& x, const Tensor& y, const Tensor& positions, const Tensor& inv_freq,
            float direction) {
  const int64_t n = x.dim(0);
  const int64_t heads_x = x.dim(1);
  const int64_t heads_y = y.empty() ? 0 : y.dim(1);
  const int64_t head_dim = x.dim(2);
  if (n == 0 || heads_x + heads_y == 0 || head_dim / 2 == 0) return;
  with_float(x, [&](auto tag) {
    using T = decltype(tag);
    rotate_rows(elems<T>(x), heads_x, heads_y > 0 ? elems<T>(y) : nullptr, heads_y, positions.i32(),
                inv_freq.f32(), n, head_dim, direction);
  });
}

}  // namespace

// x [N, H, Dh] rotated in place; positions [N] i32; inv_freq [Dh/2]
void rope_forward(const Tensor& x, const Tensor& positions, const Tensor& inv_freq) {
  rotate(x, Tensor(), positions, inv_freq, 1.0f);
}

// dx [N, H, Dh] rotated back in place; positions [N] i32; inv_freq [Dh/2]
void rope_backward(const Tensor& dx, const Tensor& positions, const Tensor& inv_freq) {
  rotate(dx, Tensor(), positions, inv_freq, -1.0f);
}

// q [N, Hq, Dh], k [N, Hk, Dh] rotated in place with one cos/sin per (token, i)
void rope_qk_forward(const Tensor& q, const Tensor& k, const Tensor& positions,
                     const Tensor& inv_freq) {
  rotate(q, k, positions, inv_freq, 1.0f);
}

// dq [N, Hq, Dh], dk [N, Hk, Dh] rotated back in place
void rope_qk_backward(const Tensor& dq, const Tensor& dk, const Tensor& positions,
                      const Tensor& inv_freq) {
  rotate(dq, dk, positions, inv_freq, -1.0f);
}

}  // namespace shardlm::cpu
