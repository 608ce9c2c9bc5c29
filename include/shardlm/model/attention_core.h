// AttentionCore: the attention of one decoder layer over the tokens this rank holds, as the model
// calls it between the q/k/v projections (after RoPE) and the output projection. The model's own
// core runs the backend kernel over its whole sequence; context parallelism (parallel/context)
// implements it over a group of ranks that each hold a shard of every sequence, exchanging keys,
// values or heads as it needs. The model knows nothing of which.
#pragma once

#include "shardlm/backend/backend.h"

namespace shardlm {

class AttentionCore {
 public:
  virtual ~AttentionCore() = default;

  // layer: the decoder layer calling (a core may keep per-layer state: a KV cache).
  // q [B, Tl, Hq, Dh]; k, v [B, Tl, Hkv, Dh]: this rank's Tl tokens of each of B rows.
  // seg_start [B, Tl] i32: for each local token, the index in its FULL row where its document
  // starts (a token attends the tokens of its row from there up to itself).
  // docs: the same documents as spans of the B whole rows (Backend's DocumentSpans), when the
  // batch's fill gave them (never under context parallelism, whose cores see shards); a core
  // may run them as variable-length sequences or ignore them.
  // out [B, Tl, Hq, Dh] overwritten; lse [B, Hq, Tl] f32 overwritten: saved for backward, its
  // layout private to the core (the model only hands it back).
  virtual void forward(int layer, const Tensor& q, const Tensor& k, const Tensor& v,
                       const Tensor& seg_start, const DocumentSpans& docs, const Tensor& out,
                       const Tensor& lse) = 0;
  // dout [B, Tl, Hq, Dh]; dq, dk, dv overwritten, shaped like q, k, v: the gradients of this
  // rank's tokens, with every rank's queries' contributions to this rank's keys and values.
  virtual void backward(int layer, const Tensor& q, const Tensor& k, const Tensor& v,
                        const Tensor& seg_start, const DocumentSpans& docs, const Tensor& out,
                        const Tensor& lse, const Tensor& dout, const Tensor& dq, const Tensor& dk,
                        const Tensor& dv) = 0;
};

}  // namespace shardlm
