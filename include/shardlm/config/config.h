// RunConfig: everything a training run is told, grouped by the JSON config's sections.
// Loading validates every key: unknown keys and wrong types are Error(kConfig) naming the key
// (and the nearest valid key); values are range-checked with the fix in the message.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "shardlm/core/dtype.h"
#include "shardlm/io/records.h"
#include "shardlm/model/config.h"
#include "shardlm/model/lora.h"

namespace shardlm {

struct DataConfig {
  std::string train;             // data.train: UTF-8 text file (byte-level tokens)
  std::string valid;             // data.valid: held-out text file ("" = split off train)
  double valid_fraction = 0.05;  // data.valid_fraction: tail of train held out when no valid
  int64_t seq_len = 256;         // data.seq_len
  // data.tokenizer: "byte", a tokenizer file or a directory holding one (load_tokenizer; paths
  // as given, from the working directory); "" = model.hf_dir's tokenizer when it has one
  // (find_tokenizer), else "byte".
  std::string tokenizer;
  // data.packing: how documents become windows of seq_len tokens (train/data.h): "samples"
  // (whole documents, best-fit decreasing), "stream" (the token stream cut every seq_len
  // tokens) or "auto" (samples for data with a loss mask: chat and instruction records).
  std::string packing = "auto";
  // data.overlong: a document longer than seq_len under "samples": "truncate", "drop", "error".
  std::string overlong = "truncate";
  // How .jsonl / .json data files are read (records.h): data.format (a RecordFormat name),
  // data.columns.*, data.tags.*, data.skip_bad_records.
  std::string format = "auto";
  RecordColumns columns;
  RecordTags tags;
  bool skip_bad_records = false;
};

// train.dpo.*: DPO's loss (TRL's DPOConfig names).
struct DpoConfig {
  double beta = 0.1;                  // train.dpo.beta: the strength of the reference's pull
  std::string loss_type = "sigmoid";  // train.dpo.loss_type: "sigmoid" (DPO) | "ipo"
  double label_smoothing = 0.0;       // train.dpo.label_smoothing: cDPO's label noise, [0, 0.5)
};

// train.simpo.*: SimPO's loss (TRL's CPOConfig with loss_type "simpo" and cpo_alpha 0).
struct SimpoConfig {
  double beta = 0.1;   // train.simpo.beta: the scale of the length-averaged log-probabilities
  double gamma = 0.5;  // train.simpo.gamma: the target reward margin (TRL's simpo_gamma)
};

struct TrainConfig {
  // train.objective: "sft" (next-token cross-entropy) | "dpo" | "simpo" (preference pairs)
  std::string objective = "sft";
  DpoConfig dpo;
  SimpoConfig simpo;
  int64_t micro_batch = 8;       // train.micro_batch: sequences per micro-batch
  int64_t grad_accum = 1;        // train.grad_accum: micro-batches per optimizer step
  int64_t epochs = 0;            // train.epochs (0 = use max_steps)
  int64_t max_steps = 0;         // train.max_steps (0 = use epochs)
  double lr = 3e-3;              // train.lr: peak learning rate
  double min_lr = 3e-4;          // train.min_lr: floor of the cosine decay
  int64_t warmup_steps = 20;     // train.warmup_steps: linear warmup from 0
  double weight_decay = 0.1;     // train.weight_decay: on matrices only (not norms, biases)
  double beta1 = 0.9;            // train.beta1
  double beta2 = 0.95;           // train.beta2
  double eps = 1e-8;             // train.eps
  double grad_clip = 1.0;        // train.grad_clip: global L2 norm (0 = off)
  uint64_t seed = 1234;          // train.seed: weights init and data order
  int64_t eval_every = 50;       // train.eval_every: steps between evaluations (0 = only at end)
  int64_t eval_batches = 8;      // train.eval_batches: micro-batches per evaluation (0 = all)
  std::string stop = "";         // train.stop: "epochs" | "max_steps": which wins if both are set
  std::string resume = "auto";   // train.resume: "auto" (log.dir's latest) | "none" | a path
  bool resume_fallback = false;  // train.resume_fallback: skip a corrupt latest checkpoint
  int64_t max_bad_steps = 5;     // train.max_bad_steps: consecutive non-finite steps to abort
  // train.device: "cpu" | "cuda" (one GPU per rank) | "cpu-queued" (the CPU's kernels run as a
  // GPU's queue runs them, backend/queued.h: a check of the engine's ordering, for tests)
  std::string device = "cpu";
  // train.attention: "auto" (cuDNN's fused attention where the CUDA build has it and it takes
  // the call, else the backend's own kernels) | "cudnn" (CUDA with cuDNN required) | "own"
  std::string attention = "auto";
};

struct CheckpointConfig {
  int64_t every_steps = 0;  // checkpoint.every_steps: 0 = only at the end (and on a signal)
  int64_t keep_last = 3;    // checkpoint.keep_last: complete checkpoints kept (0 = all)
  // checkpoint.at_end: write one when the run completes. false for throwaway runs (benchmarks,
  // probes of a node) whose state is not worth the disk: an 8B model's is ~112 GB.
  bool at_end = true;
  // checkpoint.async: periodic checkpoints are snapshotted into host memory (planned) and
  // written by a background thread while training continues; committed at a later step.
  bool async = false;
  // checkpoint.async_snapshot_gib: the most host memory the snapshot may take (0 = the rank's
  // whole share); the state vectors past it (in the order params, adam_m, adam_v, master) are
  // written synchronously at the save step.
  double async_snapshot_gib = 0;
  // checkpoint.on_save_error: "stop" ends the run when a periodic save fails (exit 3; the last
  // committed checkpoint is intact), "continue" reports it and trains on to the next save.
  std::string on_save_error = "stop";
  int64_t async_snapshot_budget_bytes() const {
    return int64_t(async_snapshot_gib * double(int64_t{1} << 30));
  }
  // Whether a snapshot is planned and held: only periodic saves are asynchronous (a stop's and
  // the end's are not), so without every_steps there is none.
  bool async_snapshot() const { return async && every_steps > 0; }
};

struct PrecisionConfig {
  std::string param = "fp32";  // precision.param: "fp32" | "bf16" (fp32 master weights)
  // precision.activations: "auto" (bf16 when param is bf16, else fp32) | "fp32" | "bf16":
  // activations, checkpoints, the residual stream and their gradients (ModelOptions).
  std::string activations = "auto";
  DType param_dtype() const { return param == "bf16" ? DType::kBF16 : DType::kF32; }
  DType activation_dtype() const {
    if (activations == "auto") return param_dtype();
    return activations == "bf16" ? DType::kBF16 : DType::kF32;
  }
};

struct ParallelConfig {
  int64_t tp = 1;                   // parallel.tp: tensor-parallel ranks per layer
  int64_t pp = 1;                   // parallel.pp: pipeline stages
  int64_t cp = 1;                   // parallel.cp: context-parallel ranks (the sequence split)
  std::string cp_kind = "ulysses";  // parallel.cp_kind: "ulysses" | "ring" | "hybrid"
  int64_t cp_ulysses = 0;           // parallel.cp_ulysses: hybrid's all-to-all size (0 = auto)
  // parallel.cp_keep_gathered: Ulysses and hybrid keep each layer's gathered q, k, v from the
  // forward for the backward instead of all-to-all'ing them again (3 of the backward's 8
  // all-to-alls), at the memory of one gathered q, k, v per layer of the stage (per layer
  // recomputed at once under full checkpointing: one set) and micro-batch in flight.
  bool cp_keep_gathered = false;
  // parallel.sequence_parallel: under tp > 1, split the residual stream and the norms by rows
  // across the tp ranks (activations between blocks 1/tp per rank); ignored at tp = 1.
  bool sequence_parallel = true;
  // parallel.device_comm: how device tensors cross ranks. "nccl": on train.device = cuda the
  // NCCL world (one GPU per rank); elsewhere the host world itself. "host" (alias "mpi"): the
  // host world (MPI under mpirun/srun, TCP under `shardlm launch` or torchrun-style variables)
  // with device tensors staged through a host buffer (StagedCommunicator), so several ranks may
  // share one GPU; on the CPU the same staging runs (its test on the CPU).
  std::string device_comm = "nccl";
  // parallel.device_comm_staging_kib: the host staging buffer of device_comm = "host", per rank.
  int64_t device_comm_staging_kib = 16384;
  // Device tensors go through the host world, staged ("host", or its alias "mpi").
  bool device_comm_staged() const { return device_comm == "host" || device_comm == "mpi"; }
  // Bytes of staging memory this run holds on each rank (0 where none is used).
  int64_t staging_bytes(int64_t world_size) const {
    return device_comm_staged() && world_size > 1 ? device_comm_staging_kib * 1024 : 0;
  }
  // The data-parallel size is not a key: it is world size / (tp * cp * pp) (see Topology).
};

struct ZeroConfig {
  int64_t stage = 0;                          // zero.stage: 0 (replicated) .. 3 (params sharded)
  std::string offload_optimizer = "none";     // zero.offload_optimizer: "none" | "cpu"
  std::string offload_params = "none";        // zero.offload_params: "none" | "cpu" (stage 3)
  bool overlap_comm = true;                   // zero.overlap_comm: comm overlaps backward
  int64_t reduce_bucket_bytes = 25000000;     // zero.reduce_bucket_bytes: gradient bucket
  int64_t allgather_bucket_bytes = 25000000;  // zero.allgather_bucket_bytes: param bucket
  int64_t prefetch_layers = 1;                // zero.prefetch_layers: stage-3 gathers ahead
  std::string reduce_dtype = "fp32";          // zero.reduce_dtype: "fp32" | "bf16" (stage >= 2)

  // Elements per ZeRO bucket (plan/zero_layout.h): one bucket is both the unit of gradient
  // reduction and of stage-3 gathering, so it holds at most reduce_bucket_bytes of f32
  // gradients and allgather_bucket_bytes of parameters (of `param_bytes` each).
  int64_t bucket_elems(size_t param_bytes) const;
};

// memory.offload_checkpoints: the share of the kept layers' checkpoints that waits on the
// host: false (none), true (all), a fraction in [0, 1] (of the kept layers, rounded to the
// nearest whole layer; the first layers go) or "auto" (the fewest that keep the device within
// memory.budget_gib; all of them without a budget).
struct CheckpointOffload {
  double fraction = 0;
  bool automatic = false;
  bool any() const { return automatic || fraction > 0; }
  bool operator==(const CheckpointOffload&) const = default;
};
void to_json(nlohmann::json& out, const CheckpointOffload& offload);  // as the key is written

struct MemoryConfig {
  std::string checkpointing = "none";     // memory.checkpointing: "none" | "selective" | "full"
  CheckpointOffload offload_checkpoints;  // memory.offload_checkpoints (above)
  // memory.checkpoint_every: keep every k-th layer's input, recompute the rest (full only)
  int64_t checkpoint_every = 1;
  int64_t loss_chunk_tokens = 1024;  // memory.loss_chunk_tokens: rows of the fused loss
  int64_t mlp_chunk_tokens = 1024;   // memory.mlp_chunk_tokens: rows of the MLP per chunk
  double budget_gib = 0;             // memory.budget_gib: device-pool cap (0 = none)

  // budget_gib in bytes (0 = no cap).
  int64_t budget_bytes() const { return int64_t(budget_gib * double(int64_t{1} << 30)); }
};

struct LoraRunConfig {
  int64_t rank = 0;             // lora.rank: adapters' rank r (0 = off: full fine-tuning)
  double alpha = 16;            // lora.alpha: the update is scaled by alpha / r
  double dropout = 0;           // lora.dropout: on the adapters' input, in training
  std::string targets = "q,v";  // lora.targets: projections with adapters (q,k,v,o,gate,up,down)
  bool offload_base = false;    // lora.offload_base: the frozen base in host memory
  std::string base_dtype = "auto";  // lora.base_dtype: auto (precision.param), nf4, bf16, fp32
};

struct LogConfig {
  std::string dir = "runs/default";  // log.dir: run directory
  int64_t every_steps = 1;           // log.every_steps: metrics.jsonl/progress cadence
  bool profile = false;              // log.profile: time per op family in summary.json
  bool tensorboard = true;           // log.tensorboard: event files of the metrics (rank 0)
  std::string tensorboard_dir = "";  // log.tensorboard_dir: "" = log.dir/tb
};

struct SampleConfig {
  std::string prompt = "";       // sample.prompt: text sampled from at the end ("" = skip)
  int64_t max_new_tokens = 200;  // sample.max_new_tokens
  double temperature = 0.8;      // sample.temperature (0 = greedy)
  int64_t top_k = 40;            // sample.top_k (0 = all)
  double top_p = 1.0;            // sample.top_p: nucleus mass kept (1 = all)
  int64_t count = 2;             // sample.count: how many samples

  // Whether a run samples at its end (a prompt, at least one sample of at least one token).
  bool at_end() const { return !prompt.empty() && count > 0 && max_new_tokens > 0; }
};

struct RunConfig {
  std::string model_preset = "tiny";  // model.preset
  // model.hf_dir: a Hugging Face model directory (config.json + safetensors): the model's
  // shape comes from its config.json and a fresh run starts from its weights ("" = none).
  std::string model_hf_dir;
  ModelConfig model;  // resolved: preset + model.* overrides
  DataConfig data;
  TrainConfig train;
  PrecisionConfig precision;
  ParallelConfig parallel;
  ZeroConfig zero;
  MemoryConfig memory;
  CheckpointConfig checkpoint;
  LogConfig log;
  SampleConfig sample;
  LoraRunConfig lora;
  std::string config_dir;  // directory of the config file: relative paths in the file
                           // (data.train, data.valid, log.dir) resolve here

  // The model's LoRA settings (rank 0: none).
  LoraConfig lora_config() const;

  // The tokenizer the run uses (data.tokenizer's rule): a path load_tokenizer takes, or "byte".
  std::string tokenizer_path() const;

  // Throws Error(kConfig) naming the key when values are inconsistent, or asks for a feature
  // this version does not have yet (parallel.tp/pp/cp > 1, ZeRO stages, offload).
  void validate() const;
};

// Parses a JSON config file, applies --set overrides ("a.b=value"; the value is parsed as
// JSON, falling back to a string), resolves the model preset, validates.
RunConfig load_run_config(const std::string& path, const std::vector<std::string>& overrides);
// Same, without validate(): what the file and the overrides say, for a layer that reads the
// values before adding overrides of its own (the DeepSpeed mapping). Values may be invalid.
RunConfig load_run_config_unvalidated(const std::string& path,
                                      const std::vector<std::string>& overrides);
// Same, from an in-memory JSON document (config_dir = base_dir).
RunConfig parse_run_config(const std::string& json_text, const std::vector<std::string>& overrides,
                           const std::string& base_dir);

// The resolved configuration, every key present (for summary.json).
nlohmann::json run_config_to_json(const RunConfig& cfg);

}  // namespace shardlm
