// The preference objectives (preference.h): the pairs of a micro-batch, each pair's loss and
// derivatives, and their step runner. Compiled without floating-point contraction
// (CMakeLists.txt), as the CPU backend's preference ops are: both give the same bits.
#include "preference.h"

#include <algorithm>
#include <cmath>

#include "preference_reference.h"
#include "shardlm/comm/communicator.h"
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

namespace {

class PreferenceRunner final : public StepRunner {
 public:
  PreferenceRunner(const StepParts& parts, const PreferenceLoss& loss, PipelineExecutor* pipe,
                   int64_t stage_output_elems, const ReferenceTable* reference)
      : p_(parts),
        loss_(loss),
        pipe_(pipe),
        stage_output_elems_(stage_output_elems),
        table_(reference) {
    SHARDLM_CHECK(parts.cp == nullptr || parts.cp_group != nullptr,
                  "a preference objective under context parallelism needs its cp group");
    SHARDLM_CHECK(table_ == nullptr || loss_.needs_reference(),
                  "reference sums given to an objective without a reference");
    const size_t local = size_t(parts.B * parts.Tl), row = size_t(parts.B * parts.T);
    policy_.resize(local);
    reference_.resize(local);
    policy_row_.resize(row);
    reference_row_.resize(row);
    targets_.resize(row);
    weights_row_.resize(row);
    if (pipe_ != nullptr) {  // each micro-batch's, kept from its load to its backward
      kept_targets_.assign(size_t(parts.micro_batches), std::vector<int32_t>(row));
      if (forward_reference())
        kept_reference_.assign(size_t(parts.micro_batches), std::vector<double>(local));
    }
    row_index_ = rank_row_positions(parts.cp, parts.cp != nullptr ? parts.cp_group->rank() : 0,
                                    parts.B, parts.T, parts.Tl);
  }

  StepSums run(const StepWork& w) override {
    if (pipe_ != nullptr) return run_pipelined(w);
    StepSums sums;
    const double norm = w.preference_pairs > 0 ? 1.0 / double(w.preference_pairs) : 0.0;
    for (int64_t a = 0; a < p_.micro_batches; ++a) {
      const int64_t first = w.first_row + a * p_.B;
      sums.pairs +=
          fill_batch(p_.model, p_.cp, p_.data, w.order, first, p_.B, p_.backend, p_.staging);
      own_targets();
      const std::vector<PairSpans> pairs = micro_batch_pairs(p_.data, w.order, first, p_.B);
      if (forward_reference()) {
        p_.model.forward_target_logps(p_.B, p_.Tl, true, reference_);
        to_rows(reference_, reference_row_);
      }
      p_.model.set_lora_dropout(p_.seed * 0x100000001b3ULL + uint64_t(w.step),
                                (w.rank_row + a * p_.B) * p_.T);
      p_.model.forward_backward_weighted(
          p_.B, p_.Tl, policy_, [&](std::span<const double> logps, std::span<float> weights) {
            weigh(pairs, logps, norm, weights, sums.preference);
          });
    }
    sums.loss_sum = sums.preference.loss;
    return sums;
  }

 private:
  // Under pipeline stages: DPO's reference first, the adapters-off forward of every micro-batch
  // through the stages (the executor's forward sweep), its logps kept on the last stage; then
  // 1F1B, the last stage's backward of a micro-batch starting from its pairs' coefficients (a
  // pair lies in one row, so in one micro-batch). Each micro-batch's targets and pairs are kept
  // from its load, since other micro-batches load before its backward.
  StepSums run_pipelined(const StepWork& w) {
    StepSums sums;
    const int m = int(p_.micro_batches);
    const double norm = w.preference_pairs > 0 ? 1.0 / double(w.preference_pairs) : 0.0;
    std::vector<std::vector<PairSpans>> pairs(static_cast<size_t>(m));
    auto load = [&](int a, int slot) {
      const int64_t first = w.first_row + a * p_.B;
      const double attention =
          fill_batch(p_.model, p_.cp, p_.data, w.order, first, p_.B, p_.backend, p_.staging, slot);
      own_targets();
      kept_targets_[size_t(a)] = targets_;
      pairs[size_t(a)] = micro_batch_pairs(p_.data, w.order, first, p_.B);
      return attention;
    };
    PipelineStageOps ops;
    ops.input = [&](int slot) { return p_.model.stage_input(slot, p_.B, p_.Tl); };
    ops.input_grad = [&] { return p_.model.stage_input_grad(p_.B, p_.Tl); };
    if (forward_reference()) {
      ops.load = [&](int a, int slot) { (void)load(a, slot); };
      ops.forward = [&](int a, int slot, LossResult*) {
        return p_.model.stage_forward_target_logps(slot, p_.B, p_.Tl, true,
                                                   kept_reference_[size_t(a)]);
      };
      // Its times stay out of sums.pipeline: pp_bubble and the stage columns measure the 1F1B
      // schedule alone (the sweep, forwards in order, idles every stage but one at a time).
      (void)pipe_->evaluate(ops, m, stage_output_elems_);
    }
    auto set_dropout = [&](int a) {  // PipelineRunner's: the micro-batch's mask, set again
      p_.model.set_lora_dropout(p_.seed * 0x100000001b3ULL + uint64_t(w.step),
                                (w.rank_row + a * p_.B) * p_.T);
    };
    ops.load = [&](int a, int slot) { sums.pairs += load(a, slot); };
    ops.forward = [&](int a, int slot, LossResult*) {
      set_dropout(a);
      return p_.model.stage_forward(slot, p_.B, p_.Tl);
    };
    ops.backward = [&](int a, int slot, const Tensor& d_out) {
      set_dropout(a);
      targets_ = kept_targets_[size_t(a)];
      if (forward_reference()) to_rows(kept_reference_[size_t(a)], reference_row_);
      p_.model.stage_backward_weighted(
          slot, p_.B, p_.Tl, policy_,
          [&](std::span<const double> logps, std::span<float> weights) {
            weigh(pairs[size_t(a)], logps, norm, weights, sums.preference);
          },
          d_out);
      return 0.0;
    };
    sums.pipeline = pipe_->train(ops, m, stage_output_elems_);
    sums.loss_sum = sums.preference.loss;
    return sums;
  }

  // Every host row above, held from construction (plan.h's preference_host_bytes counts them).
  int64_t host_bytes() const override {
    size_t bytes = (policy_.capacity() + reference_.capacity() + policy_row_.capacity() +
                    reference_row_.capacity()) *
                       sizeof(double) +
                   (targets_.capacity() + weights_row_.capacity()) * 4 +
                   row_index_.capacity() * sizeof(int64_t);
    for (const auto& v : kept_targets_) bytes += v.capacity() * sizeof(int32_t);
    for (const auto& v : kept_reference_) bytes += v.capacity() * sizeof(double);
    return int64_t(bytes);
  }

 private:
  // targets_ [B*T]: the micro-batch's targets at this rank's positions (rank_row_targets).
  void own_targets() { rank_row_targets(p_.cp, p_.staging, p_.B, p_.T, row_index_, targets_); }

  // DPO's reference from the adapters-off forward (LoRA), not a precomputed table.
  bool forward_reference() const { return loss_.needs_reference() && table_ == nullptr; }

  void to_rows(std::span<const double> local, std::vector<double>& row) const {
    for (size_t i = 0; i < row_index_.size(); ++i) row[size_t(row_index_[i])] = local[i];
  }

  // Each pair's result from the policy's logps (and the reference's), and the token weights
  // -(d loss / d pi) / pairs on its sequences' target positions (0 elsewhere). Under cp each
  // rank sums its own tokens; the pairs' sums and counts are then summed over the cp group (in
  // rank order: every cp rank gets the same bits, so the same coefficients).
  void weigh(const std::vector<PairSpans>& pairs, std::span<const double> logps, double norm,
             std::span<float> weights, PreferenceSums& sums) {
    to_rows(logps, policy_row_);
    std::vector<double> parts(pairs.size() * 6);  // per pair: 4 sums, 2 counts
    for (size_t k = 0; k < pairs.size(); ++k) {
      PairLogps p;
      int64_t count = 0;
      sum_span(pairs[k].chosen, policy_row_, targets_, p.chosen, p.n_chosen);
      sum_span(pairs[k].rejected, policy_row_, targets_, p.rejected, p.n_rejected);
      if (forward_reference()) {
        sum_span(pairs[k].chosen, reference_row_, targets_, p.ref_chosen, count);
        sum_span(pairs[k].rejected, reference_row_, targets_, p.ref_rejected, count);
      }
      const double v[6] = {p.chosen,       p.rejected,         p.ref_chosen,
                           p.ref_rejected, double(p.n_chosen), double(p.n_rejected)};
      std::copy_n(v, 6, parts.begin() + ptrdiff_t(6 * k));
    }
    if (p_.cp != nullptr) ordered_sum(*p_.cp_group, parts);
    std::fill(weights_row_.begin(), weights_row_.end(), 0.f);
    for (size_t k = 0; k < pairs.size(); ++k) {
      const double* v = parts.data() + 6 * k;
      PairLogps p{v[0], v[1], v[2], v[3], int64_t(v[4]), int64_t(v[5])};
      if (table_ != nullptr) {  // after the cp sum: the table's sums are the whole sequences'
        const int64_t i = table_->pair_index(pairs[k].window, pairs[k].nth);
        p.ref_chosen = table_->chosen[size_t(i)];
        p.ref_rejected = table_->rejected[size_t(i)];
      }
      const PairResult r = pair_result(loss_, p);
      sums.add(r.sums);
      fill_weights(pairs[k].chosen, float(-r.d_chosen * norm));
      fill_weights(pairs[k].rejected, float(-r.d_rejected * norm));
    }
    for (size_t i = 0; i < row_index_.size(); ++i) weights[i] = weights_row_[size_t(row_index_[i])];
  }

  void fill_weights(const SequenceSpan& span, float value) {
    for (int64_t i = span.begin; i < span.end; ++i)
      if (targets_[size_t(i)] != kIgnoreIndex) weights_row_[size_t(i)] = value;
  }

  StepParts p_;
  PreferenceLoss loss_;
  PipelineExecutor* pipe_;                          // pp > 1, else null
  int64_t stage_output_elems_;                      // one micro-batch's hidden state between stages
  const ReferenceTable* table_;                     // full fine-tuning dpo: the precomputed sums
  std::vector<double> policy_, reference_;          // [B*Tl] this rank's tokens' logps
  std::vector<double> policy_row_, reference_row_;  // [B*T] the same at their row positions
  std::vector<int32_t> targets_;                    // [B*T] this rank's targets (own_targets)
  std::vector<float> weights_row_;                  // [B*T] token weights at row positions
  std::vector<int64_t> row_index_;                  // [B*Tl] a local token's row position
  // pp: each micro-batch's targets_ and (dpo, last stage) reference logps [B*Tl], by index
  std::vector<std::vector<int32_t>> kept_targets_;
  std::vector<std::vector<double>> kept_reference_;
};

}  // namespace

std::unique_ptr<StepRunner> make_preference_runner(const StepParts& parts,
                                                   const PreferenceLoss& loss,
                                                   PipelineExecutor* pipe,
                                                   int64_t stage_output_elems,
                                                   const ReferenceTable* reference) {
  return std::make_unique<PreferenceRunner>(parts, loss, pipe, stage_output_elems, reference);
}

}  // namespace shardlm::trainer_detail
