// RunConfig -> PlanInputs (plan_inputs.h): the trainer and `shardlm plan` share this mapping,
// so the plan shown before a launch is the one the run checks. Must stay arithmetic: it runs
// for 70B presets in milliseconds and may not allocate model-sized buffers.
#include "shardlm/planner/plan_inputs.h"

#include <algorithm>
#include <cmath>

#include "shardlm/model/decoder.h"
#include "shardlm/model/nf4_base.h"
#include "shardlm/model/tensor_shard.h"
#include "shardlm/parallel/context.h"
#include "shardlm/parallel/pipeline.h"
#include "shardlm/plan/preference_step.h"

namespace shardlm {

Topology topology_for(const RunConfig& cfg, int64_t world_size, int64_t rank) {
  ParallelDims dims;
  dims.pp = cfg.parallel.pp;
  dims.cp = cfg.parallel.cp;
  dims.tp = cfg.parallel.tp;
  return Topology(dims, world_size, rank);
}

std::optional<ContextLayout> context_layout_for(const RunConfig& cfg) {
  if (cfg.parallel.cp <= 1) return std::nullopt;
  // Context parallelism splits the sequence of each tp rank's shard (its heads).
  return make_context_layout(tp_shard_config(cfg.model, cfg.parallel.tp), cfg.data.seq_len,
                             int(cfg.parallel.cp), parse_cp_kind(cfg.parallel.cp_kind),
                             cfg.parallel.cp_ulysses);
}

ModelConfig shard_model_for(const RunConfig& cfg) {
  ModelConfig m = tp_shard_config(cfg.model, cfg.parallel.tp);
  m.sequence_parallel = cfg.parallel.sequence_parallel && cfg.parallel.tp > 1;
  return m;
}

StagePartition pipeline_partition_for(const RunConfig& cfg) {
  const ModelConfig& m = cfg.model;
  const ParamLayout L = make_param_layout(m);
  std::vector<double> cost(m.n_layers);
  for (int l = 0; l < m.n_layers; ++l)
    cost[l] = double(L.layers[l].end - L.layers[l].begin) +
              double(m.q_dim()) * double(cfg.data.seq_len) / 2;
  return partition_layers(cost, 0.0, double(m.vocab_size) * double(m.dim), int(cfg.parallel.pp));
}

ModelConfig stage_model_for(const RunConfig& cfg, int64_t stage) {
  ModelConfig m = shard_model_for(cfg);
  if (cfg.parallel.pp <= 1) return m;
  const StagePartition part = pipeline_partition_for(cfg);
  m.pp_begin = part.begin[stage];
  m.pp_end = part.begin[stage + 1];
  return m;
}

int cp_kept_sets_for(const RunConfig& cfg, const ModelConfig& stage_model,
                     const ContextLayout& layout, Checkpointing checkpointing) {
  return cp_kept_sets(layout, cfg.parallel.cp_keep_gathered, checkpointing == Checkpointing::kFull,
                      int(stage_model.stage_end() - stage_model.pp_begin));
}

int pipeline_slots_for(const RunConfig& cfg, int64_t stage) {
  return int(std::min<int64_t>(cfg.train.grad_accum, cfg.parallel.pp - stage));
}

CheckpointPlacement checkpoint_placement_for(const RunConfig& cfg, int64_t stage_layers) {
  CheckpointPlacement placed;
  placed.every = int(cfg.memory.checkpoint_every);
  const CheckpointOffload& offload = cfg.memory.offload_checkpoints;
  if (cfg.memory.checkpointing == "none" || !offload.any()) return placed;
  const int layers = int(stage_layers > 0 ? stage_layers : cfg.model.n_layers);
  const int kept = (layers + placed.every - 1) / placed.every;
  placed.host_layers = offload.automatic ? CheckpointPlacement::kAll
                                         : int(std::lround(offload.fraction * double(kept)));
  return placed;
}

ModelOptions model_options_for(const RunConfig& cfg, int64_t local_seq) {
  ModelOptions mopt;
  mopt.param_dtype = cfg.precision.param_dtype();
  mopt.activation_dtype = cfg.precision.activation_dtype();
  mopt.max_batch = cfg.train.micro_batch;
  mopt.max_seq = local_seq;
  mopt.loss_chunk_tokens = cfg.memory.loss_chunk_tokens;
  mopt.mlp_chunk_tokens = cfg.memory.mlp_chunk_tokens;
  mopt.checkpointing = checkpointing_from_name(cfg.memory.checkpointing);
  mopt.checkpoint_placement = checkpoint_placement_for(cfg);
  mopt.lora = cfg.lora_config();
  mopt.token_weights = cfg.train.objective != "sft";  // preference objectives' weighted head
  return mopt;
}

ModelOptions sampler_model_options(const RunConfig& cfg) {
  ModelOptions o;
  o.param_dtype = cfg.precision.param_dtype();
  o.activation_dtype = cfg.precision.activation_dtype();  // the sampler's KV cache
  o.max_seq = cfg.data.seq_len;                           // the whole row, whatever the cp split
  o.activations = false;  // parameters only: the KvDecoder holds what sampling needs
  return o;
}

std::optional<DecoderPlanInputs> sampler_plan_inputs_for(const RunConfig& cfg,
                                                         const Backend& backend) {
  if (!cfg.sample.at_end()) return std::nullopt;
  const ModelOptions model = sampler_model_options(cfg);
  DecoderPlanInputs in;
  in.model = cfg.model;
  in.param_dtype = model.param_dtype;
  in.activation_dtype = model.activation_dtype;
  in.max_len = model.max_seq;
  in.max_chunk = std::min(model.max_seq, kSamplePrefillChunk);
  const ModelOptions runner = kv_decoder_runner_options(model, in.max_chunk);
  in.mlp_chunk_tokens = runner.mlp_chunk_tokens;
  in.decode_workspace_bytes = int64_t(backend.attention_decode_workspace_bytes(
      1, in.max_chunk, in.max_len, cfg.model.n_heads, cfg.model.head_dim()));
  in.runner_workspace_bytes =
      int64_t(model_kernel_workspace_bytes(backend, cfg.model, runner, /*own_attention=*/false));
  return in;
}

ZeroOptions zero_options_for(const RunConfig& cfg) {
  const DType param_dtype = cfg.precision.param_dtype();
  ZeroOptions zopt;
  zopt.stage = int(cfg.zero.stage);
  zopt.offload_optimizer = cfg.zero.offload_optimizer == "cpu";
  zopt.offload_params = cfg.zero.offload_params == "cpu";
  zopt.overlap_comm = cfg.zero.overlap_comm;
  // With LoRA the engine holds the f32 adapters, not the base.
  zopt.bucket_elems = cfg.zero.bucket_elems(cfg.lora.rank > 0 ? 4 : dtype_size(param_dtype));
  zopt.prefetch = int(cfg.zero.prefetch_layers);
  zopt.reduce_dtype = cfg.zero.reduce_dtype == "bf16" ? DType::kBF16 : DType::kF32;
  zopt.split_tables = cfg.parallel.tp == 1;
  return zopt;
}

bool head_in_pieces(const RunConfig& cfg) {
  const ParamLayout L = make_param_layout(shard_model_for(cfg));
  const int head = L.lm_head_unit;  // tied: the embeddings' unit
  if (cfg.lora.rank > 0 && cfg.lora.offload_base && cfg.lora.base_dtype == "nf4")
    return make_nf4_host_layout(L, make_nf4_base_layout(L),
                                int64_t(dtype_size(cfg.precision.param_dtype())),
                                cfg.parallel.tp == 1)
               .piece_rows[head] > 0;
  if (cfg.lora.rank > 0)  // the engine holds the adapters; the base is the model's own store
    return cfg.lora.offload_base && cfg.parallel.tp == 1 &&
           table_piece_rows(L, head, L.max_layer) > 0;
  const ZeroOptions zopt = zero_options_for(cfg);
  if (!zero_splits_tables(zopt.stage, zopt.split_tables)) return false;
  return table_piece_rows(L, head, zero_table_piece_elems(L, zopt.bucket_elems)) > 0;
}

PlanInputs plan_inputs_for(const RunConfig& cfg, int64_t world_size, const Backend& backend,
                           int64_t pp_stage, int64_t transport_device_bytes) {
  (void)topology_for(cfg, world_size);  // the world must factor into the grid
  const std::optional<ContextLayout> cp = context_layout_for(cfg);
  const int64_t B = cfg.train.micro_batch;
  const ModelOptions mopt = model_options_for(cfg, cp ? cp->local() : cfg.data.seq_len);

  // Under tensor parallelism every rank holds one tp shard, under pipeline parallelism one
  // stage of it: the plan is the stage's shard's.
  const ModelConfig model = stage_model_for(cfg, pp_stage);
  PlanInputs pin;
  pin.model = model;
  pin.micro_batch = B;
  pin.seq_len = mopt.max_seq;
  if (cp) {
    pin.cp = *cp;
    pin.cp_kernel_workspace_bytes = ContextParallel::kernel_workspace_bytes(backend, model, *cp, B);
    pin.cp_kept_sets = cp_kept_sets_for(cfg, model, *cp, mopt.checkpointing);
  }
  pin.param_dtype = mopt.param_dtype;
  pin.activation_dtype = mopt.activation_dtype;
  pin.kernel_workspace_bytes =
      int64_t(model_kernel_workspace_bytes(backend, model, mopt, /*own_attention=*/!cp));
  pin.checkpointing = mopt.checkpointing;
  pin.checkpoint_placement = checkpoint_placement_for(cfg, model.stage_end() - model.pp_begin);
  pin.mlp_chunk_tokens = mopt.mlp_chunk_tokens;
  pin.lora = mopt.lora;
  if (cfg.parallel.pp > 1) {  // the stage's micro-batches in flight, the executor's buffers
    pin.pipeline_slots = pipeline_slots_for(cfg, pp_stage);
    pin.pipeline_comm_bytes = int64_t(PipelineExecutor::buffer_bytes(
        int(cfg.parallel.pp), int(pp_stage), int(cfg.train.grad_accum),
        B * mopt.max_seq / model.seq_shards() * cfg.model.dim, mopt.activation_dtype));
  }
  pin.comm_staging_bytes = cfg.parallel.staging_bytes(world_size);
  // The trainer's InputStaging (under cp: the rank's share of each row).
  pin.input_staging_bytes = input_staging_bytes(B * mopt.max_seq);
  pin.comm_transport_bytes = transport_device_bytes;
  if (cfg.train.objective != "sft") {  // the preference runner's buffers, the evaluation's rows
    const bool dpo = cfg.train.objective == "dpo";
    const PreferenceStepBuffers step = preference_step_buffers(
        model.holds_head(), B, cfg.data.seq_len, mopt.max_seq, pin.pipeline_slots,
        cfg.train.grad_accum, cfg.parallel.pp > 1, dpo, dpo && cfg.lora.rank == 0);
    pin.preference_step_device_bytes = step.device_bytes();
    pin.preference_step_host_bytes = step.host_bytes();
    pin.preference_host_bytes =
        preference_host_bytes(B, cfg.data.seq_len, mopt.max_seq,
                              preference_pair_lists(cfg.parallel.pp > 1, cfg.train.grad_accum));
    // The model's rows for read_target_logps (the evaluation, the reference pass).
    if (model.holds_head()) pin.preference_host_bytes += int64_t(target_logps_host_bytes(mopt));
  }
  pin.async_checkpoint = cfg.checkpoint.async_snapshot();
  pin.async_snapshot_budget = cfg.checkpoint.async_snapshot_budget_bytes();
  // ZeRO shards over the ranks holding the same stage's tp shard (dp x cp), as the trainer's
  // engine.
  set_plan_inputs(zero_options_for(cfg), int(world_size / (cfg.parallel.tp * cfg.parallel.pp)),
                  pin);
  if (cfg.memory.offload_checkpoints.automatic && cfg.memory.budget_gib > 0) {
    const int host = fewest_host_checkpoints(pin, cfg.memory.budget_bytes());
    if (host >= 0) pin.checkpoint_placement.host_layers = host;
  }
  return pin;
}

int fewest_host_checkpoints(const PlanInputs& pin, int64_t device_budget) {
  const ParamLayout layout = pin.layout != nullptr ? ParamLayout{} : make_param_layout(pin.model);
  PlanInputs trial = pin;
  if (trial.layout == nullptr) trial.layout = &layout;
  const CheckpointMap map(pin.model, pin.checkpointing, pin.checkpoint_placement);
  auto fits = [&](int host) {
    trial.checkpoint_placement.host_layers = host;
    return plan_memory(trial).peak_bytes[int(MemPool::kDevice)] <= device_budget;
  };
  if (fits(0)) return 0;
  // From one host layer on, each more frees a resident slot or leaves the count as it is (the
  // rotating slots grow until they reach every + 1): the device peak never rises, so the
  // fewest that fit are found by bisection. (The first host layer itself may need more slots
  // than none: its trip and the prefetch.)
  int lo = 0, hi = map.kept_layers();  // lo does not fit; hi may not either
  if (!fits(hi)) return -1;
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    (fits(mid) ? hi : lo) = mid;
  }
  return hi;
}

std::vector<std::string> device_memory_hints(const RunConfig& cfg) {
  std::vector<std::string> hints;
  if (cfg.memory.checkpointing != "full") hints.push_back("memory.checkpointing=full");
  if (cfg.memory.checkpointing != "none" && cfg.memory.offload_checkpoints.fraction < 1 &&
      !cfg.memory.offload_checkpoints.automatic)
    hints.push_back("memory.offload_checkpoints=true (or \"auto\")");
  if (cfg.memory.checkpointing == "full" && cfg.memory.checkpoint_every == 1)
    hints.push_back("memory.checkpoint_every=2");
  if (cfg.zero.stage < 3) hints.push_back("a higher zero.stage");
  if (cfg.zero.offload_optimizer != "cpu") hints.push_back("zero.offload_optimizer=cpu");
  if (cfg.zero.stage >= 1) hints.push_back("more ranks to shard over");
  hints.push_back("parallel.cp > 1");
  if (cfg.train.micro_batch > 1) hints.push_back("a smaller train.micro_batch");
  hints.push_back("a shorter data.seq_len");
  return hints;
}

nlohmann::json category_json(const CategoryBytes& b) {
  nlohmann::json j = nlohmann::json::object();
  for (int c = 0; c < kNumMemCategories; ++c)
    j[std::string(mem_category_name(static_cast<MemCategory>(c)))] = b[c];
  return j;
}

nlohmann::json plan_json(const MemoryPlan& plan) {
  const int d = static_cast<int>(MemPool::kDevice), h = static_cast<int>(MemPool::kHost);
  return {{"peak_bytes", {{"device", plan.peak_bytes[d]}, {"host", plan.peak_bytes[h]}}},
          {"peak_by_category", category_json(plan.by_category[d])},
          {"at_peak_by_category", category_json(plan.by_category[d])},
          {"host_peak_by_category", category_json(plan.by_category[h])}};
}

}  // namespace shardlm
