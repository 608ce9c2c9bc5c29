// Preference records (records.h "preference") and their pairs in whole-sample packing: TRL's
// completion mask on both sequences, a pair as one item whose two documents share a row, the
// overlong rules, and bad records naming their field.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "shardlm/core/check.h"
#include "shardlm/io/tokenize.h"
#include "shardlm/train/data.h"

namespace shardlm {
namespace {

using json = nlohmann::json;

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
  EXPECT_NE(what(json{{"chosen", "a"}, {"rejected", "b"}}).find("\"prompt\" is missing"),
            std::string::npos);
  EXPECT_NE(what(json{{"prompt", json::array({{{"role", "user"}, {"content", "x"}}})},
                      {"chosen", "a"},
                      {"rejected", "b"}})
                .find("must all be strings"),
            std::string::npos);
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

}  // namespace
}  // namespace shardlm
