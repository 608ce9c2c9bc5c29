// The op table's xent_slice_fold cases (op_table.h): the logits of a vocabulary of 97 ids cut
// into 1, 2 and 3 uneven slices and folded in order must give the whole row's statistics
// (against an f64 reference), and xent_slice_finish on each slice with them the loss and
// gradient of the whole row's xent_slice_max + xent_slice_stats + finish. A target outside the
// vocabulary is a data error: at the op, writing nothing, or (a device deferring its id checks)
// at the next result read, the row left out. With Gemma 2's final soft cap every op reads the
// capped logits, folded or not.
#pragma once

namespace shardlm::test::ops::cases {

// The logits [n, V] of the fold cases, rows of several ranges so that the rescale of the folded
// sum is exercised both near 1 and far below it: by row r % 3, N(0, 0.05^2) (every exponential
// near 1), N(0, 1), and N(200, 30^2) (large absolute logits, the sum carried by a few terms
// near the max); the last two rows ramp up (the max in the last slice) and down (the max in the
// first).
inline Values fold_logits(int64_t n, int64_t V, uint64_t seed) {
  Values l = OpRun::randn(n * V, seed);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < V; ++j) {
      double& x = l[i * V + j];
      if (i == n - 2)
        x = 0.7 * double(j);
      else if (i == n - 1)
        x = -0.7 * double(j);
      else if (i % 3 == 0)
        x *= 0.05;
      else if (i % 3 == 2)
        x = 200.0 + 30.0 * x;
    }
  return l;
}

// targets [n]: random ids, two ignored rows, and for each slice a row whose target is its first
// id and one whose target is its last.
inline std::vector<int32_t> fold_targets(int64_t n, int64_t V, const std::vector<int64_t>& begin,
                                         const std::vector<int64_t>& width) {
  std::vector<int32_t> t = token_ids(n, V, 91);
  t[5] = t[10] = kIgnoreIndex;
  for (size_t s = 0; s < begin.size(); ++s) {
    t[3 * s] = int32_t(begin[s]);
    t[3 * s + 1] = int32_t(begin[s] + width[s] - 1);
  }
  return t;
}

// Columns [begin, begin + width) of x [n, V].
inline Values columns(const Values& x, int64_t n, int64_t V, int64_t begin, int64_t width) {
  Values out(static_cast<size_t>(n * width));
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < width; ++j) out[i * width + j] = x[i * V + begin + j];
  return out;
}

// Each got[i] within rel * |want[i]| of want[i] (rel 0: equal).
inline void expect_relative(const Values& got, const Values& want, double rel,
                            const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i)
    EXPECT_LE(std::abs(got[i] - want[i]), rel * std::abs(want[i]))
        << what << "[" << i << "] = " << got[i] << ", want " << want[i];
}

// The statistics of the whole rows of l [n, V] in f64: row_max [n] (of ignored rows too) and
// stats [n, 2] split into its sums [n] and target logits [n] (0 on ignored rows).
struct WholeRowStats {
  Values max, sum, target;
};
inline WholeRowStats whole_row_stats(const Values& l, const std::vector<int32_t>& t, int64_t n,
                                     int64_t V) {
  WholeRowStats w{Values(size_t(n)), Values(size_t(n), 0.0), Values(size_t(n), 0.0)};
  for (int64_t i = 0; i < n; ++i) {
    const double* row = &l[i * V];
    w.max[i] = *std::max_element(row, row + V);
    if (t[i] == kIgnoreIndex) continue;
    for (int64_t j = 0; j < V; ++j) w.sum[i] += std::exp(row[j] - w.max[i]);
    w.target[i] = row[t[i]];
  }
  return w;
}

// The folded row_max [n] and stats [n, 2] against the f64 statistics of the whole rows: the max
// and the target logit exact, the sum an f32 sum of 97 exponentials (the logits are exact in
// either dtype); under a cap the kernels' f32 capped logits are a few ulp off the f64 ones: the
// max and target within an element's chain, the sum's terms exp(c - max) off by that much of
// c (up to the cap, 250).
inline void check_folded_stats(OpRun& r, const Tensor& row_max, const Tensor& stats,
                               const WholeRowStats& want, double exact) {
  expect_relative(r.get(row_max), want.max, exact, "row_max");
  const Values st = r.get(stats);
  Values sum(want.sum.size()), target(want.target.size());
  for (size_t i = 0; i < sum.size(); ++i) {
    sum[i] = st[2 * i];
    target[i] = st[2 * i + 1];
  }
  expect_relative(sum, want.sum,
                  exact > 0 ? 250 * tol_of(DType::kF32, kElementChain)
                            : tol_of(DType::kF32, 97 + kElementChain),
                  "stats sum");
  expect_relative(target, want.target, exact, "stats target logit");
}

// Folds the slices of the given widths in order, checks the statistics, then finishes every
// slice with them against the whole row's max + stats + finish on the same backend.
inline void fold_slices_case(OpRun& r, const std::vector<int64_t>& width, double cap) {
  const int64_t n = 19, V = 97;
  std::vector<int64_t> begin(width.size(), 0);
  for (size_t s = 1; s < width.size(); ++s) begin[s] = begin[s - 1] + width[s - 1];
  ASSERT_EQ(begin.back() + width.back(), V);
  Values l = fold_logits(n, V, 90);
  const std::vector<int32_t> t = fold_targets(n, V, begin, width);
  const Tensor whole = r.in(l, {n, V}), targets = r.ids(t);  // rounds l first for bf16
  std::vector<Tensor> slices;
  for (size_t s = 0; s < width.size(); ++s) {
    Values part = columns(l, n, V, begin[s], width[s]);
    slices.push_back(r.in(part, {n, width[s]}));
  }
  const Tensor row_max = r.out({n}, DType::kF32), stats = r.out({n, 2}, DType::kF32);
  const float fcap = float(cap);
  for (size_t s = 0; s < slices.size(); ++s)
    r.be.xent_slice_fold(slices[s], targets, begin[s], V, row_max, stats, s == 0, fcap);
  Values capped = l;
  softcap_ref(capped, cap);
  check_folded_stats(r, row_max, stats, whole_row_stats(capped, t, n, V),
                     cap > 0 ? tol_of(DType::kF32, kElementChain) : 0.0);

  const Tensor whole_max = r.out({n}, DType::kF32), whole_stats = r.out({n, 2}, DType::kF32);
  r.be.xent_slice_max(whole, whole_max, fcap);
  r.be.xent_slice_stats(whole, targets, 0, V, whole_max, whole_stats, fcap);
  const Workspace ws = r.ws(r.be.xent_slice_workspace_bytes(n));
  const Tensor want_acc = r.f64s({0.0, 0.0});
  r.be.xent_slice_finish(whole, targets, 0, whole_max, whole_stats, 0.5f, true, want_acc, ws, fcap);
  const LossResult want = r.be.read_loss(want_acc);
  const Values want_grad = r.get(whole);
  for (size_t s = 0; s < slices.size(); ++s) {
    const Tensor acc = r.f64s({0.0, 0.0});
    r.be.xent_slice_finish(slices[s], targets, begin[s], row_max, stats, 0.5f, true, acc, ws, fcap);
    const LossResult got = r.be.read_loss(acc);
    EXPECT_NEAR(got.loss_sum, want.loss_sum,
                tol_of(DType::kF32, 97 + kElementChain) * std::abs(want.loss_sum))
        << "slice " << s;
    EXPECT_EQ(got.n_valid, want.n_valid) << "slice " << s;
    r.check(slices[s], columns(want_grad, n, V, begin[s], width[s]),
            "slice " + std::to_string(s) + " logits -> gradient");
  }
}

// A target outside [0, V) on a later slice is a data error naming it. A backend that raises it
// at the op (the CPU's, and a queue over it) has written nothing; one that defers its id checks
// to the next result read (CUDA) raises it there, having folded the row as an ignored one
// (statistics (0, 0)), and raises it once.
inline void fold_bad_target_case(OpRun& r) {
  const int64_t n = 4, Vs = 6, V = 10;
  Values l = OpRun::randn(n * Vs, 92), mx = {1.0, 2.0, 3.0, 4.0}, st(2 * n, 0.5);
  const Tensor logits = r.in(l, {n, Vs}), row_max = r.in(mx, {n}, DType::kF32),
               stats = r.in(st, {n, 2}, DType::kF32);
  const Tensor targets = r.ids({1, kIgnoreIndex, int32_t(V), 7});
  auto expect_named = [](const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kData) << e.what();
    EXPECT_NE(std::string(e.what()).find("target id 10"), std::string::npos) << e.what();
  };
  // Raised by the op (the CPU's) or by the next result read (a device's flag, the queue's run):
  // either way after the rows were written, the bad target's as an ignored row's.
  bool raised = false;
  try {
    r.be.xent_slice_fold(logits, targets, 4, V, row_max, stats, false);
  } catch (const Error& e) {
    expect_named(e);
    raised = true;
  }
  if (!raised) {
    try {
      (void)r.get(stats);
      ADD_FAILURE() << "expected a data error at the op or at the next result read";
    } catch (const Error& e) {
      expect_named(e);
    }
  }
  const Values folded = r.get(stats);  // raised once: this read passes
  EXPECT_EQ(folded[4], 0.0) << "the bad target's row is left out";
  EXPECT_EQ(folded[5], 0.0) << "the bad target's row is left out";
}

// The gradients of the slices against the whole row's, both from the backend: f32 values that
// differ by the statistics' rounding (a row of 97); in bf16 each then rounded once.
inline void xent_fold_cases(std::vector<OpCase>& c) {
  const std::vector<std::vector<int64_t>> slicings = {{97}, {40, 57}, {13, 61, 23}};
  for (const DType dt : {DType::kF32, DType::kBF16}) {
    const double tol = tol_of(dt, 97 + kElementChain);
    for (const std::vector<int64_t>& width : slicings) {
      std::string label = "n19 V97 in slices of";
      for (int64_t w : width) {
        label += ' ';
        label += std::to_string(w);
      }
      // Gemma 2's cap of 250 bends the large rows (200 +- 30) and hardly the small ones.
      for (const double cap : {0.0, 250.0})
        c.push_back({"xent_slice_fold", label + ", then finish" + cap_label(cap), dt, tol, true,
                     [width, cap](OpRun& r) { fold_slices_case(r, width, cap); }});
    }
    c.push_back({"xent_slice_fold", "a target outside the vocabulary is a data error", dt, 0, true,
                 fold_bad_target_case});
  }
}

}  // namespace shardlm::test::ops::cases
