// The contracts of the preference objectives' ops: segment_logp_sums, preference_coefficients and
// gather_segment_weights (shapes, dtypes and the loss spec). The segment ids' range is the
// backend's to check: it reads them.
#include <cmath>

#include "backend/contracts/checks.h"

namespace shardlm {
namespace {

using namespace contract;  // NOLINT: the contract helpers are this file's vocabulary

// segments [n] i32 with n the rows of the tensor named `rows_name`
void check_segments(const Tensor& segments, int64_t n, std::string_view op,
                    std::string_view rows_name) {
  check_tensor(segments, DType::kI32, 1, op, "segments");
  SHARDLM_CHECK(segments.dim(0) == n, "{}: segments must be [{}] like {}, got {}", op, n, rows_name,
                segments.shape().str());
}

// A pair table [2P, 2] f64 (segment_logp_sums' sums of the chosen and rejected sequences).
void check_pair_sums(const Tensor& t, std::string_view op, std::string_view name) {
  check_tensor(t, DType::kF64, 2, op, name);
  SHARDLM_CHECK(t.dim(1) == 2 && t.dim(0) % 2 == 0,
                "{}: {} must be [2P, 2] (a chosen and a rejected sequence per pair), got {}", op,
                name, t.shape().str());
}

void check_loss_spec(const PreferenceLossSpec& loss, std::string_view op) {
  SHARDLM_CHECK(loss.kind == PreferenceLossSpec::Kind::kDpoSigmoid ||
                    loss.kind == PreferenceLossSpec::Kind::kDpoIpo ||
                    loss.kind == PreferenceLossSpec::Kind::kSimpo,
                "{}: unknown preference loss kind {}", op, int(loss.kind));
  SHARDLM_CHECK(std::isfinite(loss.beta) && loss.beta > 0, "{}: beta = {} must be finite and > 0",
                op, loss.beta);
  SHARDLM_CHECK(
      std::isfinite(loss.label_smoothing) && loss.label_smoothing >= 0 && loss.label_smoothing <= 1,
      "{}: label_smoothing = {} must be in [0, 1]", op, loss.label_smoothing);
  SHARDLM_CHECK(std::isfinite(loss.gamma), "{}: gamma = {} must be finite", op, loss.gamma);
}

}  // namespace

void Backend::segment_logp_sums(const Tensor& row_max, const Tensor& stats, const Tensor& segments,
                                const Tensor& sums) {
  constexpr std::string_view op = "segment_logp_sums";
  check_tensor(row_max, DType::kF32, 1, op, "row_max");
  const int64_t n = row_max.dim(0);
  check_tensor(stats, DType::kF32, 2, op, "stats");
  SHARDLM_CHECK(stats.dim(0) == n && stats.dim(1) == 2, "{}: stats must be [{}, 2], got {}", op, n,
                stats.shape().str());
  check_segments(segments, n, op, "row_max");
  check_tensor(sums, DType::kF64, 2, op, "sums");
  SHARDLM_CHECK(sums.dim(1) == 2, "{}: sums must be [S, 2] (a sum and a count per segment), got {}",
                op, sums.shape().str());
  check_disjoint(sums, row_max, op, "sums", "row_max");
  check_disjoint(sums, stats, op, "sums", "stats");
  check_disjoint(sums, segments, op, "sums", "segments");
  do_segment_logp_sums(row_max, stats, segments, sums);
}

void Backend::preference_coefficients(const PreferenceLossSpec& loss, const Tensor& policy,
                                      const Tensor& reference, double norm, const Tensor& coef,
                                      const Tensor& metrics) {
  constexpr std::string_view op = "preference_coefficients";
  check_loss_spec(loss, op);
  check_pair_sums(policy, op, "policy");
  if (reference.empty()) {  // not given (a micro-batch without pairs needs none either)
    SHARDLM_CHECK(!loss.needs_reference() || policy.dim(0) == 0,
                  "{}: a DPO loss needs the reference's sums; reference is empty", op);
  } else {
    check_pair_sums(reference, op, "reference");
    SHARDLM_CHECK(reference.shape() == policy.shape(),
                  "{}: reference {} must be empty or {} like policy", op, reference.shape().str(),
                  policy.shape().str());
  }
  SHARDLM_CHECK(std::isfinite(norm), "{}: norm = {} must be finite", op, norm);
  check_tensor(coef, DType::kF32, 1, op, "coef");
  SHARDLM_CHECK(coef.dim(0) == policy.dim(0), "{}: coef must be [{}] (one per sequence), got {}",
                op, policy.dim(0), coef.shape().str());
  check_tensor(metrics, DType::kF64, 1, op, "metrics");
  SHARDLM_CHECK(metrics.dim(0) == kPreferenceMetrics, "{}: metrics must be [{}], got {}", op,
                kPreferenceMetrics, metrics.shape().str());
  check_disjoint(coef, policy, op, "coef", "policy");
  check_disjoint(metrics, policy, op, "metrics", "policy");
  check_disjoint(metrics, coef, op, "metrics", "coef");
  if (!reference.empty()) {
    check_disjoint(metrics, reference, op, "metrics", "reference");
    check_disjoint(coef, reference, op, "coef", "reference");
  }
  do_preference_coefficients(loss, policy, reference, norm, coef, metrics);
}

void Backend::gather_segment_weights(const Tensor& coef, const Tensor& segments,
                                     const Tensor& weights) {
  constexpr std::string_view op = "gather_segment_weights";
  check_tensor(coef, DType::kF32, 1, op, "coef");
  check_tensor(weights, DType::kF32, 1, op, "weights");
  check_segments(segments, weights.dim(0), op, "weights");
  check_disjoint(weights, coef, op, "weights", "coef");
  check_disjoint(weights, segments, op, "weights", "segments");
  do_gather_segment_weights(coef, segments, weights);
}

}  // namespace shardlm
