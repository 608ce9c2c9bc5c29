// The context-parallel sequence split (plan/context_layout.h): a permutation of the row that
// gives every rank two pieces, one early and one late, and clear errors for shapes it cannot
// split.
#include <gtest/gtest.h>

#include <algorithm>
#include <vector>

#include "shardlm/core/check.h"
#include "shardlm/plan/context_layout.h"

namespace shardlm {
namespace {

ModelConfig heads(int64_t hq, int64_t hkv) {
  ModelConfig c = model_preset("tiny");
  c.n_heads = hq;
  c.n_kv_heads = hkv;
  return c;
}

TEST(ContextLayout, EveryTokenBelongsToExactlyOneRank) {
  const ModelConfig cfg = heads(8, 4);
  for (auto [kind, P, U] : {std::tuple{CpKind::kUlysses, 4, 0},
                            {CpKind::kRing, 4, 0},
                            {CpKind::kHybrid, 4, 2},
                            {CpKind::kHybrid, 8, 4},
                            {CpKind::kRing, 1, 0}}) {
    const ContextLayout L = make_context_layout(cfg, 64, P, kind, U);
    std::vector<int> seen(64, 0);
    for (int c = 0; c < P; ++c)
      for (int64_t i = 0; i < L.local(); ++i) ++seen[L.global_index(c, i)];
    EXPECT_TRUE(std::all_of(seen.begin(), seen.end(), [](int n) { return n == 1; }))
        << cp_kind_name(kind) << " P=" << P;
  }
}

TEST(ContextLayout, RingPositionsHoldAnEarlyAndALateChunk) {
  const ContextLayout L = make_context_layout(heads(4, 4), 32, 4, CpKind::kRing, 0);
  EXPECT_EQ(L.chunk(), 4);
  EXPECT_EQ(L.global_index(0, 0), 0);
  EXPECT_EQ(L.global_index(0, 4), 28);  // chunk 7
  EXPECT_EQ(L.global_index(3, 0), 12);  // chunk 3
  EXPECT_EQ(L.global_index(3, 4), 16);  // chunk 4
}

TEST(ContextLayout, UlyssesGroupSequenceIsTheRowInOrder) {
  const ContextLayout L = make_context_layout(heads(4, 2), 32, 4, CpKind::kUlysses, 0);
  EXPECT_EQ(L.R(), 1);
  for (int u = 0; u < 4; ++u)
    for (int64_t i = 0; i < L.local(); ++i)
      EXPECT_EQ(L.group_global_index(0, L.group_index(u, i)), L.global_index(u, i));
}

TEST(ContextLayout, HybridAutoPicksAnAllToAllThatTheHeadsAllow) {
  EXPECT_EQ(make_context_layout(heads(8, 2), 64, 8, CpKind::kHybrid, 0).U, 4);
  EXPECT_EQ(make_context_layout(heads(6, 6), 64, 8, CpKind::kHybrid, 0).U, 2);
}

TEST(ContextLayout, KvHeadsAreReplicatedWhenFewerThanRanks) {
  const ModelConfig cfg = heads(8, 2);
  const ContextLayout L = make_context_layout(cfg, 64, 4, CpKind::kUlysses, 0);
  EXPECT_EQ(cp_q_heads(cfg, L), 2);
  EXPECT_EQ(cp_kv_heads(cfg, L), 1);
  EXPECT_EQ(cp_kv_head_of(cfg, L, 0), 0);
  EXPECT_EQ(cp_kv_head_of(cfg, L, 1), 0);
  EXPECT_EQ(cp_kv_head_of(cfg, L, 2), 1);
  EXPECT_EQ(cp_kv_head_of(cfg, L, 3), 1);
}

TEST(ContextLayout, ErrorsNameTheKeys) {
  auto message = [](auto&& f) {
    try {
      f();
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kConfig);
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(message([] {
              make_context_layout(heads(4, 4), 60, 4, CpKind::kRing, 0);
            }).find("data.seq_len"),
            std::string::npos);
  EXPECT_NE(message([] {
              make_context_layout(heads(6, 6), 64, 4, CpKind::kUlysses, 0);
            }).find("model.n_heads"),
            std::string::npos);
  // Under tensor parallelism the layout sees a tp rank's share of the heads: the message names
  // the whole model's count and the division, not the share as if it were model.n_heads.
  ModelConfig shard = heads(3, 3);
  shard.tp_shards = 2;
  EXPECT_NE(message([&] {
              make_context_layout(shard, 64, 2, CpKind::kUlysses, 0);
            }).find("model.n_heads / parallel.tp (6 / 2 = 3)"),
            std::string::npos);
  EXPECT_NE(message([] {
              make_context_layout(heads(4, 4), 64, 4, CpKind::kHybrid, 3);
            }).find("parallel.cp_ulysses"),
            std::string::npos);
  EXPECT_NE(message([] { parse_cp_kind("tree"); }).find("parallel.cp_kind"), std::string::npos);
}

}  // namespace
}  // namespace shardlm
