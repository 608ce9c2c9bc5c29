// How ZeRO splits the flat parameter arena over the N ranks of a data-parallel group. Pure
// arithmetic over model/layout: the ZeRO engine (parallel/) allocates from these numbers and the
// planner predicts from them, so planned and measured bytes agree by construction.
//
// The arena's units (embeddings, each decoder layer, final norm + head) are grouped, in order,
// into buckets: a bucket takes the next unit while it stays within `bucket_elems` (a unit is
// never split, so a unit larger than that is a bucket of its own). With tied embeddings unit 0
// is always alone, because its gradients are written at both ends of backward. A bucket is the
// unit of communication: its gradients are reduced in one collective as soon as backward has
// finished its units, and at stage 3 its parameters are gathered in one collective.
//
// Each bucket is padded to a multiple of N and cut into N equal chunks; rank r owns chunk r of
// every bucket. Replicated arenas (params at stages 0-2, grads at stages 0-1) are laid out
// padded ("padded" offsets), so that a bucket's chunks are contiguous and a collective works
// in place; a rank's shard is its chunks of all buckets, concatenated ("shard" offsets).
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "shardlm/core/dtype.h"
#include "shardlm/model/layout.h"

namespace shardlm {

struct ZeroBucket {
  int first_unit = 0, last_unit = 0;  // inclusive
  int live_units = 0;                 // units of first..last with elements (not empty)
  int64_t begin = 0, end = 0;         // flat element range: units first..last
  int64_t chunk = 0;                  // ceil((end - begin) / N): elements each rank owns
  int64_t padded_begin = 0;           // offset in the padded layout (N * chunk elements)
  int64_t shard_begin = 0;            // offset of a rank's chunk in its shard
  int64_t size() const { return end - begin; }
};

struct ZeroLayout {
  int world = 1;
  std::vector<ZeroBucket> buckets;
  std::vector<int> unit_bucket;  // unit -> bucket
  int64_t padded_total = 0;      // sum over buckets of N * chunk
  int64_t shard = 0;             // sum of chunks: the elements every rank owns
  int64_t max_bucket = 0;        // max N * chunk
  int64_t max_chunk = 0;

  // Padded offset of flat element `flat` (which must lie in a bucket).
  int64_t padded_offset(int64_t flat) const;
};

// Buffers the engine keeps in flight, so the planner counts what the engine allocates:
// stage >= 2 rotates bucket gradient buffers (two; three with tied embeddings, whose bucket is
// held through all of backward); stage 3 gathers into prefetch + 2 buffers (the bucket in use,
// the head's while the tied embeddings serve as LM head, and those prefetched).
inline int zero_grad_buffers(bool tied_embeddings) { return tied_embeddings ? 3 : 2; }
inline int zero_gather_buffers(int prefetch) { return prefetch + 2; }

// Stage >= 2 on one data-parallel rank: a reduce-scatter over one rank is the identity, so a
// gradient buffer's reduced chunk is its send buffer itself (the f32 bucket, or its bf16 wire
// rounding) and a bf16 chunk is widened back into the f32 bucket buffer: no chunk buffers.
inline bool zero_reduces_in_place(int world) { return world == 1; }

// Stage >= 2 with the optimizer offloaded streams the gradients to the host: each bucket's
// reduced chunk is copied out while backward goes on and accumulated into the host gradient
// shard the optimizer reads, so no gradient shard is kept on the device. Stages 0-1 keep their
// replicated device arena (that is what those stages are) and copy the reduced gradients
// to the host at the step.
inline bool zero_streams_gradients(int stage, bool offload_optimizer) {
  return stage >= 2 && offload_optimizer;
}

// The optimizer offloaded with bf16 parameters on the device (not offload_params): the host
// steps the shard a piece at a time and sends each piece's parameters, rounded to bf16, to the
// device through one of two rotating pinned buffers of a piece each (while one piece's copy
// runs the next is stepped and rounded), so no shard-sized host copy of them exists. A piece is
// a bucket's worth of elements, or less when no chunk is that large.
inline constexpr int kZeroParamReturnBuffers = 2;
inline int64_t zero_param_return_elems(const ZeroLayout& z, int64_t bucket_elems) {
  return std::min(z.max_chunk, bucket_elems);
}
inline bool zero_returns_params_in_pieces(DType param_dtype, bool offload_optimizer,
                                          bool offload_params) {
  return offload_optimizer && param_dtype != DType::kF32 && !offload_params;
}

// bucket_elems >= 1; world >= 1.
ZeroLayout make_zero_layout(const ParamLayout& layout, int world, int64_t bucket_elems);

}  // namespace shardlm
