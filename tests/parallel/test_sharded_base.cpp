// A dense frozen LoRA base sharded over the ranks (ModelSeams::base_shards, ZeRO-3's group):
// each rank holds its chunk of every decoder layer and gathers a layer when the model acquires
// it, so the model computes bitwise what the same model over the whole base computes: the loss
// and the adapters' gradients of a micro-batch (forward, the backward's recompute and
// backward), the evaluation loss and every unit's values read back; in f32 and bf16, with tied
// and untied embeddings, every layer kept or recomputed, the base on the device and in host
// memory (the tables in pieces, staged through two slots, the reference offloaded alike). A
// layer's elements are not a multiple of 4, so at 4 ranks the last chunk is padded. A rank
// holds less of the base than the whole, the gather buffer in comm.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
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
ModelConfig sharded_config(bool tie) {
  ModelConfig c = test::grad_check_config("sharded-base", tie, /*bias=*/true);
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
};

struct Outcome {
  LossResult train, eval;
  std::vector<float> adapter_grads, base;
  int64_t params_held = 0, comm = 0;
};

Outcome run(const Case& c, Communicator* shards) {
  const ModelConfig cfg = sharded_config(c.tie);
  auto be = make_backend(DeviceKind::kCpu);
  MemoryLedger ledger;
  ModelOptions opt;
  opt.param_dtype = opt.activation_dtype = c.param;
  opt.max_batch = kB;
  opt.max_seq = kT;
  opt.mlp_chunk_tokens = 5;
  opt.loss_chunk_tokens = 7;
  opt.checkpointing = c.checkpointing;
  opt.lora = {.rank = 3, .alpha = 6, .dropout = 0.2, .targets = 0x7f};
  opt.lora.offload_base = c.on_host;
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

TEST(ShardedBaseStore, ComputesBitwiseAsTheWholeBase) {
  Communicator& w = test::world();
  if (w.size() == 1) GTEST_SKIP() << "a base is sharded over more than one rank";
  const Checkpointing kNone = Checkpointing::kNone, kFull = Checkpointing::kFull;
  for (const Case c :
       {Case{DType::kF32, false, false, kNone}, Case{DType::kF32, true, false, kFull},
        Case{DType::kF32, false, true, kFull}, Case{DType::kF32, true, true, kNone},
        Case{DType::kBF16, false, false, kFull}, Case{DType::kBF16, true, true, kFull},
        Case{DType::kBF16, false, true, Checkpointing::kSelective}}) {
    SCOPED_TRACE(::testing::Message() << dtype_name(c.param) << (c.tie ? " tied" : " untied")
                                      << (c.on_host ? " base on the host" : " base on the device")
                                      << " checkpointing " << checkpointing_name(c.checkpointing));
    const Outcome whole = run(c, nullptr), sharded = run(c, &w);
    EXPECT_EQ(sharded.train.loss_sum, whole.train.loss_sum);
    EXPECT_EQ(sharded.train.n_valid, whole.train.n_valid);
    EXPECT_EQ(sharded.eval.loss_sum, whole.eval.loss_sum);
    ASSERT_EQ(sharded.adapter_grads.size(), whole.adapter_grads.size());
    EXPECT_EQ(std::memcmp(sharded.adapter_grads.data(), whole.adapter_grads.data(),
                          whole.adapter_grads.size() * 4),
              0);
    ASSERT_EQ(sharded.base.size(), whole.base.size());
    EXPECT_EQ(std::memcmp(sharded.base.data(), whole.base.data(), whole.base.size() * 4), 0);
    // A rank's chunks and the whole tables, not the whole base; a layer gathered in comm.
    const ParamLayout L = make_param_layout(sharded_config(c.tie));
    const DenseShardLayout S = make_dense_shard_layout(L, w.size());
    EXPECT_LT(sharded.params_held, whole.params_held);
    EXPECT_EQ(sharded.comm - whole.comm, S.gather_elems() * int64_t(dtype_size(c.param)));
  }
}

}  // namespace
}  // namespace shardlm
