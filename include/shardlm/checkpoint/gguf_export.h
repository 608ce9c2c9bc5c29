// `shardlm convert gguf-export`: a checkpoint as one GGUF file (io/gguf.h), the model file of
// llama.cpp and Ollama, laid out as llama.cpp's own converter (convert_hf_to_gguf.py) writes
// the same model: its architecture's metadata keys, the tokenizer and chat template, and the
// tensors under llama.cpp's names (token_embd, blk.N.attn_q, ..., output_norm, output), with
// Llama's q/k rows regrouped for llama.cpp's rotary layout, Gemma's norms stored as 1 + w and
// GLM's gate and up as one ffn_up.
#pragma once

#include <cstdint>
#include <string>

#include "shardlm/io/gguf.h"

namespace shardlm {

// What gguf_export wrote, for the command's message.
struct GgufExportInfo {
  // GGUF's: "llama", "qwen2", "qwen3", "gemma2", "gemma3", "chatglm", "glm4"
  std::string architecture;
  int64_t tensors = 0;
  uint64_t bytes = 0;  // of the tensor data
};

// Writes `path` from a checkpoint (a step or checkpoints directory; a LoRA checkpoint as its
// merged model, W + alpha/r B A over its base). `type`: kF16, kBF16 or kQ8_0 for the matrices
// (a Q8_0 matrix whose rows do not split into blocks of 32 falls back to F16, as llama.cpp's
// converter does); vectors (norms, biases) stay F32. architecture: a Hugging Face one
// ("" = the imported model's, else hf.h's default_hf_architecture). Streams the parameters
// tensor by tensor in pieces of about kHfExportChunk values (a LoRA checkpoint: one merged
// unit at a time). Error(kConfig) naming the setting for what llama.cpp cannot express (the
// byte tokenizer, a SentencePiece tokenizer, a pre-tokenizer llama.cpp does not name, Gemma
// layer patterns other than llama.cpp's, a GLM-4 whose queries are not as wide as the model).
GgufExportInfo gguf_export(const std::string& checkpoint, const std::string& path, GgufType type,
                           const std::string& architecture = "");

}  // namespace shardlm
