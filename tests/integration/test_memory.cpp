// Memory accounting through the ledger: activations and kernel scratch grow linearly in the
// sequence length (attention and the loss never hold T x T or T x V), the plan equals the
// ledger category by category for the ZeRO engine's stages and every checkpointing mode (and
// for the end-of-run sample's model and decoder), the communicators' transport memory is
// planned on the device, and a step allocates nothing.
#include <gtest/gtest.h>

#include <cmath>

#include "shardlm/backend/backend.h"
#include "shardlm/comm/local.h"
#include "shardlm/model/decoder.h"
#include "shardlm/model/llama.h"
#include "shardlm/model/tensor_shard.h"
#include "shardlm/parallel/tensor.h"
#include "shardlm/parallel/zero.h"
#include "shardlm/plan/plan.h"
#include "shardlm/planner/plan_inputs.h"
#include "shardlm/train/trainer.h"

namespace shardlm {
namespace {

ModelConfig small_config() {
  ModelConfig c = model_preset("tiny");
  c.dim = 32;
  c.n_layers = 1;
  c.n_heads = 2;
  c.n_kv_heads = 1;
  c.ffn_dim = 64;
  return c;
}

struct Measured {
  int64_t activations, workspace, allocations_in_step;
  double loss;
};

// Runs one forward+backward at B=1 x T with documents of 1024 tokens (so the test stays
// fast; the causal tiles inside each document are still T-independent in size).
Measured run_at(int64_t T) {
  const ModelConfig cfg = small_config();
  auto be = make_backend(DeviceKind::kCpu);
  MemoryLedger ledger;
  ModelOptions opt;
  opt.max_batch = 1;
  opt.max_seq = T;
  opt.loss_chunk_tokens = 512;
  LlamaModel model(cfg, opt, *be, ledger);
  model.init_weights(1);
  BatchInputs in = model.inputs(1, T);
  for (int64_t t = 0; t < T; ++t) {
    const int64_t start = t / 1024 * 1024;
    in.tokens.i32()[t] = int32_t((t * 7) % 256);
    in.targets.i32()[t] = int32_t((t * 7 + 7) % 256);
    in.positions.i32()[t] = int32_t(t - start);
    in.seg_start.i32()[t] = int32_t(start);
  }
  const int64_t allocs = ledger.alloc_count();
  model.zero_grads();
  const LossResult r = model.forward_backward(1, T, 1.f / T);
  return {ledger.peak(MemPool::kDevice, MemCategory::kActivations) +
              ledger.peak(MemPool::kDevice, MemCategory::kCheckpoints),
          ledger.peak(MemPool::kDevice, MemCategory::kWorkspace), ledger.alloc_count() - allocs,
          r.loss_sum / r.n_valid};
}

TEST(Memory, ActivationsAndScratchAreLinearInSequenceLength) {
  const Measured a = run_at(8192);
  const Measured b = run_at(16384);
  EXPECT_TRUE(std::isfinite(a.loss));
  EXPECT_TRUE(std::isfinite(b.loss));
  EXPECT_EQ(a.allocations_in_step, 0);
  EXPECT_EQ(b.allocations_in_step, 0);
  // Linear: doubling T at most doubles the bytes (plus alignment slack). A T x T f32 buffer
  // at T = 16384 alone would be 1 GiB.
  const double act_ratio = double(b.activations) / double(a.activations);
  const double ws_ratio = double(b.workspace) / double(a.workspace);
  EXPECT_LE(act_ratio, 2.01);
  EXPECT_LE(ws_ratio, 2.01);
  const int64_t T = 16384;
  EXPECT_LT(b.activations + b.workspace, int64_t(T) * T * 4 / 16);
  // Per token the step holds a fixed number of bytes, whatever T.
  EXPECT_LT(double(b.activations + b.workspace) / T, 4096.0);
}

// The plan equals the ledger in both pools, category by category, for the engine the trainer
// runs (one rank here; tests/parallel/test_zero checks 2 and 4 ranks the same way) and every
// checkpointing mode, with checkpoints on the device or offloaded; and for a tensor-parallel
// shard (tp = 2) with and without sequence parallelism, with and without LoRA.
TEST(Memory, PlanEqualsLedgerByCategory) {
  struct Case {
    const char* precision;
    int stage;
    bool offload_optimizer, offload_params;
    Checkpointing checkpointing = Checkpointing::kNone;
    int host_checkpoints = 0;  // kept layers on the host (kAll: every one)
    int64_t mlp_chunk_tokens = 1024;
    int64_t lora_rank = 0;  // > 0: a frozen base, the engine holds the adapters
    double lora_dropout = 0;
    int64_t tp = 1;  // > 1: one tp rank's shard (only constructed: the plan of its buffers)
    bool sequence_parallel = false;
    int checkpoint_every = 1;
    bool offload_lora_base = false;
    bool qwen3 = false;     // q/k norms and heads of 48 (q_dim 192, dim 128), no biases
    bool nf4_base = false;  // the LoRA base's projections in NF4, a layer dequantized on use
    bool gemma3 = false;    // Qwen3's layers plus Gemma's post-norms, GeGLU, local rope bases
    bool glm4 = false;      // GLM-4-0414's layers: a quarter of each head rotated, post-norms
  };
  const Checkpointing kSelective = Checkpointing::kSelective, kFull = Checkpointing::kFull;
  const int kAll = CheckpointPlacement::kAll;
  for (const Case& c :
       {Case{"fp32", 0, false, false}, Case{"bf16", 0, false, false}, Case{"bf16", 1, true, false},
        Case{"fp32", 2, false, false}, Case{"bf16", 3, true, true},
        Case{"fp32", 0, false, false, Checkpointing::kNone, 0, 16},
        Case{"fp32", 0, false, false, kSelective, 0, 16},
        Case{"bf16", 1, true, false, kSelective, kAll, 40},
        Case{"fp32", 2, false, false, kFull, 0, 111},
        Case{"fp32", 0, false, false, kFull, kAll, 16}, Case{"bf16", 3, true, true, kFull, kAll, 7},
        Case{"fp32", 0, false, false, Checkpointing::kNone, 0, 1024, 4},
        Case{"bf16", 2, false, false, kSelective, 0, 16, 8, 0.1},
        Case{"bf16", 3, true, true, kFull, kAll, 7, 2, 0.05},
        Case{"fp32", 0, false, false, Checkpointing::kNone, 0, 16, 0, 0, 2, false},
        Case{"fp32", 0, false, false, Checkpointing::kNone, 0, 16, 0, 0, 2, true},
        Case{"bf16", 1, true, false, kSelective, kAll, 40, 0, 0, 2, true},
        Case{"fp32", 3, false, false, kFull, 0, 7, 0, 0, 2, true},
        // Placement: some layers on the host, every k-th layer's input only.
        Case{"fp32", 0, false, false, kSelective, 1, 16},
        Case{"bf16", 2, true, false, kFull, 2, 16},
        Case{"fp32", 0, false, false, kFull, 0, 16, 0, 0, 1, false, 2},
        Case{"bf16", 3, true, true, kFull, 1, 7, 0, 0, 1, false, 2},
        Case{"fp32", 1, false, false, kFull, kAll, 16, 4, 0, 1, false, 3},
        // A LoRA base in host memory, two of its units on the device.
        Case{"bf16", 0, false, false, kFull, kAll, 16, 4, 0, 1, false, 1, true},
        Case{"fp32", 3, true, true, kSelective, 0, 40, 8, 0.1, 1, false, 1, true},
        // Qwen3's layers: their q/k norm weights, and q_raw, k_raw and the norms' rstd kept or
        // recomputed.
        Case{"fp32", 0, false, false, Checkpointing::kNone, 0, 1024, 0, 0, 1, false, 1, false,
             true},
        Case{"bf16", 3, true, true, kSelective, kAll, 40, 0, 0, 1, false, 1, false, true},
        Case{"bf16", 1, false, false, kFull, 0, 16, 4, 0.1, 1, false, 1, false, true},
        Case{"fp32", 2, false, false, Checkpointing::kNone, 0, 16, 0, 0, 2, true, 1, false, true},
        // An NF4 base (QLoRA).
        Case{"bf16", 3, true, true, kFull, kAll, 7, 4, 0.1, 1, false, 1, false, false, true},
        Case{"fp32", 0, false, false, kSelective, 0, 16, 8, 0, 1, false, 1, false, false, true},
        // An NF4 base in host memory, two staged parts on the device (f32: the tables in pieces).
        Case{"fp32", 2, false, false, kFull, kAll, 16, 4, 0, 1, false, 1, true, false, true},
        Case{"bf16", 3, true, true, kSelective, 0, 40, 8, 0.1, 1, false, 1, true, false, true},
        // LoRA on a tp shard: the adapters split with their base projections.
        Case{"fp32", 0, false, false, Checkpointing::kNone, 0, 16, 4, 0, 2, false},
        Case{"bf16", 3, true, true, kFull, kAll, 7, 4, 0.1, 2, true},
        Case{"bf16", 1, false, false, kSelective, 0, 16, 8, 0.05, 2, true, 1, true},
        // An NF4 base on a tp shard (its shard of each projection quantized), on the device and
        // in host memory (the table slices whole).
        Case{"bf16", 3, true, true, kFull, kAll, 7, 4, 0.1, 2, true, 1, false, false, true},
        Case{"fp32", 0, false, false, kSelective, 0, 16, 8, 0, 2, false, 1, true, false, true},
        // Gemma 3's layers: two more norm weights a layer, the sublayers' outputs before their
        // norms (the MLP's a chunk's when not kept), d_post and the local rotary frequencies.
        Case{"fp32", 0, false, false, Checkpointing::kNone, 0, 1024, 0, 0, 1, false, 1, false, true,
             false, true},
        Case{"bf16", 3, true, true, kSelective, kAll, 40, 0, 0, 1, false, 1, false, true, false,
             true},
        Case{"bf16", 1, false, false, kFull, 0, 16, 4, 0.1, 1, false, 1, false, true, false, true},
        Case{"fp32", 2, false, false, kFull, 1, 7, 0, 0, 1, false, 2, false, true, false, true},
        // Gemma's layers on a tp shard: with the rows whole the MLP's post-norm runs per chunk;
        // split (sequence parallelism), on this rank's rows of the summed output, kept.
        Case{"fp32", 0, false, false, Checkpointing::kNone, 0, 16, 0, 0, 2, false, 1, false, true,
             false, true},
        Case{"bf16", 2, false, false, kFull, 1, 7, 0, 0, 2, false, 2, false, true, false, true},
        Case{"fp32", 1, false, false, kSelective, 0, 16, 0, 0, 2, true, 1, false, true, false,
             true},
        Case{"bf16", 3, true, true, kFull, kAll, 7, 0, 0, 2, true, 1, false, true, false, true},
        Case{"bf16", 1, false, false, kFull, 0, 16, 4, 0.1, 2, true, 1, false, true, false, true},
        // GLM-4-0414's layers: a shorter rotary table (interleaved pairs over part of a head),
        // q/k/v biases and the post-norms under GLM-4's names, whole and on a tp shard.
        Case{"fp32", 0, false, false, Checkpointing::kNone, 0, 1024, 0, 0, 1, false, 1, false,
             false, false, false, true},
        Case{"bf16", 3, true, true, kSelective, kAll, 40, 4, 0.1, 1, false, 1, false, false, false,
             false, true},
        Case{"bf16", 1, false, false, kFull, 0, 16, 0, 0, 2, true, 1, false, false, false, false,
             true}}) {
    SCOPED_TRACE(::testing::Message()
                 << c.precision << " stage " << c.stage << " checkpointing "
                 << checkpointing_name(c.checkpointing) << " host " << c.host_checkpoints
                 << " every " << c.checkpoint_every
                 << (c.offload_lora_base ? " base on the host" : "")
                 << (c.nf4_base ? " nf4 base" : "") << " mlp_chunk " << c.mlp_chunk_tokens
                 << " lora " << c.lora_rank << " tp " << c.tp
                 << (c.sequence_parallel ? " sequence parallel" : "") << (c.qwen3 ? " qwen3" : "")
                 << (c.gemma3 ? " gemma3" : "") << (c.glm4 ? " glm4" : ""));
    ModelConfig whole = model_preset("tiny");
    whole.attn_bias = !c.qwen3;
    whole.qk_norm = c.qwen3;
    whole.explicit_head_dim = c.qwen3 ? 48 : 0;
    if (c.gemma3) {
      whole.post_norms = whole.norm_one_plus_weight = whole.embed_scale = true;
      whole.mlp_activation = "gelu_tanh";
      whole.global_layer_every = 2;
      whole.query_pre_attn_scalar = 40;
      // Gemma 2's soft caps: applied in place and as read, they hold no memory of their own.
      whole.attn_softcap = 50;
      whole.final_softcap = 30;
    }
    if (c.glm4) {
      whole.rope_partial_factor = 0.25;
      whole.rope_interleaved = whole.post_norms = true;
      whole.post_norm_names = "glm4";
    }
    ModelConfig cfg = c.tp > 1 ? tp_shard_config(whole, c.tp) : whole;
    cfg.sequence_parallel = c.sequence_parallel;
    auto be = make_backend(DeviceKind::kCpu);
    MemoryLedger ledger;
    ModelOptions opt;
    opt.param_dtype = std::string(c.precision) == "bf16" ? DType::kBF16 : DType::kF32;
    opt.max_batch = 3;
    opt.max_seq = c.tp > 1 ? 38 : 37;  // sequence parallelism: tp divides the 3 x T rows
    opt.loss_chunk_tokens = 16;
    opt.mlp_chunk_tokens = c.mlp_chunk_tokens;
    opt.checkpointing = c.checkpointing;
    opt.checkpoint_placement = {c.checkpoint_every, c.host_checkpoints};
    if (c.lora_rank > 0) {
      opt.lora.rank = c.lora_rank;
      opt.lora.dropout = c.lora_dropout;
      opt.lora.targets = lora_targets_from_string(c.lora_dropout > 0 ? "all" : "q,v");
      opt.lora.offload_base = c.offload_lora_base;
      opt.lora.nf4_base = c.nf4_base;
    }
    LocalCommunicator one;
    ZeroOptions zo;
    zo.stage = c.stage;
    zo.offload_optimizer = c.offload_optimizer;
    zo.offload_params = c.offload_params;
    zo.bucket_elems = 100000;
    const ParamLayout layout = make_param_layout(cfg);
    const bool lora = c.lora_rank > 0;
    const LoraLayout lora_layout = lora ? make_lora_layout(cfg, opt.lora) : LoraLayout{};
    ZeroEngine zero(lora ? lora_layout.params : layout, lora ? DType::kF32 : opt.param_dtype, zo,
                    one, *be, *be, ledger);
    // The shard needs a seam; only its buffers are compared here.
    TensorParallel seam(one, cfg.seq_shards() > 1);
    LlamaModel model(cfg, opt, *be, ledger,
                     {.store = lora ? nullptr : &zero,
                      .adapters = lora ? &zero : nullptr,
                      .tp = c.tp > 1 ? &seam : nullptr});
    if (lora) {  // the frozen base: parameters only; gradients and Adam state are the adapters'
      const int64_t n = lora_layout.params.total;
      if (c.tp > 1) {  // each rank holds its share of the split adapters only
        EXPECT_LT(n, make_lora_layout(whole, opt.lora).params.total);
      }
      if (zo.stage == 0 && !zo.offload_optimizer) {  // one rank: no padding
        EXPECT_EQ(ledger.current(MemPool::kDevice, MemCategory::kGrads), n * 4);
        EXPECT_EQ(ledger.current(MemPool::kDevice, MemCategory::kOptimizer), 2 * n * 4);
      }
      const int64_t pb = int64_t(dtype_size(opt.param_dtype));
      // The base whole on the device, or on the host with two of its units on the device; in
      // NF4 less than dense.
      if (c.nf4_base)
        EXPECT_LT(ledger.current(MemPool::kDevice, MemCategory::kParams), layout.total * pb);
      else
        EXPECT_GE(ledger.current(c.offload_lora_base ? MemPool::kHost : MemPool::kDevice,
                                 MemCategory::kParams),
                  layout.total * pb);
      if (c.offload_lora_base) {
        EXPECT_LT(ledger.current(MemPool::kDevice, MemCategory::kParams), layout.total * pb);
      }
      if (c.offload_lora_base && c.nf4_base) {  // the 4-bit arrays on the host
        EXPECT_LT(ledger.current(MemPool::kHost, MemCategory::kParams), layout.total * pb);
      }
    }

    PlanInputs pin;
    pin.model = cfg;
    pin.micro_batch = opt.max_batch;
    pin.seq_len = opt.max_seq;
    pin.param_dtype = opt.param_dtype;
    pin.kernel_workspace_bytes = int64_t(model.kernel_workspace_bytes());
    pin.checkpointing = opt.checkpointing;
    pin.checkpoint_placement = opt.checkpoint_placement;
    pin.mlp_chunk_tokens = opt.mlp_chunk_tokens;
    pin.lora = opt.lora;
    set_plan_inputs(zo, one.size(), pin);
    const MemoryPlan plan = plan_memory(pin);
    for (int p = 0; p < kNumMemPools; ++p) {
      for (int k = 0; k < kNumMemCategories; ++k)
        EXPECT_EQ(plan.by_category[p][k], ledger.current(MemPool(p), MemCategory(k)))
            << mem_pool_name(MemPool(p)) << " " << mem_category_name(MemCategory(k));
      EXPECT_EQ(plan.peak_bytes[p], ledger.peak_total(MemPool(p)));
    }
  }
}

// What the communicators' transports hold on the device (NCCL's buffers, measured when they are
// made) is planned in the device pool's comm category, and moves nothing else.
TEST(Memory, CommunicatorTransportsArePlannedOnTheDevice) {
  auto be = make_backend(DeviceKind::kCpu);
  RunConfig cfg;
  cfg.model = small_config();
  cfg.data.seq_len = 64;
  constexpr int64_t kTransport = int64_t(3) << 20;
  const MemoryPlan without = plan_memory(plan_inputs_for(cfg, 1, *be));
  const MemoryPlan with = plan_memory(plan_inputs_for(cfg, 1, *be, 0, kTransport));
  const int dev = int(MemPool::kDevice), host = int(MemPool::kHost);
  for (int k = 0; k < kNumMemCategories; ++k) {
    const int64_t more = k == int(MemCategory::kComm) ? kTransport : 0;
    EXPECT_EQ(with.by_category[dev][k], without.by_category[dev][k] + more)
        << mem_category_name(static_cast<MemCategory>(k));
    EXPECT_EQ(with.by_category[host][k], without.by_category[host][k]);
  }
  EXPECT_EQ(with.peak_bytes[dev], without.peak_bytes[dev] + kTransport);
  EXPECT_EQ(with.peak_bytes[host], without.peak_bytes[host]);
}

// The end-of-run sample (trainer: sample_from_final_checkpoint) allocates what its plan says,
// category by category: the whole model's parameters, the cache, the decoder's runner.
TEST(Memory, SamplerPlanEqualsLedgerByCategory) {
  struct Case {
    const char* param;        // precision.param
    const char* activations;  // precision.activations
    int64_t seq_len;
    const char* family;  // "llama", "qwen3" (q/k norms) or "gemma3" (post-norms, local ropes)
  };
  auto be = make_backend(DeviceKind::kCpu);
  for (const Case c : {Case{"fp32", "auto", 64, "llama"}, Case{"bf16", "auto", 300, "llama"},
                       Case{"bf16", "auto", 1000, "qwen3"}, Case{"fp32", "auto", 257, "gemma3"},
                       Case{"fp32", "bf16", 128, "llama"}, Case{"bf16", "fp32", 256, "gemma3"}}) {
    SCOPED_TRACE(fmt::format("{}/{} seq_len {} {}", c.param, c.activations, c.seq_len, c.family));
    RunConfig cfg;
    cfg.model = small_config();
    if (std::string(c.family) != "llama") {
      cfg.model.qk_norm = true;
      cfg.model.explicit_head_dim = 24;
    }
    if (std::string(c.family) == "gemma3") {
      cfg.model.post_norms = true;
      cfg.model.global_layer_every = 2;
      cfg.model.n_layers = 2;
    }
    cfg.precision.param = c.param;
    cfg.precision.activations = c.activations;
    cfg.data.seq_len = c.seq_len;
    cfg.sample.prompt = std::string("a");  // a literal assigned trips GCC 12's -Wrestrict
    const std::optional<DecoderPlanInputs> in = sampler_plan_inputs_for(cfg, *be);
    ASSERT_TRUE(in.has_value());
    const MemoryPlan plan = plan_decoder_memory(*in);
    MemoryLedger ledger;
    LlamaModel model(cfg.model, sampler_model_options(cfg), *be, ledger);
    KvDecoder decoder(model, *be, ledger, c.seq_len, std::min(c.seq_len, kSamplePrefillChunk));
    for (int p = 0; p < kNumMemPools; ++p) {
      for (int k = 0; k < kNumMemCategories; ++k)
        EXPECT_EQ(plan.by_category[p][k],
                  ledger.peak(static_cast<MemPool>(p), static_cast<MemCategory>(k)))
            << "pool " << p << ", " << mem_category_name(static_cast<MemCategory>(k));
      EXPECT_EQ(plan.peak_bytes[p], ledger.peak_total(static_cast<MemPool>(p)));
    }
  }
}

}  // namespace
}  // namespace shardlm
