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
        "Qwen2ForCausalLM, Qwen3ForCausalLM, Gemma2ForCausalLM, Gemma3ForCausalLM, "
        "GlmForCausalLM, Glm4ForCausalLM)");
  const std::string architecture = doc["architectures"][0].get<std::string>();
  if (std::find(std::begin(kHfArchitectures), std::end(kHfArchitectures), architecture) ==
      std::end(kHfArchitectures))
    r.fail(
        fmt::format("architecture '{}' is not supported; shardlm reads LlamaForCausalLM, "
                    "MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, "
                    "Gemma2ForCausalLM, Gemma3ForCausalLM, GlmForCausalLM and Glm4ForCausalLM",
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
// hidden_size / num_attention_heads (Qwen3's) becomes model.head_dim. Without head_dim the heads
// are hidden_size / num_attention_heads wide, except GLM's (GlmConfig's default 128, read_glm).
void read_dimensions(const ConfigReader& r, ModelConfig& c, bool glm) {
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
  } else if (!glm && c.dim % c.n_heads != 0) {
    r.fail(
        fmt::format("hidden_size {} is not a multiple of num_attention_heads {}, and there is "
                    "no head_dim",
                    c.dim, c.n_heads));
  }
}

// The layer variants shardlm's decoder does not have: another activation, partial rotary
// embeddings outside GLM, MLP biases, and attention biases beyond q, k, v (Qwen2's, and GLM's
// attention_bias, which transformers puts on q, k and v only).
void check_supported_layers(const ConfigReader& r, bool qwen2, bool gemma, bool glm) {
  if (!gemma && r.has("hidden_act") && r.doc["hidden_act"] != "silu")
    r.fail(fmt::format("hidden_act = {} is not supported (shardlm's MLP is SwiGLU with silu)",
                       r.doc["hidden_act"].dump()));
  if (!glm && r.number_or("partial_rotary_factor", 1.0) != 1.0)
    r.fail(
        "partial_rotary_factor != 1 (rotary embedding on part of each head) is supported for "
        "GlmForCausalLM and Glm4ForCausalLM only");
  if (r.boolean_or("mlp_bias", false)) r.fail("mlp_bias = true is not supported");
  if (!qwen2 && !glm && r.boolean_or("attention_bias", false))
    r.fail(
        "attention_bias = true (biases on q, k, v and o_proj) is not supported; shardlm has "
        "q, k, v biases only (Qwen2, GLM)");
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

// GLM-4 (GlmForCausalLM) and GLM-4-0414 (Glm4ForCausalLM): GlmConfig's defaults (q/k/v biases,
// heads of 128, norm epsilon 1.5625e-7), rotary embeddings on the first partial_rotary_factor of
// each head (rope_parameters' in transformers 5, top-level in the published files; 0.5 when
// absent) in interleaved pairs; Glm4 adds the post-norms under GLM-4's names.
void read_glm(const ConfigReader& r, bool glm4, ModelConfig& c) {
  c.attn_bias = r.boolean_or("attention_bias", true);
  if (!r.has("head_dim") && c.dim != 128 * c.n_heads) c.explicit_head_dim = 128;
  c.norm_eps = r.number_or("rms_norm_eps", 1.5625e-07);
  c.rope_partial_factor = r.number_or("partial_rotary_factor", 0.5);
  if (r.has("rope_parameters") && r.doc["rope_parameters"].is_object())
    c.rope_partial_factor =
        ConfigReader{r.file + " rope_parameters", r.doc["rope_parameters"]}.number_or(
            "partial_rotary_factor", c.rope_partial_factor);
  c.rope_interleaved = true;
  c.post_norms = glm4;
  c.post_norm_names = "glm4";
  read_rope(r, c);
  if (c.rope_scaling.type != "none")
    r.fail(fmt::format("rope scaling '{}' is not supported for GLM", c.rope_scaling.type));
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
  const bool glm4 = info.architecture == "Glm4ForCausalLM";
  const bool glm = glm4 || info.architecture == "GlmForCausalLM";

  ModelConfig& c = info.config;
  c.name = read_model_name(r, dir);
  read_dimensions(r, c, glm);
  check_supported_layers(r, qwen2, gemma2 || gemma3, glm);
  c.attn_bias = qwen2;
  c.qk_norm = qwen3;
  if (glm) {
    read_glm(r, glm4, c);
  } else if (gemma3) {
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

namespace {

bool ends_with(const std::string& s, std::string_view tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

constexpr std::string_view kGateName = "mlp.gate_proj.weight";
constexpr std::string_view kUpName = "mlp.up_proj.weight";

// GLM's name for a layer's gate and up projections stored as one tensor: "...mlp.gate_up_proj
// .weight" for either's entry name, "" for any other.
std::string fused_gate_up_name(const std::string& name) {
  for (std::string_view tail : {kGateName, kUpName})
    if (ends_with(name, tail))
      return name.substr(0, name.size() - tail.size()) + "mlp.gate_up_proj.weight";
  return "";
}

// Entry e (a gate_proj) and the next (its up_proj) from the directory's fused gate_up_proj
// [2F, D] (GLM), gate rows first, into out (the layout keeps the two adjacent, gate first, so the
// fused tensor is the two as they lie); false when the directory has no such tensor.
bool read_fused_gate_up(const SafetensorsDir& st, const ParamLayout& L, const ParamEntry& e,
                        float* out) {
  const std::string fused = fused_gate_up_name(e.name);
  if (fused.empty() || !ends_with(e.name, kGateName) || !st.contains(fused)) return false;
  const auto at = size_t(&e - L.entries.data());
  SHARDLM_CHECK(at + 1 < L.entries.size() && ends_with(L.entries[at + 1].name, kUpName) &&
                    L.entries[at + 1].offset == e.offset + e.shape.numel(),
                "read_fused_gate_up: {} is not followed by its up projection", e.name);
  const std::vector<int64_t> want = {2 * e.shape[0], e.shape[1]};
  const SafetensorsFile& f = st.file_of(fused);
  if (f.info(fused).shape != want)
    SHARDLM_FAIL(ErrorKind::kData, "{}: tensor '{}' has shape {} but config.json implies {}",
                 f.path(), fused, json(f.info(fused).shape).dump(), json(want).dump());
  f.read_f32(fused, out);
  return true;
}

}  // namespace

void read_hf_unit(const SafetensorsDir& st, const ParamLayout& L, int unit, float* out,
                  std::vector<Nf4Matrix>* nf4) {
  const int64_t begin = L.units[unit].begin, end = L.units[unit].end;
  for (const ParamEntry& e : L.entries) {
    if (e.offset < begin || e.offset >= end) continue;
    // GLM's fused gate_up_proj fills the gate's entry and the up's after it
    if (!st.contains(e.name) && read_fused_gate_up(st, L, e, out + (e.offset - begin))) continue;
    if (!st.contains(e.name) && ends_with(e.name, kUpName) &&
        st.contains(fused_gate_up_name(e.name)))
      continue;
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

// One tensor of the written directory: one layout entry, or (GLM's gate_up_proj) a gate entry
// and the up entry after it, written one after the other.
struct HfTensor {
  std::string name;
  std::vector<int64_t> shape;
  std::vector<const ParamEntry*> parts;
};

// The entries (in arena order) as the directory's tensors; fuse_gate_up joins each layer's gate
// and up projections into GLM's gate_up_proj [2F, D].
std::vector<HfTensor> hf_tensors(const std::vector<const ParamEntry*>& entries, bool fuse_gate_up) {
  std::vector<HfTensor> out;
  for (size_t k = 0; k < entries.size(); ++k) {
    const ParamEntry& e = *entries[k];
    std::vector<int64_t> shape;
    for (int d = 0; d < e.shape.rank(); ++d) shape.push_back(e.shape[d]);
    if (fuse_gate_up && ends_with(e.name, kGateName) && k + 1 < entries.size() &&
        ends_with(entries[k + 1]->name, kUpName)) {
      shape[0] += entries[k + 1]->shape[0];
      out.push_back({fused_gate_up_name(e.name), shape, {&e, entries[k + 1]}});
      ++k;
      continue;
    }
    out.push_back({e.name, shape, {&e}});
  }
  return out;
}

// The tensors' safetensors declarations, in the shard `plan` puts them: tensors [first, last).
std::vector<SafetensorsWriter::Decl> shard_decls(const std::vector<HfTensor>& tensors, size_t first,
                                                 size_t last, DType dtype) {
  std::vector<SafetensorsWriter::Decl> decls;
  for (size_t k = first; k < last; ++k)
    decls.push_back({tensors[k].name, dtype == DType::kBF16 ? StDType::kBF16 : StDType::kF32,
                     tensors[k].shape});
  return decls;
}

void write_hf_json(const std::string& dir, const char* name, const json& j) {
  posix::replace_file((fs::path(dir) / name).string(), j.dump(2) + "\n");
}

}  // namespace

bool hf_architecture_fuses_gate_up(const std::string& architecture) {
  return architecture == "GlmForCausalLM" || architecture == "Glm4ForCausalLM";
}

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
  const json& archs = config_json.contains("architectures") ? config_json["architectures"] : json();
  const std::string architecture =
      archs.is_array() && !archs.empty() && archs[0].is_string() ? archs[0].get<std::string>() : "";
  const std::vector<HfTensor> tensors =
      hf_tensors(entries, hf_architecture_fuses_gate_up(architecture));
  const size_t esize = dtype_size(dtype);
  std::vector<size_t> bytes;
  for (const HfTensor& t : tensors) {
    int64_t numel = 1;
    for (int64_t d : t.shape) numel *= d;
    bytes.push_back(size_t(numel) * esize);
  }
  const ShardPlan plan = plan_safetensors_shards(bytes, max_shard_bytes);

  std::vector<float> chunk;    // [<= kHfExportChunk] f32 values of one tensor
  std::vector<uint16_t> conv;  // [<= kHfExportChunk] the same in bf16
  std::map<std::string, std::string> weight_map;
  uint64_t total = 0;
  size_t i = 0;
  for (int s = 0; s < int(plan.files.size()); ++s) {
    size_t last = i;
    while (last < tensors.size() && plan.shard_of[last] == s) ++last;
    SafetensorsWriter w((fs::path(dir) / plan.files[s]).string(),
                        shard_decls(tensors, i, last, dtype), {{"format", "pt"}});
    for (; i < last; ++i) {
      for (const ParamEntry* part : tensors[i].parts) {
        const int64_t numel = part->shape.numel();
        for (int64_t at = 0; at < numel; at += kHfExportChunk) {
          const int64_t n = std::min(kHfExportChunk, numel - at);
          chunk.resize(size_t(n));
          chunk_values(*part, at, n, chunk.data());
          if (dtype == DType::kF32) {
            w.write(tensors[i].name, chunk.data(), size_t(n) * 4);
          } else {
            conv.resize(size_t(n));
            for (int64_t j = 0; j < n; ++j) conv[size_t(j)] = f32_to_bf16(chunk[size_t(j)]);
            w.write(tensors[i].name, conv.data(), size_t(n) * 2);
          }
        }
      }
      weight_map[tensors[i].name] = plan.files[s];
      total += bytes[i];
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
