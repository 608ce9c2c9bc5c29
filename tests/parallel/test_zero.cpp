// ZeRO stages 0-3, with and without optimizer and parameter offload, under mpiexec at 1, 2 and
// 4 ranks: every rank also trains the same model alone (a LocalCommunicator, stage 0, the whole
// global batch as accumulated micro-batches) and the sharded run must follow it step by step,
// losses and final weights, within fp32 tolerance. Each rank's memory is checked against the
// plan byte for byte and against 1/N of the single-rank figures.
#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <vector>

#include "parallel/mpi_test_env.h"
#include "shardlm/comm/local.h"
#include "shardlm/model/llama.h"
#include "shardlm/parallel/zero.h"
#include "shardlm/plan/plan.h"

namespace shardlm {
namespace {

using test::world;

constexpr int kSteps = 20;
constexpr int64_t kT = 16;          // tokens per sequence
constexpr int64_t kGlobalRows = 8;  // sequences per step, over all ranks
constexpr int64_t kVocab = 64;

ModelConfig tiny(bool tied) {
  ModelConfig c = model_preset("tiny");
  c.dim = 32;
  c.n_layers = 3;
  c.n_heads = 4;
  c.n_kv_heads = 2;
  c.ffn_dim = 48;
  c.vocab_size = kVocab;
  c.tie_embeddings = tied;
  c.attn_bias = !tied;  // biases (no weight decay) inside the shards too
  return c;
}

// Row `row` of step `step`: a deterministic token sequence with a learnable pattern.
void fill_row(BatchInputs& in, int64_t b, int64_t step, int64_t row) {
  uint64_t h = uint64_t(step * 131 + row * 7 + 1);
  for (int64_t t = 0; t < kT; ++t) {
    h = h * 6364136223846793005ull + 1442695040888963407ull;
    const int32_t tok = (t % 3 == 0) ? int32_t((h >> 33) % kVocab) : int32_t((row + t) % kVocab);
    in.tokens.i32()[b * kT + t] = tok;
    in.positions.i32()[b * kT + t] = int32_t(t);
    in.seg_start.i32()[b * kT + t] = 0;
  }
  for (int64_t t = 0; t < kT; ++t)
    in.targets.i32()[b * kT + t] = t + 1 < kT ? in.tokens.i32()[b * kT + t + 1] : kIgnoreIndex;
}

struct TrainedRun {
  std::vector<double> losses;
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
};

// Trains kSteps steps over `dp`, each rank taking its block of every step's rows as
// micro-batches of one sequence.
void train(const Case& c, Communicator& dp, TrainedRun& run) {
  const ModelConfig cfg = tiny(c.tied);
  auto be = make_backend(DeviceKind::kCpu);
  auto host = make_backend(DeviceKind::kCpu);
  const ParamLayout layout = make_param_layout(cfg);
  const DType pdt = c.bf16 ? DType::kBF16 : DType::kF32;
  ZeroOptions zo;
  zo.stage = c.stage;
  zo.offload_optimizer = c.offload_optimizer;
  zo.offload_params = c.offload_params;
  zo.overlap_comm = c.overlap;
  zo.prefetch = c.prefetch;
  zo.bucket_elems = c.bucket_elems;
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
      fill_row(in, 0, step, dp.rank() * rows + r);
      loss += model.forward_backward(1, kT, 1.f / float(targets)).loss_sum;
    }
    zero.drain();
    float total = float(loss);
    dp.all_reduce(Tensor(&total, DType::kF32, {1}, MemPool::kHost));
    AdamWHyper h;
    h.lr = 3e-3f;
    h.beta1 = 0.9f;
    h.beta2 = 0.95f;
    h.weight_decay = 0.1f;
    zero.step(h, 1.0);
    run.losses.push_back(double(total) / double(targets));
  }
  auto collect = [&](ZeroEngine::State s, std::vector<float>& out) {
    const DType dt = s == ZeroEngine::State::kParams ? pdt : DType::kF32;
    zero.save(s, [&](const void* data, size_t bytes) {
      const int64_t n = int64_t(bytes / dtype_size(dt));
      const size_t at = out.size();
      out.resize(at + n);
      be->convert(Tensor(const_cast<void*>(data), dt, {n}, MemPool::kHost),
                  Tensor(out.data() + at, DType::kF32, {n}, MemPool::kHost));
    });
  };
  collect(ZeroEngine::State::kParams, run.params);
  collect(ZeroEngine::State::kAdamM, run.m);
}

class Zero : public ::testing::TestWithParam<Case> {};

TEST_P(Zero, MatchesOneRankWithTheSameGlobalBatch) {
  const Case& c = GetParam();
  Communicator& dp = world();
  // The reference: this process alone, stage 0, the whole global batch.
  Case ref_case = c;
  ref_case.stage = 0;
  ref_case.offload_optimizer = ref_case.offload_params = false;
  LocalCommunicator local("alone");
  TrainedRun ref, got;
  train(ref_case, local, ref);
  train(c, dp, got);

  ASSERT_EQ(got.losses.size(), ref.losses.size());
  // fp32 sums in another order (per-rank partial gradients, then reductions) stay within 2e-6
  // relative over 20 steps of Adam (observed at 4 ranks); bf16 parameters round a slightly
  // different update to another bf16 value now and then, which Adam's moments then carry.
  const double tol = c.bf16 ? 1e-3 : 1e-5;
  for (size_t i = 0; i < ref.losses.size(); ++i)
    EXPECT_NEAR(got.losses[i], ref.losses[i], tol * std::abs(ref.losses[i])) << "step " << i + 1;
  if (dp.rank() == 0) {
    ASSERT_EQ(got.params.size(), ref.params.size());
    ASSERT_EQ(got.m.size(), ref.m.size());
    double worst = 0, worst_m = 0;
    for (size_t i = 0; i < ref.params.size(); ++i) {
      worst = std::max(worst, double(std::abs(got.params[i] - ref.params[i])));
      worst_m = std::max(worst_m, double(std::abs(got.m[i] - ref.m[i])));
    }
    EXPECT_LT(worst, c.bf16 ? 1e-2 : 1e-5) << "largest weight difference";
    EXPECT_LT(worst_m, c.bf16 ? 2e-4 : 1e-6) << "largest Adam moment difference";
  }

  // Memory: the plan is exact, category by category, in both pools.
  for (int p = 0; p < kNumMemPools; ++p)
    for (int k = 0; k < kNumMemCategories; ++k)
      EXPECT_EQ(got.plan.by_category[p][k], got.ledger.peak(MemPool(p), MemCategory(k)))
          << mem_pool_name(MemPool(p)) << " " << mem_category_name(MemCategory(k));

  // And 1/N of the single-rank figures, plus at most one padding element per bucket.
  const int n = dp.size();
  const ZeroLayout& z = got.layout;
  const int64_t total = make_param_layout(tiny(c.tied)).total;
  EXPECT_LE(z.shard * n, total + int64_t(z.buckets.size()) * (n - 1));
  const int64_t pb = c.bf16 ? 2 : 4;
  const MemPool opt_pool = c.offload_optimizer ? MemPool::kHost : MemPool::kDevice;
  const int n_opt = (c.bf16 || c.offload_optimizer) ? 3 : 2;
  auto peak = [&](MemPool p, MemCategory k) { return got.ledger.peak(p, k); };
  const int64_t model_params = tiny(c.tied).head_dim() / 2 * 4;  // rotary table
  EXPECT_EQ(peak(opt_pool, MemCategory::kOptimizer),
            n_opt * (c.stage >= 1 ? z.shard : z.padded_total) * 4);
  if (c.offload_optimizer) {
    EXPECT_EQ(peak(MemPool::kDevice, MemCategory::kOptimizer), 0);
  }
  if (c.stage >= 2) {
    EXPECT_EQ(peak(MemPool::kDevice, MemCategory::kGrads), z.shard * 4);
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
    ::testing::Values(Case{"stage0", 0}, Case{"stage0_offload", 0, true}, Case{"stage1", 1},
                      Case{"stage1_offload", 1, true},
                      Case{"stage1_bf16_tied", 1, false, false, true, true}, Case{"stage2", 2},
                      Case{"stage2_offload", 2, true},
                      Case{"stage2_tied_no_overlap", 2, false, false, false, true, false},
                      Case{"stage2_bf16_offload", 2, true, false, true}, Case{"stage3", 3},
                      Case{"stage3_offload", 3, true}, Case{"stage3_offload_params", 3, true, true},
                      Case{"stage3_tied_prefetch2", 3, false, false, false, true, true, 2},
                      Case{"stage3_bf16_offload_params_tied", 3, true, true, true, true},
                      Case{"stage3_no_prefetch_one_bucket_per_unit", 3, false, false, false, false,
                           true, 0, 1}),
    [](const ::testing::TestParamInfo<Case>& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace shardlm
