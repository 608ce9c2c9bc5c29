// Tests of one block of attention for ring attention (attention_block_forward / _backward in
// src/kernels/cpu): a block of queries against a block of keys at offsets in the full row,
// against an f64 reference written here as plain loops; queries that see nothing; finite
// differences; GQA; argument errors. Blocks composing into the full row:
// test_attention_block_split.cpp.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "attention_block_util.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/ops.h"
#include "test_util.h"

namespace shardlm::test {
namespace {

constexpr double kNegInf = -std::numeric_limits<double>::infinity();

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

// ---- one block against the reference -----------------------------------------------------------

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

// ---- errors ------------------------------------------------------------------------------------

TEST(AttentionBlockErrors, RejectsBadArguments) {
  cpu::CpuBackend be;  // through the entry points, which check the arguments
  const RowCase c{1, 16, 4, 2, 8, false};
  Row r = make_row(c, 3);
  Block blk = cut_block(r, Span{8, 8}, Span{0, 6});
  std::vector<float> out(blk.q.size()), lse(blk.lse_shape().numel());
  std::vector<std::byte> ws = block_workspace(blk);
  const Shape seg_shape{1, 8};
  const auto forward = [&](Shape q_shape, Shape kv_shape, Shape lse_shape, int64_t q_offset,
                           int64_t k_offset, size_t ws_bytes) {
    be.attention_block_forward(
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
  EXPECT_THROW(be.attention_forward(view(blk.q, q), view(blk.k, kv), view(blk.v, kv),
                                    view(blk.seg, seg_shape), view(out, q), view(lse, l),
                                    Workspace{full_ws.data(), full_ws.size()}),
               Error);

  // Backward: dk must have k's shape.
  std::vector<float> dq(blk.q.size()), dk(blk.k.size() / 2), dv(blk.v.size());
  EXPECT_THROW(be.attention_block_backward(
                   view(blk.q, q), view(blk.k, kv), view(blk.v, kv), view(blk.seg, seg_shape), 8, 0,
                   view(out, q), view(lse, l), view(blk.dout, q), view(dq, q),
                   view(dk, Shape{1, 3, 2, 8}), view(dv, kv), Workspace{ws.data(), ws.size()}),
               Error);

  // Merge: out_b and lse_b must match; out must agree with lse's B, Hq, T.
  std::vector<float> out_b(out.size()), lse_b(lse.size());
  EXPECT_NO_THROW(be.attention_merge(view(out, q), view(lse, l), view(out_b, q), view(lse_b, l)));
  EXPECT_THROW(
      be.attention_merge(view(out, q), view(lse, l), view(out_b, Shape{8, 4, 8}), view(lse_b, l)),
      Error);
  EXPECT_THROW(be.attention_merge(view(out, Shape{1, 8, 8, 4}), view(lse, l),
                                  view(out_b, Shape{1, 8, 8, 4}), view(lse_b, l)),
               Error);
  EXPECT_THROW(be.attention_merge(view(out, q), view(lse, Shape{1, 8, 4}), view(out_b, q),
                                  view(lse_b, Shape{1, 8, 4})),
               Error);
}

}  // namespace
}  // namespace shardlm::test
