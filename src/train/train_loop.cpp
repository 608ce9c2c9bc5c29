// TrainRun::run: the step loop (exact epoch accounting, gradient accumulation normalised over
// a step's real targets, numerical guards, evaluation, metrics and signal stops), then the
// final checkpoint, summary.json and sampling. Checkpoint contents and resume live in
// train_checkpoint.cpp; setup in train_setup.cpp.
#include <algorithm>
#include <cmath>
#include <fstream>
#include <random>

#include "run_files.h"
#include "shardlm/train/optimizer.h"
#include "shardlm/train/report.h"
#include "train_run.h"

namespace shardlm::trainer_detail {
namespace {

// (query, key) pairs that causal attention with document masks computes on rows seg_start
// [B * T] (host): token t of a row sees the tokens from its document's start to itself.
double attention_pairs(const Tensor& seg_start, int64_t T) {
  const int32_t* seg = seg_start.i32();
  double pairs = 0;
  for (int64_t i = 0; i < seg_start.numel(); ++i) pairs += double(i % T - seg[i] + 1);
  return pairs;
}

// Fills the model's inputs with rows order[first .. first + B) of `data`: directly, or, under
// context parallelism, the full rows first and then this rank's share of every row. Returns
// the attention pairs of the whole rows (for the FLOP count). slot >= 0: a pipeline stage's
// micro-batch slot.
double fill_batch(LlamaModel& model, ContextParallel* cp, Dataset& data,
                  const std::vector<int64_t>& order, int64_t first, int64_t B, Backend& be,
                  std::vector<int32_t>& staging, int slot = -1) {
  auto model_inputs = [&](int64_t T) {
    return slot < 0 ? model.inputs(B, T) : model.stage_inputs(slot, B, T);
  };
  if (cp == nullptr) {
    // Written on the host, then copied to the model's inputs (device memory on a GPU).
    const BatchInputs dev = model_inputs(data.seq_len());
    const int64_t n = B * data.seq_len();
    staging.resize(size_t(4 * n));
    auto at = [&](int i) {
      return Tensor(staging.data() + i * n, DType::kI32, {n}, MemPool::kHost);
    };
    BatchInputs host{at(0), at(1), at(2), at(3)};
    data.fill(order, first, B, host);
    be.copy(host.tokens, dev.tokens);
    be.copy(host.targets, dev.targets);
    be.copy(host.positions, dev.positions);
    be.copy(host.seg_start, dev.seg_start);
    return attention_pairs(host.seg_start, data.seq_len());
  }
  const BatchInputs in = cp->full_inputs(B);
  BatchInputs fill = in;
  data.fill(order, first, B, fill);
  cp->shard(in, model_inputs(cp->local_len()), B);
  return attention_pairs(in.seg_start, data.seq_len());
}

// Mean loss over up to max_batches micro-batches of the held-out set, in window order; the
// batches are dealt round-robin over the data-parallel replicas (the ranks of a cp group share
// theirs) and the sums reduced over every rank. Every rank runs the same number of forward
// passes (a replica without a batch of its own repeats the first and ignores it), because at
// ZeRO stage 3 each pass gathers parameters collectively.
double evaluate(LlamaModel& model, ZeroEngine& zero, ContextParallel* cp, Dataset& data, int64_t B,
                int64_t max_batches, const ParallelGrid& grid, int64_t dp_rank, int64_t dp_size,
                Backend& be, std::vector<int32_t>& staging, PipelineExecutor* pipe) {
  std::vector<int64_t> order(data.num_windows());
  for (int64_t i = 0; i < int64_t(order.size()); ++i) order[i] = i;
  const int64_t n_batches = (data.num_windows() + B - 1) / B;
  const int64_t limit = max_batches > 0 ? std::min(max_batches, n_batches) : n_batches;
  const int64_t rounds = (limit + dp_size - 1) / dp_size;
  const int64_t T = cp != nullptr ? cp->local_len() : data.seq_len();
  double sum = 0;
  int64_t count = 0;
  if (pipe != nullptr && rounds > 0) {  // forwards only through the stages; the last has the loss
    PipelineStageOps ops;
    ops.load = [&](int i, int slot) {
      const int64_t b = i * dp_size + dp_rank;
      fill_batch(model, cp, data, order, b < limit ? b * B : 0, B, be, staging, slot);
    };
    ops.input = [&](int slot) { return model.stage_input(slot, B, T); };
    ops.forward = [&](int i, int slot, LossResult* loss) {
      LossResult r{};
      const Tensor out = model.stage_forward(slot, B, T, &r);
      if (i * dp_size + dp_rank < limit) *loss = r;
      return out;
    };
    const PipelineStats st =
        pipe->evaluate(ops, int(rounds), B * T * model.config().dim / model.config().seq_shards());
    sum = st.loss_sum;
    count = st.n_valid;
  }
  for (int64_t i = 0; i < (pipe != nullptr ? 0 : rounds); ++i) {
    const int64_t b = i * dp_size + dp_rank;
    fill_batch(model, cp, data, order, b < limit ? b * B : 0, B, be, staging);
    const LossResult r = model.forward_loss(B, T);
    if (b >= limit) continue;
    sum += r.loss_sum;
    count += r.n_valid;
  }
  zero.drain();
  double totals[2] = {sum, double(count)};
  grid.sum(totals);
  return totals[1] > 0 ? totals[0] / totals[1] : std::nan("");
}

// After a resume from step k, lines of steps past k (logged before an abrupt stop) would be
// logged again: drop them.
void drop_metrics_after(const fs::path& path, int64_t step) {
  std::ifstream in(path);
  if (!in) return;
  std::string kept, line;
  while (std::getline(in, line)) {
    try {
      if (json::parse(line).value("step", int64_t{0}) > step) continue;
    } catch (const json::exception&) {
      continue;  // a line cut short by a kill
    }
    kept += line + "\n";
  }
  in.close();
  write_file_atomic(path.string(), kept);
}

}  // namespace

bool TrainRun::stop_requested() {
  // mpirun forwards a signal to every rank, but not at the same instant: agree on it, so that
  // all ranks stop after the same step.
  return grid_->any(stop_ != nullptr && *stop_ != 0);
}

TrainResult TrainRun::run() {
  const auto run_t0 = Clock::now();
  setup();
  resume_if_asked();
  if (step_ >= total_steps_) {
    out_ << fmt::format(
        "nothing to do: the run in {} is complete (step {} of {}); raise train.max_steps or "
        "train.epochs to continue it, or set train.resume = \"none\" to start over\n",
        dir_.string(), step_, total_steps_);
    TrainResult done;
    done.steps = done.first_step = step_;
    done.tokens_seen = tokens_seen_;
    done.checkpoint = last_checkpoint_;
    return done;
  }

  std::ofstream metrics;  // rank 0 only; on other ranks writes go nowhere
  if (lead_) {
    if (step_ > 0) drop_metrics_after(dir_ / "metrics.jsonl", step_);
    metrics.open(dir_ / "metrics.jsonl", step_ > 0 ? std::ios::app : std::ios::trunc);
    if (!metrics)
      SHARDLM_FAIL(ErrorKind::kConfig, "log.dir: cannot write {}",
                   (dir_ / "metrics.jsonl").string());
  }

  TrainResult result;
  result.first_step = step_ + 1;
  std::vector<int64_t> order;
  int64_t order_epoch = -1;
  int64_t allocs_after_warmup = -1;
  int64_t bad_streak = 0;
  double last_eval = std::nan("");
  const int64_t rows_per_step = B_ * accum_ * dp_size_;
  const int64_t rank_first_row = B_ * accum_ * dp_rank_;  // this replica's block of each step
  const int64_t n_epochs = (total_steps_ + steps_per_epoch_ - 1) / steps_per_epoch_;

  while (step_ < total_steps_) {
    const int64_t step = step_ + 1;
    const int64_t epoch = (step - 1) / steps_per_epoch_;  // 0-based
    const int64_t step_in_epoch = (step - 1) % steps_per_epoch_;
    if (epoch != order_epoch) {
      order = train_set_->epoch_order(cfg_.train.seed, epoch);
      order_epoch = epoch;
    }
    if (int64_t(tokens_per_epoch_.size()) <= epoch) tokens_per_epoch_.resize(epoch + 1, 0);
    const auto t0 = Clock::now();
    // Normalise by the step's real targets so that padding never dilutes the gradient.
    int64_t step_targets = 0;
    for (int64_t r = 0; r < rows_per_step; ++r) {
      const int64_t i = step_in_epoch * rows_per_step + r;
      if (i < int64_t(order.size())) step_targets += train_set_->window_targets(order[i]);
    }
    zero_->begin_step(int(accum_));
    const double comm_wait0 = zero_->comm_wait_seconds();
    double loss_sum = 0, pairs = 0;
    if (cp_) cp_->reset_stats();
    PipelineStats pipe_step;
    if (pipe_) {  // 1F1B over the step's micro-batches; every stage reads every micro-batch
      const float scale = step_targets > 0 ? 1.f / step_targets : 0.f;
      PipelineStageOps ops;
      ops.load = [&](int a, int slot) {
        pairs += fill_batch(*model_, cp_.get(), *train_set_, order,
                            step_in_epoch * rows_per_step + rank_first_row + a * B_, B_, *backend_,
                            input_staging_, slot);
      };
      ops.input = [&](int slot) { return model_->stage_input(slot, B_, Tl_); };
      ops.forward = [&](int, int slot, LossResult*) {
        return model_->stage_forward(slot, B_, Tl_);
      };
      ops.backward = [&](int, int slot, const Tensor& d_out) {
        return model_->stage_backward(slot, B_, Tl_, scale, d_out).loss_sum;
      };
      ops.input_grad = [&] { return model_->stage_input_grad(B_, Tl_); };
      pipe_step = pipe_->train(ops, int(accum_), stage_output_elems());
      loss_sum = pipe_step.loss_sum;
    }
    for (int64_t a = 0; a < (pipe_ ? 0 : accum_); ++a) {
      pairs += fill_batch(*model_, cp_.get(), *train_set_, order,
                          step_in_epoch * rows_per_step + rank_first_row + a * B_, B_, *backend_,
                          input_staging_);
      // LoRA dropout: one mask per step, indexed by the micro-batch's first token in the step.
      model_->set_lora_dropout(cfg_.train.seed * 0x100000001b3ULL + uint64_t(step),
                               (rank_first_row + a * B_) * T_);
      loss_sum +=
          model_->forward_backward(B_, Tl_, step_targets > 0 ? 1.f / step_targets : 0.f).loss_sum;
    }
    const CpStats cp_step = cp_ ? cp_->stats() : CpStats{};
    // Every rank scaled its gradients by 1 / (the whole step's targets): their sum, which the
    // engine reduces bucket by bucket during backward, is the gradient of the step's mean loss,
    // as on one rank.
    zero_->drain();
    const StepTotals totals = grid_->step_totals(loss_sum, pairs);
    loss_sum = totals.loss_sum;
    pairs = totals.pairs;
    const double loss = step_targets > 0 ? loss_sum / step_targets : std::nan("");
    const double lr = lr_at(cfg_.train, step, total_steps_);
    double grad_norm = std::nan("");
    if (std::isfinite(loss))
      grad_norm = zero_->step(adamw_hyper(cfg_.train, lr), cfg_.train.grad_clip);
    backend_->synchronize();  // the step's time includes the queued update
    const double comm_wait_s = zero_->comm_wait_seconds() - comm_wait0;
    const bool skipped = !std::isfinite(loss) || !std::isfinite(grad_norm);
    if (skipped) {
      ++bad_streak;
      const std::string where = zero_->first_nonfinite_unit();
      log_line(fmt::format("step {}: non-finite loss ({}) or gradient norm ({}); first "
                           "non-finite gradients: {}; update skipped ({} of {} in a row)",
                           step, loss, grad_norm, where, bad_streak, cfg_.train.max_bad_steps),
               true);
      metrics
          << json{{"step", step}, {"skipped", true}, {"loss", loss}, {"first_bad", where}}.dump()
          << "\n";
      if (bad_streak >= cfg_.train.max_bad_steps)
        SHARDLM_FAIL(ErrorKind::kInternal,
                     "aborting: {} consecutive steps with non-finite loss or gradients (first "
                     "non-finite gradients in {}); lower train.lr, set train.grad_clip, or check "
                     "the data. The last good checkpoint is {}",
                     bad_streak, where, last_checkpoint_.empty() ? "none" : last_checkpoint_);
    } else {
      bad_streak = 0;
    }
    const double step_s = seconds_since(t0);
    step_ = step;
    tokens_seen_ += step_targets;
    tokens_per_epoch_[epoch] += step_targets;
    result.losses.push_back(loss);
    result.final_loss = loss;
    if (!skipped) loss_points_.emplace_back(double(tokens_seen_), loss);
    if (step == result.first_step && profiler_) profiler_->reset();  // warm-up step
    if (step == result.first_step + 1) allocs_after_warmup = ledger_.alloc_count();

    const bool eval_now =
        (cfg_.train.eval_every > 0 && step % cfg_.train.eval_every == 0) || step == total_steps_;
    if (eval_now) {
      last_eval = evaluate(*model_, *zero_, cp_.get(), *valid_set_, B_, cfg_.train.eval_batches,
                           *grid_, dp_rank_, dp_size_, *backend_, input_staging_, pipe_.get());
      eval_points_.emplace_back(double(tokens_seen_), last_eval);
    }
    const double tok_s = step_targets / step_s;
    // The step's model FLOPs (attention: the pairs its document masks leave) over every rank's
    // GEMM rate.
    const double mfu = train_flops(cfg_.model, double(rows_per_step * T_), pairs) / step_s /
                       (peak_flops_ * world_.size());
    if (step % cfg_.log.every_steps == 0 || step == total_steps_ || eval_now) {
      json line{{"step", step},
                {"epoch", epoch + 1},
                {"loss", loss},
                {"lr", lr},
                {"grad_norm", grad_norm},
                {"tokens_seen", tokens_seen_},
                {"tokens_per_s", tok_s},
                {"step_ms", step_s * 1e3},
                {"comm_wait_ms", comm_wait_s * 1e3},
                {"mfu", mfu},
                {"mem_peak_bytes", ledger_.peak_total(MemPool::kDevice)},
                {"host_rss_bytes", host_rss_bytes()}};
      if (pipe_) {  // each stage's measured compute, blocked communication and bubble
        std::vector<float> per(size_t(3 * pp_), 0.f);
        const bool reporter = dp_rank_ == 0 && world_.rank() % (cfg_.parallel.cp * tp_) == 0;
        if (reporter) {
          per[3 * pp_rank_] = float(pipe_step.compute_s * 1e3);
          per[3 * pp_rank_ + 1] = float((pipe_step.recv_s + pipe_step.send_s) * 1e3);
          per[3 * pp_rank_ + 2] = float(pipe_step.bubble());
        }
        world_.all_reduce(Tensor(per.data(), DType::kF32, {3 * pp_}, MemPool::kHost));
        std::vector<double> compute, comm, bubble;
        double mean = 0;
        for (int64_t s = 0; s < pp_; ++s) {
          compute.push_back(per[3 * s]);
          comm.push_back(per[3 * s + 1]);
          bubble.push_back(per[3 * s + 2]);
          mean += per[3 * s + 2] / double(pp_);
        }
        line["pp_bubble"] = mean;
        line["pp_bubble_stages"] = bubble;
        line["pp_compute_ms"] = compute;
        line["pp_comm_ms"] = comm;
        line["pp_bubble_textbook"] = one_f_one_b_bubble(int(pp_), int(accum_));
      }
      if (cp_) {  // this rank's share of the step's context-parallel attention
        line["cp_bytes_sent"] = cp_step.bytes_sent;
        line["cp_attention_flops"] = cp_step.attention_flops;
      }
      metrics << line.dump() << "\n";
      if (eval_now)
        metrics << json{{"step", step},
                        {"eval_loss", last_eval},
                        {"eval_ppl", std::exp(last_eval)},
                        {"tokens_seen", tokens_seen_}}
                       .dump()
                << "\n";
      metrics.flush();
      log_line(fmt::format("epoch {}/{} | step {}/{} | loss {:.4f} | lr {:.2e} | {:.0f} tok/s | "
                           "mfu {:.1f}% | mem {}{}",
                           epoch + 1, n_epochs, step, total_steps_, loss, lr, tok_s, mfu * 100,
                           format_bytes(ledger_.peak_total(MemPool::kDevice)),
                           eval_now ? fmt::format(" | eval {:.4f} (ppl {:.2f})", last_eval,
                                                  std::exp(last_eval))
                                    : ""),
               eval_now);
    }
    const bool stop_now = stop_requested();
    const bool periodic = cfg_.checkpoint.every_steps > 0 &&
                          step % cfg_.checkpoint.every_steps == 0 && step < total_steps_;
    if (stop_now || periodic) save_checkpoint(step);
    if (stop_now) {
      if (interactive_) out_ << "\n";
      out_ << fmt::format(
          "stopped by signal {} after step {}; checkpoint {} written. Run the same command "
          "again to resume (train.resume = \"auto\").\n",
          stop_ != nullptr ? int(*stop_) : 0, step, last_checkpoint_);
      result.interrupted = true;
      break;
    }
  }
  if (interactive_) out_ << "\n";
  result.steps = step_;
  result.tokens_seen = tokens_seen_;
  result.final_eval_loss = last_eval;
  if (result.interrupted) {
    result.checkpoint = last_checkpoint_;
    return result;
  }
  // The final checkpoint (unless the run was already complete when resumed, or opted out).
  if (result.first_step <= total_steps_ && cfg_.checkpoint.at_end) save_checkpoint(step_);
  result.checkpoint = last_checkpoint_;

  {
    json report = memory_report(world_.rank(), ledger_, plan_);
    // Every buffer of the run is still held here, so the driver's count is the ledger's
    // device total plus the driver's rounding of each allocation.
    const int64_t driver = backend_->driver_device_bytes();
    if (driver >= 0) {
      report["driver_device_bytes"] = driver;
      report["ledger_device_bytes_now"] = ledger_.current_total(MemPool::kDevice);
      report["device_allocations"] = ledger_.alloc_count();
    }
    write_json_atomic(dir_ / fmt::format("memory_rank{}.json", world_.rank()), report);
  }
  // Sampling runs on rank 0 from a whole copy of the parameters (gathered from the shards at
  // ZeRO stage 3), in memory of its own: not the training run's.
  MemoryLedger sample_ledger;
  std::unique_ptr<LlamaModel> sampler;
  if (!cfg_.sample.prompt.empty() && cfg_.sample.count > 0)
    sampler = whole_model_on_lead(sample_ledger);
  if (!lead_) return result;
  json summary;
  summary["config"] = run_config_to_json(cfg_);
  summary["parameters"] = whole_layout_.total;
  summary["tokens_per_epoch"] = train_set_->targets_per_epoch();
  summary["documents_per_epoch"] = train_set_->num_documents();
  summary["steps_per_epoch"] = steps_per_epoch_;
  summary["tokens_seen"] = tokens_seen_;
  summary["tokens_seen_per_epoch"] = tokens_per_epoch_;
  summary["steps"] = step_;
  summary["resumed_from_step"] = result.first_step - 1;
  summary["wall_s"] = seconds_since(run_t0);
  summary["final_loss"] = result.final_loss;
  summary["final_eval_loss"] = result.final_eval_loss;
  summary["final_eval_ppl"] = std::exp(result.final_eval_loss);
  summary["gemm_flops"] = peak_flops_;
  summary["checkpoint"] = last_checkpoint_;
  // Checkpoint writes allocate on the host, never through the ledger: 0 in a healthy run.
  summary["allocations_after_step2"] =
      allocs_after_warmup < 0 ? 0 : ledger_.alloc_count() - allocs_after_warmup;
  if (profiler_) {
    json prof = json::object();
    double total = 0;
    for (int f = 0; f < kNumOpFamilies; ++f) {
      prof[std::string(op_family_name(OpFamily(f)))] = profiler_->seconds()[f];
      total += profiler_->seconds()[f];
    }
    summary["profile"] = prof;
    out_ << "time by op family (after the first step):\n";
    for (int f = 0; f < kNumOpFamilies; ++f)
      out_ << fmt::format("  {:<16} {:8.3f} s  {:5.1f}%\n", op_family_name(OpFamily(f)),
                          profiler_->seconds()[f], 100 * profiler_->seconds()[f] / total);
  }
  write_json_atomic(dir_ / "summary.json", summary);
  out_ << memory_comparison_text(ledger_, plan_);
  out_ << fmt::format(
      "done: {} steps, {} tokens, final loss {:.4f}, eval loss {:.4f} (ppl {:.2f}); reports in "
      "{}; checkpoint {}\n",
      step_, tokens_seen_, result.final_loss, last_eval, std::exp(last_eval), dir_.string(),
      last_checkpoint_);

  if (sampler) {
    std::mt19937_64 rng(cfg_.train.seed);
    for (int64_t s = 0; s < cfg_.sample.count; ++s) {
      out_ << fmt::format("\n--- sample {} ---\n{}", s + 1, cfg_.sample.prompt);
      out_.flush();
      sample_text(*sampler, *tok_, cfg_.sample.prompt, cfg_.sample, rng,
                  [&](const std::string& piece) {
                    out_ << piece;
                    out_.flush();
                  });
      out_ << "\n";
    }
  }
  return result;
}

}  // namespace shardlm::trainer_detail
