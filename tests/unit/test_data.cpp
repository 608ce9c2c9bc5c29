// Dataset and the LR schedule: every token is a target exactly once per epoch, padding and
// the loss mask are honoured, document boundaries and positions are right, shuffles are seeded.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>

#include "shardlm/backend/backend.h"
#include "shardlm/io/shards.h"
#include "shardlm/train/data.h"
#include "shardlm/train/optimizer.h"
#include "test_util.h"

namespace shardlm {
namespace {

// Host buffers standing in for the model's input buffers.
struct HostBatch {
  std::vector<int32_t> tok, tgt, pos, seg;
  BatchInputs in;
  HostBatch(int64_t B, int64_t T) : tok(B * T), tgt(B * T), pos(B * T), seg(B * T) {
    in = {Tensor(tok.data(), DType::kI32, {B * T}), Tensor(tgt.data(), DType::kI32, {B * T}),
          Tensor(pos.data(), DType::kI32, {B * T}), Tensor(seg.data(), DType::kI32, {B * T}),
          Tensor()};  // the loader never writes doc_starts (the step runner does)
  }
};

constexpr int32_t kEos = 99;

Dataset make_ds(int n_tokens, std::vector<int64_t> docs, int64_t T,
                std::vector<uint8_t> mask = {}) {
  std::vector<int32_t> tokens(n_tokens);
  for (int i = 0; i < n_tokens; ++i) tokens[i] = i;
  return Dataset(make_memory_source(tokens, std::move(docs), "synthetic", std::move(mask)), T,
                 kEos);
}

TEST(Dataset, EveryTokenIsATargetOncePerEpochWithPaddingMasked) {
  // 3 documents of lengths 5, 9, 4 (token values are their stream index).
  const int64_t T = 4, B = 2;
  Dataset ds = make_ds(18, {0, 5, 14}, T);
  EXPECT_EQ(ds.targets_per_epoch(), 18);
  EXPECT_EQ(ds.num_windows(), 5);  // ceil(18 / 4)
  const auto order = ds.epoch_order(9, 0);
  std::map<int32_t, int> seen;  // target value -> count
  int64_t valid_total = 0, counted = 0;
  HostBatch hb(B, T);
  for (int64_t first = 0; first < int64_t(order.size()); first += B) {
    for (int64_t r = 0; r < B && first + r < int64_t(order.size()); ++r)
      counted += ds.window_targets(order[first + r]);
    valid_total += ds.fill(order, first, B, hb.in);
    for (int64_t i = 0; i < B * T; ++i) {
      if (hb.tgt[i] == kIgnoreIndex) continue;
      ++seen[hb.tgt[i]];
      // Next-token target; the stream's first token is predicted from a virtual <eos>.
      EXPECT_EQ(hb.tok[i], hb.tgt[i] == 0 ? kEos : hb.tgt[i] - 1);
    }
  }
  EXPECT_EQ(valid_total, 18);
  EXPECT_EQ(counted, 18);
  ASSERT_EQ(seen.size(), 18u);
  for (const auto& [t, n] : seen) EXPECT_EQ(n, 1) << "target " << t;
}

TEST(Dataset, PositionsAndDocumentStartsRestartPerDocument) {
  Dataset ds = make_ds(12, {0, 3, 7}, 6);
  HostBatch hb(1, 6);
  ds.fill({1}, 0, 1, hb.in);  // window 1: targets 6..11, inputs 5..10
  // Input 5 is in doc [3,7) at position 2; its document began before the window (start 0).
  EXPECT_EQ(hb.tok[0], 5);
  EXPECT_EQ(hb.tgt[0], 6);
  EXPECT_EQ(hb.pos[0], 2);
  EXPECT_EQ(hb.seg[0], 0);
  EXPECT_EQ(hb.pos[1], 3);
  // Input 7 starts doc 3: position 0, its document starts at row index 2.
  EXPECT_EQ(hb.tok[2], 7);
  EXPECT_EQ(hb.pos[2], 0);
  EXPECT_EQ(hb.seg[2], 2);
  EXPECT_EQ(hb.pos[5], 3);
  EXPECT_EQ(hb.seg[5], 2);
  // Window 0: the virtual <eos> is its own document; token 0 starts the next.
  ds.fill({0}, 0, 1, hb.in);
  EXPECT_EQ(hb.tok[0], kEos);
  EXPECT_EQ(hb.tgt[0], 0);
  EXPECT_EQ(hb.seg[0], 0);
  EXPECT_EQ(hb.tok[1], 0);
  EXPECT_EQ(hb.pos[1], 0);
  EXPECT_EQ(hb.seg[1], 1);
}

TEST(Dataset, RowsPastTheEndAreFullyMasked) {
  Dataset ds = make_ds(9, {0}, 4);
  HostBatch hb(4, 4);
  const auto order = ds.epoch_order(1, 0);
  ASSERT_EQ(order.size(), 3u);
  EXPECT_EQ(ds.fill(order, 0, 4, hb.in), 9);
  for (int t = 12; t < 16; ++t) EXPECT_EQ(hb.tgt[t], kIgnoreIndex);
}

// The trainer's host check of a micro-batch against the model's vocabulary, before upload: the
// first id outside it (tokens before targets) is a data error naming the source, the window and
// both positions; a target may be the ignore index, a token may not.
TEST(Dataset, IdsOutsideTheModelsVocabularyAreNamedOnTheHost) {
  Dataset ds = make_ds(9, {0}, 4);
  HostBatch hb(4, 4);
  const auto order = ds.epoch_order(1, 0);
  ASSERT_EQ(order.size(), 3u);  // row 3 is padding
  ds.fill(order, 0, 4, hb.in);
  EXPECT_NO_THROW(ds.check_ids(order, 0, 4, hb.in, 100));  // ids 0..8 and <eos> 99
  auto message = [&](int64_t vocab) {
    try {
      ds.check_ids(order, 0, 4, hb.in, vocab);
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kData);
      return std::string(e.what());
    }
    return std::string("no error");
  };
  // <eos> (99) is the input before the stream's first token: a token outside a vocabulary of 99.
  const int64_t eos_at = std::find(hb.tok.begin(), hb.tok.end(), kEos) - hb.tok.begin();
  ASSERT_LT(eos_at, 12);
  EXPECT_NE(message(99).find(fmt::format(
                "synthetic: token id 99 at position {} of window {} (micro-batch position {}) is "
                "outside the model's vocabulary [0, 99); the data and model.vocab_size disagree",
                eos_at % 4, order[size_t(eos_at / 4)], eos_at)),
            std::string::npos)
      << message(99);
  hb.tgt[5] = 100;
  EXPECT_NE(message(100).find(fmt::format("synthetic: target id 100 at position 1 of window {} "
                                          "(micro-batch position 5) is outside the model's "
                                          "vocabulary [0, 100) and is not the ignore index -1",
                                          order[1])),
            std::string::npos)
      << message(100);
  hb.tok[13] = kIgnoreIndex;  // tokens before targets, and -1 is no token
  EXPECT_NE(message(100).find("synthetic: token id -1 at position 1 of a padding row (micro-batch "
                              "position 13)"),
            std::string::npos)
      << message(100);
}

TEST(Dataset, LossMaskSelectsTargets) {
  std::vector<uint8_t> mask(10, 0);
  mask[3] = mask[4] = mask[9] = 1;
  Dataset ds = make_ds(10, {0, 5}, 4, mask);
  EXPECT_EQ(ds.targets_per_epoch(), 3);
  HostBatch hb(3, 4);
  const auto order = ds.epoch_order(3, 0);
  int64_t counted = 0;
  for (int64_t w : order) counted += ds.window_targets(w);
  EXPECT_EQ(counted, 3);
  EXPECT_EQ(ds.fill(order, 0, 3, hb.in), 3);
  int n = 0;
  for (int i = 0; i < 12; ++i)
    if (hb.tgt[i] != kIgnoreIndex) {
      ++n;
      EXPECT_TRUE(hb.tgt[i] == 3 || hb.tgt[i] == 4 || hb.tgt[i] == 9) << hb.tgt[i];
    }
  EXPECT_EQ(n, 3);
}

TEST(Dataset, ShuffleIsSeededAndPerEpoch) {
  Dataset ds = make_ds(1001, {0}, 10);
  EXPECT_EQ(ds.epoch_order(5, 0), ds.epoch_order(5, 0));
  EXPECT_NE(ds.epoch_order(5, 0), ds.epoch_order(5, 1));
  EXPECT_NE(ds.epoch_order(5, 0), ds.epoch_order(6, 0));
}

TEST(Dataset, TextFilesSplitAtBlankLinesAndBadFilesAreNamed) {
  const auto path = shardlm::test::scratch_root() / "shardlm_data_test.txt";
  std::ofstream(path) << "ab\ncd\n\n\nef\n";
  ByteTokenizer tok;
  Dataset ds(load_text_source(path.string(), tok), 4, tok.eos_id());
  EXPECT_EQ(ds.num_documents(), 2);
  EXPECT_EQ(ds.num_tokens(), 6 + 1 + 3 + 1);  // "ab\ncd\n" <eos> "ef\n" <eos>
  Dataset held = ds.split_tail(0.5);
  EXPECT_EQ(held.num_documents(), 1);
  EXPECT_EQ(held.num_tokens(), 4);
  EXPECT_EQ(ds.num_documents(), 1);
  try {
    load_text_source("/nonexistent/file.txt", tok);
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

// What a data set and its source hold on the host is what the plan says of them from their
// sizes (plan.h), for every packing: stream (with and without a loss mask), samples, paired
// samples, a held-out tail, and a token corpus's document starts.
TEST(Dataset, HostBytesAreThePlansFromTheSizes) {
  const std::vector<int32_t> tokens = [] {
    std::vector<int32_t> t(60);
    for (int i = 0; i < 60; ++i) t[size_t(i)] = i % 50;
    return t;
  }();
  const std::vector<int64_t> docs = {0, 7, 20, 26, 41, 50};
  std::vector<uint8_t> mask(60, 1);
  for (int i = 0; i < 60; i += 3) mask[size_t(i)] = 0;
  auto expect_planned = [](const Dataset& d) {
    EXPECT_EQ(d.host_bytes(), data_set_host_bytes(d.host_sizes()));
    EXPECT_EQ(d.source().host_bytes(), d.source().planned_host_bytes());
  };
  for (const bool masked : {false, true}) {
    for (const Packing packing : {Packing::kStream, Packing::kSamples}) {
      SCOPED_TRACE(std::string(packing_name(packing)) + (masked ? ", masked" : ""));
      Dataset d(make_memory_source(tokens, docs, "s", masked ? mask : std::vector<uint8_t>{}), 16,
                kEos, 0, -1, {packing, Overlong::kTruncate});
      expect_planned(d);
      const Dataset tail = d.split_tail(0.3);
      expect_planned(d);
      expect_planned(tail);
      EXPECT_GT(d.host_bytes(), 0);
    }
  }
  // Preference pairs (documents 2k and 2k + 1), one too long for T = 16 and cut.
  const Dataset pairs(make_memory_source(tokens, docs, "pairs", mask, /*paired=*/true), 16, kEos, 0,
                      -1, {Packing::kSamples, Overlong::kTruncate});
  EXPECT_TRUE(pairs.host_sizes().paired);
  expect_planned(pairs);
  // A token corpus: its document starts and shards' first tokens (the tokens are mapped).
  const std::filesystem::path dir = test::scratch_root() / "host_bytes_corpus";
  {
    ShardWriter w(dir.string(), "byte", 256, 25);
    for (size_t k = 0; k + 1 < docs.size(); ++k)
      w.add_document(tokens.data() + docs[k], docs[k + 1] - docs[k]);
    w.finish();
  }
  const Dataset corpus(load_corpus_source(dir.string()), 16, kEos);
  expect_planned(corpus);
  EXPECT_EQ(corpus.source().host_bytes(), corpus_source_host_bytes(5, 3));  // 5 documents, 3 shards
}

}  // namespace
}  // namespace shardlm
