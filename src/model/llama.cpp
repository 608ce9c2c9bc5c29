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
// llama_units.cpp.
#include "shardlm/model/llama.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <random>
#include <utility>

#include "llama_views.h"
#include "nf4_store.h"
#include "owned_store.h"
#include "sharded_base_store.h"
#include "vocab_parallel.h"

namespace shardlm {

DocumentSpans LlamaModel::documents(const StepViews& s) {
  if (s.doc_count == 0) return {};
  return {s.in.doc_starts.view({s.B * s.T + 1}), s.doc_count, s.doc_max_len};
}

// The model's own attention core: the backend's kernel over the whole sequence, its scratch in
// the model's workspace, with each layer's sliding window (ModelConfig::window_of_layer) and the
// model's attention soft cap.
class LlamaModel::LocalAttention final : public AttentionCore {
 public:
  LocalAttention(Backend& backend, const Buffer& workspace, const ModelConfig& cfg)
      : be_(backend), ws_(workspace), cfg_(cfg) {}
  void forward(int layer, const Tensor& q, const Tensor& k, const Tensor& v,
               const Tensor& seg_start, const DocumentSpans& docs, const Tensor& out,
               const Tensor& lse) override {
    be_.attention_forward(q, k, v, seg_start, out, lse, {ws_.data(), ws_.bytes()}, docs,
                          cfg_.window_of_layer(layer), float(cfg_.attn_softcap));
  }
  void backward(int layer, const Tensor& q, const Tensor& k, const Tensor& v,
                const Tensor& seg_start, const DocumentSpans& docs, const Tensor& out,
                const Tensor& lse, const Tensor& dout, const Tensor& dq, const Tensor& dk,
                const Tensor& dv) override {
    be_.attention_backward(q, k, v, seg_start, out, lse, dout, dq, dk, dv,
                           {ws_.data(), ws_.bytes()}, docs, cfg_.window_of_layer(layer),
                           float(cfg_.attn_softcap));
  }

 private:
  Backend& be_;
  const Buffer& ws_;
  const ModelConfig& cfg_;
};

size_t model_kernel_workspace_bytes(const Backend& backend, const ModelConfig& cfg,
                                    const ModelOptions& opt, bool own_attention) {
  const int64_t B = opt.max_batch, T = opt.max_seq;
  const int64_t chunk = std::min<int64_t>(opt.loss_chunk_tokens, B * T);
  const size_t attention = own_attention ? backend.attention_workspace_bytes(
                                               B, T, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim())
                                         : 0;
  // Whole, the fused kernel's scratch; a store may hand the head out in pieces (llama_head.cpp),
  // whose scratch is counted too, so the plan need not know the store's choice.
  const size_t loss =
      cfg.tp_shards > 1 ? vocab_parallel_workspace_bytes(backend, cfg, chunk, opt.activation_dtype)
                        : std::max(backend.lm_head_loss_workspace_bytes(chunk, cfg.vocab_size,
                                                                        opt.activation_dtype),
                                   pieced_loss_workspace_bytes(backend, cfg, opt));
  return std::max(attention, loss);
}

void initial_weights(const ModelConfig& cfg, const ParamLayout& layout, uint64_t seed,
                     const std::function<void(int unit, const float* values)>& sink) {
  // One generator over the entries in arena order, whatever the units: the values of a unit
  // depend only on the seed and the layout.
  std::mt19937_64 rng(seed);
  std::vector<float> host(layout.max_unit);
  const double std_out = 0.02 / std::sqrt(2.0 * cfg.n_layers);
  size_t e = 0;
  for (int u = 0; u < int(layout.units.size()); ++u) {
    const int64_t begin = layout.units[u].begin, end = layout.units[u].end;
    for (; e < layout.entries.size() && layout.entries[e].offset < end; ++e) {
      const ParamEntry& entry = layout.entries[e];
      float* p = host.data() + (entry.offset - begin);
      const int64_t n = entry.shape.numel();
      const bool is_norm = entry.name.find("norm") != std::string::npos;
      const bool is_bias = entry.name.ends_with(".bias");
      const bool is_out = entry.name.find("o_proj") != std::string::npos ||
                          entry.name.find("down_proj") != std::string::npos;
      std::normal_distribution<float> dist(0.f, is_out ? float(std_out) : 0.02f);
      // A norm starts as the identity: w = 1, or w = 0 with Gemma's (1 + w).
      const float norm_init = cfg.norm_one_plus_weight ? 0.f : 1.f;
      for (int64_t i = 0; i < n; ++i) p[i] = is_norm ? norm_init : is_bias ? 0.f : dist(rng);
    }
    sink(u, host.data());
  }
}

LlamaModel::~LlamaModel() = default;

LlamaModel::LlamaModel(const ModelConfig& cfg, const ModelOptions& opt, Backend& backend,
                       MemoryLedger& ledger, const ModelSeams& seams)
    : cfg_(cfg),
      opt_(opt),
      layout_(make_param_layout(cfg)),
      be_(backend),
      ledger_(ledger),
      checkpoint_map_(cfg_, opt_.checkpointing, opt_.checkpoint_placement) {
  cfg_.validate();
  check_options(seams);
  seam_ = seams.tp != nullptr ? seams.tp : &single_rank_;
  for (int k = 0; k < opt.pipeline_slots; ++k) views_.push_back(std::make_unique<StepViews>());
  store_ = seams.store;
  if (store_ == nullptr && lora() && opt.lora.nf4_base) {
    nf4_ = std::make_unique<Nf4Store>(layout_, opt.param_dtype, opt.lora.offload_base,
                                      /*split_tables=*/cfg_.tp_shards == 1, seams.base_shards,
                                      backend, ledger);
    store_ = nf4_.get();
  } else if (store_ == nullptr && seams.base_shards != nullptr) {
    sharded_base_ = std::make_unique<ShardedBaseStore>(
        layout_, opt.param_dtype, opt.lora.offload_base,
        /*split_tables=*/cfg_.tp_shards == 1, *seams.base_shards, backend, ledger);
    store_ = sharded_base_.get();
  } else if (store_ == nullptr) {
    // A frozen base (LoRA) holds parameters only.
    owned_ = std::make_unique<OwnedStore>(layout_, opt.param_dtype,
                                          opt.activations && opt.backward && !lora(),
                                          lora() && opt.lora.offload_base,
                                          /*split_tables=*/cfg_.tp_shards == 1, backend, ledger);
    store_ = owned_.get();
  }
  if (lora()) open_adapters(seams.adapters);
  const size_t n_units = layout_.units.size();
  unit_params_.resize(n_units);
  unit_grads_.resize(n_units);
  unit_base_.assign(n_units, 0);
  grad_base_.assign(n_units, 0);
  for (int u = 0; u < int(n_units); ++u) {
    unit_pieces_.push_back(unit_pieces(layout_, u, store_->piece_rows(u)));
    SHARDLM_CHECK(cfg_.tp_shards == 1 || !in_pieces(u),
                  "the store hands unit {} out in pieces, but the vocabulary-parallel embedding "
                  "and loss of a tensor-parallel shard use the whole slice",
                  u);
  }
  const std::vector<float> inv = rope_inv_freq(cfg_);
  inv_freq_ = Buffer(backend, ledger, MemCategory::kParams, MemPool::kDevice, inv.size() * 4);
  be_.copy(
      Tensor(const_cast<float*>(inv.data()), DType::kF32, {int64_t(inv.size())}, MemPool::kHost),
      inv_freq_.view(DType::kF32, {int64_t(inv.size())}));
  if (cfg_.global_layer_every > 0) {  // Gemma's local layers rotate with a base of their own
    const std::vector<float> local = rope_inv_freq(cfg_, /*local=*/true);
    inv_freq_local_ =
        Buffer(backend, ledger, MemCategory::kParams, MemPool::kDevice, local.size() * 4);
    be_.copy(Tensor(const_cast<float*>(local.data()), DType::kF32, {int64_t(local.size())},
                    MemPool::kHost),
             inv_freq_local_.view(DType::kF32, {int64_t(local.size())}));
  }

  attention_ = seams.attention;
  if (!opt.activations) return;  // parameters only: nothing below is needed
  // The acquired unit in the activation dtype (only a model that runs forward acquires units).
  if (opt.param_dtype != opt.activation_dtype)
    staging_ = Buffer(backend, ledger, MemCategory::kWorkspace, MemPool::kDevice,
                      layout_.max_unit * dtype_size(opt.activation_dtype));
  allocate_activations();
  if (attention_ == nullptr) {
    own_attention_ = std::make_unique<LocalAttention>(backend, workspace_, cfg_);
    attention_ = own_attention_.get();
  }
  // Every slot's views carved once at the largest micro-batch: the layout tables and the
  // structs that unpack them are checked to agree before the first step.
  for (slot_ = 0; slot_ < opt.pipeline_slots; ++slot_) bind(opt.max_batch, opt.max_seq);
  slot_ = 0;
}

void LlamaModel::check_options(const ModelSeams& seams) const {
  const bool lora = opt_.lora.enabled();
  SHARDLM_CHECK(opt_.param_dtype == DType::kF32 || opt_.param_dtype == DType::kBF16,
                "parameters must be f32 or bf16");
  SHARDLM_CHECK(opt_.activation_dtype == DType::kF32 || opt_.activation_dtype == DType::kBF16,
                "activations must be f32 or bf16, got {}", dtype_name(opt_.activation_dtype));
  SHARDLM_CHECK((cfg_.tp_shards > 1) == (seams.tp != nullptr),
                "a tensor-parallel shard (tp_shards = {}) needs a TensorSeam, and only it",
                cfg_.tp_shards);
  // (The group's size is checked where the vocabulary is split, vocab_slice.)
  SHARDLM_CHECK(seams.tp == nullptr || seams.tp->splits_rows() == (cfg_.seq_shards() > 1),
                "the TensorSeam {} the residual stream's rows but the shard has "
                "sequence_parallel = {} with tp_shards = {}",
                seams.tp && seams.tp->splits_rows() ? "splits" : "does not split",
                cfg_.sequence_parallel, cfg_.tp_shards);
  SHARDLM_CHECK(opt_.pipeline_slots >= 1, "pipeline_slots = {} must be >= 1", opt_.pipeline_slots);
  const CheckpointPlacement& placed = opt_.checkpoint_placement;
  const bool placed_off_device = placed.host_layers > 0 || placed.every > 1;
  SHARDLM_CHECK(!lora || opt_.lora.targets != 0, "LoRA needs at least one target projection");
  SHARDLM_CHECK(!opt_.lora.nf4_base || (lora && seams.store == nullptr),
                "an NF4 base is a frozen LoRA base in the model's own store (no caller's store)");
  SHARDLM_CHECK(seams.base_shards == nullptr || (lora && seams.store == nullptr),
                "a base's shards (ModelSeams::base_shards) need a frozen LoRA base in the "
                "model's own store");
  if (!opt_.activations) return;
  SHARDLM_CHECK(opt_.mlp_chunk_tokens >= 1, "mlp_chunk_tokens = {} must be >= 1",
                opt_.mlp_chunk_tokens);
  SHARDLM_CHECK(opt_.backward || (!lora && !placed_off_device && cfg_.whole_pipeline()),
                "a forward-only model (ModelOptions::backward = false) takes no LoRA, checkpoint "
                "placement or pipeline stage");
}

void LlamaModel::open_adapters(ParamStore* adapters) {
  lora_layout_ = make_lora_layout(cfg_, opt_.lora);
  if (adapters == nullptr) {
    owned_adapters_ = std::make_unique<OwnedStore>(lora_layout_.params, DType::kF32,
                                                   opt_.activations, /*on_host=*/false,
                                                   /*split_tables=*/false, be_, ledger_);
    adapters = owned_adapters_.get();
  }
  adapters_ = adapters;
  unit_adapters_.resize(cfg_.n_layers);
  unit_adapter_grads_.resize(cfg_.n_layers);
}

// The activation arenas at the largest micro-batch, sized by the layout's tables.
void LlamaModel::allocate_activations() {
  const int64_t B = opt_.max_batch, T = opt_.max_seq;
  const DType act = opt_.activation_dtype;
  const LayerActivationSpecs specs =
      layer_activation_specs(cfg_, B, T, opt_.mlp_chunk_tokens, opt_.checkpointing, act);
  kept_stride_ = arena_bytes(specs.kept);
  work_bytes_ = arena_bytes(specs.work);
  // Forward only: a layer's kept tensors are dead once the next layer has its input, so one
  // slot serves every layer.
  slots_ = opt_.backward ? checkpoint_map_.device_slots() : 1;
  slot_layer_.assign(size_t(slots_) * opt_.pipeline_slots, -1);
  slot_fence_.assign(size_t(slots_) * opt_.pipeline_slots, 0);
  checkpoints_ = Buffer(be_, ledger_, MemCategory::kCheckpoints, MemPool::kDevice,
                        kept_stride_ * slots_ * opt_.pipeline_slots);
  if (opt_.backward && checkpoint_map_.host_layers() > 0)
    offloaded_ = Buffer(be_, ledger_, MemCategory::kCheckpoints, MemPool::kHost,
                        kept_stride_ * checkpoint_map_.host_layers() * opt_.pipeline_slots);
  saved_bytes_ = arena_bytes(model_saved_activations(cfg_, B, T, opt_.checkpointing, act));
  activations_ = Buffer(be_, ledger_, MemCategory::kActivations, MemPool::kDevice,
                        work_bytes_ + saved_bytes_ * opt_.pipeline_slots);
  transient_ = Buffer(be_, ledger_, MemCategory::kActivations, MemPool::kDevice,
                      arena_bytes(transient_specs(B, T)));
  workspace_ = Buffer(be_, ledger_, MemCategory::kWorkspace, MemPool::kDevice,
                      model_kernel_workspace_bytes(be_, cfg_, opt_, attention_ == nullptr));
  if (!lora()) return;
  const std::vector<TensorSpec> lora_specs = lora_transients(cfg_, opt_.lora, B, T, act);
  lora_scratch_ =
      Buffer(be_, ledger_, MemCategory::kActivations, MemPool::kDevice, arena_bytes(lora_specs));
  NamedViews lv(lora_scratch_.data(), lora_scratch_.pool(), lora_specs);
  auto flat = [&](std::string_view name) {
    if (!lv.has(name)) return Tensor();
    const Tensor t = lv.get(name);
    return t.view({t.numel()});
  };
  lora_views_ = {flat("lora_u"), flat("lora_du"), flat("lora_dx"), flat("lora_x")};
  lv.check_all_used("lora_transients");
  discard_grads_ = Buffer(be_, ledger_, MemCategory::kWorkspace, MemPool::kDevice,
                          std::max(cfg_.dim, cfg_.head_dim()) * 4);
  if (act != DType::kF32)
    adapter_staging_ = Buffer(be_, ledger_, MemCategory::kWorkspace, MemPool::kDevice,
                              lora_layout_.params.max_unit * dtype_size(act));
}

Tensor LlamaModel::params() const {
  SHARDLM_CHECK(owned_ != nullptr,
                "params(): this model's parameters live in a caller's store, in NF4 or sharded "
                "(read them with read_base_unit)");
  return owned_->params();
}

Tensor LlamaModel::grads() const {
  SHARDLM_CHECK(owned_ != nullptr, "grads(): this model's gradients live in a caller's store");
  return owned_->grads();
}

Tensor LlamaModel::lora_params() const {
  SHARDLM_CHECK(owned_adapters_ != nullptr, "lora_params(): the adapters live in a caller's store");
  return owned_adapters_->params();
}

Tensor LlamaModel::lora_grads() const {
  SHARDLM_CHECK(owned_adapters_ != nullptr, "lora_grads(): the adapters live in a caller's store");
  return owned_adapters_->grads();
}

void LlamaModel::init_weights(uint64_t seed) {
  initial_weights(cfg_, layout_, seed,
                  [&](int u, const float* values) { set_base_unit(u, values); });
}

void LlamaModel::set_base_unit(int u, const float* values, std::span<const Nf4Matrix> nf4) {
  if (nf4_ != nullptr) return nf4_->set_unit_values(u, values, nf4);
  if (sharded_base_ != nullptr) return sharded_base_->set_unit_values(u, values);
  const int64_t n = layout_.unit_size(u);
  be_.convert(Tensor(const_cast<float*>(values), DType::kF32, {n}, MemPool::kHost),
              params().rows(layout_.units[u].begin, n));
}

void LlamaModel::read_base_unit(int u, float* values) {
  const int64_t n = layout_.unit_size(u);
  const Tensor host(values, DType::kF32, {n}, MemPool::kHost);
  if (owned_ != nullptr) return be_.convert(params().rows(layout_.units[u].begin, n), host);
  // Through the NF4 or sharded base's store, which in host memory hands the tables out in
  // pieces.
  SHARDLM_CHECK(nf4_ != nullptr || sharded_base_ != nullptr,
                "read_base_unit(): this model's parameters live in a caller's store");
  const std::vector<UnitPiece> pieces = unit_pieces(layout_, u, store_->piece_rows(u));
  for (int k = 0; k < int(pieces.size()); ++k) {
    const UnitPiece& p = pieces[k];
    be_.convert(store_->acquire_piece_params(u, k),
                host.rows(p.begin - layout_.units[u].begin, p.end - p.begin));
    store_->release_piece_params(u, k);
  }
}

void LlamaModel::zero_grads() {
  if (lora())
    be_.zero(lora_grads());
  else
    be_.zero(grads());
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

void LlamaModel::attention_block_forward(int l, const StepViews& s, bool run_attention) {
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
  be_.rope_qk_forward(a.q.view({N, Hq, Dh}), a.k.view({N, Hkv, Dh}), s.in.positions, inv_freq);
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
  if (seam_->row_output_is_local() && !cfg_.post_norms) {
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
  be_.add(a.x_mid, a.x_in, a.x_mid);
}

void LlamaModel::layer_forward(int l, const StepViews& s) {
  attention_block_forward(l, s, /*run_attention=*/true);
  mlp_forward(l, s);
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
    for (int j = from; j < l; ++j) forward_layer(j, s, /*for_backward=*/false);
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
  be_.rope_qk_backward(t.d_q.view({N, Hq, Dh}), t.d_k.view({N, Hkv, Dh}), s.in.positions, inv_freq);
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

LossResult LlamaModel::forward_backward(int64_t B, int64_t T, float grad_scale) {
  SHARDLM_CHECK(opt_.backward, "this model runs forward only (ModelOptions::backward = false)");
  dropout_active_ = lora() && opt_.lora.dropout > 0;
  begin_pass(ParamStore::Pass::kForward);
  forward_layers(B, T, /*for_backward=*/true);
  const StepViews& s = bind(B, T);
  final_norm_unit_forward(s);
  end_pass();

  begin_pass(ParamStore::Pass::kBackward);
  const LossResult loss = head_loss_backward(s, grad_scale);
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
  if (!lora()) embedding_backward(s, /*held=*/layout_.lm_head_unit == 0 && !in_pieces(0));
  end_pass();
  dropout_active_ = false;
  return loss;
}

void LlamaModel::forward_layers_only(int64_t B, int64_t T) {
  begin_pass(ParamStore::Pass::kForward);
  forward_layers(B, T, /*for_backward=*/false);
  end_pass();
}

}  // namespace shardlm
