// LlamaModel's store for a frozen LoRA base in NF4 (LoraConfig::nf4_base, model/nf4_base.h):
// the dense parts in the parameter dtype, the decoder projections as NF4 codes and absmax, and
// a one-layer workspace in the parameter dtype. The three arrays live on the device, or with
// LoraConfig::offload_base in host memory (pinned on CUDA), whence each acquisition stages its
// part (Nf4HostLayout: a layer's absmax, dense elements and codes; a dense unit or a piece of a
// table's rows) into one of two device slots: the part in use and the next one in the walk's
// order, fetched ahead on the copy stream, as the offloaded dense base does (owned_store.h).
// Acquiring a decoder layer dequantizes its projections into the workspace
// (Backend::nf4_dequantize) and copies its norms and biases beside them, so the layer's code
// reads the same flat unit as from any store; the workspace keeps the last layer, so the
// backward's first layer (the forward's last) is not dequantized (nor staged) twice. A dense
// unit or piece is handed out from where it lies: the device array or its slot. Sharded over
// ZeRO-3's ranks (Nf4ShardLayout), a rank holds its chunk of each layer's absmax and codes (on
// the device, or in host memory staged with the layer's dense elements through a slot) and
// acquiring a layer all-gathers them (every rank of the group acquires the same layers in the
// same order: the walks are in lockstep) into a device gather buffer, dequantized from there;
// the dense parts stay whole. One decoder layer at a time. Private to src/model.
#pragma once

#include <array>

#include "shardlm/comm/communicator.h"
#include "shardlm/core/buffer.h"
#include "shardlm/model/llama.h"
#include "shardlm/model/nf4_base.h"

namespace shardlm {

class LlamaModel::Nf4Store final : public ParamStore {
 public:
  // on_host: the arrays in host memory, staged through two device slots (split_tables: the
  // tables in pieces of rows; false under tensor parallelism). shards: the group the codes and
  // absmax are sharded over (ZeRO-3, nf4_base_sharded), or null.
  Nf4Store(const ParamLayout& layout, DType param_dtype, bool on_host, bool split_tables,
           Communicator* shards, Backend& backend, MemoryLedger& ledger);

  // Unit u from f32 host values: dense parts converted, projections quantized on the host, or
  // taken from `given` (by their first element) as they are.
  void set_unit_values(int u, const float* values, std::span<const Nf4Matrix> given);

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
    Buffer buf;          // [slot_bytes] (params, device)
    int part = -1;       // the part it holds (or is being copied in)
    int holds = 0;       // acquisitions not yet released
    uint64_t fence = 0;  // its copy
  };
  // Where a layer's stored pieces are read from: the arrays (device) or a slot holding its part
  // (offset: the array index the view's first element has).
  struct Source {
    Tensor absmax, dense, codes;
    int64_t absmax_at = 0, dense_at = 0, code_at = 0;
  };

  Tensor dense(const Nf4Segment& s) const {
    return dense_.view(dtype_, {N_.dense_elems}).rows(s.dense_at, s.n);
  }
  Source arrays() const;
  Source slot_source(const Slot& slot) const;
  // Layer u's chunks gathered from the ranks (sharded) out of `held`: the arrays, or the slot
  // holding its part (the chunk in its absmax range); the dense parts read from `held`.
  Source gathered(int u, const Source& held);
  // Layer u's absmax and codes [absmax | codes] into this rank's chunk (sharded).
  void set_shard(int u, const std::vector<float>& absmax, const std::vector<uint8_t>& codes);
  // Decoder layer u's projections dequantized and its dense elements copied into the workspace.
  void fill_workspace(int u, const Source& src);
  // The slot holding part p, or a free one it is copied into; a prefetch gives up when both
  // slots are held.
  Slot& stage(int p, bool prefetch);
  void prefetch_after(int p);
  int part_of(int u, int piece) const;

  const ParamLayout& layout_;
  Nf4BaseLayout N_;
  DType dtype_;
  bool on_host_;
  Nf4HostLayout H_;  // on_host only
  Communicator* shards_;
  Nf4ShardLayout S_;  // shards_ only
  Backend& be_;
  Buffer dense_;               // [dense_elems] param dtype (params)
  Buffer codes_;               // [code_bytes] u8 (params)
  Buffer absmax_;              // [absmax_values] f32 (params)
  Buffer shard_;               // [shard_bytes] this rank's chunks (params; sharded)
  Buffer gather_;              // [world * max_chunk] a layer's chunks gathered (comm; sharded)
  Buffer workspace_;           // [workspace_elems] param dtype: the dequantized layer (workspace)
  std::array<Slot, 2> slots_;  // on_host only
  int workspace_unit_ = -1;    // the layer the workspace holds
  int holds_ = 0;              // its acquisitions not yet released
  Pass pass_ = Pass::kForward;
};

}  // namespace shardlm
