// The optimizer's settings: the warmup + cosine learning-rate schedule and the AdamW
// hyper-parameters of a step. The update itself runs in the ZeRO engine (parallel/zero.h),
// over whatever part of the parameters this rank owns, on the device or on the host.
#pragma once

#include <cstdint>

#include "shardlm/backend/backend.h"
#include "shardlm/config/config.h"

namespace shardlm {

// Learning rate at 1-based `step` of `total`: linear warmup to lr, cosine decay to min_lr.
double lr_at(const TrainConfig& cfg, int64_t step, int64_t total);

// AdamW hyper-parameters of a step at learning rate lr (weight decay applies to matrices only;
// the engine sets the step count and the clipping scale).
AdamWHyper adamw_hyper(const TrainConfig& cfg, double lr);

}  // namespace shardlm
