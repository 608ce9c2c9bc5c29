// What a checkpoint holds of the model: model.json (the ModelConfig, parameter dtype,
// tokenizer and the parameter table by name) and the "params" vector (params.bin, or sharded
// over the ranks' files: the flat parameter arena in its dtype, in layout order). Used by the
// trainer and by `shardlm generate`.
#pragma once

#include <string>

#include <nlohmann/json.hpp>

#include "shardlm/checkpoint/checkpoint.h"
#include "shardlm/model/llama.h"

namespace shardlm {

// A LoRA checkpoint's frozen base is not stored: it is model.hf_dir's weights (an absolute
// path) or, with no directory, initial_weights(init_seed) of the model.
struct StoredLoraBase {
  std::string hf_dir;
  uint64_t init_seed = 0;
};

struct StoredModel {
  ModelConfig config;
  DType param_dtype = DType::kF32;  // of the base
  std::string tokenizer = "byte";
  LoraConfig lora;  // rank 0: params.bin is the model; else params.bin holds the f32 adapters
  StoredLoraBase lora_base;
};

// model.json; with LoRA (model.lora()) the "lora" section names the adapters (rank, alpha,
// dropout, targets), the base's source and "params" lists the adapters' tensors.
nlohmann::json model_to_json(const LlamaModel& model, const std::string& tokenizer,
                             const StoredLoraBase& base = {});
// The same from the whole model's config (never a tensor shard), the stored arena's layout
// (the model's, or with LoRA the adapters') and the model's options.
nlohmann::json model_to_json(const ModelConfig& whole, const ParamLayout& stored,
                             const ModelOptions& opt, const std::string& tokenizer,
                             const StoredLoraBase& base = {});
// Throws Error(kData) naming the checkpoint's model.json when a field is missing or invalid.
StoredModel read_stored_model(const CheckpointReader& ckpt);

void write_model(CheckpointWriter& ckpt, const LlamaModel& model, Backend& backend,
                 const std::string& tokenizer);
// Loads the "params" vector (whole or sharded) into the model (which must have the stored config
// and dtype); a LoRA checkpoint's merged model (its base with the adapters added:
// read_merged_lora_params, unit by unit) into a model without adapters.
void read_params(const CheckpointReader& ckpt, LlamaModel& model, Backend& backend);

}  // namespace shardlm
