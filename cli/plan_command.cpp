// `shardlm plan --config FILE [--set k=v]... [--world N] [--gpu-mem GiB] [--host-mem GiB]
// [--tflops T] [--json]`: one rank's planned peak bytes per pool and category for a run of N
// ranks, whether it fits the budgets given, and a tokens/s estimate from the model's FLOPs.
// It reads no data and allocates nothing model-sized: the planner and the backend's workspace
// queries are arithmetic, so the largest presets plan in milliseconds.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <iostream>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "commands.h"
#include "shardlm/core/check.h"
#include "shardlm/core/ledger.h"
#include "shardlm/model/layout.h"
#include "shardlm/plan/plan.h"
#include "shardlm/train/plan_inputs.h"

namespace shardlm::cli {
namespace {

using json = nlohmann::json;

// A sustained bf16 rate an H100 SXM reaches on large GEMMs in training (about 40% of its
// 989 TFLOP/s dense peak): the default device rate of the estimate.
constexpr double kDefaultTflops = 400;
constexpr int kBarWidth = 40;
constexpr double kGiB = double(int64_t{1} << 30);

struct Budget {
  const char* name;  // what set it, as the user wrote it
  MemPool pool;
  int64_t bytes = 0;
};

struct Throughput {
  int64_t tokens_per_step = 0;  // every rank's rows of one optimizer step
  double flops_per_step = 0;
  double step_s = 0;
  double tokens_per_s = 0;
};

Throughput estimate_throughput(const RunConfig& cfg, const Topology& topo, double tflops) {
  const int64_t T = cfg.data.seq_len;
  const int64_t rows = cfg.train.micro_batch * cfg.train.grad_accum * topo.size(Axis::kDp);
  // Full causal rows (no document boundaries): T (T + 1) / 2 visible pairs per row.
  const double pairs = double(rows) * double(T) * double(T + 1) / 2;
  Throughput t;
  t.tokens_per_step = rows * T;
  t.flops_per_step = train_flops(cfg.model, double(t.tokens_per_step), pairs);
  t.step_s = t.flops_per_step / (tflops * 1e12 * double(topo.world_size()));
  t.tokens_per_s = double(t.tokens_per_step) / t.step_s;
  return t;
}

double share(int64_t part, int64_t whole) { return whole > 0 ? double(part) / double(whole) : 0; }

std::string bar(double fraction) {
  const int n = int(fraction * kBarWidth + 0.5);
  return std::string(size_t(n), '#') + std::string(size_t(kBarWidth - n), '.');
}

std::string count_text(int64_t n) {
  return n >= 1'000'000'000 ? fmt::format("{:.2f}B", double(n) / 1e9)
                            : fmt::format("{:.2f}M", double(n) / 1e6);
}

std::string gib_text(int64_t bytes) { return fmt::format("{:.2f} GiB", double(bytes) / kGiB); }

void print_text(std::ostream& out, const RunConfig& cfg, const Topology& topo,
                const ParamLayout& layout, const MemoryPlan& plan,
                const std::vector<Budget>& budgets, double tflops, const Throughput& tp) {
  const auto& m = cfg.model;
  const int d = int(MemPool::kDevice), h = int(MemPool::kHost);
  const int64_t world = topo.world_size();
  out << fmt::format("shardlm plan: {} ({} parameters, {} layers, dim {}), {} parameters\n", m.name,
                     count_text(layout.total), m.n_layers, m.dim, cfg.precision.param);
  out << fmt::format(
      "run: {} rank{} = dp {} x cp {}{}; micro_batch {} x seq_len {} ({} tokens of each row per "
      "rank), grad_accum {}; zero stage {}{}{}; checkpointing {}{}\n",
      world, world == 1 ? "" : "s", topo.size(Axis::kDp), topo.size(Axis::kCp),
      cfg.parallel.cp > 1 ? " (" + cfg.parallel.cp_kind + ")" : "", cfg.train.micro_batch,
      cfg.data.seq_len, cfg.data.seq_len / topo.size(Axis::kCp), cfg.train.grad_accum,
      cfg.zero.stage, cfg.zero.offload_optimizer == "cpu" ? ", optimizer on the host" : "",
      cfg.zero.offload_params == "cpu" ? ", parameters on the host" : "", cfg.memory.checkpointing,
      cfg.memory.offload_checkpoints ? " (offloaded)" : "");
  out << fmt::format(
      "rank roles: {}\n\n",
      world == 1 ? "one rank"
                 : fmt::format("all {} ranks are alike (data and context parallelism give every "
                               "rank an equal shard): this table stands for each of them",
                               world));

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

  if (budgets.empty()) {
    out << "fits: no budget given (--gpu-mem, --host-mem or memory.budget_gib)\n";
  } else {
    for (const Budget& b : budgets) {
      const int64_t need = plan.peak_bytes[int(b.pool)];
      const char* pool = b.pool == MemPool::kDevice ? "device" : "host";
      out << fmt::format(
          "{} {} ({}): {}, the {} peak {} is {:.0f}% of it{}\n", pool, b.name, gib_text(b.bytes),
          need <= b.bytes ? "fits" : "DOES NOT FIT", pool, gib_text(need),
          100 * share(need, b.bytes),
          need <= b.bytes ? "" : fmt::format(" ({} over)", format_bytes(need - b.bytes)));
    }
    bool device_over = false;
    for (const Budget& b : budgets)
      device_over = device_over || (b.pool == MemPool::kDevice && plan.peak_bytes[d] > b.bytes);
    if (device_over) {
      out << fmt::format("  to lower the device peak: {}\n",
                         fmt::join(device_memory_hints(cfg), ", "));
    }
  }
  out << fmt::format(
      "\nthroughput estimate: {:.0f} tokens/s in all ({:.0f} per rank), {} tokens per optimizer "
      "step in {:.3f} s\n"
      "  assumes {:.0f} TFLOP/s sustained per rank (--tflops; the default {:.0f} is about 40% of "
      "an H100's 989 TFLOP/s dense bf16 peak), the model's training FLOPs on full causal rows "
      "(6 x matmul parameters per token + attention pairs), recompute and communication not "
      "counted\n",
      tp.tokens_per_s, tp.tokens_per_s / double(world), tp.tokens_per_step, tp.step_s, tflops,
      kDefaultTflops);
}

json plan_report(const RunConfig& cfg, const Topology& topo, const ParamLayout& layout,
                 const MemoryPlan& plan, const std::vector<Budget>& budgets, bool fits,
                 double tflops, const Throughput& tp) {
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
      {"grid", {{"dp", topo.size(Axis::kDp)}, {"cp", topo.size(Axis::kCp)}}},
      {"roles", json::array({{{"ranks", topo.world_size()},
                              {"description", "every rank (dp x cp: equal shards)"},
                              {"planned", planned},
                              {"share", shares}}})},
      {"planned", planned},
      {"budgets", budget_list},
      {"fits", fits},
      {"throughput",
       {{"tflops_per_rank", tflops},
        {"tokens_per_step", tp.tokens_per_step},
        {"flops_per_step", tp.flops_per_step},
        {"step_s", tp.step_s},
        {"tokens_per_s", tp.tokens_per_s},
        {"assumption",
         "sustained rate per rank; training FLOPs of full causal rows; recompute and "
         "communication not counted"}}},
  };
}

}  // namespace

Command add_plan_command(CLI::App& app) {
  struct Options {
    std::string config_path;
    std::string deepspeed_path;
    std::vector<std::string> overrides;
    int64_t world = 1;
    double gpu_mem_gib = 0;
    double host_mem_gib = 0;
    double tflops = kDefaultTflops;
    bool json = false;
  };
  auto opt = std::make_shared<Options>();
  CLI::App* sub = app.add_subcommand(
      "plan",
      "predict one rank's peak memory per pool and category before launch, whether it fits, "
      "and the tokens/s to expect (exit 4 when it does not fit)");
  sub->add_option("--config", opt->config_path, "JSON config file (see configs/)")->required();
  sub->add_option("--deepspeed", opt->deepspeed_path,
                  "DeepSpeed ds_config.json mapped onto shardlm keys, as for train");
  sub->add_option("--set", opt->overrides, "override a config key: --set data.seq_len=8192")
      ->take_all();
  sub->add_option("--world", opt->world, "number of ranks (processes) of the run")
      ->check(CLI::PositiveNumber);
  sub->add_option("--gpu-mem", opt->gpu_mem_gib, "device memory per rank, GiB (0: no budget)")
      ->check(CLI::NonNegativeNumber);
  sub->add_option("--host-mem", opt->host_mem_gib, "host memory per rank, GiB (0: no budget)")
      ->check(CLI::NonNegativeNumber);
  sub->add_option("--tflops", opt->tflops,
                  "sustained TFLOP/s per rank for the throughput estimate (default 400: an "
                  "H100 in bf16 at about 40% of peak)")
      ->check(CLI::PositiveNumber);
  sub->add_flag("--json", opt->json, "print the plan as one JSON object");
  return {
      sub, [opt] {
        const RunConfig cfg = load_cli_config(opt->config_path, opt->deepspeed_path, opt->overrides,
                                              opt->world, true);
        const Topology topo = topology_for(cfg, opt->world);
        // The kernel scratch is sized by the backend the run will use (its tiling).
        const std::unique_ptr<Backend> backend = make_backend(DeviceKind::kCpu);
        const MemoryPlan plan = plan_memory(plan_inputs_for(cfg, opt->world, *backend));
        const ParamLayout layout = make_param_layout(cfg.model);

        std::vector<Budget> budgets;
        if (opt->gpu_mem_gib > 0)
          budgets.push_back({"--gpu-mem", MemPool::kDevice, int64_t(opt->gpu_mem_gib * kGiB)});
        if (cfg.memory.budget_gib > 0)
          budgets.push_back({"memory.budget_gib", MemPool::kDevice, cfg.memory.budget_bytes()});
        if (opt->host_mem_gib > 0)
          budgets.push_back({"--host-mem", MemPool::kHost, int64_t(opt->host_mem_gib * kGiB)});
        bool fits = true;
        for (const Budget& b : budgets) fits = fits && plan.peak_bytes[int(b.pool)] <= b.bytes;

        const Throughput tp = estimate_throughput(cfg, topo, opt->tflops);
        if (opt->json) {
          std::cout << plan_report(cfg, topo, layout, plan, budgets, fits, opt->tflops, tp).dump(2)
                    << "\n";
        } else {
          print_text(std::cout, cfg, topo, layout, plan, budgets, opt->tflops, tp);
        }
        if (!fits) {
          std::cout.flush();
          for (const Budget& b : budgets)
            if (plan.peak_bytes[int(b.pool)] > b.bytes)
              std::cerr << fmt::format(
                  "shardlm: out of memory: the planned {} peak of {} exceeds {} ({})\n",
                  b.pool == MemPool::kDevice ? "device" : "host",
                  gib_text(plan.peak_bytes[int(b.pool)]), b.name, gib_text(b.bytes));
          return 4;  // the exit code of a run that runs out of memory
        }
        return 0;
      }};
}

}  // namespace shardlm::cli
