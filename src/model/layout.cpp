// Parameter and activation size tables of the Llama decoder (see layout.h).
#include "shardlm/model/layout.h"

#include <algorithm>

#include "shardlm/core/buffer.h"
#include "shardlm/core/check.h"

namespace shardlm {

ParamLayout make_param_layout(const ModelConfig& c) {
  ParamLayout L;
  const int64_t D = c.dim, V = c.vocab_rows(), F = c.ffn_dim, qd = c.q_dim(), kvd = c.kv_dim();
  const int64_t Dh = c.head_dim();
  int64_t off = 0;
  auto add = [&](std::string name, Shape shape, int layer, bool decay) {
    const int64_t at = off;
    L.entries.push_back({std::move(name), shape, at, layer, decay});
    off += shape.numel();
    return at;
  };
  // A pipeline stage (ModelConfig::pp_begin, pp_end) holds only its own tensors; the units
  // it does not hold stay in the table, empty, so that unit u is the same part of the model
  // in every stage's layout and in the whole model's.
  const bool embed = c.holds_embedding_matrix(), head = c.holds_head();
  L.embed = embed ? add("model.embed_tokens.weight", {V, D}, -1, false) : off;
  L.units.push_back({L.embed, off});
  for (int l = 0; l < c.n_layers; ++l) {
    LayerParamOffsets o{};
    o.begin = off;
    o.bq = o.bk = o.bv = -1;
    o.q_norm = o.k_norm = -1;
    o.post_attn_norm = o.post_ffn_norm = -1;
    if (!c.holds_layer(l)) {  // another stage's layer: an empty unit
      o.attn_norm = o.wq = o.wk = o.wv = o.wo = o.ffn_norm = o.w_gate = o.w_up = o.w_down = off;
      o.end = off;
      L.layers.push_back(o);
      L.units.push_back({o.begin, o.end});
      continue;
    }
    const std::string p = "model.layers." + std::to_string(l) + ".";
    o.attn_norm = add(p + "input_layernorm.weight", {D}, l, false);
    o.wq = add(p + "self_attn.q_proj.weight", {qd, D}, l, true);
    o.wk = add(p + "self_attn.k_proj.weight", {kvd, D}, l, true);
    o.wv = add(p + "self_attn.v_proj.weight", {kvd, D}, l, true);
    if (c.attn_bias) {
      o.bq = add(p + "self_attn.q_proj.bias", {qd}, l, false);
      o.bk = add(p + "self_attn.k_proj.bias", {kvd}, l, false);
      o.bv = add(p + "self_attn.v_proj.bias", {kvd}, l, false);
    }
    if (c.qk_norm) {
      o.q_norm = add(p + "self_attn.q_norm.weight", {Dh}, l, false);
      o.k_norm = add(p + "self_attn.k_norm.weight", {Dh}, l, false);
    }
    o.wo = add(p + "self_attn.o_proj.weight", {D, qd}, l, true);
    // With Gemma's post-norms post_attention_layernorm norms the attention's output, and the
    // MLP's input norm is pre_feedforward_layernorm; Llama's post_attention_layernorm is the
    // MLP's input norm, and so is GLM-4's, whose post-norms have names of their own.
    const bool gemma_names = c.post_norms && c.post_norm_names == "gemma";
    if (c.post_norms)
      o.post_attn_norm = add(
          p + (gemma_names ? "post_attention_layernorm.weight" : "post_self_attn_layernorm.weight"),
          {D}, l, false);
    o.ffn_norm = add(
        p + (gemma_names ? "pre_feedforward_layernorm.weight" : "post_attention_layernorm.weight"),
        {D}, l, false);
    // gate then up, adjacent: GLM's fused gate_up_proj [2F, D] is the two as they lie
    o.w_gate = add(p + "mlp.gate_proj.weight", {F, D}, l, true);
    o.w_up = add(p + "mlp.up_proj.weight", {F, D}, l, true);
    o.w_down = add(p + "mlp.down_proj.weight", {D, F}, l, true);
    if (c.post_norms)
      o.post_ffn_norm =
          add(p + (gemma_names ? "post_feedforward_layernorm.weight" : "post_mlp_layernorm.weight"),
              {D}, l, false);
    o.end = off;
    L.max_layer = std::max(L.max_layer, o.end - o.begin);
    L.layers.push_back(o);
    L.units.push_back({o.begin, o.end});
  }
  const int64_t head_begin = off;
  L.final_norm = head ? add("model.norm.weight", {D}, -1, false) : off;
  L.lm_head = c.tie_embeddings ? L.embed : head ? add("lm_head.weight", {V, D}, -1, true) : off;
  L.total = off;
  L.units.push_back({head_begin, L.total});
  L.head_unit = int(L.units.size()) - 1;
  // Tied: the LM head is unit 0 where the stage holds the matrix (a middle stage holds
  // neither, and its empty head unit stands in).
  L.lm_head_unit = c.tie_embeddings && embed ? 0 : L.head_unit;
  for (int u = 0; u < int(L.units.size()); ++u) L.max_unit = std::max(L.max_unit, L.unit_size(u));
  L.vocab_rows = V;
  L.dim = D;
  return L;
}

bool unit_has_table(const ParamLayout& L, int u) {
  if (L.adapters || L.unit_size(u) == 0 || L.vocab_rows * L.dim == 0) return false;
  const ParamLayout::Unit& unit = L.units[u];
  if (u == 0) return unit.end - unit.begin == L.vocab_rows * L.dim;  // tied: also the head
  return u == L.head_unit && L.lm_head_unit == L.head_unit && L.lm_head > unit.begin &&
         unit.end - L.lm_head == L.vocab_rows * L.dim;
}

int64_t table_piece_rows(const ParamLayout& L, int u, int64_t most) {
  if (!unit_has_table(L, u) || L.unit_size(u) <= most) return 0;
  // The head's first piece also holds the final norm [D]: a row less keeps it within `most`.
  return std::max<int64_t>(1, most / L.dim - 1);
}

int64_t largest_piece(const ParamLayout& L, int64_t most) {
  int64_t largest = 0;
  for (int u = 0; u < int(L.units.size()); ++u)
    for (const UnitPiece& p : unit_pieces(L, u, table_piece_rows(L, u, most)))
      largest = std::max(largest, p.end - p.begin);
  return largest;
}

std::vector<UnitPiece> unit_pieces(const ParamLayout& L, int u, int64_t piece_rows) {
  const ParamLayout::Unit& unit = L.units[u];
  if (!unit_has_table(L, u)) return {{unit.begin, unit.end, 0, 0}};
  const int64_t table = u == 0 ? L.embed : L.lm_head, V = L.vocab_rows, D = L.dim;
  SHARDLM_CHECK(piece_rows >= 0, "unit_pieces: piece_rows {} < 0", piece_rows);
  const int64_t rows = piece_rows == 0 ? V : std::min(piece_rows, V);
  std::vector<UnitPiece> pieces;
  for (int64_t r = 0; r < V; r += rows) {
    const int64_t n = std::min(rows, V - r);
    UnitPiece p;
    p.begin = r == 0 ? unit.begin : table + r * D;  // the final norm with the first rows
    p.end = table + (r + n) * D;
    p.row_begin = r;
    p.rows = n;
    pieces.push_back(p);
  }
  SHARDLM_CHECK_KIND(ErrorKind::kInternal, pieces.back().end == unit.end,
                     "unit_pieces: unit {} has elements after its table", u);
  return pieces;
}

std::string ParamLayout::unit_name(int u) const {
  if (adapters) return "LoRA adapters of layer " + std::to_string(u);
  if (u == 0) return "embeddings";
  if (u == head_unit) return lm_head_unit == head_unit ? "final norm and head" : "final norm";
  return "layer " + std::to_string(u - 1);
}

std::string checkpointing_name(Checkpointing mode) {
  switch (mode) {
    case Checkpointing::kNone:
      return "none";
    case Checkpointing::kSelective:
      return "selective";
    case Checkpointing::kFull:
      return "full";
  }
  return "?";
}

Checkpointing checkpointing_from_name(const std::string& name) {
  for (Checkpointing m : {Checkpointing::kNone, Checkpointing::kSelective, Checkpointing::kFull})
    if (checkpointing_name(m) == name) return m;
  SHARDLM_FAIL(ErrorKind::kConfig,
               "memory.checkpointing must be \"none\", \"selective\" or \"full\", got \"{}\"",
               name);
}

namespace {

// Rows of the residual stream one rank holds: N, or N / tp under sequence parallelism.
int64_t local_rows(const ModelConfig& c, int64_t N) {
  const int64_t S = c.seq_shards();
  SHARDLM_CHECK(N % S == 0,
                "sequence parallelism splits a micro-batch's {} rows into {} tp blocks, which "
                "does not divide; make train.micro_batch x data.seq_len / parallel.cp a multiple "
                "of parallel.tp, or set parallel.sequence_parallel = false",
                N, S);
  return N / S;
}

}  // namespace

LayerActivationSpecs layer_activation_specs(const ModelConfig& c, int64_t B, int64_t T,
                                            int64_t mlp_chunk_tokens, Checkpointing mode,
                                            DType act) {
  const int64_t N = B * T, D = c.dim, F = c.ffn_dim, qd = c.q_dim(), kvd = c.kv_dim();
  const int64_t C = mlp_chunk_rows(B, T, mlp_chunk_tokens);
  const bool none = mode == Checkpointing::kNone, full = mode == Checkpointing::kFull;
  const int64_t M = none ? N : C;  // rows of the MLP's gate and up
  // Sequence parallelism: the residual stream and the norms (x_in, xn1, rstd1, x_mid, xn2,
  // rstd2) hold this rank's n rows; the norm outputs are gathered into x_full for the q/k/v
  // and gate/up projections (recomputed by a second all-gather in backward, never kept), and
  // x_full then takes the o/down projections' partial outputs before their reduce-scatter.
  const bool sp = c.seq_shards() > 1;
  const int64_t n = local_rows(c, N);
  LayerActivationSpecs s;
  auto add = [&](bool kept, TensorSpec spec) {
    (kept ? s.kept : s.work).push_back(std::move(spec));
  };
  add(true, {"x_in", act, {n, D}});
  add(none, {"xn1", act, {n, D}});
  add(none, {"rstd1", DType::kF32, {n}});
  add(none, {"q", act, {N, qd}});
  add(none, {"k", act, {N, kvd}});
  add(none, {"v", act, {N, kvd}});
  if (c.qk_norm) {  // the projections' outputs before the per-head norms, and the norms' rstd
    add(none, {"q_raw", act, {N, qd}});
    add(none, {"k_raw", act, {N, kvd}});
    add(none, {"rstd_q", DType::kF32, {N * c.n_heads}});
    add(none, {"rstd_k", DType::kF32, {N * c.n_kv_heads}});
  }
  add(!full, {"attn", act, {N, qd}});
  add(!full, {"lse", DType::kF32, {B, c.n_heads, T}});
  if (c.post_norms) {  // the o projection's output before its norm, and the norm's rstd
    add(none, {"attn_out", act, {n, D}});
    add(none, {"rstd_post1", DType::kF32, {n}});
  }
  add(none, {"x_mid", act, {n, D}});
  add(none, {"xn2", act, {sp ? n : M, D}});
  add(none, {"rstd2", DType::kF32, {sp ? n : M}});
  add(none, {"gate", act, {M, F}});
  add(none, {"up", act, {M, F}});
  // Post-norms: the down projection's (summed) output before its norm and the norm's rstd, a
  // chunk's when not kept; with the rows split, this rank's rows after the reduce-scatter,
  // kept in every mode (their norm's backward needs every rank's chunks, which no chunk of a
  // backward recomputes on its own).
  if (c.post_norms) {
    add(none || sp, {"mlp_out", act, {sp ? n : M, D}});
    add(none || sp, {"rstd_post2", DType::kF32, {sp ? n : M}});
  }
  if (sp) add(false, {"x_full", act, {N, D}});
  return s;
}

int64_t mlp_chunk_rows(int64_t B, int64_t T, int64_t mlp_chunk_tokens) {
  return std::min(mlp_chunk_tokens, B * T);
}

std::vector<TensorSpec> model_saved_activations(const ModelConfig& c, int64_t B, int64_t T,
                                                Checkpointing mode, DType act) {
  const int64_t N = B * T, D = c.dim, n = local_rows(c, N);
  const WorkSetAliases aliases = work_set_aliases(c, mode);
  // Sequence parallelism: the last layer's output and the final norm on this rank's n rows;
  // xn_final gathered whole for the LM head.
  std::vector<TensorSpec> s = {
      {"tokens", DType::kI32, {N}},
      {"targets", DType::kI32, {N}},
      {"positions", DType::kI32, {N}},
      {"seg_start", DType::kI32, {N}},
      {"doc_starts", DType::kI32, {N + 1}},
      {"x_final", act, {n, D}},
      {"xn_final", act, {N, D}},
      {"rstd_final", DType::kF32, {n}},
  };
  std::erase_if(s, [&](const TensorSpec& spec) {
    return (aliases.x_final_in_x_mid && spec.name == "x_final") ||
           (aliases.xn_final_in_q && spec.name == "xn_final");
  });
  return s;
}

WorkSetAliases work_set_aliases(const ModelConfig& c, Checkpointing mode) {
  if (c.seq_shards() > 1 || c.stage_end() <= c.pp_begin || mode == Checkpointing::kNone) return {};
  const bool one_stage = c.pp_begin == 0 && c.stage_end() == c.n_layers;
  return {.d_attn_in_x_mid = c.q_dim() <= c.dim,
          .d_norm_in_attn = mode == Checkpointing::kFull && c.q_dim() >= c.dim,
          .x_final_in_x_mid = one_stage && c.tp_shards == 1 && !c.post_norms,
          .xn_final_in_q = one_stage && c.q_dim() >= c.dim};
}

std::vector<TensorSpec> backward_transients(const ModelConfig& c, int64_t B, int64_t T,
                                            int64_t mlp_chunk_tokens, Checkpointing mode,
                                            DType act) {
  const int64_t N = B * T, D = c.dim, F = c.ffn_dim, qd = c.q_dim(), kvd = c.kv_dim();
  const int64_t C = mlp_chunk_rows(B, T, mlp_chunk_tokens), n = local_rows(c, N);
  const WorkSetAliases aliases = work_set_aliases(c, mode);
  // A norm output's consumers (q/k/v, gate/up) accumulate their input gradients straight into
  // d_norm. Sequence parallelism: d_resid holds this rank's n rows; d_part takes the gathered
  // gradient of a region's output, and d_norm [N, D] (the gathered rows' partial gradient) is
  // reduce-scattered into d_part's first n rows.
  std::vector<TensorSpec> s = {
      {"d_resid", act, {n, D}},  // gradient of the residual stream, updated in place
      {"d_norm", act, {N, D}},   // gradient of a norm's output (sum over its consumers)
      {"ffn_h", act, {C, F}},    // silu(gate)*up of one MLP chunk; then its d_gate in backward
      {"d_h", act, {C, F}},      // gradient of h (one chunk)
      {"d_up", act, {C, F}},    {"d_attn", act, {N, qd}}, {"d_q", act, {N, qd}},
      {"d_k", act, {N, kvd}},   {"d_v", act, {N, kvd}},
  };
  std::erase_if(s, [&](const TensorSpec& spec) {
    return (aliases.d_attn_in_x_mid && spec.name == "d_attn") ||
           (aliases.d_norm_in_attn && spec.name == "d_norm");
  });
  if (aliases.d_norm_in_attn) s.push_back({"d_xn2", act, {C, D}});  // one MLP chunk's d(xn2)
  if (c.seq_shards() > 1) s.push_back({"d_part", act, {N, D}});     // the seams' gather buffer
  // Post-norms: the gradient of a sublayer's output before its norm (this rank's rows, or one
  // MLP chunk's: C <= N = n with the rows whole).
  if (c.post_norms) s.push_back({"d_post", act, {n, D}});
  // Tied embeddings: the LM head's unit is the embeddings', staged after the final norm's, so
  // the final norm's backward reads its weight converted into act's dtype here.
  if (c.tie_embeddings && c.holds_embedding_matrix() && c.holds_head())
    s.push_back({"final_norm_w", act, {D}});
  return s;
}

std::vector<TensorSpec> forward_transients(const ModelConfig& c, int64_t B, int64_t T,
                                           int64_t mlp_chunk_tokens, DType act) {
  return {{"ffn_h", act, {mlp_chunk_rows(B, T, mlp_chunk_tokens), c.ffn_dim}}};
}

int64_t rotary_table_bytes(const ModelConfig& c) {
  return (c.global_layer_every > 0 ? 2 : 1) * (c.rotary_dim() / 2) * 4;
}

size_t arena_bytes(const std::vector<TensorSpec>& specs) {
  size_t total = 0;
  for (const auto& s : specs) total += align_up(s.bytes());
  return total;
}

double train_flops(const ModelConfig& c, double tokens, double attention_pairs) {
  const ParamLayout L = make_param_layout(c);
  // Matmul parameters: everything but norms, biases and the embedding gather (the LM head
  // is a matmul even when tied).
  double matmul = 0;
  for (const auto& e : L.entries)
    if (e.shape.rank() == 2 && e.name != "model.embed_tokens.weight") matmul += e.shape.numel();
  if (c.tie_embeddings) matmul += static_cast<double>(c.vocab_rows()) * c.dim;
  // Per visible (query, key) pair and head: QK^T and PV forward (2 x 2 Dh), 4 products back.
  const double attn = 6.0 * 2.0 * c.head_dim() * c.n_heads * c.n_layers * attention_pairs;
  return 6.0 * matmul * tokens + attn;
}

double train_flops_per_token(const ModelConfig& c, int64_t T) {
  return train_flops(c, 1.0, T / 2.0);
}

}  // namespace shardlm
