// The training run: exact epoch accounting, gradient accumulation with loss normalised over
// the step's real targets, evaluation, progress output and the run directory's reports.
#include "shardlm/train/trainer.h"

#include <unistd.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>

#include "shardlm/backend/profiling.h"
#include "shardlm/plan/plan.h"
#include "shardlm/train/data.h"
#include "shardlm/train/optimizer.h"

namespace shardlm {
namespace {

using Clock = std::chrono::steady_clock;
using json = nlohmann::json;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

json category_json(const CategoryBytes& b) {
  json j = json::object();
  for (int c = 0; c < kNumMemCategories; ++c)
    j[std::string(mem_category_name(static_cast<MemCategory>(c)))] = b[c];
  return j;
}

void write_json(const std::filesystem::path& path, const json& j) {
  // Written beside and renamed, so a reader never sees half a file.
  const auto tmp = path.string() + ".tmp";
  {
    std::ofstream f(tmp);
    f << j.dump(2) << "\n";
    if (!f) SHARDLM_FAIL(ErrorKind::kInternal, "{}: write failed", tmp);
  }
  std::filesystem::rename(tmp, path);
}

json memory_report(const MemoryLedger& ledger, const MemoryPlan& plan) {
  const int d = static_cast<int>(MemPool::kDevice), h = static_cast<int>(MemPool::kHost);
  CategoryBytes dev_peak{}, host_peak{};
  for (int c = 0; c < kNumMemCategories; ++c) {
    dev_peak[c] = ledger.peak(MemPool::kDevice, static_cast<MemCategory>(c));
    host_peak[c] = ledger.peak(MemPool::kHost, static_cast<MemCategory>(c));
  }
  json j;
  j["rank"] = 0;
  j["peak_bytes"] = {{"device", ledger.peak_total(MemPool::kDevice)},
                     {"host", ledger.peak_total(MemPool::kHost)}};
  j["peak_by_category"] = category_json(dev_peak);
  j["at_peak_by_category"] = category_json(ledger.at_peak(MemPool::kDevice));
  j["host_peak_by_category"] = category_json(host_peak);
  j["allocations"] = ledger.alloc_count();
  j["planned"] = {{"peak_bytes", {{"device", plan.peak_bytes[d]}, {"host", plan.peak_bytes[h]}}},
                  {"peak_by_category", category_json(plan.by_category[d])},
                  {"at_peak_by_category", category_json(plan.by_category[d])},
                  {"host_peak_by_category", category_json(plan.by_category[h])}};
  return j;
}

// Mean loss over up to max_batches micro-batches of the held-out set, in window order.
double evaluate(LlamaModel& model, const TextDataset& data, int64_t B, int64_t max_batches) {
  std::vector<int64_t> order(data.num_windows());
  for (int64_t i = 0; i < int64_t(order.size()); ++i) order[i] = i;
  const int64_t n_batches = (data.num_windows() + B - 1) / B;
  const int64_t limit = max_batches > 0 ? std::min(max_batches, n_batches) : n_batches;
  double sum = 0;
  int64_t count = 0;
  for (int64_t b = 0; b < limit; ++b) {
    BatchInputs in = model.inputs(B, data.seq_len());
    data.fill(order, b * B, B, in);
    const LossResult r = model.forward_loss(B, data.seq_len());
    sum += r.loss_sum;
    count += r.n_valid;
  }
  return count > 0 ? sum / count : std::nan("");
}

}  // namespace

double measure_gemm_flops(Backend& be, MemoryLedger& ledger) {
  const int64_t n = 1024;
  Buffer a(be, ledger, MemCategory::kWorkspace, MemPool::kDevice, n * n * 4);
  Buffer b(be, ledger, MemCategory::kWorkspace, MemPool::kDevice, n * n * 4);
  Buffer c(be, ledger, MemCategory::kWorkspace, MemPool::kDevice, n * n * 4);
  const Tensor ta = a.view(DType::kF32, {n, n}), tb = b.view(DType::kF32, {n, n}),
               tc = c.view(DType::kF32, {n, n});
  be.linear_forward(ta, tb, Tensor(), tc);  // warm up threads and caches
  double best = 0;
  for (int rep = 0; rep < 3; ++rep) {
    const auto t0 = Clock::now();
    be.linear_forward(ta, tb, Tensor(), tc);
    best = std::max(best, 2.0 * n * n * n / seconds_since(t0));
  }
  return best;
}

TrainResult train(const RunConfig& cfg, std::ostream& out) {
  const auto run_t0 = Clock::now();
  std::unique_ptr<Backend> backend = make_backend(DeviceKind::kCpu);
  ProfilingBackend* profiler = nullptr;
  if (cfg.log.profile) {
    auto wrapped = std::make_unique<ProfilingBackend>(std::move(backend));
    profiler = wrapped.get();
    backend = std::move(wrapped);
  }
  MemoryLedger ledger;
  if (cfg.memory.budget_gib > 0)
    ledger.set_budget(MemPool::kDevice, int64_t(cfg.memory.budget_gib * double(1 << 30)));
  const bool interactive = (&out == &std::cout) && isatty(STDOUT_FILENO);

  ByteTokenizer tok;
  if (cfg.model.vocab_size < tok.vocab_size())
    SHARDLM_FAIL(ErrorKind::kConfig,
                 "model.vocab_size ({}) is smaller than the byte tokenizer's {} ids; set "
                 "model.vocab_size >= {}",
                 cfg.model.vocab_size, tok.vocab_size(), tok.vocab_size());
  const int64_t B = cfg.train.micro_batch, T = cfg.data.seq_len, accum = cfg.train.grad_accum;
  TextDataset train_set(cfg.data.train, tok, T);
  TextDataset valid_set = cfg.data.valid.empty() ? train_set.split_tail(cfg.data.valid_fraction)
                                                 : TextDataset(cfg.data.valid, tok, T);

  const std::filesystem::path dir(cfg.log.dir);
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec)
    SHARDLM_FAIL(ErrorKind::kConfig, "log.dir: cannot create '{}': {}", cfg.log.dir, ec.message());

  double peak_flops;
  {
    MemoryLedger scratch;  // calibration buffers are not the run's memory
    peak_flops = measure_gemm_flops(*backend, scratch);
  }

  ModelOptions mopt;
  mopt.param_dtype = cfg.precision.param == "bf16" ? DType::kBF16 : DType::kF32;
  mopt.max_batch = B;
  mopt.max_seq = T;
  mopt.loss_chunk_tokens = cfg.memory.loss_chunk_tokens;
  LlamaModel model(cfg.model, mopt, *backend, ledger);
  AdamW opt(model, *backend, ledger, cfg.train);
  model.init_weights(cfg.train.seed, opt.master());

  PlanInputs pin;
  pin.model = cfg.model;
  pin.micro_batch = B;
  pin.seq_len = T;
  pin.param_dtype = mopt.param_dtype;
  pin.kernel_workspace_bytes = int64_t(model.kernel_workspace_bytes());
  const MemoryPlan plan = plan_memory(pin);

  // Exact accounting: each epoch visits every window once; the last step of an epoch may be
  // short, and its missing rows are padded and masked rather than dropped.
  const int64_t windows = train_set.num_windows();
  const int64_t rows_per_step = B * accum;
  const int64_t steps_per_epoch = (windows + rows_per_step - 1) / rows_per_step;
  const int64_t total_steps =
      cfg.train.max_steps > 0 ? cfg.train.max_steps : cfg.train.epochs * steps_per_epoch;
  const double flops_per_token = train_flops_per_token(cfg.model, T);
  const int64_t params = model.layout().total;

  out << fmt::format("shardlm: model {} ({:.2f}M parameters, {} layers, dim {}), {} params\n",
                     cfg.model.name, params / 1e6, cfg.model.n_layers, cfg.model.dim,
                     cfg.precision.param);
  out << fmt::format(
      "data: {}: {} tokens in {} documents -> {} windows of {} tokens per epoch ({} target "
      "tokens)\n",
      train_set.name(), train_set.num_tokens(), train_set.num_documents(), windows, T,
      train_set.targets_per_epoch());
  out << fmt::format("held-out: {}: {} tokens in {} documents\n", valid_set.name(),
                     valid_set.num_tokens(), valid_set.num_documents());
  out << fmt::format(
      "schedule: {} sequences per step ({} x {} micro-batches), {} steps per epoch, {} steps "
      "in all{}; the last step of each epoch is padded and masked, nothing is dropped\n",
      rows_per_step, B, accum, steps_per_epoch, total_steps,
      cfg.train.max_steps > 0 ? " (train.max_steps)"
                              : fmt::format(" ({} epochs)", cfg.train.epochs));
  out << fmt::format("memory: planned {} on the device pool; measured GEMM rate {:.1f} GFLOP/s\n",
                     format_bytes(plan.peak_bytes[0]), peak_flops / 1e9);
  out.flush();

  std::ofstream metrics(dir / "metrics.jsonl");
  if (!metrics)
    SHARDLM_FAIL(ErrorKind::kConfig, "log.dir: cannot write {}", (dir / "metrics.jsonl").string());

  TrainResult result;
  std::vector<int64_t> order;
  int64_t order_epoch = -1;
  int64_t allocs_after_step2 = -1;
  std::vector<int64_t> tokens_per_epoch;
  double last_eval = std::nan("");
  for (int64_t step = 1; step <= total_steps; ++step) {
    const int64_t epoch = (step - 1) / steps_per_epoch;  // 0-based
    const int64_t step_in_epoch = (step - 1) % steps_per_epoch;
    if (epoch != order_epoch) {
      order = train_set.epoch_order(cfg.train.seed, epoch);
      order_epoch = epoch;
      tokens_per_epoch.push_back(0);
    }
    const auto t0 = Clock::now();
    // Normalise by the step's real targets so that padding never dilutes the gradient.
    int64_t step_targets = 0;
    for (int64_t a = 0; a < accum; ++a) {
      BatchInputs in = model.inputs(B, T);
      step_targets += train_set.fill(order, (step_in_epoch * accum + a) * B, B, in);
    }
    model.zero_grads();
    double loss_sum = 0;
    for (int64_t a = 0; a < accum; ++a) {
      BatchInputs in = model.inputs(B, T);
      train_set.fill(order, (step_in_epoch * accum + a) * B, B, in);
      loss_sum +=
          model.forward_backward(B, T, step_targets > 0 ? 1.f / step_targets : 0.f).loss_sum;
    }
    const double lr = lr_at(cfg.train, step, total_steps);
    const double grad_norm = opt.step(lr);
    const double step_s = seconds_since(t0);
    const double loss = step_targets > 0 ? loss_sum / step_targets : std::nan("");
    if (!std::isfinite(loss) || !std::isfinite(grad_norm))
      SHARDLM_FAIL(ErrorKind::kInternal,
                   "step {}: non-finite loss ({}) or gradient norm ({}); lower train.lr or set "
                   "train.grad_clip",
                   step, loss, grad_norm);
    result.tokens_seen += step_targets;
    tokens_per_epoch.back() += step_targets;
    result.losses.push_back(loss);
    result.steps = step;
    result.final_loss = loss;
    if (step == 2) allocs_after_step2 = ledger.alloc_count();
    if (step == 1 && profiler) profiler->reset();  // the first step warms caches and threads

    const bool eval_now =
        (cfg.train.eval_every > 0 && step % cfg.train.eval_every == 0) || step == total_steps;
    if (eval_now) last_eval = evaluate(model, valid_set, B, cfg.train.eval_batches);

    const double tok_s = step_targets / step_s;
    const double mfu = flops_per_token * double(rows_per_step * T) / step_s / peak_flops;
    if (step % cfg.log.every_steps == 0 || step == total_steps || eval_now) {
      json m = {{"step", step},
                {"epoch", epoch + 1},
                {"loss", loss},
                {"lr", lr},
                {"grad_norm", grad_norm},
                {"tokens_seen", result.tokens_seen},
                {"tokens_per_s", tok_s},
                {"step_ms", step_s * 1e3},
                {"mfu", mfu},
                {"mem_peak_bytes", ledger.peak_total(MemPool::kDevice)}};
      metrics << m.dump() << "\n";
      if (eval_now) metrics << json{{"step", step}, {"eval_loss", last_eval}}.dump() << "\n";
      metrics.flush();
      const std::string line = fmt::format(
          "epoch {}/{} | step {}/{} | loss {:.4f} | lr {:.2e} | {:.0f} tok/s | mfu {:.1f}% | "
          "mem {}{}",
          epoch + 1, (total_steps + steps_per_epoch - 1) / steps_per_epoch, step, total_steps, loss,
          lr, tok_s, mfu * 100, format_bytes(ledger.peak_total(MemPool::kDevice)),
          eval_now ? fmt::format(" | eval {:.4f}", last_eval) : "");
      if (interactive) {
        out << "\r\033[K" << line << (eval_now ? "\n" : "");
      } else {
        out << line << "\n";
      }
      out.flush();
    }
  }
  if (interactive) out << "\n";
  result.final_eval_loss = last_eval;

  write_json(dir / "memory_rank0.json", memory_report(ledger, plan));
  json summary;
  summary["config"] = run_config_to_json(cfg);
  summary["parameters"] = params;
  summary["tokens_per_epoch"] = train_set.targets_per_epoch();
  summary["documents_per_epoch"] = train_set.num_documents();
  summary["steps_per_epoch"] = steps_per_epoch;
  summary["tokens_seen"] = result.tokens_seen;
  summary["tokens_seen_per_epoch"] = tokens_per_epoch;
  summary["steps"] = result.steps;
  summary["wall_s"] = seconds_since(run_t0);
  summary["final_loss"] = result.final_loss;
  summary["final_eval_loss"] = result.final_eval_loss;
  summary["gemm_flops"] = peak_flops;
  summary["allocations_after_step2"] =
      allocs_after_step2 < 0 ? 0 : ledger.alloc_count() - allocs_after_step2;
  if (profiler) {
    // Steps 2..N only, evaluation included; the rest of the step (data, loop) is "other".
    json prof = json::object();
    double total = 0;
    for (int f = 0; f < kNumOpFamilies; ++f) {
      prof[std::string(op_family_name(OpFamily(f)))] = profiler->seconds()[f];
      total += profiler->seconds()[f];
    }
    summary["profile"] = prof;
    out << "time by op family (steps 2.." << result.steps << "):\n";
    for (int f = 0; f < kNumOpFamilies; ++f)
      out << fmt::format("  {:<16} {:8.3f} s  {:5.1f}%\n", op_family_name(OpFamily(f)),
                         profiler->seconds()[f], 100 * profiler->seconds()[f] / total);
  }
  write_json(dir / "summary.json", summary);
  out << fmt::format(
      "done: {} steps, {} tokens, final loss {:.4f}, eval loss {:.4f}; reports in {}\n",
      result.steps, result.tokens_seen, result.final_loss, result.final_eval_loss, dir.string());

  if (!cfg.sample.prompt.empty() && cfg.sample.count > 0) {
    std::mt19937_64 rng(cfg.train.seed);
    for (int64_t s = 0; s < cfg.sample.count; ++s) {
      out << fmt::format("\n--- sample {} ---\n{}", s + 1, cfg.sample.prompt);
      out.flush();
      sample_text(model, tok, cfg.sample.prompt, cfg.sample, rng, [&](const std::string& piece) {
        out << piece;
        out.flush();
      });
      out << "\n";
    }
  }
  return result;
}

}  // namespace shardlm
