// Tests of the CPU kernels of the vocabulary-parallel embedding and loss (embedding.cpp's
// *_slice, xent_slice.cpp), with P simulated ranks each holding V/P vocabulary rows and the
// reductions between the calls done here: the summed slice embeddings equal the whole gather
// exactly and the slice backwards the whole one's rows; the loss, from the statistics reduced
// over the slices, matches an f64 reference on the whole [n, V] logits, and the concatenated
// dlogits match central finite differences of that reference; ignored targets give nothing;
// ids outside the whole vocabulary are data errors raised before any write, targets after the
// statistics' write, a bad target's row left as an ignored one's; bf16 logits get their
// gradient rounded once.
// Tolerances (f32 kernel vs f64 reference): loss rtol 1e-6; dlogits atol 1e-6 rtol 1e-4.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/ops.h"
#include "test_util.h"
#include "xent_ref.h"

namespace shardlm {
namespace {

using test::view;

// ---- embedding ---------------------------------------------------------------------------------

TEST(EmbeddingSlice, SlicesSumToTheWholeGatherAndSplitTheBackward) {
  const int64_t n = 37, vocab = 12, d = 70;
  std::vector<int32_t> tok(n);
  for (int64_t i = 0; i < n; ++i) tok[i] = int32_t((i * 7 + 3) % vocab);
  std::vector<float> table = test::random_vec(vocab * d, 1), dout = test::random_vec(n * d, 2);
  std::vector<float> whole(n * d), dwhole(vocab * d, 0.f);
  cpu::embedding_forward(view(tok, {n}), view(table, {vocab, d}), view(whole, {n, d}));
  cpu::embedding_backward(view(tok, {n}), view(dout, {n, d}), view(dwhole, {vocab, d}));
  for (int64_t P : {1, 2, 3, 4}) {
    SCOPED_TRACE(P);
    const int64_t rows = vocab / P;
    std::vector<float> sum(n * d, 0.f);
    for (int64_t r = 0; r < P; ++r) {
      std::vector<float> slice(table.begin() + r * rows * d, table.begin() + (r + 1) * rows * d);
      std::vector<float> out(n * d, NAN), dslice(rows * d, 0.f);
      cpu::embedding_forward_slice(view(tok, {n}), view(slice, {rows, d}), r * rows, vocab,
                                   view(out, {n, d}));
      for (int64_t i = 0; i < n * d; ++i) sum[i] += out[i];
      cpu::embedding_backward_slice(view(tok, {n}), view(dout, {n, d}), r * rows, vocab,
                                    view(dslice, {rows, d}));
      // the whole backward's rows of this slice, summed in the same (token) order
      for (int64_t i = 0; i < rows * d; ++i)
        ASSERT_EQ(dslice[i], dwhole[r * rows * d + i]) << "rank " << r << " elem " << i;
    }
    for (int64_t i = 0; i < n * d; ++i) ASSERT_EQ(sum[i], whole[i]) << "elem " << i;  // x + 0 = x
  }
}

TEST(EmbeddingSlice, IdsOutsideTheWholeVocabularyAreDataErrors) {
  cpu::CpuBackend be;                 // through the entry points, which check the arguments
  std::vector<int32_t> tok = {1, 8};  // 8 is in [0, 9), outside this rank's [3, 6): a zero row
  std::vector<float> table = test::random_vec(3 * 2, 3), out(4, NAN);
  be.embedding_forward_slice(view(tok, {2}), view(table, {3, 2}), 3, 9, view(out, {2, 2}));
  EXPECT_EQ(out, std::vector<float>(4, 0.f));
  tok[1] = 9;  // outside the whole vocabulary
  out.assign(4, 7.f);
  try {
    be.embedding_forward_slice(view(tok, {2}), view(table, {3, 2}), 3, 9, view(out, {2, 2}));
    ADD_FAILURE() << "expected a data error";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kData);
    EXPECT_NE(std::string(e.what()).find("token id 9"), std::string::npos) << e.what();
  }
  EXPECT_EQ(out, std::vector<float>(4, 7.f));  // nothing written
  std::vector<float> dtable(6, 1.f);
  EXPECT_THROW(
      be.embedding_backward_slice(view(tok, {2}), view(out, {2, 2}), 3, 9, view(dtable, {3, 2})),
      Error);
  EXPECT_EQ(dtable, std::vector<float>(6, 1.f));
  // A slice that does not fit in the vocabulary is a caller's bug.
  tok[1] = 2;
  EXPECT_THROW(
      be.embedding_forward_slice(view(tok, {2}), view(table, {3, 2}), 7, 9, view(out, {2, 2})),
      Error);
}

// ---- cross-entropy over slices -----------------------------------------------------------------

struct SliceRun {
  std::vector<LossResult> per_rank;  // every rank's result (all equal)
  std::vector<float> dlogits;        // [n, V]: the ranks' slices put back together
};

// P ranks each with logits[:, r V/P : (r+1) V/P]; the all-reduces done here.
SliceRun run_slices(const std::vector<float>& logits, std::vector<int32_t>& targets, int64_t n,
                    int64_t V, int64_t P, float grad_scale, bool want_grad) {
  const int64_t vs = V / P;
  std::vector<std::vector<float>> slice(P, std::vector<float>(n * vs));
  for (int64_t r = 0; r < P; ++r)
    for (int64_t i = 0; i < n; ++i) std::copy_n(&logits[i * V + r * vs], vs, &slice[r][i * vs]);
  std::vector<std::vector<float>> mx(P, std::vector<float>(n)), st(P, std::vector<float>(2 * n));
  std::vector<float> max_all(n, -INFINITY), stats_all(2 * n, 0.f);
  for (int64_t r = 0; r < P; ++r) {
    cpu::xent_slice_max(view(slice[r], {n, vs}), view(mx[r], {n}));
    for (int64_t i = 0; i < n; ++i) max_all[i] = std::max(max_all[i], mx[r][i]);
  }
  for (int64_t r = 0; r < P; ++r) {
    cpu::xent_slice_stats(view(slice[r], {n, vs}), view(targets, {n}), r * vs, V,
                          view(max_all, {n}), view(st[r], {n, 2}));
    for (int64_t i = 0; i < 2 * n; ++i) stats_all[i] += st[r][i];
  }
  SliceRun out;
  out.dlogits.resize(n * V);
  for (int64_t r = 0; r < P; ++r) {
    out.per_rank.push_back(cpu::xent_slice_finish(view(slice[r], {n, vs}), view(targets, {n}),
                                                  r * vs, view(max_all, {n}),
                                                  view(stats_all, {n, 2}), grad_scale, want_grad));
    for (int64_t i = 0; i < n; ++i)
      std::copy_n(&slice[r][i * vs], vs, &out.dlogits[i * V + r * vs]);
  }
  return out;
}

TEST(XentSlice, LossAndGradientMatchTheWholeVocabularyReference) {
  const int64_t n = 9, V = 24;
  const float scale = 0.37f;
  std::vector<float> logits = test::random_vec(n * V, 4, -4.f, 4.f);
  std::vector<int32_t> targets(n);
  for (int64_t i = 0; i < n; ++i) targets[i] = int32_t((i * 5 + 1) % V);
  targets[3] = kIgnoreIndex;
  targets[7] = kIgnoreIndex;
  std::vector<double> l64 = test::to_f64(logits);
  const double want = test::cross_entropy_sum_ref(l64, targets, n, V);
  // d(scale * loss) / d logits by central differences of the f64 reference.
  std::vector<double> fd =
      test::finite_difference(l64, [&] { return test::cross_entropy_sum_ref(l64, targets, n, V); });
  for (double& g : fd) g *= scale;
  for (int64_t P : {1, 2, 3, 4, 6}) {
    SCOPED_TRACE(P);
    const SliceRun run = run_slices(logits, targets, n, V, P, scale, true);
    for (const LossResult& r : run.per_rank) {
      EXPECT_EQ(r.n_valid, n - 2);
      EXPECT_NEAR(r.loss_sum, want, 1e-6 * std::abs(want));
    }
    EXPECT_CLOSE(run.dlogits, fd, 1e-6, 1e-4);
    for (int64_t j = 0; j < V; ++j) {  // ignored rows: exactly zero gradient
      EXPECT_EQ(run.dlogits[3 * V + j], 0.f);
      EXPECT_EQ(run.dlogits[7 * V + j], 0.f);
    }
    // Forward only: the same loss, the logits left as they were.
    const SliceRun fwd = run_slices(logits, targets, n, V, P, 0.f, false);
    EXPECT_NEAR(fwd.per_rank[0].loss_sum, want, 1e-6 * std::abs(want));
    EXPECT_EQ(fwd.dlogits, logits);
  }
}

TEST(XentSlice, LargeLogitsStayFinite) {
  // Row maxima far apart on different slices: the reduced max keeps every exp in (0, 1].
  const int64_t n = 2, V = 8;
  std::vector<float> logits = {90, 1, 2, 3, -50, 0, 1, 2, 1, 2, 3, 4, 300, 299, 0, 0};
  std::vector<int32_t> targets = {4, 13 % V};
  const double want = test::cross_entropy_sum_ref(test::to_f64(logits), targets, n, V);
  const SliceRun run = run_slices(logits, targets, n, V, 2, 1.f, true);
  EXPECT_TRUE(std::isfinite(run.per_rank[0].loss_sum));
  EXPECT_NEAR(run.per_rank[0].loss_sum, want, 1e-6 * std::abs(want));
  for (float g : run.dlogits) EXPECT_TRUE(std::isfinite(g));
}

// bf16 logits (statistics f32), through the entry points: every gradient element, the target's
// (softmax - 1) included, is its f64 value from the stored logits and statistics rounded once to
// bf16, up to f32 error. Rounding the softmax term to bf16 before subtracting 1 would miss the
// targets' by up to a further half ulp. Narrow rows make the targets' softmax terms large.
TEST(XentSlice, Bf16GradientIsRoundedOnce) {
  const int64_t n = 3001, vs = 5, V = 9, begin = 2;
  const float scale = 0.37f;
  std::vector<uint16_t> logits(n * vs);
  const std::vector<float> f = test::random_vec(n * vs, 6, -3.f, 3.f);
  for (int64_t i = 0; i < n * vs; ++i) logits[i] = f32_to_bf16(f[i]);
  const std::vector<uint16_t> original = logits;
  std::vector<int32_t> targets(n);
  for (int64_t i = 0; i < n; ++i) targets[i] = int32_t(begin + (i * 7) % vs);
  targets[5] = kIgnoreIndex;
  targets[6] = 0;  // another rank's target
  std::vector<float> mx(n), stats(2 * n);
  const Tensor tl(logits.data(), DType::kBF16, Shape{n, vs});
  cpu::CpuBackend be;
  be.xent_slice_max(tl, view(mx, {n}));
  be.xent_slice_stats(tl, view(targets, {n}), begin, V, view(mx, {n}), view(stats, {n, 2}));
  std::vector<double> acc(2, 0.0);
  be.xent_slice_finish(tl, view(targets, {n}), begin, view(mx, {n}), view(stats, {n, 2}), scale,
                       true, Tensor(acc.data(), DType::kF64, Shape{2}), Workspace{});
  EXPECT_EQ(acc[1], double(n - 1));
  int64_t misses = 0;
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < vs; ++j) {
      const double g = bf16_to_f32(logits[i * vs + j]);
      double want = 0;
      if (targets[i] != kIgnoreIndex)
        want = scale * (std::exp(double(bf16_to_f32(original[i * vs + j])) - mx[i]) / stats[2 * i] -
                        (targets[i] == begin + j ? 1.0 : 0.0));
      const double slack = 1e-6 * scale;
      const double half_ulp = std::ldexp(0.5, std::ilogb(std::abs(want) + slack) - 7);
      if (std::abs(g - want) > half_ulp + slack && ++misses <= 3)
        ADD_FAILURE() << "dlogits[" << i << ", " << j << "] = " << g << ", want " << want
                      << " rounded once (half an ulp: " << half_ulp << ")";
    }
  EXPECT_EQ(misses, 0);
}

TEST(XentSlice, TargetsOutsideTheVocabularyAreDataErrors) {
  const int64_t n = 3, vs = 4;
  std::vector<float> logits = test::random_vec(n * vs, 5), mx(n, 1.f), stats(2 * n, 9.f);
  std::vector<int32_t> targets = {1, 11, kIgnoreIndex};  // 11 is another rank's: fine
  cpu::xent_slice_stats(view(logits, {n, vs}), view(targets, {n}), 4, 12, view(mx, {n}),
                        view(stats, {n, 2}));
  EXPECT_EQ(stats[3], 0.f);  // row 1's target is not in [4, 8)
  EXPECT_EQ(stats[4], 0.f);  // ignored row
  targets[1] = 12;
  stats.assign(2 * n, 9.f);
  try {
    cpu::xent_slice_stats(view(logits, {n, vs}), view(targets, {n}), 4, 12, view(mx, {n}),
                          view(stats, {n, 2}));
    ADD_FAILURE() << "expected a data error";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kData);
    EXPECT_NE(std::string(e.what()).find("target id 12"), std::string::npos) << e.what();
  }
  // Raised after the write (a device raises it at the next read): the bad target's row as an
  // ignored one's, the others written.
  EXPECT_EQ(stats[2], 0.f);
  EXPECT_EQ(stats[3], 0.f);
  EXPECT_NE(stats[0], 9.f);
  EXPECT_EQ(stats[4], 0.f);  // ignored row
}

}  // namespace
}  // namespace shardlm
