// encode_record (tokenize.h): one record of a format in records.h into its document. Each
// format is validated field by field (Error(kData) naming the field; the reader adds the file and
// line), converted into chat messages where it is a chat (alpaca and ShareGPT as LLaMA-Factory
// converts them) and rendered by encode_chat; prompt/completion records get TRL's completion
// mask.
#include <algorithm>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "shardlm/core/check.h"
#include "shardlm/io/records.h"
#include "shardlm/io/tokenize.h"

namespace shardlm {
namespace {

using json = nlohmann::json;

constexpr std::pair<RecordFormat, std::string_view> kFormatNames[] = {
    {RecordFormat::kAuto, "auto"},
    {RecordFormat::kMessages, "messages"},
    {RecordFormat::kAlpaca, "alpaca"},
    {RecordFormat::kShareGpt, "sharegpt"},
    {RecordFormat::kPromptCompletion, "prompt_completion"},
    {RecordFormat::kText, "text"},
    {RecordFormat::kPreference, "preference"}};

std::string key_name(std::string_view key) { return fmt::format("\"{}\"", key); }

// The record's value at `key`, or null when it is absent or JSON null.
const json* find(const json& record, const std::string& key) {
  const auto it = record.find(key);
  return it == record.end() || it->is_null() ? nullptr : &*it;
}

// A string field; non_empty: "" is refused too. `where`: the object's place in the record
// ("conversations[2]"), which names the field; "" = the record itself.
std::string string_field(const json& record, const std::string& key, bool non_empty,
                         const std::string& where = "") {
  const json* v = find(record, key);
  if (v == nullptr || !v->is_string() || (non_empty && v->get_ref<const std::string&>().empty()))
    SHARDLM_FAIL(ErrorKind::kData, "{} must be a {}string{}",
                 where.empty() ? key_name(key) : where + "." + key, non_empty ? "non-empty " : "",
                 v == nullptr     ? " (it is missing)"
                 : v->is_string() ? ""
                                  : ", not " + v->dump());
  return v->get<std::string>();
}

// An optional string field: "" when absent or null.
std::string optional_string(const json& record, const std::string& key) {
  return find(record, key) == nullptr ? std::string() : string_field(record, key, false);
}

// An assistant's reasoning: "reasoning_content" or "thinking", a string (null: none).
std::optional<std::string> parse_reasoning(const json& m, const std::string& where) {
  std::optional<std::string> reasoning;
  for (const char* key : {"reasoning_content", "thinking"}) {
    const json* v = find(m, key);
    if (v == nullptr) continue;
    if (!v->is_string()) SHARDLM_FAIL(ErrorKind::kData, "{}.{} must be a string", where, key);
    if (reasoning)
      SHARDLM_FAIL(ErrorKind::kData, "{} has both \"reasoning_content\" and \"thinking\"; keep one",
                   where);
    reasoning = v->get<std::string>();
  }
  return reasoning;
}

// OpenAI-style messages: a non-empty list of {"role", "content"}.
std::vector<ChatMessage> parse_messages(const json* list, const std::string& key) {
  if (list == nullptr || !list->is_array() || list->empty())
    SHARDLM_FAIL(ErrorKind::kData,
                 "{} must be a non-empty list of {{\"role\", \"content\"}} messages",
                 key_name(key));
  std::vector<ChatMessage> messages;
  messages.reserve(list->size());
  for (size_t i = 0; i < list->size(); ++i) {
    const json& m = (*list)[i];
    const std::string where = fmt::format("{}[{}]", key, i);
    if (!m.is_object()) SHARDLM_FAIL(ErrorKind::kData, "{} is not an object", where);
    const auto role = m.find("role");
    if (role == m.end() || !role->is_string() || !is_chat_role(role->get<std::string>()))
      SHARDLM_FAIL(ErrorKind::kData, "{}.role must be \"system\", \"user\" or \"assistant\"{}",
                   where, role != m.end() ? ", not " + role->dump() : "");
    const auto content = m.find("content");
    if (content == m.end() || !content->is_string())
      SHARDLM_FAIL(ErrorKind::kData, "{}.content must be a string", where);
    messages.push_back(
        {role->get<std::string>(), content->get<std::string>(), parse_reasoning(m, where)});
  }
  return messages;
}

bool has_assistant(const std::vector<ChatMessage>& messages) {
  return std::any_of(messages.begin(), messages.end(),
                     [](const ChatMessage& m) { return m.role == "assistant"; });
}

// LLaMA-Factory's alpaca conversion: history pairs, then instruction "\n" input, then output.
std::vector<ChatMessage> alpaca_messages(const json& record, const RecordColumns& c) {
  std::vector<ChatMessage> messages;
  if (std::string system = optional_string(record, c.system); !system.empty())
    messages.push_back({"system", std::move(system)});
  if (const json* history = find(record, c.history)) {
    if (!history->is_array())
      SHARDLM_FAIL(ErrorKind::kData, "{} must be a list of [instruction, response] pairs",
                   key_name(c.history));
    for (size_t i = 0; i < history->size(); ++i) {
      const json& pair = (*history)[i];
      if (!pair.is_array() || pair.size() != 2 || !pair[0].is_string() || !pair[1].is_string())
        SHARDLM_FAIL(ErrorKind::kData,
                     "{}[{}] must be an [instruction, response] pair of strings, not {}",
                     key_name(c.history), i, pair.dump());
      messages.push_back({"user", pair[0].get<std::string>()});
      messages.push_back({"assistant", pair[1].get<std::string>()});
    }
  }
  const std::string instruction = string_field(record, c.instruction, false);
  const std::string input = optional_string(record, c.input);
  if (instruction.empty() && input.empty())
    SHARDLM_FAIL(ErrorKind::kData, "{} and {} are both empty: there is no prompt",
                 key_name(c.instruction), key_name(c.input));
  const std::string query = instruction.empty() ? input
                            : input.empty()     ? instruction
                                                : instruction + "\n" + input;
  messages.push_back({"user", query});
  messages.push_back({"assistant", string_field(record, c.output, true)});
  return messages;
}

// The key of a ShareGPT record's turn list: the mapped column, else "conversations", else
// "messages".
std::string sharegpt_key(const json& record, const RecordColumns& c) {
  if (!c.messages.empty()) return c.messages;
  return record.contains("conversations") ? "conversations" : "messages";
}

// LLaMA-Factory's ShareGPT conversion: a first system turn (else the record's system column),
// then turns alternating user, assistant, ending on the assistant.
std::vector<ChatMessage> sharegpt_messages(const json& record, const RecordOptions& o) {
  const std::string key = sharegpt_key(record, o.columns);
  const RecordTags& t = o.tags;
  const json* list = find(record, key);
  if (list == nullptr || !list->is_array() || list->empty())
    SHARDLM_FAIL(ErrorKind::kData, "{} must be a non-empty list of {{\"{}\", \"{}\"}} turns",
                 key_name(key), t.role, t.content);
  std::vector<ChatMessage> messages;
  std::string system = optional_string(record, o.columns.system);
  for (size_t i = 0; i < list->size(); ++i) {
    const json& turn = (*list)[i];
    const std::string where = fmt::format("{}[{}]", key, i);
    if (!turn.is_object()) SHARDLM_FAIL(ErrorKind::kData, "{} is not an object", where);
    const std::string tag = string_field(turn, t.role, false, where);
    const std::string value = string_field(turn, t.content, tag == t.assistant, where);
    if (tag != t.user && tag != t.assistant && tag != t.system)
      SHARDLM_FAIL(ErrorKind::kData,
                   "{}.{} is {}: not {}, {} or {} (other turns, such as tool calls, are not "
                   "supported; data.tags.* maps other tag names)",
                   where, t.role, key_name(tag), key_name(t.user), key_name(t.assistant),
                   key_name(t.system));
    if (tag == t.system && i == 0) {
      system = value;
      continue;
    }
    const bool user_due = messages.size() % 2 == 0;
    if (tag != (user_due ? t.user : t.assistant))
      SHARDLM_FAIL(ErrorKind::kData, "{}.{} is {} where {} is due (turns alternate {}, {}, ...{})",
                   where, t.role, key_name(tag), key_name(user_due ? t.user : t.assistant),
                   key_name(t.user), key_name(t.assistant),
                   tag == t.system ? "; a system turn may only come first" : "");
    messages.push_back({user_due ? "user" : "assistant", value});
  }
  if (messages.empty() || messages.size() % 2 != 0)
    SHARDLM_FAIL(ErrorKind::kData,
                 "{} ends without a {} turn after its last {} one: nothing to train on",
                 key_name(key), key_name(t.assistant), key_name(t.user));
  if (!system.empty()) messages.insert(messages.begin(), {"system", std::move(system)});
  return messages;
}

size_t common_prefix(const std::vector<int32_t>& a, const std::vector<int32_t>& b) {
  return size_t(std::mismatch(a.begin(), a.end(), b.begin(), b.end()).first - a.begin());
}

// TRL's completion mask on `doc`: 0 on its first `prompt_len` tokens, 1 on the rest of its first
// `body` tokens, 0 after.
void completion_mask(DocumentTokens& doc, size_t prompt_len, size_t body) {
  doc.mask.assign(doc.tokens.size(), 0);
  std::fill(doc.mask.begin() + std::min(prompt_len, body), doc.mask.begin() + body, 1);
}

DocumentTokens text_prompt_completion(const std::string& prompt, const std::string& completion,
                                      const Tokenizer& tok) {
  DocumentTokens doc;
  doc.tokens = tok.encode(prompt + completion);
  if (doc.tokens.empty() || doc.tokens.back() != tok.eos_id()) doc.tokens.push_back(tok.eos_id());
  completion_mask(doc, common_prefix(tok.encode(prompt), doc.tokens), doc.tokens.size());
  return doc;
}

// The conversation's own tokens end where it and the same conversation with a generation prompt
// part: whatever follows is the document's closing eos.
DocumentTokens chat_prompt_completion(const std::vector<ChatMessage>& prompt,
                                      const std::vector<ChatMessage>& completion,
                                      const Tokenizer& tok) {
  std::vector<ChatMessage> all = prompt;
  all.insert(all.end(), completion.begin(), completion.end());
  DocumentTokens doc = encode_chat(all, tok);
  const size_t body = common_prefix(doc.tokens, encode_chat(all, tok, true).tokens);
  completion_mask(doc, common_prefix(encode_chat(prompt, tok, true).tokens, doc.tokens), body);
  return doc;
}

DocumentTokens prompt_completion(const json& record, const RecordColumns& c, const Tokenizer& tok) {
  const json* prompt = find(record, c.prompt);
  const json* completion = find(record, c.completion);
  if (prompt != nullptr && prompt->is_string() && completion != nullptr && completion->is_string())
    return text_prompt_completion(prompt->get<std::string>(),
                                  string_field(record, c.completion, true), tok);
  if (prompt == nullptr || completion == nullptr || !prompt->is_array() || !completion->is_array())
    SHARDLM_FAIL(ErrorKind::kData,
                 "{} and {} must both be strings (text) or both lists of messages "
                 "(conversational)",
                 key_name(c.prompt), key_name(c.completion));
  const std::vector<ChatMessage> p = parse_messages(prompt, c.prompt);
  const std::vector<ChatMessage> q = parse_messages(completion, c.completion);
  if (q.back().role != "assistant")
    SHARDLM_FAIL(ErrorKind::kData, "{} must end with an assistant message", key_name(c.completion));
  return chat_prompt_completion(p, q, tok);
}

// TRL's preference tokenization (DPOTrainer._prepare_dataset and its collator): the two
// sequences whole, the completion mask from the shorter common prefix with the prompt's ids.
RecordDocument preference_pair(std::vector<int32_t> prompt, DocumentTokens chosen,
                               DocumentTokens rejected) {
  const size_t prompt_len =
      std::min(common_prefix(prompt, chosen.tokens), common_prefix(prompt, rejected.tokens));
  completion_mask(chosen, prompt_len, chosen.tokens.size());
  completion_mask(rejected, prompt_len, rejected.tokens.size());
  RecordDocument out;
  out.masked = true;
  out.doc = std::move(chosen);
  out.rejected = std::move(rejected);
  return out;
}

DocumentTokens text_with_eos(const std::string& text, const Tokenizer& tok) {
  DocumentTokens doc;
  doc.tokens = tok.encode(text);
  if (doc.tokens.empty() || doc.tokens.back() != tok.eos_id()) doc.tokens.push_back(tok.eos_id());
  return doc;
}

// The conversation as the template renders it, without the closing eos encode_chat adds (the
// tokens it shares with the same conversation rendered with a generation prompt).
DocumentTokens chat_without_end(const std::vector<ChatMessage>& messages, const Tokenizer& tok) {
  DocumentTokens doc = encode_chat(messages, tok);
  doc.tokens.resize(common_prefix(doc.tokens, encode_chat(messages, tok, true).tokens));
  doc.mask.clear();
  return doc;
}

std::vector<ChatMessage> completion_messages(const json* list, const std::string& key) {
  std::vector<ChatMessage> messages = parse_messages(list, key);
  if (messages.back().role != "assistant")
    SHARDLM_FAIL(ErrorKind::kData, "{} must end with an assistant message", key_name(key));
  return messages;
}

RecordDocument preference(const json& record, const RecordColumns& c, const Tokenizer& tok) {
  const json* prompt = find(record, c.prompt);
  const json* chosen = find(record, c.chosen);
  const json* rejected = find(record, c.rejected);
  if (prompt == nullptr) {  // TRL's implicit prompt: the completions' shared prefix
    if (chosen == nullptr || rejected == nullptr)
      SHARDLM_FAIL(ErrorKind::kData, "{} and {} are both needed in a preference record",
                   key_name(c.chosen), key_name(c.rejected));
    json split;
    extract_implicit_prompt(*chosen, *rejected, split, c.chosen, c.rejected);
    return preference(json{{c.prompt, split["prompt"]},
                           {c.chosen, split["chosen"]},
                           {c.rejected, split["rejected"]}},
                      c, tok);
  }
  if (prompt->is_string()) {
    const std::string p = prompt->get<std::string>();
    return preference_pair(tok.encode(p),
                           text_with_eos(p + string_field(record, c.chosen, true), tok),
                           text_with_eos(p + string_field(record, c.rejected, true), tok));
  }
  if (!prompt->is_array() || chosen == nullptr || rejected == nullptr || !chosen->is_array() ||
      !rejected->is_array())
    SHARDLM_FAIL(ErrorKind::kData,
                 "{}, {} and {} must all be strings (text) or all lists of messages "
                 "(conversational)",
                 key_name(c.prompt), key_name(c.chosen), key_name(c.rejected));
  const std::vector<ChatMessage> p = parse_messages(prompt, c.prompt);
  std::vector<ChatMessage> pc = p, pr = p;
  const std::vector<ChatMessage> ch = completion_messages(chosen, c.chosen);
  const std::vector<ChatMessage> rj = completion_messages(rejected, c.rejected);
  pc.insert(pc.end(), ch.begin(), ch.end());
  pr.insert(pr.end(), rj.begin(), rj.end());
  return preference_pair(encode_chat(p, tok, true).tokens, chat_without_end(pc, tok),
                         chat_without_end(pr, tok));
}

// ShareGPT when the list's first turn carries the role tag and no "role".
bool looks_sharegpt(const json& list, const RecordTags& tags) {
  return list.is_array() && !list.empty() && list[0].is_object() && list[0].contains(tags.role) &&
         !list[0].contains("role");
}

RecordFormat detect_format(const json& record, const RecordOptions& o) {
  const RecordColumns& c = o.columns;
  const std::string messages = c.messages.empty() ? "messages" : c.messages;
  std::vector<RecordFormat> fits;
  if (record.contains(messages))
    fits.push_back(looks_sharegpt(record[messages], o.tags) ? RecordFormat::kShareGpt
                                                            : RecordFormat::kMessages);
  if (c.messages.empty() && record.contains("conversations"))
    fits.push_back(RecordFormat::kShareGpt);
  if (record.contains(c.instruction) && record.contains(c.output))
    fits.push_back(RecordFormat::kAlpaca);
  if (record.contains(c.prompt) && record.contains(c.completion))
    fits.push_back(RecordFormat::kPromptCompletion);
  if (record.contains(c.chosen) && record.contains(c.rejected))
    fits.push_back(RecordFormat::kPreference);
  if (record.contains(c.text)) fits.push_back(RecordFormat::kText);
  if (fits.size() == 1) return fits[0];
  std::string names;
  if (fits.empty()) {
    for (const auto& [key, value] : record.items())
      names += (names.empty() ? "" : ", ") + key_name(key);
    SHARDLM_FAIL(ErrorKind::kData,
                 "the record fits no format: it has {}{}, where {} (messages), \"conversations\" "
                 "(sharegpt), {} + {} (alpaca), {} + {} (prompt_completion), {} + {} "
                 "(preference) or {} (text) is expected (data.format / --format names the format, "
                 "data.columns.* / --column maps other column names)",
                 names.empty() ? "no keys" : "the keys ", names, key_name(messages),
                 key_name(c.instruction), key_name(c.output), key_name(c.prompt),
                 key_name(c.completion), key_name(c.chosen), key_name(c.rejected),
                 key_name(c.text));
  }
  for (const RecordFormat f : fits)
    names += (names.empty() ? "" : ", ") + std::string(record_format_name(f));
  SHARDLM_FAIL(ErrorKind::kData,
               "the record's keys fit more than one format ({}); name the one to read with "
               "data.format / --format",
               names);
}

}  // namespace

RecordFormat parse_record_format(std::string_view name, std::string_view what) {
  std::string all;
  for (const auto& [format, text] : kFormatNames) {
    if (name == text) return format;
    all += (all.empty() ? "" : ", ") + std::string(text);
  }
  SHARDLM_FAIL(ErrorKind::kConfig, "{}: unknown record format \"{}\"; one of {}", what, name, all);
}

void extract_implicit_prompt(const json& chosen, const json& rejected, json& split,
                             const std::string& chosen_key, const std::string& rejected_key) {
  const bool text = chosen.is_string() && rejected.is_string();
  if (!text && !(chosen.is_array() && rejected.is_array()))
    SHARDLM_FAIL(ErrorKind::kData,
                 "{} and {} must both be strings (text) or both lists of messages "
                 "(conversational) in a record without \"prompt\"",
                 key_name(chosen_key), key_name(rejected_key));
  // Python indexes a str by code points: the UTF-8 bytes of one are never split.
  const std::string empty;
  const std::string& c = text ? chosen.get_ref<const std::string&>() : empty;
  const std::string& r = text ? rejected.get_ref<const std::string&>() : empty;
  auto code_point_start = [&](size_t i) {
    while (i > 0 && i < c.size() && (uint8_t(c[i]) & 0xC0) == 0x80) --i;
    return i;
  };
  const size_t shorter =
      text ? std::min(c.size(), r.size()) : std::min(chosen.size(), rejected.size());
  if (shorter == 0)
    SHARDLM_FAIL(ErrorKind::kData,
                 "{} or {} is empty: a record without \"prompt\" takes its prompt from their "
                 "shared start",
                 key_name(chosen_key), key_name(rejected_key));
  // extract_prompt's loop: the first index where they differ; without one, the loop ends on the
  // shorter one's last element, which stays in the completions.
  size_t at = 0;
  bool differ = false;
  if (text) {
    at = size_t(std::mismatch(c.begin(), c.begin() + shorter, r.begin()).first - c.begin());
    differ = at < shorter;
    at = differ ? code_point_start(at) : code_point_start(shorter - 1);
    if (differ && at > 0 && c[at - 1] == ' ') --at;  // the space goes with the completions
  } else {
    while (at < shorter && chosen[at] == rejected[at]) ++at;
    differ = at < shorter;
    if (!differ) at = shorter - 1;
  }
  if (at == 0)
    SHARDLM_FAIL(ErrorKind::kData,
                 "{} and {} share no start, so a record without \"prompt\" has no prompt; give "
                 "one in \"prompt\"",
                 key_name(chosen_key), key_name(rejected_key));
  if (text) {
    split = {{"prompt", c.substr(0, at)}, {"chosen", c.substr(at)}, {"rejected", r.substr(at)}};
  } else {
    const auto cut = std::ptrdiff_t(at);
    split = {{"prompt", json(chosen.begin(), chosen.begin() + cut)},
             {"chosen", json(chosen.begin() + cut, chosen.end())},
             {"rejected", json(rejected.begin() + cut, rejected.end())}};
  }
}

std::string_view record_format_name(RecordFormat format) {
  for (const auto& [f, text] : kFormatNames)
    if (f == format) return text;
  return "?";
}

bool is_record_file(const std::string& path) {
  const std::string ext = std::filesystem::path(path).extension().string();
  return ext == ".jsonl" || ext == ".json";
}

RecordDocument encode_record(const json& record, const RecordOptions& options,
                             const Tokenizer& tok) {
  if (!record.is_object()) SHARDLM_FAIL(ErrorKind::kData, "a record must be a JSON object");
  const RecordColumns& c = options.columns;
  const RecordFormat format =
      options.format == RecordFormat::kAuto ? detect_format(record, options) : options.format;
  RecordDocument out;
  out.masked = format != RecordFormat::kText;
  switch (format) {
    case RecordFormat::kText:
      if (const std::string text = string_field(record, c.text, false); !text.empty()) {
        out.doc.tokens = tok.encode(text);
        out.doc.tokens.push_back(tok.eos_id());
      }
      return out;
    case RecordFormat::kMessages: {
      const std::string key = c.messages.empty() ? "messages" : c.messages;
      const std::vector<ChatMessage> messages = parse_messages(find(record, key), key);
      if (!has_assistant(messages))
        SHARDLM_FAIL(ErrorKind::kData, "{} has no assistant message: nothing to train on",
                     key_name(key));
      out.doc = encode_chat(messages, tok);
      return out;
    }
    case RecordFormat::kAlpaca:
      out.doc = encode_chat(alpaca_messages(record, c), tok);
      return out;
    case RecordFormat::kShareGpt:
      out.doc = encode_chat(sharegpt_messages(record, options), tok);
      return out;
    case RecordFormat::kPromptCompletion:
      out.doc = prompt_completion(record, c, tok);
      return out;
    case RecordFormat::kPreference:
      return preference(record, c, tok);
    case RecordFormat::kAuto:
      break;
  }
  SHARDLM_FAIL(ErrorKind::kInternal, "record format {} not handled", int(format));
}

}  // namespace shardlm
