// The memory plan of one data-parallel rank: every buffer the ZeRO engine and the model
// allocate, from the same tables they allocate from. All buffers live for the whole run, so
// the peak is their sum.
#include "shardlm/plan/plan.h"

#include <fmt/format.h>

#include "shardlm/model/layout.h"
#include "shardlm/model/nf4_base.h"
#include "shardlm/model/sharded_base.h"
#include "shardlm/plan/model_state.h"

namespace shardlm {
namespace {

// Stage >= 2: each rotating gradient buffer of the engine (ZeroEngine::GradBuf): the bucket
// buffer backward writes, its bf16 rounding for a bf16 wire, the reduced chunk, and either its
// f32 widening (bf16 into the device shard) or the host staging it is copied to (streamed).
// One rank reduces in place: no reduced chunk, no widening buffer (zero_reduces_in_place).
template <class Add>
void add_zero_grad_buffers(const ZeroLayout& z, bool holds_tied, bool streamed, DType wire,
                           Add&& add) {
  const MemPool dev = MemPool::kDevice, host = MemPool::kHost;
  const bool narrow = wire != DType::kF32;
  const bool in_place = zero_reduces_in_place(z.world);
  const int64_t wb = int64_t(dtype_size(wire));
  for (int i = 0; i < zero_grad_buffers(holds_tied); ++i) {
    add(dev, MemCategory::kComm, z.max_bucket * 4);
    if (narrow) add(dev, MemCategory::kComm, z.max_bucket * wb);
    if (!in_place) add(dev, MemCategory::kComm, z.max_chunk * wb);
    if (narrow && !streamed && !in_place) add(dev, MemCategory::kComm, z.max_chunk * 4);
    if (streamed) add(host, MemCategory::kHostOffload, z.max_chunk * wb);
    if (streamed && narrow) add(host, MemCategory::kHostOffload, z.max_chunk * 4);
  }
}

// The model's own buffers (model/llama_setup.cpp), its attention core's (parallel/context.cpp) and
// the pipeline executor's (parallel/pipeline.cpp). L: the model's layout; lora_params: with LoRA,
// the adapters' (the engine's arena).
template <class Add>
void add_model_buffers(const PlanInputs& in, const ParamLayout& L, const ParamLayout& lora_params,
                       Add&& add) {
  const ModelConfig& c = in.model;
  const int64_t B = in.micro_batch, T = in.seq_len;
  const MemPool dev = MemPool::kDevice, host = MemPool::kHost;
  const DType act = in.activation_dtype;
  const int64_t act_size = int64_t(dtype_size(act));
  if (in.lora.enabled()) {  // the frozen base (parameters only, replicated or sharded by
                            // ZeRO-3), LoRA's scratch, the norms' discarded gradients
    const int64_t pb = int64_t(dtype_size(in.param_dtype));
    if (in.lora.nf4_base) {  // dense parts, NF4 codes and absmax; one layer dequantized
      const Nf4BaseLayout N = make_nf4_base_layout(L);
      // ZeRO-3: a chunk of each layer, gathered on use
      const bool sharded = nf4_base_sharded(true, in.zero_stage, in.dp);
      const Nf4ShardLayout S = sharded ? make_nf4_shard_layout(L, N, in.dp) : Nf4ShardLayout{};
      const int64_t arrays =
          N.dense_elems * pb + (sharded ? S.shard_bytes : N.code_bytes + N.absmax_values * 4);
      if (sharded) add(dev, MemCategory::kComm, in.dp * S.max_chunk);
      if (in.lora.offload_base) {  // on the host, two staged parts on the device
        add(host, MemCategory::kParams, arrays);
        add(dev, MemCategory::kParams,
            2 * make_nf4_host_layout(L, N, pb, c.tp_shards == 1, sharded ? &S : nullptr)
                    .slot_bytes);
      } else {
        add(dev, MemCategory::kParams, arrays);
      }
      add(dev, MemCategory::kWorkspace, N.workspace_elems * pb);
    } else if (lora_base_sharded(in.zero_stage, in.dp)) {  // ZeRO-3: a chunk of each layer
      const DenseShardLayout S = make_dense_shard_layout(L, in.dp);
      // a layer gathered on use, and with prefetch the walk's next one
      add(dev, MemCategory::kComm,
          dense_shard_gather_buffers(in.lora.prefetch_base) * S.gather_elems() * pb);
      const int64_t arrays = (S.whole_elems + S.shard_elems) * pb;
      if (in.lora.offload_base) {  // on the host, two staged parts on the device
        add(host, MemCategory::kParams, arrays);
        add(dev, MemCategory::kParams,
            2 * make_dense_shard_host_layout(L, S, c.tp_shards == 1).slot_elems * pb);
      } else {
        add(dev, MemCategory::kParams, arrays);
      }
    } else if (in.lora.offload_base) {  // on the host, two units (or table pieces) on the device
      add(host, MemCategory::kParams, L.total * pb);
      add(dev, MemCategory::kParams, 2 * offloaded_base_slot_elems(L, c.tp_shards == 1) * pb);
    } else {
      add(dev, MemCategory::kParams, L.total * pb);
    }
    add(dev, MemCategory::kActivations,
        int64_t(arena_bytes(lora_transients(c, in.lora, B, T, act))));
    add(dev, MemCategory::kWorkspace, std::max(c.dim, c.head_dim()) * 4);
    if (act != DType::kF32)  // one layer's adapters in the activation dtype
      add(dev, MemCategory::kWorkspace, lora_params.max_unit * act_size);
  }
  add(dev, MemCategory::kParams, rotary_table_bytes(c));
  if (in.param_dtype != act) add(dev, MemCategory::kWorkspace, L.max_unit * act_size);  // staging
  const LayerActivationSpecs layer =
      layer_activation_specs(c, B, T, in.mlp_chunk_tokens, in.checkpointing, act);
  const int64_t kept = int64_t(arena_bytes(layer.kept));  // one layer's checkpoints
  const CheckpointMap slots(c, in.checkpointing, in.checkpoint_placement);
  add(dev, MemCategory::kCheckpoints, kept * slots.device_slots() * in.pipeline_slots);
  add(host, MemCategory::kCheckpoints, kept * slots.host_layers() * in.pipeline_slots);
  add(dev, MemCategory::kActivations,
      int64_t(arena_bytes(layer.work)) +
          int64_t(arena_bytes(model_saved_activations(c, B, T, in.checkpointing, act))) *
              in.pipeline_slots);
  add(dev, MemCategory::kComm, in.pipeline_comm_bytes);            // pipeline sends and receives
  add(host, MemCategory::kComm, in.comm_staging_bytes);            // device tensors staged for MPI
  add(host, MemCategory::kActivations, in.input_staging_bytes);    // the inputs' upload slots
  add(host, MemCategory::kActivations, in.preference_host_bytes);  // preference objectives' rows
  add(host, MemCategory::kData, in.data_host_bytes);               // the data sets, DPO's tables
  add(dev, MemCategory::kActivations, in.preference_step_device_bytes);  // preference step
  add(host, MemCategory::kActivations, in.preference_step_host_bytes);   // its upload slots
  add(dev, MemCategory::kComm, in.comm_transport_bytes);                 // NCCL's own buffers
  add(dev, MemCategory::kActivations,
      int64_t(
          arena_bytes(backward_transients(c, B, T, in.mlp_chunk_tokens, in.checkpointing, act))));
  add(dev, MemCategory::kWorkspace, in.kernel_workspace_bytes);
  if (in.cp.P > 1)
    for (const CpBuffer& b : cp_buffers(c, in.cp, B, in.cp_kernel_workspace_bytes, act,
                                        in.pipeline_slots, in.cp_kept_sets))
      add(b.pool, b.category, b.bytes);
}

// The schedule: forward fills one layer's checkpoints at a time (every layer's when they stay on
// the device), backward frees them from the last layer down. The contents peak at the start of
// the last layer's backward: every checkpoint kept, the model's saved activations (final norm,
// loss) live, the backward transients and the layer's recompute buffers in use; at stage 3 the
// gather buffers hold the layer's bucket and the prefetched.
std::string peak_moment(const PlanInputs& in) {
  const ModelConfig& c = in.model;
  const CheckpointMap slots(c, in.checkpointing, in.checkpoint_placement);
  const std::string kept_text =
      in.checkpointing == Checkpointing::kNone
          ? fmt::format("every layer's saved activations live ({} layers)", c.n_layers)
          : fmt::format(
                "{} of {} layers' checkpoints ({}) kept: {} on the host, {} device slots "
                "in use",
                slots.kept_layers(), c.n_layers, checkpointing_name(in.checkpointing),
                slots.host_layers(), slots.device_slots());
  return fmt::format(
      "from setup on: every buffer is allocated before step 1 and held (the step allocates "
      "nothing); fullest at the backward of layer {}: {}{}",
      c.n_layers - 1, kept_text,
      in.zero_stage == 3
          ? fmt::format(", {} gather buffers in use", zero_gather_buffers(in.prefetch))
          : "");
}

}  // namespace

MemoryPlan plan_memory(const PlanInputs& in) {
  ParamLayout built;
  if (in.layout == nullptr) built = make_param_layout(in.model);
  const ParamLayout& L = in.layout != nullptr ? *in.layout : built;
  const bool lora = in.lora.enabled();
  // The engine's arena: the model, or with LoRA the f32 adapters.
  const LoraLayout lora_layout = lora ? make_lora_layout(in.model, in.lora) : LoraLayout{};
  const ParamLayout& E = lora ? lora_layout.params : L;
  const DType engine_dtype = lora ? DType::kF32 : in.param_dtype;
  const ZeroLayout z = make_zero_layout(E, in.dp, in.bucket_elems,
                                        zero_splits_tables(in.zero_stage, in.split_tables));
  const int64_t pb = int64_t(dtype_size(engine_dtype));
  const int stage = in.zero_stage;
  std::array<CategoryBytes, kNumMemPools> by{};
  auto add = [&](MemPool pool, MemCategory cat, int64_t bytes) {
    if (bytes > 0) by[static_cast<int>(pool)][static_cast<int>(cat)] += bytes;
  };
  const MemPool dev = MemPool::kDevice, host = MemPool::kHost;
  // The ZeRO engine (parallel/zero.cpp), buffer for buffer.
  const int64_t state = stage >= 1 ? z.shard : z.padded_total;
  const ModelStateBytes ms = model_state_bytes(
      z.padded_total, z.shard, stage, shardlm_accounting(engine_dtype, in.offload_optimizer));
  const bool streamed = zero_streams_gradients(stage, in.offload_optimizer);
  add(stage == 3 && in.offload_params ? host : dev, MemCategory::kParams, ms.params);
  // Streamed, the gradient shard is the host copy the optimizer reads; else on the device.
  add(streamed ? host : dev, MemCategory::kGrads, ms.grads);
  add(in.offload_optimizer ? host : dev, MemCategory::kOptimizer, ms.optimizer);  // m, v, master
  if (in.offload_optimizer && !streamed)
    add(host, MemCategory::kHostOffload, state * 4);  // gradients copied out
  if (zero_returns_params_in_pieces(engine_dtype, in.offload_optimizer, in.offload_params))
    add(host, MemCategory::kHostOffload,  // updated parameters on their way to the device
        kZeroParamReturnBuffers * zero_param_return_elems(z, in.bucket_elems) * pb);
  add(host, MemCategory::kHostOffload,  // checkpoint staging: the most of a vector a rank holds
      zero_checkpoint_stage_elems(z, in.bucket_elems) * 4);
  if (in.async_checkpoint)  // the snapshot an asynchronous checkpoint is written from
    add(host, MemCategory::kHostOffload,
        zero_checkpoint_snapshot_bytes(z, size_t(pb), engine_dtype != DType::kF32,
                                       in.async_snapshot_budget));
  if (stage >= 2)
    add_zero_grad_buffers(z, zero_holds_tied_bucket(E, z), streamed, in.reduce_dtype, add);
  if (stage == 3) {
    add(dev, MemCategory::kComm,
        zero_gather_buffers(in.prefetch) * z.max_bucket * pb);              // gather buffers
    if (in.offload_params) add(dev, MemCategory::kComm, z.max_chunk * pb);  // send staging
  }
  add_model_buffers(in, L, lora_layout.params, add);

  MemoryPlan plan;
  plan.by_category = by;
  plan.peak_moment = peak_moment(in);
  for (int p = 0; p < kNumMemPools; ++p)
    for (int64_t b : by[p]) plan.peak_bytes[p] += b;
  return plan;
}

MemoryPlan plan_decoder_memory(const DecoderPlanInputs& in) {
  const ModelConfig& c = in.model;
  const ParamLayout L = make_param_layout(c);
  const DType act = in.activation_dtype;
  const int64_t act_size = int64_t(dtype_size(act));
  std::array<CategoryBytes, kNumMemPools> by{};
  auto add = [&](MemCategory cat, int64_t bytes) {
    by[static_cast<int>(MemPool::kDevice)][static_cast<int>(cat)] += bytes;
  };
  // The model: its parameters (model/owned_store.cpp, no gradients) and rotary tables.
  add(MemCategory::kParams, L.total * int64_t(dtype_size(in.param_dtype)));
  add(MemCategory::kParams, rotary_table_bytes(c));
  // The cache (model/decoder.cpp): every layer's keys and values, and attention_decode's scratch.
  add(MemCategory::kActivations, 2 * c.n_layers * in.max_len * c.kv_dim() * act_size);
  add(MemCategory::kWorkspace, in.decode_workspace_bytes);
  // The runner (model/llama_setup.cpp, forward only over the model's store): its rotary tables, the
  // acquired unit in the activation dtype, one layer's kept input, the work set and the model's
  // saved tensors, the MLP's hidden chunk, the kernels' scratch.
  const int64_t B = 1, T = in.max_chunk;
  add(MemCategory::kParams, rotary_table_bytes(c));
  if (in.param_dtype != act) add(MemCategory::kWorkspace, L.max_unit * act_size);
  const LayerActivationSpecs layer =
      layer_activation_specs(c, B, T, in.mlp_chunk_tokens, Checkpointing::kFull, act);
  add(MemCategory::kCheckpoints, int64_t(arena_bytes(layer.kept)));
  add(MemCategory::kActivations,
      int64_t(arena_bytes(layer.work) +
              arena_bytes(model_saved_activations(c, B, T, Checkpointing::kFull, act))));
  add(MemCategory::kActivations,
      int64_t(arena_bytes(forward_transients(c, B, T, in.mlp_chunk_tokens, act))));
  add(MemCategory::kWorkspace, in.runner_workspace_bytes);

  MemoryPlan plan;
  plan.by_category = by;
  plan.peak_moment = fmt::format(
      "while sampling: the whole model's parameters and a cache of {} positions, prefilled in "
      "chunks of {} tokens",
      in.max_len, in.max_chunk);
  for (int p = 0; p < kNumMemPools; ++p)
    for (int64_t b : by[p]) plan.peak_bytes[p] += b;
  return plan;
}

}  // namespace shardlm
