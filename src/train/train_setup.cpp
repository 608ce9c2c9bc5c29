// TrainRun::setup: the backend, the rank grid and its communicators, the plan's budget check,
// the data sets, the ZeRO engine and model with their initial (seeded, Hugging Face or LoRA)
// weights, the epoch accounting and the run's opening lines. It trains nothing and reads no
// checkpoint (train_checkpoint.cpp resumes).
#include <unistd.h>

#include <fmt/ranges.h>

#include <algorithm>
#include <iostream>
#include <numeric>
#include <optional>
#include <sstream>

#include "shardlm/hf/hf.h"
#include "shardlm/parallel/topology.h"
#include "shardlm/planner/plan_inputs.h"
#include "train_run.h"

namespace shardlm {
namespace trainer_detail {
namespace {

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

// Refuses an end-of-run sample whose planned device peak on rank 0 (the whole model and its
// cache, after the training buffers are released) is over memory.budget_gib, less what stays
// held to the end (`held`: the communicators' transport memory).
void check_sampler_fits(const MemoryPlan& plan, const RunConfig& cfg, int64_t held) {
  if (cfg.memory.budget_gib <= 0) return;
  const int64_t budget = cfg.memory.budget_bytes() - held;
  const int dev = static_cast<int>(MemPool::kDevice);
  if (plan.peak_bytes[dev] <= budget) return;
  SHARDLM_FAIL(ErrorKind::kOutOfMemory,
               "the plan, before anything is allocated: the end-of-run sample needs {} on rank "
               "0's device (the whole model's parameters {} and a key/value cache of "
               "data.seq_len = {} positions), over memory.budget_gib = {} less what the "
               "communicators hold ({}); set "
               "sample.count = 0 (the final checkpoint is written either way, and `shardlm "
               "generate` samples from it where the whole model fits), or raise "
               "memory.budget_gib",
               format_bytes(plan.peak_bytes[dev]),
               format_bytes(plan.by_category[dev][int(MemCategory::kParams)]), cfg.data.seq_len,
               cfg.memory.budget_gib, format_bytes(budget));
}

// How the run reads .jsonl / .json data files (data.format, data.columns, data.tags).
RecordOptions record_options(const DataConfig& data) {
  return {parse_record_format(data.format, "data.format"), data.columns, data.tags,
          data.skip_bad_records};
}

}  // namespace
}  // namespace trainer_detail

using trainer_detail::Clock;
using trainer_detail::seconds_since;

double measure_gemm_flops(Backend& be, MemoryLedger& ledger, DType dtype) {
  // From n = 512 up, the first square product that takes 5 ms (long enough to time to a few
  // per cent): on a small CPU that is 512 (four products, ~40 ms at startup), on a GPU 8192.
  for (int64_t n = 512;; n *= 2) {
    const int64_t bytes = n * n * int64_t(dtype_size(dtype));
    Buffer a(be, ledger, MemCategory::kWorkspace, MemPool::kDevice, bytes);
    Buffer b(be, ledger, MemCategory::kWorkspace, MemPool::kDevice, bytes);
    Buffer c(be, ledger, MemCategory::kWorkspace, MemPool::kDevice, bytes);
    const Tensor ta = a.view(dtype, {n, n}), tb = b.view(dtype, {n, n}), tc = c.view(dtype, {n, n});
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
    if (shortest >= 0.005 || n >= 8192) return best;
  }
}

namespace trainer_detail {

void TrainRun::setup() {
  make_run_backend();
  load_tokenizer_and_shapes();
  const std::optional<ContextLayout> cp_layout = build_grid();
  plan_and_open_data();
  try {
    build_engine_and_model(cp_layout);
    init_weights();
  } catch (const Error& e) {
    // Within the plan, but the machine could not give it (the budget checks come earlier):
    // say what the plan asked of this rank beside what the machine refused.
    if (e.kind() != ErrorKind::kOutOfMemory) throw;
    const int dev = int(MemPool::kDevice), host = int(MemPool::kHost);
    SHARDLM_FAIL(ErrorKind::kOutOfMemory,
                 "{}; the plan for rank {} holds {} on the host pool and {} on the device pool "
                 "(`shardlm plan` with the same options shows the breakdown; "
                 "zero.offload_*, lora.offload_base, memory.offload_checkpoints and "
                 "checkpoint.async move bytes between them)",
                 e.what(), world_.rank(), format_bytes(plan_.peak_bytes[host]),
                 format_bytes(plan_.peak_bytes[dev]));
  }
  schedule_steps();
  print_model_setup();
  print_run_setup();
}

// The backend of train.device (a GPU per local rank), profiled when log.profile is set.
void TrainRun::make_run_backend() {
  const bool cuda = cfg_.train.device == "cuda";
  // Several GPUs: world_ is the NCCL world (train()), whose local_rank() is this rank's GPU;
  // under parallel.device_comm = "host" ranks beyond the visible GPUs share them.
  const int gpus = cuda ? std::max(1, visible_devices(DeviceKind::kCuda)) : 1;
  const DeviceKind kind = cuda                                ? DeviceKind::kCuda
                          : cfg_.train.device == "cpu-queued" ? DeviceKind::kCpuQueued
                                                              : DeviceKind::kCpu;
  // A GPU other ranks of this node use too: the backend counts its own memory for the report.
  const bool shared =
      cuda && device_shared_by_ranks(world_.local_rank(), world_.local_size(), gpus);
  backend_ = make_backend(kind, cuda ? world_.local_rank() % gpus : 0, shared);
  // Before any workspace query: the attention implementation sizes the attention scratch.
  attention_impl_ = backend_->select_attention(cfg_.train.attention);
  // NCCL's stream waits for the compute stream's work before each collective (a no-op on MPI).
  world_.set_compute_stream(backend_->device_stream());
  if (auto* staged = dynamic_cast<StagedCommunicator*>(&world_))
    comm_staging_ = std::make_unique<CommStaging>(*staged, *backend_, ledger_,
                                                  cfg_.parallel.staging_bytes(world_.size()));
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
}

// The tokenizer and the micro-batch shapes; checks the model's vocabulary covers it.
void TrainRun::load_tokenizer_and_shapes() {
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
}

// The rank grid (dp x pp x cp x tp) and this rank's place in it: its stage of its tp shard of
// the model, and its share of each row under context parallelism.
std::optional<ContextLayout> TrainRun::build_grid() {
  std::optional<ContextLayout> cp_layout = context_layout_for(cfg_);
  // Every communicator of the run, made before the plan counts their transports' memory. A
  // frozen LoRA base sharded by ZeRO-3 gathers on a communicator of its own.
  grid_ = std::make_unique<ParallelGrid>(
      topology_for(cfg_, world_.size(), world_.rank()), world_,
      GridGroups{.tied_embeddings = cfg_.model.tie_embeddings,
                 .base_group = cfg_.lora.rank > 0 && cfg_.zero.stage == 3,
                 .cp_ulysses = cp_layout ? cp_layout->U : 0});
  dp_size_ = grid_->size(Axis::kDp);
  dp_rank_ = grid_->coord(Axis::kDp);
  tp_ = grid_->size(Axis::kTp);
  tp_rank_ = grid_->coord(Axis::kTp);
  pp_ = grid_->size(Axis::kPp);
  pp_rank_ = grid_->coord(Axis::kPp);
  shard_model_ = stage_model_for(cfg_, pp_rank_);
  whole_layout_ = make_param_layout(cfg_.model);
  if (tp_ > 1)
    tp_seam_ =
        std::make_unique<TensorParallel>(grid_->group(Axis::kTp), shard_model_.seq_shards() > 1);
  if (pp_ > 1) partition_ = pipeline_partition_for(cfg_);
  if (tp_ > 1 || pp_ > 1)
    tp_pieces_ = stage_shard_pieces(cfg_.model, shard_model_.pp_begin, shard_model_.stage_end(),
                                    tp_, tp_rank_);
  SHARDLM_CHECK(cp_layout.has_value() == grid_->has(Axis::kCp),
                "the context layout and the grid disagree on cp = {}", grid_->size(Axis::kCp));
  Tl_ = cp_layout ? cp_layout->local() : T_;
  return cp_layout;
}

// The data a train.objective reads: preference records for dpo and simpo, any other data for
// sft.
void TrainRun::check_objective_data() const {
  for (const Dataset* set : {train_set_.get(), valid_set_.get()}) {
    if (preference() && !set->paired())
      SHARDLM_FAIL(ErrorKind::kData,
                   "{}: train.objective = \"{}\" reads preference records (\"prompt\", "
                   "\"chosen\", \"rejected\" in a .jsonl or .json file), and this data has none",
                   set->name(), cfg_.train.objective);
    if (!preference() && set->paired())
      SHARDLM_FAIL(ErrorKind::kData,
                   "{}: holds preference records, which train.objective = \"sft\" does not read; "
                   "set train.objective = \"dpo\" or \"simpo\"",
                   set->name());
  }
}

int64_t TrainRun::planned_data_host_bytes() const {
  // the epoch's window order and the evaluation's: 8 bytes a training and a held-out window
  int64_t bytes = train_set_->source().planned_host_bytes() + train_set_->num_windows() * 8 +
                  valid_set_->num_windows() * 8;
  if (&valid_set_->source() != &train_set_->source())  // data.valid: a source of its own
    bytes += valid_set_->source().planned_host_bytes();
  for (const Dataset* set : {train_set_.get(), valid_set_.get()}) {
    const DataSetSizes sizes = set->host_sizes();
    bytes += data_set_host_bytes(sizes);
    if (reference_table())
      bytes += reference_table_host_bytes(sizes.windows, sizes.placed, sizes.seq_len);
  }
  return bytes;
}

int64_t TrainRun::held_data_host_bytes() const {
  int64_t bytes = train_set_->source().host_bytes() + train_set_->host_bytes() +
                  valid_set_->host_bytes() +
                  int64_t((epoch_order_.capacity() + eval_order_.capacity()) * sizeof(int64_t));
  if (&valid_set_->source() != &train_set_->source()) bytes += valid_set_->source().host_bytes();
  for (const ReferenceTable* t : {reference_table_.get(), valid_reference_table_.get()})
    if (t != nullptr)
      bytes += int64_t(t->window_first.capacity() * sizeof(int64_t) +
                       (t->chosen.capacity() + t->rejected.capacity()) * sizeof(double) +
                       t->key_rows.capacity() * sizeof(int32_t));
  return bytes;
}

void TrainRun::plan_and_open_data() {
  // The planner first (the plan `shardlm plan` shows, from the same mapping): a configuration
  // whose plan exceeds memory.budget_gib stops here, before any data is read or memory
  // allocated (the ledger's budget stays the backstop).
  PlanInputs planned =
      plan_inputs_for(cfg_, world_.size(), *backend_, pp_rank_, grid_->transport_device_bytes());
  plan_ = plan_memory(planned);
  checkpoint_placement_ = planned.checkpoint_placement;  // "auto" resolved by the plan
  check_plan_fits(plan_, cfg_);
  // The transports' device memory (NCCL's buffers) is held from their creation to the run's
  // end: counted once here, like an allocation, though the transport made it.
  if (planned.comm_transport_bytes > 0)
    ledger_.on_alloc(MemCategory::kComm, MemPool::kDevice, planned.comm_transport_bytes);
  // The end-of-run sample runs on rank 0; every rank checks it, so that all of them stop.
  if (const auto sampler = sampler_plan_inputs_for(cfg_, *backend_)) {
    sampler_plan_ = plan_decoder_memory(*sampler);
    check_sampler_fits(*sampler_plan_, cfg_, planned.comm_transport_bytes);
  }
  const RecordOptions records = record_options(cfg_.data);
  std::ostringstream data_log;
  const std::shared_ptr<TokenSource> train_source =
      open_source(cfg_.data.train, *tok_, records, &data_log);
  // One packing for both sets, resolved from the training data.
  const PackingOptions packing =
      packing_options(cfg_.data.packing, cfg_.data.overlong, *train_source);
  train_set_ = std::make_unique<Dataset>(train_source, T_, tok_->eos_id(), 0, -1, packing);
  valid_set_ = std::make_unique<Dataset>(
      cfg_.data.valid.empty() ? train_set_->split_tail(cfg_.data.valid_fraction)
                              : Dataset(open_source(cfg_.data.valid, *tok_, records, &data_log), T_,
                                        tok_->eos_id(), 0, -1, packing));
  data_files_log_ = data_log.str();
  check_objective_data();
  epoch_order_.assign(size_t(train_set_->num_windows()), 0);
  eval_order_.resize(size_t(valid_set_->num_windows()));
  std::iota(eval_order_.begin(), eval_order_.end(), int64_t{0});
  // The data's host bytes, now that their sizes are known (the device pool is unchanged).
  planned.data_host_bytes = planned_data_host_bytes();
  plan_ = plan_memory(planned);
  for (const Dataset* set : {train_set_.get(), valid_set_.get()})
    if (set->targets_per_epoch() == 0)
      SHARDLM_FAIL(ErrorKind::kData,
                   "{}: no target tokens to {} on ({}); under samples packing a longer "
                   "data.seq_len keeps the targets that truncation cut",
                   set->name(), set == train_set_.get() ? "train" : "evaluate", packing_line(*set));

  dir_ = cfg_.log.dir;
  std::error_code ec;
  fs::create_directories(dir_ / "checkpoints", ec);
  if (ec)
    SHARDLM_FAIL(ErrorKind::kConfig, "log.dir: cannot create '{}': {}", cfg_.log.dir, ec.message());
  {
    MemoryLedger scratch;  // calibration buffers are not the run's memory
    peak_dtype_ = backend_->peak_gemm_dtype(cfg_.precision.activation_dtype());
    peak_flops_ = measure_gemm_flops(*backend_, scratch, peak_dtype_);
  }
}

// The ZeRO engine (with every axis's gradient rule), the context-parallel core, the model and
// the step runner, all allocating from the ledger as the plan says.
void TrainRun::build_engine_and_model(const std::optional<ContextLayout>& cp_layout) {
  ModelOptions mopt = model_options_for(cfg_, Tl_);
  mopt.checkpoint_placement = checkpoint_placement_;
  if (pp_ > 1) {
    mopt.pipeline_slots = pipeline_slots_for(cfg_, pp_rank_);
    pipe_ = std::make_unique<PipelineExecutor>(grid_->group(Axis::kPp), *backend_, ledger_,
                                               stage_output_elems(), int(accum_),
                                               mopt.activation_dtype);
  }
  const ZeroOptions zopt = zero_options_for(cfg_);
  layout_ = make_param_layout(shard_model_);
  lora_ = mopt.lora;
  if (lora_.enabled()) {  // the stage's adapters, split with their base projections (tp > 1)
    whole_lora_layout_ = make_lora_layout(cfg_.model, lora_);
    lora_layout_ = make_lora_layout(shard_model_, lora_);
    if (pp_ > 1 || tp_ > 1)
      lora_pieces_ = lora_stage_shard_pieces(cfg_.model, lora_, shard_model_.pp_begin,
                                             shard_model_.stage_end(), tp_, tp_rank_);
  }
  host_backend_ = make_backend(DeviceKind::kCpu);
  // With LoRA the engine trains the f32 adapters; the model keeps the frozen base itself.
  zero_ = std::make_unique<ZeroEngine>(engine_layout(),
                                       lora_.enabled() ? DType::kF32 : mopt.param_dtype, zopt,
                                       grid_->zero(), *backend_, *host_backend_, ledger_);
  grad_axes_ = std::make_unique<GradientAxes>(*grid_, shard_model_, lora_);
  zero_->set_gradient_axes(*grad_axes_);
  if (cp_layout)
    cp_ = std::make_unique<ContextParallel>(
        shard_model_, *cp_layout, B_, grid_->context(), *backend_, ledger_, mopt.activation_dtype,
        mopt.pipeline_slots, cp_kept_sets_for(cfg_, shard_model_, *cp_layout, mopt.checkpointing));
  // With LoRA the engine holds the adapters; the model keeps the frozen base itself.
  model_ = std::make_unique<LlamaModel>(
      shard_model_, mopt, *backend_, ledger_,
      ModelSeams{.store = lora_.enabled() ? nullptr : zero_.get(),
                 .adapters = lora_.enabled() ? zero_.get() : nullptr,
                 .attention = cp_.get(),
                 .tp = tp_seam_.get(),
                 .base_shards = base_sharded() ? &grid_->base_shards() : nullptr});
  // The inputs go up from the pinned slots, under cp the rank's share of each row.
  input_staging_ = InputStaging(*backend_, ledger_, B_ * Tl_);
  const StepParts parts = step_parts(*train_set_, accum_);
  if (reference_table()) {
    reference_table_ = std::make_unique<ReferenceTable>(reference_layout(*train_set_));
    valid_reference_table_ = std::make_unique<ReferenceTable>(reference_layout(*valid_set_));
  }
  runner_ = preference()
                ? make_preference_runner(parts, ledger_, preference_loss(cfg_.train), pipe_.get(),
                                         stage_output_elems(), reference_table_.get())
                : make_step_runner(parts, pipe_.get(), stage_output_elems());
  if (preference()) {
    eval_rows_ = std::make_unique<PreferenceEvalRows>(B_, T_, Tl_);
    preference_charge_ = LedgerCharge(ledger_, MemCategory::kActivations, MemPool::kHost,
                                      runner_->host_bytes() + eval_rows_->host_bytes());
  }
  data_charge_ = LedgerCharge(ledger_, MemCategory::kData, MemPool::kHost, held_data_host_bytes());
  allocate_checkpoint_snapshot();
}

void TrainRun::init_weights() {
  if (lora_.enabled()) {
    // The frozen base (every rank of a stage holds the stage's whole, or its tp shard) and
    // PEFT's initial adapters (B = 0, so the first forward is the base's), both from the run's
    // seed and the whole model's layouts, each rank keeping its units and shards; a resume
    // overrides the adapters.
    std::vector<float> shard(size_t(std::max(layout_.max_unit, lora_layout_.params.max_unit)));
    // nf4: a 4-bit directory's projections as saved, cut to this rank's stage and shard.
    auto set_base_unit = [&](int u, const float* values, std::span<const Nf4Matrix> nf4) {
      const int64_t n = layout_.unit_size(u);
      if (n == 0) return;  // another stage's
      if (tp_pieces_.empty())
        return model_->set_base_unit(u, values, nf4);  // other NF4 projections quantized here
      slice_unit(u, values, shard.data());
      model_->set_base_unit(u, shard.data(), nf4_shard_matrices(nf4, whole_layout_, tp_pieces_));
    };
    if (cfg_.model_hf_dir.empty()) {
      initial_weights(cfg_.model, whole_layout_, cfg_.train.seed,
                      [&](int u, const float* values) { set_base_unit(u, values, {}); });
    } else {
      const SafetensorsDir st(cfg_.model_hf_dir);
      std::vector<float> values(size_t(whole_layout_.max_unit));
      std::vector<Nf4Matrix> nf4;
      for (int u = 0; u < int(whole_layout_.units.size()); ++u) {
        nf4.clear();
        read_hf_unit(st, whole_layout_, u, values.data(), &nf4);
        set_base_unit(u, values.data(), nf4);
      }
    }
    initial_lora_weights(cfg_.model, lora_, whole_lora_layout_, cfg_.train.seed ^ 0x4c6f5241ULL,
                         [&](int u, const float* values) {
                           if (lora_layout_.params.unit_size(u) == 0) return;  // another stage's
                           if (lora_pieces_.empty()) return zero_->set_unit_values(u, values);
                           slice_unit(whole_lora_layout_.params, lora_layout_.params, lora_pieces_,
                                      u, values, shard.data());
                           zero_->set_unit_values(u, shard.data());
                         });
  } else {
    // The whole model's values unit by unit (the seeded initial weights, or a fine-tune's
    // Hugging Face weights; a resume overrides), each rank keeping its tp shard of them.
    std::vector<float> shard(tp_pieces_.empty() ? 0 : size_t(layout_.max_unit));
    auto set_unit = [&](int u, const float* values) {
      // Full fine-tuning DPO keys its reference sums by these values (every rank sees them whole).
      if (reference_table())
        initial_weights_crc_ = crc32_continue(initial_weights_crc_, values,
                                              size_t(whole_layout_.unit_size(u)) * sizeof(float));
      if (tp_pieces_.empty()) return zero_->set_unit_values(u, values);
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
}

void TrainRun::schedule_steps() {
  // Exact accounting: each epoch visits every window once; the last step of an epoch may be
  // short, and its missing rows are padded and masked rather than dropped. A step's rows are
  // dealt to the data-parallel ranks in contiguous blocks of micro_batch x grad_accum.
  steps_per_epoch_ = (train_set_->num_windows() + rows_per_step() - 1) / rows_per_step();
  const bool by_epochs =
      cfg_.train.stop == "epochs" || (cfg_.train.stop.empty() && cfg_.train.max_steps == 0);
  total_steps_ = by_epochs ? cfg_.train.epochs * steps_per_epoch_ : cfg_.train.max_steps;
}

// What the run holds: the model, its tp / sequence / pipeline split, LoRA.
void TrainRun::print_model_setup() {
  const auto& m = cfg_.model;
  out_ << fmt::format("shardlm: model {} ({:.2f}M parameters, {} layers, dim {}), {} params\n",
                      m.name, whole_layout_.total / 1e6, m.n_layers, m.dim, cfg_.precision.param);
  out_ << fmt::format("attention: {} (train.attention = \"{}\")\n", attention_impl_,
                      cfg_.train.attention);
  if (tp_ > 1)
    out_ << fmt::format(
        "tensor: {} ranks per tp group, each {} of {} heads, {} of {} kv heads, {} of {} MLP "
        "columns and {} of {} vocabulary rows ({:.2f}M parameters per rank{}; the norms "
        "replicated)\n",
        tp_, shard_model_.n_heads, m.n_heads, shard_model_.n_kv_heads, m.n_kv_heads,
        shard_model_.ffn_dim, m.ffn_dim, shard_model_.vocab_rows(), m.vocab_size,
        layout_.total / 1e6, pp_ > 1 ? " on its stage" : "");
  if (shard_model_.seq_shards() > 1)
    out_ << fmt::format(
        "sequence: the residual stream and the norms split by rows across the tp group, {} of "
        "each micro-batch's {} rows per rank (parallel.sequence_parallel)\n",
        B_ * Tl_ / tp_, B_ * Tl_);
  if (pp_ > 1) {
    std::string stages;
    for (int s = 0; s < partition_.stages(); ++s)
      stages +=
          fmt::format("{}stage {}: layers {}-{}{}{}", s == 0 ? "" : ", ", s, partition_.begin[s],
                      partition_.begin[s + 1] - 1, s == 0 ? " + embeddings" : "",
                      s + 1 == partition_.stages()
                          ? cfg_.model.tie_embeddings
                                ? " + final norm, tied LM head (a copy of the embeddings), loss"
                                : " + final norm, LM head, loss"
                          : "");
    out_ << fmt::format(
        "pipeline: {} stages ({}), 1F1B over {} micro-batches per step (train.grad_accum); "
        "textbook bubble (pp-1)/(m+pp-1) = {:.1f}%; stage s holds up to min(m, pp - s) "
        "micro-batches' activations\n",
        pp_, stages, accum_, 100 * one_f_one_b_bubble(int(pp_), int(accum_)));
  }
  if (lora_.enabled())
    out_ << fmt::format(
        "lora: rank {}, alpha {}, dropout {}, targets {}: {} trainable parameters ({:.3f}% of "
        "the model) in f32; the base is frozen ({}, no gradients or optimizer state){}\n",
        lora_.rank, lora_.alpha, lora_.dropout, lora_targets_string(lora_.targets),
        whole_lora_layout_.params.total,
        100.0 * double(whole_lora_layout_.params.total) / whole_layout_.total,
        lora_.nf4_base
            ? "nf4 projections" +
                  (nf4_sharded() ? fmt::format(" sharded over {} ranks", grid_->zero().size())
                                 : std::string()) +
                  ", the rest " + cfg_.precision.param
            : cfg_.precision.param +
                  (base_sharded()
                       ? fmt::format(", decoder layers sharded over {} ranks", grid_->zero().size())
                       : std::string()),
        cfg_.model_hf_dir.empty() ? ", from its seeded initial weights"
                                  : ", from " + cfg_.model_hf_dir);
}

// What the run does: data, schedule, ZeRO, context parallelism, the plan.
void TrainRun::print_run_setup() {
  const bool by_epochs =
      cfg_.train.stop == "epochs" || (cfg_.train.stop.empty() && cfg_.train.max_steps == 0);
  if (!data_files_log_.empty()) out_ << "data files tokenized in memory:\n" << data_files_log_;
  out_ << fmt::format(
      "data: {}: {} tokens in {} documents, {} target tokens per epoch -> {} windows of {}\n",
      train_set_->name(), train_set_->num_tokens(), train_set_->num_documents(),
      train_set_->targets_per_epoch(), train_set_->num_windows(), T_);
  out_ << packing_line(*train_set_) << "\n";
  out_ << fmt::format("held-out: {}: {} tokens in {} documents\n", valid_set_->name(),
                      valid_set_->num_tokens(), valid_set_->num_documents());
  const int64_t last_rows = train_set_->num_windows() - (steps_per_epoch_ - 1) * rows_per_step();
  out_ << fmt::format(
      "schedule: {} sequences per step ({} x {} micro-batches x {} data-parallel ranks), {} "
      "steps per epoch, {} steps in all ({}); the last step of each epoch has {} of {} "
      "sequences, the rest padded and masked: nothing is dropped\n",
      rows_per_step(), B_, accum_, dp_size_, steps_per_epoch_, total_steps_,
      by_epochs
          ? fmt::format("{} epochs", cfg_.train.epochs)
          : fmt::format("train.max_steps, {:.2f} epochs", double(total_steps_) / steps_per_epoch_),
      last_rows, rows_per_step());
  // The transport by the world's backend: "mpi", "tcp", "nccl", "<host>-staged".
  const std::string_view backend = world_.backend();
  const std::string transport = backend.starts_with("tcp")    ? "TCP"
                                : backend.starts_with("nccl") ? "NCCL"
                                                              : "MPI";
  if (comm_staging_)
    out_ << fmt::format(
        "communication: {} ranks over {}, device tensors staged through {} of host memory per "
        "rank (parallel.device_comm = \"{}\")\n",
        world_.size(), transport, format_bytes(cfg_.parallel.staging_bytes(world_.size())),
        cfg_.parallel.device_comm);
  else if (world_.size() > 1)
    out_ << fmt::format("communication: {} ranks over {}\n", world_.size(), transport);
  const ZeroLayout& zl = zero_->zero_layout();
  out_ << fmt::format(
      "zero: stage {} over {} rank{}: {} bucket{}, {} of {} parameters' optimizer "
      "state per rank{}{}{}\n",
      cfg_.zero.stage, grid_->zero().size(), grid_->zero().size() == 1 ? "" : "s",
      zl.buckets.size(), zl.buckets.size() == 1 ? "" : "s",
      cfg_.zero.stage >= 1 ? zl.shard : zl.padded_total, engine_layout().total,
      cfg_.zero.offload_optimizer == "cpu" ? " (on the host)" : "",
      cfg_.zero.offload_params == "cpu" ? ", parameter shard on the host" : "",
      cfg_.zero.overlap_comm && grid_->zero().size() > 1 ? ", communication overlapped" : "");
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

}  // namespace trainer_detail
}  // namespace shardlm
