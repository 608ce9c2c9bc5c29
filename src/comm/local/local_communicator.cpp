// LocalCommunicator: size 1. The base class answers every collective (copy or nothing) before
// a backend is reached, so the start_* collectives here are unreachable; only send/recv to self
// (a mailbox of copies), split and abort do anything.
#include "shardlm/comm/local.h"

#include <cstdlib>
#include <cstring>

namespace shardlm {

namespace {

[[noreturn]] void unreachable(const char* op) {
  SHARDLM_CHECK(false, "LocalCommunicator::{} called: the size-1 fast path should have handled it",
                op);
  std::abort();
}

}  // namespace

LocalCommunicator::LocalCommunicator(std::string name, CommOptions options)
    : Communicator(0, 1, std::move(name), options) {}

void LocalCommunicator::abort(int exit_code) { std::exit(exit_code); }

std::unique_ptr<CommHandle> LocalCommunicator::start_all_reduce(const Tensor&, ReduceOp) {
  unreachable("all_reduce");
}
std::unique_ptr<CommHandle> LocalCommunicator::start_reduce_scatter(const Tensor&, const Tensor&,
                                                                    ReduceOp) {
  unreachable("reduce_scatter");
}
std::unique_ptr<CommHandle> LocalCommunicator::start_all_gather(const Tensor&, const Tensor&,
                                                                bool) {
  unreachable("all_gather");
}
std::unique_ptr<CommHandle> LocalCommunicator::start_all_to_all(const Tensor&, const Tensor&) {
  unreachable("all_to_all");
}
std::unique_ptr<CommHandle> LocalCommunicator::start_broadcast(const Tensor&, int) {
  unreachable("broadcast");
}
std::unique_ptr<CommHandle> LocalCommunicator::start_barrier() { unreachable("barrier"); }

std::unique_ptr<CommHandle> LocalCommunicator::start_send(const Tensor& buf, int, int tag) {
  Message m{tag, std::vector<std::byte>(buf.bytes())};
  if (buf.bytes() != 0) std::memcpy(m.bytes.data(), buf.data(), buf.bytes());
  std::lock_guard lock(mailbox_mutex_);
  mailbox_.push_back(std::move(m));
  return std::make_unique<CompletedHandle>();
}

std::unique_ptr<CommHandle> LocalCommunicator::start_recv(const Tensor& buf, int, int tag) {
  std::lock_guard lock(mailbox_mutex_);
  for (auto it = mailbox_.begin(); it != mailbox_.end(); ++it) {
    if (it->tag != tag) continue;
    SHARDLM_CHECK(it->bytes.size() == buf.bytes(),
                  "recv on communicator '{}': the matching send (tag {}) has {} bytes but the "
                  "recv buffer {} {} has {}",
                  name(), tag, it->bytes.size(), dtype_name(buf.dtype()), buf.shape().str(),
                  buf.bytes());
    if (buf.bytes() != 0) std::memcpy(buf.data(), it->bytes.data(), buf.bytes());
    mailbox_.erase(it);
    return std::make_unique<CompletedHandle>();
  }
  SHARDLM_CHECK(false,
                "recv from self on communicator '{}' (tag {}) with no earlier send to self: it "
                "would wait forever; send before receiving",
                name(), tag);
  std::abort();
}

std::unique_ptr<Communicator> LocalCommunicator::split_impl(int, int, std::string name) {
  return std::make_unique<LocalCommunicator>(std::move(name), options());
}

}  // namespace shardlm
