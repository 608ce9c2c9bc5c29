// The step-time model and the `--fit` search of `shardlm plan`.
//
// estimate_step() turns a configuration into one rank's step time from stated rates: compute
// (the model's training FLOPs plus what activation checkpointing recomputes) at a sustained
// TFLOP/s, ZeRO, context-, tensor- and pipeline-parallel traffic over a link of given
// bandwidth, the pipeline's 1F1B bubble, device<->host traffic and the host optimizer for the
// offload options. Arithmetic only; the rates are assumptions the output states, not
// measurements.
//
// fit_search() enumerates ZeRO stage and offload, activation checkpointing and its offload,
// tensor-parallel degree (up to 8, dividing the heads, kv heads and MLP), context-parallel
// degree (up to 64) and kind, micro-batch (the global batch kept: grad_accum
// follows) and the MLP chunk; plans each with plan_memory(), keeps those within the budgets, and
// ranks them by estimated tokens/s, then by less communication, less recompute, fewer changes to
// the given configuration and less memory.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "shardlm/backend/backend.h"
#include "shardlm/config/config.h"
#include "shardlm/plan/plan.h"

namespace shardlm {

struct CostRates {
  // A sustained bf16 rate an H100 SXM reaches on large GEMMs in training (about 40% of its
  // 989 TFLOP/s dense peak).
  static constexpr double kDefaultTflops = 400;
  double tflops = kDefaultTflops;  // per rank, sustained
  double link_gbs = 100;           // GB/s each rank sends to the others (NVLink-class: 100-450)
  double host_link_gbs = 25;       // GB/s between a rank's device and host (PCIe 5 x16 sustained)
  double host_adam_gparams = 2;    // AdamW on the host, 10^9 parameters per second per rank
};

struct StepEstimate {
  int64_t tokens_per_step = 0;  // every rank's rows of one optimizer step
  double flops_per_step = 0;    // the model's training FLOPs (all ranks), no recompute
  double recompute_flops = 0;   // per rank, per step: what checkpointing runs twice
  double dp_bytes = 0;          // per rank, per step: ZeRO collectives (sent)
  double cp_bytes = 0;          // per rank, per step: context-parallel exchanges (sent)
  double tp_bytes = 0;          // per rank, per step: tensor-parallel all-reduces (sent)
  double pp_bytes = 0;          // per rank, per step: pipeline activations and gradients (sent)
  double host_bytes = 0;        // per rank, per step: device <-> host (offload)
  // Per rank, per step: LoRA DPO's reference forward (the adapters off: one more forward of
  // every row, train.objective = "dpo" with lora.rank > 0), part of the busy time.
  double reference_flops = 0;
  // Seconds per step of one rank: compute and recompute; communication and host transfers
  // as the step exposes them (overlapped traffic costs only what exceeds the compute).
  double compute_s = 0, recompute_s = 0, comm_s = 0, host_s = 0;
  double reference_s = 0;  // reference_flops' time and reference_fill_s (in step_s)
  // Full fine-tuning DPO (lora.rank = 0): the reference pass before the first step, a forward of
  // every training pair, in seconds per step of an epoch (one forward of a step's rows, with
  // ZeRO-3's gathers); not in step_s, since it runs once per run.
  double reference_pass_s = 0;
  // Under pipeline stages, DPO's reference sweep's fill and drain: the forwards of m
  // micro-batches through pp stages one after another take m + pp - 1 stage-forward times. With
  // LoRA the (pp - 1) extra are in every step (part of reference_s); with full fine-tuning the
  // pass is one sweep, so they come once per pass, beside reference_pass_s. 0 without stages.
  double reference_fill_s = 0;
  // The 1F1B pipeline's idle time: (pp - 1) / m of a stage's busy time (0 without pp).
  double bubble_s = 0;
  double step_s = 0;
  double tokens_per_s = 0;  // all ranks
};

StepEstimate estimate_step(const RunConfig& cfg, int64_t world_size, const CostRates& rates);

struct FitBudget {
  int64_t device_bytes = 0;  // per rank; must be > 0
  int64_t host_bytes = 0;    // per rank; 0 = no limit
};

struct FitCandidate {
  RunConfig cfg;
  std::vector<std::pair<std::string, std::string>> sets;  // key, value: what differs from base
  MemoryPlan plan;
  StepEstimate est;
  bool fits = false;
};

struct FitResult {
  std::optional<FitCandidate> chosen;
  // The best configuration of each other strategy (ZeRO stage and offload, checkpointing,
  // context parallelism), best first: fitting ones by tokens/s, then those over the budget.
  std::vector<FitCandidate> runner_ups;
  int64_t searched = 0;  // configurations planned
  int64_t invalid = 0;   // combinations the config rules reject (heads, seq_len, batch)
  int64_t fitting = 0;
};

// Throws Error(kConfig) when budget.device_bytes <= 0.
FitResult fit_search(const RunConfig& base, int64_t world_size, const FitBudget& budget,
                     const CostRates& rates, const Backend& backend);

// Why `other` ranks below `chosen`, in words ("does not fit: ...", "12% slower: more
// recompute (+0.8 s per step)"). `chosen` is only read when `other` fits.
std::string fit_loss_reason(const FitCandidate& chosen, const FitCandidate& other,
                            const FitBudget& budget);

// The --set arguments of a candidate ("--set zero.stage=2 --set ..."), and the same keys as
// a nested JSON config fragment.
std::string fit_set_line(const FitCandidate& c);
nlohmann::json fit_config_fragment(const FitCandidate& c);

}  // namespace shardlm
