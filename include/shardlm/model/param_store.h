// ParamStore: where a LlamaModel's parameters and gradient buffers live, unit by unit (the
// units of ParamLayout: embeddings, each decoder layer, final norm + head). The model asks for
// a unit just before it reads the unit's weights or adds into its gradients and gives it back
// right after, so a store may keep the whole model in place (the model's own store), hand out
// slices of a replicated arena, or gather a sharded unit on demand and reduce its gradients as
// soon as they are complete (ZeRO, in parallel/). The model knows nothing of which.
#pragma once

#include <cstdint>

#include "shardlm/core/check.h"
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
  // Within a backward pass, checkpoint recompute runs layers forward again from a kept input:
  // between these calls the walk ascends, as in a forward pass, up to the layer whose backward
  // comes next. A store that prefetches in the walk's direction may follow it.
  virtual void begin_recompute() {}
  virtual void end_recompute() {}

  // Unit u's parameters, [unit_size(u)] in the model's parameter dtype, valid until the
  // matching release_params(u). Acquisitions nest (a unit may be acquired twice).
  virtual Tensor acquire_params(int u) = 0;
  virtual void release_params(int u) = 0;

  // Unit u's f32 gradient buffer [unit_size(u)]: the model adds this micro-batch's gradients
  // into it. release_grads(u) says they are complete for this micro-batch.
  virtual Tensor acquire_grads(int u) = 0;
  virtual void release_grads(int u) = 0;

  // A store whose buffers are smaller than the embeddings' or the LM head's [V, D] table hands
  // that unit out in pieces of piece_rows(u) rows (model/layout.h unit_pieces), 0 = whole (the
  // default). The model then acquires and releases piece k of the unit instead of the unit,
  // and walks a unit's pieces like units: forward in ascending, backward in descending order.
  // Piece k's parameters and gradients are [pieces[k].end - pieces[k].begin].
  virtual int64_t piece_rows(int u) const {
    (void)u;
    return 0;
  }
  virtual Tensor acquire_piece_params(int u, int piece) {
    check_whole(u, piece);
    return acquire_params(u);
  }
  virtual void release_piece_params(int u, int piece) {
    check_whole(u, piece);
    release_params(u);
  }
  virtual Tensor acquire_piece_grads(int u, int piece) {
    check_whole(u, piece);
    return acquire_grads(u);
  }
  virtual void release_piece_grads(int u, int piece) {
    check_whole(u, piece);
    release_grads(u);
  }

 private:
  void check_whole(int u, int piece) const {
    SHARDLM_CHECK_KIND(ErrorKind::kInternal, piece == 0 && piece_rows(u) == 0,
                       "piece {} of unit {}: this store hands the unit out whole", piece, u);
  }
};

}  // namespace shardlm
