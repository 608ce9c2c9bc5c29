// StagedCommunicator's ops: host-pool tensors straight to the host communicator; collectives on
// device tensors chunk by chunk through one slot, finished before they return; sends and
// receives registered with the engine and advanced by every wait and test.
#include "shardlm/comm/staged.h"

#include <cstdlib>
#include <cstring>
#include <functional>

#include "comm/staged/staging_engine.h"

namespace shardlm {

using staged::Clock;
using staged::Transfer;

namespace {

bool on_device(const Tensor& t) { return t.pool() == MemPool::kDevice; }

// A staged send or receive. Destroying it unfinished waits for it (the buffer must outlive
// the transfer).
class TransferHandle final : public CommHandle {
 public:
  TransferHandle(std::shared_ptr<StagingEngine> engine, std::shared_ptr<Transfer> t,
                 double timeout_s)
      : engine_(std::move(engine)), t_(std::move(t)), timeout_s_(timeout_s) {}
  ~TransferHandle() override {
    try {
      wait();
    } catch (const Error&) {
      // The transport failed; the error was or will be seen by the op that waits next.
    }
  }

  void wait() override {
    const auto start = Clock::now();
    while (!test()) {
      if (staged::seconds_since(start) > timeout_s_)
        SHARDLM_FAIL(ErrorKind::kInternal,
                     "{}: chunk {} of {} did not complete within {} s (SHARDLM_COMM_TIMEOUT_S): "
                     "the peer never started the matching transfer, or failed",
                     t_->what, t_->next, t_->chunks, timeout_s_);
      staged::backoff(start);
    }
  }

  bool test() override {
    std::lock_guard lock(engine_->mutex);
    if (!t_->done) engine_->progress();
    return t_->done;
  }

 private:
  std::shared_ptr<StagingEngine> engine_;
  std::shared_ptr<Transfer> t_;
  double timeout_s_;
};

// One staged collective: `k` pieces of a chunk fit in the slot at once; for each chunk
// [begin, begin + count) of the per-rank element range [0, n), copy_in fills the slot, start
// moves it (returning the host op's handle), copy_out empties it. `slot` is the slot's memory.
struct Collective {
  std::string what;
  DType dtype = DType::kF32;
  int64_t n = 0;
  int k = 1;
  std::function<void(DeviceCopier&, std::byte*slot, int64_t begin, int64_t count)> copy_in,
      copy_out;
  std::function<std::unique_ptr<CommHandle>(std::byte* slot, int64_t count)> start;
};

}  // namespace

StagedCommunicator::StagedCommunicator(std::unique_ptr<Communicator> host)
    : StagedCommunicator(std::move(host), std::make_shared<StagingEngine>()) {}

StagedCommunicator::StagedCommunicator(Communicator& host)
    : Communicator(host.rank(), host.size(), host.name(), host.options()),
      host_(&host),
      engine_(std::make_shared<StagingEngine>()),
      backend_name_(std::string(host.backend()) + "-staged") {}

StagedCommunicator::StagedCommunicator(std::unique_ptr<Communicator> host,
                                       std::shared_ptr<StagingEngine> engine)
    : Communicator(host->rank(), host->size(), host->name(), host->options()),
      owned_host_(std::move(host)),
      host_(owned_host_.get()),
      engine_(std::move(engine)),
      backend_name_(std::string(host_->backend()) + "-staged") {}

StagedCommunicator::~StagedCommunicator() = default;

size_t StagedCommunicator::slot_bytes(size_t staging_bytes) {
  return staging_bytes / kSlots / 8 * 8;
}

void StagedCommunicator::attach(DeviceCopier& copier, std::span<std::byte> staging) {
  engine_->attach(copier, staging);
}

void StagedCommunicator::detach() { engine_->detach(); }

void StagedCommunicator::abort(int exit_code) {
  host_->abort(exit_code);
  std::abort();  // unreachable: the host's abort never returns
}

namespace {

// Takes a slot (advancing the transfers meanwhile), runs `c` chunk by chunk through it, gives
// it back. The host op of each chunk is polled, advancing the transfers between polls.
void run_collective(StagingEngine& engine, const Collective& c, double timeout_s) {
  const auto start = Clock::now();
  int slot = -1;
  DeviceCopier* copier = nullptr;
  while (slot < 0) {
    {
      std::lock_guard lock(engine.mutex);
      copier = &engine.copier(c.what);
      engine.progress();
      slot = engine.take_slot();
    }
    if (slot < 0) staged::backoff(start);
  }
  struct Release {
    StagingEngine& e;
    int s;
    ~Release() {
      std::lock_guard lock(e.mutex);
      e.give_slot(s);
    }
  } release{engine, slot};
  const int64_t chunk = int64_t(engine.slot_bytes() / (size_t(c.k) * dtype_size(c.dtype)));
  SHARDLM_CHECK(chunk >= 1,
                "{}: a staging slot of {} bytes holds no chunk of {} pieces of {}; raise "
                "parallel.device_comm_staging_kib",
                c.what, engine.slot_bytes(), c.k, dtype_name(c.dtype));
  std::byte* memory = engine.slot(slot);
  for (int64_t begin = 0; begin < c.n; begin += chunk) {
    const int64_t count = std::min(chunk, c.n - begin);
    c.copy_in(*copier, memory, begin, count);
    std::unique_ptr<CommHandle> h = c.start(memory, count);
    const auto chunk_start = Clock::now();
    while (!h->test()) {
      {
        std::lock_guard lock(engine.mutex);
        engine.progress();
      }
      // Past the deadline the host op's own wait names the ranks that never arrived.
      if (staged::seconds_since(chunk_start) > timeout_s) h->wait();
      staged::backoff(chunk_start);
    }
    c.copy_out(*copier, memory, begin, count);
  }
}

// Elements [begin, begin + count) of t.
Tensor piece(const Tensor& t, int64_t begin, int64_t count) {
  return Tensor(static_cast<std::byte*>(t.data()) + size_t(begin) * dtype_size(t.dtype()),
                t.dtype(), {count}, t.pool());
}

// Piece j of a chunk in the slot: `count` elements at j * count.
Tensor in_slot(std::byte* slot, int64_t j, int64_t count, DType dtype) {
  return Tensor(slot + size_t(j * count) * dtype_size(dtype), dtype, {count}, MemPool::kHost);
}

}  // namespace

// ---- collectives ------------------------------------------------------------------------------

std::unique_ptr<CommHandle> StagedCommunicator::start_all_reduce(const Tensor& buf, ReduceOp op) {
  if (!on_device(buf)) return host_->all_reduce_async(buf, op);
  const DType t = buf.dtype();
  Collective c;
  c.what = fmt::format("all_reduce on staged communicator '{}'", name());
  c.dtype = t;
  c.n = buf.numel();
  c.k = 1;
  c.copy_in = [&](DeviceCopier& cp, std::byte* s, int64_t b, int64_t n) {
    cp.copy(piece(buf, b, n), in_slot(s, 0, n, t));
  };
  c.start = [&](std::byte* s, int64_t n) {
    return host_->all_reduce_async(in_slot(s, 0, n, t), op);
  };
  c.copy_out = [&](DeviceCopier& cp, std::byte* s, int64_t b, int64_t n) {
    cp.copy(in_slot(s, 0, n, t), piece(buf, b, n));
  };
  run_collective(*engine_, c, options().timeout_s);
  return std::make_unique<CompletedHandle>();
}

// send [P * n] -> recv [n]: a chunk's slot holds rank r's piece of it at r, recv's at P.
std::unique_ptr<CommHandle> StagedCommunicator::start_reduce_scatter(const Tensor& send,
                                                                     const Tensor& recv,
                                                                     ReduceOp op) {
  if (!on_device(send) && !on_device(recv)) return host_->reduce_scatter_async(send, recv, op);
  const DType t = send.dtype();
  const int64_t n = recv.numel();
  const int P = size();
  Collective c;
  c.what = fmt::format("reduce_scatter on staged communicator '{}'", name());
  c.dtype = t;
  c.n = n;
  c.k = P + 1;
  c.copy_in = [&](DeviceCopier& cp, std::byte* s, int64_t b, int64_t m) {
    for (int r = 0; r < P; ++r) cp.copy(piece(send, r * n + b, m), in_slot(s, r, m, t));
  };
  c.start = [&](std::byte* s, int64_t m) {
    return host_->reduce_scatter_async(Tensor(s, t, {P * m}, MemPool::kHost), in_slot(s, P, m, t),
                                       op);
  };
  c.copy_out = [&](DeviceCopier& cp, std::byte* s, int64_t b, int64_t m) {
    cp.copy(in_slot(s, P, m, t), piece(recv, b, m));
  };
  run_collective(*engine_, c, options().timeout_s);
  return std::make_unique<CompletedHandle>();
}

// send [n] -> recv [P * n], gathered in place in the slot (this rank's piece at rank()).
std::unique_ptr<CommHandle> StagedCommunicator::start_all_gather(const Tensor& send,
                                                                 const Tensor& recv,
                                                                 bool /*in_place*/) {
  if (!on_device(send) && !on_device(recv)) return host_->all_gather_async(send, recv);
  const DType t = send.dtype();
  const int64_t n = send.numel();
  const int P = size();
  Collective c;
  c.what = fmt::format("all_gather on staged communicator '{}'", name());
  c.dtype = t;
  c.n = n;
  c.k = P;
  // An in-place send (recv's own chunk) is read before any of recv is written.
  c.copy_in = [&](DeviceCopier& cp, std::byte* s, int64_t b, int64_t m) {
    cp.copy(piece(send, b, m), in_slot(s, rank(), m, t));
  };
  c.start = [&](std::byte* s, int64_t m) {
    return host_->all_gather_async(in_slot(s, rank(), m, t), Tensor(s, t, {P * m}, MemPool::kHost));
  };
  c.copy_out = [&](DeviceCopier& cp, std::byte* s, int64_t b, int64_t m) {
    for (int r = 0; r < P; ++r) cp.copy(in_slot(s, r, m, t), piece(recv, r * n + b, m));
  };
  run_collective(*engine_, c, options().timeout_s);
  return std::make_unique<CompletedHandle>();
}

// send [P * n] -> recv [P * n]: the slot holds the send pieces at 0..P-1, the recv's at P..2P-1.
std::unique_ptr<CommHandle> StagedCommunicator::start_all_to_all(const Tensor& send,
                                                                 const Tensor& recv) {
  if (!on_device(send) && !on_device(recv)) {
    host_->all_to_all(send, recv);
    return std::make_unique<CompletedHandle>();
  }
  const DType t = send.dtype();
  const int P = size();
  const int64_t n = send.numel() / P;
  Collective c;
  c.what = fmt::format("all_to_all on staged communicator '{}'", name());
  c.dtype = t;
  c.n = n;
  c.k = 2 * P;
  c.copy_in = [&](DeviceCopier& cp, std::byte* s, int64_t b, int64_t m) {
    for (int r = 0; r < P; ++r) cp.copy(piece(send, r * n + b, m), in_slot(s, r, m, t));
  };
  c.start = [&](std::byte* s, int64_t m) {
    // Blocking (the host interface has no async all_to_all): transfers wait until it returns.
    host_->all_to_all(Tensor(s, t, {P * m}, MemPool::kHost), in_slot(s, 1, P * m, t));
    return std::unique_ptr<CommHandle>(std::make_unique<CompletedHandle>());
  };
  c.copy_out = [&](DeviceCopier& cp, std::byte* s, int64_t b, int64_t m) {
    for (int r = 0; r < P; ++r) cp.copy(in_slot(s, P + r, m, t), piece(recv, r * n + b, m));
  };
  run_collective(*engine_, c, options().timeout_s);
  return std::make_unique<CompletedHandle>();
}

std::unique_ptr<CommHandle> StagedCommunicator::start_broadcast(const Tensor& buf, int root) {
  if (!on_device(buf)) {
    host_->broadcast(buf, root);
    return std::make_unique<CompletedHandle>();
  }
  const DType t = buf.dtype();
  Collective c;
  c.what = fmt::format("broadcast on staged communicator '{}'", name());
  c.dtype = t;
  c.n = buf.numel();
  c.k = 1;
  c.copy_in = [&](DeviceCopier& cp, std::byte* s, int64_t b, int64_t m) {
    if (rank() == root) cp.copy(piece(buf, b, m), in_slot(s, 0, m, t));
  };
  c.start = [&](std::byte* s, int64_t m) {
    host_->broadcast(in_slot(s, 0, m, t), root);  // blocking, as all_to_all
    return std::unique_ptr<CommHandle>(std::make_unique<CompletedHandle>());
  };
  c.copy_out = [&](DeviceCopier& cp, std::byte* s, int64_t b, int64_t m) {
    if (rank() != root) cp.copy(in_slot(s, 0, m, t), piece(buf, b, m));
  };
  run_collective(*engine_, c, options().timeout_s);
  return std::make_unique<CompletedHandle>();
}

std::unique_ptr<CommHandle> StagedCommunicator::start_barrier() {
  host_->barrier();
  return std::make_unique<CompletedHandle>();
}

// ---- sends and receives ---------------------------------------------------------------------

std::unique_ptr<CommHandle> StagedCommunicator::start_send(const Tensor& buf, int peer, int tag) {
  if (!on_device(buf)) return host_->send_async(buf, peer, tag);
  return start_transfer(buf, peer, tag, true);
}

std::unique_ptr<CommHandle> StagedCommunicator::start_recv(const Tensor& buf, int peer, int tag) {
  if (!on_device(buf)) return host_->recv_async(buf, peer, tag);
  return start_transfer(buf, peer, tag, false);
}

std::unique_ptr<CommHandle> StagedCommunicator::start_transfer(const Tensor& buf, int peer, int tag,
                                                               bool is_send) {
  auto t = std::make_shared<Transfer>();
  t->host = host_;
  t->is_send = is_send;
  t->buf = buf;
  t->peer = peer;
  t->tag = tag;
  t->what = fmt::format("{} of {} bytes {} rank {} (tag {}) on staged communicator '{}'",
                        is_send ? "send" : "recv", buf.bytes(), is_send ? "to" : "from", peer, tag,
                        name());
  {
    std::lock_guard lock(engine_->mutex);
    (void)engine_->copier(t->what);
    // Whole elements per chunk, so that both ends cut a message at the same bytes.
    t->chunk_bytes = engine_->slot_bytes() / dtype_size(buf.dtype()) * dtype_size(buf.dtype());
    t->chunks = int64_t((buf.bytes() + t->chunk_bytes - 1) / t->chunk_bytes);
    engine_->add(t);
    engine_->progress();
  }
  return std::make_unique<TransferHandle>(engine_, std::move(t), options().timeout_s);
}

// ---- groups -------------------------------------------------------------------------------------

std::unique_ptr<Communicator> StagedCommunicator::split_impl(int color, int key, std::string name) {
  // `name` is "<this name>/<part>"; the host prefixes its own (the same) name again.
  const std::string part = name.substr(std::min(name.size(), this->name().size() + 1));
  std::unique_ptr<Communicator> child = host_->split(color, key, part);
  return std::unique_ptr<Communicator>(new StagedCommunicator(std::move(child), engine_));
}

void StagedCommunicator::copy_local(const Tensor& dst, const Tensor& src) {
  if (!on_device(dst) && !on_device(src)) {
    std::memcpy(dst.data(), src.data(), src.bytes());
    return;
  }
  DeviceCopier* copier = nullptr;
  {
    std::lock_guard lock(engine_->mutex);
    copier = &engine_->copier(fmt::format("copy on staged communicator '{}'", name()));
  }
  // The views may differ in dtype (the base class compares bytes): copy as bytes of src's dtype.
  copier->copy(src, Tensor(dst.data(), src.dtype(), {src.numel()}, dst.pool()));
}

}  // namespace shardlm
