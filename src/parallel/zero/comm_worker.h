// CommWorker: runs a data-parallel group's collectives in submission order on one thread of its
// own, so that a reduce-scatter of finished gradients (or a gather of the next layer's
// parameters) proceeds while the compute thread goes on with backward (or forward). With
// threaded = false every op runs at submit() on the caller's thread (zero.overlap_comm = false).
//
// Discipline: the compute thread may use other groups (tp, cp, pp collectives inside forward
// and backward) while ops submitted here run: MPI is initialised MPI_THREAD_SERIALIZED and
// every MPI call holds the session's lock, a blocking wait polling with MPI_Test and releasing
// it in between; NCCL's communicators each have their own stream, and this thread's waits on
// them are host waits (only the compute thread's are stream dependencies, at program points
// every rank shares: communicator.h). What the compute thread must
// not do is issue ops on the group this worker serves before drain(): collectives on one
// communicator must be issued in the same order on every rank. An op that throws (a timeout,
// a dead peer) fails every later wait() and drain() with its message.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>

namespace shardlm {

class CommWorker {
 public:
  using Ticket = uint64_t;  // 0 = nothing to wait for

  explicit CommWorker(bool threaded);
  ~CommWorker();  // finishes what was submitted (errors are dropped: the run is failing)
  CommWorker(const CommWorker&) = delete;
  CommWorker& operator=(const CommWorker&) = delete;

  Ticket submit(std::function<void()> op);
  // Blocks until op `t` (and everything before it) is done; rethrows a failure.
  void wait(Ticket t);
  void drain() { wait(submitted_); }
  bool done(Ticket t);  // without blocking
  // Seconds the compute thread has spent on communication (cumulative): blocked in wait(), or
  // running the ops itself when not threaded.
  double wait_seconds() const { return wait_s_; }

 private:
  void loop();

  const bool threaded_;
  std::mutex mu_;
  std::condition_variable cv_work_, cv_done_;
  std::deque<std::function<void()>> queue_;
  Ticket submitted_ = 0, completed_ = 0;
  std::exception_ptr error_;
  bool stopping_ = false;
  double wait_s_ = 0;
  std::thread thread_;
};

}  // namespace shardlm
