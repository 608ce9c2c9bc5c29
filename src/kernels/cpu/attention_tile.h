// Register-blocked f32 tile GEMM and 8-lane softmax arithmetic (GCC/Clang vector extensions)
// for the CPU attention kernel. Internal to src/kernels/cpu: no allocation, no threads; every
// C element is one f32 sum in a fixed order, which the attention backward's determinism needs.
#pragma once

#if defined(__FMA__)
#include <immintrin.h>
#endif

#include <cmath>
#include <cstdint>
#include <cstring>

namespace shardlm::cpu::tile {

// ---- tile GEMM ---------------------------------------------------------------------------------
// C[M, N] (+)= A[M, K] B[K, N] with A(i, p) = a[i * a_row + p * a_col] (any strides, so that a
// transposed tile costs nothing), B rows ldb apart with unit column stride, C rows ldc apart.
// Every C element is one f32 sum over p in increasing order starting from zero, then added to C,
// whatever block shape computed it; the backward's determinism across strategies relies on it.

// Without AVX (SHARDLM_NATIVE=OFF) GCC notes that 32-byte vectors change the calling convention;
// these helpers are internal to this file and inlined, so that does not matter.
#pragma GCC diagnostic ignored "-Wpsabi"
using Vec8 = float __attribute__((vector_size(32)));

inline Vec8 load8(const float* p) {
  Vec8 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void store8(float* p, Vec8 v) { std::memcpy(p, &v, sizeof(v)); }

// a * b + c, fused wherever the target has FMA. Left to contraction, GCC's Zen tuning fuses
// some of these loops and not others (it avoids FMA chains), and then the same C element would
// round differently in different block shapes.
inline Vec8 fma8(Vec8 a, Vec8 b, Vec8 c) {
#if defined(__FMA__)
  return Vec8(_mm256_fmadd_ps(__m256(a), __m256(b), __m256(c)));
#else
  return a * b + c;
#endif
}

// MR x 8*kVecs block of C, all accumulators in registers.
template <int MR, int kVecs>
[[gnu::always_inline]] inline void gemm_block(int64_t K, const float* a, int64_t a_row,
                                              int64_t a_col, const float* b, int64_t ldb, float* c,
                                              int64_t ldc, bool accumulate) {
  Vec8 acc[MR][kVecs] = {};
  for (int64_t p = 0; p < K; ++p) {
    Vec8 bv[kVecs];
    for (int j = 0; j < kVecs; ++j) bv[j] = load8(b + p * ldb + 8 * j);
    for (int r = 0; r < MR; ++r) {
      const float ar = a[r * a_row + p * a_col];
      const Vec8 av = {ar, ar, ar, ar, ar, ar, ar, ar};
      for (int j = 0; j < kVecs; ++j) acc[r][j] = fma8(av, bv[j], acc[r][j]);
    }
  }
  for (int r = 0; r < MR; ++r) {
    for (int j = 0; j < kVecs; ++j) {
      float* cp = c + r * ldc + 8 * j;
      store8(cp, accumulate ? load8(cp) + acc[r][j] : acc[r][j]);
    }
  }
}

// The last n < 8 columns, through the same vector expression as gemm_block (a scalar loop
// would be contracted to FMA differently, or not at all).
template <int MR>
[[gnu::always_inline]] inline void gemm_block_tail(int64_t n, int64_t K, const float* a,
                                                   int64_t a_row, int64_t a_col, const float* b,
                                                   int64_t ldb, float* c, int64_t ldc,
                                                   bool accumulate) {
  Vec8 acc[MR] = {};
  for (int64_t p = 0; p < K; ++p) {
    Vec8 bv = {};
    for (int64_t j = 0; j < n; ++j) bv[j] = b[p * ldb + j];
    for (int r = 0; r < MR; ++r) {
      const float ar = a[r * a_row + p * a_col];
      const Vec8 av = {ar, ar, ar, ar, ar, ar, ar, ar};
      acc[r] = fma8(av, bv, acc[r]);
    }
  }
  for (int r = 0; r < MR; ++r) {
    for (int64_t j = 0; j < n; ++j) {
      c[r * ldc + j] = accumulate ? c[r * ldc + j] + acc[r][j] : acc[r][j];
    }
  }
}

template <int MR>
[[gnu::always_inline]] inline void gemm_rows(int64_t N, int64_t K, const float* a, int64_t a_row,
                                             int64_t a_col, const float* b, int64_t ldb, float* c,
                                             int64_t ldc, bool accumulate) {
  int64_t j = 0;
  for (; j + 16 <= N; j += 16) {
    gemm_block<MR, 2>(K, a, a_row, a_col, b + j, ldb, c + j, ldc, accumulate);
  }
  for (; j + 8 <= N; j += 8) {
    gemm_block<MR, 1>(K, a, a_row, a_col, b + j, ldb, c + j, ldc, accumulate);
  }
  if (j < N) gemm_block_tail<MR>(N - j, K, a, a_row, a_col, b + j, ldb, c + j, ldc, accumulate);
}

// 6x16 blocks measured fastest here (12 accumulators; ~90 GFLOP/s per core on 64^3, above
// OpenBLAS's ~77 for the same small product).
inline void gemm(int64_t M, int64_t N, int64_t K, const float* a, int64_t a_row, int64_t a_col,
                 const float* b, int64_t ldb, float* c, int64_t ldc, bool accumulate) {
  int64_t i = 0;
  for (; i + 6 <= M; i += 6) {
    gemm_rows<6>(N, K, a + i * a_row, a_row, a_col, b, ldb, c + i * ldc, ldc, accumulate);
  }
  for (; i + 4 <= M; i += 4) {
    gemm_rows<4>(N, K, a + i * a_row, a_row, a_col, b, ldb, c + i * ldc, ldc, accumulate);
  }
  for (; i < M; ++i) {
    gemm_rows<1>(N, K, a + i * a_row, a_row, a_col, b, ldb, c + i * ldc, ldc, accumulate);
  }
}

// ---- softmax arithmetic on 8 lanes ------------------------------------------------------------
// Written on Vec8 rather than left to the auto-vectorizer: GCC will not if-convert the clamps
// below under -ftrapping-math, and every lane must round the same way in both backward passes.

using Vec8i = int32_t __attribute__((vector_size(32)));

inline Vec8 splat(float x) { return Vec8{x, x, x, x, x, x, x, x}; }
inline Vec8i splat_i(int32_t x) { return Vec8i{x, x, x, x, x, x, x, x}; }
inline Vec8i load8i(const int32_t* p) {
  Vec8i v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline Vec8 max8(Vec8 a, Vec8 b) { return a < b ? b : a; }
const Vec8i kLane = {0, 1, 2, 3, 4, 5, 6, 7};

// 2^x (Cephes exp2f polynomial, < 2 ulp); exactly 0 for x <= -127, so masked scores (-inf) give
// p = 0. Callers pass x <= ~0.
inline Vec8 exp2_softmax(Vec8 x) {
  const Vec8 lo = splat(-127.0f), hi = splat(127.0f);
  const Vec8 round = splat(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer
  Vec8 xc = x < lo ? lo : x;
  xc = xc > hi ? hi : xc;
  const Vec8 big = xc + round;
  const Vec8 f = xc - (big - round);  // [-0.5, 0.5]
  Vec8 p = splat(1.535336188319500e-4f);
  p = fma8(p, f, splat(1.339887440266574e-3f));
  p = fma8(p, f, splat(9.618437357674640e-3f));
  p = fma8(p, f, splat(5.550332471162809e-2f));
  p = fma8(p, f, splat(2.402264791363012e-1f));
  p = fma8(p, f, splat(6.931472028550421e-1f));
  p = fma8(p, f, splat(1.0f));
  // 2^round(xc) built in the exponent field; round(xc) = -127 gives +0.
  const Vec8i e = (Vec8i(big) - Vec8i(round) + 127) << 23;
  return p * Vec8(e);
}

// Gemma 2's attention logit soft-capping of scaled scores s (natural units), lane by lane: the
// capped score cap * tanh(s / cap) in log2 units (times log2e), and, where slope is given, its
// derivative 1 - tanh^2 there. One scalar tanhf per lane, so the forward and both backward passes
// round every score alike.
inline Vec8 softcap_log2(Vec8 s, float cap, float log2e, Vec8* slope) {
  Vec8 capped, derivative;
  for (int i = 0; i < 8; ++i) {
    const float t = std::tanh(s[i] / cap);
    capped[i] = cap * t * log2e;
    derivative[i] = 1.0f - t * t;
  }
  if (slope != nullptr) *slope = derivative;
  return capped;
}

}  // namespace shardlm::cpu::tile
