// Tensor parallelism under mpiexec (1, 2, 4 ranks): for each tp that divides the world, a
// model holding rank r's shard (tp_shard_config, its weights sliced out of a single-rank
// model's by tp_shard_pieces) with the TensorParallel seam over its tp group gives the loss of
// the single-rank model on the same rows, and gradients equal to the single-rank gradients
// sliced the same way, within fp32 tolerance (attention bias, grouped-query attention, the
// chunked MLP and every checkpointing mode, whose recompute reduces again), with sequence
// parallelism (the residual stream and norms split by rows across the tp group) on and off.
// The embedding table and the LM head are split by vocabulary rows (tied or not): the shard
// holds V/tp rows, the chunked vocabulary-parallel loss (ignored targets included) and
// forward_loss give the one-rank loss, each read once whatever the chunks, and
// forward_last_logits gathers the one-rank logits.
// Gemma 2's and 3's layers too (post-norms on the summed row-parallel outputs, soft caps,
// sliding windows, q/k norms). Also: the sequence-parallel collectives against their adjoints,
// and the ZeRO engine summing the norms' partial gradients over tp (its global norm is the
// single-rank model's).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <random>
#include <vector>

#include "loss_reads.h"
#include "parallel/mpi_test_env.h"
#include "parallel/shard_grads.h"
#include "shardlm/model/llama.h"
#include "shardlm/model/tensor_shard.h"
#include "shardlm/parallel/grid.h"
#include "shardlm/parallel/tensor.h"
#include "shardlm/parallel/topology.h"
#include "shardlm/parallel/zero.h"
#include "tolerance.h"

namespace shardlm {
namespace {

using test::world;

constexpr int64_t kB = 2, kT = 24, kVocab = 40;

// qwen3: q/k norms before RoPE and heads of 12 (q is 48 wide, the model 32).
ModelConfig tiny(int64_t kv_heads, bool bias, bool tied, bool qwen3 = false) {
  ModelConfig c = model_preset("tiny");
  c.qk_norm = qwen3;
  c.explicit_head_dim = qwen3 ? 12 : 0;
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

// Gemma's layers (version 2 or 3): post-norms around both sublayers, GeGLU, (1 + w) norms,
// scaled embeddings and queries, layer 0 local over a sliding window. Gemma 2: attention scores
// and logits soft-capped below their range (tanh well off its linear part); Gemma 3: q/k norms,
// heads of 12 (q 48 wide, the model 32), the local layer rotating with a base of its own.
void make_gemma(ModelConfig& c, int version) {
  c.attn_bias = false;
  c.post_norms = c.norm_one_plus_weight = c.embed_scale = true;
  c.mlp_activation = "gelu_tanh";
  c.query_pre_attn_scalar = 20;
  c.sliding_window = 5;
  c.global_layer_every = 2;
  if (version == 2) {
    c.attn_softcap = 0.05;
    c.final_softcap = 0.1;
    c.rope_local_theta = c.rope_theta;
  } else {
    c.qk_norm = true;
    c.explicit_head_dim = 12;
    c.rope_local_theta = 100.0;
  }
}

// GLM-4-0414's layers: half of each head rotated in interleaved pairs (the heads split across
// the ranks, never a head's dims), q/k/v biases, post-norms under GLM-4's names.
void make_glm4(ModelConfig& c) {
  c.rope_partial_factor = 0.5;
  c.rope_interleaved = c.post_norms = c.attn_bias = true;
  c.post_norm_names = "glm4";
}

// The single-rank model's weights; Gemma's norm weights off their identity start, so that each
// norm's scale counts.
void init_reference(LlamaModel& ref, int gemma) {
  ref.init_weights(7);
  if (gemma > 0)
    for (int64_t i = 0; i < ref.layout().total; ++i)
      ref.params().f32()[i] += 0.05f * std::sin(0.37f * float(i));
}

struct Case {
  int tp;
  int64_t kv_heads = 4;
  bool bias = true;
  bool tied = false;
  Checkpointing checkpointing = Checkpointing::kNone;
  int64_t mlp_chunk_tokens = 1024;
  bool sequence_parallel = false;
  int64_t loss_chunk_tokens = 1024;
  bool qwen3 = false;              // tiny(kv_heads, bias, tied, qwen3)
  std::vector<int64_t> windows{};  // per-layer sliding windows (ModelConfig::layer_windows)
  int gemma = 0;                   // 2 or 3: make_gemma's layers
  bool glm4 = false;               // GLM-4-0414's layers (make_glm4)
};

// Deterministic rows: two documents per row (the second from token 9 + r), next-token targets
// within each.
void fill(const BatchInputs& in) {
  test::fill_two_documents(in, kB, kT, kVocab, 12345, [](int64_t r) { return 9 + r; });
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

// Returns the shard's loss (NaN when this world has no such grid).
double expect_matches(const Case& c) {
  Communicator& w = world();
  if (w.size() % c.tp != 0) return std::nan("");  // no such grid (np 4 runs every case)
  ModelConfig full = tiny(c.kv_heads, c.bias, c.tied, c.qwen3);
  full.layer_windows = c.windows;
  if (c.gemma > 0) make_gemma(full, c.gemma);
  if (c.glm4) make_glm4(full);
  auto be = make_backend(DeviceKind::kCpu);

  // The single-rank model, whole, on every rank.
  MemoryLedger ref_ledger;
  LlamaModel ref(full, options(c), *be, ref_ledger);
  init_reference(ref, c.gemma);
  fill(ref.inputs(kB, kT));
  ref.zero_grads();
  const float scale = 1.f / float(kB * kT);
  const double ref_loss = ref.forward_backward(kB, kT, scale).loss_sum;

  // This rank's shard, its weights sliced from the single-rank model's.
  ParallelDims dims;
  dims.tp = c.tp;
  const Topology topo(dims, w.size(), w.rank());
  auto tp_comm = w.split(int(topo.color(Axis::kTp)), int(topo.key(Axis::kTp)), "tp");
  ModelConfig shard_cfg = tp_shard_config(full, c.tp);
  shard_cfg.sequence_parallel = c.sequence_parallel;
  TensorParallel seam(*tp_comm, shard_cfg.seq_shards() > 1);
  MemoryLedger ledger;
  test::LossReads counting;  // the shard's backend: the CPU's, its loss reads counted
  LlamaModel model(shard_cfg, options(c), counting, ledger, {.tp = c.tp > 1 ? &seam : nullptr});
  const std::vector<ShardPiece> pieces = tp_shard_pieces(full, c.tp, topo.coord(Axis::kTp));
  int64_t covered = 0;
  for (const ShardPiece& p : pieces) {
    std::copy_n(ref.params().f32() + p.full, p.count, model.params().f32() + p.shard);
    covered += p.count;
  }
  EXPECT_EQ(covered, model.layout().total);
  if (covered != model.layout().total) return std::nan("");
  // Vocabulary-parallel: the shard holds V/tp rows of the embedding table (and of the head).
  EXPECT_EQ(model.layout().entries[0].shape, (Shape{kVocab / c.tp, full.dim}));
  fill(model.inputs(kB, kT));
  model.zero_grads();
  const double loss = model.forward_backward(kB, kT, scale).loss_sum;
  // One read of the loss, whatever the chunks (the vocabulary-parallel loss's finishes add it
  // up on the device); one finish per chunk, each counted.
  const int64_t chunks = (kB * kT + c.loss_chunk_tokens - 1) / c.loss_chunk_tokens;
  EXPECT_EQ(counting.reads, 1);
  EXPECT_EQ(counting.finishes, c.tp > 1 ? chunks : 0);
  EXPECT_EQ(counting.counted, counting.finishes);
  // The tp all-reduces and the vocabulary-parallel loss sum in another order.
  const double tol = test::reorder_tolerance(test::reduction_chain(full, kT, kB));
  EXPECT_NEAR(loss, ref_loss, tol * std::abs(ref_loss));
  // The q/k norms' weight gradients cover each rank's heads only, and under sequence
  // parallelism every norm's its rows only; summed over the tp group (as the ZeRO engine does
  // before the optimizer) they are the whole gradient.
  if (c.tp > 1)
    for (auto [b, e] : tp_partial_ranges(model.layout(), c.sequence_parallel))
      tp_comm->all_reduce(model.grads().rows(b, e - b));

  test::expect_pieces_match(pieces, model.grads().f32(), ref.grads().f32(), ref.layout().total,
                            tol);

  // The forward-only loss and the last row's whole-vocabulary logits (gathered over tp).
  fill(ref.inputs(kB, kT));
  fill(model.inputs(kB, kT));
  const LossResult ref_fwd = ref.forward_loss(kB, kT), fwd = model.forward_loss(kB, kT);
  EXPECT_EQ(counting.reads, 2) << "forward_loss reads its loss once";
  EXPECT_EQ(fwd.n_valid, ref_fwd.n_valid);
  EXPECT_NEAR(fwd.loss_sum, ref_fwd.loss_sum, tol * std::abs(ref_fwd.loss_sum));
  std::vector<float> ref_logits, logits;
  fill_row(ref.inputs(1, kT));
  fill_row(model.inputs(1, kT));
  ref.forward_last_logits(kT, ref_logits);
  model.forward_last_logits(kT, logits);
  EXPECT_EQ(logits.size(), size_t(kVocab));
  EXPECT_EQ(ref_logits.size(), size_t(kVocab));
  double logit_max = 0;
  for (float l : ref_logits) logit_max = std::max(logit_max, double(std::abs(l)));
  for (int64_t j = 0;
       j < kVocab && logits.size() == size_t(kVocab) && ref_logits.size() == size_t(kVocab); ++j)
    EXPECT_NEAR(logits[j], ref_logits[j], tol * logit_max) << "logit " << j;
  return loss;
}

TEST(TensorParallel, MatchesOneRankWithSlicedWeights) {
  for (bool sp : {false, true})
    for (int tp : {1, 2, 4}) {
      SCOPED_TRACE(testing::Message() << "tp " << tp << " sequence_parallel " << sp);
      expect_matches({.tp = tp, .sequence_parallel = sp});
    }
}

// At tp = 2 a reduce-scatter adds the same two partial values as the all-reduce it replaces
// (a sum of two is exact either way round), and the LM head sees the same gathered rows: the
// loss is bitwise the one without sequence parallelism.
TEST(TensorParallel, SequenceParallelLossIsBitwiseAtTp2) {
  if (world().size() % 2 != 0) return;
  const double off = expect_matches({.tp = 2, .sequence_parallel = false});
  const double on = expect_matches({.tp = 2, .sequence_parallel = true});
  EXPECT_EQ(on, off);
  const Case tied_full{2, 2, false, true, Checkpointing::kFull, 7, false};
  Case tied_full_sp = tied_full;
  tied_full_sp.sequence_parallel = true;
  EXPECT_EQ(expect_matches(tied_full_sp), expect_matches(tied_full));
}

TEST(TensorParallel, GroupedQueryAttentionAndTiedEmbeddings) {
  for (bool sp : {false, true}) {
    SCOPED_TRACE(sp);
    expect_matches({2, 2, false, true, Checkpointing::kNone, 1024, sp});
    expect_matches({4, 4, false, true, Checkpointing::kNone, 1024, sp});
  }
}

// Qwen3's layers: each rank normalises its own heads of q and k with the replicated q/k norm
// weights, whose gradients are partial sums over the heads; every checkpointing mode.
// Sliding windows on the two packed documents per row (layer 0 windowed, layer 1 full or with
// a wider window): each tp rank's heads see the same window.
TEST(TensorParallel, SlidingWindows) {
  for (bool sp : {false, true})
    for (int tp : {2, 4})
      for (const std::vector<int64_t>& windows :
           {std::vector<int64_t>{3, 0}, std::vector<int64_t>{5, 11}}) {
        SCOPED_TRACE(testing::Message() << "tp " << tp << " sequence_parallel " << sp << " windows "
                                        << windows[0] << ", " << windows[1]);
        expect_matches({.tp = tp, .sequence_parallel = sp, .windows = windows});
      }
}

TEST(TensorParallel, QkNormsAndWideHeads) {
  for (bool sp : {false, true})
    for (Checkpointing mode : {Checkpointing::kNone, Checkpointing::kFull})
      for (int tp : {2, 4}) {
        SCOPED_TRACE(testing::Message() << "tp " << tp << " " << checkpointing_name(mode)
                                        << " sequence_parallel " << sp);
        expect_matches({.tp = tp,
                        .kv_heads = 4,
                        .bias = false,
                        .checkpointing = mode,
                        .mlp_chunk_tokens = 7,
                        .sequence_parallel = sp,
                        .qwen3 = true});
      }
}

TEST(TensorParallel, VocabularyParallelLossInChunks) {
  // 7-row loss chunks (the last one short) of V/tp logits each, tied and untied.
  for (bool sp : {false, true})
    for (int tp : {2, 4}) {
      SCOPED_TRACE(testing::Message() << "tp " << tp << " sequence_parallel " << sp);
      expect_matches({tp, 4, true, false, Checkpointing::kNone, 1024, sp, 7});
      expect_matches({tp, 4, false, true, Checkpointing::kSelective, 1024, sp, 7});
    }
}

TEST(TensorParallel, CheckpointingAndChunkedMlpRecomputeTheSame) {
  for (bool sp : {false, true})
    for (Checkpointing mode :
         {Checkpointing::kNone, Checkpointing::kSelective, Checkpointing::kFull}) {
      SCOPED_TRACE(testing::Message() << checkpointing_name(mode) << " sequence_parallel " << sp);
      expect_matches({2, 4, true, false, mode, 7, sp});
      expect_matches({4, 4, true, false, mode, 7, sp});
    }
}

// Gemma 2's and 3's layers: the post-norms on the row-parallel projections' summed outputs
// (all-reduced, or this rank's rows after the reduce-scatter), their weights' gradients partial
// over the rows under sequence parallelism; the soft caps on each rank's heads and each shard of
// logits; every checkpointing mode, the MLP in chunks (the last one short) and whole, tied.
TEST(TensorParallel, GemmaLayers) {
  for (int gemma : {2, 3})
    for (bool sp : {false, true})
      for (int tp : {2, 4}) {
        SCOPED_TRACE(testing::Message()
                     << "gemma " << gemma << " tp " << tp << " sequence_parallel " << sp);
        expect_matches({.tp = tp, .tied = true, .sequence_parallel = sp, .gemma = gemma});
        for (Checkpointing mode : {Checkpointing::kSelective, Checkpointing::kFull}) {
          SCOPED_TRACE(checkpointing_name(mode));
          expect_matches({.tp = tp,
                          .tied = true,
                          .checkpointing = mode,
                          .mlp_chunk_tokens = 7,
                          .sequence_parallel = sp,
                          .loss_chunk_tokens = 7,
                          .gemma = gemma});
        }
      }
  // Untied, GQA, the MLP in chunks with every row kept.
  expect_matches(
      {.tp = 2, .kv_heads = 2, .mlp_chunk_tokens = 7, .sequence_parallel = true, .gemma = 2});
}

// GLM-4-0414's layers under tp 2 and 4, with and without sequence parallelism, whole and
// recomputed with the MLP in chunks.
TEST(TensorParallel, GlmLayers) {
  for (bool sp : {false, true})
    for (int tp : {2, 4}) {
      SCOPED_TRACE(testing::Message() << "glm4 tp " << tp << " sequence_parallel " << sp);
      expect_matches({.tp = tp, .sequence_parallel = sp, .glm4 = true});
      expect_matches({.tp = tp,
                      .checkpointing = Checkpointing::kFull,
                      .mlp_chunk_tokens = 7,
                      .sequence_parallel = sp,
                      .glm4 = true});
    }
}

// Under sequence parallelism each tp rank's norm-weight gradients cover its rows only, and the
// q/k norms' its heads only (with or without); the ZeRO grid's GradientAxes sum them over the
// tp group before the global norm, which then is the single-rank model's (ZeRO stage 1 over the
// dp replicas, which all run the same batch at 1/dp of the gradient scale).
void expect_zero_sums_partial_gradients(bool qwen3, bool sp, int gemma = 0) {
  Communicator& w = world();
  ModelConfig full = tiny(4, !qwen3, false, qwen3);
  if (gemma > 0) make_gemma(full, gemma);
  auto be = make_backend(DeviceKind::kCpu);
  const Case c{.tp = 2, .sequence_parallel = sp};
  MemoryLedger ref_ledger;
  LlamaModel ref(full, options(c), *be, ref_ledger);
  init_reference(ref, gemma);
  fill(ref.inputs(kB, kT));
  ref.zero_grads();
  const float scale = 1.f / float(kB * kT);
  ref.forward_backward(kB, kT, scale);
  double ref_sq = 0;
  for (int64_t i = 0; i < ref.layout().total; ++i)
    ref_sq += double(ref.grads().f32()[i]) * ref.grads().f32()[i];

  for (int tp : {2, 4}) {
    if (w.size() % tp != 0) continue;
    SCOPED_TRACE(tp);
    ParallelDims dims;
    dims.tp = tp;
    const Topology topo(dims, w.size(), w.rank());
    const ParallelGrid grid(topo, w);
    Communicator* tp_comm = &grid.group(Axis::kTp);
    Communicator* zero_comm = &grid.zero();
    TensorParallel seam(*tp_comm, /*split_rows=*/sp);
    ModelConfig shard_cfg = tp_shard_config(full, tp);
    shard_cfg.sequence_parallel = sp;
    const ParamLayout layout = make_param_layout(shard_cfg);
    MemoryLedger ledger;
    ZeroOptions zo;
    zo.stage = 1;
    zo.overlap_comm = false;
    zo.bucket_elems = 4096;
    ZeroEngine zero(layout, DType::kF32, zo, *zero_comm, *be, *be, ledger);
    const GradientAxes axes(grid, shard_cfg, LoraConfig{});
    zero.set_gradient_axes(axes);
    LlamaModel model(shard_cfg, options(c), *be, ledger, {.store = &zero, .tp = &seam});
    std::vector<float> shard(layout.total);
    for (const ShardPiece& p : tp_shard_pieces(full, tp, topo.coord(Axis::kTp)))
      std::copy_n(ref.params().f32() + p.full, p.count, shard.data() + p.shard);
    for (int u = 0; u < int(layout.units.size()); ++u)
      zero.set_unit_values(u, shard.data() + layout.units[u].begin);
    fill(model.inputs(kB, kT));
    zero.begin_step(1);
    model.forward_backward(kB, kT, scale / float(zero_comm->size()));
    AdamWHyper h;
    h.lr = 0;
    const double norm = zero.step(h, 0.0);
    // The gradients' own reorder bound, then the f32 sum of their squares (leaving the norms
    // unsummed over the tp group is off by ~3e-5).
    const double tol = test::reorder_tolerance(test::reduction_chain(full, kT, kB)) +
                       test::gamma_n(DType::kF32, layout.total);
    EXPECT_NEAR(norm, std::sqrt(ref_sq), tol * std::sqrt(ref_sq));
  }
}

TEST(TensorParallel, ZeroSumsTheNormsPartialGradientsOverTp) {
  expect_zero_sums_partial_gradients(/*qwen3=*/false, /*sp=*/true);
}

// Gemma's post-norms too (and Gemma 3's q/k norms).
TEST(TensorParallel, ZeroSumsThePostNormsPartialGradientsOverTp) {
  for (int gemma : {2, 3})
    for (bool sp : {false, true}) {
      SCOPED_TRACE(testing::Message() << "gemma " << gemma << " sequence_parallel " << sp);
      expect_zero_sums_partial_gradients(/*qwen3=*/false, sp, gemma);
    }
}

TEST(TensorParallel, ZeroSumsTheQkNormsPartialGradientsOverTp) {
  for (bool sp : {false, true}) {
    SCOPED_TRACE(sp);
    expect_zero_sums_partial_gradients(/*qwen3=*/true, sp);
  }
}

// Sum over the group of a double, exactly the same on every rank (gathered as f64, added in
// rank order).
double group_sum(Communicator& c, double x) {
  ordered_sum(c, std::span<double>(&x, 1));
  return x;
}

double dot(const std::vector<float>& a, const std::vector<float>& b) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += double(a[i]) * b[i];
  return s;
}

// sum |a_i b_i|: the scale of dot(a, b)'s rounding.
double abs_dot(const std::vector<float>& a, const std::vector<float>& b) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += std::abs(double(a[i]) * b[i]);
  return s;
}

Tensor host(std::vector<float>& v, Shape shape) {
  return Tensor(v.data(), DType::kF32, shape, MemPool::kHost);
}

// The sequence-parallel collectives against their adjoints: over the tp group (the operator's
// domain and range are the ranks' tensors together), <A x, y> = <x, A* y> for random x and y,
// for the all-gather entering a column-parallel region (A* its input gradient, a reduce-scatter)
// and the reduce-scatter leaving a row-parallel one (A* its output gradient, an all-gather); and
// local_rows is the rank's block of what the all-gather assembles.
TEST(TensorParallel, SequenceCollectivesMatchTheirAdjoints) {
  Communicator& w = world();
  for (int tp : {1, 2, 4}) {
    if (w.size() % tp != 0) continue;
    SCOPED_TRACE(tp);
    ParallelDims dims;
    dims.tp = tp;
    const Topology topo(dims, w.size(), w.rank());
    auto tp_comm = w.split(int(topo.color(Axis::kTp)), int(topo.key(Axis::kTp)), "tp");
    TensorParallel seam(*tp_comm, /*split_rows=*/true);
    const int64_t n = 3, D = 5, N = n * tp;
    std::mt19937 rng(uint32_t(101 + w.rank()));
    std::normal_distribution<float> dist(0.f, 1.f);
    auto random = [&](int64_t count) {
      std::vector<float> v(count);
      for (float& x : v) x = dist(rng);
      return v;
    };
    std::vector<float> x = random(n * D), y = random(N * D);
    std::vector<float> gx(N * D), sy(n * D);
    EXPECT_EQ(seam.column_input(host(x, {n, D}), host(gx, {N, D})).data(), host(gx, {N, D}).data());
    EXPECT_EQ(seam.column_input_grad(host(y, {N, D}), host(sy, {n, D})).data(),
              host(sy, {n, D}).data());
    // The gather is exact; each reduce-scattered element sums tp f32 terms, within gamma_tp of
    // their magnitudes: |<x, A* y> - <A x, y>| <= gamma_tp <A|x|, |y|> (the dots are f64).
    const double lhs = group_sum(*tp_comm, dot(gx, y)), rhs = group_sum(*tp_comm, dot(x, sy));
    const double tol = test::gamma_n(DType::kF32, tp) + 0x1p-40;
    EXPECT_NEAR(lhs, rhs, tol * group_sum(*tp_comm, abs_dot(gx, y)));
    // local_rows of the gathered tensor is this rank's own block, bit for bit.
    const Tensor mine = seam.local_rows(host(gx, {N, D}));
    ASSERT_EQ(mine.dim(0), n);
    EXPECT_TRUE(std::equal(x.begin(), x.end(), mine.f32()));

    std::vector<float> p = random(N * D), z = random(n * D);
    std::vector<float> sp(n * D), gz(N * D);
    EXPECT_EQ(seam.row_output_buffer(host(sp, {n, D}), host(p, {N, D})).data(), p.data());
    seam.row_output(host(p, {N, D}), host(sp, {n, D}));
    EXPECT_EQ(seam.row_output_grad(host(z, {n, D}), host(gz, {N, D})).data(), gz.data());
    const double lhs2 = group_sum(*tp_comm, dot(sp, z)), rhs2 = group_sum(*tp_comm, dot(p, gz));
    EXPECT_NEAR(lhs2, rhs2, tol * group_sum(*tp_comm, abs_dot(p, gz)));
    // The gather in place (the local block is the full tensor's own block) gives the same.
    std::vector<float> inplace(N * D);
    const Tensor own = seam.local_rows(host(inplace, {N, D}));
    std::copy(x.begin(), x.end(), own.f32());
    seam.column_input(own, host(inplace, {N, D}));
    EXPECT_EQ(inplace, gx);
  }
}

}  // namespace
}  // namespace shardlm
