// The dense sharded LoRA base's store (sharded_base_store.h): keep this rank's chunks at load,
// stage a part from host memory when the base is offloaded, gather a decoder layer on acquire
// and, with prefetch, the walk's next one ahead.
#include "sharded_base_store.h"

#include <algorithm>
#include <vector>

#include "shardlm/core/check.h"

namespace shardlm {

LlamaModel::ShardedBaseStore::ShardedBaseStore(const ParamLayout& layout, DType param_dtype,
                                               bool on_host, bool split_tables, bool prefetch,
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
  gathers_.resize(size_t(dense_shard_gather_buffers(prefetch)));
  for (Gather& g : gathers_)
    g.buf = Buffer(backend, ledger, MemCategory::kComm, dev, size_t(S_.gather_elems()) * pb);
  if (!on_host) return;
  H_ = make_dense_shard_host_layout(layout, S_, split_tables);
  for (Slot& slot : slots_)
    slot.buf = Buffer(backend, ledger, MemCategory::kParams, dev, size_t(H_.slot_elems) * pb);
}

void LlamaModel::ShardedBaseStore::set_unit_values(int u, const float* values) {
  finish_ahead();
  for (Gather& g : gathers_) {  // a gathered copy of the unit's old values is dropped
    if (g.unit != u) continue;
    SHARDLM_CHECK(g.holds == 0, "the sharded LoRA base's unit {} is set while it is acquired", u);
    g.unit = -1;
    g.ahead = false;
  }
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

void LlamaModel::ShardedBaseStore::begin_pass(Pass pass) {
  pass_ = pass;
  in_pass_ = true;
  recompute_ = false;
  furthest_unit_ = -1;
}

void LlamaModel::ShardedBaseStore::end_pass() {
  finish_ahead();  // every rank started the same gathers: each completes here
  in_pass_ = false;
  recompute_ = false;
}

Tensor LlamaModel::ShardedBaseStore::part_source(int p) const {
  const DenseShardPart& part = H_.parts[p];
  return part.chunk ? shard(part.at, part.n) : whole(part.at, part.n);
}

LlamaModel::ShardedBaseStore::Gather* LlamaModel::ShardedBaseStore::holding(int u) {
  for (Gather& g : gathers_)
    if (g.unit == u) return &g;
  return nullptr;
}

LlamaModel::ShardedBaseStore::Gather* LlamaModel::ShardedBaseStore::victim(bool ahead) {
  // Preferred: empty, then holding a layer already used, then one gathered ahead (not for
  // another gather ahead: the walk has not reached it yet); the least recently used first.
  auto rank = [](const Gather& g) { return g.unit < 0 ? 0 : g.ahead ? 2 : 1; };
  Gather* best = nullptr;
  for (Gather& g : gathers_) {
    if (g.holds > 0 || (ahead && g.ahead)) continue;
    if (best == nullptr || rank(g) < rank(*best) || (rank(g) == rank(*best) && g.used < best->used))
      best = &g;
  }
  return best;
}

bool LlamaModel::ShardedBaseStore::gather(int u, Gather& g, bool ahead) {
  finish_ahead();  // one gather in flight at a time; g's old layer is no longer being written
  Tensor chunk = shard(S_.chunk_at[u], S_.chunk_elems[u]);  // [c]
  Slot* slot = nullptr;
  if (on_host_) {
    slot = stage(part_of(u, 0));
    if (slot == nullptr) {
      SHARDLM_CHECK(ahead, "the sharded LoRA base's two device slots are both in use (layer {})",
                    u - 1);
      return false;
    }
    // The copy into the slot lands before the gather reads it: the collective is ordered
    // after the compute work issued so far, this wait included.
    be_.wait_fence(slot->fence);
    chunk = slot_view(*slot);
  }
  // chunk [c] -> gather [world * c]: rank r's chunk at r * c, the layer's elements in order.
  const Tensor recv = gathered(g, S_.world * S_.chunk_elems[u]);
  g.unit = u;
  g.ahead = ahead;
  g.used = ++clock_;
  ++counts_.gathers;
  if (!ahead) {
    shards_.all_gather(chunk, recv);  // the slot is free again once this returns
    return true;
  }
  ++counts_.ahead;
  if (slot != nullptr) {  // held until the gather has read it
    ++slot->holds;
    g.source = slot;
  }
  g.flight = shards_.all_gather_async(chunk, recv);
  return true;
}

void LlamaModel::ShardedBaseStore::finish_ahead() {
  for (Gather& g : gathers_) {
    if (g.flight == nullptr) continue;
    g.flight->wait();
    g.flight.reset();
    if (g.source != nullptr) --g.source->holds;
    g.source = nullptr;
  }
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
    Tensor out = on_host_ ? Tensor() : whole(S_.whole_at[u], n);
    if (on_host_) {
      Slot* slot = stage(p);
      SHARDLM_CHECK(slot != nullptr,
                    "the sharded LoRA base's two device slots are both in use (part {})", p);
      ++slot->holds;
      be_.wait_fence(slot->fence);
      out = slot_view(*slot);
    }
    prefetch_layer_after(u, p);
    return out;
  }
  Gather* g = holding(u);
  if (g == nullptr) {
    for (const Gather& other : gathers_)
      SHARDLM_CHECK(other.holds == 0,
                    "the sharded LoRA base gathers one decoder layer at a time: layer {} is "
                    "acquired while layer {} is in use",
                    u - 1, other.unit - 1);
    g = victim(/*ahead=*/false);  // none is in use
    gather(u, *g, /*ahead=*/false);
  } else if (g->flight != nullptr) {
    finish_ahead();  // the host waits: the layer is complete before any kernel reads it
  }
  if (g->ahead) ++counts_.ahead_used;
  g->ahead = false;
  g->used = ++clock_;
  ++g->holds;
  prefetch_layer_after(u, p);
  return gathered(*g, n);
}

void LlamaModel::ShardedBaseStore::release_piece_params(int u, int piece) {
  if (S_.sharded(u)) {
    Gather* g = holding(u);
    if (g != nullptr && g->holds > 0) --g->holds;
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

int LlamaModel::ShardedBaseStore::next_layer(int u, int p) const {
  const int step = pass_ == Pass::kForward || recompute_ ? 1 : -1;
  if (on_host_) {  // the next part: a table's next piece, or the next unit's first part
    const int next = p + step;
    if (next < 0 || next >= int(H_.parts.size()) || !H_.parts[next].chunk) return -1;
    return H_.parts[next].unit;
  }
  const int next = u + step;
  return next >= 0 && next < int(layout_.units.size()) && S_.sharded(next) ? next : -1;
}

void LlamaModel::ShardedBaseStore::prefetch_layer_after(int u, int p) {
  // The tied LM head reads unit 0 after the layers: out of the walk's order.
  const bool head_use = u == 0 && furthest_unit_ > 0;
  furthest_unit_ = std::max(furthest_unit_, u);
  const int next = gathers_.size() > 1 && in_pass_ && !head_use ? next_layer(u, p) : -1;
  Gather* free = next >= 0 && holding(next) == nullptr ? victim(/*ahead=*/true) : nullptr;
  if (free != nullptr && gather(next, *free, /*ahead=*/true)) {
    if (on_host_) prefetch_after(part_of(next, 0));  // the walk's part after the gathered one
    return;
  }
  if (on_host_) prefetch_after(p);
}

void LlamaModel::ShardedBaseStore::prefetch_after(int p) {
  const int next = pass_ == Pass::kForward || recompute_ ? p + 1 : p - 1;
  if (next < 0 || next >= int(H_.parts.size()) || H_.parts[next].n == 0) return;
  if (holding(H_.parts[next].unit) != nullptr) return;  // a gather buffer holds that layer
  stage(next);
}

LlamaModel::ShardedBaseStore::Slot* LlamaModel::ShardedBaseStore::stage(int p) {
  Slot* free = nullptr;
  for (Slot& slot : slots_) {
    if (slot.part == p) return &slot;
    if (slot.holds == 0 && (free == nullptr || free->part >= 0)) free = &slot;
  }
  if (free == nullptr) return nullptr;
  free->part = p;
  free->fence = be_.copy_async(part_source(p), slot_view(*free));
  return free;
}

}  // namespace shardlm
