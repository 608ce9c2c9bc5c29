// TrainRun::run: the step loop (exact epoch accounting, gradient accumulation normalised over
// a step's real targets, numerical guards, evaluation, metrics and signal stops), then the
// final checkpoint, summary.json and sampling. Checkpoint contents and resume live in
// train_checkpoint.cpp; setup in train_setup.cpp.
#include <algorithm>
#include <cmath>
#include <fstream>
#include <random>

#include "run_files.h"
#include "shardlm/checkpoint/checkpoint.h"
#include "shardlm/planner/plan_inputs.h"
#include "shardlm/train/optimizer.h"
#include "shardlm/train/report.h"
#include "train_run.h"

namespace shardlm::trainer_detail {
namespace {

// Mean loss over up to max_batches micro-batches of the held-out set, in window order (`order`:
// 0, 1, ..., the run's held buffer); the
// batches are dealt round-robin over the data-parallel replicas (the ranks of a cp group share
// theirs) and the sums reduced over every rank. Every rank runs the same number of forward
// passes (a replica without a batch of its own repeats the first and ignores it), because at
// ZeRO stage 3 each pass gathers parameters collectively.
double evaluate(LlamaModel& model, ZeroEngine& zero, ContextParallel* cp, Dataset& data,
                const std::vector<int64_t>& order, int64_t B, int64_t max_batches,
                const ParallelGrid& grid, int64_t dp_rank, int64_t dp_size, Backend& be,
                InputStaging& staging, PipelineExecutor* pipe,
                const std::function<void(int64_t, int64_t)>& progress) {
  SHARDLM_CHECK(int64_t(order.size()) == data.num_windows(),
                "an evaluation order of {} windows for {}'s {}", order.size(), data.name(),
                data.num_windows());
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
    progress(i + 1, rounds);
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

// Every number of a metrics line as a TensorBoard scalar, its tag the key ("a/b" for the key b
// of a nested object a, "a/3" for an array's element); "step" is the event's step.
void add_scalar_tags(const json& j, const std::string& prefix,
                     std::vector<std::pair<std::string, double>>& out) {
  if (j.is_number()) {
    out.emplace_back(prefix, j.get<double>());
  } else if (j.is_object()) {
    for (const auto& [key, value] : j.items())
      if (!(prefix.empty() && key == "step"))
        add_scalar_tags(value, prefix.empty() ? key : prefix + "/" + key, out);
  } else if (j.is_array()) {
    for (size_t i = 0; i < j.size(); ++i)
      add_scalar_tags(j[i], prefix + "/" + std::to_string(i), out);
  }
}

std::vector<std::pair<std::string, double>> scalar_tags(const json& line) {
  std::vector<std::pair<std::string, double>> out;
  add_scalar_tags(line, "", out);
  return out;
}

// 75 -> "1:15", 3725 -> "1:02:05".
std::string clock_text(double seconds) {
  const auto s = int64_t(std::max(0.0, seconds) + 0.5);
  return s >= 3600 ? fmt::format("{}:{:02d}:{:02d}", s / 3600, s / 60 % 60, s % 60)
                   : fmt::format("{}:{:02d}", s / 60, s % 60);
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

// A preference objective's metric sums over the whole step. Each pair ran on one data-parallel
// replica, whose last pipeline stage's tp and cp ranks all hold its sums (reduced over the tp
// group's vocabulary and the cp group's tokens; the other stages hold none): the replica's
// first tp and cp rank of its last stage gives them, the others 0, so the sum over the world
// counts every pair once, exactly.
PreferenceSums sum_over_ranks(const ParallelGrid& grid, const PreferenceSums& mine) {
  const bool owner = grid.coord(Axis::kTp) == 0 && grid.coord(Axis::kCp) == 0 &&
                     grid.coord(Axis::kPp) == grid.size(Axis::kPp) - 1;
  const PreferenceSums given = owner ? mine : PreferenceSums{};
  double v[6] = {given.loss,       given.rewards_chosen, given.rewards_rejected,
                 given.accuracies, given.logps_chosen,   given.logps_rejected};
  grid.sum(v);
  return {v[0], v[1], v[2], v[3], v[4], v[5]};
}

// The step a checkpoint holds (its state.json), 0 for none ("").
int64_t saved_step(const std::string& checkpoint) {
  if (checkpoint.empty()) return 0;
  const CheckpointReader ckpt(checkpoint, CheckpointReader::Verify::kSizesOnly);
  try {
    return ckpt.read_json("state.json").at("step").get<int64_t>();
  } catch (const json::exception& e) {
    SHARDLM_FAIL(ErrorKind::kData, "{}/state.json: {}", ckpt.dir(), e.what());
  }
}

// TRL's metric names of a preference objective's sums over `pairs` pairs, as means, after
// `prefix` ("" for a step, "eval_" for the held-out set).
void add_preference_columns(const PreferenceSums& p, int64_t pairs, const std::string& prefix,
                            json& line) {
  const double n = double(pairs);
  line[prefix + "rewards/chosen"] = p.rewards_chosen / n;
  line[prefix + "rewards/rejected"] = p.rewards_rejected / n;
  line[prefix + "rewards/margins"] = (p.rewards_chosen - p.rewards_rejected) / n;
  line[prefix + "rewards/accuracies"] = p.accuracies / n;
  line[prefix + "logps/chosen"] = p.logps_chosen / n;
  line[prefix + "logps/rejected"] = p.logps_rejected / n;
  line[prefix + "preference_pairs"] = pairs;
}

}  // namespace

PreferenceEval TrainRun::evaluate_preference_set() {
  auto progress = [&](int64_t done, int64_t total) {
    if (interactive_) log_line(fmt::format("evaluating: batch {}/{}", done, total), false);
  };
  const StepParts parts = step_parts(*valid_set_, 1);
  const PreferenceEval mine =
      evaluate_preference({parts, preference_loss(cfg_.train), pipe_.get(), stage_output_elems(),
                           valid_reference_table_.get(), cfg_.train.eval_batches, dp_rank_,
                           dp_size_, progress, eval_rows_.get(), &eval_order_});
  zero_->drain();
  // Each pair once: its replica's first tp and cp rank of the last stage (sum_over_ranks).
  const bool owner = grid_->coord(Axis::kTp) == 0 && grid_->coord(Axis::kCp) == 0 &&
                     grid_->coord(Axis::kPp) == grid_->size(Axis::kPp) - 1;
  double pairs[1] = {owner ? double(mine.pairs) : 0.0};
  grid_->sum(pairs);
  return {sum_over_ranks(*grid_, mine.sums), int64_t(pairs[0])};
}

bool TrainRun::stop_requested() {
  // mpirun forwards a signal to every rank, but not at the same instant: agree on it, so that
  // all ranks stop after the same step.
  return grid_->any(stop_ != nullptr && *stop_ != 0);
}

TrainResult TrainRun::run() {
  const auto run_t0 = Clock::now();
  run_started_ = run_t0;
  setup();
  const std::string checkpoint = choose_checkpoint((dir_ / "checkpoints").string());
  // Full fine-tuning DPO: the reference sums come from the initial weights, which the model
  // holds until a resume loads trained ones. A run its checkpoint already completes reads none.
  if (reference_table() && saved_step(checkpoint) < total_steps_)
    prepare_dpo_reference(/*refuse_stale=*/!checkpoint.empty());
  resume_from(checkpoint);
  if (step_ >= total_steps_) return nothing_to_do();
  MetricsLog metrics = open_metrics();
  open_tensorboard();
  TrainResult result;
  result.first_step = step_ + 1;
  LoopState loop;
  while (step_ < total_steps_ && !train_step(loop, result, metrics)) {
  }
  if (interactive_) out_ << "\n";
  result.steps = step_;
  result.tokens_seen = tokens_seen_;
  result.final_eval_loss = loop.last_eval;
  if (result.interrupted) {
    result.checkpoint = last_checkpoint_;
    return result;
  }
  // The final checkpoint (unless opted out), after the one in flight (whose failure the
  // final save makes good under checkpoint.on_save_error = "continue").
  guard_save(inflight_ ? inflight_->step : step_, true, [&] { finish_async_checkpoint(); });
  if (cfg_.checkpoint.at_end) guard_save(step_, false, [&] { save_checkpoint(step_); });
  result.checkpoint = last_checkpoint_;
  json memory = write_memory_report();
  release_training_state();
  if (!lead_) return result;
  write_summary(result, loop, seconds_since(run_t0));
  // (validate() refuses a sample without the final checkpoint it reads.)
  if (cfg_.sample.at_end() && cfg_.checkpoint.at_end) sample_from_final_checkpoint(memory);
  return result;
}

TrainResult TrainRun::nothing_to_do() {
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

MetricsLog TrainRun::open_metrics() {
  if (!lead_) return MetricsLog();  // rank 0 only; on other ranks writes go nowhere
  if (step_ > 0) drop_metrics_after(dir_ / "metrics.jsonl", step_);
  return MetricsLog((dir_ / "metrics.jsonl").string(), step_ > 0);
}

int64_t TrainRun::rows_per_step() const { return B_ * accum_ * dp_size_; }

bool TrainRun::train_step(LoopState& loop, TrainResult& result, MetricsLog& metrics) {
  StepLog log;
  log.step = step_ + 1;
  log.epoch = (log.step - 1) / steps_per_epoch_;  // 0-based
  const int64_t step_in_epoch = (log.step - 1) % steps_per_epoch_;
  if (log.epoch != loop.order_epoch) {
    train_set_->epoch_order(cfg_.train.seed, log.epoch, epoch_order_);  // in place
    loop.order_epoch = log.epoch;
  }
  if (int64_t(tokens_per_epoch_.size()) <= log.epoch) tokens_per_epoch_.resize(log.epoch + 1, 0);
  const auto t0 = Clock::now();
  const int64_t waits0 = backend_->host_waits();
  const int64_t comm_waits0 = grid_->comm_host_waits();
  // Normalise by the step's real targets so that padding never dilutes the gradient.
  int64_t step_targets = 0, step_tokens = 0;  // tokens: positions that are not padding
  for (int64_t r = 0; r < rows_per_step(); ++r) {
    const int64_t i = step_in_epoch * rows_per_step() + r;
    if (i >= int64_t(epoch_order_.size())) continue;
    step_targets += train_set_->window_targets(epoch_order_[i]);
    step_tokens += train_set_->window_tokens(epoch_order_[i]);
    if (preference())
      log.preference_pairs += train_set_->window_document_count(epoch_order_[i]) / 2;
  }
  zero_->begin_step(int(accum_));
  const double comm_wait0 = zero_->comm_wait_seconds();
  if (cp_) cp_->reset_stats();
  const int64_t rank_row = B_ * accum_ * dp_rank_;  // this replica's block of each step
  const StepSums sums = runner_->run({epoch_order_, step_in_epoch * rows_per_step() + rank_row,
                                      rank_row, log.step, step_targets, log.preference_pairs});
  log.pipeline = sums.pipeline;
  log.cp = cp_ ? cp_->stats() : CpStats{};
  // Every rank scaled its gradients by 1 / (the whole step's targets): their sum, which the
  // engine reduces bucket by bucket during backward, is the gradient of the step's mean loss,
  // as on one rank.
  zero_->drain();
  const StepTotals totals = grid_->step_totals(sums.loss_sum, sums.pairs);
  if (preference()) log.preference = sum_over_ranks(*grid_, sums.preference);
  // A preference objective's loss is the mean over the step's pairs, wherever they ran.
  const double normaliser = preference() ? double(log.preference_pairs) : double(step_targets);
  const double loss_sum = preference() ? log.preference.loss : totals.loss_sum;
  log.loss = normaliser > 0 ? loss_sum / normaliser : std::nan("");
  log.lr = lr_at(cfg_.train, log.step, total_steps_);
  if (std::isfinite(log.loss))
    log.grad_norm = zero_->step(adamw_hyper(cfg_.train, log.lr), cfg_.train.grad_clip);
  backend_->synchronize();  // the step's time includes the queued update
  if (waits0 >= 0) log.host_waits = backend_->host_waits() - waits0;
  if (world_.backend() == "nccl") log.comm_host_waits = grid_->comm_host_waits() - comm_waits0;
  log.comm_wait_s = zero_->comm_wait_seconds() - comm_wait0;
  const bool skipped = guard_nonfinite(log, loop, metrics);
  log.step_s = seconds_since(t0);
  step_ = log.step;
  tokens_seen_ += step_targets;
  tokens_per_epoch_[log.epoch] += step_targets;
  result.losses.push_back(log.loss);
  result.final_loss = log.loss;
  if (!skipped) loss_points_.emplace_back(double(tokens_seen_), log.loss);
  if (log.step == result.first_step && profiler_) profiler_->reset();  // warm-up step
  if (log.step == result.first_step + 1) loop.allocs_after_warmup = ledger_.alloc_count();

  log.eval = (cfg_.train.eval_every > 0 && log.step % cfg_.train.eval_every == 0) ||
             log.step == total_steps_;
  if (log.eval) {
    auto progress = [&](int64_t done, int64_t total) {
      if (interactive_) log_line(fmt::format("evaluating: batch {}/{}", done, total), false);
    };
    if (preference()) {  // the objective itself over the held-out pairs, as TRL evaluates
      log.eval_preference = evaluate_preference_set();
      const double n = double(log.eval_preference.pairs);
      loop.last_eval = n > 0 ? log.eval_preference.sums.loss / n : std::nan("");
    } else {
      loop.last_eval = evaluate(*model_, *zero_, cp_.get(), *valid_set_, eval_order_, B_,
                                cfg_.train.eval_batches, *grid_, dp_rank_, dp_size_, *backend_,
                                input_staging_, pipe_.get(), progress);
    }
    eval_points_.emplace_back(double(tokens_seen_), loop.last_eval);
  }
  log.eval_loss = loop.last_eval;
  log.tokens_per_s = step_targets / log.step_s;
  // The step's model FLOPs over its tokens, padding not counted (attention: the pairs its
  // document masks leave), over every rank's GEMM rate (Backend::peak_gemm_dtype's: bf16 on a
  // GPU).
  log.mfu = train_flops(cfg_.model, double(step_tokens), totals.pairs) / log.step_s /
            (peak_flops_ * world_.size());
  if (log.step % cfg_.log.every_steps == 0 || log.step == total_steps_ || log.eval)
    log_step(log, metrics);
  return stop_or_checkpoint(log.step, result);
}

// Counts a step whose loss or gradient norm is not finite (its update was skipped), names the
// first layer with non-finite gradients, and aborts after train.max_bad_steps in a row.
bool TrainRun::guard_nonfinite(const StepLog& log, LoopState& loop, MetricsLog& metrics) {
  if (std::isfinite(log.loss) && std::isfinite(log.grad_norm)) {
    loop.bad_streak = 0;
    return false;
  }
  ++loop.bad_streak;
  const std::string where = zero_->first_nonfinite_unit();
  log_line(fmt::format("step {}: non-finite loss ({}) or gradient norm ({}); first "
                       "non-finite gradients: {}; update skipped ({} of {} in a row)",
                       log.step, log.loss, log.grad_norm, where, loop.bad_streak,
                       cfg_.train.max_bad_steps),
           true);
  metrics.write(
      json{{"step", log.step}, {"skipped", true}, {"loss", log.loss}, {"first_bad", where}});
  if (loop.bad_streak >= cfg_.train.max_bad_steps)
    SHARDLM_FAIL(ErrorKind::kInternal,
                 "aborting: {} consecutive steps with non-finite loss or gradients (first "
                 "non-finite gradients in {}); lower train.lr, set train.grad_clip, or check "
                 "the data. The last good checkpoint is {}",
                 loop.bad_streak, where, last_checkpoint_.empty() ? "none" : last_checkpoint_);
  return true;
}

// The step's metrics line (and its eval line), and the progress line.
void TrainRun::log_step(const StepLog& log, MetricsLog& metrics) {
  json line{{"step", log.step},
            {"epoch", log.epoch + 1},
            {"loss", log.loss},
            {"lr", log.lr},
            {"grad_norm", log.grad_norm},
            {"tokens_seen", tokens_seen_},
            {"tokens_per_s", log.tokens_per_s},
            {"step_ms", log.step_s * 1e3},
            {"comm_wait_ms", log.comm_wait_s * 1e3},
            {"mfu", log.mfu},
            {"mem_peak_bytes", ledger_.peak_total(MemPool::kDevice)},
            {"host_rss_bytes", host_rss_bytes()}};
  if (log.host_waits >= 0) line["host_waits"] = log.host_waits;
  if (log.comm_host_waits >= 0) line["comm_host_waits"] = log.comm_host_waits;
  if (pipe_) add_pipeline_columns(log.pipeline, line);
  if (preference() && log.preference_pairs > 0)  // TRL's names, means over the step's pairs
    add_preference_columns(log.preference, log.preference_pairs, "", line);
  if (cp_) {  // this rank's share of the step's context-parallel attention
    line["cp_bytes_sent"] = log.cp.bytes_sent;
    line["cp_attention_flops"] = log.cp.attention_flops;
  }
  json by_category = json::object();  // constant after setup: a step allocates nothing
  for (int c = 0; c < kNumMemCategories; ++c)
    by_category[std::string(mem_category_name(MemCategory(c)))] =
        ledger_.peak(MemPool::kDevice, MemCategory(c));
  line["mem_peak_by_category"] = std::move(by_category);
  metrics.write(line);
  if (tb_) tb_->scalars(log.step, scalar_tags(line));
  if (log.eval) {
    // Under a preference objective TRL's eval_ names: the loss is the objective's, whose
    // exponential is no perplexity.
    json eval{{"eval_loss", log.eval_loss}};
    if (preference())
      add_preference_columns(log.eval_preference.sums, log.eval_preference.pairs, "eval_", eval);
    else
      eval["eval_ppl"] = std::exp(log.eval_loss);
    json eval_line{{"step", log.step}, {"tokens_seen", tokens_seen_}};
    eval_line.update(eval);
    metrics.write(eval_line);
    if (tb_) tb_->scalars(log.step, scalar_tags(eval));
  }
  const int64_t n_epochs = (total_steps_ + steps_per_epoch_ - 1) / steps_per_epoch_;
  log_line(fmt::format("epoch {}/{} | step {} | loss {:.4f} | lr {:.2e} | {:.0f} tok/s | "
                       "mfu {:.1f}% | mem {}{}",
                       log.epoch + 1, n_epochs, progress_text(log.step), log.loss, log.lr,
                       log.tokens_per_s, log.mfu * 100,
                       format_bytes(ledger_.peak_total(MemPool::kDevice)),
                       !log.eval      ? ""
                       : preference() ? fmt::format(" | eval {:.4f}", log.eval_loss)
                                      : fmt::format(" | eval {:.4f} (ppl {:.2f})", log.eval_loss,
                                                    std::exp(log.eval_loss))),
           log.eval);
}

std::string TrainRun::progress_text(int64_t step) {
  const Clock::time_point now = Clock::now();
  step_ends_.emplace_back(step, now);
  if (step_ends_.size() > 20) step_ends_.pop_front();
  std::string eta = "";
  if (step_ends_.size() >= 2) {
    const auto& [first_step, first_end] = step_ends_.front();
    const double per_step =
        std::chrono::duration<double>(now - first_end).count() / double(step - first_step);
    eta = ", ETA " + clock_text(per_step * double(total_steps_ - step));
  }
  return fmt::format("{}/{} ({:.0f}%) | {} elapsed{}", step, total_steps_,
                     100.0 * double(step) / double(total_steps_),
                     clock_text(std::chrono::duration<double>(now - run_started_).count()), eta);
}

void TrainRun::open_tensorboard() {
  if (!lead_ || !cfg_.log.tensorboard) return;
  const fs::path dir =
      cfg_.log.tensorboard_dir.empty() ? dir_ / "tb" : fs::path(cfg_.log.tensorboard_dir);
  tb_ = std::make_unique<TensorBoardWriter>(dir.string(), step_ + 1);
  tb_->text(step_, "config", "```json\n" + run_config_to_json(cfg_).dump(2) + "\n```");
  std::vector<std::pair<std::string, double>> plan;
  for (int p = 0; p < kNumMemPools; ++p)
    for (int c = 0; c < kNumMemCategories; ++c)
      plan.emplace_back(fmt::format("plan/{}/{}", p == int(MemPool::kDevice) ? "device" : "host",
                                    mem_category_name(MemCategory(c))),
                        double(plan_.by_category[size_t(p)][size_t(c)]));
  tb_->scalars(step_, plan);
}

// Each stage's measured compute, blocked communication and bubble, gathered from one rank per
// stage (collective over the world).
void TrainRun::add_pipeline_columns(const PipelineStats& st, json& line) {
  std::vector<float> per(size_t(3 * pp_), 0.f);
  const bool reporter = dp_rank_ == 0 && world_.rank() % (cfg_.parallel.cp * tp_) == 0;
  if (reporter) {
    per[3 * pp_rank_] = float(st.compute_s * 1e3);
    per[3 * pp_rank_ + 1] = float((st.recv_s + st.send_s) * 1e3);
    per[3 * pp_rank_ + 2] = float(st.bubble());
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

// A stop request (agreed by every rank) or a periodic checkpoint: true when the run stops here.
bool TrainRun::stop_or_checkpoint(int64_t step, TrainResult& result) {
  const bool stop_now = stop_requested();
  const bool periodic = cfg_.checkpoint.every_steps > 0 &&
                        step % cfg_.checkpoint.every_steps == 0 && step < total_steps_;
  // A save in flight commits at the first step boundary where every rank's files are durable;
  // at a stop, save_checkpoint waits for it first.
  if (!stop_now && inflight_) guard_save(inflight_->step, true, [&] { poll_async_checkpoint(); });
  if (stop_now)
    guard_save(step, false, [&] { save_checkpoint(step); });
  else if (periodic)
    periodic_checkpoint(step);
  if (!stop_now) return false;
  if (interactive_) out_ << "\n";
  out_ << fmt::format(
      "stopped by signal {} after step {}; checkpoint {} written. Run the same command "
      "again to resume (train.resume = \"auto\").\n",
      stop_ != nullptr ? int(*stop_) : 0, step, last_checkpoint_);
  result.interrupted = true;
  return true;
}

json TrainRun::write_memory_report() {
  json report = memory_report(world_.rank(), ledger_, plan_);
  report["transport_device_bytes"] = grid_->transport_device_bytes();  // in the ledger already
  // Every buffer of the run is still held here, so the driver's count is the ledger's
  // device total plus the driver's rounding of each allocation. On a GPU shared with other
  // ranks a figure is this process's own or none (the reason instead), never the device's.
  // The backend counts from its creation; the world communicator was made before it, so the
  // driver's measure of that (NCCL's buffers; 0 on host transports) is added.
  const DriverDeviceBytes driver = backend_->driver_device_bytes();
  if (!driver.source.empty()) report["driver_device_source"] = driver.source;
  if (driver.bytes >= 0) {
    report["driver_device_bytes"] = driver.bytes + world_.transport_device_bytes();
    report["ledger_device_bytes_now"] = ledger_.current_total(MemPool::kDevice);
    report["device_allocations"] = ledger_.alloc_count();
  } else if (!driver.unavailable.empty()) {
    report["driver_device_bytes_unavailable"] = driver.unavailable;
  }
  // The process's peak resident set over the run, its checkpoint saves included (the final one
  // is done by now): the planned peak plus the runtime's own memory when no save holds more
  // than the plan says.
  report["host_peak_rss_bytes"] = host_peak_rss_bytes();
  write_json_atomic(dir_ / fmt::format("memory_rank{}.json", world_.rank()), report);
  return report;
}

void TrainRun::write_summary(const TrainResult& result, const LoopState& loop, double wall_s) {
  json summary;
  summary["config"] = run_config_to_json(cfg_);
  summary["parameters"] = whole_layout_.total;
  summary["tokens_per_epoch"] = train_set_->targets_per_epoch();
  summary["documents_per_epoch"] = train_set_->num_documents();
  const PackingStats& packed = train_set_->packing_stats();
  summary["packing"] = {{"kind", packing_name(train_set_->packing().packing)},
                        {"windows", train_set_->num_windows()},
                        {"padding_per_epoch", packed.padding},
                        {"samples", packed.samples},
                        {"truncated", packed.truncated},
                        {"dropped", packed.dropped},
                        {"overlong_tokens", packed.overlong_tokens},
                        {"overlong_targets", packed.overlong_targets}};
  summary["steps_per_epoch"] = steps_per_epoch_;
  summary["tokens_seen"] = tokens_seen_;
  summary["tokens_seen_per_epoch"] = tokens_per_epoch_;
  summary["steps"] = step_;
  summary["resumed_from_step"] = result.first_step - 1;
  summary["wall_s"] = wall_s;
  summary["final_loss"] = result.final_loss;
  summary["final_eval_loss"] = result.final_eval_loss;
  if (!preference()) summary["final_eval_ppl"] = std::exp(result.final_eval_loss);
  summary["gemm_flops"] = peak_flops_;
  summary["gemm_flops_dtype"] = dtype_name(peak_dtype_);
  summary["checkpoint"] = last_checkpoint_;
  // Checkpoint writes allocate on the host, never through the ledger: 0 in a healthy run.
  summary["allocations_after_step2"] =
      loop.allocs_after_warmup < 0 ? 0 : ledger_.alloc_count() - loop.allocs_after_warmup;
  if (profiler_) summary["profile"] = profile_report();
  write_json_atomic(dir_ / "summary.json", summary);
  out_ << memory_comparison_text(ledger_, plan_);
  out_ << fmt::format(
      "done: {} steps, {} tokens, final loss {:.4f}, eval loss {:.4f}{}; reports in {}; "
      "checkpoint {}\n",
      step_, tokens_seen_, result.final_loss, loop.last_eval,
      preference() ? "" : fmt::format(" (ppl {:.2f})", std::exp(loop.last_eval)), dir_.string(),
      last_checkpoint_);
}

// Seconds by op family after the first step, as JSON, and printed.
json TrainRun::profile_report() {
  json prof = json::object();
  double total = 0;
  for (int f = 0; f < kNumOpFamilies; ++f) {
    prof[std::string(op_family_name(OpFamily(f)))] = profiler_->seconds()[f];
    total += profiler_->seconds()[f];
  }
  out_ << "time by op family (after the first step):\n";
  for (int f = 0; f < kNumOpFamilies; ++f)
    out_ << fmt::format("  {:<16} {:8.3f} s  {:5.1f}%\n", op_family_name(OpFamily(f)),
                        profiler_->seconds()[f], 100 * profiler_->seconds()[f] / total);
  return prof;
}

void TrainRun::release_training_state() {
  // Users first: the step's schedule and the pipeline executor use the model, the model reads
  // the engine's parameters, the engine the gradient axes.
  runner_.reset();
  eval_rows_.reset();
  preference_charge_.reset();
  pipe_.reset();
  model_.reset();
  cp_.reset();
  zero_.reset();
  grad_axes_.reset();
  snapshot_ = Buffer();
  input_staging_ = InputStaging();
}

void TrainRun::sample_from_final_checkpoint(json& memory_report) {
  MemoryLedger ledger;  // the sample's own: the training buffers are released by now
  // What the run's ledger still holds (the communicators' transport memory) is not the sample's.
  if (cfg_.memory.budget_gib > 0)
    ledger.set_budget(MemPool::kDevice,
                      cfg_.memory.budget_bytes() - ledger_.current_total(MemPool::kDevice));
  {
    // Written and fsynced by this run moments ago: the sizes are checked, the contents trusted.
    // A LoRA checkpoint reads as its merged model, unit by unit (read_params).
    const CheckpointReader ckpt(last_checkpoint_, CheckpointReader::Verify::kSizesOnly);
    SHARDLM_CHECK(ckpt.step() == step_, "sampling: the final checkpoint {} is of step {}, not {}",
                  ckpt.dir(), ckpt.step(), step_);
    LlamaModel sampler(cfg_.model, sampler_model_options(cfg_), *backend_, ledger);
    read_params(ckpt, sampler, *backend_);
    out_ << fmt::format("sample: the parameters of {}\n", ckpt.dir());
    print_samples(sampler);
  }
  SHARDLM_CHECK(sampler_plan_.has_value(), "sampling without the sample's plan");
  memory_report["sample"] = shardlm::memory_report(0, ledger, *sampler_plan_);
  memory_report["sample"]["training_device_bytes_held"] = ledger_.current_total(MemPool::kDevice);
  write_json_atomic(dir_ / "memory_rank0.json", memory_report);
  const int dev = static_cast<int>(MemPool::kDevice);
  out_ << fmt::format(
      "\nsample memory on rank 0, the training buffers released: device peak {} planned, {} "
      "measured (memory_rank0.json, \"sample\")\n",
      format_bytes(sampler_plan_->peak_bytes[dev]),
      format_bytes(ledger.peak_total(MemPool::kDevice)));
}

void TrainRun::print_samples(LlamaModel& sampler) {
  std::mt19937_64 rng(cfg_.train.seed);
  for (int64_t s = 0; s < cfg_.sample.count; ++s) {
    out_ << fmt::format("\n--- sample {} ---\n{}", s + 1, cfg_.sample.prompt);
    out_.flush();
    sample_text(sampler, *tok_, cfg_.sample.prompt, cfg_.sample, rng,
                [&](const std::string& piece) {
                  out_ << piece;
                  out_.flush();
                });
    out_ << "\n";
  }
}
}  // namespace shardlm::trainer_detail
