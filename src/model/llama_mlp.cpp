// LlamaModel's MLP block, forward and backward, row chunk by row chunk (mlp_chunk_tokens): in
// every checkpointing mode the chunks run the same ops on the same rows, so gradients are
// bitwise the same. The ffn norm runs per chunk, or, when the rows are split across the tp group
// (sequence parallelism), over this rank's rows at once, which the seam gathers for the chunks;
// Gemma's post-norm on the MLP's output likewise, on the output summed over the tp group.
#include <algorithm>

#include "llama_views.h"

namespace shardlm {

namespace {

// Rows [r0, r0 + n) of an MLP input: kept tensors are [N, ...], recomputed ones one chunk.
Tensor chunk_rows(const Tensor& t, bool whole, int64_t r0, int64_t n) {
  return t.rows(whole ? r0 : 0, n);
}

// Where a chunk's d(xn2) [n, D] goes: rows [r0, r0 + n) of d_norm, or d_xn2 of its own while
// d_norm lives in the attention's output (work_set_aliases), which the MLP's backward must not
// touch yet.
Tensor chunk_d_norm(const Tensor& d_norm, const Tensor& d_xn2, int64_t r0, int64_t n) {
  return d_xn2.empty() ? d_norm.rows(r0, n) : d_xn2.rows(0, n);
}

}  // namespace

// out [n, D] = x_mid + down(silu(gate(xn2)) * up(xn2)), xn2 = norm(x_mid) (residual_pending:
// x_mid += x_in in the same pass as the whole-rows norm, add_rmsnorm_forward). On one rank each
// chunk's down projection sums x_mid's rows as its GEMM's residual; otherwise its partial
// outputs go into the seam's row-output buffer, summed over the group at the end, then x_mid
// added. Post-norms: out = x_mid + norm(down(...)), the norm on the summed output, so never
// with the residual in the GEMM: chunk by chunk (each chunk's sum in mlp_out), or, with the
// rows split, once on this rank's rows after the reduce-scatter (mlp_out [n, D]).
void LlamaModel::mlp_forward(int l, const StepViews& s, bool residual_pending) {
  const auto& o = layout_.layers[l];
  const int u = l + 1;
  const int64_t N = s.B * s.T, D = cfg_.dim, F = cfg_.ffn_dim;
  const LayerActs& a = s.layers[l];
  // The output is the next layer's input, or x_final after the last layer.
  const Tensor out = l + 1 < cfg_.n_layers ? s.layers[l + 1].x_in : s.x_final;  // [n, D]
  const Tensor norm_w = weight(u, o.ffn_norm, {D});
  Tensor xn2_all;  // [N, D] with the norm run whole
  SHARDLM_CHECK(!residual_pending || s.mlp_norm_whole,
                "mlp_forward: the residual add is left only to the whole-rows norm");
  if (s.mlp_norm_whole) {
    if (residual_pending)
      add_norm_forward(a.x_in, a.x_mid, norm_w, a.xn2, a.rstd2);  // x_mid += x_in first
    else
      norm_forward(a.x_mid, norm_w, a.xn2, a.rstd2);
    xn2_all = seam_->column_input(a.xn2, a.x_full);
  }
  // Rows split: each chunk's partial output overwrites its own (consumed) gathered input rows.
  const Tensor y_all = seam_->row_output_buffer(out, a.x_full);  // [N, D]
  const bool residual_in_gemm = seam_->row_output_is_local() && !cfg_.post_norms;
  // Post-norms with the rows whole: each chunk's down projection writes mlp_out, summed there.
  const bool chunk_post_norm = cfg_.post_norms && !s.mlp_norm_whole;
  for (int64_t r0 = 0; r0 < N; r0 += s.mlp_chunk) {
    const int64_t n = std::min(s.mlp_chunk, N - r0);
    const Tensor xn2 =
        s.mlp_norm_whole ? xn2_all.rows(r0, n) : chunk_rows(a.xn2, s.mlp_kept, r0, n);  // [n, D]
    if (!s.mlp_norm_whole)
      norm_forward(a.x_mid.rows(r0, n), norm_w, xn2, chunk_rows(a.rstd2, s.mlp_kept, r0, n));
    const Tensor gate = chunk_rows(a.gate, s.mlp_kept, r0, n);  // [n, F]
    const Tensor up = chunk_rows(a.up, s.mlp_kept, r0, n);      // [n, F]
    const Tensor h = s.tr.ffn_h.rows(0, n);                     // [n, F]
    const Tensor y =
        chunk_post_norm ? chunk_rows(a.mlp_out, s.mlp_kept, r0, n) : y_all.rows(r0, n);  // [n, D]
    be_.linear_forward(xn2, weight(u, o.w_gate, {F, D}), Tensor(), gate);
    be_.linear_forward(xn2, weight(u, o.w_up, {F, D}), Tensor(), up);
    lora_forward(l, LoraTarget::kGate, xn2, gate, r0);
    lora_forward(l, LoraTarget::kUp, xn2, up, r0);
    gated_forward(gate, up, h);
    // x_final in x_mid (work_set_aliases): the chunk's rows summed onto x_mid in place, the
    // same rounding as x_mid taken as the residual.
    if (residual_in_gemm && out.data() == a.x_mid.data())
      be_.linear_forward(h, weight(u, o.w_down, {D, F}), Tensor(), y, OutputMode::kAccumulate);
    else
      be_.linear_forward(h, weight(u, o.w_down, {D, F}), Tensor(), y, OutputMode::kOverwrite,
                         residual_in_gemm ? a.x_mid.rows(r0, n) : Tensor());
    lora_forward(l, LoraTarget::kDown, h, y, r0);
    if (chunk_post_norm) {  // out = x_mid + norm(y summed over the group), row by row
      seam_->row_output(y, y);
      norm_forward(y, weight(u, o.post_ffn_norm, {D}), out.rows(r0, n),
                   chunk_rows(a.rstd_post2, s.mlp_kept, r0, n));
      be_.add(out.rows(r0, n), a.x_mid.rows(r0, n), out.rows(r0, n));
    }
  }
  if (residual_in_gemm || chunk_post_norm) return;
  // Sum the MLP shards' outputs (rows split: keep ours), normed first with post-norms.
  if (cfg_.post_norms) {
    seam_->row_output(y_all, a.mlp_out);
    norm_forward(a.mlp_out, weight(u, o.post_ffn_norm, {D}), out, a.rstd_post2);
  } else {
    seam_->row_output(y_all, out);
  }
  be_.add(out, a.x_mid, out);
}

// d_resid [n, D] holds d(out) and becomes d(x_mid). Chunks run in forward order, so weight
// gradients accumulate in the same order in every mode. The gradient of the down projection's
// partial output is d_resid itself, or (rows split) gathered into d_part; d_norm [N, D] takes
// d(xn2) = d_gate W_gate + d_up W_up (accumulated in place), summed over the tp group per
// chunk, or (rows split) once into this rank's rows in d_part's first n rows.
void LlamaModel::mlp_backward(int l, const StepViews& s) {
  const auto& o = layout_.layers[l];
  const int u = l + 1;
  const int64_t N = s.B * s.T, D = cfg_.dim, F = cfg_.ffn_dim;
  const LayerActs& a = s.layers[l];
  const Transients& t = s.tr;
  const Tensor norm_w = weight(u, o.ffn_norm, {D});
  Tensor xn2_all;  // [N, D] with the norm run whole
  if (s.mlp_norm_whole) {
    if (!s.mlp_kept) norm_forward(a.x_mid, norm_w, a.xn2, a.rstd2);
    xn2_all = seam_->column_input(a.xn2, a.x_full);
  }
  // Post-norms with the rows split: the gradient of this rank's rows of the summed output
  // through their norm first (kept: every rank's chunks make them), in d_post.
  const bool chunk_post_norm = cfg_.post_norms && !s.mlp_norm_whole;
  Tensor d_sum = t.d_resid;  // [n, D]
  if (cfg_.post_norms && s.mlp_norm_whole) {
    d_sum = t.d_post;
    be_.zero(d_sum);
    norm_backward(a.mlp_out, weight(u, o.post_ffn_norm, {D}), a.rstd_post2, t.d_resid, d_sum,
                  norm_grad(u, o.post_ffn_norm, D));
  }
  const Tensor d_y = seam_->row_output_grad(d_sum, t.d_part);  // [N, D]
  for (int64_t r0 = 0; r0 < N; r0 += s.mlp_chunk) {
    const int64_t n = std::min(s.mlp_chunk, N - r0);
    const Tensor d_out = d_y.rows(r0, n),
                 d_norm = chunk_d_norm(t.d_norm, t.d_xn2, r0, n);  // [n, D]
    const Tensor xn2 =
        s.mlp_norm_whole ? xn2_all.rows(r0, n) : chunk_rows(a.xn2, s.mlp_kept, r0, n);  // [n, D]
    // [n]: the per-chunk norm's (the whole norm's are this rank's rows, a.rstd2)
    const Tensor rstd2 = s.mlp_norm_whole ? Tensor() : chunk_rows(a.rstd2, s.mlp_kept, r0, n);
    const Tensor gate = chunk_rows(a.gate, s.mlp_kept, r0, n);  // [n, F]
    const Tensor up = chunk_rows(a.up, s.mlp_kept, r0, n);      // [n, F]
    const Tensor h = t.ffn_h.rows(0, n), d_h = t.d_h.rows(0, n),
                 d_up = t.d_up.rows(0, n);  // [n, F]
    if (!s.mlp_kept) {  // the chunk's MLP inputs, exactly as its forward computed them
      if (!s.mlp_norm_whole) norm_forward(a.x_mid.rows(r0, n), norm_w, xn2, rstd2);
      be_.linear_forward(xn2, weight(u, o.w_gate, {F, D}), Tensor(), gate);
      be_.linear_forward(xn2, weight(u, o.w_up, {F, D}), Tensor(), up);
      lora_forward(l, LoraTarget::kGate, xn2, gate, r0);
      lora_forward(l, LoraTarget::kUp, xn2, up, r0);
    }
    gated_forward(gate, up, h);  // recompute h instead of saving it
    const Tensor d_down = chunk_post_norm ? post_ffn_norm_backward(l, s, r0, n) : d_out;  // [n, D]
    be_.linear_backward(h, weight(u, o.w_down, {D, F}), d_down, d_h, grad(u, o.w_down, {D, F}),
                        Tensor());
    lora_backward(l, LoraTarget::kDown, h, d_down, d_h, r0);
    const Tensor d_gate = h;  // h is dead once d(w_down) is done
    gated_backward(gate, up, d_h, d_gate, d_up);
    be_.linear_backward(xn2, weight(u, o.w_gate, {F, D}), d_gate, d_norm, grad(u, o.w_gate, {F, D}),
                        Tensor());
    lora_backward(l, LoraTarget::kGate, xn2, d_gate, d_norm, r0);
    be_.linear_backward(xn2, weight(u, o.w_up, {F, D}), d_up, d_norm, grad(u, o.w_up, {F, D}),
                        Tensor(), OutputMode::kAccumulate);
    lora_backward(l, LoraTarget::kUp, xn2, d_up, d_norm, r0);
    if (!s.mlp_norm_whole)
      norm_backward(a.x_mid.rows(r0, n), norm_w, rstd2, seam_->column_input_grad(d_norm, Tensor()),
                    t.d_resid.rows(r0, n), norm_grad(u, o.ffn_norm, D));
  }
  if (s.mlp_norm_whole)
    norm_backward(a.x_mid, norm_w, a.rstd2, seam_->column_input_grad(t.d_norm, t.d_part), t.d_resid,
                  norm_grad(u, o.ffn_norm, D));
}

// Post-norms with the rows whole: rows [r0, r0 + n) of d_resid (the gradient of out = x_mid +
// norm(mlp_out)) through the norm into d_post's first n rows, returned. The chunk's mlp_out
// (and the norm's rstd), when not kept, are recomputed from h in ffn_h with the forward's ops
// (the sum over the tp group included); the norm's output is written over d_norm's rows, which
// the gate's backward overwrites later.
Tensor LlamaModel::post_ffn_norm_backward(int l, const StepViews& s, int64_t r0, int64_t n) {
  const auto& o = layout_.layers[l];
  const int u = l + 1;
  const int64_t D = cfg_.dim, F = cfg_.ffn_dim;
  const LayerActs& a = s.layers[l];
  const Tensor y = chunk_rows(a.mlp_out, s.mlp_kept, r0, n);        // [n, D]
  const Tensor rstd = chunk_rows(a.rstd_post2, s.mlp_kept, r0, n);  // [n]
  const Tensor norm_w = weight(u, o.post_ffn_norm, {D});
  if (!s.mlp_kept) {
    const Tensor h = s.tr.ffn_h.rows(0, n);  // [n, F]
    be_.linear_forward(h, weight(u, o.w_down, {D, F}), Tensor(), y);
    lora_forward(l, LoraTarget::kDown, h, y, r0);
    seam_->row_output(y, y);
    norm_forward(y, norm_w, chunk_d_norm(s.tr.d_norm, s.tr.d_xn2, r0, n), rstd);
  }
  const Tensor d_y = s.tr.d_post.rows(0, n);  // [n, D]
  be_.zero(d_y);
  norm_backward(y, norm_w, rstd, s.tr.d_resid.rows(r0, n), d_y, norm_grad(u, o.post_ffn_norm, D));
  return d_y;
}

}  // namespace shardlm
