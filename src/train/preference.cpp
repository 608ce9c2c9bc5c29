// The preference objectives (preference.h): the pairs of a micro-batch, each pair's loss and
// derivatives, and their step runner.
#include "preference.h"

#include <cmath>

#include "preference_reference.h"
#include "shardlm/core/check.h"

namespace shardlm::trainer_detail {
namespace {

// log sigmoid(x) and sigmoid(x), stable for either sign
double log_sigmoid(double x) {
  return x >= 0 ? -std::log1p(std::exp(-x)) : x - std::log1p(std::exp(x));
}
double sigmoid(double x) { return std::exp(log_sigmoid(x)); }

}  // namespace

PreferenceLoss preference_loss(const TrainConfig& train) {
  PreferenceLoss loss;
  if (train.objective == "simpo") {
    loss.kind = PreferenceLoss::Kind::kSimpo;
    loss.beta = train.simpo.beta;
    loss.gamma = train.simpo.gamma;
    return loss;
  }
  SHARDLM_CHECK(train.objective == "dpo", "train.objective \"{}\" is no preference objective",
                train.objective);
  loss.kind = train.dpo.loss_type == "ipo" ? PreferenceLoss::Kind::kDpoIpo
                                           : PreferenceLoss::Kind::kDpoSigmoid;
  loss.beta = train.dpo.beta;
  loss.label_smoothing = train.dpo.label_smoothing;
  return loss;
}

std::vector<PairSpans> micro_batch_pairs(const Dataset& data, const std::vector<int64_t>& order,
                                         int64_t first, int64_t B) {
  std::vector<PairSpans> pairs;
  for (int64_t r = 0; r < B && first + r < int64_t(order.size()); ++r) {
    const std::vector<int64_t> docs = data.window_documents(order[first + r]);
    int64_t at = r * data.seq_len();
    for (size_t k = 0; k + 1 < docs.size(); k += 2) {
      PairSpans p;
      p.chosen = {at, at + docs[k]};
      p.rejected = {at + docs[k], at + docs[k] + docs[k + 1]};
      p.window = order[first + r];
      p.nth = int64_t(k / 2);
      at = p.rejected.end;
      pairs.push_back(p);
    }
  }
  return pairs;
}

void sum_span(const SequenceSpan& span, std::span<const double> logps,
              std::span<const int32_t> targets, double& sum, int64_t& count) {
  sum = 0;
  count = 0;
  for (int64_t i = span.begin; i < span.end; ++i) {
    if (targets[size_t(i)] == kIgnoreIndex) continue;
    sum += logps[size_t(i)];
    ++count;
  }
}

PairResult pair_result(const PreferenceLoss& loss, const PairLogps& p) {
  PairResult out;
  PreferenceSums& m = out.sums;
  const double nc = double(std::max<int64_t>(p.n_chosen, 1));
  const double nr = double(std::max<int64_t>(p.n_rejected, 1));
  const double b = loss.beta;
  if (loss.kind == PreferenceLoss::Kind::kSimpo) {
    const double h = b * (p.chosen / nc - p.rejected / nr) - loss.gamma;
    m.loss = -log_sigmoid(h);
    const double dh = -sigmoid(-h);  // d loss / d h
    out.d_chosen = dh * b / nc;
    out.d_rejected = -dh * b / nr;
    m.logps_chosen = p.chosen / nc;
    m.logps_rejected = p.rejected / nr;
    m.rewards_chosen = b * m.logps_chosen;
    m.rewards_rejected = b * m.logps_rejected;
  } else {
    const double lc = p.chosen - p.ref_chosen, lr = p.rejected - p.ref_rejected;  // log-ratios
    if (loss.kind == PreferenceLoss::Kind::kDpoIpo) {
      const double h = lc / nc - lr / nr, e = h - 1 / (2 * b);
      m.loss = e * e;
      out.d_chosen = 2 * e / nc;
      out.d_rejected = -2 * e / nr;
    } else {
      const double d = b * (lc - lr), s = loss.label_smoothing;
      m.loss = -(1 - s) * log_sigmoid(d) - s * log_sigmoid(-d);
      const double dd = -(1 - s) * sigmoid(-d) + s * sigmoid(d);  // d loss / d d
      out.d_chosen = dd * b;
      out.d_rejected = -dd * b;
    }
    m.logps_chosen = p.chosen;
    m.logps_rejected = p.rejected;
    m.rewards_chosen = b * lc;
    m.rewards_rejected = b * lr;
  }
  m.accuracies = m.rewards_chosen > m.rewards_rejected ? 1 : 0;
  return out;
}

namespace {

class PreferenceRunner final : public StepRunner {
 public:
  PreferenceRunner(const StepParts& parts, const PreferenceLoss& loss,
                   const ReferenceTable* reference)
      : p_(parts), loss_(loss), table_(reference) {
    SHARDLM_CHECK_KIND(ErrorKind::kConfig, parts.cp == nullptr,
                       "preference objectives do not run under context parallelism yet");
    SHARDLM_CHECK(table_ == nullptr || loss_.needs_reference(),
                  "reference sums given to an objective without a reference");
    const size_t n = size_t(parts.B * parts.T);
    policy_.resize(n);
    if (loss_.needs_reference() && table_ == nullptr) reference_.resize(n);
    targets_.resize(n);
  }

  StepSums run(const StepWork& w) override {
    StepSums sums;
    const double norm = w.preference_pairs > 0 ? 1.0 / double(w.preference_pairs) : 0.0;
    for (int64_t a = 0; a < p_.micro_batches; ++a) {
      const int64_t first = w.first_row + a * p_.B;
      sums.pairs +=
          fill_batch(p_.model, p_.cp, p_.data, w.order, first, p_.B, p_.backend, p_.staging);
      // fill_batch's host staging holds the targets second (step_runner.cpp).
      const int64_t n = p_.B * p_.T;
      std::copy_n(p_.staging.begin() + n, n, targets_.begin());
      const std::vector<PairSpans> pairs = micro_batch_pairs(p_.data, w.order, first, p_.B);
      if (loss_.needs_reference() && table_ == nullptr)
        p_.model.forward_target_logps(p_.B, p_.T, true, reference_);
      p_.model.set_lora_dropout(p_.seed * 0x100000001b3ULL + uint64_t(w.step),
                                (w.rank_row + a * p_.B) * p_.T);
      p_.model.forward_backward_weighted(
          p_.B, p_.T, policy_, [&](std::span<const double> logps, std::span<float> weights) {
            weigh(pairs, logps, norm, weights, sums.preference);
          });
    }
    sums.loss_sum = sums.preference.loss;
    return sums;
  }

 private:
  // Each pair's result from the policy's logps (and the reference's), and the token weights
  // -(d loss / d pi) / pairs on its sequences' target positions (0 elsewhere).
  void weigh(const std::vector<PairSpans>& pairs, std::span<const double> logps, double norm,
             std::span<float> weights, PreferenceSums& sums) const {
    std::fill(weights.begin(), weights.end(), 0.f);
    for (const PairSpans& s : pairs) {
      PairLogps p;
      int64_t count = 0;
      sum_span(s.chosen, logps, targets_, p.chosen, p.n_chosen);
      sum_span(s.rejected, logps, targets_, p.rejected, p.n_rejected);
      if (table_ != nullptr) {
        const int64_t i = table_->pair_index(s.window, s.nth);
        p.ref_chosen = table_->chosen[size_t(i)];
        p.ref_rejected = table_->rejected[size_t(i)];
      } else if (loss_.needs_reference()) {
        sum_span(s.chosen, reference_, targets_, p.ref_chosen, count);
        sum_span(s.rejected, reference_, targets_, p.ref_rejected, count);
      }
      const PairResult r = pair_result(loss_, p);
      sums.add(r.sums);
      fill_weights(s.chosen, float(-r.d_chosen * norm), weights);
      fill_weights(s.rejected, float(-r.d_rejected * norm), weights);
    }
  }

  void fill_weights(const SequenceSpan& span, float value, std::span<float> weights) const {
    for (int64_t i = span.begin; i < span.end; ++i)
      if (targets_[size_t(i)] != kIgnoreIndex) weights[size_t(i)] = value;
  }

  StepParts p_;
  PreferenceLoss loss_;
  const ReferenceTable* table_;             // full fine-tuning dpo: the precomputed sums
  std::vector<double> policy_, reference_;  // [B*T] per-token log-probabilities
  std::vector<int32_t> targets_;            // [B*T] the micro-batch's targets (host)
};

}  // namespace

std::unique_ptr<StepRunner> make_preference_runner(const StepParts& parts,
                                                   const PreferenceLoss& loss,
                                                   const ReferenceTable* reference) {
  return std::make_unique<PreferenceRunner>(parts, loss, reference);
}

}  // namespace shardlm::trainer_detail
