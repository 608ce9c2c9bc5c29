// Size tables of a Llama model: where every parameter lives in the flat arenas and which
// activations each layer saves for backward. Pure arithmetic: no backend, no allocation.
// The allocator (model/llama) and the planner use these same tables, so planned and measured
// bytes agree by construction.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "shardlm/core/dtype.h"
#include "shardlm/core/shape.h"
#include "shardlm/model/config.h"

namespace shardlm {

struct ParamEntry {
  std::string name;  // Hugging Face style, e.g. "model.layers.3.self_attn.q_proj.weight"
  Shape shape;
  int64_t offset = 0;  // in elements, into the parameter arena
  int layer = -1;      // decoder layer, or -1 for embeddings / final norm / head
  bool decay = false;  // weight decay applies (matrices yes; norms and biases no)
};

// Element offsets of one decoder layer's parameters (contiguous per layer, in this order).
struct LayerParamOffsets {
  int64_t attn_norm;       // [D]
  int64_t wq;              // [Hq*Dh, D]
  int64_t wk;              // [Hkv*Dh, D]
  int64_t wv;              // [Hkv*Dh, D]
  int64_t bq, bk, bv;      // [Hq*Dh], [Hkv*Dh], [Hkv*Dh]; -1 without attention bias
  int64_t q_norm;          // [Dh] per-head RMSNorm of q (Qwen3); -1 without ModelConfig::qk_norm
  int64_t k_norm;          // [Dh] of k; -1 without
  int64_t wo;              // [D, Hq*Dh]
  int64_t post_attn_norm;  // [D] the attention output's norm (Gemma's post-norms); -1 without
  int64_t ffn_norm;        // [D] the MLP's input norm
  int64_t post_ffn_norm;   // [D] the MLP output's norm; -1 without
  int64_t w_gate;          // [F, D]
  int64_t w_up;            // [F, D]
  int64_t w_down;          // [D, F]
  int64_t begin, end;      // the layer's element range
};

struct ParamLayout {
  int64_t embed = 0;  // [V, D]
  std::vector<LayerParamOffsets> layers;
  int64_t final_norm = 0;  // [D]
  int64_t lm_head = 0;     // [V, D]; equals `embed` when embeddings are tied
  int64_t total = 0;       // elements
  int64_t max_layer = 0;   // largest single decoder layer, elements
  int64_t vocab_rows = 0;  // V: rows of the embedding table and the LM head (this shard's)
  int64_t dim = 0;         // D: their row length
  std::vector<ParamEntry> entries;

  // The arena in units, the granularity at which a ParamStore hands parameters and gradient
  // buffers to the model: unit 0 the embeddings, unit 1 + l decoder layer l, the last unit the
  // final norm (and the LM head when untied). Contiguous, in arena order, covering [0, total).
  struct Unit {
    int64_t begin, end;
  };
  std::vector<Unit> units;
  int head_unit = 0;      // the final norm's unit (the last)
  int lm_head_unit = 0;   // the LM head's unit: 0 when tied to the embeddings, else head_unit
  int64_t max_unit = 0;   // elements of the largest unit
  bool adapters = false;  // a LoRA arena (model/lora.h): unit u is decoder layer u's adapters
  int64_t unit_size(int u) const { return units[u].end - units[u].begin; }
  // "embeddings", "layer 3", "final norm and head" (for messages).
  std::string unit_name(int u) const;
};

// A unit handed out in pieces (ParamStore::piece_rows): the embeddings' (tied: also the LM
// head's) or the untied LM head's [V, D] table in blocks of rows, so that no buffer of a store
// need hold the whole table.
// Piece k is the flat range [begin, end) and table rows [row_begin, row_begin + rows); the
// final norm, which precedes the LM head in its unit, goes with the head's first piece.
struct UnitPiece {
  int64_t begin = 0, end = 0;
  int64_t row_begin = 0, rows = 0;
};
// Whether unit u may be handed out in pieces: the embeddings' unit, or the LM head's when it
// holds its own [V, D] table (untied); not in an adapter arena.
bool unit_has_table(const ParamLayout& L, int u);
// The pieces of unit u at `piece_rows` rows a piece, in order, covering the unit: one piece
// (the whole unit; its table's rows if it has one) when piece_rows is 0 or the unit has no
// table.
std::vector<UnitPiece> unit_pieces(const ParamLayout& L, int u, int64_t piece_rows);
// Rows a piece of unit u's table when no piece may exceed `most` elements (at least one row),
// or 0 when the unit fits whole (or has no table).
int64_t table_piece_rows(const ParamLayout& L, int u, int64_t most);
// The largest unit or piece when every table larger than `most` is in pieces.
int64_t largest_piece(const ParamLayout& L, int64_t most);
// Elements of one of the two device slots of a frozen base offloaded to the host
// (LoraConfig::offload_base): a decoder layer, the tables being handed out in pieces that size;
// without split_tables (a tensor-parallel shard: its vocabulary-parallel embedding and loss use
// the whole slice) the largest unit.
inline int64_t offloaded_base_slot_elems(const ParamLayout& L, bool split_tables) {
  return split_tables ? largest_piece(L, L.max_layer) : L.max_unit;
}

ParamLayout make_param_layout(const ModelConfig& cfg);

// A tensor the step keeps or uses, with its dtype and shape.
struct TensorSpec {
  std::string name;
  DType dtype;
  Shape shape;
  size_t bytes() const { return static_cast<size_t>(shape.numel()) * dtype_size(dtype); }
};

// Activation checkpointing: what each decoder layer keeps from its forward until its backward.
//   kNone:      everything backward reads (x_in, xn1, rstd1, q, k, v, attn, lse, x_mid, xn2,
//               rstd2, gate, up; with q/k norms also q_raw, k_raw, rstd_q, rstd_k).
//   kSelective: x_in, attn and lse (cheap to store, expensive to recompute); backward
//               recomputes the norms, q/k/v, x_mid and the MLP inputs.
//   kFull:      x_in only; backward recomputes the whole layer forward, attention included.
enum class Checkpointing : uint8_t { kNone, kSelective, kFull };
// "none", "selective", "full" (the memory.checkpointing values).
std::string checkpointing_name(Checkpointing mode);
// The mode of a memory.checkpointing value; Error(kConfig) naming the valid ones otherwise.
Checkpointing checkpointing_from_name(const std::string& name);

// The tensors one decoder layer's backward reads, for a micro-batch of B x T, split by mode.
// act: element type of activations (f32 on CPU). The MLP inputs (xn2, rstd2, gate, up) are
// [N, ...] when kept and [mlp_chunk, ...] otherwise: the MLP runs in chunks of
// min(mlp_chunk_tokens, B*T) rows, so what is recomputed is recomputed one chunk at a time.
struct LayerActivationSpecs {
  std::vector<TensorSpec> kept;  // per layer, forward to backward (category checkpoints)
  std::vector<TensorSpec> work;  // one set shared by every layer: recomputed (activations)
};
LayerActivationSpecs layer_activation_specs(const ModelConfig& cfg, int64_t B, int64_t T,
                                            int64_t mlp_chunk_tokens, Checkpointing mode,
                                            DType act);
// Rows of one MLP chunk: min(mlp_chunk_tokens, B*T).
int64_t mlp_chunk_rows(int64_t B, int64_t T, int64_t mlp_chunk_tokens);

// What the model keeps outside the layers (embedding output is layer 0's input; the final
// norm's input, output and rstd; the batch's token, target, position and document tensors),
// less what work_set_aliases places in the work set.
std::vector<TensorSpec> model_saved_activations(const ModelConfig& cfg, int64_t B, int64_t T,
                                                Checkpointing mode, DType act);
// Tensors that live in the shared work set's bytes while those are dead, so that a model whose
// layers recompute holds up to four [N, D]-sized tensors fewer (none of them under sequence
// parallelism, where x_mid holds a rank's n < N rows, nor on a stage without layers):
//   d_attn [N, qd] in x_mid: dead once the MLP's backward is done (x_mid is recomputed unless
//     mode is none; qd <= D);
//   d_norm [N, D] in attn: dead once the attention's backward is done (recomputed under full
//     checkpointing only; qd >= D); the MLP's chunks then take d(xn2) in d_xn2 [C, D];
//   x_final [N, D] in x_mid and xn_final [N, D] in q, on a model of one stage: the last layer's
//     work set is dead from its output on, and the final norm's backward (the head's first
//     act in the backward) is done with both before any layer recomputes. x_final needs the
//     MLP's output summed onto x_mid in place: one rank of tp and no post-norms; xn_final qd >= D.
struct WorkSetAliases {
  bool d_attn_in_x_mid = false;
  bool d_norm_in_attn = false;
  bool x_final_in_x_mid = false;
  bool xn_final_in_q = false;
};
WorkSetAliases work_set_aliases(const ModelConfig& cfg, Checkpointing mode);

// Per-step scratch tensors (gradients of activations, the MLP's hidden chunk), reused by every
// layer; the MLP's are [mlp_chunk, F]. Those work_set_aliases places in the work set are not
// listed.
std::vector<TensorSpec> backward_transients(const ModelConfig& cfg, int64_t B, int64_t T,
                                            int64_t mlp_chunk_tokens, Checkpointing mode,
                                            DType act);

// A forward-only model's (ModelOptions::backward = false) per-step scratch: the MLP's hidden
// chunk, backward_transients' only tensor the forward reads.
std::vector<TensorSpec> forward_transients(const ModelConfig& cfg, int64_t B, int64_t T,
                                           int64_t mlp_chunk_tokens, DType act);

// Bytes of a model's rotary frequency tables (f32 [Dh / 2]; Gemma's local layers have their own).
int64_t rotary_table_bytes(const ModelConfig& cfg);

// Sum of align_up(bytes) over specs: the bytes of one buffer that holds them all, each aligned.
size_t arena_bytes(const std::vector<TensorSpec>& specs);

// FLOPs of training (forward + backward) on `tokens` tokens whose attention sees
// `attention_pairs` (query, key) pairs in all: 6 * matmul params per token plus
// 6 * 2 * Dh * Hq per pair and layer (forward 2 matmuls, backward 4).
double train_flops(const ModelConfig& cfg, double tokens, double attention_pairs);
// Per token of full causal rows of T (T/2 pairs per token on average): the figure peers use.
double train_flops_per_token(const ModelConfig& cfg, int64_t T);

}  // namespace shardlm
