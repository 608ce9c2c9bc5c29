// Qwen3's and Gemma's chat templates (io/chat_template.cpp) against transformers'
// apply_chat_template with the published Jinja templates (chat_reference.py; their no-tools
// paths): the same token ids for conversations with a system message, several turns,
// reasoning (a field, a <think> block in content, none), a conversation ending on the user,
// and generation prompts; the loss mask equal to the assistant spans the reference finds in
// its own ids. Tokenizers are small ones trained by the reference scripts: a Qwen3-style
// tokenizer.json (Qwen2's pipeline, Qwen3's added tokens) and a Gemma-style SentencePiece
// model. Without the venv the comparisons skip.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "shardlm/core/check.h"
#include "shardlm/io/bpe.h"
#include "shardlm/io/sentencepiece.h"
#include "shardlm/io/shards.h"
#include "shardlm/io/tokenize.h"
#include "test_util.h"
#include "tokenizer_reference.h"

namespace shardlm {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

std::string script(const std::string& name) {
  return std::string(SHARDLM_SOURCE_DIR) + "/tests/unit/" + name;
}

struct Case {
  std::vector<ChatMessage> messages;
  bool generation_prompt = false;
};

json to_json(const std::vector<Case>& cases) {
  json out = json::array();
  for (const Case& c : cases) {
    json messages = json::array();
    for (const ChatMessage& m : c.messages) {
      json j = {{"role", m.role}, {"content", m.content}};
      if (m.reasoning) j["reasoning_content"] = *m.reasoning;
      messages.push_back(j);
    }
    out.push_back({{"messages", messages}, {"generation_prompt", c.generation_prompt}});
  }
  return out;
}

// The reference's {"ids", "mask"} for each case.
json reference(const std::string& python, const std::string& family, const fs::path& dir,
               const std::vector<Case>& cases) {
  std::ofstream(dir / "cases.json") << to_json(cases).dump();
  return json::parse(test::run_command(python + " " + script("chat_reference.py") + " render " +
                                           family + " " + dir.string() + " " +
                                           (dir / "cases.json").string(),
                                       dir / "rendered.json"));
}

// encode_chat gives the reference's ids and assistant mask; a training document adds the
// tokenizer's eos (mask 0) at its end; a generation prompt's final header (from the last
// `turn_start` on, which the reference counts as the open assistant turn) is all 0s.
void expect_reference(const std::vector<Case>& cases, const json& ref, const Tokenizer& tok,
                      const std::string& turn_start) {
  ASSERT_EQ(ref.size(), cases.size());
  for (size_t k = 0; k < cases.size(); ++k) {
    SCOPED_TRACE("case " + std::to_string(k));
    const DocumentTokens doc = encode_chat(cases[k].messages, tok, cases[k].generation_prompt);
    ASSERT_EQ(doc.tokens.size(), doc.mask.size());
    std::vector<int32_t> ids = ref[k]["ids"].get<std::vector<int32_t>>();
    std::vector<uint8_t> mask = ref[k]["mask"].get<std::vector<uint8_t>>();
    if (cases[k].generation_prompt) {
      const auto last = std::find(ids.rbegin(), ids.rend(), tok.special_token(turn_start));
      ASSERT_NE(last, ids.rend());
      std::fill(mask.end() - (last - ids.rbegin() + 1), mask.end(), 0);
    } else {
      ids.push_back(tok.eos_id());
      mask.push_back(0);
    }
    EXPECT_EQ(doc.tokens, ids) << tok.decode(doc.tokens) << "\nvs\n" << tok.decode(ids);
    EXPECT_EQ(doc.mask, mask) << tok.decode(doc.tokens);
  }
}

const ChatMessage kSystem = {"system", "You are terse."};
ChatMessage user(const std::string& s) { return {"user", s}; }
ChatMessage assistant(const std::string& s, std::optional<std::string> r = std::nullopt) {
  return {"assistant", s, std::move(r)};
}

std::vector<Case> qwen3_cases() {
  return {
      // History turns lose their reasoning; the last keeps it (newlines around it stripped).
      {{kSystem, user("What's 2+2? 日本語 ok"), assistant("Four.", "2+2 is 4.\n"),
        user("And Straße?\n"), assistant("Eine Straße 😀", "\nGerman street.")}},
      // No reasoning: the last turn gets the empty think block (non-thinking mode).
      {{user("Hi"), assistant("Hello there")}},
      // Reasoning written into the content, with and without the opening <think>.
      {{user("Sum?"), assistant("<think>\nadd them\n</think>\n\n  Three"), user("Again?"),
        assistant("plan</think>\nThree again")}},
      // Ending on the user: every assistant turn is history.
      {{kSystem, user("Q1"), assistant("A1", "r1"), user("Q2")}},
      // Two turns after the last query: reasoning kept where present, the last always.
      {{user("Go"), assistant("step", "think first"), assistant("done")}},
      // An empty reasoning field keeps the content as written.
      {{user("x"), assistant("<think>kept</think>y", "")}},
      // A later system message, and generation prompts.
      {{user("a"), {"system", "mid"}, user("b")}, true},
      {{kSystem, user("Hi"), assistant("Hey", "greet"), user("Bye")}, true},
  };
}

TEST(ChatTemplate, Qwen3MatchesTheJinjaRendering) {
  const std::string python = test::venv_python("transformers");
  if (python.empty()) SHARDLM_MISSING_REFERENCE(test::venv_skip_reason("transformers"));
  const fs::path dir =
      test::reference_tokenizer_dir(python, script("bpe_reference.py"), "chat_qwen3", "qwen3");
  const std::vector<Case> cases = qwen3_cases();
  const json ref = reference(python, "qwen3", dir, cases);
  // Told by the think tokens alone, then by the template beside the tokenizer.json.
  for (const bool with_config : {false, true}) {
    SCOPED_TRACE(with_config ? "tokenizer_config.json" : "tokens");
    if (with_config)
      test::run_command(
          python + " " + script("chat_reference.py") + " config qwen3 " + dir.string(),
          dir / "config.txt");
    const auto tok = BpeTokenizer::from_file((dir / "tokenizer.json").string());
    ASSERT_EQ(chat_template_for(*tok), ChatTemplate::kQwen3);
    EXPECT_EQ(!tok->chat_template().empty(), with_config);
    expect_reference(cases, ref, *tok, "<|im_start|>");
    EXPECT_EQ(chat_end_of_turn(*tok), tok->special_token("<|im_end|>"));
  }
  // A ChatML template beside the same tokens (Qwen2.5, Qwen3's instruct-only releases)
  // keeps plain ChatML.
  std::ofstream(dir / "tokenizer_config.json")
      << json{{"chat_template", "{% for m in messages %}<|im_start|>...{% endfor %}"}}.dump();
  EXPECT_EQ(chat_template_for(*BpeTokenizer::from_file((dir / "tokenizer.json").string())),
            ChatTemplate::kChatml);
  fs::remove(dir / "tokenizer_config.json");
  // A JSONL chat with "thinking" (reasoning_content's other name) is the same document.
  const auto tok = BpeTokenizer::from_file((dir / "tokenizer.json").string());
  std::ofstream(dir / "chat.jsonl")
      << R"({"messages": [{"role": "system", "content": "You are terse."}, )"
         R"({"role": "user", "content": "Q1"}, {"role": "assistant", "content": "A1", )"
         R"("thinking": "r1"}, {"role": "user", "content": "Q2"}, )"
         R"({"role": "assistant", "content": "A2", "thinking": "r2"}]})"
      << "\n";
  std::ostringstream log;
  tokenize_files({(dir / "chat.jsonl").string()}, (dir / "corpus").string(), *tok, log);
  const TokenCorpus corpus((dir / "corpus").string());
  const int64_t n = corpus.info().n_tokens;
  DocumentTokens got;
  got.tokens.resize(size_t(n));
  got.mask.resize(size_t(n));
  corpus.read(0, n, got.tokens.data(), got.mask.data());
  const DocumentTokens want = encode_chat(
      {kSystem, user("Q1"), assistant("A1", "r1"), user("Q2"), assistant("A2", "r2")}, *tok);
  EXPECT_EQ(got.tokens, want.tokens);
  EXPECT_EQ(got.mask, want.mask);
  EXPECT_NE(tok->decode(got.tokens).find("<think>\nr2\n</think>\n\nA2"), std::string::npos);
  EXPECT_EQ(tok->decode(got.tokens).find("r1"), std::string::npos);
}

// GLM-4: a system message, several turns, an empty message (left out), two assistant turns in
// a row, a conversation ending on the user, generation prompts; the rendering is one text piece
// per message, so the ids are the joint string's.
std::vector<Case> glm4_cases() {
  return {
      {{kSystem, user("What's 2+2? 日本語 ok"), assistant("Four."), user("And Straße?\n"),
        assistant("Eine Straße 😀")}},
      {{user("Hi"), assistant("  Hello there  ")}},
      {{user("Go"), assistant("step"), assistant("done")}},
      {{kSystem, user("Q1"), assistant(""), user("Q2")}},
      {{user("a"), {"system", "mid"}, user("b")}, true},
      {{kSystem, user("Hi"), assistant("Hey"), user("Bye")}, true},
  };
}

TEST(ChatTemplate, Glm4MatchesTheJinjaRendering) {
  const std::string python = test::venv_python("transformers");
  if (python.empty()) SHARDLM_MISSING_REFERENCE(test::venv_skip_reason("transformers"));
  const fs::path dir =
      test::reference_tokenizer_dir(python, script("bpe_reference.py"), "chat_glm4", "glm4");
  const std::vector<Case> cases = glm4_cases();
  const json ref = reference(python, "glm4", dir, cases);
  const auto tok = BpeTokenizer::from_file((dir / "tokenizer.json").string());
  ASSERT_EQ(chat_template_for(*tok), ChatTemplate::kGlm4);
  EXPECT_EQ(chat_end_of_turn(*tok), tok->special_token("<|user|>"));
  ASSERT_EQ(ref.size(), cases.size());
  for (size_t k = 0; k < cases.size(); ++k) {
    SCOPED_TRACE("case " + std::to_string(k));
    const DocumentTokens doc = encode_chat(cases[k].messages, *tok, cases[k].generation_prompt);
    std::vector<int32_t> ids = ref[k]["ids"].get<std::vector<int32_t>>();
    std::vector<uint8_t> mask = ref[k]["mask"].get<std::vector<uint8_t>>();
    if (cases[k].generation_prompt) {  // the prompt's <|assistant|> opens no trained turn
      mask.back() = 0;
    } else {  // the document's eos ends the last turn: in the loss after the assistant's
      const bool assistant_last = !mask.empty() && mask.back() == 1;
      ids.push_back(tok->eos_id());
      mask.push_back(assistant_last ? 1 : 0);
    }
    EXPECT_EQ(doc.tokens, ids) << tok->decode(doc.tokens) << "\nvs\n" << tok->decode(ids);
    EXPECT_EQ(doc.mask, mask) << tok->decode(doc.tokens);
  }
}

// `shardlm generate --chat` samples after the template's generation prompt: greedy, its
// reply continues the same ids as a plain prompt holding the rendered text, and the prompt is
// not echoed.
TEST(ChatTemplate, GenerateChatSamplesAfterTheGenerationPrompt) {
  const std::string python = test::venv_python("tokenizers");
  if (python.empty()) SHARDLM_MISSING_REFERENCE(test::venv_skip_reason("tokenizers"));
  const fs::path dir =
      test::reference_tokenizer_dir(python, script("bpe_reference.py"), "chat_generate", "qwen3");
  const fs::path tokfile = dir / "tokenizer.json";
  std::ofstream(dir / "train.json") << json{
      {"data",
       {{"train", std::string(SHARDLM_SOURCE_DIR) + "/tests/data/genesis_1_12.txt"},
        {"seq_len", 32},
        {"tokenizer", tokfile.string()}}},
      {"model", {{"n_layers", 1}, {"vocab_size", 768}}},
      {"train", {{"micro_batch", 2}, {"max_steps", 2}, {"eval_every", 0}, {"eval_batches", 1}}},
      {"log", {{"dir", (dir / "run").string()}}}};
  test::run_command(
      std::string(SHARDLM_BINARY) + " train --config " + (dir / "train.json").string(),
      dir / "train.txt");
  const std::string rendered =
      "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi "
      "there<|im_end|>\n<|im_start|>assistant\n";
  const auto tok = BpeTokenizer::from_file(tokfile.string());
  ASSERT_EQ(tok->encode(rendered),
            encode_chat({{"system", "Be brief."}, user("Hi there")}, *tok, true).tokens);
  const std::string generate = std::string(SHARDLM_BINARY) + " generate --checkpoint " +
                               (dir / "run/checkpoints").string() +
                               " --temperature 0 --max-new-tokens 6 ";
  std::ofstream(dir / "prompt.txt") << rendered;
  // The shell keeps the prompt's final newline through the x it strips.
  const std::string plain =
      test::run_command("p=\"$(cat " + (dir / "prompt.txt").string() + "; printf x)\"; " +
                            generate + "--prompt \"${p%x}\"",
                        dir / "plain.txt");
  const std::string reply = test::run_command(
      generate + "--chat --system 'Be brief.' --prompt 'Hi there'", dir / "reply.txt");
  ASSERT_TRUE(reply.ends_with("\n"));
  EXPECT_GT(reply.size(), 1u) << "an empty reply compares nothing";
  EXPECT_EQ(reply.find("<|im_start|>"), std::string::npos) << reply;
  EXPECT_TRUE(plain.starts_with(rendered + reply.substr(0, reply.size() - 1))) << plain << "\nvs\n"
                                                                               << reply;
  // --system without --chat is refused, naming the flag.
  const fs::path err = dir / "system_error.txt";
  EXPECT_NE(std::system((generate + "--prompt x --system y > " + err.string() + " 2>&1").c_str()),
            0);
  EXPECT_NE(test::slurp(err).find("add --chat"), std::string::npos) << test::slurp(err);
}

std::vector<Case> gemma_cases() {
  return {
      {{kSystem, user("What's 2+2? 日本語 ok"), assistant(" Four.  "), user("And Straße?\n"),
        assistant("Eine Straße 😀\u3000")}},
      {{user("Hi"), assistant("Hello there")}},
      {{user("\u00a0 padded \t"), assistant("\nreply\n"), user("unanswered")}},
      {{kSystem, user("Hi")}, true},
      {{user("Hi"), assistant("Hey"), user("Bye")}, true},
  };
}

TEST(ChatTemplate, GemmaMatchesTheJinjaRendering) {
  const std::string python = test::venv_python("transformers");
  if (python.empty()) SHARDLM_MISSING_REFERENCE(test::venv_skip_reason("transformers"));
  if (test::venv_python("sentencepiece").empty())
    SHARDLM_MISSING_REFERENCE(test::venv_skip_reason("sentencepiece"));
  const fs::path dir = test::reference_tokenizer_dir(python, script("sentencepiece_reference.py"),
                                                     "chat_gemma", "gemma");
  const std::vector<Case> cases = gemma_cases();
  const json ref = reference(python, "gemma", dir, cases);
  // The reference saved its tokenizer.json (BPE with byte fallback) beside tokenizer.model:
  // the directory loads the SentencePiece model, which gets Gemma's template.
  ASSERT_TRUE(fs::exists(dir / "tokenizer.json"));
  const std::unique_ptr<Tokenizer> tok = load_tokenizer(dir.string());
  ASSERT_NE(dynamic_cast<const SentencePieceTokenizer*>(tok.get()), nullptr) << tok->name();
  ASSERT_EQ(chat_template_for(*tok), ChatTemplate::kGemma);
  EXPECT_EQ(tok->bos_id(), 2);
  EXPECT_EQ(tok->eos_id(), 1);
  expect_reference(cases, ref, *tok, "<start_of_turn>");
  EXPECT_EQ(chat_end_of_turn(*tok), tok->special_token("<end_of_turn>"));
  // Roles that do not alternate are the template's error, naming the message.
  try {
    encode_chat({kSystem, user("a"), user("b")}, *tok);
    ADD_FAILURE() << "no error for two user turns in a row";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kData);
    EXPECT_NE(std::string(e.what()).find("messages[2] is \"user\""), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace shardlm
