// TextDataset and the LR schedule: every target token is served exactly once per epoch,
// padding is masked, document boundaries and positions are right, shuffles are seeded.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>

#include "shardlm/backend/backend.h"
#include "shardlm/train/data.h"
#include "shardlm/train/optimizer.h"

namespace shardlm {
namespace {

// Host buffers standing in for the model's input buffers.
struct HostBatch {
  std::vector<int32_t> tok, tgt, pos, seg;
  BatchInputs in;
  HostBatch(int64_t B, int64_t T) : tok(B * T), tgt(B * T), pos(B * T), seg(B * T) {
    in = {Tensor(tok.data(), DType::kI32, {B * T}), Tensor(tgt.data(), DType::kI32, {B * T}),
          Tensor(pos.data(), DType::kI32, {B * T}), Tensor(seg.data(), DType::kI32, {B * T})};
  }
};

TEST(TextDataset, EveryTargetOncePerEpochWithPaddingMasked) {
  // 3 documents of lengths 5, 9, 4 (token values encode their stream index).
  std::vector<int32_t> tokens(18);
  for (int i = 0; i < 18; ++i) tokens[i] = i;
  const int64_t T = 4, B = 2;
  TextDataset ds(tokens, {0, 5, 14}, T, "synthetic");
  EXPECT_EQ(ds.targets_per_epoch(), 17);
  EXPECT_EQ(ds.num_windows(), 5);  // ceil(17 / 4)
  const auto order = ds.epoch_order(9, 0);
  std::map<int32_t, int> seen;  // target value -> count
  int64_t valid_total = 0;
  HostBatch hb(B, T);
  for (int64_t first = 0; first < int64_t(order.size()); first += B) {
    valid_total += ds.fill(order, first, B, hb.in);
    for (int64_t i = 0; i < B * T; ++i) {
      if (hb.tgt[i] == kIgnoreIndex) continue;
      ++seen[hb.tgt[i]];
      EXPECT_EQ(hb.tgt[i], hb.tok[i] + 1);  // next-token target
    }
  }
  EXPECT_EQ(valid_total, 17);
  ASSERT_EQ(seen.size(), 17u);
  for (const auto& [t, n] : seen) EXPECT_EQ(n, 1) << "target " << t;
  EXPECT_EQ(seen.begin()->first, 1);
}

TEST(TextDataset, PositionsAndDocumentStartsRestartPerDocument) {
  std::vector<int32_t> tokens(12);
  for (int i = 0; i < 12; ++i) tokens[i] = i;
  TextDataset ds(tokens, {0, 3, 7}, 6, "synthetic");
  HostBatch hb(1, 6);
  ds.fill({1}, 0, 1, hb.in);  // window 1: stream tokens 6..11
  // Stream 6 is in doc [3,7): position 3, its document began before the window (start 0).
  EXPECT_EQ(hb.tok[0], 6);
  EXPECT_EQ(hb.pos[0], 3);
  EXPECT_EQ(hb.seg[0], 0);
  // Stream 7 starts doc 3: position 0, document starts at row index 1.
  EXPECT_EQ(hb.pos[1], 0);
  EXPECT_EQ(hb.seg[1], 1);
  EXPECT_EQ(hb.pos[4], 3);
  EXPECT_EQ(hb.seg[4], 1);
  // The stream's last token has no successor: masked.
  EXPECT_EQ(hb.tok[5], 11);
  EXPECT_EQ(hb.tgt[5], kIgnoreIndex);
}

TEST(TextDataset, RowsPastTheEndAreFullyMasked) {
  std::vector<int32_t> tokens(9, 1);
  TextDataset ds(tokens, {0}, 4, "synthetic");
  HostBatch hb(3, 4);
  const auto order = ds.epoch_order(1, 0);
  ASSERT_EQ(order.size(), 2u);
  EXPECT_EQ(ds.fill(order, 0, 3, hb.in), 8);
  for (int t = 8; t < 12; ++t) EXPECT_EQ(hb.tgt[t], kIgnoreIndex);
}

TEST(TextDataset, ShuffleIsSeededAndPerEpoch) {
  std::vector<int32_t> tokens(1001, 3);
  TextDataset ds(tokens, {0}, 10, "synthetic");
  EXPECT_EQ(ds.epoch_order(5, 0), ds.epoch_order(5, 0));
  EXPECT_NE(ds.epoch_order(5, 0), ds.epoch_order(5, 1));
  EXPECT_NE(ds.epoch_order(5, 0), ds.epoch_order(6, 0));
}

TEST(TextDataset, ReadsDocumentsAtBlankLinesAndNamesBadFiles) {
  const auto path = std::filesystem::temp_directory_path() / "shardlm_data_test.txt";
  std::ofstream(path) << "ab\ncd\n\n\nef\n";
  ByteTokenizer tok;
  TextDataset ds(path.string(), tok, 4);
  EXPECT_EQ(ds.num_documents(), 2);
  EXPECT_EQ(ds.num_tokens(), 5 + 1 + 3 + 1);  // "ab\ncd" <eos> "ef\n" <eos>
  TextDataset held = ds.split_tail(0.5);
  EXPECT_EQ(held.num_documents(), 1);
  EXPECT_EQ(ds.num_documents(), 1);
  try {
    TextDataset missing("/nonexistent/file.txt", tok, 4);
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kData);
    EXPECT_NE(std::string(e.what()).find("/nonexistent/file.txt"), std::string::npos);
  }
}

TEST(LrSchedule, WarmupThenCosineToFloor) {
  TrainConfig c;
  c.lr = 1.0;
  c.min_lr = 0.1;
  c.warmup_steps = 10;
  EXPECT_DOUBLE_EQ(lr_at(c, 1, 110), 0.1);
  EXPECT_DOUBLE_EQ(lr_at(c, 10, 110), 1.0);
  EXPECT_NEAR(lr_at(c, 60, 110), 0.55, 1e-12);  // halfway through the decay
  EXPECT_NEAR(lr_at(c, 110, 110), 0.1, 1e-12);
  EXPECT_GT(lr_at(c, 30, 110), lr_at(c, 31, 110));
}

}  // namespace
}  // namespace shardlm
