// Model-state bytes of one data-parallel rank (parameters, gradients, optimizer state) under
// ZeRO stages 0-3, for a stated accounting: how many bytes each parameter costs in each
// category. Pure arithmetic: the planner counts shardlm's own model states through it, and the
// same function reproduces published figures (the ZeRO paper, DeepSpeed's estimators) when
// given their accounting. Buffers, activations and where the bytes live (device or host) are
// the planner's business, not this file's.
#pragma once

#include <cstdint>

#include "shardlm/core/dtype.h"

namespace shardlm {

// Bytes per parameter, by category. Stage 1 shards the optimizer state, stage 2 also the
// gradients, stage 3 also the parameters; an unsharded category is replicated on every rank.
struct ModelStateAccounting {
  int64_t param_bytes = 0;       // the copy forward and backward read
  int64_t grad_bytes = 0;        // the gradients backward accumulates into
  int64_t grad_shard_bytes = 0;  // at stage 1 only: a reduced-gradient shard beside the full
                                 // gradients (from stage 2 on that shard is the gradients)
  int64_t optimizer_bytes = 0;   // K: master weights and moments
};

// The ZeRO paper (Rajbhandari et al. 2020, section 3.1): mixed-precision Adam with fp16
// parameters and gradients (2 + 2) and K = 12 bytes of fp32 master weights, momentum and
// variance.
inline constexpr ModelStateAccounting kZeroPaperAccounting{2, 2, 0, 12};

// DeepSpeed's estimate_zero2_model_states_mem_needs (stages 1 and 2, no offload): 2 bytes of
// 16-bit parameters replicated, and 18 bytes sharded, which its comment splits as 16-bit (2)
// and fp32 (4) gradients, fp32 master weights (4) and Adam's moments (8).
inline constexpr ModelStateAccounting kDeepSpeedZero2Accounting{2, 6, 0, 12};
// estimate_zero3_model_states_mem_needs (no offload) counts the same 18 bytes per parameter,
// all sharded, with the 16-bit parameter shard among them: so one of the 2-byte items of the
// stage-2 split is not there. We read it as no 16-bit gradient partition (its gradients are
// reduced from bucket buffers into the fp32 partition); the estimator's separate
// 4 * largest_layer_params (the gathered 16-bit parameters and gradients of the largest
// layer) is a buffer, not a model state.
inline constexpr ModelStateAccounting kDeepSpeedZero3Accounting{2, 4, 0, 12};

// What shardlm's ZeRO engine keeps (parallel/zero, as plan_memory counts it): parameters in
// `param_dtype`; fp32 gradients, replicated through stage 1, plus at stage 1 an fp32 shard of the
// reduced gradients; Adam's fp32 moments, and fp32 master weights when parameters are
// not fp32 or when the optimizer is offloaded (the host then keeps its own fp32 copy). Where the
// bytes live is the planner's: from stage 2 with the optimizer offloaded the gradient shard is
// in host memory (zero_streams_gradients), with the optimizer state.
ModelStateAccounting shardlm_accounting(DType param_dtype, bool offload_optimizer);

struct ModelStateBytes {
  int64_t params = 0, grads = 0, optimizer = 0;  // per rank
  int64_t total() const { return params + grads + optimizer; }
};

// `replicated_elems` is what a rank holds of an unsharded category, `shard_elems` what it owns
// of a sharded one (ZeroLayout's padded_total and shard; zero_stage in 0..3).
ModelStateBytes model_state_bytes(int64_t replicated_elems, int64_t shard_elems, int zero_stage,
                                  const ModelStateAccounting& a);

// `params` split evenly over `world` ranks, each owning ceil(params / world) (no buckets).
ModelStateBytes model_state_bytes(int64_t params, int world, int zero_stage,
                                  const ModelStateAccounting& a);

}  // namespace shardlm
