// The step-time model (fit.h's estimate_step, step_estimate.h): compute and recompute at a
// sustained rate, ZeRO, context-, tensor- and pipeline-parallel traffic, the 1F1B bubble, and
// device<->host traffic with the host optimizer, overlapped or exposed as the engine runs them.
#include "step_estimate.h"

#include <algorithm>
#include <cmath>
#include <optional>

#include "shardlm/model/nf4_base.h"
#include "shardlm/model/sharded_base.h"
#include "shardlm/model/tensor_shard.h"
#include "shardlm/plan/context_layout.h"
#include "shardlm/planner/plan_inputs.h"

namespace shardlm {
namespace {

// Forward FLOPs one checkpointing mode runs again in backward, per token (matmuls) and per
// visible pair (attention), summed over layers.
// Keeping every k-th layer's input only, the layers between run forward once more (their
// inputs recomputed from their segment's start).
double recompute_flops(const ModelConfig& c, const ModelCosts& mc, Checkpointing mode,
                       int64_t every, double tokens, double pairs) {
  if (mode == Checkpointing::kNone) return 0;
  if (mode == Checkpointing::kSelective)  // norms, q/k/v, o, gate and up: not attention, not down
    return 2 * (mc.layer_matmul - mc.layer_down) * tokens;
  // full: the whole layer forward, attention (QK^T and PV) included
  const double forward =
      2 * mc.layer_matmul * tokens + 4.0 * double(c.head_dim() * c.n_heads * c.n_layers) * pairs;
  const double kept = CheckpointMap(c, mode, {int(every), 0}).kept_layers();
  return forward * (1 + (double(c.n_layers) - kept) / double(c.n_layers));
}

// Visible (query, key) pairs of one full causal row of T tokens, averaged over the layers: a
// layer with window W sees min(t + 1, W) keys from query t, so W (W + 1) / 2 + (T - W) W in
// all (T (T + 1) / 2 without a window, or one as long as the row). A ring skips the blocks
// outside the window, so it runs these pairs too.
double causal_pairs_per_row(const ModelConfig& m, int64_t T) {
  double sum = 0;
  for (int64_t l = 0; l < m.n_layers; ++l) {
    const double W = double(std::min(m.window_of_layer(l) > 0 ? m.window_of_layer(l) : T, T));
    sum += W * (W + 1) / 2 + (double(T) - W) * W;
  }
  return sum / double(m.n_layers);
}

// The shape of one step as every term of the estimate sees it: the parallel degrees, the
// batch, a rank's part of each row and the checkpointing mode.
struct StepShape {
  int64_t dp = 1, world = 1, tp = 1, pp = 1;
  int64_t seq_len = 0, micro_batch = 0, accum = 0;
  int64_t rows = 0;  // rows of one step, all data-parallel ranks together
  std::optional<ContextLayout> cp_layout;
  bool cp_kept = false;  // parallel.cp_keep_gathered: the backward's q, k, v not exchanged again
  int64_t local_tokens = 0;  // tokens of a row on this rank
  Checkpointing mode = Checkpointing::kNone;
  int64_t every = 1;            // memory.checkpoint_every
  double host_layers = 0;       // kept layers whose checkpoints go to the host ("auto": all)
  DType act = DType::kF32;      // precision.activations
  double activation_bytes = 0;  // one micro-batch's [B*Tl, D] activations
  double stage_layers = 0;      // decoder layers per pipeline stage
  bool head_pieces = false;     // the LM head in pieces: its logits GEMM runs twice
  // Preference objectives: the weighted head computes its logits twice too (statistics, then
  // dlogits); LoRA DPO runs one more forward per micro-batch (the reference, adapters off),
  // full fine-tuning DPO a forward of every pair before training.
  bool weighted_head = false;
  int64_t reference_forwards = 0;
  bool reference_pass = false;
};

StepShape step_shape_of(const RunConfig& cfg, int64_t world_size) {
  const ModelConfig& m = cfg.model;
  const Topology topo = topology_for(cfg, world_size);
  StepShape shape;
  shape.dp = topo.size(Axis::kDp);
  shape.world = topo.world_size();
  shape.tp = topo.size(Axis::kTp);
  shape.pp = topo.size(Axis::kPp);
  shape.seq_len = cfg.data.seq_len;
  shape.micro_batch = cfg.train.micro_batch;
  shape.accum = cfg.train.grad_accum;
  shape.rows = shape.micro_batch * shape.accum * shape.dp;
  shape.cp_layout = context_layout_for(cfg);
  shape.cp_kept = cfg.parallel.cp_keep_gathered;
  shape.local_tokens = shape.cp_layout ? shape.cp_layout->local() : shape.seq_len;
  shape.mode = checkpointing_from_name(cfg.memory.checkpointing);
  shape.every = cfg.memory.checkpoint_every;
  shape.host_layers = CheckpointMap(m, shape.mode, checkpoint_placement_for(cfg)).host_layers();
  shape.act = cfg.precision.activation_dtype();
  shape.activation_bytes = double(shape.micro_batch) * double(shape.local_tokens) * double(m.dim) *
                           double(dtype_size(shape.act));
  shape.stage_layers = double(m.n_layers) / double(shape.pp);
  shape.head_pieces = head_in_pieces(cfg);
  shape.weighted_head = cfg.train.objective != "sft";
  const bool dpo = cfg.train.objective == "dpo";
  shape.reference_forwards = dpo && cfg.lora.rank > 0 ? 1 : 0;
  shape.reference_pass = dpo && cfg.lora.rank == 0;
  return shape;
}

// A forward-only sweep of m micro-batches through pp stages runs m + pp - 1 stage forwards one
// after another (the executor's evaluate): its fill and drain, (pp - 1) / m of its m forwards.
double sweep_fill(const StepShape& shape) { return double(shape.pp - 1) / double(shape.accum); }

// The step's FLOPs, and a rank's compute and recompute time; returns the rank's busy time (LoRA
// DPO's reference sweep included, its fill and drain too).
double estimate_compute(const StepShape& shape, const ModelConfig& m, const ModelCosts& mc,
                        const CostRates& rates, StepEstimate& e) {
  e.tokens_per_step = shape.rows * shape.seq_len;
  // Full causal rows (no document boundaries), averaged over the layers' sliding windows.
  const double pairs = double(shape.rows) * causal_pairs_per_row(m, shape.seq_len);
  e.flops_per_step = mc.train_flops_token * double(e.tokens_per_step) + mc.train_flops_pair * pairs;
  // The head in pieces (or weighted) computes its logits in a statistics walk, then again for
  // dlogits.
  const double head_again =
      shape.head_pieces || shape.weighted_head
          ? 2.0 * double(m.vocab_size) * double(m.dim) * double(e.tokens_per_step)
          : 0.0;
  e.recompute_flops =
      (recompute_flops(m, mc, shape.mode, shape.every, double(e.tokens_per_step), pairs) +
       head_again) /
      double(shape.world);
  e.compute_s = e.flops_per_step / double(shape.world) / (rates.tflops * 1e12);
  e.recompute_s = e.recompute_flops / (rates.tflops * 1e12);
  // A forward is a third of the training FLOPs (2 per weight and token against 6, attention
  // likewise).
  const double forward_flops = e.flops_per_step / 3 / double(shape.world);
  e.reference_flops = double(shape.reference_forwards) * forward_flops;
  const double reference_compute_s = e.reference_flops / (rates.tflops * 1e12);
  // Under pipeline stages LoRA DPO's reference is a forward-only sweep of the step's m
  // micro-batches through the pp stages, one after another: m + pp - 1 stage forwards, the
  // fill and the drain leaving stages idle (no backward fills them, unlike 1F1B's).
  e.reference_fill_s = reference_compute_s * sweep_fill(shape);
  e.reference_s = reference_compute_s + e.reference_fill_s;
  if (shape.reference_pass) e.reference_pass_s = forward_flops / (rates.tflops * 1e12);
  return e.compute_s + e.recompute_s + e.reference_s;
}

// Tensor parallelism: per layer and micro-batch, two all-reduces of the [B*Tl, D] f32
// activations forward (after o and down), one more when checkpointing recomputes the
// attention block, two backward (the norm outputs' gradients); a ring all-reduce sends
// 2 (tp-1)/tp of the buffer. Sequence parallelism turns each into an all-gather and a
// reduce-scatter ((tp-1)/tp each: the same bytes), and backward re-gathers the two norm
// outputs (one more all-reduce's worth per layer). They block the compute (not overlapped
// in this version). The vocabulary-parallel ends add one each per micro-batch: the
// embedding's partial rows summed forward (first stage), the LM head's input gradient summed
// backward (last stage).
void estimate_tensor_parallel(const RunConfig& cfg, const StepShape& shape, StepEstimate& e) {
  if (shape.tp <= 1) return;
  const double per_layer =
      (shape.mode == Checkpointing::kNone ? 4 : 5) + (cfg.parallel.sequence_parallel ? 1 : 0);
  const double ends = shape.pp == 1 ? 2 : 1;
  e.tp_bytes = (per_layer * shape.stage_layers + ends) * double(shape.accum) * 2 *
               double(shape.tp - 1) / double(shape.tp) * shape.activation_bytes;
}

// Pipeline parallelism: a stage sends each micro-batch's activations forward and their
// gradients back (2 buffers per micro-batch at an inner stage). 1F1B idles (pp - 1) / m of
// a stage's busy time in its schedule (`busy`: compute and recompute; LoRA DPO's reference
// sweep before it counts its own fill and drain), and the fill and the drain each cross pp - 1
// boundaries on the critical path; the steady state's transfers overlap the compute. Returns
// the exposed transfer time.
double estimate_pipeline(const StepShape& shape, double busy, double link, StepEstimate& e) {
  if (shape.pp <= 1) return 0;
  e.pp_bytes = 2 * double(shape.accum) * shape.activation_bytes;
  e.bubble_s = busy * sweep_fill(shape);
  return 2 * double(shape.pp - 1) * shape.activation_bytes / link;
}

// What ZeRO shards and communicates: a rank's parameters are its tp shard of its pipeline
// stage (the stage's share taken as 1/pp of the shard). With LoRA the engine holds (and
// communicates) only the f32 adapters.
struct ZeroShard {
  int64_t ranks = 1;       // the ranks holding the same parameters (dp x cp)
  double params = 0;       // a rank's parameters
  double param_bytes = 4;  // bytes of one parameter as gathered
  double wire_bytes = 4;   // bytes of one gradient as reduced (zero.reduce_dtype)
  int stage = 0;           // zero.stage
  double base_params = 0;  // LoRA: the frozen base's parameters on a rank (the stage's share)
  double base_bytes = 0;   // LoRA: their bytes as stored (NF4: codes, absmax, dense parts)
  double gathered_base_bytes = 0;  // a base sharded by ZeRO-3: NF4 codes and absmax, or the
                                   // dense decoder layers
};

ZeroShard zero_shard_of(const RunConfig& cfg, const StepShape& shape, const ModelCosts& mc) {
  const bool lora = cfg.lora.rank > 0;
  ZeroShard zero;
  zero.ranks = shape.world / (shape.tp * shape.pp);
  // LoRA: the adapters of the rank's tp shard, split with their base projections.
  zero.params =
      (lora ? double(make_lora_layout(tp_shard_config(cfg.model, shape.tp), cfg.lora_config())
                         .params.total)
            : mc.shard_params(shape.tp)) /
      double(shape.pp);
  zero.param_bytes = lora ? 4 : double(dtype_size(cfg.precision.param_dtype()));
  zero.wire_bytes = cfg.zero.reduce_dtype == "bf16" ? 2 : 4;
  zero.stage = int(cfg.zero.stage);
  if (!lora) return zero;
  zero.base_params = mc.shard_params(shape.tp) / double(shape.pp);
  const int64_t pb = int64_t(dtype_size(cfg.precision.param_dtype()));
  zero.base_bytes = zero.base_params * double(pb);
  if (cfg.lora.base_dtype == "nf4") {
    const ParamLayout L = make_param_layout(tp_shard_config(cfg.model, shape.tp));
    const Nf4BaseLayout N = make_nf4_base_layout(L);
    zero.base_bytes =
        double(N.dense_elems * pb + N.code_bytes + N.absmax_values * 4) / double(shape.pp);
    if (nf4_base_sharded(true, zero.stage, zero.ranks))
      zero.gathered_base_bytes = double(N.code_bytes + N.absmax_values * 4) / double(shape.pp);
  } else if (lora_base_sharded(zero.stage, zero.ranks)) {  // the decoder layers, gathered
    const ParamLayout L = make_param_layout(tp_shard_config(cfg.model, shape.tp));
    const DenseShardLayout S = make_dense_shard_layout(L, 1);  // one chunk: the whole layers
    zero.gathered_base_bytes = double(S.shard_elems * pb) / double(shape.pp);
  }
  return zero;
}

// ZeRO's collectives over its ranks, ring algorithms: each rank sends (n-1)/n of the buffer.
// Returns their time (overlapped with backward or not, as zero.overlap_comm says).
// forwards: forward passes per micro-batch (LoRA DPO's reference forward gathers a sharded base
// once more).
double estimate_zero(const ZeroShard& zero, int64_t accum, int64_t forwards, const CostRates& rates,
                     StepEstimate& e) {
  const double params = zero.params, param_bytes = zero.param_bytes;
  const double sent_share = double(zero.ranks - 1) / double(zero.ranks);
  if (zero.stage == 0) {
    e.dp_bytes = 2 * sent_share * params * 4;  // all-reduce of the f32 gradients
  } else {
    const double reductions = zero.stage >= 2 ? double(accum) : 1;  // stage >= 2: every micro-batch
    e.dp_bytes = reductions * sent_share * params * zero.wire_bytes;  // reduce-scatter
    // Stage 3 gathers the parameters forward and backward; 1 and 2 gather the updated chunks.
    e.dp_bytes += zero.stage == 3 ? 2 * double(accum) * sent_share * params * param_bytes
                                  : sent_share * params * param_bytes;
    // A sharded base is gathered layer by layer in every forward and the backward, like the
    // parameters.
    e.dp_bytes += double(forwards + 1) * double(accum) * sent_share * zero.gathered_base_bytes;
  }
  return e.dp_bytes / (rates.link_gbs * 1e9);
}

// Context parallelism's exchanges: the ring's run under the block computations, the
// all-to-alls block.
struct ContextCommTimes {
  double ulysses_s = 0;  // exposed
  double ring_s = 0;     // overlapped
};

// The core's analytic volume per layer (plan/context_layout.h); full checkpointing runs the
// forward's exchanges again.
ContextCommTimes estimate_context_parallel(const ModelConfig& m, const StepShape& shape,
                                           const CostRates& rates, StepEstimate& e) {
  ContextCommTimes times;
  if (!shape.cp_layout) return times;
  const CpCommVolume v =
      cp_comm_volume(m, *shape.cp_layout, shape.micro_batch, shape.act, shape.cp_kept);
  const double fwd_times = shape.mode == Checkpointing::kFull ? 2 : 1;
  const double layers = shape.stage_layers * double(shape.accum);
  const double ring = (fwd_times * double(v.ring_forward) + double(v.ring_backward)) * layers;
  e.cp_bytes = (fwd_times * double(v.forward) + double(v.backward)) * layers;
  times.ring_s = ring / (rates.link_gbs * 1e9);
  times.ulysses_s = (e.cp_bytes - ring) / (rates.link_gbs * 1e9);
  return times;
}

struct HostTimes {
  double exposed_s = 0;  // the offloaded optimizer's transfers and host AdamW
  double overlap_s = 0;  // transfers that run a layer ahead of the compute
};

// Host traffic: the offloaded optimizer moves gradients out and parameters back every step
// and runs AdamW on the host (exposed); from stage 2 the gradients go out instead as each
// micro-batch's buckets are reduced, under backward (overlapped); offloaded checkpoints go out
// and come back a layer ahead (overlapped); an offloaded stage-3 shard is read for every
// gather.
HostTimes estimate_host_traffic(const RunConfig& cfg, const StepShape& shape, const ZeroShard& zero,
                                const CostRates& rates, StepEstimate& e) {
  const double params = zero.params, param_bytes = zero.param_bytes;
  const double state = zero.stage >= 1 ? params / double(zero.ranks) : params;
  HostTimes times;
  double host_overlapped = 0;
  if (cfg.zero.offload_optimizer == "cpu") {
    const bool streamed = zero_streams_gradients(zero.stage, true);
    const double grads = streamed ? double(shape.accum) * state * zero.wire_bytes : state * 4;
    const double exposed = state * param_bytes + (streamed ? 0 : grads);
    e.host_bytes += grads + state * param_bytes;
    if (streamed) host_overlapped += grads;
    times.exposed_s +=
        exposed / (rates.host_link_gbs * 1e9) + state / (rates.host_adam_gparams * 1e9);
  }
  if (shape.host_layers > 0) {
    const LayerActivationSpecs specs = layer_activation_specs(
        tp_shard_config(cfg.model, shape.tp), shape.micro_batch, shape.local_tokens,
        cfg.memory.mlp_chunk_tokens, shape.mode, shape.act);
    const double bytes =
        2 * double(arena_bytes(specs.kept)) * shape.host_layers * double(shape.accum);
    e.host_bytes += bytes;
    host_overlapped += bytes;
  }
  if (zero.stage == 3 && cfg.zero.offload_params == "cpu") {
    const double bytes = 2 * double(shape.accum) * (params / double(zero.ranks)) * param_bytes;
    e.host_bytes += bytes;
    host_overlapped += bytes;
  }
  if (cfg.lora.rank > 0 && cfg.lora.offload_base) {  // the base staged forward and backward
    // (sharded: a rank stages its chunk of the NF4 codes and absmax, or of the dense layers)
    const double staged = zero.base_bytes - zero.gathered_base_bytes * (1 - 1 / double(zero.ranks));
    const double bytes = 2 * double(shape.accum) * staged;
    e.host_bytes += bytes;
    host_overlapped += bytes;
  }
  times.overlap_s = host_overlapped / (rates.host_link_gbs * 1e9);
  return times;
}

}  // namespace

// The step's time: the busy compute, or the overlapped traffic where it takes longer, plus
// the bubble and everything exposed.
StepEstimate estimate_step_with(const RunConfig& cfg, int64_t world_size, const CostRates& rates,
                                const ModelCosts& mc) {
  const StepShape shape = step_shape_of(cfg, world_size);
  StepEstimate e;
  const double busy = estimate_compute(shape, cfg.model, mc, rates, e);
  const double link = rates.link_gbs * 1e9;
  estimate_tensor_parallel(cfg, shape, e);
  const double pp_exposed_s = estimate_pipeline(shape, e.compute_s + e.recompute_s, link, e);
  const ZeroShard zero = zero_shard_of(cfg, shape, mc);
  const double dp_s = estimate_zero(zero, shape.accum, 1 + shape.reference_forwards, rates, e);
  if (shape.reference_pass && zero.stage == 3) {  // the pass gathers as a forward does
    const double gathers = double(shape.accum) * double(zero.ranks - 1) / double(zero.ranks) *
                           zero.params * zero.param_bytes / link;
    e.reference_pass_s = cfg.zero.overlap_comm ? std::max(e.reference_pass_s, gathers)
                                               : e.reference_pass_s + gathers;
  }
  // The pass is one forward-only sweep of all its micro-batches through the stages: its fill
  // and drain once, pp - 1 stage forwards of a step's m.
  if (shape.reference_pass) e.reference_fill_s = e.reference_pass_s * sweep_fill(shape);
  const ContextCommTimes cp = estimate_context_parallel(cfg.model, shape, rates, e);
  const HostTimes host = estimate_host_traffic(cfg, shape, zero, rates, e);

  const double overlapped_comm = (cfg.zero.overlap_comm ? dp_s : 0) + cp.ring_s;
  const double exposed_comm =
      (cfg.zero.overlap_comm ? 0 : dp_s) + cp.ulysses_s + e.tp_bytes / link + pp_exposed_s;
  const double critical = std::max({busy, overlapped_comm, host.overlap_s});
  e.comm_s = exposed_comm + std::max(0.0, overlapped_comm - busy);
  e.host_s = host.exposed_s + std::max(0.0, host.overlap_s - std::max(busy, overlapped_comm));
  e.step_s = critical + e.bubble_s + exposed_comm + host.exposed_s;
  e.tokens_per_s = double(e.tokens_per_step) / e.step_s;
  return e;
}

StepEstimate estimate_step(const RunConfig& cfg, int64_t world_size, const CostRates& rates) {
  return estimate_step_with(cfg, world_size, rates, ModelCosts(cfg.model));
}

}  // namespace shardlm
