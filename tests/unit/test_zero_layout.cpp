// ZeRO's parts and buckets with the vocabulary tables in pieces (plan/zero_layout.h,
// model/layout.h unit_pieces): pieces cover their unit in order, the head's first piece carries
// the final norm, tied embeddings are pieced with each piece a bucket alone, adapter arenas
// stay whole, and every bucket of Llama-3.1-8B is then bounded by a layer instead of the
// 128K-row table.
#include <gtest/gtest.h>

#include "shardlm/model/layout.h"
#include "shardlm/model/lora.h"
#include "shardlm/plan/zero_layout.h"

namespace shardlm {
namespace {

TEST(UnitPieces, CoverTheUnitInOrderAndTheHeadsFirstPieceHoldsTheFinalNorm) {
  ModelConfig c = model_preset("llama3.1-8b");
  const ParamLayout L = make_param_layout(c);
  ASSERT_TRUE(unit_has_table(L, 0));
  ASSERT_TRUE(unit_has_table(L, L.head_unit));
  EXPECT_FALSE(unit_has_table(L, 1));
  for (int u : {0, L.head_unit}) {
    const std::vector<UnitPiece> pieces = unit_pieces(L, u, 50'000);
    ASSERT_EQ(pieces.size(), 3u);  // 128,256 rows: 50,000 + 50,000 + 28,256
    EXPECT_EQ(pieces.front().begin, L.units[u].begin);
    EXPECT_EQ(pieces.back().end, L.units[u].end);
    int64_t row = 0;
    for (size_t k = 0; k < pieces.size(); ++k) {
      if (k > 0) {
        EXPECT_EQ(pieces[k].begin, pieces[k - 1].end);
      }
      EXPECT_EQ(pieces[k].row_begin, row);
      const int64_t table = u == 0 ? L.embed : L.lm_head;
      EXPECT_EQ(pieces[k].end, table + (row + pieces[k].rows) * c.dim);
      row += pieces[k].rows;
    }
    EXPECT_EQ(row, c.vocab_size);
    EXPECT_EQ(pieces.back().rows, 28'256);
  }
  // The final norm precedes the head in its unit and goes with the first rows.
  const std::vector<UnitPiece> head = unit_pieces(L, L.head_unit, 50'000);
  EXPECT_EQ(head[0].end - head[0].begin, c.dim + 50'000 * c.dim);
  // Whole: one piece.
  EXPECT_EQ(unit_pieces(L, L.head_unit, 0).size(), 1u);
  EXPECT_EQ(unit_pieces(L, 1, 10).size(), 1u);
}

TEST(UnitPieces, TiedEmbeddingsArePiecedAloneAndAdapterArenasStayWhole) {
  ModelConfig c = model_preset("llama3.2-1b");
  ASSERT_TRUE(c.tie_embeddings);
  const ParamLayout L = make_param_layout(c);
  EXPECT_TRUE(unit_has_table(L, 0));             // also the LM head
  EXPECT_FALSE(unit_has_table(L, L.head_unit));  // the final norm alone
  const ZeroLayout whole = make_zero_layout(L, 4, 1 << 22);
  EXPECT_TRUE(zero_holds_tied_bucket(L, whole));
  EXPECT_EQ(whole.max_bucket, (L.unit_size(0) + 3) / 4 * 4);
  const ZeroLayout z = make_zero_layout(L, 4, 1 << 22, /*split_tables=*/true);
  EXPECT_GT(z.piece_rows[0], 0);
  EXPECT_FALSE(zero_holds_tied_bucket(L, z));  // each piece reduced after either end instead
  EXPECT_LE(z.max_bucket, L.max_layer + 3);
  // Each piece of the tied table a bucket alone, and layer 0 not joining the last one.
  for (int p = z.unit_part[0]; p < z.unit_part[1]; ++p) {
    const ZeroBucket& b = z.buckets[z.part_bucket[p]];
    EXPECT_EQ(b.first_part, p);
    EXPECT_EQ(b.last_part, p);
  }

  LoraConfig lora;
  lora.rank = 16;
  lora.targets = lora_targets_from_string("q,v");
  const LoraLayout adapters = make_lora_layout(model_preset("llama3.1-8b"), lora);
  for (int u = 0; u < int(adapters.params.units.size()); ++u)
    EXPECT_FALSE(unit_has_table(adapters.params, u)) << u;
}

TEST(ZeroLayoutPieces, BucketsOfTheEightBillionModelAreBoundedByALayer) {
  const ParamLayout L = make_param_layout(model_preset("llama3.1-8b"));
  for (int world : {1, 8}) {
    const ZeroLayout whole = make_zero_layout(L, world, 1 << 22);
    const ZeroLayout split = make_zero_layout(L, world, 1 << 22, /*split_tables=*/true);
    EXPECT_GE(whole.max_bucket, L.unit_size(0));
    EXPECT_LE(split.max_bucket, L.max_layer + world - 1);
    // The same arena, in order, every part in one bucket; more buckets than units.
    EXPECT_GT(split.buckets.size(), whole.buckets.size());
    EXPECT_EQ(split.buckets.front().begin, 0);
    EXPECT_EQ(split.buckets.back().end, L.total);
    for (size_t b = 1; b < split.buckets.size(); ++b)
      EXPECT_EQ(split.buckets[b].begin, split.buckets[b - 1].end);
    ASSERT_EQ(split.parts.size(), split.part_bucket.size());
    for (size_t p = 0; p < split.parts.size(); ++p) {
      const ZeroBucket& b = split.buckets[split.part_bucket[p]];
      EXPECT_GE(split.parts[p].begin, b.begin);
      EXPECT_LE(split.parts[p].end, b.end);
    }
    const int head = L.head_unit;
    EXPECT_EQ(split.part_of(head, 0), split.unit_part[head]);
    EXPECT_EQ(split.parts[split.part_of(head, 1)].unit, head);
    // A larger bucket size makes the pieces larger, never smaller than a layer.
    const ZeroLayout big = make_zero_layout(L, world, int64_t{300} << 20, true);
    EXPECT_LE(big.max_bucket, (int64_t{300} << 20) + world - 1);
    EXPECT_GT(big.piece_rows[0], split.piece_rows[0]);
  }
}

TEST(ZeroLayoutPieces, OnlyFromStageTwoAndWhereAsked) {
  EXPECT_FALSE(zero_splits_tables(1, true));
  EXPECT_TRUE(zero_splits_tables(2, true));
  EXPECT_TRUE(zero_splits_tables(3, true));
  EXPECT_FALSE(zero_splits_tables(3, false));
}

}  // namespace
}  // namespace shardlm
