// NcclCommunicator: the Communicator over NCCL, one GPU per rank, and its bootstrap (the unique
// id over the MPI world or the TCP rendezvous). With nccl_support, the only code that sees NCCL.
// Every op is enqueued on the communicator's own stream after an event recorded on the compute
// stream, and completes when an event after it does. On the thread that set the compute stream,
// waiting for an op on device tensors is a stream dependency (the compute stream waits for that
// event), not a host wait; the family's CompletionWatch (comm/completion_watch.h) polls the
// event and NCCL's async error on its own thread against the timeout and ends the process on
// a failure (make_nccl_world says why). Host tensors, barriers and waits on other threads
// (ZeRO's worker) poll on the host as before: NCCL runs in nonblocking mode, so every wait
// polls (event, ncclCommGetAsyncError) against the timeout, and a failure there is recorded
// for the family (every later op of any of its communicators raises it), the communicator
// aborted, and the error thrown. What
// NCCL allocates on the GPU for a communicator is measured by the driver while it is made (the
// collectives' connections made then, not at their first use) and while connect_peers makes
// its point-to-point pairs, and reported as transport_device_bytes().
//
// Threads: the trainer's thread uses the tp/cp/pp groups while ZeRO's worker uses the
// data-parallel ones, and NCCL does not allow operations issued in parallel to independent
// communicators on one device ("Thread Safety"). So every enqueue (group start to its end,
// settled), every split, finalize and the world's creation run under the world's EnqueueLock,
// shared by every communicator split from it (comm/enqueue_lock.h), taken after the
// communicator's own lock. Why that cannot deadlock is in docs/comm.md ("Threads and NCCL").
// A communicator's own lock also covers every call that reads its ncclComm_t (polls included),
// so ncclCommAbort, under it, never frees a communicator another thread is reading.
#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <type_traits>
#include <vector>

#include "comm/completion_watch.h"
#include "comm/enqueue_lock.h"
#include "nccl_support.h"
#include "shardlm/comm/nccl.h"
#include "shardlm/comm/rendezvous.h"

namespace shardlm {

namespace {

using nccl_detail::backoff;
using nccl_detail::Clock;
using nccl_detail::connect_at_creation;
using nccl_detail::cuda_ok;
using nccl_detail::gpu_used_bytes;
using nccl_detail::kHostStagingBytes;
using nccl_detail::nccl_fail;
using nccl_detail::nccl_op;
using nccl_detail::nccl_type;
using nccl_detail::settle;
using nccl_detail::since;

class NcclCommunicator;

// An op's completion event, shared by its handle and the watch (destroyed by the last).
using SharedEvent = std::shared_ptr<std::remove_pointer_t<cudaEvent_t>>;

// What follows "<op> did not complete within T s (SHARDLM_COMM_TIMEOUT_S): ".
constexpr const char* kTimeoutHint =
    "another rank of the group never called it, called a different collective, or died (NCCL "
    "cannot tell which: look for the rank whose error differs); the communicator was aborted";

// connect_peers' op: setup, whose memory is measured once it has run, so the host waits for it.
constexpr std::string_view kConnectPeers = "connecting point-to-point peers";

// An op in flight: done when its event (recorded on the communicator's stream after the op)
// has passed.
class NcclHandle final : public CommHandle {
 public:
  NcclHandle(NcclCommunicator& comm, SharedEvent done, std::string what)
      : comm_(comm), done_(std::move(done)), what_(std::move(what)) {}
  ~NcclHandle() override;
  // On the compute thread a stream dependency; elsewhere the host polls.
  void wait() override;
  bool test() override;

 private:
  NcclCommunicator& comm_;
  SharedEvent done_;
  std::string what_;
  bool finished_ = false;
};

class NcclCommunicator final : public Communicator {
 public:
  // What a communicator shares with its family (the world and every group split from it).
  struct Family {
    std::shared_ptr<EnqueueLock> enqueue;  // one thread enqueues at a time
    std::shared_ptr<CompletionWatch> watch;
  };

  NcclCommunicator(ncclComm_t comm, int rank, int size, int device, std::string name,
                   CommOptions options, cudaStream_t compute, std::thread::id compute_thread,
                   Family family)
      : Communicator(rank, size, std::move(name), options),
        comm_(comm),
        device_(device),
        compute_(compute),
        compute_thread_(compute_thread),
        enqueue_(std::move(family.enqueue)),
        watch_(std::move(family.watch)) {
    cuda_ok(cudaSetDevice(device_), "cudaSetDevice");
    cuda_ok(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate");
    cuda_ok(cudaEventCreateWithFlags(&ready_, cudaEventDisableTiming), "cudaEventCreate");
    cuda_ok(cudaMalloc(&barrier_word_, sizeof(int32_t)), "cudaMalloc (barrier word)");
    cuda_ok(cudaMalloc(&scratch_, kHostStagingBytes), "cudaMalloc (NCCL host-tensor staging)");
    // On this communicator's stream, which its barrier's all-reduce runs on (the legacy
    // default stream's cudaMemset would be unordered with the non-blocking stream).
    cuda_ok(cudaMemsetAsync(barrier_word_, 0, sizeof(int32_t), stream_),
            "cudaMemsetAsync (barrier word)");
  }

  ~NcclCommunicator() override {
    watch_->forget(this);  // before anything its polls read goes
    cudaSetDevice(device_);
    if (!aborted_) {
      if (std::uncaught_exceptions() > 0) {
        abort_once();  // unwinding after a failure: peers may never finalize
      } else {
        finalize();
      }
    }
    if (stream_) cudaStreamSynchronize(stream_);
    cudaFree(scratch_);
    cudaFree(barrier_word_);
    if (ready_) cudaEventDestroy(ready_);
    if (stream_) cudaStreamDestroy(stream_);
  }

  std::string_view backend() const override { return "nccl"; }

  // One word sent to and received from each peer in one group: NCCL connects point-to-point
  // pairs (its own channels and buffers for them) at their first transfer, even with every
  // collective connection made at creation; the driver's measure of it joins this
  // communicator's transport bytes.
  void connect_peers(std::span<const int> peers) override {
    if (peers.empty()) return;
    SHARDLM_CHECK(peers.size() * sizeof(int32_t) <= kHostStagingBytes, "{}: {} peers to connect",
                  describe("connect_peers"), peers.size());
    const int64_t used_before = gpu_used_bytes();
    run(kConnectPeers, int64_t(peers.size()), {}, [&](void* const*) {
      auto* landing = static_cast<int32_t*>(scratch_);
      ncclResult_t res = ncclGroupStart();
      for (size_t i = 0; i < peers.size() && res == ncclSuccess; ++i) {
        res = ncclSend(barrier_word_, 1, ncclInt32, peers[i], comm_, stream_);
        if (res == ncclSuccess || res == ncclInProgress)
          res = ncclRecv(landing + i, 1, ncclInt32, peers[i], comm_, stream_);
        if (res == ncclInProgress) res = ncclSuccess;
      }
      const ncclResult_t end = ncclGroupEnd();
      return res != ncclSuccess ? res : end;
    })->wait();
    transport_bytes_ += std::max<int64_t>(0, gpu_used_bytes() - used_before);
  }
  int64_t transport_device_bytes() const override { return transport_bytes_; }
  int64_t host_waits() const override { return host_waits_.load(); }
  // What the driver saw taken on the GPU from just before NCCL made the communicator to after
  // this object was built.
  void set_transport_device_bytes(int64_t bytes) { transport_bytes_ = std::max<int64_t>(0, bytes); }
  // The GPU this rank drives: its local rank (nccl_device_for).
  int local_rank() const override { return device_; }

  // The calling thread becomes the compute thread: its waits for ops on device tensors are
  // stream dependencies from now on (groups split later inherit both).
  void set_compute_stream(void* stream) override {
    compute_ = static_cast<cudaStream_t>(stream);
    compute_thread_ = compute_ != nullptr ? std::this_thread::get_id() : std::thread::id{};
  }

  [[noreturn]] void abort(int exit_code) override {
    // Another thread may hold this communicator's lock in a wait that lasts until its timeout:
    // the process ends now either way, and without ncclCommAbort if the lock does not come.
    std::unique_lock<std::timed_mutex> lock(mutex_, std::chrono::seconds(1));
    if (lock.owns_lock()) abort_locked();
    std::fflush(stdout);
    std::fflush(stderr);
    std::_Exit(exit_code);  // the launcher (mpirun, torchrun) ends the other ranks
  }

  // Polls `done` until it has passed, checking NCCL's state; on error or timeout aborts. Each
  // poll takes this communicator's lock (the caller holds none).
  void wait_event(cudaEvent_t done, const std::string& what) {
    if (event_passed(done, what)) return;
    count_host_wait();
    poll_until(what, [&] { return event_passed(done, what); });
  }

  // Whether the calling thread queues the compute stream's work: there a wait for an op is
  // ordered on the device. Only at that thread's own program points, which are the same on
  // every rank: a stream dependency inserted by another thread (ZeRO's worker) would land at a
  // point that differs by rank, and could close a cycle across ranks through the compute
  // stream and another group's collective.
  bool on_compute_thread() const {
    return compute_ != nullptr && compute_thread_ == std::this_thread::get_id();
  }

  // The compute stream waits for `done` (the host does not): everything it runs later, and
  // every later op of any communicator of the family (each starts after the compute stream's
  // work), comes after the op. The dependency goes in first, then a failure recorded for the
  // family is raised: the op may still be running (the failure may be another communicator's),
  // and its buffers are reused in the compute stream's order. From here no host waits for the
  // op: the family's watch does (a host wait has a timeout of its own, so the watch is not told
  // of the ops the host waits for).
  void stream_wait(const SharedEvent& done, const std::string& what) {
    cuda_ok(cudaStreamWaitEvent(compute_, done.get(), 0), what);
    watch_op(done, what);
    watch_->raise_if_failed();
    SHARDLM_CHECK(!aborted_, "{}: the communicator was aborted after an earlier failure", what);
  }

  bool event_passed(cudaEvent_t done, const std::string& what) {
    auto lock = enqueue_->comm_lock(mutex_, what);
    return passed_locked(done, what);
  }

 protected:
  std::unique_ptr<CommHandle> start_all_reduce(const Tensor& buf, ReduceOp op) override {
    const ncclDataType_t t = nccl_type(buf.dtype());
    return in_pieces(buf, [&](const Tensor& piece) {
      return run("all_reduce", piece.numel(), {{piece, true, true}}, [&](void* const* p) {
        return ncclAllReduce(p[0], p[0], size_t(piece.numel()), t, nccl_op(op), comm_, stream_);
      });
    });
  }

  std::unique_ptr<CommHandle> start_reduce_scatter(const Tensor& send, const Tensor& recv,
                                                   ReduceOp op) override {
    const ncclDataType_t t = nccl_type(send.dtype());
    return run("reduce_scatter", send.numel(), {{send, true, false}, {recv, false, true}},
               [&](void* const* p) {
                 return ncclReduceScatter(p[0], p[1], size_t(recv.numel()), t, nccl_op(op), comm_,
                                          stream_);
               });
  }

  std::unique_ptr<CommHandle> start_all_gather(const Tensor& send, const Tensor& recv,
                                               bool in_place) override {
    const ncclDataType_t t = nccl_type(send.dtype());
    // recv first: an in-place send (recv's own chunk) is then found inside recv's staging.
    return run("all_gather", recv.numel(), {{recv, in_place, true}, {send, true, false}},
               [&](void* const* p) {
                 return ncclAllGather(p[1], p[0], size_t(send.numel()), t, comm_, stream_);
               });
  }

  std::unique_ptr<CommHandle> start_all_to_all(const Tensor& send, const Tensor& recv) override {
    const ncclDataType_t t = nccl_type(send.dtype());
    const size_t count = size_t(send.numel() / size());
    const size_t chunk = count * dtype_size(send.dtype());
    return run("all_to_all", send.numel(), {{send, true, false}, {recv, false, true}},
               [&](void* const* p) {
                 auto* s = static_cast<std::byte*>(p[0]);
                 auto* r = static_cast<std::byte*>(p[1]);
                 cuda_ok(cudaMemcpyAsync(r + rank() * chunk, s + rank() * chunk, chunk,
                                         cudaMemcpyDeviceToDevice, stream_),
                         "all_to_all (own chunk)");
                 ncclResult_t res = ncclGroupStart();
                 for (int peer = 0; peer < size() && res == ncclSuccess; ++peer) {
                   if (peer == rank()) continue;
                   res = ncclSend(s + peer * chunk, count, t, peer, comm_, stream_);
                   if (res == ncclSuccess || res == ncclInProgress)
                     res = ncclRecv(r + peer * chunk, count, t, peer, comm_, stream_);
                   if (res == ncclInProgress) res = ncclSuccess;
                 }
                 const ncclResult_t end = ncclGroupEnd();
                 return res != ncclSuccess ? res : end;
               });
  }

  std::unique_ptr<CommHandle> start_broadcast(const Tensor& buf, int root) override {
    const ncclDataType_t t = nccl_type(buf.dtype());
    return in_pieces(buf, [&](const Tensor& piece) {
      return run("broadcast", piece.numel(), {{piece, true, true}}, [&](void* const* p) {
        return ncclBroadcast(p[0], p[0], size_t(piece.numel()), t, root, comm_, stream_);
      });
    });
  }

  // NCCL has no tags: transfers between two ranks match in issue order (the base class has
  // checked the tag; callers that rely on tags to reorder must not use this transport).
  std::unique_ptr<CommHandle> start_send(const Tensor& buf, int peer, int /*tag*/) override {
    const ncclDataType_t t = nccl_type(buf.dtype());
    return in_pieces(buf, [&](const Tensor& piece) {
      return run("send", piece.numel(), {{piece, true, false}}, [&](void* const* p) {
        return ncclSend(p[0], size_t(piece.numel()), t, peer, comm_, stream_);
      });
    });
  }

  std::unique_ptr<CommHandle> start_recv(const Tensor& buf, int peer, int /*tag*/) override {
    const ncclDataType_t t = nccl_type(buf.dtype());
    return in_pieces(buf, [&](const Tensor& piece) {
      return run("recv", piece.numel(), {{piece, false, true}}, [&](void* const* p) {
        return ncclRecv(p[0], size_t(piece.numel()), t, peer, comm_, stream_);
      });
    });
  }

  // One group: the send and the recv progress together, so a ring step cannot deadlock.
  std::unique_ptr<CommHandle> start_sendrecv(const Tensor& send, int dest, const Tensor& recv,
                                             int source, int /*tag*/) override {
    const ncclDataType_t ts = nccl_type(send.dtype()), tr = nccl_type(recv.dtype());
    return run("sendrecv", send.numel(), {{send, true, false}, {recv, false, true}},
               [&](void* const* p) {
                 ncclResult_t res = ncclGroupStart();
                 if (res == ncclSuccess)
                   res = ncclSend(p[0], size_t(send.numel()), ts, dest, comm_, stream_);
                 if (res == ncclSuccess || res == ncclInProgress)
                   res = ncclRecv(p[1], size_t(recv.numel()), tr, source, comm_, stream_);
                 if (res == ncclInProgress) res = ncclSuccess;
                 const ncclResult_t end = ncclGroupEnd();
                 return res != ncclSuccess ? res : end;
               });
  }

  // NCCL has no barrier: an all-reduce of one word, waited for.
  std::unique_ptr<CommHandle> start_barrier() override {
    const Tensor word(barrier_word_, DType::kI32, {1}, MemPool::kDevice);
    return run("barrier", 1, {{word, false, false}}, [&](void* const* p) {
      return ncclAllReduce(p[0], p[0], 1, ncclInt32, ncclSum, comm_, stream_);
    });
  }

  // A collective of the parent's members, settled under the enqueue lock: every rank makes its
  // groups on one thread, before any other thread uses NCCL, in the same order (the grid).
  std::unique_ptr<Communicator> split_impl(int color, int key, std::string name) override {
    const std::string what = describe(fmt::format("split into '{}'", name));
    auto lock = enqueue_->comm_lock(mutex_, what);
    check_usable("split");
    cuda_ok(cudaSetDevice(device_), "cudaSetDevice");
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    ncclComm_t child = nullptr;
    const int64_t used_before = gpu_used_bytes();
    int child_rank = 0, child_size = 0;
    {
      const EnqueueLock::Hold hold = enqueue_->hold(options().timeout_s, what);
      const ncclResult_t r = ncclCommSplit(comm_, color, key, &child, &config);
      settle(comm_, r, options().timeout_s, what, fail_and_abort());
      SHARDLM_CHECK(child != nullptr, "{}: NCCL returned no communicator", what);
      settle(child, ncclInProgress, options().timeout_s, what,
             [child](const std::string&) { ncclCommAbort(child); });
      if (ncclCommUserRank(child, &child_rank) != ncclSuccess ||
          ncclCommCount(child, &child_size) != ncclSuccess) {
        ncclCommAbort(child);
        SHARDLM_FAIL(ErrorKind::kInternal, "{}: cannot read the new communicator's rank", what);
      }
    }
    auto made = std::make_unique<NcclCommunicator>(child, child_rank, child_size, device_,
                                                   std::move(name), options(), compute_,
                                                   compute_thread_, Family{enqueue_, watch_});
    made->set_transport_device_bytes(gpu_used_bytes() - used_before);
    return made;
  }

  // Size 1: on the compute thread, device to device, a copy queued on the compute stream;
  // otherwise (any pair of pools, another thread) on this communicator's stream, after the
  // compute stream's work, finished before returning.
  void copy_local(const Tensor& dst, const Tensor& src) override {
    if (on_compute_thread() && on_device(dst.data()) && on_device(src.data())) {
      cuda_ok(cudaSetDevice(device_), "cudaSetDevice");
      cuda_ok(
          cudaMemcpyAsync(dst.data(), src.data(), src.bytes(), cudaMemcpyDeviceToDevice, compute_),
          "copy (group of one)");
      return;
    }
    auto lock = enqueue_->comm_lock(mutex_, "copy (group of one)");
    cuda_ok(cudaSetDevice(device_), "cudaSetDevice");
    after_compute();
    cuda_ok(cudaMemcpyAsync(dst.data(), src.data(), src.bytes(), cudaMemcpyDefault, stream_),
            "copy (group of one)");
    count_host_wait();
    cuda_ok(cudaStreamSynchronize(stream_), "copy (group of one)");
  }

 private:
  struct Arg {
    Tensor t;
    bool in;   // the op reads it
    bool out;  // the op writes it
  };

  std::string describe(std::string_view op) const {
    return fmt::format("rank {} of {}: {} on NCCL communicator '{}' (GPU {})", rank(), size(), op,
                       name(), device_);
  }

  // ncclCommAbort exactly once, whichever thread (the ZeRO thread, the trainer) fails first,
  // under this communicator's lock: no other thread is then inside a call on comm_, and each
  // one re-checks aborted_ once it has the lock (check_usable, passed_locked).
  void abort_once() {
    auto lock = enqueue_->comm_lock(mutex_, describe("abort"));
    abort_locked();
  }
  void abort_locked() {
    if (!aborted_.exchange(true)) ncclCommAbort(comm_);
  }

  // Flushes this rank's outstanding work and frees the communicator; a peer that died makes
  // it time out (and aborts). Teardown runs on one thread once ZeRO's worker has stopped.
  void finalize() {
    const std::string what = describe("finalizing the communicator");
    try {
      auto lock = enqueue_->comm_lock(mutex_, what);
      const EnqueueLock::Hold hold = enqueue_->hold(options().timeout_s, what);
      settle(comm_, ncclCommFinalize(comm_), options().timeout_s, what,
             [this](const std::string&) { abort_locked(); });
      ncclCommDestroy(comm_);
    } catch (const Error&) {
      // settle aborted it, or the lock never came (then the process is failing anyway)
    }
  }

  // Calls `passed` (which takes the locks it needs) until it returns true; past the timeout
  // aborts the communicator and throws.
  template <typename Passed>
  void poll_until(const std::string& what, const Passed& passed) {
    const auto start = Clock::now();
    for (;;) {
      if (passed()) return;
      const double waited = since(start);
      if (waited > options().timeout_s) timed_out(what, [this] { abort_once(); });
      backoff(waited);
    }
  }

  // A host wait's timeout: recorded for the family's other threads before the communicator is
  // aborted (its kernels then end, and a thread that sees their events pass must already find
  // the failure), then thrown.
  template <typename Abort>
  [[noreturn]] void timed_out(const std::string& what, const Abort& abort) const {
    const std::string text =
        fmt::format("{} did not complete within {} s (SHARDLM_COMM_TIMEOUT_S): {}", what,
                    options().timeout_s, kTimeoutHint);
    watch_->fail(ErrorKind::kInternal, text);
    abort();
    SHARDLM_FAIL(ErrorKind::kInternal, "{}", text);
  }

  // settle's abort with this communicator's lock held: the failure recorded first, as above.
  std::function<void(const std::string&)> fail_and_abort() {
    return [this](const std::string& text) {
      watch_->fail(ErrorKind::kInternal, text);
      abort_locked();
    };
  }

  // One poll of `done` with this communicator's lock held: false while it is pending. Throws
  // when another thread aborted the communicator meanwhile, or NCCL reports an error.
  bool passed_locked(cudaEvent_t done, const std::string& what) {
    watch_->raise_if_failed();
    SHARDLM_CHECK(!aborted_, "{}: the communicator was aborted after a failure on another thread",
                  what);
    if (query_locked(done, what)) {
      // An op of another communicator aborted meanwhile may have ended early, this one with it:
      // its failure was recorded before the abort.
      watch_->raise_if_failed();
      return true;
    }
    check_async(what);
    return false;
  }

  // Whether `done` has passed, with this communicator's lock held.
  bool query_locked(cudaEvent_t done, const std::string& what) {
    cuda_ok(cudaSetDevice(device_), "cudaSetDevice");
    const cudaError_t e = cudaEventQuery(done);
    if (e == cudaSuccess) return true;
    if (e != cudaErrorNotReady) cuda_ok(e, what);
    return false;
  }

  // The watch's poll of an op completed on the device: never waits for this communicator's
  // lock, and aborts nothing (the watch's failure ends the process: make_nccl_world). An
  // aborted communicator is not read; its op is watched until its event passes or it times out
  // (an op queued behind the abort may never run, and the compute stream may wait for it).
  CompletionWatch::Poll poll_for_watch(cudaEvent_t done, const std::string& what) {
    std::unique_lock<std::timed_mutex> lock(mutex_, std::try_to_lock);
    if (!lock.owns_lock()) return CompletionWatch::Poll::kBusy;
    if (query_locked(done, what)) return CompletionWatch::Poll::kDone;
    if (aborted_) return CompletionWatch::Poll::kPending;
    const std::string error = async_error(what);
    if (!error.empty()) SHARDLM_FAIL(ErrorKind::kInternal, "{}", error);
    return CompletionWatch::Poll::kPending;
  }

  // Registers an op enqueued on device tensors with the family's watch.
  void watch_op(const SharedEvent& done, const std::string& what) {
    const int device = device_;
    watch_->watch({what, this, [this, done, what] { return poll_for_watch(done.get(), what); },
                   [done, device] {
                     cudaSetDevice(device);
                     return cudaEventQuery(done.get()) == cudaSuccess
                                ? CompletionWatch::Poll::kDone
                                : CompletionWatch::Poll::kPending;
                   }});
  }

  // wait_event for a caller that holds this communicator's lock (run's own waits).
  void wait_locked(cudaEvent_t done, const std::string& what) {
    const auto start = Clock::now();
    while (!passed_locked(done, what)) {
      const double waited = since(start);
      if (waited > options().timeout_s) timed_out(what, [this] { abort_locked(); });
      backoff(waited);
    }
  }

  void check_usable(std::string_view op) const {
    watch_->raise_if_failed();
    SHARDLM_CHECK(!aborted_,
                  "{}: the communicator was aborted after an earlier failure and cannot be used",
                  describe(op));
  }

  // NCCL's asynchronous error on this communicator as a message, or "" (lock held).
  std::string async_error(const std::string& what) {
    ncclResult_t state = ncclSuccess;
    const ncclResult_t q = ncclCommGetAsyncError(comm_, &state);
    if (q != ncclSuccess) state = q;
    if (state == ncclSuccess || state == ncclInProgress) return "";
    return fmt::format("{}: NCCL error: {}: {}", what, ncclGetErrorString(state),
                       ncclGetLastError(comm_) ? ncclGetLastError(comm_) : "");
  }

  // A host wait's check: an error is recorded for the family, then the communicator aborted
  // (lock held), then thrown.
  void check_async(const std::string& what) {
    const std::string error = async_error(what);
    if (error.empty()) return;
    fail_and_abort()(error);
    SHARDLM_FAIL(ErrorKind::kInternal, "{}", error);
  }

  // This stream waits for everything queued on the compute stream so far.
  void after_compute() {
    if (compute_ == nullptr) return;
    cuda_ok(cudaEventRecord(ready_, compute_), "cudaEventRecord");
    cuda_ok(cudaStreamWaitEvent(stream_, ready_, 0), "cudaStreamWaitEvent");
  }

  static bool on_device(const void* p) {
    cudaPointerAttributes a{};
    if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
      cudaGetLastError();  // an unknown host pointer on old drivers: clear the error
      return false;
    }
    return a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged;
  }

  // A host tensor larger than the staging moves as consecutive ops on pieces that fit, each
  // finished before the next. The pieces depend only on the size and the dtype, so they match
  // on every rank as long as every member passes the same pool (as the engine does: the same
  // code runs everywhere). Device tensors, and host tensors that fit, go in one op.
  template <typename StartPiece>
  std::unique_ptr<CommHandle> in_pieces(const Tensor& buf, const StartPiece& start) {
    if (buf.bytes() <= kHostStagingBytes || on_device(buf.data())) return start(buf);
    const size_t elem = dtype_size(buf.dtype());
    const int64_t per = int64_t(kHostStagingBytes / elem);
    auto* base = static_cast<std::byte*>(buf.data());
    for (int64_t at = 0; at < buf.numel(); at += per) {
      const Tensor piece(base + size_t(at) * elem, buf.dtype(), {std::min(per, buf.numel() - at)},
                         buf.pool());
      start(piece)->wait();
    }
    return std::make_unique<CompletedHandle>();
  }

  // Enqueues one op: device tensors in place, host tensors staged through scratch_ (then the op
  // is waited for here and copied back). `enqueue` gets the device pointers in args' order.
  std::unique_ptr<CommHandle> run(std::string_view op, int64_t elems, std::vector<Arg> args,
                                  const std::function<ncclResult_t(void* const*)>& enqueue) {
    const std::string what = describe(fmt::format("{} of {} elements", op, elems));
    auto lock = enqueue_->comm_lock(mutex_, what);
    check_usable(op);
    cuda_ok(cudaSetDevice(device_), "cudaSetDevice");
    std::vector<void*> ptrs(args.size(), nullptr);
    std::vector<size_t> offsets(args.size(), SIZE_MAX);  // into scratch_, for staged args
    size_t staged_bytes = 0;
    for (size_t i = 0; i < args.size(); ++i) {
      const Tensor& t = args[i].t;
      if (t.bytes() == 0 || on_device(t.data())) continue;
      // Inside an earlier staged arg (an in-place gather's send): share its staging.
      bool inside = false;
      for (size_t j = 0; j < i && !inside; ++j) {
        const auto* base = static_cast<const std::byte*>(args[j].t.data());
        const auto* p = static_cast<const std::byte*>(t.data());
        if (offsets[j] != SIZE_MAX && p >= base && p + t.bytes() <= base + args[j].t.bytes()) {
          offsets[i] = offsets[j] + size_t(p - base);
          inside = true;
        }
      }
      if (inside) continue;
      offsets[i] = staged_bytes;
      staged_bytes += (t.bytes() + 255) & ~size_t(255);
    }
    SHARDLM_CHECK(staged_bytes <= kHostStagingBytes,
                  "{}: its host tensors take {} bytes of staging, over the {} this communicator "
                  "keeps on the device; pass device tensors",
                  what, staged_bytes, kHostStagingBytes);
    auto* scratch = static_cast<std::byte*>(scratch_);
    after_compute();
    for (size_t i = 0; i < args.size(); ++i) {
      const Tensor& t = args[i].t;
      if (offsets[i] == SIZE_MAX) {
        ptrs[i] = t.data();
        continue;
      }
      ptrs[i] = scratch + offsets[i];
      if (args[i].in)
        cuda_ok(cudaMemcpyAsync(ptrs[i], t.data(), t.bytes(), cudaMemcpyHostToDevice, stream_),
                what);
    }
    {
      // From the group's start to its end, settled; not the wait for its completion.
      const EnqueueLock::Hold hold = enqueue_->hold(options().timeout_s, what);
      settle(comm_, enqueue(ptrs.data()), options().timeout_s, what, fail_and_abort());
    }
    const SharedEvent done = recorded_event();
    if (staged_bytes == 0 && op != "barrier" && op != kConnectPeers)
      return std::make_unique<NcclHandle>(*this, done, what);
    // The staging buffer is reused by the next op; a barrier and the connection of peers block.
    count_host_wait();  // one, with the copies back
    wait_locked(done.get(), what);
    for (size_t i = 0; i < args.size(); ++i) {
      if (offsets[i] == SIZE_MAX || !args[i].out) continue;
      cuda_ok(cudaMemcpyAsync(args[i].t.data(), ptrs[i], args[i].t.bytes(), cudaMemcpyDeviceToHost,
                              stream_),
              what);
    }
    cuda_ok(cudaStreamSynchronize(stream_), what);
    return std::make_unique<CompletedHandle>();
  }

  // host_waits() counts the compute thread's (ZeRO's worker's are its comm_wait_s).
  void count_host_wait() {
    if (std::this_thread::get_id() == compute_thread_) ++host_waits_;
  }

  // A new event recorded on this communicator's stream after what was enqueued on it.
  SharedEvent recorded_event() {
    cudaEvent_t e = nullptr;
    cuda_ok(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreate");
    SharedEvent done(e, [](cudaEvent_t ev) { cudaEventDestroy(ev); });
    cuda_ok(cudaEventRecord(e, stream_), "cudaEventRecord");
    return done;
  }

  ncclComm_t comm_ = nullptr;
  int device_ = 0;
  cudaStream_t compute_ = nullptr;          // the backend's compute stream, or none
  std::thread::id compute_thread_;          // the thread that queues compute_'s work
  cudaStream_t stream_ = nullptr;           // this communicator's
  cudaEvent_t ready_ = nullptr;             // recorded on compute_, waited for by stream_
  void* barrier_word_ = nullptr;            // [1] i32 on the device
  void* scratch_ = nullptr;                 // [kHostStagingBytes] staging for host tensors
  int64_t transport_bytes_ = 0;             // transport_device_bytes()
  std::atomic<int64_t> host_waits_{0};      // host_waits()
  std::shared_ptr<EnqueueLock> enqueue_;    // the world's: one thread enqueues at a time
  std::shared_ptr<CompletionWatch> watch_;  // the world's: ops no host waits for
  std::atomic<bool> aborted_{false};        // set by whichever thread saw the failure
  // Every call on comm_ (one op at a time on this communicator; polls and abort too).
  std::timed_mutex mutex_;

  friend class NcclHandle;
};

NcclHandle::~NcclHandle() {
  try {
    // A buffer must never be reused or freed under a transfer: the compute stream (whose work,
    // and every later op's, the device pool's reuse follows) or the host waits.
    if (!finished_) wait();
  } catch (const Error&) {
    // The communicator has been aborted; the error was or will be seen by its next user.
  }
}

void NcclHandle::wait() {
  if (finished_) return;
  finished_ = true;  // also on failure: the communicator is aborted, nothing is left to wait for
  if (comm_.on_compute_thread())
    comm_.stream_wait(done_, what_);
  else
    comm_.wait_event(done_.get(), what_);
}

bool NcclHandle::test() {
  if (!finished_) finished_ = comm_.event_passed(done_.get(), what_);
  return finished_;
}

// torchrun's LOCAL_WORLD_SIZE, the ranks on this node; 0 when unset or malformed (unknown).
int local_world_size() {
  const char* text = std::getenv("LOCAL_WORLD_SIZE");
  if (text == nullptr || *text == '\0') return 0;
  char* end = nullptr;
  const long n = std::strtol(text, &end, 10);
  return *end == '\0' && n > 0 && n < (1 << 20) ? int(n) : 0;
}

}  // namespace

bool nccl_built() { return true; }

std::unique_ptr<Communicator> make_nccl_world(Communicator* host_world,
                                              const CommOptions& options) {
  int rank = 0, size = 1, local = 0, local_size = 0;
  std::optional<LaunchEnv> env;
  if (host_world != nullptr && host_world->size() > 1) {
    rank = host_world->rank();
    size = host_world->size();
    local = host_world->local_rank();
    local_size = host_world->local_size();
  } else {
    env = launch_env();
    if (!env || env->world_size < 2)
      SHARDLM_FAIL(ErrorKind::kConfig,
                   "the NCCL communicator needs several ranks: start them with mpirun/srun, or "
                   "set RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT on each "
                   "process (torchrun's convention)");
    rank = env->rank;
    size = env->world_size;
    local = env->local_rank;
    local_size = local_world_size();
  }
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess || count == 0)
    SHARDLM_FAIL(ErrorKind::kConfig, "rank {}: no CUDA device is usable ({})", rank,
                 e == cudaSuccess ? "none found" : cudaGetErrorString(e));
  const int device = nccl_device_for(rank, local, local_size, count);
  cuda_ok(cudaSetDevice(device), "cudaSetDevice");
  cuda_ok(cudaFree(nullptr), "creating the CUDA context");  // not NCCL's: before the measure
  connect_at_creation();

  ncclUniqueId id{};
  static_assert(sizeof(id) % sizeof(int32_t) == 0);
  if (rank == 0) {
    const ncclResult_t r = ncclGetUniqueId(&id);
    if (r != ncclSuccess) nccl_fail(nullptr, r, "rank 0: ncclGetUniqueId");
  }
  if (env) {
    std::vector<std::byte> bytes(sizeof(id));
    std::memcpy(bytes.data(), &id, sizeof(id));
    bytes = tcp_broadcast_bytes(*env, bytes, options.timeout_s);
    SHARDLM_CHECK(bytes.size() == sizeof(id), "rank {}: the rendezvous gave {} bytes, not {}", rank,
                  bytes.size(), sizeof(id));
    std::memcpy(&id, bytes.data(), sizeof(id));
  } else {
    host_world->broadcast(
        Tensor(&id, DType::kI32, {int64_t(sizeof(id) / sizeof(int32_t))}, MemPool::kHost), 0);
  }

  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  ncclComm_t comm = nullptr;
  const int64_t used_before = gpu_used_bytes();
  const std::string what =
      fmt::format("rank {} of {}: NCCL initialisation on GPU {}", rank, size, device);
  // The world owns the process's enqueue lock and the watch; every communicator split from it
  // shares them.
  auto enqueue = std::make_shared<EnqueueLock>();
  // A failure the watch sees (an op no host waits for timed out, or NCCL reported an error)
  // ends this process at once, without aborting NCCL: the compute stream may wait for the failed
  // op forever, so every later synchronisation, the unwinding's included, could hang, and an
  // abort can block too (PyTorch's ProcessGroupNCCL tears its process down the same way by
  // default). The launcher ends the other ranks; the last checkpoint is whole (atomic).
  auto watch = std::make_shared<CompletionWatch>(
      options.timeout_s, kTimeoutHint, [rank, size](const Error& failure) {
        std::fprintf(stderr,
                     "shardlm: %s; ending rank %d of %d now (a failed NCCL collective cannot be "
                     "unwound)\n",
                     failure.what(), rank, size);
        std::fflush(stdout);
        std::fflush(stderr);
        std::_Exit(int(failure.kind()));
      });
  {
    const EnqueueLock::Hold hold = enqueue->hold(options.timeout_s, what);
    const ncclResult_t r = ncclCommInitRankConfig(&comm, size, id, rank, &config);
    if (comm == nullptr) nccl_fail(nullptr, r == ncclSuccess ? ncclInternalError : r, what);
    settle(comm, r, options.timeout_s, what, [comm](const std::string&) { ncclCommAbort(comm); });
  }
  auto world = std::make_unique<NcclCommunicator>(
      comm, rank, size, device, "world", options, nullptr, std::thread::id{},
      NcclCommunicator::Family{std::move(enqueue), std::move(watch)});
  world->set_transport_device_bytes(gpu_used_bytes() - used_before);
  return world;
}

}  // namespace shardlm
