// Transport: the TCP communicator's sockets, one per pair of ranks of the launch (a full mesh),
// driven by one progress thread. Messages carry {communicator id, tag, bytes}; a receive matches
// the oldest message of its (peer, communicator, tag), so transfers on one key keep their order.
// Callers group transfers into an Op with an optional continuation, which the progress thread
// runs once the Op's posted transfers have finished (a collective's next stage): nothing a
// caller starts ever waits for a peer. Private to src/comm/tcp.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "comm/socket_io.h"
#include "shardlm/comm/rendezvous.h"

namespace shardlm::tcp {

struct Op;

// One message to or from a peer (a world rank of the launch).
struct Transfer {
  bool is_send = false;
  int peer = 0;
  uint64_t comm_id = 0;
  uint64_t tag = 0;
  std::byte* data = nullptr;
  size_t bytes = 0;
  size_t elem_bytes = 1;  // for size-mismatch messages, in elements
  size_t sent = 0;        // sends: bytes of header and body written
  bool finished = false;
  Op* op = nullptr;  // null for the zero-filled rest of a cancelled send
  std::vector<std::byte> zeros;
};

// An operation in flight: its transfers, the continuation that posts its next stage (or
// computes its result) once they have finished, and its outcome. Guarded by Transport::mutex.
struct Op {
  std::string what;  // "all_reduce #3 of 7 f32", for messages
  std::vector<std::unique_ptr<Transfer>> transfers;
  int outstanding = 0;
  std::function<void(Op&)> then;
  std::vector<std::byte> scratch;  // received chunks before they are reduced
  bool complete = false;
  std::string error;    // non-empty: the op failed
  bool breaks = false;  // the failure leaves the communicator unusable (a lost peer, a timeout)
};

struct Mesh {
  std::vector<net::Fd> sockets;    // [world size], connected, except this rank's own
  std::vector<std::string> nodes;  // [world size] an identity of each rank's machine
};

class Transport {
 public:
  Transport(int rank, Mesh mesh, double close_timeout_s);
  // Sends what is queued, tells every peer this rank is done and waits (bounded) until each
  // peer has said so too, so no rank closes a socket with data its peer has not yet read.
  ~Transport();
  Transport(const Transport&) = delete;
  Transport& operator=(const Transport&) = delete;

  int rank() const { return rank_; }
  int size() const { return int(peers_.size()); }
  const std::string& node(int world_rank) const { return nodes_[size_t(world_rank)]; }

  std::mutex mutex;  // guards every Op and the peers' state

  // Lock held. Post one transfer of `op` (at once complete for a lost peer: the op fails).
  void post_send(Op& op, int peer, uint64_t comm_id, uint64_t tag, const void* data, size_t bytes,
                 size_t elem_bytes);
  void post_recv(Op& op, int peer, uint64_t comm_id, uint64_t tag, void* data, size_t bytes,
                 size_t elem_bytes);
  // Lock held, after posting a stage: runs the continuation or completes the op when nothing of
  // it is outstanding.
  void settle(Op& op);
  // Lock held: fails `op` with `reason`, withdrawing its unfinished transfers.
  void fail(Op& op, const std::string& reason, bool breaks);
  // Lock held: the peers (world ranks) whose transfers of `op` have not finished.
  std::vector<int> pending_peers(const Op& op) const;

  // Lock not held. Blocks until `op` is complete; past timeout_s fails it with
  // on_timeout(pending peers) (which runs with the lock held).
  void wait(Op& op, double timeout_s,
            const std::function<std::string(const std::vector<int>&)>& on_timeout);

  // Ends this process now: every connection is shut (the peers' transfers with it fail, naming
  // this rank) and the process exits with exit_code.
  [[noreturn]] void abort(int exit_code);

 private:
  struct Key {
    uint64_t comm_id, tag;
    auto operator<=>(const Key&) const = default;
  };
  struct WireHeader {
    uint64_t comm_id, tag, bytes;
  };
  struct Peer {
    int fd = -1;
    std::string lost;  // non-empty once the connection is gone while it was still needed
    bool eof = false;  // the peer has closed its side
    std::list<Transfer*> sendq;
    std::map<Key, std::list<Transfer*>> posted;
    std::map<Key, std::list<std::vector<std::byte>>> unexpected;
    WireHeader rx{};
    size_t rx_header = 0, rx_body = 0;
    Transfer* rx_target = nullptr;
    bool rx_discard = false;
    std::vector<std::byte> rx_buffer;
    std::list<std::unique_ptr<Transfer>> orphans;  // cancelled sends still on the wire
  };

  void progress_loop();
  void wake();
  void read_peer(int p);
  void write_peer(int p, bool settle_now);
  void begin_body(Peer& peer);
  void finish_body(Peer& peer);
  void finish(Transfer& t, bool settle_now);
  void deliver(Transfer& t, const std::vector<std::byte>& bytes, bool settle_now);
  void peer_gone(int p, const std::string& reason);
  void cancel(Transfer& t);

  int rank_ = 0;
  double close_timeout_s_ = 30;
  std::vector<Peer> peers_;
  std::vector<std::string> nodes_;
  std::vector<net::Fd> sockets_;
  net::Fd wake_fd_;
  std::condition_variable changed_;
  bool closing_ = false;
  bool stop_ = false;
  std::thread progress_;
};

// The full mesh of a torchrun-style launch: each rank listens on a free port, the ports are
// exchanged through the rendezvous on MASTER_ADDR:MASTER_PORT, and rank i connects to every
// rank below it. Collective; every wait is bounded by timeout_s.
Mesh connect_mesh(const LaunchEnv& env, double timeout_s);

}  // namespace shardlm::tcp
