// StagingEngine: what a StagedCommunicator and its splits share: the device copier, the staging
// slots, and the staged sends and receives in flight, advanced chunk by chunk by whichever op
// waits or tests (progress()). Private to src/comm/staged.
#pragma once

#include <array>
#include <chrono>
#include <list>
#include <memory>
#include <mutex>
#include <span>
#include <string>

#include "shardlm/comm/staged.h"

namespace shardlm::staged {

using Clock = std::chrono::steady_clock;

// Yields for the first millisecond, then sleeps 1/32 of the time waited (16 us to 1 ms): a
// rank polling a peer must leave the core to the peer (tests run several ranks per core).
void backoff(Clock::time_point since);
double seconds_since(Clock::time_point t);

// One staged send or receive: `buf` moved in chunks of chunk_bytes through one slot.
struct Transfer {
  Communicator* host = nullptr;  // the host communicator it runs on
  bool is_send = true;
  Tensor buf;
  int peer = 0, tag = 0;
  size_t chunk_bytes = 0;
  int64_t chunks = 0;
  int64_t next = 0;  // the next chunk to start
  int slot = -1;     // held from the first chunk to the last
  std::unique_ptr<CommHandle> in_flight;
  bool done = false;
  std::string what;  // "send of 4096 bytes to rank 1 (tag 3) on communicator 'world/pp'"

  bool same_channel(const Transfer& o) const {
    return host == o.host && is_send == o.is_send && peer == o.peer && tag == o.tag;
  }
  // Chunk c of buf and the slot's staging memory for it.
  Tensor buf_chunk(int64_t c) const;
};

}  // namespace shardlm::staged

namespace shardlm {

class StagingEngine {
 public:
  void attach(DeviceCopier& copier, std::span<std::byte> staging);
  void detach();

  // Lock held: the copier, or an Error naming `what` when none is attached.
  DeviceCopier& copier(std::string_view what) const;
  size_t slot_bytes() const { return slot_bytes_; }
  // Lock held: a free slot's index, or -1.
  int take_slot();
  void give_slot(int slot);
  std::byte* slot(int s) const { return base_ + size_t(s) * slot_bytes_; }
  // `bytes` bytes of slot s at `offset`, seen as `dtype`.
  Tensor slot_view(int s, size_t offset, DType dtype, int64_t elems) const;

  // Lock held: registers a transfer (started by progress() when its turn and a slot come).
  void add(std::shared_ptr<staged::Transfer> t) { transfers_.push_back(std::move(t)); }
  // Lock held: advances every transfer in start order as far as it goes without blocking.
  void progress();

  std::mutex mutex;

 private:
  void advance(staged::Transfer& t);
  bool may_start(
      const staged::Transfer& t) const;  // no earlier transfer on its channel is unfinished

  DeviceCopier* copier_ = nullptr;
  std::byte* base_ = nullptr;
  size_t slot_bytes_ = 0;
  std::array<bool, StagedCommunicator::kSlots> busy_{};
  std::list<std::shared_ptr<staged::Transfer>> transfers_;  // unfinished, in start order
};

}  // namespace shardlm
