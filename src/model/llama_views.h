// Private to src/model: the views a LlamaModel step carves out of its arenas (one layer's
// saved activations, the backward scratch, everything of one micro-batch slot at one (B, T)),
// shared by llama.cpp and the pipeline stage's llama_stage.cpp. Not a public header.
#pragma once

#include <string_view>
#include <vector>

#include "shardlm/model/llama.h"
#include "vocab_parallel.h"

namespace shardlm {

// The kernel scratch of the LM head + loss over a table in pieces (llama_head.cpp), at the
// options' largest micro-batch.
size_t pieced_loss_workspace_bytes(const Backend& backend, const ModelConfig& cfg,
                                   const ModelOptions& opt);
// The scratch of one walk of the head over a table's pieces (or a tp shard's whole slice) for
// n_tokens tokens, in the model workspace as slice_loss_scratch lays it out: loss chunks of
// `chunk` rows, each chunk's logits against a piece, every token's running statistics, the
// walk's loss accumulator and the backend's xent_slice scratch. Shared by the walks of
// llama_head.cpp (pieced_head_loss, head_row_stats, head_grad_walk) and read_target_logps
// (llama_logps.cpp).
struct HeadWalkScratch {
  const Buffer* workspace = nullptr;
  DType act = DType::kF32;  // the logits' dtype (the activations')
  int64_t chunk = 0;        // rows of a loss chunk
  SliceLossScratch at;      // the offsets in the workspace
  Tensor row_max, stats;    // [n_tokens] f32, [n_tokens, 2] f32
  Tensor loss_acc;          // [2] f64: the walk's loss sum and count, added on the device
  Workspace xent;           // the backend's xent_slice_* scratch
  // The logits of n tokens (one chunk) against `rows` vocabulary ids: [n, rows] in act.
  Tensor logits(int64_t n, int64_t rows) const {
    return workspace->view(act, {n, rows}, at.logits);
  }
};
// Fails (naming both sizes) when the workspace is smaller than the walk needs. piece_rows: the
// table's largest piece (the first).
HeadWalkScratch head_walk_scratch(const Backend& be, const Buffer& workspace,
                                  const ModelOptions& opt, int64_t n_tokens, int64_t piece_rows);

// The per-token weights of a preference objective's backward ([B*T] f32, after the pieced
// loss's scratch in the workspace; llama_logps.cpp).
size_t token_weights_bytes(const ModelOptions& opt);

// Carves the specs' tensors out of `base` in order; returns the views.
std::vector<Tensor> carve(std::byte* base, MemPool pool, const std::vector<TensorSpec>& specs);

// The views of one of model/layout's tables, carved in order and handed out by name, so the
// structs below are filled by the names the layout gives, never by position. check_all_used
// fails when the table has a tensor no field took: the table and the struct disagree.
class NamedViews {
 public:
  NamedViews(std::byte* base, MemPool pool, const std::vector<TensorSpec>& specs);
  bool has(std::string_view name) const;
  Tensor get(std::string_view name);  // fails when the table has no such tensor
  void check_all_used(const char* table) const;

 private:
  std::vector<TensorSpec> specs_;
  std::vector<Tensor> views_;
  std::vector<bool> used_;
};

// Views of what one layer's backward reads (names and shapes from layer_activation_specs):
// the kept tensors in the layer's checkpoint slot, the others in the shared work set.
// n: rows of the residual stream on this rank (N, or N / tp under sequence parallelism).
struct LlamaModel::LayerActs {
  Tensor x_in;    // [n, D] layer input (residual stream)
  Tensor xn1;     // [n, D] attention-norm output
  Tensor rstd1;   // [n]
  Tensor q;       // [B, T, Hq, Dh] after RoPE
  Tensor k;       // [B, T, Hkv, Dh] after RoPE
  Tensor v;       // [B, T, Hkv, Dh]
  Tensor attn;    // [B, T, Hq, Dh] attention output (before o_proj)
  Tensor lse;     // [B, Hq, T]
  Tensor x_mid;   // [n, D] residual after attention
  Tensor xn2;     // [M, D] ffn-norm output; M = N when kept, else one MLP chunk (n: seq. par.)
  Tensor rstd2;   // [M]
  Tensor gate;    // [M, F]
  Tensor up;      // [M, F]
  Tensor x_full;  // [N, D] sequence parallelism: gathered norm output, then a partial output
  // q/k norms (ModelConfig::qk_norm) only:
  Tensor q_raw;   // [N, Hq*Dh] the q projection's output, before its per-head norm
  Tensor k_raw;   // [N, Hkv*Dh]
  Tensor rstd_q;  // [N*Hq]
  Tensor rstd_k;  // [N*Hkv]
  // Post-norms only (Gemma): the o and down projections' outputs (summed over the tp group)
  // before their norms, and the norms' rstd.
  Tensor attn_out;    // [n, D]
  Tensor rstd_post1;  // [n]
  Tensor mlp_out;     // [M, D] (M: every row when kept, else one MLP chunk's; n: seq. par.)
  Tensor rstd_post2;  // [M]
};

// Views of the backward scratch (names and shapes from backward_transients; a forward-only
// model has ffn_h alone).
struct LlamaModel::Transients {
  Tensor d_resid;       // [n, D] gradient of the residual stream, updated in place
  Tensor d_norm;        // [N, D] gradient of a norm's output (maybe in attn: work_set_aliases)
  Tensor d_xn2;         // [C, D] one MLP chunk's d(xn2), only while d_norm lives in attn
  Tensor d_part;        // [N, D] the seams' gather buffer (sequence parallelism only)
  Tensor d_post;        // [n, D] a post-norm's input gradient (post-norms only)
  Tensor final_norm_w;  // [D] the final norm's weight in act's dtype (tied embeddings only)
  Tensor ffn_h;         // [C, F] silu(gate)*up of one MLP chunk; d_gate in backward
  Tensor d_h;           // [C, F]
  Tensor d_up;          // [C, F]
  Tensor d_attn;        // [B, T, Hq, Dh] (maybe in x_mid: work_set_aliases)
  Tensor d_q;           // [B, T, Hq, Dh]
  Tensor d_k;           // [B, T, Hkv, Dh]
  Tensor d_v;           // [B, T, Hkv, Dh]
};

struct LlamaModel::StepViews {
  int64_t B = 0, T = 0;
  int64_t mlp_chunk = 0;  // C: rows of one MLP chunk
  bool mlp_kept = false;  // gate, up (and xn2, rstd2) are [N] and kept, else [C], recomputed
  // The ffn norm runs over all of this rank's rows before the chunks (its rows split across
  // the tp group: the seam gathers them for the projections), else chunk by chunk; so does
  // the post-norm of the MLP's output, after the chunks.
  bool mlp_norm_whole = false;
  std::vector<LayerActs> layers;  // [n_layers]
  std::vector<Tensor> slot_kept;  // [slots] f32 view of a device slot's used bytes
  std::vector<Tensor> host_kept;  // [host layers] f32 view of a host layer's copy
  BatchInputs in;
  Tensor x_final;     // [n, D] output of the last layer
  Tensor xn_final;    // [N, D] final norm output (the LM head's input), gathered
  Tensor rstd_final;  // [n]
  Transients tr;
  // The documents in in.doc_starts when set_documents told them (0: not told).
  int64_t doc_count = 0, doc_max_len = 0;
};

}  // namespace shardlm
