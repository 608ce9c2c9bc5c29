// The learning-rate schedule and AdamW settings (optimizer.h).
#include "shardlm/train/optimizer.h"

#include <algorithm>
#include <cmath>
#include <numbers>

namespace shardlm {

double lr_at(const TrainConfig& cfg, int64_t step, int64_t total) {
  if (cfg.warmup_steps > 0 && step <= cfg.warmup_steps)
    return cfg.lr * static_cast<double>(step) / cfg.warmup_steps;
  const int64_t decay_steps = std::max<int64_t>(1, total - cfg.warmup_steps);
  const double progress =
      std::clamp(static_cast<double>(step - cfg.warmup_steps) / decay_steps, 0.0, 1.0);
  return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1.0 + std::cos(std::numbers::pi * progress));
}

AdamWHyper adamw_hyper(const TrainConfig& cfg, double lr) {
  AdamWHyper h;
  h.lr = float(lr);
  h.beta1 = float(cfg.beta1);
  h.beta2 = float(cfg.beta2);
  h.eps = float(cfg.eps);
  h.weight_decay = float(cfg.weight_decay);
  return h;
}

}  // namespace shardlm
