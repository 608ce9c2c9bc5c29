// Model presets (real published shapes) and validation of ModelConfig.
#include "shardlm/model/config.h"

#include <cmath>
#include <numbers>

#include "shardlm/core/check.h"

namespace shardlm {
namespace {

struct Preset {
  const char* name;
  ModelConfig (*make)();
};

ModelConfig make(const char* name, int64_t dim, int64_t layers, int64_t heads, int64_t kv,
                 int64_t ffn, int64_t vocab, double theta, double eps, bool tie, bool bias) {
  ModelConfig c;
  c.name = name;
  c.dim = dim;
  c.n_layers = layers;
  c.n_heads = heads;
  c.n_kv_heads = kv;
  c.ffn_dim = ffn;
  c.vocab_size = vocab;
  c.rope_theta = theta;
  c.norm_eps = eps;
  c.tie_embeddings = tie;
  c.attn_bias = bias;
  return c;
}

ModelConfig llama3(const char* name, int64_t dim, int64_t layers, int64_t heads, int64_t kv,
                   int64_t ffn, bool tie, double factor) {
  ModelConfig c = make(name, dim, layers, heads, kv, ffn, 128256, 500000.0, 1e-5, tie, false);
  c.rope_scaling.type = "llama3";
  c.rope_scaling.factor = factor;
  c.rope_scaling.low_freq_factor = 1.0;
  c.rope_scaling.high_freq_factor = 4.0;
  c.rope_scaling.original_max_position = 8192;
  return c;
}

// Qwen3 (the Qwen/Qwen3-* config.json files): heads of 128 whatever the width, q/k norms,
// no biases, 151936 tokens, rope_theta 1e6, rms_norm_eps 1e-6.
ModelConfig qwen3(const char* name, int64_t dim, int64_t layers, int64_t heads, int64_t kv,
                  int64_t ffn, bool tie) {
  ModelConfig c = make(name, dim, layers, heads, kv, ffn, 151936, 1000000.0, 1e-6, tie, false);
  c.explicit_head_dim = 128;
  c.qk_norm = true;
  return c;
}

// Gemma 3 text models (the google/gemma-3-*-pt config.json files; the text_config of the 4B,
// 12B and 27B): GeGLU, (1 + w) norms, post-norms, q/k norms, embeddings times sqrt(dim), tied;
// every 6th layer global (rope_theta 1e6, linear scaling 8 beyond 1B), the others local over
// a sliding window (rope_local_theta 1e4).
ModelConfig gemma3(const char* name, int64_t dim, int64_t layers, int64_t heads, int64_t kv,
                   int64_t head_dim, int64_t ffn, int64_t vocab, int64_t window, double qpas,
                   double linear_factor) {
  ModelConfig c = make(name, dim, layers, heads, kv, ffn, vocab, 1000000.0, 1e-6, true, false);
  c.explicit_head_dim = head_dim;
  c.qk_norm = true;
  c.norm_one_plus_weight = true;
  c.embed_scale = true;
  c.post_norms = true;
  c.mlp_activation = "gelu_tanh";
  c.query_pre_attn_scalar = qpas;
  c.sliding_window = window;
  c.global_layer_every = 6;
  c.rope_local_theta = 10000.0;
  if (linear_factor > 1) {
    c.rope_scaling.type = "linear";
    c.rope_scaling.factor = linear_factor;
  }
  return c;
}

// Gemma 2 (the google/gemma-2-*b config.json files): Gemma 3's layers without q/k norms, one
// rotary base (1e4) for every layer, even-indexed layers local over a 4096-token window, the
// odd ones global; 256000 tokens, heads of 256 (27B: 128), attention scores soft-capped at 50
// and the final logits at 30.
ModelConfig gemma2(const char* name, int64_t dim, int64_t layers, int64_t heads, int64_t kv,
                   int64_t head_dim, int64_t ffn, double qpas) {
  ModelConfig c = make(name, dim, layers, heads, kv, ffn, 256000, 10000.0, 1e-6, true, false);
  c.explicit_head_dim = head_dim;
  c.norm_one_plus_weight = true;
  c.embed_scale = true;
  c.post_norms = true;
  c.mlp_activation = "gelu_tanh";
  c.query_pre_attn_scalar = qpas;
  c.sliding_window = 4096;
  c.global_layer_every = 2;
  c.rope_local_theta = 10000.0;
  c.attn_softcap = 50.0;
  c.final_softcap = 30.0;
  return c;
}

// GLM-4 (THUDM/glm-4-9b-chat-hf, GlmForCausalLM): q/k/v biases, heads of 128 with 2 k/v heads,
// rotary embeddings on the first half of each head in interleaved pairs (rope_theta 1e4),
// 151552 tokens, untied. post_norms: GLM-4-0414 (THUDM/GLM-4-9B-0414, Glm4ForCausalLM), whose
// sublayer outputs are normed before the residual add (GLM-4's names for Gemma's post-norms).
ModelConfig glm4(const char* name, double eps, bool post_norms) {
  ModelConfig c = make(name, 4096, 40, 32, 2, 13696, 151552, 10000.0, eps, false, true);
  c.explicit_head_dim = 128;
  c.rope_partial_factor = 0.5;
  c.rope_interleaved = true;
  c.post_norms = post_norms;
  c.post_norm_names = "glm4";
  return c;
}

const Preset kPresets[] = {
    // Byte-level vocabulary (256 bytes + specials, padded to 320); trains in a minute on 2 cores.
    {"tiny", [] { return make("tiny", 128, 4, 4, 2, 384, 320, 10000.0, 1e-5, false, false); }},
    {"llama3.2-1b", [] { return llama3("llama3.2-1b", 2048, 16, 32, 8, 8192, true, 32.0); }},
    {"llama3.1-8b", [] { return llama3("llama3.1-8b", 4096, 32, 32, 8, 14336, false, 8.0); }},
    {"llama3.1-70b", [] { return llama3("llama3.1-70b", 8192, 80, 64, 8, 28672, false, 8.0); }},
    {"mistral-7b",
     [] {
       return make("mistral-7b", 4096, 32, 32, 8, 14336, 32768, 1000000.0, 1e-5, false, false);
     }},
    {"qwen2.5-0.5b",
     [] {
       return make("qwen2.5-0.5b", 896, 24, 14, 2, 4864, 151936, 1000000.0, 1e-6, true, true);
     }},
    {"qwen2.5-7b",
     [] {
       return make("qwen2.5-7b", 3584, 28, 28, 4, 18944, 152064, 1000000.0, 1e-6, false, true);
     }},
    {"qwen3-0.6b", [] { return qwen3("qwen3-0.6b", 1024, 28, 16, 8, 3072, true); }},
    {"qwen3-8b", [] { return qwen3("qwen3-8b", 4096, 36, 32, 8, 12288, false); }},
    {"qwen3-32b", [] { return qwen3("qwen3-32b", 5120, 64, 64, 8, 25600, false); }},
    {"gemma2-2b", [] { return gemma2("gemma2-2b", 2304, 26, 8, 4, 256, 9216, 256); }},
    {"gemma2-9b", [] { return gemma2("gemma2-9b", 3584, 42, 16, 8, 256, 14336, 256); }},
    {"gemma2-27b", [] { return gemma2("gemma2-27b", 4608, 46, 32, 16, 128, 36864, 144); }},
    {"gemma3-1b",
     [] { return gemma3("gemma3-1b", 1152, 26, 4, 1, 256, 6912, 262144, 512, 256, 1); }},
    {"gemma3-4b",
     [] { return gemma3("gemma3-4b", 2560, 34, 8, 4, 256, 10240, 262208, 1024, 256, 8); }},
    {"gemma3-12b",
     [] { return gemma3("gemma3-12b", 3840, 48, 16, 8, 256, 15360, 262208, 1024, 256, 8); }},
    {"gemma3-27b",
     [] { return gemma3("gemma3-27b", 5376, 62, 32, 16, 128, 21504, 262208, 1024, 168, 8); }},
    {"glm4-9b", [] { return glm4("glm4-9b", 1.5625e-07, false); }},
    {"glm4-9b-0414", [] { return glm4("glm4-9b-0414", 1e-05, true); }},
};

}  // namespace

std::vector<std::string> model_preset_names() {
  std::vector<std::string> names;
  for (const auto& p : kPresets) names.emplace_back(p.name);
  return names;
}

ModelConfig model_preset(const std::string& name) {
  for (const auto& p : kPresets)
    if (name == p.name) return p.make();
  std::string valid;
  for (const auto& p : kPresets) valid += std::string(valid.empty() ? "" : ", ") + p.name;
  SHARDLM_FAIL(ErrorKind::kConfig, "model.preset: unknown preset '{}'; valid presets: {}", name,
               valid);
}

void ModelConfig::validate() const {
  auto positive = [](int64_t v, const char* key) {
    if (v <= 0) SHARDLM_FAIL(ErrorKind::kConfig, "{} must be a positive integer, got {}", key, v);
  };
  positive(dim, "model.dim");
  positive(n_layers, "model.n_layers");
  positive(n_heads, "model.n_heads");
  positive(n_kv_heads, "model.n_kv_heads");
  positive(ffn_dim, "model.ffn_dim");
  positive(vocab_size, "model.vocab_size");
  if (explicit_head_dim < 0)
    SHARDLM_FAIL(ErrorKind::kConfig,
                 "model.head_dim must be a positive integer, or 0 for model.dim / model.n_heads; "
                 "got {}",
                 explicit_head_dim);
  if (tp_shards < 1 || (explicit_head_dim == 0 && dim % (n_heads * tp_shards) != 0))
    SHARDLM_FAIL(ErrorKind::kConfig,
                 "model.dim ({}) must be divisible by model.n_heads ({}); pick n_heads that "
                 "divides dim, or set model.head_dim",
                 dim, n_heads * tp_shards);
  if (pp_begin < 0 || pp_begin >= stage_end() || stage_end() > n_layers)
    SHARDLM_FAIL(ErrorKind::kInternal, "pipeline stage layers [{}, {}) are not in [0, {})",
                 pp_begin, stage_end(), n_layers);
  if (head_dim() % 2 != 0)
    SHARDLM_FAIL(ErrorKind::kConfig,
                 "the head dimension (model.head_dim, else model.dim / model.n_heads) = {} must be "
                 "even for rotary embeddings",
                 head_dim());
  if (!(rope_partial_factor > 0 && rope_partial_factor <= 1) || rotary_dim() < 2 ||
      rotary_dim() % 2 != 0)
    SHARDLM_FAIL(ErrorKind::kConfig,
                 "model.rope_partial_factor must be in (0, 1] and rotate an even number of each "
                 "head's {} dims; got {} (int({} x {}) = {} dims)",
                 head_dim(), rope_partial_factor, head_dim(), rope_partial_factor, rotary_dim());
  if (post_norm_names != "gemma" && post_norm_names != "glm4")
    SHARDLM_FAIL(ErrorKind::kConfig,
                 "model.post_norm_names must be \"gemma\" or \"glm4\", got \"{}\"",
                 post_norm_names);
  if (n_heads % n_kv_heads != 0)
    SHARDLM_FAIL(ErrorKind::kConfig,
                 "model.n_heads ({}) must be a multiple of model.n_kv_heads ({}) for grouped-query "
                 "attention",
                 n_heads, n_kv_heads);
  if (!(rope_theta > 0))
    SHARDLM_FAIL(ErrorKind::kConfig, "model.rope_theta must be > 0, got {}", rope_theta);
  if (!(norm_eps > 0))
    SHARDLM_FAIL(ErrorKind::kConfig, "model.norm_eps must be > 0, got {}", norm_eps);
  if (rope_scaling.type != "none" && rope_scaling.type != "llama3" && rope_scaling.type != "linear")
    SHARDLM_FAIL(ErrorKind::kConfig,
                 "model.rope_scaling.type must be \"none\", \"llama3\" or \"linear\", got \"{}\"",
                 rope_scaling.type);
  if (mlp_activation != "silu" && mlp_activation != "gelu_tanh")
    SHARDLM_FAIL(ErrorKind::kConfig,
                 "model.mlp_activation must be \"silu\" (SwiGLU) or \"gelu_tanh\" (GeGLU), got "
                 "\"{}\"",
                 mlp_activation);
  if (global_layer_every < 0)
    SHARDLM_FAIL(ErrorKind::kConfig,
                 "model.global_layer_every must be >= 0 (0: every layer alike), got {}",
                 global_layer_every);
  if (!(rope_local_theta > 0))
    SHARDLM_FAIL(ErrorKind::kConfig, "model.rope_local_theta must be > 0, got {}",
                 rope_local_theta);
  if (!(query_pre_attn_scalar >= 0))
    SHARDLM_FAIL(ErrorKind::kConfig,
                 "model.query_pre_attn_scalar must be > 0, or 0 for model.head_dim; got {}",
                 query_pre_attn_scalar);
  if (!(attn_softcap >= 0 && std::isfinite(attn_softcap)))
    SHARDLM_FAIL(ErrorKind::kConfig,
                 "model.attn_softcap must be a finite cap > 0 on the attention scores, or 0 for "
                 "none; got {}",
                 attn_softcap);
  if (!(final_softcap >= 0 && std::isfinite(final_softcap)))
    SHARDLM_FAIL(
        ErrorKind::kConfig,
        "model.final_softcap must be a finite cap > 0 on the logits, or 0 for none; got {}",
        final_softcap);
  validate_windows();
}

void ModelConfig::validate_windows() const {
  constexpr int64_t kMaxWindow = 2147483647;  // the kernels compare i32 positions
  if (sliding_window < 0 || sliding_window > kMaxWindow)
    SHARDLM_FAIL(ErrorKind::kConfig,
                 "model.sliding_window must be 0 (full attention) or a positive window of at "
                 "most 2^31 - 1 tokens, got {}",
                 sliding_window);
  if (!layer_windows.empty() && int64_t(layer_windows.size()) != n_layers)
    SHARDLM_FAIL(ErrorKind::kConfig,
                 "the per-layer sliding windows (config.json's layer_types, or a checkpoint's "
                 "model.json layer_windows) list {} layers but the model has {} "
                 "(model.n_layers): give one window per layer, 0 for a full-attention layer",
                 layer_windows.size(), n_layers);
  if (!layer_windows.empty() && global_layer_every > 0)
    SHARDLM_FAIL(ErrorKind::kConfig,
                 "model.global_layer_every = {} (Gemma's local and global layers) and per-layer "
                 "sliding windows (config.json's layer_types, or a checkpoint's model.json "
                 "layer_windows) both say which layers are windowed; keep one of them",
                 global_layer_every);
  for (size_t l = 0; l < layer_windows.size(); ++l)
    if (layer_windows[l] < 0 || layer_windows[l] > kMaxWindow)
      SHARDLM_FAIL(ErrorKind::kConfig,
                   "the sliding window of layer {} (config.json's layer_types and "
                   "sliding_window, or a checkpoint's model.json layer_windows) must be 0 (full "
                   "attention) or a positive window of at most 2^31 - 1 tokens, got {}",
                   l, layer_windows[l]);
}

std::vector<float> rope_inv_freq(const ModelConfig& cfg, bool local) {
  const int64_t rotary = cfg.rotary_dim(), half = rotary / 2;
  std::vector<float> inv(half);
  const RopeScaling s = local ? RopeScaling{} : cfg.rope_scaling;
  const double theta = local ? cfg.rope_local_theta : cfg.rope_theta;
  for (int64_t i = 0; i < half; ++i) {
    double f = 1.0 / std::pow(theta, static_cast<double>(2 * i) / double(rotary));
    if (s.type == "linear") {  // positions divided by the factor
      f = f / s.factor;
    } else if (s.type == "llama3") {
      // Llama 3.1 scaling: long wavelengths slowed by `factor`, short ones kept, smooth between.
      const double low_wavelen = s.original_max_position / s.low_freq_factor;
      const double high_wavelen = s.original_max_position / s.high_freq_factor;
      const double wavelen = 2 * std::numbers::pi / f;
      if (wavelen > low_wavelen) {
        f = f / s.factor;
      } else if (wavelen >= high_wavelen) {
        const double smooth = (s.original_max_position / wavelen - s.low_freq_factor) /
                              (s.high_freq_factor - s.low_freq_factor);
        f = (1 - smooth) * f / s.factor + smooth * f;
      }
    }
    inv[i] = static_cast<float>(f);
  }
  return inv;
}

}  // namespace shardlm
