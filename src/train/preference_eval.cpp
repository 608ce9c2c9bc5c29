// Evaluation under a preference objective (preference_eval.h): the held-out pairs' sums from
// forward passes only, their losses and metrics.
#include "preference_eval.h"

#include <algorithm>

#include "shardlm/comm/communicator.h"
#include "shardlm/core/check.h"

namespace shardlm::trainer_detail {
namespace {

const std::vector<int64_t>& checked_order(const PreferenceEvalPass& pass) {
  SHARDLM_CHECK(
      pass.order != nullptr && int64_t(pass.order->size()) == pass.parts.data.num_windows(),
      "a preference evaluation of {} windows needs their order", pass.parts.data.num_windows());
  return *pass.order;
}

class PreferenceEvaluator {
 public:
  explicit PreferenceEvaluator(const PreferenceEvalPass& pass)
      : s_(pass),
        p_(pass.parts),
        holds_head_(p_.model.config().holds_head()),
        own_(pass.rows == nullptr
                 ? std::optional<PreferenceEvalRows>(std::in_place, p_.B, p_.T, p_.Tl)
                 : std::nullopt),
        r_(pass.rows != nullptr ? *pass.rows : *own_),
        order_(checked_order(pass)),
        local_(r_.local),
        row_(r_.row),
        targets_(r_.targets),
        row_index_(r_.row_index) {
    SHARDLM_CHECK(int64_t(local_.size()) == p_.B * p_.Tl && int64_t(row_.size()) == p_.B * p_.T,
                  "the evaluation's rows hold {} and {} tokens, its micro-batches {} and {}",
                  local_.size(), row_.size(), p_.B * p_.Tl, p_.B * p_.T);
    SHARDLM_CHECK(p_.cp == nullptr || p_.cp_group != nullptr,
                  "a preference evaluation under context parallelism needs its cp group");
    SHARDLM_CHECK(s_.reference == nullptr || s_.loss.needs_reference(),
                  "reference sums given to an objective without a reference");
    const int64_t batches = (p_.data.num_windows() + p_.B - 1) / p_.B;
    limit_ = s_.max_batches > 0 ? std::min(s_.max_batches, batches) : batches;
    rounds_ = (limit_ + s_.dp_size - 1) / s_.dp_size;
    // Where each of this rank's B * Tl tokens sits in the micro-batch's full rows [B * T].
    for (int64_t b = 0; b < p_.B; ++b)
      for (int64_t i = 0; i < p_.Tl; ++i)
        row_index_[size_t(b * p_.Tl + i)] =
            b * p_.T +
            (p_.cp != nullptr ? p_.cp->layout().global_index(p_.cp_group->rank(), i) : i);
  }

  PreferenceEval run() {
    if (s_.pipe != nullptr) return run_pipelined();
    for (int64_t i = 0; i < rounds_; ++i) {
      if (s_.progress) s_.progress(i + 1, rounds_);
      load(i, -1);
      std::vector<double> reference;
      if (forward_reference()) {
        p_.model.forward_target_logps(p_.B, p_.Tl, /*base_only=*/true, local_);
        reference = pair_sums(i);
      }
      p_.model.forward_target_logps(p_.B, p_.Tl, /*base_only=*/false, local_);
      add(i, pair_sums(i), reference);
    }
    return out_;
  }

 private:
  // Through the stages, one micro-batch after another (the executor's forward sweep): DPO's
  // reference sweep first (each round's pairs' reference sums kept on the last stage), then
  // the policy's.
  PreferenceEval run_pipelined() {
    if (rounds_ == 0) return out_;
    std::vector<std::vector<double>> reference(static_cast<size_t>(rounds_));
    PipelineStageOps ops;
    ops.load = [&](int i, int slot) { load(i, slot); };
    ops.input = [&](int slot) { return p_.model.stage_input(slot, p_.B, p_.Tl); };
    if (forward_reference()) {
      ops.forward = [&](int i, int slot, LossResult*) {
        const Tensor out = p_.model.stage_forward_target_logps(slot, p_.B, p_.Tl, true, local_);
        if (holds_head_) reference[size_t(i)] = pair_sums(i);
        return out;
      };
      s_.pipe->evaluate(ops, int(rounds_), s_.stage_output_elems);
    }
    ops.forward = [&](int i, int slot, LossResult*) {
      const Tensor out = p_.model.stage_forward_target_logps(slot, p_.B, p_.Tl, false, local_);
      if (holds_head_) add(i, pair_sums(i), reference[size_t(i)]);
      return out;
    };
    s_.pipe->evaluate(ops, int(rounds_), s_.stage_output_elems);
    return out_;
  }

  // DPO's reference from the adapters-off forward (LoRA), not a precomputed table.
  bool forward_reference() const { return s_.loss.needs_reference() && s_.reference == nullptr; }

  // The replica's micro-batch of round i (its first rows; a replica without one this round
  // repeats the set's first, whose sums add() drops).
  int64_t first_row(int64_t i) const {
    const int64_t b = i * s_.dp_size + s_.dp_rank;
    return b < limit_ ? b * p_.B : 0;
  }
  bool owns(int64_t i) const { return i * s_.dp_size + s_.dp_rank < limit_; }

  // Round i's rows into the model, and targets_ [B*T]: the full rows' targets at the positions
  // this rank holds, kIgnoreIndex elsewhere.
  void load(int64_t i, int slot) {
    fill_batch(p_.model, p_.cp, p_.data, order_, first_row(i), p_.B, p_.backend, p_.staging, slot);
    const int64_t n = p_.B * p_.T;
    if (p_.cp == nullptr) {  // fill_batch's host staging holds the targets second
      std::copy_n(p_.staging.begin() + n, n, targets_.begin());
      return;
    }
    const int32_t* full = p_.cp->full_inputs(p_.B).targets.i32();
    std::fill(targets_.begin(), targets_.end(), kIgnoreIndex);
    for (const int64_t at : row_index_) targets_[size_t(at)] = full[at];
  }

  // Per pair of round i, from the logps in local_: the chosen and rejected sums and their
  // target counts [4 per pair], summed over the cp group (in rank order: every cp rank gets the
  // same bits).
  std::vector<double> pair_sums(int64_t i) {
    for (size_t k = 0; k < row_index_.size(); ++k) row_[size_t(row_index_[k])] = local_[k];
    micro_batch_pairs(p_.data, order_, first_row(i), p_.B, r_.pairs);
    const std::vector<PairSpans>& pairs = r_.pairs;
    std::vector<double> sums(4 * pairs.size());
    for (size_t k = 0; k < pairs.size(); ++k) {
      int64_t n_chosen = 0, n_rejected = 0;
      sum_span(pairs[k].chosen, row_, targets_, sums[4 * k], n_chosen);
      sum_span(pairs[k].rejected, row_, targets_, sums[4 * k + 1], n_rejected);
      sums[4 * k + 2] = double(n_chosen);
      sums[4 * k + 3] = double(n_rejected);
    }
    if (p_.cp != nullptr) ordered_sum(*p_.cp_group, sums);
    return sums;
  }

  // Round i's pairs' losses and metrics into out_ (when the round's batch is the replica's own).
  void add(int64_t i, const std::vector<double>& policy, const std::vector<double>& reference) {
    if (!owns(i)) return;
    micro_batch_pairs(p_.data, order_, first_row(i), p_.B, r_.pairs);
    const std::vector<PairSpans>& pairs = r_.pairs;
    for (size_t k = 0; k < pairs.size(); ++k) {
      PairLogps p;
      p.chosen = policy[4 * k];
      p.rejected = policy[4 * k + 1];
      p.n_chosen = int64_t(policy[4 * k + 2]);
      p.n_rejected = int64_t(policy[4 * k + 3]);
      if (s_.reference != nullptr) {
        const size_t at = size_t(s_.reference->pair_index(pairs[k].window, pairs[k].nth));
        p.ref_chosen = s_.reference->chosen[at];
        p.ref_rejected = s_.reference->rejected[at];
      } else if (!reference.empty()) {
        p.ref_chosen = reference[4 * k];
        p.ref_rejected = reference[4 * k + 1];
      }
      out_.sums.add(pair_result(s_.loss, p).sums);
      ++out_.pairs;
    }
  }

  const PreferenceEvalPass& s_;
  const StepParts& p_;
  bool holds_head_;  // the last pipeline stage (or the whole model): the logps are here
  int64_t limit_ = 0, rounds_ = 0;         // micro-batches evaluated; rounds over the replicas
  std::optional<PreferenceEvalRows> own_;  // without the run's rows
  PreferenceEvalRows& r_;
  const std::vector<int64_t>& order_;  // the pass's: the held-out windows in order
  // r_'s rows (PreferenceEvalRows says what each holds)
  std::vector<double>& local_;
  std::vector<double>& row_;
  std::vector<int32_t>& targets_;
  std::vector<int64_t>& row_index_;
  PreferenceEval out_;
};

}  // namespace

PreferenceEval evaluate_preference(const PreferenceEvalPass& pass) {
  return PreferenceEvaluator(pass).run();
}

}  // namespace shardlm::trainer_detail
