// The step-time model behind `shardlm plan --fit` and its estimate (fit.h's estimate_step),
// shared inside src/train by the search (fit.cpp): the model's size tables computed once, and
// one configuration's step estimated from them.
#pragma once

#include <map>

#include "shardlm/model/config.h"
#include "shardlm/model/layout.h"
#include "shardlm/model/tensor_shard.h"
#include "shardlm/planner/fit.h"

namespace shardlm {

// What the estimate needs of the model's size tables, computed once per model.
struct ModelCosts {
  double params = 0;             // every parameter
  double layer_matmul = 0;       // decoder-layer matmul weights, summed over layers
  double layer_down = 0;         // of which the MLP down projections
  double train_flops_token = 0;  // train_flops() per token, attention apart
  double train_flops_pair = 0;   // train_flops() per visible pair

  explicit ModelCosts(const ModelConfig& c) : model(c) {
    const ParamLayout L = make_param_layout(c);
    params = double(L.total);
    for (const auto& e : L.entries) {
      if (e.layer < 0 || e.shape.rank() != 2) continue;
      layer_matmul += double(e.shape.numel());
      if (e.name.find("down_proj") != std::string::npos) layer_down += double(e.shape.numel());
    }
    train_flops_token = train_flops(c, 1, 0);
    train_flops_pair = train_flops(c, 0, 1);
  }
  // Parameters of one tensor-parallel rank's shard (tp_shard_config; Error(kConfig) when tp
  // does not divide the heads or the MLP).
  double shard_params(int64_t tp) const {
    if (tp == 1) return params;
    auto it = shard_params_.find(tp);
    if (it == shard_params_.end())
      it = shard_params_.emplace(tp, double(make_param_layout(tp_shard_config(model, tp)).total))
               .first;
    return it->second;
  }
  ModelConfig model;

 private:
  mutable std::map<int64_t, double> shard_params_;  // by tp: the search asks again and again
};

// estimate_step() with the model's size tables given (the search keeps one ModelCosts).
StepEstimate estimate_step_with(const RunConfig& cfg, int64_t world_size, const CostRates& rates,
                                const ModelCosts& mc);

}  // namespace shardlm
