// The step-time model and the --fit search (planner/fit.h): traffic figures by hand for known
// cases, the orderings the model must respect, and the search's choice against every
// candidate it rejected.
#include "shardlm/planner/fit.h"

#include <gtest/gtest.h>

#include <cmath>

#include "shardlm/backend/backend.h"
#include "shardlm/model/layout.h"
#include "shardlm/model/lora.h"
#include "shardlm/planner/plan_inputs.h"

namespace shardlm {
namespace {

RunConfig config(const std::string& preset, int64_t T, int64_t micro) {
  RunConfig c;
  c.model_preset = preset;
  c.model = model_preset(preset);
  c.data.train = "unused.txt";
  c.data.seq_len = T;
  c.train.micro_batch = micro;
  c.train.max_steps = 1;
  c.precision.param = "bf16";
  return c;
}

TEST(StepEstimate, ZeroTrafficIsTheRingAlgorithmsBytes) {
  RunConfig c = config("llama3.2-1b", 2048, 1);
  const double P = double(make_param_layout(c.model).total);
  const CostRates rates;
  EXPECT_EQ(estimate_step(c, 1, rates).dp_bytes, 0);  // one rank talks to nobody
  // stage 0: all-reduce of f32 gradients, 2 (n-1)/n of the buffer per rank
  EXPECT_DOUBLE_EQ(estimate_step(c, 8, rates).dp_bytes, 2 * 7.0 / 8 * P * 4);
  // stage 1: reduce-scatter (f32) once, all-gather of the updated bf16 parameters once
  c.zero.stage = 1;
  EXPECT_DOUBLE_EQ(estimate_step(c, 8, rates).dp_bytes, 7.0 / 8 * P * (4 + 2));
  // stage 2 with 4 micro-batches: the reduce-scatter every micro-batch
  c.zero.stage = 2;
  c.train.grad_accum = 4;
  EXPECT_DOUBLE_EQ(estimate_step(c, 8, rates).dp_bytes, 7.0 / 8 * P * (4 * 4 + 2));
  // stage 3: two gathers (forward, backward) per micro-batch instead of the final one
  c.zero.stage = 3;
  EXPECT_DOUBLE_EQ(estimate_step(c, 8, rates).dp_bytes, 7.0 / 8 * P * (4 * 4 + 2 * 4 * 2));
  // bf16 reductions: the reduce-scatters send half the bytes
  c.zero.reduce_dtype = "bf16";
  EXPECT_DOUBLE_EQ(estimate_step(c, 8, rates).dp_bytes, 7.0 / 8 * P * (4 * 2 + 2 * 4 * 2));
}

// A LoRA base sharded by ZeRO-3 is gathered layer by layer forward and backward, beside the
// adapters' own traffic; below stage 3 it is replicated and moves nothing. In host memory a
// rank stages only its chunk of the layers.
TEST(StepEstimate, ShardedLoraBaseIsGatheredForwardAndBackward) {
  RunConfig c = config("llama3.2-1b", 2048, 1);
  c.lora.rank = 16;
  c.lora.alpha = 32;
  c.train.grad_accum = 4;
  const CostRates rates;
  const ParamLayout L = make_param_layout(c.model);
  double layers = 0;  // the decoder layers' elements: what is sharded
  for (int u = 1; u <= c.model.n_layers; ++u) layers += double(L.unit_size(u));
  const double A = double(make_lora_layout(c.model, c.lora_config()).params.total);
  // stage 2: the f32 adapters reduce-scattered every micro-batch, their chunks gathered once
  c.zero.stage = 2;
  EXPECT_DOUBLE_EQ(estimate_step(c, 8, rates).dp_bytes, 7.0 / 8 * A * (4 * 4 + 4));
  // stage 3: the adapters gathered forward and backward, and so is each bf16 layer of the base
  c.zero.stage = 3;
  EXPECT_DOUBLE_EQ(estimate_step(c, 8, rates).dp_bytes,
                   7.0 / 8 * (A * (4 * 4 + 2 * 4 * 4) + 2 * 4 * layers * 2));
  c.lora.offload_base = true;
  const double sharded = estimate_step(c, 8, rates).host_bytes;
  c.zero.stage = 2;
  EXPECT_DOUBLE_EQ(estimate_step(c, 8, rates).host_bytes - sharded, 2 * 4 * 7.0 / 8 * layers * 2);
}

TEST(StepEstimate, OffloadedGradientsStreamFromStage2) {
  RunConfig c = config("llama3.2-1b", 2048, 1);
  const double state = double(make_param_layout(c.model).total) / 8;
  const CostRates rates;
  c.train.grad_accum = 4;
  c.zero.offload_optimizer = "cpu";
  // stage 1: the f32 gradient shard goes out once at the step, the bf16 parameters come back
  c.zero.stage = 1;
  const StepEstimate at_step = estimate_step(c, 8, rates);
  EXPECT_DOUBLE_EQ(at_step.host_bytes, state * (4 + 2));
  // stage 2: every micro-batch's reduced chunks go out (in the wire dtype) under backward, so
  // only the parameters' way back and the host AdamW are exposed
  c.zero.stage = 2;
  const StepEstimate streamed = estimate_step(c, 8, rates);
  EXPECT_DOUBLE_EQ(streamed.host_bytes, state * (4 * 4 + 2));
  c.zero.reduce_dtype = "bf16";
  EXPECT_DOUBLE_EQ(estimate_step(c, 8, rates).host_bytes, state * (4 * 2 + 2));
  const double adam_s = state / (rates.host_adam_gparams * 1e9);
  EXPECT_NEAR(streamed.host_s, state * 2 / (rates.host_link_gbs * 1e9) + adam_s, 1e-12);
}

TEST(StepEstimate, RecomputeOrdersNoneSelectiveFull) {
  RunConfig c = config("llama3.2-1b", 4096, 1);
  const CostRates rates;
  c.memory.checkpointing = "none";
  const StepEstimate none = estimate_step(c, 1, rates);
  c.memory.checkpointing = "selective";
  const StepEstimate sel = estimate_step(c, 1, rates);
  c.memory.checkpointing = "full";
  const StepEstimate full = estimate_step(c, 1, rates);
  EXPECT_EQ(none.recompute_flops, 0);
  EXPECT_GT(sel.recompute_flops, 0);
  EXPECT_GT(full.recompute_flops, sel.recompute_flops);
  // Full recompute is one forward of the decoder layers: a third of their training FLOPs
  // (6 per weight and token against 2), the LM head (6 V D per token) not recomputed.
  const double head = 6.0 * double(c.model.vocab_size * c.model.dim) * 4096;
  EXPECT_NEAR(3 * full.recompute_flops / (full.flops_per_step - head), 1.0, 1e-9);
  EXPECT_LT(full.tokens_per_s, sel.tokens_per_s);
  EXPECT_LT(sel.tokens_per_s, none.tokens_per_s);
  EXPECT_EQ(none.flops_per_step, full.flops_per_step);
}

// DPO with LoRA runs the reference forward (adapters off) every micro-batch: a third of the
// training FLOPs more, and ZeRO-3's sharded base gathered once more. Full fine-tuning DPO runs it
// once before training instead: a forward of each step's rows per step of an epoch, outside the
// step. Every preference objective computes the head's logits twice (statistics, then dlogits).
TEST(StepEstimate, DpoCountsItsReferenceForward) {
  RunConfig c = config("llama3.2-1b", 4096, 1);
  c.zero.stage = 3;
  c.lora.rank = 16;
  const CostRates rates;
  const StepEstimate sft = estimate_step(c, 4, rates);
  c.train.objective = "simpo";
  const StepEstimate simpo = estimate_step(c, 4, rates);
  c.train.objective = "dpo";
  const StepEstimate lora = estimate_step(c, 4, rates);
  c.lora.rank = 0;
  const StepEstimate full = estimate_step(c, 4, rates);
  c.train.objective = "sft";
  const StepEstimate full_sft = estimate_step(c, 4, rates);

  EXPECT_EQ(sft.reference_flops, 0);
  EXPECT_EQ(simpo.reference_flops, 0);
  EXPECT_NEAR(lora.reference_flops, lora.flops_per_step / 3 / 4, 1e-6 * lora.reference_flops);
  EXPECT_DOUBLE_EQ(lora.reference_s, lora.reference_flops / (rates.tflops * 1e12));
  // per rank: 2 V D per token of its rows (4 ranks, a row each)
  const double head_again = 2.0 * double(c.model.vocab_size * c.model.dim) * 4096;
  EXPECT_NEAR(simpo.recompute_flops - sft.recompute_flops, head_again, 1e-6 * head_again);
  EXPECT_GT(lora.dp_bytes, sft.dp_bytes);  // the base gathered for the reference too
  EXPECT_NEAR(lora.step_s - simpo.step_s, lora.reference_s + (lora.comm_s - simpo.comm_s),
              1e-9 * lora.step_s);
  EXPECT_LT(lora.tokens_per_s, simpo.tokens_per_s);
  EXPECT_EQ(lora.reference_pass_s, 0);

  EXPECT_EQ(full.reference_flops, 0);
  EXPECT_GE(full.reference_pass_s, full.flops_per_step / 3 / 4 / (rates.tflops * 1e12));
  EXPECT_LT(full.reference_pass_s, full.step_s);
  EXPECT_EQ(full_sft.reference_pass_s, 0);
  // (a head already in pieces, as ZeRO-3 full fine-tuning holds it, computes its logits twice
  // for SFT too)
  EXPECT_NEAR(full.recompute_flops - full_sft.recompute_flops, head_in_pieces(c) ? 0 : head_again,
              1e-6 * head_again);
}

// A sliding window counts only the pairs inside it, per layer: half the layers with a window of
// 512 on rows of 4096 run W (W + 1) / 2 + (T - W) W pairs there, the rest T (T + 1) / 2.
TEST(StepEstimate, SlidingWindowsCountOnlyTheirPairs) {
  RunConfig c = config("llama3.2-1b", 4096, 1);
  const CostRates rates;
  const double T = 4096, W = 512, L = double(c.model.n_layers);
  const StepEstimate full = estimate_step(c, 1, rates);
  c.model.layer_windows.assign(size_t(c.model.n_layers), 0);
  for (int64_t l = 0; l < c.model.n_layers; l += 2) c.model.layer_windows[size_t(l)] = 512;
  const StepEstimate windowed = estimate_step(c, 1, rates);
  const double full_pairs = T * (T + 1) / 2, window_pairs = W * (W + 1) / 2 + (T - W) * W;
  const double sliding_layers = std::ceil(L / 2);
  const double saved = (full_pairs - window_pairs) * sliding_layers / L;
  const double per_pair = train_flops(c.model, 0, 1);
  EXPECT_NEAR(full.flops_per_step - windowed.flops_per_step, per_pair * saved,
              1e-9 * full.flops_per_step);
  EXPECT_GT(windowed.tokens_per_s, full.tokens_per_s);
  c.model.layer_windows.clear();  // a window as long as the row changes nothing
  c.model.sliding_window = 4096;
  EXPECT_DOUBLE_EQ(estimate_step(c, 1, rates).flops_per_step, full.flops_per_step);
}

TEST(StepEstimate, ContextParallelTrafficAndOffloadCost) {
  RunConfig c = config("llama3.2-1b", 8192, 1);
  const CostRates rates;
  const StepEstimate one = estimate_step(c, 4, rates);
  EXPECT_EQ(one.cp_bytes, 0);
  c.parallel.cp = 4;
  c.parallel.cp_kind = "ring";
  const StepEstimate ring = estimate_step(c, 4, rates);
  // Ring of 4, per layer: k and v passed on 3 times forward; backward k, v 3 times and the
  // dk, dv accumulators 4 times. Per rank 2048 tokens of 8 kv heads of 64 dims, bf16 (the
  // activations follow the bf16 parameters); f32 activations send twice the bytes.
  const double kv = 2048.0 * 8 * 64 * 2;
  EXPECT_DOUBLE_EQ(ring.cp_bytes, 16 * (3 * 2 * kv + (3 * 2 + 4 * 2) * kv));
  c.precision.activations = "fp32";
  EXPECT_DOUBLE_EQ(estimate_step(c, 4, rates).cp_bytes, 2 * ring.cp_bytes);
  c.precision.activations = "auto";
  c.parallel.cp_kind = "ulysses";
  EXPECT_GT(estimate_step(c, 4, rates).cp_bytes, 0);
  c.parallel.cp = 1;
  c.zero.offload_optimizer = "cpu";
  const StepEstimate off = estimate_step(c, 4, rates);
  EXPECT_GT(off.host_bytes, 0);
  EXPECT_GT(off.host_s, 0);
  EXPECT_GT(off.step_s, one.step_s);
}

// Under pipeline stages DPO's reference is a forward-only sweep: m micro-batches through pp
// stages one after another take m + pp - 1 stage forwards, not m. With LoRA the sweep runs every
// step, before 1F1B: its fill and drain are in reference_s (and so in the step), and the bubble
// is 1F1B's alone, as the run measures pp_bubble. With full fine-tuning the start-up pass is one
// sweep: its fill and drain come once, beside the per-step figure.
TEST(StepEstimate, DpoReferenceSweepCountsItsFillAndDrain) {
  RunConfig c = config("llama3.2-1b", 2048, 1);
  c.train.grad_accum = 4;
  c.train.objective = "dpo";
  c.lora.rank = 16;
  const CostRates rates;
  const double tflops = rates.tflops * 1e12;
  const StepEstimate flat = estimate_step(c, 2, rates);  // dp = 2: no stages, no fill
  EXPECT_EQ(flat.reference_fill_s, 0);
  EXPECT_DOUBLE_EQ(flat.reference_s, flat.reference_flops / tflops);
  c.parallel.pp = 2;
  const StepEstimate lora = estimate_step(c, 2, rates);
  const double stage_forward = lora.reference_flops / tflops / 4;  // one micro-batch's
  EXPECT_NEAR(lora.reference_fill_s, stage_forward, 1e-12 * stage_forward);
  EXPECT_NEAR(lora.reference_s, (4 + 2 - 1) * stage_forward, 1e-12 * lora.reference_s);
  EXPECT_DOUBLE_EQ(lora.bubble_s, (lora.compute_s + lora.recompute_s) / 4);
  c.train.objective = "simpo";  // no reference: the same 1F1B, the sweep's time less
  const StepEstimate simpo = estimate_step(c, 2, rates);
  EXPECT_DOUBLE_EQ(simpo.bubble_s, lora.bubble_s);
  EXPECT_NEAR(lora.step_s - simpo.step_s, lora.reference_s + (lora.comm_s - simpo.comm_s),
              1e-9 * lora.step_s);

  c.train.objective = "dpo";
  c.lora.rank = 0;
  for (const int64_t pp : {int64_t{1}, int64_t{2}}) {
    c.parallel.pp = pp;
    const StepEstimate full = estimate_step(c, 2, rates);
    SCOPED_TRACE(pp);
    EXPECT_GT(full.reference_pass_s, 0);
    EXPECT_EQ(full.reference_s, 0);
    // (pp - 1) stage forwards, a stage forward being a quarter of a step's reference time
    EXPECT_NEAR(full.reference_fill_s, double(pp - 1) * full.reference_pass_s / 4,
                1e-12 * full.reference_pass_s);
  }
}

TEST(StepEstimate, TensorAndPipelineTrafficAndBubble) {
  RunConfig c = config("tiny", 256, 2);
  c.train.grad_accum = 4;
  const CostRates rates;
  const ModelConfig& m = c.model;
  const double act = 2.0 * 256 * double(m.dim) * 2;  // one micro-batch's [B*T, D] bf16
  const StepEstimate one = estimate_step(c, 1, rates);
  EXPECT_EQ(one.tp_bytes, 0);
  EXPECT_EQ(one.pp_bytes, 0);
  EXPECT_EQ(one.bubble_s, 0);
  // tp = 2: 2 all-reduces forward and 2 backward per layer and micro-batch, and one at each
  // vocabulary-parallel end, each sending 2 (tp-1)/tp of the buffer; selective checkpointing
  // recomputes the o projection's.
  c.parallel.tp = 2;
  c.parallel.sequence_parallel = false;
  EXPECT_DOUBLE_EQ(estimate_step(c, 2, rates).tp_bytes, (4.0 * m.n_layers + 2) * 4 * 2 * 0.5 * act);
  c.memory.checkpointing = "selective";
  EXPECT_DOUBLE_EQ(estimate_step(c, 2, rates).tp_bytes, (5.0 * m.n_layers + 2) * 4 * 2 * 0.5 * act);
  // Sequence parallelism: the same bytes forward, and the norm outputs re-gathered backward.
  c.parallel.sequence_parallel = true;
  EXPECT_DOUBLE_EQ(estimate_step(c, 2, rates).tp_bytes, (6.0 * m.n_layers + 2) * 4 * 2 * 0.5 * act);
  // ZeRO shards over the ranks holding the same tp shard: dp = 1 here, nothing to reduce.
  EXPECT_EQ(estimate_step(c, 2, rates).dp_bytes, 0);
  // pp = 2 over 4 micro-batches: the 1F1B bubble is (pp-1)/m of the busy time, and a stage
  // sends each micro-batch's activations or gradients across its boundaries.
  c.parallel.tp = 1;
  c.memory.checkpointing = "none";
  c.parallel.pp = 2;
  const StepEstimate pp = estimate_step(c, 2, rates);
  EXPECT_DOUBLE_EQ(pp.bubble_s, (pp.compute_s + pp.recompute_s) / 4);
  EXPECT_DOUBLE_EQ(pp.pp_bytes, 2 * 4 * act);
  EXPECT_NEAR(pp.compute_s, one.compute_s / 2, 1e-15);
  c.train.grad_accum = 16;  // more micro-batches: a smaller share of idle time
  const StepEstimate pp16 = estimate_step(c, 2, rates);
  EXPECT_LT(pp16.bubble_s / pp16.step_s, pp.bubble_s / pp.step_s);
}

TEST(FitSearch, ChoosesTheFastestThatFitsAndEveryRunnerUpLosesForAReason) {
  const std::unique_ptr<Backend> be = make_backend(DeviceKind::kCpu);
  RunConfig c = config("tiny", 256, 4);
  c.train.grad_accum = 2;
  const CostRates rates;
  // A budget under the given configuration's peak.
  FitBudget budget;
  FitResult loose = fit_search(c, 2, FitBudget{int64_t{1} << 40, 0}, rates, *be);
  ASSERT_TRUE(loose.chosen);
  EXPECT_EQ(loose.fitting, loose.searched);
  int64_t smallest = INT64_MAX, largest = 0;
  for (const auto& r : loose.runner_ups) {
    smallest = std::min(smallest, r.plan.peak_bytes[0]);
    largest = std::max(largest, r.plan.peak_bytes[0]);
  }
  budget.device_bytes = (smallest + largest) / 2;
  const FitResult r = fit_search(c, 2, budget, rates, *be);
  ASSERT_TRUE(r.chosen);
  EXPECT_LE(r.chosen->plan.peak_bytes[0], budget.device_bytes);
  EXPECT_LT(r.fitting, r.searched);
  EXPECT_GT(r.invalid, 0);  // e.g. cp = 2 x micro-batches that do not divide
  bool seen_unfit = false, seen_tp = r.chosen->cfg.parallel.tp > 1;
  for (const FitCandidate& o : r.runner_ups) {
    seen_tp = seen_tp || o.cfg.parallel.tp > 1;
    EXPECT_EQ(o.cfg.parallel.pp, 1);  // something fits without pipeline stages
    // Fitting runner-ups first, then those over budget.
    if (!o.fits) seen_unfit = true;
    if (seen_unfit) {
      EXPECT_FALSE(o.fits);
    }
    if (o.fits) {
      EXPECT_LE(o.est.tokens_per_s, r.chosen->est.tokens_per_s * 1.005);
    }
    EXPECT_FALSE(fit_loss_reason(*r.chosen, o, budget).empty());
    // The global batch is kept: micro x accum x dp.
    const int64_t dp = 2 / (o.cfg.parallel.cp * o.cfg.parallel.tp * o.cfg.parallel.pp);
    EXPECT_EQ(o.cfg.train.micro_batch * o.cfg.train.grad_accum * dp, 4 * 2 * 2);
  }
  EXPECT_TRUE(seen_tp);  // tensor parallelism is one of the strategies searched
  // Pipeline stages are searched when nothing fits without them.
  const FitResult none = fit_search(c, 2, FitBudget{1, 0}, rates, *be);
  EXPECT_FALSE(none.chosen);
  bool seen_pp = false;
  for (const FitCandidate& o : none.runner_ups) seen_pp = seen_pp || o.cfg.parallel.pp == 2;
  EXPECT_TRUE(seen_pp);
  // The set line names exactly the keys that changed, and parses as --set arguments.
  for (const auto& [k, v] : r.chosen->sets)
    EXPECT_NE(fit_set_line(*r.chosen).find("--set " + k + "=" + v), std::string::npos);
}

TEST(FitSearch, APreferenceObjectiveSearchesEveryAxis) {
  // DPO and SimPO run under dp, tp, cp and pp: the search offers them as it does for SFT (pipeline
  // stages when nothing fits without them), keeping the global batch. DPO with LoRA (the
  // reference is the adapters-off forward) and with full fine-tuning (the reference table's pass
  // runs on any grid too).
  const std::unique_ptr<Backend> be = make_backend(DeviceKind::kCpu);
  for (const int64_t rank : {4, 0}) {
    SCOPED_TRACE(rank > 0 ? "LoRA" : "full fine-tuning");
    RunConfig c = config("tiny", 256, 4);
    c.train.grad_accum = 2;
    c.train.objective = "dpo";
    c.lora.rank = rank;
    bool seen_tp = false, seen_cp = false, seen_pp = false;
    for (const FitBudget& budget : {FitBudget{int64_t{1} << 40, 0}, FitBudget{1, 0}}) {
      const FitResult r = fit_search(c, 4, budget, CostRates{}, *be);
      EXPECT_GT(r.searched, 0);
      std::vector<const FitCandidate*> all;
      if (r.chosen) all.push_back(&*r.chosen);
      for (const FitCandidate& o : r.runner_ups) all.push_back(&o);
      ASSERT_FALSE(all.empty());
      for (const FitCandidate* o : all) {
        const ParallelConfig& p = o->cfg.parallel;
        EXPECT_EQ(o->cfg.train.micro_batch * o->cfg.train.grad_accum * (4 / (p.tp * p.pp * p.cp)),
                  4 * 2 * 4);
        seen_tp = seen_tp || p.tp > 1;
        seen_cp = seen_cp || p.cp > 1;
        seen_pp = seen_pp || p.pp > 1;
      }
    }
    EXPECT_TRUE(seen_tp);
    EXPECT_TRUE(seen_cp);
    EXPECT_TRUE(seen_pp);  // nothing fits one byte: pipeline stages are tried
  }
}

TEST(FitSearch, AGivenLayoutPlansAsABuiltOne) {
  // The search hands plan_memory the layouts it keeps; the plan must be the same.
  const std::unique_ptr<Backend> be = make_backend(DeviceKind::kCpu);
  RunConfig c = config("tiny", 256, 2);
  c.parallel.pp = 2;
  c.parallel.tp = 2;
  c.train.grad_accum = 4;
  for (int64_t stage : {0, 1}) {
    PlanInputs pin = plan_inputs_for(c, 4, *be, stage);
    const MemoryPlan built = plan_memory(pin);
    const ParamLayout L = make_param_layout(pin.model);
    pin.layout = &L;
    const MemoryPlan given = plan_memory(pin);
    EXPECT_EQ(given.peak_bytes, built.peak_bytes) << "stage " << stage;
    EXPECT_EQ(given.by_category, built.by_category) << "stage " << stage;
  }
}

TEST(FitSearch, NeedsADeviceBudget) {
  const std::unique_ptr<Backend> be = make_backend(DeviceKind::kCpu);
  EXPECT_THROW(fit_search(config("tiny", 64, 1), 1, FitBudget{}, CostRates{}, *be), Error);
}

}  // namespace
}  // namespace shardlm
