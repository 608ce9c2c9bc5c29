// The tokenizer.* keys of a GGUF export (gguf_export.h): what llama.cpp's converter writes for
// a byte-level BPE tokenizer. Private to src/checkpoint.
#pragma once

#include <cstdint>
#include <string>

#include "shardlm/io/gguf.h"

namespace shardlm {

// Adds the keys of `tokenizer` (model.json's: a tokenizer.json, or a directory holding one) for
// a model of vocab_size rows: tokenizer.ggml.model "gpt2", .pre (llama.cpp's name of the
// pre-tokenizer), .tokens (vocab_size of them, ids the tokenizer lacks as [PADi]),
// .token_type, .merges, the special ids and add_bos/add_eos where the tokenizer says, and
// tokenizer.chat_template from the tokenizer_config.json beside it. Error(kConfig) naming the
// tokenizer for the byte tokenizer, SentencePiece, tiktoken and pre-tokenizers llama.cpp does
// not name.
void add_gguf_tokenizer(const std::string& tokenizer, int64_t vocab_size, GgufMetadata& meta);

}  // namespace shardlm
