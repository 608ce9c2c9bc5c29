// The JSON run-configuration loader: one key table (kKeys) drives parsing, --set overrides,
// run_config_to_json and the "did you mean" suggestions, so a key added there is everywhere.
// Every failure is Error(kConfig) naming the full key path and the fix; nothing here reads
// data files or touches the model beyond resolving the preset. The value rules are in
// config_validate.cpp.
#include "shardlm/train/config.h"
#include "shardlm/train/hf.h"

#include "json_show.h"
#include "name_distance.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <limits>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string_view>
#include <variant>

#include "shardlm/core/check.h"
#include "shardlm/io/tokenize.h"

namespace shardlm {
namespace {

using nlohmann::json;
namespace fs = std::filesystem;

using FieldRef =
    std::variant<int64_t*, uint64_t*, double*, bool*, std::string*, CheckpointOffload*>;

struct KeySpec {
  std::string_view path;
  FieldRef (*field)(RunConfig&);
  // Relative paths (data.train, data.valid, log.dir) given in the config file are resolved
  // against the file's directory, so configs/demo.json can say "../data/kjv.txt" and work
  // from any working directory; paths given by --set, and defaults, are kept as they are
  // (relative to the working directory, where the user typed them).
  bool relative_to_config_dir = false;
};

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
struct PlannedKey {
  std::string_view path;
  std::string_view hint;
};
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

const KeySpec* find_key(std::string_view path) {
  for (const auto& k : kKeys)
    if (k.path == path) return &k;
  return nullptr;
}

// Whether `path` lies inside `group` ("train.lr" is under "train", "trainer.x" is not).
// "a.b.c" -> "a/b/c" (a JSON pointer without its leading slash).
std::string dotted_to_pointer(std::string_view path) {
  std::string p(path);
  std::replace(p.begin(), p.end(), '.', '/');
  return p;
}

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

// A JSON value for an error message: compact, valid UTF-8, at most ~60 bytes.

std::string type_of(const json& v) {
  if (v.is_number_integer()) return "integer";
  if (v.is_number_float()) return "number";
  return v.type_name();
}

[[noreturn]] void fail_type(std::string_view path, std::string_view want, const json& v) {
  SHARDLM_FAIL(ErrorKind::kConfig, "{} must be {}, got {} ({})", path, want, quote_json(v),
               type_of(v));
}

// A value bound for a key, from the file or from --set.
struct Assignment {
  std::string path;
  json value;
  std::string set_text;        // the --set argument, "" when the value came from the file
  bool set_names_key = false;  // --set named this key itself (not a section holding it)
};

void flatten(const json& obj, const std::string& prefix, const std::string& set_text,
             std::vector<Assignment>& out) {
  for (const auto& [name, value] : obj.items()) {
    const std::string path = prefix.empty() ? name : prefix + "." + name;
    if (name.find('.') != std::string::npos)
      SHARDLM_FAIL(ErrorKind::kConfig,
                   "key '{}' contains '.'; nest it as an object instead (\"train\": {{\"lr\": "
                   "...}}) or use --set {}=...",
                   path, path);
    if (find_key(path)) {
      out.push_back({path, value, set_text});
    } else if (is_group(path)) {
      if (!value.is_object())
        SHARDLM_FAIL(ErrorKind::kConfig, "'{}' must be a JSON object with keys {}; got {} ({})",
                     path, join(children_of(path), ", "), quote_json(value), type_of(value));
      flatten(value, path, set_text, out);
    } else {
      for (const auto& planned : kPlannedKeys)
        if (planned.path == path)
          SHARDLM_FAIL(ErrorKind::kConfig, "'{}' is not supported in this version; {}", path,
                       planned.hint);
      for (const auto& not_key : kNotKeys)
        if (not_key.path == path)
          SHARDLM_FAIL(ErrorKind::kConfig, "'{}' is not a key: {}", path, not_key.hint);
      if (std::string near = suggest(path); !near.empty())
        SHARDLM_FAIL(ErrorKind::kConfig, "unknown {} '{}'; did you mean '{}'?",
                     prefix.empty() ? "section" : "key", path, near);
      if (prefix.empty())
        SHARDLM_FAIL(ErrorKind::kConfig, "unknown section '{}'; valid sections: {}", path,
                     join(children_of(""), ", "));
      SHARDLM_FAIL(ErrorKind::kConfig, "unknown key '{}'; valid keys in '{}': {}", path, prefix,
                   join(children_of(prefix), ", "));
    }
  }
}

// JSON number -> int64, accepting integral floats (1e6) and rejecting everything else.
int64_t to_int(std::string_view path, const json& v) {
  if (v.is_number_unsigned()) {
    if (v.get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
      SHARDLM_FAIL(ErrorKind::kConfig, "{} is out of range: {}", path, quote_json(v));
    return static_cast<int64_t>(v.get<uint64_t>());
  }
  if (v.is_number_integer()) return v.get<int64_t>();
  if (v.is_number_float()) {
    const double d = v.get<double>();
    if (std::trunc(d) != d) fail_type(path, "an integer", v);
    if (!(d >= -9.2233720368547758e18 && d < 9.2233720368547758e18))
      SHARDLM_FAIL(ErrorKind::kConfig, "{} is out of range: {}", path, quote_json(v));
    return static_cast<int64_t>(d);
  }
  fail_type(path, "an integer", v);
}

uint64_t to_uint(std::string_view path, const json& v) {
  if (v.is_number_unsigned()) return v.get<uint64_t>();
  if (v.is_number_integer() && v.get<int64_t>() >= 0)
    return static_cast<uint64_t>(v.get<int64_t>());
  if (v.is_number_integer() || (v.is_number_float() && v.get<double>() < 0))
    SHARDLM_FAIL(ErrorKind::kConfig, "{} must be a non-negative integer, got {}", path,
                 quote_json(v));
  if (v.is_number_float()) {
    const double d = v.get<double>();
    if (std::trunc(d) != d) fail_type(path, "a non-negative integer", v);
    if (!(d < 1.8446744073709552e19))
      SHARDLM_FAIL(ErrorKind::kConfig, "{} is out of range: {}", path, quote_json(v));
    return static_cast<uint64_t>(d);
  }
  fail_type(path, "a non-negative integer", v);
}

double to_double(std::string_view path, const json& v) {
  if (!v.is_number()) fail_type(path, "a number", v);
  const double d = v.get<double>();
  if (!std::isfinite(d)) SHARDLM_FAIL(ErrorKind::kConfig, "{} must be finite", path);
  return d;
}

// true, false, a fraction in [0, 1] or "auto".
CheckpointOffload to_checkpoint_offload(std::string_view path, const json& v) {
  if (v.is_boolean()) return {v.get<bool>() ? 1.0 : 0.0, false};
  if (v.is_string() && v.get<std::string>() == "auto") return {0, true};
  if (v.is_number() && v.get<double>() >= 0 && v.get<double>() <= 1)
    return {v.get<double>(), false};
  fail_type(path, "true, false, a fraction in [0, 1] or \"auto\"", v);
}

void assign(RunConfig& cfg, const KeySpec& key, const Assignment& a) {
  const std::string_view path = key.path;
  const json& v = a.value;
  std::visit(
      [&](auto* field) {
        using T = std::remove_pointer_t<decltype(field)>;
        if constexpr (std::is_same_v<T, int64_t>) {
          *field = to_int(path, v);
        } else if constexpr (std::is_same_v<T, uint64_t>) {
          *field = to_uint(path, v);
        } else if constexpr (std::is_same_v<T, double>) {
          *field = to_double(path, v);
        } else if constexpr (std::is_same_v<T, bool>) {
          if (!v.is_boolean()) fail_type(path, "true or false", v);
          *field = v.get<bool>();
        } else if constexpr (std::is_same_v<T, CheckpointOffload>) {
          *field = to_checkpoint_offload(path, v);
        } else {
          if (v.is_string()) {
            *field = v.get<std::string>();
          } else if (a.set_names_key && !v.is_object() && !v.is_array()) {
            // --set data.train=2024 means the file "2024", not a type error.
            *field = a.set_text.substr(a.set_text.find('=') + 1);
          } else {
            fail_type(path, "a string", v);
          }
          if (key.relative_to_config_dir && a.set_text.empty() && !field->empty() &&
              !cfg.config_dir.empty() && fs::path(*field).is_relative())
            *field = (fs::path(cfg.config_dir) / *field).lexically_normal().string();
        }
      },
      key.field(cfg));
}

// Reports an error in a --set value as coming from that argument.
template <typename F>
void with_origin(const Assignment& a, F&& f) {
  if (a.set_text.empty()) return f();
  try {
    f();
  } catch (const Error& e) {
    SHARDLM_FAIL(ErrorKind::kConfig, "--set {}: {}", a.set_text, e.what());
  }
}

std::vector<Assignment> parse_overrides(const std::vector<std::string>& overrides) {
  std::vector<Assignment> out;
  for (const auto& text : overrides) {
    const size_t eq = text.find('=');
    if (eq == std::string::npos)
      SHARDLM_FAIL(ErrorKind::kConfig,
                   "--set '{}': expected key.path=value (for example --set train.lr=1e-3)", text);
    std::string path = text.substr(0, eq);
    const auto ws = " \t";
    path.erase(0, path.find_first_not_of(ws));
    path.erase(path.find_last_not_of(ws) + 1);
    if (path.empty() || path.starts_with('.') || path.ends_with('.') ||
        path.find("..") != std::string::npos)
      SHARDLM_FAIL(ErrorKind::kConfig,
                   "--set '{}': '{}' is not a key path; expected section.key=value", text, path);
    json value = json::parse(text.substr(eq + 1), nullptr, /*allow_exceptions=*/false);
    if (value.is_discarded()) value = text.substr(eq + 1);
    // Wrap the value as {"a": {"b": value}} so --set goes through the file's checks exactly.
    json wrapped = value;
    for (std::string_view p = path; !p.empty(); p = parent_of(p))
      wrapped = json::object({{std::string(leaf_of(p)), std::move(wrapped)}});
    const size_t first_new = out.size();
    try {
      flatten(wrapped, "", text, out);
    } catch (const Error& e) {
      SHARDLM_FAIL(ErrorKind::kConfig, "--set {}: {}", text, e.what());
    }
    for (size_t i = first_new; i < out.size(); ++i) out[i].set_names_key = out[i].path == path;
  }
  return out;
}

// "[json.exception.parse_error.101] parse error at ..." -> "parse error at ...".
std::string without_exception_id(std::string what) {
  const size_t p = what.find("] ");
  return what.starts_with("[json.exception") && p != std::string::npos ? what.substr(p + 2) : what;
}

RunConfig parse_impl(const std::string& json_text, const std::vector<std::string>& overrides,
                     const std::string& base_dir, const std::string& source, bool validate = true) {
  json doc;
  try {
    doc = json::parse(json_text);
  } catch (const json::parse_error& e) {
    SHARDLM_FAIL(ErrorKind::kConfig, "{}: invalid JSON at byte {}: {}", source, e.byte,
                 without_exception_id(e.what()));
  } catch (const json::exception& e) {  // number overflow ("1e999") reports no position
    SHARDLM_FAIL(ErrorKind::kConfig, "{}: invalid JSON: {}", source,
                 without_exception_id(e.what()));
  }
  if (!doc.is_object())
    SHARDLM_FAIL(ErrorKind::kConfig,
                 "{}: the config must be a JSON object with sections {}; got {}", source,
                 join(children_of(""), ", "), type_of(doc));

  std::vector<Assignment> assignments;
  flatten(doc, "", "", assignments);
  for (auto& a : parse_overrides(overrides)) assignments.push_back(std::move(a));

  RunConfig cfg;
  cfg.config_dir = base_dir;
  // The preset is the base that every other model.* key overrides, wherever it was set.
  const KeySpec& preset_key = *find_key("model.preset");
  const KeySpec& hf_key = *find_key("model.hf_dir");
  for (const auto& a : assignments)
    if (a.path == preset_key.path || a.path == hf_key.path)
      with_origin(a, [&] { assign(cfg, *find_key(a.path), a); });
  const bool from_hf = !cfg.model_hf_dir.empty();
  // A Hugging Face directory's config.json is the model (model.preset is then ignored);
  // model.* keys given beside it must agree with it.
  cfg.model = from_hf ? read_hf_config(cfg.model_hf_dir).config : model_preset(cfg.model_preset);
  for (const auto& a : assignments) {
    if (a.path == preset_key.path || a.path == hf_key.path) continue;
    const KeySpec& key = *find_key(a.path);
    if (!from_hf || !is_under(a.path, "model")) {
      with_origin(a, [&] { assign(cfg, key, a); });
      continue;
    }
    RunConfig probe = cfg;
    with_origin(a, [&] { assign(probe, key, a); });
    const json given =
        run_config_to_json(probe)[json::json_pointer("/" + dotted_to_pointer(a.path))];
    const json hf = run_config_to_json(cfg)[json::json_pointer("/" + dotted_to_pointer(a.path))];
    if (given != hf)
      SHARDLM_FAIL(ErrorKind::kConfig,
                   "{} = {} disagrees with model.hf_dir's config.json ({}/config.json says {}); "
                   "drop {} (the Hugging Face config defines the model)",
                   a.path, given.dump(), cfg.model_hf_dir, hf.dump(), a.path);
  }

  if (validate) cfg.validate();
  return cfg;
}

}  // namespace

// As the key is written: false, true, the fraction, or "auto".
void to_json(json& out, const CheckpointOffload& offload) {
  if (offload.automatic)
    out = "auto";
  else if (offload.fraction == 0 || offload.fraction == 1)
    out = offload.fraction == 1;
  else
    out = offload.fraction;
}

RunConfig parse_run_config(const std::string& json_text, const std::vector<std::string>& overrides,
                           const std::string& base_dir) {
  return parse_impl(json_text, overrides, base_dir, "<config text>");
}

namespace {

RunConfig load_impl(const std::string& path, const std::vector<std::string>& overrides,
                    bool validate) {
  std::error_code ec;
  if (fs::is_directory(path, ec))
    SHARDLM_FAIL(ErrorKind::kConfig, "config file '{}' is a directory; pass a JSON file", path);
  std::ifstream in(path, std::ios::binary);
  if (!in)
    SHARDLM_FAIL(ErrorKind::kConfig, "cannot read config file '{}': {}", path,
                 std::strerror(errno));
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) SHARDLM_FAIL(ErrorKind::kConfig, "cannot read config file '{}'", path);
  std::string dir = fs::path(path).parent_path().string();
  return parse_impl(text.str(), overrides, dir.empty() ? "." : dir, path, validate);
}

}  // namespace

RunConfig load_run_config(const std::string& path, const std::vector<std::string>& overrides) {
  return load_impl(path, overrides, /*validate=*/true);
}

RunConfig load_run_config_unvalidated(const std::string& path,
                                      const std::vector<std::string>& overrides) {
  return load_impl(path, overrides, /*validate=*/false);
}

std::string RunConfig::tokenizer_path() const {
  if (!data.tokenizer.empty()) return data.tokenizer;
  if (!model_hf_dir.empty() && !find_tokenizer(model_hf_dir).empty()) return model_hf_dir;
  return "byte";
}

nlohmann::json run_config_to_json(const RunConfig& cfg) {
  RunConfig copy = cfg;  // kKeys hands out mutable field pointers
  json out = json::object();
  for (const auto& key : kKeys) {
    std::string pointer = "/";
    pointer += key.path;
    std::replace(pointer.begin(), pointer.end(), '.', '/');
    std::visit(
        [&](auto* field) {
          json value = *field;
          // A --set string need not be UTF-8 (a Latin-1 file name); keep the output dumpable.
          if (value.is_string())
            value = json::parse(value.dump(-1, ' ', false, json::error_handler_t::replace));
          out[json::json_pointer(pointer)] = std::move(value);
        },
        key.field(copy));
  }
  return out;
}

int64_t ZeroConfig::bucket_elems(size_t param_bytes) const {
  return std::max<int64_t>(
      1, std::min<int64_t>(reduce_bucket_bytes / 4, allgather_bucket_bytes / int64_t(param_bytes)));
}

}  // namespace shardlm
