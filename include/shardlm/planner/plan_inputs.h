// From a resolved RunConfig to the planner's inputs: the one mapping that both `shardlm train`
// (which checks the run against the plan) and `shardlm plan` (which shows it before launch)
// use, so that the plan printed before a run is the plan the run is measured against.
// Arithmetic only: the backend is asked for workspace sizes, nothing is allocated.
#pragma once

#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "shardlm/backend/backend.h"
#include "shardlm/config/config.h"
#include "shardlm/model/llama.h"
#include "shardlm/parallel/topology.h"
#include "shardlm/parallel/zero.h"
#include "shardlm/plan/context_layout.h"
#include "shardlm/plan/pipeline.h"
#include "shardlm/plan/plan.h"

namespace shardlm {

// The rank grid of `world_size` processes for cfg's parallel.* keys, as rank `rank` sees it.
// Throws Error(kConfig) naming the parallel keys when the world does not factor.
Topology topology_for(const RunConfig& cfg, int64_t world_size, int64_t rank = 0);

// The sequence split (parallel.cp > 1), or nothing.
std::optional<ContextLayout> context_layout_for(const RunConfig& cfg);

// This rank's shard of cfg.model: tp_shard_config, with sequence parallelism on when
// parallel.sequence_parallel and parallel.tp > 1.
ModelConfig shard_model_for(const RunConfig& cfg);

// The model's options for this config; the model holds `local_seq` tokens of each row (the
// whole data.seq_len, or this rank's share under context parallelism).
ModelOptions model_options_for(const RunConfig& cfg, int64_t local_seq);

// memory.checkpoint_every, and memory.offload_checkpoints' fraction of the kept layers rounded
// to whole layers ("auto" gives all of them; plan_inputs_for resolves it against
// memory.budget_gib). stage_layers: the decoder layers of the pipeline stage the placement is
// for (a fraction is of the stage's kept layers); 0 = the whole model's.
CheckpointPlacement checkpoint_placement_for(const RunConfig& cfg, int64_t stage_layers = 0);

// The ZeRO engine's options for this config.
ZeroOptions zero_options_for(const RunConfig& cfg);

// Whether the LM head's table is handed out in pieces of rows (ZeRO from stage 2 without
// tensor parallelism, or a LoRA base offloaded to the host), so that the loss runs the head's
// logits GEMM twice (model/llama_head.cpp).
bool head_in_pieces(const RunConfig& cfg);

// The layers of each pipeline stage (parallel.pp of them): partition_layers over the layers'
// training FLOPs per token (matmul parameters plus attention at half the sequence), the LM
// head's on the last stage, the embedding gather counted free. Throws Error(kConfig) naming
// parallel.pp and model.n_layers when pp > n_layers.
StagePartition pipeline_partition_for(const RunConfig& cfg);

// The model a rank of pipeline stage `stage` holds: its tp shard of cfg.model restricted to
// the stage's layers (ModelConfig::pp_begin, pp_end); cfg.model's tp shard at parallel.pp = 1.
ModelConfig stage_model_for(const RunConfig& cfg, int64_t stage);

// Micro-batches a rank of stage `stage` holds at once under 1F1B: min(grad_accum, pp - stage).
int pipeline_slots_for(const RunConfig& cfg, int64_t stage);

// The gathered q, k, v sets the context-parallel core of a stage holding `stage_model` keeps
// per micro-batch in flight (parallel.cp_keep_gathered; plan/context_layout.h cp_kept_sets).
int cp_kept_sets_for(const RunConfig& cfg, const ModelConfig& stage_model,
                     const ContextLayout& layout, Checkpointing checkpointing);

// Everything plan_memory() needs for one rank of a `world_size`-rank run of cfg, a rank of
// pipeline stage `pp_stage` (every other coordinate of the grid plays the same role).
// The end-of-run sampler's model options (rank 0 reads the final checkpoint into a whole
// model): parameters only, the run's dtypes, the whole row (data.seq_len) as its window.
ModelOptions sampler_model_options(const RunConfig& cfg);
// The end-of-run sample's memory inputs (plan_decoder_memory), or nullopt when the run does not
// sample (sample.prompt empty or sample.count = 0).
std::optional<DecoderPlanInputs> sampler_plan_inputs_for(const RunConfig& cfg,
                                                         const Backend& backend);

// transport_device_bytes: what the run's communicators hold on the device
// (ParallelGrid::transport_device_bytes), known once they are made; `shardlm plan` runs
// without them and says so.
PlanInputs plan_inputs_for(const RunConfig& cfg, int64_t world_size, const Backend& backend,
                           int64_t pp_stage = 0, int64_t transport_device_bytes = 0);

// The fewest of the kept layers' checkpoints on the host whose plan keeps the device within
// `device_budget` bytes (memory.offload_checkpoints = "auto", and `plan --fit`); -1 when even
// all of them on the host do not.
int fewest_host_checkpoints(const PlanInputs& pin, int64_t device_budget);

// What would lower a rank's device peak for cfg, only the changes not already in effect
// ("memory.checkpointing=full", "a higher zero.stage", ...): for `shardlm plan` and the
// trainer's refusal of a configuration over memory.budget_gib.
std::vector<std::string> device_memory_hints(const RunConfig& cfg);

// Bytes per category, keyed as the ledger names them (memory reports and plan_json).
nlohmann::json category_json(const CategoryBytes& b);

// A plan as memory_rank{R}.json's `planned` field writes it: peak_bytes per pool and the
// per-category bytes (keys as the ledger names them).
nlohmann::json plan_json(const MemoryPlan& plan);

}  // namespace shardlm
