// TcpCommunicator: the Communicator over a group of the launch's ranks on the shared Transport.
// Each op becomes an Op of transfers (a collective's stages chained by continuations) keyed by
// this communicator's id and a tag: the user's tag for send/recv, the collective's sequence
// number and stage for collectives, so concurrent ops never take each other's messages.
// Private to src/comm/tcp.
#pragma once

#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "comm/tcp/transport.h"
#include "shardlm/comm/communicator.h"

namespace shardlm::tcp {

class TcpCommunicator final : public Communicator {
 public:
  // members[g] = world rank of group rank g; `rank` is this process's group rank.
  TcpCommunicator(std::shared_ptr<Transport> transport, std::vector<int> members, int rank,
                  int local_rank, uint64_t id, std::string name, CommOptions options);

  std::string_view backend() const override { return "tcp"; }
  int local_rank() const override { return local_rank_; }
  // The members whose transport node (the address they were reached at) is this rank's.
  int local_size() const override { return local_size_; }
  [[noreturn]] void abort(int exit_code) override;

  Transport& transport() { return *transport_; }
  // Throws the op's error (prefixed with what and where), marking this communicator unusable
  // when the failure does.
  void raise(const Op& op);
  bool unusable_locked() const { return !broken_.empty(); }  // transport mutex held
  std::string timeout_message(const std::vector<int>& world_peers) const;

 protected:
  std::unique_ptr<CommHandle> start_all_reduce(const Tensor& buf, ReduceOp op) override;
  std::unique_ptr<CommHandle> start_reduce_scatter(const Tensor& send, const Tensor& recv,
                                                   ReduceOp op) override;
  std::unique_ptr<CommHandle> start_all_gather(const Tensor& send, const Tensor& recv,
                                               bool in_place) override;
  std::unique_ptr<CommHandle> start_all_to_all(const Tensor& send, const Tensor& recv) override;
  std::unique_ptr<CommHandle> start_broadcast(const Tensor& buf, int root) override;
  std::unique_ptr<CommHandle> start_send(const Tensor& buf, int peer, int tag) override;
  std::unique_ptr<CommHandle> start_recv(const Tensor& buf, int peer, int tag) override;
  std::unique_ptr<CommHandle> start_barrier() override;
  std::unique_ptr<Communicator> split_impl(int color, int key, std::string name) override;

 private:
  // A new op named `what` (collectives numbered); throws when this communicator is unusable.
  std::shared_ptr<Op> begin(std::string what, bool collective, uint64_t& seq);
  std::unique_ptr<CommHandle> handle(std::shared_ptr<Op> op);
  // Lock held: transfers of op with group rank `peer`.
  void send_to(Op& op, int peer, uint64_t tag, const void* data, size_t bytes, size_t elem);
  void recv_from(Op& op, int peer, uint64_t tag, void* data, size_t bytes, size_t elem);
  std::string group_rank_label(int world_rank) const;

  std::shared_ptr<Transport> transport_;
  std::vector<int> members_;
  int local_rank_ = 0;
  int local_size_ = 1;
  uint64_t id_ = 0;
  uint64_t next_seq_ = 0;
  uint64_t splits_ = 0;
  std::string broken_;  // guarded by the transport's mutex; non-empty: unusable
};

}  // namespace shardlm::tcp
