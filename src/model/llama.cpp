// Llama decoder forward and backward, layer by layer, with explicit saved activations.
// Each layer keeps what the checkpointing mode says (model/layout) and backward recomputes the
// rest into one work set shared by every layer; the MLP runs in row chunks in every mode, so
// every mode runs the same ops on the same rows and gives bitwise the same gradients.
// Tensor parallelism enters only through the TensorSeam, which hands back the view each
// column-parallel region reads and each row-parallel region writes: under sequence parallelism
// the residual stream and the norms hold this tp rank's block of rows and those views are the
// gathered rows in x_full. Every buffer is allocated once in the constructor from the layout's
// size tables; a step only takes views (llama_views.cpp), so the steady-state step allocates
// nothing. The MLP block is in llama_mlp.cpp, the LoRA adapters in llama_lora.cpp, a pipeline
// stage's entry points in llama_stage.cpp, the parameter units' acquisition and views in
// llama_units.cpp, the constructor, its buffers and the parameter access in llama_setup.cpp.
#include "shardlm/model/llama.h"

#include "llama_views.h"

namespace shardlm {

DocumentSpans LlamaModel::documents(const StepViews& s) {
  if (s.doc_count == 0) return {};
  return {s.in.doc_starts.view({s.B * s.T + 1}), s.doc_count, s.doc_max_len};
}

BatchInputs LlamaModel::inputs(int64_t B, int64_t T) {
  const BatchInputs in = bind(B, T).in;
  views_[slot_]->doc_count = 0;  // a new fill: spans only when set_documents says so
  return in;
}

void LlamaModel::set_documents(int64_t count, int64_t max_len) {
  StepViews& s = *views_[slot_];
  SHARDLM_CHECK(s.B > 0 && count >= 1 && count <= s.B * s.T && max_len >= 1 && max_len <= s.T,
                "set_documents: {} documents of at most {} tokens do not fit the bound micro-batch "
                "{}x{}",
                count, max_len, s.B, s.T);
  s.doc_count = count;
  s.doc_max_len = max_len;
}

// x_final -> xn_final: the norm of this rank's rows, written in their place in xn_final, which
// the LM head (a column-parallel region) reads whole: with the rows split, gathered in place.
void LlamaModel::final_norm_forward(const StepViews& s) {
  const Tensor mine = seam_->local_rows(s.xn_final);
  norm_forward(s.x_final, final_norm_weight(s), mine, s.rstd_final);
  seam_->column_input(mine, s.xn_final);
}

void LlamaModel::attention_block_forward(int l, const StepViews& s, bool run_attention,
                                         bool add_residual) {
  const auto& o = layout_.layers[l];
  const int u = l + 1;  // the layer's unit; the caller has acquired it
  const int64_t N = s.B * s.T, D = cfg_.dim, qd = cfg_.q_dim(), kvd = cfg_.kv_dim();
  const int64_t Hq = cfg_.n_heads, Hkv = cfg_.n_kv_heads, Dh = cfg_.head_dim();
  const LayerActs& a = s.layers[l];
  const Tensor inv_freq = layer_inv_freq(l);
  auto bias = [&](int64_t off, int64_t n) { return off < 0 ? Tensor() : weight(u, off, {n}); };

  norm_forward(a.x_in, weight(u, o.attn_norm, {D}), a.xn1, a.rstd1);
  const Tensor xn = seam_->column_input(a.xn1, a.x_full);  // [N, D]
  // With q/k norms the projections (and their adapters) write q_raw and k_raw, normed per head
  // into q and k.
  const Tensor q_proj = (cfg_.qk_norm ? a.q_raw : a.q).view({N, qd});   // [N, qd]
  const Tensor k_proj = (cfg_.qk_norm ? a.k_raw : a.k).view({N, kvd});  // [N, kvd]
  be_.linear_forward(xn, weight(u, o.wq, {qd, D}), bias(o.bq, qd), q_proj);
  be_.linear_forward(xn, weight(u, o.wk, {kvd, D}), bias(o.bk, kvd), k_proj);
  be_.linear_forward(xn, weight(u, o.wv, {kvd, D}), bias(o.bv, kvd), a.v.view({N, kvd}));
  lora_forward(l, LoraTarget::kQ, xn, q_proj, 0);
  lora_forward(l, LoraTarget::kK, xn, k_proj, 0);
  lora_forward(l, LoraTarget::kV, xn, a.v.view({N, kvd}), 0);
  if (cfg_.qk_norm) {  // rows of one head: [N*Hq, Dh], [N*Hkv, Dh]
    norm_forward(a.q_raw.view({N * Hq, Dh}), weight(u, o.q_norm, {Dh}), a.q.view({N * Hq, Dh}),
                 a.rstd_q);
    norm_forward(a.k_raw.view({N * Hkv, Dh}), weight(u, o.k_norm, {Dh}), a.k.view({N * Hkv, Dh}),
                 a.rstd_k);
  }
  be_.rope_qk_forward(a.q.view({N, Hq, Dh}), a.k.view({N, Hkv, Dh}), s.in.positions, inv_freq,
                      rope_pairs());
  // query_pre_attn_scalar: q scaled so that the kernels' 1/sqrt(Dh) gives its scale
  if (cfg_.query_prescale() != 1.0) be_.scale(a.q, float(cfg_.query_prescale()));
  if (run_attention)
    attention_->forward(l, a.q, a.k, a.v, s.in.seg_start.view({s.B, s.T}), documents(s), a.attn,
                        a.lse);
  // x_mid = x_in + attn Wo^T. On one rank x_in is the GEMM's residual (its C, beta 1) and
  // LoRA's update is added after it. Otherwise the heads' partial outputs are summed first
  // (rows split: in x_full, whose gathered input is dead by now), then x_in added. Post-norms:
  // x_mid = x_in + norm(attn Wo^T), the norm on this rank's rows of the sum (attn_out), so the
  // residual is never the GEMM's.
  const Tensor attn = a.attn.view({N, qd}), wo = weight(u, o.wo, {D, qd});  // [N, qd], [D, qd]
  if (!residual_add_separate()) {
    be_.linear_forward(attn, wo, Tensor(), a.x_mid, OutputMode::kOverwrite, a.x_in);
    lora_forward(l, LoraTarget::kO, attn, a.x_mid, 0);
    return;
  }
  const Tensor sum = cfg_.post_norms ? a.attn_out : a.x_mid;  // [n, D]
  const Tensor y = seam_->row_output_buffer(sum, a.x_full);   // [N, D]
  be_.linear_forward(attn, wo, Tensor(), y);
  lora_forward(l, LoraTarget::kO, attn, y, 0);
  seam_->row_output(y, sum);
  if (cfg_.post_norms)
    norm_forward(a.attn_out, weight(u, o.post_attn_norm, {D}), a.x_mid, a.rstd_post1);
  if (add_residual) be_.add(a.x_mid, a.x_in, a.x_mid);
}

bool LlamaModel::residual_add_separate() const {
  return !seam_->row_output_is_local() || cfg_.post_norms;
}

void LlamaModel::layer_forward(int l, const StepViews& s) {
  // Where the residual add is a pass of its own and the ffn norm runs on the whole rows right
  // after it (rows split: sequence parallelism), the two are one pass over x_mid, with the same
  // bits. The per-chunk norms (rows whole) keep the add apart. Backward and its recomputation
  // are unchanged: the add's gradient is the identity, and recomputing adds apart.
  const bool fuse = s.mlp_norm_whole && residual_add_separate();
  attention_block_forward(l, s, /*run_attention=*/true, /*add_residual=*/!fuse);
  mlp_forward(l, s, /*residual_pending=*/fuse);
}

void LlamaModel::forward_layers(int64_t B, int64_t T, bool for_backward) {
  const StepViews& s = bind(B, T);
  // The first layer's input slot may still be in a copy.
  if (cfg_.stage_end() > cfg_.pp_begin) be_.wait_fence(slot_fence(checkpoint_slot(cfg_.pp_begin)));
  // A later pipeline stage's input was received into x_in.
  if (cfg_.holds_embeddings()) embedding_forward(s);
  for (int l = int(cfg_.pp_begin); l < cfg_.stage_end(); ++l) forward_layer(l, s, for_backward);
  if (!for_backward || !opt_.backward || checkpoint_map_.every() == 1) return;
  // The inputs of layers between kept ones that happen to survive in their slots are dropped
  // all the same: backward recomputes every one of them, so the forwards it runs (and their
  // collectives: ZeRO-3 gathers, context-parallel exchanges) do not depend on how many
  // rotating slots this rank's placement has.
  for (int l = int(cfg_.pp_begin); l < cfg_.stage_end(); ++l)
    if (!checkpoint_map_.kept(l) && slot_layer(checkpoint_slot(l)) == l)
      slot_layer(checkpoint_slot(l)) = -1;
}

// Layer l's forward from its input (in its slot) to the next layer's (in that one's slot).
void LlamaModel::forward_layer(int l, const StepViews& s, bool for_backward) {
  acquire(l + 1);
  // The slot the output goes to may still be on its way to the host (a layer before's
  // offload); layer l's own slot was waited for when the layer before wrote it.
  if (l + 1 < cfg_.stage_end()) be_.wait_fence(slot_fence(checkpoint_slot(l + 1)));
  acquire_adapters(l, false);
  slot_layer(checkpoint_slot(l)) = l;
  layer_forward(l, s);
  release_adapters(l, false);
  release(l + 1);
  if (l + 1 < cfg_.stage_end()) slot_layer(checkpoint_slot(l + 1)) = l + 1;
  // Layer l's kept tensors are complete (its x_in was written by the layer before). On the
  // CPU backend this copy is a synchronous memcpy; the CUDA backend overlaps it with the next
  // layers' forward on its copy stream.
  if (for_backward && opt_.backward && checkpoint_map_.on_host(l)) {
    const int slot = checkpoint_slot(l);
    slot_fence(slot) =
        be_.copy_async(s.slot_kept[slot], s.host_kept[checkpoint_map_.host_index(l)]);
  }
}

void LlamaModel::restore_checkpoints(int l, const StepViews& s) {
  const int slot = checkpoint_slot(l);
  if (slot_layer(slot) != l) {
    // The nearest layer of l's segment whose input is still in its slot, else the segment's
    // start from the host (a start on the device never leaves its slot); then the layers
    // from there up to l run forward again, each writing the next one's input.
    const int start = checkpoint_map_.segment_start(l);
    int from = l;
    while (from > start && slot_layer(checkpoint_slot(from)) != from) --from;
    if (slot_layer(checkpoint_slot(from)) != from)
      fetch_checkpoints(from, s, /*wait=*/true);
    else
      be_.wait_fence(slot_fence(checkpoint_slot(from)));  // fetched a layer ahead
    store_->begin_recompute();  // an ascending walk inside the backward one
    for (int j = from; j < l; ++j) forward_layer(j, s, /*for_backward=*/false);
    store_->end_recompute();
  }
  be_.wait_fence(slot_fence(slot));  // a prefetch may still be on its way
}

void LlamaModel::fetch_checkpoints(int l, const StepViews& s, bool wait) {
  SHARDLM_CHECK(checkpoint_map_.on_host(l), "layer {}'s checkpoints are not on the host", l);
  // Synchronous memcpy on the CPU backend. On CUDA the copy stream runs it after the compute
  // work issued so far (which may still read the slot) and after the slot's own offload (one
  // copy stream, in order); the compute stream waits for it when the layer needs it.
  const int slot = checkpoint_slot(l);
  slot_fence(slot) = be_.copy_async(s.host_kept[checkpoint_map_.host_index(l)], s.slot_kept[slot]);
  slot_layer(slot) = l;
  if (wait) be_.wait_fence(slot_fence(slot));
}

// At the backward of a segment's start l: the next segment's start, if it waits on the host,
// fetched into its slot while layer l runs (unless that slot is l's own).
void LlamaModel::prefetch_checkpoints(int l, const StepViews& s) {
  const int next = l - checkpoint_map_.every();
  if (checkpoint_map_.segment_start(l) != l || next < cfg_.pp_begin) return;
  if (!checkpoint_map_.on_host(next) || slot_layer(checkpoint_slot(next)) == next) return;
  if (checkpoint_slot(next) == checkpoint_slot(l)) return;
  fetch_checkpoints(next, s, /*wait=*/false);
}

void LlamaModel::layer_backward(int l, const StepViews& s) {
  const auto& o = layout_.layers[l];
  const int u = l + 1;  // the caller has acquired the unit's parameters and gradients
  const int64_t N = s.B * s.T, D = cfg_.dim, qd = cfg_.q_dim(), kvd = cfg_.kv_dim();
  const int64_t Hq = cfg_.n_heads, Hkv = cfg_.n_kv_heads, Dh = cfg_.head_dim();
  const LayerActs& a = s.layers[l];
  const Transients& t = s.tr;
  const Tensor inv_freq = layer_inv_freq(l);
  auto bgrad = [&](int64_t off, int64_t n) { return off < 0 ? Tensor() : grad(u, off, {n}); };

  // Recompute what the layer did not keep into the work set, with the same ops on the same
  // rows as its forward (so the values are bitwise those of the forward).
  if (opt_.checkpointing != Checkpointing::kNone)
    attention_block_forward(l, s, /*run_attention=*/opt_.checkpointing == Checkpointing::kFull);
  mlp_backward(l, s);

  // Attention: x_mid = x_in + o_proj(attn(rope(q), rope(k), v)); d_resid becomes d(x_in).
  // d(xn1) = dq Wq + dk Wk + dv Wv (and the adapters' shares) accumulates in d_norm. Rows
  // split: d(x_mid) gathered into d_part and the norm output again into x_full; the input
  // gradient's sum gives this rank's rows of d(xn1) in d_part's first n rows.
  // Post-norms: first through the output's norm on this rank's rows, d(attn_out) into d_post.
  Tensor d_sum = t.d_resid;  // [n, D] the gradient of this rank's rows of the summed output
  if (cfg_.post_norms) {
    d_sum = t.d_post;
    be_.zero(d_sum);
    norm_backward(a.attn_out, weight(u, o.post_attn_norm, {D}), a.rstd_post1, t.d_resid, d_sum,
                  norm_grad(u, o.post_attn_norm, D));
  }
  const Tensor d_out = seam_->row_output_grad(d_sum, t.d_part);  // [N, D]
  const Tensor xn = seam_->column_input(a.xn1, a.x_full);        // [N, D]
  be_.linear_backward(a.attn.view({N, qd}), weight(u, o.wo, {D, qd}), d_out, t.d_attn.view({N, qd}),
                      grad(u, o.wo, {D, qd}), Tensor());
  lora_backward(l, LoraTarget::kO, a.attn.view({N, qd}), d_out, t.d_attn.view({N, qd}), 0);
  attention_->backward(l, a.q, a.k, a.v, s.in.seg_start.view({s.B, s.T}), documents(s), a.attn,
                       a.lse, t.d_attn, t.d_q, t.d_k, t.d_v);
  if (cfg_.query_prescale() != 1.0) be_.scale(t.d_q, float(cfg_.query_prescale()));
  be_.rope_qk_backward(t.d_q.view({N, Hq, Dh}), t.d_k.view({N, Hkv, Dh}), s.in.positions, inv_freq,
                       rope_pairs());
  Tensor dq = t.d_q.view({N, qd}), dk = t.d_k.view({N, kvd});  // of the projections' outputs
  if (cfg_.qk_norm) {
    // Through the per-head norms (whose input gradients accumulate, so into zeroed buffers):
    // d(q_raw) into d_attn, dead since the attention's backward; d(k_raw) into the front of
    // d_q, dead once q's norm has read it (kvd <= qd).
    const Tensor dq_raw = t.d_attn.view({N * Hq, Dh}),
                 dk_raw = t.d_q.view({N * qd}).rows(0, N * kvd);
    be_.zero(dq_raw);
    norm_backward(a.q_raw.view({N * Hq, Dh}), weight(u, o.q_norm, {Dh}), a.rstd_q,
                  t.d_q.view({N * Hq, Dh}), dq_raw, norm_grad(u, o.q_norm, Dh));
    be_.zero(dk_raw);
    norm_backward(a.k_raw.view({N * Hkv, Dh}), weight(u, o.k_norm, {Dh}), a.rstd_k,
                  t.d_k.view({N * Hkv, Dh}), dk_raw.view({N * Hkv, Dh}),
                  norm_grad(u, o.k_norm, Dh));
    dq = dq_raw.view({N, qd});
    dk = dk_raw.view({N, kvd});
  }
  constexpr OutputMode kAdd = OutputMode::kAccumulate;
  be_.linear_backward(xn, weight(u, o.wq, {qd, D}), dq, t.d_norm, grad(u, o.wq, {qd, D}),
                      bgrad(o.bq, qd));
  lora_backward(l, LoraTarget::kQ, xn, dq, t.d_norm, 0);
  be_.linear_backward(xn, weight(u, o.wk, {kvd, D}), dk, t.d_norm, grad(u, o.wk, {kvd, D}),
                      bgrad(o.bk, kvd), kAdd);
  lora_backward(l, LoraTarget::kK, xn, dk, t.d_norm, 0);
  be_.linear_backward(xn, weight(u, o.wv, {kvd, D}), t.d_v.view({N, kvd}), t.d_norm,
                      grad(u, o.wv, {kvd, D}), bgrad(o.bv, kvd), kAdd);
  lora_backward(l, LoraTarget::kV, xn, t.d_v.view({N, kvd}), t.d_norm, 0);
  const Tensor d_xn1 = seam_->column_input_grad(t.d_norm, t.d_part);  // [n, D]
  norm_backward(a.x_in, weight(u, o.attn_norm, {D}), a.rstd1, d_xn1, t.d_resid,
                norm_grad(u, o.attn_norm, D));
}

const LlamaModel::StepViews& LlamaModel::forward_for_backward(int64_t B, int64_t T) {
  SHARDLM_CHECK(opt_.backward, "this model runs forward only (ModelOptions::backward = false)");
  dropout_active_ = lora() && opt_.lora.dropout > 0;
  begin_pass(ParamStore::Pass::kForward);
  forward_layers(B, T, /*for_backward=*/true);
  const StepViews& s = bind(B, T);
  final_norm_unit_forward(s);
  end_pass();
  return s;
}

LossResult LlamaModel::forward_backward(int64_t B, int64_t T, float grad_scale) {
  const StepViews& s = forward_for_backward(B, T);
  begin_pass(ParamStore::Pass::kBackward);
  const LossResult loss = head_loss_backward(s, grad_scale);
  layers_backward(s, /*embed_held=*/whole_tied_head());
  end_pass();
  dropout_active_ = false;
  return loss;
}

void LlamaModel::layers_backward(const StepViews& s, bool embed_held) {
  for (int l = cfg_.n_layers - 1; l >= 0; --l) {
    // First, as recomputing a layer's input acquires (and stages) the layers before it.
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
  // A frozen base's embeddings take no gradient; a whole tied head's are held since the loss.
  if (!lora()) embedding_backward(s, embed_held);
}

void LlamaModel::forward_layers_only(int64_t B, int64_t T) {
  begin_pass(ParamStore::Pass::kForward);
  forward_layers(B, T, /*for_backward=*/false);
  end_pass();
}

}  // namespace shardlm
