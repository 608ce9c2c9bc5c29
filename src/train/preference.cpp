// The preference objectives (preference.h): the pairs of a micro-batch and each pair's loss and
// derivatives (their step runner: preference_runner.cpp). Compiled without floating-point
// contraction (CMakeLists.txt), as the CPU backend's preference ops are: both give the same bits.
#include "preference.h"

#include <algorithm>

#include "shardlm/core/check.h"

namespace shardlm::trainer_detail {
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

void micro_batch_pairs(const Dataset& data, const std::vector<int64_t>& order, int64_t first,
                       int64_t B, std::vector<PairSpans>& pairs) {
  pairs.clear();
  for (int64_t r = 0; r < B && first + r < int64_t(order.size()); ++r) {
    const int64_t w = order[first + r], docs = data.window_document_count(w);
    int64_t at = r * data.seq_len();
    for (int64_t k = 0; k + 1 < docs; k += 2) {
      SHARDLM_CHECK(pairs.size() < pairs.capacity(),
                    "a micro-batch of {} rows holds more than the {} pairs its list was reserved "
                    "for",
                    B, pairs.capacity());
      const int64_t chosen = data.window_document_length(w, k);
      const int64_t rejected = data.window_document_length(w, k + 1);
      pairs.push_back({{at, at + chosen}, {at + chosen, at + chosen + rejected}, w, k / 2});
      at += chosen + rejected;
    }
  }
}

std::vector<PairSpans> pair_list(const Dataset& data, int64_t B) {
  std::vector<PairSpans> pairs;
  pairs.reserve(size_t(max_micro_batch_pairs(B, data.seq_len())));
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

std::vector<int64_t> rank_row_positions(const ContextParallel* cp, int64_t cp_rank, int64_t B,
                                        int64_t T, int64_t Tl) {
  std::vector<int64_t> at(static_cast<size_t>(B * Tl));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < Tl; ++i)
      at[size_t(b * Tl + i)] = b * T + (cp != nullptr ? cp->layout().global_index(cp_rank, i) : i);
  return at;
}

void rank_row_targets(ContextParallel* cp, InputStaging& staging, int64_t B, int64_t T,
                      std::span<const int64_t> positions, std::span<int32_t> targets) {
  const int64_t n = B * T;
  if (cp == nullptr) {  // fill_batch's host staging holds the targets second
    std::copy_n(staging.begin() + n, n, targets.begin());
    return;
  }
  const int32_t* full = cp->full_inputs(B).targets.i32();  // the rows fill_batch read
  std::fill(targets.begin(), targets.end(), kIgnoreIndex);
  for (const int64_t at : positions) targets[size_t(at)] = full[at];
}

PairResult pair_result(const PreferenceLoss& loss, const PairLogps& p) {
  const PreferencePairResult r = preference_pair_result(loss, p);
  PairResult out;
  out.sums = {r.loss,       r.rewards_chosen, r.rewards_rejected,
              r.accuracies, r.logps_chosen,   r.logps_rejected};
  out.d_chosen = r.d_chosen;
  out.d_rejected = r.d_rejected;
  return out;
}

}  // namespace shardlm::trainer_detail
