// Turning text into a token-shard corpus (shards.h): the input formats, the chat template
// and its loss mask, and the tokenizer loader. Inputs are streamed; a bounded batch of
// documents is held in memory at a time.
//
// Inputs, by extension:
//   *.jsonl  one JSON object per line (blank lines skipped): {"text": "..."} is a document
//            (empty texts are skipped), {"messages": [{"role": ..., "content": ...}, ...]}
//            a chat with roles "system", "user" or "assistant"; other keys are ignored.
//   others   plain text: documents are maximal runs of non-blank lines (a blank line is
//            empty or a lone "\r"), each line ending in "\n" (the same documents as
//            load_text_source in shardlm/train/data.h).
// Every document ends with <eos>. Plain-text documents have no loss mask (all targets).
//
// Chat template, each piece encoded separately (so the mask falls on token boundaries):
//   for each message:  "<|" role "|>\n"   mask 0
//                      content            mask 1 for the assistant, else 0
//                      end of turn        assistant: <eos>, mask 1 (the model learns to stop)
//                                         system, user: "\n", mask 0
//   then, when the last message is not the assistant's: <eos>, mask 0 (the document's end;
//   after an assistant turn its closing <eos> is the document's end).
// Example: [user "Hi", assistant "Hello"] ->
//   "<|user|>\nHi\n<|assistant|>\n" (0s), "Hello" (1s), <eos> (1).
// With the byte tokenizer the role headers are plain text: content that itself contains
// "\n<|assistant|>\n" cannot be told apart from a turn change.
#pragma once

#include <cstdint>
#include <iosfwd>
#include <memory>
#include <string>
#include <vector>

#include "shardlm/io/shards.h"
#include "shardlm/io/tokenizer.h"

namespace shardlm {

struct ChatMessage {
  std::string role;  // "system", "user" or "assistant"
  std::string content;
};

struct DocumentTokens {
  std::vector<int32_t> tokens;  // [n]
  std::vector<uint8_t> mask;    // [n] 1 = a training target; empty = all targets
};

// The chat template a tokenizer gets, from its special tokens: Llama-3's
// (<|start_header_id|>, <|end_header_id|>, <|eot_id|>), ChatML (<|im_start|>, <|im_end|>;
// Qwen), else the plain template above (the byte tokenizer's).
//   Llama-3: [<|begin_of_text|>] then per message <|start_header_id|> role <|end_header_id|>
//            "\n\n" content (trimmed) <|eot_id|>; mask 1 on assistant content and its
//            <|eot_id|>. Generation prompt: the assistant's header.
//   ChatML:  per message <|im_start|> role "\n" content <|im_end|> "\n"; mask 1 on assistant
//            content and its <|im_end|>. Generation prompt: <|im_start|>assistant\n.
// Both end the document with the tokenizer's eos (mask 0) unless the last token is it.
enum class ChatTemplate { kPlain, kLlama3, kChatml };
ChatTemplate chat_template_for(const Tokenizer& tok);

// Renders messages with the tokenizer's chat template (chat_template_for). generation_prompt:
// no end of document; the template's assistant header ends it, the prompt a model continues
// to answer. Throws Error(kData) for an unknown role.
DocumentTokens encode_chat(const std::vector<ChatMessage>& messages, const Tokenizer& tok,
                           bool generation_prompt = false);

// Tokenizes the inputs in order into a corpus at output_dir (see ShardWriter), logging each
// file's documents and tokens and the totals. `threads` encode documents in parallel (the
// tokenizer's encode must be thread-safe, as every Tokenizer here is): batches of up to
// threads x 2 MiB of text (or threads x 1024 documents) are encoded, then written in input
// order, so the corpus is byte-identical for any thread count and memory stays bounded.
// Errors: no inputs or threads < 1 -> kConfig; an unreadable file, a file without
// documents, or a malformed JSONL line ("<file>:<line>: ...", the first in input order) -> kData.
CorpusInfo tokenize_files(const std::vector<std::string>& inputs, const std::string& output_dir,
                          const Tokenizer& tok, std::ostream& log,
                          int64_t max_shard_tokens = int64_t(1) << 28, int threads = 1);

// "" or "byte": the byte tokenizer. A directory: the file find_tokenizer picks in it. A file:
// vocab.json (with merges.txt beside it), another *.json (tokenizer.json: byte-level BPE,
// bpe.h), or anything else as a tokenizer.model, which is a tiktoken rank file (bpe.h) or a
// SentencePiece model (sentencepiece.h) by its content; a file that is neither is
// Error(kConfig) naming it. A tokenizer's name() is a path this takes back.
std::unique_ptr<Tokenizer> load_tokenizer(const std::string& path);

// The tokenizer file of a model directory, "" when it has none: tokenizer.json, unless it is
// Hugging Face's conversion of a SentencePiece model (Unigram, or BPE with byte fallback) and
// the tokenizer.model it came from is there; else vocab.json (+ merges.txt); else
// tokenizer.model.
std::string find_tokenizer(const std::string& dir);

}  // namespace shardlm
