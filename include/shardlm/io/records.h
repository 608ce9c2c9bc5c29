// The record formats instruction data ships in and the options that choose and map them. Each
// record becomes one training document whose loss mask covers the completion or the assistant's
// turns only (encode_record in tokenize.h, records.cpp); record files are JSON Lines (.jsonl) or
// a JSON array (.json) (record_reader.h/.cpp).
//
// Formats (the column names are the defaults; RecordColumns maps others onto them):
//   messages  {"messages": [{"role": "system"|"user"|"assistant", "content": ...}, ...]}
//             (OpenAI's chat format), rendered by encode_chat (tokenize.h); it must hold an
//             assistant message (a chat without one has nothing to train on).
//   alpaca    {"instruction", "input" (optional), "output", "system" (optional), "history"
//             (optional: [[instruction, response], ...])}, converted as LLaMA-Factory does:
//             the history pairs as user / assistant turns, then one user turn holding the
//             non-empty ones of instruction and input joined by "\n", then the output as the
//             assistant's turn; a non-empty system as the first message. Rendered by
//             encode_chat.
//   sharegpt  {"conversations" (or "messages"): [{"from": "human"|"gpt"|"system", "value": ...},
//             ...], "system" (optional)}: a first "system" turn (else the record's "system")
//             is the system message; the rest alternate human, gpt, ... and end on gpt (as
//             LLaMA-Factory requires). Rendered by encode_chat. RecordTags maps other tags.
//   prompt_completion  TRL's SFTTrainer format. Text: {"prompt": str, "completion": str}: the
//             ids of prompt + completion, then eos (unless the text already ends with it);
//             mask 0 on the longest prefix shared with the prompt's own ids, 1 after (TRL's
//             completion mask). Conversational: "prompt" and "completion" are message lists
//             (the completion ending with an assistant message): the ids of
//             encode_chat(prompt + completion), mask 0 on the prefix it shares with
//             encode_chat(prompt, generation prompt), 1 after, and the document's closing eos
//             (when encode_chat adds one) 0. No bos is added (TRL's tokenizer call adds one
//             only for tokenizers whose post-processor does; shardlm's documents never start
//             with one).
//   text      {"text": str}: the text then eos, every token a target; an empty text is no
//             document.
//   preference  TRL's preference format (DPOTrainer, trl 1.x): {"prompt", "chosen", "rejected"},
//             all text or all message lists; a record is a pair of documents, chosen then
//             rejected (RecordDocument::rejected), read by training's preference objectives.
//             Text: each of prompt + chosen and prompt + rejected tokenized whole, eos appended
//             unless it ends with it. Conversational: encode_chat(prompt + chosen) up to where
//             the conversation ends (no closing eos: TRL renders the template alone), the
//             prompt rendered with the generation prompt. Either way the prompt's length is the
//             shorter of its common prefixes with the two (TRL's `prompt_len`); the mask is 0
//             before it and 1 on every token after it (TRL's completion mask). Without "prompt"
//             (TRL's implicit prompt), chosen and rejected both text or both message lists hold
//             it as their shared start: extract_implicit_prompt splits them first. Chosen and
//             rejected must be non-empty.
// kAuto picks by the record's keys: messages (sharegpt when its turns have the "from" tag and no
// "role"), conversations (sharegpt), instruction + output (alpaca), prompt + completion,
// chosen + rejected (preference), text.
// A record matching none, or more than one, is an error naming its keys.
//
// Bad records (missing fields, wrong types, an empty output or completion, a role out of order,
// an unknown role or tag, a chat with nothing to train on) are Error(kData) naming the file, the
// line where the record starts (a JSON array: and the record's index) and the field, unless
// RecordOptions::skip_bad_records, which counts them instead (FileStats).
#pragma once

#include <string>
#include <string_view>

namespace shardlm {

enum class RecordFormat {
  kAuto,
  kMessages,
  kAlpaca,
  kShareGpt,
  kPromptCompletion,
  kText,
  kPreference
};

// "auto", "messages", "alpaca", "sharegpt", "prompt_completion", "text", "preference"; anything
// else is
// Error(kConfig) naming `what` (the key or option that gave it).
RecordFormat parse_record_format(std::string_view name, std::string_view what);
std::string_view record_format_name(RecordFormat format);

// The record keys each field is read from (LLaMA-Factory's `columns`: its prompt, query and
// response are instruction, input and output here).
struct RecordColumns {
  std::string messages;  // "" = "messages" (messages), "conversations" else "messages" (sharegpt)
  std::string instruction = "instruction";
  std::string input = "input";
  std::string output = "output";
  std::string system = "system";
  std::string history = "history";
  std::string prompt = "prompt";
  std::string completion = "completion";
  std::string text = "text";
  std::string chosen = "chosen";
  std::string rejected = "rejected";
};

// ShareGPT's turn keys and role values (LLaMA-Factory's `tags`).
struct RecordTags {
  std::string role = "from";
  std::string content = "value";
  std::string user = "human";
  std::string assistant = "gpt";
  std::string system = "system";
};

struct RecordOptions {
  RecordFormat format = RecordFormat::kAuto;
  RecordColumns columns;
  RecordTags tags;
  bool skip_bad_records = false;
};

// .jsonl and .json files hold records; anything else is plain text.
bool is_record_file(const std::string& path);

}  // namespace shardlm
