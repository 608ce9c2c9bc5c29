// Hugging Face model directories: config.json of LlamaForCausalLM, MistralForCausalLM,
// Qwen2ForCausalLM, Qwen3ForCausalLM, Gemma2/3ForCausalLM and GlmForCausalLM/Glm4ForCausalLM
// mapped onto ModelConfig and back, and the weights (safetensors, one file or sharded) read into
// or written from the parameter layout. shardlm's parameter names are the Hugging Face ones and
// its rotary embedding computes Hugging Face's conventions (rotate-half, GLM's interleaved
// partial rotary), so the tensors move as they are (only converted between dtypes), except GLM's
// fused gate_up_proj, split into the layout's gate and up on reading and joined on writing.
#pragma once

#include <cstddef>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>

#include "shardlm/core/dtype.h"
#include "shardlm/io/safetensors.h"
#include "shardlm/model/config.h"
#include "shardlm/model/layout.h"
#include "shardlm/model/nf4_base.h"

namespace shardlm {

struct HfModelInfo {
  ModelConfig config;
  std::string architecture;  // "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", ...
  std::string torch_dtype;   // as config.json says ("bfloat16", "float32", ...; "" if absent)
  bool bnb_4bit = false;     // saved by bitsandbytes in 4 bits (hf_config_is_bnb_4bit)
  nlohmann::json raw;        // config.json as read
};

// Reads DIR/config.json. Throws Error(kConfig) naming the file and the field when the
// architecture is not one of kHfArchitectures, a field is missing or malformed, or the config asks
// for something shardlm does not compute (another activation, rope scaling other than llama3,
// MLP or output-projection biases, partial rotary embeddings).
HfModelInfo read_hf_config(const std::string& dir);

// The architectures shardlm reads and writes.
inline constexpr const char* kHfArchitectures[] = {
    "LlamaForCausalLM",  "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
    "Gemma2ForCausalLM", "Gemma3ForCausalLM",  "GlmForCausalLM",   "Glm4ForCausalLM"};

// config.json for a model: the fields of `architecture` (LlamaForCausalLM and
// MistralForCausalLM need no attention bias; Qwen2ForCausalLM has it; Qwen3ForCausalLM has q/k
// norms and no bias; Llama has no sliding window, Mistral one on every layer), with `dtype` as
// torch_dtype. Fields of `original` (an imported model's config.json) are kept unless shardlm
// sets them.
nlohmann::json hf_config_json(const ModelConfig& cfg, const std::string& architecture, DType dtype,
                              const nlohmann::json& original = nlohmann::json::object());

// The architecture a model exports as: Qwen3 with q/k norms, Qwen2 with q/k/v biases, else
// Mistral with a sliding window, else Llama.
std::string default_hf_architecture(const ModelConfig& cfg);

// Unit u of the layout (ParamLayout::units), f32, from the directory's tensors: every entry of
// the unit must be there with its shape (Error(kData) naming the file and the tensor). A weight
// bitsandbytes saved in 4 bits (is_bnb_nf4) is dequantized into `out` (bitsandbytes' values,
// which a dense base then holds) and, when `nf4` is given, also appended to it as read, for an
// NF4 base to hold as it is.
void read_hf_unit(const SafetensorsDir& st, const ParamLayout& layout, int unit, float* out,
                  std::vector<Nf4Matrix>* nf4 = nullptr);

// A directory bitsandbytes saved in 4 bits (transformers' save_pretrained of a model loaded
// with BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")). config.json's
// quantization_config: true for that, false without one, Error(kConfig) naming `file` for any
// other (8 bits, fp4, another method or storage dtype). Each quantized weight W is stored as W
// (U8: the packed codes, quant/nf4.h's layout, which is bitsandbytes'), W.absmax (F32; U8
// under double quantization, with W.nested_absmax and W.nested_quant_map), W.quant_map and
// W.quant_state.bitsandbytes__nf4 (a JSON text: quant_type, blocksize, shape,
// nested_blocksize, nested_offset).
bool hf_config_is_bnb_4bit(const nlohmann::json& config, const std::string& file);
// Whether tensor `name` is stored so (it has a quant state).
bool is_bnb_nf4(const SafetensorsDir& st, const std::string& name);
// That tensor of `shape` as packed codes and f32 absmax (double quantization restored as
// bitsandbytes' dequantize_4bit does); Nf4Matrix::begin is left 0. Error(kData) naming the
// tensor for another quant type, block size, shape or code book.
Nf4Matrix read_bnb_nf4(const SafetensorsDir& st, const std::string& name,
                       const std::vector<int64_t>& shape);

// Whether `architecture` stores each layer's gate and up projections as one tensor (GLM's
// mlp.gate_up_proj [2F, D], gate rows first): written so by write_hf_dir_streamed, and read so
// by read_hf_unit wherever a directory has it.
bool hf_architecture_fuses_gate_up(const std::string& architecture);

// Elements [at, at + n) of tensor `e`'s f32 values into out [n]; n <= kHfExportChunk.
using HfChunkSource = std::function<void(const ParamEntry& e, int64_t at, int64_t n, float* out)>;
// The largest piece of a tensor an export holds at once, in elements (4 MiB of f32): the
// streamed writer's buffers are this many f32 and bf16 values, whatever the model's size.
constexpr int64_t kHfExportChunk = int64_t{1} << 20;

// Writes a Hugging Face directory: config.json, generation_config.json and the weights in
// `dtype` (kF32 or kBF16), sharded at max_shard_bytes (model.safetensors, or shards with
// model.safetensors.index.json). `chunk_values` is asked for every tensor in arena order, each
// in consecutive chunks of at most kHfExportChunk elements, so a caller can stream them from
// disk holding no more than a chunk.
void write_hf_dir_streamed(const std::string& dir, const ParamLayout& layout, DType dtype,
                           const nlohmann::json& config_json, size_t max_shard_bytes,
                           const HfChunkSource& chunk_values);
// The same from whole units: `unit_values(u, out)` fills unit u's f32 values; it is asked for
// each unit once, in order (a caller that transforms a unit as a whole, e.g. merges LoRA
// adapters into a layer, holds that unit).
void write_hf_dir(const std::string& dir, const ParamLayout& layout, DType dtype,
                  const nlohmann::json& config_json, size_t max_shard_bytes,
                  const std::function<void(int unit, float* out)>& unit_values);

}  // namespace shardlm
