// The DeepSpeed ds_config.json mapping: a DeepSpeed config becomes --set style overrides of
// shardlm keys, applied after the shardlm config file and before the user's --set. Every key
// it cannot honour is named in a warning or an error; nothing is ignored silently. It reads no
// data and starts nothing: it only translates and checks.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "shardlm/config/config.h"

namespace shardlm {

// The policy, key by key ("auto", anywhere, means "keep shardlm's value": no override).
//
// Mapped:
//   train_micro_batch_size_per_gpu -> train.micro_batch
//   gradient_accumulation_steps -> train.grad_accum
//   gradient_clipping -> train.grad_clip
//   steps_per_print -> log.every_steps
//   bf16.enabled (or bfloat16.enabled) -> precision.param "bf16" (true) | "fp32" (false)
//   zero_optimization.stage -> zero.stage
//   zero_optimization.offload_optimizer.device "cpu" | "none" -> zero.offload_optimizer
//   zero_optimization.offload_param.device "cpu" | "none" -> zero.offload_params
//   (and the deprecated cpu_offload / cpu_offload_params booleans)
//   zero_optimization.overlap_comm -> zero.overlap_comm
//   communication_data_type "fp32" | "bf16" -> zero.reduce_dtype (bf16 from stage 2; "fp16"
//     is an error)
//   zero_optimization.reduce_bucket_size -> zero.reduce_bucket_bytes,
//   zero_optimization.allgather_bucket_size -> zero.allgather_bucket_bytes: DeepSpeed counts
//     these in elements; shardlm counts bytes, at 4 bytes per element (f32 gradients), so a
//     bucket holds the same number of elements as DeepSpeed's.
//   optimizer {type Adam | AdamW (any case), params lr, betas, eps, weight_decay} -> train.lr,
//     train.beta1, train.beta2, train.eps, train.weight_decay. "Adam" is decoupled AdamW in
//     DeepSpeed too (adam_w_mode defaults to true).
//   scheduler WarmupLR: warmup_max_lr -> train.lr, warmup_num_steps -> train.warmup_steps,
//     train.min_lr = train.lr (constant after warmup);
//   scheduler WarmupDecayLR: as WarmupLR, and warmup_min_lr -> train.min_lr (the floor);
//   scheduler WarmupCosineLR: warmup_num_steps -> train.warmup_steps, train.min_lr =
//     cos_min_ratio (DeepSpeed's default 0.0001) x train.lr.
//   tensor_parallel.autotp_size -> parallel.tp; sequence_parallel_size -> parallel.cp with
//     parallel.cp_kind "ulysses" (DeepSpeed's sequence parallelism is Ulysses).
//   train_batch_size: a constraint, train_batch_size = micro x accum x dp (dp = world size /
//     (tp x cp x pp)). Given with one of micro/accum missing or "auto", that one is derived, as
//     DeepSpeed does (with both missing, train.micro_batch is kept and train.grad_accum
//     derived: the micro-batch fixes the memory). Missing or "auto" values are shardlm's.
//     It is checked again on the final config, after the user's --set.
//
// Warnings (the result of training is the same; the key only tunes DeepSpeed's machinery, or
// shardlm's behaviour differs only in memory or speed, or the schedule's shape is approximated):
//   contiguous_gradients false (shardlm's gradients always live in one contiguous arena, so
//   there is nothing to turn off); sub_group_size (shardlm's optimizer steps run per arena
//   range, never on a flat copy); reduce_scatter / allgather_partitions false;
//   stage3_prefetch_bucket_size, stage3_max_live_parameters, stage3_max_reuse_distance
//   (shardlm prefetches whole layers: zero.prefetch_layers); stage3_param_persistence_threshold
//   (stage 3 shards every parameter, small ones too: memory only);
//   stage3_gather_16bit_weights_on_model_save; the other ZeRO tuning keys (round_robin_gradients,
//   mics_*, zero_hpz_partition_size, ...); offload pin_memory, buffer_count, buffer_size,
//   max_in_cpu, ratio, fast_init; optimizer params fused, foreach, capturable, set_grad_none;
//   warmup_type "log" (DeepSpeed's default: shardlm warms up linearly), warmup_min_lr > 0 and
//   warmup_min_ratio > 0 (shardlm warms up from 0), WarmupDecayLR's linear decay (shardlm's is
//   a cosine between the same end points), total_num_steps other than train.max_steps (shardlm
//   decays over the run's length), last_batch_iteration; bf16 sub-keys other than enabled;
//   prescale_gradients, gradient_predivide_factor, data_types (shardlm scales and accumulates
//   in fp32); monitoring and profiling (wall_clock_breakdown,
//   memory_breakdown, flops_profiler, tensorboard, wandb, csv_monitor, comet, comms_logger,
//   dump_state, timers); activation_checkpointing (use memory.checkpointing); checkpoint, aio,
//   nebula (shardlm's own checkpoints); autotuning (use shardlm plan); pipeline; compile;
//   zero_allow_untested_optimizer, zero_force_ds_cpu_optimizer; hybrid_engine; sparse_gradients;
//   and any key this table does not know. Keys whose value asks for nothing (false, "auto",
//   {"enabled": false}, the DeepSpeed default) give no warning; sub-keys of a disabled section
//   (fp16.loss_scale when fp16 is off) are not read, as in DeepSpeed.
//
// Errors (they change what is computed, or cannot be done):
//   fp16.enabled true (fp16 with loss scaling is not supported: use bf16); amp.enabled true;
//   offload device "nvme"; optimizer types other than Adam/AdamW; Adam with adam_w_mode false
//   and a non-zero weight decay (L2-coupled decay); amsgrad true; bias_correction false;
//   other optimizer params; scheduler types other than the three above; elasticity,
//   curriculum_learning, data_efficiency, progressive_layer_drop enabled; sparse_attention;
//   compression_training; quantize_training enabled; zero_quantized_weights,
//   zero_quantized_nontrainable_weights, zero_quantized_gradients true; train_batch_size not
//   equal to micro x accum x dp; values of the wrong type or out of range.
//
// A DeepSpeed config is given on the command line only (`shardlm train --deepspeed FILE`),
// not by a key of the shardlm config: a run's settings then always come from the files the
// command names.

struct DeepSpeedMapping {
  std::vector<std::string> overrides;  // "zero.stage=2", in --set syntax
  std::vector<std::string> sources;    // the DeepSpeed key of each override (same order)
  std::vector<std::string> warnings;   // each names the DeepSpeed key it is about
  int64_t train_batch_size = 0;        // the explicit train_batch_size (0: absent or "auto")
  int64_t world_size = 1;              // the processes the batch arithmetic assumed
};

// Maps a parsed ds_config. `base` is the shardlm config as its file and the user's --set give
// it (load_run_config_unvalidated): "auto" and missing values, and the batch arithmetic, read
// it. Throws Error(kConfig) naming the DeepSpeed key for the errors listed above.
DeepSpeedMapping map_deepspeed_config(const nlohmann::json& ds, const RunConfig& base,
                                      int64_t world_size);

// Throws Error(kConfig) with the three numbers when the final config's train.micro_batch x
// train.grad_accum x dp differs from the mapping's train_batch_size.
void check_deepspeed_batch(const DeepSpeedMapping& mapping, const RunConfig& cfg);

// The whole load: the config file, then the DeepSpeed file's overrides, then the user's --set;
// validated, and the batch checked. Warnings are appended to `warnings` before anything can
// fail, so that a caller can print them with the error. Errors name the DeepSpeed file, and a
// validation error about a key the DeepSpeed file set names the DeepSpeed key it came from.
RunConfig load_run_config_with_deepspeed(const std::string& config_path,
                                         const std::string& deepspeed_path,
                                         const std::vector<std::string>& overrides,
                                         int64_t world_size, std::vector<std::string>& warnings);

}  // namespace shardlm
