// LlamaModel: a Llama-family decoder with explicit per-layer forward and backward over the
// Backend interface. It owns its activation arenas (sized from model/layout) and reaches its
// parameters and gradients unit by unit through a ParamStore: its own (whole arenas, params()
// and grads()) unless the caller passes one (ZeRO, in parallel/). Activation checkpointing
// (what a layer keeps for its backward, on the device or the host) and the sequence-tiled MLP
// are its options. It knows nothing of parallelism or optimizers: a tensor-parallel shard is
// just a config with fewer heads and a narrower MLP plus a TensorSeam to call.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "shardlm/backend/backend.h"
#include "shardlm/comm/communicator.h"
#include "shardlm/core/buffer.h"
#include "shardlm/model/attention_core.h"
#include "shardlm/model/checkpoint_map.h"
#include "shardlm/model/config.h"
#include "shardlm/model/layout.h"
#include "shardlm/model/lora.h"
#include "shardlm/model/nf4_base.h"
#include "shardlm/model/param_store.h"
#include "shardlm/model/sharded_base.h"
#include "shardlm/model/tensor_seam.h"

namespace shardlm {

struct ModelOptions {
  DType param_dtype = DType::kF32;  // working copy of the weights: f32 or bf16
  // Activations, checkpoints, the residual stream, their gradients and the weights as the kernels
  // read them: f32 or bf16. Arithmetic is f32 inside every kernel and parameter gradients
  // accumulate in f32 either way; parameters of another dtype are converted one unit at a time
  // into a staging buffer of this dtype. f32 is the gradient-check mode.
  DType activation_dtype = DType::kF32;
  int64_t max_batch = 1;             // B: sequences per micro-batch
  int64_t max_seq = 256;             // T: tokens per sequence
  int64_t loss_chunk_tokens = 1024;  // rows of the fused LM head + loss per chunk
  int64_t mlp_chunk_tokens = 1024;   // rows of the MLP per chunk, forward and backward
  // What each layer keeps from its forward for its backward (model/layout.h); the rest is
  // recomputed in backward. Loss and gradients are bitwise the same in every mode.
  Checkpointing checkpointing = Checkpointing::kNone;
  // Which layers keep their tensors and where they wait (model/checkpoint_map.h): every layer
  // on the device by default; some or all on the host (selective or full only); only every
  // k-th layer's input, the rest recomputed (full only).
  CheckpointPlacement checkpoint_placement;
  // false: parameters only, no gradients or activation arenas (sampling through a KvDecoder,
  // export); forward and backward then fail with a clear error.
  bool activations = true;
  // false: forward only (a KvDecoder's model): no gradients, of the backward scratch only the
  // MLP chunk's product the forward uses, and one layer's kept tensors (nothing is kept for a
  // backward); forward_backward and stage_backward fail with a clear error.
  bool backward = true;
  // Pipeline stage (a config with pp_begin/pp_end): micro-batches held between their forward
  // and backward at once (1F1B: up to stages - stage). Each slot keeps its own batch inputs,
  // layers' kept tensors and final-norm tensors; the work set and transients stay shared.
  int pipeline_slots = 1;
  // Preference objectives (forward_target_logps, forward_backward_weighted): the workspace also
  // holds a micro-batch's per-token weights [B*T] f32.
  bool token_weights = false;
  // LoRA (lora.rank > 0): the base weights are frozen (parameters only: no gradient buffers,
  // their dW GEMMs skipped) and the targeted projections carry adapters (model/lora.h), f32,
  // reached through the adapter store.
  LoraConfig lora;
};

// One micro-batch's inputs, views into the model's own input buffers; fill, then call.
struct BatchInputs {
  Tensor tokens;     // [B*T] i32
  Tensor targets;    // [B*T] i32, kIgnoreIndex where no loss is taken
  Tensor positions;  // [B*T] i32, position within the token's document (RoPE)
  Tensor seg_start;  // [B*T] i32, index in its row where the token's document starts
  // [B*T + 1] i32: the same documents as spans (DocumentSpans::starts); optional, told to the
  // model with set_documents after the fill.
  Tensor doc_starts;
};

// The initial weights, unit by unit in arena order: GPT-2/Llama style N(0, 0.02), output
// projections N(0, 0.02/sqrt(2L)), norms 1, biases 0, from one generator seeded with `seed`
// (so the values do not depend on who asks for them or how the arena is split).
void initial_weights(const ModelConfig& cfg, const ParamLayout& layout, uint64_t seed,
                     const std::function<void(int unit, const float* values)>& sink);

// The kernel scratch a LlamaModel with `opt` allocates (kernel_workspace_bytes()): the larger
// of the attention workspace (when the model runs its own attention, no AttentionCore given)
// and the fused LM head + loss workspace for one chunk of min(loss_chunk_tokens, B * T)
// tokens. Arithmetic: the planner asks it too.
size_t model_kernel_workspace_bytes(const Backend& backend, const ModelConfig& cfg,
                                    const ModelOptions& opt, bool own_attention);
// The host rows a model with token weights (a preference objective's) and the head allocates
// for read_target_logps (forward_target_logps: the held-out evaluation, full fine-tuning DPO's
// reference pass): the head's row statistics of a micro-batch read back in one copy, the row
// maxima and the statistics as they lie in the workspace, [align_up(N) + 2 N] f32 for N = B * T
// tokens at the options' largest micro-batch (host pool, activations). Arithmetic: the planner
// asks it too.
size_t target_logps_host_bytes(const ModelOptions& opt);
// The LM head's row statistics of a micro-batch of N tokens, on the device, as the xent_slice
// ops leave them (a preference objective's view of its forward; LlamaModel::forward_row_stats):
// row_max [N] f32 and stats [N, 2] f32, each token's sum of exp(logit - max) and its target's
// (capped) logit, (0, 0) for a token without a target. log p(target_i) = stats[i, 1] -
// row_max[i] - log(stats[i, 0]). Valid until the model's next head walk.
struct HeadRowStats {
  Tensor row_max, stats;
};

// Where a LlamaModel meets the rest of the engine: each seam the caller leaves null is the
// model's own. Named members, so a caller says which it passes ({.store = &zero, ...}).
struct ModelSeams {
  // Where parameters and gradients live; null = the model's own arenas (params(), grads()).
  ParamStore* store = nullptr;
  // With LoRA, where the adapters and their gradients live (units: decoder layers of
  // lora_layout().params); null = the model's own arenas (lora_params(), lora_grads()).
  ParamStore* adapters = nullptr;
  // The attention core over this rank's tokens; null = the backend kernel over the whole
  // sequence, its scratch in the model's workspace.
  AttentionCore* attention = nullptr;
  // A tensor-parallel shard's (cfg.tp_shards > 1) tp group, required then: the seam sums the
  // ranks' partial results and, under sequence parallelism (cfg.sequence_parallel, which it
  // must agree with), gathers and scatters the residual stream's rows. null = SingleRankSeam.
  TensorSeam* tp = nullptr;
  // With LoRA, the group the frozen base is sharded over, a layer gathered on use (ZeRO-3's
  // ranks, lora_base_sharded; on the device or in host memory): an NF4 base's codes and
  // absmax, a dense base's decoder layers; null = whole on every rank.
  Communicator* base_shards = nullptr;
};

class LlamaModel {
 public:
  LlamaModel(const ModelConfig& cfg, const ModelOptions& opt, Backend& backend,
             MemoryLedger& ledger, const ModelSeams& seams = {});
  ~LlamaModel();
  LlamaModel(const LlamaModel&) = delete;
  LlamaModel& operator=(const LlamaModel&) = delete;

  const ModelConfig& config() const { return cfg_; }
  const ParamLayout& layout() const { return layout_; }
  const ModelOptions& options() const { return opt_; }
  // The backend and ledger the model allocates and computes through (for KvDecoder).
  Backend& backend() const { return be_; }
  MemoryLedger& ledger() const { return ledger_; }

  // With the model's own store: sets the parameters to initial_weights(seed).
  void init_weights(uint64_t seed);
  // With the model's own store: unit u's parameters from `values` [unit_size(u)] f32 on the
  // host (an NF4 base quantizes its projections, or takes those in `nf4` as they are: a
  // directory saved in 4 bits; a sharded base keeps its rank's chunk), and unit u's values as
  // the model computes with them (an NF4 base's dequantized) into `values` (a sharded base's
  // layer is gathered: collective over ModelSeams::base_shards).
  void set_base_unit(int u, const float* values, std::span<const Nf4Matrix> nf4 = {});
  void read_base_unit(int u, float* values);

  // LoRA (options().lora.enabled()): the adapters' size table; with the model's own adapter
  // store, the adapters [lora total] f32 and their gradients [lora total] f32.
  bool lora() const { return opt_.lora.enabled(); }
  const LoraLayout& lora_layout() const { return lora_layout_; }
  Tensor lora_params() const;
  Tensor lora_grads() const;
  // The dropout mask of the next forward_backward: a key per micro-batch (e.g. seed and step)
  // and the index of its first token in the step (so that ranks holding other rows of the
  // same step draw other masks). Evaluation and generation never drop.
  void set_lora_dropout(uint64_t key, int64_t first_token) {
    dropout_key_ = key;
    dropout_token0_ = first_token;
  }

  // With the model's own store: the working parameters [total] (param_dtype) and the f32
  // gradients [total]. Error(kInternal) with a caller's store, which holds them instead.
  Tensor params() const;
  Tensor grads() const;
  void zero_grads();
  ParamStore& store() const { return *store_; }

  // Views of the input buffers for a micro-batch of B x T (B <= max_batch, T <= max_seq).
  BatchInputs inputs(int64_t B, int64_t T);
  // After filling the inputs (inputs() or stage_inputs()) with doc_starts too: the number of
  // documents written there and the longest, so that attention may run them as variable-length
  // sequences (DocumentSpans). Without it (every inputs() call forgets the last) attention reads
  // seg_start alone.
  void set_documents(int64_t count, int64_t max_len);

  // Forward and backward of one micro-batch; gradients accumulate into grads(), scaled so
  // that the step's loss is grad_scale * (sum of token losses). Returns the loss sum.
  LossResult forward_backward(int64_t B, int64_t T, float grad_scale);
  // Forward and loss only (evaluation).
  LossResult forward_loss(int64_t B, int64_t T);

  // ---- preference objectives (llama_logps.cpp; options().token_weights) ----
  // Under tensor parallelism every tp rank gets the same statistics (the head's are reduced
  // over the tp group); under context parallelism a rank's own tokens' (B rows of T local
  // tokens).
  // Forward only, then sink(stats) with the head's row statistics on the device (one head GEMM
  // per piece, no logits kept): the caller issues its own device ops on them, the host reads
  // nothing. base_only: with LoRA, the adapters left out (the frozen base: DPO's reference).
  using RowStatsSink = std::function<void(const HeadRowStats& stats)>;
  void forward_row_stats(int64_t B, int64_t T, bool base_only, const RowStatsSink& sink);
  // The same, read back: logps [B*T] = log p(target) at every position with a target, 0
  // elsewhere, in f64 on the host (one copy, a host wait: the evaluation's and the reference
  // pass's, outside the training step).
  void forward_target_logps(int64_t B, int64_t T, bool base_only, std::span<double> logps);
  // Forward, then weigh(stats, weights) issues the device ops that write weights [B*T] f32 on
  // the device from the statistics, then the backward of sum_t weights[t] * (-log p(target_t)):
  // the gradient of any loss of the per-token log-probabilities whose derivative with respect
  // to log p(target_t) is -weights[t]. Gradients accumulate as forward_backward's. The head's
  // logits are computed twice (the statistics, then the weighted gradient), the layers once;
  // nothing waits for the device.
  using TokenWeigher = std::function<void(const HeadRowStats& stats, const Tensor& weights)>;
  void forward_backward_weighted(int64_t B, int64_t T, const TokenWeigher& weigh);
  // Logits of the last position of row 0 after a forward of B=1, T tokens: [V] f32 host.
  void forward_last_logits(int64_t T, std::vector<float>& logits);
  // The decoder layers only, no final norm or head (a KvDecoder's prefill chunks before the
  // last: their effect is the attention core's state).
  void forward_layers_only(int64_t B, int64_t T);

  // ---- pipeline stage (llama_stage.cpp) ----
  // A stage (config() with pp_begin/pp_end; the whole model is the one-stage case) runs
  // micro-batches in slots [0, options().pipeline_slots): a slot holds one micro-batch from
  // its forward to its backward. Per slot: the inputs (every stage fills positions and
  // seg_start, the first tokens, the last targets), and, on stages after the first, the
  // received hidden state [B*T, D] (stage_input) before stage_forward.
  BatchInputs stage_inputs(int slot, int64_t B, int64_t T);
  Tensor stage_input(int slot, int64_t B, int64_t T);
  // Forward of the micro-batch in `slot`. Stages before the last return the hidden state to
  // send [B*T, D] (valid until the slot's next forward); the last returns an empty tensor,
  // and with eval_loss computes the loss into it (evaluation: no backward follows).
  Tensor stage_forward(int slot, int64_t B, int64_t T, LossResult* eval_loss = nullptr);
  // Backward of the micro-batch in `slot`: on the last stage the LM head and loss (gradients
  // scaled by grad_scale; returns the loss sum), elsewhere from d_out [B*T, D], the gradient
  // of the stage's output received from the next stage. Afterwards stage_input_grad() is the
  // gradient of the stage's input [B*T, D] to send back (stages after the first; valid until
  // the next backward); the first stage runs the embedding backward instead.
  LossResult stage_backward(int slot, int64_t B, int64_t T, float grad_scale, const Tensor& d_out);
  Tensor stage_input_grad(int64_t B, int64_t T);
  // The preference objectives' stage entry points (options().token_weights): a forward only
  // (base_only: the adapters off, DPO's reference) whose last stage hands its row statistics
  // to sink, or reads them back into logps, as forward_row_stats / forward_target_logps do
  // (others return the hidden state to send, sink not called, logps untouched); and a backward
  // whose last stage runs forward_backward_weighted's head (the statistics, weigh, the weighted
  // gradient), the others starting from d_out as stage_backward does.
  Tensor stage_forward_row_stats(int slot, int64_t B, int64_t T, bool base_only,
                                 const RowStatsSink& sink);
  Tensor stage_forward_target_logps(int slot, int64_t B, int64_t T, bool base_only,
                                    std::span<double> logps);
  void stage_backward_weighted(int slot, int64_t B, int64_t T, const TokenWeigher& weigh,
                               const Tensor& d_out);

  // Bytes of kernel scratch (max of attention and loss needs) held in the workspace arena.
  size_t kernel_workspace_bytes() const { return workspace_.bytes(); }
  // A dense base sharded over ModelSeams::base_shards: the layers its store gathered, ahead of
  // the walk and on use (model/sharded_base.h); all zero for any other base.
  DenseShardGatherCounts base_gather_counts() const;

 private:
  struct LayerActs;                             // views of one layer's saved activations
  struct Transients;                            // views of the backward scratch
  struct StepViews;                             // every view of a step at one (B, T)
  const StepViews& bind(int64_t B, int64_t T);  // re-carves only when (B, T) changes
  // The micro-batch's documents as spans when its fill told them (set_documents), else none.
  static DocumentSpans documents(const StepViews& s);
  void bind_layers(StepViews& s, int64_t B, int64_t T);
  void bind_model_tensors(StepViews& s, int64_t B, int64_t T);
  void bind_transients(StepViews& s, int64_t B, int64_t T);
  // backward_transients, or with a forward-only model the one tensor its forward uses.
  std::vector<TensorSpec> transient_specs(int64_t B, int64_t T) const;
  class OwnedStore;        // whole arenas: params_, grads_
  class Nf4Store;          // a frozen base with NF4 projections (LoraConfig::nf4_base)
  class ShardedBaseStore;  // a dense frozen base sharded over ZeRO-3's ranks
  void check_options(const ModelSeams& seams) const;
  void open_adapters(ParamStore* adapters);  // LoRA: the caller's adapter store or our own
  void allocate_activations();               // the arenas, at max_batch x max_seq
  class LocalAttention;                      // the backend kernel, whole sequence
  Tensor weight(int u, int64_t offset,
                Shape shape);  // view into acquired unit u (activation dtype)
  Tensor grad(int u, int64_t offset, Shape shape) const;
  Tensor final_norm_weight(const StepViews& s);  // model.norm.weight (activation dtype)
  void acquire(int u);                           // params of unit u (+ bf16 -> f32 staging)
  void release(int u);
  void acquire_grads(int u);
  void release_grads(int u);
  // A unit the store hands out in pieces (ParamStore::piece_rows: the embeddings' or the LM
  // head's table in blocks of rows) is acquired piece by piece; piece 0 of any other unit is the
  // unit. weight() and grad() then view the acquired piece.
  bool in_pieces(int u) const { return unit_pieces_[u].size() > 1; }
  void acquire_piece(int u, int k);
  void release_piece(int u, int k);
  void acquire_piece_grads(int u, int k);
  void release_piece_grads(int u, int k);
  void begin_pass(ParamStore::Pass pass);  // the base store and the adapter store
  void end_pass();
  void acquire_adapters(int l, bool grads);  // layer l's adapters (and their gradients)
  void release_adapters(int l, bool grads);
  // The gradient of a norm weight: a discard buffer when the base is frozen.
  Tensor norm_grad(int u, int64_t offset, int64_t D) const;
  // The model's RMSNorm: the config's eps, and Gemma's (1 + w) weights when it says so.
  void norm_forward(const Tensor& x, const Tensor& w, const Tensor& y, const Tensor& rstd);
  void norm_backward(const Tensor& x, const Tensor& w, const Tensor& rstd, const Tensor& dy,
                     const Tensor& dx, const Tensor& dw);
  // residual += x, then norm_forward of the sum, in one pass (Backend::add_rmsnorm_forward).
  void add_norm_forward(const Tensor& x, const Tensor& residual, const Tensor& w, const Tensor& y,
                        const Tensor& rstd);
  // The attention block's residual add is a pass of its own (not the o projection's epilogue):
  // the rows are split over the tp group or summed after it, or a post-norm comes first.
  bool residual_add_separate() const;
  // The MLP's gated activation, SwiGLU or GeGLU (ModelConfig::mlp_activation).
  void gated_forward(const Tensor& gate, const Tensor& up, const Tensor& h);
  void gated_backward(const Tensor& gate, const Tensor& up, const Tensor& dh, const Tensor& dgate,
                      const Tensor& dup);
  // Layer l's rotary frequencies [R/2] (R = rotary_dim()): a local layer's own base, else the
  // global one.
  Tensor layer_inv_freq(int l) const;
  // How the model's rotated dims pair up (ModelConfig::rope_interleaved).
  RopePairs rope_pairs() const {
    return cfg_.rope_interleaved ? RopePairs::kInterleaved : RopePairs::kHalf;
  }
  // Gemma's embedding multiplier sqrt(dim), rounded to the activation dtype as Hugging Face
  // rounds it to the model's.
  float embedding_multiplier() const;
  // y [n, out] += alpha/r * dropout(x) A^T B^T of layer l's target t (accumulated in place); x [n,
  // in]; row0: the first row's index among the micro-batch's B*T tokens (the dropout mask's
  // position).
  void lora_forward(int l, LoraTarget t, const Tensor& x, const Tensor& y, int64_t row0);
  // dy [n, out]; dx [n, in] += the update's input gradient; A's and B's gradients accumulate.
  void lora_backward(int l, LoraTarget t, const Tensor& x, const Tensor& dy, const Tensor& dx,
                     int64_t row0);
  bool lora_on(int l, LoraTarget t) const {
    return opt_.lora.enabled() && !adapters_off_ && lora_layout_.a[l][int(t)] >= 0;
  }
  // The dropped-out input into lora_x (recomputed identically in backward), or x itself.
  Tensor lora_input(int l, LoraTarget t, const Tensor& x, int64_t row0);
  // x [n, in] (this rank's part of the projection's input) masked into out as the one-rank
  // model masks those rows and columns.
  void drop_lora_input(int l, LoraTarget t, const Tensor& x, const Tensor& out, int64_t row0);
  // The seed of layer l's target t's dropout mask in the current micro-batch.
  uint64_t lora_dropout_key(int l, LoraTarget t) const;
  // Embeddings and decoder layers; for_backward: offloaded checkpoints go to the host.
  void forward_layers(int64_t B, int64_t T, bool for_backward);
  // Layer l's forward into the next layer's input; for_backward: then its kept tensors leave
  // for the host if they wait there.
  void forward_layer(int l, const StepViews& s, bool for_backward);
  void layer_forward(int l, const StepViews& s);
  // q, k, v and x_mid of layer l from its x_in; run_attention = false keeps attn and lse.
  // add_residual = false (only where residual_add_separate()): x_mid is left without x_in, for
  // mlp_forward's fused add and norm.
  void attention_block_forward(int l, const StepViews& s, bool run_attention,
                               bool add_residual = true);
  // Chunk by chunk: the layer's output. residual_pending: x_in is still to be added to x_mid,
  // which the whole-rows ffn norm does in the same pass.
  void mlp_forward(int l, const StepViews& s, bool residual_pending = false);
  void mlp_backward(int l, const StepViews& s);  // chunk by chunk: d_resid becomes d(x_mid)
  // Gemma's post-norm: rows [r0, r0 + n) of the MLP output's gradient through its norm.
  Tensor post_ffn_norm_backward(int l, const StepViews& s, int64_t r0, int64_t n);
  void final_norm_forward(const StepViews& s);  // x_final -> xn_final (gathered)
  // ---- the two ends, which read the vocabulary tables (llama_head.cpp) ----
  // The token embedding into layer 0's input, acquiring unit 0 (or its pieces).
  void embedding_forward(const StepViews& s);
  void embedding_lookup(const StepViews& s);  // the table's rows alone (before Gemma's scale)
  // The final norm's forward, acquiring its unit (the head's first piece).
  void final_norm_unit_forward(const StepViews& s);
  // The LM head + loss after final_norm_unit_forward, acquiring the head's units: forward only
  // (evaluation), or with gradients (backward's start: then d_resid = d(x_final)).
  LossResult head_loss_forward(const StepViews& s);
  LossResult head_loss_backward(const StepViews& s, float grad_scale);
  // The same over the head's table in pieces: per piece, its logits fold into each token's
  // statistics (head_row_stats); with gradients a second walk recomputes them into dlogits
  // (head_grad_walk). The loss chunks' finishes add to one device accumulator, read once.
  LossResult pieced_head_loss(const StepViews& s, bool with_grads, float grad_scale);
  // Walk 1: every token's row statistics over the head's pieces (in the pass's order:
  // descending in backward) into the pieced scratch; a tp shard's single slice is reduced over
  // the tp group (max, then the sums and the target's logit), so every tp rank holds the
  // whole vocabulary's statistics.
  void head_row_stats(const StepViews& s, bool backward_order);
  // Walk 2, after walk 1 with backward_order: each piece's dlogits = grad_scale (softmax -
  // onehot), times token_weights[t] on token t's row when given ([N] f32 on the device), then
  // the dh and dW GEMMs and the final norm's backward. Adds the (unweighted) loss sum and count
  // to loss_acc ([2] f64 on the device; empty: the loss is not wanted), read by the caller.
  void head_grad_walk(const StepViews& s, float grad_scale, const Tensor& token_weights,
                      const Tensor& loss_acc = Tensor());
  int64_t head_vocab_begin() const;  // this rank's first vocabulary id of the head
  // The LM head is the embedding table (tied), whole: the head's backward leaves its gradients
  // acquired for the embedding's backward (or the last stage's release).
  bool whole_tied_head() const;
  // Preference objectives (llama_logps.cpp): walk 1's statistics as views (row_stats) or read
  // back as per-token target log-probabilities; walk 2 with the weights the weigher wrote.
  void check_token_weights() const;
  HeadRowStats row_stats(const StepViews& s) const;
  void read_target_logps(const StepViews& s, std::span<double> logps);
  // forward_row_stats on the micro-batch bound now (a stage's: the hidden state to send, or, on
  // the stage with the head, sink called and an empty tensor).
  Tensor row_stats_forward(int64_t B, int64_t T, bool base_only, const RowStatsSink& sink);
  // After the final norm's forward, in a backward pass: walk 1, weigh, walk 2.
  void weighted_head(const StepViews& s, const TokenWeigher& weigh);
  // A stage's backward: the slot bound, the pass begun, d_out into d_resid before the last
  // stage; then, after the head (if held), the stage's layers, its embedding, the pass ended.
  // tied_held: the head's loss left a whole tied matrix's gradients acquired.
  const StepViews& stage_backward_begin(int slot, int64_t B, int64_t T, const Tensor& d_out);
  void stage_layers_backward(const StepViews& s, bool tied_held);
  // The forward half of a training micro-batch (LoRA dropout on, the layers keeping what
  // backward reads, the final norm): forward_backward's and forward_backward_weighted's.
  const StepViews& forward_for_backward(int64_t B, int64_t T);
  // After the head: every layer, then the embedding (embed_held: its gradients are held since
  // a whole tied head's loss).
  void layers_backward(const StepViews& s, bool embed_held);
  // d_resid = d(x_final) from d(xn_final) in d_norm, the final norm's weight gradient added.
  void final_norm_backward(const StepViews& s);
  // The LM head + loss over xn_final (vocabulary-parallel under tp), the caller holding the
  // head's units (and, with grad_scale, their gradients): the loss, and with gradients the
  // head's weight gradient and d_resid = d(x_final) through the final norm (this rank's rows
  // under sequence parallelism). Shared by forward_backward / forward_loss and the stages.
  LossResult head_loss(const StepViews& s, bool with_grads, float grad_scale);
  // The embedding's gradient from d_resid (d of layer 0's input), then unit 0's gradients
  // released; held: the caller acquired them (the tied head's, held since the head loss),
  // else acquired here.
  void embedding_backward(const StepViews& s, bool held);
  void layer_backward(int l, const StepViews& s);
  // Before layer l's backward: its kept tensors in its slot, fetched from the host or
  // recomputed from its segment's start (checkpoint_map.h); the next segment's start, if on
  // the host, fetched a layer ahead.
  void restore_checkpoints(int l, const StepViews& s);
  void fetch_checkpoints(int l, const StepViews& s, bool wait);
  void prefetch_checkpoints(int l, const StepViews& s);
  int checkpoint_slot(int l) const { return opt_.backward ? checkpoint_map_.slot(l) : 0; }
  Workspace workspace() const { return {workspace_.data(), workspace_.bytes()}; }

  ModelConfig cfg_;
  ModelOptions opt_;
  ParamLayout layout_;
  Backend& be_;
  MemoryLedger& ledger_;

  std::unique_ptr<OwnedStore> owned_;  // the model's own store, unless the caller gave one
  std::unique_ptr<Nf4Store> nf4_;      // or, for an NF4 base, this one
  std::unique_ptr<ShardedBaseStore> sharded_base_;  // or, for a dense base sharded, this one
  ParamStore* store_ = nullptr;
  std::unique_ptr<LocalAttention> own_attention_;  // unless the caller gave a core
  AttentionCore* attention_ = nullptr;
  SingleRankSeam single_rank_;       // the seam unless the caller gave the tp group's
  TensorSeam* seam_ = nullptr;       // never null
  std::vector<Tensor> unit_params_;  // per unit: what acquire_params returned (while held)
  std::vector<Tensor> unit_grads_;   // per unit: what acquire_grads returned (while held)
  std::vector<int64_t> unit_base_;   // per unit: the arena offset of the acquired params
  std::vector<int64_t> grad_base_;   // per unit: the arena offset of the acquired gradients
  std::vector<std::vector<UnitPiece>> unit_pieces_;  // per unit: as the store hands it out
  Buffer staging_;        // one unit in the activation dtype when the parameters differ (workspace)
  int staged_ = -1;       // the unit staging_ holds, -1 nothing
  int staged_piece_ = 0;  // and which of its pieces
  Buffer inv_freq_;       // [R/2] f32 (params: a constant of the model)
  Buffer inv_freq_local_;  // [R/2] f32 of the local layers (Gemma's pattern only; params)
  Buffer checkpoints_;     // kept tensors of the map's device slots (checkpoints, device)
  Buffer offloaded_;       // the host layers' kept tensors per pipeline slot (checkpoints, host)
  Buffer activations_;     // the layers' shared work set + the model's saved tensors (activations)
  Buffer transient_;   // backward scratch and the MLP chunk, reused by every layer (activations)
  Buffer workspace_;   // kernel scratch: max of attention and loss needs (workspace)
  Buffer logps_host_;  // read_target_logps' rows (target_logps_host_bytes; host, activations)
  size_t kept_stride_ = 0;        // bytes of one layer's kept tensors (at max B, T)
  size_t work_bytes_ = 0;         // bytes of the work set in activations_ (at max B, T)
  CheckpointMap checkpoint_map_;  // where each layer's kept tensors wait (with a backward)
  int slots_ = 0;                 // layers' worth of kept tensors on the device
  // [pipeline_slots][slots_] the layer whose kept tensors a device slot holds, -1 none: each
  // micro-batch in flight (pipeline slot) walks its own device slots.
  std::vector<int> slot_layer_;
  // [pipeline_slots][slots_] each device slot's last copy (Backend::copy_async: an offload or a
  // prefetch), waited for before the slot is read or written again.
  std::vector<uint64_t> slot_fence_;
  // Device slot i of the pipeline slot in use (slot_).
  int& slot_layer(int i) { return slot_layer_[size_t(slot_) * slots_ + i]; }
  uint64_t& slot_fence(int i) { return slot_fence_[size_t(slot_) * slots_ + i]; }
  std::vector<std::unique_ptr<StepViews>> views_;  // [pipeline_slots]: each slot's views
  int slot_ = 0;                                   // the slot bind() carves (pipeline stages)
  size_t saved_bytes_ = 0;  // bytes of one slot's model-saved tensors (at max B, T)

  // LoRA
  LoraLayout lora_layout_;
  std::unique_ptr<OwnedStore> owned_adapters_;  // unless the caller gave an adapter store
  ParamStore* adapters_ = nullptr;
  std::vector<Tensor> unit_adapters_;  // per layer: acquired adapters [unit], activation dtype
  // One layer's adapters in the activation dtype when it is not f32 (workspace)
  Buffer adapter_staging_;
  std::vector<Tensor> unit_adapter_grads_;  // per layer: acquired adapter gradients
  Buffer lora_scratch_;                     // lora_transients (activations)
  // Flat views of lora_scratch_ (activation dtype): s u and its gradient [N * r]; with
  // lora.dropout > 0 the update's input gradient before its mask and the dropped-out input
  // [N * max_in] (empty otherwise).
  struct LoraScratch {
    Tensor u, du, dx, x;
  } lora_views_;
  Buffer discard_grads_;         // [D] f32: frozen norms' gradients, never read (workspace)
  bool dropout_active_ = false;  // inside forward_backward with lora.dropout > 0
  bool adapters_off_ = false;    // inside forward_target_logps(base_only): the frozen base alone
  uint64_t dropout_key_ = 0;
  int64_t dropout_token0_ = 0;
};

}  // namespace shardlm
