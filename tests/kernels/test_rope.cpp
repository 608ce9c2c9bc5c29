// Tests of the CPU rotary embedding kernels (rope.cpp): hand-worked cases fixing the Hugging
// Face rotate_half pairing and sign and GLM's interleaved partial one, forward against an f64
// reference (including positions far beyond f32 angle precision), backward against central
// finite differences, and the round trip, for whole heads in rotate_half pairs and for GLM's
// interleaved pairs over part of each head.
#include <algorithm>
#include <cmath>
#include <numbers>
#include <vector>

#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/ops.h"
#include "test_util.h"

namespace shardlm {
namespace {

// Each output is a*cos - b*sin with cos/sin rounded once to f32: a few f32 ulps of |x| <= 1.
constexpr double kF32Atol = 1e-6;
constexpr double kF32Rtol = 1e-5;

struct Dims {
  int64_t n, heads, head_dim;
};
// Dh = 2 (one pair), 6 (odd half), 64, and 130 (half = 65 crosses the 64-wide frequency tile).
const std::vector<Dims> kShapes = {{1, 1, 2},   {7, 3, 6},    {33, 2, 64},
                                   {7, 1, 130}, {33, 3, 130}, {1, 5, 64}};

// inv_freq[i] = theta^(-2i/Dh) in f32, as models compute it.
std::vector<float> make_inv_freq(int64_t head_dim, double theta = 10000.0) {
  std::vector<float> f(head_dim / 2);
  for (int64_t i = 0; i < head_dim / 2; ++i)
    f[i] = static_cast<float>(std::pow(theta, -2.0 * double(i) / double(head_dim)));
  return f;
}

std::vector<int32_t> random_positions(int64_t n, int32_t max_pos, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int32_t> p(n);
  for (auto& v : p) v = static_cast<int32_t>(rng() % static_cast<uint64_t>(max_pos));
  return p;
}

// How a case rotates: the first `rotary` dims of each head (0: all), in interleaved pairs or not.
struct Variant {
  int64_t rotary = 0;
  bool interleaved = false;
  int64_t dims(const Dims& s) const { return rotary == 0 ? s.head_dim : rotary; }
  RopePairs pairs() const { return interleaved ? RopePairs::kInterleaved : RopePairs::kHalf; }
};
// Llama's, and GLM's (half of each head, at most: the rest untouched), for the shapes above.
Variant glm_variant(const Dims& s) { return {2 * std::max<int64_t>(1, s.head_dim / 4), true}; }

// f64 reference with its cos/sin tables built once (they do not depend on x).
struct RefRope {
  Dims s;
  Variant v;
  int64_t freqs;
  std::vector<double> cos, sin;  // [N, freqs]
  RefRope(Dims dims, const std::vector<int32_t>& pos, const std::vector<float>& inv_freq,
          Variant variant = {})
      : s(dims), v(variant), freqs(variant.dims(dims) / 2), cos(dims.n * freqs), sin(cos.size()) {
    for (int64_t t = 0; t < s.n; ++t) {
      for (int64_t i = 0; i < freqs; ++i) {
        const double angle = double(pos[t]) * double(inv_freq[i]);
        cos[t * freqs + i] = std::cos(angle);
        sin[t * freqs + i] = std::sin(angle);
      }
    }
  }
  std::vector<double> forward(const std::vector<double>& x) const {
    std::vector<double> y = x;  // the dims past the rotated ones stay
    for (int64_t t = 0; t < s.n; ++t) {
      for (int64_t h = 0; h < s.heads; ++h) {
        const int64_t base = (t * s.heads + h) * s.head_dim;
        for (int64_t i = 0; i < freqs; ++i) {
          const double c = cos[t * freqs + i], sn = sin[t * freqs + i];
          const int64_t i1 = base + (v.interleaved ? 2 * i : i);
          const int64_t i2 = v.interleaved ? i1 + 1 : i1 + freqs;
          const double a = x[i1], b = x[i2];
          y[i1] = a * c - b * sn;
          y[i2] = b * c + a * sn;
        }
      }
    }
    return y;
  }
};

// Dh = 4, pos = 1, inv_freq = {pi/2, 0}: the pair (0, 2) turns by 90 degrees, so
// x = [1, 0, 0, 0] -> x*cos + rotate_half(x)*sin = [0, 0, 1, 0]; the pair (1, 3) does not move.
TEST(RopeForward, HuggingFaceRotateHalfByHand) {
  std::vector<float> x = {1, 5, 0, 7};
  std::vector<int32_t> pos = {1};
  std::vector<float> inv_freq = {static_cast<float>(std::numbers::pi / 2), 0.0f};
  cpu::rope_forward(test::view(x, Shape{1, 1, 4}), test::view(pos, Shape{1}),
                    test::view(inv_freq, Shape{2}));
  const std::vector<double> want = {0, 5, 1, 7};
  EXPECT_CLOSE(x, want, kF32Atol, 0.0);
}

TEST(RopeForward, MatchesF64IncludingLargePositions) {
  for (Dims s : kShapes) {
    for (const Variant v : {Variant{}, glm_variant(s)}) {
      for (int32_t max_pos : {16, 8192, 1000000}) {
        const int64_t R = v.dims(s);
        std::vector<float> inv_freq = make_inv_freq(R);
        std::vector<int32_t> pos = random_positions(s.n, max_pos, 1);
        std::vector<float> x = test::random_vec(s.n * s.heads * s.head_dim, 2);
        const RefRope ref(s, pos, inv_freq, v);
        const std::vector<double> want = ref.forward(test::to_f64(x));
        cpu::rope_forward(test::view(x, Shape{s.n, s.heads, s.head_dim}),
                          test::view(pos, Shape{s.n}), test::view(inv_freq, Shape{R / 2}),
                          v.pairs());
        EXPECT_CLOSE(x, want, kF32Atol, kF32Rtol)
            << "N=" << s.n << " H=" << s.heads << " Dh=" << s.head_dim << " R=" << R
            << " interleaved=" << v.interleaved << " max_pos=" << max_pos;
      }
    }
  }
}

// loss = sum(r * rope(x)): dloss/dx by central differences equals rope_backward applied to r.
TEST(RopeBackward, MatchesFiniteDifferences) {
  for (Dims s : kShapes) {
    for (const Variant v : {Variant{}, glm_variant(s)}) {
      const int64_t R = v.dims(s);
      std::vector<float> inv_freq = make_inv_freq(R);
      std::vector<int32_t> pos = random_positions(s.n, 4096, 3);
      const std::vector<float> x = test::random_vec(s.n * s.heads * s.head_dim, 4);
      std::vector<float> r = test::random_vec(x.size(), 5);
      const RefRope ref(s, pos, inv_freq, v);
      auto x64 = test::to_f64(x);
      const auto r64 = test::to_f64(r);
      auto loss = [&] {
        const auto y = ref.forward(x64);
        double l = 0;
        for (size_t k = 0; k < y.size(); ++k) l += r64[k] * y[k];
        return l;
      };
      const auto grad = test::finite_difference(x64, loss);
      cpu::rope_backward(test::view(r, Shape{s.n, s.heads, s.head_dim}),
                         test::view(pos, Shape{s.n}), test::view(inv_freq, Shape{R / 2}),
                         v.pairs());
      // Finite differences of a linear f64 map are exact to ~1e-10; the rest is f32 rounding.
      EXPECT_CLOSE(r, grad, kF32Atol, kF32Rtol)
          << "N=" << s.n << " H=" << s.heads << " Dh=" << s.head_dim << " R=" << R;
    }
  }
}

TEST(RopeBackward, InvertsForward) {
  for (Dims s : kShapes) {
    for (const Variant v : {Variant{}, glm_variant(s)}) {
      const int64_t R = v.dims(s);
      std::vector<float> inv_freq = make_inv_freq(R);
      std::vector<int32_t> pos = random_positions(s.n, 100000, 6);
      std::vector<float> x = test::random_vec(s.n * s.heads * s.head_dim, 7);
      const std::vector<double> x0 = test::to_f64(x);
      const Tensor t = test::view(x, Shape{s.n, s.heads, s.head_dim});
      const Tensor f = test::view(inv_freq, Shape{R / 2});
      cpu::rope_forward(t, test::view(pos, Shape{s.n}), f, v.pairs());
      cpu::rope_backward(t, test::view(pos, Shape{s.n}), f, v.pairs());
      EXPECT_CLOSE(x, x0, 2 * kF32Atol, kF32Rtol);
    }
  }
}

// GLM: Dh = 8, the first R = 4 dims in interleaved pairs; pos = 1, inv_freq = {pi/2, 0}. Pair 0
// is dims (0, 1), turned by 90 degrees: (a, b) -> (-b, a); pair 1 (dims 2, 3) does not turn;
// dims 4..7 pass through. transformers' glm rotate_half: stack(-x[1::2], x[0::2]).
TEST(RopeForward, GlmInterleavedPartialByHand) {
  std::vector<float> x = {1, 2, 3, 4, 5, 6, 7, 8};
  std::vector<int32_t> pos = {1};
  std::vector<float> inv_freq = {static_cast<float>(std::numbers::pi / 2), 0.0f};
  cpu::rope_forward(test::view(x, Shape{1, 1, 8}), test::view(pos, Shape{1}),
                    test::view(inv_freq, Shape{2}), RopePairs::kInterleaved);
  const std::vector<double> want = {-2, 1, 3, 4, 5, 6, 7, 8};
  EXPECT_CLOSE(x, want, kF32Atol, 0.0);
}

TEST(Rope, RejectsMismatchedShapes) {
  cpu::CpuBackend be;  // through the entry points, which check the arguments
  std::vector<float> x(2 * 3 * 5), x8(2 * 3 * 8), f2(2), f4(4);
  std::vector<int32_t> pos = {0, 1}, pos3 = {0, 1, 2};
  // odd head dim
  EXPECT_THROW(be.rope_forward(test::view(x, Shape{2, 3, 5}), test::view(pos, Shape{2}),
                               test::view(f2, Shape{2})),
               Error);
  // inv_freq must be [R/2] with R <= Dh
  std::vector<float> f5(5);
  EXPECT_THROW(be.rope_forward(test::view(x8, Shape{2, 3, 8}), test::view(pos, Shape{2}),
                               test::view(f5, Shape{5})),
               Error);
  // positions must be [N]
  EXPECT_THROW(be.rope_backward(test::view(x8, Shape{2, 3, 8}), test::view(pos3, Shape{3}),
                                test::view(f4, Shape{4})),
               Error);
  // rank 2 is not [N, H, Dh]
  EXPECT_THROW(be.rope_forward(test::view(x8, Shape{6, 8}), test::view(pos, Shape{2}),
                               test::view(f4, Shape{4})),
               Error);
}

}  // namespace
}  // namespace shardlm
