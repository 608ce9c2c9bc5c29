// MpiCommunicator: the Communicator over one MPI_Comm (a duplicate or split made for it alone).
// Every op is a nonblocking MPI call polled with MPI_Test under the session lock until done or
// until the timeout, when the ranks are asked over a side channel where they are waiting and the
// Error names those that never arrived. Private to src/comm/mpi: only here is <mpi.h> seen.
#pragma once

#include <mpi.h>

#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "comm/mpi/session.h"
#include "shardlm/comm/communicator.h"

namespace shardlm::mpi {

enum class OpKind : int64_t {
  kAllReduce,
  kReduceScatter,
  kAllGather,
  kAllToAll,
  kBroadcast,
  kBarrier,
  kSend,
  kRecv,
};

std::string_view op_kind_name(OpKind kind);

// What a rank is waiting for, for timeout messages and for answering peers' queries.
struct OpInfo {
  OpKind kind = OpKind::kBarrier;
  int64_t seq = -1;  // collectives: index among this communicator's collectives; p2p: -1
  int64_t count = 0;
  DType dtype = DType::kF32;
  int peer = -1;  // send/recv: the other rank; broadcast: the root
  int tag = 0;
  std::string describe() const;
};

class MpiCommunicator final : public Communicator {
 public:
  // Takes ownership of `comm`, which every member has just created (split or idup): the
  // constructor is collective over it (it makes the side channel and finds the node ranks).
  MpiCommunicator(std::shared_ptr<Session> session, MPI_Comm comm, std::string name,
                  CommOptions options);
  ~MpiCommunicator() override;

  std::string_view backend() const override { return "mpi"; }
  int local_rank() const override { return local_rank_; }
  int local_size() const override { return local_size_; }
  [[noreturn]] void abort(int exit_code) override;

  // Polls `request` until complete (status filled) under the session lock, answering peers'
  // queries meanwhile; past the deadline, finds who is missing and throws.
  void wait_request(MPI_Request& request, MPI_Status* status, const OpInfo& op);
  // One poll; true when complete.
  bool test_request(MPI_Request& request, MPI_Status* status);
  bool broken() const { return !broken_reason_.empty(); }

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
  class Handle;
  struct PendingSend {
    MPI_Request request = MPI_REQUEST_NULL;
    std::array<int64_t, 3> payload{};
  };

  // Throws if broken; numbers collectives; returns the handle the MPI_I* call fills.
  std::unique_ptr<Handle> begin(OpInfo op);
  // Answers queued status queries from peers (lock held).
  void serve_queries();
  [[noreturn]] void fail_timeout(const OpInfo& op);
  // A peer's answer to a status query: {waiting, op kind, seq}; empty when it did not answer.
  using PeerReply = std::optional<std::array<int64_t, 3>>;
  // Queries every peer, serving their queries meanwhile, until all answer or the grace passes.
  std::vector<PeerReply> ask_peers_what_they_wait_for();
  // The timeout's Error text: the ranks waiting in the same op, in another, and the silent.
  std::string timeout_message(const OpInfo& op, const std::vector<PeerReply>& replies) const;
  std::string rank_label(int rank) const;

  std::shared_ptr<Session> session_;
  MPI_Comm comm_ = MPI_COMM_NULL;
  MPI_Comm side_ = MPI_COMM_NULL;  // status queries after a timeout, never user data
  int local_rank_ = 0;
  int local_size_ = 1;            // members on this node (MPI_COMM_TYPE_SHARED)
  std::vector<int> world_ranks_;  // [size] world rank of each member, for messages
  int64_t next_seq_ = 0;
  std::optional<OpInfo> waiting_;  // what wait_request is waiting for now (lock held)
  std::vector<std::unique_ptr<PendingSend>> pending_sends_;
  std::string broken_reason_;  // non-empty once an op timed out: the communicator is unusable
};

// Polls a request of communicator setup (MPI_Comm_idup) until `timeout_s` passes.
void wait_setup_request(Session& session, MPI_Request& request, double timeout_s,
                        const std::string& what);

}  // namespace shardlm::mpi
