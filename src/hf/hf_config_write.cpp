// config.json from a ModelConfig (hf.h's hf_config_json and default_hf_architecture): what
// each written architecture can express is checked first, so that an export never drops a
// setting the model trained with (the weights are hf_export.cpp's).
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <string>

#include "shardlm/core/check.h"
#include "shardlm/hf/hf.h"

namespace shardlm {

using json = nlohmann::json;

namespace {

// The sliding-window keys of config.json: the window, Qwen's switch and, where the layers
// differ, the first windowed layer (Qwen's max_window_layers; transformers 5 rebuilds
// layer_types from it) and layer_types itself when the file has it.
void write_sliding_window(const ModelConfig& c, bool qwen, bool no_window_keys, json& j) {
  const bool sliding = c.has_sliding_window();
  if (sliding) {
    j["sliding_window"] = c.sliding_window;
  } else if (!no_window_keys) {
    j["sliding_window"] = nullptr;
  }
  if (qwen) {
    j["use_sliding_window"] = sliding;
    int64_t first = c.n_layers;
    while (first > 0 && c.window_of_layer(first - 1) > 0) --first;
    if (sliding) j["max_window_layers"] = first;
    for (int64_t l = 0; l < first && !j.contains("layer_types"); ++l)
      SHARDLM_CHECK_KIND(ErrorKind::kConfig, c.window_of_layer(l) == 0,
                         "Qwen's config.json without layer_types windows the layers from "
                         "max_window_layers on, and this model's windowed layers (layer {}) are "
                         "not the last ones; export over an original config.json that has "
                         "layer_types",
                         l);
  }
  if (j.contains("layer_types")) {  // transformers 5: one entry per layer
    j["layer_types"] = json::array();
    for (int64_t l = 0; l < c.n_layers; ++l)
      j["layer_types"].push_back(c.window_of_layer(l) > 0 ? "sliding_attention" : "full_attention");
  }
}

// The fields Gemma 2's and 3's config.json share: the activation, the head width and the query
// scale (transformers types it an integer: written as one when it is whole).
void write_gemma_layer_fields(const ModelConfig& c, json& j) {
  j["hidden_activation"] = "gelu_pytorch_tanh";
  j["head_dim"] = c.head_dim();
  const double qpas = c.query_pre_attn_scalar > 0 ? c.query_pre_attn_scalar : double(c.head_dim());
  j["query_pre_attn_scalar"] = qpas == std::floor(qpas) ? json(int64_t(qpas)) : json(qpas);
}

// Gemma3ForCausalLM's config.json: the fields read_gemma3 reads, in the original's rotary
// spelling (transformers 5's rope_parameters per layer type, else rope_theta,
// rope_local_base_freq and rope_scaling).
json gemma3_config_json(const ModelConfig& c, json j) {
  SHARDLM_CHECK_KIND(ErrorKind::kConfig,
                     c.post_norms && c.norm_one_plus_weight && c.embed_scale && c.qk_norm &&
                         c.mlp_activation == "gelu_tanh" && !c.attn_bias &&
                         c.rope_scaling.type != "llama3",
                     "Gemma3ForCausalLM needs Gemma's layers (model.post_norms, "
                     "norm_one_plus_weight, embed_scale, qk_norm, mlp_activation = gelu_tanh, no "
                     "attn_bias or llama3 rope scaling), and this model differs");
  j["model_type"] = "gemma3_text";
  write_gemma_layer_fields(c, j);
  j["sliding_window"] = c.sliding_window;
  j["layer_types"] = json::array();
  for (int64_t l = 0; l < c.n_layers; ++l)
    j["layer_types"].push_back(c.window_of_layer(l) > 0 ? "sliding_attention" : "full_attention");
  json full = {{"rope_type", "default"}, {"rope_theta", c.rope_theta}};
  if (c.rope_scaling.type == "linear")
    full = {
        {"rope_type", "linear"}, {"rope_theta", c.rope_theta}, {"factor", c.rope_scaling.factor}};
  if (j.contains("rope_parameters")) {
    j["rope_parameters"] = {
        {"full_attention", full},
        {"sliding_attention", {{"rope_type", "default"}, {"rope_theta", c.rope_local_theta}}}};
  } else {
    j["rope_theta"] = c.rope_theta;
    j["rope_local_base_freq"] = c.rope_local_theta;
    j["rope_scaling"] = c.rope_scaling.type == "linear"
                            ? json{{"rope_type", "linear"}, {"factor", c.rope_scaling.factor}}
                            : json(nullptr);
  }
  if (!j.contains("max_position_embeddings")) j["max_position_embeddings"] = int64_t{32768};
  return j;
}

// Gemma2ForCausalLM's config.json: the fields read_gemma2 reads (one rotary base, in the
// original's spelling; the soft caps, null where the model has none).
json gemma2_config_json(const ModelConfig& c, json j) {
  SHARDLM_CHECK_KIND(ErrorKind::kConfig,
                     c.post_norms && c.norm_one_plus_weight && c.embed_scale && !c.qk_norm &&
                         c.mlp_activation == "gelu_tanh" && !c.attn_bias &&
                         c.rope_scaling.type == "none" && c.rope_local_theta == c.rope_theta,
                     "Gemma2ForCausalLM needs Gemma's layers without q/k norms (model.post_norms, "
                     "norm_one_plus_weight, embed_scale, mlp_activation = gelu_tanh, no qk_norm, "
                     "attn_bias or rope scaling, model.rope_local_theta = model.rope_theta), and "
                     "this model differs");
  j["model_type"] = "gemma2";
  write_gemma_layer_fields(c, j);
  j["attn_logit_softcapping"] = c.attn_softcap > 0 ? json(c.attn_softcap) : json(nullptr);
  j["final_logit_softcapping"] = c.final_softcap > 0 ? json(c.final_softcap) : json(nullptr);
  j["sliding_window"] = c.sliding_window;
  j["layer_types"] = json::array();
  for (int64_t l = 0; l < c.n_layers; ++l)
    j["layer_types"].push_back(c.local_layer(l) ? "sliding_attention" : "full_attention");
  if (j.contains("rope_parameters")) {
    j["rope_parameters"] = {{"rope_theta", c.rope_theta}, {"rope_type", "default"}};
  } else {
    j["rope_theta"] = c.rope_theta;
  }
  if (!j.contains("max_position_embeddings")) j["max_position_embeddings"] = int64_t{8192};
  return j;
}

// Gemma's local layers have the model's window, its global layers none: the pattern
// config.json's layer_types and sliding_window express (Gemma 2 may have no window at all).
void check_gemma_layers(const ModelConfig& c, const std::string& architecture) {
  const bool gemma2 = architecture == "Gemma2ForCausalLM";
  SHARDLM_CHECK_KIND(ErrorKind::kConfig,
                     (gemma2 || c.sliding_window > 0) && c.global_layer_every > 0,
                     "{} has local sliding-window layers and global ones, and this model has "
                     "model.sliding_window = {} and model.global_layer_every = {}; set both",
                     architecture, c.sliding_window, c.global_layer_every);
  for (int64_t l = 0; l < c.n_layers; ++l)
    SHARDLM_CHECK_KIND(ErrorKind::kConfig,
                       c.window_of_layer(l) == (c.local_layer(l) ? c.sliding_window : 0),
                       "{} windows exactly its local layers, and layer {} (a {} layer of "
                       "model.global_layer_every = {}) has a window of {}",
                       architecture, l, c.local_layer(l) ? "local" : "global", c.global_layer_every,
                       c.window_of_layer(l));
}

// Only Gemma 2's config.json holds the soft caps: another architecture would drop them.
void check_no_softcaps(const ModelConfig& c, const std::string& architecture) {
  const char* key = c.attn_softcap > 0    ? "model.attn_softcap"
                    : c.final_softcap > 0 ? "model.final_softcap"
                                          : nullptr;
  SHARDLM_CHECK_KIND(ErrorKind::kConfig, key == nullptr,
                     "{} cannot express {} (Gemma 2's soft-capping, which this model has); export "
                     "it as Gemma2ForCausalLM",
                     architecture, key ? key : "");
}

// The settings only Gemma's config.json can say: another architecture would drop them.
void check_no_gemma_settings(const ModelConfig& c, const std::string& architecture) {
  const char* key = c.mlp_activation != "silu"     ? "model.mlp_activation"
                    : c.norm_one_plus_weight       ? "model.norm_one_plus_weight"
                    : c.embed_scale                ? "model.embed_scale"
                    : c.query_pre_attn_scalar != 0 ? "model.query_pre_attn_scalar"
                    : c.global_layer_every != 0    ? "model.global_layer_every"
                                                   : nullptr;
  SHARDLM_CHECK_KIND(ErrorKind::kConfig, key == nullptr,
                     "{} cannot express {} (a Gemma setting this model has); export it as "
                     "Gemma2ForCausalLM or Gemma3ForCausalLM",
                     architecture, key ? key : "");
}

// GLM's rotary embedding (interleaved pairs, partial_rotary_factor) is GlmForCausalLM's and
// Glm4ForCausalLM's alone, and they have no other: either side would change the function.
void check_glm_rope(const ModelConfig& c, const std::string& architecture, bool glm) {
  SHARDLM_CHECK_KIND(ErrorKind::kConfig, c.rope_interleaved == glm,
                     "{} {} GLM's interleaved rotary pairs (model.rope_interleaved), and this "
                     "model has {}",
                     architecture, glm ? "needs" : "has no",
                     c.rope_interleaved ? "them" : "rotate_half's");
  SHARDLM_CHECK_KIND(ErrorKind::kConfig, glm || c.rope_partial_factor == 1.0,
                     "{} rotates whole heads, and this model rotates a part of each "
                     "(model.rope_partial_factor = {}); export it as GlmForCausalLM",
                     architecture, c.rope_partial_factor);
  SHARDLM_CHECK_KIND(ErrorKind::kConfig, !glm || c.post_norm_names == "glm4" || !c.post_norms,
                     "{} names its post-norms GLM-4's way (model.post_norm_names = \"glm4\"), "
                     "and this model has Gemma's",
                     architecture);
}

// What `architecture` can express of c: one of the written architectures, Qwen2's and GLM's
// biases, Qwen3's q/k norms, GLM's rotary embedding, no window on Llama and one window on every
// layer on Mistral.
void check_exportable(const ModelConfig& c, const std::string& architecture) {
  SHARDLM_CHECK_KIND(
      ErrorKind::kConfig,
      std::find(std::begin(kHfArchitectures), std::end(kHfArchitectures), architecture) !=
          std::end(kHfArchitectures),
      "architecture '{}': shardlm writes LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, "
      "Qwen3ForCausalLM, Gemma2ForCausalLM, Gemma3ForCausalLM, GlmForCausalLM or "
      "Glm4ForCausalLM",
      architecture);
  const bool gemma3 = architecture == "Gemma3ForCausalLM";
  const bool gemma2 = architecture == "Gemma2ForCausalLM";
  const bool qwen2 = architecture == "Qwen2ForCausalLM";
  const bool qwen3 = architecture == "Qwen3ForCausalLM";
  const bool glm4 = architecture == "Glm4ForCausalLM";
  const bool glm = glm4 || architecture == "GlmForCausalLM";
  SHARDLM_CHECK_KIND(ErrorKind::kConfig, glm || c.attn_bias == qwen2,
                     "{} {} q/k/v biases, and this model has {}", architecture,
                     qwen2 ? "needs" : "has no", c.attn_bias ? "them" : "none");
  check_glm_rope(c, architecture, glm);
  SHARDLM_CHECK_KIND(ErrorKind::kConfig, c.post_norms == (gemma2 || gemma3 || glm4),
                     "{} {} post-norms (model.post_norms), and this model has {}", architecture,
                     gemma2 || gemma3 || glm4 ? "needs" : "has no", c.post_norms ? "them" : "none");
  SHARDLM_CHECK_KIND(ErrorKind::kConfig, !(gemma2 || gemma3) || c.post_norm_names == "gemma",
                     "{} names its post-norms Gemma's way (model.post_norm_names = \"gemma\"), "
                     "and this model has GLM-4's",
                     architecture);
  SHARDLM_CHECK_KIND(ErrorKind::kConfig, !glm || !c.has_sliding_window(),
                     "{} has no sliding window, and this model has one (model.sliding_window = "
                     "{})",
                     architecture, c.sliding_window);
  SHARDLM_CHECK_KIND(ErrorKind::kConfig, c.qk_norm == (qwen3 || gemma3),
                     "{} {} q/k norms (model.qk_norm), and this model has {}", architecture,
                     qwen3 || gemma3 ? "needs" : "has no", c.qk_norm ? "them" : "none");
  // Llama has no sliding window; Mistral's is one window on every layer.
  const bool mistral = architecture == "MistralForCausalLM";
  bool uniform = true;
  for (int64_t l = 0; l < c.n_layers; ++l)
    uniform = uniform && c.window_of_layer(l) == c.sliding_window;
  SHARDLM_CHECK_KIND(ErrorKind::kConfig,
                     architecture != "LlamaForCausalLM" || !c.has_sliding_window(),
                     "LlamaForCausalLM has no sliding window, and this model has one "
                     "(model.sliding_window = {}); export it as MistralForCausalLM",
                     c.sliding_window);
  SHARDLM_CHECK_KIND(ErrorKind::kConfig, !mistral || uniform,
                     "MistralForCausalLM has one sliding window on every layer, and this model's "
                     "layers differ; export it as Qwen2ForCausalLM or Qwen3ForCausalLM");
  for (int64_t l = 0; l < c.n_layers; ++l)
    SHARDLM_CHECK_KIND(ErrorKind::kConfig,
                       c.window_of_layer(l) == 0 || c.window_of_layer(l) == c.sliding_window,
                       "config.json holds one sliding window per model, and layer {} has {} "
                       "where model.sliding_window is {}",
                       l, c.window_of_layer(l), c.sliding_window);
  if (!gemma2) check_no_softcaps(c, architecture);
  if (gemma2 || gemma3) return check_gemma_layers(c, architecture);
  check_no_gemma_settings(c, architecture);
}

}  // namespace

std::string default_hf_architecture(const ModelConfig& cfg) {
  if (cfg.rope_interleaved) return cfg.post_norms ? "Glm4ForCausalLM" : "GlmForCausalLM";
  if (cfg.post_norms) return cfg.qk_norm ? "Gemma3ForCausalLM" : "Gemma2ForCausalLM";
  if (cfg.qk_norm) return "Qwen3ForCausalLM";
  if (cfg.attn_bias) return "Qwen2ForCausalLM";
  return cfg.has_sliding_window() ? "MistralForCausalLM" : "LlamaForCausalLM";
}

json hf_config_json(const ModelConfig& c, const std::string& architecture, DType dtype,
                    const json& original) {
  check_exportable(c, architecture);
  const bool gemma3 = architecture == "Gemma3ForCausalLM";
  const bool gemma2 = architecture == "Gemma2ForCausalLM";
  const bool qwen2 = architecture == "Qwen2ForCausalLM";
  const bool qwen3 = architecture == "Qwen3ForCausalLM";
  const bool mistral = architecture == "MistralForCausalLM";
  const bool glm4 = architecture == "Glm4ForCausalLM";
  const bool glm = glm4 || architecture == "GlmForCausalLM";
  json j = original.is_object() ? original : json::object();
  j.erase("quantization_config");  // shardlm writes dense weights
  j["architectures"] = {architecture};
  j["model_type"] = qwen2     ? "qwen2"
                    : qwen3   ? "qwen3"
                    : mistral ? "mistral"
                    : glm4    ? "glm4"
                    : glm     ? "glm"
                              : "llama";
  j["hidden_size"] = c.dim;
  j["num_hidden_layers"] = c.n_layers;
  j["num_attention_heads"] = c.n_heads;
  j["num_key_value_heads"] = c.n_kv_heads;
  j["intermediate_size"] = c.ffn_dim;
  j["vocab_size"] = c.vocab_size;
  j["rms_norm_eps"] = c.norm_eps;
  j["tie_word_embeddings"] = c.tie_embeddings;
  const char* dtype_name_key =
      j.contains("dtype") && !j.contains("torch_dtype") ? "dtype" : "torch_dtype";
  if (gemma2 || gemma3) {
    j[dtype_name_key] = dtype == DType::kBF16 ? "bfloat16" : "float32";
    return gemma2 ? gemma2_config_json(c, j) : gemma3_config_json(c, j);
  }
  // Fields whose value is the architecture's default are written for a new model, and for an
  // imported one only where its config.json had them (so that a round trip is exact).
  const bool fresh = !original.is_object() || original.empty();
  auto set_default = [&](const char* key, const json& value) {
    if (fresh || j.contains(key)) j[key] = value;
  };
  j["hidden_act"] = "silu";
  if (c.explicit_head_dim > 0 || glm)  // transformers computes no other (GLM's default: 128)
    j["head_dim"] = c.head_dim();
  else
    set_default("head_dim", c.head_dim());
  if (glm)  // GLM's attention_bias is q/k/v biases (its o_proj has none), true by default
    j["attention_bias"] = c.attn_bias;
  else if (!qwen2)
    set_default("attention_bias", false);
  if (architecture == "LlamaForCausalLM") set_default("mlp_bias", false);
  // transformers 5 spells the rotary settings rope_parameters, earlier versions (and most
  // published checkpoints) rope_theta + rope_scaling; transformers 5 reads both. Keep the
  // original's spelling, the classic one for a model that has none.
  json scaling = nullptr;
  if (c.rope_scaling.type == "linear")
    scaling = {{"rope_type", "linear"}, {"factor", c.rope_scaling.factor}};
  if (c.rope_scaling.type == "llama3")
    scaling = {{"rope_type", "llama3"},
               {"factor", c.rope_scaling.factor},
               {"low_freq_factor", c.rope_scaling.low_freq_factor},
               {"high_freq_factor", c.rope_scaling.high_freq_factor},
               {"original_max_position_embeddings", c.rope_scaling.original_max_position}};
  if (j.contains("rope_parameters")) {
    json params = {{"rope_theta", c.rope_theta}, {"rope_type", "default"}};
    if (!scaling.is_null()) params.update(scaling);
    if (glm) params["partial_rotary_factor"] = c.rope_partial_factor;
    j["rope_parameters"] = params;
    j.erase("rope_theta");
    j.erase("rope_scaling");
    j.erase("partial_rotary_factor");
  } else {
    j["rope_theta"] = c.rope_theta;
    j["rope_scaling"] = scaling;
    if (glm) j["partial_rotary_factor"] = c.rope_partial_factor;
  }
  // Llama's and GLM's config.json have no sliding-window keys
  write_sliding_window(c, qwen2 || qwen3, architecture == "LlamaForCausalLM" || glm, j);
  if (!j.contains("max_position_embeddings"))
    j["max_position_embeddings"] =
        c.rope_scaling.type == "llama3"
            ? int64_t(double(c.rope_scaling.original_max_position) * c.rope_scaling.factor)
            : int64_t{8192};
  j[dtype_name_key] = dtype == DType::kBF16 ? "bfloat16" : "float32";
  return j;
}

}  // namespace shardlm
