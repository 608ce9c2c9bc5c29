// Private to src/train: one rank's share of a checkpoint's state vectors as files, the part of a
// save that needs no communication: written by the training thread (synchronous saves) or by a
// background thread from a snapshot in host memory (checkpoint.async, AsyncSave).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "shardlm/checkpoint/checkpoint.h"
#include "shardlm/model/tensor_shard.h"
#include "shardlm/parallel/zero.h"

namespace shardlm::trainer_detail {

// What a rank writes of the state vectors, fixed when the save begins.
struct StateShardSpec {
  struct Vector {
    ZeroEngine::State state;
    const char* name;  // "params", "adam_m", "adam_v", "master"
    size_t elem_bytes;
  };
  std::vector<Vector> vectors;     // those the run keeps, in file order
  int64_t total = 0;               // elements of each whole vector
  std::vector<ShardPiece> pieces;  // the parts of the engine's arena this rank writes
  int rank = 0, world = 1;
};

// Streams this rank's share of a state vector, as ZeroEngine::save_owned does:
// sink(begin, count, data) gets elements [begin, begin + count) of the engine's arena.
using OwnedSink = std::function<void(int64_t begin, int64_t count, const void* data)>;
using OwnedSource = std::function<void(ZeroEngine::State, const OwnedSink&)>;

// Every vector of `spec` declared in `w`, then this rank's share of it in one file of its own
// ("<name>-RRRRR-of-NNNNN.bin"), each element at its place in the whole vector.
void write_state_shards(CheckpointWriter& w, const StateShardSpec& spec, const OwnedSource& owned);

// A stretch of a state vector's owned share in a snapshot: elements [begin, begin + count) of
// the engine's arena, at byte `offset` of the snapshot.
struct SnapshotStretch {
  int64_t begin = 0, count = 0;
  size_t offset = 0;
};

// One state vector's share as a snapshot holds it.
struct SnapshotVector {
  ZeroEngine::State state;
  std::vector<SnapshotStretch> stretches;
};

// An asynchronous save in flight: the writer (its temporary directory made collectively), the
// snapshot's map, and the thread that writes and fsyncs this rank's files from it. The training
// thread reads `written` each step and commits (collectively) once every rank's is set.
struct AsyncSave {
  int64_t step = 0;
  std::unique_ptr<CheckpointWriter> writer;
  std::chrono::steady_clock::time_point started;
  double snapshot_s = 0;             // the training thread's copy into the snapshot
  std::atomic<bool> written{false};  // set (release) when the thread is done, ok or not
  std::atomic<double> write_s{0.0};  // the thread's time, valid once `written`
  std::string failure;               // the thread's error ("" when none), valid once `written`
  std::thread thread;
  ~AsyncSave() {
    if (thread.joinable()) thread.join();  // before the writer and the snapshot go
  }
};

}  // namespace shardlm::trainer_detail
