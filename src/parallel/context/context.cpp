// Context-parallel attention: Ulysses all-to-all, ring, and their hybrid (see context.h).
#include "shardlm/parallel/context.h"

#include <algorithm>

namespace shardlm {

namespace {

constexpr int kTagKv = 11;   // ring: a key/value block
constexpr int kTagDkv = 12;  // ring: the gradients accumulated for a key/value block

// A view of `shape` starting `offset` elements into t (same dtype and pool).
Tensor at(const Tensor& t, int64_t offset, Shape shape) {
  return Tensor(static_cast<std::byte*>(t.data()) + offset * int64_t(dtype_size(t.dtype())),
                t.dtype(), shape, t.pool());
}

}  // namespace

ContextParallel::~ContextParallel() = default;

ContextParallel::ContextParallel(const ModelConfig& cfg, const ContextLayout& layout, int64_t B,
                                 const ContextGroups& groups, Backend& backend,
                                 MemoryLedger& ledger, DType act, int slots, int kept_sets)
    : cfg_(cfg),
      L_(layout),
      max_B_(B),
      act_(act),
      slots_(slots),
      kept_sets_(L_.U > 1 ? kept_sets : 0),
      slot_seg_(size_t(std::max(slots, 1)), nullptr),
      slot_one_document_(size_t(std::max(slots, 1)), 0),
      slot_spans_(size_t(std::max(slots, 1))),
      kept_layer_(size_t(std::max(slots, 1) * std::max(kept_sets_, 0)), -1),
      slot_half_(size_t(std::max(slots, 1)), kCpHostHalves - 1),
      slot_seg_fence_(size_t(std::max(slots, 1) * kCpHostHalves), 0),
      spans_fence_(size_t(kCpHostHalves), 0),
      cp_(groups.cp()),
      ulysses_(groups.ulysses()),
      ring_(groups.ring()),
      be_(backend) {
  SHARDLM_CHECK(slots >= 1 && kept_sets >= 0,
                "context parallelism: {} micro-batch slots and {} kept sets; at least 1 and 0",
                slots, kept_sets);
  SHARDLM_CHECK(cp_.size() == L_.P && groups.ulysses_size() == L_.U,
                "context parallelism: the cp group has {} ranks in Ulysses groups of {}, the "
                "layout {} in groups of {}",
                cp_.size(), groups.ulysses_size(), L_.P, L_.U);
  for (const CpBuffer& b : cp_buffers(cfg_, L_, B, kernel_workspace_bytes(backend, cfg, L_, B), act,
                                      slots, kept_sets_)) {
    if (b.bytes > 0)
      buffers_.emplace_back(b.name, Buffer(backend, ledger, b.category, b.pool, size_t(b.bytes)));
  }
}

int64_t ContextParallel::kernel_workspace_bytes(const Backend& backend, const ModelConfig& cfg,
                                                const ContextLayout& layout, int64_t B) {
  const CpKernelShape s = cp_kernel_shape(cfg, layout, B);
  const std::vector<int64_t> windows = cfg.attention_windows();
  return int64_t(
      s.block ? backend.attention_block_plan_workspace_bytes(s.B, s.Tq, s.Tk, s.Hq, s.Hkv, s.Dh,
                                                             windows)
              : backend.attention_plan_workspace_bytes(s.B, s.Tq, s.Hq, s.Hkv, s.Dh, windows));
}

Tensor ContextParallel::buf(const char* name, Shape shape, DType dtype) const {
  for (const auto& [n, b] : buffers_) {
    if (n != name) continue;
    SHARDLM_CHECK(size_t(shape.numel()) * dtype_size(dtype) <= b.bytes(),
                  "context parallelism: {} {} does not fit buffer '{}' ({} bytes)",
                  dtype_name(dtype), shape.str(), name, b.bytes());
    return b.view(dtype, shape);
  }
  SHARDLM_FAIL(ErrorKind::kInternal, "context parallelism: no buffer '{}'", name);
}

Tensor ContextParallel::seg_host(int slot, int64_t B, int half) const {
  const int64_t n = max_B_ * L_.group_len();  // one half: [max_B, G]
  const Tensor all = buf("attention.seg_host", {kCpHostHalves * slots_ * n}, DType::kI32);
  return at(all, (slot * kCpHostHalves + half) * n, {B, L_.group_len()});
}

Tensor ContextParallel::seg_device(int slot, int64_t B) const {
  const int64_t n = max_B_ * L_.group_len();
  return at(buf("ulysses.seg", {slots_ * n}, DType::kI32), slot * n, {B, L_.group_len()});
}

int ContextParallel::slot_of(const Tensor& seg_start) const {
  for (int s = 0; s < slots_; ++s)
    if (slot_seg_[size_t(s)] == seg_start.data()) return s;
  SHARDLM_FAIL(ErrorKind::kInternal,
               "context parallelism: attention on document starts that shard() never filled; "
               "shard every micro-batch into the model's inputs first");
}

Tensor ContextParallel::kernel_seg(const Tensor& seg) const {
  return one_document_ ? Tensor() : seg;
}

Tensor ContextParallel::kernel_seg_rows(const Tensor& seg, int64_t row0, int64_t n) const {
  return one_document_ ? Tensor() : at(seg, row0, {1, n});
}

Workspace ContextParallel::workspace() const {
  for (const auto& [n, b] : buffers_)
    if (n == "attention.workspace") return {b.data(), b.bytes()};
  return {};
}

BatchInputs ContextParallel::full_inputs(int64_t B) {
  SHARDLM_CHECK(B >= 1 && B <= max_B_,
                "context parallelism: a micro-batch of {} rows, but the core was built for at most "
                "{}; build it with the micro-batch size",
                B, max_B_);
  const int64_t n = B * L_.T, stride = max_B_ * L_.T;
  const Tensor all = buf("inputs.full_rows", {4 * stride}, DType::kI32);
  auto part = [&](int i) { return at(all, i * stride, {n}); };
  return {part(0), part(1), part(2), part(3), Tensor()};  // no spans: the core sees shards
}

void ContextParallel::shard(const BatchInputs& full, const BatchInputs& local_host,
                            const BatchInputs& local, int64_t B, int slot) {
  SHARDLM_CHECK(slot >= 0 && slot < slots_,
                "context parallelism: micro-batch slot {}, but the core has {} slots", slot,
                slots_);
  const int64_t T = L_.T, Tl = L_.local(), piece = L_.piece(), C = L_.chunk(), G = L_.group_len();
  const int c = cp_.rank(), g = c / L_.U, u = c % L_.U;
  // This rank's two pieces of a row: piece u of chunk g and of chunk 2R-1-g.
  const int64_t first = L_.chunk_start(g, 0) + u * piece;
  const int64_t late = L_.chunk_start(g, 1) - L_.chunk_start(g, 0);  // chunk 2R-1-g's offset
  const Tensor* src[4] = {&full.tokens, &full.targets, &full.positions, &full.seg_start};
  const Tensor* dst[4] = {&local_host.tokens, &local_host.targets, &local_host.positions,
                          &local_host.seg_start};
  static constexpr const char* kInput[4] = {"tokens", "targets", "positions", "seg_start"};
  for (int a = 0; a < 4; ++a) {
    SHARDLM_CHECK(dst[a]->pool() == MemPool::kHost && dst[a]->numel() >= B * Tl,
                  "context parallelism: shard() cuts the rank's {} into host rows of at least {} "
                  "tokens, got {} in the {} pool",
                  kInput[a], B * Tl, dst[a]->numel(),
                  dst[a]->pool() == MemPool::kHost ? "host" : "device");
    for (int64_t b = 0; b < B; ++b)
      for (int h = 0; h < 2; ++h)
        std::copy_n(src[a]->i32() + b * T + first + h * late, piece,
                    dst[a]->i32() + b * Tl + h * piece);
  }
  // The group's document starts (its two chunks of every row), cut on the host from the rows
  // the loader wrote there, and (Ulysses) copied to the device once for every layer's use.
  // They go into the slot's other host half: the current one's copy may still be queued (a
  // device one micro-batch behind), and only the copy out of this half, made for this slot's
  // micro-batch before last, must have run; the host read this half's starts last while it
  // issued that micro-batch's attention, before this one was sharded.
  const int half = (slot_half_[size_t(slot)] + 1) % kCpHostHalves;
  uint64_t& fence = slot_seg_fence_[size_t(slot * kCpHostHalves + half)];
  be_.host_wait_fence(fence);
  slot_half_[size_t(slot)] = half;
  const Tensor seg_h = seg_host(slot, B);
  const int32_t* rows = full.seg_start.i32();
  for (int64_t b = 0; b < B; ++b)
    for (int h = 0; h < 2; ++h) {
      const int32_t* chunk = rows + b * T + L_.chunk_start(g, h);
      std::copy(chunk, chunk + C, seg_h.i32() + b * G + h * C);
    }
  if (L_.U > 1) {
    // The device starts are one buffer per slot: copy_async runs after the compute issued so
    // far, the slot's last micro-batch's attention included.
    fence = be_.copy_async(seg_h, seg_device(slot, B));
    be_.wait_fence(fence);
  }
  slot_seg_[size_t(slot)] = local.seg_start.data();
  const int32_t* starts = seg_h.i32();
  slot_one_document_[size_t(slot)] =
      std::all_of(starts, starts + seg_h.numel(), [](int32_t s) { return s == 0; });
  slot_spans_[size_t(slot)] = {};
  if (L_.U > 1 && L_.R() == 1 && !slot_one_document_[size_t(slot)])
    slot_spans_[size_t(slot)] = document_spans(seg_h, slot);
  // A new micro-batch: the slot's kept sets hold none of its layers yet.
  for (int i = 0; i < kept_sets_; ++i) kept_layer_[size_t(kept_index(slot, i))] = -1;
}

// Whole rows seg_h [B, G] (Ulysses without a ring: G = T, the gathered rows in full-row order)
// as spans: a document begins at each token whose start is its own index in the row. Written on
// the host, copied into the slot's device starts.
DocumentSpans ContextParallel::document_spans(const Tensor& seg_h, int slot) {
  const int64_t G = L_.group_len(), n = seg_h.numel(), per_slot = max_B_ * G + 1;
  // The host spans are staging only (nothing reads them after the copy): the halves are used
  // in turn whatever the slot, and a half is written once the copy out of it, two calls back,
  // has run.
  const int half = next_spans_half_;
  next_spans_half_ = (half + 1) % kCpHostHalves;
  const Tensor all_host = buf("ulysses.doc_starts_host", {kCpHostHalves * per_slot}, DType::kI32);
  const Tensor host = at(all_host, half * per_slot, {n + 1});
  be_.host_wait_fence(spans_fence_[size_t(half)]);
  const auto [count, longest] = document_starts(seg_h.i32(), n, G, host.i32());
  const Tensor dev =
      at(buf("ulysses.doc_starts", {slots_ * per_slot}, DType::kI32), slot * per_slot, {count + 1});
  spans_fence_[size_t(half)] = be_.copy_async(at(host, 0, {count + 1}), dev);
  be_.wait_fence(spans_fence_[size_t(half)]);
  return {dev, count, longest};
}

// ---- Ulysses: sequence shards <-> head shards ------------------------------------------------

ContextParallel::HeadSplit ContextParallel::head_split(int64_t H, int64_t Hg, bool kv) const {
  const int64_t rep = kv && H < L_.U ? L_.U / H : 1;
  return {rep, Hg * cfg_.head_dim()};
}

// x [B, Tl, H, Dh] (this rank's tokens, every head) -> xg [B, G, Hg, Dh] (the group's tokens,
// this member's heads). kv: x holds kv heads (member u reads Hg of them from cp_kv_head_of(u)).
void ContextParallel::to_group(const Tensor& x, int64_t H, int64_t Hg, bool kv, const Tensor& xg) {
  const int U = L_.U;
  const int64_t B = x.dim(0), N = B * L_.local(), piece = L_.piece(), C = L_.chunk();
  const auto [rep, row] = head_split(H, Hg, kv);
  const int64_t n = N * row, Dh = cfg_.head_dim();
  const Tensor send = buf("ulysses.send", {U * n}), recv = buf("ulysses.recv", {U * n});
  // send [U, N, Hg, Dh]: member u = a * rep + r gets heads [a * Hg, (a + 1) * Hg) of every token.
  be_.copy_blocks(x, send, {{U / rep, rep, N}, row, {row, 0, H * Dh}, {rep * n, n, row}});
  ulysses_->all_to_all(send, recv);
  stats_.bytes_sent += (U - 1) * n * int64_t(dtype_size(act_));
  // recv [U, B, 2, piece, row] (member, row, chunk half) -> xg [B, 2, U, piece, row]: the
  // group sequence, in full-row order within each chunk.
  be_.copy_blocks(recv, xg,
                  {{U, 2 * B, 1}, piece * row, {n, piece * row, 0}, {piece * row, C * row, 0}});
}

// The inverse: xg [B, G, Hg, Dh] -> x [B, Tl, H, Dh]. kv: heads shared by several members
// (replicated kv heads) receive the sum of their gradients, added in member order.
void ContextParallel::from_group(const Tensor& xg, int64_t H, int64_t Hg, bool kv,
                                 const Tensor& x) {
  const int U = L_.U;
  const int64_t B = x.dim(0), N = B * L_.local(), piece = L_.piece(), C = L_.chunk();
  const auto [rep, row] = head_split(H, Hg, kv);
  const int64_t n = N * row, Dh = cfg_.head_dim();
  const Tensor send = buf("ulysses.send", {U * n}), recv = buf("ulysses.recv", {U * n});
  // xg [B, 2, U, piece, row] -> send [U, B, 2, piece, row]: each member's tokens back.
  be_.copy_blocks(xg, send,
                  {{U, 2 * B, 1}, piece * row, {piece * row, C * row, 0}, {n, piece * row, 0}});
  ulysses_->all_to_all(send, recv);
  stats_.bytes_sent += (U - 1) * n * int64_t(dtype_size(act_));
  // recv [U, N, Hg, Dh]: the rep members of a head group sum into the first one's block.
  for (int64_t a = 0; a < U / rep; ++a) {
    const Tensor sum = at(recv, a * rep * n, {n});
    for (int64_t r = 1; r < rep; ++r) be_.add(sum, at(recv, (a * rep + r) * n, {n}), sum);
  }
  be_.copy_blocks(recv, x, {{U / rep, N, 1}, row, {rep * n, row, 0}, {row, H * Dh, 0}});
}

// ---- the attention of the group sequence -----------------------------------------------------

void ContextParallel::attend_forward(const Tensor& q, const Tensor& k, const Tensor& v,
                                     const Tensor& seg, const int32_t* seg_h, const Tensor& out,
                                     const Tensor& lse) {
  if (L_.R() > 1) return ring_forward(q, k, v, seg, seg_h, out, lse);
  const int64_t B = q.dim(0), G = q.dim(1), Hg = q.dim(2);
  // One rank's view of the whole row: the plain kernel. Count its visible pairs too.
  be_.attention_forward(q, k, v, kernel_seg(seg), out, lse.view({B, Hg, G}), workspace(), spans_,
                        window_, softcap_);
  double pairs = 0;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < G; ++t)
      pairs += double(t - first_visible_key(seg_h[b * G + t], t, window_) + 1);
  stats_.attention_flops += 4.0 * pairs * double(Hg * cfg_.head_dim());
}

void ContextParallel::attend_backward(const Tensor& q, const Tensor& k, const Tensor& v,
                                      const Tensor& seg, const int32_t* seg_h, const Tensor& out,
                                      const Tensor& lse, const Tensor& dout, const Tensor& dq,
                                      const Tensor& dk, const Tensor& dv) {
  if (L_.R() > 1) return ring_backward(q, k, v, seg, seg_h, out, lse, dout, dq, dk, dv);
  const int64_t B = q.dim(0), G = q.dim(1), Hg = q.dim(2);
  be_.attention_backward(q, k, v, kernel_seg(seg), out, lse.view({B, Hg, G}), dout, dq, dk, dv,
                         workspace(), spans_, window_, softcap_);
}

// ---- the public entry points -----------------------------------------------------------------

ContextParallel::Group ContextParallel::group(int64_t B, int slot, int layer) const {
  const int64_t Dh = cfg_.head_dim(), G = L_.group_len();
  const int64_t Hg = cp_q_heads(cfg_, L_), Kg = cp_kv_heads(cfg_, L_);
  const Shape qs{B, G, Hg, Dh}, kvs{B, G, Kg, Dh};
  Group g{Tensor(),           Tensor(), Tensor(), buf("ulysses.dk", kvs), buf("ulysses.dv", kvs),
          seg_device(slot, B)};
  if (kept_sets_ == 0) {
    g.q = buf("ulysses.q", qs);
    g.k = buf("ulysses.k", kvs);
    g.v = buf("ulysses.v", kvs);
    return g;
  }
  // A set: q [max_B, G, Hg, Dh], k and v [max_B, G, Kg, Dh] (cp_buffers' sizes).
  const int64_t qn = max_B_ * G * Hg * Dh, kvn = max_B_ * G * Kg * Dh, set = qn + 2 * kvn;
  const Tensor all = buf("ulysses.kept", {slots_ * kept_sets_ * set});
  const int64_t first = kept_index(slot, layer) * set;
  g.q = at(all, first, qs);
  g.k = at(all, first + qn, kvs);
  g.v = at(all, first + qn + kvn, kvs);
  return g;
}

ContextParallel::Group ContextParallel::gather(const Tensor& q, const Tensor& k, const Tensor& v,
                                               int slot, int layer) {
  const Group g = group(q.dim(0), slot, layer);
  if (kept_sets_ > 0) kept_layer_[size_t(kept_index(slot, layer))] = layer;
  to_group(q, cfg_.n_heads, cp_q_heads(cfg_, L_), false, g.q);
  to_group(k, cfg_.n_kv_heads, cp_kv_heads(cfg_, L_), true, g.k);
  to_group(v, cfg_.n_kv_heads, cp_kv_heads(cfg_, L_), true, g.v);
  return g;
}

void ContextParallel::forward(int layer, const Tensor& q, const Tensor& k, const Tensor& v,
                              const Tensor& seg_start, const DocumentSpans& docs, const Tensor& out,
                              const Tensor& lse) {
  SHARDLM_CHECK(docs.count == 0,
                "context parallelism: document spans are whole rows' (none "
                "are given to a core that sees shards)");
  const int64_t B = q.dim(0);
  SHARDLM_CHECK(B <= max_B_ && q.dim(1) == L_.local(),
                "context parallelism: q is {} but this rank holds {} x {} tokens", q.shape().str(),
                max_B_, L_.local());
  window_ = cfg_.window_of_layer(layer);
  softcap_ = float(cfg_.attn_softcap);
  const int slot = slot_of(seg_start);
  one_document_ = slot_one_document_[size_t(slot)] != 0;
  spans_ = slot_spans_[size_t(slot)];
  const int32_t* seg_h = seg_host(slot, B).i32();
  if (L_.U == 1) return attend_forward(q, k, v, seg_start, seg_h, out, lse);
  const Group g = gather(q, k, v, slot, layer);
  // The group's output lands in the receive staging, idle until from_group packs it.
  const Tensor og = buf("ulysses.recv", g.q.shape());
  attend_forward(g.q, g.k, g.v, g.seg, seg_h, og, lse);
  from_group(og, cfg_.n_heads, cp_q_heads(cfg_, L_), false, out);
}

void ContextParallel::backward(int layer, const Tensor& q, const Tensor& k, const Tensor& v,
                               const Tensor& seg_start, const DocumentSpans& docs,
                               const Tensor& out, const Tensor& lse, const Tensor& dout,
                               const Tensor& dq, const Tensor& dk, const Tensor& dv) {
  SHARDLM_CHECK(docs.count == 0,
                "context parallelism: document spans are whole rows' (none "
                "are given to a core that sees shards)");
  const int64_t B = q.dim(0);
  SHARDLM_CHECK(B <= max_B_ && q.dim(1) == L_.local() && dq.numel() == q.numel() &&
                    dout.numel() == q.numel() && out.numel() == q.numel() &&
                    dk.numel() == k.numel() && dv.numel() == v.numel() && k.numel() == v.numel(),
                "context parallelism: backward of q {} (this rank holds {} x {} tokens) with out "
                "{}, dout {}, dq {}, k {}, dk {}, dv {}",
                q.shape().str(), max_B_, L_.local(), out.shape().str(), dout.shape().str(),
                dq.shape().str(), k.shape().str(), dk.shape().str(), dv.shape().str());
  window_ = cfg_.window_of_layer(layer);
  softcap_ = float(cfg_.attn_softcap);
  const int slot = slot_of(seg_start);
  one_document_ = slot_one_document_[size_t(slot)] != 0;
  spans_ = slot_spans_[size_t(slot)];
  const int32_t* seg_h = seg_host(slot, B).i32();
  if (L_.U == 1) return attend_backward(q, k, v, seg_start, seg_h, out, lse, dout, dq, dk, dv);
  const int64_t Hq = cfg_.n_heads, Hkv = cfg_.n_kv_heads;
  const int64_t Hg = cp_q_heads(cfg_, L_), Kg = cp_kv_heads(cfg_, L_);
  // The forward's gathered q, k, v when this layer's set still holds them.
  const bool kept = kept_sets_ > 0 && kept_layer_[size_t(kept_index(slot, layer))] == layer;
  const Group g = kept ? group(B, slot, layer) : gather(q, k, v, slot, layer);
  // Three of the eight group tensors live in memory that is idle while the kernel runs, so the
  // core keeps five: out in the caller's dq (same size; written only by the last from_group),
  // dout in the send staging (the last gather: its unpack reads only the receive staging),
  // dq in the receive staging (the first from_group packs it before anything is received).
  const Tensor og = dq.view(g.q.shape());
  const Tensor dog = buf("ulysses.send", g.q.shape());
  const Tensor dqg = buf("ulysses.recv", g.q.shape());
  to_group(out, Hq, Hg, false, og);
  to_group(dout, Hq, Hg, false, dog);
  attend_backward(g.q, g.k, g.v, g.seg, seg_h, og, lse, dog, dqg, g.dk, g.dv);
  from_group(dqg, Hq, Hg, false, dq);
  from_group(g.dk, Hkv, Kg, true, dk);
  from_group(g.dv, Hkv, Kg, true, dv);
}

// ---- ring ----------------------------------------------------------------------------------

namespace {

// Visible (query, key) pairs of queries [q_off, q_off + n) (document starts seg[n]) against keys
// [k_off, k_off + n), under a sliding window of `window` keys (0: none).
double visible_pairs(const int32_t* seg, int64_t n, int64_t q_off, int64_t k_off, int64_t window) {
  double pairs = 0;
  for (int64_t t = 0; t < n; ++t) {
    const int64_t first = first_visible_key(seg[t], q_off + t, window);
    const int64_t lo = std::max(first, k_off), hi = std::min(q_off + t, k_off + n - 1);
    if (hi >= lo) pairs += double(hi - lo + 1);
  }
  return pairs;
}

// A query chunk half of one row against a key chunk half of the block in hand.
struct ChunkPair {
  int64_t b;             // batch row
  int hq;                // query half: 0 early chunk, 1 late chunk
  int64_t q_off, k_off;  // full-row index of the first query and key
  int64_t row0, krow0;   // their first rows in the [B, G] group layout
  const int32_t* seg;    // the queries' document starts (host)
};

// Calls f(pair) for every chunk pair of ring position g's queries against block j's keys that
// holds a visible (query, key) pair, in a fixed order: a pair whose keys all come after its
// last query, or before every query's first visible key (its document's start, or under a
// sliding window the window - 1 keys before it), is skipped.
template <typename F>
void for_each_chunk_pair(const ContextLayout& L, const int32_t* seg_host, int64_t B, int g, int j,
                         int64_t window, F&& f) {
  const int64_t G = L.group_len(), C = L.chunk();
  for (int64_t b = 0; b < B; ++b) {
    for (int hq = 0; hq < 2; ++hq) {
      const int64_t q_off = L.chunk_start(g, hq), row0 = b * G + hq * C;
      const int32_t* seg = seg_host + row0;
      int64_t first_seen = q_off;
      for (int64_t t = 0; t < C; ++t)
        first_seen = std::min(first_seen, first_visible_key(seg[t], q_off + t, window));
      for (int hk = 0; hk < 2; ++hk) {
        const int64_t k_off = L.chunk_start(j, hk);
        if (k_off > q_off + C - 1 || k_off + C - 1 < first_seen) continue;
        f(ChunkPair{b, hq, q_off, k_off, row0, b * G + hk * C, seg});
      }
    }
  }
}

// MPI moves the data of nonblocking transfers only inside MPI calls: poke the ring's transfers
// between blocks so that the next block arrives while this one is computed.
void progress(CommHandle* xfer) {
  if (xfer != nullptr) xfer->test();
}

}  // namespace

// q [B, G, Hg, Dh]; k, v [B, G, Kg, Dh]; seg [B, G]; out [B, G, Hg, Dh];
// lse: [B, 2, Hg, C] (row b, chunk half h, head, token).
void ContextParallel::ring_forward(const Tensor& q, const Tensor& k, const Tensor& v,
                                   const Tensor& seg, const int32_t* sh, const Tensor& out,
                                   const Tensor& lse) {
  const int R = L_.R(), g = ring_->rank();
  const int64_t B = q.dim(0), G = L_.group_len(), C = L_.chunk();
  const int64_t Hg = q.dim(2), Kg = k.dim(2), Dh = cfg_.head_dim();
  const int64_t kv_n = B * G * Kg * Dh;  // elements of k (or v) of one group sequence
  const Tensor kv_all = buf("ring.kv", {4 * kv_n});
  Tensor cur = at(kv_all, 0, {2 * kv_n}), nxt = at(kv_all, 2 * kv_n, {2 * kv_n});
  be_.copy(k.view({kv_n}), at(cur, 0, {kv_n}));
  be_.copy(v.view({kv_n}), at(cur, kv_n, {kv_n}));
  const Tensor o_b = buf("ring.block_out", {1, C, Hg, Dh});
  const Tensor l_b = buf("ring.block_lse", {1, Hg, C}, DType::kF32);
  std::vector<bool> started(size_t(B * 2), false);

  for (int s = 0; s < R; ++s) {
    const int j = (g - s + R) % R;     // the owner of the block in hand
    std::unique_ptr<CommHandle> xfer;  // one sendrecv: cannot deadlock on NCCL either
    if (s + 1 < R) {
      xfer = ring_->sendrecv_async(cur, (g + 1) % R, nxt, (g - 1 + R) % R, kTagKv);
      stats_.bytes_sent += int64_t(cur.bytes());
    }
    for_each_chunk_pair(L_, sh, B, g, j, window_, [&](const ChunkPair& c) {
      const Tensor qv = at(q, c.row0 * Hg * Dh, {1, C, Hg, Dh});
      const Tensor kv = at(cur, c.krow0 * Kg * Dh, {1, C, Kg, Dh});
      const Tensor vv = at(cur, kv_n + c.krow0 * Kg * Dh, {1, C, Kg, Dh});
      const Tensor sv = kernel_seg_rows(seg, c.row0, C);
      const Tensor ov = at(out, c.row0 * Hg * Dh, {1, C, Hg, Dh});
      const Tensor lv = at(lse, (c.b * 2 + c.hq) * Hg * C, {1, Hg, C});
      auto&& first = started[size_t(c.b * 2 + c.hq)];
      if (!first) {
        be_.attention_block_forward(qv, kv, vv, sv, c.q_off, c.k_off, ov, lv, workspace(), window_,
                                    softcap_);
        first = true;
      } else {
        be_.attention_block_forward(qv, kv, vv, sv, c.q_off, c.k_off, o_b, l_b, workspace(),
                                    window_, softcap_);
        be_.attention_merge(ov, lv, o_b, l_b);
      }
      stats_.attention_flops +=
          4.0 * visible_pairs(c.seg, C, c.q_off, c.k_off, window_) * double(Hg * Dh);
      progress(xfer.get());
    });
    if (xfer) {
      xfer->wait();
      std::swap(cur, nxt);
    }
  }
  // Every query sees at least itself (a window holds at least one key), so the diagonal block
  // started every (row, half).
}

void ContextParallel::ring_backward(const Tensor& q, const Tensor& k, const Tensor& v,
                                    const Tensor& seg, const int32_t* sh, const Tensor& out,
                                    const Tensor& lse, const Tensor& dout, const Tensor& dq,
                                    const Tensor& dk, const Tensor& dv) {
  const int R = L_.R(), g = ring_->rank();
  const int next = (g + 1) % R, prev = (g - 1 + R) % R;
  const int64_t B = q.dim(0), G = L_.group_len(), C = L_.chunk();
  const int64_t Hg = q.dim(2), Kg = k.dim(2), Dh = cfg_.head_dim();
  const int64_t kv_n = B * G * Kg * Dh;
  const Tensor kv_all = buf("ring.kv", {4 * kv_n}), dkv_all = buf("ring.dkv", {6 * kv_n});
  Tensor cur = at(kv_all, 0, {2 * kv_n}), nxt = at(kv_all, 2 * kv_n, {2 * kv_n});
  // Gradients of the block in hand: at step 0 straight into the accumulator that leaves first,
  // later into `mine` while the previous accumulator is still travelling; then the arrived
  // accumulator takes `mine` and goes on. `out_acc` is the one sent, `in_acc` the one arriving.
  Tensor out_acc = at(dkv_all, 0, {2 * kv_n}), in_acc = at(dkv_all, 2 * kv_n, {2 * kv_n});
  const Tensor mine = at(dkv_all, 4 * kv_n, {2 * kv_n});
  be_.copy(k.view({kv_n}), at(cur, 0, {kv_n}));
  be_.copy(v.view({kv_n}), at(cur, kv_n, {kv_n}));
  be_.zero(dq);
  const Tensor dq_b = buf("ring.block_dq", {1, C, Hg, Dh});
  const Tensor dkv_b = buf("ring.block_dkv", {2 * C * Kg * Dh});
  const Tensor dk_b = at(dkv_b, 0, {1, C, Kg, Dh}), dv_b = at(dkv_b, C * Kg * Dh, {1, C, Kg, Dh});

  std::unique_ptr<CommHandle> dxfer;  // the accumulators' exchange, in flight
  for (int s = 0; s < R; ++s) {
    const int j = (g - s + R) % R;
    std::unique_ptr<CommHandle> xfer;
    if (s + 1 < R) {  // the next block's keys and values travel while this one is computed
      xfer = ring_->sendrecv_async(cur, next, nxt, prev, kTagKv);
      stats_.bytes_sent += int64_t(cur.bytes());
    }
    const Tensor acc = s == 0 ? out_acc : mine;
    be_.zero(acc);
    for_each_chunk_pair(L_, sh, B, g, j, window_, [&](const ChunkPair& c) {
      be_.attention_block_backward(
          at(q, c.row0 * Hg * Dh, {1, C, Hg, Dh}), at(cur, c.krow0 * Kg * Dh, {1, C, Kg, Dh}),
          at(cur, kv_n + c.krow0 * Kg * Dh, {1, C, Kg, Dh}), kernel_seg_rows(seg, c.row0, C),
          c.q_off, c.k_off, at(out, c.row0 * Hg * Dh, {1, C, Hg, Dh}),
          at(lse, (c.b * 2 + c.hq) * Hg * C, {1, Hg, C}),
          at(dout, c.row0 * Hg * Dh, {1, C, Hg, Dh}), dq_b, dk_b, dv_b, workspace(), window_,
          softcap_);
      const Tensor dq_rows = at(dq, c.row0 * Hg * Dh, {C * Hg * Dh});
      be_.add(dq_rows, dq_b.view({C * Hg * Dh}), dq_rows);
      const Tensor dk_rows = at(acc, c.krow0 * Kg * Dh, {C * Kg * Dh});
      const Tensor dv_rows = at(acc, kv_n + c.krow0 * Kg * Dh, {C * Kg * Dh});
      be_.add(dk_rows, dk_b.view({C * Kg * Dh}), dk_rows);
      be_.add(dv_rows, dv_b.view({C * Kg * Dh}), dv_rows);
      progress(xfer.get());
      progress(dxfer.get());
    });
    if (s > 0) {
      // Block j's accumulator (every earlier rank's share) has arrived: add this rank's and
      // pass it on. The one sent before is out of the way, so it receives the next.
      dxfer->wait();
      be_.add(in_acc, mine, in_acc);
      std::swap(out_acc, in_acc);
    }
    // Block j's gradients go on to the next rank, which holds block j next; after R exchanges
    // this rank's own block has come back with every rank's contribution.
    dxfer = ring_->sendrecv_async(out_acc, next, in_acc, prev, kTagDkv);
    stats_.bytes_sent += int64_t(out_acc.bytes());
    if (xfer) {
      xfer->wait();
      std::swap(cur, nxt);
    }
  }
  dxfer->wait();
  const Tensor dcur = in_acc;
  be_.copy(at(dcur, 0, {kv_n}), dk.view({kv_n}));
  be_.copy(at(dcur, kv_n, {kv_n}), dv.view({kv_n}));
}

}  // namespace shardlm
