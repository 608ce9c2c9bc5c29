// LlamaModel: a Llama-family decoder with explicit per-layer forward and backward over the
// Backend interface. It owns its parameter, gradient and activation arenas (sized from
// model/layout) and knows nothing of parallelism or optimizers: the trainer reads params()
// and grads() and the parallel strategies wrap it.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "shardlm/backend/backend.h"
#include "shardlm/core/buffer.h"
#include "shardlm/model/config.h"
#include "shardlm/model/layout.h"

namespace shardlm {

struct ModelOptions {
  DType param_dtype = DType::kF32;   // working copy of the weights: f32 or bf16
  int64_t max_batch = 1;             // B: sequences per micro-batch
  int64_t max_seq = 256;             // T: tokens per sequence
  int64_t loss_chunk_tokens = 1024;  // rows of the fused LM head + loss per chunk
};

// One micro-batch's inputs, views into the model's own input buffers; fill, then call.
struct BatchInputs {
  Tensor tokens;     // [B*T] i32
  Tensor targets;    // [B*T] i32, kIgnoreIndex where no loss is taken
  Tensor positions;  // [B*T] i32, position within the token's document (RoPE)
  Tensor seg_start;  // [B*T] i32, index in its row where the token's document starts
};

class LlamaModel {
 public:
  LlamaModel(const ModelConfig& cfg, const ModelOptions& opt, Backend& backend,
             MemoryLedger& ledger);
  ~LlamaModel();
  LlamaModel(const LlamaModel&) = delete;
  LlamaModel& operator=(const LlamaModel&) = delete;

  const ModelConfig& config() const { return cfg_; }
  const ParamLayout& layout() const { return layout_; }
  const ModelOptions& options() const { return opt_; }
  // The backend and ledger the model allocates and computes through (for KvDecoder).
  Backend& backend() const { return be_; }
  MemoryLedger& ledger() const { return ledger_; }

  // GPT-2/Llama style init: N(0, 0.02), output projections N(0, 0.02/sqrt(2L)), norms 1.
  // Writes f32 values through `master` (f32, [total]) when given, else the params directly.
  void init_weights(uint64_t seed, const Tensor& master = Tensor());

  // Working parameters [total] (param_dtype) and f32 gradients [total].
  Tensor params() const { return params_.view(opt_.param_dtype, {layout_.total}); }
  Tensor grads() const { return grads_.view(DType::kF32, {layout_.total}); }
  void zero_grads();

  // Views of the input buffers for a micro-batch of B x T (B <= max_batch, T <= max_seq).
  BatchInputs inputs(int64_t B, int64_t T);

  // Forward and backward of one micro-batch; gradients accumulate into grads(), scaled so
  // that the step's loss is grad_scale * (sum of token losses). Returns the loss sum.
  LossResult forward_backward(int64_t B, int64_t T, float grad_scale);
  // Forward and loss only (evaluation).
  LossResult forward_loss(int64_t B, int64_t T);
  // Logits of the last position of row 0 after a forward of B=1, T tokens: [V] f32 host.
  void forward_last_logits(int64_t T, std::vector<float>& logits);

  // Bytes of kernel scratch (max of attention and loss needs) held in the workspace arena.
  size_t kernel_workspace_bytes() const { return workspace_.bytes(); }

 private:
  struct LayerActs;                             // views of one layer's saved activations
  struct Transients;                            // views of the backward scratch
  struct StepViews;                             // every view of a step at one (B, T)
  const StepViews& bind(int64_t B, int64_t T);  // re-carves only when (B, T) changes
  Tensor weight(int64_t offset, Shape shape);   // f32 view (staged from bf16 if needed)
  Tensor grad(int64_t offset, Shape shape) const;
  Tensor final_norm_weight(const StepViews& s);  // f32 view of model.norm.weight
  void stage_layer(int l);                       // bf16 -> f32 staging of layer l
  void forward_layers(int64_t B, int64_t T);
  void layer_forward(int l, const StepViews& s);
  void layer_backward(int l, const StepViews& s);
  Workspace workspace() const { return {workspace_.data(), workspace_.bytes()}; }

  ModelConfig cfg_;
  ModelOptions opt_;
  ParamLayout layout_;
  Backend& be_;
  MemoryLedger& ledger_;

  Buffer params_;     // [total] param_dtype (params)
  Buffer grads_;      // [total] f32 (grads)
  Buffer staging_;    // f32 copy of one layer / the embeddings when params are bf16 (workspace)
  int staged_ = -3;   // what staging_ holds: layer index, -1 embed, -2 head, -3 nothing
  Buffer inv_freq_;   // [Dh/2] f32 (params: a constant of the model)
  Buffer saved_;      // all layers' saved activations + the model's (activations)
  Buffer transient_;  // backward scratch, reused by every layer (activations)
  Buffer workspace_;  // kernel scratch: max of attention and loss needs (workspace)
  size_t layer_stride_ = 0;  // bytes of one layer's saved activations in saved_ (at max B, T)
  std::unique_ptr<StepViews> views_;
};

}  // namespace shardlm
