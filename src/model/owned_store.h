// LlamaModel's own ParamStore: the whole parameter and gradient arenas, in layout order. A
// frozen base offloaded (LoraConfig::offload_base) lives in the host pool and each acquired
// unit is staged into one of two device slots: the unit in use and the next one in the walk's
// order, fetched ahead on the copy stream (the compute waits for a slot's copy only when it
// reads the slot). The slots are as large as the largest decoder layer: the embeddings' and
// the LM head's tables, when larger, are handed out in pieces of rows (ParamStore::piece_rows),
// except on a tensor-parallel shard (its slots hold the largest unit, the tables whole).
// The base never changes, so a slot's contents stay valid from one walk to the next. Private to
// src/model.
#pragma once

#include <array>
#include <vector>

#include "shardlm/core/buffer.h"
#include "shardlm/model/llama.h"

namespace shardlm {

class LlamaModel::OwnedStore final : public ParamStore {
 public:
  // split_tables: offloaded (on_host), the tables larger than a layer in pieces; off for a
  // tensor-parallel shard, whose slots then hold its largest unit.
  OwnedStore(const ParamLayout& layout, DType param_dtype, bool with_grads, bool on_host,
             bool split_tables, Backend& backend, MemoryLedger& ledger);
  Tensor params() const { return params_.view(dtype_, {layout_.total}); }
  Tensor grads() const;

  void begin_pass(Pass pass) override { pass_ = pass; }
  void end_pass() override {}
  Tensor acquire_params(int u) override;
  void release_params(int u) override { release_piece_params(u, 0); }
  Tensor acquire_grads(int u) override;
  void release_grads(int) override {}
  int64_t piece_rows(int u) const override { return piece_rows_[u]; }
  Tensor acquire_piece_params(int u, int piece) override;
  void release_piece_params(int u, int piece) override;

 private:
  struct Part {
    int64_t begin = 0, end = 0;  // arena elements
  };
  struct Slot {
    Buffer buf;          // [offloaded_base_slot_elems] param dtype (params, device)
    int part = -1;       // the part it holds (or is being copied in)
    int holds = 0;       // acquisitions not yet released
    uint64_t fence = 0;  // its copy
  };

  Tensor part_params(int p) const {
    return params().rows(parts_[p].begin, parts_[p].end - parts_[p].begin);
  }
  // The slot holding part p, or a free one it is copied into; a prefetch gives up when both
  // slots are held.
  Slot& stage(int p, bool prefetch);

  const ParamLayout& layout_;
  DType dtype_;
  Backend& be_;
  Buffer params_;                    // [total] param dtype (params; device, or host when offloaded)
  Buffer grads_;                     // [total] f32 (grads)
  std::vector<Part> parts_;          // the units and pieces, in arena order
  std::vector<int> unit_part_;       // unit -> its first part
  std::vector<int64_t> piece_rows_;  // unit -> rows of a piece (0: whole)
  std::array<Slot, 2> slots_;
  Pass pass_ = Pass::kForward;
};

}  // namespace shardlm
