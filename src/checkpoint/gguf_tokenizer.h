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
// for Gemma. Both: the special ids, add_bos/add_eos where the tokenizer says, and
// tokenizer.chat_template from the tokenizer_config.json beside it. For GLM (`arch` chatglm or
// glm4, general.architecture's value) what llama.cpp's converter adds: Llama 3's split named
// "chatglm-bpe" / "glm4", <|endoftext|> as eos (and glm4's bos) where the tokenizer names none
// and as unknown, <|user|> as end of turn, and chatglm's add_bos_token false unless the
// tokenizer says. Error(kConfig) naming the tokenizer for the byte tokenizer, tiktoken,
// vocab.json + merges.txt and pre-tokenizers llama.cpp does not name.
void add_gguf_tokenizer(const std::string& tokenizer, int64_t vocab_size, const std::string& arch,
                        GgufMetadata& meta);

}  // namespace shardlm
