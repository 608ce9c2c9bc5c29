// The ZeRO engine's private pieces, shared by its source files (zero.cpp: construction,
// parameters and the step; zero_grads.cpp: gradient buffers and reductions; zero_checkpoint.cpp:
// checkpoint state): the owned segments, the rotating gradient buffers and the gather buffers.
#pragma once

#include <algorithm>
#include <cstdint>

#include "comm_worker.h"
#include "shardlm/core/buffer.h"
#include "shardlm/model/layout.h"
#include "shardlm/parallel/zero.h"

namespace shardlm {

// The unit holding arena element `flat`.
inline int zero_unit_of(const ParamLayout& layout, int64_t flat) {
  const auto it =
      std::upper_bound(layout.units.begin(), layout.units.end(), flat,
                       [](int64_t f, const ParamLayout::Unit& u) { return f < u.begin; });
  return int(it - layout.units.begin()) - 1;
}

struct ZeroEngine::Segment {
  int64_t flat = 0;    // arena (ParamLayout) offset
  int64_t padded = 0;  // offset in the padded layout
  int64_t state = 0;   // offset in this rank's optimizer state (= padded at stage 0)
  int64_t count = 0;
  bool decay = false;
};

// Stage >= 2: one bucket's gradients from backward to the shard. Which buffers exist depends on
// the options (plan_memory counts the same):
//   buf        always                 [max_bucket] f32 device: backward accumulates into it
//   wire       bf16 reductions        [max_bucket] bf16 device: buf rounded, the send
//   recv       more than one rank     [max_chunk] wire dtype device: the reduced chunk (an f32
//                                     one into the device shard lands there directly when it
//                                     is the step's first); one rank reduces in place, the
//                                     chunk is buf (f32) or wire (bf16) itself
//   recv_f32   bf16, device shard,    [max_chunk] f32 device: recv widened, to be added (one
//              more than one rank     rank: widened back into buf)
//   host_recv  streaming              [max_chunk] wire dtype host: recv copied out
//   host_f32   streaming bf16         [max_chunk] f32 host: host_recv widened, to be added
struct ZeroEngine::GradBuf {
  Buffer buf, wire, recv, recv_f32, host_recv, host_f32;
  int bucket = -1;                // the bucket backward is writing into it, or -1
  int reducing = -1;              // the bucket whose reduction it feeds until settled, or -1
  bool accumulate = false;        // that reduction adds to the step's earlier micro-batches
  CommWorker::Ticket ticket = 0;  // that reduction
  int landing = -1;               // streaming: the bucket whose chunk is being copied out, or -1
  bool land_accumulate = false;   // that chunk adds to the host shard (else it overwrites)
  uint64_t fence = 0;             // that copy (0: none)
};

struct ZeroEngine::Gather {
  Buffer buf;                     // [max_bucket] param dtype: a bucket's parameters (comm)
  int bucket = -1;                // what it holds (or is being gathered into it), or -1
  int holds = 0;                  // acquisitions not yet released
  bool prefetched = false;        // gathered ahead of use and not used yet: not evictable
  CommWorker::Ticket ticket = 0;  // the gather
  uint64_t used = 0;              // LRU clock
};

}  // namespace shardlm
