// Samples packing (train/data.h): best-fit decreasing against its definition, every document
// of an epoch trained once and exactly as if alone (tokens, targets under its mask, positions,
// its own start), the overlong rule counted, and data.packing's "auto".
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <random>

#include "shardlm/core/check.h"
#include "shardlm/train/data.h"

namespace shardlm {
namespace {

// Best-fit decreasing as its definition reads, in O(items x bins): longest first (ties by
// index), into the open bin with the least room that holds the item (ties: the first opened).
PackedBins reference_bfd(const std::vector<int64_t>& lengths, int64_t capacity) {
  std::vector<int64_t> order(lengths.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = int64_t(i);
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return lengths[a] > lengths[b]; });
  std::vector<std::vector<int64_t>> bins;
  std::vector<int64_t> room;
  for (const int64_t i : order) {
    int64_t best = -1;
    for (size_t b = 0; b < bins.size(); ++b)
      if (room[b] >= lengths[i] && (best < 0 || room[b] < room[best])) best = int64_t(b);
    if (best < 0) {
      best = int64_t(bins.size());
      bins.emplace_back();
      room.push_back(capacity);
    }
    bins[best].push_back(i);
    room[best] -= lengths[i];
  }
  PackedBins out{{0}, {}};
  for (const auto& b : bins) {
    out.items.insert(out.items.end(), b.begin(), b.end());
    out.offsets.push_back(int64_t(out.items.size()));
  }
  return out;
}

TEST(PackBestFitDecreasing, PlacesEachItemInTheFullestBinThatHoldsIt) {
  // 5 -> bin 0 (room 3); 4 -> bin 1 (4); 3 -> bin 0 (exactly); 3 -> bin 1 (1); 2, 2 -> bin 2;
  // 1 -> bin 1, the bin with the least room that holds it.
  const PackedBins p = pack_best_fit_decreasing({5, 4, 3, 3, 2, 2, 1}, 8);
  EXPECT_EQ(p.offsets, (std::vector<int64_t>{0, 2, 5, 7}));
  EXPECT_EQ(p.items, (std::vector<int64_t>{0, 2, 1, 3, 6, 4, 5}));
}

TEST(PackBestFitDecreasing, EqualsItsDefinitionOnRandomLengths) {
  std::mt19937_64 rng(7);
  for (const int64_t capacity : {1, 2, 17, 64, 4096}) {
    for (int trial = 0; trial < 20; ++trial) {
      std::vector<int64_t> lengths(size_t(rng() % 300));
      for (auto& l : lengths) l = 1 + int64_t(rng() % uint64_t(capacity));
      const PackedBins got = pack_best_fit_decreasing(lengths, capacity);
      const PackedBins want = reference_bfd(lengths, capacity);
      ASSERT_EQ(got.offsets, want.offsets) << "capacity " << capacity << " trial " << trial;
      ASSERT_EQ(got.items, want.items) << "capacity " << capacity << " trial " << trial;
      for (int64_t b = 0; b < got.size(); ++b) {
        int64_t used = 0;
        for (int64_t k = got.offsets[b]; k < got.offsets[b + 1]; ++k) used += lengths[got.items[k]];
        EXPECT_LE(used, capacity);
      }
    }
  }
  EXPECT_THROW(pack_best_fit_decreasing({3, 9}, 8), Error);
}

// Host buffers standing in for the model's input buffers.
struct Rows {
  std::vector<int32_t> tok, tgt, pos, seg;
  BatchInputs in;
  Rows(int64_t B, int64_t T) : tok(B * T), tgt(B * T), pos(B * T), seg(B * T) {
    in = {Tensor(tok.data(), DType::kI32, {B * T}), Tensor(tgt.data(), DType::kI32, {B * T}),
          Tensor(pos.data(), DType::kI32, {B * T}), Tensor(seg.data(), DType::kI32, {B * T}),
          Tensor()};
  }
};

// Documents of the given lengths whose token values are their stream indices, with a mask that
// leaves out every third token.
std::shared_ptr<TokenSource> numbered_source(const std::vector<int64_t>& lengths, bool masked) {
  std::vector<int32_t> tokens;
  std::vector<int64_t> starts;
  std::vector<uint8_t> mask;
  for (const int64_t n : lengths) {
    starts.push_back(int64_t(tokens.size()));
    for (int64_t j = 0; j < n; ++j) {
      mask.push_back(tokens.size() % 3 == 1 ? 0 : 1);
      tokens.push_back(int32_t(tokens.size()));
    }
  }
  return make_memory_source(tokens, starts, "numbered", masked ? mask : std::vector<uint8_t>{});
}

constexpr int32_t kEos = 9999;

// Splits every row of an epoch into its documents (by their starts), checking each is its
// source document alone: tokens, positions from 0, targets the next token where the mask is 1
// and none at its last token. Returns documents seen by their first token, and their lengths.
std::map<int32_t, int64_t> epoch_documents(Dataset& ds, const std::vector<uint8_t>& mask,
                                           int64_t B) {
  const int64_t T = ds.seq_len();
  const std::vector<int64_t> order = ds.epoch_order(3, 1);
  std::map<int32_t, int64_t> seen;
  int64_t valid = 0, counted = 0;
  Rows rows(B, T);
  for (int64_t first = 0; first < int64_t(order.size()); first += B) {
    for (int64_t r = 0; r < B && first + r < int64_t(order.size()); ++r)
      counted += ds.window_targets(order[first + r]);
    valid += ds.fill(order, first, B, rows.in);
    for (int64_t r = 0; r < B; ++r) {
      const int64_t tokens =
          first + r < int64_t(order.size()) ? ds.window_tokens(order[first + r]) : 0;
      for (int64_t t = 0; t < T;) {
        const int64_t at = r * T + t;
        if (t >= tokens) {  // padding: masked, its own start
          EXPECT_EQ(rows.tgt[at], kIgnoreIndex);
          EXPECT_EQ(rows.seg[at], t);
          ++t;
          continue;
        }
        int64_t n = 1;  // this document's length in the row
        while (t + n < tokens && rows.seg[at + n] == t) ++n;
        const int32_t first_token = rows.tok[at];
        EXPECT_EQ(seen.count(first_token), 0u) << "document at " << first_token << " twice";
        seen[first_token] = n;
        for (int64_t j = 0; j < n; ++j) {
          EXPECT_EQ(rows.seg[at + j], t);
          EXPECT_EQ(rows.pos[at + j], j);
          EXPECT_EQ(rows.tok[at + j], first_token + j);
          const bool target = j + 1 < n && (mask.empty() || mask[first_token + j + 1]);
          EXPECT_EQ(rows.tgt[at + j], target ? first_token + j + 1 : kIgnoreIndex)
              << "document at " << first_token << ", token " << j;
        }
        t += n;
      }
    }
  }
  EXPECT_EQ(valid, ds.targets_per_epoch());
  EXPECT_EQ(counted, ds.targets_per_epoch());
  return seen;
}

// The mask of the whole source (empty without one).
std::vector<uint8_t> source_mask(const TokenSource& src) {
  if (!src.has_loss_mask()) return {};
  std::vector<int32_t> tok(size_t(src.num_tokens()));
  std::vector<uint8_t> mask(tok.size());
  src.read(0, src.num_tokens(), tok.data(), mask.data());
  return mask;
}

TEST(SamplePacking, EveryDocumentOnceAndAsIfAlone) {
  const std::vector<int64_t> lengths = {7, 3, 12, 16, 1, 5, 9, 2, 11, 4, 6};
  for (const bool masked : {false, true}) {
    SCOPED_TRACE(masked ? "masked" : "unmasked");
    const auto src = numbered_source(lengths, masked);
    Dataset ds(src, 16, kEos, 0, -1, {Packing::kSamples, Overlong::kError});
    const std::vector<uint8_t> mask = source_mask(*src);
    // 76 tokens in windows of 16: best-fit decreasing fills 5 with 4 positions of padding.
    EXPECT_EQ(ds.num_windows(), 5);
    EXPECT_EQ(ds.packing_stats().padding, 5 * 16 - 76);
    EXPECT_EQ(ds.packing_stats().samples, 11);
    int64_t want_targets = 0;
    for (size_t d = 0, start = 0; d < lengths.size(); start += lengths[d++])
      for (int64_t j = 1; j < lengths[d]; ++j) want_targets += masked ? mask[start + j] : 1;
    EXPECT_EQ(ds.targets_per_epoch(), want_targets);
    const std::map<int32_t, int64_t> seen = epoch_documents(ds, mask, 2);
    ASSERT_EQ(seen.size(), lengths.size());
    for (size_t d = 0, start = 0; d < lengths.size(); start += lengths[d++])
      EXPECT_EQ(seen.at(int32_t(start)), lengths[d]);
  }
}

TEST(SamplePacking, OverlongDocumentsAreTruncatedDroppedOrAnErrorAndCounted) {
  const std::vector<int64_t> lengths = {4, 9, 3, 12};  // two longer than T = 8
  const auto src = numbered_source(lengths, true);
  Dataset cut(src, 8, kEos, 0, -1, {Packing::kSamples, Overlong::kTruncate});
  EXPECT_EQ(cut.packing_stats().samples, 4);
  EXPECT_EQ(cut.packing_stats().truncated, 2);
  EXPECT_EQ(cut.packing_stats().overlong_tokens, 1 + 4);
  // Targets cut: stream indices 12 (doc 1) and 24..27 (doc 3), less those the mask leaves out
  // (index % 3 == 1: 25).
  EXPECT_EQ(cut.packing_stats().overlong_targets, 1 + 3);
  const std::map<int32_t, int64_t> seen = epoch_documents(cut, source_mask(*src), 1);
  EXPECT_EQ(seen.at(4), 8);   // doc 1's first 8 tokens
  EXPECT_EQ(seen.at(16), 8);  // doc 3's
  EXPECT_NE(packing_line(cut).find("2 longer than data.seq_len = 8 truncated (5 tokens"),
            std::string::npos)
      << packing_line(cut);

  Dataset dropped(src, 8, kEos, 0, -1, {Packing::kSamples, Overlong::kDrop});
  EXPECT_EQ(dropped.packing_stats().samples, 2);
  EXPECT_EQ(dropped.packing_stats().dropped, 2);
  EXPECT_EQ(dropped.packing_stats().overlong_tokens, 9 + 12);
  EXPECT_EQ(dropped.num_windows(), 1);  // 4 + 3 tokens
  EXPECT_EQ(epoch_documents(dropped, source_mask(*src), 1).size(), 2u);

  try {
    Dataset refused(src, 8, kEos, 0, -1, {Packing::kSamples, Overlong::kError});
    ADD_FAILURE() << "a document longer than seq_len was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kData);
    EXPECT_NE(std::string(e.what()).find("numbered: document 1 has 9 tokens, more than "
                                         "data.seq_len = 8"),
              std::string::npos)
        << e.what();
  }
  const auto long_only = numbered_source({9, 10}, false);
  EXPECT_THROW(Dataset(long_only, 8, kEos, 0, -1, {Packing::kSamples, Overlong::kDrop}), Error);
}

TEST(SamplePacking, HeldOutSplitKeepsThePackingAndStreamCountsItsPadding) {
  const auto src = numbered_source({7, 3, 12, 16, 1, 5}, true);
  Dataset train(src, 16, kEos, 0, -1, {Packing::kSamples, Overlong::kError});
  const Dataset valid = train.split_tail(0.34);  // the last 2 documents
  EXPECT_EQ(valid.packing().packing, Packing::kSamples);
  EXPECT_EQ(valid.packing_stats().samples, 2);
  EXPECT_EQ(train.packing_stats().samples, 4);
  const Dataset stream(src, 16, kEos);
  EXPECT_EQ(stream.num_windows(), 3);  // 44 tokens
  EXPECT_EQ(stream.packing_stats().padding, 3 * 16 - 44);
  EXPECT_EQ(stream.window_tokens(2), 12);
}

TEST(SamplePacking, AutoIsSamplesForMaskedData) {
  const auto masked = numbered_source({3, 4}, true), plain = numbered_source({3, 4}, false);
  EXPECT_EQ(packing_options("auto", "truncate", *masked).packing, Packing::kSamples);
  EXPECT_EQ(packing_options("auto", "truncate", *plain).packing, Packing::kStream);
  EXPECT_EQ(packing_options("samples", "drop", *plain).packing, Packing::kSamples);
  EXPECT_EQ(packing_options("samples", "drop", *plain).overlong, Overlong::kDrop);
  EXPECT_EQ(packing_options("stream", "error", *masked).packing, Packing::kStream);
}

}  // namespace
}  // namespace shardlm
