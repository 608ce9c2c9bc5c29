// The op table's cases of the preference objectives' ops (op_table.h): segment_logp_sums against
// an f64 sum of the rows' log-probabilities, preference_coefficients against the loss formulas
// written out here (independently of preference_loss.h) and against central differences of its
// own loss in the policy sums, and gather_segment_weights exactly. Segments have rows outside
// any segment (-1), rows without a target (statistics (0, 0)), and empty segments; a segment id
// outside [-1, S) is an error at the op or at the next result read.
#pragma once

#include <algorithm>
#include <string>
#include <tuple>
#include <vector>

namespace shardlm::test::ops::cases {

// The head's statistics of n rows as the xent slice ops leave them: row_max [n], stats [n, 2]
// with a sum of exponentials >= 1 and a target logit <= the max; every 7th row has no target
// (0, 0).
struct HeadStats {
  Values row_max, stats;
};
inline HeadStats head_stats(int64_t n, uint64_t seed) {
  HeadStats h{OpRun::randn(n, seed, 3.0), Values(size_t(2 * n))};
  const Values a = OpRun::randn(2 * n, seed + 1);
  for (int64_t i = 0; i < n; ++i) {
    const bool ignored = i % 7 == 3;
    h.stats[2 * i] = ignored ? 0.0 : 1.0 + 40.0 * std::abs(a[2 * i]);
    h.stats[2 * i + 1] = ignored ? 0.0 : h.row_max[i] - 2.0 * std::abs(a[2 * i + 1]);
  }
  return h;
}

// segments [n] in [-1, S): runs of one segment in order (a micro-batch's sequences), with
// gaps of -1 between them (prompt tokens), the segments `empty` given no row at all; or, with
// `scattered`, each row's segment drawn at random (the contract allows any order).
inline std::vector<int32_t> segment_ids(int64_t n, int64_t S, const std::vector<int64_t>& empty,
                                        bool scattered, uint64_t seed) {
  std::vector<int32_t> seg(static_cast<size_t>(n), -1);
  std::mt19937_64 rng(seed);
  std::vector<int32_t> used;
  for (int32_t s = 0; s < int32_t(S); ++s)
    if (std::find(empty.begin(), empty.end(), s) == empty.end()) used.push_back(s);
  if (used.empty()) return seg;
  if (scattered) {
    for (int32_t& s : seg) s = rng() % 5 == 0 ? -1 : used[rng() % used.size()];
    return seg;
  }
  const int64_t run = std::max<int64_t>(n / int64_t(used.size()), 1);
  for (int64_t i = 0; i < n; ++i) {
    const size_t k = size_t(std::min<int64_t>(i / run, int64_t(used.size()) - 1));
    seg[size_t(i)] = i % run < run / 4 ? -1 : used[k];  // the first quarter of a run: a prompt
  }
  return seg;
}

// The f64 reference of segment_logp_sums: (sum, count) per segment.
inline Values segment_sums_reference(const HeadStats& h, const std::vector<int32_t>& seg,
                                     int64_t S) {
  Values want(size_t(2 * S), 0.0);
  for (size_t i = 0; i < seg.size(); ++i) {
    if (seg[i] < 0 || h.stats[2 * i] == 0) continue;
    want[2 * size_t(seg[i])] += h.stats[2 * i + 1] - h.row_max[i] - std::log(h.stats[2 * i]);
    want[2 * size_t(seg[i]) + 1] += 1;
  }
  return want;
}

// Every log-probability is <= 0, so a segment's terms share a sign: two f64 sums of them in any
// order, each term off by its subtraction and log (a few u), are within 2 gamma_{n + 4} of
// their magnitude, relative; the counts are exact. `offset`: the statistics' views start one
// element in (a device's unaligned path).
inline void segment_sums_case(OpRun& r, int64_t n, int64_t S, const std::vector<int64_t>& empty,
                              bool scattered, int64_t offset) {
  HeadStats h = head_stats(n, 70 + uint64_t(n));
  const std::vector<int32_t> seg = segment_ids(n, S, empty, scattered, 71);
  const Tensor row_max = r.in_at(offset, h.row_max, {n}, DType::kF32);
  const Tensor stats = r.in_at(offset, h.stats, {n, 2}, DType::kF32);
  const Tensor sums = r.out({S, 2}, DType::kF64);
  r.be.segment_logp_sums(row_max, stats, r.ids(seg), sums);
  const Values want = segment_sums_reference(h, seg, S), got = r.get(sums);
  ASSERT_EQ(got.size(), want.size());
  const double rel = 2 * gamma_n(DType::kF64, n + 4);
  for (int64_t s = 0; s < S; ++s) {
    EXPECT_LE(std::abs(got[2 * s] - want[2 * s]), rel * std::abs(want[2 * s]))
        << "segment " << s << " sum " << got[2 * s] << ", want " << want[2 * s];
    EXPECT_EQ(got[2 * s + 1], want[2 * s + 1]) << "segment " << s << " count";
  }
}

// The loss of one pair written out from its definitions (train.objective's formulas, TRL's
// dpo_loss / CPOTrainer's simpo_loss), with its derivatives in pi_c and pi_r and its metrics.
struct PairReference {
  double loss = 0, d_chosen = 0, d_rejected = 0;
  double metrics[6] = {};  // loss, rewards chosen and rejected, accuracies, logps chosen, rejected
};
inline double sigmoid_ref(double x) { return 1 / (1 + std::exp(-x)); }
inline PairReference pair_reference(const PreferenceLossSpec& l, const double* pol,
                                    const double* ref) {
  PairReference o;
  const double pc = pol[0], pr = pol[2];
  const double nc = std::max(pol[1], 1.0), nr = std::max(pol[3], 1.0);
  const double b = l.beta, s = l.label_smoothing;
  double rc = 0, rr = 0, lc = pc, lr = pr;
  if (l.kind == PreferenceLossSpec::Kind::kSimpo) {
    const double h = b * (pc / nc - pr / nr) - l.gamma;
    o.loss = std::log1p(std::exp(-h));
    o.d_chosen = -sigmoid_ref(-h) * b / nc;
    o.d_rejected = sigmoid_ref(-h) * b / nr;
    lc = pc / nc, lr = pr / nr, rc = b * lc, rr = b * lr;
  } else if (l.kind == PreferenceLossSpec::Kind::kDpoIpo) {
    const double h = (pc - ref[0]) / nc - (pr - ref[2]) / nr;
    o.loss = (h - 1 / (2 * b)) * (h - 1 / (2 * b));
    o.d_chosen = 2 * (h - 1 / (2 * b)) / nc;
    o.d_rejected = -2 * (h - 1 / (2 * b)) / nr;
    rc = b * (pc - ref[0]), rr = b * (pr - ref[2]);
  } else {
    const double d = b * ((pc - ref[0]) - (pr - ref[2]));
    o.loss = (1 - s) * std::log1p(std::exp(-d)) + s * std::log1p(std::exp(d));
    const double g = -(1 - s) * sigmoid_ref(-d) + s * sigmoid_ref(d);
    o.d_chosen = g * b;
    o.d_rejected = -g * b;
    rc = b * (pc - ref[0]), rr = b * (pr - ref[2]);
  }
  const double m[6] = {o.loss, rc, rr, rc > rr ? 1.0 : 0.0, lc, lr};
  std::copy_n(m, 6, o.metrics);
  return o;
}

// policy and reference [2P, 2]: sums of a few dozen log-probabilities, counts 0 (an empty
// completion: sum 0), 1 and up to 40, so that every kind's max(n, 1) is exercised.
struct PairSums {
  Values policy, reference;
};
inline PairSums pair_sums(int64_t P, uint64_t seed) {
  PairSums p{Values(size_t(4 * P)), Values(size_t(4 * P))};
  std::mt19937_64 rng(seed);
  const Values a = OpRun::randn(4 * P, seed + 1);
  for (int64_t q = 0; q < 2 * P; ++q) {
    const double n = q % 9 == 4 ? 0.0 : q % 9 == 7 ? 1.0 : double(2 + rng() % 39);
    p.policy[2 * q] = n == 0 ? 0.0 : -n * (0.5 + std::abs(a[2 * q]));
    p.policy[2 * q + 1] = n;
    p.reference[2 * q] = p.policy[2 * q] + 3.0 * a[2 * q + 1];  // within a few nats
    p.reference[2 * q + 1] = n;
  }
  return p;
}

inline const char* kind_label(const PreferenceLossSpec& l) {
  switch (l.kind) {
    case PreferenceLossSpec::Kind::kDpoSigmoid:
      return l.label_smoothing > 0 ? "dpo sigmoid, label smoothing" : "dpo sigmoid";
    case PreferenceLossSpec::Kind::kDpoIpo:
      return "dpo ipo";
    case PreferenceLossSpec::Kind::kSimpo:
      return "simpo";
  }
  return "?";
}

// The op's loss (its metrics' first entry) at policy sums `pol`.
inline double op_loss(OpRun& r, const PreferenceLossSpec& l, Values pol, const Tensor& ref) {
  const int64_t S = int64_t(pol.size()) / 2;
  Values zero(size_t(kPreferenceMetrics), 0.0);
  const Tensor metrics = r.in(zero, {kPreferenceMetrics}, DType::kF64);
  r.be.preference_coefficients(l, r.in(pol, {S, 2}, DType::kF64), ref, 1.0, r.out({S}), metrics);
  return r.get(metrics)[0];
}

// Central differences of the op's loss in each sequence's policy sum, step e, against
// coef / -norm. Their error: the truncation e^2 / 6 max|f'''| (f''' = a^3 L''' with the slope a
// of the loss's argument in pi at most max(beta, 1), and |L'''| = |s (1 - s)(1 - 2 s)| <= 0.1
// for the sigmoid losses, 0 for ipo), the loss's f64 rounding (a few dozen operations, exp and
// log1p within 2 ulp) twice over 2e, and the rounding of pi +- e times the slope (about the
// derivative, + 1) over 2e; the coefficient itself an f32 of an f64 a few dozen operations deep.
inline void finite_difference_check(OpRun& r, const PreferenceLossSpec& l, const Values& pol,
                                    const Tensor& ref, const Values& coef, double norm) {
  const double e = 1e-3, a = std::max(l.beta, 1.0), u = unit_roundoff(DType::kF64);
  for (size_t q = 0; q < coef.size(); ++q) {
    Values up = pol, down = pol;
    up[2 * q] += e;
    down[2 * q] -= e;
    const double f_up = op_loss(r, l, up, ref), f_down = op_loss(r, l, down, ref);
    const double fd = (f_up - f_down) / (2 * e), want = coef[q] / -norm;
    const double bound = e * e / 6 * a * a * a * 0.1 +
                         2 * gamma_n(DType::kF64, 64) * std::max(std::abs(f_up), 1.0) / e +
                         2 * u * (std::abs(pol[2 * q]) + e) / e * (std::abs(want) + 1) +
                         (unit_roundoff(DType::kF32) + gamma_n(DType::kF64, 64)) * std::abs(want);
    EXPECT_LE(std::abs(fd - want), bound)
        << "sequence " << q << ": central difference " << fd << ", coef / -norm " << want;
  }
}

// The coefficients against the reference's derivatives (each an f32 of an f64 value a few
// dozen f64 operations deep), the metrics against the reference's sums added to nonzero old
// values (P + 1 f64 additions of terms within a few dozen u each: 2 gamma_{P + 64} of the terms'
// magnitudes), then the central differences.
inline void coefficients_case(OpRun& r, const PreferenceLossSpec& l, int64_t P, bool with_ref) {
  PairSums ps = pair_sums(P, 80 + uint64_t(P));
  const double norm = 1.0 / 7.0;
  const Tensor policy = r.in(ps.policy, {2 * P, 2}, DType::kF64);
  const Tensor ref = with_ref ? r.in(ps.reference, {2 * P, 2}, DType::kF64) : Tensor();
  Values old = {0.5, -1.25, 2.0, 3.0, -7.5, 4.25, 11.0};
  const Tensor metrics = r.in(old, {kPreferenceMetrics}, DType::kF64), coef = r.out({2 * P});
  r.be.preference_coefficients(l, policy, ref, norm, coef, metrics);

  Values want_coef(size_t(2 * P)), want_metrics = old, scale(size_t(kPreferenceMetrics), 0.0);
  for (int64_t k = 0; k < P; ++k) {
    const PairReference p = pair_reference(l, &ps.policy[4 * k], &ps.reference[4 * k]);
    ASSERT_GT(std::abs(p.metrics[1] - p.metrics[2]), 1e-6 * std::abs(p.metrics[1]))
        << "pair " << k << ": chosen's and rejected's rewards tie; accuracies would be rounding";
    want_coef[2 * k] = -p.d_chosen * norm;
    want_coef[2 * k + 1] = -p.d_rejected * norm;
    for (int j = 0; j < 6; ++j) {
      want_metrics[j] += p.metrics[j];
      scale[j] += std::abs(p.metrics[j]);
    }
    // SimPO's loss is 1-Lipschitz in h = beta (pi_c / n_c - pi_r / n_r) - gamma, whose terms
    // cancel and which a device's fused multiply-add rounds otherwise: their magnitude too.
    const double* pol = &ps.policy[4 * k];
    if (l.kind == PreferenceLossSpec::Kind::kSimpo)
      scale[kMetricLoss] += l.beta * (std::abs(pol[0] / std::max(pol[1], 1.0)) +
                                      std::abs(pol[2] / std::max(pol[3], 1.0))) +
                            std::abs(l.gamma);
  }
  want_metrics[kMetricPairs] += double(P);
  r.check(coef, want_coef, "coef");
  const Values got = r.get(metrics);
  for (int64_t j = 0; j < kPreferenceMetrics; ++j)
    EXPECT_LE(std::abs(got[j] - want_metrics[j]),
              2 * gamma_n(DType::kF64, P + 64) * (scale[j] + std::abs(old[j])))
        << "metrics[" << j << "] = " << got[j] << ", want " << want_metrics[j];
  if (P <= 8) finite_difference_check(r, l, ps.policy, ref, r.get(coef), norm);
}

// weights [n] = coef[segments[i]] or 0, exactly; `offset`: unaligned views of weights and coef.
inline void gather_case(OpRun& r, int64_t n, int64_t S, bool scattered, int64_t offset) {
  Values coef = OpRun::randn(S, 60 + uint64_t(S));
  const std::vector<int64_t> empty = S > 2 ? std::vector<int64_t>{S / 2} : std::vector<int64_t>{};
  const std::vector<int32_t> seg = segment_ids(n, S, empty, scattered, 61);
  const Tensor c = r.in_at(offset, coef, {S}, DType::kF32), w = r.out_at(offset, {n});
  r.be.gather_segment_weights(c, r.ids(seg), w);
  Values want(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) want[i] = seg[size_t(i)] >= 0 ? coef[size_t(seg[i])] : 0.0;
  r.check(w, want, "weights");
}

// A segment id S (one past the last) is an error naming it: at the op, writing nothing (the
// CPU's, and a queue over it, at the next result read), or for a device that defers its check,
// at the next result read, the row left out.
inline void bad_segment_case(OpRun& r) {
  const int64_t n = 5, S = 2;
  HeadStats h = head_stats(n, 75);
  const Tensor row_max = r.in(h.row_max, {n}, DType::kF32),
               stats = r.in(h.stats, {n, 2}, DType::kF32);
  Values poison(size_t(2 * S), -3.0);
  const Tensor sums = r.in(poison, {S, 2}, DType::kF64);
  auto expect_named = [](const Error& e) {
    EXPECT_NE(std::string(e.what()).find("segments[2] = 2 is outside [-1, 2)"), std::string::npos)
        << e.what();
  };
  try {
    r.be.segment_logp_sums(row_max, stats, r.ids({0, 1, 2, -1, 0}), sums);
    (void)r.get(sums);
    ADD_FAILURE() << "expected an error at the op or at the next result read";
  } catch (const Error& e) {
    expect_named(e);
  }
}

inline void preference_cases(std::vector<OpCase>& c) {
  struct Sums {
    int64_t n, S;
    std::vector<int64_t> empty;
    bool scattered;
    int64_t offset;
    std::string label;
  };
  const std::vector<Sums> sums = {
      {1, 1, {}, false, 0, "n1 S1"},
      {37, 1, {}, false, 1, "n37 S1, unaligned"},
      {5, 0, {}, false, 0, "n5 S0 (no pair)"},
      {203, 7, {2, 6}, false, 0, "n203 S7, segments 2 and 6 empty"},
      {1031, 64, {0, 33}, true, 1, "n1031 S64 scattered, unaligned"},
      {4099, 2, {}, false, 0, "n4099 S2"},
  };
  for (const Sums& s : sums)
    c.push_back({"segment_logp_sums", s.label, DType::kF32, 0, true, [s](OpRun& r) {
                   segment_sums_case(r, s.n, s.S, s.empty, s.scattered, s.offset);
                 }});
  c.push_back({"segment_logp_sums", "a segment id outside [-1, S) is an error", DType::kF32, 0,
               true, bad_segment_case});

  using Kind = PreferenceLossSpec::Kind;
  const std::vector<PreferenceLossSpec> losses = {
      {Kind::kDpoSigmoid, 0.1, 0.0, 0.0},
      {Kind::kDpoSigmoid, 0.5, 0.15, 0.0},
      {Kind::kDpoIpo, 0.1, 0.0, 0.0},
      {Kind::kSimpo, 2.0, 0.0, 0.5},
  };
  const double tol = unit_roundoff(DType::kF32) + gamma_n(DType::kF64, 64);
  for (const PreferenceLossSpec& l : losses)
    for (const int64_t P : {1, 5, 61}) {
      const bool ref = l.needs_reference();
      c.push_back({"preference_coefficients",
                   fmt::format("{}, {} pairs{}", kind_label(l), P, ref ? "" : ", no reference"),
                   DType::kF32, tol, true,
                   [l, P, ref](OpRun& r) { coefficients_case(r, l, P, ref); }});
    }
  c.push_back({"preference_coefficients", "simpo, 3 pairs, a reference given and unread",
               DType::kF32, tol, true,
               [l = losses[3]](OpRun& r) { coefficients_case(r, l, 3, true); }});
  c.push_back({"preference_coefficients", "dpo sigmoid, 0 pairs", DType::kF32, tol, true,
               [l = losses[0]](OpRun& r) { coefficients_case(r, l, 0, false); }});

  for (const auto& [n, S, scattered, offset] :
       std::vector<std::tuple<int64_t, int64_t, bool, int64_t>>{
           {1, 1, false, 0}, {301, 7, false, 1}, {1029, 64, true, 0}, {4103, 2, false, 1}})
    c.push_back({"gather_segment_weights",
                 fmt::format("n{} S{}{}{}", n, S, scattered ? " scattered" : "",
                             offset ? ", unaligned" : ""),
                 DType::kF32, 0, true,
                 [n, S, scattered, offset](OpRun& r) { gather_case(r, n, S, scattered, offset); }});
}

}  // namespace shardlm::test::ops::cases
