// What a checkpoint holds of the model: model.json (the ModelConfig, parameter dtype,
// tokenizer and the parameter table by name) and params.bin (the flat parameter arena in its
// dtype, in layout order). Used by the trainer and by `shardlm generate`.
#pragma once

#include <string>

#include <nlohmann/json.hpp>

#include "shardlm/model/llama.h"
#include "shardlm/train/checkpoint.h"

namespace shardlm {

struct StoredModel {
  ModelConfig config;
  DType param_dtype = DType::kF32;
  std::string tokenizer = "byte";
};

nlohmann::json model_to_json(const LlamaModel& model, const std::string& tokenizer);
// Throws Error(kData) naming the checkpoint's model.json when a field is missing or invalid.
StoredModel read_stored_model(const CheckpointReader& ckpt);

void write_model(CheckpointWriter& ckpt, const LlamaModel& model, Backend& backend,
                 const std::string& tokenizer);
// Loads params.bin into the model (which must have the stored config and dtype).
void read_params(const CheckpointReader& ckpt, LlamaModel& model, Backend& backend);

}  // namespace shardlm
