// Pipeline parallelism under mpiexec (1, 2, 4 ranks): LlamaModel stages (their layers from
// partition_layers, their weights sliced out of a single-rank model's by stage_shard_pieces)
// driven by the PipelineExecutor's 1F1B over 8 micro-batches give the loss and every gradient
// of the single-rank model accumulating over the same micro-batches, within fp32 tolerance;
// composed with tensor parallelism too, in every checkpointing mode and placement (every k-th
// layer kept, host layers), with bf16 activations, with LoRA adapters (the base frozen), and
// with tied embeddings held by the first and last stages (their gradients summed), with Qwen3's,
// Gemma 3's and GLM-4-0414's layers; and the forward-only sweep gives the single-rank evaluation
// loss.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <vector>

#include "parallel/mpi_test_env.h"
#include "parallel/shard_grads.h"
#include "shardlm/model/llama.h"
#include "shardlm/model/tensor_shard.h"
#include "shardlm/parallel/pipeline.h"
#include "shardlm/parallel/tensor.h"
#include "shardlm/parallel/topology.h"
#include "shardlm/plan/pipeline.h"
#include "tolerance.h"

namespace shardlm {
namespace {

using test::world;

constexpr int64_t kB = 2, kT = 16, kVocab = 40;
constexpr int kMicro = 8;

ModelConfig tiny() {
  ModelConfig c = model_preset("tiny");
  c.dim = 32;
  c.n_layers = 4;
  c.n_heads = 4;
  c.n_kv_heads = 2;
  c.ffn_dim = 40;
  c.vocab_size = kVocab;
  c.attn_bias = true;
  c.tie_embeddings = false;
  return c;
}

// Micro-batch i: deterministic rows of two documents, next-token targets within each.
void fill(const BatchInputs& in, int micro) {
  test::fill_two_documents(in, kB, kT, kVocab, 12345 + 977 * uint64_t(micro),
                           [micro](int64_t r) { return 5 + r + micro % 3; });
}

struct Case {
  int pp;
  int tp = 1;
  Checkpointing checkpointing = Checkpointing::kNone;
  bool tied = false;
  CheckpointPlacement placed = {};  // every k-th layer kept, host layers (per stage)
  DType act = DType::kF32;
  bool lora = false;    // rank-4 adapters on every projection, dropout 0.1
  int layers = 4;       // more than a placement's rotating slots: host layers come back
  bool qwen3 = false;   // q/k norms and heads of 12 (q is 48 wide, the model 32), no biases
  bool gemma3 = false;  // Qwen3's q/k norms with Gemma's post-norms, GeGLU, scaled embeddings
  bool glm4 = false;    // GLM-4-0414: q/k/v biases, heads of 12 with half their dims rotated in
                        // interleaved pairs, post-norms under GLM-4's names
};

ModelOptions options(const Case& c) {
  ModelOptions o;
  o.max_batch = kB;
  o.max_seq = kT;
  o.checkpointing = c.checkpointing;
  o.checkpoint_placement = c.placed;
  o.activation_dtype = c.act;
  o.mlp_chunk_tokens = 10;
  if (c.lora) o.lora = {.rank = 4, .alpha = 8, .dropout = 0.1, .targets = 0x7f};
  return o;
}

// The LoRA dropout mask of micro-batch i: one key per step, the micro-batch's first token.
void set_dropout(LlamaModel& m, int micro) { m.set_lora_dropout(99, int64_t(micro) * kB * kT); }

void expect_matches(const Case& c) {
  Communicator& w = world();
  if (w.size() % (c.pp * c.tp) != 0) return;  // no such grid in this world
  ModelConfig full = tiny();
  full.tie_embeddings = c.tied;
  full.n_layers = c.layers;
  full.attn_bias = !c.qwen3;
  full.qk_norm = c.qwen3;
  full.explicit_head_dim = c.qwen3 ? 12 : 0;
  if (c.gemma3) {
    full.attn_bias = false;
    full.qk_norm = full.post_norms = full.norm_one_plus_weight = full.embed_scale = true;
    full.explicit_head_dim = 12;
    full.mlp_activation = "gelu_tanh";
    full.query_pre_attn_scalar = 20;
    full.global_layer_every = 2;
  }
  if (c.glm4) {
    full.explicit_head_dim = 12;
    full.rope_partial_factor = 0.5;
    full.rope_interleaved = full.post_norms = true;
    full.post_norm_names = "glm4";
  }
  auto be = make_backend(DeviceKind::kCpu);

  // The single-rank model, whole, on every rank: 8 micro-batches accumulated.
  MemoryLedger ref_ledger;
  LlamaModel ref(full, options(c), *be, ref_ledger);
  ref.init_weights(7);
  if (c.lora) {  // non-zero adapters (B too), so that every adapter takes a gradient
    const Tensor a = ref.lora_params();
    for (int64_t i = 0; i < a.numel(); ++i) a.f32()[i] = 0.05f * std::sin(0.37f * float(i));
  }
  ref.zero_grads();
  const float scale = 1.f / float(kMicro * kB * kT);
  double ref_loss = 0, ref_eval = 0;
  for (int i = 0; i < kMicro; ++i) {
    fill(ref.inputs(kB, kT), i);
    set_dropout(ref, i);
    ref_loss += ref.forward_backward(kB, kT, scale).loss_sum;
  }
  for (int i = 0; i < kMicro; ++i) {
    fill(ref.inputs(kB, kT), i);
    ref_eval += ref.forward_loss(kB, kT).loss_sum;
  }

  ParallelDims dims;
  dims.pp = c.pp;
  dims.tp = c.tp;
  const Topology topo(dims, w.size(), w.rank());
  auto pp_comm = w.split(int(topo.color(Axis::kPp)), int(topo.key(Axis::kPp)), "pp");
  auto tp_comm = w.split(int(topo.color(Axis::kTp)), int(topo.key(Axis::kTp)), "tp");
  TensorParallel seam(*tp_comm, /*split_rows=*/false);
  const int stage = int(topo.coord(Axis::kPp));
  const StagePartition part =
      partition_layers(std::vector<double>(full.n_layers, 1.0), 0.5, 0.5, c.pp);
  ModelConfig stage_cfg = tp_shard_config(full, c.tp);
  stage_cfg.pp_begin = part.begin[stage];
  stage_cfg.pp_end = part.begin[stage + 1];

  MemoryLedger ledger;
  PipelineExecutor exec(*pp_comm, *be, ledger, kB * kT * full.dim, kMicro, c.act);
  ModelOptions opt = options(c);
  opt.pipeline_slots = exec.slots();
  LlamaModel model(stage_cfg, opt, *be, ledger, {.tp = c.tp > 1 ? &seam : nullptr});
  const std::vector<ShardPiece> pieces =
      stage_shard_pieces(full, stage_cfg.pp_begin, stage_cfg.pp_end, c.tp, topo.coord(Axis::kTp));
  int64_t covered = 0;
  for (const ShardPiece& p : pieces) {
    std::copy_n(ref.params().f32() + p.full, p.count, model.params().f32() + p.shard);
    covered += p.count;
  }
  ASSERT_EQ(covered, model.layout().total);
  const std::vector<ShardPiece> adapters =
      c.lora ? lora_stage_pieces(ref.lora_layout(), model.lora_layout())
             : std::vector<ShardPiece>{};
  for (const ShardPiece& p : adapters)
    std::copy_n(ref.lora_params().f32() + p.full, p.count, model.lora_params().f32() + p.shard);
  model.zero_grads();

  PipelineStageOps ops;
  ops.load = [&](int micro, int slot) { fill(model.stage_inputs(slot, kB, kT), micro); };
  ops.input = [&](int slot) { return model.stage_input(slot, kB, kT); };
  ops.forward = [&](int micro, int slot, LossResult* eval) {
    set_dropout(model, micro);
    return model.stage_forward(slot, kB, kT, eval);
  };
  ops.backward = [&](int micro, int slot, const Tensor& d_out) {
    set_dropout(model, micro);  // other micro-batches' forwards ran since this one's
    return model.stage_backward(slot, kB, kT, scale, d_out).loss_sum;
  };
  ops.input_grad = [&] { return model.stage_input_grad(kB, kT); };
  const PipelineStats st = exec.train(ops, kMicro, kB * kT * full.dim);
  EXPECT_GE(st.total_s, st.compute_s);
  // Tied embeddings: the first and last stages each hold the matrix; their gradients are
  // summed (what GradientAxes::sum_shared does before the update).
  const bool ends = stage == 0 || stage == c.pp - 1;
  auto tied_comm =
      w.split(ends ? int(w.rank() % (w.size() / c.pp)) : w.size() + w.rank(), stage, "tied");
  if (c.tied && ends && c.pp > 1) {
    const ParamLayout& L = model.layout();
    tied_comm->all_reduce(model.grads().rows(L.units[0].begin, L.unit_size(0)));
  }

  // The q/k norms' gradients cover each tp rank's heads: summed over tp (GradientAxes' part).
  if (c.tp > 1)
    for (auto [b, e] : tp_partial_ranges(model.layout(), /*sequence_parallel=*/false))
      tp_comm->all_reduce(model.grads().rows(b, e - b));

  // The loss is the last stage's: summed over the pipeline group (others add 0).
  if (stage + 1 < c.pp) {
    EXPECT_EQ(st.loss_sum, 0.0);
  }
  float lsum = float(st.loss_sum);
  pp_comm->all_reduce(Tensor(&lsum, DType::kF32, {1}, MemPool::kHost));
  // Micro-batches accumulated in the schedule's order, tp all-reduces, f32 loss partials.
  const double tol = test::reorder_tolerance(test::reduction_chain(full, kT, kMicro * kB));
  EXPECT_NEAR(lsum, ref_loss, tol * std::abs(ref_loss));

  const std::string where = "stage " + std::to_string(stage) + ": ";
  if (c.lora)
    test::expect_pieces_match(adapters, model.lora_grads().f32(), ref.lora_grads().f32(),
                              ref.lora_layout().params.total, tol, where);
  else
    test::expect_pieces_match(pieces, model.grads().f32(), ref.grads().f32(), ref.layout().total,
                              tol, where);

  // Evaluation: forwards only.
  const PipelineStats ev = exec.evaluate(ops, kMicro, kB * kT * full.dim);
  float esum = float(ev.loss_sum);
  pp_comm->all_reduce(Tensor(&esum, DType::kF32, {1}, MemPool::kHost));
  EXPECT_NEAR(esum, ref_eval, tol * std::abs(ref_eval));
}

TEST(PipelineStages, OneFOneBMatchesOneRankAccumulation) {
  for (int pp : {1, 2, 4}) {
    SCOPED_TRACE(pp);
    expect_matches({pp});
  }
}

TEST(PipelineStages, ComposesWithTensorParallelism) { expect_matches({2, 2}); }

TEST(PipelineStages, TiedEmbeddingsOnTheFirstAndLastStages) {
  for (int pp : {2, 4}) {
    SCOPED_TRACE(pp);
    expect_matches({pp, 1, Checkpointing::kNone, true});
  }
  expect_matches({2, 2, Checkpointing::kSelective, true});
}

TEST(PipelineStages, CheckpointingModesRecomputeTheSame) {
  for (Checkpointing mode : {Checkpointing::kSelective, Checkpointing::kFull}) {
    SCOPED_TRACE(checkpointing_name(mode));
    expect_matches({2, 1, mode});
  }
}

// Checkpoint placements on stages: every other layer's input kept (recomputing the rest), kept
// layers waiting on the host, both; each micro-batch in flight has its own slots and host
// places. pp 4 gives one layer per stage (a placement of one kept layer).
TEST(PipelineStages, CheckpointPlacementsPerMicroBatchInFlight) {
  const Checkpointing full = Checkpointing::kFull;
  const CheckpointPlacement all_host{.every = 1, .host_layers = CheckpointPlacement::kAll};
  for (int pp : {2, 4}) {  // 8 layers: 4 or 2 a stage
    SCOPED_TRACE(pp);
    expect_matches({pp, 1, full, false, {.every = 2}, DType::kF32, false, 8});
    expect_matches({pp, 1, full, false, all_host, DType::kF32, false, 8});
    expect_matches({pp, 1, full, false, {.every = 2, .host_layers = 1}, DType::kF32, false, 8});
  }
  expect_matches({2,
                  1,
                  Checkpointing::kSelective,
                  false,
                  {.every = 1, .host_layers = 3},
                  DType::kF32,
                  false,
                  8});
  expect_matches({2, 2, full, true, {.every = 2, .host_layers = 1}});  // tp and tied too
}

// bf16 activations (hidden states and their gradients travel in bf16): the same ops as the
// one-rank bf16 model, with and without a placement.
TEST(PipelineStages, Bf16ActivationsMatchTheOneRankBf16Model) {
  expect_matches({2, 1, Checkpointing::kSelective, false, {}, DType::kBF16});
  expect_matches(
      {2, 1, Checkpointing::kFull, false, {.every = 2, .host_layers = 1}, DType::kBF16, false, 8});
}

// LoRA on stages: the frozen base, each stage's adapters (its layers'), dropout masks per
// micro-batch recomputed in its backward after other micro-batches' forwards.
TEST(PipelineStages, LoraAdaptersMatchOneRank) {
  for (int pp : {2, 4}) {
    SCOPED_TRACE(pp);
    expect_matches({pp, 1, Checkpointing::kNone, false, {}, DType::kF32, true});
  }
  expect_matches(
      {2, 1, Checkpointing::kFull, false, {.every = 2, .host_layers = 1}, DType::kBF16, true, 8});
}

// Qwen3's layers split over stages (their q/k norm weights inside each stage's layer units),
// alone and with tp.
TEST(PipelineStages, QkNormsAndWideHeads) {
  for (int pp : {2, 4}) {
    SCOPED_TRACE(pp);
    expect_matches({.pp = pp, .qwen3 = true});
  }
  expect_matches({.pp = 2, .tp = 2, .checkpointing = Checkpointing::kFull, .qwen3 = true});
}

// Gemma 3's layers over stages: the embedding's scale on the first stage, post-norms inside
// each stage's layer units, local and global layers on different stages; tied and untied; and
// with tp (the post-norms on the summed row-parallel outputs, recomputed under full).
TEST(PipelineStages, GemmaLayers) {
  for (int pp : {2, 4}) {
    SCOPED_TRACE(pp);
    expect_matches({.pp = pp, .gemma3 = true});
  }
  expect_matches(
      {.pp = 2, .checkpointing = Checkpointing::kSelective, .tied = true, .gemma3 = true});
  for (Checkpointing mode : {Checkpointing::kNone, Checkpointing::kFull}) {
    SCOPED_TRACE(checkpointing_name(mode));
    expect_matches({.pp = 2, .tp = 2, .checkpointing = mode, .tied = true, .gemma3 = true});
  }
}

// GLM-4-0414's layers over stages (post-norm weights and q/k/v biases inside each stage's layer
// units, the partial interleaved rotary on every stage), alone, with tp (heads split, never a
// head's dims) recomputed under full checkpointing, and with LoRA adapters on every projection.
TEST(PipelineStages, Glm4Layers) {
  for (int pp : {2, 4}) {
    SCOPED_TRACE(pp);
    expect_matches({.pp = pp, .glm4 = true});
  }
  expect_matches({.pp = 2, .tp = 2, .checkpointing = Checkpointing::kFull, .glm4 = true});
  expect_matches({.pp = 2, .lora = true, .glm4 = true});
}

TEST(StageShardPieces, CoverTheWholeArenaOnceOverTheGrid) {
  const ModelConfig full = tiny();
  const ParamLayout whole = make_param_layout(full);
  for (int pp : {1, 2, 3, 4})
    for (int tp : {1, 2}) {
      const StagePartition part =
          partition_layers(std::vector<double>(full.n_layers, 1.0), 0.5, 0.5, pp);
      std::vector<int> seen(whole.total, 0);
      for (int s = 0; s < pp; ++s)
        for (int r = 0; r < tp; ++r) {
          ModelConfig sc = tp_shard_config(full, tp);
          sc.pp_begin = part.begin[s];
          sc.pp_end = part.begin[s + 1];
          const ParamLayout sl = make_param_layout(sc);
          ASSERT_EQ(sl.units.size(), whole.units.size());
          int64_t n = 0, last = -1;
          for (const ShardPiece& p : stage_shard_pieces(full, sc.pp_begin, sc.pp_end, tp, r)) {
            EXPECT_GT(p.shard, last);
            last = p.shard;
            n += p.count;
            for (int64_t i = 0; i < p.count; ++i) ++seen[p.full + i];
          }
          EXPECT_EQ(n, sl.total);
        }
      // Split tensors once over the grid; replicated ones (norms, embeddings, head) tp times.
      const auto replicated = tp_replicated_ranges(whole);
      for (int64_t i = 0; i < whole.total; ++i) {
        bool rep = false;
        for (auto [b, e] : replicated) rep = rep || (i >= b && i < e);
        ASSERT_EQ(seen[i], rep ? tp : 1) << "pp " << pp << " tp " << tp << " element " << i;
      }
    }
}

}  // namespace
}  // namespace shardlm
