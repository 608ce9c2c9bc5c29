// The ZeRO engine's gradients (zero.h): the arena or the rotating bucket buffers backward writes
// into, the reductions of finished buckets, and the reduced chunks added into the shard.
#include <algorithm>

#include "shardlm/core/check.h"
#include "zero_parts.h"

namespace shardlm {

Tensor ZeroEngine::grads_padded() const { return grads_.view(DType::kF32, {z_.padded_total}); }
Tensor ZeroEngine::grad_source() const {
  return opt_.stage == 0 ? grads_padded() : grad_shard_.view(DType::kF32, {z_.shard});
}

Tensor ZeroEngine::acquire_grads(int u) {
  const int64_t begin = layout_.units[u].begin, n = layout_.unit_size(u);
  if (opt_.stage <= 1) return grads_padded().rows(z_.padded_offset(begin), n);
  const int b = z_.unit_bucket[u];
  if (grad_of_bucket_[b] < 0) take_grad_buffer(b);
  const GradBuf& g = *grad_bufs_[grad_of_bucket_[b]];
  return g.buf.view(DType::kF32, {n}, (begin - z_.buckets[b].begin) * 4);
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
  const ZeroBucket& bk = z_.buckets[b];
  be_.zero(g.buf.view(DType::kF32, {int64_t(world_) * bk.chunk}));
  g.bucket = b;
  grad_of_bucket_[b] = pick;
  return g;
}

void ZeroEngine::settle(GradBuf& g) {
  worker_->wait(g.ticket);
  if (g.reducing >= 0 && g.accumulate) {
    const ZeroBucket& bk = z_.buckets[g.reducing];
    const Tensor dst = grad_shard_.view(DType::kF32, {z_.shard}).rows(bk.shard_begin, bk.chunk);
    be_.add(dst, g.recv.view(DType::kF32, {bk.chunk}), dst);
  }
  g.reducing = -1;
}

void ZeroEngine::release_grads(int u) {
  const int b = z_.unit_bucket[u];
  const ZeroBucket& bk = z_.buckets[b];
  if (++units_done_[b] == bk.live_units) bucket_complete(b);
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
      const Tensor recv = grad_shard_.view(DType::kF32, {z_.shard}).rows(bk.shard_begin, bk.chunk);
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
  const Tensor send = g.buf.view(DType::kF32, {padded});
  const Tensor recv =
      g.accumulate ? g.recv.view(DType::kF32, {bk.chunk})
                   : grad_shard_.view(DType::kF32, {z_.shard}).rows(bk.shard_begin, bk.chunk);
  g.ticket = worker_->submit([this, send, recv] { dp_reduce_scatter(send, recv); });
}

void ZeroEngine::dp_reduce_scatter(const Tensor& send, const Tensor& recv) {
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
}

}  // namespace shardlm
