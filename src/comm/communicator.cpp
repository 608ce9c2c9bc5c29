// The transport-independent half of every communicator: argument validation (identical on
// every rank, so a bad call fails everywhere instead of hanging), the size-1 fast paths, the
// timeout option and abort_world. Backends see only validated calls on groups of size > 1.
#include "shardlm/comm/communicator.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <vector>

namespace shardlm {

namespace {

bool overlaps(const Tensor& a, const Tensor& b) {
  if (a.bytes() == 0 || b.bytes() == 0) return false;
  const auto* pa = static_cast<const std::byte*>(a.data());
  const auto* pb = static_cast<const std::byte*>(b.data());
  return pa < pb + b.bytes() && pb < pa + a.bytes();
}

// Both handles of a sendrecv composed from a send and a recv.
class PairHandle final : public CommHandle {
 public:
  PairHandle(std::unique_ptr<CommHandle> a, std::unique_ptr<CommHandle> b)
      : a_(std::move(a)), b_(std::move(b)) {}
  void wait() override {
    a_->wait();
    b_->wait();
  }
  bool test() override {
    const bool a = a_->test();  // progress both, whatever the first says
    const bool b = b_->test();
    return a && b;
  }

 private:
  std::unique_ptr<CommHandle> a_, b_;
};

}  // namespace

void Communicator::copy_local(const Tensor& dst, const Tensor& src) {
  std::memcpy(dst.data(), src.data(), src.bytes());
}

void Communicator::copy_bytes(const Tensor& dst, const Tensor& src) {
  if (src.bytes() != 0 && dst.data() != src.data()) copy_local(dst, src);
}

std::string_view reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return "sum";
    case ReduceOp::kMax:
      return "max";
    case ReduceOp::kMin:
      return "min";
  }
  return "?";
}

void ordered_sum(Communicator& group, std::span<double> values) {
  const int64_t n = int64_t(values.size());
  std::vector<double> all(size_t(n * group.size()));
  group.all_gather(Tensor(values.data(), DType::kF64, {n}, MemPool::kHost),
                   Tensor(all.data(), DType::kF64, {n * group.size()}, MemPool::kHost));
  for (int64_t i = 0; i < n; ++i) {
    double sum = 0;
    for (int r = 0; r < group.size(); ++r) sum += all[size_t(r * n + i)];
    values[size_t(i)] = sum;
  }
}

std::string broadcast_text(Communicator& group, std::string text, int root) {
  int64_t n = int64_t(text.size());
  group.broadcast(Tensor(&n, DType::kI64, {1}, MemPool::kHost), root);
  std::vector<int32_t> words(size_t((n + 3) / 4), 0);
  if (group.rank() == root) std::memcpy(words.data(), text.data(), size_t(n));
  if (!words.empty())
    group.broadcast(Tensor(words.data(), DType::kI32, {int64_t(words.size())}, MemPool::kHost),
                    root);
  return std::string(reinterpret_cast<const char*>(words.data()), size_t(n));
}

void connect_neighbours(Communicator& group, bool ring) {
  const int n = group.size(), me = group.rank();
  std::vector<int> peers;
  for (const int peer : {me - 1, me + 1}) {
    const int wrapped = ring ? (peer + n) % n : peer;
    if (wrapped >= 0 && wrapped < n && wrapped != me &&
        std::find(peers.begin(), peers.end(), wrapped) == peers.end())
      peers.push_back(wrapped);
  }
  group.connect_peers(peers);
}

void connect_all_peers(Communicator& group) {
  std::vector<int> peers;
  for (int r = 0; r < group.size(); ++r)
    if (r != group.rank()) peers.push_back(r);
  group.connect_peers(peers);
}

CommOptions CommOptions::from_env() {
  CommOptions options;
  const char* text = std::getenv("SHARDLM_COMM_TIMEOUT_S");
  if (text == nullptr || *text == '\0') return options;
  char* end = nullptr;
  const double seconds = std::strtod(text, &end);
  if (end == text || *end != '\0' || !std::isfinite(seconds) || seconds <= 0) {
    SHARDLM_FAIL(ErrorKind::kConfig,
                 "SHARDLM_COMM_TIMEOUT_S='{}' is not a positive number of seconds; unset it for "
                 "the default of {} s",
                 text, kDefaultTimeoutS);
  }
  options.timeout_s = seconds;
  return options;
}

Communicator::Communicator(int rank, int size, std::string name, CommOptions options)
    : rank_(rank), size_(size), name_(std::move(name)), options_(options) {
  SHARDLM_CHECK(size >= 1 && rank >= 0 && rank < size, "rank {} of a group of size {}", rank, size);
}

std::string Communicator::what(std::string_view op) const {
  return fmt::format("{} on communicator '{}' (rank {} of {})", op, name_, rank_, size_);
}

void Communicator::check_peer(std::string_view op, int peer, int tag) const {
  SHARDLM_CHECK(peer >= 0 && peer < size_, "{}: peer {} is not a rank of this group", what(op),
                peer);
  SHARDLM_CHECK(tag >= 0 && tag <= kMaxTag, "{}: tag {} is outside [0, {}]", what(op), tag,
                kMaxTag);
}

// ---- all_reduce  <->  identity copy ---------------------------------------------------------

std::unique_ptr<CommHandle> Communicator::all_reduce_async(const Tensor& buf, ReduceOp op) {
  if (size_ == 1) return std::make_unique<CompletedHandle>();
  return start_all_reduce(buf, op);
}

void Communicator::all_reduce(const Tensor& buf, ReduceOp op) { all_reduce_async(buf, op)->wait(); }

// ---- reduce_scatter  <->  all_gather --------------------------------------------------------

std::unique_ptr<CommHandle> Communicator::reduce_scatter_async(const Tensor& send,
                                                               const Tensor& recv, ReduceOp op) {
  SHARDLM_CHECK(send.dtype() == recv.dtype(), "{}: send is {} but recv is {}",
                what("reduce_scatter"), dtype_name(send.dtype()), dtype_name(recv.dtype()));
  SHARDLM_CHECK(send.numel() == size_ * recv.numel(),
                "{}: send {} must hold size * recv.numel() = {} * {} elements",
                what("reduce_scatter"), send.shape().str(), size_, recv.numel());
  SHARDLM_CHECK(!overlaps(send, recv), "{}: send and recv overlap", what("reduce_scatter"));
  if (size_ == 1) {
    copy_bytes(recv, send);
    return std::make_unique<CompletedHandle>();
  }
  return start_reduce_scatter(send, recv, op);
}

void Communicator::reduce_scatter(const Tensor& send, const Tensor& recv, ReduceOp op) {
  reduce_scatter_async(send, recv, op)->wait();
}

std::unique_ptr<CommHandle> Communicator::all_gather_async(const Tensor& send, const Tensor& recv) {
  SHARDLM_CHECK(send.dtype() == recv.dtype(), "{}: send is {} but recv is {}", what("all_gather"),
                dtype_name(send.dtype()), dtype_name(recv.dtype()));
  SHARDLM_CHECK(recv.numel() == size_ * send.numel(),
                "{}: recv {} must hold size * send.numel() = {} * {} elements", what("all_gather"),
                recv.shape().str(), size_, send.numel());
  const auto* own_chunk = static_cast<const std::byte*>(recv.data()) + rank_ * send.bytes();
  const bool in_place = send.bytes() != 0 && send.data() == own_chunk;
  SHARDLM_CHECK(in_place || !overlaps(send, recv),
                "{}: send overlaps recv without being exactly recv's chunk {} (in place)",
                what("all_gather"), rank_);
  if (size_ == 1) {
    copy_bytes(recv, send);
    return std::make_unique<CompletedHandle>();
  }
  return start_all_gather(send, recv, in_place);
}

void Communicator::all_gather(const Tensor& send, const Tensor& recv) {
  all_gather_async(send, recv)->wait();
}

// ---- all_to_all  <->  all_to_all ------------------------------------------------------------

void Communicator::all_to_all(const Tensor& send, const Tensor& recv) {
  SHARDLM_CHECK(send.dtype() == recv.dtype(), "{}: send is {} but recv is {}", what("all_to_all"),
                dtype_name(send.dtype()), dtype_name(recv.dtype()));
  SHARDLM_CHECK(send.numel() == recv.numel() && send.numel() % size_ == 0,
                "{}: send {} and recv {} must hold the same size * n elements", what("all_to_all"),
                send.shape().str(), recv.shape().str());
  SHARDLM_CHECK(!overlaps(send, recv), "{}: send and recv overlap", what("all_to_all"));
  if (size_ == 1) return copy_bytes(recv, send);
  start_all_to_all(send, recv)->wait();
}

// ---- broadcast  <->  sum-reduce to root -----------------------------------------------------

void Communicator::broadcast(const Tensor& buf, int root) {
  SHARDLM_CHECK(root >= 0 && root < size_, "{}: root {} is not a rank of this group",
                what("broadcast"), root);
  if (size_ == 1) return;
  start_broadcast(buf, root)->wait();
}

// ---- send  <->  recv ------------------------------------------------------------------------

std::unique_ptr<CommHandle> Communicator::send_async(const Tensor& buf, int peer, int tag) {
  check_peer("send", peer, tag);
  return start_send(buf, peer, tag);
}

std::unique_ptr<CommHandle> Communicator::recv_async(const Tensor& buf, int peer, int tag) {
  check_peer("recv", peer, tag);
  return start_recv(buf, peer, tag);
}

void Communicator::send(const Tensor& buf, int peer, int tag) {
  send_async(buf, peer, tag)->wait();
}

void Communicator::recv(const Tensor& buf, int peer, int tag) {
  recv_async(buf, peer, tag)->wait();
}

std::unique_ptr<CommHandle> Communicator::sendrecv_async(const Tensor& send, int dest,
                                                         const Tensor& recv, int source, int tag) {
  check_peer("sendrecv", dest, tag);
  check_peer("sendrecv", source, tag);
  SHARDLM_CHECK(!overlaps(send, recv), "{}: send and recv overlap", what("sendrecv"));
  return start_sendrecv(send, dest, recv, source, tag);
}

void Communicator::sendrecv(const Tensor& send, int dest, const Tensor& recv, int source, int tag) {
  sendrecv_async(send, dest, recv, source, tag)->wait();
}

std::unique_ptr<CommHandle> Communicator::start_sendrecv(const Tensor& send, int dest,
                                                         const Tensor& recv, int source, int tag) {
  // The send first: a send to self (size 1) must be in the mailbox before its recv.
  auto s = start_send(send, dest, tag);
  auto r = start_recv(recv, source, tag);
  return std::make_unique<PairHandle>(std::move(s), std::move(r));
}

void Communicator::barrier() {
  if (size_ == 1) return;
  start_barrier()->wait();
}

std::unique_ptr<Communicator> Communicator::split(int color, int key, std::string_view name) {
  SHARDLM_CHECK(color >= 0, "{}: color {} must be >= 0 (every rank joins some group)",
                what("split"), color);
  std::string full =
      name.empty() ? fmt::format("{}/color{}", name_, color) : fmt::format("{}/{}", name_, name);
  return split_impl(color, key, std::move(full));
}

void abort_world(Communicator& comm, const std::string& message, int exit_code) {
  std::cout.flush();
  std::fflush(stdout);
  std::string text = message;
  while (!text.empty() && (text.back() == '.' || text.back() == '\n')) text.pop_back();
  std::fprintf(stderr, "shardlm: rank %d of %d: %s; aborting all ranks\n", comm.rank(), comm.size(),
               text.c_str());
  std::fflush(stderr);
  comm.abort(exit_code);
  std::abort();  // unreachable: abort() never returns
}

}  // namespace shardlm
