// Model-state bytes per rank under ZeRO (model_state.h).
#include "shardlm/plan/model_state.h"

#include "shardlm/core/check.h"

namespace shardlm {

ModelStateAccounting shardlm_accounting(DType param_dtype, bool offload_optimizer) {
  const bool master = param_dtype != DType::kF32 || offload_optimizer;
  return {int64_t(dtype_size(param_dtype)), 4, 4, 8 + (master ? 4 : 0)};
}

ModelStateBytes model_state_bytes(int64_t replicated_elems, int64_t shard_elems, int zero_stage,
                                  const ModelStateAccounting& a) {
  SHARDLM_CHECK(zero_stage >= 0 && zero_stage <= 3, "zero stage {} must be 0, 1, 2 or 3",
                zero_stage);
  SHARDLM_CHECK(replicated_elems >= 0 && shard_elems >= 0, "element counts {} and {} must be >= 0",
                replicated_elems, shard_elems);
  auto elems = [&](int sharded_from) {
    return zero_stage >= sharded_from ? shard_elems : replicated_elems;
  };
  ModelStateBytes b;
  b.params = a.param_bytes * elems(3);
  b.grads = a.grad_bytes * elems(2) + (zero_stage == 1 ? a.grad_shard_bytes * shard_elems : 0);
  b.optimizer = a.optimizer_bytes * elems(1);
  return b;
}

ModelStateBytes model_state_bytes(int64_t params, int world, int zero_stage,
                                  const ModelStateAccounting& a) {
  SHARDLM_CHECK(world >= 1, "world {} must be >= 1", world);
  return model_state_bytes(params, (params + world - 1) / world, zero_stage, a);
}

}  // namespace shardlm
