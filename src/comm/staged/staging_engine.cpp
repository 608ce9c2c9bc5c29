// StagingEngine: the staging slots and the staged sends and receives in flight. A transfer
// starts when a slot is free and no earlier transfer on its (host, direction, peer, tag) is
// unfinished (so messages match in start order on both ends); each chunk of a send is copied
// into the slot and sent, each chunk of a receive received into it and copied out, one chunk
// in flight per transfer.
#include "comm/staged/staging_engine.h"

#include <algorithm>
#include <thread>

namespace shardlm::staged {

void backoff(Clock::time_point since) {
  const auto waited = Clock::now() - since;
  if (waited < std::chrono::milliseconds(1)) {
    std::this_thread::yield();
    return;
  }
  std::this_thread::sleep_for(std::clamp<Clock::duration>(
      waited / 32, std::chrono::microseconds(16), std::chrono::milliseconds(1)));
}

double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

Tensor Transfer::buf_chunk(int64_t c) const {
  const size_t begin = size_t(c) * chunk_bytes;
  const size_t bytes = std::min(chunk_bytes, buf.bytes() - begin);
  const int64_t elems = int64_t(bytes / dtype_size(buf.dtype()));
  return Tensor(static_cast<std::byte*>(buf.data()) + begin, buf.dtype(), {elems}, buf.pool());
}

}  // namespace shardlm::staged

namespace shardlm {

using staged::Transfer;

void StagingEngine::attach(DeviceCopier& copier, std::span<std::byte> staging) {
  std::lock_guard lock(mutex);
  const size_t slot = StagedCommunicator::slot_bytes(staging.size());
  SHARDLM_CHECK(slot > 0,
                "staged communicator: {} bytes of staging memory leave no slot; it needs at least "
                "{} bytes ({} slots of 8 bytes)",
                staging.size(), 8 * StagedCommunicator::kSlots, StagedCommunicator::kSlots);
  SHARDLM_CHECK(transfers_.empty(), "staged communicator: attach with {} transfers in flight",
                transfers_.size());
  copier_ = &copier;
  base_ = staging.data();
  slot_bytes_ = slot;
  busy_.fill(false);
}

void StagingEngine::detach() {
  std::lock_guard lock(mutex);
  SHARDLM_CHECK(transfers_.empty() && std::none_of(busy_.begin(), busy_.end(), std::identity()),
                "staged communicator: detach with {} transfers in flight", transfers_.size());
  copier_ = nullptr;
  base_ = nullptr;
  slot_bytes_ = 0;
}

DeviceCopier& StagingEngine::copier(std::string_view what) const {
  SHARDLM_CHECK(copier_ != nullptr,
                "{}: a tensor is in the device pool but no device copier and staging memory are "
                "attached (StagedCommunicator::attach)",
                what);
  return *copier_;
}

int StagingEngine::take_slot() {
  for (int s = 0; s < StagedCommunicator::kSlots; ++s)
    if (!busy_[size_t(s)]) {
      busy_[size_t(s)] = true;
      return s;
    }
  return -1;
}

void StagingEngine::give_slot(int slot) { busy_[size_t(slot)] = false; }

Tensor StagingEngine::slot_view(int s, size_t offset, DType dtype, int64_t elems) const {
  return Tensor(slot(s) + offset, dtype, {elems}, MemPool::kHost);
}

bool StagingEngine::may_start(const Transfer& t) const {
  for (const auto& other : transfers_) {
    if (other.get() == &t) return true;
    if (!other->done && other->same_channel(t)) return false;
  }
  return true;
}

void StagingEngine::advance(Transfer& t) {
  if (t.slot < 0) {
    if (t.chunks == 0) {
      t.done = true;  // nothing to move; the peer's matching transfer has no chunks either
      return;
    }
    if (!may_start(t)) return;
    t.slot = take_slot();
    if (t.slot < 0) return;
  }
  while (!t.done) {
    if (t.in_flight) {
      if (!t.in_flight->test()) return;
      t.in_flight.reset();
      if (!t.is_send) {
        const Tensor dst = t.buf_chunk(t.next - 1);
        copier(t.what).copy(slot_view(t.slot, 0, dst.dtype(), dst.numel()), dst);
      }
    }
    if (t.next == t.chunks) {
      give_slot(t.slot);
      t.slot = -1;
      t.done = true;
      return;
    }
    const Tensor piece = t.buf_chunk(t.next);
    const Tensor stage = slot_view(t.slot, 0, piece.dtype(), piece.numel());
    if (t.is_send) {
      copier(t.what).copy(piece, stage);
      t.in_flight = t.host->send_async(stage, t.peer, t.tag);
    } else {
      t.in_flight = t.host->recv_async(stage, t.peer, t.tag);
    }
    ++t.next;
  }
}

void StagingEngine::progress() {
  for (const auto& t : transfers_) advance(*t);
  transfers_.remove_if([](const std::shared_ptr<Transfer>& t) { return t->done; });
}

}  // namespace shardlm
