// ContextGroups: the communicators a context-parallel core runs on, for a cp group of P = U x R
// ranks (plan/context_layout.h): Ulysses' all-to-all group (the U consecutive cp ranks of one
// group) and the ring (the R ranks at the same place in every group). Each is the cp group
// itself when it spans it, split from it otherwise, and absent when it would hold one rank.
// Made once, collectively over the cp group: by the ParallelGrid for a run, so that every
// communicator exists before the run plans its memory.
#pragma once

#include <cstdint>
#include <memory>

#include "shardlm/comm/communicator.h"

namespace shardlm {

class ContextGroups {
 public:
  // ulysses_size: U, which divides cp.size().
  ContextGroups(Communicator& cp, int64_t ulysses_size);
  ContextGroups(const ContextGroups&) = delete;
  ContextGroups& operator=(const ContextGroups&) = delete;

  Communicator& cp() const { return cp_; }
  Communicator* ulysses() const { return ulysses_; }  // size U, or null when U == 1
  Communicator* ring() const { return ring_; }        // size R, or null when R == 1
  int64_t ulysses_size() const { return ulysses_size_; }
  // A communicator's count (transport_device_bytes, host_waits) summed over the groups split
  // here (the cp group's is its owner's to count).
  int64_t sum_over_owned(int64_t (Communicator::*count)() const) const;

 private:
  Communicator& cp_;
  int64_t ulysses_size_;
  std::unique_ptr<Communicator> ulysses_owned_, ring_owned_;
  Communicator* ulysses_ = nullptr;
  Communicator* ring_ = nullptr;
};

}  // namespace shardlm
