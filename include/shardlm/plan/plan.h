// MemoryPlan: the predicted peak bytes of one rank, per pool and category, from the model's
// size tables. Pure arithmetic over model/layout: builds without a backend, allocates nothing.
// It covers data parallelism with ZeRO stages 0-3 and offload, activation checkpointing (none,
// selective, full; checkpoints placed between the device and the host, every k-th layer's),
// the MLP chunk, context, tensor and pipeline parallelism; the kernel scratch sizes are inputs
// because they depend on the backend's tiling.
#pragma once

#include <cstdint>
#include <string>

#include "shardlm/core/dtype.h"
#include "shardlm/core/ledger.h"
#include "shardlm/model/checkpoint_map.h"
#include "shardlm/model/config.h"
#include "shardlm/model/layout.h"
#include "shardlm/model/lora.h"
#include "shardlm/plan/context_layout.h"
#include "shardlm/plan/zero_layout.h"

namespace shardlm {

struct PlanInputs {
  ModelConfig model;
  int64_t micro_batch = 1;
  int64_t seq_len = 1;
  DType param_dtype = DType::kF32;
  DType activation_dtype = DType::kF32;  // ModelOptions::activation_dtype
  int64_t kernel_workspace_bytes = 0;    // max over attention and loss scratch (backend query)

  // The model's activation options (ModelOptions, model/llama.h).
  Checkpointing checkpointing = Checkpointing::kNone;
  CheckpointPlacement checkpoint_placement;  // model/checkpoint_map.h
  int64_t mlp_chunk_tokens = 1024;
  // LoRA (lora.rank > 0): the base is frozen and replicated (parameters only, in param_dtype);
  // the ZeRO engine below holds the f32 adapters (model/lora.h) instead of the base.
  LoraConfig lora;

  // Data parallelism: ranks of the group and the ZeRO engine's settings (parallel/zero.h).
  int dp = 1;
  int zero_stage = 0;
  bool offload_optimizer = false;
  bool offload_params = false;
  int64_t bucket_elems = int64_t{1} << 22;
  int prefetch = 1;
  DType reduce_dtype = DType::kF32;  // gradient reductions' wire format (ZeroOptions)
  bool split_tables = true;          // ZeroOptions::split_tables

  // Context parallelism (cp.P > 1): seq_len is then this rank's share (cp.local()), and the
  // attention core's buffers (plan/context_layout.h) are added, with its kernel scratch.
  ContextLayout cp;
  int64_t cp_kernel_workspace_bytes = 0;
  int cp_kept_sets = 0;  // parallel.cp_keep_gathered's layer sets (cp_kept_sets)

  // Pipeline parallelism: `model` is one stage (ModelConfig::pp_begin, pp_end); its kept
  // tensors and saved activations are held once per micro-batch in flight (pipeline_slots),
  // plus the executor's send and receive buffers (parallel/pipeline.h).
  int pipeline_slots = 1;
  int64_t pipeline_comm_bytes = 0;
  // The staged communicator's host staging buffer (parallel.device_comm = "mpi"), host pool.
  int64_t comm_staging_bytes = 0;
  // The trainer's host rows and pinned slots of a micro-batch's inputs (input_staging_bytes of the
  // rank's tokens: under context parallelism its share of each row), host pool.
  int64_t input_staging_bytes = 0;
  // A preference objective's host rows (preference_host_bytes, and on the stage with the head
  // the model's rows for read_target_logps: model/llama.h's target_logps_host_bytes), host
  // pool, activations.
  int64_t preference_host_bytes = 0;
  // What the trainer holds of its data on the host (data_host_bytes and
  // reference_table_host_bytes below), host pool, data. Known once the data is read: the
  // trainer plans it then; `shardlm plan` reads no data and plans 0.
  int64_t data_host_bytes = 0;
  // A preference objective's step buffers on the stage with the head
  // (plan/preference_step.h): device and pinned host bytes, category activations.
  int64_t preference_step_device_bytes = 0;
  int64_t preference_step_host_bytes = 0;
  // What the run's communicators' transports hold on the device (NCCL's buffers, measured when
  // they are made: Communicator::transport_device_bytes), device pool.
  int64_t comm_transport_bytes = 0;
  // checkpoint.async: the snapshot of the rank's share of the state vectors (host pool), at
  // most async_snapshot_budget bytes of them (0 = all; zero_layout.h's
  // zero_checkpoint_snapshot_vectors).
  bool async_checkpoint = false;
  int64_t async_snapshot_budget = 0;

  // make_param_layout(model) when the caller already has it (the --fit search keeps one per
  // grid and stage: building it dominates a plan's time); null: plan_memory builds it. Not
  // owned; must outlive the call.
  const ParamLayout* layout = nullptr;
};

struct MemoryPlan {
  std::array<int64_t, kNumMemPools> peak_bytes{};         // per pool
  std::array<CategoryBytes, kNumMemPools> by_category{};  // per pool, at the peak
  // When the peak is reached and which phase of the step fills the buffers most, in words.
  // Every buffer is allocated at setup and held (the steady-state step allocates nothing), so
  // the peak is reached before step 1 and holds; the phase names when the buffers' contents
  // are largest (all kept checkpoints live, the loss's saved activations too).
  std::string peak_moment;
};

MemoryPlan plan_memory(const PlanInputs& in);

// Host bytes of the trainer's host rows and two pinned upload slots for micro-batches of
// `tokens` = B * T tokens: each holds the tokens, targets, positions and segment starts (tokens
// int32 each) and the tokens + 1 document starts.
inline int64_t input_staging_bytes(int64_t tokens) { return 3 * (5 * tokens + 1) * 4; }

// A preference micro-batch's pair list (train/preference.h's PairSpans: the chosen and rejected
// token spans, the window and the pair's place in it): 48 bytes a pair. A pair is two
// documents of at least one token each within one row, so B rows of T tokens hold at most
// B * (T / 2) pairs; a list is reserved for that many and never grows.
inline constexpr int64_t kPreferencePairBytes = 48;
inline int64_t max_micro_batch_pairs(int64_t B, int64_t T) { return B * (T / 2); }
// The step runner's pair lists: one per micro-batch alive at once, the step's `micro_batches`
// under pipeline stages (every load comes before the backwards that read it), else one.
inline int64_t preference_pair_lists(bool pipelined, int64_t micro_batches) {
  return pipelined ? micro_batches : 1;
}

// Host bytes of a preference objective's rows, B rows of T tokens of which a rank holds Tl,
// held from setup to the end of the run: the step runner's (train/preference_runner.cpp) row
// position of each local token [B*Tl] i64 and its `runner_pair_lists` pair lists (its segment
// ids and sums live in the step buffers, plan/preference_step.h); and the held-out
// evaluation's (train/preference_eval.cpp; the reference pass's too, at another time) logps
// [B*Tl] f64, at row positions [B*T] f64, targets [B*T] i32, row positions [B*Tl] i64 and one
// pair list.
int64_t preference_host_bytes(int64_t B, int64_t T, int64_t Tl, int64_t runner_pair_lists);

// What one data set of the trainer (train/data.h's Dataset) holds on the host, from its sizes.
struct DataSetSizes {
  int64_t seq_len = 1;
  int64_t windows = 0;
  bool samples = false;         // samples packing (else stream)
  bool paired = false;          // preference pairs
  int64_t documents = 0;        // the set's documents (a pair is two)
  int64_t placed = 0;           // samples packing: the items placed in windows (a pair is one)
  bool window_targets = false;  // stream packing of a masked source: a target count per window
};
// Its fill scratch [T + 1] i32 and u8; under samples packing each window's tokens and targets
// (i64), the windows' item offsets [windows + 1] and items (i64), and a paired set's kept length
// per pair (i64); under stream packing of a masked source each window's targets (i64).
int64_t data_set_host_bytes(const DataSetSizes& set);
// A token source read whole into memory (text or record files): its tokens (i32), loss mask (u8,
// when masked) and document starts (i64); a token corpus is mapped from its files, whose pages
// are the kernel's page cache, and holds its document starts (i64) and its shards' first tokens
// (i64).
int64_t memory_source_host_bytes(int64_t tokens, int64_t documents, bool masked);
int64_t corpus_source_host_bytes(int64_t documents, int64_t shards);
// Full fine-tuning DPO's reference table of a data set of windows of T tokens: each window's
// first pair [windows + 1] (i64), two sums a pair (f64): 16 bytes a pair, and the table's key's
// scratch, one window's inputs as the loader fills them [5 T + 1] (i32).
inline int64_t reference_table_host_bytes(int64_t windows, int64_t pairs, int64_t T) {
  return (windows + 1) * 8 + pairs * 16 + (5 * T + 1) * 4;
}

// Generation on one process (the trainer's end-of-run sample, after the training buffers are
// released): a whole model, parameters only, and a KvDecoder over it (model/decoder.h) with a
// cache of max_len positions and prefill chunks of max_chunk tokens. The scratch sizes are the
// backend's, queried with kv_decoder_runner_options.
struct DecoderPlanInputs {
  ModelConfig model;  // the whole model: one tp shard, every layer
  DType param_dtype = DType::kF32;
  DType activation_dtype = DType::kF32;
  int64_t max_len = 1;
  int64_t max_chunk = 1;               // min(prefill chunk, max_len)
  int64_t mlp_chunk_tokens = 1024;     // the runner's ModelOptions::mlp_chunk_tokens
  int64_t decode_workspace_bytes = 0;  // Backend::attention_decode_workspace_bytes
  int64_t runner_workspace_bytes = 0;  // model_kernel_workspace_bytes (no own attention)
};

MemoryPlan plan_decoder_memory(const DecoderPlanInputs& in);

}  // namespace shardlm
