// shardlm convert gguf-export (gguf_export.h): the architecture and its metadata keys, the
// tensors' names, types and transforms as llama.cpp's converter writes them, and the stream of
// their values from the checkpoint. The tokenizer's keys are gguf_tokenizer.cpp's.
#include "shardlm/checkpoint/gguf_export.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <memory>
#include <vector>

#include "export_source.h"
#include "gguf_tokenizer.h"
#include "shardlm/checkpoint/checkpoint.h"
#include "shardlm/checkpoint/model_io.h"
#include "shardlm/core/check.h"
#include "shardlm/hf/hf.h"

namespace shardlm {

using json = nlohmann::json;

namespace {

// llama.cpp's architecture for a Hugging Face one, and what its converter does to the weights.
struct GgufArch {
  std::string name;            // general.architecture
  bool permute_qk = false;     // Llama: q/k rows regrouped per head for llama.cpp's rope
  bool norm_plus_one = false;  // Gemma: norms stored as 1 + w
  // GLM (chatglm, glm4): gate and up are one ffn_up tensor [2F, D] (llama.cpp's SwiGLU takes
  // silu of its first half times its second), and llama.cpp's "normal" rope, which rotates
  // adjacent pairs of the first rope.dimension_count dims, is GLM's interleaved partial one.
  bool glm = false;
};

GgufArch gguf_arch(const std::string& hf) {
  if (hf == "LlamaForCausalLM" || hf == "MistralForCausalLM") return {"llama", true, false};
  if (hf == "Qwen2ForCausalLM") return {"qwen2", false, false};
  if (hf == "Qwen3ForCausalLM") return {"qwen3", false, false};
  if (hf == "Gemma2ForCausalLM") return {"gemma2", false, true};
  if (hf == "Gemma3ForCausalLM") return {"gemma3", false, true};
  // llama.cpp's converter writes GLM-4-9B-chat-hf's GlmForCausalLM as its chatglm architecture
  // and GLM-4-0414's Glm4ForCausalLM (with its post-norms) as glm4.
  if (hf == "GlmForCausalLM") return {"chatglm", false, false, true};
  if (hf == "Glm4ForCausalLM") return {"glm4", false, false, true};
  SHARDLM_FAIL(ErrorKind::kConfig,
               "--architecture {}: GGUF export writes Llama, Mistral, Qwen2, "
               "Qwen3, Gemma2, Gemma3, GLM and GLM-4 models",
               hf);
}

// What llama.cpp computes of a model but cannot read from a GGUF file: its Gemma layer pattern
// (Gemma 2 alternates local and global layers, Gemma 3 has five local per global one with a
// local rope base of 10000), Gemma's attention scale (1/sqrt(head_dim), 1/sqrt(hidden / heads)
// for the 27B models), and no sliding window on qwen2/qwen3.
void check_llama_cpp_can_express(const ModelConfig& c, const GgufArch& a) {
  // hf_config_json checked that a GLM architecture has GLM's rotary embedding and no other
  // does; llama.cpp rotates pairs, so the rotated dims must be a whole number of them.
  SHARDLM_CHECK_KIND(ErrorKind::kConfig, a.glm || c.rope_partial_factor == 1.0,
                     "GGUF export: {} rotates whole heads, and this model rotates a part of each "
                     "(model.rope_partial_factor = {})",
                     a.name, c.rope_partial_factor);
  SHARDLM_CHECK_KIND(ErrorKind::kConfig, !a.glm || (c.rotary_dim() > 0 && c.rotary_dim() % 2 == 0),
                     "GGUF {}: llama.cpp rotates pairs of dims, and this model rotates {} of each "
                     "head's {} (model.rope_partial_factor = {})",
                     a.name, c.rotary_dim(), c.head_dim(), c.rope_partial_factor);
  SHARDLM_CHECK_KIND(ErrorKind::kConfig, a.name != "chatglm" || c.q_dim() == c.dim,
                     "GGUF chatglm: llama.cpp's queries are as wide as the model ({}), and this "
                     "model's are {} ({} heads of {})",
                     c.dim, c.q_dim(), c.n_heads, c.head_dim());
  const bool gemma = a.name == "gemma2" || a.name == "gemma3";
  if (!gemma) {
    SHARDLM_CHECK_KIND(ErrorKind::kConfig, a.name == "llama" || !c.has_sliding_window(),
                       "GGUF {}: llama.cpp gives {} no sliding window, and this model has one "
                       "(model.sliding_window = {})",
                       a.name, a.name, c.sliding_window);
    SHARDLM_CHECK_KIND(ErrorKind::kConfig, a.name == "llama" || c.rope_scaling.type != "llama3",
                       "GGUF {}: llama.cpp writes Llama-3 rope scaling for llama only", a.name);
    return;
  }
  const int64_t every = a.name == "gemma2" ? 2 : 6;
  for (int64_t l = 0; l < c.n_layers; ++l)
    SHARDLM_CHECK_KIND(ErrorKind::kConfig, c.local_layer(l) == ((l + 1) % every != 0),
                       "GGUF {}: llama.cpp makes every {}th layer global, and this model's layer "
                       "{} is {} (model.global_layer_every = {})",
                       a.name, every, l, c.local_layer(l) ? "local" : "global",
                       c.global_layer_every);
  SHARDLM_CHECK_KIND(ErrorKind::kConfig, a.name == "gemma2" || c.rope_local_theta == 10000.0,
                     "GGUF gemma3: llama.cpp's local layers have a rope base of 10000, and this "
                     "model has model.rope_local_theta = {}",
                     c.rope_local_theta);
  // llama.cpp knows the 27B models by their layer count (46, 62): they scale by hidden / heads.
  const bool big = c.n_layers == (a.name == "gemma2" ? 46 : 62);
  const double scale = big ? double(c.dim / c.n_heads) : double(c.head_dim());
  const double qpas = c.query_pre_attn_scalar > 0 ? c.query_pre_attn_scalar : double(c.head_dim());
  SHARDLM_CHECK_KIND(ErrorKind::kConfig, qpas == scale,
                     "GGUF {}: llama.cpp scales attention scores by 1/sqrt({}) for a model of {} "
                     "layers, and this model has model.query_pre_attn_scalar = {}",
                     a.name, scale, c.n_layers, qpas);
  SHARDLM_CHECK_KIND(ErrorKind::kConfig, a.name == "gemma3" || c.tie_embeddings,
                     "GGUF gemma2 has no output tensor of its own, and this model's LM head is "
                     "untied (model.tie_embeddings = false)");
  SHARDLM_CHECK_KIND(ErrorKind::kConfig, a.name == "gemma3" || c.attn_softcap > 0,
                     "GGUF gemma2: llama.cpp soft-caps attention scores (50 unless the file "
                     "says), and this model has no model.attn_softcap");
}

// general.file_type: llama_ftype's MOSTLY_F16, MOSTLY_Q8_0, MOSTLY_BF16.
uint32_t llama_ftype(GgufType t) {
  return t == GgufType::kF16 ? 1 : t == GgufType::kQ8_0 ? 7 : t == GgufType::kBF16 ? 32 : 0;
}

// The architecture's keys, from the config.json that hf-export would write (the converter
// reads the same file).
void add_model_keys(GgufMetadata& m, const GgufArch& a, const ModelConfig& c, const json& hf,
                    GgufType type) {
  const std::string p = a.name + ".";
  m.add_string("general.architecture", a.name);
  m.add_string("general.type", "model");
  m.add_string("general.name", c.name);
  m.add_u32("general.file_type", llama_ftype(type));
  m.add_u32("general.quantization_version", 2);  // ggml's GGML_QNT_VERSION
  m.add_u32(p + "block_count", uint32_t(c.n_layers));
  m.add_u32(p + "context_length", hf.at("max_position_embeddings").get<uint32_t>());
  m.add_u32(p + "embedding_length", uint32_t(c.dim));
  m.add_u32(p + "feed_forward_length", uint32_t(c.ffn_dim));
  m.add_u32(p + "attention.head_count", uint32_t(c.n_heads));
  m.add_u32(p + "attention.head_count_kv", uint32_t(c.n_kv_heads));
  if (c.rope_scaling.type == "linear") {
    m.add_string(p + "rope.scaling.type", "linear");
    m.add_f32(p + "rope.scaling.factor", float(c.rope_scaling.factor));
  }
  m.add_f32(p + "rope.freq_base", float(c.rope_theta));
  m.add_f32(p + "attention.layer_norm_rms_epsilon", float(c.norm_eps));
  if (hf.contains("head_dim")) {
    m.add_u32(p + "attention.key_length", uint32_t(c.head_dim()));
    m.add_u32(p + "attention.value_length", uint32_t(c.head_dim()));
  }
  if (a.name == "llama") {
    m.add_u32(p + "vocab_size", uint32_t(c.vocab_size));
    m.add_u32(p + "rope.dimension_count", uint32_t(c.head_dim()));
  }
  if (a.glm) m.add_u32(p + "rope.dimension_count", uint32_t(c.rotary_dim()));
  if (a.name == "gemma2") m.add_f32(p + "attn_logit_softcapping", float(c.attn_softcap));
  if (c.final_softcap > 0) m.add_f32(p + "final_logit_softcapping", float(c.final_softcap));
  if (a.name == "gemma2" || a.name == "gemma3")
    m.add_u32(p + "attention.sliding_window", uint32_t(c.sliding_window));
}

// llama.cpp's name of a layout entry (Hugging Face names: model/layout.h).
std::string gguf_tensor_name(const std::string& hf, bool gemma_post_norms) {
  if (hf == "model.embed_tokens.weight") return "token_embd.weight";
  if (hf == "model.norm.weight") return "output_norm.weight";
  if (hf == "lm_head.weight") return "output.weight";
  // GLM-4-0414's post-norms have names of their own; its gate_proj stands for the fused
  // gate_up_proj (plan_tensors).
  static const std::pair<const char*, const char*> kLayer[] = {
      {"post_self_attn_layernorm.", "post_attention_norm."},
      {"post_mlp_layernorm.", "post_ffw_norm."},
      {"input_layernorm.", "attn_norm."},
      {"self_attn.q_proj.", "attn_q."},
      {"self_attn.k_proj.", "attn_k."},
      {"self_attn.v_proj.", "attn_v."},
      {"self_attn.o_proj.", "attn_output."},
      {"self_attn.q_norm.", "attn_q_norm."},
      {"self_attn.k_norm.", "attn_k_norm."},
      {"pre_feedforward_layernorm.", "ffn_norm."},
      {"post_feedforward_layernorm.", "post_ffw_norm."},
      {"mlp.gate_proj.", "ffn_gate."},
      {"mlp.up_proj.", "ffn_up."},
      {"mlp.down_proj.", "ffn_down."}};
  const std::string prefix = "model.layers.";
  SHARDLM_CHECK(hf.rfind(prefix, 0) == 0, "GGUF export: no llama.cpp name for '{}'", hf);
  const size_t dot = hf.find('.', prefix.size());
  const std::string layer = hf.substr(prefix.size(), dot - prefix.size());
  const std::string rest = hf.substr(dot + 1);
  // Gemma's post_attention_layernorm norms the attention's output; Llama's (and GLM-4's) is the
  // MLP's input.
  if (rest.rfind("post_attention_layernorm.", 0) == 0)
    return "blk." + layer + (gemma_post_norms ? ".post_attention_norm." : ".ffn_norm.") +
           rest.substr(rest.find('.') + 1);
  for (const auto& [from, to] : kLayer)
    if (rest.rfind(from, 0) == 0) return "blk." + layer + "." + to + rest.substr(std::strlen(from));
  SHARDLM_FAIL(ErrorKind::kInternal, "GGUF export: no llama.cpp name for '{}'", hf);
}

// One tensor as written: its entries (one, or GLM's gate and up, stacked by rows), name, type
// and transforms.
struct TensorPlan {
  std::vector<const ParamEntry*> parts;
  GgufWriter::Decl decl;
  int64_t rope_heads = 0;  // > 0: rows regrouped per head (Llama's q/k)
  float offset = 0;        // added to every value (Gemma's norms)
};

// GLM's gate_up_proj [2F, D]: the layer's gate entry and the up entry after it.
bool is_glm_gate(const GgufArch& a, const ParamEntry& e) {
  return a.glm && e.name.find(".mlp.gate_proj.") != std::string::npos;
}

std::vector<TensorPlan> plan_tensors(const ParamLayout& L, const ModelConfig& c, const GgufArch& a,
                                     GgufType type) {
  std::vector<TensorPlan> plan;
  const bool gemma_post_norms = c.post_norms && c.post_norm_names == "gemma";
  for (size_t i = 0; i < L.entries.size(); ++i) {
    const ParamEntry& e = L.entries[i];
    TensorPlan t{{&e}, {gguf_tensor_name(e.name, gemma_post_norms), type, {}}, 0, 0};
    for (int d = 0; d < e.shape.rank(); ++d) t.decl.shape.push_back(e.shape[d]);
    if (is_glm_gate(a, e)) {
      const ParamEntry& up = L.entries.at(++i);
      SHARDLM_CHECK(up.name.find(".mlp.up_proj.") != std::string::npos,
                    "GGUF export: '{}' does not follow '{}'", up.name, e.name);
      t.parts.push_back(&up);
      t.decl.name = gguf_tensor_name(up.name, gemma_post_norms);
      t.decl.shape[0] += up.shape[0];
    }
    const bool norm = e.name.find("norm.weight") != std::string::npos;
    // Vectors (norms, biases) stay f32; a Q8_0 matrix needs rows of whole blocks, else F16.
    if (t.decl.shape.size() < 2) t.decl.type = GgufType::kF32;
    if (t.decl.type == GgufType::kQ8_0 && t.decl.shape.back() % kGgufQ8Block != 0)
      t.decl.type = GgufType::kF16;
    if (a.permute_qk && e.name.find("self_attn.q_proj.") != std::string::npos)
      t.rope_heads = c.n_heads;
    if (a.permute_qk && e.name.find("self_attn.k_proj.") != std::string::npos)
      t.rope_heads = c.n_kv_heads;
    if (a.norm_plus_one && norm) t.offset = 1.0f;
    plan.push_back(std::move(t));
  }
  return plan;
}

// Llama-3 rope scaling as llama.cpp reads it: rope_freqs.weight [head_dim / 2], the factor
// each frequency is divided by (the converter's generate_extra_tensors).
std::vector<float> llama3_rope_factors(const ModelConfig& c) {
  const RopeScaling& s = c.rope_scaling;
  const int64_t dim = c.head_dim();
  const double low_wavelen = double(s.original_max_position) / s.low_freq_factor;
  const double high_wavelen = double(s.original_max_position) / s.high_freq_factor;
  std::vector<float> factors;
  for (int64_t i = 0; i < dim; i += 2) {
    const float freq = 1.0f / float(std::pow(c.rope_theta, double(i) / double(dim)));
    const double wavelen = 2 * M_PI / double(freq);
    if (wavelen < high_wavelen) {
      factors.push_back(1.0f);
    } else if (wavelen > low_wavelen) {
      factors.push_back(float(s.factor));
    } else {
      const double smooth = (double(s.original_max_position) / wavelen - s.low_freq_factor) /
                            (s.high_freq_factor - s.low_freq_factor);
      factors.push_back(float(1.0 / ((1 - smooth) / s.factor + smooth)));
    }
  }
  return factors;
}

// Rows [row0, row0 + rows) of an entry's values (a vector is one row) into out, f32.
using RowSource = std::function<void(const ParamEntry& e, int64_t row0, int64_t rows, float* out)>;

// A head's rows [2, half] as llama.cpp's rope wants them, [half, 2]: row 2i + j <- j half + i.
void regroup_head_rows(const float* in, int64_t head_rows, int64_t cols, float* out) {
  const int64_t half = head_rows / 2;
  for (int64_t i = 0; i < half; ++i)
    for (int64_t j = 0; j < 2; ++j)
      std::memcpy(out + (2 * i + j) * cols, in + (j * half + i) * cols, size_t(cols) * 4);
}

// One entry's values in a tensor, transformed and encoded, in pieces of whole heads' rows.
void write_part(GgufWriter& w, const TensorPlan& t, const ParamEntry& e, const RowSource& source) {
  const int64_t cols = t.decl.shape.back();
  const int64_t rows = e.shape.rank() < 2 ? 1 : e.shape[0];
  const int64_t group = t.rope_heads > 0 ? rows / t.rope_heads : 1;
  const int64_t step = std::max<int64_t>(1, kHfExportChunk / (cols * group)) * group;
  std::vector<float> values, regrouped;
  std::vector<std::byte> encoded;
  for (int64_t r0 = 0; r0 < rows; r0 += step) {
    const int64_t n = std::min(step, rows - r0);
    values.resize(size_t(n * cols));
    source(e, r0, n, values.data());
    if (t.rope_heads > 0) {
      regrouped.resize(values.size());
      for (int64_t h = 0; h < n / group; ++h)
        regroup_head_rows(values.data() + h * group * cols, group, cols,
                          regrouped.data() + h * group * cols);
      values.swap(regrouped);
    }
    if (t.offset != 0)
      for (float& v : values) v += t.offset;
    encoded.resize(gguf_type_bytes(t.decl.type, n * cols));
    gguf_encode(t.decl.type, values.data(), n * cols, encoded.data());
    w.write(t.decl.name, encoded.data(), encoded.size());
  }
}

// The full model's rows, read from the parameters in the checkpoint's dtype.
RowSource stored_rows(const CheckpointReader& ckpt, const StoredModel& stored) {
  return [&ckpt, &stored, raw = std::vector<std::byte>()](const ParamEntry& e, int64_t row0,
                                                          int64_t rows, float* out) mutable {
    const int64_t cols = e.shape[e.shape.rank() - 1];
    read_params_as_f32(ckpt, stored.param_dtype, e.offset + row0 * cols, rows * cols, raw, out);
  };
}

// A LoRA checkpoint's rows: each tensor's merged unit computed once, as the tensors come in
// arena order.
RowSource merged_rows(MergedLoraUnits& merged, const ParamLayout& L) {
  struct Cache {
    int unit = -1;
    std::vector<float> values;  // [the unit]
  };
  auto cache = std::make_shared<Cache>();
  return [&merged, &L, cache](const ParamEntry& e, int64_t row0, int64_t rows, float* out) {
    int u = 0;
    while (L.units[u].end <= e.offset) ++u;
    if (u != cache->unit) {
      cache->values.resize(size_t(L.unit_size(u)));
      merged.unit(u, cache->values.data());
      cache->unit = u;
    }
    const int64_t cols = e.shape[e.shape.rank() - 1];
    const float* from = cache->values.data() + (e.offset - L.units[u].begin) + row0 * cols;
    std::copy(from, from + rows * cols, out);
  };
}

}  // namespace

GgufExportInfo gguf_export(const std::string& checkpoint, const std::string& path, GgufType type,
                           const std::string& architecture) {
  const CheckpointReader ckpt(checkpoint, CheckpointReader::Verify::kSizesOnly);
  ckpt.verify_contents_for({"params"});
  const StoredModel stored = read_stored_model(ckpt);
  const ModelConfig& c = stored.config;
  const ParamLayout L = make_param_layout(c);
  std::unique_ptr<MergedLoraUnits> merged;
  json original = json::object();
  if (stored.lora.enabled()) {
    merged = std::make_unique<MergedLoraUnits>(ckpt, stored, L);
    original = merged->base().config;
  } else {
    const size_t want = size_t(L.total) * dtype_size(stored.param_dtype);
    if (ckpt.vector_bytes("params") != want)
      SHARDLM_FAIL(ErrorKind::kData, "{}: the parameters hold {} bytes but the model needs {}",
                   ckpt.dir(), ckpt.vector_bytes("params"), want);
    if (ckpt.has("hf_config.json")) original = ckpt.read_json("hf_config.json");
  }
  const std::string hf_arch = export_architecture(architecture, original, c);
  const json hf = hf_config_json(c, hf_arch, DType::kF32, original);  // checks what it can say
  const GgufArch a = gguf_arch(hf_arch);
  check_llama_cpp_can_express(c, a);

  GgufMetadata meta;
  add_model_keys(meta, a, c, hf, type);
  add_gguf_tokenizer(stored.tokenizer, c.vocab_size, a.name, meta);
  std::vector<TensorPlan> plan = plan_tensors(L, c, a, type);
  std::vector<GgufWriter::Decl> decls;
  std::vector<float> rope_factors;
  if (a.name == "llama" && c.rope_scaling.type == "llama3") {
    rope_factors = llama3_rope_factors(c);
    decls.push_back({"rope_freqs.weight", GgufType::kF32, {int64_t(rope_factors.size())}});
  }
  for (const TensorPlan& t : plan) decls.push_back(t.decl);
  GgufWriter w(path, meta, decls);
  if (!rope_factors.empty())
    w.write("rope_freqs.weight", rope_factors.data(), rope_factors.size() * 4);

  const RowSource source = merged ? merged_rows(*merged, L) : stored_rows(ckpt, stored);
  GgufExportInfo info{a.name, int64_t(decls.size()), 0};
  for (const TensorPlan& t : plan)
    for (const ParamEntry* e : t.parts) write_part(w, t, *e, source);
  w.commit();
  for (const GgufWriter::Decl& d : decls) {
    int64_t n = 1;
    for (int64_t s : d.shape) n *= s;
    info.bytes += gguf_type_bytes(d.type, n);
  }
  return info;
}

}  // namespace shardlm
