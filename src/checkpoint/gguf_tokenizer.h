// The tokenizer.* keys of a GGUF export (gguf_export.h): what llama.cpp's converter writes for
// a byte-level BPE or SentencePiece tokenizer. Private to src/checkpoint.
#pragma once

#include <cstdint>
#include <string>

#include "shardlm/io/gguf.h"

namespace shardlm {

// Adds the keys of `tokenizer` (model.json's: a file, or a directory holding one) for a model
// of vocab_size rows. A tokenizer.json: tokenizer.ggml.model "gpt2", .pre (llama.cpp's name of
// the pre-tokenizer), .tokens (vocab_size of them, ids the tokenizer lacks as [PADi]),
// .token_type, .merges. A SentencePiece tokenizer.model: "llama", .tokens, .scores,
// .token_type (tokenizer_config.json's added tokens over the pieces), .add_space_prefix false
// for Gemma (`gemma`). Both: the special ids, add_bos/add_eos where the tokenizer says, and
// tokenizer.chat_template from the tokenizer_config.json beside it. Error(kConfig) naming the
// tokenizer for the byte tokenizer, tiktoken, vocab.json + merges.txt and pre-tokenizers
// llama.cpp does not name.
void add_gguf_tokenizer(const std::string& tokenizer, int64_t vocab_size, bool gemma,
                        GgufMetadata& meta);

}  // namespace shardlm
