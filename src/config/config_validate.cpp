// RunConfig::validate(): every range and consistency rule of the configuration, each an
// Error(kConfig) naming the key and the fix, and check_implemented(), the one place that
// rejects values this version cannot run yet. Parsing lives in config.cpp.
#include <cstdint>
#include <initializer_list>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "shardlm/config/config.h"
#include "shardlm/core/check.h"
#include "shardlm/io/records.h"
#include "shardlm/model/nf4_base.h"
#include "shardlm/model/tensor_shard.h"
#include "shardlm/plan/context_layout.h"
#include "shardlm/plan/pipeline.h"

namespace shardlm {
namespace {

template <typename T>
void check_range(bool ok, std::string_view path, std::string_view rule, T value) {
  if (!ok) SHARDLM_FAIL(ErrorKind::kConfig, "{} must be {}, got {}", path, rule, value);
}

void check_one_of(std::string_view path, const std::string& value,
                  std::initializer_list<std::string_view> allowed) {
  for (std::string_view a : allowed)
    if (value == a) return;
  std::string list;
  for (std::string_view a : allowed) list += (list.empty() ? "\"" : ", \"") + std::string(a) + "\"";
  SHARDLM_FAIL(ErrorKind::kConfig, "{} must be one of {}, got \"{}\"", path, list, value);
}

// The features this version's trainer does not have yet, each an error naming the key. The
// keys exist (and validate() checks their values) so that configs, the DeepSpeed mapping and
// the planner can use them already; each check here is removed by the work that implements
// the feature (ZeRO, context, tensor and pipeline parallelism: done).
void check_implemented(const RunConfig& cfg) {
  if (cfg.parallel.tp > 1)
    (void)tp_shard_config(cfg.model, cfg.parallel.tp);  // names the key tp does not divide
  // The partition names parallel.pp and model.n_layers when pp > layers.
  if (cfg.parallel.pp > 1)
    (void)partition_layers(std::vector<double>(size_t(cfg.model.n_layers), 1.0), 0, 0,
                           int(cfg.parallel.pp));
  // Each tp rank quantizes its shard of a projection: the blocks must be the whole model's.
  if (cfg.lora.rank > 0 && cfg.lora.base_dtype == "nf4" && cfg.parallel.tp > 1)
    check_nf4_tp_blocks(cfg.model, cfg.parallel.tp);
}

// Bounds well past any real run, so that token counts (micro_batch * grad_accum * seq_len)
// cannot overflow downstream.
constexpr int64_t kMaxCount = int64_t{1} << 24;

// llama3 and linear rope scaling's factors.
void check_rope_scaling(const RopeScaling& rs) {
  if (rs.type == "linear")
    check_range(rs.factor > 0, "model.rope_scaling.factor", "> 0", rs.factor);
  if (rs.type != "llama3") return;
  check_range(rs.factor >= 1, "model.rope_scaling.factor", ">= 1", rs.factor);
  check_range(rs.low_freq_factor > 0, "model.rope_scaling.low_freq_factor", "> 0",
              rs.low_freq_factor);
  if (!(rs.high_freq_factor > rs.low_freq_factor))
    SHARDLM_FAIL(ErrorKind::kConfig,
                 "model.rope_scaling.high_freq_factor ({}) must be greater than "
                 "model.rope_scaling.low_freq_factor ({})",
                 rs.high_freq_factor, rs.low_freq_factor);
  check_range(rs.original_max_position >= 1, "model.rope_scaling.original_max_position", ">= 1",
              rs.original_max_position);
}

// The data section.
void check_data(const DataConfig& data) {
  if (data.train.empty())
    SHARDLM_FAIL(ErrorKind::kConfig, "data.train is required: the text file to train on");
  check_range(data.valid_fraction >= 0 && data.valid_fraction < 1, "data.valid_fraction",
              "in [0, 1)", data.valid_fraction);
  check_one_of("data.packing", data.packing, {"auto", "samples", "stream"});
  check_one_of("data.overlong", data.overlong, {"truncate", "drop", "error"});
  check_range(data.seq_len >= 2 && data.seq_len <= kMaxCount, "data.seq_len",
              "in [2, 16777216] (a sequence needs an input and a next token)", data.seq_len);
  parse_record_format(data.format, "data.format");
  const std::pair<const char*, const std::string*> names[] = {
      {"data.columns.instruction", &data.columns.instruction},
      {"data.columns.input", &data.columns.input},
      {"data.columns.output", &data.columns.output},
      {"data.columns.system", &data.columns.system},
      {"data.columns.history", &data.columns.history},
      {"data.columns.prompt", &data.columns.prompt},
      {"data.columns.completion", &data.columns.completion},
      {"data.columns.text", &data.columns.text},
      {"data.tags.role", &data.tags.role},
      {"data.tags.content", &data.tags.content},
      {"data.tags.user", &data.tags.user},
      {"data.tags.assistant", &data.tags.assistant},
      {"data.tags.system", &data.tags.system}};
  for (const auto& [key, value] : names)
    if (value->empty())
      SHARDLM_FAIL(ErrorKind::kConfig, "{} must name a record key, not \"\"", key);
}

// How long the run trains: exactly one of epochs and max_steps, unless train.stop says which
// of the two wins.
void check_stop_rule(const TrainConfig& train) {
  if (!train.stop.empty() && train.stop != "epochs" && train.stop != "max_steps")
    SHARDLM_FAIL(ErrorKind::kConfig, "train.stop must be \"epochs\" or \"max_steps\", got \"{}\"",
                 train.stop);
  if (train.epochs > 0 && train.max_steps > 0 && train.stop.empty())
    SHARDLM_FAIL(ErrorKind::kConfig,
                 "train.epochs ({}) and train.max_steps ({}) are both set; set only one of them, "
                 "or say which wins with train.stop = \"epochs\" or \"max_steps\"",
                 train.epochs, train.max_steps);
  if (!train.stop.empty() && (train.stop == "epochs" ? train.epochs : train.max_steps) == 0)
    SHARDLM_FAIL(ErrorKind::kConfig, "train.stop is \"{}\" but train.{} is not set", train.stop,
                 train.stop);
  if (train.epochs == 0 && train.max_steps == 0)
    SHARDLM_FAIL(ErrorKind::kConfig,
                 "set how long to train: train.epochs or train.max_steps (exactly one, > 0)");
}

// The learning-rate schedule, AdamW's hyperparameters and gradient clipping.
void check_optimizer_settings(const TrainConfig& train) {
  check_range(train.lr > 0, "train.lr", "> 0", train.lr);
  check_range(train.min_lr >= 0, "train.min_lr", ">= 0", train.min_lr);
  if (!(train.min_lr <= train.lr))
    SHARDLM_FAIL(ErrorKind::kConfig, "train.min_lr ({}) must not exceed train.lr ({})",
                 train.min_lr, train.lr);
  check_range(train.warmup_steps >= 0, "train.warmup_steps", ">= 0", train.warmup_steps);
  check_range(train.weight_decay >= 0, "train.weight_decay", ">= 0", train.weight_decay);
  check_range(train.beta1 >= 0 && train.beta1 < 1, "train.beta1", "in [0, 1)", train.beta1);
  check_range(train.beta2 >= 0 && train.beta2 < 1, "train.beta2", "in [0, 1)", train.beta2);
  check_range(train.eps > 0, "train.eps", "> 0", train.eps);
  check_range(train.grad_clip >= 0, "train.grad_clip", ">= 0 (0 turns clipping off)",
              train.grad_clip);
}

void check_train(const TrainConfig& train) {
  check_range(train.micro_batch >= 1 && train.micro_batch <= kMaxCount, "train.micro_batch",
              "in [1, 16777216]", train.micro_batch);
  check_range(train.grad_accum >= 1 && train.grad_accum <= kMaxCount, "train.grad_accum",
              "in [1, 16777216]", train.grad_accum);
  check_range(train.epochs >= 0, "train.epochs", ">= 0", train.epochs);
  check_range(train.max_steps >= 0, "train.max_steps", ">= 0", train.max_steps);
  if (train.device != "cpu" && train.device != "cuda" && train.device != "cpu-queued")
    SHARDLM_FAIL(ErrorKind::kConfig,
                 "train.device must be \"cpu\", \"cuda\" or \"cpu-queued\" (the CPU's kernels "
                 "queued as on a GPU, a check for tests), got \"{}\"",
                 train.device);
  check_one_of("train.objective", train.objective, {"sft", "dpo", "simpo"});
  check_one_of("train.dpo.loss_type", train.dpo.loss_type, {"sigmoid", "ipo"});
  check_range(train.dpo.beta > 0, "train.dpo.beta", "> 0", train.dpo.beta);
  check_range(train.dpo.label_smoothing >= 0 && train.dpo.label_smoothing < 0.5,
              "train.dpo.label_smoothing", "in [0, 0.5)", train.dpo.label_smoothing);
  if (train.dpo.label_smoothing > 0 && train.dpo.loss_type != "sigmoid")
    SHARDLM_FAIL(ErrorKind::kConfig,
                 "train.dpo.label_smoothing applies to train.dpo.loss_type = \"sigmoid\" "
                 "(conservative DPO), not \"{}\"",
                 train.dpo.loss_type);
  check_range(train.simpo.beta > 0, "train.simpo.beta", "> 0", train.simpo.beta);
  if (train.attention != "auto" && train.attention != "cudnn" && train.attention != "own")
    SHARDLM_FAIL(ErrorKind::kConfig,
                 "train.attention must be \"auto\", \"cudnn\" or \"own\", got \"{}\"",
                 train.attention);
  check_stop_rule(train);
  check_optimizer_settings(train);
  check_range(train.eval_every >= 0, "train.eval_every", ">= 0", train.eval_every);
  check_range(train.eval_batches >= 0, "train.eval_batches", ">= 0", train.eval_batches);
  if (train.resume.empty())
    SHARDLM_FAIL(ErrorKind::kConfig,
                 "train.resume must be \"auto\", \"none\" or a checkpoint directory");
  check_range(train.max_bad_steps >= 1, "train.max_bad_steps", ">= 1", train.max_bad_steps);
}

void check_checkpoint_and_precision(const CheckpointConfig& checkpoint,
                                    const PrecisionConfig& precision) {
  check_range(checkpoint.every_steps >= 0, "checkpoint.every_steps", ">= 0 (0 = only at the end)",
              checkpoint.every_steps);
  check_range(checkpoint.keep_last >= 0, "checkpoint.keep_last", ">= 0 (0 = keep all)",
              checkpoint.keep_last);
  check_range(checkpoint.async_snapshot_gib >= 0, "checkpoint.async_snapshot_gib",
              ">= 0 (0 = the rank's whole share)", checkpoint.async_snapshot_gib);
  check_one_of("checkpoint.on_save_error", checkpoint.on_save_error, {"stop", "continue"});

  if (precision.param != "fp32" && precision.param != "bf16")
    SHARDLM_FAIL(ErrorKind::kConfig, "precision.param must be \"fp32\" or \"bf16\", got \"{}\"",
                 precision.param);
  if (precision.activations != "auto" && precision.activations != "fp32" &&
      precision.activations != "bf16")
    SHARDLM_FAIL(ErrorKind::kConfig,
                 "precision.activations must be \"auto\" (as precision.param), \"fp32\" or "
                 "\"bf16\", got \"{}\"",
                 precision.activations);
}

// The parallel sizes and the context-parallel kind; under cp > 1, also that the sequence and
// the heads split as the kind needs (make_context_layout names the key that does not divide).
void check_parallel(const RunConfig& cfg) {
  const ParallelConfig& parallel = cfg.parallel;
  check_range(parallel.tp >= 1 && parallel.tp <= kMaxCount, "parallel.tp", "in [1, 16777216]",
              parallel.tp);
  check_range(parallel.pp >= 1 && parallel.pp <= kMaxCount, "parallel.pp", "in [1, 16777216]",
              parallel.pp);
  check_range(parallel.cp >= 1 && parallel.cp <= kMaxCount, "parallel.cp", "in [1, 16777216]",
              parallel.cp);
  check_one_of("parallel.cp_kind", parallel.cp_kind, {"ulysses", "ring", "hybrid"});
  check_one_of("parallel.device_comm", parallel.device_comm, {"nccl", "host", "mpi"});
  // A slot (1/8 of the buffer) must hold a chunk of every op: all_to_all's 2 x ranks pieces.
  check_range(
      parallel.device_comm_staging_kib >= 1 && parallel.device_comm_staging_kib <= (1 << 22),
      "parallel.device_comm_staging_kib", "in [1, 4194304] (KiB of host memory per rank)",
      parallel.device_comm_staging_kib);
  check_range(parallel.cp_ulysses >= 0, "parallel.cp_ulysses", ">= 0 (0 = auto)",
              parallel.cp_ulysses);
  if (parallel.cp_ulysses > 0 && parallel.cp_kind != "hybrid")
    SHARDLM_FAIL(ErrorKind::kConfig,
                 "parallel.cp_ulysses ({}) only applies to parallel.cp_kind \"hybrid\" (got "
                 "\"{}\"); remove it, or set parallel.cp_kind = \"hybrid\"",
                 parallel.cp_ulysses, parallel.cp_kind);
  if (parallel.cp_keep_gathered && parallel.cp_kind == "ring")
    SHARDLM_FAIL(ErrorKind::kConfig,
                 "parallel.cp_keep_gathered keeps the all-to-all's gathered q, k, v, and "
                 "parallel.cp_kind \"ring\" has no all-to-all; remove it, or set parallel.cp_kind "
                 "= \"ulysses\" or \"hybrid\"");
  if (parallel.cp_ulysses > 0 && parallel.cp % parallel.cp_ulysses != 0)
    SHARDLM_FAIL(ErrorKind::kConfig,
                 "parallel.cp_ulysses ({}) must divide parallel.cp ({}): the hybrid runs "
                 "all-to-all inside groups of cp_ulysses ranks and a ring across them",
                 parallel.cp_ulysses, parallel.cp);
  if (parallel.cp > 1)  // the sequence split and the heads' split (of a tp rank's heads)
    make_context_layout(tp_shard_config(cfg.model, parallel.tp), cfg.data.seq_len, int(parallel.cp),
                        parse_cp_kind(parallel.cp_kind), parallel.cp_ulysses);
}

// The ZeRO stage, its offloads (parameters on the host need stage 3 and the optimizer there
// too), its buckets and the reductions' wire format.
void check_zero(const ZeroConfig& zero) {
  check_range(zero.stage >= 0 && zero.stage <= 3, "zero.stage", "0, 1, 2 or 3", zero.stage);
  check_one_of("zero.offload_optimizer", zero.offload_optimizer, {"none", "cpu"});
  check_one_of("zero.offload_params", zero.offload_params, {"none", "cpu"});
  if (zero.offload_params != "none" && zero.stage != 3)
    SHARDLM_FAIL(ErrorKind::kConfig,
                 "zero.offload_params \"{}\" requires zero.stage = 3 (got {}): only stage 3 "
                 "shards the parameters, so only it can keep them on the host; set zero.stage = "
                 "3 or zero.offload_params = \"none\"",
                 zero.offload_params, zero.stage);
  if (zero.offload_params != "none" && zero.offload_optimizer == "none")
    SHARDLM_FAIL(ErrorKind::kConfig,
                 "zero.offload_params \"{}\" requires zero.offload_optimizer = \"cpu\": the "
                 "optimizer updates the parameter shard where it lives, on the host; set "
                 "zero.offload_optimizer = \"cpu\" or zero.offload_params = \"none\"",
                 zero.offload_params);
  check_range(zero.reduce_bucket_bytes >= 1, "zero.reduce_bucket_bytes", ">= 1",
              zero.reduce_bucket_bytes);
  check_range(zero.allgather_bucket_bytes >= 1, "zero.allgather_bucket_bytes", ">= 1",
              zero.allgather_bucket_bytes);
  check_range(zero.prefetch_layers >= 0, "zero.prefetch_layers", ">= 0 (0 = no prefetch)",
              zero.prefetch_layers);
  // "f32" is the name this key took first; "fp32" matches precision.param.
  check_one_of("zero.reduce_dtype", zero.reduce_dtype, {"fp32", "bf16", "f32"});
  if (zero.reduce_dtype == "bf16" && zero.stage < 2)
    SHARDLM_FAIL(ErrorKind::kConfig,
                 "zero.reduce_dtype \"{}\" requires zero.stage >= 2 (got {}): stages 0 and 1 "
                 "reduce the replicated f32 gradients in place, only the bucket buffers of "
                 "stages 2 and 3 have a send buffer to round; set zero.stage = 2 or 3 or "
                 "zero.reduce_dtype = \"fp32\"",
                 zero.reduce_dtype, zero.stage);
}

void check_memory(const MemoryConfig& memory) {
  check_one_of("memory.checkpointing", memory.checkpointing, {"none", "selective", "full"});
  if (memory.offload_checkpoints.any() && memory.checkpointing == "none")
    SHARDLM_FAIL(ErrorKind::kConfig,
                 "memory.offload_checkpoints = {} requires memory.checkpointing = \"selective\" "
                 "or \"full\" (got \"none\"): without checkpointing every layer keeps all its "
                 "activations and none are offloaded; set memory.checkpointing or "
                 "memory.offload_checkpoints = false",
                 nlohmann::json(memory.offload_checkpoints).dump());
  check_range(memory.checkpoint_every >= 1, "memory.checkpoint_every", ">= 1",
              memory.checkpoint_every);
  if (memory.checkpoint_every > 1 && memory.checkpointing != "full")
    SHARDLM_FAIL(ErrorKind::kConfig,
                 "memory.checkpoint_every = {} requires memory.checkpointing = \"full\" (got "
                 "\"{}\"): only a layer that keeps its input alone can be recomputed from the "
                 "layer before's; set memory.checkpointing = \"full\" or "
                 "memory.checkpoint_every = 1",
                 memory.checkpoint_every, memory.checkpointing);
  check_range(memory.loss_chunk_tokens >= 1, "memory.loss_chunk_tokens", ">= 1",
              memory.loss_chunk_tokens);
  check_range(memory.mlp_chunk_tokens >= 1, "memory.mlp_chunk_tokens", ">= 1",
              memory.mlp_chunk_tokens);
  check_range(memory.budget_gib >= 0, "memory.budget_gib", ">= 0 (0 = no cap)", memory.budget_gib);
}

void check_log_and_sample(const LogConfig& log, const SampleConfig& sample) {
  if (log.dir.empty())
    SHARDLM_FAIL(ErrorKind::kConfig, "log.dir must not be empty: the run directory to write");
  check_range(log.every_steps >= 1, "log.every_steps", ">= 1", log.every_steps);

  check_range(sample.max_new_tokens >= 0, "sample.max_new_tokens", ">= 0", sample.max_new_tokens);
  check_range(sample.temperature >= 0, "sample.temperature", ">= 0 (0 = greedy)",
              sample.temperature);
  check_range(sample.top_k >= 0, "sample.top_k", ">= 0 (0 = all tokens)", sample.top_k);
  check_range(sample.top_p > 0 && sample.top_p <= 1, "sample.top_p", "in (0, 1] (1 = off)",
              sample.top_p);
  check_range(sample.count >= 0, "sample.count", ">= 0", sample.count);
}

// The end-of-run sample reads the final checkpoint: no rank gathers the model to sample.
void check_sample_source(const SampleConfig& sample, const CheckpointConfig& checkpoint) {
  if (sample.at_end() && !checkpoint.at_end)
    SHARDLM_FAIL(ErrorKind::kConfig,
                 "sample.prompt is set (sample.count = {}) with checkpoint.at_end = false: the "
                 "end-of-run sample reads the final checkpoint; set checkpoint.at_end = true, or "
                 "sample.count = 0 and sample later with `shardlm generate` on a checkpoint",
                 sample.count);
}

// lora.base_dtype: the frozen base's storage. bf16 and fp32 name precision.param's dtype (the
// base's dense dtype), nf4 quantizes the decoder projections.
void check_lora_base(const LoraRunConfig& lora, const PrecisionConfig& precision) {
  const std::string& b = lora.base_dtype;
  if (b != "auto" && b != "nf4" && b != "bf16" && b != "fp32")
    SHARDLM_FAIL(ErrorKind::kConfig,
                 "lora.base_dtype = '{}' is not a base dtype; use auto (precision.param's), nf4 "
                 "(QLoRA's 4-bit base), bf16 or fp32",
                 b);
  if (b != "auto" && lora.rank == 0)
    SHARDLM_FAIL(ErrorKind::kConfig,
                 "lora.base_dtype = {} needs lora.rank > 0: only a frozen LoRA base takes a "
                 "storage dtype of its own; set lora.rank or lora.base_dtype = auto",
                 b);
  if ((b == "bf16" || b == "fp32") && b != precision.param)
    SHARDLM_FAIL(ErrorKind::kConfig,
                 "lora.base_dtype = {} disagrees with precision.param = {}: the base is stored "
                 "in the parameter dtype; set precision.param = {} (or lora.base_dtype = auto)",
                 b, precision.param, b);
}

void check_lora(const LoraRunConfig& lora) {
  check_range(lora.rank >= 0, "lora.rank", ">= 0 (0 = no adapters)", lora.rank);
  check_range(lora.alpha > 0, "lora.alpha", "> 0 (the update is scaled by lora.alpha / lora.rank)",
              lora.alpha);
  check_range(lora.dropout >= 0 && lora.dropout < 1, "lora.dropout", "in [0, 1)", lora.dropout);
  if (lora.rank > 0 && lora_targets_from_string(lora.targets) == 0)
    SHARDLM_FAIL(ErrorKind::kConfig,
                 "lora.targets is empty with lora.rank = {}: name the projections to adapt, e.g. "
                 "\"q,v\" or \"q,k,v,o,gate,up,down\"",
                 lora.rank);
  if (lora.rank > 0) (void)lora_targets_from_string(lora.targets);
  if (lora.offload_base && lora.rank == 0)
    SHARDLM_FAIL(ErrorKind::kConfig,
                 "lora.offload_base = true needs lora.rank > 0: only a frozen LoRA base is kept in "
                 "host memory (full fine-tuning offloads through zero.offload_params); set "
                 "lora.rank or lora.offload_base = false");
}

// Sequence parallelism splits the residual stream's rows of a micro-batch (of a cp rank's part
// of the sequence) into parallel.tp blocks, so tp must divide them.
void check_sequence_parallel_rows(const RunConfig& cfg) {
  const ParallelConfig& parallel = cfg.parallel;
  if (!parallel.sequence_parallel || parallel.tp <= 1) return;
  const int64_t rows = cfg.train.micro_batch * (cfg.data.seq_len / parallel.cp);
  if (rows % parallel.tp != 0)
    SHARDLM_FAIL(ErrorKind::kConfig,
                 "parallel.sequence_parallel splits each micro-batch's train.micro_batch x "
                 "data.seq_len / parallel.cp = {} x {} / {} = {} rows across parallel.tp = {} "
                 "ranks, which does not divide them; make train.micro_batch or data.seq_len a "
                 "multiple of parallel.tp, or set parallel.sequence_parallel = false",
                 cfg.train.micro_batch, cfg.data.seq_len, parallel.cp, rows, parallel.tp);
}

}  // namespace

void RunConfig::validate() const {
  model.validate();
  check_rope_scaling(model.rope_scaling);
  check_data(data);
  check_train(train);
  check_checkpoint_and_precision(checkpoint, precision);
  check_parallel(*this);
  check_zero(zero);
  check_memory(memory);
  check_log_and_sample(log, sample);
  check_sample_source(sample, checkpoint);
  check_lora(lora);
  check_lora_base(lora, precision);
  check_implemented(*this);
  check_sequence_parallel_rows(*this);
}

LoraConfig RunConfig::lora_config() const {
  LoraConfig l;
  if (lora.rank <= 0) return l;
  l.rank = lora.rank;
  l.alpha = lora.alpha;
  l.dropout = lora.dropout;
  l.targets = lora_targets_from_string(lora.targets);
  l.offload_base = lora.offload_base;
  l.nf4_base = lora.base_dtype == "nf4";
  l.prefetch_base = zero.prefetch_layers >= 1;
  return l;
}

}  // namespace shardlm
