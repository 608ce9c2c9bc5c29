// The training run: exact epoch accounting, gradient accumulation with the loss normalised
// over a step's real targets, evaluation, numerical guards, checkpoints with exact resume,
// signal handling, progress output and the run directory's reports.
#include "shardlm/train/trainer.h"

#include <fmt/ranges.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <nlohmann/json.hpp>
#include <optional>

#include "run_files.h"
#include "shardlm/backend/profiling.h"
#include "shardlm/comm/communicator.h"
#include "shardlm/comm/local.h"
#include "shardlm/comm/nccl.h"
#include "shardlm/comm/rendezvous.h"
#include "shardlm/io/tokenize.h"
#include "shardlm/model/tensor_shard.h"
#include "shardlm/parallel/context.h"
#include "shardlm/parallel/tensor.h"
#include "shardlm/parallel/topology.h"
#include "shardlm/parallel/zero.h"
#include "shardlm/plan/plan.h"
#include "shardlm/train/checkpoint.h"
#include "shardlm/train/data.h"
#include "shardlm/train/hf.h"
#include "shardlm/train/model_io.h"
#include "shardlm/train/optimizer.h"
#include "shardlm/train/plan_inputs.h"
#include "shardlm/train/report.h"

namespace shardlm {
namespace {

using Clock = std::chrono::steady_clock;
using json = nlohmann::json;
namespace fs = std::filesystem;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// (query, key) pairs that causal attention with document masks computes on rows seg_start
// [B * T] (host): token t of a row sees the tokens from its document's start to itself.
double attention_pairs(const Tensor& seg_start, int64_t T) {
  const int32_t* seg = seg_start.i32();
  double pairs = 0;
  for (int64_t i = 0; i < seg_start.numel(); ++i) pairs += double(i % T - seg[i] + 1);
  return pairs;
}

// Refuses a configuration whose planned device peak is over memory.budget_gib, naming what
// the plan holds and what to change.
void check_plan_fits(const MemoryPlan& plan, const RunConfig& cfg) {
  if (cfg.memory.budget_gib <= 0) return;
  const int64_t budget = cfg.memory.budget_bytes();
  const int dev = static_cast<int>(MemPool::kDevice);
  if (plan.peak_bytes[dev] <= budget) return;
  std::string held;
  for (int c = 0; c < kNumMemCategories; ++c) {
    const int64_t b = plan.by_category[dev][c];
    if (b > 0)
      held += fmt::format("{}{} {}", held.empty() ? "" : ", ", mem_category_name(MemCategory(c)),
                          format_bytes(b));
  }
  SHARDLM_FAIL(ErrorKind::kOutOfMemory,
               "the plan, before anything is allocated: this configuration needs {} per rank "
               "on the device pool ({}), over memory.budget_gib = {} ({}). `shardlm plan` with the "
               "same options shows the breakdown, and `shardlm plan --fit` the fastest settings "
               "that fit. To lower the device peak: {}; or raise memory.budget_gib.",
               format_bytes(plan.peak_bytes[dev]), held, cfg.memory.budget_gib,
               format_bytes(budget), fmt::join(device_memory_hints(cfg), ", "));
}

// Fills the model's inputs with rows order[first .. first + B) of `data`: directly, or, under
// context parallelism, the full rows first and then this rank's share of every row. Returns
// the attention pairs of the whole rows (for the FLOP count).
double fill_batch(LlamaModel& model, ContextParallel* cp, Dataset& data,
                  const std::vector<int64_t>& order, int64_t first, int64_t B, Backend& be,
                  std::vector<int32_t>& staging) {
  if (cp == nullptr) {
    // Written on the host, then copied to the model's inputs (device memory on a GPU).
    const BatchInputs dev = model.inputs(B, data.seq_len());
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
  cp->shard(in, model.inputs(B, cp->local_len()), B);
  return attention_pairs(in.seg_start, data.seq_len());
}

// Mean loss over up to max_batches micro-batches of the held-out set, in window order; the
// batches are dealt round-robin over the data-parallel replicas (the ranks of a cp group share
// theirs) and the sums reduced over every rank. Every rank runs the same number of forward
// passes (a replica without a batch of its own repeats the first and ignores it), because at
// ZeRO stage 3 each pass gathers parameters collectively.
double evaluate(LlamaModel& model, ZeroEngine& zero, ContextParallel* cp, Dataset& data, int64_t B,
                int64_t max_batches, Communicator& world, int64_t dp_rank, int64_t dp_size,
                Backend& be, std::vector<int32_t>& staging) {
  std::vector<int64_t> order(data.num_windows());
  for (int64_t i = 0; i < int64_t(order.size()); ++i) order[i] = i;
  const int64_t n_batches = (data.num_windows() + B - 1) / B;
  const int64_t limit = max_batches > 0 ? std::min(max_batches, n_batches) : n_batches;
  const int64_t rounds = (limit + dp_size - 1) / dp_size;
  const int64_t T = cp != nullptr ? cp->local_len() : data.seq_len();
  double sum = 0;
  int64_t count = 0;
  for (int64_t i = 0; i < rounds; ++i) {
    const int64_t b = i * dp_size + dp_rank;
    fill_batch(model, cp, data, order, b < limit ? b * B : 0, B, be, staging);
    const LossResult r = model.forward_loss(B, T);
    if (b >= limit) continue;
    sum += r.loss_sum;
    count += r.n_valid;
  }
  zero.drain();
  float totals[2] = {float(sum), float(count)};
  world.all_reduce(Tensor(totals, DType::kF32, {2}, MemPool::kHost));
  return totals[1] > 0 ? double(totals[0]) / totals[1] : std::nan("");
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

double measure_gemm_flops(Backend& be, MemoryLedger& ledger) {
  for (int64_t n = 1024;; n *= 2) {
    Buffer a(be, ledger, MemCategory::kWorkspace, MemPool::kDevice, n * n * 4);
    Buffer b(be, ledger, MemCategory::kWorkspace, MemPool::kDevice, n * n * 4);
    Buffer c(be, ledger, MemCategory::kWorkspace, MemPool::kDevice, n * n * 4);
    const Tensor ta = a.view(DType::kF32, {n, n}), tb = b.view(DType::kF32, {n, n}),
                 tc = c.view(DType::kF32, {n, n});
    be.linear_forward(ta, tb, Tensor(), tc);  // warm up threads and caches
    be.synchronize();
    double best = 0, shortest = 1e30;
    for (int rep = 0; rep < 3; ++rep) {
      const auto t0 = Clock::now();
      be.linear_forward(ta, tb, Tensor(), tc);
      be.synchronize();
      const double s = seconds_since(t0);
      shortest = std::min(shortest, s);
      best = std::max(best, 2.0 * n * n * n / s);
    }
    if (shortest >= 0.01 || n >= 8192) return best;
  }
}

namespace {

// One training run's state; train() builds it and calls run().
class TrainRun {
 public:
  TrainRun(const RunConfig& cfg, std::ostream& out, const volatile std::sig_atomic_t* stop,
           Communicator& world)
      : cfg_(cfg), out_(world.rank() == 0 ? out : null_out_), stop_(stop), world_(world) {}
  TrainResult run();
  DryRunResult dry_run();

 private:
  void setup();
  void resume_if_asked();
  void save_checkpoint(int64_t step);
  void write_reports(int64_t step);
  // Collective: rank 0 gets a single-sequence model holding all the current parameters.
  std::unique_ptr<LlamaModel> whole_model_on_lead(MemoryLedger& ledger);
  // A checkpoint vector (params, Adam m, v, master) in the whole model's arena order, whatever
  // the grid: save_state streams it to `sink` on rank 0 (under tensor parallelism the tp
  // ranks' shards are gathered and interleaved on the host); load_state has every rank read
  // its shard of it from `source` (whole units read, the rank's slices kept).
  void save_state(ZeroEngine::State s, const std::function<void(const void*, size_t)>& sink);
  void load_state(ZeroEngine::State s,
                  const std::function<void(int64_t begin, int64_t count, void* dst)>& source);
  // Unit u of the whole model's f32 values -> this rank's shard of it (tensor parallelism).
  void slice_unit(int u, const float* whole, float* shard) const;
  void log_line(const std::string& line, bool keep);

  bool stop_requested();  // agreed by every rank

  const RunConfig& cfg_;
  std::ostream null_out_{nullptr};  // ranks other than 0 print nothing
  std::ostream& out_;
  const volatile std::sig_atomic_t* stop_;
  Communicator& world_;  // every rank: dp x cp x tp; ZeRO shards over dp x cp (zero_group())
  int64_t dp_size_ = 1, dp_rank_ = 0;      // data-parallel replicas: who reads which rows
  std::unique_ptr<Communicator> cp_comm_;  // this rank's context-parallel group (cp > 1)
  // Tensor parallelism (tp > 1): this rank's tp group, the group ZeRO shards over (the ranks
  // holding the same tp shard: dp x cp), and the model's seam over the tp group.
  int64_t tp_ = 1, tp_rank_ = 0;
  std::unique_ptr<Communicator> tp_comm_, zero_comm_;
  std::unique_ptr<TensorParallel> tp_seam_;
  ModelConfig shard_model_;            // this rank's shard of cfg_.model (cfg_.model at tp = 1)
  ParamLayout whole_layout_;           // the whole model's arena: checkpoints, init, export
  std::vector<ShardPiece> tp_pieces_;  // this rank's shard within whole_layout_
  Communicator& zero_group() { return zero_comm_ ? *zero_comm_ : world_; }
  bool lead_ = true;  // rank 0: prints, writes run files and checkpoints
  bool interactive_ = false;
  fs::path dir_;

  std::unique_ptr<Backend> backend_;
  ProfilingBackend* profiler_ = nullptr;
  MemoryLedger ledger_;
  std::unique_ptr<Tokenizer> tok_;  // data.tokenizer: text inputs, sampling, model.json
  std::unique_ptr<Dataset> train_set_, valid_set_;
  ParamLayout layout_;      // the model's, for the engine (which keeps a reference)
  LoraConfig lora_;         // lora.*: rank 0 = full fine-tuning
  LoraLayout lora_layout_;  // with LoRA, the engine's arena: the adapters
  // What the ZeRO engine holds: the model, or with LoRA the adapters (the base is frozen and
  // replicated in the model's own parameters-only store).
  const ParamLayout& engine_layout() const {
    return lora_.enabled() ? lora_layout_.params : layout_;
  }
  StoredLoraBase lora_base() const;
  std::unique_ptr<Backend> host_backend_;  // offloaded optimizer state (unprofiled)
  std::unique_ptr<ZeroEngine> zero_;       // parameters, gradients, optimizer state
  std::unique_ptr<ContextParallel> cp_;    // the sequence split (cp > 1), the model's attention
  std::unique_ptr<LlamaModel> model_;
  MemoryPlan plan_;
  double peak_flops_ = 0;
  std::vector<int32_t> input_staging_;  // a micro-batch's inputs on the host

  int64_t B_ = 0, T_ = 0, accum_ = 0;
  int64_t Tl_ = 0;  // tokens of each row this rank holds: T_ / cp
  int64_t steps_per_epoch_ = 0, total_steps_ = 0;
  int64_t step_ = 0;  // steps completed
  int64_t tokens_seen_ = 0;
  std::vector<int64_t> tokens_per_epoch_;
  std::vector<std::pair<double, double>> loss_points_, eval_points_;  // (tokens, loss)
  std::string last_checkpoint_;
};

bool TrainRun::stop_requested() {
  // mpirun forwards a signal to every rank, but not at the same instant: agree on it, so that
  // all ranks stop after the same step.
  int32_t flag = (stop_ != nullptr && *stop_ != 0) ? int32_t(*stop_) : 0;
  if (world_.size() > 1)
    world_.all_reduce(Tensor(&flag, DType::kI32, {1}, MemPool::kHost), ReduceOp::kMax);
  return flag != 0;
}

void TrainRun::log_line(const std::string& line, bool keep) {
  if (interactive_) {
    out_ << "\r\033[K" << line << (keep ? "\n" : "");
  } else {
    out_ << line << "\n";
  }
  out_.flush();
}

void TrainRun::setup() {
  const bool cuda = cfg_.train.device == "cuda";
  if (cuda && world_.size() > 1 && cfg_.parallel.cp > 1)
    SHARDLM_FAIL(ErrorKind::kConfig,
                 "train.device = \"cuda\" with parallel.cp = {} is not supported yet: the "
                 "context-parallel core packs and rotates sequence pieces through host pointers; "
                 "set parallel.cp = 1 on GPUs, or train.device = \"cpu\"",
                 cfg_.parallel.cp);
  // Several GPUs: world_ is the NCCL world (train()), whose local_rank() is this rank's GPU.
  backend_ =
      make_backend(cuda ? DeviceKind::kCuda : DeviceKind::kCpu, cuda ? world_.local_rank() : 0);
  // NCCL's stream waits for the compute stream's work before each collective (a no-op on MPI).
  world_.set_compute_stream(backend_->device_stream());
  if (cfg_.log.profile) {
    auto wrapped = std::make_unique<ProfilingBackend>(std::move(backend_));
    profiler_ = wrapped.get();
    backend_ = std::move(wrapped);
  }
  if (cfg_.memory.budget_gib > 0) ledger_.set_budget(MemPool::kDevice, cfg_.memory.budget_bytes());
  lead_ = world_.rank() == 0;
  // Under mpirun, stdout is forwarded (often through a pseudo-terminal) and interleaves with
  // the other ranks' stderr: plain lines only.
  interactive_ = lead_ && world_.size() == 1 && (&out_ == &std::cout) && isatty(STDOUT_FILENO);

  tok_ = load_tokenizer(cfg_.tokenizer_path());
  if (tok_->eos_id() < 0)
    SHARDLM_FAIL(ErrorKind::kConfig,
                 "the tokenizer {} has no end-of-text token (documents are separated by it); name "
                 "it as eos_token in tokenizer_config.json beside tokenizer.json",
                 tok_->name());
  if (cfg_.model.vocab_size < tok_->vocab_size())
    SHARDLM_FAIL(ErrorKind::kConfig,
                 "model.vocab_size ({}) is smaller than the tokenizer's {} ids ({}); set "
                 "model.vocab_size >= {}",
                 cfg_.model.vocab_size, tok_->vocab_size(), tok_->name(), tok_->vocab_size());
  B_ = cfg_.train.micro_batch;
  T_ = cfg_.data.seq_len;
  accum_ = cfg_.train.grad_accum;
  // The rank grid: dp x cp x tp (pipeline parallelism is rejected by validation).
  const Topology topo = topology_for(cfg_, world_.size(), world_.rank());
  dp_size_ = topo.size(Axis::kDp);
  dp_rank_ = topo.coord(Axis::kDp);
  tp_ = topo.size(Axis::kTp);
  tp_rank_ = topo.coord(Axis::kTp);
  shard_model_ = tp_shard_config(cfg_.model, tp_);
  whole_layout_ = make_param_layout(cfg_.model);
  if (tp_ > 1) {
    tp_comm_ = world_.split(int(topo.color(Axis::kTp)), int(topo.key(Axis::kTp)), "tp");
    // ZeRO shards over the ranks that hold the same tp shard (same tp coordinate).
    zero_comm_ = world_.split(int(tp_rank_), world_.rank(), "zero");
    tp_seam_ = std::make_unique<TensorParallel>(*tp_comm_);
    tp_pieces_ = tp_shard_pieces(cfg_.model, tp_, tp_rank_);
  }
  const std::optional<ContextLayout> cp_layout = context_layout_for(cfg_);
  if (cp_layout)
    cp_comm_ = world_.split(int(topo.color(Axis::kCp)), int(topo.key(Axis::kCp)), "cp");
  Tl_ = cp_layout ? cp_layout->local() : T_;
  // The planner first (the plan `shardlm plan` shows, from the same mapping): a configuration
  // whose plan exceeds memory.budget_gib stops here, before any data is read or memory
  // allocated (the ledger's budget stays the backstop).
  plan_ = plan_memory(plan_inputs_for(cfg_, world_.size(), *backend_));
  check_plan_fits(plan_, cfg_);
  train_set_ = std::make_unique<Dataset>(open_source(cfg_.data.train, *tok_), T_, tok_->eos_id());
  valid_set_ = std::make_unique<Dataset>(
      cfg_.data.valid.empty() ? train_set_->split_tail(cfg_.data.valid_fraction)
                              : Dataset(open_source(cfg_.data.valid, *tok_), T_, tok_->eos_id()));

  dir_ = cfg_.log.dir;
  std::error_code ec;
  fs::create_directories(dir_ / "checkpoints", ec);
  if (ec)
    SHARDLM_FAIL(ErrorKind::kConfig, "log.dir: cannot create '{}': {}", cfg_.log.dir, ec.message());
  {
    MemoryLedger scratch;  // calibration buffers are not the run's memory
    peak_flops_ = measure_gemm_flops(*backend_, scratch);
  }

  const ModelOptions mopt = model_options_for(cfg_, Tl_);
  const ZeroOptions zopt = zero_options_for(cfg_);
  layout_ = make_param_layout(shard_model_);
  lora_ = mopt.lora;
  if (lora_.enabled()) lora_layout_ = make_lora_layout(cfg_.model, lora_);
  host_backend_ = make_backend(DeviceKind::kCpu);
  // With LoRA the engine trains the f32 adapters; the model keeps the frozen base itself.
  zero_ = std::make_unique<ZeroEngine>(engine_layout(),
                                       lora_.enabled() ? DType::kF32 : mopt.param_dtype, zopt,
                                       zero_group(), *backend_, *host_backend_, ledger_);
  if (tp_ > 1) zero_->set_tensor_parallel(*tp_comm_, tp_replicated_ranges(layout_));
  if (cp_layout)
    cp_ = std::make_unique<ContextParallel>(shard_model_, *cp_layout, B_, *cp_comm_, *backend_,
                                            ledger_);
  model_ = std::make_unique<LlamaModel>(shard_model_, mopt, *backend_, ledger_,
                                        lora_.enabled() ? nullptr : zero_.get(), cp_.get(),
                                        lora_.enabled() ? zero_.get() : nullptr, tp_seam_.get());
  if (lora_.enabled()) {
    // The frozen base (every rank holds it whole) and PEFT's initial adapters (B = 0, so the
    // first forward is the base's), both from the run's seed; a resume overrides the adapters.
    if (cfg_.model_hf_dir.empty()) {
      model_->init_weights(cfg_.train.seed);
    } else {
      const SafetensorsDir st(cfg_.model_hf_dir);
      std::vector<float> values(size_t(layout_.max_unit));
      for (int u = 0; u < int(layout_.units.size()); ++u) {
        const int64_t n = layout_.unit_size(u);
        read_hf_unit(st, layout_, u, values.data());
        backend_->convert(Tensor(values.data(), DType::kF32, {n}, MemPool::kHost),
                          model_->params().rows(layout_.units[u].begin, n));
      }
    }
    initial_lora_weights(cfg_.model, lora_, lora_layout_, cfg_.train.seed ^ 0x4c6f5241ULL,
                         [&](int u, const float* values) { zero_->set_unit_values(u, values); });
  } else {
    // The whole model's values unit by unit (the seeded initial weights, or a fine-tune's
    // Hugging Face weights; a resume overrides), each rank keeping its tp shard of them.
    std::vector<float> shard(tp_ > 1 ? size_t(layout_.max_unit) : 0);
    auto set_unit = [&](int u, const float* values) {
      if (tp_ == 1) return zero_->set_unit_values(u, values);
      slice_unit(u, values, shard.data());
      zero_->set_unit_values(u, shard.data());
    };
    if (cfg_.model_hf_dir.empty()) {
      initial_weights(cfg_.model, whole_layout_, cfg_.train.seed, set_unit);
    } else {
      const SafetensorsDir st(cfg_.model_hf_dir);
      std::vector<float> values(size_t(whole_layout_.max_unit));
      for (int u = 0; u < int(whole_layout_.units.size()); ++u) {
        read_hf_unit(st, whole_layout_, u, values.data());
        set_unit(u, values.data());
      }
    }
  }

  // Exact accounting: each epoch visits every window once; the last step of an epoch may be
  // short, and its missing rows are padded and masked rather than dropped. A step's rows are
  // dealt to the data-parallel ranks in contiguous blocks of micro_batch x grad_accum.
  const int64_t rows_per_step = B_ * accum_ * dp_size_;
  steps_per_epoch_ = (train_set_->num_windows() + rows_per_step - 1) / rows_per_step;
  const bool by_epochs =
      cfg_.train.stop == "epochs" || (cfg_.train.stop.empty() && cfg_.train.max_steps == 0);
  total_steps_ = by_epochs ? cfg_.train.epochs * steps_per_epoch_ : cfg_.train.max_steps;

  const auto& m = cfg_.model;
  out_ << fmt::format("shardlm: model {} ({:.2f}M parameters, {} layers, dim {}), {} params\n",
                      m.name, whole_layout_.total / 1e6, m.n_layers, m.dim, cfg_.precision.param);
  if (tp_ > 1)
    out_ << fmt::format(
        "tensor: {} ranks per tp group, each {} of {} heads, {} of {} kv heads, {} of {} MLP "
        "columns ({:.2f}M parameters per rank; embeddings, norms and LM head replicated)\n",
        tp_, shard_model_.n_heads, m.n_heads, shard_model_.n_kv_heads, m.n_kv_heads,
        shard_model_.ffn_dim, m.ffn_dim, layout_.total / 1e6);
  if (lora_.enabled())
    out_ << fmt::format(
        "lora: rank {}, alpha {}, dropout {}, targets {}: {} trainable parameters ({:.3f}% of "
        "the model) in f32; the base is frozen ({}, no gradients or optimizer state){}\n",
        lora_.rank, lora_.alpha, lora_.dropout, lora_targets_string(lora_.targets),
        lora_layout_.params.total, 100.0 * double(lora_layout_.params.total) / layout_.total,
        cfg_.precision.param,
        cfg_.model_hf_dir.empty() ? ", from its seeded initial weights"
                                  : ", from " + cfg_.model_hf_dir);
  out_ << fmt::format(
      "data: {}: {} tokens in {} documents, {} target tokens per epoch -> {} windows of {}\n",
      train_set_->name(), train_set_->num_tokens(), train_set_->num_documents(),
      train_set_->targets_per_epoch(), train_set_->num_windows(), T_);
  out_ << fmt::format("held-out: {}: {} tokens in {} documents\n", valid_set_->name(),
                      valid_set_->num_tokens(), valid_set_->num_documents());
  const int64_t last_rows = train_set_->num_windows() - (steps_per_epoch_ - 1) * rows_per_step;
  out_ << fmt::format(
      "schedule: {} sequences per step ({} x {} micro-batches x {} data-parallel ranks), {} "
      "steps per epoch, {} steps in all ({}); the last step of each epoch has {} of {} "
      "sequences, the rest padded and masked: nothing is dropped\n",
      rows_per_step, B_, accum_, dp_size_, steps_per_epoch_, total_steps_,
      by_epochs
          ? fmt::format("{} epochs", cfg_.train.epochs)
          : fmt::format("train.max_steps, {:.2f} epochs", double(total_steps_) / steps_per_epoch_),
      last_rows, rows_per_step);
  const ZeroLayout& zl = zero_->zero_layout();
  out_ << fmt::format(
      "zero: stage {} over {} rank{}: {} bucket{}, {} of {} parameters' optimizer "
      "state per rank{}{}{}\n",
      cfg_.zero.stage, zero_group().size(), zero_group().size() == 1 ? "" : "s", zl.buckets.size(),
      zl.buckets.size() == 1 ? "" : "s", cfg_.zero.stage >= 1 ? zl.shard : zl.padded_total,
      engine_layout().total, cfg_.zero.offload_optimizer == "cpu" ? " (on the host)" : "",
      cfg_.zero.offload_params == "cpu" ? ", parameter shard on the host" : "",
      cfg_.zero.overlap_comm && zero_group().size() > 1 ? ", communication overlapped" : "");
  if (cp_) {
    const ContextLayout& cl = cp_->layout();
    out_ << fmt::format(
        "context: {} over {} ranks ({} x {} data-parallel{} = {} ranks){}: every sequence of {} "
        "tokens split into {} pieces of {}, {} tokens per rank\n",
        cfg_.parallel.cp_kind, cl.P, cl.P, dp_size_,
        tp_ > 1 ? fmt::format(" x {} tensor-parallel", tp_) : "", world_.size(),
        cl.U > 1 && cl.R() > 1
            ? fmt::format(", all-to-all in groups of {}, ring of {}", cl.U, cl.R())
        : cfg_.parallel.cp_kind == "hybrid" && cl.U == 1
            ? fmt::format(" (no all-to-all group of 2 to {} ranks divides parallel.cp and the "
                          "heads: a plain ring)",
                          cl.P / 2)
            : "",
        T_, 2 * cl.P, cl.piece(), cl.local());
  }
  out_ << fmt::format(
      "memory: planned {} on the device pool, {} on the host pool; measured GEMM rate {:.1f} "
      "GFLOP/s\n",
      format_bytes(plan_.peak_bytes[0]), format_bytes(plan_.peak_bytes[1]), peak_flops_ / 1e9);
  out_.flush();
}

// Rank root's string on every rank of the group.
std::string broadcast_string(Communicator& comm, std::string text, int root) {
  int32_t n = int32_t(text.size());
  comm.broadcast(Tensor(&n, DType::kI32, {1}, MemPool::kHost), root);
  std::vector<int32_t> words((n + 3) / 4, 0);
  if (comm.rank() == root) std::memcpy(words.data(), text.data(), n);
  if (!words.empty())
    comm.broadcast(Tensor(words.data(), DType::kI32, {int64_t(words.size())}, MemPool::kHost),
                   root);
  return std::string(reinterpret_cast<const char*>(words.data()), n);
}

// The checkpoint to resume from as train.resume says ("" for none), chosen and verified in
// full on this process (rank 0), with the fallback to older ones.
std::string choose_checkpoint(const RunConfig& cfg, const std::string& ckdir, std::ostream& out) {
  const std::string& mode = cfg.train.resume;
  if (mode == "none") return "";
  const bool fallback = cfg.train.resume_fallback && mode == "auto";
  try {
    std::string target = mode;
    if (mode == "auto") {
      target = latest_checkpoint(ckdir);
      if (target.empty()) return "";
    }
    return CheckpointReader(target).dir();
  } catch (const Error& e) {
    if (!fallback || e.kind() != ErrorKind::kData) throw;
    out << fmt::format(
        "resume: the latest checkpoint is unusable ({}); falling back "
        "(train.resume_fallback)\n",
        e.what());
    for (const std::string& older : list_checkpoints(ckdir)) {
      try {
        return CheckpointReader(older).dir();
      } catch (const Error& e2) {
        out << fmt::format("resume: {} is unusable too ({})\n", older, e2.what());
      }
    }
    SHARDLM_FAIL(ErrorKind::kData, "{}: no complete checkpoint verifies", ckdir);
  }
}

void TrainRun::resume_if_asked() {
  // Rank 0 picks and verifies the checkpoint; the others open what it chose, checking sizes
  // only, and every rank reads just the parts of the flat vectors it holds. The vectors do not
  // depend on the number of ranks or the ZeRO stage, so any checkpoint resumes on any.
  const std::string ckdir = (dir_ / "checkpoints").string();
  std::string chosen = lead_ ? choose_checkpoint(cfg_, ckdir, out_) : "";
  if (world_.size() > 1) chosen = broadcast_string(world_, chosen, 0);
  if (chosen.empty()) return;
  const CheckpointReader ckpt(chosen, CheckpointReader::Verify::kSizesOnly);  // verified above
  const json state = ckpt.read_json("state.json");
  const std::string where = ckpt.dir() + "/state.json";
  try {
    const StoredModel stored = read_stored_model(ckpt);
    if (stored.param_dtype != model_->options().param_dtype ||
        stored.config.dim != cfg_.model.dim || stored.config.n_layers != cfg_.model.n_layers ||
        stored.config.vocab_size != cfg_.model.vocab_size ||
        stored.config.ffn_dim != cfg_.model.ffn_dim ||
        stored.config.n_heads != cfg_.model.n_heads ||
        stored.config.n_kv_heads != cfg_.model.n_kv_heads ||
        stored.config.tie_embeddings != cfg_.model.tie_embeddings ||
        stored.config.attn_bias != cfg_.model.attn_bias)
      SHARDLM_FAIL(ErrorKind::kConfig,
                   "train.resume: {} holds a different model or parameter dtype than the config; "
                   "resume with the config it was trained with, or set train.resume = \"none\"",
                   ckpt.dir());
    const StoredLoraBase base = lora_base();
    if (stored.lora.rank != lora_.rank || stored.lora.alpha != lora_.alpha ||
        stored.lora.dropout != lora_.dropout || stored.lora.targets != lora_.targets ||
        (lora_.enabled() &&
         (stored.lora_base.hf_dir != base.hf_dir || stored.lora_base.init_seed != base.init_seed)))
      SHARDLM_FAIL(
          ErrorKind::kConfig,
          "train.resume: {} was trained with {} and this config asks for {}; resume "
          "with the same lora.* keys (and the same base: model.hf_dir, train.seed), or "
          "set train.resume = \"none\"",
          ckpt.dir(),
          stored.lora.enabled()
              ? fmt::format("LoRA rank {}, alpha {}, dropout {}, targets {}, base '{}'",
                            stored.lora.rank, stored.lora.alpha, stored.lora.dropout,
                            lora_targets_string(stored.lora.targets), stored.lora_base.hf_dir)
              : std::string("no LoRA (full fine-tuning)"),
          lora_.enabled() ? fmt::format("LoRA rank {}, alpha {}, dropout {}, targets {}, base '{}'",
                                        lora_.rank, lora_.alpha, lora_.dropout,
                                        lora_targets_string(lora_.targets), base.hf_dir)
                          : std::string("no LoRA"));
    const json& data = state.at("data");
    if (data.at("tokens").get<int64_t>() != train_set_->num_tokens() ||
        data.at("seq_len").get<int64_t>() != T_ ||
        data.at("rows_per_step").get<int64_t>() != B_ * accum_ * dp_size_ ||
        state.at("seed").get<uint64_t>() != cfg_.train.seed)
      SHARDLM_FAIL(ErrorKind::kConfig,
                   "train.resume: {} was trained on other data or batch settings (tokens, "
                   "data.seq_len, train.seed and the global batch train.micro_batch x "
                   "train.grad_accum x ranks = {} must match; it has {} sequences per step); "
                   "set train.resume = \"none\" to start over",
                   ckpt.dir(), B_ * accum_ * dp_size_, data.at("rows_per_step").get<int64_t>());
    const int64_t total = lora_.enabled() ? engine_layout().total : whole_layout_.total;
    const size_t pb = lora_.enabled() ? 4 : dtype_size(model_->options().param_dtype);
    if (ckpt.size("params.bin") != size_t(total) * pb)
      SHARDLM_FAIL(ErrorKind::kData,
                   "{}/params.bin: holds {} bytes but this model's parameters need {} bytes",
                   ckpt.dir(), ckpt.size("params.bin"), size_t(total) * pb);
    const int n_states = zero_->has_master() ? 3 : 2;
    if (ckpt.size("optimizer.bin") != size_t(total) * 4 * n_states)
      SHARDLM_FAIL(ErrorKind::kData, "{}/optimizer.bin: holds {} bytes, this run needs {}",
                   ckpt.dir(), ckpt.size("optimizer.bin"), size_t(total) * 4 * n_states);
    load_state(ZeroEngine::State::kParams, [&](int64_t begin, int64_t count, void* dst) {
      ckpt.read_range("params.bin", uint64_t(begin) * pb, dst, size_t(count) * pb);
    });
    // optimizer.bin: m, v (and the f32 master weights with bf16 parameters), each [total].
    const ZeroEngine::State parts[] = {ZeroEngine::State::kAdamM, ZeroEngine::State::kAdamV,
                                       ZeroEngine::State::kMaster};
    for (int i = 0; i < n_states; ++i)
      load_state(parts[i], [&](int64_t begin, int64_t count, void* dst) {
        ckpt.read_range("optimizer.bin", (uint64_t(i) * total + begin) * 4, dst, size_t(count) * 4);
      });
    zero_->set_steps_taken(state.at("optimizer_steps").get<int64_t>());
    step_ = state.at("step").get<int64_t>();
    tokens_seen_ = state.at("tokens_seen").get<int64_t>();
    tokens_per_epoch_ = state.at("tokens_per_epoch").get<std::vector<int64_t>>();
    loss_points_ = state.at("loss_points").get<std::vector<std::pair<double, double>>>();
    eval_points_ = state.at("eval_points").get<std::vector<std::pair<double, double>>>();
  } catch (const json::exception& e) {
    SHARDLM_FAIL(ErrorKind::kData, "{}: {}", where, e.what());
  }
  last_checkpoint_ = ckpt.dir();
  out_ << fmt::format("resume: continuing from {} (step {} of {})\n", ckpt.dir(), step_,
                      total_steps_);
}

void TrainRun::save_checkpoint(int64_t step) {
  // Every rank takes part (the sharded state is gathered bucket by bucket); rank 0 alone
  // streams it into the checkpoint and commits. The others then wait, so that nobody runs
  // ahead of a checkpoint that may not exist yet.
  std::unique_ptr<CheckpointWriter> w;
  if (lead_) {
    w = std::make_unique<CheckpointWriter>((dir_ / "checkpoints").string(), step);
    w->add_json("model.json",
                model_to_json(cfg_.model, lora_.enabled() ? lora_layout_.params : whole_layout_,
                              model_->options(), tok_->name(), lora_base()));
  }
  auto sink = [&](const void* data, size_t bytes) { w->append(data, bytes); };
  if (lead_) w->begin_file("params.bin");
  save_state(ZeroEngine::State::kParams, sink);
  if (lead_) {
    w->end_file();
    w->begin_file("optimizer.bin");
  }
  save_state(ZeroEngine::State::kAdamM, sink);
  save_state(ZeroEngine::State::kAdamV, sink);
  if (zero_->has_master()) save_state(ZeroEngine::State::kMaster, sink);
  if (!lead_) {
    world_.barrier();
    last_checkpoint_ = latest_checkpoint((dir_ / "checkpoints").string());
    return;
  }
  w->end_file();
  json state = {
      {"step", step},
      {"optimizer_steps", zero_->steps_taken()},
      {"zero", {{"stage", cfg_.zero.stage}, {"ranks", zero_group().size()}}},
      {"parallel", {{"tp", tp_}, {"cp", cfg_.parallel.cp}, {"dp", dp_size_}}},
      {"seed", cfg_.train.seed},
      {"tokens_seen", tokens_seen_},
      {"tokens_per_epoch", tokens_per_epoch_},
      {"data",
       {{"tokens", train_set_->num_tokens()},
        {"seq_len", T_},
        {"rows_per_step", B_ * accum_ * dp_size_},
        {"position",
         {{"epoch", step / steps_per_epoch_}, {"step_in_epoch", step % steps_per_epoch_}}}}},
      {"loss_points", loss_points_},
      {"eval_points", eval_points_},
      {"config", run_config_to_json(cfg_)}};
  w->add_json("state.json", state);
  last_checkpoint_ = w->commit(cfg_.checkpoint.keep_last);
  write_reports(step);
  world_.barrier();
}

StoredLoraBase TrainRun::lora_base() const {
  StoredLoraBase b;
  if (!lora_.enabled()) return b;
  if (!cfg_.model_hf_dir.empty())
    b.hf_dir = fs::absolute(cfg_.model_hf_dir).lexically_normal().string();
  else
    b.init_seed = cfg_.train.seed;
  return b;
}

void TrainRun::slice_unit(int u, const float* whole, float* shard) const {
  const int64_t wb = whole_layout_.units[u].begin, we = whole_layout_.units[u].end;
  const int64_t sb = layout_.units[u].begin;
  for (const ShardPiece& p : tp_pieces_)
    if (p.full >= wb && p.full < we)
      std::copy_n(whole + (p.full - wb), p.count, shard + (p.shard - sb));
}

void TrainRun::save_state(ZeroEngine::State s,
                          const std::function<void(const void*, size_t)>& sink) {
  if (tp_ == 1 || lora_.enabled()) return zero_->save(s, sink);
  // Rank 0 of each ZeRO group holds its tp shard's vector after the engine's save; the tp
  // groups of other replicas (their ZeRO rank is not 0) only take part in the engine's save.
  const size_t eb = s == ZeroEngine::State::kParams ? dtype_size(model_->options().param_dtype) : 4;
  const size_t shard_bytes = size_t(layout_.total) * eb, padded = (shard_bytes + 3) / 4 * 4;
  std::vector<std::byte> mine(zero_group().rank() == 0 ? padded : 0);
  size_t at = 0;
  zero_->save(s, [&](const void* data, size_t bytes) {
    std::memcpy(mine.data() + at, data, bytes);
    at += bytes;
  });
  if (zero_group().rank() != 0) return;
  std::vector<std::byte> all(padded * size_t(tp_));
  const int64_t words = int64_t(padded / 4);
  tp_comm_->all_gather(Tensor(mine.data(), DType::kI32, {words}, MemPool::kHost),
                       Tensor(all.data(), DType::kI32, {words * tp_}, MemPool::kHost));
  if (!lead_) return;
  std::vector<std::byte> whole(size_t(whole_layout_.total) * eb);
  for (int64_t r = 0; r < tp_; ++r)
    for (const ShardPiece& p : tp_shard_pieces(cfg_.model, tp_, r))
      std::memcpy(whole.data() + size_t(p.full) * eb,
                  all.data() + padded * r + size_t(p.shard) * eb, size_t(p.count) * eb);
  sink(whole.data(), whole.size());
}

void TrainRun::load_state(
    ZeroEngine::State s,
    const std::function<void(int64_t begin, int64_t count, void* dst)>& source) {
  if (tp_ == 1 || lora_.enabled()) return zero_->load(s, source);
  const size_t eb = s == ZeroEngine::State::kParams ? dtype_size(model_->options().param_dtype) : 4;
  std::vector<std::byte> mine(size_t(layout_.total) * eb),
      unit(size_t(whole_layout_.max_unit) * eb);
  size_t pi = 0;
  for (int u = 0; u < int(whole_layout_.units.size()); ++u) {
    const int64_t b = whole_layout_.units[u].begin, e = whole_layout_.units[u].end;
    source(b, e - b, unit.data());
    for (; pi < tp_pieces_.size() && tp_pieces_[pi].full < e; ++pi) {
      const ShardPiece& p = tp_pieces_[pi];
      std::memcpy(mine.data() + size_t(p.shard) * eb, unit.data() + size_t(p.full - b) * eb,
                  size_t(p.count) * eb);
    }
  }
  zero_->load(s, [&](int64_t begin, int64_t count, void* dst) {
    std::memcpy(dst, mine.data() + size_t(begin) * eb, size_t(count) * eb);
  });
}

std::unique_ptr<LlamaModel> TrainRun::whole_model_on_lead(MemoryLedger& ledger) {
  std::unique_ptr<LlamaModel> m;
  ModelOptions o;
  o.param_dtype = model_->options().param_dtype;
  o.max_seq = T_;         // the sampler's window: the whole row, whatever the cp split
  o.activations = false;  // parameters only: the KvDecoder holds what sampling needs
  if (lead_) m = std::make_unique<LlamaModel>(cfg_.model, o, *backend_, ledger);
  if (tp_ > 1) {  // the tp shards gathered into the whole arena
    const DType dt = o.param_dtype;
    save_state(ZeroEngine::State::kParams, [&](const void* data, size_t bytes) {
      const int64_t n = int64_t(bytes / dtype_size(dt));
      backend_->copy(Tensor(const_cast<void*>(data), dt, {n}, MemPool::kHost), m->params());
    });
    return m;
  }
  if (lora_.enabled()) {  // the base with the adapters merged in (W + alpha/r B A)
    std::vector<float> adapters(lead_ ? size_t(lora_layout_.params.total) : 0);
    int64_t at = 0;
    zero_->save(ZeroEngine::State::kParams, [&](const void* data, size_t bytes) {
      std::memcpy(adapters.data() + at, data, bytes);
      at += int64_t(bytes / 4);
    });
    if (!lead_) return m;
    std::vector<float> unit(size_t(layout_.max_unit));
    for (int u = 0; u < int(layout_.units.size()); ++u) {
      const int64_t n = layout_.unit_size(u), begin = layout_.units[u].begin;
      const Tensor host(unit.data(), DType::kF32, {n}, MemPool::kHost);
      backend_->convert(model_->params().rows(begin, n), host);
      if (u >= 1 && u <= cfg_.model.n_layers)
        merge_lora_layer(cfg_.model, lora_, lora_layout_, layout_, u - 1,
                         adapters.data() + lora_layout_.params.units[u - 1].begin, unit.data());
      backend_->convert(host, m->params().rows(begin, n));
    }
    return m;
  }
  const DType dt = o.param_dtype;
  int64_t at = 0;
  zero_->save(ZeroEngine::State::kParams, [&](const void* data, size_t bytes) {
    const int64_t n = int64_t(bytes / dtype_size(dt));
    backend_->copy(Tensor(const_cast<void*>(data), dt, {n}, MemPool::kHost),
                   m->params().rows(at, n));
    at += n;
  });
  return m;
}

void TrainRun::write_reports(int64_t step) {
  write_file_atomic((dir_ / "loss.svg").string(),
                    loss_curve_svg(loss_points_, eval_points_,
                                   fmt::format("{}: loss (step {})", cfg_.model.name, step)));
  std::vector<std::string> names;
  std::vector<int64_t> planned, measured;
  for (int c = 0; c < kNumMemCategories; ++c) {
    names.emplace_back(mem_category_name(MemCategory(c)));
    planned.push_back(plan_.by_category[0][c]);
    measured.push_back(ledger_.peak(MemPool::kDevice, MemCategory(c)));
  }
  write_file_atomic((dir_ / "memory.svg").string(),
                    memory_chart_svg(names, planned, measured,
                                     "device memory by category: planned vs measured peak"));
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
    for (int64_t a = 0; a < accum_; ++a) {
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
    if (world_.size() > 1) {  // the cp (and tp) ranks of a replica all counted its rows' pairs;
                              // the tp ranks of a group all computed the same loss
      float totals[2] = {float(loss_sum / double(tp_)),
                         float(pairs / double(cfg_.parallel.cp * tp_))};
      world_.all_reduce(Tensor(totals, DType::kF32, {2}, MemPool::kHost));
      loss_sum = totals[0];
      pairs = totals[1];
    }
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
                           world_, dp_rank_, dp_size_, *backend_, input_staging_);
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
  // The final checkpoint (unless the run was already complete when resumed).
  if (result.first_step <= total_steps_) save_checkpoint(step_);
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

DryRunResult TrainRun::dry_run() {
  setup();  // allocates everything; throws kOutOfMemory past memory.budget_gib
  DryRunResult r;
  r.device_peak_bytes = ledger_.peak_total(MemPool::kDevice);
  r.host_peak_bytes = ledger_.peak_total(MemPool::kHost);
  r.memory_report = (dir_ / fmt::format("memory_rank{}.json", world_.rank())).string();
  write_json_atomic(r.memory_report, memory_report(world_.rank(), ledger_, plan_));
  if (world_.size() > 1) world_.barrier();  // every rank's report is written before rank 0 says so
  out_ << fmt::format(
      "dry run: rank 0 peak device {} ({} bytes), host {} ({} bytes), {} allocations; "
      "{}; nothing trained\n",
      format_bytes(r.device_peak_bytes), r.device_peak_bytes, format_bytes(r.host_peak_bytes),
      r.host_peak_bytes, ledger_.alloc_count(),
      world_.size() == 1 ? r.memory_report
                         : fmt::format("{}/memory_rank{{R}}.json for R = 0..{}", dir_.string(),
                                       world_.size() - 1));
  return r;
}

}  // namespace

namespace {

// train.device = cuda on several ranks: the NCCL world, bootstrapped over `host` (mpirun/srun)
// or over TCP from the torchrun-style variables; every collective of the run, host scalars
// included (NCCL stages them), goes through it. Null where `host` is the run's communicator.
std::unique_ptr<Communicator> device_world_for(const RunConfig& cfg, Communicator& host) {
  const std::optional<LaunchEnv> env = host.size() == 1 ? launch_env() : std::nullopt;
  const bool torchrun = env && env->world_size > 1;
  if (cfg.train.device != "cuda") {
    if (torchrun)
      SHARDLM_FAIL(ErrorKind::kConfig,
                   "WORLD_SIZE={} is set (a torchrun-style launch), but train.device = \"{}\" "
                   "communicates over MPI only: launch with mpirun/srun, or use "
                   "train.device = \"cuda\" (NCCL)",
                   env->world_size, cfg.train.device);
    return nullptr;
  }
  if (host.size() == 1 && !torchrun) return nullptr;
  return make_nccl_world(&host, host.options());
}

}  // namespace

DryRunResult dry_run(const RunConfig& cfg, std::ostream& out, Communicator* world) {
  LocalCommunicator local("world");
  Communicator& host = world != nullptr ? *world : local;
  const std::unique_ptr<Communicator> device_world = device_world_for(cfg, host);
  return TrainRun(cfg, out, nullptr, device_world ? *device_world : host).dry_run();
}

TrainResult train(const RunConfig& cfg, std::ostream& out,
                  const volatile std::sig_atomic_t* stop_signal, Communicator* world) {
  LocalCommunicator local("world");
  Communicator& host = world != nullptr ? *world : local;
  const std::unique_ptr<Communicator> device_world = device_world_for(cfg, host);
  TrainRun run(cfg, out, stop_signal, device_world ? *device_world : host);
  return run.run();
}

}  // namespace shardlm
