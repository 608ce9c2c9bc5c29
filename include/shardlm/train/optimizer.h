// AdamW over the model's flat arenas: f32 moments (and f32 master weights when the working
// parameters are bf16), global gradient-norm clipping, the warmup + cosine LR schedule.
#pragma once

#include <cstdint>
#include <vector>

#include "shardlm/backend/backend.h"
#include "shardlm/core/buffer.h"
#include "shardlm/model/llama.h"
#include "shardlm/train/config.h"

namespace shardlm {

// Learning rate at 1-based `step` of `total`: linear warmup to lr, cosine decay to min_lr.
double lr_at(const TrainConfig& cfg, int64_t step, int64_t total);

class AdamW {
 public:
  AdamW(LlamaModel& model, Backend& backend, MemoryLedger& ledger, const TrainConfig& cfg);

  // f32 master weights [total] when params are bf16; empty when params are the master.
  Tensor master() const;
  // Clips by the global gradient norm and updates the weights. Returns the norm before
  // clipping (NaN/inf are returned as is, and the update is skipped).
  double step(double lr);
  int64_t steps_taken() const { return t_; }
  void set_steps_taken(int64_t t) { t_ = t; }
  // The state a checkpoint must hold besides the parameters, each [total] f32:
  // m, v, and the master weights when the parameters are bf16.
  std::vector<Tensor> state() const;

 private:
  struct Range {
    int64_t begin, count;
    bool decay;
  };
  LlamaModel& model_;
  Backend& be_;
  TrainConfig cfg_;
  Buffer m_, v_, master_;  // [total] f32 each (optimizer)
  std::vector<Range> ranges_;
  int64_t t_ = 0;
};

}  // namespace shardlm
