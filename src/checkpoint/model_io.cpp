// model.json + params.bin: the model part of a checkpoint.
#include "shardlm/checkpoint/model_io.h"

#include <algorithm>
#include <cstddef>
#include <vector>

#include "shardlm/checkpoint/hf_convert.h"
#include "shardlm/core/check.h"

namespace shardlm {

using json = nlohmann::json;

json model_to_json(const LlamaModel& model, const std::string& tokenizer,
                   const StoredLoraBase& base) {
  return model_to_json(model.config(), model.lora() ? model.lora_layout().params : model.layout(),
                       model.options(), tokenizer, base);
}

json model_to_json(const ModelConfig& c, const ParamLayout& stored, const ModelOptions& opt,
                   const std::string& tokenizer, const StoredLoraBase& base) {
  SHARDLM_CHECK(c.tp_shards == 1, "model.json describes the whole model, not a tensor shard");
  json params = json::array();
  for (const auto& e : stored.entries) {
    json shape = json::array();
    for (int i = 0; i < e.shape.rank(); ++i) shape.push_back(e.shape[i]);
    params.push_back({{"name", e.name}, {"offset", e.offset}, {"shape", shape}});
  }
  json j = {{"format", 1},
            {"architecture", "llama"},
            {"name", c.name},
            {"dim", c.dim},
            {"n_layers", c.n_layers},
            {"n_heads", c.n_heads},
            {"n_kv_heads", c.n_kv_heads},
            {"ffn_dim", c.ffn_dim},
            {"vocab_size", c.vocab_size},
            {"rope_theta", c.rope_theta},
            {"rope_partial_factor", c.rope_partial_factor},
            {"rope_interleaved", c.rope_interleaved},
            {"rope_scaling",
             {{"type", c.rope_scaling.type},
              {"factor", c.rope_scaling.factor},
              {"low_freq_factor", c.rope_scaling.low_freq_factor},
              {"high_freq_factor", c.rope_scaling.high_freq_factor},
              {"original_max_position", c.rope_scaling.original_max_position}}},
            {"norm_eps", c.norm_eps},
            {"tie_embeddings", c.tie_embeddings},
            {"attn_bias", c.attn_bias},
            {"head_dim", c.explicit_head_dim},
            {"qk_norm", c.qk_norm},
            {"sliding_window", c.sliding_window},
            {"layer_windows", c.layer_windows},
            {"global_layer_every", c.global_layer_every},
            {"rope_local_theta", c.rope_local_theta},
            {"norm_one_plus_weight", c.norm_one_plus_weight},
            {"embed_scale", c.embed_scale},
            {"post_norms", c.post_norms},
            {"post_norm_names", c.post_norm_names},
            {"mlp_activation", c.mlp_activation},
            {"query_pre_attn_scalar", c.query_pre_attn_scalar},
            {"attn_softcap", c.attn_softcap},
            {"final_softcap", c.final_softcap},
            {"param_dtype", std::string(dtype_name(opt.param_dtype))},
            {"tokenizer", tokenizer},
            {"params", params}};
  if (opt.lora.enabled()) {
    const LoraConfig& l = opt.lora;
    j["lora"] = {{"rank", l.rank},
                 {"alpha", l.alpha},
                 {"dropout", l.dropout},
                 {"targets", lora_targets_string(l.targets)},
                 {"base_dtype", l.nf4_base ? "nf4" : "param_dtype"},
                 {"base", {{"hf_dir", base.hf_dir}, {"init_seed", base.init_seed}}}};
  }
  return j;
}

StoredModel read_stored_model(const CheckpointReader& ckpt) {
  const json j = ckpt.read_json("model.json");
  const std::string where = ckpt.dir() + "/model.json";
  StoredModel s;
  try {
    ModelConfig& c = s.config;
    c.name = j.at("name").get<std::string>();
    c.dim = j.at("dim").get<int64_t>();
    c.n_layers = j.at("n_layers").get<int64_t>();
    c.n_heads = j.at("n_heads").get<int64_t>();
    c.n_kv_heads = j.at("n_kv_heads").get<int64_t>();
    c.ffn_dim = j.at("ffn_dim").get<int64_t>();
    c.vocab_size = j.at("vocab_size").get<int64_t>();
    c.rope_theta = j.at("rope_theta").get<double>();
    const json& rs = j.at("rope_scaling");
    c.rope_scaling.type = rs.at("type").get<std::string>();
    c.rope_scaling.factor = rs.at("factor").get<double>();
    c.rope_scaling.low_freq_factor = rs.at("low_freq_factor").get<double>();
    c.rope_scaling.high_freq_factor = rs.at("high_freq_factor").get<double>();
    c.rope_scaling.original_max_position = rs.at("original_max_position").get<int64_t>();
    c.norm_eps = j.at("norm_eps").get<double>();
    c.tie_embeddings = j.at("tie_embeddings").get<bool>();
    c.attn_bias = j.at("attn_bias").get<bool>();
    // Written since heads of their own width and q/k norms exist; absent: neither.
    c.explicit_head_dim = j.value("head_dim", int64_t{0});
    c.qk_norm = j.value("qk_norm", false);
    // Written since sliding windows are masks and the Gemma variants exist; absent: Llama's.
    c.sliding_window = j.value("sliding_window", int64_t{0});
    c.layer_windows = j.value("layer_windows", std::vector<int64_t>{});
    c.global_layer_every = j.value("global_layer_every", int64_t{0});
    c.rope_local_theta = j.value("rope_local_theta", 10000.0);
    c.norm_one_plus_weight = j.value("norm_one_plus_weight", false);
    c.embed_scale = j.value("embed_scale", false);
    c.post_norms = j.value("post_norms", false);
    // Written since GLM exists; absent: whole heads in rotate_half pairs, Gemma's names.
    c.post_norm_names = j.value("post_norm_names", std::string("gemma"));
    c.rope_partial_factor = j.value("rope_partial_factor", 1.0);
    c.rope_interleaved = j.value("rope_interleaved", false);
    c.mlp_activation = j.value("mlp_activation", std::string("silu"));
    c.query_pre_attn_scalar = j.value("query_pre_attn_scalar", 0.0);
    c.attn_softcap = j.value("attn_softcap", 0.0);
    c.final_softcap = j.value("final_softcap", 0.0);
    const std::string dt = j.at("param_dtype").get<std::string>();
    if (dt != "f32" && dt != "bf16")
      SHARDLM_FAIL(ErrorKind::kData, "{}: param_dtype '{}' is not f32 or bf16", where, dt);
    s.param_dtype = dt == "bf16" ? DType::kBF16 : DType::kF32;
    s.tokenizer = j.at("tokenizer").get<std::string>();
    if (j.contains("lora")) {
      const json& l = j.at("lora");
      s.lora.rank = l.at("rank").get<int64_t>();
      s.lora.alpha = l.at("alpha").get<double>();
      s.lora.dropout = l.at("dropout").get<double>();
      s.lora.targets = lora_targets_from_string(l.at("targets").get<std::string>());
      s.lora.nf4_base = l.value("base_dtype", std::string("param_dtype")) == "nf4";
      s.lora_base.hf_dir = l.at("base").at("hf_dir").get<std::string>();
      s.lora_base.init_seed = l.at("base").at("init_seed").get<uint64_t>();
      if (s.lora.rank <= 0 || s.lora.targets == 0)
        SHARDLM_FAIL(ErrorKind::kData, "{}: lora.rank {} with targets '{}' is not an adapter",
                     where, s.lora.rank, l.at("targets").get<std::string>());
    }
  } catch (const json::exception& e) {
    SHARDLM_FAIL(ErrorKind::kData, "{}: {}", where, e.what());
  }
  try {
    s.config.validate();
  } catch (const Error& e) {
    SHARDLM_FAIL(ErrorKind::kData, "{}: invalid model: {}", where, e.what());
  }
  return s;
}

namespace {

// params.bin moves between the model's arena and the file in slices staged through host memory
// with the backend's copy: a device-resident arena is never copied whole to the host, and the
// CPU backend takes the same path.
constexpr int64_t kStageBytes = int64_t{64} << 20;

// Calls slice(at, rows [at, at + n) of params, a host tensor of n elements) slice by slice,
// every slice staged through one host buffer.
template <class Slice>
void for_each_staged_slice(const Tensor& params, Slice slice) {
  const int64_t cap = std::max<int64_t>(1, kStageBytes / int64_t(dtype_size(params.dtype())));
  const int64_t step = std::min(cap, std::max<int64_t>(params.numel(), 1));
  std::vector<std::byte> staging(size_t(step) * dtype_size(params.dtype()));
  for (int64_t at = 0; at < params.numel(); at += step) {
    const int64_t n = std::min(step, params.numel() - at);
    slice(at, params.rows(at, n), Tensor(staging.data(), params.dtype(), {n}, MemPool::kHost));
  }
}

}  // namespace

void write_model(CheckpointWriter& ckpt, const LlamaModel& model, Backend& backend,
                 const std::string& tokenizer) {
  ckpt.add_json("model.json", model_to_json(model, tokenizer));
  const Tensor p = model.params();
  ckpt.begin_file("params.bin");
  for_each_staged_slice(p, [&](int64_t, const Tensor& arena, const Tensor& host) {
    backend.copy(arena, host);
    ckpt.append(host.data(), host.bytes());
  });
  ckpt.end_file();
}

void read_params(const CheckpointReader& ckpt, LlamaModel& model, Backend& backend) {
  // A LoRA checkpoint's parameters are its adapters: the model is its base merged with them.
  if (read_stored_model(ckpt).lora.enabled()) return read_merged_lora_params(ckpt, model, backend);
  const Tensor p = model.params();
  const size_t stored = ckpt.vector_bytes("params");
  if (stored != p.bytes())
    SHARDLM_FAIL(ErrorKind::kData,
                 "{}: the parameters hold {} bytes but this model's parameters need {} bytes",
                 ckpt.dir(), stored, p.bytes());
  for_each_staged_slice(p, [&](int64_t at, const Tensor& arena, const Tensor& host) {
    ckpt.read_vector("params", uint64_t(at) * dtype_size(p.dtype()), host.data(), host.bytes());
    backend.copy(host, arena);
  });
}

}  // namespace shardlm
