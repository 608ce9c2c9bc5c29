// Tests of block attention for ring attention (attention_block_forward / _backward and
// attention_merge in src/kernels/cpu): a block of queries against a block of keys at offsets in
// the full row, against an f64 reference written here as plain loops; splitting a full row's
// keys into blocks and merging reproduces attention_forward / attention_backward; queries that
// see nothing; finite differences; GQA; argument errors.
#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <ostream>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "kernels/cpu/ops.h"
#include "test_util.h"

namespace shardlm::test {
namespace {

// f32 kernel vs f64 reference (as in test_attention.cpp): f32 tile sums and the exp2 polynomial.
constexpr double kOutAtol = 5e-6, kOutRtol = 5e-5;    // out
constexpr double kLseAtol = 3e-6, kLseRtol = 3e-6;    // lse
constexpr double kGradAtol = 1e-5, kGradRtol = 1e-4;  // dq, dk, dv
constexpr double kNegInf = -std::numeric_limits<double>::infinity();

// One full row of B batch rows, T tokens; blocks are slices [offset, offset + len) of it.
struct RowCase {
  int64_t B, T, Hq, Hkv, Dh;
  bool docs;  // several packed documents per batch row, else one causal sequence
};

struct Span {
  int64_t offset, len;
};

std::string case_name(const RowCase& c) {
  return "B" + std::to_string(c.B) + "_T" + std::to_string(c.T) + "_Hq" + std::to_string(c.Hq) +
         "_Hkv" + std::to_string(c.Hkv) + "_Dh" + std::to_string(c.Dh) + (c.docs ? "_docs" : "");
}

// Document starts [B, T], full-row indices: random lengths in [1, max(2, T / 3)], so that
// boundaries fall anywhere inside and across blocks.
std::vector<int32_t> make_seg_start(const RowCase& c, uint64_t seed) {
  std::vector<int32_t> seg(c.B * c.T, 0);
  if (!c.docs) return seg;
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int64_t> len(1, std::max<int64_t>(2, c.T / 3));
  for (int64_t b = 0; b < c.B; ++b) {
    for (int64_t start = 0; start < c.T;) {
      const int64_t end = std::min(c.T, start + len(rng));
      for (int64_t t = start; t < end; ++t) seg[b * c.T + t] = static_cast<int32_t>(start);
      start = end;
    }
  }
  return seg;
}

struct Row {
  RowCase c;
  std::vector<float> q;      // [B, T, Hq, Dh]
  std::vector<float> k, v;   // [B, T, Hkv, Dh]
  std::vector<int32_t> seg;  // [B, T]
  std::vector<float> dout;   // [B, T, Hq, Dh]
};

Row make_row(const RowCase& c, uint64_t seed) {
  const size_t nq = c.B * c.T * c.Hq * c.Dh;
  const size_t nkv = c.B * c.T * c.Hkv * c.Dh;
  return Row{c,
             random_vec(nq, seed, -2.f, 2.f),
             random_vec(nkv, seed + 1, -2.f, 2.f),
             random_vec(nkv, seed + 2),
             make_seg_start(c, seed + 3),
             random_vec(nq, seed + 4)};
}

// Tokens [s.offset, s.offset + s.len) of x [B, T, width] -> [B, s.len, width].
template <typename X>
std::vector<X> slice_tokens(const std::vector<X>& x, int64_t B, int64_t T, int64_t width, Span s) {
  std::vector<X> y(B * s.len * width);
  for (int64_t b = 0; b < B; ++b) {
    std::copy_n(x.begin() + (b * T + s.offset) * width, s.len * width,
                y.begin() + b * s.len * width);
  }
  return y;
}

// Adds y [B, s.len, width] into tokens s of x [B, T, width].
template <typename X, typename Y>
void add_tokens(std::vector<X>& x, int64_t B, int64_t T, int64_t width, Span s,
                const std::vector<Y>& y) {
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t i = 0; i < s.len * width; ++i) {
      x[(b * T + s.offset) * width + i] += y[b * s.len * width + i];
    }
  }
}

// The inputs of one (query block, key block) pair, cut from a Row.
struct Block {
  RowCase c;
  Span qs, ks;
  std::vector<float> q, k, v, dout;
  std::vector<int32_t> seg;  // [B, Tq]
  Shape q_shape() const { return Shape{c.B, qs.len, c.Hq, c.Dh}; }
  Shape kv_shape() const { return Shape{c.B, ks.len, c.Hkv, c.Dh}; }
  Shape lse_shape() const { return Shape{c.B, c.Hq, qs.len}; }
};

Block cut_block(const Row& r, Span qs, Span ks) {
  const RowCase& c = r.c;
  return Block{c,
               qs,
               ks,
               slice_tokens(r.q, c.B, c.T, c.Hq * c.Dh, qs),
               slice_tokens(r.k, c.B, c.T, c.Hkv * c.Dh, ks),
               slice_tokens(r.v, c.B, c.T, c.Hkv * c.Dh, ks),
               slice_tokens(r.dout, c.B, c.T, c.Hq * c.Dh, qs),
               slice_tokens(r.seg, c.B, c.T, 1, qs)};
}

// lse [B, Hq, T] -> [B, Hq, s.len] for query tokens s.
template <typename X>
std::vector<X> slice_lse(const std::vector<X>& lse, const RowCase& c, Span s) {
  return slice_tokens(lse, c.B * c.Hq, c.T, 1, s);
}

// ---- f64 reference ---------------------------------------------------------------------------

struct RefBlock {
  const Block* blk;
  std::vector<double> q, k, v;  // as in Block
  size_t qi(int64_t b, int64_t t, int64_t h) const {
    const RowCase& c = blk->c;
    return ((b * blk->qs.len + t) * c.Hq + h) * c.Dh;
  }
  size_t ki(int64_t b, int64_t s, int64_t h) const {  // h: the query head
    const RowCase& c = blk->c;
    return ((b * blk->ks.len + s) * c.Hkv + h / (c.Hq / c.Hkv)) * c.Dh;
  }
  bool visible(int64_t b, int64_t t, int64_t s) const {
    const int64_t key = blk->ks.offset + s;
    return blk->seg[b * blk->qs.len + t] <= key && key <= blk->qs.offset + t;
  }
  double score(int64_t b, int64_t h, int64_t t, int64_t s) const {
    double dot = 0;
    for (int64_t e = 0; e < blk->c.Dh; ++e) dot += q[qi(b, t, h) + e] * k[ki(b, s, h) + e];
    return dot / std::sqrt(double(blk->c.Dh));
  }
};

RefBlock ref_block(const Block& blk) {
  return RefBlock{&blk, to_f64(blk.q), to_f64(blk.k), to_f64(blk.v)};
}

// out [B, Tq, Hq, Dh]; lse [B, Hq, Tq]; a query that sees no key gets out 0, lse -inf.
void ref_forward(const RefBlock& in, std::vector<double>* out, std::vector<double>* lse) {
  const RowCase& c = in.blk->c;
  const int64_t Tq = in.blk->qs.len, Tk = in.blk->ks.len;
  out->assign(c.B * Tq * c.Hq * c.Dh, 0.0);
  lse->assign(c.B * c.Hq * Tq, kNegInf);
  for (int64_t b = 0; b < c.B; ++b) {
    for (int64_t h = 0; h < c.Hq; ++h) {
      for (int64_t t = 0; t < Tq; ++t) {
        double m = kNegInf;
        for (int64_t s = 0; s < Tk; ++s) {
          if (in.visible(b, t, s)) m = std::max(m, in.score(b, h, t, s));
        }
        if (m == kNegInf) continue;
        double sum = 0;
        double* o = out->data() + in.qi(b, t, h);
        for (int64_t s = 0; s < Tk; ++s) {
          if (!in.visible(b, t, s)) continue;
          const double p = std::exp(in.score(b, h, t, s) - m);
          sum += p;
          for (int64_t e = 0; e < c.Dh; ++e) o[e] += p * in.v[in.ki(b, s, h) + e];
        }
        for (int64_t e = 0; e < c.Dh; ++e) o[e] /= sum;
        (*lse)[(b * c.Hq + h) * Tq + t] = m + std::log(sum);
      }
    }
  }
}

// The block's share of the gradients given the queries' final out and lse:
// P = exp(S - lse), D = dO . out, dS = P (dO V^T - D) / sqrt(Dh).
void ref_backward(const RefBlock& in, const std::vector<double>& out,
                  const std::vector<double>& lse, std::vector<double>* dq, std::vector<double>* dk,
                  std::vector<double>* dv) {
  const RowCase& c = in.blk->c;
  const int64_t Tq = in.blk->qs.len, Tk = in.blk->ks.len;
  const std::vector<double> dout = to_f64(in.blk->dout);
  const double scale = 1.0 / std::sqrt(double(c.Dh));
  dq->assign(in.q.size(), 0.0);
  dk->assign(in.k.size(), 0.0);
  dv->assign(in.v.size(), 0.0);
  for (int64_t b = 0; b < c.B; ++b) {
    for (int64_t h = 0; h < c.Hq; ++h) {
      for (int64_t t = 0; t < Tq; ++t) {
        const size_t qi = in.qi(b, t, h);
        double row_dot = 0;
        for (int64_t e = 0; e < c.Dh; ++e) row_dot += dout[qi + e] * out[qi + e];
        for (int64_t s = 0; s < Tk; ++s) {
          if (!in.visible(b, t, s)) continue;
          const size_t kv = in.ki(b, s, h);
          const double p = std::exp(in.score(b, h, t, s) - lse[(b * c.Hq + h) * Tq + t]);
          double dp = 0;
          for (int64_t e = 0; e < c.Dh; ++e) dp += dout[qi + e] * in.v[kv + e];
          const double ds = p * (dp - row_dot) * scale;
          for (int64_t e = 0; e < c.Dh; ++e) {
            (*dq)[qi + e] += ds * in.k[kv + e];
            (*dk)[kv + e] += ds * in.q[qi + e];
            (*dv)[kv + e] += p * dout[qi + e];
          }
        }
      }
    }
  }
}

// ---- kernels ---------------------------------------------------------------------------------

struct Fwd {
  std::vector<float> out, lse;
};
struct Grads {
  std::vector<float> dq, dk, dv;
};

std::vector<std::byte> block_workspace(const Block& blk) {
  const RowCase& c = blk.c;
  return std::vector<std::byte>(
      cpu::attention_block_workspace_bytes(c.B, blk.qs.len, blk.ks.len, c.Hq, c.Hkv, c.Dh));
}

Fwd block_forward(Block& blk) {
  Fwd f{std::vector<float>(blk.q.size(), NAN), std::vector<float>(blk.lse_shape().numel(), NAN)};
  std::vector<std::byte> ws = block_workspace(blk);
  cpu::attention_block_forward(
      view(blk.q, blk.q_shape()), view(blk.k, blk.kv_shape()), view(blk.v, blk.kv_shape()),
      view(blk.seg, Shape{blk.c.B, blk.qs.len}), blk.qs.offset, blk.ks.offset,
      view(f.out, blk.q_shape()), view(f.lse, blk.lse_shape()), Workspace{ws.data(), ws.size()});
  return f;
}

// out, lse: the queries' final results [B, Tq, Hq, Dh], [B, Hq, Tq].
Grads block_backward(Block& blk, std::vector<float> out, std::vector<float> lse) {
  Grads g{std::vector<float>(blk.q.size(), NAN), std::vector<float>(blk.k.size(), NAN),
          std::vector<float>(blk.v.size(), NAN)};  // overwritten: NaN must not leak through
  std::vector<std::byte> ws = block_workspace(blk);
  cpu::attention_block_backward(
      view(blk.q, blk.q_shape()), view(blk.k, blk.kv_shape()), view(blk.v, blk.kv_shape()),
      view(blk.seg, Shape{blk.c.B, blk.qs.len}), blk.qs.offset, blk.ks.offset,
      view(out, blk.q_shape()), view(lse, blk.lse_shape()), view(blk.dout, blk.q_shape()),
      view(g.dq, blk.q_shape()), view(g.dk, blk.kv_shape()), view(g.dv, blk.kv_shape()),
      Workspace{ws.data(), ws.size()});
  return g;
}

// attention_forward and attention_backward on the whole row.
struct FullResult {
  Fwd f;
  Grads g;
};
FullResult full_attention(Row& r) {
  const RowCase& c = r.c;
  const Shape q_shape{c.B, c.T, c.Hq, c.Dh}, kv_shape{c.B, c.T, c.Hkv, c.Dh};
  const Shape lse_shape{c.B, c.Hq, c.T};
  FullResult x{{std::vector<float>(r.q.size()), std::vector<float>(lse_shape.numel())},
               {std::vector<float>(r.q.size()), std::vector<float>(r.k.size()),
                std::vector<float>(r.v.size())}};
  std::vector<std::byte> ws(cpu::attention_workspace_bytes(c.B, c.T, c.Hq, c.Hkv, c.Dh));
  const Workspace w{ws.data(), ws.size()};
  const Tensor q = view(r.q, q_shape), k = view(r.k, kv_shape), v = view(r.v, kv_shape);
  const Tensor seg = view(r.seg, Shape{c.B, c.T});
  const Tensor out = view(x.f.out, q_shape), lse = view(x.f.lse, lse_shape);
  cpu::attention_forward(q, k, v, seg, out, lse, w);
  cpu::attention_backward(q, k, v, seg, out, lse, view(r.dout, q_shape), view(x.g.dq, q_shape),
                          view(x.g.dk, kv_shape), view(x.g.dv, kv_shape), w);
  return x;
}

void merge(const Block& blk, Fwd& running, Fwd& part) {
  cpu::attention_merge(view(running.out, blk.q_shape()), view(running.lse, blk.lse_shape()),
                       view(part.out, blk.q_shape()), view(part.lse, blk.lse_shape()));
}

// ---- one block against the reference -----------------------------------------------------------

struct BlockCase {
  RowCase c;
  Span qs, ks;
};

std::string block_case_name(const BlockCase& x) {
  return case_name(x.c) + "_q" + std::to_string(x.qs.offset) + "_" + std::to_string(x.qs.len) +
         "_k" + std::to_string(x.ks.offset) + "_" + std::to_string(x.ks.len);
}

// Names the case in failure messages instead of its bytes.
void PrintTo(const BlockCase& x, std::ostream* os) { *os << block_case_name(x); }

class AttentionBlockTest : public ::testing::TestWithParam<BlockCase> {};

TEST_P(AttentionBlockTest, ForwardMatchesReference) {
  const BlockCase& x = GetParam();
  Row r = make_row(x.c, 7);
  Block blk = cut_block(r, x.qs, x.ks);
  const Fwd f = block_forward(blk);
  std::vector<double> out, lse;
  ref_forward(ref_block(blk), &out, &lse);
  EXPECT_CLOSE(f.out, out, kOutAtol, kOutRtol);
  for (size_t i = 0; i < lse.size(); ++i) {
    if (lse[i] == kNegInf) {
      ASSERT_EQ(f.lse[i], -INFINITY) << "lse " << i;
    } else {
      ASSERT_NEAR(f.lse[i], lse[i], kLseAtol + kLseRtol * std::abs(lse[i])) << "lse " << i;
    }
  }
}

// The gradients' block share, with the final out and lse of the whole row's attention.
TEST_P(AttentionBlockTest, BackwardMatchesReference) {
  const BlockCase& x = GetParam();
  Row r = make_row(x.c, 13);
  Block blk = cut_block(r, x.qs, x.ks);
  Block all_keys = cut_block(r, x.qs, Span{0, x.c.T});
  std::vector<double> out, lse;
  ref_forward(ref_block(all_keys), &out, &lse);
  const std::vector<float> out32(out.begin(), out.end()), lse32(lse.begin(), lse.end());
  const Grads g = block_backward(blk, out32, lse32);
  std::vector<double> dq, dk, dv;
  ref_backward(ref_block(blk), to_f64(out32), to_f64(lse32), &dq, &dk, &dv);
  EXPECT_CLOSE(g.dq, dq, kGradAtol, kGradRtol);
  EXPECT_CLOSE(g.dk, dk, kGradAtol, kGradRtol);
  EXPECT_CLOSE(g.dv, dv, kGradAtol, kGradRtol);
}

// Blocks on and off the 64-tile grid: keys wholly before the queries, overlapping the diagonal,
// wholly after (nothing visible), and single tokens; MHA and GQA (Hkv 2 and 1). With 2 threads,
// B * Hkv = 1 takes the two-pass backward and B * Hkv >= 2 the fused one.
INSTANTIATE_TEST_SUITE_P(
    Blocks, AttentionBlockTest,
    ::testing::Values(BlockCase{{1, 200, 4, 2, 16, true}, {130, 70}, {0, 130}},
                      BlockCase{{2, 200, 4, 1, 8, true}, {100, 100}, {37, 100}},
                      BlockCase{{1, 200, 4, 4, 16, false}, {70, 130}, {70, 130}},
                      BlockCase{{2, 200, 4, 2, 64, true}, {0, 150}, {50, 150}},
                      BlockCase{{1, 200, 4, 1, 12, true}, {3, 80}, {90, 110}},
                      BlockCase{{2, 160, 2, 2, 8, true}, {159, 1}, {0, 160}},
                      BlockCase{{1, 160, 4, 2, 8, false}, {10, 140}, {77, 1}},
                      BlockCase{{1, 140, 4, 1, 16, true}, {65, 75}, {1, 130}}),
    [](const ::testing::TestParamInfo<BlockCase>& info) { return block_case_name(info.param); });

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

// Uneven blocks off the tile grid: three key blocks of 70, 3 and 127 tokens, two query blocks.
TEST(AttentionBlockSplit, UnevenBlocksEqualFullRow) {
  check_split({{2, 200, 4, 2, 8, true}, {{0, 133}, {133, 67}}, {{73, 127}, {0, 70}, {70, 3}}});
}

// ---- queries that see nothing ------------------------------------------------------------------

// Keys after every query, or before a query's document: out is 0 and lse -inf exactly, the
// block's gradients are 0, and merging the block changes nothing.
TEST(AttentionBlockEmpty, InvisibleKeysGiveZeroAndMinusInf) {
  const RowCase c{2, 160, 4, 2, 8, false};
  Row r = make_row(c, 19);
  for (int64_t b = 0; b < c.B; ++b) {  // documents [0, 100) and [100, 160)
    for (int64_t t = 100; t < c.T; ++t) r.seg[b * c.T + t] = 100;
  }
  // Queries [100, 160) against keys [0, 80): all in another document. Queries [0, 80) against
  // keys [80, 160): all in the future.
  for (const auto& [qs, ks] :
       {std::pair{Span{100, 60}, Span{0, 80}}, std::pair{Span{0, 80}, Span{80, 80}}}) {
    SCOPED_TRACE("queries at " + std::to_string(qs.offset));
    Block blk = cut_block(r, qs, ks);
    const Fwd f = block_forward(blk);
    EXPECT_TRUE(std::all_of(f.out.begin(), f.out.end(), [](float x) { return x == 0.0f; }));
    EXPECT_TRUE(std::all_of(f.lse.begin(), f.lse.end(), [](float x) { return x == -INFINITY; }));

    Block own = cut_block(r, qs, qs);  // the diagonal block: every query sees itself
    Fwd running = block_forward(own);
    const Fwd before = running;
    Fwd part = f;
    merge(blk, running, part);
    EXPECT_EQ(running.out, before.out);
    EXPECT_EQ(running.lse, before.lse);
    Fwd from_empty = f;  // the other way round: a running result that has seen nothing yet
    Fwd diagonal = before;
    merge(blk, from_empty, diagonal);
    EXPECT_EQ(from_empty.out, before.out);
    EXPECT_EQ(from_empty.lse, before.lse);
    Fwd both_empty = f;
    Fwd empty = f;
    merge(blk, both_empty, empty);
    EXPECT_EQ(both_empty.out, f.out);
    EXPECT_EQ(both_empty.lse, f.lse);

    const Grads g = block_backward(blk, before.out, before.lse);
    for (const auto* x : {&g.dq, &g.dk, &g.dv}) {
      EXPECT_TRUE(std::all_of(x->begin(), x->end(), [](float v) { return v == 0.0f; }));
    }
  }
}

// ---- gradient check ----------------------------------------------------------------------------

// One block is the full attention over its keys: loss = sum(dout * out) with the block's own out
// and lse. The kernel's gradients against central differences of the f64 reference forward;
// blocks where some queries see no key, GQA groups of 2 and 4.
TEST(AttentionBlockGradient, MatchesFiniteDifferences) {
  for (const BlockCase& x : {BlockCase{{1, 24, 2, 1, 8, true}, {12, 9}, {5, 10}},
                             BlockCase{{2, 20, 4, 2, 8, true}, {8, 12}, {2, 14}},
                             BlockCase{{1, 20, 4, 1, 16, false}, {4, 16}, {6, 7}}}) {
    SCOPED_TRACE(block_case_name(x));
    Row r = make_row(x.c, 23);
    Block blk = cut_block(r, x.qs, x.ks);
    const Fwd f = block_forward(blk);
    const Grads g = block_backward(blk, f.out, f.lse);
    RefBlock in = ref_block(blk);
    const std::vector<double> dout = to_f64(blk.dout);
    auto loss = [&] {
      std::vector<double> out, lse;
      ref_forward(in, &out, &lse);
      double sum = 0;
      for (size_t i = 0; i < out.size(); ++i) sum += dout[i] * out[i];
      return sum;
    };
    EXPECT_CLOSE(g.dq, finite_difference(in.q, loss), kGradAtol, kGradRtol);
    EXPECT_CLOSE(g.dk, finite_difference(in.k, loss), kGradAtol, kGradRtol);
    EXPECT_CLOSE(g.dv, finite_difference(in.v, loss), kGradAtol, kGradRtol);
  }
}

// ---- merge, full-row equivalence, determinism, errors ------------------------------------------

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

TEST(AttentionBlockErrors, RejectsBadArguments) {
  const RowCase c{1, 16, 4, 2, 8, false};
  Row r = make_row(c, 3);
  Block blk = cut_block(r, Span{8, 8}, Span{0, 6});
  std::vector<float> out(blk.q.size()), lse(blk.lse_shape().numel());
  std::vector<std::byte> ws = block_workspace(blk);
  const Shape seg_shape{1, 8};
  const auto forward = [&](Shape q_shape, Shape kv_shape, Shape lse_shape, int64_t q_offset,
                           int64_t k_offset, size_t ws_bytes) {
    cpu::attention_block_forward(
        Tensor(blk.q.data(), DType::kF32, q_shape), Tensor(blk.k.data(), DType::kF32, kv_shape),
        Tensor(blk.v.data(), DType::kF32, kv_shape), view(blk.seg, seg_shape), q_offset, k_offset,
        Tensor(out.data(), DType::kF32, q_shape), Tensor(lse.data(), DType::kF32, lse_shape),
        Workspace{ws.data(), ws_bytes});
  };
  const Shape q{1, 8, 4, 8}, kv{1, 6, 2, 8}, l{1, 4, 8};
  EXPECT_NO_THROW(forward(q, kv, l, 8, 0, ws.size()));
  EXPECT_THROW(forward(q, kv, l, -1, 0, ws.size()), Error);                 // negative offset
  EXPECT_THROW(forward(q, kv, l, 8, -3, ws.size()), Error);                 // negative offset
  EXPECT_THROW(forward(q, kv, Shape{1, 4, 6}, 8, 0, ws.size()), Error);     // lse has Tk, not Tq
  EXPECT_THROW(forward(q, Shape{1, 4, 3, 8}, l, 8, 0, ws.size()), Error);   // Hq % Hkv != 0
  EXPECT_THROW(forward(q, Shape{1, 3, 2, 16}, l, 8, 0, ws.size()), Error);  // Dh differs
  EXPECT_THROW(forward(q, kv, l, 8, 0, 0), Error);                          // no workspace
  blk.seg[0] = 9;  // query 0 sits at 8 of the full row: its document cannot start at 9
  EXPECT_THROW(forward(q, kv, l, 8, 0, ws.size()), Error);
  EXPECT_NO_THROW(forward(q, kv, l, 9, 0, ws.size()));
  blk.seg[0] = 8;

  // The full-row op wants as many keys as queries.
  std::vector<std::byte> full_ws(cpu::attention_block_workspace_bytes(1, 8, 8, 4, 2, 8));
  EXPECT_THROW(cpu::attention_forward(view(blk.q, q), view(blk.k, kv), view(blk.v, kv),
                                      view(blk.seg, seg_shape), view(out, q), view(lse, l),
                                      Workspace{full_ws.data(), full_ws.size()}),
               Error);

  // Backward: dk must have k's shape.
  std::vector<float> dq(blk.q.size()), dk(blk.k.size() / 2), dv(blk.v.size());
  EXPECT_THROW(cpu::attention_block_backward(
                   view(blk.q, q), view(blk.k, kv), view(blk.v, kv), view(blk.seg, seg_shape), 8, 0,
                   view(out, q), view(lse, l), view(blk.dout, q), view(dq, q),
                   view(dk, Shape{1, 3, 2, 8}), view(dv, kv), Workspace{ws.data(), ws.size()}),
               Error);

  // Merge: out_b and lse_b must match; out must agree with lse's B, Hq, T.
  std::vector<float> out_b(out.size()), lse_b(lse.size());
  EXPECT_NO_THROW(cpu::attention_merge(view(out, q), view(lse, l), view(out_b, q), view(lse_b, l)));
  EXPECT_THROW(
      cpu::attention_merge(view(out, q), view(lse, l), view(out_b, Shape{8, 4, 8}), view(lse_b, l)),
      Error);
  EXPECT_THROW(cpu::attention_merge(view(out, Shape{1, 8, 8, 4}), view(lse, l),
                                    view(out_b, Shape{1, 8, 8, 4}), view(lse_b, l)),
               Error);
  EXPECT_THROW(cpu::attention_merge(view(out, q), view(lse, Shape{1, 8, 4}), view(out_b, q),
                                    view(lse_b, Shape{1, 8, 4})),
               Error);
}

}  // namespace
}  // namespace shardlm::test
