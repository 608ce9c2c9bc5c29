// The run config's key table (config_keys.h): each key with its RunConfig field, the refused
// keys with their reasons, the aliases other trainers use, and the suggestions for unknown keys.
#include "config_keys.h"

#include <algorithm>
#include <iterator>
#include <limits>
#include <utility>

#include "name_distance.h"

namespace shardlm::config_keys {
namespace {

#define SHARDLM_KEY(path, member, ...)                                      \
  KeySpec {                                                                 \
    path, [](RunConfig& c) -> FieldRef { return &c.member; }, ##__VA_ARGS__ \
  }

// Every valid key, in the order run_config_to_json writes them. Sections and nested objects
// (model.rope_scaling) are the path prefixes of these keys.
const KeySpec kKeys[] = {
    SHARDLM_KEY("model.preset", model_preset),
    SHARDLM_KEY("model.hf_dir", model_hf_dir, true),
    SHARDLM_KEY("model.dim", model.dim),
    SHARDLM_KEY("model.n_layers", model.n_layers),
    SHARDLM_KEY("model.n_heads", model.n_heads),
    SHARDLM_KEY("model.n_kv_heads", model.n_kv_heads),
    SHARDLM_KEY("model.ffn_dim", model.ffn_dim),
    SHARDLM_KEY("model.vocab_size", model.vocab_size),
    SHARDLM_KEY("model.rope_theta", model.rope_theta),
    SHARDLM_KEY("model.rope_scaling.type", model.rope_scaling.type),
    SHARDLM_KEY("model.rope_scaling.factor", model.rope_scaling.factor),
    SHARDLM_KEY("model.rope_scaling.low_freq_factor", model.rope_scaling.low_freq_factor),
    SHARDLM_KEY("model.rope_scaling.high_freq_factor", model.rope_scaling.high_freq_factor),
    SHARDLM_KEY("model.rope_scaling.original_max_position",
                model.rope_scaling.original_max_position),
    SHARDLM_KEY("model.norm_eps", model.norm_eps),
    SHARDLM_KEY("model.tie_embeddings", model.tie_embeddings),
    SHARDLM_KEY("model.attn_bias", model.attn_bias),
    SHARDLM_KEY("model.head_dim", model.explicit_head_dim),
    SHARDLM_KEY("model.qk_norm", model.qk_norm),
    SHARDLM_KEY("model.sliding_window", model.sliding_window),
    SHARDLM_KEY("model.global_layer_every", model.global_layer_every),
    SHARDLM_KEY("model.rope_local_theta", model.rope_local_theta),
    SHARDLM_KEY("model.norm_one_plus_weight", model.norm_one_plus_weight),
    SHARDLM_KEY("model.embed_scale", model.embed_scale),
    SHARDLM_KEY("model.post_norms", model.post_norms),
    SHARDLM_KEY("model.mlp_activation", model.mlp_activation),
    SHARDLM_KEY("model.query_pre_attn_scalar", model.query_pre_attn_scalar),
    SHARDLM_KEY("model.attn_softcap", model.attn_softcap),
    SHARDLM_KEY("model.final_softcap", model.final_softcap),
    SHARDLM_KEY("data.train", data.train, true),
    SHARDLM_KEY("data.valid", data.valid, true),
    SHARDLM_KEY("data.valid_fraction", data.valid_fraction),
    SHARDLM_KEY("data.seq_len", data.seq_len),
    SHARDLM_KEY("data.tokenizer", data.tokenizer),
    SHARDLM_KEY("train.micro_batch", train.micro_batch),
    SHARDLM_KEY("train.grad_accum", train.grad_accum),
    SHARDLM_KEY("train.epochs", train.epochs),
    SHARDLM_KEY("train.max_steps", train.max_steps),
    SHARDLM_KEY("train.stop", train.stop),
    SHARDLM_KEY("train.resume", train.resume),
    SHARDLM_KEY("train.resume_fallback", train.resume_fallback),
    SHARDLM_KEY("train.max_bad_steps", train.max_bad_steps),
    SHARDLM_KEY("train.device", train.device),
    SHARDLM_KEY("train.attention", train.attention),
    SHARDLM_KEY("checkpoint.every_steps", checkpoint.every_steps),
    SHARDLM_KEY("checkpoint.keep_last", checkpoint.keep_last),
    SHARDLM_KEY("checkpoint.at_end", checkpoint.at_end),
    SHARDLM_KEY("checkpoint.async", checkpoint.async),
    SHARDLM_KEY("checkpoint.async_snapshot_gib", checkpoint.async_snapshot_gib),
    SHARDLM_KEY("train.lr", train.lr),
    SHARDLM_KEY("train.min_lr", train.min_lr),
    SHARDLM_KEY("train.warmup_steps", train.warmup_steps),
    SHARDLM_KEY("train.weight_decay", train.weight_decay),
    SHARDLM_KEY("train.beta1", train.beta1),
    SHARDLM_KEY("train.beta2", train.beta2),
    SHARDLM_KEY("train.eps", train.eps),
    SHARDLM_KEY("train.grad_clip", train.grad_clip),
    SHARDLM_KEY("train.seed", train.seed),
    SHARDLM_KEY("train.eval_every", train.eval_every),
    SHARDLM_KEY("train.eval_batches", train.eval_batches),
    SHARDLM_KEY("precision.param", precision.param),
    SHARDLM_KEY("precision.activations", precision.activations),
    SHARDLM_KEY("parallel.tp", parallel.tp),
    SHARDLM_KEY("parallel.pp", parallel.pp),
    SHARDLM_KEY("parallel.cp", parallel.cp),
    SHARDLM_KEY("parallel.cp_kind", parallel.cp_kind),
    SHARDLM_KEY("parallel.cp_ulysses", parallel.cp_ulysses),
    SHARDLM_KEY("parallel.cp_keep_gathered", parallel.cp_keep_gathered),
    SHARDLM_KEY("parallel.sequence_parallel", parallel.sequence_parallel),
    SHARDLM_KEY("parallel.device_comm", parallel.device_comm),
    SHARDLM_KEY("parallel.device_comm_staging_kib", parallel.device_comm_staging_kib),
    SHARDLM_KEY("zero.stage", zero.stage),
    SHARDLM_KEY("zero.offload_optimizer", zero.offload_optimizer),
    SHARDLM_KEY("zero.offload_params", zero.offload_params),
    SHARDLM_KEY("zero.overlap_comm", zero.overlap_comm),
    SHARDLM_KEY("zero.reduce_bucket_bytes", zero.reduce_bucket_bytes),
    SHARDLM_KEY("zero.allgather_bucket_bytes", zero.allgather_bucket_bytes),
    SHARDLM_KEY("zero.prefetch_layers", zero.prefetch_layers),
    SHARDLM_KEY("zero.reduce_dtype", zero.reduce_dtype),
    SHARDLM_KEY("memory.checkpointing", memory.checkpointing),
    SHARDLM_KEY("memory.offload_checkpoints", memory.offload_checkpoints),
    SHARDLM_KEY("memory.checkpoint_every", memory.checkpoint_every),
    SHARDLM_KEY("memory.loss_chunk_tokens", memory.loss_chunk_tokens),
    SHARDLM_KEY("memory.mlp_chunk_tokens", memory.mlp_chunk_tokens),
    SHARDLM_KEY("memory.budget_gib", memory.budget_gib),
    SHARDLM_KEY("log.dir", log.dir, true),
    SHARDLM_KEY("log.every_steps", log.every_steps),
    SHARDLM_KEY("log.profile", log.profile),
    SHARDLM_KEY("sample.prompt", sample.prompt),
    SHARDLM_KEY("sample.max_new_tokens", sample.max_new_tokens),
    SHARDLM_KEY("sample.temperature", sample.temperature),
    SHARDLM_KEY("sample.top_k", sample.top_k),
    SHARDLM_KEY("sample.top_p", sample.top_p),
    SHARDLM_KEY("sample.count", sample.count),
    SHARDLM_KEY("lora.rank", lora.rank),
    SHARDLM_KEY("lora.alpha", lora.alpha),
    SHARDLM_KEY("lora.dropout", lora.dropout),
    SHARDLM_KEY("lora.targets", lora.targets),
    SHARDLM_KEY("lora.offload_base", lora.offload_base),
    SHARDLM_KEY("lora.base_dtype", lora.base_dtype),
};

#undef SHARDLM_KEY

// Keys the architecture names but this version cannot honour: an error that says so, rather
// than "unknown key" with a misleading suggestion.
const PlannedKey kPlannedKeys[] = {
    {"lora.bias", "LoRA adapters train no biases (PEFT's bias = \"none\")"},
};

// Keys other tools have that are not keys here, with the reason (instead of a suggestion
// that would be wrong: parallel.dp is one letter from parallel.tp).
const PlannedKey kNotKeys[] = {
    {"parallel.dp",
     "the data-parallel size is derived: world size / (parallel.tp x parallel.cp x parallel.pp)"},
};

// Names other trainers (Hugging Face, nanoGPT) use for our keys' last component.
const std::pair<std::string_view, std::string_view> kLeafAliases[] = {
    {"batch_size", "micro_batch"},
    {"micro_batch_size", "micro_batch"},
    {"gradient_accumulation_steps", "grad_accum"},
    {"hidden_size", "dim"},
    {"intermediate_size", "ffn_dim"},
    {"num_attention_heads", "n_heads"},
    {"num_key_value_heads", "n_kv_heads"},
    {"num_hidden_layers", "n_layers"},
    {"max_seq_len", "seq_len"},
    {"seq_length", "seq_len"},
    {"block_size", "seq_len"},
    {"rms_norm_eps", "norm_eps"},
    {"tie_word_embeddings", "tie_embeddings"},
    {"num_epochs", "epochs"},
};

}  // namespace

std::span<const KeySpec> all_keys() { return kKeys; }
std::span<const PlannedKey> planned_keys() { return kPlannedKeys; }
std::span<const PlannedKey> not_keys() { return kNotKeys; }

const KeySpec* find_key(std::string_view path) {
  for (const auto& k : kKeys)
    if (k.path == path) return &k;
  return nullptr;
}

// "a.b.c" -> "a/b/c" (a JSON pointer without its leading slash).
std::string dotted_to_pointer(std::string_view path) {
  std::string p(path);
  std::replace(p.begin(), p.end(), '.', '/');
  return p;
}

// Whether `path` lies inside `group` ("train.lr" is under "train", "trainer.x" is not).
bool is_under(std::string_view path, std::string_view group) {
  return path.size() > group.size() && path.starts_with(group) && path[group.size()] == '.';
}

// A section or nested object: a proper prefix of some key.
bool is_group(std::string_view path) {
  return std::any_of(std::begin(kKeys), std::end(kKeys),
                     [&](const KeySpec& k) { return is_under(k.path, path); });
}

std::string_view parent_of(std::string_view path) {
  const size_t dot = path.rfind('.');
  return dot == std::string_view::npos ? std::string_view{} : path.substr(0, dot);
}

std::string_view leaf_of(std::string_view path) {
  const size_t dot = path.rfind('.');
  return dot == std::string_view::npos ? path : path.substr(dot + 1);
}

// Valid groups and keys one level below `parent` ("" = the sections), in table order.
std::vector<std::string> children_of(std::string_view parent) {
  std::vector<std::string> out;
  for (const auto& k : kKeys) {
    std::string_view rest = k.path;
    if (!parent.empty()) {
      if (!is_under(rest, parent)) continue;
      rest.remove_prefix(parent.size() + 1);
    }
    std::string child(rest.substr(0, rest.find('.')));
    if (std::find(out.begin(), out.end(), child) == out.end()) out.push_back(child);
  }
  return out;
}

std::string join(const std::vector<std::string>& items, std::string_view sep) {
  std::string out;
  for (const auto& s : items) out += (out.empty() ? "" : std::string(sep)) + s;
  return out;
}

// The valid key or section nearest to an unknown one, or "" when none is reasonably close.
std::string suggest(std::string_view unknown) {
  const std::string_view parent = parent_of(unknown), leaf = leaf_of(unknown);
  if (leaf.size() > 64) return "";  // nothing is close, and the distance table would be large
  std::vector<std::string> candidates;
  if (parent.empty()) {
    candidates = children_of("");
  } else {
    for (const auto& k : kKeys) {
      candidates.emplace_back(k.path);
      if (std::string_view group = parent_of(k.path); group.find('.') != std::string_view::npos)
        candidates.emplace_back(group);  // nested objects such as model.rope_scaling
    }
  }
  const size_t threshold = std::max<size_t>(1, leaf.size() / 3);
  std::string best;
  size_t best_score = std::numeric_limits<size_t>::max();
  for (const auto& cand : candidates) {
    const std::string_view cand_leaf = leaf_of(cand);
    size_t score = edit_distance(leaf, cand_leaf);
    for (const auto& [alias, target] : kLeafAliases)
      if (leaf == alias && cand_leaf == target) score = 0;
    if (score > 1 && abbreviates(leaf, cand_leaf)) score = 1;
    if (parent_of(cand) != parent) score += 1;  // same leaf in another section: close, not equal
    if (score <= threshold && score < best_score) {
      best = cand;
      best_score = score;
    }
  }
  return best;
}

}  // namespace shardlm::config_keys
