// The CUDA backend's preference ops against the CPU backend's at a training run's shapes: the
// head statistics of 8192 and 131072 tokens in 2 to 64 sequences (and one sequence of 100k
// tokens), each pair's coefficients and metrics for every loss kind, the token weights; and no
// host wait in any of the three ops. Tolerances from tests/tolerance.h's bounds.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "cuda_kernels_fixture.h"
#include "tolerance.h"

namespace shardlm::test {
namespace {

// A micro-batch's head statistics (a sum of exponentials >= 1, a target logit <= the max; every
// 11th row without a target) and its segments: S sequences of the given lengths one after
// another, each after a prompt of `prompt` rows (-1), the rest of the rows -1.
struct Batch {
  std::vector<float> row_max, stats;
  std::vector<int32_t> segments;
};
Batch batch(int64_t n, const std::vector<int64_t>& lengths, int64_t prompt, uint64_t seed) {
  Batch b{randn(size_t(n), seed, 3.f), std::vector<float>(size_t(2 * n), 0.f),
          std::vector<int32_t>(size_t(n), -1)};
  const std::vector<float> a = randn(size_t(2 * n), seed + 1);
  for (int64_t i = 0; i < n; ++i) {
    if (i % 11 == 5) continue;
    b.stats[2 * i] = 1.f + 40.f * std::abs(a[2 * i]);
    b.stats[2 * i + 1] = b.row_max[i] - 2.f * std::abs(a[2 * i + 1]);
  }
  int64_t at = 0;
  for (size_t s = 0; s < lengths.size(); ++s) {
    at += prompt;
    for (int64_t i = 0; i < lengths[s] && at < n; ++i) b.segments[size_t(at++)] = int32_t(s);
  }
  return b;
}

class CudaPreference : public CudaKernels {
 protected:
  Tensor up_f64(std::vector<double> v, Shape s) {
    Tensor t = alloc(s, DType::kF64);
    gpu->copy(Tensor(v.data(), DType::kF64, s, MemPool::kHost), t);
    return t;
  }
  std::vector<double> down_f64(const Tensor& t) {
    std::vector<double> v(size_t(t.numel()));
    gpu->copy(t, Tensor(v.data(), DType::kF64, t.shape(), MemPool::kHost));
    return v;
  }
  // segment_logp_sums on both backends; returns the CPU's sums [S, 2] after checking the GPU's
  // against them: every log-probability is <= 0, so two f64 sums of a segment's terms in any
  // order are within 2 gamma_{n + 4} of their magnitude (each term a few u off); counts exact.
  std::vector<double> check_sums(Batch& b, int64_t S) {
    const int64_t n = int64_t(b.row_max.size());
    std::vector<double> want(size_t(2 * S));
    cpu.segment_logp_sums(host(b.row_max, {n}), host(b.stats, {n, 2}), host_i32(b.segments, {n}),
                          Tensor(want.data(), DType::kF64, {S, 2}, MemPool::kHost));
    const Tensor sums = up_f64(std::vector<double>(size_t(2 * S), std::nan("")), {S, 2});
    gpu->segment_logp_sums(up(b.row_max, {n}), up(b.stats, {n, 2}), up_i32(b.segments, {n}), sums);
    const std::vector<double> got = down_f64(sums);
    const double rel = 2 * gamma_n(DType::kF64, n + 4);
    for (int64_t s = 0; s < S; ++s) {
      EXPECT_LE(std::abs(got[2 * s] - want[2 * s]), rel * std::abs(want[2 * s]))
          << "segment " << s << ": " << got[2 * s] << " vs the CPU's " << want[2 * s];
      EXPECT_EQ(got[2 * s + 1], want[2 * s + 1]) << "segment " << s << " count";
    }
    return want;
  }
  // preference_coefficients on both backends, for P = S / 2 pairs of sums [S, 2] (below).
  void check_coefficients(const PreferenceLossSpec& l, std::vector<double> pol,
                          std::vector<double> ref, const std::string& what);
};

// SimPO's h = beta (pi_c / n_c - pi_r / n_r) - gamma: the magnitude of its terms, which a
// fused multiply-add (nvcc's) or not rounds differently before they cancel.
double simpo_terms(const PreferenceLossSpec& l, const double* pol) {
  return l.beta *
             (std::abs(pol[0] / std::max(pol[1], 1.0)) + std::abs(pol[2] / std::max(pol[3], 1.0))) +
         std::abs(l.gamma);
}

// The magnitude of the terms a coefficient is computed from (times norm): beta for the DPO
// sigmoid (sigmoids at most 1), beta / n for SimPO (times 1 + h's terms: the sigmoid is
// 1/4-Lipschitz in h), and for IPO 2 (|h's terms| + 1 / (2 beta)) / n. Each backend's f64
// result is within a few dozen u of it (exp, log1p within 2 ulp, FMA contraction or not); the
// f32 roundings of two such values differ by at most 2 u_f32 of it.
double coefficient_scale(const PreferenceLossSpec& l, const double* pol, const double* ref, int q,
                         double norm) {
  const double nc = std::max(pol[1], 1.0), nr = std::max(pol[3], 1.0), n = q == 0 ? nc : nr;
  switch (l.kind) {
    case PreferenceLossSpec::Kind::kDpoSigmoid:
      return l.beta * norm;
    case PreferenceLossSpec::Kind::kSimpo:
      return l.beta / n * norm * (1 + simpo_terms(l, pol));
    case PreferenceLossSpec::Kind::kDpoIpo:
      return 2 *
             (std::abs((pol[0] - ref[0]) / nc) + std::abs((pol[2] - ref[2]) / nr) +
              1 / (2 * l.beta)) /
             n * norm;
  }
  return 0;
}

void CudaPreference::check_coefficients(const PreferenceLossSpec& l, std::vector<double> pol,
                                        std::vector<double> ref, const std::string& what) {
  const int64_t S = int64_t(pol.size()) / 2, P = S / 2;
  const double norm = 1.0 / double(P);
  std::vector<float> want(static_cast<size_t>(S));
  std::vector<double> want_m(size_t(kPreferenceMetrics), 0.0);
  const Tensor host_ref =
      l.needs_reference() ? Tensor(ref.data(), DType::kF64, {S, 2}, MemPool::kHost) : Tensor();
  cpu.preference_coefficients(
      l, Tensor(pol.data(), DType::kF64, {S, 2}, MemPool::kHost), host_ref, norm, host(want, {S}),
      Tensor(want_m.data(), DType::kF64, {kPreferenceMetrics}, MemPool::kHost));
  const Tensor coef = poisoned({S});
  const Tensor metrics =
      up_f64(std::vector<double>(size_t(kPreferenceMetrics), 0.0), {kPreferenceMetrics});
  gpu->preference_coefficients(l, up_f64(pol, {S, 2}),
                               l.needs_reference() ? up_f64(ref, {S, 2}) : Tensor(), norm, coef,
                               metrics);
  const std::vector<float> got = down(coef);
  const double g = gamma_n(DType::kF64, 64), u32 = unit_roundoff(DType::kF32);
  std::vector<double> scale(size_t(kPreferenceMetrics), 0.0);
  for (int64_t k = 0; k < P; ++k)
    for (int q = 0; q < 2; ++q) {
      const size_t i = size_t(2 * k + q);
      const double bound = 2 * u32 * std::abs(want[i]) +
                           2 * g * coefficient_scale(l, &pol[4 * k], &ref[4 * k], q, norm);
      EXPECT_LE(std::abs(double(got[i]) - double(want[i])), bound)
          << what << " sequence " << i << ": " << got[i] << " vs the CPU's " << want[i];
    }
  // Each metric a sum over the pairs of values within a few dozen u of their magnitude (the
  // loss at most its own log1p's, the rewards and logps a product or quotient of the sums, the
  // accuracies a comparison of identical rewards): 2 gamma_{P + 64} of the sum of magnitudes.
  const std::vector<double> got_m = down_f64(metrics);
  // The magnitudes of each metric's terms, from the per-pair results on the host (the pairs
  // count is exact: its scale stays 0).
  for (int64_t k = 0; k < P; ++k) {
    PreferencePair p{pol[4 * k],     pol[4 * k + 2],          ref[4 * k],
                     ref[4 * k + 2], int64_t(pol[4 * k + 1]), int64_t(pol[4 * k + 3])};
    if (!l.needs_reference()) p.ref_chosen = p.ref_rejected = 0;
    const PreferencePairResult r = preference_pair_result(l, p);
    const double v[6] = {r.loss,       r.rewards_chosen, r.rewards_rejected,
                         r.accuracies, r.logps_chosen,   r.logps_rejected};
    for (int j = 0; j < 6; ++j) scale[size_t(j)] += std::abs(v[j]);
    // SimPO's loss is 1-Lipschitz in h, whose terms cancel: their magnitude too.
    if (l.kind == PreferenceLossSpec::Kind::kSimpo)
      scale[kMetricLoss] += simpo_terms(l, &pol[4 * k]);
  }
  for (int64_t j = 0; j < kPreferenceMetrics; ++j)
    EXPECT_LE(std::abs(got_m[j] - want_m[j]), 2 * gamma_n(DType::kF64, P + 64) * scale[j])
        << what << " metrics[" << j << "]: " << got_m[j] << " vs the CPU's " << want_m[j];
}

std::vector<PreferenceLossSpec> losses() {
  using Kind = PreferenceLossSpec::Kind;
  return {{Kind::kDpoSigmoid, 0.1, 0, 0},
          {Kind::kDpoSigmoid, 0.1, 0.1, 0},
          {Kind::kDpoIpo, 0.1, 0, 0},
          {Kind::kSimpo, 2.0, 0, 0.5}};
}

// Sequences of a packed micro-batch: S of them over n rows, lengths from a few tokens to a
// few thousand, prompts of 37 rows between them.
std::vector<int64_t> lengths(int64_t n, int64_t S, uint64_t seed) {
  std::mt19937_64 rng(seed);
  const int64_t room = n / S - 37;
  std::vector<int64_t> l(static_cast<size_t>(S));
  for (int64_t& x : l) x = 1 + int64_t(rng() % uint64_t(std::max<int64_t>(room, 1)));
  return l;
}

TEST_F(CudaPreference, SumsCoefficientsAndWeightsMatchTheCpuAtTrainingShapes) {
  struct Shape {
    int64_t n, S;
  };
  for (const Shape sh : {Shape{8192, 2}, Shape{8192, 16}, Shape{8192, 64}, Shape{131072, 2},
                         Shape{131072, 32}, Shape{131072, 64}}) {
    const std::string what = "n " + std::to_string(sh.n) + " S " + std::to_string(sh.S);
    SCOPED_TRACE(what);
    Batch b = batch(sh.n, lengths(sh.n, sh.S, uint64_t(sh.n + sh.S)), 37, 7);
    const std::vector<double> pol = check_sums(b, sh.S);
    Batch r = batch(sh.n, lengths(sh.n, sh.S, uint64_t(sh.n + sh.S)), 37, 8);  // same segments
    const std::vector<double> ref = check_sums(r, sh.S);
    for (const PreferenceLossSpec& l : losses())
      check_coefficients(l, pol, ref, what + " kind " + std::to_string(int(l.kind)));

    std::vector<float> coef = randn(size_t(sh.S), 5);
    std::vector<float> want(size_t(sh.n));
    cpu.gather_segment_weights(host(coef, {sh.S}), host_i32(b.segments, {sh.n}),
                               host(want, {sh.n}));
    const Tensor w = poisoned({sh.n});
    gpu->gather_segment_weights(up(coef, {sh.S}), up_i32(b.segments, {sh.n}), w);
    EXPECT_EQ(down(w), want) << "the weights are the coefficients, exactly";
  }
}

TEST_F(CudaPreference, OneSequenceOf100kTokens) {
  Batch b = batch(131072, {100000, 3000, 17}, 500, 9);
  (void)check_sums(b, 3);
}

// Unaligned views (one element in) take the gather's scalar path.
TEST_F(CudaPreference, UnalignedWeightsTakeTheScalarPath) {
  const int64_t n = 8191, S = 5;
  Batch b = batch(n + 1, lengths(n + 1, S, 3), 37, 4);
  std::vector<float> coef = randn(size_t(S), 6), want(static_cast<size_t>(n));
  std::vector<int32_t> seg(b.segments.begin() + 1, b.segments.end());
  cpu.gather_segment_weights(host(coef, {S}), host_i32(seg, {n}), host(want, {n}));
  const Tensor segs = up_i32(b.segments, {n + 1}), w = poisoned({n + 1});
  gpu->gather_segment_weights(up(coef, {S}), segs.rows(1, n), w.rows(1, n));
  const std::vector<float> got = down(w);
  EXPECT_EQ(std::vector<float>(got.begin() + 1, got.end()), want);
}

// The three ops queue their kernels and return: no host wait between the uploads and the read
// of their results (a micro-batch's preference loss costs no wait of its own).
TEST_F(CudaPreference, TheOpsNeverWaitForTheDevice) {
  const int64_t n = 131072, S = 64;
  Batch b = batch(n, lengths(n, S, 11), 37, 12);
  const Tensor row_max = up(b.row_max, {n}), stats = up(b.stats, {n, 2}),
               segs = up_i32(b.segments, {n});
  const Tensor pol = alloc({S, 2}, DType::kF64), ref = alloc({S, 2}, DType::kF64);
  const Tensor coef = alloc({S}, DType::kF32), w = alloc({n}, DType::kF32);
  const Tensor metrics =
      up_f64(std::vector<double>(size_t(kPreferenceMetrics), 0.0), {kPreferenceMetrics});
  const int64_t waits = gpu->host_waits();
  for (const PreferenceLossSpec& l : losses()) {
    gpu->segment_logp_sums(row_max, stats, segs, pol);
    gpu->segment_logp_sums(row_max, stats, segs, ref);
    gpu->preference_coefficients(l, pol, l.needs_reference() ? ref : Tensor(), 0.25, coef, metrics);
    gpu->gather_segment_weights(coef, segs, w);
  }
  EXPECT_EQ(gpu->host_waits(), waits) << "the preference ops do not wait";
  EXPECT_EQ(down_f64(metrics)[kMetricPairs], 4.0 * double(S / 2));
  EXPECT_GT(gpu->host_waits(), waits) << "the read waits";
}

}  // namespace
}  // namespace shardlm::test
