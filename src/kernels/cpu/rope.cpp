// Rotary position embedding on the CPU, in place, Hugging Face "rotate_half" convention: the pair
// (i, i + Dh/2) of every head is rotated by pos * inv_freq[i]. The backward is the inverse
// rotation. Angles are formed and their cos/sin taken in f64 (f32 angles lose ~1e-4 rad at
// positions in the thousands), once per (token, i), and reused across all heads. No allocation.
#include <algorithm>
#include <cmath>

#include "kernels/cpu/ops.h"

namespace shardlm::cpu {
namespace {

// Frequencies per tile: cos/sin for one tile live on the stack while every head uses them.
constexpr int64_t kFreqTile = 64;

// x [N, H, Dh] in place; positions [N] i32; inv_freq [Dh/2].
// direction = +1 rotates by +angle (forward), -1 by -angle (backward).
void rotate(const Tensor& x, const Tensor& positions, const Tensor& inv_freq, float direction) {
  const int64_t n = x.dim(0);
  const int64_t heads = x.dim(1);
  const int64_t head_dim = x.dim(2);
  const int64_t half = head_dim / 2;
  if (n == 0 || heads == 0 || half == 0) return;
  float* px = x.f32();
  const int32_t* pos = positions.i32();
  const float* freq = inv_freq.f32();

#pragma omp parallel for schedule(static) if (n * heads * head_dim > 16384)
  for (int64_t t = 0; t < n; ++t) {
    float* xt = px + t * heads * head_dim;
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
      for (int64_t h = 0; h < heads; ++h) {
        float* x1 = xt + h * head_dim + i0;
        float* x2 = x1 + half;
#pragma omp simd
        for (int64_t i = 0; i < width; ++i) {
          const float a = x1[i];
          const float b = x2[i];
          x1[i] = a * cs[i] - b * sn[i];
          x2[i] = b * cs[i] + a * sn[i];
        }
      }
    }
  }
}

}  // namespace

// x [N, H, Dh] rotated in place; positions [N] i32; inv_freq [Dh/2]
void rope_forward(const Tensor& x, const Tensor& positions, const Tensor& inv_freq) {
  rotate(x, positions, inv_freq, 1.0f);
}

// dx [N, H, Dh] rotated back in place; positions [N] i32; inv_freq [Dh/2]
void rope_backward(const Tensor& dx, const Tensor& positions, const Tensor& inv_freq) {
  rotate(dx, positions, inv_freq, -1.0f);
}

}  // namespace shardlm::cpu
