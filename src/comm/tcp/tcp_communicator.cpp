// TcpCommunicator's frame: handles, op bookkeeping, send/recv, split and the world factory. The
// collectives are in tcp_collectives.cpp.
#include "comm/tcp/tcp_communicator.h"

#include <algorithm>
#include <cstdio>
#include <numeric>

#include "shardlm/comm/local.h"
#include "shardlm/comm/tcp.h"

namespace shardlm::tcp {

namespace {

uint64_t mix(uint64_t x) {  // splitmix64: communicator ids of splits
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// One Op. Waiting throws its error; an unfinished handle is waited for on destruction, except
// on a communicator already unusable, where its transfers are withdrawn.
class TcpHandle final : public CommHandle {
 public:
  TcpHandle(TcpCommunicator& comm, std::shared_ptr<Op> op) : comm_(comm), op_(std::move(op)) {}
  ~TcpHandle() override {
    {
      std::lock_guard lock(comm_.transport().mutex);
      if (op_->complete) return;
      if (comm_.unusable_locked()) {
        comm_.transport().fail(*op_, "abandoned on an unusable communicator", true);
        return;
      }
    }
    try {
      wait();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "shardlm: dropping an unfinished %s: %s\n", op_->what.c_str(), e.what());
    }
  }

  void wait() override {
    comm_.transport().wait(*op_, comm_.options().timeout_s, [this](const std::vector<int>& peers) {
      return comm_.timeout_message(peers);
    });
    comm_.raise(*op_);
  }

  bool test() override {
    {
      std::lock_guard lock(comm_.transport().mutex);
      if (!op_->complete) return false;
    }
    comm_.raise(*op_);
    return true;
  }

 private:
  TcpCommunicator& comm_;
  std::shared_ptr<Op> op_;
};

}  // namespace

TcpCommunicator::TcpCommunicator(std::shared_ptr<Transport> transport, std::vector<int> members,
                                 int rank, int local_rank, uint64_t id, std::string name,
                                 CommOptions options)
    : Communicator(rank, int(members.size()), std::move(name), options),
      transport_(std::move(transport)),
      members_(std::move(members)),
      local_rank_(local_rank),
      id_(id) {
  const std::string& mine = transport_->node(members_[size_t(rank)]);
  local_size_ = int(std::count_if(members_.begin(), members_.end(),
                                  [&](int w) { return transport_->node(w) == mine; }));
}

void TcpCommunicator::abort(int exit_code) { transport_->abort(exit_code); }

std::string TcpCommunicator::group_rank_label(int world_rank) const {
  const auto it = std::find(members_.begin(), members_.end(), world_rank);
  const int g = int(it - members_.begin());
  if (g == world_rank) return std::to_string(g);
  return fmt::format("{} (world rank {})", g, world_rank);
}

std::string TcpCommunicator::timeout_message(const std::vector<int>& world_peers) const {
  std::string who;
  for (int w : world_peers) who += (who.empty() ? "" : ", ") + group_rank_label(w);
  return fmt::format(
      "Not responding within {} s (SHARDLM_COMM_TIMEOUT_S): rank{} {}; the communicator is "
      "unusable now",
      options().timeout_s, world_peers.size() == 1 ? "" : "s", who.empty() ? "?" : who);
}

void TcpCommunicator::raise(const Op& op) {
  std::string error;
  {
    std::lock_guard lock(transport_->mutex);
    if (op.error.empty()) return;
    error = op.error;
    if (op.breaks && broken_.empty()) broken_ = op.error;
  }
  SHARDLM_FAIL(ErrorKind::kInternal, "{} on communicator '{}' (rank {} of {}): {}", op.what, name(),
               rank(), size(), error);
}

std::shared_ptr<Op> TcpCommunicator::begin(std::string what, bool collective, uint64_t& seq) {
  auto op = std::make_shared<Op>();
  std::lock_guard lock(transport_->mutex);
  if (collective) {
    seq = next_seq_++;
    what = fmt::format("{} #{}", what, seq);
  }
  op->what = std::move(what);
  if (!broken_.empty())
    SHARDLM_FAIL(ErrorKind::kInternal,
                 "{} on communicator '{}' (rank {} of {}): the communicator is unusable after an "
                 "earlier failure: {}",
                 op->what, name(), rank(), size(), broken_);
  return op;
}

std::unique_ptr<CommHandle> TcpCommunicator::handle(std::shared_ptr<Op> op) {
  return std::make_unique<TcpHandle>(*this, std::move(op));
}

void TcpCommunicator::send_to(Op& op, int peer, uint64_t tag, const void* data, size_t bytes,
                              size_t elem) {
  transport_->post_send(op, members_[size_t(peer)], id_, tag, data, bytes, elem);
}

void TcpCommunicator::recv_from(Op& op, int peer, uint64_t tag, void* data, size_t bytes,
                                size_t elem) {
  transport_->post_recv(op, members_[size_t(peer)], id_, tag, data, bytes, elem);
}

// ---- send  <->  recv ------------------------------------------------------------------------

std::unique_ptr<CommHandle> TcpCommunicator::start_send(const Tensor& buf, int peer, int tag) {
  uint64_t seq = 0;
  auto op = begin(fmt::format("send of {} {} to rank {} (tag {})", buf.numel(),
                              dtype_name(buf.dtype()), peer, tag),
                  false, seq);
  std::lock_guard lock(transport_->mutex);
  send_to(*op, peer, uint64_t(tag), buf.data(), buf.bytes(), dtype_size(buf.dtype()));
  transport_->settle(*op);
  return handle(op);
}

std::unique_ptr<CommHandle> TcpCommunicator::start_recv(const Tensor& buf, int peer, int tag) {
  uint64_t seq = 0;
  auto op = begin(fmt::format("recv of {} {} from rank {} (tag {})", buf.numel(),
                              dtype_name(buf.dtype()), peer, tag),
                  false, seq);
  std::lock_guard lock(transport_->mutex);
  recv_from(*op, peer, uint64_t(tag), buf.data(), buf.bytes(), dtype_size(buf.dtype()));
  transport_->settle(*op);
  return handle(op);
}

// ---- split ----------------------------------------------------------------------------------

std::unique_ptr<Communicator> TcpCommunicator::split_impl(int color, int key, std::string name) {
  // Every member's (color, key), then the members of this color ordered by (key, rank).
  std::vector<int64_t> mine = {color, key}, all(size_t(2 * size()));
  all_gather(Tensor(mine.data(), DType::kI64, {2}, MemPool::kHost),
             Tensor(all.data(), DType::kI64, {2 * int64_t(size())}, MemPool::kHost));
  std::vector<int> group;
  for (int r = 0; r < size(); ++r)
    if (all[size_t(2 * r)] == color) group.push_back(r);
  std::stable_sort(group.begin(), group.end(),
                   [&](int a, int b) { return all[size_t(2 * a + 1)] < all[size_t(2 * b + 1)]; });
  std::vector<int> members;
  int my_rank = 0, local = 0;
  const int me_world = members_[size_t(rank())];
  for (int r : group) {
    if (r == rank()) my_rank = int(members.size());
    members.push_back(members_[size_t(r)]);
  }
  for (int g = 0; g < my_rank; ++g)
    if (transport_->node(members[size_t(g)]) == transport_->node(me_world)) ++local;
  const uint64_t id = mix(id_ ^ mix((splits_++ << 32) ^ uint64_t(color)));
  return std::make_unique<TcpCommunicator>(transport_, std::move(members), my_rank, local, id,
                                           std::move(name), options());
}

}  // namespace shardlm::tcp

namespace shardlm {

std::unique_ptr<Communicator> make_tcp_world(const LaunchEnv& env, const CommOptions& options) {
  tcp::Mesh mesh = tcp::connect_mesh(env, options.timeout_s);
  auto transport = std::make_shared<tcp::Transport>(env.rank, std::move(mesh),
                                                    std::min(options.timeout_s, 60.0));
  std::vector<int> members(size_t(env.world_size));
  std::iota(members.begin(), members.end(), 0);
  return std::make_unique<tcp::TcpCommunicator>(std::move(transport), std::move(members), env.rank,
                                                env.local_rank, 1, "world", options);
}

std::unique_ptr<Communicator> make_world_without_mpi(const CommOptions& options) {
  const std::optional<LaunchEnv> env = launch_env();
  if (env && env->world_size > 1) return make_tcp_world(*env, options);
  return std::make_unique<LocalCommunicator>("world", options);
}

}  // namespace shardlm
