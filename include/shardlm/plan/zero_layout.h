// How ZeRO splits the flat parameter arena over the N ranks of a data-parallel group. Pure
// arithmetic over model/layout: the ZeRO engine (parallel/) allocates from these numbers and the
// planner predicts from them, so planned and measured bytes agree by construction.
//
// The arena's units (embeddings, each decoder layer, final norm + head) are cut into parts: a
// unit is one part, except that, where the layout splits tables (zero_splits_tables), the
// embeddings' unit and the untied LM head's are cut into pieces of rows (model/layout.h
// unit_pieces) no larger than zero_table_piece_elems: a decoder layer or `bucket_elems`,
// whichever is larger, so that no buffer is sized by the 128K-row vocabulary tables. Parts are
// grouped, in order, into buckets: a bucket takes the next part while it stays within
// `bucket_elems` (a part is never split, so a larger part is a bucket of its own). With tied
// embeddings each part of unit 0 is a bucket alone, because its gradients are written at both
// ends of backward: whole, the unit's gradients stay held from the head to the embedding; in
// pieces, each piece's bucket is reduced twice a micro-batch (after the head, after the
// embedding). A bucket is the unit of communication: its gradients are reduced in one
// collective as soon as backward has finished its parts, and at stage 3 its parameters are
// gathered in one collective.
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

// Piece `piece` of unit `unit` (0 for a whole unit): flat elements [begin, end).
struct ZeroPart {
  int unit = 0, piece = 0;
  int64_t begin = 0, end = 0;
};

struct ZeroBucket {
  int first_part = 0, last_part = 0;  // inclusive
  int live_parts = 0;                 // parts of first..last with elements (not empty)
  int64_t begin = 0, end = 0;         // flat element range: parts first..last
  int64_t chunk = 0;                  // ceil((end - begin) / N): elements each rank owns
  int64_t padded_begin = 0;           // offset in the padded layout (N * chunk elements)
  int64_t shard_begin = 0;            // offset of a rank's chunk in its shard
  int64_t size() const { return end - begin; }
};

struct ZeroLayout {
  int world = 1;
  std::vector<ZeroBucket> buckets;
  std::vector<ZeroPart> parts;      // in arena order
  std::vector<int> unit_part;       // unit -> its first part
  std::vector<int> part_bucket;     // part -> bucket
  std::vector<int64_t> piece_rows;  // unit -> rows of its table a piece (0: whole)
  int64_t padded_total = 0;         // sum over buckets of N * chunk
  int64_t shard = 0;                // sum of chunks: the elements every rank owns
  int64_t max_bucket = 0;           // max N * chunk
  int64_t max_chunk = 0;

  // Padded offset of flat element `flat` (which must lie in a bucket).
  int64_t padded_offset(int64_t flat) const;
  int part_of(int unit, int piece) const;  // the part of a unit's piece (checked)
  int bucket_of(int unit, int piece) const { return part_bucket[part_of(unit, piece)]; }
};

// Tables are cut into pieces from stage 2 on, where the engine's buffers are buckets (stage 2
// gradients, stage 3 parameters too); `split_tables` is ZeroOptions::split_tables.
inline bool zero_splits_tables(int stage, bool split_tables) { return split_tables && stage >= 2; }

// The most elements of a table's piece: the largest decoder layer or the bucket size, whichever
// is larger (a bucket never holds less than a layer, so smaller pieces would save nothing).
inline int64_t zero_table_piece_elems(const ParamLayout& layout, int64_t bucket_elems) {
  return std::max(layout.max_layer, bucket_elems);
}

// Buffers the engine keeps in flight, so the planner counts what the engine allocates:
// stage >= 2 rotates bucket gradient buffers (two; three when the whole tied embeddings' bucket
// is held through all of backward); stage 3 gathers into prefetch + 2 buffers (the bucket in
// use, the head's while the tied embeddings serve as LM head, and those prefetched).
inline int zero_grad_buffers(bool holds_tied_bucket) { return holds_tied_bucket ? 3 : 2; }
// Whether backward holds unit 0's bucket throughout: tied embeddings handed out whole.
inline bool zero_holds_tied_bucket(const ParamLayout& layout, const ZeroLayout& z) {
  return layout.lm_head_unit == 0 && z.piece_rows[0] == 0;
}
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

// Checkpoints move the state between the engine's buffers and the files through one host
// staging buffer of this many elements (4 bytes each: the largest state dtype): a rank's chunk
// of a bucket, or a bucket's worth when chunks are larger. No rank holds more of a vector.
inline int64_t zero_checkpoint_stage_elems(const ZeroLayout& z, int64_t bucket_elems) {
  return std::max<int64_t>(1, std::min(z.max_chunk, bucket_elems));
}

// An asynchronous checkpoint's snapshot holds the rank's share (a chunk of each bucket, zero.h's
// save_owned) of the first of the state vectors, in the order parameters (param_bytes an
// element), Adam m, v (f32) and, with `master`, the f32 master weights, that fit `budget` bytes
// together (0: every one); the rest are written synchronously at the save. Held for the run, so
// that a save allocates nothing. How many vectors, and their bytes:
inline int zero_checkpoint_snapshot_vectors(const ZeroLayout& z, size_t param_bytes, bool master,
                                            int64_t budget) {
  const int vectors = master ? 4 : 3;
  if (budget <= 0) return vectors;
  int64_t bytes = 0;
  for (int i = 0; i < vectors; ++i) {
    bytes += z.shard * int64_t(i == 0 ? param_bytes : 4);
    if (bytes > budget) return i;
  }
  return vectors;
}
inline int64_t zero_checkpoint_snapshot_bytes(const ZeroLayout& z, size_t param_bytes, bool master,
                                              int64_t budget) {
  const int n = zero_checkpoint_snapshot_vectors(z, param_bytes, master, budget);
  return n == 0 ? 0 : z.shard * int64_t(param_bytes + 4 * size_t(n - 1));
}

// bucket_elems >= 1; world >= 1; split_tables: zero_splits_tables.
ZeroLayout make_zero_layout(const ParamLayout& layout, int world, int64_t bucket_elems,
                            bool split_tables = false);

}  // namespace shardlm
