// ZeRO stages 0-3, with and without optimizer and parameter offload, under mpiexec at 1, 2 and
// 4 ranks: every rank also trains the same model alone (a LocalCommunicator, stage 0, the whole
// global batch as accumulated micro-batches) and the sharded run must follow it step by step,
// losses, gradient norms, Adam moments and final weights, within the bounds of tests/tolerance.h
// (AdamW's eps above the gradients' small elements). Each rank's memory is checked against the
// plan byte for byte and against 1/N of the single-rank figures. Gradients streamed to the host
// (stage >= 2 with the optimizer offloaded) give the device shard's results bit for bit; bf16
// reductions round each micro-batch's reduced gradients once and accumulate them in f32;
// non-finite gradients are found and their step skipped on every path; one rank reduces in
// place, with the arithmetic of the chunk buffers. GLM-4-0414's layers (partial interleaved
// rotary, q/k/v biases, post-norms) at stages 1-3. The bf16 reductions
// over more than one rank need a communicator that reduces bf16: until it does, those cases
// skip saying so.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "parallel/mpi_test_env.h"
#include "shardlm/comm/local.h"
#include "shardlm/core/dtype.h"
#include "shardlm/model/llama.h"
#include "shardlm/parallel/zero.h"
#include "shardlm/plan/plan.h"
#include "tolerance.h"

namespace shardlm {
namespace {

using test::world;

constexpr int kSteps = 20;
constexpr int64_t kT = 16;          // tokens per sequence
constexpr int64_t kGlobalRows = 8;  // sequences per step, over all ranks
constexpr int64_t kVocab = 64;
constexpr float kLr = 3e-3f;
constexpr double kClip = 1.0;
// Above the gradients' small elements, so that AdamW is Lipschitz in the gradient with a
// constant that makes its weights comparable (tests/tolerance.h).
constexpr float kAdamEps = 1e-2f;

// glm4: GLM-4-0414's layers: q/k/v biases, heads of 12 (q 48 wide, the model 32) of which the
// first 6 dims rotate in interleaved pairs, post-norms under GLM-4's names (more norm weights,
// without weight decay, inside the shards).
ModelConfig tiny(bool tied, int64_t vocab = kVocab, bool glm4 = false) {
  ModelConfig c = model_preset("tiny");
  c.dim = 32;
  c.n_layers = 3;
  c.n_heads = 4;
  c.n_kv_heads = 2;
  c.ffn_dim = 48;
  c.vocab_size = vocab;
  c.tie_embeddings = tied;
  c.attn_bias = !tied || glm4;  // biases (no weight decay) inside the shards too
  if (glm4) {
    c.explicit_head_dim = 12;
    c.rope_partial_factor = 0.5;
    c.rope_interleaved = c.post_norms = true;
    c.post_norm_names = "glm4";
  }
  return c;
}

// Row `row` of step `step`: a deterministic token sequence with a learnable pattern.
void fill_row(BatchInputs& in, int64_t b, int64_t step, int64_t row, int64_t vocab = kVocab) {
  uint64_t h = uint64_t(step * 131 + row * 7 + 1);
  for (int64_t t = 0; t < kT; ++t) {
    h = h * 6364136223846793005ull + 1442695040888963407ull;
    const int32_t tok = (t % 3 == 0) ? int32_t((h >> 33) % vocab) : int32_t((row + t) % vocab);
    in.tokens.i32()[b * kT + t] = tok;
    in.positions.i32()[b * kT + t] = int32_t(t);
    in.seg_start.i32()[b * kT + t] = 0;
  }
  for (int64_t t = 0; t < kT; ++t)
    in.targets.i32()[b * kT + t] = t + 1 < kT ? in.tokens.i32()[b * kT + t + 1] : kIgnoreIndex;
}

struct TrainedRun {
  std::vector<double> losses;
  std::vector<double> norms;  // the global gradient norm of every step, before clipping
  std::vector<float> params;  // final, whole, as f32 (on rank 0 of the group)
  std::vector<float> m;       // final Adam first moment, whole (rank 0)
  MemoryLedger ledger;
  MemoryPlan plan;
  ZeroLayout layout;
};

struct Case {
  const char* name;
  int stage;
  bool offload_optimizer = false;
  bool offload_params = false;
  bool bf16 = false;
  bool tied = false;
  bool overlap = true;
  int prefetch = 1;
  int64_t bucket_elems = 3000;  // several buckets, padding in most
  bool bf16_wire = false;       // zero.reduce_dtype bf16
  // Larger than a layer (7.8K elements) at 512: from stage 2 the untied tables are in pieces.
  int64_t vocab = kVocab;
  bool glm4 = false;  // GLM-4-0414's layers (tiny)
};

ZeroOptions zero_options(const Case& c) {
  ZeroOptions zo;
  zo.stage = c.stage;
  zo.offload_optimizer = c.offload_optimizer;
  zo.offload_params = c.offload_params;
  zo.overlap_comm = c.overlap;
  zo.prefetch = c.prefetch;
  zo.bucket_elems = c.bucket_elems;
  zo.reduce_dtype = c.bf16_wire ? DType::kBF16 : DType::kF32;
  return zo;
}

// The whole vector of state s on every rank: each rank's share (save_owned: disjoint ranges
// that cover the vector) widened to f32, the other ranks' elements zero bits, summed over the
// group as integers (exact: each element has one nonzero term).
std::vector<float> whole_state(ZeroEngine& zero, Communicator& dp, Backend& be, ZeroEngine::State s,
                               DType dt, int64_t total) {
  std::vector<float> out(size_t(total), 0.f);
  zero.save_owned(s, [&](int64_t begin, int64_t count, const void* data) {
    const Tensor share(const_cast<void*>(data), dt, {count}, MemPool::kHost);
    const Tensor to(out.data() + begin, DType::kF32, {count}, MemPool::kHost);
    if (dt == DType::kF32)
      be.copy(share, to);
    else
      be.convert(share, to);
  });
  dp.all_reduce(Tensor(out.data(), DType::kI32, {total}, MemPool::kHost));
  return out;
}

// Trains kSteps steps over `dp`, each rank taking its block of every step's rows as
// micro-batches of one sequence.
void train(const Case& c, Communicator& dp, TrainedRun& run) {
  const ModelConfig cfg = tiny(c.tied, c.vocab, c.glm4);
  auto be = make_backend(DeviceKind::kCpu);
  auto host = make_backend(DeviceKind::kCpu);
  const ParamLayout layout = make_param_layout(cfg);
  const DType pdt = c.bf16 ? DType::kBF16 : DType::kF32;
  const ZeroOptions zo = zero_options(c);
  ZeroEngine zero(layout, pdt, zo, dp, *be, *host, run.ledger);
  ModelOptions mo;
  mo.param_dtype = pdt;
  mo.max_batch = 1;
  mo.max_seq = kT;
  mo.loss_chunk_tokens = 8;
  LlamaModel model(cfg, mo, *be, run.ledger, {.store = &zero});
  initial_weights(cfg, layout, 42, [&](int u, const float* v) { zero.set_unit_values(u, v); });
  run.layout = zero.zero_layout();

  PlanInputs pin;
  pin.model = cfg;
  pin.micro_batch = 1;
  pin.seq_len = kT;
  pin.param_dtype = pdt;
  pin.kernel_workspace_bytes = int64_t(model.kernel_workspace_bytes());
  set_plan_inputs(zo, dp.size(), pin);
  run.plan = plan_memory(pin);

  const int64_t rows = kGlobalRows / dp.size();
  const int64_t targets = kGlobalRows * (kT - 1);
  for (int step = 1; step <= kSteps; ++step) {
    zero.begin_step(int(rows));
    double loss = 0;
    for (int64_t r = 0; r < rows; ++r) {
      BatchInputs in = model.inputs(1, kT);
      fill_row(in, 0, step, dp.rank() * rows + r, c.vocab);
      loss += model.forward_backward(1, kT, 1.f / float(targets)).loss_sum;
    }
    zero.drain();
    float total = float(loss);
    dp.all_reduce(Tensor(&total, DType::kF32, {1}, MemPool::kHost));
    AdamWHyper h;
    h.lr = kLr;
    h.beta1 = 0.9f;
    h.beta2 = 0.95f;
    h.weight_decay = 0.1f;
    h.eps = kAdamEps;
    run.norms.push_back(zero.step(h, kClip));
    run.losses.push_back(double(total) / double(targets));
  }
  run.params = whole_state(zero, dp, *be, ZeroEngine::State::kParams, pdt, layout.total);
  run.m = whole_state(zero, dp, *be, ZeroEngine::State::kAdamM, DType::kF32, layout.total);
}

// The relative bound on a loss or a gradient element (relative to the norm) of the run against
// the one-rank run (tests/tolerance.h): fp32 sums in another order through the model's
// reductions; with bf16 parameters and activations, the bf16 stores along a token's chain that
// may round the other way, averaged over the step's tokens; on a bf16 wire, each micro-batch's
// reduced gradient rounded once and every sum over ranks once more, which the one-rank f32
// reference does not.
struct Tolerances {
  double relative;       // losses, gradient elements (relative to the norm)
  double norm_relative;  // the gradient norm: its elements, then the sum of their squares
};

Tolerances tolerances(const Case& c, int ranks) {
  const ModelConfig cfg = tiny(c.tied, c.vocab, c.glm4);
  double relative = test::reorder_tolerance(test::reduction_chain(cfg, kT, kGlobalRows));
  if (c.bf16)
    relative += test::bf16_mean_tolerance(test::bf16_stores_per_token(cfg), kGlobalRows * kT);
  if (c.bf16_wire) relative += 2.0 * ranks * test::unit_roundoff(DType::kBF16);
  return {relative, relative + test::gamma_n(DType::kF32, make_param_layout(cfg).total)};
}

double max_abs(const std::vector<float>& v) {
  double m = 0;
  for (float x : v) m = std::max(m, double(std::abs(x)));
  return m;
}

class Zero : public ::testing::TestWithParam<Case> {};

TEST_P(Zero, MatchesOneRankWithTheSameGlobalBatch) {
  const Case& c = GetParam();
  Communicator& dp = world();
  // The reference: this process alone, stage 0, the whole global batch.
  Case ref_case = c;
  ref_case.stage = 0;
  ref_case.offload_optimizer = ref_case.offload_params = false;
  ref_case.bf16_wire = false;
  LocalCommunicator local("alone");
  TrainedRun ref, got;
  train(ref_case, local, ref);
  train(c, dp, got);

  ASSERT_EQ(got.losses.size(), ref.losses.size());
  ASSERT_EQ(got.norms.size(), ref.norms.size());
  const Tolerances tol = tolerances(c, dp.size());
  double largest_norm = 0;
  for (size_t i = 0; i < ref.losses.size(); ++i) {
    EXPECT_NEAR(got.losses[i], ref.losses[i], tol.relative * ref.losses[i]) << "step " << i + 1;
    EXPECT_NEAR(got.norms[i], ref.norms[i], tol.norm_relative * ref.norms[i])
        << "gradient norm, step " << i + 1;
    largest_norm = std::max(largest_norm, ref.norms[i]);
  }
  if (dp.rank() == 0) {
    ASSERT_EQ(got.params.size(), ref.params.size());
    ASSERT_EQ(got.m.size(), ref.m.size());
    double worst = 0, worst_m = 0;
    for (size_t i = 0; i < ref.params.size(); ++i) {
      worst = std::max(worst, double(std::abs(got.params[i] - ref.params[i])));
      worst_m = std::max(worst_m, double(std::abs(got.m[i] - ref.m[i])));
    }
    // Every gradient element is at most the norm (clipped to kClip), so each step's gradients
    // differ by at most tol.relative times that, twice when clipping scales them by a factor
    // computed from the norm; AdamW's first moment (weights summing to at most one) by as much;
    // the weights by the Lipschitz bound, and bf16 weights by one more rounding of their f32
    // masters (2 u of the largest).
    const double grad_bound =
        (largest_norm > kClip ? 2 : 1) * tol.relative * std::min(largest_norm, kClip);
    const double lipschitz = test::adamw_lipschitz(kLr, kAdamEps, 0.9, 0.95, kSteps);
    double weight_tol = test::weight_bound(lipschitz, grad_bound, kSteps);
    if (c.bf16) weight_tol += 2 * test::unit_roundoff(DType::kBF16) * max_abs(ref.params);
    EXPECT_LE(worst, weight_tol) << "largest weight difference";
    EXPECT_LE(worst_m, grad_bound) << "largest Adam moment difference";
  }

  // Memory: the plan is exact, category by category, in both pools.
  for (int p = 0; p < kNumMemPools; ++p)
    for (int k = 0; k < kNumMemCategories; ++k)
      EXPECT_EQ(got.plan.by_category[p][k], got.ledger.peak(MemPool(p), MemCategory(k)))
          << mem_pool_name(MemPool(p)) << " " << mem_category_name(MemCategory(k));

  // And 1/N of the single-rank figures, plus at most one padding element per bucket.
  const int n = dp.size();
  const ZeroLayout& z = got.layout;
  const ParamLayout model_layout = make_param_layout(tiny(c.tied, c.vocab, c.glm4));
  const int64_t total = model_layout.total;
  if (c.vocab > kVocab && c.stage >= 2) {
    // The tables in pieces: every bucket within a layer, not the [V, D] table.
    EXPECT_GT(z.piece_rows[0], 0);
    EXPECT_EQ(z.piece_rows[model_layout.head_unit] > 0, !c.tied);
    EXPECT_LE(z.max_bucket, model_layout.max_layer + n - 1);
    EXPECT_LT(z.max_bucket, model_layout.unit_size(0));
  }
  EXPECT_LE(z.shard * n, total + int64_t(z.buckets.size()) * (n - 1));
  const int64_t pb = c.bf16 ? 2 : 4;
  const MemPool opt_pool = c.offload_optimizer ? MemPool::kHost : MemPool::kDevice;
  const int n_opt = (c.bf16 || c.offload_optimizer) ? 3 : 2;
  auto peak = [&](MemPool p, MemCategory k) { return got.ledger.peak(p, k); };
  const int64_t model_params = rotary_table_bytes(tiny(c.tied, c.vocab, c.glm4));
  EXPECT_EQ(peak(opt_pool, MemCategory::kOptimizer),
            n_opt * (c.stage >= 1 ? z.shard : z.padded_total) * 4);
  if (c.offload_optimizer) {
    EXPECT_EQ(peak(MemPool::kDevice, MemCategory::kOptimizer), 0);
  }
  if (c.stage >= 2) {  // the f32 shard: on the host when streamed there, no device gradients
    const bool streamed = c.offload_optimizer;
    EXPECT_EQ(peak(streamed ? MemPool::kHost : MemPool::kDevice, MemCategory::kGrads), z.shard * 4);
    EXPECT_EQ(peak(streamed ? MemPool::kDevice : MemPool::kHost, MemCategory::kGrads), 0);
  }
  if (c.stage == 3) {
    const MemPool param_pool = c.offload_params ? MemPool::kHost : MemPool::kDevice;
    EXPECT_EQ(peak(param_pool, MemCategory::kParams) - (c.offload_params ? 0 : model_params),
              z.shard * pb);
    if (c.offload_params) {
      EXPECT_EQ(peak(MemPool::kDevice, MemCategory::kParams), model_params);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Stages, Zero,
    ::testing::Values(
        Case{"stage0", 0}, Case{"stage0_offload", 0, true}, Case{"stage1", 1},
        Case{"stage1_offload", 1, true}, Case{"stage1_bf16_tied", 1, false, false, true, true},
        Case{"stage2", 2}, Case{"stage2_offload", 2, true},
        Case{"stage2_tied_no_overlap", 2, false, false, false, true, false},
        Case{"stage2_bf16_offload", 2, true, false, true}, Case{"stage3", 3},
        Case{"stage3_offload", 3, true}, Case{"stage3_offload_params", 3, true, true},
        Case{"stage3_tied_prefetch2", 3, false, false, false, true, true, 2},
        Case{"stage3_bf16_offload_params_tied", 3, true, true, true, true},
        Case{"stage3_no_prefetch_one_bucket_per_unit", 3, false, false, false, false, true, 0, 1},
        Case{.name = "stage2_bf16_wire", .stage = 2, .bf16_wire = true},
        Case{.name = "stage3_offload_bf16_wire_tied",
             .stage = 3,
             .offload_optimizer = true,
             .tied = true,
             .bf16_wire = true},
        Case{.name = "stage1_large_vocab_whole_tables", .stage = 1, .vocab = 512},
        Case{.name = "stage2_tables_in_pieces", .stage = 2, .vocab = 512},
        Case{.name = "stage3_bf16_offload_params_tables_in_pieces",
             .stage = 3,
             .offload_optimizer = true,
             .offload_params = true,
             .bf16 = true,
             .vocab = 512},
        Case{.name = "stage2_tied_tables_in_pieces", .stage = 2, .tied = true, .vocab = 512},
        Case{.name = "stage3_offload_tied_tables_in_pieces",
             .stage = 3,
             .offload_optimizer = true,
             .tied = true,
             .vocab = 512},
        Case{.name = "stage3_offload_bf16_wire_tables_in_pieces",
             .stage = 3,
             .offload_optimizer = true,
             .bf16_wire = true,
             .vocab = 512},
        Case{.name = "stage1_glm4", .stage = 1, .glm4 = true},
        Case{.name = "stage2_offload_glm4", .stage = 2, .offload_optimizer = true, .glm4 = true},
        Case{.name = "stage3_glm4", .stage = 3, .glm4 = true},
        Case{.name = "stage3_bf16_offload_params_glm4",
             .stage = 3,
             .offload_optimizer = true,
             .offload_params = true,
             .bf16 = true,
             .glm4 = true}),
    [](const ::testing::TestParamInfo<Case>& info) { return std::string(info.param.name); });

// Streaming the gradients to the host changes where they are accumulated, not how: the same
// chunks are added in the same order, so a streamed run (stage >= 2, optimizer offloaded)
// follows the same run with the shard on the device bit for bit (AdamW runs the same kernel on
// either backend here), over micro-batches accumulated (8, 4 or 2 per step at 1, 2, 4 ranks).
// With bf16 parameters the host steps the shard a piece at a time and returns each piece through
// one of two rotating buffers: the same AdamW per element, no shard-sized host copy.
class ZeroStreamed : public ::testing::TestWithParam<Case> {};

TEST_P(ZeroStreamed, EqualsTheDeviceShardBitwise) {
  const Case& c = GetParam();
  ASSERT_TRUE(c.offload_optimizer && c.stage >= 2);
  Communicator& dp = world();
  Case device_case = c;
  device_case.offload_optimizer = device_case.offload_params = false;
  TrainedRun streamed, device;
  train(c, dp, streamed);
  train(device_case, dp, device);
  EXPECT_EQ(streamed.ledger.peak(MemPool::kDevice, MemCategory::kGrads), 0);
  EXPECT_GT(device.ledger.peak(MemPool::kDevice, MemCategory::kGrads), 0);
  if (c.bf16 && !c.offload_params) {  // host staging: the gradients' chunks, two return pieces,
                                      // the checkpoint's staging
    const ZeroLayout& z = streamed.layout;
    const int64_t chunk_staging = z.max_chunk * (c.bf16_wire ? 2 + 4 : 4);
    const int64_t piece = std::min(z.max_chunk, c.bucket_elems);
    EXPECT_LT(piece, z.shard);
    EXPECT_EQ(streamed.ledger.peak(MemPool::kHost, MemCategory::kHostOffload),
              zero_grad_buffers(c.tied) * chunk_staging + kZeroParamReturnBuffers * piece * 2 +
                  zero_checkpoint_stage_elems(z, c.bucket_elems) * 4);
  }
  ASSERT_EQ(streamed.losses.size(), device.losses.size());
  for (size_t i = 0; i < device.losses.size(); ++i)
    EXPECT_EQ(streamed.losses[i], device.losses[i]) << "step " << i + 1;
  if (dp.rank() == 0) {
    ASSERT_EQ(streamed.params.size(), device.params.size());
    ASSERT_EQ(streamed.m.size(), device.m.size());
    EXPECT_EQ(std::memcmp(streamed.params.data(), device.params.data(),
                          device.params.size() * sizeof(float)),
              0)
        << "final weights differ";
    EXPECT_EQ(std::memcmp(streamed.m.data(), device.m.data(), device.m.size() * sizeof(float)), 0)
        << "final Adam moments differ";
  }
}

INSTANTIATE_TEST_SUITE_P(
    Offload, ZeroStreamed,
    ::testing::Values(
        Case{.name = "stage2", .stage = 2, .offload_optimizer = true},
        Case{.name = "stage2_bf16_tied_no_overlap",
             .stage = 2,
             .offload_optimizer = true,
             .bf16 = true,
             .tied = true,
             .overlap = false},
        Case{
            .name = "stage3_params", .stage = 3, .offload_optimizer = true, .offload_params = true},
        Case{.name = "stage3_bf16_tied",
             .stage = 3,
             .offload_optimizer = true,
             .bf16 = true,
             .tied = true},
        Case{.name = "stage3_bf16_wire", .stage = 3, .offload_optimizer = true, .bf16_wire = true},
        // every unit a bucket of its own, returned in pieces of 1000 that cut its segments
        Case{.name = "stage2_bf16_small_pieces",
             .stage = 2,
             .offload_optimizer = true,
             .bf16 = true,
             .bucket_elems = 1000}),
    [](const ::testing::TestParamInfo<Case>& info) { return std::string(info.param.name); });

// The engine without a model: backward is played by writing chosen gradients into every unit,
// last to first, for each micro-batch of one step.
struct Synthetic {
  std::unique_ptr<Backend> be = make_backend(DeviceKind::kCpu);
  std::unique_ptr<Backend> host = make_backend(DeviceKind::kCpu);
  ParamLayout layout = make_param_layout(tiny(false));
  MemoryLedger ledger;
  Communicator& dp;
  ZeroEngine zero;

  Synthetic(const Case& c, Communicator& group)
      : dp(group), zero(layout, DType::kF32, zero_options(c), dp, *be, *host, ledger) {
    std::vector<float> w(size_t(layout.max_unit), 0.5f);
    for (int u = 0; u < int(layout.units.size()); ++u) zero.set_unit_values(u, w.data());
  }

  // grad(micro, flat) for every element of the arena, in `micro_batches` backward passes.
  template <class F>
  void backward(int micro_batches, F&& grad) {
    zero.begin_step(micro_batches);
    for (int m = 0; m < micro_batches; ++m) {
      zero.begin_pass(ParamStore::Pass::kBackward);
      for (int u = int(layout.units.size()) - 1; u >= 0; --u) {
        const Tensor g = zero.acquire_grads(u);
        for (int64_t j = 0; j < g.numel(); ++j) g.f32()[j] = grad(m, layout.units[u].begin + j);
        zero.release_grads(u);
      }
      zero.end_pass();
    }
  }

  // With beta1 = 0 and no clipping Adam's first moment after the step is the gradient itself.
  double step_reading_gradients(std::vector<float>& grads) {
    AdamWHyper h;
    h.lr = 1e-3f;
    h.beta1 = 0.f;
    const double norm = zero.step(h, 0.0);
    grads = whole_state(zero, dp, *be, ZeroEngine::State::kAdamM, DType::kF32, layout.total);
    return norm;
  }

  std::vector<float> params() {
    return whole_state(zero, dp, *be, ZeroEngine::State::kParams, DType::kF32, layout.total);
  }
};

class ZeroBf16Wire : public ::testing::TestWithParam<Case> {};

// Each rank's gradient is k / 256 (32 <= |k| < 64, exact in bf16: 6 significant bits) plus a
// part below half a bf16 step at that size, which rounding to the wire removes; the ranks' sum
// of the k / 256 is exact in bf16 whatever the reduction order (|sum| < 1 on up to 4 ranks, a
// multiple of 1/256). Over nine micro-batches the f32 sums need more significant bits than bf16
// holds: the test fails if the wire is f32, or if the accumulation rounds through bf16.
TEST_P(ZeroBf16Wire, RoundsEachMicroBatchOnceAndAccumulatesInF32) {
  Communicator& dp = world();
  ASSERT_LE(dp.size(), 4) << "the ranks' sum must stay exact in bf16";
  Synthetic s(GetParam(), dp);
  constexpr int kMicro = 9;
  auto k_of = [](int r, int m, int64_t i) {
    const int k = 32 + int((i * 7 + r * 13 + m * 5) % 32);
    return (i + m + r) % 7 == 0 ? -k : k;
  };
  auto below_half_step = [](int64_t i) { return float((i % 5) - 2) * 0x1p-13f; };
  const int r = dp.rank();
  s.backward(kMicro,
             [&](int m, int64_t i) { return float(k_of(r, m, i)) * 0x1p-8f + below_half_step(i); });
  std::vector<float> got;
  s.step_reading_gradients(got);
  if (r != 0) return;
  ASSERT_EQ(int64_t(got.size()), s.layout.total);
  int bad = 0;
  int64_t beyond_bf16 = 0;  // sums a bf16 accumulation could not hold
  for (int64_t i = 0; i < s.layout.total; ++i) {
    int64_t k = 0;
    for (int m = 0; m < kMicro; ++m)
      for (int q = 0; q < dp.size(); ++q) k += k_of(q, m, i);
    const float want = float(k) * 0x1p-8f;
    if (bf16_to_f32(f32_to_bf16(want)) != want) ++beyond_bf16;
    if (got[size_t(i)] != want && ++bad <= 5)
      ADD_FAILURE() << "element " << i << ": " << got[size_t(i)] << ", want " << want;
  }
  EXPECT_GT(beyond_bf16, s.layout.total / 10);
}

INSTANTIATE_TEST_SUITE_P(
    Paths, ZeroBf16Wire,
    ::testing::Values(
        Case{.name = "stage2_device", .stage = 2, .bf16_wire = true},
        Case{.name = "stage2_streamed", .stage = 2, .offload_optimizer = true, .bf16_wire = true},
        Case{.name = "stage3_streamed_no_overlap",
             .stage = 3,
             .offload_optimizer = true,
             .overlap = false,
             .bf16_wire = true}),
    [](const ::testing::TestParamInfo<Case>& info) { return std::string(info.param.name); });

class ZeroInPlace : public ::testing::TestWithParam<Case> {};

// One data-parallel rank reduces in place (zero_reduces_in_place): the reduced chunk is the
// gradient buffer's send buffer itself and a bf16 chunk is widened back into the f32 bucket
// buffer, so the device keeps no chunk buffers. The arithmetic is the one of more ranks: the
// reference is stated here, each micro-batch's gradient (rounded to bf16 on a bf16 wire) added
// in f32 in micro-batch order, the first one copied. Only rank 0's gradients are non-zero, so
// the sum over ranks is exact in either wire format and the reference holds at 2 and 4 ranks
// too, where the chunk buffers exist.
TEST_P(ZeroInPlace, AccumulatesAsTheChunkBuffersDo) {
  const Case& c = GetParam();
  Communicator& dp = world();
  Synthetic s(c, dp);
  constexpr int kMicro = 4;
  auto x = [](int m, int64_t i) {  // values whose f32 sums round
    return std::sin(float(i) * 0.37f + float(m)) * (1.f + float(i % 11) / 3.f);
  };
  const bool narrow = c.bf16_wire;
  auto on_wire = [&](float v) { return narrow ? bf16_to_f32(f32_to_bf16(v)) : v; };
  s.backward(kMicro, [&](int m, int64_t i) { return dp.rank() == 0 ? x(m, i) : 0.f; });
  std::vector<float> got;
  s.step_reading_gradients(got);

  const ZeroLayout& z = s.zero.zero_layout();
  const int64_t per_buffer =
      z.max_bucket * (4 + (narrow ? 2 : 0)) +
      (dp.size() == 1 ? 0
                      : z.max_chunk * (narrow ? 2 : 4) +
                            (narrow && !c.offload_optimizer ? 4 : 0) * z.max_chunk);
  EXPECT_EQ(s.ledger.peak(MemPool::kDevice, MemCategory::kComm),
            zero_grad_buffers(false) * per_buffer +
                (c.stage == 3 ? zero_gather_buffers(c.prefetch) * z.max_bucket * 4 : 0) +
                (c.offload_params ? z.max_chunk * 4 : 0))  // the gathers' send staging
      << "device comm buffers";
  if (dp.rank() != 0) return;
  ASSERT_EQ(int64_t(got.size()), s.layout.total);
  int bad = 0;
  for (int64_t i = 0; i < s.layout.total; ++i) {
    float want = on_wire(x(0, i));
    for (int m = 1; m < kMicro; ++m) want += on_wire(x(m, i));
    if (std::memcmp(&got[size_t(i)], &want, sizeof(float)) != 0 && ++bad <= 5)
      ADD_FAILURE() << "element " << i << ": " << got[size_t(i)] << ", want " << want;
  }
}

INSTANTIATE_TEST_SUITE_P(
    Paths, ZeroInPlace,
    ::testing::Values(Case{.name = "stage2_device", .stage = 2},
                      Case{.name = "stage2_device_bf16_wire", .stage = 2, .bf16_wire = true},
                      Case{.name = "stage2_streamed", .stage = 2, .offload_optimizer = true},
                      Case{.name = "stage2_streamed_bf16_wire_no_overlap",
                           .stage = 2,
                           .offload_optimizer = true,
                           .overlap = false,
                           .bf16_wire = true},
                      Case{.name = "stage3_device_bf16_wire", .stage = 3, .bf16_wire = true},
                      Case{.name = "stage3_streamed_params",
                           .stage = 3,
                           .offload_optimizer = true,
                           .offload_params = true}),
    [](const ::testing::TestParamInfo<Case>& info) { return std::string(info.param.name); });

class ZeroNonFinite : public ::testing::TestWithParam<Case> {};

// One rank's infinity in layer 1's gradients, in the second of two micro-batches: the norm is
// not finite, the step leaves the parameters as they were, every rank names the layer, and the
// next step (finite gradients) updates again.
TEST_P(ZeroNonFinite, IsFoundAndTheStepSkipped) {
  const Case& c = GetParam();
  Communicator& dp = world();
  Synthetic s(c, dp);
  const int bad_unit = 2;  // units: embeddings, layers 0.., final norm and head
  const ParamLayout::Unit& unit = s.layout.units[bad_unit];
  const int64_t bad_flat = unit.begin + (unit.end - unit.begin) / 2;
  const int bad_rank = dp.size() - 1;
  const std::vector<float> before = s.params();
  s.backward(2, [&](int m, int64_t i) {
    if (m == 1 && i == bad_flat && dp.rank() == bad_rank) return INFINITY;
    return 1e-3f * float(i % 7);
  });
  std::vector<float> grads;
  EXPECT_FALSE(std::isfinite(s.step_reading_gradients(grads)));
  EXPECT_EQ(s.zero.first_nonfinite_unit(), s.layout.unit_name(bad_unit));
  EXPECT_EQ(s.zero.steps_taken(), 0);
  const std::vector<float> after = s.params();
  if (dp.rank() == 0) {
    ASSERT_EQ(after.size(), before.size());
    EXPECT_EQ(std::memcmp(after.data(), before.data(), before.size() * sizeof(float)), 0)
        << "a skipped step changed the weights";
  }
  s.backward(2, [](int, int64_t i) { return 1e-3f * float(i % 7); });
  EXPECT_TRUE(std::isfinite(s.step_reading_gradients(grads)));
  EXPECT_EQ(s.zero.first_nonfinite_unit(), "");
  EXPECT_EQ(s.zero.steps_taken(), 1);
}

INSTANTIATE_TEST_SUITE_P(
    Paths, ZeroNonFinite,
    ::testing::Values(Case{.name = "stage2_device", .stage = 2},
                      Case{.name = "stage2_streamed", .stage = 2, .offload_optimizer = true},
                      Case{.name = "stage3_streamed_params",
                           .stage = 3,
                           .offload_optimizer = true,
                           .offload_params = true},
                      Case{.name = "stage3_streamed_bf16_wire",
                           .stage = 3,
                           .offload_optimizer = true,
                           .bf16_wire = true}),
    [](const ::testing::TestParamInfo<Case>& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace shardlm
