// The loss of one preference pair (train.objective "dpo" or "simpo"): its spec, the order of the
// metrics the preference ops sum, and the per-pair math itself, in the one definition that the
// CPU op, the CUDA kernel (this header is compiled by nvcc too: standard headers only) and the
// trainer's host code share, so that every path computes the same double operations in the
// same order.
//
// With pi and ref the sums of the policy's and the reference's log-probabilities over a
// sequence's completion tokens, n its completion tokens (counted as max(n, 1)):
//   dpo sigmoid  d = beta ((pi_c - ref_c) - (pi_r - ref_r)),
//                loss = -(1 - e) log sigmoid(d) - e log sigmoid(-d)  (e: label_smoothing, cDPO)
//   dpo ipo      h = (pi_c - ref_c) / n_c - (pi_r - ref_r) / n_r, loss = (h - 1 / (2 beta))^2
//   simpo        h = beta (pi_c / n_c - pi_r / n_r) - gamma, loss = -log sigmoid(h)
// Metrics of a pair: rewards_chosen = beta (pi_c - ref_c) (simpo: beta pi_c / n_c), likewise
// rejected; accuracies 1 when chosen's reward is above rejected's; logps_chosen = pi_c (simpo:
// pi_c / n_c, as TRL's CPOTrainer logs them), logps_rejected likewise.
#pragma once

#include <cmath>
#include <cstdint>

#ifdef __CUDACC__
#define SHARDLM_HOST_DEVICE __host__ __device__
#else
#define SHARDLM_HOST_DEVICE
#endif

namespace shardlm {

struct PreferenceLossSpec {
  enum class Kind : uint8_t { kDpoSigmoid, kDpoIpo, kSimpo } kind = Kind::kDpoSigmoid;
  double beta = 0.1, label_smoothing = 0, gamma = 0;  // label_smoothing: dpo sigmoid; gamma: simpo
  SHARDLM_HOST_DEVICE bool needs_reference() const { return kind != Kind::kSimpo; }
};

// The metrics the preference ops sum, [kPreferenceMetrics] f64 in this order: each the sum over
// pairs, pairs their count.
enum PreferenceMetric : int64_t {
  kMetricLoss,
  kMetricRewardsChosen,
  kMetricRewardsRejected,
  kMetricAccuracies,
  kMetricLogpsChosen,
  kMetricLogpsRejected,
  kMetricPairs,
};
inline constexpr int64_t kPreferenceMetrics = 7;

// One pair's summed log-probabilities (policy and reference) and completion tokens.
struct PreferencePair {
  double chosen = 0, rejected = 0;          // policy
  double ref_chosen = 0, ref_rejected = 0;  // reference (dpo)
  int64_t n_chosen = 0, n_rejected = 0;
};

// One pair's loss and metrics (PreferenceMetric's first six), and d loss / d pi_c and d pi_r.
struct PreferencePairResult {
  double loss = 0, rewards_chosen = 0, rewards_rejected = 0, accuracies = 0;
  double logps_chosen = 0, logps_rejected = 0;
  double d_chosen = 0, d_rejected = 0;
};

namespace preference_detail {
// log sigmoid(x) and sigmoid(x), stable for either sign (the global functions: nvcc's device
// overloads, glibc's on the host)
SHARDLM_HOST_DEVICE inline double log_sigmoid(double x) {
  return x >= 0 ? -::log1p(::exp(-x)) : x - ::log1p(::exp(x));
}
SHARDLM_HOST_DEVICE inline double sigmoid(double x) { return ::exp(log_sigmoid(x)); }

SHARDLM_HOST_DEVICE inline void simpo(const PreferenceLossSpec& loss, const PreferencePair& p,
                                      double nc, double nr, PreferencePairResult& m) {
  const double b = loss.beta;
  const double h = b * (p.chosen / nc - p.rejected / nr) - loss.gamma;
  m.loss = -log_sigmoid(h);
  const double dh = -sigmoid(-h);  // d loss / d h
  m.d_chosen = dh * b / nc;
  m.d_rejected = -dh * b / nr;
  m.logps_chosen = p.chosen / nc;
  m.logps_rejected = p.rejected / nr;
  m.rewards_chosen = b * m.logps_chosen;
  m.rewards_rejected = b * m.logps_rejected;
}

SHARDLM_HOST_DEVICE inline void dpo(const PreferenceLossSpec& loss, const PreferencePair& p,
                                    double nc, double nr, PreferencePairResult& m) {
  const double b = loss.beta;
  const double lc = p.chosen - p.ref_chosen, lr = p.rejected - p.ref_rejected;  // log-ratios
  if (loss.kind == PreferenceLossSpec::Kind::kDpoIpo) {
    const double h = lc / nc - lr / nr, e = h - 1 / (2 * b);
    m.loss = e * e;
    m.d_chosen = 2 * e / nc;
    m.d_rejected = -2 * e / nr;
  } else {
    const double d = b * (lc - lr), s = loss.label_smoothing;
    m.loss = -(1 - s) * log_sigmoid(d) - s * log_sigmoid(-d);
    const double dd = -(1 - s) * sigmoid(-d) + s * sigmoid(d);  // d loss / d d
    m.d_chosen = dd * b;
    m.d_rejected = -dd * b;
  }
  m.logps_chosen = p.chosen;
  m.logps_rejected = p.rejected;
  m.rewards_chosen = b * lc;
  m.rewards_rejected = b * lr;
}
}  // namespace preference_detail

// The pair's loss, metrics and derivatives (the formulas above).
SHARDLM_HOST_DEVICE inline PreferencePairResult preference_pair_result(
    const PreferenceLossSpec& loss, const PreferencePair& p) {
  PreferencePairResult m;
  // A sequence without completion tokens counts as one token: its sum is 0, and a division by
  // zero would make the pair's loss NaN.
  const double nc = double(p.n_chosen > 1 ? p.n_chosen : 1);
  const double nr = double(p.n_rejected > 1 ? p.n_rejected : 1);
  if (loss.kind == PreferenceLossSpec::Kind::kSimpo)
    preference_detail::simpo(loss, p, nc, nr, m);
  else
    preference_detail::dpo(loss, p, nc, nr, m);
  m.accuracies = m.rewards_chosen > m.rewards_rejected ? 1 : 0;
  return m;
}

// The pairs of Backend::preference_coefficients in order, on raw arrays (the CPU op's loop and
// the CUDA kernel's one thread): policy [2P, 2], reference [2P, 2] or null, coef [2P]
// overwritten, metrics [kPreferenceMetrics] += the pairs' sums (summed first), pairs += P.
SHARDLM_HOST_DEVICE inline void preference_pairs(const PreferenceLossSpec& loss,
                                                 const double* policy, const double* reference,
                                                 int64_t P, double norm, float* coef,
                                                 double* metrics) {
  double local[kPreferenceMetrics - 1] = {};  // the pairs' sums
  for (int64_t k = 0; k < P; ++k) {
    PreferencePair p;
    p.chosen = policy[4 * k];
    p.rejected = policy[4 * k + 2];
    p.n_chosen = int64_t(policy[4 * k + 1]);
    p.n_rejected = int64_t(policy[4 * k + 3]);
    if (reference != nullptr && loss.needs_reference()) {
      p.ref_chosen = reference[4 * k];
      p.ref_rejected = reference[4 * k + 2];
    }
    const PreferencePairResult r = preference_pair_result(loss, p);
    const double v[kPreferenceMetrics - 1] = {r.loss,       r.rewards_chosen, r.rewards_rejected,
                                              r.accuracies, r.logps_chosen,   r.logps_rejected};
    for (int j = 0; j < kPreferenceMetrics - 1; ++j) local[j] += v[j];
    coef[2 * k] = float(-r.d_chosen * norm);
    coef[2 * k + 1] = float(-r.d_rejected * norm);
  }
  for (int j = 0; j < kPreferenceMetrics - 1; ++j) metrics[j] += local[j];
  metrics[kMetricPairs] += double(P);
}

}  // namespace shardlm
