// NcclCommunicator: the Communicator over NCCL, one GPU per rank, and its bootstrap (the unique
// id over the MPI world or the TCP rendezvous). The only file that sees NCCL. Every op is
// enqueued on the communicator's own stream after an event recorded on the compute stream, and
// completes when an event after it does; NCCL runs in nonblocking mode, so every wait polls
// (event, ncclCommGetAsyncError) against the timeout and can abort the communicator.
#include <cuda_runtime.h>
#include <nccl.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "shardlm/comm/nccl.h"
#include "shardlm/comm/rendezvous.h"

namespace shardlm {

namespace {

using Clock = std::chrono::steady_clock;

void cuda_ok(cudaError_t e, std::string_view what) {
  if (e != cudaSuccess)
    SHARDLM_FAIL(ErrorKind::kInternal, "CUDA error in {}: {} ({})", what, cudaGetErrorString(e),
                 cudaGetErrorName(e));
}

ncclDataType_t nccl_type(DType t) {
  switch (t) {
    case DType::kF32:
      return ncclFloat32;
    case DType::kBF16:
      return ncclBfloat16;  // reduced pairwise, each result rounded to bf16 (communicator.h)
    case DType::kI32:
      return ncclInt32;
    case DType::kF64:
      return ncclFloat64;
    case DType::kI64:
      return ncclInt64;
    case DType::kU8:
      return ncclUint8;  // packed NF4 codes: moved, never reduced
  }
  SHARDLM_FAIL(ErrorKind::kInternal, "no NCCL type for {}", dtype_name(t));
}

ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return ncclSum;
    case ReduceOp::kMax:
      return ncclMax;
    case ReduceOp::kMin:
      return ncclMin;
  }
  return ncclSum;
}

// Yields for the first millisecond, then sleeps 1/32 of the time waited (at most 10 ms): a
// quick op costs no sleep, a long wait costs little CPU.
void backoff(double waited_s) {
  if (waited_s < 1e-3) {
    std::this_thread::yield();
    return;
  }
  std::this_thread::sleep_for(std::chrono::duration<double>(std::min(waited_s / 32, 0.01)));
}

double since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

[[noreturn]] void nccl_fail(ncclComm_t comm, ncclResult_t r, const std::string& what) {
  const char* detail = comm != nullptr ? ncclGetLastError(comm) : nullptr;
  SHARDLM_FAIL(ErrorKind::kInternal, "{}: NCCL error: {}{}{}", what, ncclGetErrorString(r),
               detail && *detail ? ": " : "", detail ? detail : "");
}

// Nonblocking NCCL: a call may return ncclInProgress and finish in the background. Polls the
// communicator's state until the call has finished; a failure, or no end within timeout_s,
// aborts the communicator and throws.
void settle(ncclComm_t comm, ncclResult_t r, double timeout_s, const std::string& what,
            const std::function<void()>& abort_comm) {
  if (r != ncclSuccess && r != ncclInProgress) {
    const std::string text = fmt::format("{}: NCCL error: {}", what, ncclGetErrorString(r));
    if (comm != nullptr) abort_comm();
    SHARDLM_FAIL(ErrorKind::kInternal, "{}", text);
  }
  const auto start = Clock::now();
  for (;;) {
    ncclResult_t state = ncclSuccess;
    const ncclResult_t q = ncclCommGetAsyncError(comm, &state);
    if (q != ncclSuccess) state = q;
    if (state == ncclSuccess) return;
    if (state != ncclInProgress) {
      const std::string text = fmt::format("{}: NCCL error: {}", what, ncclGetErrorString(state));
      abort_comm();
      SHARDLM_FAIL(ErrorKind::kInternal, "{}", text);
    }
    const double waited = since(start);
    if (waited > timeout_s) {
      abort_comm();
      SHARDLM_FAIL(ErrorKind::kInternal,
                   "{} did not finish within {} s (SHARDLM_COMM_TIMEOUT_S): another rank never "
                   "joined it or failed; NCCL was aborted",
                   what, timeout_s);
    }
    backoff(waited);
  }
}

class NcclCommunicator;

// An op in flight: done when its event (recorded on the communicator's stream after the op)
// has passed.
class NcclHandle final : public CommHandle {
 public:
  NcclHandle(NcclCommunicator& comm, cudaEvent_t done, std::string what)
      : comm_(comm), done_(done), what_(std::move(what)) {}
  ~NcclHandle() override;
  void wait() override;
  bool test() override;

 private:
  NcclCommunicator& comm_;
  cudaEvent_t done_;
  std::string what_;
  bool finished_ = false;
};

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(ncclComm_t comm, int rank, int size, int device, std::string name,
                   CommOptions options, cudaStream_t compute)
      : Communicator(rank, size, std::move(name), options),
        comm_(comm),
        device_(device),
        compute_(compute) {
    cuda_ok(cudaSetDevice(device_), "cudaSetDevice");
    cuda_ok(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate");
    cuda_ok(cudaEventCreateWithFlags(&ready_, cudaEventDisableTiming), "cudaEventCreate");
    cuda_ok(cudaMalloc(&barrier_word_, sizeof(int32_t)), "cudaMalloc (barrier word)");
    // On this communicator's stream, which its barrier's all-reduce runs on (the legacy
    // default stream's cudaMemset would be unordered with the non-blocking stream).
    cuda_ok(cudaMemsetAsync(barrier_word_, 0, sizeof(int32_t), stream_),
            "cudaMemsetAsync (barrier word)");
  }

  ~NcclCommunicator() override {
    cudaSetDevice(device_);
    if (!aborted_) {
      if (std::uncaught_exceptions() > 0) {
        abort_once();  // unwinding after a failure: peers may never finalize
      } else {
        try {
          // Flushes this rank's outstanding work; a peer that died makes it time out.
          settle(comm_, ncclCommFinalize(comm_), options().timeout_s,
                 describe("finalizing the communicator"), [this] { abort_once(); });
          ncclCommDestroy(comm_);
        } catch (const Error&) {
          // settle aborted it
        }
      }
    }
    if (stream_) cudaStreamSynchronize(stream_);
    cudaFree(scratch_);
    cudaFree(barrier_word_);
    if (ready_) cudaEventDestroy(ready_);
    if (stream_) cudaStreamDestroy(stream_);
  }

  std::string_view backend() const override { return "nccl"; }
  // The GPU this rank drives: its local rank modulo the visible GPUs.
  int local_rank() const override { return device_; }

  void set_compute_stream(void* stream) override { compute_ = static_cast<cudaStream_t>(stream); }

  [[noreturn]] void abort(int exit_code) override {
    abort_once();
    std::fflush(stdout);
    std::fflush(stderr);
    std::_Exit(exit_code);  // the launcher (mpirun, torchrun) ends the other ranks
  }

  // Polls `done` until it has passed, checking NCCL's state; on error or timeout aborts.
  void wait_event(cudaEvent_t done, const std::string& what) {
    cuda_ok(cudaSetDevice(device_), "cudaSetDevice");
    const auto start = Clock::now();
    for (;;) {
      const cudaError_t e = cudaEventQuery(done);
      if (e == cudaSuccess) return;
      if (e != cudaErrorNotReady) cuda_ok(e, what);
      check_async(what);
      const double waited = since(start);
      if (waited > options().timeout_s) {
        abort_once();
        SHARDLM_FAIL(ErrorKind::kInternal,
                     "{} did not complete within {} s (SHARDLM_COMM_TIMEOUT_S): another rank of "
                     "the group never called it, called a different collective, or died (NCCL "
                     "cannot tell which: look for the rank whose error differs); the "
                     "communicator was aborted",
                     what, options().timeout_s);
      }
      backoff(waited);
    }
  }

  bool event_passed(cudaEvent_t done, const std::string& what) {
    cuda_ok(cudaSetDevice(device_), "cudaSetDevice");
    const cudaError_t e = cudaEventQuery(done);
    if (e == cudaSuccess) return true;
    if (e != cudaErrorNotReady) cuda_ok(e, what);
    check_async(what);
    return false;
  }

 protected:
  std::unique_ptr<CommHandle> start_all_reduce(const Tensor& buf, ReduceOp op) override {
    const ncclDataType_t t = nccl_type(buf.dtype());
    return run("all_reduce", buf.numel(), {{buf, true, true}}, [&](void* const* p) {
      return ncclAllReduce(p[0], p[0], size_t(buf.numel()), t, nccl_op(op), comm_, stream_);
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
    return run("broadcast", buf.numel(), {{buf, true, true}}, [&](void* const* p) {
      return ncclBroadcast(p[0], p[0], size_t(buf.numel()), t, root, comm_, stream_);
    });
  }

  // NCCL has no tags: transfers between two ranks match in issue order (the base class has
  // checked the tag; callers that rely on tags to reorder must not use this transport).
  std::unique_ptr<CommHandle> start_send(const Tensor& buf, int peer, int /*tag*/) override {
    const ncclDataType_t t = nccl_type(buf.dtype());
    return run("send", buf.numel(), {{buf, true, false}}, [&](void* const* p) {
      return ncclSend(p[0], size_t(buf.numel()), t, peer, comm_, stream_);
    });
  }

  std::unique_ptr<CommHandle> start_recv(const Tensor& buf, int peer, int /*tag*/) override {
    const ncclDataType_t t = nccl_type(buf.dtype());
    return run("recv", buf.numel(), {{buf, false, true}}, [&](void* const* p) {
      return ncclRecv(p[0], size_t(buf.numel()), t, peer, comm_, stream_);
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

  std::unique_ptr<Communicator> split_impl(int color, int key, std::string name) override {
    std::lock_guard<std::mutex> lock(mutex_);
    check_usable("split");
    cuda_ok(cudaSetDevice(device_), "cudaSetDevice");
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    ncclComm_t child = nullptr;
    const std::string what = describe(fmt::format("split into '{}'", name));
    const ncclResult_t r = ncclCommSplit(comm_, color, key, &child, &config);
    settle(comm_, r, options().timeout_s, what, [this] { abort_once(); });
    SHARDLM_CHECK(child != nullptr, "{}: NCCL returned no communicator", what);
    settle(child, ncclInProgress, options().timeout_s, what, [child] { ncclCommAbort(child); });
    int child_rank = 0, child_size = 0;
    if (ncclCommUserRank(child, &child_rank) != ncclSuccess ||
        ncclCommCount(child, &child_size) != ncclSuccess) {
      ncclCommAbort(child);
      SHARDLM_FAIL(ErrorKind::kInternal, "{}: cannot read the new communicator's rank", what);
    }
    return std::make_unique<NcclCommunicator>(child, child_rank, child_size, device_,
                                              std::move(name), options(), compute_);
  }

  // Size 1: device-to-device (or any pair of pools) on this communicator's stream, after the
  // compute stream's work, finished before returning.
  void copy_local(const Tensor& dst, const Tensor& src) override {
    std::lock_guard<std::mutex> lock(mutex_);
    cuda_ok(cudaSetDevice(device_), "cudaSetDevice");
    after_compute();
    cuda_ok(cudaMemcpyAsync(dst.data(), src.data(), src.bytes(), cudaMemcpyDefault, stream_),
            "copy (group of one)");
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

  // ncclCommAbort exactly once, whichever thread (the ZeRO thread, the trainer) fails first.
  void abort_once() {
    if (!aborted_.exchange(true)) ncclCommAbort(comm_);
  }

  void check_usable(std::string_view op) const {
    SHARDLM_CHECK(!aborted_,
                  "{}: the communicator was aborted after an earlier failure and cannot be used",
                  describe(op));
  }

  void check_async(const std::string& what) {
    ncclResult_t state = ncclSuccess;
    const ncclResult_t q = ncclCommGetAsyncError(comm_, &state);
    if (q != ncclSuccess) state = q;
    if (state == ncclSuccess || state == ncclInProgress) return;
    const std::string text = fmt::format("{}: NCCL error: {}: {}", what, ncclGetErrorString(state),
                                         ncclGetLastError(comm_) ? ncclGetLastError(comm_) : "");
    abort_once();
    SHARDLM_FAIL(ErrorKind::kInternal, "{}", text);
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

  void* grow_scratch(size_t bytes) {
    if (bytes > scratch_bytes_) {
      cuda_ok(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
      cudaFree(scratch_);
      scratch_ = nullptr;
      scratch_bytes_ = 0;
      cuda_ok(cudaMalloc(&scratch_, bytes), "cudaMalloc (NCCL host-tensor staging)");
      scratch_bytes_ = bytes;
    }
    return scratch_;
  }

  // Enqueues one op: device tensors in place, host tensors staged through scratch_ (then the op
  // is waited for here and copied back). `enqueue` gets the device pointers in args' order.
  std::unique_ptr<CommHandle> run(std::string_view op, int64_t elems, std::vector<Arg> args,
                                  const std::function<ncclResult_t(void* const*)>& enqueue) {
    std::lock_guard<std::mutex> lock(mutex_);
    check_usable(op);
    cuda_ok(cudaSetDevice(device_), "cudaSetDevice");
    const std::string what = describe(fmt::format("{} of {} elements", op, elems));
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
    auto* scratch = static_cast<std::byte*>(staged_bytes ? grow_scratch(staged_bytes) : nullptr);
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
    settle(comm_, enqueue(ptrs.data()), options().timeout_s, what, [this] { abort_once(); });
    cudaEvent_t done = nullptr;
    cuda_ok(cudaEventCreateWithFlags(&done, cudaEventDisableTiming), "cudaEventCreate");
    cuda_ok(cudaEventRecord(done, stream_), "cudaEventRecord");
    auto handle = std::make_unique<NcclHandle>(*this, done, what);
    if (staged_bytes == 0 && op != "barrier") return handle;
    handle->wait();  // the staging buffer is reused by the next op; a barrier blocks
    for (size_t i = 0; i < args.size(); ++i) {
      if (offsets[i] == SIZE_MAX || !args[i].out) continue;
      cuda_ok(cudaMemcpyAsync(args[i].t.data(), ptrs[i], args[i].t.bytes(), cudaMemcpyDeviceToHost,
                              stream_),
              what);
    }
    cuda_ok(cudaStreamSynchronize(stream_), what);
    return std::make_unique<CompletedHandle>();
  }

  ncclComm_t comm_ = nullptr;
  int device_ = 0;
  cudaStream_t compute_ = nullptr;  // the backend's compute stream, or none
  cudaStream_t stream_ = nullptr;   // this communicator's
  cudaEvent_t ready_ = nullptr;     // recorded on compute_, waited for by stream_
  void* barrier_word_ = nullptr;    // [1] i32 on the device
  void* scratch_ = nullptr;         // staging for host tensors, grown to the largest call
  size_t scratch_bytes_ = 0;
  std::atomic<bool> aborted_{false};  // set by whichever thread saw the failure
  std::mutex mutex_;  // one op enqueued at a time (the ZeRO thread and the trainer never overlap)

  friend class NcclHandle;
};

NcclHandle::~NcclHandle() {
  try {
    if (!finished_) wait();  // a buffer must never be freed under a transfer
  } catch (const Error&) {
    // The communicator has been aborted; the error was or will be seen by its next user.
  }
  cudaEventDestroy(done_);
}

void NcclHandle::wait() {
  if (finished_) return;
  finished_ = true;  // also on failure: the communicator is aborted, nothing is left to wait for
  comm_.wait_event(done_, what_);
}

bool NcclHandle::test() {
  if (!finished_) finished_ = comm_.event_passed(done_, what_);
  return finished_;
}

}  // namespace

bool nccl_built() { return true; }

std::unique_ptr<Communicator> make_nccl_world(Communicator* host_world,
                                              const CommOptions& options) {
  int rank = 0, size = 1, local = 0;
  std::optional<LaunchEnv> env;
  if (host_world != nullptr && host_world->size() > 1) {
    rank = host_world->rank();
    size = host_world->size();
    local = host_world->local_rank();
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
  }
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess || count == 0)
    SHARDLM_FAIL(ErrorKind::kConfig, "rank {}: no CUDA device is usable ({})", rank,
                 e == cudaSuccess ? "none found" : cudaGetErrorString(e));
  const int device = local % count;
  cuda_ok(cudaSetDevice(device), "cudaSetDevice");

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
  const ncclResult_t r = ncclCommInitRankConfig(&comm, size, id, rank, &config);
  const std::string what =
      fmt::format("rank {} of {}: NCCL initialisation on GPU {}", rank, size, device);
  if (comm == nullptr) nccl_fail(nullptr, r == ncclSuccess ? ncclInternalError : r, what);
  settle(comm, r, options.timeout_s, what, [comm] { ncclCommAbort(comm); });
  return std::make_unique<NcclCommunicator>(comm, rank, size, device, "world", options, nullptr);
}

}  // namespace shardlm
