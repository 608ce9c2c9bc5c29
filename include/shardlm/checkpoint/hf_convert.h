// Conversions between Hugging Face directories (hf/hf.h) and shardlm checkpoints
// (checkpoint.h, model_io.h): `shardlm convert hf-import` / `hf-export`, and a LoRA checkpoint
// read as its merged model.
#pragma once

#include <cstddef>
#include <string>

#include "shardlm/core/dtype.h"

namespace shardlm {

class Backend;
class CheckpointReader;
class LlamaModel;

// `shardlm convert hf-import`: a Hugging Face directory -> a shardlm checkpoint (model.json,
// params.bin in `dtype`, and the directory's config.json kept as hf_config.json so that an
// export gives it back) in checkpoints_dir (step 0). Returns the step directory. Streams:
// params.bin is written unit by unit (a decoder layer, the embeddings), so it holds one unit in
// f32 plus, for bf16, the same unit converted, never the model.
std::string hf_import(const std::string& hf_dir, const std::string& checkpoints_dir, DType dtype);

// `shardlm convert hf-export`: a checkpoint (step or checkpoints directory) -> a Hugging Face
// directory in `dtype` (kF32 / kBF16). architecture "" = the imported model's, else by
// default_hf_architecture. Streams the parameters tensor by tensor, in chunks of
// kHfExportChunk elements read through the manifest from whichever rank's file holds them.
// A LoRA checkpoint exports its adapters in PEFT's format (adapter_model.safetensors with
// PEFT's names, A [r, in] and B [out, r]; adapter_config.json), or with merge = true the
// merged model (W + alpha/r B A, the base read from where model.json says) as above.
void hf_export(const std::string& checkpoint, const std::string& hf_dir, DType dtype,
               const std::string& architecture, size_t max_shard_bytes, bool merge = false);

// A LoRA checkpoint's merged model (as hf_export's merge computes it) into `model`'s parameters
// (a model without adapters of the checkpoint's shape), unit by unit: one unit in f32 on the
// host at a time, plus, for a base without a directory, its seeded initial weights whole.
void read_merged_lora_params(const CheckpointReader& ckpt, LlamaModel& model, Backend& backend);

}  // namespace shardlm
