// The dense sharded LoRA base's store (sharded_base_store.h): keep this rank's chunks at load,
// stage a part from host memory when the base is offloaded, gather a decoder layer on acquire.
#include "sharded_base_store.h"

#include <algorithm>
#include <vector>

#include "shardlm/core/check.h"

namespace shardlm {

LlamaModel::ShardedBaseStore::ShardedBaseStore(const ParamLayout& layout, DType param_dtype,
                                               bool on_host, bool split_tables,
                                               Communicator& shards, Backend& backend,
                                               MemoryLedger& ledger)
    : layout_(layout),
      S_(make_dense_shard_layout(layout, shards.size())),
      dtype_(param_dtype),
      on_host_(on_host),
      shards_(shards),
      be_(backend) {
  SHARDLM_CHECK(shards.size() > 1, "a LoRA base is sharded over more than one rank ({} ranks)",
                shards.size());
  const size_t pb = dtype_size(param_dtype);
  const MemPool arrays = on_host ? MemPool::kHost : MemPool::kDevice, dev = MemPool::kDevice;
  whole_ = Buffer(backend, ledger, MemCategory::kParams, arrays, size_t(S_.whole_elems) * pb);
  shard_ = Buffer(backend, ledger, MemCategory::kParams, arrays, size_t(S_.shard_elems) * pb);
  gather_ = Buffer(backend, ledger, MemCategory::kComm, dev, size_t(S_.gather_elems()) * pb);
  if (!on_host) return;
  H_ = make_dense_shard_host_layout(layout, S_, split_tables);
  for (Slot& slot : slots_)
    slot.buf = Buffer(backend, ledger, MemCategory::kParams, dev, size_t(H_.slot_elems) * pb);
}

void LlamaModel::ShardedBaseStore::set_unit_values(int u, const float* values) {
  SHARDLM_CHECK(holds_ == 0 || gathered_unit_ != u,
                "the sharded LoRA base's unit {} is set while it is acquired", u);
  if (gathered_unit_ == u) gathered_unit_ = -1;
  for (Slot& slot : slots_) {  // a staged copy of the unit's old values is dropped
    if (slot.part < 0 || H_.parts[slot.part].unit != u) continue;
    SHARDLM_CHECK(slot.holds == 0, "the sharded LoRA base's unit {} is set while it is acquired",
                  u);
    be_.host_wait_fence(slot.fence);  // the arrays are not written under a copy from them
    slot.part = -1;
  }
  const int64_t n = layout_.unit_size(u);
  if (!S_.sharded(u)) {
    be_.convert(Tensor(const_cast<float*>(values), DType::kF32, {n}, MemPool::kHost),
                whole(S_.whole_at[u], n));
    return;
  }
  // This rank's chunk [rank * c, (rank + 1) * c) of the layer, the last rank's padded with 0.
  const int64_t c = S_.chunk_elems[u], from = shards_.rank() * c;
  std::vector<float> chunk(size_t(c), 0.f);  // [c] f32
  if (from < n) std::copy(values + from, values + std::min(n, from + c), chunk.begin());
  be_.convert(Tensor(chunk.data(), DType::kF32, {c}, MemPool::kHost), shard(S_.chunk_at[u], c));
}

Tensor LlamaModel::ShardedBaseStore::part_source(int p) const {
  const DenseShardPart& part = H_.parts[p];
  return part.chunk ? shard(part.at, part.n) : whole(part.at, part.n);
}

void LlamaModel::ShardedBaseStore::gather(int u, const Tensor& chunk) {
  const int64_t c = S_.chunk_elems[u];
  // chunk [c] -> gather [world * c]: rank r's chunk at r * c, the layer's elements in order.
  shards_.all_gather(chunk, gather_.view(dtype_, {S_.gather_elems()}).rows(0, S_.world * c));
  gathered_unit_ = u;
}

int LlamaModel::ShardedBaseStore::part_of(int u, int piece) const {
  const int p = H_.unit_part[u] + piece;
  SHARDLM_CHECK(piece >= 0 && p < int(H_.parts.size()) && H_.parts[p].unit == u,
                "the sharded LoRA base's unit {} has no piece {}", u, piece);
  return p;
}

Tensor LlamaModel::ShardedBaseStore::acquire_params(int u) {
  SHARDLM_CHECK(piece_rows(u) == 0, "the sharded LoRA base hands unit {} out in pieces", u);
  return acquire_piece_params(u, 0);
}

Tensor LlamaModel::ShardedBaseStore::acquire_piece_params(int u, int piece) {
  const int64_t n = layout_.unit_size(u);
  SHARDLM_CHECK(on_host_ || piece == 0,
                "the sharded LoRA base hands unit {} out whole, not piece {}", u, piece);
  if (n == 0) return Tensor(nullptr, dtype_, {0}, MemPool::kDevice);  // another stage's unit
  const int p = on_host_ ? part_of(u, piece) : -1;
  if (!S_.sharded(u)) {  // embeddings, final norm and head (or a piece of a table)
    if (!on_host_) return whole(S_.whole_at[u], n);
    Slot& slot = stage(p, /*prefetch=*/false);
    ++slot.holds;
    be_.wait_fence(slot.fence);
    prefetch_after(p);
    return slot_view(slot);
  }
  if (gathered_unit_ != u) {
    SHARDLM_CHECK(holds_ == 0,
                  "the sharded LoRA base gathers one decoder layer at a time: layer {} is "
                  "acquired while layer {} is in use",
                  u - 1, gathered_unit_ - 1);
    if (on_host_) {
      const Slot& slot = stage(p, /*prefetch=*/false);
      be_.wait_fence(slot.fence);
      gather(u, slot_view(slot));  // the slot is free again once this is issued
    } else {
      gather(u, shard(S_.chunk_at[u], S_.chunk_elems[u]));
    }
  }
  if (on_host_) prefetch_after(p);
  ++holds_;
  return gather_.view(dtype_, {S_.gather_elems()}).rows(0, n);
}

void LlamaModel::ShardedBaseStore::release_piece_params(int u, int piece) {
  if (S_.sharded(u)) {
    if (gathered_unit_ == u && holds_ > 0) --holds_;
    return;
  }
  if (!on_host_ || layout_.unit_size(u) == 0) return;
  const int p = part_of(u, piece);
  for (Slot& slot : slots_)
    if (slot.part == p && slot.holds > 0) {
      --slot.holds;
      return;
    }
}

Tensor LlamaModel::ShardedBaseStore::acquire_grads(int u) {
  SHARDLM_FAIL(ErrorKind::kInternal, "the sharded LoRA base is frozen: unit {} has no gradients",
               u);
}

void LlamaModel::ShardedBaseStore::prefetch_after(int p) {
  const int next = pass_ == Pass::kForward ? p + 1 : p - 1;
  if (next < 0 || next >= int(H_.parts.size()) || H_.parts[next].n == 0) return;
  if (H_.parts[next].unit == gathered_unit_) return;  // the gather buffer holds that layer
  stage(next, /*prefetch=*/true);
}

LlamaModel::ShardedBaseStore::Slot& LlamaModel::ShardedBaseStore::stage(int p, bool prefetch) {
  Slot* free = nullptr;
  for (Slot& slot : slots_) {
    if (slot.part == p) return slot;
    if (slot.holds == 0 && (free == nullptr || free->part >= 0)) free = &slot;
  }
  if (free == nullptr) {
    SHARDLM_CHECK(prefetch, "the sharded LoRA base's two device slots are both in use (part {})",
                  p);
    return slots_[0];
  }
  free->part = p;
  free->fence = be_.copy_async(part_source(p), slot_view(*free));
  return *free;
}

}  // namespace shardlm
