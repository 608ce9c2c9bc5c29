// Building a LlamaModel: its own attention core, the kernel workspace it sizes, the checks on
// its options and seams, the buffers allocated once from the layout's size tables (parameters,
// gradients, activations, staging), and the parameter access that checkpoints, weight init and
// the stores go through. The step itself is in llama.cpp.
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
  // Every layer's window: a backend preparing per-window kernels prepares them all here.
  const size_t attention = own_attention ? backend.attention_plan_workspace_bytes(
                                               B, T, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim(),
                                               cfg.attention_windows())
                                         : 0;
  // Whole, the fused kernel's scratch; a store may hand the head out in pieces (llama_head.cpp),
  // whose scratch is counted too, so the plan need not know the store's choice.
  // Preference objectives walk the head as the pieced loss does (a tp shard: its one slice),
  // every token's statistics kept, then the token weights.
  const size_t walks = pieced_loss_workspace_bytes(backend, cfg, opt) +
                       (opt.token_weights ? token_weights_bytes(opt) : 0);
  const size_t loss =
      cfg.tp_shards > 1
          ? std::max(vocab_parallel_workspace_bytes(backend, cfg, chunk, opt.activation_dtype),
                     opt.token_weights ? walks : 0)
          : std::max(
                backend.lm_head_loss_workspace_bytes(chunk, cfg.vocab_size, opt.activation_dtype),
                walks);
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
        /*split_tables=*/cfg_.tp_shards == 1, opt.lora.prefetch_base, *seams.base_shards, backend,
        ledger);
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
  if (opt.token_weights && cfg_.holds_head())
    logps_host_ = Buffer(backend, ledger, MemCategory::kActivations, MemPool::kHost,
                         target_logps_host_bytes(opt));
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

DenseShardGatherCounts LlamaModel::base_gather_counts() const {
  return sharded_base_ != nullptr ? sharded_base_->gather_counts() : DenseShardGatherCounts{};
}

void LlamaModel::zero_grads() {
  if (lora())
    be_.zero(lora_grads());
  else
    be_.zero(grads());
}

}  // namespace shardlm
