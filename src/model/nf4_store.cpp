// The NF4 base's store (nf4_store.h): quantize at load, stage a part from host memory when the
// base is offloaded, dequantize a decoder layer on acquire.
#include "nf4_store.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "shardlm/core/check.h"
#include "shardlm/quant/nf4.h"

namespace shardlm {

LlamaModel::Nf4Store::Nf4Store(const ParamLayout& layout, DType param_dtype, bool on_host,
                               bool split_tables, Communicator* shards, Backend& backend,
                               MemoryLedger& ledger)
    : layout_(layout),
      N_(make_nf4_base_layout(layout)),
      dtype_(param_dtype),
      on_host_(on_host),
      shards_(shards),
      be_(backend) {
  SHARDLM_CHECK(shards == nullptr || shards->size() > 1,
                "an NF4 base is sharded over more than one rank ({} ranks)",
                shards == nullptr ? 0 : shards->size());
  const MemPool arrays = on_host ? MemPool::kHost : MemPool::kDevice, dev = MemPool::kDevice;
  dense_ = Buffer(backend, ledger, MemCategory::kParams, arrays,
                  size_t(N_.dense_elems) * dtype_size(param_dtype));
  if (shards != nullptr) {
    S_ = make_nf4_shard_layout(layout, N_, shards->size());
    shard_ = Buffer(backend, ledger, MemCategory::kParams, arrays, size_t(S_.shard_bytes));
    gather_ =
        Buffer(backend, ledger, MemCategory::kComm, dev, size_t(shards->size() * S_.max_chunk));
  } else {
    codes_ = Buffer(backend, ledger, MemCategory::kParams, arrays, size_t(N_.code_bytes));
    absmax_ = Buffer(backend, ledger, MemCategory::kParams, arrays, size_t(N_.absmax_values) * 4);
  }
  workspace_ = Buffer(backend, ledger, MemCategory::kWorkspace, dev,
                      size_t(N_.workspace_elems) * dtype_size(param_dtype));
  if (!on_host) return;
  H_ = make_nf4_host_layout(layout, N_, int64_t(dtype_size(param_dtype)), split_tables,
                            shards != nullptr ? &S_ : nullptr);
  for (Slot& slot : slots_)
    slot.buf = Buffer(backend, ledger, MemCategory::kParams, dev, size_t(H_.slot_bytes));
}

void LlamaModel::Nf4Store::set_unit_values(int u, const float* values,
                                           std::span<const Nf4Matrix> given) {
  SHARDLM_CHECK(holds_ == 0 || workspace_unit_ != u,
                "the NF4 base's unit {} is set while it is acquired", u);
  if (workspace_unit_ == u) workspace_unit_ = -1;
  for (Slot& slot : slots_) {  // a staged copy of the unit's old values is dropped
    if (slot.part < 0 || H_.parts[slot.part].unit != u) continue;
    SHARDLM_CHECK(slot.holds == 0, "the NF4 base's unit {} is set while it is acquired", u);
    be_.host_wait_fence(slot.fence);  // the arrays are not written under a copy from them
    slot.part = -1;
  }
  // Every matrix given must be one of the unit's (a mis-based cut would else be quantized anew).
  for (const Nf4Matrix& g : given)
    SHARDLM_CHECK(
        std::any_of(N_.units[u].begin(), N_.units[u].end(),
                    [&](const Nf4Segment& s) { return s.quantized && s.begin == g.begin; }),
        "the NF4 matrix given at element {} is none of unit {}'s projections", g.begin, u);
  std::vector<uint8_t> codes, layer_codes;
  std::vector<float> absmax, layer_absmax;  // sharded: the layer's, in order
  for (const Nf4Segment& s : N_.units[u]) {
    const float* w = values + (s.begin - layout_.units[u].begin);
    if (!s.quantized) {
      be_.convert(Tensor(const_cast<float*>(w), DType::kF32, {s.n}, MemPool::kHost), dense(s));
      continue;
    }
    const int64_t bytes = nf4::packed_bytes(s.n), blocks = nf4::num_blocks(s.n);
    const auto m = std::find_if(given.begin(), given.end(),
                                [&](const Nf4Matrix& g) { return g.begin == s.begin; });
    if (m != given.end()) {
      SHARDLM_CHECK(int64_t(m->codes.size()) == bytes && int64_t(m->absmax.size()) == blocks,
                    "the NF4 matrix at element {} of unit {} has {} code bytes and {} absmax "
                    "values; its {} elements take {} and {}",
                    s.begin, u, m->codes.size(), m->absmax.size(), s.n, bytes, blocks);
      codes = m->codes;
      absmax = m->absmax;
    } else {
      codes.resize(size_t(bytes));
      absmax.resize(size_t(blocks));
      nf4::quantize(w, s.n, codes.data(), absmax.data());
    }
    if (shards_ != nullptr) {
      layer_codes.insert(layer_codes.end(), codes.begin(), codes.end());
      layer_absmax.insert(layer_absmax.end(), absmax.begin(), absmax.end());
      continue;
    }
    be_.copy(Tensor(codes.data(), DType::kU8, {bytes}, MemPool::kHost),
             codes_.view(DType::kU8, {N_.code_bytes}).rows(s.code_at, bytes));
    be_.copy(Tensor(absmax.data(), DType::kF32, {blocks}, MemPool::kHost),
             absmax_.view(DType::kF32, {N_.absmax_values}).rows(s.absmax_at, blocks));
  }
  if (shards_ != nullptr && N_.quantized(u)) set_shard(u, layer_absmax, layer_codes);
}

void LlamaModel::Nf4Store::set_shard(int u, const std::vector<float>& absmax,
                                     const std::vector<uint8_t>& codes) {
  const int64_t chunk = S_.chunk_bytes[u], world = shards_->size();
  std::vector<uint8_t> layer(size_t(chunk * world), 0);  // [absmax | codes], padded
  SHARDLM_CHECK(int64_t(absmax.size() * 4 + codes.size()) <= chunk * world,
                "the NF4 base's layer {} has {} bytes for {} chunks of {}", u - 1,
                absmax.size() * 4 + codes.size(), world, chunk);
  std::memcpy(layer.data(), absmax.data(), absmax.size() * 4);
  std::memcpy(layer.data() + absmax.size() * 4, codes.data(), codes.size());
  be_.copy(Tensor(layer.data() + shards_->rank() * chunk, DType::kU8, {chunk}, MemPool::kHost),
           shard_.view(DType::kU8, {S_.shard_bytes}).rows(S_.chunk_at[u], chunk));
}

LlamaModel::Nf4Store::Source LlamaModel::Nf4Store::gathered(int u, const Source& held) {
  const int64_t chunk = S_.chunk_bytes[u], world = shards_->size();
  // Whole f32 words: the chunks are multiples of 4 bytes.
  shards_->all_gather(held.absmax.rows(S_.chunk_at[u] / 4 - held.absmax_at, chunk / 4),
                      gather_.view(DType::kF32, {world * chunk / 4}));
  const Nf4HostPart p = nf4_layer_part(layout_, N_, u);
  return {.absmax = gather_.view(DType::kF32, {p.absmax_n}),
          .dense = held.dense,
          .codes = gather_.view(DType::kU8, {p.code_n}, size_t(p.absmax_n) * 4),
          .absmax_at = p.absmax_at,
          .dense_at = held.dense_at,
          .code_at = p.code_at};
}

LlamaModel::Nf4Store::Source LlamaModel::Nf4Store::arrays() const {
  if (shards_ != nullptr)  // this rank's chunks where the absmax would be, no codes of its own
    return {.absmax = shard_.view(DType::kF32, {S_.shard_bytes / 4}),
            .dense = dense_.view(dtype_, {N_.dense_elems}),
            .codes = {}};
  return {.absmax = absmax_.view(DType::kF32, {N_.absmax_values}),
          .dense = dense_.view(dtype_, {N_.dense_elems}),
          .codes = codes_.view(DType::kU8, {N_.code_bytes})};
}

LlamaModel::Nf4Store::Source LlamaModel::Nf4Store::slot_source(const Slot& slot) const {
  const Nf4HostPart& p = H_.parts[slot.part];
  const size_t pb = dtype_size(dtype_), dense_off = size_t(p.absmax_n) * 4;
  const size_t code_off = dense_off + size_t(p.dense_n) * pb;
  return {.absmax = slot.buf.view(DType::kF32, {p.absmax_n}),
          .dense = slot.buf.view(dtype_, {p.dense_n}, dense_off),
          .codes = slot.buf.view(DType::kU8, {p.code_n}, code_off),
          .absmax_at = p.absmax_at,
          .dense_at = p.dense_at,
          .code_at = p.code_at};
}

void LlamaModel::Nf4Store::fill_workspace(int u, const Source& src) {
  const Tensor unit = workspace_.view(dtype_, {N_.workspace_elems}).rows(0, layout_.unit_size(u));
  for (const Nf4Segment& s : N_.units[u]) {
    const Tensor dst = unit.rows(s.begin - layout_.units[u].begin, s.n);  // [n] param dtype
    if (!s.quantized) {
      be_.copy(src.dense.rows(s.dense_at - src.dense_at, s.n), dst);
      continue;
    }
    be_.nf4_dequantize(src.codes.rows(s.code_at - src.code_at, nf4::packed_bytes(s.n)),
                       src.absmax.rows(s.absmax_at - src.absmax_at, nf4::num_blocks(s.n)), dst);
  }
}

int LlamaModel::Nf4Store::part_of(int u, int piece) const {
  const int p = H_.unit_part[u] + piece;
  SHARDLM_CHECK(piece >= 0 && p < int(H_.parts.size()) && H_.parts[p].unit == u,
                "the NF4 base's unit {} has no piece {}", u, piece);
  return p;
}

Tensor LlamaModel::Nf4Store::acquire_params(int u) {
  SHARDLM_CHECK(piece_rows(u) == 0, "the NF4 base hands unit {} out in pieces", u);
  return acquire_piece_params(u, 0);
}

Tensor LlamaModel::Nf4Store::acquire_piece_params(int u, int piece) {
  const int64_t n = layout_.unit_size(u);
  const int p = on_host_ ? part_of(u, piece) : -1;
  SHARDLM_CHECK(on_host_ || piece == 0, "the NF4 base hands unit {} out whole, not piece {}", u,
                piece);
  if (!N_.quantized(u)) {  // dense: embeddings, final norm and head (or a piece), an empty layer
    if (n == 0) return Tensor(nullptr, dtype_, {0}, MemPool::kDevice);
    if (!on_host_) return dense(N_.units[u].front());
    Slot& slot = stage(p, /*prefetch=*/false);
    ++slot.holds;
    be_.wait_fence(slot.fence);
    prefetch_after(p);
    return slot_source(slot).dense;
  }
  if (workspace_unit_ != u) {
    SHARDLM_CHECK(holds_ == 0,
                  "the NF4 base dequantizes one decoder layer at a time: layer {} is acquired "
                  "while layer {} is in use",
                  u - 1, workspace_unit_ - 1);
    if (on_host_) {
      const Slot& slot = stage(p, /*prefetch=*/false);
      be_.wait_fence(slot.fence);
      // The slot is free again once this is issued (sharded: its chunk gathered from it).
      fill_workspace(u, shards_ != nullptr ? gathered(u, slot_source(slot)) : slot_source(slot));
    } else {
      fill_workspace(u, shards_ != nullptr ? gathered(u, arrays()) : arrays());
    }
    workspace_unit_ = u;
  }
  if (on_host_) prefetch_after(p);
  ++holds_;
  return workspace_.view(dtype_, {N_.workspace_elems}).rows(0, n);
}

void LlamaModel::Nf4Store::release_piece_params(int u, int piece) {
  if (N_.quantized(u)) {
    if (workspace_unit_ == u && holds_ > 0) --holds_;
    return;
  }
  if (!on_host_) return;
  const int p = part_of(u, piece);
  for (Slot& slot : slots_)
    if (slot.part == p && slot.holds > 0) {
      --slot.holds;
      return;
    }
}

Tensor LlamaModel::Nf4Store::acquire_grads(int u) {
  SHARDLM_FAIL(ErrorKind::kInternal, "the NF4 base is frozen: unit {} has no gradients", u);
}

void LlamaModel::Nf4Store::prefetch_after(int p) {
  const int next = pass_ == Pass::kForward ? p + 1 : p - 1;
  if (next < 0 || next >= int(H_.parts.size())) return;
  if (H_.parts[next].unit == workspace_unit_) return;  // the workspace holds that layer
  stage(next, /*prefetch=*/true);
}

LlamaModel::Nf4Store::Slot& LlamaModel::Nf4Store::stage(int p, bool prefetch) {
  Slot* free = nullptr;
  for (Slot& slot : slots_) {
    if (slot.part == p) return slot;
    if (slot.holds == 0 && (free == nullptr || free->part >= 0)) free = &slot;
  }
  if (free == nullptr) {
    SHARDLM_CHECK(prefetch, "the NF4 base's two device slots are both in use (part {})", p);
    return slots_[0];
  }
  const Nf4HostPart& part = H_.parts[p];
  free->part = p;
  const Source from = arrays(), to = slot_source(*free);
  // The part's three ranges, each one copy (none when empty); the last copy's fence covers all.
  auto copy = [&](const Tensor& src, const Tensor& dst) {
    if (src.numel() > 0) free->fence = be_.copy_async(src, dst);
  };
  if (part.absmax_n > 0) copy(from.absmax.rows(part.absmax_at, part.absmax_n), to.absmax);
  if (part.dense_n > 0) copy(from.dense.rows(part.dense_at, part.dense_n), to.dense);
  if (part.code_n > 0) copy(from.codes.rows(part.code_at, part.code_n), to.codes);
  return *free;
}

}  // namespace shardlm
