// The DeepSpeed keys shardlm reads but does not honour (warnings) or cannot honour (errors),
// each with the reason the message gives: the data half of deepspeed.h's policy. Internal to
// shardlm_train (deepspeed.cpp); the keys that map onto shardlm keys are in deepspeed.cpp.
#pragma once

#include <string_view>

namespace shardlm::deepspeed_keys {

// A key that is read but not honoured (a warning when its value asks for something) or that
// cannot be honoured (an error when its value asks for something).
struct KnownKey {
  std::string_view key;
  std::string_view quiet;  // JSON of the value that asks for nothing; "" = false/{enabled:false}
  std::string_view why;
};

inline constexpr std::string_view kMonitoring =
    "shardlm writes metrics.jsonl, summary.json and memory_rank*.json to log.dir (log.profile "
    "adds the time per op family)";
inline constexpr std::string_view kOwnCheckpoints =
    "shardlm writes its own checkpoints (checkpoint.every_steps, checkpoint.keep_last), which "
    "load on any topology";
inline constexpr std::string_view kFp32Reduce =
    "shardlm averages and accumulates gradients in fp32, where scaling order and wire type make "
    "no difference";
inline constexpr std::string_view kZeroTuning =
    "it tunes DeepSpeed's ZeRO implementation; shardlm's result is the same";
inline constexpr std::string_view kLayerPrefetch =
    "shardlm gathers and prefetches whole layers: zero.prefetch_layers bounds what is live";
inline constexpr std::string_view kHostBuffers = "shardlm sizes and manages its own host buffers";
inline constexpr std::string_view kChangesData =
    "it changes which tokens are trained and in what order; shardlm's data order is fixed by "
    "train.seed and every token is seen once per epoch. Remove it";

inline constexpr KnownKey kIgnoredTopLevel[] = {
    {"wall_clock_breakdown", "", kMonitoring},
    {"memory_breakdown", "", kMonitoring},
    {"dump_state", "", kMonitoring},
    {"flops_profiler", "", kMonitoring},
    {"wandb", "", kMonitoring},
    {"csv_monitor", "", kMonitoring},
    {"comet", "", kMonitoring},
    {"comms_logger", "", kMonitoring},
    {"timers", "", kMonitoring},
    {"activation_checkpointing", "", "choose recomputation with memory.checkpointing"},
    {"checkpoint", "", kOwnCheckpoints},
    {"nebula", "", kOwnCheckpoints},
    {"aio", "", "shardlm offloads to host memory only, never to NVMe"},
    {"autotuning", "", "use `shardlm plan --fit` to choose a configuration that fits"},
    {"pipeline", "", "set parallel.pp for pipeline stages"},
    {"compile", "", "shardlm is compiled ahead of time"},
    {"graph_harvesting", "", "CUDA graphs are the backend's choice"},
    {"zero_allow_untested_optimizer", "",
     "shardlm always runs its own AdamW, on the device or on the host as zero.offload_optimizer "
     "says"},
    {"zero_force_ds_cpu_optimizer", "",
     "shardlm always runs its own AdamW, on the device or on the host as zero.offload_optimizer "
     "says"},
    {"hybrid_engine", "", "it serves generation inside RLHF loops; use `shardlm generate`"},
    {"sparse_gradients", "", "shardlm's embedding gradients are dense"},
    {"prescale_gradients", "", kFp32Reduce},
    {"gradient_predivide_factor", "1.0", kFp32Reduce},
    {"seq_parallel_communication_data_type", "\"fp32\"", kFp32Reduce},
    {"data_types", R"({"grad_accum_dtype": "fp32"})", kFp32Reduce},
    {"disable_allgather", "", "shardlm picks its collectives per ZeRO stage"},
    {"eigenvalue", "", "it serves quantization schedules, which shardlm does not have"},
    {"use_data_before_expert_parallelism", "", "shardlm has no expert parallelism"},
};

inline constexpr KnownKey kRejectedTopLevel[] = {
    {"amp", "",
     "apex AMP (fp16 with loss scaling) is not supported; use bf16 (\"bf16\": {\"enabled\": "
     "true}), which needs no loss scaling"},
    {"elasticity", "",
     "elastic training changes the batch size as ranks come and go; shardlm trains with a fixed "
     "train.micro_batch x train.grad_accum x data-parallel size. Remove it"},
    {"curriculum_learning", "", kChangesData},
    {"data_efficiency", "", kChangesData},
    {"progressive_layer_drop", "",
     "it skips layers during training, which changes the updates; shardlm trains every layer "
     "every step. Remove it"},
    {"sparse_attention", "",
     "shardlm's attention is dense causal (flash) attention; remove it to train with that"},
    {"compression_training", "",
     "it quantizes or prunes the model during training, which shardlm does not do. Remove it"},
    {"quantize_training", "",
     "it quantizes the model during training, which shardlm does not do. Remove it"},
};

inline constexpr KnownKey kIgnoredZero[] = {
    {"contiguous_gradients", "true",
     "shardlm's gradients always live in one contiguous arena, so there is nothing to turn off"},
    {"reduce_scatter", "true",
     "shardlm picks the gradient collective per ZeRO stage; the reduced gradients are the same"},
    {"allgather_partitions", "true", "shardlm picks the parameter collective per ZeRO stage"},
    {"sub_group_size", "",
     "it is not needed: shardlm's optimizer steps run per arena range, never on a flattened copy "
     "of a sub-group"},
    {"stage3_prefetch_bucket_size", "", kLayerPrefetch},
    {"stage3_max_live_parameters", "", kLayerPrefetch},
    {"stage3_max_reuse_distance", "", kLayerPrefetch},
    {"stage3_param_persistence_threshold", "",
     "stage 3 shards every parameter, small ones too (this changes memory only, and shardlm plan "
     "counts it)"},
    {"stage3_gather_16bit_weights_on_model_save", "", kOwnCheckpoints},
    {"stage3_gather_fp16_weights_on_model_save", "", kOwnCheckpoints},
    {"elastic_checkpoint", "", kOwnCheckpoints},
    {"load_from_fp32_weights", "true", "shardlm always resumes from its f32 master weights"},
    {"ignore_unused_parameters", "true", "every parameter of shardlm's model is used"},
    {"round_robin_gradients", "", kZeroTuning},
    {"legacy_stage1", "", kZeroTuning},
    {"memory_efficient_linear", "true", kZeroTuning},
    {"stage3_module_granularity_threshold", "0", kZeroTuning},
    {"use_multi_rank_bucket_allreduce", "true", kZeroTuning},
    {"stage3_use_all_reduce_for_fetch_params", "", kZeroTuning},
    {"pipeline_loading_checkpoint", "", kZeroTuning},
    {"override_module_apply", "true", kZeroTuning},
    {"log_trace_cache_warnings", "", kZeroTuning},
    {"mics_shard_size", "-1",
     "MiCS sharding groups are not available; shardlm shards over all data-parallel ranks"},
    {"mics_hierarchical_params_gather", "",
     "MiCS sharding groups are not available; shardlm shards over all data-parallel ranks"},
    {"zero_hpz_partition_size", "1",
     "hierarchical partitioning (ZeRO++ hpZ) is not available; shardlm shards over all "
     "data-parallel ranks"},
    {"cpu_offload_use_pin_memory", "", kHostBuffers},
};

inline constexpr KnownKey kRejectedZero[] = {
    {"zero_quantized_weights", "",
     "quantized communication (ZeRO++) changes the numbers; shardlm communicates in full "
     "precision. Remove it"},
    {"zero_quantized_nontrainable_weights", "",
     "quantized communication (ZeRO++) changes the numbers; shardlm communicates in full "
     "precision. Remove it"},
    {"zero_quantized_gradients", "",
     "quantized communication (ZeRO++) changes the numbers; shardlm communicates in full "
     "precision. Remove it"},
};

inline constexpr KnownKey kIgnoredOffload[] = {
    {"pin_memory", "", kHostBuffers},
    {"buffer_count", "", kHostBuffers},
    {"buffer_size", "", kHostBuffers},
    {"max_in_cpu", "", kHostBuffers},
    {"fast_init", "", kHostBuffers},
    {"pipeline_read", "", kHostBuffers},
    {"pipeline_write", "", kHostBuffers},
    {"pipeline", "", kHostBuffers},
    {"nvme_path", "null", kHostBuffers},
    {"ratio", "1.0", "shardlm offloads the whole optimizer state, not a fraction of it"},
};

inline constexpr KnownKey kIgnoredOptimizerParams[] = {
    {"fused", "", "shardlm's AdamW is one fused pass already"},
    {"foreach", "", "shardlm's AdamW is one fused pass already"},
    {"capturable", "", "shardlm's AdamW is one fused pass already"},
    {"differentiable", "", "shardlm's AdamW is one fused pass already"},
    {"set_grad_none", "", "shardlm's gradient arena is zeroed in place"},
    {"torch_adam", "", "shardlm runs its own AdamW either way"},
};

}  // namespace shardlm::deepspeed_keys
