// `shardlm plan --config FILE [--set k=v]... [--world N] [--gpu-mem GiB] [--host-mem GiB]
// [--tflops T] [--json]`: one rank's planned peak bytes per pool and category for a run of N
// ranks, whether it fits the budgets given, and a tokens/s estimate from the model's FLOPs.
// It reads no data and allocates nothing model-sized: the planner and the backend's workspace
// queries are arithmetic, so the largest presets plan in milliseconds.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "commands.h"
#include "shardlm/core/check.h"
#include "shardlm/core/ledger.h"
#include "shardlm/model/layout.h"
#include "shardlm/model/sharded_base.h"
#include "shardlm/plan/plan.h"
#include "shardlm/planner/fit.h"
#include "shardlm/planner/plan_inputs.h"

namespace shardlm::cli {
namespace {

using json = nlohmann::json;

constexpr double kDefaultTflops = CostRates::kDefaultTflops;
constexpr int kBarWidth = 40;
constexpr double kGiB = double(int64_t{1} << 30);

struct Budget {
  const char* name;  // what set it, as the user wrote it
  MemPool pool;
  int64_t bytes = 0;
};

double share(int64_t part, int64_t whole) { return whole > 0 ? double(part) / double(whole) : 0; }

std::string bar(double fraction) {
  const int n = int(fraction * kBarWidth + 0.5);
  return std::string(size_t(n), '#') + std::string(size_t(kBarWidth - n), '.');
}

std::string count_text(int64_t n) {
  return n >= 1'000'000'000 ? fmt::format("{:.2f}B", double(n) / 1e9)
                            : fmt::format("{:.2f}M", double(n) / 1e6);
}

// How the config places checkpoints: "", " (offloaded)", " (auto offload)", " (5 of 16 kept
// layers offloaded)", each with ", every 2nd layer's input" where only every k-th is kept.
std::string placement_text(const RunConfig& c) {
  const MemoryConfig& m = c.memory;
  const CheckpointMap map(c.model, checkpointing_from_name(m.checkpointing),
                          checkpoint_placement_for(c));
  const int kept = map.kept_layers(), host = map.host_layers();
  std::string text = m.checkpointing == "none" || !m.offload_checkpoints.any() ? ""
                     : m.offload_checkpoints.automatic                         ? " (auto offload)"
                     : host == kept                                            ? " (offloaded)"
                                    : fmt::format(" ({} of {} kept layers offloaded)", host, kept);
  if (m.checkpoint_every > 1)
    text += fmt::format(", every {}{} layer's input", m.checkpoint_every,
                        m.checkpoint_every == 2   ? "nd"
                        : m.checkpoint_every == 3 ? "rd"
                                                  : "th");
  return text;
}

std::string gib_text(int64_t bytes) { return fmt::format("{:.2f} GiB", double(bytes) / kGiB); }

// The step-time estimate and the rates it assumes.
void print_estimate(std::ostream& out, const StepEstimate& tp, const CostRates& rates,
                    int64_t world) {
  out << fmt::format(
      "\nthroughput estimate: {:.0f} tokens/s in all ({:.0f} per rank), {} tokens per optimizer "
      "step in {:.3f} s (compute {:.3f} s, recompute {:.3f} s, pipeline bubble {:.3f} s, exposed "
      "communication {:.3f} s, host {:.3f} s)\n"
      "  assumes per rank {:.0f} TFLOP/s sustained (--tflops; the default {:.0f} is about 40% of "
      "an H100's 989 TFLOP/s dense bf16 peak), {:.0f} GB/s to the other ranks (--link-gbs), "
      "{:.0f} GB/s to the host (--host-link-gbs), AdamW on the host at {:.1f} G parameters/s; "
      "the model's training FLOPs on full causal rows (6 x matmul parameters per token + "
      "attention pairs) plus what checkpointing recomputes; ZeRO traffic overlapped with "
      "compute (zero.overlap_comm), ring exchanges and checkpoint offload overlapped, Ulysses "
      "all-to-alls, tensor-parallel all-reduces and the host optimizer not; a pipeline's 1F1B "
      "bubble of (pp - 1) / grad_accum of the busy time\n",
      tp.tokens_per_s, tp.tokens_per_s / double(world), tp.tokens_per_step, tp.step_s, tp.compute_s,
      tp.recompute_s, tp.bubble_s, tp.comm_s, tp.host_s, rates.tflops, kDefaultTflops,
      rates.link_gbs, rates.host_link_gbs, rates.host_adam_gparams);
  // Under pipeline stages the reference is a forward-only sweep: its fill and drain named.
  const std::string lora_fill =
      tp.reference_fill_s > 0
          ? fmt::format(" ({:.3f} s of it the sweep's fill and drain through the pipeline stages)",
                        tp.reference_fill_s)
          : "";
  if (tp.reference_s > 0)
    out << fmt::format(
        "  dpo with LoRA: the step includes the reference forward (the adapters off, one more "
        "forward of every row): {:.3f} s per step{}, and a sharded base's gathers for it\n",
        tp.reference_s, lora_fill);
  const std::string pass_fill =
      tp.reference_fill_s > 0
          ? fmt::format(
                ", plus {:.3f} s once for the sweep's fill and drain through the pipeline "
                "stages",
                tp.reference_fill_s)
          : "";
  if (tp.reference_pass_s > 0)
    out << fmt::format(
        "  dpo with full fine-tuning: before the first step, the reference pass (a forward of "
        "every training pair, unless log.dir holds a current dpo_reference.json) takes about "
        "{:.3f} s per step of an epoch{}, outside the step time\n",
        tp.reference_pass_s, pass_fill);
}

// The model and the run's grid, batch, ZeRO and checkpointing.
void print_run_lines(std::ostream& out, const RunConfig& cfg, const Topology& topo,
                     const ParamLayout& layout) {
  const auto& m = cfg.model;
  const int64_t world = topo.world_size();
  out << fmt::format("shardlm plan: {} ({} parameters, {} layers, dim {}), {} parameters\n", m.name,
                     count_text(layout.total), m.n_layers, m.dim, cfg.precision.param);
  out << fmt::format(
      "run: {} rank{} = dp {} x pp {} x cp {}{} x tp {}; micro_batch {} x seq_len {} ({} tokens "
      "of each row per rank), grad_accum {}; zero stage {}{}{}; checkpointing {}{}\n",
      world, world == 1 ? "" : "s", topo.size(Axis::kDp), topo.size(Axis::kPp),
      topo.size(Axis::kCp), cfg.parallel.cp > 1 ? " (" + cfg.parallel.cp_kind + ")" : "",
      topo.size(Axis::kTp), cfg.train.micro_batch, cfg.data.seq_len,
      cfg.data.seq_len / topo.size(Axis::kCp), cfg.train.grad_accum, cfg.zero.stage,
      cfg.zero.offload_optimizer == "cpu" ? ", optimizer on the host" : "",
      cfg.zero.offload_params == "cpu" ? ", parameters on the host" : "", cfg.memory.checkpointing,
      placement_text(cfg));
}

// Which ranks the table stands for: every rank, or one pipeline stage of several.
void print_rank_roles(std::ostream& out, const RunConfig& cfg, const Topology& topo,
                      const std::vector<MemoryPlan>& stage_plans) {
  const int d = int(MemPool::kDevice), h = int(MemPool::kHost);
  const int64_t world = topo.world_size();
  if (stage_plans.size() > 1) {  // pipeline stages: one role each
    const StagePartition part = pipeline_partition_for(cfg);
    std::string roles;
    for (size_t s = 0; s < stage_plans.size(); ++s)
      roles += fmt::format(
          "\n  stage {} (layers {}-{}, {} ranks): device peak {}, host peak {}", s, part.begin[s],
          part.begin[s + 1] - 1, world / int64_t(stage_plans.size()),
          gib_text(stage_plans[s].peak_bytes[d]), gib_text(stage_plans[s].peak_bytes[h]));
    out << fmt::format(
        "rank roles: {} pipeline stages (parallel.pp; tp {}, 1F1B over {} micro-batches), the "
        "ranks of a stage alike; the table is the stage with the largest device peak:{}\n\n",
        stage_plans.size(), topo.size(Axis::kTp), cfg.train.grad_accum, roles);
  } else {
    out << fmt::format(
        "rank roles: {}\n\n",
        world == 1 ? "one rank"
                   : fmt::format("all {} ranks are alike (data, context and tensor parallelism "
                                 "give every rank an equal shard): this table stands for each of "
                                 "them",
                                 world));
  }
}

// Bytes per category and pool with their shares of the peak, then a bar chart per pool.
void print_category_table(std::ostream& out, const MemoryPlan& plan) {
  const int d = int(MemPool::kDevice), h = int(MemPool::kHost);
  out << fmt::format("{:<14}{:>14}{:>8}{:>14}{:>8}\n", "category", "device", "share", "host",
                     "share");
  for (int c = 0; c < kNumMemCategories; ++c) {
    const int64_t dev = plan.by_category[d][c], host = plan.by_category[h][c];
    out << fmt::format("{:<14}{:>14}{:>7.1f}%{:>14}{:>7.1f}%\n",
                       mem_category_name(static_cast<MemCategory>(c)), format_bytes(dev),
                       100 * share(dev, plan.peak_bytes[d]), format_bytes(host),
                       100 * share(host, plan.peak_bytes[h]));
  }
  out << fmt::format("{:<14}{:>14}{:>8}{:>14}{:>8}\n\n", "total (peak)",
                     format_bytes(plan.peak_bytes[d]), "", format_bytes(plan.peak_bytes[h]), "");

  for (const int pool : {d, h}) {
    if (plan.peak_bytes[pool] == 0) continue;
    out << fmt::format("{} pool, share of {}:\n", pool == d ? "device" : "host",
                       format_bytes(plan.peak_bytes[pool]));
    for (int c = 0; c < kNumMemCategories; ++c) {
      const int64_t b = plan.by_category[pool][c];
      if (b == 0) continue;
      out << fmt::format("  {:<13}{} {:5.1f}%\n", mem_category_name(static_cast<MemCategory>(c)),
                         bar(share(b, plan.peak_bytes[pool])),
                         100 * share(b, plan.peak_bytes[pool]));
    }
    out << "\n";
  }
}

// Each budget's verdict, with the settings that lower the device peak when one is exceeded.
void print_budget_verdicts(std::ostream& out, const RunConfig& cfg, const MemoryPlan& plan,
                           const std::vector<Budget>& budgets) {
  if (budgets.empty()) {
    out << "fits: no budget given (--gpu-mem, --host-mem or memory.budget_gib)\n";
    return;
  }
  for (const Budget& b : budgets) {
    const int64_t need = plan.peak_bytes[int(b.pool)];
    const char* pool = b.pool == MemPool::kDevice ? "device" : "host";
    out << fmt::format(
        "{} {} ({}): {}, the {} peak {} is {:.0f}% of it{}\n", pool, b.name, gib_text(b.bytes),
        need <= b.bytes ? "fits" : "DOES NOT FIT", pool, gib_text(need), 100 * share(need, b.bytes),
        need <= b.bytes ? "" : fmt::format(" ({} over)", format_bytes(need - b.bytes)));
  }
  bool device_over = false;
  for (const Budget& b : budgets)
    device_over = device_over ||
                  (b.pool == MemPool::kDevice && plan.peak_bytes[int(MemPool::kDevice)] > b.bytes);
  if (device_over) {
    out << fmt::format("  to lower the device peak: {}\n",
                       fmt::join(device_memory_hints(cfg), ", "));
  }
}

void print_text(std::ostream& out, const RunConfig& cfg, const Topology& topo,
                const ParamLayout& layout, const MemoryPlan& plan,
                const std::vector<Budget>& budgets, const CostRates& rates, const StepEstimate& tp,
                int threads, const std::vector<MemoryPlan>& stage_plans) {
  const int64_t world = topo.world_size();
  print_run_lines(out, cfg, topo, layout);
  print_rank_roles(out, cfg, topo, stage_plans);
  print_category_table(out, plan);
  print_budget_verdicts(out, cfg, plan, budgets);
  out << fmt::format("peak: {}\n", plan.peak_moment);
  if (world > 1 && cfg.train.device == "cuda" && !cfg.parallel.device_comm_staged())
    out << "  NCCL's own buffers are not in these figures: their size depends on the NCCL "
           "version and the node, so a run measures them as it makes its communicators and "
           "plans them then (device, comm; memory_rank{R}.json's transport_device_bytes)\n";
  if (threads > 1)
    out << fmt::format(
        "  the CPU backend's attention scratch is per thread: planned for {} threads "
        "(OMP_NUM_THREADS); a run with another thread count plans its own\n",
        threads);
  print_estimate(out, tp, rates, world);
}

// The end-of-run sample's plan in one line, against the device budgets.
void print_sample_line(std::ostream& out, const MemoryPlan& sample,
                       const std::vector<Budget>& budgets) {
  const int64_t need = sample.peak_bytes[int(MemPool::kDevice)];
  std::string verdict;
  for (const Budget& b : budgets)
    if (b.pool == MemPool::kDevice)
      verdict += fmt::format(", {} {} ({})", need <= b.bytes ? "fits" : "DOES NOT FIT", b.name,
                             gib_text(b.bytes));
  out << fmt::format(
      "end-of-run sample (sample.prompt; rank 0 alone, the training buffers released): device "
      "peak {} (parameters {}){}\n",
      format_bytes(need),
      format_bytes(sample.by_category[int(MemPool::kDevice)][int(MemCategory::kParams)]), verdict);
}

// A sample over the budget: the run would stop at start-up. Returns the exit code (4).
int refuse_sample(const MemoryPlan& sample) {
  std::cout.flush();
  std::cerr << fmt::format(
      "shardlm: out of memory: the end-of-run sample's planned device peak of {} on rank 0 (the "
      "whole model and its key/value cache, the same whatever the grid) exceeds the budget; set "
      "sample.count = 0\n",
      gib_text(sample.peak_bytes[int(MemPool::kDevice)]));
  return 4;
}

json plan_report(const RunConfig& cfg, const Topology& topo, const ParamLayout& layout,
                 const MemoryPlan& plan, const std::vector<Budget>& budgets, bool fits,
                 const CostRates& rates, const StepEstimate& tp, int threads,
                 const std::vector<MemoryPlan>& stage_plans) {
  const int d = int(MemPool::kDevice), h = int(MemPool::kHost);
  json shares = {{"device", json::object()}, {"host", json::object()}};
  for (int c = 0; c < kNumMemCategories; ++c) {
    const std::string name(mem_category_name(static_cast<MemCategory>(c)));
    shares["device"][name] = share(plan.by_category[d][c], plan.peak_bytes[d]);
    shares["host"][name] = share(plan.by_category[h][c], plan.peak_bytes[h]);
  }
  json budget_list = json::array();
  for (const Budget& b : budgets) {
    const int64_t need = plan.peak_bytes[int(b.pool)];
    budget_list.push_back({{"name", b.name},
                           {"pool", b.pool == MemPool::kDevice ? "device" : "host"},
                           {"bytes", b.bytes},
                           {"fits", need <= b.bytes}});
  }
  const json planned = plan_json(plan);
  return {
      {"model",
       {{"name", cfg.model.name},
        {"parameters", layout.total},
        {"n_layers", cfg.model.n_layers},
        {"dim", cfg.model.dim}}},
      {"world", topo.world_size()},
      {"grid",
       {{"dp", topo.size(Axis::kDp)},
        {"pp", topo.size(Axis::kPp)},
        {"cp", topo.size(Axis::kCp)},
        {"tp", topo.size(Axis::kTp)}}},
      {"roles", stage_plans.size() <= 1
                    ? json::array({{{"ranks", topo.world_size()},
                                    {"description", "every rank (dp x cp x tp: equal shards)"},
                                    {"planned", planned},
                                    {"share", shares}}})
                    : [&] {  // one role per pipeline stage
                        json roles = json::array();
                        const StagePartition part = pipeline_partition_for(cfg);
                        for (size_t s = 0; s < stage_plans.size(); ++s)
                          roles.push_back(
                              {{"ranks", topo.world_size() / int64_t(stage_plans.size())},
                               {"stage", s},
                               {"description", fmt::format("pipeline stage {}: layers {}-{}", s,
                                                           part.begin[s], part.begin[s + 1] - 1)},
                               {"planned", plan_json(stage_plans[s])}});
                        return roles;
                      }()},
      {"planned", planned},
      {"budgets", budget_list},
      {"fits", fits},
      {"throughput",
       {{"tflops_per_rank", rates.tflops},
        {"link_gbs", rates.link_gbs},
        {"host_link_gbs", rates.host_link_gbs},
        {"host_adam_gparams", rates.host_adam_gparams},
        {"tokens_per_step", tp.tokens_per_step},
        {"flops_per_step", tp.flops_per_step},
        {"recompute_flops_per_rank", tp.recompute_flops},
        {"dp_bytes_per_rank", tp.dp_bytes},
        {"cp_bytes_per_rank", tp.cp_bytes},
        {"tp_bytes_per_rank", tp.tp_bytes},
        {"pp_bytes_per_rank", tp.pp_bytes},
        {"host_bytes_per_rank", tp.host_bytes},
        {"compute_s", tp.compute_s},
        {"recompute_s", tp.recompute_s},
        {"reference_flops_per_rank", tp.reference_flops},
        {"reference_s", tp.reference_s},
        {"reference_pass_s_per_epoch_step", tp.reference_pass_s},
        {"reference_fill_s", tp.reference_fill_s},
        {"bubble_s", tp.bubble_s},
        {"comm_s", tp.comm_s},
        {"host_s", tp.host_s},
        {"step_s", tp.step_s},
        {"tokens_per_s", tp.tokens_per_s},
        {"assumption",
         "sustained rates per rank; training FLOPs of full causal rows plus recompute; ZeRO "
         "traffic, ring exchanges and checkpoint offload overlapped with compute, Ulysses "
         "all-to-alls, tensor-parallel all-reduces and the host optimizer not; the 1F1B bubble "
         "(pp - 1) / grad_accum of the busy time; DPO's reference, a forward-only sweep of m "
         "micro-batches through the stages, m + pp - 1 stage forwards"}}},
      {"peak_moment", plan.peak_moment},
      {"workspace_threads", threads},
  };
}

constexpr size_t kFitRunnerUps = 6;  // the runner-ups --fit shows

// A candidate's peaks against the device budget and its estimated throughput.
std::string fit_summary(const FitCandidate& c, const FitBudget& budget) {
  const int d = int(MemPool::kDevice), h = int(MemPool::kHost);
  return fmt::format("device {} ({:.0f}% of the budget), host {}; est. {:.0f} tokens/s",
                     format_bytes(c.plan.peak_bytes[d]),
                     100 * share(c.plan.peak_bytes[d], budget.device_bytes),
                     format_bytes(c.plan.peak_bytes[h]), c.est.tokens_per_s);
}

// A candidate's settings in one line: grid, ZeRO and offloads, checkpointing, cp, batch.
std::string fit_description(const FitCandidate& c, int64_t world) {
  const RunConfig& x = c.cfg;
  // A LoRA base sharded over ZeRO-3's ranks (the dp x cp ranks of a stage's tp shard).
  const bool base_sharded =
      x.lora.rank > 0 &&
      lora_base_sharded(int(x.zero.stage), world / (x.parallel.tp * x.parallel.pp));
  return fmt::format(
      "{}zero.stage={}{}{}{}{}, checkpointing={}{}, {}, micro_batch={} x grad_accum={}",
      (x.parallel.tp > 1 ? fmt::format("tp={}, ", x.parallel.tp) : "") +
          (x.parallel.pp > 1 ? fmt::format("pp={}, ", x.parallel.pp) : ""),
      x.zero.stage, x.zero.offload_optimizer == "cpu" ? " +optimizer offload" : "",
      x.zero.offload_params == "cpu" ? " +param offload" : "",
      base_sharded ? " +LoRA base sharded" : "",
      x.lora.offload_base ? " +LoRA base on the host" : "", x.memory.checkpointing,
      placement_text(x),
      x.parallel.cp > 1 ? fmt::format("cp={} {}", x.parallel.cp, x.parallel.cp_kind)
                        : std::string("no cp"),
      x.train.micro_batch, x.train.grad_accum);
}

// `--fit --json`: the search's counts, the chosen candidate and the runner-ups with why each
// lost.
json fit_json(const FitResult& r, const FitBudget& budget) {
  json j = {{"searched", r.searched},
            {"invalid", r.invalid},
            {"fitting", r.fitting},
            {"budget", {{"device_bytes", budget.device_bytes}, {"host_bytes", budget.host_bytes}}},
            {"fits", r.chosen.has_value()}};
  auto cand_json = [&](const FitCandidate& c) {
    return json{{"set", fit_set_line(c)},
                {"config", fit_config_fragment(c)},
                {"fits", c.fits},
                {"planned", plan_json(c.plan)},
                {"tokens_per_s", c.est.tokens_per_s},
                {"step_s", c.est.step_s}};
  };
  if (r.chosen) j["chosen"] = cand_json(*r.chosen);
  j["runner_ups"] = json::array();
  for (size_t i = 0; i < r.runner_ups.size() && i < kFitRunnerUps; ++i) {
    json c = cand_json(r.runner_ups[i]);
    c["why"] = fit_loss_reason(r.chosen ? *r.chosen : r.runner_ups[i], r.runner_ups[i], budget);
    j["runner_ups"].push_back(c);
  }
  return j;
}

// `--fit` as text: what was searched, the chosen candidate as --set arguments and a config
// fragment, the runner-ups, and the chosen one's step-time estimate.
void print_fit_text(std::ostream& out, const RunConfig& cfg, int64_t world, const FitBudget& budget,
                    const CostRates& rates, const FitResult& r) {
  out << fmt::format(
      "shardlm plan --fit: {} ({}), {} rank{}; budget per rank: device {}{}\n"
      "searched {} configurations (ZeRO stage and offload, checkpointing and its offload, tp "
      "and pp degree, cp degree and kind, micro-batch at the same global batch, MLP chunk; {} "
      "combinations the config rules reject); {} fit\n\n",
      cfg.model.name, cfg.precision.param, world, world == 1 ? "" : "s",
      format_bytes(budget.device_bytes),
      budget.host_bytes > 0 ? ", host " + format_bytes(budget.host_bytes) : std::string(),
      r.searched, r.invalid, r.fitting);
  if (r.chosen) {
    const FitCandidate& c = *r.chosen;
    out << fmt::format("chosen: {}\n  {}\n", fit_description(c, world), fit_summary(c, budget));
    const std::string line = fit_set_line(c);
    out << fmt::format("  as --set: {}\n",
                       line.empty() ? "(nothing to change: the config as given is best)" : line);
    if (!c.sets.empty())
      out << fmt::format("  as config (merge into the file):\n{}\n",
                         fit_config_fragment(c).dump(2));
  } else {
    out << "nothing fits the budget; the configurations that come closest:\n";
  }
  out << "\nrunner-up strategies:\n";
  for (size_t i = 0; i < r.runner_ups.size() && i < kFitRunnerUps; ++i) {
    const FitCandidate& c = r.runner_ups[i];
    out << fmt::format("  {}. {}\n     {}; {}\n", i + 1, fit_description(c, world),
                       fit_summary(c, budget),
                       fit_loss_reason(r.chosen ? *r.chosen : c, c, budget));
  }
  if (r.chosen) print_estimate(out, r.chosen->est, rates, world);
}

// `--fit-output`: the chosen configuration as a whole config, every key resolved: `train
// --config` takes it as it is.
void write_fit_config(const RunConfig& chosen, const std::string& output_path) {
  // The loader has already joined the file's relative paths to its directory (a --set path
  // stays relative to the working directory), so both are made absolute against the working
  // directory.
  json whole = run_config_to_json(chosen);
  for (const char* key : {"/data/train", "/data/valid", "/log/dir"}) {
    const json::json_pointer ptr(key);
    if (whole.contains(ptr) && whole[ptr].is_string() && !whole[ptr].get<std::string>().empty()) {
      const std::filesystem::path p = whole[ptr].get<std::string>();
      if (p.is_relative()) whole[ptr] = std::filesystem::absolute(p).lexically_normal().string();
    }
  }
  std::ofstream f(output_path);
  if (!(f << whole.dump(2) << "\n"))
    SHARDLM_FAIL(ErrorKind::kConfig, "--fit-output: cannot write '{}'", output_path);
}

// `--fit`: the chosen configuration as --set arguments and a config fragment, the runner-ups
// with why each lost. Returns the exit code: 0 when one fits, 4 when none does.
int print_fit(std::ostream& out, const RunConfig& cfg, int64_t world, const FitBudget& budget,
              const CostRates& rates, const Backend& backend, bool as_json,
              const std::string& output_path) {
  const FitResult r = fit_search(cfg, world, budget, rates, backend);
  if (as_json)
    out << fit_json(r, budget).dump(2) << "\n";
  else
    print_fit_text(out, cfg, world, budget, rates, r);
  if (r.chosen && !output_path.empty()) {
    write_fit_config(r.chosen->cfg, output_path);
    if (!as_json) out << fmt::format("\nwrote the chosen configuration to {}\n", output_path);
  }
  return r.chosen ? 0 : 4;
}

struct PlanOptions {
  std::string config_path;
  std::string deepspeed_path;
  std::vector<std::string> overrides;
  int64_t world = 1;
  double gpu_mem_gib = 0;
  double host_mem_gib = 0;
  CostRates rates;
  bool json = false;
  bool fit = false;
  std::string fit_output;
};

void add_plan_options(CLI::App* sub, PlanOptions& opt) {
  sub->add_option("--config", opt.config_path, "JSON config file (see configs/)")->required();
  sub->add_option("--deepspeed", opt.deepspeed_path,
                  "DeepSpeed ds_config.json mapped onto shardlm keys, as for train");
  sub->add_option("--set", opt.overrides, "override a config key: --set data.seq_len=8192")
      ->take_all();
  sub->add_option("--world", opt.world, "number of ranks (processes) of the run")
      ->check(CLI::PositiveNumber);
  sub->add_option("--gpu-mem", opt.gpu_mem_gib, "device memory per rank, GiB (0: no budget)")
      ->check(CLI::NonNegativeNumber);
  sub->add_option("--host-mem", opt.host_mem_gib, "host memory per rank, GiB (0: no budget)")
      ->check(CLI::NonNegativeNumber);
  sub->add_option("--tflops", opt.rates.tflops,
                  "sustained TFLOP/s per rank for the throughput estimate (default 400: an "
                  "H100 in bf16 at about 40% of peak)")
      ->check(CLI::PositiveNumber);
  sub->add_option("--link-gbs", opt.rates.link_gbs,
                  "GB/s each rank sends to the others (default 100)")
      ->check(CLI::PositiveNumber);
  sub->add_option("--host-link-gbs", opt.rates.host_link_gbs,
                  "GB/s between a rank's device and host memory (default 25)")
      ->check(CLI::PositiveNumber);
  sub->add_flag("--json", opt.json, "print the plan as one JSON object");
  sub->add_flag("--fit", opt.fit,
                "search ZeRO stage and offload, checkpointing, tp and pp degree, cp degree and "
                "kind, micro-batch and MLP chunk for the fastest configuration within the budget "
                "(--gpu-mem or "
                "memory.budget_gib, and --host-mem)");
  sub->add_option("--fit-output", opt.fit_output,
                  "with --fit: write the chosen configuration, whole, to this JSON file");
}

// The budgets given: --gpu-mem, memory.budget_gib and --host-mem, in that order.
std::vector<Budget> budgets_of(const PlanOptions& opt, const RunConfig& cfg) {
  std::vector<Budget> budgets;
  if (opt.gpu_mem_gib > 0)
    budgets.push_back({"--gpu-mem", MemPool::kDevice, int64_t(opt.gpu_mem_gib * kGiB)});
  if (cfg.memory.budget_gib > 0)
    budgets.push_back({"memory.budget_gib", MemPool::kDevice, cfg.memory.budget_bytes()});
  if (opt.host_mem_gib > 0)
    budgets.push_back({"--host-mem", MemPool::kHost, int64_t(opt.host_mem_gib * kGiB)});
  return budgets;
}

// The smallest budget of each pool (0: none given), for --fit.
FitBudget fit_budget_of(const std::vector<Budget>& budgets) {
  FitBudget fb;
  for (const Budget& b : budgets) {
    int64_t& slot = b.pool == MemPool::kDevice ? fb.device_bytes : fb.host_bytes;
    slot = slot == 0 ? b.bytes : std::min(slot, b.bytes);
  }
  return fb;
}

bool plan_fits(const MemoryPlan& plan, const std::vector<Budget>& budgets) {
  bool fits = true;
  for (const Budget& b : budgets) fits = fits && plan.peak_bytes[int(b.pool)] <= b.bytes;
  return fits;
}

// One plan per pipeline stage (one at pp = 1).
std::vector<MemoryPlan> plan_stages(const RunConfig& cfg, int64_t world, const Backend& backend) {
  std::vector<MemoryPlan> stage_plans;
  for (int64_t s = 0; s < cfg.parallel.pp; ++s)
    stage_plans.push_back(plan_memory(plan_inputs_for(cfg, world, backend, s)));
  return stage_plans;
}

// The stage with the largest device peak (the first of equals).
const MemoryPlan& worst_stage(const std::vector<MemoryPlan>& stage_plans) {
  size_t worst = 0;
  for (size_t s = 1; s < stage_plans.size(); ++s)
    if (stage_plans[s].peak_bytes[0] > stage_plans[worst].peak_bytes[0]) worst = s;
  return stage_plans[worst];
}

// The exceeded budgets on stderr, as a run that runs out of memory says them. Returns its exit
// code (4).
int refuse_plan(const MemoryPlan& plan, const std::vector<Budget>& budgets) {
  std::cout.flush();
  for (const Budget& b : budgets)
    if (plan.peak_bytes[int(b.pool)] > b.bytes)
      std::cerr << fmt::format(
          "shardlm: out of memory: the planned {} peak of {} exceeds {} ({})\n",
          b.pool == MemPool::kDevice ? "device" : "host", gib_text(plan.peak_bytes[int(b.pool)]),
          b.name, gib_text(b.bytes));
  return 4;
}

// `shardlm plan`: returns the exit code (0, or 4 when the plan or the sample does not fit).
int run_plan(const PlanOptions& opt) {
  const RunConfig cfg =
      load_cli_config(opt.config_path, opt.deepspeed_path, opt.overrides, opt.world, true);
  const Topology topo = topology_for(cfg, opt.world);
  // The kernel scratch is sized by the backend the run will use (its tiling).
  const std::unique_ptr<Backend> backend = make_backend(DeviceKind::kCpu);
  const std::vector<Budget> budgets = budgets_of(opt, cfg);

  // The end-of-run sample: rank 0 alone, after the training buffers are released. The
  // same for every grid and setting: --fit cannot make it fit.
  std::optional<MemoryPlan> sample;
  if (const auto in = sampler_plan_inputs_for(cfg, *backend)) sample = plan_decoder_memory(*in);
  const bool sample_fits = !sample || plan_fits(*sample, budgets);
  if (opt.fit && !sample_fits) {
    if (opt.json)
      std::cout << json{{"fits", false}, {"sample", plan_json(*sample)}}.dump(2) << "\n";
    else
      print_sample_line(std::cout, *sample, budgets);
    return refuse_sample(*sample);
  }
  if (opt.fit)
    return print_fit(std::cout, cfg, opt.world, fit_budget_of(budgets), opt.rates, *backend,
                     opt.json, opt.fit_output);
  if (!opt.fit_output.empty())
    SHARDLM_FAIL(ErrorKind::kConfig, "--fit-output is for --fit; add --fit");

  // The report's plan is the stage with the largest device peak.
  const std::vector<MemoryPlan> stage_plans = plan_stages(cfg, opt.world, *backend);
  const MemoryPlan plan = worst_stage(stage_plans);
  const ParamLayout layout = make_param_layout(cfg.model);
  const bool fits = plan_fits(plan, budgets);

  const StepEstimate tp = estimate_step(cfg, opt.world, opt.rates);
  const int threads = backend->workspace_threads();
  if (opt.json) {
    json report = plan_report(cfg, topo, layout, plan, budgets, fits && sample_fits, opt.rates, tp,
                              threads, stage_plans);
    if (sample) report["sample"] = plan_json(*sample);
    std::cout << report.dump(2) << "\n";
  } else {
    print_text(std::cout, cfg, topo, layout, plan, budgets, opt.rates, tp, threads, stage_plans);
    if (sample) print_sample_line(std::cout, *sample, budgets);
  }
  if (!fits) return refuse_plan(plan, budgets);
  if (!sample_fits) return refuse_sample(*sample);
  return 0;
}

}  // namespace

Command add_plan_command(CLI::App& app) {
  auto opt = std::make_shared<PlanOptions>();
  CLI::App* sub = app.add_subcommand(
      "plan",
      "predict one rank's peak memory per pool and category before launch, whether it fits, "
      "and the tokens/s to expect (exit 4 when it does not fit); --fit searches the settings "
      "for the fastest configuration that fits");
  add_plan_options(sub, *opt);
  return {sub, [opt] { return run_plan(*opt); }};
}

}  // namespace shardlm::cli
