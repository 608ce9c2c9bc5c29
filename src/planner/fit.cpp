// The configuration search behind `shardlm plan --fit` (fit.h); the step-time model it ranks
// by is step_estimate.cpp.
#include "shardlm/planner/fit.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <tuple>

#include "shardlm/core/check.h"
#include "shardlm/model/layout.h"
#include "shardlm/planner/plan_inputs.h"
#include "step_estimate.h"

namespace shardlm {
namespace {

constexpr int64_t kMaxCp = 64;  // the largest context-parallel degree the search tries
constexpr int64_t kMaxTp = 8;   // the largest tensor-parallel degree (one node's GPUs)

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

  // LoRA: the frozen base (dense or NF4) on the device, or in host memory staged a unit at a
  // time.
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
