// LlamaModel's store for a dense frozen LoRA base sharded over ZeRO-3's ranks
// (lora_base_sharded, model/sharded_base.h): a rank holds its chunk of every decoder layer and
// the whole embeddings' and final norm's units, in the parameter dtype. Acquiring a layer
// all-gathers its chunks into a layer-sized device gather buffer (every rank of the group
// acquires the same layers in the same order: the walks are in lockstep) and hands the layer
// out from there; a buffer keeps its layer until another gather needs it, so the backward's
// first layer (the forward's last) is not gathered twice. One decoder layer in use at a time.
// With prefetch (LoraConfig::prefetch_base) a second buffer receives the walk's next layer
// (forward and recompute: the one after, backward: the one before), its all-gather started
// asynchronously when the layer before it is acquired and waited for when it is acquired; the
// decisions follow the walk only, so every rank starts the same gathers. With
// LoraConfig::offload_base both arrays are in host memory (pinned on CUDA) and each acquisition
// stages its part (a layer's chunk, a whole unit or a piece of a table's rows) into one of two
// device slots, the next part of the walk fetched ahead on the copy stream as the unsharded
// offloaded base's (owned_store.h); a layer is then gathered from its slot, which a gather
// started ahead holds until it has completed. Private to src/model.
#pragma once

#include <array>
#include <memory>
#include <vector>

#include "shardlm/comm/communicator.h"
#include "shardlm/core/buffer.h"
#include "shardlm/model/llama.h"
#include "shardlm/model/sharded_base.h"

namespace shardlm {

class LlamaModel::ShardedBaseStore final : public ParamStore {
 public:
  // on_host: the arrays in host memory, staged through two device slots (split_tables: the
  // tables in pieces of rows; false under tensor parallelism). shards: the ZeRO group.
  // prefetch: a second gather buffer, the walk's next layer gathered ahead.
  ShardedBaseStore(const ParamLayout& layout, DType param_dtype, bool on_host, bool split_tables,
                   bool prefetch, Communicator& shards, Backend& backend, MemoryLedger& ledger);

  // Unit u from f32 host values [unit_size(u)]: a layer's chunk of this rank kept, a whole unit
  // converted.
  void set_unit_values(int u, const float* values);

  void begin_pass(Pass pass) override;
  // Waits for a gather started ahead: no collective outlives the walk.
  void end_pass() override;
  void begin_recompute() override { recompute_ = true; }
  void end_recompute() override { recompute_ = false; }
  Tensor acquire_params(int u) override;
  void release_params(int u) override { release_piece_params(u, 0); }
  Tensor acquire_grads(int u) override;
  void release_grads(int) override {}
  int64_t piece_rows(int u) const override { return on_host_ ? H_.piece_rows[u] : 0; }
  Tensor acquire_piece_params(int u, int piece) override;
  void release_piece_params(int u, int piece) override;
  const DenseShardGatherCounts& gather_counts() const { return counts_; }

 private:
  struct Slot {
    Buffer buf;          // [slot_elems] param dtype (params, device)
    int part = -1;       // the part it holds (or is being copied in)
    int holds = 0;       // acquisitions not yet released
    uint64_t fence = 0;  // its copy
  };
  struct Gather {
    Buffer buf;                          // [world * max_chunk] a layer (param dtype, comm, device)
    int unit = -1;                       // the layer it holds, or is being gathered into it
    int holds = 0;                       // acquisitions not yet released
    uint64_t used = 0;                   // when last gathered into or handed out
    bool ahead = false;                  // gathered ahead, not acquired since
    Slot* source = nullptr;              // on_host: the slot a gather in flight reads (held)
    std::unique_ptr<CommHandle> flight;  // a gather started ahead, not waited for yet
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
  // The gather buffer holding decoder layer u (or gathering it), or null.
  Gather* holding(int u);
  // A buffer for a new gather (ahead: started ahead), not in use; null when there is none.
  Gather* victim(bool ahead);
  // Decoder layer u gathered into g from this rank's chunk (with the base on the host staged
  // into a slot first): blocking, or started ahead. false: ahead, but no slot was free.
  bool gather(int u, Gather& g, bool ahead);
  // Waits for the gathers started ahead; their slots are free again.
  void finish_ahead();
  Tensor gathered(const Gather& g, int64_t n) const {
    return g.buf.view(dtype_, {S_.gather_elems()}).rows(0, n);
  }
  // The layer the walk acquires after unit u's part p (-1: none, or not a layer); ascending
  // in a forward pass and in recompute, descending in backward.
  int next_layer(int u, int p) const;
  // The walk's next layer gathered ahead (prefetch), and the part after it staged.
  void prefetch_layer_after(int u, int p);
  // The slot holding part p, or a free one it is copied into; null when both are held.
  Slot* stage(int p);
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
  std::array<Slot, 2> slots_;  // on_host only
  // After the slots: destroyed first, a gather in flight waited for before what it reads goes.
  std::vector<Gather> gathers_;  // dense_shard_gather_buffers(prefetch)
  DenseShardGatherCounts counts_;
  uint64_t clock_ = 0;
  Pass pass_ = Pass::kForward;
  bool in_pass_ = false;  // gathers start ahead only inside a walk
  bool recompute_ = false;
  int furthest_unit_ = -1;  // the walk's highest unit so far (the tied head's unit 0 comes late)
};

}  // namespace shardlm
