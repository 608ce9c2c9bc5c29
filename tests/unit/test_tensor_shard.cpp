// The tensor-parallel split of the parameter arena (model/tensor_shard.h): config errors name
// the key tp does not divide, the shard pieces of all tp ranks cover the full arena exactly
// (split tensors once, replicated ones once per rank), the embedding table and the head are
// split by vocabulary rows, and the replicated ranges are the norms.
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

}  // namespace
}  // namespace shardlm
