// The step-time model and the configuration search behind `shardlm plan --fit` (fit.h).
#include "shardlm/train/fit.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <tuple>

#include "shardlm/core/check.h"
#include "shardlm/model/layout.h"
#include "shardlm/model/tensor_shard.h"
#include "shardlm/plan/context_layout.h"
#include "shardlm/plan/zero_layout.h"
#include "shardlm/train/plan_inputs.h"

namespace shardlm {
namespace {

constexpr int64_t kMaxCp = 64;  // the largest context-parallel degree the search tries
constexpr int64_t kMaxTp = 8;   // the largest tensor-parallel degree (one node's GPUs)

// What the estimate needs of the model's size tables, computed once per model.
struct ModelCosts {
  double params = 0;             // every parameter
  double layer_matmul = 0;       // decoder-layer matmul weights, summed over layers
  double layer_down = 0;         // of which the MLP down projections
  double train_flops_token = 0;  // train_flops() per token, attention apart
  double train_flops_pair = 0;   // train_flops() per visible pair

  explicit ModelCosts(const ModelConfig& c) : model(c) {
    const ParamLayout L = make_param_layout(c);
    params = double(L.total);
    for (const auto& e : L.entries) {
      if (e.layer < 0 || e.shape.rank() != 2) continue;
      layer_matmul += double(e.shape.numel());
      if (e.name.find("down_proj") != std::string::npos) layer_down += double(e.shape.numel());
    }
    train_flops_token = train_flops(c, 1, 0);
    train_flops_pair = train_flops(c, 0, 1);
  }
  // Parameters of one tensor-parallel rank's shard (tp_shard_config; Error(kConfig) when tp
  // does not divide the heads or the MLP).
  double shard_params(int64_t tp) const {
    if (tp == 1) return params;
    auto it = shard_params_.find(tp);
    if (it == shard_params_.end())
      it = shard_params_.emplace(tp, double(make_param_layout(tp_shard_config(model, tp)).total))
               .first;
    return it->second;
  }
  ModelConfig model;

 private:
  mutable std::map<int64_t, double> shard_params_;  // by tp: the search asks again and again
};

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
  const double kept = double((c.n_layers + every - 1) / every);
  return forward * (1 + (double(c.n_layers) - kept) / double(c.n_layers));
}

// The shape of one step as every term of the estimate sees it: the parallel degrees, the
// batch, a rank's part of each row and the checkpointing mode.
struct StepShape {
  int64_t dp = 1, world = 1, tp = 1, pp = 1;
  int64_t seq_len = 0, micro_batch = 0, accum = 0;
  int64_t rows = 0;  // rows of one step, all data-parallel ranks together
  std::optional<ContextLayout> cp_layout;
  int64_t local_tokens = 0;  // tokens of a row on this rank
  Checkpointing mode = Checkpointing::kNone;
  int64_t every = 1;            // memory.checkpoint_every
  double host_layers = 0;       // kept layers whose checkpoints go to the host ("auto": all)
  DType act = DType::kF32;      // precision.activations
  double activation_bytes = 0;  // one micro-batch's [B*Tl, D] activations
  double stage_layers = 0;      // decoder layers per pipeline stage
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
  shape.local_tokens = shape.cp_layout ? shape.cp_layout->local() : shape.seq_len;
  shape.mode = checkpointing_from_name(cfg.memory.checkpointing);
  shape.every = cfg.memory.checkpoint_every;
  const CheckpointOffload& offload = cfg.memory.offload_checkpoints;
  if (shape.mode != Checkpointing::kNone && offload.any()) {
    const double kept = double((m.n_layers / topo.size(Axis::kPp) + shape.every - 1) / shape.every);
    shape.host_layers = offload.automatic ? kept : std::round(offload.fraction * kept);
  }
  shape.act = cfg.precision.activation_dtype();
  shape.activation_bytes = double(shape.micro_batch) * double(shape.local_tokens) * double(m.dim) *
                           double(dtype_size(shape.act));
  shape.stage_layers = double(m.n_layers) / double(shape.pp);
  return shape;
}

// The step's FLOPs, and a rank's compute and recompute time; returns the rank's busy time.
double estimate_compute(const StepShape& shape, const ModelConfig& m, const ModelCosts& mc,
                        const CostRates& rates, StepEstimate& e) {
  e.tokens_per_step = shape.rows * shape.seq_len;
  // Full causal rows (no document boundaries): T (T + 1) / 2 visible pairs per row.
  const double pairs = double(shape.rows) * double(shape.seq_len) * double(shape.seq_len + 1) / 2;
  e.flops_per_step = mc.train_flops_token * double(e.tokens_per_step) + mc.train_flops_pair * pairs;
  e.recompute_flops =
      recompute_flops(m, mc, shape.mode, shape.every, double(e.tokens_per_step), pairs) /
      double(shape.world);
  e.compute_s = e.flops_per_step / double(shape.world) / (rates.tflops * 1e12);
  e.recompute_s = e.recompute_flops / (rates.tflops * 1e12);
  return e.compute_s + e.recompute_s;
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
// a stage's busy time, and the fill and the drain each cross pp - 1 boundaries on the
// critical path; the steady state's transfers overlap the compute. Returns the exposed
// transfer time.
double estimate_pipeline(const StepShape& shape, double busy, double link, StepEstimate& e) {
  if (shape.pp <= 1) return 0;
  e.pp_bytes = 2 * double(shape.accum) * shape.activation_bytes;
  e.bubble_s = busy * double(shape.pp - 1) / double(shape.accum);
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
};

ZeroShard zero_shard_of(const RunConfig& cfg, const StepShape& shape, const ModelCosts& mc) {
  const bool lora = cfg.lora.rank > 0;
  ZeroShard zero;
  zero.ranks = shape.world / (shape.tp * shape.pp);
  zero.params = (lora ? double(make_lora_layout(cfg.model, cfg.lora_config()).params.total)
                      : mc.shard_params(shape.tp)) /
                double(shape.pp);
  zero.param_bytes = lora ? 4 : double(dtype_size(cfg.precision.param_dtype()));
  zero.wire_bytes = cfg.zero.reduce_dtype == "bf16" ? 2 : 4;
  zero.stage = int(cfg.zero.stage);
  if (lora) zero.base_params = mc.shard_params(shape.tp) / double(shape.pp);
  return zero;
}

// ZeRO's collectives over its ranks, ring algorithms: each rank sends (n-1)/n of the buffer.
// Returns their time (overlapped with backward or not, as zero.overlap_comm says).
double estimate_zero(const ZeroShard& zero, int64_t accum, const CostRates& rates,
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
  const CpCommVolume v = cp_comm_volume(m, *shape.cp_layout, shape.micro_batch, shape.act);
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
    const double bytes = 2 * double(shape.accum) * zero.base_params *
                         double(dtype_size(cfg.precision.param_dtype()));
    e.host_bytes += bytes;
    host_overlapped += bytes;
  }
  times.overlap_s = host_overlapped / (rates.host_link_gbs * 1e9);
  return times;
}

// The step's time: the busy compute, or the overlapped traffic where it takes longer, plus
// the bubble and everything exposed.
StepEstimate estimate_step_with(const RunConfig& cfg, int64_t world_size, const CostRates& rates,
                                const ModelCosts& mc) {
  const StepShape shape = step_shape_of(cfg, world_size);
  StepEstimate e;
  const double busy = estimate_compute(shape, cfg.model, mc, rates, e);
  const double link = rates.link_gbs * 1e9;
  estimate_tensor_parallel(cfg, shape, e);
  const double pp_exposed_s = estimate_pipeline(shape, busy, link, e);
  const ZeroShard zero = zero_shard_of(cfg, shape, mc);
  const double dp_s = estimate_zero(zero, shape.accum, rates, e);
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

}  // namespace

StepEstimate estimate_step(const RunConfig& cfg, int64_t world_size, const CostRates& rates) {
  return estimate_step_with(cfg, world_size, rates, ModelCosts(cfg.model));
}

namespace {

std::vector<int64_t> divisors(int64_t n) {
  std::vector<int64_t> d;
  for (int64_t i = 1; i <= n; ++i)
    if (n % i == 0) d.push_back(i);
  return d;
}

// The keys the search sets, read from a config as --set would write them.
std::vector<std::pair<std::string, std::string>> searched_keys(const RunConfig& c) {
  return {
      {"zero.stage", std::to_string(c.zero.stage)},
      {"zero.offload_optimizer", c.zero.offload_optimizer},
      {"zero.offload_params", c.zero.offload_params},
      {"memory.checkpointing", c.memory.checkpointing},
      {"memory.offload_checkpoints", nlohmann::json(c.memory.offload_checkpoints).dump()},
      {"memory.checkpoint_every", std::to_string(c.memory.checkpoint_every)},
      {"lora.offload_base", c.lora.offload_base ? "true" : "false"},
      {"memory.mlp_chunk_tokens", std::to_string(c.memory.mlp_chunk_tokens)},
      {"parallel.tp", std::to_string(c.parallel.tp)},
      {"parallel.pp", std::to_string(c.parallel.pp)},
      {"parallel.cp", std::to_string(c.parallel.cp)},
      {"parallel.cp_kind", c.parallel.cp_kind},
      {"train.micro_batch", std::to_string(c.train.micro_batch)},
      {"train.grad_accum", std::to_string(c.train.grad_accum)},
  };
}

// Strategy: what the runner-up list keeps one configuration of.
using Strategy = std::tuple<int64_t, std::string, std::string, std::string, bool, int64_t, bool,
                            int64_t, std::string, int64_t, int64_t>;
Strategy strategy_of(const RunConfig& c) {
  return {c.zero.stage,
          c.zero.offload_optimizer,
          c.zero.offload_params,
          c.memory.checkpointing,
          c.memory.offload_checkpoints.any(),
          c.memory.checkpoint_every,
          c.lora.offload_base,
          c.parallel.cp,
          c.parallel.cp > 1 ? c.parallel.cp_kind : "",
          c.parallel.tp,
          c.parallel.pp};
}

double comm_bytes(const StepEstimate& e) {
  return e.dp_bytes + e.cp_bytes + e.tp_bytes + e.pp_bytes + e.host_bytes;
}

// a before b: fitting first; then faster (beyond 0.5%), less traffic, less recompute, fewer
// changes to the given config, less device memory.
bool better(const FitCandidate& a, const FitCandidate& b) {
  if (a.fits != b.fits) return a.fits;
  const int d = int(MemPool::kDevice);
  if (!a.fits) return a.plan.peak_bytes[d] < b.plan.peak_bytes[d];
  const double ta = a.est.tokens_per_s, tb = b.est.tokens_per_s;
  if (std::abs(ta - tb) > 0.005 * std::max(ta, tb)) return ta > tb;
  if (comm_bytes(a.est) != comm_bytes(b.est)) return comm_bytes(a.est) < comm_bytes(b.est);
  if (a.est.recompute_flops != b.est.recompute_flops)
    return a.est.recompute_flops < b.est.recompute_flops;
  if (a.sets.size() != b.sets.size()) return a.sets.size() < b.sets.size();  // fewer changes
  return a.plan.peak_bytes[d] < b.plan.peak_bytes[d];
}

// The candidate MLP chunk sizes: the config's own and three common ones, ascending.
std::vector<int64_t> mlp_chunk_choices(const RunConfig& base) {
  std::vector<int64_t> chunks = {base.memory.mlp_chunk_tokens, 4096, 1024, 256};
  std::sort(chunks.begin(), chunks.end());
  chunks.erase(std::unique(chunks.begin(), chunks.end()), chunks.end());
  return chunks;
}

// One `--fit` search: it plans and estimates every candidate, keeps the best of each strategy
// and counts what it tried. The global batch stays: rows per step = micro_batch x grad_accum x
// dp.
class FitSearch {
 public:
  FitSearch(const RunConfig& base, int64_t world_size, const FitBudget& budget,
            const CostRates& rates, const Backend& backend)
      : base_(base),
        world_size_(world_size),
        budget_(budget),
        rates_(rates),
        backend_(backend),
        rows_(base.train.micro_batch * base.train.grad_accum *
              topology_for(base, world_size).size(Axis::kDp)),
        chunks_(mlp_chunk_choices(base)),
        base_keys_(searched_keys(base)),
        costs_(base.model) {}

  // Pipeline stages (2, 4 or 8, at most the layers) are searched only when nothing fits
  // without them: their bubble never makes a step faster, and each stage is planned.
  FitResult run() {
    const ModelConfig& model = base_.model;
    const std::vector<int64_t> tps = tensor_parallel_choices();
    for (const int64_t tp : tps) search(tp, 1);
    if (result_.fitting == 0)
      for (const int64_t tp : tps)
        for (const int64_t pp : {2, 4, 8})
          if (pp <= model.n_layers && (world_size_ / tp) % pp == 0) search(tp, pp);
    return ranked_result();
  }

 private:
  // Tensor parallelism up to 8 (one node's GPUs: it all-reduces in every layer); a tp that
  // does not divide the heads, kv heads, MLP and vocabulary is skipped.
  std::vector<int64_t> tensor_parallel_choices() const {
    const ModelConfig& model = base_.model;
    std::vector<int64_t> tps;
    for (const int64_t tp : divisors(world_size_))
      if (tp <= kMaxTp && model.n_heads % tp == 0 && model.n_kv_heads % tp == 0 &&
          model.ffn_dim % tp == 0 && model.vocab_size % tp == 0)
        tps.push_back(tp);
    return tps;
  }

  // Every context-parallel degree and kind, and every micro-batch that keeps the global batch,
  // of one (tp, pp).
  void search(int64_t tp, int64_t pp) {
    for (const int64_t cp : divisors(world_size_ / (tp * pp))) {
      if (cp > kMaxCp) break;
      const int64_t dp = world_size_ / (tp * pp * cp);
      if (rows_ % dp != 0) continue;
      const int64_t per_rank_rows = rows_ / dp;
      std::vector<std::string> kinds = {base_.parallel.cp_kind};
      if (cp > 1)
        kinds = cp >= 4 ? std::vector<std::string>{"ulysses", "ring", "hybrid"}
                        : std::vector<std::string>{"ulysses", "ring"};
      for (const std::string& kind : kinds)
        for (const int64_t micro : divisors(per_rank_rows)) {
          RunConfig layout = base_;
          layout.parallel.tp = tp;
          layout.parallel.pp = pp;
          layout.parallel.cp = cp;
          layout.parallel.cp_kind = kind;
          if (kind != "hybrid") layout.parallel.cp_ulysses = 0;
          layout.train.micro_batch = micro;
          layout.train.grad_accum = per_rank_rows / micro;
          search_memory_settings(layout);
        }
    }
  }

  // Every ZeRO stage and offload of one parallel layout and batch split, each with every
  // activation setting.
  void search_memory_settings(const RunConfig& layout) {
    for (int stage = 0; stage <= 3; ++stage)
      for (const char* opt_off : {"none", "cpu"})
        for (const char* par_off : {"none", "cpu"}) {
          if (stage < 3 && std::string(par_off) == "cpu") continue;
          RunConfig c = layout;
          c.zero.stage = stage;
          c.zero.offload_optimizer = opt_off;
          c.zero.offload_params = par_off;
          search_activation_settings(c);
        }
  }

  // Every checkpointing mode, its placement and checkpoint_every, the LoRA base's place and
  // the MLP chunk.
  void search_activation_settings(const RunConfig& zero) {
    for (const char* ckpt : {"none", "selective", "full"})
      for (const int64_t every : checkpoint_every_choices(ckpt))
        for (const bool ckpt_off : {false, true}) {
          if (std::string(ckpt) == "none" && ckpt_off) continue;
          for (const bool base_off : lora_base_choices())
            for (const int64_t chunk : chunks_) {
              RunConfig c = zero;
              c.memory.checkpointing = ckpt;
              c.memory.checkpoint_every = every;
              c.memory.offload_checkpoints = {ckpt_off ? 1.0 : 0.0, false};
              c.lora.offload_base = base_off;
              c.memory.mlp_chunk_tokens = chunk;
              consider(std::move(c));
            }
        }
  }

  // LoRA: the frozen base on the device, or in host memory staged a unit at a time.
  std::vector<bool> lora_base_choices() const {
    return base_.lora.rank > 0 ? std::vector<bool>{false, true} : std::vector<bool>{false};
  }

  // Keeping every 2nd or 4th layer's input (full checkpointing only): a layer forward more
  // for the layers between, for when nothing else fits.
  std::vector<int64_t> checkpoint_every_choices(const std::string& ckpt) const {
    if (ckpt != "full") return {1};
    std::vector<int64_t> every = {1, 2, 4};
    if (base_.memory.checkpoint_every > 1) every.push_back(base_.memory.checkpoint_every);
    std::sort(every.begin(), every.end());
    every.erase(std::unique(every.begin(), every.end()), every.end());
    return every;
  }

  // Offloaded checkpoints: the fewest kept layers' on the host that keep the device within the
  // budget (the rest stay on the device, sparing the host and the copies); all when none do.
  void place_checkpoints(RunConfig& c) {
    if (!c.memory.offload_checkpoints.any()) return;
    PlanInputs pin = plan_inputs_for(c, world_size_, backend_, 0);
    pin.layout = &layout_of(c, 0, pin.model);
    const int host = fewest_host_checkpoints(pin, budget_.device_bytes);
    const CheckpointMap map(pin.model, pin.checkpointing, pin.checkpoint_placement);
    if (host >= 0) c.memory.offload_checkpoints.fraction = double(host) / map.kept_layers();
  }

  // Plans and estimates one candidate; those the config rules reject count as invalid.
  void consider(RunConfig c) {
    FitCandidate cand;
    try {
      c.validate();
      place_checkpoints(c);
      cand.plan = fullest_stage_plan(c);
      cand.est = estimate_step_with(c, world_size_, rates_, costs_);
    } catch (const Error&) {
      ++result_.invalid;
      return;
    }
    ++result_.searched;
    const int d = int(MemPool::kDevice), h = int(MemPool::kHost);
    cand.fits = cand.plan.peak_bytes[d] <= budget_.device_bytes &&
                (budget_.host_bytes <= 0 || cand.plan.peak_bytes[h] <= budget_.host_bytes);
    if (cand.fits) ++result_.fitting;
    const auto keys = searched_keys(c);
    for (size_t i = 0; i < keys.size(); ++i)
      if (keys[i].second != base_keys_[i].second) cand.sets.push_back(keys[i]);
    cand.cfg = std::move(c);
    keep_if_best(std::move(cand));
  }

  // Every stage's plan (pipeline: the fullest stage counts); the parameter layouts of each
  // (tp, pp, stage) are built once for the whole search.
  MemoryPlan fullest_stage_plan(const RunConfig& c) {
    MemoryPlan fullest;
    for (int64_t st = 0; st < c.parallel.pp; ++st) {
      PlanInputs pin = plan_inputs_for(c, world_size_, backend_, st);
      pin.layout = &layout_of(c, st, pin.model);
      MemoryPlan p = plan_memory(pin);
      if (st == 0 || p.peak_bytes[0] > fullest.peak_bytes[0]) fullest = std::move(p);
    }
    return fullest;
  }

  // The parameter layout of (tp, pp, stage), built once for the whole search.
  const ParamLayout& layout_of(const RunConfig& c, int64_t stage, const ModelConfig& model) {
    auto key = std::make_tuple(c.parallel.tp, c.parallel.pp, stage);
    auto it = layouts_.find(key);
    if (it == layouts_.end()) it = layouts_.emplace(key, make_param_layout(model)).first;
    return it->second;
  }

  void keep_if_best(FitCandidate cand) {
    const Strategy s = strategy_of(cand.cfg);
    auto it = best_of_.find(s);
    if (it == best_of_.end())
      best_of_.emplace(s, std::move(cand));
    else if (better(cand, it->second))
      it->second = std::move(cand);
  }

  // The best of each strategy, best first: the first is chosen when it fits.
  FitResult ranked_result() {
    std::vector<FitCandidate> all;
    all.reserve(best_of_.size());
    for (auto& [s, c] : best_of_) all.push_back(std::move(c));
    std::sort(all.begin(), all.end(), better);
    if (!all.empty() && all.front().fits) {
      result_.chosen = std::move(all.front());
      all.erase(all.begin());
    }
    result_.runner_ups = std::move(all);
    return std::move(result_);
  }

  const RunConfig& base_;
  const int64_t world_size_;
  const FitBudget& budget_;
  const CostRates& rates_;
  const Backend& backend_;
  const int64_t rows_;  // rows per step, kept by every candidate
  const std::vector<int64_t> chunks_;
  const std::vector<std::pair<std::string, std::string>> base_keys_;
  const ModelCosts costs_;
  FitResult result_;
  std::map<Strategy, FitCandidate> best_of_;
  std::map<std::tuple<int64_t, int64_t, int64_t>, ParamLayout> layouts_;  // (tp, pp, stage)
};

}  // namespace

FitResult fit_search(const RunConfig& base, int64_t world_size, const FitBudget& budget,
                     const CostRates& rates, const Backend& backend) {
  SHARDLM_CHECK_KIND(ErrorKind::kConfig, budget.device_bytes > 0,
                     "--fit needs a device budget: --gpu-mem GiB or memory.budget_gib");
  return FitSearch(base, world_size, budget, rates, backend).run();
}

std::string fit_loss_reason(const FitCandidate& chosen, const FitCandidate& other,
                            const FitBudget& budget) {
  const int d = int(MemPool::kDevice), h = int(MemPool::kHost);
  if (!other.fits) {
    if (other.plan.peak_bytes[d] > budget.device_bytes)
      return fmt::format("does not fit: device peak {} over the {} budget",
                         format_bytes(other.plan.peak_bytes[d]), format_bytes(budget.device_bytes));
    return fmt::format("does not fit: host peak {} over the {} budget",
                       format_bytes(other.plan.peak_bytes[h]), format_bytes(budget.host_bytes));
  }
  const StepEstimate &a = chosen.est, &b = other.est;
  const double slower = 1 - b.tokens_per_s / a.tokens_per_s;
  struct Part {
    const char* what;
    double extra_s;
  };
  const Part parts[] = {{"more recompute", b.recompute_s - a.recompute_s},
                        {"a longer pipeline bubble", b.bubble_s - a.bubble_s},
                        {"more exposed communication", b.comm_s - a.comm_s},
                        {"more host traffic and host optimizer time", b.host_s - a.host_s},
                        {"more compute per rank", b.compute_s - a.compute_s}};
  const Part* worst = &parts[0];
  for (const Part& p : parts)
    if (p.extra_s > worst->extra_s) worst = &p;
  if (slower > 0.005 && worst->extra_s > 0)
    return fmt::format("{:.0f}% slower: {} (+{:.3g} s per step)", 100 * slower, worst->what,
                       worst->extra_s);
  if (comm_bytes(b) > comm_bytes(a))
    return fmt::format("as fast, but more traffic ({} per step vs {})",
                       format_bytes(int64_t(comm_bytes(b))), format_bytes(int64_t(comm_bytes(a))));
  if (b.recompute_flops > a.recompute_flops) return "as fast, but more recompute";
  return fmt::format("as fast, but a higher device peak ({} vs {})",
                     format_bytes(other.plan.peak_bytes[d]),
                     format_bytes(chosen.plan.peak_bytes[d]));
}

std::string fit_set_line(const FitCandidate& c) {
  std::string line;
  for (const auto& [k, v] : c.sets)
    line += fmt::format("{}--set {}={}", line.empty() ? "" : " ", k, v);
  return line;
}

nlohmann::json fit_config_fragment(const FitCandidate& c) {
  nlohmann::json j = nlohmann::json::object();
  for (const auto& [k, v] : c.sets) {
    const size_t dot = k.find('.');
    nlohmann::json value;
    if (v == "true" || v == "false")
      value = v == "true";
    else if (!v.empty() &&
             std::all_of(v.begin(), v.end(), [](char ch) { return ch >= '0' && ch <= '9'; }))
      value = std::stoll(v);
    else
      value = v;
    j[k.substr(0, dot)][k.substr(dot + 1)] = value;
  }
  return j;
}

}  // namespace shardlm
