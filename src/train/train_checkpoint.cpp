// TrainRun's checkpoints, resume side and sampling: the checks that a checkpoint belongs to
// this run, the loop's progress restored, and the sampler's whole model on rank 0 (read from
// the final checkpoint, or gathered: the tp gather and the LoRA adapters' merge). Saving and
// loading the state vectors is train_checkpoint_shards.cpp's; the on-disk format is
// checkpoint.cpp's.
#include <algorithm>
#include <cstring>

#include "shardlm/train/hf.h"
#include "shardlm/train/plan_inputs.h"
#include "train_run.h"

namespace shardlm::trainer_detail {
namespace {

// The layer functions a model computes beyond its shape (Gemma's): resuming with others would
// train another function on the same tensors. Rotary bases and windows may change on purpose
// (context extension) and are not compared.
bool same_layer_functions(const ModelConfig& a, const ModelConfig& b) {
  return a.post_norms == b.post_norms && a.mlp_activation == b.mlp_activation &&
         a.norm_one_plus_weight == b.norm_one_plus_weight && a.embed_scale == b.embed_scale &&
         a.query_pre_attn_scalar == b.query_pre_attn_scalar && a.attn_softcap == b.attn_softcap &&
         a.final_softcap == b.final_softcap && a.global_layer_every == b.global_layer_every;
}

// A checkpoint resumes only the model it was trained as: the same shape, layer functions and
// parameter dtype.
void check_resumed_model(const CheckpointReader& ckpt, const StoredModel& stored,
                         const ModelConfig& model, DType param_dtype) {
  if (stored.param_dtype != param_dtype || stored.config.dim != model.dim ||
      stored.config.n_layers != model.n_layers || stored.config.vocab_size != model.vocab_size ||
      stored.config.ffn_dim != model.ffn_dim || stored.config.n_heads != model.n_heads ||
      stored.config.n_kv_heads != model.n_kv_heads ||
      stored.config.tie_embeddings != model.tie_embeddings ||
      stored.config.attn_bias != model.attn_bias || stored.config.qk_norm != model.qk_norm ||
      stored.config.head_dim() != model.head_dim() || !same_layer_functions(stored.config, model))
    SHARDLM_FAIL(ErrorKind::kConfig,
                 "train.resume: {} holds a different model or parameter dtype than the config; "
                 "resume with the config it was trained with, or set train.resume = \"none\"",
                 ckpt.dir());
}

// LoRA settings and base in words, for the message naming both sides of a mismatch.
std::string lora_description(const LoraConfig& lora, const std::string& base_dir) {
  return fmt::format("LoRA rank {}, alpha {}, dropout {}, targets {}, base '{}'{}", lora.rank,
                     lora.alpha, lora.dropout, lora_targets_string(lora.targets), base_dir,
                     lora.nf4_base ? " in nf4" : "");
}

}  // namespace

void TrainRun::resume_if_asked() {
  // The ranks pick and verify the checkpoint together, then every rank reads just the parts
  // of the flat vectors it holds. The vectors do not depend on the grid or the ZeRO stage, so
  // any checkpoint resumes on any.
  const Clock::time_point t0 = Clock::now();
  const std::string chosen = choose_checkpoint((dir_ / "checkpoints").string());
  if (chosen.empty()) return;
  const CheckpointReader ckpt(chosen, CheckpointReader::Verify::kSizesOnly);  // verified above
  const json state = ckpt.read_json("state.json");
  const std::string where = ckpt.dir() + "/state.json";
  try {
    const StoredModel stored = read_stored_model(ckpt);
    check_resumed_model(ckpt, stored, cfg_.model, model_->options().param_dtype);
    check_resumed_lora(ckpt, stored);
    check_resumed_data(ckpt, state);
    load_resumed_state(ckpt);
    restore_progress(state);
  } catch (const json::exception& e) {
    SHARDLM_FAIL(ErrorKind::kData, "{}: {}", where, e.what());
  }
  last_checkpoint_ = ckpt.dir();
  out_ << fmt::format("resume: continuing from {} (step {} of {}; verified and read in {:.3f} s)\n",
                      ckpt.dir(), step_, total_steps_, seconds_since(t0));
}

// The adapters resume only under the same lora.* keys and on the same base model.
void TrainRun::check_resumed_lora(const CheckpointReader& ckpt, const StoredModel& stored) const {
  const StoredLoraBase base = lora_base();
  if (stored.lora.rank != lora_.rank || stored.lora.alpha != lora_.alpha ||
      stored.lora.dropout != lora_.dropout || stored.lora.targets != lora_.targets ||
      stored.lora.nf4_base != lora_.nf4_base ||
      (lora_.enabled() &&
       (stored.lora_base.hf_dir != base.hf_dir || stored.lora_base.init_seed != base.init_seed)))
    SHARDLM_FAIL(ErrorKind::kConfig,
                 "train.resume: {} was trained with {} and this config asks for {}; resume "
                 "with the same lora.* keys (and the same base: model.hf_dir, train.seed), or "
                 "set train.resume = \"none\"",
                 ckpt.dir(),
                 stored.lora.enabled() ? lora_description(stored.lora, stored.lora_base.hf_dir)
                                       : std::string("no LoRA (full fine-tuning)"),
                 lora_.enabled() ? lora_description(lora_, base.hf_dir) : std::string("no LoRA"));
}

// The data order continues only over the same tokens, windows, seed and global batch.
void TrainRun::check_resumed_data(const CheckpointReader& ckpt, const json& state) const {
  const json& data = state.at("data");
  if (data.at("tokens").get<int64_t>() != train_set_->num_tokens() ||
      data.at("seq_len").get<int64_t>() != T_ ||
      data.at("rows_per_step").get<int64_t>() != B_ * accum_ * dp_size_ ||
      state.at("seed").get<uint64_t>() != cfg_.train.seed)
    SHARDLM_FAIL(ErrorKind::kConfig,
                 "train.resume: {} was trained on other data or batch settings (tokens, "
                 "data.seq_len, train.seed and the global batch train.micro_batch x "
                 "train.grad_accum x ranks = {} must match; it has {} sequences per step); "
                 "set train.resume = \"none\" to start over",
                 ckpt.dir(), B_ * accum_ * dp_size_, data.at("rows_per_step").get<int64_t>());
}

// The optimizer's step count and the loop's counters and curves, as state.json has them.
void TrainRun::restore_progress(const json& state) {
  zero_->set_steps_taken(state.at("optimizer_steps").get<int64_t>());
  step_ = state.at("step").get<int64_t>();
  tokens_seen_ = state.at("tokens_seen").get<int64_t>();
  tokens_per_epoch_ = state.at("tokens_per_epoch").get<std::vector<int64_t>>();
  loss_points_ = state.at("loss_points").get<std::vector<std::pair<double, double>>>();
  eval_points_ = state.at("eval_points").get<std::vector<std::pair<double, double>>>();
}

StoredLoraBase TrainRun::lora_base() const {
  StoredLoraBase b;
  if (!lora_.enabled()) return b;
  if (!cfg_.model_hf_dir.empty())
    b.hf_dir = fs::absolute(cfg_.model_hf_dir).lexically_normal().string();
  else
    b.init_seed = cfg_.train.seed;
  return b;
}

void TrainRun::slice_unit(const ParamLayout& whole_layout, const ParamLayout& shard_layout,
                          const std::vector<ShardPiece>& pieces, int u, const float* whole,
                          float* shard) {
  const int64_t wb = whole_layout.units[u].begin, we = whole_layout.units[u].end;
  const int64_t sb = shard_layout.units[u].begin;
  for (const ShardPiece& p : pieces)
    if (p.full >= wb && p.full < we)
      std::copy_n(whole + (p.full - wb), p.count, shard + (p.shard - sb));
}

void TrainRun::save_state(ZeroEngine::State s,
                          const std::function<void(const void*, size_t)>& sink) {
  if (pp_ > 1) return save_state_pipeline(s, sink);
  if (engine_pieces().empty()) return zero_->save(s, sink);
  // Rank 0 of each ZeRO group holds its tp shard's vector after the engine's save; the tp
  // groups of other replicas (their ZeRO rank is not 0) only take part in the engine's save.
  const size_t eb = state_elem_bytes(s);
  const size_t shard_bytes = size_t(engine_layout().total) * eb;
  std::vector<std::byte> mine(grid_->zero().rank() == 0 ? (shard_bytes + 3) / 4 * 4 : 0);
  size_t at = 0;
  zero_->save(s, [&](const void* data, size_t bytes) {
    std::memcpy(mine.data() + at, data, bytes);
    at += bytes;
  });
  if (grid_->zero().rank() != 0) return;
  gather_tp_shards(
      mine, eb, whole_engine_layout().total, [&](int64_t r) { return engine_pieces_of(r); }, sink);
}

void TrainRun::gather_tp_shards(const std::vector<std::byte>& mine, size_t eb, int64_t whole_total,
                                const std::function<std::vector<ShardPiece>(int64_t)>& pieces_of,
                                const std::function<void(const void*, size_t)>& sink) {
  const size_t padded = mine.size();
  std::vector<std::byte> all(padded * size_t(tp_));
  const int64_t words = int64_t(padded / 4);
  grid_->group(Axis::kTp).all_gather(
      Tensor(const_cast<std::byte*>(mine.data()), DType::kI32, {words}, MemPool::kHost),
      Tensor(all.data(), DType::kI32, {words * tp_}, MemPool::kHost));
  if (!lead_) return;
  std::vector<std::byte> whole(size_t(whole_total) * eb);
  for (int64_t r = 0; r < tp_; ++r)
    for (const ShardPiece& p : pieces_of(r))
      std::memcpy(whole.data() + size_t(p.full) * eb,
                  all.data() + padded * r + size_t(p.shard) * eb, size_t(p.count) * eb);
  sink(whole.data(), whole.size());
}

void TrainRun::save_state_pipeline(ZeroEngine::State s,
                                   const std::function<void(const void*, size_t)>& sink) {
  // Rank 0 of each ZeRO group holds its (stage, tp shard) vector after the engine's save. With
  // LoRA the engine's vector is the stage's f32 adapters.
  const size_t eb = state_elem_bytes(s);
  std::vector<int32_t> mine(grid_->zero().rank() == 0 ? (size_t(engine_layout().total) * eb + 3) / 4
                                                      : 0);
  size_t at = 0;
  zero_->save(s, [&](const void* data, size_t bytes) {
    std::memcpy(reinterpret_cast<std::byte*>(mine.data()) + at, data, bytes);
    at += bytes;
  });
  gather_stages(mine, eb, lora_.enabled(), sink);
}

void TrainRun::gather_stages(const std::vector<int32_t>& mine, size_t eb, bool adapters,
                             const std::function<void(const void*, size_t)>& sink) {
  // The holders send their vectors to rank 0, which places every piece in the whole arena
  // (stage_shard_pieces, or each stage's adapter units).
  auto padded_words = [&](int64_t elems) { return int64_t((size_t(elems) * eb + 3) / 4); };
  const Topology topo = topology_for(cfg_, world_.size(), world_.rank());
  constexpr int kTag = 7;
  if (!lead_) {
    if (grid_->zero().rank() == 0)
      world_.send(Tensor(const_cast<int32_t*>(mine.data()), DType::kI32, {int64_t(mine.size())},
                         MemPool::kHost),
                  0, kTag);
    return;
  }
  const int64_t whole_total = adapters ? whole_lora_layout_.params.total : whole_layout_.total;
  std::vector<std::byte> whole(size_t(whole_total) * eb);
  std::vector<int32_t> theirs;
  for (int64_t st = 0; st < pp_; ++st)
    for (int64_t r = 0; r < tp_; ++r) {
      RankCoords c;
      c.pp = st;
      c.tp = r;
      const int64_t holder = topo.rank_of(c);  // dp = cp = 0: its ZeRO group's rank 0
      const ModelConfig sc = stage_model_for(cfg_, st);
      const LoraLayout stage_adapters = adapters ? make_lora_layout(sc, lora_) : LoraLayout{};
      const int64_t n = adapters ? stage_adapters.params.total : make_param_layout(sc).total;
      const int32_t* src = mine.data();
      if (holder != 0) {
        theirs.assign(size_t(padded_words(n)), 0);
        world_.recv(Tensor(theirs.data(), DType::kI32, {int64_t(theirs.size())}, MemPool::kHost),
                    int(holder), kTag);
        src = theirs.data();
      }
      const auto* bytes = reinterpret_cast<const std::byte*>(src);
      for (const ShardPiece& p :
           adapters ? lora_stage_pieces(whole_lora_layout_, stage_adapters)
                    : stage_shard_pieces(cfg_.model, sc.pp_begin, sc.stage_end(), tp_, r))
        std::memcpy(whole.data() + size_t(p.full) * eb, bytes + size_t(p.shard) * eb,
                    size_t(p.count) * eb);
    }
  sink(whole.data(), whole.size());
}

ModelOptions TrainRun::sampler_options() const {
  ModelOptions o;
  o.param_dtype = model_->options().param_dtype;
  o.activation_dtype = model_->options().activation_dtype;  // the sampler's KV cache
  o.max_seq = T_;         // the sampler's window: the whole row, whatever the cp split
  o.activations = false;  // parameters only: the KvDecoder holds what sampling needs
  return o;
}

std::unique_ptr<LlamaModel> TrainRun::sampler_on_lead(MemoryLedger& ledger, bool final_saved) {
  // Without a final checkpoint the ranks' shards are gathered; with one (a LoRA checkpoint's:
  // the base from where model.json says, merged with the adapters unit by unit) it is read.
  if (!final_saved) return whole_model_on_lead(ledger);
  if (!lead_) return nullptr;
  // Written and fsynced by this run moments ago: the sizes are checked, the contents trusted.
  const CheckpointReader ckpt(last_checkpoint_, CheckpointReader::Verify::kSizesOnly);
  SHARDLM_CHECK(ckpt.step() == step_, "sampling: the final checkpoint {} is of step {}, not {}",
                ckpt.dir(), ckpt.step(), step_);
  auto m = std::make_unique<LlamaModel>(cfg_.model, sampler_options(), *backend_, ledger);
  read_params(ckpt, *m, *backend_);
  out_ << fmt::format("sample: the parameters of {}\n", ckpt.dir());
  return m;
}

std::unique_ptr<LlamaModel> TrainRun::whole_model_on_lead(MemoryLedger& ledger) {
  std::unique_ptr<LlamaModel> m;
  const ModelOptions o = sampler_options();
  if (lead_) m = std::make_unique<LlamaModel>(cfg_.model, o, *backend_, ledger);
  if (lora_.enabled() && pp_ > 1) {  // the stages' bases and adapters, merged
    merge_stages_on_lead(m.get());
    return m;
  }
  if (lora_.enabled()) {
    merged_lora_model_on_lead(m.get());
    return m;
  }
  if (!tp_pieces_.empty()) {  // the tp shards (pipeline stages) gathered into the whole arena
    const DType dt = o.param_dtype;
    save_state(ZeroEngine::State::kParams, [&](const void* data, size_t bytes) {
      const int64_t n = int64_t(bytes / dtype_size(dt));
      backend_->copy(Tensor(const_cast<void*>(data), dt, {n}, MemPool::kHost), m->params());
    });
    return m;
  }
  const DType dt = o.param_dtype;
  int64_t at = 0;
  zero_->save(ZeroEngine::State::kParams, [&](const void* data, size_t bytes) {
    const int64_t n = int64_t(bytes / dtype_size(dt));
    backend_->copy(Tensor(const_cast<void*>(data), dt, {n}, MemPool::kHost),
                   m->params().rows(at, n));
    at += n;
  });
  return m;
}

void TrainRun::merge_stages_on_lead(LlamaModel* m) {
  std::vector<float> adapters;
  save_state(ZeroEngine::State::kParams, [&](const void* data, size_t bytes) {
    const auto* f = static_cast<const float*>(data);
    adapters.assign(f, f + bytes / 4);
  });
  // The stage's frozen base in f32 on the host, gathered like the engine's vectors.
  std::vector<int32_t> base_words(grid_->zero().rank() == 0 ? size_t(layout_.total) : 0);
  if (!base_words.empty() || nf4_sharded())
    read_base(base_words.empty() ? nullptr : reinterpret_cast<float*>(base_words.data()));
  std::vector<float> base;
  gather_stages(base_words, 4, /*adapters=*/false, [&](const void* data, size_t bytes) {
    const auto* f = static_cast<const float*>(data);
    base.assign(f, f + bytes / 4);
  });
  if (!lead_) return;
  for (int l = 0; l < cfg_.model.n_layers; ++l)  // the base with the adapters merged in
    merge_lora_layer(cfg_.model, lora_, whole_lora_layout_, whole_layout_, l,
                     adapters.data() + whole_lora_layout_.params.units[l].begin,
                     base.data() + whole_layout_.units[l + 1].begin);
  backend_->convert(Tensor(base.data(), DType::kF32, {whole_layout_.total}, MemPool::kHost),
                    m->params());
}

void TrainRun::read_base(float* out) {
  if (!lora_.nf4_base) {
    if (out != nullptr)
      backend_->convert(model_->params(),
                        Tensor(out, DType::kF32, {layout_.total}, MemPool::kHost));
    return;
  }
  std::vector<float> discard(out != nullptr ? 0 : size_t(layout_.max_unit));
  for (int u = 0; u < int(layout_.units.size()); ++u)
    if (layout_.unit_size(u) > 0)  // (another stage's units are empty)
      model_->read_base_unit(u, out != nullptr ? out + layout_.units[u].begin : discard.data());
}

// The base (each tp rank's shard of it gathered, in f32) with the whole adapters merged in
// (W + alpha/r B A), written into rank 0's whole model.
void TrainRun::merged_lora_model_on_lead(LlamaModel* whole) {
  std::vector<float> adapters(lead_ ? size_t(whole_lora_layout_.params.total) : 0);
  int64_t at = 0;
  save_state(ZeroEngine::State::kParams, [&](const void* data, size_t bytes) {
    std::memcpy(adapters.data() + at, data, bytes);
    at += int64_t(bytes / 4);
  });
  std::vector<float> base(lead_ ? size_t(whole_layout_.total) : 0);
  if (tp_pieces_.empty()) {
    if (lead_ || nf4_sharded()) read_base(lead_ ? base.data() : nullptr);
  } else if (grid_->zero().rank() == 0 || nf4_sharded()) {
    const bool gathers = grid_->zero().rank() == 0;
    std::vector<std::byte> mine(gathers ? size_t(layout_.total) * 4 : 0);  // this rank's shard
    read_base(gathers ? reinterpret_cast<float*>(mine.data()) : nullptr);
    if (gathers)
      gather_tp_shards(
          mine, 4, whole_layout_.total,
          [&](int64_t r) { return tp_shard_pieces(cfg_.model, tp_, r); },
          [&](const void* data, size_t bytes) { std::memcpy(base.data(), data, bytes); });
  }
  if (!lead_) return;
  for (int u = 0; u < int(whole_layout_.units.size()); ++u) {
    const int64_t n = whole_layout_.unit_size(u), begin = whole_layout_.units[u].begin;
    if (u >= 1 && u <= cfg_.model.n_layers)
      merge_lora_layer(cfg_.model, lora_, whole_lora_layout_, whole_layout_, u - 1,
                       adapters.data() + whole_lora_layout_.params.units[u - 1].begin,
                       base.data() + begin);
    backend_->convert(Tensor(base.data() + begin, DType::kF32, {n}, MemPool::kHost),
                      whole->params().rows(begin, n));
  }
}

}  // namespace shardlm::trainer_detail
