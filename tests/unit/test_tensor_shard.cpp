// The tensor-parallel split of the parameter arena (model/tensor_shard.h): config errors name
// the key tp does not divide, the shard pieces of all tp ranks cover the full arena exactly
// (split tensors once, replicated ones once per rank), the embedding table and the head are
// split by vocabulary rows, and the replicated ranges are the norms; LoRA's adapters split
// with their base projection (B by rows for q/k/v/gate/up, A by columns for o/down), and a
// pipeline stage's tp shard of them places each element at the whole adapter arena's element of
// the same tensor.
#include <gtest/gtest.h>

#include <vector>

#include "shardlm/core/check.h"
#include "shardlm/model/tensor_shard.h"

namespace shardlm {
namespace {

ModelConfig cfg() {
  ModelConfig c = model_preset("tiny");  // 4 heads, 2 kv heads
  c.n_layers = 2;
  c.attn_bias = true;
  return c;
}

TEST(TensorShard, ErrorsNameTheKeyTpDoesNotDivide) {
  auto message = [](const ModelConfig& c, int64_t tp) {
    try {
      tp_shard_config(c, tp);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_NE(message(cfg(), 4).find("model.n_kv_heads"), std::string::npos);
  EXPECT_NE(message(cfg(), 3).find("model.n_heads"), std::string::npos);
  ModelConfig c = cfg();
  c.n_kv_heads = 4;
  c.ffn_dim = 386;
  EXPECT_NE(message(c, 4).find("model.ffn_dim"), std::string::npos);
  c.ffn_dim = 384;
  c.vocab_size = 322;  // even, not a multiple of 4
  const std::string m = message(c, 4);
  EXPECT_NE(m.find("model.vocab_size"), std::string::npos) << m;
  EXPECT_NE(m.find("parallel.tp"), std::string::npos) << m;
  EXPECT_EQ(tp_shard_config(c, 2).vocab_rows(), 161);
}

TEST(TensorShard, PiecesCoverTheArena) {
  for (bool tied : {false, true}) {
    ModelConfig c = cfg();
    c.tie_embeddings = tied;
    const int64_t tp = 2;
    const ParamLayout full = make_param_layout(c);
    const ParamLayout shard = make_param_layout(tp_shard_config(c, tp));
    EXPECT_EQ(shard.units.size(), full.units.size());
    std::vector<int> hits(full.total, 0);
    for (int64_t r = 0; r < tp; ++r) {
      int64_t next = 0;
      for (const ShardPiece& p : tp_shard_pieces(c, tp, r)) {
        EXPECT_EQ(p.shard, next);  // in shard order, every element once
        next += p.count;
        for (int64_t i = 0; i < p.count; ++i) ++hits[p.full + i];
      }
      EXPECT_EQ(next, shard.total);
    }
    int64_t replicated = 0;
    for (auto [b, e] : tp_replicated_ranges(shard)) replicated += e - b;
    int64_t twice = 0;
    for (int h : hits) {
      EXPECT_TRUE(h == 1 || h == int(tp));
      twice += h == int(tp);
    }
    EXPECT_EQ(twice, replicated);
    // 2 norms per layer and the final norm; the embeddings and head are vocabulary-parallel
    EXPECT_EQ(replicated, c.dim * (2 * c.n_layers + 1));
    EXPECT_EQ(shard.entries[0].shape, (Shape{c.vocab_size / tp, c.dim}));
    // rank 1's embedding rows are the second half of the table's
    EXPECT_EQ(tp_shard_pieces(c, tp, 1).front().full, full.embed + c.vocab_size / tp * c.dim);
  }
}

// The adapters' arena under tp = 2: every element of the whole arena in exactly one rank's
// shard or (the column-parallel A, the row-parallel B) in every rank's; a shard's B of q holds
// the whole B's rows of its heads and its A of o the whole A's columns of its heads.
TEST(TensorShard, LoraPiecesFollowTheirBaseProjection) {
  const ModelConfig c = cfg();
  const int64_t tp = 2, r = 4;
  LoraConfig lora;
  lora.rank = r;
  lora.targets = lora_targets_from_string("all");
  const LoraLayout full = make_lora_layout(c, lora);
  const LoraLayout shard = make_lora_layout(tp_shard_config(c, tp), lora);
  std::vector<int> hits(full.params.total, 0);
  std::vector<std::vector<int64_t>> at(tp);  // shard element -> whole element
  for (int64_t k = 0; k < tp; ++k) {
    at[k].assign(shard.params.total, -1);
    int64_t next = 0;
    for (const ShardPiece& p : lora_shard_pieces(c, lora, tp, k)) {
      EXPECT_EQ(p.shard, next);
      next += p.count;
      for (int64_t i = 0; i < p.count; ++i) {
        ++hits[p.full + i];
        at[k][p.shard + i] = p.full + i;
      }
    }
    EXPECT_EQ(next, shard.params.total);
  }
  int64_t replicated = 0, twice = 0;
  for (auto [b, e] : tp_replicated_ranges(shard.params)) replicated += e - b;
  for (int h : hits) {
    EXPECT_TRUE(h == 1 || h == int(tp));
    twice += h == int(tp);
  }
  EXPECT_EQ(twice, replicated);
  // per layer: A of q, k, v, gate, up and B of o, down, each r x dim
  EXPECT_EQ(replicated, 7 * r * c.dim * c.n_layers);
  const int64_t l = 1, qs = c.q_dim() / tp, os = c.q_dim() / tp;  // rank 1's share
  const int q = int(LoraTarget::kQ), o = int(LoraTarget::kO);
  // B of q [q_dim / tp, r]: rank 1's row i, column j is the whole B's row qs + i
  for (int64_t i : {int64_t(0), qs - 1})
    for (int64_t j : {int64_t(0), r - 1})
      EXPECT_EQ(at[1][shard.b[l][q] + i * r + j], full.b[l][q] + (qs + i) * r + j);
  // A of o [r, q_dim / tp]: rank 1's row i, column j is the whole A's column os + j
  for (int64_t i : {int64_t(0), r - 1})
    for (int64_t j : {int64_t(0), os - 1})
      EXPECT_EQ(at[1][shard.a[l][o] + i * os + j], full.a[l][o] + i * c.q_dim() + os + j);
  EXPECT_EQ(at[1][shard.a[l][q]], full.a[l][q]);  // A of q whole
  EXPECT_EQ(at[1][shard.b[l][o]], full.b[l][o]);  // B of o whole
}

// The adapters of every (stage, tp rank) of pp x tp grids: each coordinate's pieces fill its
// arena in order, each element lands in the whole arena's tensor of the same name at the place
// the stage's tp = 1 adapters and the whole model's tp shard agree on, and over the grid the
// split elements are covered once, the replicated ones once per tp rank.
TEST(TensorShard, LoraStageShardPiecesCoverTheWholeAdaptersOnceOverTheGrid) {
  ModelConfig c = cfg();
  c.n_layers = 4;
  LoraConfig lora;
  lora.rank = 2;
  lora.targets = lora_targets_from_string("q,v,o,down");
  const ParamLayout whole = make_lora_layout(c, lora).params;
  auto entry_at = [](const ParamLayout& L, int64_t at) -> const ParamEntry& {
    size_t e = 0;
    while (e + 1 < L.entries.size() && L.entries[e + 1].offset <= at) ++e;
    return L.entries[e];
  };
  const std::vector<std::vector<int64_t>> partitions = {{0, 4}, {0, 2, 4}, {0, 1, 3, 4}};
  for (const std::vector<int64_t>& bounds : partitions)
    for (int64_t tp : {1, 2}) {
      const int pp = int(bounds.size()) - 1;
      SCOPED_TRACE(::testing::Message() << "pp " << pp << " tp " << tp);
      std::vector<int> seen(size_t(whole.total), 0);
      for (int s = 0; s < pp; ++s)
        for (int64_t r = 0; r < tp; ++r) {
          ModelConfig sc = tp_shard_config(c, tp);
          sc.pp_begin = bounds[s];
          sc.pp_end = bounds[s + 1];
          const ParamLayout sl = make_lora_layout(sc, lora).params;
          const std::vector<ShardPiece> pieces =
              lora_stage_shard_pieces(c, lora, bounds[s], bounds[s + 1], tp, r);
          int64_t next = 0;
          for (const ShardPiece& p : pieces) {
            ASSERT_EQ(p.shard, next);
            next += p.count;
            EXPECT_EQ(entry_at(whole, p.full).name, entry_at(sl, p.shard).name);
            for (int64_t i = 0; i < p.count; ++i) ++seen[size_t(p.full + i)];
          }
          EXPECT_EQ(next, sl.total);
          // The special cases: the whole model's tp shard, and a stage's adapters at tp = 1.
          auto elements = [](const std::vector<ShardPiece>& ps) {
            std::vector<std::pair<int64_t, int64_t>> m;
            for (const ShardPiece& p : ps)
              for (int64_t i = 0; i < p.count; ++i) m.emplace_back(p.shard + i, p.full + i);
            return m;
          };
          if (pp == 1) {
            EXPECT_EQ(elements(pieces), elements(lora_shard_pieces(c, lora, tp, r)));
          }
          if (tp == 1) {
            EXPECT_EQ(elements(pieces), elements(lora_stage_pieces(make_lora_layout(c, lora),
                                                                   make_lora_layout(sc, lora))));
          }
        }
      const auto replicated = tp_replicated_ranges(whole);
      for (int64_t i = 0; i < whole.total; ++i) {
        bool rep = false;
        for (auto [b, e] : replicated) rep = rep || (i >= b && i < e);
        ASSERT_EQ(seen[size_t(i)], rep ? int(tp) : 1) << "element " << i;
      }
    }
}

}  // namespace
}  // namespace shardlm
