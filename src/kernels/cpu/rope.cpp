// Rotary position embedding on the CPU, in place, in Hugging Face's two pairings of a head's
// rotated dims R = 2 * inv_freq.dim(0) (R < Dh: partial rotary, the rest untouched): rotate_half
// (Llama's; pair i is (i, i + R/2)) or interleaved (GLM's; pair i is (2i, 2i + 1)); pair i turns
// by pos * inv_freq[i]. The backward is the inverse rotation. Angles are formed and their
// cos/sin taken in f64 (f32 angles lose ~1e-4 rad at positions in the thousands), once per
// (token, i), and reused across all heads, of q and k together when both are rotated in one
// call. x is f32 or bf16 (each rotated pair is computed in f32 and rounded once), inv_freq f32.
// No allocation.
#include <algorithm>
#include <cmath>

#include "kernels/cpu/element.h"
#include "kernels/cpu/ops.h"

namespace shardlm::cpu {
namespace {

// Frequencies per tile: cos/sin for one tile live on the stack while every head uses them.
constexpr int64_t kFreqTile = 64;

// The heads of one token's row that a tile's cos/sin rotate: pairs [i0, i0 + width) of each
// head's `freqs`.
template <typename T>
void rotate_heads(T* row, int64_t heads, int64_t head_dim, int64_t freqs, bool interleaved,
                  int64_t i0, int64_t width, const float* cs, const float* sn) {
  for (int64_t h = 0; h < heads; ++h) {
    T* x = row + h * head_dim;
    if (interleaved) {
      T* p = x + 2 * i0;
      for (int64_t i = 0; i < width; ++i) {
        const float a = load(p + 2 * i);
        const float b = load(p + 2 * i + 1);
        store(p + 2 * i, a * cs[i] - b * sn[i]);
        store(p + 2 * i + 1, b * cs[i] + a * sn[i]);
      }
      continue;
    }
    T* x1 = x + i0;
    T* x2 = x1 + freqs;
#pragma omp simd
    for (int64_t i = 0; i < width; ++i) {
      const float a = load(x1 + i);
      const float b = load(x2 + i);
      store(x1 + i, a * cs[i] - b * sn[i]);
      store(x2 + i, b * cs[i] + a * sn[i]);
    }
  }
}

// One rope call's operands: x [N, Hx, Dh] and y [N, Hy, Dh] (Hy = 0: none), each head's first
// 2 * freqs dims rotated.
template <typename T>
struct RopeRows {
  T* x;
  int64_t heads_x;
  T* y;
  int64_t heads_y;
  int64_t n, head_dim, freqs;
  bool interleaved;
};

// positions [N] i32; inv_freq [freqs]. direction = +1 rotates by +angle (forward), -1 by -angle
// (backward).
template <typename T>
void rotate_rows(const RopeRows<T>& r, const int32_t* pos, const float* freq, float direction) {
#pragma omp parallel for schedule(static) if (r.n * (r.heads_x + r.heads_y) * r.head_dim > 16384)
  for (int64_t t = 0; t < r.n; ++t) {
    const double p = pos[t];
    for (int64_t i0 = 0; i0 < r.freqs; i0 += kFreqTile) {
      const int64_t width = std::min(kFreqTile, r.freqs - i0);
      float cs[kFreqTile];
      float sn[kFreqTile];
      for (int64_t i = 0; i < width; ++i) {
        const double angle = p * double(freq[i0 + i]);
        cs[i] = static_cast<float>(std::cos(angle));
        sn[i] = direction * static_cast<float>(std::sin(angle));
      }
      rotate_heads(r.x + t * r.heads_x * r.head_dim, r.heads_x, r.head_dim, r.freqs, r.interleaved,
                   i0, width, cs, sn);
      if (r.heads_y > 0)
        rotate_heads(r.y + t * r.heads_y * r.head_dim, r.heads_y, r.head_dim, r.freqs,
                     r.interleaved, i0, width, cs, sn);
    }
  }
}

// x [N, H, Dh] and y [N, Hy, Dh] (empty: none) in place, rotated in their storage type
void rotate(const Tensor& x, const Tensor& y, const Tensor& positions, const Tensor& inv_freq,
            RopePairs pairs, float direction) {
  const int64_t n = x.dim(0);
  const int64_t heads_x = x.dim(1);
  const int64_t heads_y = y.empty() ? 0 : y.dim(1);
  const int64_t freqs = inv_freq.dim(0);
  if (n == 0 || heads_x + heads_y == 0 || freqs == 0) return;
  with_float(x, [&](auto tag) {
    using T = decltype(tag);
    const RopeRows<T> rows{elems<T>(x), heads_x, heads_y > 0 ? elems<T>(y) : nullptr, heads_y, n,
                           x.dim(2),    freqs,   pairs == RopePairs::kInterleaved};
    rotate_rows(rows, positions.i32(), inv_freq.f32(), direction);
  });
}

}  // namespace

// x [N, H, Dh] rotated in place; positions [N] i32; inv_freq [R/2]
void rope_forward(const Tensor& x, const Tensor& positions, const Tensor& inv_freq,
                  RopePairs pairs) {
  rotate(x, Tensor(), positions, inv_freq, pairs, 1.0f);
}

// dx [N, H, Dh] rotated back in place; positions [N] i32; inv_freq [R/2]
void rope_backward(const Tensor& dx, const Tensor& positions, const Tensor& inv_freq,
                   RopePairs pairs) {
  rotate(dx, Tensor(), positions, inv_freq, pairs, -1.0f);
}

// q [N, Hq, Dh], k [N, Hk, Dh] rotated in place with one cos/sin per (token, i)
void rope_qk_forward(const Tensor& q, const Tensor& k, const Tensor& positions,
                     const Tensor& inv_freq, RopePairs pairs) {
  rotate(q, k, positions, inv_freq, pairs, 1.0f);
}

// dq [N, Hq, Dh], dk [N, Hk, Dh] rotated back in place
void rope_qk_backward(const Tensor& dq, const Tensor& dk, const Tensor& positions,
                      const Tensor& inv_freq, RopePairs pairs) {
  rotate(dq, dk, positions, inv_freq, pairs, -1.0f);
}

}  // namespace shardlm::cpu
