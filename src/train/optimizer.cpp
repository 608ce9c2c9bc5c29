// AdamW step over contiguous parameter ranges grouped by whether weight decay applies.
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

AdamW::AdamW(LlamaModel& model, Backend& backend, MemoryLedger& ledger, const TrainConfig& cfg)
    : model_(model), be_(backend), cfg_(cfg) {
  const int64_t total = model.layout().total;
  m_ = Buffer(backend, ledger, MemCategory::kOptimizer, MemPool::kDevice, total * 4);
  v_ = Buffer(backend, ledger, MemCategory::kOptimizer, MemPool::kDevice, total * 4);
  if (model.options().param_dtype != DType::kF32)
    master_ = Buffer(backend, ledger, MemCategory::kOptimizer, MemPool::kDevice, total * 4);
  // Merge adjacent entries with the same decay flag into as few ranges as possible.
  for (const auto& e : model.layout().entries) {
    const int64_t n = e.shape.numel();
    if (!ranges_.empty() && ranges_.back().decay == e.decay &&
        ranges_.back().begin + ranges_.back().count == e.offset) {
      ranges_.back().count += n;
    } else {
      ranges_.push_back({e.offset, n, e.decay});
    }
  }
}

Tensor AdamW::master() const {
  return master_.empty() ? Tensor() : master_.view(DType::kF32, {model_.layout().total});
}

std::vector<Tensor> AdamW::state() const {
  const int64_t total = model_.layout().total;
  std::vector<Tensor> s = {m_.view(DType::kF32, {total}), v_.view(DType::kF32, {total})};
  if (!master_.empty()) s.push_back(master());
  return s;
}

double AdamW::step(double lr) {
  const Tensor grads = model_.grads();
  const double norm = std::sqrt(be_.sum_squares(grads));
  if (!std::isfinite(norm)) return norm;
  ++t_;
  float clip = 1.f;
  if (cfg_.grad_clip > 0 && norm > cfg_.grad_clip) clip = float(cfg_.grad_clip / (norm + 1e-6));
  const Tensor weights = master_.empty() ? model_.params() : master();
  const Tensor m = m_.view(DType::kF32, {model_.layout().total});
  const Tensor v = v_.view(DType::kF32, {model_.layout().total});
  for (const Range& r : ranges_) {
    AdamWHyper h;
    h.lr = float(lr);
    h.beta1 = float(cfg_.beta1);
    h.beta2 = float(cfg_.beta2);
    h.eps = float(cfg_.eps);
    h.weight_decay = r.decay ? float(cfg_.weight_decay) : 0.f;
    h.step = t_;
    h.grad_scale = clip;
    be_.adamw_step(weights.rows(r.begin, r.count), grads.rows(r.begin, r.count),
                   m.rows(r.begin, r.count), v.rows(r.begin, r.count), h);
  }
  if (!master_.empty()) be_.convert(master(), model_.params());
  return norm;
}

}  // namespace shardlm
