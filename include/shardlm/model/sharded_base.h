// Where a dense (f32 or bf16) frozen LoRA base sharded over ZeRO-3's ranks keeps each part of
// the parameter arena (lora_base_sharded): each decoder layer cut into one chunk per rank, a
// rank holding its chunk of every layer and gathering a layer's chunks into a device buffer
// when the model acquires it; the embeddings' unit and the final norm's (with an untied LM
// head) stay whole on every rank, as an NF4 base's dense parts do. Pure arithmetic like
// model/layout: the store (src/model/sharded_base_store.h) allocates from this table and the
// planner sums it.
#pragma once

#include <cstdint>
#include <vector>

#include "shardlm/model/layout.h"

namespace shardlm {

// Whether ZeRO shards a frozen LoRA base (dense or NF4): stage 3 over more than one rank.
inline bool lora_base_sharded(int zero_stage, int64_t world) {
  return zero_stage == 3 && world > 1;
}

struct DenseShardLayout {
  std::vector<int64_t> whole_at;     // unit -> its element offset in the whole array (kept whole)
  std::vector<int64_t> chunk_at;     // unit -> its chunk's element offset in the shard (layers)
  std::vector<int64_t> chunk_elems;  // unit -> elements of one chunk (0: a unit kept whole)
  int64_t whole_elems = 0;           // the units kept whole, parameter dtype
  int64_t shard_elems = 0;           // a rank's chunks of every layer, parameter dtype
  int64_t max_chunk = 0;
  int64_t world = 1;
  bool sharded(int u) const { return chunk_elems[u] > 0; }
  // The gather buffer: world x the largest chunk (a layer, the last chunk padded).
  int64_t gather_elems() const { return world * max_chunk; }
};
// A decoder layer of `L.unit_size(u)` elements is cut into chunks of ceil(size / world).
DenseShardLayout make_dense_shard_layout(const ParamLayout& L, int64_t world);

// Gather buffers (DenseShardLayout::gather_elems each, comm, device): the layer in use, and
// with prefetch (LoraConfig::prefetch_base) the walk's next layer, gathered while it computes.
inline int dense_shard_gather_buffers(bool prefetch) { return prefetch ? 2 : 1; }

// What the store gathered since it was made: every all-gather of a layer it started, those
// started ahead of the walk (prefetch), and of these the ones the walk then acquired.
struct DenseShardGatherCounts {
  int64_t gathers = 0;
  int64_t ahead = 0;
  int64_t ahead_used = 0;
};

// The sharded base in host memory (LoraConfig::offload_base): each acquisition stages one part
// into one of two device slots. A layer's part is this rank's chunk (gathered from the slot);
// a whole unit's part is the unit, or with split_tables its table in pieces of rows no larger
// than an unsharded layer (as the unsharded offloaded base's, layout.h unit_pieces), handed out
// from the slot.
struct DenseShardPart {
  int unit = 0;
  int piece = 0;
  int64_t at = 0;  // its first element in its host array: the shard (a chunk) or the whole one
  int64_t n = 0;   // elements
  bool chunk = false;
};
struct DenseShardHostLayout {
  std::vector<DenseShardPart> parts;  // in arena order
  std::vector<int> unit_part;         // unit -> its first part
  std::vector<int64_t> piece_rows;    // unit -> rows of a table piece (0: whole)
  int64_t slot_elems = 0;             // one device slot: the largest part
};
DenseShardHostLayout make_dense_shard_host_layout(const ParamLayout& L, const DenseShardLayout& S,
                                                  bool split_tables);

}  // namespace shardlm
