// LlamaModel's own arenas and the offloaded base's device slots (owned_store.h).
#include "owned_store.h"

#include "shardlm/core/check.h"

namespace shardlm {

LlamaModel::OwnedStore::OwnedStore(const ParamLayout& layout, DType param_dtype, bool with_grads,
                                   bool on_host, bool split_tables, Backend& backend,
                                   MemoryLedger& ledger)
    : layout_(layout), dtype_(param_dtype), be_(backend) {
  const size_t pb = dtype_size(param_dtype);
  params_ = Buffer(backend, ledger, MemCategory::kParams,
                   on_host ? MemPool::kHost : MemPool::kDevice, layout.total * pb);
  if (with_grads)
    grads_ = Buffer(backend, ledger, MemCategory::kGrads, MemPool::kDevice, layout.total * 4);
  SHARDLM_CHECK(!(with_grads && on_host), "an offloaded base is frozen: it has no gradients");
  for (int u = 0; u < int(layout.units.size()); ++u) {
    // In device memory every unit is handed out whole; offloaded, the tables larger than a
    // layer in pieces, so that a slot holds a layer.
    const int64_t rows =
        on_host && split_tables ? table_piece_rows(layout, u, layout.max_layer) : 0;
    piece_rows_.push_back(rows);
    unit_part_.push_back(int(parts_.size()));
    for (const UnitPiece& p : unit_pieces(layout, u, rows)) parts_.push_back({p.begin, p.end});
  }
  if (on_host)
    for (Slot& slot : slots_)
      slot.buf = Buffer(backend, ledger, MemCategory::kParams, MemPool::kDevice,
                        offloaded_base_slot_elems(layout, split_tables) * pb);
}

Tensor LlamaModel::OwnedStore::grads() const {
  SHARDLM_CHECK(!grads_.empty(), "grads(): this model holds parameters only");
  return grads_.view(DType::kF32, {layout_.total});
}

Tensor LlamaModel::OwnedStore::acquire_params(int u) {
  SHARDLM_CHECK(piece_rows_[u] == 0, "unit {} is handed out in pieces", u);
  return acquire_piece_params(u, 0);
}

Tensor LlamaModel::OwnedStore::acquire_grads(int u) {
  return grads().rows(layout_.units[u].begin, layout_.unit_size(u));
}

Tensor LlamaModel::OwnedStore::acquire_piece_params(int u, int piece) {
  const int p = unit_part_[u] + piece;
  SHARDLM_CHECK(
      p < int(parts_.size()) && (u + 1 == int(unit_part_.size()) || p < unit_part_[u + 1]),
      "unit {} has no piece {}", u, piece);
  if (slots_[0].buf.empty()) return part_params(p);
  Slot& slot = stage(p, /*prefetch=*/false);
  ++slot.holds;
  be_.wait_fence(slot.fence);
  const int next = pass_ == Pass::kForward ? p + 1 : p - 1;
  if (next >= 0 && next < int(parts_.size())) stage(next, /*prefetch=*/true);
  return slot.buf.view(dtype_, {parts_[p].end - parts_[p].begin});
}

void LlamaModel::OwnedStore::release_piece_params(int u, int piece) {
  const int p = unit_part_[u] + piece;
  for (Slot& slot : slots_)
    if (slot.part == p && slot.holds > 0) {
      --slot.holds;
      return;
    }
}

LlamaModel::OwnedStore::Slot& LlamaModel::OwnedStore::stage(int p, bool prefetch) {
  Slot* free = nullptr;
  for (Slot& slot : slots_) {
    if (slot.part == p) return slot;
    if (slot.holds == 0 && (free == nullptr || free->part >= 0)) free = &slot;
  }
  if (free == nullptr) {
    SHARDLM_CHECK(prefetch, "the offloaded base's two device slots are both in use (part {})", p);
    return slots_[0];
  }
  free->part = p;
  free->fence =
      be_.copy_async(part_params(p), free->buf.view(dtype_, {parts_[p].end - parts_[p].begin}));
  return *free;
}

}  // namespace shardlm
