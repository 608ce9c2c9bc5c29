// Preference records (records.h "preference") and their pairs in whole-sample packing: TRL's
// completion mask on both sequences, a pair as one item whose two documents share a row, the
// overlong rules, bad records naming their field, and TRL's implicit-prompt records (against
// trl.data_utils.extract_prompt in the reference venv).
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "shardlm/core/check.h"
#include "shardlm/io/tokenize.h"
#include "shardlm/train/data.h"
#include "test_util.h"

namespace shardlm {
namespace {

using json = nlohmann::json;
namespace fs = std::filesystem;

RecordOptions preference_options() {
  RecordOptions o;
  o.format = RecordFormat::kPreference;
  return o;
}

TEST(PreferenceRecords, TextPairGetsTrlCompletionMask) {
  const auto tok = load_tokenizer("");
  const RecordDocument r = encode_record(
      json{{"prompt", "Q:"}, {"chosen", " yes"}, {"rejected", " no"}}, RecordOptions{}, *tok);
  ASSERT_TRUE(r.rejected.has_value());
  // prompt + completion, then eos; mask 0 on the prompt's 2 bytes, 1 after
  EXPECT_EQ(r.doc.tokens, (std::vector<int32_t>{'Q', ':', ' ', 'y', 'e', 's', tok->eos_id()}));
  EXPECT_EQ(r.doc.mask, (std::vector<uint8_t>{0, 0, 1, 1, 1, 1, 1}));
  EXPECT_EQ(r.rejected->tokens, (std::vector<int32_t>{'Q', ':', ' ', 'n', 'o', tok->eos_id()}));
  EXPECT_EQ(r.rejected->mask, (std::vector<uint8_t>{0, 0, 1, 1, 1, 1}));
}

TEST(PreferenceRecords, ConversationalPairEndsWhereTheTemplateEnds) {
  const auto tok = load_tokenizer("");
  const json prompt = json::array({{{"role", "user"}, {"content", "Hi"}}});
  const RecordDocument r =
      encode_record(json{{"prompt", prompt},
                         {"chosen", json::array({{{"role", "assistant"}, {"content", "Hey"}}})},
                         {"rejected", json::array({{{"role", "assistant"}, {"content", "No"}}})}},
                    preference_options(), *tok);
  const std::vector<int32_t> p = encode_chat({{"user", "Hi"}}, *tok, true).tokens;
  ASSERT_TRUE(r.rejected.has_value());
  ASSERT_GT(r.doc.tokens.size(), p.size());
  EXPECT_TRUE(std::equal(p.begin(), p.end(), r.doc.tokens.begin()));
  for (size_t i = 0; i < r.doc.mask.size(); ++i) EXPECT_EQ(r.doc.mask[i], i >= p.size() ? 1 : 0);
}

TEST(PreferenceRecords, BadRecordsNameTheirField) {
  const auto tok = load_tokenizer("");
  const RecordOptions o = preference_options();
  auto what = [&](const json& record) {
    try {
      encode_record(record, o, *tok);
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kData);
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_NE(what(json{{"prompt", "a"}, {"chosen", ""}, {"rejected", "b"}}).find("\"chosen\""),
            std::string::npos);
  EXPECT_NE(what(json{{"chosen", "a"}, {"rejected", "b"}}).find("share no start"),
            std::string::npos);
  EXPECT_NE(what(json{{"chosen", "a"}, {"rejected", json::array()}}).find("must both be strings"),
            std::string::npos);
  EXPECT_NE(what(json{{"chosen", ""}, {"rejected", "b"}}).find("is empty"), std::string::npos);
  EXPECT_NE(what(json{{"chosen", "ab"}}).find("\"rejected\""), std::string::npos);
  EXPECT_NE(what(json{{"prompt", json::array({{{"role", "user"}, {"content", "x"}}})},
                      {"chosen", "a"},
                      {"rejected", "b"}})
                .find("must all be strings"),
            std::string::npos);
}

json user(const std::string& text) { return {{"role", "user"}, {"content", text}}; }
json assistant(const std::string& text) { return {{"role", "assistant"}, {"content", text}}; }

// TRL's implicit-prompt records: the shared start is the prompt, and the record reads as the
// same record with it given.
TEST(PreferenceRecords, ImplicitPromptIsTheSharedStart) {
  const auto tok = load_tokenizer("");
  json split;
  extract_implicit_prompt("Q: sky? It is blue.", "Q: sky? It is green.", split);
  EXPECT_EQ(split,
            (json{{"prompt", "Q: sky? It is"}, {"chosen", " blue."}, {"rejected", " green."}}));
  // Python's str indexes code points: é and è share their first UTF-8 byte, not a character.
  extract_implicit_prompt("Le café", "Le cafè", split);
  EXPECT_EQ(split["prompt"], "Le caf");
  EXPECT_EQ(split["chosen"], "é");
  const json q = json::array({user("Hi")});
  extract_implicit_prompt(json::array({user("Hi"), assistant("Hey")}),
                          json::array({user("Hi"), assistant("No")}), split);
  EXPECT_EQ(split["prompt"], q);
  EXPECT_EQ(split["rejected"], json::array({assistant("No")}));

  const RecordOptions o = preference_options();
  const RecordDocument implicit = encode_record(
      json{{"chosen", "Q: sky? It is blue."}, {"rejected", "Q: sky? It is green."}}, o, *tok);
  const RecordDocument given = encode_record(
      json{{"prompt", "Q: sky? It is"}, {"chosen", " blue."}, {"rejected", " green."}}, o, *tok);
  EXPECT_EQ(implicit.doc.tokens, given.doc.tokens);
  EXPECT_EQ(implicit.doc.mask, given.doc.mask);
  ASSERT_TRUE(implicit.rejected && given.rejected);
  EXPECT_EQ(implicit.rejected->mask, given.rejected->mask);
  const RecordDocument chat =
      encode_record(json{{"chosen", json::array({user("Hi"), assistant("Hey")})},
                         {"rejected", json::array({user("Hi"), assistant("No")})}},
                    RecordOptions{}, *tok);  // auto: chosen + rejected is the preference format
  const RecordDocument chat_given =
      encode_record(json{{"prompt", q},
                         {"chosen", json::array({assistant("Hey")})},
                         {"rejected", json::array({assistant("No")})}},
                    o, *tok);
  EXPECT_EQ(chat.doc.tokens, chat_given.doc.tokens);
  EXPECT_EQ(chat.doc.mask, chat_given.doc.mask);
}

// extract_implicit_prompt against TRL's extract_prompt in the reference venv: text with and
// without a space before the difference, one completion a prefix of the other or equal to it,
// multi-byte characters, and message lists likewise.
TEST(PreferenceRecords, ImplicitPromptMatchesTrlExtractPrompt) {
  const std::string python = test::venv_python("trl");
  if (python.empty()) SHARDLM_MISSING_REFERENCE(test::venv_skip_reason("trl"));
  const json a = assistant("It is blue."), b = assistant("It is green.");
  const json cases = json::array({
      {{"chosen", "Q: sky? It is blue."}, {"rejected", "Q: sky? It is green."}},
      {{"chosen", "abcX"}, {"rejected", "abcY"}},
      {{"chosen", "x  yes"}, {"rejected", "x  no"}},
      {{"chosen", "Hello there"}, {"rejected", "Hello there, friend"}},
      {{"chosen", "same text"}, {"rejected", "same text"}},
      {{"chosen", "Le café noir"}, {"rejected", "Le cafè noir"}},
      {{"chosen", "日本語の答え"}, {"rejected", "日本語で答え"}},
      {{"chosen", "emoji 😀 ok"}, {"rejected", "emoji 😃 ok"}},
      {{"chosen", json::array({user("Sky?"), a})}, {"rejected", json::array({user("Sky?"), b})}},
      {{"chosen", json::array({user("1"), assistant("2"), user("3"), a})},
       {"rejected", json::array({user("1"), assistant("2"), user("3"), b})}},
      {{"chosen", json::array({user("Sky?"), a})}, {"rejected", json::array({user("Sky?"), a})}},
      {{"chosen", json::array({user("Sky?"), a})},
       {"rejected", json::array({user("Sky?"), a, user("Sure?"), b})}},
  });
  const fs::path dir = test::scratch_root() / "extract_prompt";
  fs::create_directories(dir);
  std::ofstream(dir / "cases.json") << cases.dump();
  const std::string out = test::run_command(python + " " + std::string(SHARDLM_SOURCE_DIR) +
                                                "/tests/unit/extract_prompt_reference.py " +
                                                (dir / "cases.json").string(),
                                            dir / "out.txt");
  const json ref = json::parse(out.substr(out.find('[')));
  ASSERT_EQ(ref.size(), cases.size());
  for (size_t i = 0; i < cases.size(); ++i) {
    json split;
    extract_implicit_prompt(cases[i]["chosen"], cases[i]["rejected"], split);
    EXPECT_EQ(split, ref[i]) << "case " << i << ": " << cases[i].dump();
  }
}

// Pairs of documents (3 + 4, 5 + 2, 6 + 6 tokens) packed whole: each pair in one window, chosen
// first, the overlong pair cut to the largest common length that fits.
TEST(PreferencePacking, PairsStayWholeInOneRow) {
  std::vector<int32_t> tokens;
  std::vector<int64_t> docs;
  for (int64_t n : {3, 4, 5, 2, 6, 6}) {
    docs.push_back(int64_t(tokens.size()));
    for (int64_t i = 0; i < n; ++i) tokens.push_back(int32_t(10 + i));
  }
  std::vector<uint8_t> mask(tokens.size(), 1);
  const auto src = make_memory_source(tokens, docs, "pairs", mask, /*paired=*/true);
  Dataset data(src, 8, 1, 0, -1, {Packing::kSamples, Overlong::kTruncate});
  EXPECT_EQ(data.packing_stats().samples, 3);
  EXPECT_EQ(data.packing_stats().truncated, 1);  // 6 + 6 > 8: both cut to 4
  std::vector<std::vector<int64_t>> rows;
  for (int64_t w = 0; w < data.num_windows(); ++w) rows.push_back(data.window_documents(w));
  EXPECT_EQ(rows, (std::vector<std::vector<int64_t>>{{4, 4}, {3, 4}, {5, 2}}));
  EXPECT_THROW(Dataset(src, 8, 1, 0, -1, {Packing::kSamples, Overlong::kError}), Error);
  EXPECT_THROW(Dataset(src, 8, 1, 0, -1, {Packing::kStream, Overlong::kError}), Error);
}

// A pair with an empty sequence is refused, naming the pair and the sequence: every sequence
// takes a token of its row, the bound of B * T sequences a micro-batch can hold that the
// preference step's buffers are sized by (plan/preference_step.h).
TEST(PreferencePacking, EmptySequenceIsADataError) {
  const std::vector<int32_t> tokens = {10, 11, 12, 13, 14};
  const std::vector<int64_t> docs = {0, 2, 4, 4};  // pair 1's chosen is empty
  const auto src = make_memory_source(tokens, docs, "pairs", std::vector<uint8_t>(5, 1),
                                      /*paired=*/true);
  try {
    Dataset data(src, 8, 1, 0, -1, {Packing::kSamples, Overlong::kTruncate});
    FAIL() << "an empty sequence was packed";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kData);
    EXPECT_NE(std::string(e.what()).find("preference pair 1 has an empty chosen sequence"),
              std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace shardlm
