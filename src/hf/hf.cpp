// Hugging Face config.json -> ModelConfig and weights through safetensors (hf.h); config.json
// from a ModelConfig is hf_config_write.cpp. The import and export are checkpoint/hf_*.cpp.
#include "shardlm/hf/hf.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <memory>
#include <vector>

#include "io/posix_file.h"
#include "shardlm/core/check.h"
#include "shardlm/quant/nf4.h"

namespace shardlm {

using json = nlohmann::json;
namespace fs = std::filesystem;

namespace {

struct ConfigReader {
  std::string file;
  const json& doc;

  [[noreturn]] void fail(const std::string& what) const {
    SHARDLM_FAIL(ErrorKind::kConfig, "{}: {}", file, what);
  }
  bool has(const char* key) const { return doc.contains(key) && !doc[key].is_null(); }
  int64_t integer(const char* key) const {
    if (!has(key)) fail(fmt::format("'{}' is missing", key));
    if (!doc[key].is_number_integer() || doc[key].get<int64_t>() <= 0)
      fail(fmt::format("'{}' must be a positive integer, got {}", key, doc[key].dump()));
    return doc[key].get<int64_t>();
  }
  int64_t integer_or(const char* key, int64_t dflt) const { return has(key) ? integer(key) : dflt; }
  double number_or(const char* key, double dflt) const {
    if (!has(key)) return dflt;
    if (!doc[key].is_number())
      fail(fmt::format("'{}' must be a number, got {}", key, doc[key].dump()));
    return doc[key].get<double>();
  }
  bool boolean_or(const char* key, bool dflt) const {
    if (!has(key)) return dflt;
    if (!doc[key].is_boolean())
      fail(fmt::format("'{}' must be true or false, got {}", key, doc[key].dump()));
    return doc[key].get<bool>();
  }
};

json parse_config_file(const std::string& file, const std::string& dir) {
  std::ifstream f(file);
  if (!f)
    SHARDLM_FAIL(ErrorKind::kConfig, "{}: cannot read (is {} a Hugging Face model directory?)",
                 file, dir);
  json raw;
  try {
    f >> raw;
  } catch (const json::exception& e) {
    SHARDLM_FAIL(ErrorKind::kConfig, "{}: not valid JSON: {}", file, e.what());
  }
  return raw;
}

// architectures[0], one of those shardlm reads.
std::string read_architecture(const ConfigReader& r) {
  const json& doc = r.doc;
  if (!doc.is_object()) r.fail("not a JSON object");
  if (!r.has("architectures") || !doc["architectures"].is_array() || doc["architectures"].empty() ||
      !doc["architectures"][0].is_string())
    r.fail(
        "'architectures' is missing (expected one of LlamaForCausalLM, MistralForCausalLM, "
        "Qwen2ForCausalLM, Qwen3ForCausalLM, Gemma2ForCausalLM, Gemma3ForCausalLM)");
  const std::string architecture = doc["architectures"][0].get<std::string>();
  if (std::find(std::begin(kHfArchitectures), std::end(kHfArchitectures), architecture) ==
      std::end(kHfArchitectures))
    r.fail(
        fmt::format("architecture '{}' is not supported; shardlm reads LlamaForCausalLM, "
                    "MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, "
                    "Gemma2ForCausalLM and Gemma3ForCausalLM",
                    architecture));
  return architecture;
}

// The model's name: the last part of _name_or_path, else of the directory.
std::string read_model_name(const ConfigReader& r, const std::string& dir) {
  const std::string name =
      r.has("_name_or_path") && r.doc["_name_or_path"].is_string()
          ? fs::path(r.doc["_name_or_path"].get<std::string>()).filename().string()
          : fs::path(dir).filename().string();
  return name.empty() ? "hf" : name;
}

// The sizes, the norm's epsilon, the rotary base and the tied embeddings; a head_dim other than
// hidden_size / num_attention_heads (Qwen3's) becomes model.head_dim.
void read_dimensions(const ConfigReader& r, ModelConfig& c) {
  c.dim = r.integer("hidden_size");
  c.n_layers = r.integer("num_hidden_layers");
  c.n_heads = r.integer("num_attention_heads");
  c.n_kv_heads = r.integer_or("num_key_value_heads", c.n_heads);
  c.ffn_dim = r.integer("intermediate_size");
  c.vocab_size = r.integer("vocab_size");
  c.norm_eps = r.number_or("rms_norm_eps", 1e-6);
  c.rope_theta = r.number_or("rope_theta", 10000.0);
  c.tie_embeddings = r.boolean_or("tie_word_embeddings", false);
  if (r.has("head_dim")) {
    const int64_t head_dim = r.integer("head_dim");
    if (c.dim % c.n_heads != 0 || head_dim != c.dim / c.n_heads) c.explicit_head_dim = head_dim;
  } else if (c.dim % c.n_heads != 0) {
    r.fail(
        fmt::format("hidden_size {} is not a multiple of num_attention_heads {}, and there is "
                    "no head_dim",
                    c.dim, c.n_heads));
  }
}

// The layer variants shardlm's decoder does not have: another activation, partial rotary
// embeddings, MLP biases, and attention biases beyond Qwen2's q, k, v.
void check_supported_layers(const ConfigReader& r, bool qwen2, bool gemma) {
  if (!gemma && r.has("hidden_act") && r.doc["hidden_act"] != "silu")
    r.fail(fmt::format("hidden_act = {} is not supported (shardlm's MLP is SwiGLU with silu)",
                       r.doc["hidden_act"].dump()));
  if (r.number_or("partial_rotary_factor", 1.0) != 1.0)
    r.fail("partial_rotary_factor != 1 (rotary embedding on part of each head) is not supported");
  if (r.boolean_or("mlp_bias", false)) r.fail("mlp_bias = true is not supported");
  if (!qwen2 && r.boolean_or("attention_bias", false))
    r.fail(
        "attention_bias = true (biases on q, k, v and o_proj) is not supported; shardlm has "
        "q, k, v biases only (Qwen2)");
}

// transformers 5 writes rope_parameters {rope_theta, rope_type, ...}; earlier versions (and
// most published checkpoints) rope_theta and rope_scaling.
void read_rope(const ConfigReader& r, ModelConfig& c) {
  const char* rope_key = r.has("rope_parameters") ? "rope_parameters" : "rope_scaling";
  if (r.has("rope_parameters")) {
    const json& rp = r.doc["rope_parameters"];
    if (!rp.is_object()) r.fail("'rope_parameters' must be an object");
    c.rope_theta =
        ConfigReader{r.file + " rope_parameters", rp}.number_or("rope_theta", c.rope_theta);
  }
  if (!r.has(rope_key)) return;
  const json& rs = r.doc[rope_key];
  if (!rs.is_object()) r.fail(fmt::format("'{}' must be an object or null", rope_key));
  std::string type;
  for (const char* k : {"type", "rope_type"})  // rope_type wins when both are there
    if (rs.contains(k)) {
      if (!rs[k].is_string()) r.fail(fmt::format("'{}.{}' must be a string", rope_key, k));
      type = rs[k].get<std::string>();
    }
  if (type == "default" || (type.empty() && std::string(rope_key) == "rope_parameters")) {
    // no scaling
  } else if (type == "llama3") {
    // (an empty type with rope_parameters is the default too)
    c.rope_scaling.type = "llama3";
    const ConfigReader s{r.file + " " + rope_key, rs};
    c.rope_scaling.factor = s.number_or("factor", 8.0);
    c.rope_scaling.low_freq_factor = s.number_or("low_freq_factor", 1.0);
    c.rope_scaling.high_freq_factor = s.number_or("high_freq_factor", 4.0);
    c.rope_scaling.original_max_position = s.integer_or("original_max_position_embeddings", 8192);
  } else {
    r.fail(fmt::format("{} type '{}' is not supported (llama3 or default)", rope_key, type));
  }
}

// Sliding-window attention, per layer. Mistral windows every layer (its modeling code reads no
// layer_types); otherwise transformers 5 lists each layer's kind in layer_types
// ("sliding_attention" layers use sliding_window), and without it Qwen2/3 with
// use_sliding_window window the layers from max_window_layers on (Qwen2Config's rule).
// A null sliding_window (or Qwen's use_sliding_window false) windows no layer.
void read_sliding_window(const ConfigReader& r, bool qwen, bool mistral, ModelConfig& c) {
  const bool enabled = qwen ? r.boolean_or("use_sliding_window", false) : true;
  if (!enabled || !r.has("sliding_window") || r.doc["sliding_window"].is_null()) return;
  const int64_t window = r.integer("sliding_window");
  std::vector<int64_t> windows(size_t(c.n_layers), 0);
  if (mistral) {  // MistralForCausalLM windows every layer, whatever layer_types says
    std::fill(windows.begin(), windows.end(), window);
  } else if (r.has("layer_types") && r.doc["layer_types"].is_array()) {
    const json& types = r.doc["layer_types"];
    if (int64_t(types.size()) != c.n_layers)
      r.fail(fmt::format("layer_types lists {} layers but num_hidden_layers is {}", types.size(),
                         c.n_layers));
    for (size_t l = 0; l < types.size(); ++l) {
      if (types[l] != "sliding_attention" && types[l] != "full_attention")
        r.fail(
            fmt::format("layer_types[{}] = {} is not supported (sliding_attention or "
                        "full_attention)",
                        l, types[l].dump()));
      windows[l] = types[l] == "sliding_attention" ? window : 0;
    }
  } else if (qwen) {
    const int64_t first = r.integer_or("max_window_layers", c.n_layers);
    for (int64_t l = std::max<int64_t>(first, 0); l < c.n_layers; ++l) windows[size_t(l)] = window;
  } else {
    return;  // Llama has no sliding window
  }
  if (std::all_of(windows.begin(), windows.end(), [](int64_t w) { return w == 0; })) return;
  c.sliding_window = window;
  if (!std::all_of(windows.begin(), windows.end(), [&](int64_t w) { return w == window; }))
    c.layer_windows = std::move(windows);
}

// What Gemma 2 and 3 share: GeGLU with tanh GELU, (1 + w) norms, post-norms, the embedding
// times sqrt(hidden_size), query_pre_attn_scalar, tied embeddings by default, causal attention.
void read_gemma_layers(const ConfigReader& r, ModelConfig& c) {
  const json& d = r.doc;
  if (r.has("hidden_activation") && d["hidden_activation"] != "gelu_pytorch_tanh")
    r.fail(
        fmt::format("hidden_activation = {} is not supported (Gemma's GeGLU is "
                    "gelu_pytorch_tanh)",
                    d["hidden_activation"].dump()));
  if (r.boolean_or("use_bidirectional_attention", false))
    r.fail("use_bidirectional_attention = true is not supported (shardlm's attention is causal)");
  c.norm_one_plus_weight = c.embed_scale = c.post_norms = true;
  c.mlp_activation = "gelu_tanh";
  c.tie_embeddings = r.boolean_or("tie_word_embeddings", true);
  c.query_pre_attn_scalar = r.number_or("query_pre_attn_scalar", 256);
}

// Gemma's pattern of local (sliding-window) and global layers: layer i is global iff (i + 1) is a
// multiple of the period, `every` unless layer_types lists the layers (its first full layer sets
// the period, and the list must repeat it).
void read_local_global_layers(const ConfigReader& r, int64_t every, ModelConfig& c) {
  const json& d = r.doc;
  if (r.has("layer_types")) {
    const json& types = d["layer_types"];
    if (!types.is_array() || int64_t(types.size()) != c.n_layers)
      r.fail("'layer_types' must list one entry per layer");
    const auto first_full = std::find(types.begin(), types.end(), "full_attention");
    if (first_full == types.end())  // no global layer: a period past the last layer
      every = std::max(every, c.n_layers + 1);
    else  // the first global layer sets the period
      every = int64_t(first_full - types.begin()) + 1;
    for (int64_t l = 0; l < c.n_layers; ++l) {
      const bool global = (l + 1) % every == 0;
      if (types[l] != (global ? "full_attention" : "sliding_attention"))
        r.fail(
            fmt::format("'layer_types' is not a repeating pattern of sliding layers and "
                        "every {}th layer full (layer {} is {})",
                        every, l, types[l].dump()));
    }
  }
  c.global_layer_every = every;
}

// Gemma 3's text model: Gemma's layers with q/k norms, and layer_types' pattern of local
// (sliding-window, rope_local_base_freq) and global (rope_theta, rope_scaling) layers. No
// soft-capping (Gemma 2's) is read.
void read_gemma3(const ConfigReader& r, ModelConfig& c) {
  const json& d = r.doc;
  for (const char* cap : {"attn_logit_softcapping", "final_logit_softcapping"})
    if (r.has(cap)) r.fail(fmt::format("'{}' = {} is not supported", cap, d[cap].dump()));
  read_gemma_layers(r, c);
  c.qk_norm = true;
  // transformers 5: rope_parameters per layer type; earlier: rope_theta, rope_local_base_freq
  c.rope_theta = r.number_or("rope_theta", 1000000.0);
  c.rope_local_theta = r.number_or("rope_local_base_freq", 10000.0);
  if (r.has("rope_parameters") && d["rope_parameters"].contains("full_attention")) {
    const json& rp = d["rope_parameters"];
    const ConfigReader full{r.file + " rope_parameters.full_attention", rp["full_attention"]};
    c.rope_theta = full.number_or("rope_theta", c.rope_theta);
    if (rp.contains("sliding_attention"))
      c.rope_local_theta =
          ConfigReader{r.file + " rope_parameters.sliding_attention", rp["sliding_attention"]}
              .number_or("rope_theta", c.rope_local_theta);
    const std::string type = rp["full_attention"].value("rope_type", "default");
    if (type == "linear") {
      c.rope_scaling.type = "linear";
      c.rope_scaling.factor = full.number_or("factor", 1.0);
    } else if (type != "default") {
      r.fail(
          fmt::format("rope_parameters.full_attention rope_type '{}' is not supported "
                      "(linear or default)",
                      type));
    }
  } else if (r.has("rope_scaling")) {
    const ConfigReader s{r.file + " rope_scaling", d["rope_scaling"]};
    const std::string type =
        d["rope_scaling"].value("rope_type", d["rope_scaling"].value("type", ""));
    if (type != "linear")
      r.fail(fmt::format("rope_scaling type '{}' is not supported (linear)", type));
    c.rope_scaling.type = "linear";
    c.rope_scaling.factor = s.number_or("factor", 1.0);
  }
  read_local_global_layers(
      r, r.integer_or("sliding_window_pattern", r.integer_or("_sliding_window_pattern", 6)), c);
  c.sliding_window = r.integer_or("sliding_window", 4096);
}

// A Gemma 2 soft cap: absent, transformers' default; null, none (0); else a positive number.
double read_softcap(const ConfigReader& r, const char* key, double dflt) {
  if (r.doc.contains(key) && r.doc[key].is_null()) return 0;
  const double cap = r.number_or(key, dflt);
  if (!(cap > 0))
    r.fail(fmt::format("'{}' must be a positive number or null (no cap), got {}", key,
                       r.doc[key].dump()));
  return cap;
}

// Gemma 2: Gemma's layers without q/k norms, one rotary base for every layer, even-indexed
// layers local by default (Gemma2Config's layer_types), the attention scores and the final
// logits soft-capped (attn_logit_softcapping, final_logit_softcapping; null: none).
void read_gemma2(const ConfigReader& r, ModelConfig& c) {
  read_gemma_layers(r, c);
  read_rope(r, c);
  if (c.rope_scaling.type != "none")
    r.fail(
        fmt::format("rope scaling '{}' is not supported for Gemma2ForCausalLM (shardlm "
                    "scales only its global layers' frequencies)",
                    c.rope_scaling.type));
  c.rope_local_theta = c.rope_theta;
  c.attn_softcap = read_softcap(r, "attn_logit_softcapping", 50.0);
  c.final_softcap = read_softcap(r, "final_logit_softcapping", 30.0);
  read_local_global_layers(r, 2, c);
  c.sliding_window = r.doc.contains("sliding_window") && r.doc["sliding_window"].is_null()
                         ? 0
                         : r.integer_or("sliding_window", 4096);
}

}  // namespace

HfModelInfo read_hf_config(const std::string& dir) {
  const std::string file = (fs::path(dir) / "config.json").string();
  HfModelInfo info;
  info.raw = parse_config_file(file, dir);
  const ConfigReader r{file, info.raw};
  info.architecture = read_architecture(r);
  info.bnb_4bit = hf_config_is_bnb_4bit(info.raw, file);
  const bool qwen2 = info.architecture == "Qwen2ForCausalLM";
  const bool mistral = info.architecture == "MistralForCausalLM";
  const bool qwen3 = info.architecture == "Qwen3ForCausalLM";
  const bool gemma3 = info.architecture == "Gemma3ForCausalLM";
  const bool gemma2 = info.architecture == "Gemma2ForCausalLM";

  ModelConfig& c = info.config;
  c.name = read_model_name(r, dir);
  read_dimensions(r, c);
  check_supported_layers(r, qwen2, gemma2 || gemma3);
  c.attn_bias = qwen2;
  c.qk_norm = qwen3;
  if (gemma3) {
    read_gemma3(r, c);
  } else if (gemma2) {
    read_gemma2(r, c);
  } else {
    read_rope(r, c);
    read_sliding_window(r, qwen2 || qwen3, mistral, c);
  }
  for (const char* key : {"torch_dtype", "dtype"})  // the name before and after transformers 5
    if (r.has(key) && info.raw[key].is_string())
      info.torch_dtype = info.raw[key].get<std::string>();
  try {
    c.validate();
  } catch (const Error& e) {
    r.fail(e.what());
  }
  return info;
}

void read_hf_unit(const SafetensorsDir& st, const ParamLayout& L, int unit, float* out,
                  std::vector<Nf4Matrix>* nf4) {
  const int64_t begin = L.units[unit].begin, end = L.units[unit].end;
  for (const ParamEntry& e : L.entries) {
    if (e.offset < begin || e.offset >= end) continue;
    std::vector<int64_t> want;
    for (int i = 0; i < e.shape.rank(); ++i) want.push_back(e.shape[i]);
    if (is_bnb_nf4(st, e.name)) {
      Nf4Matrix m = read_bnb_nf4(st, e.name, want);
      nf4::dequantize(m.codes.data(), m.absmax.data(), 0, e.shape.numel(),
                      out + (e.offset - begin));
      m.begin = e.offset;
      if (nf4 != nullptr) nf4->push_back(std::move(m));
      continue;
    }
    if (!st.contains(e.name))
      SHARDLM_FAIL(ErrorKind::kData,
                   "{}: the safetensors files have no tensor '{}' ({}), which config.json implies",
                   st.dir(), e.name, L.unit_name(unit));
    const SafetensorsFile& f = st.file_of(e.name);
    const StTensorInfo& t = f.info(e.name);
    if (t.shape != want)
      SHARDLM_FAIL(ErrorKind::kData, "{}: tensor '{}' has shape {} but config.json implies {}",
                   f.path(), e.name, json(t.shape).dump(), json(want).dump());
    f.read_f32(e.name, out + (e.offset - begin));
  }
}

namespace {

// The tensors' safetensors declarations, in the shard `plan` puts them: entries [first, last).
std::vector<SafetensorsWriter::Decl> shard_decls(const std::vector<const ParamEntry*>& entries,
                                                 size_t first, size_t last, DType dtype) {
  std::vector<SafetensorsWriter::Decl> decls;
  for (size_t k = first; k < last; ++k) {
    std::vector<int64_t> shape;
    for (int d = 0; d < entries[k]->shape.rank(); ++d) shape.push_back(entries[k]->shape[d]);
    decls.push_back(
        {entries[k]->name, dtype == DType::kBF16 ? StDType::kBF16 : StDType::kF32, shape});
  }
  return decls;
}

void write_hf_json(const std::string& dir, const char* name, const json& j) {
  posix::replace_file((fs::path(dir) / name).string(), j.dump(2) + "\n");
}

}  // namespace

void write_hf_dir_streamed(const std::string& dir, const ParamLayout& L, DType dtype,
                           const json& config_json, size_t max_shard_bytes,
                           const HfChunkSource& chunk_values) {
  SHARDLM_CHECK_KIND(ErrorKind::kConfig, dtype == DType::kF32 || dtype == DType::kBF16,
                     "Hugging Face export writes float32 or bfloat16");
  fs::create_directories(dir);
  std::vector<const ParamEntry*> entries;  // in arena order, the order the values come in
  for (const ParamEntry& e : L.entries) entries.push_back(&e);
  std::sort(entries.begin(), entries.end(),
            [](const ParamEntry* a, const ParamEntry* b) { return a->offset < b->offset; });
  const size_t esize = dtype_size(dtype);
  std::vector<size_t> bytes;
  for (const ParamEntry* e : entries) bytes.push_back(size_t(e->shape.numel()) * esize);
  const ShardPlan plan = plan_safetensors_shards(bytes, max_shard_bytes);

  std::vector<float> chunk;    // [<= kHfExportChunk] f32 values of one tensor
  std::vector<uint16_t> conv;  // [<= kHfExportChunk] the same in bf16
  std::map<std::string, std::string> weight_map;
  uint64_t total = 0;
  size_t i = 0;
  for (int s = 0; s < int(plan.files.size()); ++s) {
    size_t last = i;
    while (last < entries.size() && plan.shard_of[last] == s) ++last;
    SafetensorsWriter w((fs::path(dir) / plan.files[s]).string(),
                        shard_decls(entries, i, last, dtype), {{"format", "pt"}});
    for (; i < last; ++i) {
      const ParamEntry& e = *entries[i];
      const int64_t numel = e.shape.numel();
      for (int64_t at = 0; at < numel; at += kHfExportChunk) {
        const int64_t n = std::min(kHfExportChunk, numel - at);
        chunk.resize(size_t(n));
        chunk_values(e, at, n, chunk.data());
        if (dtype == DType::kF32) {
          w.write(e.name, chunk.data(), size_t(n) * 4);
        } else {
          conv.resize(size_t(n));
          for (int64_t j = 0; j < n; ++j) conv[size_t(j)] = f32_to_bf16(chunk[size_t(j)]);
          w.write(e.name, conv.data(), size_t(n) * 2);
        }
      }
      weight_map[e.name] = plan.files[s];
      total += uint64_t(numel) * esize;
    }
    w.commit();
  }
  if (plan.files.size() > 1) write_safetensors_index(dir, weight_map, total);
  write_hf_json(dir, "config.json", config_json);
  json gen = {{"_from_model_config", true}};
  if (config_json.contains("bos_token_id")) gen["bos_token_id"] = config_json["bos_token_id"];
  if (config_json.contains("eos_token_id")) gen["eos_token_id"] = config_json["eos_token_id"];
  write_hf_json(dir, "generation_config.json", gen);
}

void write_hf_dir(const std::string& dir, const ParamLayout& L, DType dtype,
                  const json& config_json, size_t max_shard_bytes,
                  const std::function<void(int unit, float* out)>& unit_values) {
  std::vector<float> unit_buf(size_t(L.max_unit));  // [max_unit] the unit being written
  int loaded = -1;
  write_hf_dir_streamed(dir, L, dtype, config_json, max_shard_bytes,
                        [&](const ParamEntry& e, int64_t at, int64_t n, float* out) {
                          int u = 0;  // the unit holding the tensor
                          while (e.offset >= L.units[u].end) ++u;
                          if (u != loaded) {
                            unit_values(u, unit_buf.data());
                            loaded = u;
                          }
                          std::copy_n(unit_buf.data() + (e.offset - L.units[u].begin) + at, n, out);
                        });
}

}  // namespace shardlm
