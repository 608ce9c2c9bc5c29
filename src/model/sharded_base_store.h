// LlamaModel's store for a dense frozen LoRA base sharded over ZeRO-3's ranks
// (lora_base_sharded, model/sharded_base.h): a rank holds its chunk of every decoder layer and
// the whole embeddings' and final norm's units, in the parameter dtype. Acquiring a layer
// all-gathers its chunks into a one-layer device gather buffer (every rank of the group
// acquires the same layers in the same order: the walks are in lockstep) and hands the layer
// out from there; the buffer keeps the last layer, so the backward's first layer (the
// forward's last) is not gathered twice. One decoder layer at a time. With
// LoraConfig::offload_base both arrays are in host memory (pinned on CUDA) and each acquisition
// stages its part (a layer's chunk, a whole unit or a piece of a table's rows) into one of two
// device slots, the next part of the walk fetched ahead on the copy stream as the unsharded
// offloaded base's (owned_store.h); a layer is then gathered from its slot. Private to
// src/model.
#pragma once

#include <array>

#include "shardlm/comm/communicator.h"
#include "shardlm/core/buffer.h"
#include "shardlm/model/llama.h"
#include "shardlm/model/sharded_base.h"

namespace shardlm {

class LlamaModel::ShardedBaseStore final : public ParamStore {
 public:
  // on_host: the arrays in host memory, staged through two device slots (split_tables: the
  // tables in pieces of rows; false under tensor parallelism). shards: the ZeRO group.
  ShardedBaseStore(const ParamLayout& layout, DType param_dtype, bool on_host, bool split_tables,
                   Communicator& shards, Backend& backend, MemoryLedger& ledger);

  // Unit u from f32 host values [unit_size(u)]: a layer's chunk of this rank kept, a whole unit
  // converted.
  void set_unit_values(int u, const float* values);

  void begin_pass(Pass pass) override { pass_ = pass; }
  void end_pass() override {}
  Tensor acquire_params(int u) override;
  void release_params(int u) override { release_piece_params(u, 0); }
  Tensor acquire_grads(int u) override;
  void release_grads(int) override {}
  int64_t piece_rows(int u) const override { return on_host_ ? H_.piece_rows[u] : 0; }
  Tensor acquire_piece_params(int u, int piece) override;
  void release_piece_params(int u, int piece) override;

 private:
  struct Slot {
    Buffer buf;          // [slot_elems] param dtype (params, device)
    int part = -1;       // the part it holds (or is being copied in)
    int holds = 0;       // acquisitions not yet released
    uint64_t fence = 0;  // its copy
  };

  Tensor whole(int64_t at, int64_t n) const {
    return whole_.view(dtype_, {S_.whole_elems}).rows(at, n);
  }
  Tensor shard(int64_t at, int64_t n) const {
    return shard_.view(dtype_, {S_.shard_elems}).rows(at, n);
  }
  // Part p's elements in its host array (on_host).
  Tensor part_source(int p) const;
  Tensor slot_view(const Slot& slot) const {
    return slot.buf.view(dtype_, {H_.parts[slot.part].n});
  }
  // Decoder layer u gathered into the gather buffer from this rank's chunk.
  void gather(int u, const Tensor& chunk);
  // The slot holding part p, or a free one it is copied into; a prefetch gives up when both
  // slots are held.
  Slot& stage(int p, bool prefetch);
  void prefetch_after(int p);
  int part_of(int u, int piece) const;

  const ParamLayout& layout_;
  DenseShardLayout S_;
  DType dtype_;
  bool on_host_;
  DenseShardHostLayout H_;  // on_host only
  Communicator& shards_;
  Backend& be_;
  Buffer whole_;               // [whole_elems] param dtype (params)
  Buffer shard_;               // [shard_elems] this rank's chunks (params)
  Buffer gather_;              // [world * max_chunk] a layer gathered (comm, device)
  std::array<Slot, 2> slots_;  // on_host only
  int gathered_unit_ = -1;     // the layer the gather buffer holds
  int holds_ = 0;              // its acquisitions not yet released
  Pass pass_ = Pass::kForward;
};

}  // namespace shardlm
