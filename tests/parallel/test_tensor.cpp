// Tensor parallelism under mpiexec (1, 2, 4 ranks): for each tp that divides the world, a
// model holding rank r's shard (tp_shard_config, its weights sliced out of a single-rank
// model's by tp_shard_pieces) with the TensorParallel seam over its tp group gives the loss of
// the single-rank model on the same rows, and gradients equal to the single-rank gradients
// sliced the same way, within fp32 tolerance (attention bias, grouped-query attention, the
// chunked MLP and every checkpointing mode, whose recompute reduces again). The embedding
// table and the LM head are split by vocabulary rows (tied or not): the shard holds V/tp rows,
// the chunked vocabulary-parallel loss (ignored targets included) and forward_loss give the
// one-rank loss, and forward_last_logits gathers the one-rank logits.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <vector>

#include "parallel/mpi_test_env.h"
#include "shardlm/model/llama.h"
#include "shardlm/model/tensor_shard.h"
#include "shardlm/parallel/tensor.h"
#include "shardlm/parallel/topology.h"

namespace shardlm {
namespace {

using test::world;

constexpr int64_t kB = 2, kT = 24, kVocab = 40;

ModelConfig tiny(int64_t kv_heads, bool bias, bool tied) {
  ModelConfig c = model_preset("tiny");
  c.dim = 32;
  c.n_layers = 2;
  c.n_heads = 4;
  c.n_kv_heads = kv_heads;
  c.ffn_dim = 40;
  c.vocab_size = kVocab;
  c.attn_bias = bias;
  c.tie_embeddings = tied;
  return c;
}

struct Case {
  int tp;
  int64_t kv_heads = 4;
  bool bias = true;
  bool tied = false;
  Checkpointing checkpointing = Checkpointing::kNone;
  int64_t mlp_chunk_tokens = 1024;
  int64_t loss_chunk_tokens = 1024;
};

// Deterministic rows: two documents per row, next-token targets within each.
void fill(const BatchInputs& in) {
  uint64_t h = 12345;
  for (int64_t r = 0; r < kB; ++r)
    for (int64_t t = 0; t < kT; ++t) {
      const int64_t i = r * kT + t, start = t < 9 + r ? 0 : 9 + r;
      h = h * 6364136223846793005ull + 1442695040888963407ull;
      in.tokens.i32()[i] = int32_t((h >> 33) % kVocab);
      in.positions.i32()[i] = int32_t(t - start);
      in.seg_start.i32()[i] = int32_t(start);
    }
  for (int64_t i = 0; i < kB * kT; ++i) {
    const bool last = (i + 1) % kT == 0 || in.seg_start.i32()[i + 1] != in.seg_start.i32()[i];
    in.targets.i32()[i] = last ? kIgnoreIndex : in.tokens.i32()[i + 1];
  }
}

// One row of one document, for the last-token logits.
void fill_row(const BatchInputs& in) {
  for (int64_t t = 0; t < kT; ++t) {
    in.tokens.i32()[t] = int32_t((7 * t + 3) % kVocab);
    in.positions.i32()[t] = int32_t(t);
    in.seg_start.i32()[t] = 0;
    in.targets.i32()[t] = kIgnoreIndex;
  }
}

ModelOptions options(const Case& c) {
  ModelOptions o;
  o.max_batch = kB;
  o.max_seq = kT;
  o.checkpointing = c.checkpointing;
  o.mlp_chunk_tokens = c.mlp_chunk_tokens;
  o.loss_chunk_tokens = c.loss_chunk_tokens;
  return o;
}

void expect_matches(const Case& c) {
  Communicator& w = world();
  if (w.size() % c.tp != 0) return;  // this world has no such grid (np 4 runs every case)
  const ModelConfig full = tiny(c.kv_heads, c.bias, c.tied);
  auto be = make_backend(DeviceKind::kCpu);

  // The single-rank model, whole, on every rank.
  MemoryLedger ref_ledger;
  LlamaModel ref(full, options(c), *be, ref_ledger);
  ref.init_weights(7);
  fill(ref.inputs(kB, kT));
  ref.zero_grads();
  const float scale = 1.f / float(kB * kT);
  const double ref_loss = ref.forward_backward(kB, kT, scale).loss_sum;

  // This rank's shard, its weights sliced from the single-rank model's.
  ParallelDims dims;
  dims.tp = c.tp;
  const Topology topo(dims, w.size(), w.rank());
  auto tp_comm = w.split(int(topo.color(Axis::kTp)), int(topo.key(Axis::kTp)), "tp");
  TensorParallel seam(*tp_comm);
  const ModelConfig shard_cfg = tp_shard_config(full, c.tp);
  MemoryLedger ledger;
  LlamaModel model(shard_cfg, options(c), *be, ledger, nullptr, nullptr, nullptr,
                   c.tp > 1 ? &seam : nullptr);
  const std::vector<ShardPiece> pieces = tp_shard_pieces(full, c.tp, topo.coord(Axis::kTp));
  int64_t covered = 0;
  for (const ShardPiece& p : pieces) {
    std::copy_n(ref.params().f32() + p.full, p.count, model.params().f32() + p.shard);
    covered += p.count;
  }
  ASSERT_EQ(covered, model.layout().total);
  // Vocabulary-parallel: the shard holds V/tp rows of the embedding table (and of the head).
  EXPECT_EQ(model.layout().entries[0].shape, (Shape{kVocab / c.tp, full.dim}));
  fill(model.inputs(kB, kT));
  model.zero_grads();
  const double loss = model.forward_backward(kB, kT, scale).loss_sum;
  EXPECT_NEAR(loss, ref_loss, 1e-5 * std::abs(ref_loss));

  const float* rg = ref.grads().f32();
  const float* g = model.grads().f32();
  float gmax = 0;
  for (int64_t i = 0; i < ref.layout().total; ++i) gmax = std::max(gmax, std::abs(rg[i]));
  int bad = 0;
  for (const ShardPiece& p : pieces)
    for (int64_t i = 0; i < p.count && bad < 5; ++i)
      if (std::abs(g[p.shard + i] - rg[p.full + i]) > 2e-5f * gmax) {
        ++bad;
        ADD_FAILURE() << "gradient at full offset " << p.full + i << ": " << g[p.shard + i]
                      << " vs " << rg[p.full + i] << " (max |g| " << gmax << ")";
      }

  // The forward-only loss and the last row's whole-vocabulary logits (gathered over tp).
  fill(ref.inputs(kB, kT));
  fill(model.inputs(kB, kT));
  const LossResult ref_fwd = ref.forward_loss(kB, kT), fwd = model.forward_loss(kB, kT);
  EXPECT_EQ(fwd.n_valid, ref_fwd.n_valid);
  EXPECT_NEAR(fwd.loss_sum, ref_fwd.loss_sum, 1e-5 * std::abs(ref_fwd.loss_sum));
  std::vector<float> ref_logits, logits;
  fill_row(ref.inputs(1, kT));
  fill_row(model.inputs(1, kT));
  ref.forward_last_logits(kT, ref_logits);
  model.forward_last_logits(kT, logits);
  ASSERT_EQ(logits.size(), size_t(kVocab));
  ASSERT_EQ(ref_logits.size(), size_t(kVocab));
  for (int64_t j = 0; j < kVocab; ++j)
    EXPECT_NEAR(logits[j], ref_logits[j], 1e-4f) << "logit " << j;
}

TEST(TensorParallel, MatchesOneRankWithSlicedWeights) {
  for (int tp : {1, 2, 4}) {
    SCOPED_TRACE(tp);
    expect_matches({tp});
  }
}

TEST(TensorParallel, GroupedQueryAttentionAndTiedEmbeddings) {
  expect_matches({2, 2, false, true});
  expect_matches({4, 4, false, true});
}

TEST(TensorParallel, VocabularyParallelLossInChunks) {
  // 7-row loss chunks (the last one short) of V/tp logits each, tied and untied.
  for (int tp : {2, 4}) {
    SCOPED_TRACE(tp);
    expect_matches({tp, 4, true, false, Checkpointing::kNone, 1024, 7});
    expect_matches({tp, 4, false, true, Checkpointing::kSelective, 1024, 7});
  }
}

TEST(TensorParallel, CheckpointingAndChunkedMlpRecomputeTheSame) {
  for (Checkpointing mode : {Checkpointing::kSelective, Checkpointing::kFull}) {
    SCOPED_TRACE(checkpointing_name(mode));
    expect_matches({2, 4, true, false, mode, 7});
    expect_matches({4, 4, true, false, mode, 7});
  }
}

}  // namespace
}  // namespace shardlm
