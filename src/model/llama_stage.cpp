// LlamaModel as one pipeline stage: the forward and backward of a micro-batch held in a slot,
// over the stage's decoder layers (ModelConfig::pp_begin .. stage_end()), starting from the
// embeddings on the first stage or from a received hidden state, ending in the final norm, LM
// head and loss on the last stage or in the hidden state to send. The ops and their order are
// those of forward_backward / forward_loss (llama.cpp), so a micro-batch gives bitwise the
// same values split over stages as on one rank.
#include <algorithm>

#include "llama_views.h"

namespace shardlm {

namespace {

void check_slot(int slot, const ModelOptions& opt) {
  SHARDLM_CHECK(slot >= 0 && slot < opt.pipeline_slots, "pipeline slot {} out of [0, {})", slot,
                opt.pipeline_slots);
}

}  // namespace

BatchInputs LlamaModel::stage_inputs(int slot, int64_t B, int64_t T) {
  check_slot(slot, opt_);
  slot_ = slot;
  const BatchInputs in = bind(B, T).in;
  views_[slot_]->doc_count = 0;  // a new fill (LlamaModel::inputs)
  return in;
}

Tensor LlamaModel::stage_input(int slot, int64_t B, int64_t T) {
  check_slot(slot, opt_);
  SHARDLM_CHECK(!cfg_.holds_embeddings(), "the first pipeline stage has no received input");
  slot_ = slot;
  return bind(B, T).layers[cfg_.pp_begin].x_in;
}

Tensor LlamaModel::stage_input_grad(int64_t B, int64_t T) {
  return bind(B, T).tr.d_resid;  // the transients are shared by every slot
}

Tensor LlamaModel::stage_forward(int slot, int64_t B, int64_t T, LossResult* eval_loss) {
  check_slot(slot, opt_);
  slot_ = slot;
  // LoRA dropout as in forward_backward (training only); the caller has set the micro-batch's
  // mask (set_lora_dropout) before this forward and again before its backward.
  dropout_active_ = eval_loss == nullptr && lora() && opt_.lora.dropout > 0;
  begin_pass(ParamStore::Pass::kForward);
  forward_layers(B, T, /*for_backward=*/eval_loss == nullptr);
  const StepViews& s = bind(B, T);
  Tensor out = s.x_final;
  if (cfg_.holds_head()) {
    out = Tensor();
    final_norm_unit_forward(s);
    if (eval_loss != nullptr) *eval_loss = head_loss_forward(s);  // forward_loss's head
  }
  end_pass();
  dropout_active_ = false;
  return out;
}

Tensor LlamaModel::stage_forward_row_stats(int slot, int64_t B, int64_t T, bool base_only,
                                           const RowStatsSink& sink) {
  check_slot(slot, opt_);
  slot_ = slot;
  return row_stats_forward(B, T, base_only, sink);
}

Tensor LlamaModel::stage_forward_target_logps(int slot, int64_t B, int64_t T, bool base_only,
                                              std::span<double> logps) {
  return stage_forward_row_stats(
      slot, B, T, base_only, [&](const HeadRowStats&) { read_target_logps(bind(B, T), logps); });
}

LossResult LlamaModel::stage_backward(int slot, int64_t B, int64_t T, float grad_scale,
                                      const Tensor& d_out) {
  const StepViews& s = stage_backward_begin(slot, B, T, d_out);
  LossResult loss{};
  // forward_backward's head: the fused LM head + loss, final norm (a whole tied matrix's
  // gradients stay held until the embedding backward, or are released at the end)
  if (cfg_.holds_head()) loss = head_loss_backward(s, grad_scale);
  stage_layers_backward(s, /*tied_held=*/cfg_.holds_head() && whole_tied_head());
  return loss;
}

void LlamaModel::stage_backward_weighted(int slot, int64_t B, int64_t T, const TokenWeigher& weigh,
                                         const Tensor& d_out) {
  const StepViews& s = stage_backward_begin(slot, B, T, d_out);
  if (cfg_.holds_head()) weighted_head(s, weigh);  // forward_backward_weighted's head
  stage_layers_backward(s, /*tied_held=*/cfg_.holds_head() && whole_tied_head());
}

const LlamaModel::StepViews& LlamaModel::stage_backward_begin(int slot, int64_t B, int64_t T,
                                                              const Tensor& d_out) {
  check_slot(slot, opt_);
  SHARDLM_CHECK(opt_.backward, "this model runs forward only (ModelOptions::backward = false)");
  slot_ = slot;
  const StepViews& s = bind(B, T);
  dropout_active_ = lora() && opt_.lora.dropout > 0;
  begin_pass(ParamStore::Pass::kBackward);
  if (!cfg_.holds_head()) {
    // The stage's output rows (this tp rank's block under sequence parallelism).
    SHARDLM_CHECK(d_out.numel() == s.tr.d_resid.numel(),
                  "stage_backward: the received gradient has {} elements, the stage's output {}",
                  d_out.numel(), s.tr.d_resid.numel());
    be_.copy(d_out, s.tr.d_resid);
  }
  return s;
}

void LlamaModel::stage_layers_backward(const StepViews& s, bool tied_held) {
  for (int l = int(cfg_.stage_end()) - 1; l >= cfg_.pp_begin; --l) {
    // forward_backward's layer loop: the slot's checkpoints first (recomputing acquires the
    // layers before l), then the layer's units, adapters and the next segment's prefetch.
    restore_checkpoints(l, s);
    acquire(l + 1);
    acquire_grads(l + 1);
    acquire_adapters(l, true);
    prefetch_checkpoints(l, s);
    layer_backward(l, s);
    release_adapters(l, true);
    release_grads(l + 1);
    release(l + 1);
  }
  // A frozen base's embeddings take no gradient (LoRA).
  if (cfg_.holds_embeddings() && !lora())
    embedding_backward(s, tied_held);
  else if (tied_held)
    release_grads(0);  // the last stage's copy of the tied matrix: its LM head gradients
  end_pass();
  dropout_active_ = false;
}

}  // namespace shardlm
