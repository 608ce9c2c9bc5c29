// The memory plan of the single-rank engine: every buffer the model and optimizer allocate,
// from the same tables they allocate from. All buffers live for the whole run, so the peak
// is their sum.
#include "shardlm/plan/plan.h"

#include "shardlm/model/layout.h"

namespace shardlm {

MemoryPlan plan_memory(const PlanInputs& in) {
  const ModelConfig& c = in.model;
  const ParamLayout L = make_param_layout(c);
  const int64_t B = in.micro_batch, T = in.seq_len;
  CategoryBytes dev{};
  auto add = [&](MemCategory cat, int64_t bytes) {
    if (bytes > 0) dev[static_cast<int>(cat)] += bytes;
  };
  add(MemCategory::kParams, L.total * int64_t(dtype_size(in.param_dtype)));
  add(MemCategory::kParams, c.head_dim() / 2 * 4);  // rotary frequencies
  add(MemCategory::kGrads, L.total * 4);
  add(MemCategory::kOptimizer, L.total * 4);  // Adam m
  add(MemCategory::kOptimizer, L.total * 4);  // Adam v
  if (in.param_dtype != DType::kF32) {
    add(MemCategory::kOptimizer, L.total * 4);  // f32 master weights
    add(MemCategory::kWorkspace, std::max(L.max_layer, c.vocab_size * c.dim) * 4);  // staging
  }
  const DType act = DType::kF32;
  add(MemCategory::kActivations,
      int64_t(arena_bytes(layer_saved_activations(c, B, T, act))) * c.n_layers +
          int64_t(arena_bytes(model_saved_activations(c, B, T, act))));
  add(MemCategory::kActivations, int64_t(arena_bytes(backward_transients(c, B, T, act))));
  add(MemCategory::kWorkspace, in.kernel_workspace_bytes);

  MemoryPlan plan;
  plan.by_category[static_cast<int>(MemPool::kDevice)] = dev;
  for (int64_t b : dev) plan.peak_bytes[static_cast<int>(MemPool::kDevice)] += b;
  return plan;
}

}  // namespace shardlm
