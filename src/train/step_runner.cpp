// The step runners (step_runner.h) and the batch filling they share with evaluation.
#include "step_runner.h"

#include <algorithm>
#include <utility>

namespace shardlm::trainer_detail {
namespace {

// (query, key) pairs that causal attention with document masks computes on rows seg_start
// [B * T] (host), averaged over the layers: token t of a row sees the tokens from its
// document's start, or its layer's sliding window's first key if later, to itself.
double attention_pairs(const Tensor& seg_start, int64_t T, const ModelConfig& cfg) {
  const int32_t* seg = seg_start.i32();
  double pairs = 0;
  int64_t last_window = -1;
  double last_pairs = 0;  // layers mostly share a window: count each run of equal ones once
  for (int64_t l = 0; l < cfg.n_layers; ++l) {
    const int64_t window = cfg.window_of_layer(l);
    if (window != last_window) {
      last_pairs = 0;
      for (int64_t i = 0; i < seg_start.numel(); ++i)
        last_pairs += double(i % T - first_visible_key(seg[i], i % T, window) + 1);
      last_window = window;
    }
    pairs += last_pairs;
  }
  return pairs / double(cfg.n_layers);
}

}  // namespace

double fill_batch(LlamaModel& model, ContextParallel* cp, Dataset& data,
                  const std::vector<int64_t>& order, int64_t first, int64_t B, Backend& be,
                  InputStaging& staging, int slot) {
  auto model_inputs = [&](int64_t T) {
    return slot < 0 ? model.inputs(B, T) : model.stage_inputs(slot, B, T);
  };
  if (cp == nullptr) {
    // Written and checked against the vocabulary on the host, then copied to the model's
    // inputs (device memory on a GPU) without the host waiting, with the documents as spans
    // for attention kernels that take variable-length sequences.
    const BatchInputs dev = model_inputs(data.seq_len());
    BatchInputs host = staging.rows(B * data.seq_len());
    data.fill(order, first, B, host);
    data.check_ids(order, first, B, host, model.config().vocab_size);
    const auto [docs, longest] = document_starts(host.seg_start.i32(), host.seg_start.numel(),
                                                 data.seq_len(), host.doc_starts.i32());
    staging.upload(be, dev, docs);
    model.set_documents(docs, longest);
    return attention_pairs(host.seg_start, data.seq_len(), model.config());
  }
  // Under context parallelism the loader writes the full rows; the rank's share of each is cut
  // on the host and goes up from the pinned slots likewise (attention gets no spans: the core
  // sees shards, with seg_start's full-row indices).
  const BatchInputs in = cp->full_inputs(B);
  BatchInputs fill = in;
  data.fill(order, first, B, fill);
  data.check_ids(order, first, B, fill, model.config().vocab_size);
  const BatchInputs dev = model_inputs(cp->local_len());
  const BatchInputs host = staging.rows(B * cp->local_len());
  cp->shard(in, host, dev, B, std::max(slot, 0));
  host.doc_starts.i32()[0] = 0;  // no document list: the one start sent
  staging.upload(be, dev, 0);
  return attention_pairs(in.seg_start, data.seq_len(), model.config());
}

namespace {

class MicroBatchRunner final : public StepRunner {
 public:
  explicit MicroBatchRunner(const StepParts& parts) : p_(parts) {}

  StepSums run(const StepWork& w) override {
    StepSums sums;
    for (int64_t a = 0; a < p_.micro_batches; ++a) {
      sums.pairs += fill_batch(p_.model, p_.cp, p_.data, w.order, w.first_row + a * p_.B, p_.B,
                               p_.backend, p_.staging);
      // LoRA dropout: one mask per step, indexed by the micro-batch's first token in the step.
      p_.model.set_lora_dropout(p_.seed * 0x100000001b3ULL + uint64_t(w.step),
                                (w.rank_row + a * p_.B) * p_.T);
      sums.loss_sum +=
          p_.model.forward_backward(p_.B, p_.Tl, w.targets > 0 ? 1.f / w.targets : 0.f).loss_sum;
    }
    return sums;
  }

 private:
  StepParts p_;
};

// 1F1B over the step's micro-batches; every stage reads every micro-batch (the first for its
// tokens, the last for its targets, all for the attention masks).
class PipelineRunner final : public StepRunner {
 public:
  PipelineRunner(const StepParts& parts, PipelineExecutor& pipe, int64_t stage_output_elems)
      : p_(parts), pipe_(pipe), stage_output_elems_(stage_output_elems) {}

  StepSums run(const StepWork& w) override {
    StepSums sums;
    const float scale = w.targets > 0 ? 1.f / w.targets : 0.f;
    PipelineStageOps ops;
    ops.load = [&](int a, int slot) {
      sums.pairs += fill_batch(p_.model, p_.cp, p_.data, w.order, w.first_row + a * p_.B, p_.B,
                               p_.backend, p_.staging, slot);
    };
    ops.input = [&](int slot) { return p_.model.stage_input(slot, p_.B, p_.Tl); };
    // LoRA dropout: the micro-batch's mask (MicroBatchRunner's), set again before its backward,
    // since other micro-batches' forwards may run in between.
    auto set_dropout = [&](int a) {
      p_.model.set_lora_dropout(p_.seed * 0x100000001b3ULL + uint64_t(w.step),
                                (w.rank_row + a * p_.B) * p_.T);
    };
    ops.forward = [&](int a, int slot, LossResult*) {
      set_dropout(a);
      return p_.model.stage_forward(slot, p_.B, p_.Tl);
    };
    ops.backward = [&](int a, int slot, const Tensor& d_out) {
      set_dropout(a);
      return p_.model.stage_backward(slot, p_.B, p_.Tl, scale, d_out).loss_sum;
    };
    ops.input_grad = [&] { return p_.model.stage_input_grad(p_.B, p_.Tl); };
    sums.pipeline = pipe_.train(ops, int(p_.micro_batches), stage_output_elems_);
    sums.loss_sum = sums.pipeline.loss_sum;
    return sums;
  }

 private:
  StepParts p_;
  PipelineExecutor& pipe_;
  int64_t stage_output_elems_;
};

}  // namespace

std::unique_ptr<StepRunner> make_step_runner(const StepParts& parts, PipelineExecutor* pipe,
                                             int64_t stage_output_elems) {
  if (pipe != nullptr) return std::make_unique<PipelineRunner>(parts, *pipe, stage_output_elems);
  return std::make_unique<MicroBatchRunner>(parts);
}

}  // namespace shardlm::trainer_detail
