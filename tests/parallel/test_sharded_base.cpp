// A dense frozen LoRA base sharded over the ranks (ModelSeams::base_shards, ZeRO-3's group):
// each rank holds its chunk of every decoder layer and gathers a layer when the model acquires
// it, so the model computes bitwise what the same model over the whole base computes: the loss
// and the adapters' gradients of a micro-batch (forward, the backward's recompute and
// backward), the evaluation loss and every unit's values read back; in f32 and bf16, with tied
// and untied embeddings, every layer kept or recomputed, the base on the device and in host
// memory (the tables in pieces, staged through two slots, the reference offloaded alike). A
// layer's elements are not a multiple of 4, so at 4 ranks the last chunk is padded. A rank
// holds less of the base than the whole, the gather buffer in comm. With prefetch the walk's
// next layer is gathered ahead into a second buffer: every such gather is then used, forward,
// in backward and through checkpoint recompute, and the results are bitwise those without.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <cstring>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "integration/grad_check_model.h"
#include "parallel/mpi_test_env.h"
#include "shardlm/model/llama.h"
#include "shardlm/model/sharded_base.h"
#include "test_util.h"

namespace shardlm {
namespace {

constexpr int64_t kB = 2, kT = 9;

// Layers of 2226 elements (2 x 1113, 4 x 556.5: padded); a [200, 18] table larger than a
// layer, so that the base in host memory hands it out in pieces.
ModelConfig sharded_config(bool tie, int layers = 2) {
  ModelConfig c = test::grad_check_config("sharded-base", tie, /*bias=*/true);
  c.n_layers = layers;
  c.dim = 18;
  c.n_heads = 3;
  c.n_kv_heads = 1;
  c.ffn_dim = 24;
  c.vocab_size = 200;
  return c;
}

struct Case {
  DType param;
  bool tie, on_host;
  Checkpointing checkpointing;
  bool prefetch = false;
  int layers = 2;
  int every = 1;  // checkpoint every `every`-th layer's input, recompute the rest (full only)
};

struct Outcome {
  LossResult train, eval;
  std::vector<float> adapter_grads, base;
  int64_t params_held = 0, comm = 0;
  DenseShardGatherCounts train_gathers;  // those of forward_backward
};

Outcome run(const Case& c, Communicator* shards) {
  const ModelConfig cfg = sharded_config(c.tie, c.layers);
  auto be = make_backend(DeviceKind::kCpu);
  MemoryLedger ledger;
  ModelOptions opt;
  opt.param_dtype = opt.activation_dtype = c.param;
  opt.max_batch = kB;
  opt.max_seq = kT;
  opt.mlp_chunk_tokens = 5;
  opt.loss_chunk_tokens = 7;
  opt.checkpointing = c.checkpointing;
  opt.checkpoint_placement.every = c.every;
  opt.lora = {.rank = 3, .alpha = 6, .dropout = 0.2, .targets = 0x7f};
  opt.lora.offload_base = c.on_host;
  opt.lora.prefetch_base = c.prefetch;
  LlamaModel model(cfg, opt, *be, ledger, {.base_shards = shards});
  model.init_weights(11);
  const std::vector<float> a = test::random_vec(model.lora_layout().params.total, 5, -0.4f, 0.4f);
  std::copy(a.begin(), a.end(), model.lora_params().f32());
  Outcome o;
  BatchInputs in = model.inputs(kB, kT);
  test::fill_grad_batch(in, kB, kT, cfg.vocab_size, 3);
  model.set_lora_dropout(17, 0);
  model.zero_grads();
  o.train = model.forward_backward(kB, kT, 1.f);
  o.train_gathers = model.base_gather_counts();
  const Tensor g = model.lora_grads();
  o.adapter_grads.assign(g.f32(), g.f32() + g.numel());
  o.eval = model.forward_loss(kB, kT);
  const ParamLayout& L = model.layout();
  o.base.resize(size_t(L.total));
  for (int u = 0; u < int(L.units.size()); ++u)
    model.read_base_unit(u, o.base.data() + L.units[u].begin);
  o.params_held = ledger.current(MemPool::kDevice, MemCategory::kParams) +
                  ledger.current(MemPool::kHost, MemCategory::kParams);
  o.comm = ledger.current(MemPool::kDevice, MemCategory::kComm);
  return o;
}

// The same losses, adapter gradients and base values, bit for bit.
void expect_bitwise(const Outcome& got, const Outcome& want) {
  EXPECT_EQ(got.train.loss_sum, want.train.loss_sum);
  EXPECT_EQ(got.train.n_valid, want.train.n_valid);
  EXPECT_EQ(got.eval.loss_sum, want.eval.loss_sum);
  ASSERT_EQ(got.adapter_grads.size(), want.adapter_grads.size());
  EXPECT_EQ(std::memcmp(got.adapter_grads.data(), want.adapter_grads.data(),
                        want.adapter_grads.size() * 4),
            0);
  ASSERT_EQ(got.base.size(), want.base.size());
  EXPECT_EQ(std::memcmp(got.base.data(), want.base.data(), want.base.size() * 4), 0);
}

std::string describe(const Case& c) {
  return fmt::format(
      "{}{}{} checkpointing {} every {}, {} layers{}", dtype_name(c.param),
      c.tie ? " tied" : " untied", c.on_host ? " base on the host" : " base on the device",
      checkpointing_name(c.checkpointing), c.every, c.layers, c.prefetch ? ", prefetch" : "");
}

TEST(ShardedBaseStore, ComputesBitwiseAsTheWholeBase) {
  Communicator& w = test::world();
  if (w.size() == 1) GTEST_SKIP() << "a base is sharded over more than one rank";
  const Checkpointing kNone = Checkpointing::kNone, kFull = Checkpointing::kFull;
  for (const Case base :
       {Case{DType::kF32, false, false, kNone}, Case{DType::kF32, true, false, kFull},
        Case{DType::kF32, false, true, kFull}, Case{DType::kF32, true, true, kNone},
        Case{DType::kBF16, false, false, kFull}, Case{DType::kBF16, true, true, kFull},
        Case{DType::kBF16, false, true, Checkpointing::kSelective}})
    for (const bool prefetch : {false, true}) {
      Case c = base;
      c.prefetch = prefetch;
      SCOPED_TRACE(describe(c));
      const Outcome whole = run(c, nullptr), sharded = run(c, &w);
      expect_bitwise(sharded, whole);
      // A rank's chunks and the whole tables, not the whole base; the layers gathered in comm.
      const ParamLayout L = make_param_layout(sharded_config(c.tie));
      const DenseShardLayout S = make_dense_shard_layout(L, w.size());
      EXPECT_LT(sharded.params_held, whole.params_held);
      EXPECT_EQ(sharded.comm - whole.comm, dense_shard_gather_buffers(prefetch) * S.gather_elems() *
                                               int64_t(dtype_size(c.param)));
    }
}

// With prefetch the walk's next layer's all-gather starts while the layer before it computes,
// and the walk then uses it. Without recompute every gather comes ahead: forward's L from the
// embeddings on, backward's L - 2 (forward's last two are still in the two buffers). With
// checkpoint recompute (every 2nd or 3rd layer's input kept) the recompute of a segment walks
// its layers ascending inside the backward and its gathers come ahead too, except where the
// walk jumps: every 2nd, the recomputed layers 2 and 0 (each its segment's first, reached from
// a later layer); every 3rd, layer 3 (its segment's first; it takes the buffer of layer 4, the
// least recently used, which then comes ahead again) and layers 0 and 1 (1 is not gathered
// ahead while the other buffer holds layer 2, gathered ahead for the backward, not used yet). A
// gather ahead is never in vain, no more gathers are made than without prefetch, and the results
// are bitwise the same.
TEST(ShardedBaseStore, PrefetchGathersTheNextLayerAhead) {
  Communicator& w = test::world();
  if (w.size() == 1) GTEST_SKIP() << "a base is sharded over more than one rank";
  constexpr int kLayers = 6;
  const Checkpointing kNone = Checkpointing::kNone, kFull = Checkpointing::kFull;
  struct Walk {
    Checkpointing mode;
    int every;
    int64_t ahead, gathers;  // forward_backward's, with prefetch
  };
  for (const bool on_host : {false, true})
    for (const bool tie : {false, true})
      for (const Walk walk : {Walk{kNone, 1, 2 * kLayers - 2, 2 * kLayers - 2},
                              Walk{kFull, 1, 2 * kLayers - 2, 2 * kLayers - 2},
                              Walk{kFull, 2, 8, 10}, Walk{kFull, 3, 11, 14}}) {
        Case c{DType::kBF16, tie, on_host, walk.mode, /*prefetch=*/false, kLayers, walk.every};
        SCOPED_TRACE(describe(c));
        const Outcome plain = run(c, &w);
        c.prefetch = true;
        const Outcome ahead = run(c, &w);
        expect_bitwise(ahead, plain);
        const DenseShardGatherCounts &p = plain.train_gathers, &a = ahead.train_gathers;
        EXPECT_EQ(p.ahead, 0);
        EXPECT_EQ(a.ahead, walk.ahead);
        EXPECT_EQ(a.gathers, walk.gathers);
        EXPECT_EQ(a.ahead_used, a.ahead);
        EXPECT_LE(a.gathers, p.gathers);
      }
}

}  // namespace
}  // namespace shardlm
