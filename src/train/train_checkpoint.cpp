// TrainRun's checkpoints, resume side: the checks that a checkpoint belongs to this run and the
// loop's progress restored. Saving and loading the state vectors is train_checkpoint_shards.cpp's;
// the on-disk format is checkpoint.cpp's.
#include <algorithm>

#include "shardlm/planner/plan_inputs.h"
#include "train_run.h"

namespace shardlm::trainer_detail {
namespace {

// The layer functions a model computes beyond its shape (Gemma's, GLM's): resuming with others
// would train another function on the same tensors. Rotary bases and windows may change on purpose
// (context extension) and are not compared.
bool same_layer_functions(const ModelConfig& a, const ModelConfig& b) {
  return a.post_norms == b.post_norms && a.mlp_activation == b.mlp_activation &&
         a.norm_one_plus_weight == b.norm_one_plus_weight && a.embed_scale == b.embed_scale &&
         a.query_pre_attn_scalar == b.query_pre_attn_scalar && a.attn_softcap == b.attn_softcap &&
         a.final_softcap == b.final_softcap && a.global_layer_every == b.global_layer_every &&
         a.rope_partial_factor == b.rope_partial_factor &&
         a.rope_interleaved == b.rope_interleaved && a.post_norm_names == b.post_norm_names;
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

void TrainRun::resume_from(const std::string& chosen) {
  // The ranks picked and verified the checkpoint together (choose_checkpoint); every rank reads
  // just the parts of the flat vectors it holds. The vectors do not depend on the grid or the
  // ZeRO stage, so any checkpoint resumes on any.
  if (chosen.empty()) return;
  const Clock::time_point t0 = Clock::now();
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
  const std::string packing(packing_name(train_set_->packing().packing));
  if (data.value("packing", packing) != packing ||
      data.value("windows", train_set_->num_windows()) != train_set_->num_windows())
    SHARDLM_FAIL(ErrorKind::kConfig,
                 "train.resume: {} was trained with {} packing into {} windows, and this run "
                 "packs the data ({}) into {} ({} packing): the data order cannot continue; keep "
                 "data.packing and data.overlong as they were, or set train.resume = \"none\"",
                 ckpt.dir(), data.value("packing", packing),
                 data.value("windows", train_set_->num_windows()), train_set_->name(),
                 train_set_->num_windows(), packing);
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

}  // namespace shardlm::trainer_detail
