// Private to src/train: the TrainRun class that train() and dry_run() build, shared by the
// files that implement it (setup, the step loop, checkpoints, reports). Declarations and a clock
// helper only; nothing outside src/train may include this header.
#pragma once

#include <chrono>
#include <cmath>
#include <csignal>
#include <deque>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <ostream>
#include <string>
#include <utility>
#include <vector>

#include "comm_staging.h"
#include "io/tensorboard_writer.h"
#include "preference.h"
#include "preference_eval.h"
#include "preference_reference.h"
#include "run_files.h"
#include "shardlm/backend/profiling.h"
#include "shardlm/checkpoint/checkpoint.h"
#include "shardlm/checkpoint/model_io.h"
#include "shardlm/comm/communicator.h"
#include "shardlm/io/tokenize.h"
#include "shardlm/model/nf4_base.h"
#include "shardlm/model/sharded_base.h"
#include "shardlm/model/tensor_shard.h"
#include "shardlm/parallel/context.h"
#include "shardlm/parallel/grid.h"
#include "shardlm/parallel/pipeline.h"
#include "shardlm/parallel/tensor.h"
#include "shardlm/parallel/zero.h"
#include "shardlm/plan/plan.h"
#include "shardlm/train/data.h"
#include "shardlm/train/trainer.h"
#include "state_shards.h"
#include "step_runner.h"

namespace shardlm::trainer_detail {

using Clock = std::chrono::steady_clock;
using json = nlohmann::json;
namespace fs = std::filesystem;

inline double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// One training run's state; train() builds it and calls run().
class TrainRun {
 public:
  TrainRun(const RunConfig& cfg, std::ostream& out, const volatile std::sig_atomic_t* stop,
           Communicator& world)
      : cfg_(cfg), out_(world.rank() == 0 ? out : null_out_), stop_(stop), world_(world) {}
  TrainResult run();
  DryRunResult dry_run();
  // `shardlm dpo-reference`: setup, then the reference table of full fine-tuning DPO computed
  // (or found current) and kept in the run directory; returns the file's path.
  std::string dpo_reference();

 private:
  // The step loop's state that lives across steps.
  struct LoopState {
    int64_t order_epoch = -1;  // the epoch epoch_order_ holds
    int64_t allocs_after_warmup = -1;
    int64_t bad_streak = 0;  // consecutive non-finite steps
    double last_eval = std::nan("");
  };
  // What one step measured, for its metrics line and progress line.
  struct StepLog {
    int64_t step = 0, epoch = 0;  // step 1-based, epoch 0-based
    double loss = std::nan(""), lr = 0, grad_norm = std::nan("");
    double step_s = 0, comm_wait_s = 0, tokens_per_s = 0, mfu = 0;
    int64_t host_waits = -1;  // the host's waits for the device in the step; -1: not counted
    // The host's waits for a collective the device runs (NCCL), besides; -1: host transports.
    int64_t comm_host_waits = -1;
    bool eval = false;
    double eval_loss = std::nan("");
    PreferenceEval eval_preference;  // a preference objective's: the held-out pairs' sums
    PipelineStats pipeline;
    CpStats cp;
    int64_t preference_pairs = 0;  // a preference objective's: the step's pairs and metric sums
    PreferenceSums preference;
  };

  // setup()'s stages, in order.
  void setup();
  void make_run_backend();
  void load_tokenizer_and_shapes();
  std::optional<ContextLayout> build_grid();
  void plan_and_open_data();
  void check_objective_data() const;
  // The host bytes of the data sets, their sources (once each), the epoch's window order and
  // full fine-tuning DPO's reference tables: planned from their sizes (plan.h), and held (their
  // containers').
  int64_t planned_data_host_bytes() const;
  int64_t held_data_host_bytes() const;
  // train.objective is a preference objective (dpo, simpo: preference.h).
  bool preference() const { return cfg_.train.objective != "sft"; }
  // Full fine-tuning DPO: the reference is a table of the initial weights' sums
  // (preference_reference.h; train_dpo_reference.cpp).
  bool reference_table() const { return cfg_.train.objective == "dpo" && cfg_.lora.rank == 0; }
  // order: the set's windows in order (0, 1, ...), as the pass reads them; rows: the set's
  // table's key_rows.
  nlohmann::json dpo_reference_key(Dataset& set, const std::vector<int64_t>& order,
                                   std::span<int32_t> rows);
  // Collective: the table read from the run directory when its key is this run's, else
  // computed from the weights the model holds (the initial ones: before any resume) and written.
  // refuse_stale: a run that will resume from a checkpoint refuses a table of another key, since
  // its steps were taken against that table. The held-out set's table (evaluation) likewise,
  // in a file of its own, never refused.
  void prepare_dpo_reference(bool refuse_stale);
  void prepare_reference_table(Dataset& set, const std::vector<int64_t>& order,
                               ReferenceTable& table, const fs::path& path, bool refuse_stale,
                               std::string_view what);
  // The held-out set's loss and metrics under a preference objective (preference_eval.h),
  // summed over the world with each pair counted once.
  PreferenceEval evaluate_preference_set();
  void build_engine_and_model(const std::optional<ContextLayout>& cp_layout);
  void init_weights();
  void schedule_steps();
  void print_model_setup();
  void print_run_setup();
  // run()'s pieces: one step (true when a stop request ends the run), and what it logs,
  // guards, checkpoints and reports.
  TrainResult nothing_to_do();
  MetricsLog open_metrics();
  // log.tensorboard on rank 0: the event writer, with the resolved config and the plan written
  // at the run's first step.
  void open_tensorboard();
  // The progress line's "12/40 (30%) | 0:41 elapsed, ETA 1:36": elapsed since the run started,
  // the rest from the mean of the last steps' wall time (evaluations and saves included).
  std::string progress_text(int64_t step);
  int64_t rows_per_step() const;
  bool train_step(LoopState& loop, TrainResult& result, MetricsLog& metrics);
  bool guard_nonfinite(const StepLog& log, LoopState& loop, MetricsLog& metrics);
  void log_step(const StepLog& log, MetricsLog& metrics);
  void add_pipeline_columns(const PipelineStats& st, json& line);
  bool stop_or_checkpoint(int64_t step, TrainResult& result);
  json write_memory_report();  // memory_rank<r>.json; returns what it wrote
  void write_summary(const TrainResult& result, const LoopState& loop, double wall_s);
  json profile_report();
  // The end of a run: the training buffers freed (no collective follows), then on rank 0 the
  // samples from the final checkpoint's whole model, in a ledger of their own measured against
  // sampler_plan_ (added to rank 0's memory report).
  void release_training_state();
  void sample_from_final_checkpoint(json& memory_report);
  void print_samples(LlamaModel& sampler);
  // The run's state read from `checkpoint` (choose_checkpoint's; "" for none: nothing read).
  void resume_from(const std::string& checkpoint);
  // resume_from()'s pieces: the checks that a checkpoint belongs to this run (each an
  // Error naming what differs), then its state read into the engine and the loop.
  void check_resumed_lora(const CheckpointReader& ckpt, const StoredModel& stored) const;
  void check_resumed_data(const CheckpointReader& ckpt, const json& state) const;
  void load_resumed_state(const CheckpointReader& ckpt);
  void restore_progress(const json& state);
  // Collective: the checkpoint train.resume names ("" for none), verified by all ranks.
  std::string choose_checkpoint(const std::string& checkpoints_dir);
  // Collective: every rank writes its share of the state vectors; rank 0 commits.
  void save_checkpoint(int64_t step);
  // A periodic save (synchronous or started in the background), skipped when a rank's disk
  // lacks the space its share needs; its failure stops the run or, under
  // checkpoint.on_save_error = "continue", is reported and training goes on.
  void periodic_checkpoint(int64_t step);
  // Runs `save` (collective); a failed save's error gains the disk's free space and what a
  // save needs, and is thrown again unless `may_continue` and on_save_error = "continue".
  void guard_save(int64_t step, bool may_continue, const std::function<void()>& save);
  // Collective: whether every rank's disk has the space for its share of a save (false: a
  // line says which rank lacks how much, and when the next save comes).
  bool checkpoint_space_fits(int64_t step);
  int64_t checkpoint_bytes_of_rank(int64_t step) const;   // what this rank writes in a save
  std::string checkpoint_space_text(int64_t step) const;  // "DIR has X free; a save needs Y"
  json checkpoint_state_json(int64_t step) const;         // state.json
  int64_t state_vector_bytes() const;                     // of all the state vectors together
  // What this rank writes of the state vectors, and the grid recorded in the manifest.
  StateShardSpec state_shard_spec() const;
  json checkpoint_layout_json() const;
  // checkpoint.async: the rank's shares copied into snapshot_, then written by a background
  // thread (AsyncSave) while training goes on. MPI stays on this thread: start makes the
  // temporary directory (collective), poll commits at a step boundary once one collective says
  // every rank's files are durable, finish waits for them and commits (a next save, the end of
  // the run and a stop call it). All three are collective.
  void start_async_checkpoint(int64_t step);
  void poll_async_checkpoint();
  void finish_async_checkpoint();
  void commit_async_checkpoint();
  void allocate_checkpoint_snapshot();
  // The save step's part of an asynchronous save: the vectors past the snapshot's budget
  // written, the others copied into snapshot_; returns where each is.
  std::vector<SnapshotVector> snapshot_state(AsyncSave& save);
  // Whether the engine's arena is the checkpoint vectors' order itself (tp = pp = 1).
  bool state_in_whole_order() const { return engine_pieces().empty(); }
  // Whether the model's NF4 base is sharded over the ZeRO group (nf4_base_sharded).
  bool nf4_sharded() const {
    return nf4_base_sharded(lora_.nf4_base, int(cfg_.zero.stage), grid_->zero().size());
  }
  // Whether the model's frozen LoRA base (dense or NF4) is sharded over the ZeRO group.
  bool base_sharded() const {
    return lora_.enabled() && lora_base_sharded(int(cfg_.zero.stage), grid_->zero().size());
  }
  // The pieces of the whole checkpoint vectors coordinate (stage, tp_rank) holds, by its
  // arena offset: of the model, or with LoRA of the adapters.
  std::vector<ShardPiece> coordinate_pieces(int64_t stage, int64_t tp_rank) const;
  // The parts of the engine's arena this rank's (stage, tp shard) writes, with their places
  // in the whole vectors (by arena offset); a tensor held by several coordinates (norms and
  // replicated adapter halves under tp, tied embeddings under pp) goes to the first of them.
  std::vector<ShardPiece> checkpoint_pieces() const;
  void write_reports(int64_t step);
  // load_state has every rank read its pieces of a checkpoint vector (params, Adam m, v,
  // master; in the whole model's arena order, whatever the grid) from `source`, and nothing else.
  void load_state(ZeroEngine::State s,
                  const std::function<void(int64_t begin, int64_t count, void* dst)>& source);
  // Unit u of the whole model's f32 values -> this rank's shard of it (tensor parallelism):
  // of the model, or of the adapters (whole_layout: whole_layout_ or whole_lora_layout_).
  void slice_unit(int u, const float* whole, float* shard) const {
    slice_unit(whole_layout_, layout_, tp_pieces_, u, whole, shard);
  }
  static void slice_unit(const ParamLayout& whole_layout, const ParamLayout& shard_layout,
                         const std::vector<ShardPiece>& pieces, int u, const float* whole,
                         float* shard);
  void log_line(const std::string& line, bool keep);
  std::unique_ptr<TensorBoardWriter> tb_;  // rank 0 with log.tensorboard
  Clock::time_point run_started_{};
  std::deque<std::pair<int64_t, Clock::time_point>> step_ends_;  // logged steps' ends (ETA)

  bool stop_requested();  // agreed by every rank

  const RunConfig& cfg_;
  std::ostream null_out_{nullptr};  // ranks other than 0 print nothing
  std::ostream& out_;
  std::string data_files_log_;  // what tokenizing record files in memory said (print_run_setup)
  const volatile std::sig_atomic_t* stop_;
  Communicator& world_;  // every rank: dp x pp x cp x tp
  // Every group of the grid (cp, tp, pp, ZeRO's dp x cp, tied) and its f64/i64 reductions;
  // the sizes and this rank's coordinates below are the grid's, kept at hand.
  std::unique_ptr<ParallelGrid> grid_;
  int64_t dp_size_ = 1, dp_rank_ = 0;  // data-parallel replicas: who reads which rows
  int64_t tp_ = 1, tp_rank_ = 0;
  std::unique_ptr<TensorParallel> tp_seam_;  // the model's seam over the tp group (tp > 1)
  // Pipeline parallelism (pp > 1): this rank's stage and the layers of every stage (the
  // executor, pipe_, is declared after the backend it allocates from).
  int64_t pp_ = 1, pp_rank_ = 0;
  StagePartition partition_;
  ModelConfig shard_model_;   // this rank's stage of its tp shard of cfg_.model (cfg_.model at
                              // tp = pp = 1)
  ParamLayout whole_layout_;  // the whole model's arena: checkpoints, init, export
  // This rank's stage and tp shard within whole_layout_ (empty at tp = pp = 1).
  std::vector<ShardPiece> tp_pieces_;
  // Elements of the hidden state a pipeline stage sends per micro-batch: its rows of the
  // micro-batch (1/tp of them under sequence parallelism) x dim.
  // What a step runner or the evaluation reads of the run, over `set` in steps of
  // `micro_batches` micro-batches.
  StepParts step_parts(Dataset& set, int64_t micro_batches) {
    return {*model_,
            cp_.get(),
            set,
            *backend_,
            input_staging_,
            B_,
            T_,
            Tl_,
            micro_batches,
            uint64_t(cfg_.train.seed),
            cp_ ? &grid_->group(Axis::kCp) : nullptr};
  }
  int64_t stage_output_elems() const {
    return B_ * Tl_ / shard_model_.seq_shards() * shard_model_.dim;
  }
  bool lead_ = true;  // rank 0: prints, writes run files and checkpoints
  bool interactive_ = false;
  fs::path dir_;

  std::unique_ptr<Backend> backend_;
  std::string attention_impl_;  // the start-up words of train.attention's choice
  ProfilingBackend* profiler_ = nullptr;
  MemoryLedger ledger_;
  // parallel.device_comm = "host": world_'s device copies and staging buffer (after the backend
  // and the ledger, so it goes first; before the users of world_'s splits, so it goes last).
  std::unique_ptr<CommStaging> comm_staging_;
  std::unique_ptr<Tokenizer> tok_;  // data.tokenizer: text inputs, sampling, model.json
  std::unique_ptr<Dataset> train_set_, valid_set_;
  std::vector<int64_t> epoch_order_;  // [training windows] the current epoch's window order
  // [held-out windows] 0, 1, ...: the evaluation's window order (and the held-out reference
  // pass's), held for the run so that the ledger counts it under data.
  std::vector<int64_t> eval_order_;
  ParamLayout layout_;      // the model's, for the engine (which keeps a reference)
  LoraConfig lora_;         // lora.*: rank 0 = full fine-tuning
  LoraLayout lora_layout_;  // with LoRA, the engine's arena: this rank's adapters
  // The whole model's adapters (checkpoints, init, export), and this rank's pieces of them within
  // that arena: its stage's units (pp > 1), each split with its base projection (tp > 1); empty
  // on one rank.
  LoraLayout whole_lora_layout_;
  std::vector<ShardPiece> lora_pieces_;
  // The checkpoint arena of what the engine holds: the model's (a pipeline stage's pieces
  // apart), or with LoRA the adapters'; and this rank's pieces of it (tp or pp > 1).
  const ParamLayout& whole_engine_layout() const {
    return lora_.enabled() ? whole_lora_layout_.params : whole_layout_;
  }
  const std::vector<ShardPiece>& engine_pieces() const {
    return lora_.enabled() ? lora_pieces_ : tp_pieces_;
  }
  // What the ZeRO engine holds: the model, or with LoRA the adapters (the base is frozen and
  // replicated in the model's own parameters-only store).
  const ParamLayout& engine_layout() const {
    return lora_.enabled() ? lora_layout_.params : layout_;
  }
  // Bytes per element of one of the engine's state vectors: the model's parameters in the
  // parameter dtype; the adapters, Adam's moments and the master weights in f32.
  size_t state_elem_bytes(ZeroEngine::State s) const {
    return s == ZeroEngine::State::kParams && !lora_.enabled()
               ? dtype_size(model_->options().param_dtype)
               : 4;
  }
  StoredLoraBase lora_base() const;
  std::unique_ptr<Backend> host_backend_;    // offloaded optimizer state (unprofiled)
  std::unique_ptr<GradientAxes> grad_axes_;  // the other axes' gradient sums and norm rules
  std::unique_ptr<ZeroEngine> zero_;         // parameters, gradients, optimizer state
  std::unique_ptr<ContextParallel> cp_;      // the sequence split (cp > 1), the model's attention
  std::unique_ptr<LlamaModel> model_;
  std::unique_ptr<PipelineExecutor> pipe_;  // pp > 1: runs the stage's schedule (its buffers)
  std::unique_ptr<StepRunner> runner_;      // the step's schedule over its micro-batches
  // Full fine-tuning DPO: the reference sums the runner reads, and a CRC-32 of the initial
  // weights' f32 values as init_weights() set them (part of the table's key).
  std::unique_ptr<ReferenceTable> reference_table_;
  std::unique_ptr<ReferenceTable> valid_reference_table_;  // the held-out set's (evaluation)
  // A preference objective's evaluation rows (full fine-tuning DPO's reference passes use them
  // before the first step).
  std::unique_ptr<PreferenceEvalRows> eval_rows_;
  // Host memory held in containers, charged to the ledger for the run: the data (data sets,
  // sources, reference tables; category data) and a preference objective's host rows (the
  // runner's and the evaluation's; activations).
  LedgerCharge data_charge_, preference_charge_;
  uint32_t initial_weights_crc_ = 0;
  MemoryPlan plan_;
  std::optional<MemoryPlan> sampler_plan_;    // the end-of-run sample's (sample.at_end())
  CheckpointPlacement checkpoint_placement_;  // as the plan placed them
  double peak_flops_ = 0;  // MFU's denominator: the GEMM rate measured at setup, in peak_dtype_
  DType peak_dtype_ = DType::kF32;
  InputStaging input_staging_;  // a micro-batch's inputs on the host and their upload slots

  int64_t B_ = 0, T_ = 0, accum_ = 0;
  int64_t Tl_ = 0;  // tokens of each row this rank holds: T_ / cp
  int64_t steps_per_epoch_ = 0, total_steps_ = 0;
  int64_t step_ = 0;  // steps completed
  int64_t tokens_seen_ = 0;
  std::vector<int64_t> tokens_per_epoch_;
  std::vector<std::pair<double, double>> loss_points_, eval_points_;  // (tokens, loss)
  std::string last_checkpoint_;
  // checkpoint.async: the rank's share of the state vectors that fit
  // checkpoint.async_snapshot_gib (host pool, pinned where the backend pins; planned), and the
  // save being written from it (destroyed first: its thread reads the snapshot).
  Buffer snapshot_;
  std::unique_ptr<AsyncSave> inflight_;
};

}  // namespace shardlm::trainer_detail
