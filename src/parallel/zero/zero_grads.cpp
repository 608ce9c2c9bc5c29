// The ZeRO engine's gradients (zero.h): the arena or the rotating bucket buffers backward writes
// into, the reductions of finished buckets, and where each reduced chunk goes: the device
// shard, or (offload, stage >= 2) the host shard, streamed out on the copy stream.
#include <algorithm>

#include "shardlm/core/check.h"
#include "zero_parts.h"

namespace shardlm {

void ZeroEngine::allocate_grad_buffers(MemoryLedger& ledger) {
  const MemPool dev = MemPool::kDevice, host = MemPool::kHost;
  const DType wire = opt_.reduce_dtype;
  const bool narrow = wire != DType::kF32;
  const int64_t wb = int64_t(dtype_size(wire));
  // One rank: the reduce-scatter is the identity, so the reduced chunk is the send buffer
  // itself and its widening reuses the f32 bucket buffer (zero_reduces_in_place).
  const bool in_place = zero_reduces_in_place(world_);
  for (int i = 0; i < zero_grad_buffers(zero_holds_tied_bucket(layout_, z_)); ++i) {
    auto g = std::make_unique<GradBuf>();
    g->buf = Buffer(be_, ledger, MemCategory::kComm, dev, z_.max_bucket * 4);
    if (narrow) g->wire = Buffer(be_, ledger, MemCategory::kComm, dev, z_.max_bucket * wb);
    if (!in_place) g->recv = Buffer(be_, ledger, MemCategory::kComm, dev, z_.max_chunk * wb);
    if (narrow && !streams_grads() && !in_place)
      g->recv_f32 = Buffer(be_, ledger, MemCategory::kComm, dev, z_.max_chunk * 4);
    if (streams_grads()) {
      g->host_recv = Buffer(be_, ledger, MemCategory::kHostOffload, host, z_.max_chunk * wb);
      if (narrow)
        g->host_f32 = Buffer(be_, ledger, MemCategory::kHostOffload, host, z_.max_chunk * 4);
    }
    grad_bufs_.push_back(std::move(g));
  }
}

// [chunk] wire dtype: where g's reduction lands (one rank: the send buffer, reduced in place).
Tensor ZeroEngine::reduced_chunk(const GradBuf& g, int64_t chunk) const {
  const DType wire = opt_.reduce_dtype;
  if (!zero_reduces_in_place(world_)) return g.recv.view(wire, {chunk});
  return (wire == DType::kF32 ? g.buf : g.wire).view(wire, {chunk});
}

// [chunk] f32: the reduced bf16 chunk widened, to be added to the device shard (one rank: the
// f32 bucket buffer, whose rounding on the wire is all the reduction still reads).
Tensor ZeroEngine::widened_chunk(const GradBuf& g, int64_t chunk) const {
  return (zero_reduces_in_place(world_) ? g.buf : g.recv_f32).view(DType::kF32, {chunk});
}

Tensor ZeroEngine::grads_padded() const { return grads_.view(DType::kF32, {z_.padded_total}); }

Tensor ZeroEngine::grad_shard() const {
  return (streams_grads() ? host_grads_ : grad_shard_).view(DType::kF32, {z_.shard});
}

Tensor ZeroEngine::grad_source() const { return opt_.stage == 0 ? grads_padded() : grad_shard(); }

Tensor ZeroEngine::acquire_grads(int u) {
  SHARDLM_CHECK(z_.piece_rows[u] == 0, "zero: unit {} is handed out in pieces", u);
  return acquire_piece_grads(u, 0);
}

void ZeroEngine::release_grads(int u) { release_piece_grads(u, 0); }

Tensor ZeroEngine::acquire_piece_grads(int u, int piece) {
  const int p = z_.part_of(u, piece);
  const ZeroPart& part = z_.parts[p];
  const int64_t n = part.end - part.begin;
  if (opt_.stage <= 1) return grads_padded().rows(z_.padded_offset(part.begin), n);
  const int b = z_.part_bucket[p];
  if (grad_of_bucket_[b] < 0) take_grad_buffer(b);
  const GradBuf& g = *grad_bufs_[grad_of_bucket_[b]];
  return g.buf.view(DType::kF32, {n}, (part.begin - z_.buckets[b].begin) * 4);
}

ZeroEngine::GradBuf& ZeroEngine::take_grad_buffer(int b) {
  int pick = -1;
  for (int i = 0; i < int(grad_bufs_.size()); ++i) {
    if (grad_bufs_[i]->bucket >= 0) continue;
    if (pick < 0 || grad_bufs_[i]->ticket < grad_bufs_[pick]->ticket) pick = i;  // the oldest
  }
  SHARDLM_CHECK(pick >= 0, "zero: every gradient buffer is bound ({})", grad_bufs_.size());
  GradBuf& g = *grad_bufs_[pick];
  settle(g);
  be_.wait_fence(g.fence);  // streaming one rank: the copy out reads buf (or wire) itself
  const ZeroBucket& bk = z_.buckets[b];
  be_.zero(g.buf.view(DType::kF32, {int64_t(world_) * bk.chunk}));
  g.bucket = b;
  grad_of_bucket_[b] = pick;
  return g;
}

void ZeroEngine::settle(GradBuf& g) {
  worker_->wait(g.ticket);
  if (g.reducing >= 0) {
    if (streams_grads())
      stream_out(g);
    else
      settle_on_device(g);
  }
  g.reducing = -1;
}

// The reduced chunk into the device shard: added when accumulating, widened first when bf16.
void ZeroEngine::settle_on_device(GradBuf& g) {
  const ZeroBucket& bk = z_.buckets[g.reducing];
  const Tensor dst = grad_shard().rows(bk.shard_begin, bk.chunk);
  const Tensor reduced = reduced_chunk(g, bk.chunk);
  if (reduced.dtype() == DType::kF32) {
    if (g.accumulate) be_.add(dst, reduced, dst);
    return;  // the step's first landed in the shard directly
  }
  const Tensor wide = g.accumulate ? widened_chunk(g, bk.chunk) : dst;
  be_.convert(reduced, wide);
  if (g.accumulate) be_.add(dst, wide, dst);
}

void ZeroEngine::stream_out(GradBuf& g) {
  land_through(&g);  // g's host staging is free again
  const ZeroBucket& bk = z_.buckets[g.reducing];
  const DType wire = opt_.reduce_dtype;
  // The step's first f32 chunk goes straight into the host shard; the others through staging.
  const bool direct = wire == DType::kF32 && !g.accumulate;
  const Tensor dst =
      direct ? grad_shard().rows(bk.shard_begin, bk.chunk) : g.host_recv.view(wire, {bk.chunk});
  g.fence = be_.copy_async(reduced_chunk(g, bk.chunk), dst);
  g.landing = g.reducing;
  g.land_accumulate = g.accumulate;
  landing_.push_back(&g);
}

// On the host, as settle_on_device does on the device: the same adds in the same order.
void ZeroEngine::land(GradBuf& g) {
  be_.host_wait_fence(g.fence);
  const ZeroBucket& bk = z_.buckets[g.landing];
  const Tensor dst = grad_shard().rows(bk.shard_begin, bk.chunk);
  const DType wire = opt_.reduce_dtype;
  if (wire == DType::kF32) {
    if (g.land_accumulate) host_.add(dst, g.host_recv.view(DType::kF32, {bk.chunk}), dst);
  } else {
    const Tensor wide = g.land_accumulate ? g.host_f32.view(DType::kF32, {bk.chunk}) : dst;
    host_.convert(g.host_recv.view(wire, {bk.chunk}), wide);
    if (g.land_accumulate) host_.add(dst, wide, dst);
  }
  g.landing = -1;
}

void ZeroEngine::land_through(GradBuf* g) {
  // In issue order, which is settle order: a bucket's micro-batches add in the order they were
  // reduced, the step's first (which overwrites) before the others.
  while (!landing_.empty() && (g == nullptr || g->landing >= 0)) {
    GradBuf* front = landing_.front();
    landing_.pop_front();
    land(*front);
  }
}

void ZeroEngine::release_piece_grads(int u, int piece) {
  const int b = z_.bucket_of(u, piece);
  if (++parts_done_[b] < z_.buckets[b].live_parts) return;
  // A tied table's piece completes twice a backward (after the head, after the embedding):
  // each time a reduction, the second accumulating.
  parts_done_[b] = 0;
  bucket_complete(b);
}

void ZeroEngine::bucket_complete(int b) {
  const ZeroBucket& bk = z_.buckets[b];
  const int64_t padded = int64_t(world_) * bk.chunk;
  if (opt_.stage <= 1) {
    if (micro_ < micro_batches_) return;  // accumulate locally until the step's last one
    const Tensor send = grads_padded().rows(bk.padded_begin, padded);
    if (opt_.stage == 0) {
      if (world_ > 1) bucket_ticket_[b] = worker_->submit([this, send] { dp_.all_reduce(send); });
    } else {
      const Tensor recv = grad_shard().rows(bk.shard_begin, bk.chunk);
      bucket_ticket_[b] = worker_->submit([this, send, recv] { dp_reduce_scatter(send, recv); });
    }
    return;
  }
  GradBuf& g = *grad_bufs_[grad_of_bucket_[b]];
  grad_of_bucket_[b] = -1;
  g.bucket = -1;
  g.reducing = b;
  g.accumulate = reduced_once_[b] != 0;
  reduced_once_[b] = 1;
  const DType wire = opt_.reduce_dtype;
  Tensor send = g.buf.view(DType::kF32, {padded});
  if (wire != DType::kF32) {  // rounded to the wire format on the compute thread
    be_.convert(send, g.wire.view(wire, {padded}));
    send = g.wire.view(wire, {padded});
  }
  // An f32 chunk for the device shard lands there directly when it is the step's first.
  const bool direct = !streams_grads() && wire == DType::kF32 && !g.accumulate;
  const Tensor recv =
      direct ? grad_shard().rows(bk.shard_begin, bk.chunk) : reduced_chunk(g, bk.chunk);
  be_.wait_fence(g.fence);  // streaming: the copy out of recv has read it
  g.ticket = worker_->submit([this, send, recv] { dp_reduce_scatter(send, recv); });
}

void ZeroEngine::dp_reduce_scatter(const Tensor& send, const Tensor& recv) {
  if (world_ == 1 && send.data() == recv.data()) return;  // reduced in place
  if (world_ == 1)
    be_.copy(send.view({send.numel()}).rows(0, recv.numel()), recv);
  else
    dp_.reduce_scatter(send, recv);
}

// Every reduction of this group done and accumulated, in submission order (the buffers are
// taken oldest first, so the step's earlier settles were in that order too): a bucket's
// micro-batches add up in the order backward produced them.
void ZeroEngine::finish_gradients() {
  worker_->drain();
  std::vector<GradBuf*> pending;
  for (auto& g : grad_bufs_) pending.push_back(g.get());
  std::sort(pending.begin(), pending.end(),
            [](const GradBuf* a, const GradBuf* b) { return a->ticket < b->ticket; });
  for (GradBuf* g : pending) settle(*g);
  land_through(nullptr);
}

// A step given up after backward (a non-finite loss): its reductions and copies are waited
// for and dropped.
void ZeroEngine::drop_pending_gradients() {
  worker_->drain();
  for (auto& g : grad_bufs_) {
    g->reducing = -1;
    if (g->landing >= 0) be_.host_wait_fence(g->fence);
    g->landing = -1;
  }
  landing_.clear();
}

}  // namespace shardlm
