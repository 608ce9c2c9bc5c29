// LlamaModel's MLP block, forward and backward, row chunk by row chunk (mlp_chunk_tokens): in
// every checkpointing mode the chunks run the same ops on the same rows, so gradients are
// bitwise the same; under sequence parallelism the *_gathered variants run the chunks over the
// rows all-gathered from the tp group and reduce-scatter the result back into this rank's rows.
#include <algorithm>

#include "llama_views.h"

namespace shardlm {

namespace {

// Rows [r0, r0 + n) of an MLP input: kept tensors are [N, ...], recomputed ones one chunk.
Tensor chunk_rows(const Tensor& t, bool whole, int64_t r0, int64_t n) {
  return t.rows(whole ? r0 : 0, n);
}

}  // namespace

void LlamaModel::mlp_forward(int l, const StepViews& s) {
  const auto& o = layout_.layers[l];
  const int u = l + 1;
  const int64_t N = s.B * s.T, D = cfg_.dim, F = cfg_.ffn_dim;
  const LayerActs& a = s.layers[l];
  // The output is the next layer's input, or x_final after the last layer.
  const Tensor out = l + 1 < cfg_.n_layers ? s.layers[l + 1].x_in : s.x_final;  // [n, D]
  if (seq_parallel()) {
    mlp_forward_gathered(l, s, out);
    return;
  }
  for (int64_t r0 = 0; r0 < N; r0 += s.mlp_chunk) {
    const int64_t n = std::min(s.mlp_chunk, N - r0);
    const Tensor x_mid = a.x_mid.rows(r0, n);                     // [n, D]
    const Tensor y = out.rows(r0, n);                             // [n, D]
    const Tensor xn2 = chunk_rows(a.xn2, s.mlp_kept, r0, n);      // [n, D]
    const Tensor rstd2 = chunk_rows(a.rstd2, s.mlp_kept, r0, n);  // [n]
    const Tensor gate = chunk_rows(a.gate, s.mlp_kept, r0, n);    // [n, F]
    const Tensor up = chunk_rows(a.up, s.mlp_kept, r0, n);        // [n, F]
    const Tensor h = s.tr.ffn_h.rows(0, n);                       // [n, F]
    be_.rmsnorm_forward(x_mid, weight(u, o.ffn_norm, {D}), float(cfg_.norm_eps), xn2, rstd2);
    be_.linear_forward(xn2, weight(u, o.w_gate, {F, D}), Tensor(), gate);
    be_.linear_forward(xn2, weight(u, o.w_up, {F, D}), Tensor(), up);
    lora_forward(l, LoraTarget::kGate, xn2, gate, r0);
    lora_forward(l, LoraTarget::kUp, xn2, up, r0);
    be_.swiglu_forward(gate, up, h);
    be_.linear_forward(h, weight(u, o.w_down, {D, F}), Tensor(), y);
    lora_forward(l, LoraTarget::kDown, h, y, r0);
    if (tensor_ != nullptr) tensor_->row_output_forward(y);  // g: sum the MLP shards' outputs
    be_.add(y, x_mid, y);
  }
}

// Sequence parallelism: the norm on this rank's rows, all-gathered into x_full; the chunks run
// over the N gathered rows, each writing its partial down output over its own (consumed) input
// rows of x_full, which is then reduce-scattered into this rank's rows of out once.
void LlamaModel::mlp_forward_gathered(int l, const StepViews& s, const Tensor& out) {
  const auto& o = layout_.layers[l];
  const int u = l + 1;
  const int64_t N = s.B * s.T, D = cfg_.dim, F = cfg_.ffn_dim;
  const LayerActs& a = s.layers[l];
  be_.rmsnorm_forward(a.x_mid, weight(u, o.ffn_norm, {D}), float(cfg_.norm_eps), a.xn2, a.rstd2);
  tensor_->sequence_gather_forward(a.xn2, a.x_full);
  for (int64_t r0 = 0; r0 < N; r0 += s.mlp_chunk) {
    const int64_t n = std::min(s.mlp_chunk, N - r0);
    const Tensor xn2 = a.x_full.rows(r0, n);                    // [n, D] gathered input rows
    const Tensor gate = chunk_rows(a.gate, s.mlp_kept, r0, n);  // [n, F]
    const Tensor up = chunk_rows(a.up, s.mlp_kept, r0, n);      // [n, F]
    const Tensor h = s.tr.ffn_h.rows(0, n);                     // [n, F]
    be_.linear_forward(xn2, weight(u, o.w_gate, {F, D}), Tensor(), gate);
    be_.linear_forward(xn2, weight(u, o.w_up, {F, D}), Tensor(), up);
    be_.swiglu_forward(gate, up, h);
    be_.linear_forward(h, weight(u, o.w_down, {D, F}), Tensor(), xn2);  // partial output rows
  }
  tensor_->sequence_scatter_forward(a.x_full, out);  // sum the MLP shards', keep our rows
  be_.add(out, a.x_mid, out);
}

void LlamaModel::mlp_backward(int l, const StepViews& s) {
  const auto& o = layout_.layers[l];
  const int u = l + 1;
  const int64_t N = s.B * s.T, D = cfg_.dim, F = cfg_.ffn_dim;
  const LayerActs& a = s.layers[l];
  const Transients& t = s.tr;
  if (seq_parallel()) {
    mlp_backward_gathered(l, s);
    return;
  }
  // MLP: out = x_mid + down(silu(gate) * up), row by row; per chunk, d_resid holds d(out) and
  // becomes d(x_mid). Chunks run in forward order, so weight gradients accumulate in the same
  // order in every mode.
  for (int64_t r0 = 0; r0 < N; r0 += s.mlp_chunk) {
    const int64_t n = std::min(s.mlp_chunk, N - r0);
    const Tensor x_mid = a.x_mid.rows(r0, n);                                     // [n, D]
    const Tensor d_resid = t.d_resid.rows(r0, n), d_norm = t.d_norm.rows(r0, n);  // [n, D]
    const Tensor d_part = t.d_part.rows(r0, n);                                   // [n, D]
    const Tensor xn2 = chunk_rows(a.xn2, s.mlp_kept, r0, n);                      // [n, D]
    const Tensor rstd2 = chunk_rows(a.rstd2, s.mlp_kept, r0, n);                  // [n]
    const Tensor gate = chunk_rows(a.gate, s.mlp_kept, r0, n);                    // [n, F]
    const Tensor up = chunk_rows(a.up, s.mlp_kept, r0, n);                        // [n, F]
    const Tensor h = t.ffn_h.rows(0, n), d_h = t.d_h.rows(0, n),
                 d_up = t.d_up.rows(0, n);  // [n, F]
    if (!s.mlp_kept) {  // the chunk's MLP inputs, exactly as its forward computed them
      be_.rmsnorm_forward(x_mid, weight(u, o.ffn_norm, {D}), float(cfg_.norm_eps), xn2, rstd2);
      be_.linear_forward(xn2, weight(u, o.w_gate, {F, D}), Tensor(), gate);
      be_.linear_forward(xn2, weight(u, o.w_up, {F, D}), Tensor(), up);
      lora_forward(l, LoraTarget::kGate, xn2, gate, r0);
      lora_forward(l, LoraTarget::kUp, xn2, up, r0);
    }
    be_.swiglu_forward(gate, up, h);  // recompute h instead of saving it
    be_.linear_backward(h, weight(u, o.w_down, {D, F}), d_resid, d_h, grad(u, o.w_down, {D, F}),
                        Tensor());
    lora_backward(l, LoraTarget::kDown, h, d_resid, d_h, r0);
    const Tensor d_gate = h;  // h is dead once d(w_down) is done
    be_.swiglu_backward(gate, up, d_h, d_gate, d_up);
    be_.linear_backward(xn2, weight(u, o.w_gate, {F, D}), d_gate, d_norm, grad(u, o.w_gate, {F, D}),
                        Tensor());
    lora_backward(l, LoraTarget::kGate, xn2, d_gate, d_norm, r0);
    be_.linear_backward(xn2, weight(u, o.w_up, {F, D}), d_up, d_part, grad(u, o.w_up, {F, D}),
                        Tensor());
    lora_backward(l, LoraTarget::kUp, xn2, d_up, d_part, r0);
    be_.add(d_norm, d_part, d_norm);
    if (tensor_ != nullptr) tensor_->column_input_backward(d_norm);  // f's adjoint
    be_.rmsnorm_backward(x_mid, weight(u, o.ffn_norm, {D}), rstd2, d_norm, d_resid,
                         norm_grad(u, o.ffn_norm, D));
  }
}

// Sequence parallelism: d_resid [n, D] holds d(out) of this rank's rows and becomes d(x_mid).
// d(out) is all-gathered into d_part (the reduce-scatter's adjoint) and the norm output again
// into x_full (the forward wrote partial outputs over it); the chunks run over the N rows as
// forward, into d_norm [N, D], whose reduce-scatter (the all-gather's adjoint) gives this
// rank's rows of d(xn2) in d_part's first n rows.
void LlamaModel::mlp_backward_gathered(int l, const StepViews& s) {
  const auto& o = layout_.layers[l];
  const int u = l + 1;
  const int64_t N = s.B * s.T, D = cfg_.dim, F = cfg_.ffn_dim;
  const LayerActs& a = s.layers[l];
  const Transients& t = s.tr;
  if (!s.mlp_kept)
    be_.rmsnorm_forward(a.x_mid, weight(u, o.ffn_norm, {D}), float(cfg_.norm_eps), a.xn2, a.rstd2);
  tensor_->sequence_gather_forward(a.xn2, a.x_full);
  tensor_->sequence_scatter_backward(t.d_resid, t.d_part);
  for (int64_t r0 = 0; r0 < N; r0 += s.mlp_chunk) {
    const int64_t n = std::min(s.mlp_chunk, N - r0);
    const Tensor xn2 = a.x_full.rows(r0, n);                    // [n, D]
    const Tensor d_out = t.d_part.rows(r0, n);                  // [n, D]; then d(xn2) via up
    const Tensor d_norm = t.d_norm.rows(r0, n);                 // [n, D]
    const Tensor gate = chunk_rows(a.gate, s.mlp_kept, r0, n);  // [n, F]
    const Tensor up = chunk_rows(a.up, s.mlp_kept, r0, n);      // [n, F]
    const Tensor h = t.ffn_h.rows(0, n), d_h = t.d_h.rows(0, n),
                 d_up = t.d_up.rows(0, n);  // [n, F]
    if (!s.mlp_kept) {
      be_.linear_forward(xn2, weight(u, o.w_gate, {F, D}), Tensor(), gate);
      be_.linear_forward(xn2, weight(u, o.w_up, {F, D}), Tensor(), up);
    }
    be_.swiglu_forward(gate, up, h);
    be_.linear_backward(h, weight(u, o.w_down, {D, F}), d_out, d_h, grad(u, o.w_down, {D, F}),
                        Tensor());
    const Tensor d_gate = h;
    be_.swiglu_backward(gate, up, d_h, d_gate, d_up);
    be_.linear_backward(xn2, weight(u, o.w_gate, {F, D}), d_gate, d_norm, grad(u, o.w_gate, {F, D}),
                        Tensor());
    be_.linear_backward(xn2, weight(u, o.w_up, {F, D}), d_up, d_out, grad(u, o.w_up, {F, D}),
                        Tensor());
    be_.add(d_norm, d_out, d_norm);
  }
  const Tensor d_xn2 = t.d_part.rows(0, a.xn2.dim(0));  // [n, D]
  tensor_->sequence_gather_backward(t.d_norm, d_xn2);
  be_.rmsnorm_backward(a.x_mid, weight(u, o.ffn_norm, {D}), a.rstd2, d_xn2, t.d_resid,
                       norm_grad(u, o.ffn_norm, D));
}

}  // namespace shardlm
