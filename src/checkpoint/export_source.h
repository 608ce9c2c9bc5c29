// What the exports (hf_export.cpp, gguf_export.cpp) read: a full checkpoint's parameters as
// f32, a LoRA checkpoint's merged model (W + alpha/r B A over its base), unit by unit, which
// read_merged_lora_params also loads; and the Hugging Face architecture a checkpoint exports as.
// Private to src/checkpoint.
#pragma once

#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "shardlm/checkpoint/checkpoint.h"
#include "shardlm/checkpoint/model_io.h"
#include "shardlm/io/safetensors.h"
#include "shardlm/model/layout.h"
#include "shardlm/model/lora.h"
#include "shardlm/model/nf4_base.h"

namespace shardlm {

// A LoRA checkpoint's base model: its Hugging Face directory's weights and config.json, or,
// without a directory, the whole seeded initial model.
struct LoraBase {
  std::unique_ptr<SafetensorsDir> weights;           // the directory's (null: seeded)
  std::vector<float> init;                           // the seeded weights (no directory)
  nlohmann::json config = nlohmann::json::object();  // the directory's config.json ({}: seeded)
};

LoraBase load_lora_base(const StoredModel& stored, const ParamLayout& L);

// out [n] f32: elements [first, first + n) of the checkpoint's "params" vector, stored in
// `param_dtype` (f32 or bf16), read through `raw` (reused between calls).
void read_params_as_f32(const CheckpointReader& ckpt, DType param_dtype, int64_t first, int64_t n,
                        std::vector<std::byte>& raw, float* out);

// The architecture written: the one asked for, else the original config.json's, else
// default_hf_architecture(config).
std::string export_architecture(const std::string& asked, const nlohmann::json& original,
                                const ModelConfig& config);

// The merged model, one unit at a time: the base from its directory (or its seeded initial
// weights), an NF4 base's projections as the dequantized weights its adapters trained on, each
// decoder layer plus alpha/r B A.
class MergedLoraUnits {
 public:
  // Error(kData) naming the checkpoint when its parameters are not the adapters' size.
  MergedLoraUnits(const CheckpointReader& ckpt, const StoredModel& stored, const ParamLayout& L);
  const LoraBase& base() const { return base_; }

  // out [L.unit_size(u)] f32: unit u of the merged model.
  void unit(int u, float* out);

 private:
  const CheckpointReader& ckpt_;
  const StoredModel& stored_;
  const ParamLayout& L_;
  const LoraLayout A_;
  const LoraBase base_;
  const Nf4BaseLayout nf4_;
  std::vector<float> adapters_;  // [one layer's adapters]
};

}  // namespace shardlm
