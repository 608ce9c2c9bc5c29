// Tests of block attention composing into the full row (ring attention): splitting a row's keys
// into blocks and merging with attention_merge reproduces attention_forward / attention_backward,
// on f32 and on bf16 storage; merge against its f64 formula; offsets 0 equal the full-row ops bit
// for bit; the block backward is bit-identical across thread counts. One block against the f64
// reference: test_attention_block.cpp.
#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

#include "attention_block_util.h"
#include "kernels/cpu/ops.h"
#include "test_util.h"

namespace shardlm::test {
namespace {

// ---- splitting a row's keys into blocks reproduces full attention ------------------------------

struct SplitCase {
  RowCase c;
  std::vector<Span> query_blocks;  // each query block sees every key block, in order
  std::vector<Span> key_blocks;    // a partition of [0, T), any order
};

// Forward: per query block, merging its key blocks' results equals attention_forward's rows.
// Backward: per query block, dq summed over key blocks; per key block, dk / dv summed over query
// blocks; each equals attention_backward's rows, given the merged out and lse.
void check_split(const SplitCase& x) {
  Row r = make_row(x.c, 17);
  const RowCase& c = r.c;
  const FullResult full = full_attention(r);
  std::vector<double> dq(r.q.size(), 0.0), dk(r.k.size(), 0.0), dv(r.v.size(), 0.0);
  for (const Span& qs : x.query_blocks) {
    SCOPED_TRACE("query block at " + std::to_string(qs.offset));
    Fwd running{std::vector<float>(c.B * qs.len * c.Hq * c.Dh, 0.0f),
                std::vector<float>(c.B * c.Hq * qs.len, -INFINITY)};
    for (const Span& ks : x.key_blocks) {
      Block blk = cut_block(r, qs, ks);
      Fwd part = block_forward(blk);
      merge(blk, running, part);
    }
    EXPECT_CLOSE(running.out, slice_tokens(full.f.out, c.B, c.T, c.Hq * c.Dh, qs), kOutAtol,
                 kOutRtol);
    EXPECT_CLOSE(running.lse, slice_lse(full.f.lse, c, qs), kLseAtol, kLseRtol);
    for (const Span& ks : x.key_blocks) {
      Block blk = cut_block(r, qs, ks);
      const Grads g = block_backward(blk, running.out, running.lse);
      add_tokens(dq, c.B, c.T, c.Hq * c.Dh, qs, g.dq);
      add_tokens(dk, c.B, c.T, c.Hkv * c.Dh, ks, g.dk);
      add_tokens(dv, c.B, c.T, c.Hkv * c.Dh, ks, g.dv);
    }
  }
  EXPECT_CLOSE(dq, full.g.dq, kGradAtol, kGradRtol);
  EXPECT_CLOSE(dk, full.g.dk, kGradAtol, kGradRtol);
  EXPECT_CLOSE(dv, full.g.dv, kGradAtol, kGradRtol);
}

TEST(AttentionBlockSplit, TwoKeyBlocksEqualFullRow) {
  check_split({{2, 150, 4, 2, 16, true}, {{0, 150}}, {{0, 90}, {90, 60}}});
  check_split({{1, 150, 4, 1, 8, false}, {{0, 150}}, {{90, 60}, {0, 90}}});
}

// Ring attention's zig-zag layout: a 4C row in chunks 0..3, rank 0 holding chunks 0 and 3, rank 1
// chunks 1 and 2; each query chunk meets the key chunks in ring order.
TEST(AttentionBlockSplit, ZigZagChunksEqualFullRow) {
  const int64_t C = 50;
  const std::vector<Span> chunks{{0, C}, {C, C}, {2 * C, C}, {3 * C, C}};
  const std::vector<Span> ring_order{chunks[0], chunks[3], chunks[1], chunks[2]};
  for (const RowCase& c : {RowCase{1, 4 * C, 4, 2, 16, true}, RowCase{2, 4 * C, 4, 1, 8, true},
                           RowCase{1, 4 * C, 4, 4, 64, false}}) {
    SCOPED_TRACE(case_name(c));
    check_split({c, chunks, ring_order});
  }
}

// The same with sliding windows shorter than a chunk (most key chunks wholly outside: their
// blocks give -inf and merge as nothing), as long as one, and reaching over two chunks.
TEST(AttentionBlockSplit, ZigZagChunksWithSlidingWindowEqualFullRow) {
  const int64_t C = 50;
  const std::vector<Span> chunks{{0, C}, {C, C}, {2 * C, C}, {3 * C, C}};
  const std::vector<Span> ring_order{chunks[0], chunks[3], chunks[1], chunks[2]};
  for (const RowCase& c :
       {RowCase{1, 4 * C, 4, 2, 16, true, 7}, RowCase{2, 4 * C, 4, 1, 8, false, C},
        RowCase{1, 4 * C, 4, 4, 64, true, 120}, RowCase{2, 4 * C, 2, 1, 8, false, 1}}) {
    SCOPED_TRACE(case_name(c));
    check_split({c, chunks, ring_order});
  }
}

// Uneven blocks off the tile grid: three key blocks of 70, 3 and 127 tokens, two query blocks.
TEST(AttentionBlockSplit, UnevenBlocksEqualFullRow) {
  check_split({{2, 200, 4, 2, 8, true}, {{0, 133}, {133, 67}}, {{73, 127}, {0, 70}, {70, 3}}});
}

// ---- the same on bf16 storage ------------------------------------------------------------------

// The split rounds where the whole row does not: each block's out is rounded to bf16 before the
// merge (done here on f32 copies of the blocks' outputs), the merged out once more before the
// backward (D = rowsum(dO * O) reads it), and dq sums the key blocks' rounded shares; the whole
// row rounds each result once. A few bf16 steps (2^-8 relative each) of the largest values:
// atol is relative to the largest magnitude of each tensor, rtol to the element. lse stays f32
// (the blocks compute it from the same bf16 inputs): the f32 tolerances.
constexpr double kBf16Atol = 1e-2, kBf16Rtol = 1e-2;  // x max |x|; out, dq, dk, dv

double max_abs(const std::vector<float>& x) {
  double m = 0;
  for (float v : x) m = std::max(m, double(std::abs(v)));
  return m;
}

void check_split_bf16(const SplitCase& x) {
  Row r = make_row(x.c, 17);
  round_to_bf16(r);
  const RowCase& c = r.c;
  const FullResultBf16 full = full_attention_bf16(r);
  const std::vector<float> full_out = from_bf16(full.f.out);
  std::vector<double> dq(r.q.size(), 0.0), dk(r.k.size(), 0.0), dv(r.v.size(), 0.0);
  for (const Span& qs : x.query_blocks) {
    SCOPED_TRACE("query block at " + std::to_string(qs.offset));
    Fwd running{std::vector<float>(c.B * qs.len * c.Hq * c.Dh, 0.0f),
                std::vector<float>(c.B * c.Hq * qs.len, -INFINITY)};
    for (const Span& ks : x.key_blocks) {
      Block blk = cut_block(r, qs, ks);
      const Bf16Fwd part16 = block_forward_bf16(blk);
      Fwd part{from_bf16(part16.out), part16.lse};
      merge(blk, running, part);
    }
    const Bf16Vec out16 = to_bf16(running.out);
    EXPECT_CLOSE(from_bf16(out16), slice_tokens(full_out, c.B, c.T, c.Hq * c.Dh, qs),
                 kBf16Atol * max_abs(full_out), kBf16Rtol);
    EXPECT_CLOSE(running.lse, slice_lse(full.f.lse, c, qs), kLseAtol, kLseRtol);
    for (const Span& ks : x.key_blocks) {
      Block blk = cut_block(r, qs, ks);
      const Bf16Grads g = block_backward_bf16(blk, out16, running.lse);
      add_tokens(dq, c.B, c.T, c.Hq * c.Dh, qs, from_bf16(g.dq));
      add_tokens(dk, c.B, c.T, c.Hkv * c.Dh, ks, from_bf16(g.dk));
      add_tokens(dv, c.B, c.T, c.Hkv * c.Dh, ks, from_bf16(g.dv));
    }
  }
  for (const auto& [got, want, name] :
       {std::tuple{&dq, &full.g.dq, "dq"}, std::tuple{&dk, &full.g.dk, "dk"},
        std::tuple{&dv, &full.g.dv, "dv"}}) {
    const std::vector<float> whole = from_bf16(*want);
    EXPECT_CLOSE(*got, whole, kBf16Atol * max_abs(whole), kBf16Rtol) << name;
  }
}

TEST(AttentionBlockSplitBf16, TwoKeyBlocksEqualFullRow) {
  check_split_bf16({{2, 150, 4, 2, 16, true}, {{0, 150}}, {{0, 90}, {90, 60}}});
  check_split_bf16({{1, 150, 4, 1, 8, false}, {{0, 150}}, {{90, 60}, {0, 90}}});
}

// Two query blocks against three uneven key blocks, off the tile grid.
TEST(AttentionBlockSplitBf16, UnevenBlocksEqualFullRow) {
  check_split_bf16({{2, 200, 4, 2, 8, true}, {{0, 133}, {133, 67}}, {{73, 127}, {0, 70}, {70, 3}}});
}

// ---- merge, full-row equivalence, determinism --------------------------------------------------

// Elementwise against the f64 formula, [N, Hq, Dh] layout, lse far apart and equal.
TEST(AttentionMerge, MatchesReference) {
  const int64_t B = 2, T = 5, Hq = 3, Dh = 4;
  std::vector<float> out = random_vec(B * T * Hq * Dh, 1), out_b = random_vec(out.size(), 2);
  std::vector<float> lse = random_vec(B * Hq * T, 3, -5.f, 5.f);
  std::vector<float> lse_b = random_vec(lse.size(), 4, -5.f, 5.f);
  lse[0] = lse_b[0] = 1.5f;
  lse[1] = 80.0f;  // exp(lse) alone would overflow f32
  lse_b[1] = 90.0f;
  std::vector<double> want_out(out.size()), want_lse(lse.size());
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < Hq; ++h) {
      for (int64_t t = 0; t < T; ++t) {
        const size_t i = (b * Hq + h) * T + t;
        const double m = std::max(lse[i], lse_b[i]);
        const double wa = std::exp(lse[i] - m), wb = std::exp(lse_b[i] - m);
        want_lse[i] = m + std::log(wa + wb);
        for (int64_t e = 0; e < Dh; ++e) {
          const size_t o = ((b * T + t) * Hq + h) * Dh + e;
          want_out[o] = (wa * out[o] + wb * out_b[o]) / (wa + wb);
        }
      }
    }
  }
  cpu::attention_merge(view(out, Shape{B * T, Hq, Dh}), view(lse, Shape{B, Hq, T}),
                       view(out_b, Shape{B * T, Hq, Dh}), view(lse_b, Shape{B, Hq, T}));
  EXPECT_CLOSE(out, want_out, 1e-6, 1e-6);
  EXPECT_CLOSE(lse, want_lse, 1e-6, 1e-6);
}

// The full-row ops are the block form at offsets 0, bit for bit.
TEST(AttentionBlockFullRow, OffsetsZeroEqualAttentionForwardAndBackward) {
  const RowCase c{2, 130, 4, 2, 16, true};
  Row r = make_row(c, 29);
  const FullResult full = full_attention(r);
  Block blk = cut_block(r, Span{0, c.T}, Span{0, c.T});
  const Fwd f = block_forward(blk);
  EXPECT_EQ(f.out, full.f.out);
  EXPECT_EQ(f.lse, full.f.lse);
  const Grads g = block_backward(blk, f.out, f.lse);
  EXPECT_EQ(g.dq, full.g.dq);
  EXPECT_EQ(g.dk, full.g.dk);
  EXPECT_EQ(g.dv, full.g.dv);
}

TEST(AttentionBlockBackward, BitIdenticalAcrossThreadCounts) {
  const int saved = omp_get_max_threads();
  for (const BlockCase& x : {BlockCase{{1, 300, 4, 1, 16, true}, {150, 150}, {20, 200}},
                             BlockCase{{2, 200, 4, 2, 16, false}, {130, 70}, {0, 170}}}) {
    SCOPED_TRACE(block_case_name(x));
    Row r = make_row(x.c, 37);
    Block blk = cut_block(r, x.qs, x.ks);
    omp_set_num_threads(1);
    const Fwd f = block_forward(blk);
    const Grads one = block_backward(blk, f.out, f.lse);
    for (int threads : {2, 3}) {
      omp_set_num_threads(threads);
      const Grads many = block_backward(blk, f.out, f.lse);
      EXPECT_EQ(many.dq, one.dq) << threads << " threads";
      EXPECT_EQ(many.dk, one.dk) << threads << " threads";
      EXPECT_EQ(many.dv, one.dv) << threads << " threads";
    }
  }
  omp_set_num_threads(saved);
}

}  // namespace
}  // namespace shardlm::test
