// ModelConfig: the shape of a Llama-family decoder, and the named presets.
// Pure data and arithmetic; no backend, no allocation.
#pragma once

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

namespace shardlm {

struct RopeScaling {
  std::string type = "none";  // "none" | "llama3" | "linear" (every frequency / factor)
  double factor = 8.0;
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  int64_t original_max_position = 8192;
};

struct ModelConfig {
  std::string name = "custom";
  int64_t dim = 0;
  int64_t n_layers = 0;
  int64_t n_heads = 0;
  int64_t n_kv_heads = 0;
  int64_t ffn_dim = 0;
  int64_t vocab_size = 0;
  double rope_theta = 10000.0;
  RopeScaling rope_scaling;
  // Partial rotary embeddings (GLM: 0.5): only the first rotary_dim() = int(head_dim *
  // rope_partial_factor) dims of each head rotate, the rest pass through (transformers'
  // partial_rotary_factor). 1: the whole head.
  double rope_partial_factor = 1.0;
  // How the rotated dims pair up: false, Llama's rotate_half (dim i with i + rotary_dim / 2);
  // true, GLM's interleaved pairs (dims 2i and 2i + 1). Pair i turns by pos * inv_freq[i].
  bool rope_interleaved = false;
  double norm_eps = 1e-5;
  bool tie_embeddings = false;
  bool attn_bias = false;  // Qwen2-style bias on the q, k, v projections
  // The width of one attention head (model.head_dim) when it is not dim / n_heads (Qwen3,
  // Gemma: q_dim() = n_heads * head_dim() may differ from dim); 0: dim / n_heads.
  int64_t explicit_head_dim = 0;
  // Qwen3: an RMSNorm over each head of q and of k (weights [head_dim], one shared by every
  // head) between the projections and RoPE.
  bool qk_norm = false;
  // Sliding-window attention (Mistral, Qwen2/3 with use_sliding_window, Gemma's local layers):
  // in a layer with window W > 0, query t sees key s of its document iff s <= t and t - s < W
  // (transformers' convention: a token sees itself and the W - 1 before it); W = 0 is full
  // causal attention. sliding_window is the model's window; layer_windows, when not empty, holds
  // one window per decoder layer (n_layers entries, 0 for a full-attention layer), for models
  // that mix sliding and full layers (Gemma 2/3, Qwen's max_window_layers). Empty: every layer
  // has sliding_window, except Gemma's global layers (global_layer_every). Read layer l's window
  // with window_of_layer(l), never the fields.
  int64_t sliding_window = 0;
  std::vector<int64_t> layer_windows;
  // Gemma's layer pattern: every global_layer_every-th layer (l + 1 a multiple of it) is global
  // (full attention, rope_theta and rope_scaling); the others are local (sliding_window, and
  // rope_local_theta without scaling). 0: every layer alike (rope_theta, and sliding_window on
  // all of them).
  int64_t global_layer_every = 0;
  double rope_local_theta = 10000.0;
  int64_t window_of_layer(int64_t l) const {
    if (!layer_windows.empty()) return layer_windows[static_cast<size_t>(l)];
    return global_layer_every > 0 && (l + 1) % global_layer_every == 0 ? 0 : sliding_window;
  }
  // Whether some layer has a sliding window.
  bool has_sliding_window() const {
    for (int64_t l = 0; l < n_layers; ++l)
      if (window_of_layer(l) > 0) return true;
    return false;
  }
  // The layers' distinct windows, ascending (0: a full-attention layer): the attention variants
  // a run plans and prepares (Backend::attention_plan_workspace_bytes).
  std::vector<int64_t> attention_windows() const {
    std::vector<int64_t> w;
    for (int64_t l = 0; l < n_layers; ++l) {
      const int64_t x = window_of_layer(l);
      auto at = w.begin();
      while (at != w.end() && *at < x) ++at;
      if (at == w.end() || *at != x) w.insert(at, x);
    }
    return w;
  }
  // Gemma: RMSNorm weights (1 + w) computed in f32 (every norm: layers, q/k, final).
  bool norm_one_plus_weight = false;
  // Gemma: the embedding output times sqrt(dim), rounded to the activation dtype first.
  bool embed_scale = false;
  // Gemma: each sublayer's output normed (post_attention_layernorm, post_feedforward_layernorm)
  // before it joins the residual stream; the MLP's input norm is then pre_feedforward_layernorm.
  bool post_norms = false;
  // The parameter names of the post-norms' layers: "gemma" (post_attention_layernorm on the
  // attention output, pre_feedforward_layernorm the MLP's input norm, post_feedforward_layernorm
  // on its output) or "glm4" (GLM-4-0414: post_self_attn_layernorm, post_attention_layernorm as
  // the MLP's input norm, post_mlp_layernorm). The same computation under either.
  std::string post_norm_names = "gemma";
  // The MLP's gate activation: "silu" (SwiGLU) or "gelu_tanh" (Gemma's GeGLU).
  std::string mlp_activation = "silu";
  // Attention scores scaled by query_pre_attn_scalar^-0.5 (Gemma); 0: head_dim^-0.5.
  double query_pre_attn_scalar = 0;
  // Gemma 2's soft-capping, cap * tanh(x / cap), 0: none. attn_softcap caps each scaled
  // attention score before the mask and softmax (every layer); final_softcap caps the LM head's
  // logits before the loss and sampling.
  double attn_softcap = 0;
  double final_softcap = 0;
  // Tensor parallelism (model/tensor_shard.h): this config is one rank's shard of a model split
  // tp_shards ways; n_heads, n_kv_heads and ffn_dim are then the rank's share, and the rank holds
  // vocab_rows() = vocab_size / tp_shards rows of the embedding table and the LM head (dim,
  // vocab_size and the norms stay whole). 1: the whole model. Never read from a configuration
  // file.
  int64_t tp_shards = 1;
  // Sequence parallelism (with tp_shards > 1; docs/tensor-pipeline.md): the residual stream
  // between the tensor-parallel regions, and the norms, are split by rows across the tp ranks,
  // each holding N / tp_shards of a micro-batch's N rows. Set on a shard from
  // parallel.sequence_parallel.
  bool sequence_parallel = false;

  // Into how many row blocks the residual stream is split: tp_shards under sequence
  // parallelism, else 1.
  int64_t seq_shards() const { return sequence_parallel && tp_shards > 1 ? tp_shards : 1; }

  // Pipeline parallelism (plan/pipeline.h): this config is one stage, decoder layers
  // [pp_begin, stage_end()) of the n_layers; the first stage (pp_begin = 0) also holds the
  // embeddings, the last (stage_end() = n_layers) the final norm and LM head (with tied
  // embeddings its own copy of the embedding matrix, Megatron's way). Its parameter
  // layout keeps the whole model's units, the ones it does not hold empty. pp_end = -1: up to
  // n_layers (with pp_begin = 0, the whole model). Never read from a configuration file.
  int64_t pp_begin = 0;
  int64_t pp_end = -1;

  int64_t stage_end() const { return pp_end < 0 ? n_layers : pp_end; }
  bool whole_pipeline() const { return pp_begin == 0 && stage_end() == n_layers; }
  bool holds_embeddings() const { return pp_begin == 0; }
  bool holds_head() const { return stage_end() == n_layers; }
  bool holds_layer(int64_t l) const { return l >= pp_begin && l < stage_end(); }
  // The embedding matrix: the first stage's, and the last stage's LM head when tied.
  bool holds_embedding_matrix() const {
    return holds_embeddings() || (tie_embeddings && holds_head());
  }

  // n_heads * tp_shards: the whole model's heads, whatever the shard.
  int64_t head_dim() const {
    return explicit_head_dim > 0 ? explicit_head_dim : dim / (n_heads * tp_shards);
  }
  // Rows of the embedding table and of the LM head this config holds (vocabulary-parallel).
  int64_t vocab_rows() const { return vocab_size / tp_shards; }
  int64_t q_dim() const { return n_heads * head_dim(); }
  int64_t kv_dim() const { return n_kv_heads * head_dim(); }
  // The rotated dims of each head: int(head_dim * rope_partial_factor), as transformers rounds.
  int64_t rotary_dim() const {
    return static_cast<int64_t>(double(head_dim()) * rope_partial_factor);
  }
  // A local (sliding-window) layer of Gemma's pattern; false for every layer without one.
  bool local_layer(int64_t l) const {
    return global_layer_every > 0 && (l + 1) % global_layer_every != 0;
  }
  // The factor q is multiplied by so that the attention's 1/sqrt(head_dim) becomes
  // 1/sqrt(query_pre_attn_scalar); 1 without one.
  double query_prescale() const {
    return query_pre_attn_scalar > 0 ? std::sqrt(double(head_dim()) / query_pre_attn_scalar) : 1.0;
  }
  float norm_offset() const { return norm_one_plus_weight ? 1.f : 0.f; }

  // Throws Error(kConfig) naming the model.* key that is wrong and how to fix it.
  void validate() const;
  // The sliding-window part of validate(): windows in [0, 2^31), one per layer when listed.
  void validate_windows() const;
};

// Preset by name ("tiny", "llama3.2-1b", ...); throws kConfig listing the valid names.
ModelConfig model_preset(const std::string& name);
std::vector<std::string> model_preset_names();

// Rotary inverse frequencies [rotary_dim/2] (theta^(-2i / rotary_dim)), with Llama-3 or linear
// frequency scaling when configured; local: a local layer's (rope_local_theta, no scaling).
std::vector<float> rope_inv_freq(const ModelConfig& cfg, bool local = false);

}  // namespace shardlm
