// LocalCommunicator: the group of one rank, for a run without MPI. Every collective is the
// base class's size-1 fast path (a copy or nothing); send/recv to self go through a mailbox.
// No transport, no threads, no global state.
#pragma once

#include <deque>
#include <mutex>
#include <vector>

#include "shardlm/comm/communicator.h"

namespace shardlm {

class LocalCommunicator final : public Communicator {
 public:
  explicit LocalCommunicator(std::string name = "local", CommOptions options = {});

  std::string_view backend() const override { return "local"; }
  int local_rank() const override { return 0; }
  // exit(exit_code): the whole job is this process.
  [[noreturn]] void abort(int exit_code) override;

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
  struct Message {
    int tag = 0;
    std::vector<std::byte> bytes;
  };
  std::mutex mailbox_mutex_;
  std::deque<Message> mailbox_;  // sends to self not yet received, in send order
};

}  // namespace shardlm
