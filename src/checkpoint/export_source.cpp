// What the exports read (export_source.h): a LoRA checkpoint's merged model, unit by unit, and
// the architecture a checkpoint exports as.
#include "export_source.h"

#include <algorithm>
#include <cstring>

#include "shardlm/core/check.h"
#include "shardlm/hf/hf.h"
#include "shardlm/model/llama.h"

namespace shardlm {

void read_params_as_f32(const CheckpointReader& ckpt, DType param_dtype, int64_t first, int64_t n,
                        std::vector<std::byte>& raw, float* out) {
  const size_t psize = dtype_size(param_dtype);
  raw.resize(size_t(n) * psize);
  ckpt.read_vector("params", uint64_t(first) * psize, raw.data(), raw.size());
  if (param_dtype == DType::kF32) {
    std::memcpy(out, raw.data(), size_t(n) * 4);
    return;
  }
  for (int64_t i = 0; i < n; ++i) {
    uint16_t h;
    std::memcpy(&h, raw.data() + 2 * i, 2);
    out[i] = bf16_to_f32(h);
  }
}

LoraBase load_lora_base(const StoredModel& stored, const ParamLayout& L) {
  LoraBase base;
  const std::string& base_dir = stored.lora_base.hf_dir;
  if (!base_dir.empty()) {
    base.weights = std::make_unique<SafetensorsDir>(base_dir);
    base.config = read_hf_config(base_dir).raw;
  } else {
    base.init.resize(size_t(L.total));
    initial_weights(stored.config, L, stored.lora_base.init_seed, [&](int u, const float* v) {
      std::copy(v, v + L.unit_size(u), base.init.begin() + L.units[u].begin);
    });
  }
  return base;
}

std::string export_architecture(const std::string& asked, const nlohmann::json& original,
                                const ModelConfig& config) {
  std::string arch = asked;
  if (arch.empty() && original.contains("architectures") && original["architectures"].is_array() &&
      !original["architectures"].empty() && original["architectures"][0].is_string())
    arch = original["architectures"][0].get<std::string>();
  if (arch.empty()) arch = default_hf_architecture(config);
  return arch;
}

MergedLoraUnits::MergedLoraUnits(const CheckpointReader& ckpt, const StoredModel& stored,
                                 const ParamLayout& L)
    : ckpt_(ckpt),
      stored_(stored),
      L_(L),
      A_(make_lora_layout(stored.config, stored.lora)),
      base_(load_lora_base(stored, L)),
      nf4_(stored.lora.nf4_base ? make_nf4_base_layout(L) : Nf4BaseLayout{}) {
  if (ckpt.vector_bytes("params") != size_t(A_.params.total) * 4)
    SHARDLM_FAIL(ErrorKind::kData, "{}: the parameters hold {} bytes but the adapters need {}",
                 ckpt.dir(), ckpt.vector_bytes("params"), size_t(A_.params.total) * 4);
}

void MergedLoraUnits::unit(int u, float* out) {
  const int64_t n = L_.unit_size(u);
  if (base_.weights)
    read_hf_unit(*base_.weights, L_, u, out);
  else
    std::copy(base_.init.begin() + L_.units[u].begin, base_.init.begin() + L_.units[u].begin + n,
              out);
  if (stored_.lora.nf4_base) nf4_round_trip_unit(L_, nf4_, u, out);
  if (u < 1 || u > stored_.config.n_layers) return;
  const int l = u - 1;
  adapters_.resize(size_t(A_.params.unit_size(l)));
  ckpt_.read_vector("params", uint64_t(A_.params.units[l].begin) * 4, adapters_.data(),
                    adapters_.size() * 4);
  merge_lora_layer(stored_.config, stored_.lora, A_, L_, l, adapters_.data(), out);
}

}  // namespace shardlm
