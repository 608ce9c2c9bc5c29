// Turning text into a token-shard corpus (shards.h): the input formats, the chat template
// and its loss mask, and the tokenizer loader. Inputs are streamed; a bounded batch of
// documents is held in memory at a time.
//
// Inputs, by extension:
//   *.jsonl, *.json  records (records.h: OpenAI messages, alpaca, ShareGPT, prompt/completion,
//            text), one JSON object per line (blank lines skipped) or, in a .json file that
//            starts with '[', a JSON array of them. In a {"messages": [...]} chat the roles are
//            "system", "user" or "assistant"; an assistant message may carry its reasoning as
//            "reasoning_content" or "thinking" (a string, not both; only Qwen3's template
//            renders it); other keys are ignored.
//   others   plain text: documents are maximal runs of non-blank lines (a blank line is
//            empty or a lone "\r"), each line ending in "\n" (the same documents as
//            load_text_source in shardlm/train/data.h).
// Every document ends with <eos>. Plain-text documents have no loss mask (all targets).
//
// The plain chat template, each piece encoded separately (so the mask falls on token
// boundaries); tokenizers with chat markers get their family's template (chat_template_for):
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
#include <functional>
#include <iosfwd>
#include <memory>
#include <nlohmann/json_fwd.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "shardlm/io/records.h"
#include "shardlm/io/shards.h"
#include "shardlm/io/tokenizer.h"

namespace shardlm {

struct ChatMessage {
  std::string role;  // "system", "user" or "assistant"
  std::string content;
  // The assistant's reasoning (JSONL "reasoning_content" or "thinking"); unset when the
  // message has none, which Qwen3's template tells apart from an empty one.
  std::optional<std::string> reasoning = std::nullopt;
};

// "system", "user" or "assistant".
bool is_chat_role(std::string_view role);

struct DocumentTokens {
  std::vector<int32_t> tokens;  // [n]
  std::vector<uint8_t> mask;    // [n] 1 = a training target; empty = all targets
};

// The chat template a tokenizer gets, from its special tokens (chat_template.cpp):
//   Gemma    <start_of_turn> and <end_of_turn> (Gemma 2 and 3; SentencePiece or
//            tokenizer.json).
//   Llama-3  <|start_header_id|>, <|end_header_id|> and <|eot_id|>.
//   Qwen3    <|im_start|> and <|im_end|>, and a Jinja chat_template beside the tokenizer
//            (tokenizer_config.json or chat_template.jinja) that reads "reasoning_content",
//            or, without one, the <think> and </think> tokens.
//   ChatML   <|im_start|> and <|im_end|> otherwise (Qwen2, Qwen2.5).
//   GLM-4    [gMASK], <sop>, <|system|>, <|user|> and <|assistant|> (glm-4-9b-chat, GLM-4-0414).
//   Plain    any other tokenizer (the byte tokenizer's template above).
// Renderings, pieces encoded separately where the mask changes (content is encoded on its
// own, so text that tokenizes across a marker boundary in the joint string can differ):
//   Llama-3: [<|begin_of_text|>] then per message <|start_header_id|> role <|end_header_id|>
//            "\n\n" content (trimmed) <|eot_id|>; mask 1 on assistant content and its
//            <|eot_id|>. Generation prompt: the assistant's header.
//   ChatML:  per message <|im_start|> role "\n" content <|im_end|> "\n"; mask 1 on assistant
//            content and its <|im_end|>. Generation prompt: <|im_start|>assistant\n.
//   Qwen3:   ChatML, but an assistant turn after the last user message renders its reasoning
//            (`reasoning`, else a "<think>...</think>" block at the start of its content) as
//            "<think>\n" reasoning "\n</think>\n\n" content, the last turn always (an empty
//            block "<think>\n\n</think>\n\n" without reasoning: the non-thinking mode);
//            earlier turns are rendered without their reasoning. Mask 1 on the think block,
//            the content and <|im_end|>. Generation prompt: <|im_start|>assistant\n
//            (thinking mode: the model writes its own think block).
//   Gemma:   [<bos>] then per message <start_of_turn> role "\n" content (trimmed)
//            <end_of_turn> "\n", "assistant" rendered as "model", a first system message
//            folded into the first user turn as system "\n\n" user; roles must alternate
//            user, assistant, ... (Error(kData) naming the message otherwise). Mask 1 on the
//            model's content and its <end_of_turn>. Generation prompt: <start_of_turn>model\n.
//   GLM-4:   [gMASK] <sop> then per message with content <|role|> "\n" content (no end
//            marker: the next role token ends a turn); mask 1 on the assistant's "\n" content
//            and on the token after it (the next role token, or the eos ending the document),
//            which GLM-4 emits to end its turn. Messages with empty content are left out, as
//            the template does. Generation prompt: <|assistant|> (the model writes the "\n").
// All end the document with the tokenizer's eos (mask 0; GLM-4: 1 after an assistant turn)
// unless the last token is it.
// "Trimmed" is Jinja's trim: Unicode whitespace off both ends. These are the published
// templates' paths without tools; tool calls and tool messages are not rendered.
enum class ChatTemplate { kPlain, kLlama3, kChatml, kQwen3, kGemma, kGlm4 };
ChatTemplate chat_template_for(const Tokenizer& tok);

// Renders messages with the tokenizer's chat template (chat_template_for). generation_prompt:
// no end of document; the template's assistant header ends it, the prompt a model continues
// to answer. Throws Error(kData) for an unknown role, and for Gemma roles that do not
// alternate.
DocumentTokens encode_chat(const std::vector<ChatMessage>& messages, const Tokenizer& tok,
                           bool generation_prompt = false);

// The token that ends an assistant turn in the tokenizer's template (<|eot_id|>, <|im_end|>,
// <end_of_turn>, GLM-4's <|user|>; the plain template's eos): where a chat reply stops.
int32_t chat_end_of_turn(const Tokenizer& tok);

// One record of a format in records.h into its document (records.cpp); no tokens: nothing to
// write (an empty text). `masked`: the document has a loss mask (every format but text). Throws
// Error(kData) for a bad record, naming the field but not the place (read_documents prefixes
// "<file>:<line>: ").
struct RecordDocument {
  DocumentTokens doc;
  bool masked = false;
  // A preference record: doc is the chosen sequence, this the rejected one (both masked).
  std::optional<DocumentTokens> rejected;
};
RecordDocument encode_record(const nlohmann::json& record, const RecordOptions& options,
                             const Tokenizer& tok);

// TRL's extract_prompt (trl/data_utils.py), for a preference record without "prompt": chosen and
// rejected, both text or both message lists, split at the first character (Python's: a code
// point) or message where they differ, a space before it going with the completions; when one
// is a prefix of the other, at the shorter one's last element (as TRL's loop leaves it).
// Error(kData) naming the two keys where they are of other kinds, empty, or share no start (TRL
// would make a prompt of nothing, or of the chosen text's end).
// The three parts go to `split` as {"prompt", "chosen", "rejected"}.
void extract_implicit_prompt(const nlohmann::json& chosen, const nlohmann::json& rejected,
                             nlohmann::json& split, const std::string& chosen_key = "chosen",
                             const std::string& rejected_key = "rejected");

// What reading one input gave.
struct FileStats {
  int64_t docs = 0;
  int64_t tokens = 0;
  int64_t masked = 0;                  // documents with a loss mask
  int64_t pairs = 0;                   // preference records: two documents each (of `docs`)
  int64_t bad_records = 0;             // skipped (RecordOptions::skip_bad_records)
  std::vector<std::string> bad_shown;  // the first kBadRecordsShown of their messages
  static constexpr size_t kBadRecordsShown = 5;
};

// One input's documents, in file order, handed to `sink` (plain text or records, by
// is_record_file; a preference record's two documents one after the other, chosen first), encoded
// on `threads` threads in bounded batches (see tokenize_files). A bad record is Error(kData)
// "<file>:<line>: <what>" ("<file>:<line>: record <i>: <what>" in a JSON array), the first in file
// order, unless options.skip_bad_records counts it instead. An unreadable file or a broken JSON
// array is Error(kData) either way.
FileStats read_documents(const std::string& path, const Tokenizer& tok,
                         const RecordOptions& options, int threads,
                         const std::function<void(const DocumentTokens&)>& sink);

// The log line(s) of an input: "  <path>: <docs> documents (<n> masked), <tokens> tokens", then,
// when records were skipped, their count and the first messages.
std::string describe_file(const std::string& path, const FileStats& stats);

// Tokenizes the inputs in order into a corpus at output_dir (see ShardWriter), logging each
// file's documents and tokens (describe_file) and the totals. `threads` encode documents in
// parallel (the tokenizer's encode must be thread-safe, as every Tokenizer here is): batches of
// up to threads x 2 MiB of text (or threads x 1024 documents) are encoded, then written in input
// order, so the corpus is byte-identical for any thread count and memory stays bounded.
// `records` reads the record files (records.h).
// Errors: no inputs or threads < 1 -> kConfig; an unreadable file, a file without documents, or
// a bad record (read_documents, the first in input order) -> kData.
CorpusInfo tokenize_files(const std::vector<std::string>& inputs, const std::string& output_dir,
                          const Tokenizer& tok, std::ostream& log,
                          int64_t max_shard_tokens = int64_t(1) << 28, int threads = 1,
                          const RecordOptions& records = {});

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
