// The preference objectives' step runner (preference.h's make_preference_runner), its pairs'
// arithmetic on the device. Per micro-batch the host knows which sequence each of its tokens
// belongs to, from the pairs' placement and the targets; it writes those segment ids into a
// pinned slot and starts their upload (no wait). The rest is device work, issued where the
// model hands over the head's row statistics (LlamaModel::HeadRowStats):
//   reference (DPO with LoRA)  segment_logp_sums of the adapters-off forward, kept on the device
//                              (full fine-tuning DPO: the table's sums, uploaded with the ids)
//   policy (in the backward)   segment_logp_sums, preference_coefficients (the pairs' loss and
//                              metrics into the step's metrics buffer), gather_segment_weights
//                              into the weighted head's token weights
// Under context parallelism each sum is all-reduced over the cp group on the device, in place
// (a blocking collective: on NCCL the host still waits for its completion). The metrics are read
// once, at the end of the step: its loss read. The buffers and their bytes
// are plan/preference_step.h's.
#include <algorithm>
#include <array>
#include <span>
#include <vector>

#include "preference.h"
#include "preference_reference.h"
#include "shardlm/comm/communicator.h"
#include "shardlm/core/check.h"
#include "shardlm/plan/preference_step.h"

namespace shardlm::trainer_detail {
namespace {

static_assert(kPreferenceStepMetrics == kPreferenceMetrics);

// One micro-batch as its device work needs it: its pairs (the host's, for the table's sums
// and the metrics' check; in the runner's pair list for it), its segment ids' set and its
// reference sums' set.
struct MicroBatch {
  std::span<const PairSpans> pairs;
  int segments = 0;   // the set holding its segment ids
  int reference = 0;  // the set holding its reference sums (dpo)
  int64_t sequences() const { return 2 * int64_t(pairs.size()); }
};

class PreferenceRunner final : public StepRunner {
 public:
  PreferenceRunner(const StepParts& parts, MemoryLedger& ledger, const PreferenceLoss& loss,
                   PipelineExecutor* pipe, int64_t stage_output_elems,
                   const ReferenceTable* reference)
      : p_(parts),
        be_(parts.backend),
        loss_(loss),
        pipe_(pipe),
        stage_output_elems_(stage_output_elems),
        table_(reference),
        bufs_(preference_step_buffers(parts.model.config().holds_head(), parts.B, parts.T, parts.Tl,
                                      parts.model.options().pipeline_slots, parts.micro_batches,
                                      pipe != nullptr, loss.needs_reference(),
                                      reference != nullptr)) {
    SHARDLM_CHECK(parts.cp == nullptr || parts.cp_group != nullptr,
                  "a preference objective under context parallelism needs its cp group");
    SHARDLM_CHECK(table_ == nullptr || loss_.needs_reference(),
                  "reference sums given to an objective without a reference");
    if (bufs_.device_bytes() > 0) {
      device_ = Buffer(be_, ledger, MemCategory::kActivations, MemPool::kDevice,
                       size_t(bufs_.device_bytes()));
      staging_ = Buffer(be_, ledger, MemCategory::kActivations, MemPool::kHost,
                        size_t(bufs_.host_bytes()));
    }
    row_index_ = rank_row_positions(parts.cp, parts.cp != nullptr ? parts.cp_group->rank() : 0,
                                    parts.B, parts.T, parts.Tl);
    // A pair list per micro-batch alive at once: the step's all under pipeline stages (their
    // backwards come after other loads), else one (preference_pair_lists).
    for (int64_t k = 0; k < preference_pair_lists(pipe != nullptr, parts.micro_batches); ++k)
      pair_lists_.push_back(pair_list(parts.data, parts.B));
  }

  StepSums run(const StepWork& w) override {
    norm_ = w.preference_pairs > 0 ? 1.0 / double(w.preference_pairs) : 0.0;
    pairs_ = 0;
    if (holds_head()) be_.zero(metrics());
    StepSums sums = pipe_ != nullptr ? run_pipelined(w) : run_micro_batches(w);
    read_metrics(sums);
    return sums;
  }

  // The row positions and the pair lists; the staging slots and device buffers are Buffers in
  // the ledger.
  int64_t host_bytes() const override {
    size_t bytes = row_index_.capacity() * sizeof(int64_t);
    for (const std::vector<PairSpans>& l : pair_lists_) bytes += l.capacity() * sizeof(PairSpans);
    return int64_t(bytes);
  }

 private:
  // Without pipeline stages: per micro-batch its load, DPO's adapters-off forward (its sums
  // kept on the device), then the policy's forward and weighted backward.
  StepSums run_micro_batches(const StepWork& w) {
    StepSums sums;
    for (int64_t a = 0; a < p_.micro_batches; ++a) {
      const int64_t first = w.first_row + a * p_.B;
      sums.pairs +=
          fill_batch(p_.model, p_.cp, p_.data, w.order, first, p_.B, p_.backend, p_.staging);
      const MicroBatch mb = stage(w.order, first, 0, 0);
      if (forward_reference())
        p_.model.forward_row_stats(p_.B, p_.Tl, /*base_only=*/true, [&](const HeadRowStats& s) {
          sequence_sums(s, mb, reference(mb));
        });
      set_dropout(w, a);
      p_.model.forward_backward_weighted(
          p_.B, p_.Tl,
          [&](const HeadRowStats& s, const Tensor& weights) { weigh(s, mb, weights); });
    }
    return sums;
  }

  // Under pipeline stages: DPO's reference first, the adapters-off forward of every micro-batch
  // through the stages (the executor's forward sweep, every micro-batch in slot 0), its sums
  // kept on the last stage in the micro-batch's own reference set; then 1F1B, the last stage's
  // backward of a micro-batch starting from its pairs' coefficients (a pair lies in one row, so
  // in one micro-batch). A micro-batch's segment ids go up at its load into its slot's set,
  // which holds them until its backward.
  StepSums run_pipelined(const StepWork& w) {
    StepSums sums;
    const int m = int(p_.micro_batches);
    std::vector<MicroBatch> mbs(static_cast<size_t>(m));
    auto load = [&](int a, int slot) {
      const int64_t first = w.first_row + a * p_.B;
      const double attention =
          fill_batch(p_.model, p_.cp, p_.data, w.order, first, p_.B, p_.backend, p_.staging, slot);
      mbs[size_t(a)] = stage(w.order, first, slot, a);
      return attention;
    };
    PipelineStageOps ops;
    ops.input = [&](int slot) { return p_.model.stage_input(slot, p_.B, p_.Tl); };
    ops.input_grad = [&] { return p_.model.stage_input_grad(p_.B, p_.Tl); };
    if (forward_reference()) {
      ops.load = [&](int a, int slot) { (void)load(a, slot); };
      ops.forward = [&](int a, int slot, LossResult*) {
        const MicroBatch& mb = mbs[size_t(a)];
        return p_.model.stage_forward_row_stats(
            slot, p_.B, p_.Tl, true,
            [&](const HeadRowStats& s) { sequence_sums(s, mb, reference(mb)); });
      };
      // Its times stay out of sums.pipeline: pp_bubble and the stage columns measure the 1F1B
      // schedule alone (the sweep, forwards in order, idles every stage but one at a time).
      (void)pipe_->evaluate(ops, m, stage_output_elems_);
    }
    ops.load = [&](int a, int slot) { sums.pairs += load(a, slot); };
    ops.forward = [&](int a, int slot, LossResult*) {
      set_dropout(w, a);  // PipelineRunner's: the micro-batch's mask, set again at its backward
      return p_.model.stage_forward(slot, p_.B, p_.Tl);
    };
    ops.backward = [&](int a, int slot, const Tensor& d_out) {
      set_dropout(w, a);
      const MicroBatch& mb = mbs[size_t(a)];
      p_.model.stage_backward_weighted(
          slot, p_.B, p_.Tl,
          [&](const HeadRowStats& s, const Tensor& weights) { weigh(s, mb, weights); }, d_out);
      return 0.0;
    };
    sums.pipeline = pipe_->train(ops, m, stage_output_elems_);
    return sums;
  }

  void set_dropout(const StepWork& w, int64_t a) {
    p_.model.set_lora_dropout(p_.seed * 0x100000001b3ULL + uint64_t(w.step),
                              (w.rank_row + a * p_.B) * p_.T);
  }

  bool holds_head() const { return !device_.empty(); }
  // DPO's reference from the adapters-off forward (LoRA), not a precomputed table.
  bool forward_reference() const { return loss_.needs_reference() && table_ == nullptr; }

  // The micro-batch of rows order[first .. first + B) just loaded (fill_batch): its pairs, and
  // on the stage with the head its segment ids (and the table's reference sums) written into
  // the next pinned slot and sent up into segment set `set`; `micro`: its index in the step.
  MicroBatch stage(const std::vector<int64_t>& order, int64_t first, int set, int micro) {
    MicroBatch mb;
    std::vector<PairSpans>& list = pair_lists_[size_t(pipe_ != nullptr ? micro : 0)];
    micro_batch_pairs(p_.data, order, first, p_.B, list);
    mb.pairs = list;
    if (!holds_head()) return mb;
    SHARDLM_CHECK(set < bufs_.segment_sets, "segment set {} of {}", set, bufs_.segment_sets);
    SHARDLM_CHECK(mb.sequences() <= bufs_.max_segments,
                  "a micro-batch of {} rows holds {} sequences, more than its bound {}", p_.B,
                  mb.sequences(), bufs_.max_segments);
    mb.segments = set;
    mb.reference = table_ != nullptr ? set : pipe_ != nullptr ? micro : 0;
    const int slot = next_slot_;
    next_slot_ = (next_slot_ + 1) % PreferenceStepBuffers::kStagingSlots;
    // Written again only once its copies from kStagingSlots loads ago have run (never a block
    // where the inputs go up from the input staging: plan/preference_step.h says why).
    be_.host_wait_fence(slot_fence_[size_t(slot)]);
    std::byte* at = staging_.data() + slot * bufs_.slot_bytes();
    const Tensor ids(reinterpret_cast<int32_t*>(at), DType::kI32, {bufs_.tokens}, MemPool::kHost);
    fill_segments(mb.pairs, ids.i32());
    slot_fence_[size_t(slot)] = be_.copy_async(ids, segments(mb));
    if (table_ != nullptr && mb.sequences() > 0) {
      const Tensor sums(reinterpret_cast<double*>(at + bufs_.segments_bytes()), DType::kF64,
                        {mb.sequences(), 2}, MemPool::kHost);
      fill_table_sums(mb.pairs, sums.f64());
      slot_fence_[size_t(slot)] = be_.copy_async(sums, reference(mb));
    }
    be_.wait_fence(slot_fence_[size_t(slot)]);
    return mb;
  }

  // ids [B*Tl]: each local token's sequence (2k: pair k's chosen, 2k + 1 its rejected), -1 for
  // a token outside the pairs or without a target. Targets from fill_batch's host rows: the
  // staging's (targets second) or, under cp, the full rows it sharded.
  void fill_segments(std::span<const PairSpans> pairs, int32_t* ids) const {
    std::vector<int64_t> begins, ends;  // the sequences' row spans, in row order
    for (const PairSpans& p : pairs)
      for (const SequenceSpan& s : {p.chosen, p.rejected}) {
        begins.push_back(s.begin);
        ends.push_back(s.end);
      }
    const int64_t n = p_.B * p_.T;
    const int32_t* targets =
        p_.cp != nullptr ? p_.cp->full_inputs(p_.B).targets.i32() : &*(p_.staging.begin() + n);
    for (size_t i = 0; i < row_index_.size(); ++i) {
      const int64_t at = row_index_[i];
      const auto next = std::upper_bound(begins.begin(), begins.end(), at);
      const int64_t k = int64_t(next - begins.begin()) - 1;
      const bool in = k >= 0 && at < ends[size_t(k)] && targets[at] != kIgnoreIndex;
      ids[i] = in ? int32_t(k) : -1;
    }
  }

  // sums [2P, 2]: each pair's reference sums from the table (its count column unused).
  void fill_table_sums(std::span<const PairSpans> pairs, double* sums) const {
    for (size_t k = 0; k < pairs.size(); ++k) {
      const size_t i = size_t(table_->pair_index(pairs[k].window, pairs[k].nth));
      const double row[4] = {table_->chosen[i], 0, table_->rejected[i], 0};
      std::copy_n(row, 4, sums + 4 * k);
    }
  }

  // out [2P, 2]: each sequence's summed log-probabilities and count from the head's
  // statistics, summed over the cp group (every rank's own tokens' share) on the device.
  void sequence_sums(const HeadRowStats& s, const MicroBatch& mb, const Tensor& out) {
    if (mb.sequences() == 0) return;
    be_.segment_logp_sums(s.row_max, s.stats, segments(mb), out);
    // NCCL's all-reduce gives every rank the same bits. A host transport may round a rank's
    // sum differently in the last place; that rank's coefficients then weigh only its own
    // tokens (its share of the gradient) by a relative 1 ulp more or less, and the metrics
    // are counted from one cp rank: within the bound of a sum in another order (the tests').
    if (p_.cp != nullptr) p_.cp_group->all_reduce(out);
  }

  // The policy's sums, the pairs' coefficients and metrics, and the token weights [B*Tl].
  void weigh(const HeadRowStats& s, const MicroBatch& mb, const Tensor& weights) {
    if (mb.sequences() == 0) {
      be_.zero(weights);
      return;
    }
    const Tensor policy = sums_at(bufs_.policy_at(), mb.sequences());
    sequence_sums(s, mb, policy);
    const Tensor coef = device_.view(DType::kF32, {mb.sequences()}, size_t(bufs_.coef_at()));
    be_.preference_coefficients(loss_, policy, loss_.needs_reference() ? reference(mb) : Tensor(),
                                norm_, coef, metrics());
    be_.gather_segment_weights(coef, segments(mb), weights);
    pairs_ += int64_t(mb.pairs.size());
  }

  // The step's metrics: one copy (the step's one wait here), on the stage with the head.
  void read_metrics(StepSums& sums) {
    if (!holds_head()) return;
    double m[kPreferenceMetrics] = {};
    be_.copy(metrics(), Tensor(m, DType::kF64, {kPreferenceMetrics}, MemPool::kHost));
    SHARDLM_CHECK(int64_t(m[kMetricPairs]) == pairs_,
                  "the preference step's metrics count {} pairs, its micro-batches {}",
                  m[kMetricPairs], pairs_);
    sums.preference = {m[kMetricLoss],       m[kMetricRewardsChosen], m[kMetricRewardsRejected],
                       m[kMetricAccuracies], m[kMetricLogpsChosen],   m[kMetricLogpsRejected]};
    sums.loss_sum = sums.preference.loss;
  }

  Tensor sums_at(int64_t offset, int64_t sequences) const {
    return device_.view(DType::kF64, {sequences, 2}, size_t(offset));
  }
  Tensor segments(const MicroBatch& mb) const {
    return device_.view(DType::kI32, {bufs_.tokens}, size_t(bufs_.segments_at(mb.segments)));
  }
  Tensor reference(const MicroBatch& mb) const {
    return sums_at(bufs_.reference_at(mb.reference), mb.sequences());
  }
  Tensor metrics() const {
    return device_.view(DType::kF64, {kPreferenceMetrics}, size_t(bufs_.metrics_at()));
  }

  StepParts p_;
  Backend& be_;
  PreferenceLoss loss_;
  PipelineExecutor* pipe_;       // pp > 1, else null
  int64_t stage_output_elems_;   // one micro-batch's hidden state between stages
  const ReferenceTable* table_;  // full fine-tuning dpo: the precomputed sums
  PreferenceStepBuffers bufs_;   // the sizes and offsets of device_ and staging_
  Buffer device_;                // the step's device buffers (stage with the head; else none)
  Buffer staging_;               // the pinned upload slots
  std::array<uint64_t, PreferenceStepBuffers::kStagingSlots> slot_fence_{};  // last copies
  int next_slot_ = 0;                               // the slot the next micro-batch writes
  std::vector<int64_t> row_index_;                  // [B*Tl] a local token's row position
  std::vector<std::vector<PairSpans>> pair_lists_;  // reserved, never grown (pair_list)
  double norm_ = 0;                                 // 1 / the step's pairs
  int64_t pairs_ = 0;                               // pairs weighed this step (the metrics' count)
};

}  // namespace

std::unique_ptr<StepRunner> make_preference_runner(const StepParts& parts, MemoryLedger& ledger,
                                                   const PreferenceLoss& loss,
                                                   PipelineExecutor* pipe,
                                                   int64_t stage_output_elems,
                                                   const ReferenceTable* reference) {
  return std::make_unique<PreferenceRunner>(parts, ledger, loss, pipe, stage_output_elems,
                                            reference);
}

}  // namespace shardlm::trainer_detail
