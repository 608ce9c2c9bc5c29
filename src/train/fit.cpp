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
double recompute_flops(const ModelConfig& c, const ModelCosts& mc, Checkpointing mode,
                       double tokens, double pairs) {
  if (mode == Checkpointing::kNone) return 0;
  if (mode == Checkpointing::kSelective)  // norms, q/k/v, o, gate and up: not attention, not down
    return 2 * (mc.layer_matmul - mc.layer_down) * tokens;
  // full: the whole layer forward, attention (QK^T and PV) included
  return 2 * mc.layer_matmul * tokens + 4.0 * double(c.head_dim() * c.n_heads * c.n_layers) * pairs;
}

StepEstimate estimate_step_with(const RunConfig& cfg, int64_t world_size, const CostRates& rates,
                                const ModelCosts& mc) {
  const ModelConfig& m = cfg.model;
  const Topology topo = topology_for(cfg, world_size);
  const int64_t dp = topo.size(Axis::kDp), world = topo.world_size();
  const int64_t tp = topo.size(Axis::kTp), pp = topo.size(Axis::kPp);
  const int64_t T = cfg.data.seq_len, B = cfg.train.micro_batch, accum = cfg.train.grad_accum;
  const int64_t rows = B * accum * dp;
  const std::optional<ContextLayout> cp_layout = context_layout_for(cfg);
  const int64_t Tl = cp_layout ? cp_layout->local() : T;  // tokens of a row on this rank
  StepEstimate e;
  e.tokens_per_step = rows * T;
  // Full causal rows (no document boundaries): T (T + 1) / 2 visible pairs per row.
  const double pairs = double(rows) * double(T) * double(T + 1) / 2;
  e.flops_per_step = mc.train_flops_token * double(e.tokens_per_step) + mc.train_flops_pair * pairs;
  const Checkpointing mode = checkpointing_from_name(cfg.memory.checkpointing);
  e.recompute_flops =
      recompute_flops(m, mc, mode, double(e.tokens_per_step), pairs) / double(world);
  e.compute_s = e.flops_per_step / double(world) / (rates.tflops * 1e12);
  e.recompute_s = e.recompute_flops / (rates.tflops * 1e12);
  const double busy = e.compute_s + e.recompute_s;
  const double link = rates.link_gbs * 1e9;

  // Tensor parallelism: per layer and micro-batch, two all-reduces of the [B*Tl, D] f32
  // activations forward (after o and down), one more when checkpointing recomputes the
  // attention block, two backward (the norm outputs' gradients); a ring all-reduce sends
  // 2 (tp-1)/tp of the buffer. Sequence parallelism turns each into an all-gather and a
  // reduce-scatter ((tp-1)/tp each: the same bytes), and backward re-gathers the two norm
  // outputs (one more all-reduce's worth per layer). They block the compute (not overlapped
  // in this version).
  const double act_bytes = double(B) * double(Tl) * double(m.dim) * 4;
  const double stage_layers = double(m.n_layers) / double(pp);
  // The vocabulary-parallel ends add one each per micro-batch: the embedding's partial rows
  // summed forward (first stage), the LM head's input gradient summed backward (last stage).
  if (tp > 1) {
    const double per_layer =
        (mode == Checkpointing::kNone ? 4 : 5) + (cfg.parallel.sequence_parallel ? 1 : 0);
    const double ends = pp == 1 ? 2 : 1;
    e.tp_bytes = (per_layer * stage_layers + ends) * double(accum) * 2 * double(tp - 1) /
                 double(tp) * act_bytes;
  }
  // Pipeline parallelism: a stage sends each micro-batch's activations forward and their
  // gradients back (2 buffers per micro-batch at an inner stage). 1F1B idles (pp - 1) / m of
  // a stage's busy time, and the fill and the drain each cross pp - 1 boundaries on the
  // critical path; the steady state's transfers overlap the compute.
  double pp_exposed_s = 0;
  if (pp > 1) {
    e.pp_bytes = 2 * double(accum) * act_bytes;
    e.bubble_s = busy * double(pp - 1) / double(accum);
    pp_exposed_s = 2 * double(pp - 1) * act_bytes / link;
  }

  // ZeRO over the ranks holding the same parameters (dp x cp), ring algorithms: each rank
  // sends (n-1)/n of the buffer. A rank's parameters are its tp shard of its pipeline stage
  // (the stage's share taken as 1/pp of the shard). With LoRA the engine holds (and
  // communicates) only the f32 adapters.
  const bool lora = cfg.lora.rank > 0;
  const int64_t zero_ranks = world / (tp * pp);
  const double P =
      (lora ? double(make_lora_layout(m, cfg.lora_config()).params.total) : mc.shard_params(tp)) /
      double(pp);
  const double pb = lora || cfg.precision.param != "bf16" ? 4 : 2;
  const double f = double(zero_ranks - 1) / double(zero_ranks);
  const int stage = int(cfg.zero.stage);
  if (stage == 0) {
    e.dp_bytes = 2 * f * P * 4;  // all-reduce of the f32 gradients
  } else {
    const double reductions = stage >= 2 ? double(accum) : 1;  // stage >= 2: every micro-batch
    e.dp_bytes = reductions * f * P * 4;                       // reduce-scatter
    e.dp_bytes += stage == 3 ? 2 * double(accum) * f * P * pb  // gathers: forward, backward
                             : f * P * pb;                     // updated chunks
  }
  const double dp_s = e.dp_bytes / (rates.link_gbs * 1e9);

  double ulysses_s = 0, ring_s = 0;
  if (const std::optional<ContextLayout>& cp = cp_layout) {
    // The core's analytic volume per layer (plan/context_layout.h); full checkpointing runs
    // the forward's exchanges again. The ring's run under the block computations, the
    // all-to-alls block.
    const CpCommVolume v = cp_comm_volume(m, *cp, B);
    const double fwd_times = mode == Checkpointing::kFull ? 2 : 1;
    const double layers = stage_layers * double(accum);
    const double ring = (fwd_times * double(v.ring_forward) + double(v.ring_backward)) * layers;
    e.cp_bytes = (fwd_times * double(v.forward) + double(v.backward)) * layers;
    ring_s = ring / (rates.link_gbs * 1e9);
    ulysses_s = (e.cp_bytes - ring) / (rates.link_gbs * 1e9);
  }

  // Host traffic: the offloaded optimizer moves gradients out and parameters back every step
  // and runs AdamW on the host (exposed); offloaded checkpoints go out and come back a layer
  // ahead (overlapped); an offloaded stage-3 shard is read for every gather.
  const double state = stage >= 1 ? P / double(zero_ranks) : P;
  double host_exposed_s = 0, host_overlapped = 0;
  if (cfg.zero.offload_optimizer == "cpu") {
    const double bytes = state * (4 + pb);
    e.host_bytes += bytes;
    host_exposed_s += bytes / (rates.host_link_gbs * 1e9) + state / (rates.host_adam_gparams * 1e9);
  }
  if (cfg.memory.offload_checkpoints && mode != Checkpointing::kNone) {
    const LayerActivationSpecs specs = layer_activation_specs(
        tp_shard_config(m, tp), B, Tl, cfg.memory.mlp_chunk_tokens, mode, DType::kF32);
    const double bytes = 2 * double(arena_bytes(specs.kept)) * stage_layers * double(accum);
    e.host_bytes += bytes;
    host_overlapped += bytes;
  }
  if (stage == 3 && cfg.zero.offload_params == "cpu") {
    const double bytes = 2 * double(accum) * (P / double(zero_ranks)) * pb;
    e.host_bytes += bytes;
    host_overlapped += bytes;
  }
  const double host_overlap_s = host_overlapped / (rates.host_link_gbs * 1e9);

  const double overlapped_comm = (cfg.zero.overlap_comm ? dp_s : 0) + ring_s;
  const double exposed_comm =
      (cfg.zero.overlap_comm ? 0 : dp_s) + ulysses_s + e.tp_bytes / link + pp_exposed_s;
  const double critical = std::max({busy, overlapped_comm, host_overlap_s});
  e.comm_s = exposed_comm + std::max(0.0, overlapped_comm - busy);
  e.host_s = host_exposed_s + std::max(0.0, host_overlap_s - std::max(busy, overlapped_comm));
  e.step_s = critical + e.bubble_s + exposed_comm + host_exposed_s;
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
      {"memory.offload_checkpoints", c.memory.offload_checkpoints ? "true" : "false"},
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
using Strategy = std::tuple<int64_t, std::string, std::string, std::string, bool, int64_t,
                            std::string, int64_t, int64_t>;
Strategy strategy_of(const RunConfig& c) {
  return {c.zero.stage,
          c.zero.offload_optimizer,
          c.zero.offload_params,
          c.memory.checkpointing,
          c.memory.offload_checkpoints,
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

}  // namespace

FitResult fit_search(const RunConfig& base, int64_t world_size, const FitBudget& budget,
                     const CostRates& rates, const Backend& backend) {
  SHARDLM_CHECK_KIND(ErrorKind::kConfig, budget.device_bytes > 0,
                     "--fit needs a device budget: --gpu-mem GiB or memory.budget_gib");
  // The global batch stays: rows per step = micro_batch x grad_accum x dp.
  const int64_t base_dp = topology_for(base, world_size).size(Axis::kDp);
  const int64_t rows = base.train.micro_batch * base.train.grad_accum * base_dp;
  std::vector<int64_t> chunks = {base.memory.mlp_chunk_tokens, 4096, 1024, 256};
  std::sort(chunks.begin(), chunks.end());
  chunks.erase(std::unique(chunks.begin(), chunks.end()), chunks.end());
  const std::vector<std::pair<std::string, std::string>> base_keys = searched_keys(base);

  const ModelCosts costs(base.model);
  FitResult result;
  std::map<Strategy, FitCandidate> best_of;
  std::map<std::tuple<int64_t, int64_t, int64_t>, ParamLayout> layouts;  // (tp, pp, stage)
  auto consider = [&](RunConfig c) {
    FitCandidate cand;
    try {
      c.validate();
      // Every stage's plan (pipeline: the fullest stage counts); the parameter layouts of
      // each (tp, pp, stage) are built once for the whole search.
      for (int64_t st = 0; st < c.parallel.pp; ++st) {
        PlanInputs pin = plan_inputs_for(c, world_size, backend, st);
        auto key = std::make_tuple(c.parallel.tp, c.parallel.pp, st);
        auto it = layouts.find(key);
        if (it == layouts.end()) it = layouts.emplace(key, make_param_layout(pin.model)).first;
        pin.layout = &it->second;
        MemoryPlan p = plan_memory(pin);
        if (st == 0 || p.peak_bytes[0] > cand.plan.peak_bytes[0]) cand.plan = std::move(p);
      }
      cand.est = estimate_step_with(c, world_size, rates, costs);
    } catch (const Error&) {
      ++result.invalid;
      return;
    }
    ++result.searched;
    const int d = int(MemPool::kDevice), h = int(MemPool::kHost);
    cand.fits = cand.plan.peak_bytes[d] <= budget.device_bytes &&
                (budget.host_bytes <= 0 || cand.plan.peak_bytes[h] <= budget.host_bytes);
    if (cand.fits) ++result.fitting;
    const auto keys = searched_keys(c);
    for (size_t i = 0; i < keys.size(); ++i)
      if (keys[i].second != base_keys[i].second) cand.sets.push_back(keys[i]);
    cand.cfg = std::move(c);
    const Strategy s = strategy_of(cand.cfg);
    auto it = best_of.find(s);
    if (it == best_of.end())
      best_of.emplace(s, std::move(cand));
    else if (better(cand, it->second))
      it->second = std::move(cand);
  };

  // Tensor parallelism up to 8 (one node's GPUs: it all-reduces in every layer); a tp that
  // does not divide the heads, kv heads, MLP and vocabulary is skipped. Pipeline stages (2, 4
  // or 8, at most the layers) are searched only when nothing fits without them: their bubble
  // never makes a step faster, and each stage is planned. Candidates the config rules reject
  // count as invalid.
  const ModelConfig& bm = base.model;
  auto search = [&](int64_t tp, int64_t pp) {
    for (const int64_t cp : divisors(world_size / (tp * pp))) {
      if (cp > kMaxCp) break;
      const int64_t dp = world_size / (tp * pp * cp);
      if (rows % dp != 0) continue;
      const int64_t per_rank_rows = rows / dp;
      std::vector<std::string> kinds = {base.parallel.cp_kind};
      if (cp > 1)
        kinds = cp >= 4 ? std::vector<std::string>{"ulysses", "ring", "hybrid"}
                        : std::vector<std::string>{"ulysses", "ring"};
      for (const std::string& kind : kinds)
        for (const int64_t micro : divisors(per_rank_rows))
          for (int stage = 0; stage <= 3; ++stage)
            for (const char* opt_off : {"none", "cpu"})
              for (const char* par_off : {"none", "cpu"}) {
                if (stage < 3 && std::string(par_off) == "cpu") continue;
                for (const char* ckpt : {"none", "selective", "full"})
                  for (const bool ckpt_off : {false, true}) {
                    if (std::string(ckpt) == "none" && ckpt_off) continue;
                    for (const int64_t chunk : chunks) {
                      RunConfig c = base;
                      c.parallel.tp = tp;
                      c.parallel.pp = pp;
                      c.parallel.cp = cp;
                      c.parallel.cp_kind = kind;
                      if (kind != "hybrid") c.parallel.cp_ulysses = 0;
                      c.train.micro_batch = micro;
                      c.train.grad_accum = per_rank_rows / micro;
                      c.zero.stage = stage;
                      c.zero.offload_optimizer = opt_off;
                      c.zero.offload_params = par_off;
                      c.memory.checkpointing = ckpt;
                      c.memory.offload_checkpoints = ckpt_off;
                      c.memory.mlp_chunk_tokens = chunk;
                      consider(std::move(c));
                    }
                  }
              }
    }
  };
  std::vector<int64_t> tps;
  for (const int64_t tp : divisors(world_size))
    if (tp <= kMaxTp && bm.n_heads % tp == 0 && bm.n_kv_heads % tp == 0 && bm.ffn_dim % tp == 0 &&
        bm.vocab_size % tp == 0)
      tps.push_back(tp);
  for (const int64_t tp : tps) search(tp, 1);
  if (result.fitting == 0)
    for (const int64_t tp : tps)
      for (const int64_t pp : {2, 4, 8})
        if (pp <= bm.n_layers && (world_size / tp) % pp == 0) search(tp, pp);

  std::vector<FitCandidate> all;
  all.reserve(best_of.size());
  for (auto& [s, c] : best_of) all.push_back(std::move(c));
  std::sort(all.begin(), all.end(), better);
  if (!all.empty() && all.front().fits) {
    result.chosen = std::move(all.front());
    all.erase(all.begin());
  }
  result.runner_ups = std::move(all);
  return result;
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
