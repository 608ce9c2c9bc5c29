// Full fine-tuning DPO's reference table (src/train/preference_reference.h): its layout over a
// paired data set's windows, the data key's sensitivity to one token, and dpo_reference.json:
// sums round-tripped exactly, another key named by the part that differs, a damaged file a data
// error naming it.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <numeric>

#include "shardlm/core/check.h"
#include "shardlm/plan/plan.h"
#include "test_util.h"
#include "train/preference_reference.h"

namespace shardlm::trainer_detail {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

// Three pairs of (chosen, rejected) lengths 3 + 4, 5 + 2, 6 + 6, token t at position t; the loss
// mask on all but each document's first two tokens.
std::shared_ptr<TokenSource> pairs(int32_t changed = -1) {
  std::vector<int32_t> tokens;
  std::vector<int64_t> docs;
  std::vector<uint8_t> mask;
  for (int64_t len : {3, 4, 5, 2, 6, 6}) {
    docs.push_back(int64_t(tokens.size()));
    for (int64_t i = 0; i < len; ++i) {
      tokens.push_back(int32_t(tokens.size()) == changed ? 99 : int32_t(10 + tokens.size()));
      mask.push_back(i >= 2 ? 1 : 0);
    }
  }
  return make_memory_source(tokens, docs, "pairs", mask, /*paired=*/true);
}

Dataset dataset(int32_t changed = -1) {
  return Dataset(pairs(changed), 12, 1, 0, -1, {Packing::kSamples, Overlong::kError});
}

TEST(DpoReferenceTable, OnePlacePerPairWindowByWindow) {
  const Dataset data = dataset();
  const ReferenceTable t = reference_layout(data);
  EXPECT_EQ(t.pairs(), 3);
  ASSERT_EQ(int64_t(t.window_first.size()), data.num_windows() + 1);
  for (int64_t w = 0; w < data.num_windows(); ++w)
    EXPECT_EQ(t.window_first[size_t(w + 1)] - t.window_first[size_t(w)],
              int64_t(data.window_documents(w).size()) / 2);
  // What the run charges the ledger for the table (its containers' capacities, the key's
  // one-window scratch among them) is what the plan counts for it.
  EXPECT_EQ(t.key_rows.size(), size_t(5 * data.seq_len() + 1));
  const size_t held = t.window_first.capacity() * sizeof(int64_t) +
                      (t.chosen.capacity() + t.rejected.capacity()) * sizeof(double) +
                      t.key_rows.capacity() * sizeof(int32_t);
  EXPECT_EQ(int64_t(held),
            reference_table_host_bytes(data.num_windows(), t.pairs(), data.seq_len()));
}

// The data key of `data`, its windows read in order (the order the caller holds).
json data_key(Dataset& data) {
  std::vector<int64_t> order(size_t(data.num_windows()));
  std::iota(order.begin(), order.end(), int64_t{0});
  ReferenceTable t = reference_layout(data);
  return reference_data_key(data, order, t.key_rows);
}

TEST(DpoReferenceTable, DataKeyFollowsEveryToken) {
  Dataset a = dataset(), b = dataset(), c = dataset(/*changed=*/17);
  EXPECT_EQ(data_key(a), data_key(b));
  EXPECT_NE(data_key(a)["crc32"], data_key(c)["crc32"]);
  Dataset longer(pairs(), 16, 1, 0, -1, {Packing::kSamples, Overlong::kError});
  EXPECT_NE(data_key(a), data_key(longer));  // seq_len, windows
}

// The pass and its key read the windows in order, from a buffer the caller holds: any other
// order (or one of another set) is refused rather than keying another pass.
TEST(DpoReferenceTable, DataKeyNeedsTheWindowsInOrder) {
  Dataset a = dataset();
  ASSERT_GT(a.num_windows(), 1);
  std::vector<int64_t> order(size_t(a.num_windows()));
  std::iota(order.rbegin(), order.rend(), int64_t{0});
  ReferenceTable t = reference_layout(a);
  EXPECT_THROW(reference_data_key(a, order, t.key_rows), Error);
  order.pop_back();
  EXPECT_THROW(reference_data_key(a, order, t.key_rows), Error);
  // A window's rows too short for one window of inputs are refused, not overrun.
  std::iota(order.begin(), order.end(), int64_t{0});
  order.push_back(int64_t(order.size()));
  std::vector<int32_t> short_rows(size_t(5 * a.seq_len()));
  EXPECT_THROW(reference_data_key(a, order, short_rows), Error);
}

TEST(DpoReferenceTable, FileRoundTripsAndNamesWhatDiffers) {
  const fs::path dir = test::scratch_root() / "dpo_reference_file";
  fs::create_directories(dir);
  const fs::path path = reference_file(dir);
  Dataset data = dataset();
  ReferenceTable t = reference_layout(data);
  t.chosen = {-1.0 / 3, -12.345678901234567, -1e-300};
  t.rejected = {-2.0 / 7, -0.1, -123456.789};
  const json key = {{"objective", "dpo"}, {"data", data_key(data)}, {"model", {{"x", 1}}}};
  std::string why;
  EXPECT_FALSE(read_reference(path, key, t, why));
  EXPECT_EQ(why, "there is none yet");
  write_reference(path, key, t);
  const std::optional<ReferenceTable> back = read_reference(path, key, reference_layout(data), why);
  ASSERT_TRUE(back);
  EXPECT_EQ(back->chosen, t.chosen);  // bit for bit
  EXPECT_EQ(back->rejected, t.rejected);

  json other = key;
  other["model"]["x"] = 2;
  EXPECT_FALSE(read_reference(path, other, t, why));
  EXPECT_NE(why.find("its model differs"), std::string::npos) << why;

  std::ofstream(path) << "{\"format\": 1, \"key\": ";  // cut short
  try {
    read_reference(path, key, t, why);
    ADD_FAILURE() << "a damaged file was read";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kData);
    EXPECT_NE(std::string(e.what()).find(path.string()), std::string::npos) << e.what();
  }
  std::ofstream(path) << json{
      {"format", 1},
      {"key", key},
      {"pairs", 3},
      {"chosen", {1.0, 2.0}},
      {"rejected",
       {1.0, 2.0}}}.dump();
  EXPECT_THROW(read_reference(path, key, t, why), Error);
}

}  // namespace
}  // namespace shardlm::trainer_detail
