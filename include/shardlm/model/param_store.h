// ParamStore: where a LlamaModel's parameters and gradient buffers live, unit by unit (the
// units of ParamLayout: embeddings, each decoder layer, final norm + head). The model asks for
// a unit just before it reads the unit's weights or adds into its gradients and gives it back
// right after, so a store may keep the whole model in place (the model's own store), hand out
// slices of a replicated arena, or gather a sharded unit on demand and reduce its gradients as
// soon as they are complete (ZeRO, in parallel/). The model knows nothing of which.
#pragma once

#include "shardlm/core/tensor.h"

namespace shardlm {

class ParamStore {
 public:
  enum class Pass { kForward, kBackward };

  virtual ~ParamStore() = default;

  // The model starts a forward (also evaluation) or a backward walk over the units: forward
  // walks them in ascending order, backward in descending order (a store may prefetch).
  virtual void begin_pass(Pass pass) = 0;
  // The walk is over: nothing the model was handed is in use any more.
  virtual void end_pass() = 0;

  // Unit u's parameters, [unit_size(u)] in the model's parameter dtype, valid until the
  // matching release_params(u). Acquisitions nest (a unit may be acquired twice).
  virtual Tensor acquire_params(int u) = 0;
  virtual void release_params(int u) = 0;

  // Unit u's f32 gradient buffer [unit_size(u)]: the model adds this micro-batch's gradients
  // into it. release_grads(u) says they are complete for this micro-batch.
  virtual Tensor acquire_grads(int u) = 0;
  virtual void release_grads(int u) = 0;
};

}  // namespace shardlm
