// Chat templates (tokenize.h): which family's template a tokenizer gets, and the rendering of
// a conversation into token ids and its loss mask (plain, Llama-3, ChatML, Qwen3, Gemma, GLM-4),
// each reproducing the published Jinja template's no-tools output; and reading the Jinja template
// stored beside a tokenizer file, used only as a signal.
#include <filesystem>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>

#include "shardlm/core/check.h"
#include "shardlm/io/tokenize.h"

namespace shardlm {
namespace {

void append(DocumentTokens& doc, const std::vector<int32_t>& ids, uint8_t mask) {
  doc.tokens.insert(doc.tokens.end(), ids.begin(), ids.end());
  doc.mask.insert(doc.mask.end(), ids.size(), mask);
}

void push(DocumentTokens& doc, int32_t id, uint8_t mask) {
  doc.tokens.push_back(id);
  doc.mask.push_back(mask);
}

void check_roles(const std::vector<ChatMessage>& messages) {
  for (const ChatMessage& m : messages)
    if (!is_chat_role(m.role))
      SHARDLM_FAIL(ErrorKind::kData,
                   "chat role \"{}\" is not \"system\", \"user\" or \"assistant\"", m.role);
}

// The document ends with the tokenizer's end-of-text, unless its last token is already that
// (an instruct tokenizer's eos is often the end-of-turn marker).
void end_document(DocumentTokens& doc, const Tokenizer& tok) {
  if (doc.tokens.empty() || doc.tokens.back() != tok.eos_id()) push(doc, tok.eos_id(), 0);
}

// The length of the UTF-8 whitespace character (Python's str.isspace, which Jinja's trim
// strips) that starts s[at..], or 0.
size_t space_at(std::string_view s, size_t at) {
  const auto b = [&](size_t i) { return at + i < s.size() ? uint8_t(s[at + i]) : 0; };
  const uint8_t c = b(0);
  if (c == ' ' || (c >= '\t' && c <= '\r') || (c >= 0x1c && c <= 0x1f)) return 1;
  if (c == 0xc2 && (b(1) == 0x85 || b(1) == 0xa0)) return 2;
  if (c == 0xe1 && b(1) == 0x9a && b(2) == 0x80) return 3;  // U+1680
  if (c == 0xe2 && b(1) == 0x80 &&
      (b(2) <= 0x8a || b(2) == 0xa8 || b(2) == 0xa9 || b(2) == 0xaf))  // U+2000-200A, 2028-9, 202F
    return 3;
  if (c == 0xe2 && b(1) == 0x81 && b(2) == 0x9f) return 3;  // U+205F
  if (c == 0xe3 && b(1) == 0x80 && b(2) == 0x80) return 3;  // U+3000
  return 0;
}

// Jinja's trim: Unicode whitespace off both ends.
std::string_view trim(std::string_view s) {
  for (size_t n; !s.empty() && (n = space_at(s, 0)) > 0;) s.remove_prefix(n);
  for (bool cut = true; cut && !s.empty();) {
    cut = false;
    // A whitespace character is at most 3 bytes long: try each start that could end here.
    for (size_t len = 1; len <= std::min<size_t>(3, s.size()); ++len)
      if (space_at(s, s.size() - len) == len) {
        s.remove_suffix(len);
        cut = true;
        break;
      }
  }
  return s;
}

// Python's str.lstrip / rstrip / strip with one character.
std::string_view lstrip(std::string_view s, char c) {
  while (!s.empty() && s.front() == c) s.remove_prefix(1);
  return s;
}
std::string_view rstrip(std::string_view s, char c) {
  while (!s.empty() && s.back() == c) s.remove_suffix(1);
  return s;
}

DocumentTokens render_llama3(const std::vector<ChatMessage>& messages, const Tokenizer& tok,
                             bool generation_prompt) {
  DocumentTokens doc;
  const int32_t bot = tok.special_token("<|begin_of_text|>");
  const int32_t sh = tok.special_token("<|start_header_id|>");
  const int32_t eh = tok.special_token("<|end_header_id|>");
  const int32_t eot = tok.special_token("<|eot_id|>");
  const std::vector<int32_t> blank = tok.encode("\n\n");
  if (bot >= 0) push(doc, bot, 0);
  auto header = [&](const std::string& role) {
    push(doc, sh, 0);
    append(doc, tok.encode(role), 0);
    push(doc, eh, 0);
    append(doc, blank, 0);
  };
  for (const ChatMessage& m : messages) {
    const uint8_t a = m.role == "assistant" ? 1 : 0;
    header(m.role);
    append(doc, tok.encode(trim(m.content)), a);
    push(doc, eot, a);
  }
  if (generation_prompt)
    header("assistant");
  else
    end_document(doc, tok);
  return doc;
}

// An assistant message as Qwen3's template reads it: the reasoning from the message's field,
// else from a "<think>...</think>" block in its content, which then leaves the content.
struct Qwen3Turn {
  std::string_view reasoning, content;
};

Qwen3Turn qwen3_turn(const ChatMessage& m) {
  Qwen3Turn t{{}, m.content};
  if (m.reasoning) {
    t.reasoning = *m.reasoning;
  } else if (const size_t close = t.content.find("</think>"); close != std::string_view::npos) {
    // content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n'), and the
    // content after the last </think>, lstrip('\n').
    std::string_view before = rstrip(t.content.substr(0, close), '\n');
    if (const size_t open = before.rfind("<think>"); open != std::string_view::npos)
      before.remove_prefix(open + std::string_view("<think>").size());
    t.reasoning = lstrip(before, '\n');
    t.content = t.content.substr(t.content.rfind("</think>") + std::string_view("</think>").size());
    t.content = lstrip(t.content, '\n');
  }
  return t;
}

// The index of the last user message (Qwen3's last query), or the last index when none is.
size_t last_query_index(const std::vector<ChatMessage>& messages) {
  for (size_t i = messages.size(); i-- > 0;) {
    const std::string& c = messages[i].content;
    if (messages[i].role == "user" &&
        !(c.starts_with("<tool_response>") && c.ends_with("</tool_response>")))
      return i;
  }
  return messages.size() - 1;
}

// ChatML (qwen3 = false) and Qwen3's variant, which differs in assistant turns only.
DocumentTokens render_chatml(const std::vector<ChatMessage>& messages, const Tokenizer& tok,
                             bool generation_prompt, bool qwen3) {
  DocumentTokens doc;
  const int32_t start = tok.special_token("<|im_start|>");
  const int32_t stop = tok.special_token("<|im_end|>");
  const std::vector<int32_t> newline = tok.encode("\n");
  const size_t last_query = messages.empty() ? 0 : last_query_index(messages);
  for (size_t i = 0; i < messages.size(); ++i) {
    const ChatMessage& m = messages[i];
    const bool assistant = m.role == "assistant";
    push(doc, start, 0);
    append(doc, tok.encode(m.role + "\n"), 0);
    if (assistant && qwen3) {
      // The think block goes on turns after the last query: always on the last message (an
      // empty block without reasoning), on earlier ones when they have reasoning.
      const Qwen3Turn t = qwen3_turn(m);
      const bool think = i > last_query && (i + 1 == messages.size() || !t.reasoning.empty());
      const std::string body = think ? "<think>\n" +
                                           std::string(rstrip(lstrip(t.reasoning, '\n'), '\n')) +
                                           "\n</think>\n\n" + std::string(lstrip(t.content, '\n'))
                                     : std::string(t.content);
      append(doc, tok.encode(body), 1);
    } else {
      append(doc, tok.encode(m.content), assistant ? 1 : 0);
    }
    push(doc, stop, assistant ? 1 : 0);
    append(doc, newline, 0);
  }
  if (generation_prompt) {
    push(doc, start, 0);
    append(doc, tok.encode("assistant\n"), 0);
  } else {
    end_document(doc, tok);
  }
  return doc;
}

// Gemma 2/3: the roles after an optional first system message alternate user, assistant.
DocumentTokens render_gemma(const std::vector<ChatMessage>& messages, const Tokenizer& tok,
                            bool generation_prompt) {
  DocumentTokens doc;
  const int32_t start = tok.special_token("<start_of_turn>");
  const int32_t stop = tok.special_token("<end_of_turn>");
  const std::vector<int32_t> newline = tok.encode("\n");
  if (tok.bos_id() >= 0) push(doc, tok.bos_id(), 0);
  const size_t first = !messages.empty() && messages[0].role == "system" ? 1 : 0;
  for (size_t i = first; i < messages.size(); ++i) {
    const ChatMessage& m = messages[i];
    const char* want = (i - first) % 2 == 0 ? "user" : "assistant";
    if (m.role != want)
      SHARDLM_FAIL(ErrorKind::kData,
                   "Gemma's chat template: messages[{}] is \"{}\" where \"{}\" is due (roles "
                   "alternate user, assistant, ... after an optional first system message)",
                   i, m.role, want);
    push(doc, start, 0);
    if (m.role == "assistant") {
      append(doc, tok.encode("model\n"), 0);
      append(doc, tok.encode(trim(m.content)), 1);
    } else {
      // The system message opens the first user turn, as Gemma 3's template folds it.
      const std::string prefix = i == first && first == 1 ? messages[0].content + "\n\n" : "";
      append(doc, tok.encode(m.role + "\n" + prefix + std::string(trim(m.content))), 0);
    }
    push(doc, stop, m.role == "assistant" ? 1 : 0);
    append(doc, newline, 0);
  }
  if (generation_prompt) {
    push(doc, start, 0);
    append(doc, tok.encode("model\n"), 0);
  } else {
    end_document(doc, tok);
  }
  return doc;
}

// GLM-4 (glm-4-9b-chat's and GLM-4-0414's template, no tools): [gMASK]<sop>, then each message
// with content as its role token and "\n" content, one text piece; no end marker, so the token
// after an assistant turn (the next role token, or the document's eos) is what the model emits
// to end it, and is in the loss.
DocumentTokens render_glm4(const std::vector<ChatMessage>& messages, const Tokenizer& tok,
                           bool generation_prompt) {
  DocumentTokens doc;
  push(doc, tok.special_token("[gMASK]"), 0);
  push(doc, tok.special_token("<sop>"), 0);
  bool after_assistant = false;
  for (const ChatMessage& m : messages) {
    if (m.content.empty()) continue;  // the template's `if item['content']`
    const int32_t role = tok.special_token("<|" + m.role + "|>");
    if (role < 0)
      SHARDLM_FAIL(ErrorKind::kData, "GLM-4's chat template: the tokenizer has no <|{}|> token",
                   m.role);
    push(doc, role, after_assistant ? 1 : 0);
    after_assistant = m.role == "assistant";
    append(doc, tok.encode("\n" + m.content), after_assistant ? 1 : 0);
  }
  if (generation_prompt) {
    push(doc, tok.special_token("<|assistant|>"), 0);
  } else if (doc.tokens.back() != tok.eos_id()) {
    push(doc, tok.eos_id(), after_assistant ? 1 : 0);
  }
  return doc;
}

// The byte tokenizer's template (tokenize.h): role headers as text, the assistant's turn
// ended by <eos>.
DocumentTokens render_plain(const std::vector<ChatMessage>& messages, const Tokenizer& tok,
                            bool generation_prompt) {
  DocumentTokens doc;
  const std::vector<int32_t> newline = tok.encode("\n");
  bool ends_with_eos = false;
  for (const ChatMessage& m : messages) {
    const bool assistant = m.role == "assistant";
    append(doc, tok.encode("<|" + m.role + "|>\n"), 0);
    append(doc, tok.encode(m.content), assistant ? 1 : 0);
    if (assistant) {
      push(doc, tok.eos_id(), 1);
    } else {
      append(doc, newline, 0);
    }
    ends_with_eos = assistant;
  }
  if (generation_prompt) {
    append(doc, tok.encode("<|assistant|>\n"), 0);
  } else if (!ends_with_eos) {
    push(doc, tok.eos_id(), 0);
  }
  return doc;
}

}  // namespace

bool is_chat_role(std::string_view role) {
  return role == "system" || role == "user" || role == "assistant";
}

ChatTemplate chat_template_for(const Tokenizer& tok) {
  if (tok.special_token("[gMASK]") >= 0 && tok.special_token("<sop>") >= 0 &&
      tok.special_token("<|system|>") >= 0 && tok.special_token("<|user|>") >= 0 &&
      tok.special_token("<|assistant|>") >= 0)
    return ChatTemplate::kGlm4;
  if (tok.special_token("<start_of_turn>") >= 0 && tok.special_token("<end_of_turn>") >= 0)
    return ChatTemplate::kGemma;
  if (tok.special_token("<|start_header_id|>") >= 0 &&
      tok.special_token("<|end_header_id|>") >= 0 && tok.special_token("<|eot_id|>") >= 0)
    return ChatTemplate::kLlama3;
  if (tok.special_token("<|im_start|>") >= 0 && tok.special_token("<|im_end|>") >= 0) {
    // Qwen3's template is the one that reads reasoning_content; a tokenizer without a
    // template beside it is told by Qwen3's think tokens.
    const std::string_view jinja = tok.chat_template();
    const bool qwen3 = jinja.empty()
                           ? tok.special_token("<think>") >= 0 && tok.special_token("</think>") >= 0
                           : jinja.find("reasoning_content") != std::string_view::npos;
    return qwen3 ? ChatTemplate::kQwen3 : ChatTemplate::kChatml;
  }
  return ChatTemplate::kPlain;
}

DocumentTokens encode_chat(const std::vector<ChatMessage>& messages, const Tokenizer& tok,
                           bool generation_prompt) {
  check_roles(messages);
  switch (chat_template_for(tok)) {
    case ChatTemplate::kLlama3:
      return render_llama3(messages, tok, generation_prompt);
    case ChatTemplate::kChatml:
      return render_chatml(messages, tok, generation_prompt, false);
    case ChatTemplate::kQwen3:
      return render_chatml(messages, tok, generation_prompt, true);
    case ChatTemplate::kGemma:
      return render_gemma(messages, tok, generation_prompt);
    case ChatTemplate::kGlm4:
      return render_glm4(messages, tok, generation_prompt);
    case ChatTemplate::kPlain:
      break;
  }
  return render_plain(messages, tok, generation_prompt);
}

int32_t chat_end_of_turn(const Tokenizer& tok) {
  switch (chat_template_for(tok)) {
    case ChatTemplate::kLlama3:
      return tok.special_token("<|eot_id|>");
    case ChatTemplate::kChatml:
    case ChatTemplate::kQwen3:
      return tok.special_token("<|im_end|>");
    case ChatTemplate::kGemma:
      return tok.special_token("<end_of_turn>");
    case ChatTemplate::kGlm4:  // its turn ends where the user's begins
      return tok.special_token("<|user|>");
    case ChatTemplate::kPlain:
      break;
  }
  return tok.eos_id();
}

std::string chat_template_beside(const std::string& tokenizer_file) {
  namespace fs = std::filesystem;
  using json = nlohmann::json;
  const fs::path dir = fs::path(tokenizer_file).parent_path();
  std::ifstream cfg_file(dir / "tokenizer_config.json");
  if (cfg_file) {
    // An unreadable config is the tokenizer loader's error to report, not this signal's.
    const json cfg = json::parse(cfg_file, nullptr, /*allow_exceptions=*/false);
    const json tmpl = cfg.is_object() ? cfg.value("chat_template", json()) : json();
    if (tmpl.is_string()) return tmpl.get<std::string>();
    if (tmpl.is_array())
      for (const json& t : tmpl)
        if (t.is_object() && t.value("name", json()) == "default" &&
            t.value("template", json()).is_string())
          return t["template"].get<std::string>();
  }
  std::ifstream jinja(dir / "chat_template.jinja", std::ios::binary);
  if (!jinja) return "";
  return {std::istreambuf_iterator<char>(jinja), std::istreambuf_iterator<char>()};
}

}  // namespace shardlm
