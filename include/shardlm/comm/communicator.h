// Communicator: the collectives and point-to-point transfers every parallel strategy uses, over
// one group of ranks. It depends only on core and names no transport: LocalCommunicator (size
// 1), the MPI (world.h), TCP (tcp/), staged (staged/: device tensors through host memory) and
// NCCL (nccl.h) communicators implement it. Nothing here is global: a strategy receives a
// Communicator& (one per grid axis, made with split()).
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>

#include "shardlm/core/tensor.h"

namespace shardlm {

// Element-wise reductions of f32, bf16, f64, i32 and i64 tensors (f64 and i64 for the scalars
// that must stay exact: loss sums, token counts, norms).
//
// bf16 (tensor parallelism's activations and their gradients, at half the bytes of f32): each
// pairwise combination of two partial results is computed in f32 and rounded to bf16 (nearest,
// ties to even, as core/dtype.h's f32_to_bf16) before the next, as NCCL's ncclBfloat16 does.
// The f32 sum of two bf16 values is exact whenever the rounding could depend on it, so each
// combination is the bf16 nearest its exact result. The rounding happens in the transport (MPI:
// its user-defined bf16 ops, run by whichever rank combines; NCCL: its kernels). A sum over P
// ranks is thus rounded P - 1 times, in an order the transport picks (ring, tree, recursive
// halving; it may change with P and the size), so with bf16's unit roundoff u = 2^-8
//   |result - exact sum| <= ((1 + u)^(P-1) - 1) * sum over ranks of |x_r|,
// and sums whose every partial sum is a bf16 (small integers) are exact. Max and min are exact
// (the result is one of the inputs; a NaN loses to a number, as in NCCL). Gradients that
// accumulate over micro-batches or steps belong in f32 buffers, not in bf16 reductions.
// All dtypes may also be all-gathered, broadcast, all-to-all'd and sent: those move bytes.
enum class ReduceOp : uint8_t { kSum, kMax, kMin };

std::string_view reduce_op_name(ReduceOp op);

struct CommOptions {
  static constexpr double kDefaultTimeoutS = 300.0;
  // A blocking op, or wait() on an async one, that has not completed after this many seconds
  // throws Error naming the ranks that never arrived; the communicator is unusable afterwards
  // (the only sane next step is abort_world).
  double timeout_s = kDefaultTimeoutS;

  // timeout_s from SHARDLM_COMM_TIMEOUT_S (seconds, > 0) when set, else the default; a malformed
  // value is Error(kConfig) naming the variable.
  static CommOptions from_env();
};

// An operation in flight. The buffers it was started on must stay alive and untouched (recv
// buffers unread, send buffers unmodified) until wait() returns or test() returns true.
// Destroying an unfinished handle waits for it, so a buffer is never freed under a transfer.
// A handle must not outlive its communicator.
class CommHandle {
 public:
  CommHandle() = default;
  CommHandle(const CommHandle&) = delete;
  CommHandle& operator=(const CommHandle&) = delete;
  virtual ~CommHandle() = default;

  // Blocks until the operation is complete; throws Error on timeout or transport failure.
  // Device transports (NCCL), on the thread that set the compute stream, for an op on device
  // tensors: the compute stream waits for the op instead of the host, so everything queued on
  // it afterwards (and every later op of the communicator's family) comes after the op, and
  // the buffers may be reused by such work at once; a failure or timeout of the op then ends
  // the process (a watch polls what no host waits for: docs/comm.md, "Timeouts").
  virtual void wait() = 0;
  // Makes progress without blocking; true once complete (then wait() returns at once). MPI
  // moves data of nonblocking collectives only inside MPI calls, so a compute loop that wants
  // real overlap calls test() now and then.
  virtual bool test() = 0;
};

// Collectives over the `size()` ranks of one group. Every rank of the group must call the same
// collectives in the same order with matching sizes (tensors are read as flat arrays; only
// their element counts matter). Arguments are validated identically on every rank before
// anything is sent, so a bad call fails on all ranks with the same message, not as a hang.
//
// Adjoint pairs, for the parallel layers' forward/backward (Megatron's discipline):
//   all_reduce(sum)  <->  identity copy   (a row-parallel output's sum is the backward of a
//                                          column-parallel input's copy, and vice versa)
//   reduce_scatter   <->  all_gather      (ZeRO: gradients reduce-scattered, parameters
//                                          gathered; both over chunks in rank order)
//   all_to_all       <->  all_to_all      (with send and recv roles swapped: the chunk
//                                          transpose is its own inverse; Ulysses)
//   broadcast(root)  <->  sum-reduce to root (all_reduce, kept on the root)
//   send(peer)       <->  recv(peer)      (pipeline stages, ring attention)
//
// Size-1 fast path: with one rank every collective is a copy or nothing, done here in the base
// class before any backend is reached, so every backend at size 1 costs no transport call.
class Communicator {
 public:
  static constexpr int kMaxTag = 32767;  // the smallest MPI_TAG_UB the standard allows

  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;
  virtual ~Communicator() = default;

  int rank() const { return rank_; }
  int size() const { return size_; }
  // For messages: "world", "world/tp", ...
  const std::string& name() const { return name_; }
  // "local", "mpi", ...
  virtual std::string_view backend() const = 0;
  // This rank's index among the members of this group that share its node (picks a GPU).
  virtual int local_rank() const = 0;
  // How many members of this group share its node (local_rank() counts among them): with the
  // visible devices, whether ranks share one (device_shared_by_ranks). 1 unless the transport
  // knows its node's members (MPI, TCP and the staged world over them do); a group whose ranks
  // each own a device (NCCL's) need not say.
  virtual int local_size() const { return 1; }
  const CommOptions& options() const { return options_; }

  // buf [n] on every rank; afterwards buf = op over the ranks' bufs, on every rank.
  void all_reduce(const Tensor& buf, ReduceOp op = ReduceOp::kSum);
  std::unique_ptr<CommHandle> all_reduce_async(const Tensor& buf, ReduceOp op = ReduceOp::kSum);

  // send [size * n], recv [n]: recv = op over the ranks of their send chunk number rank().
  // Adjoint of all_gather. send and recv must not overlap.
  void reduce_scatter(const Tensor& send, const Tensor& recv, ReduceOp op = ReduceOp::kSum);
  std::unique_ptr<CommHandle> reduce_scatter_async(const Tensor& send, const Tensor& recv,
                                                   ReduceOp op = ReduceOp::kSum);

  // send [n], recv [size * n]: recv chunk r = rank r's send. Adjoint of reduce_scatter. send may
  // be exactly recv's chunk number rank() (gathering in place); any other overlap is an error.
  void all_gather(const Tensor& send, const Tensor& recv);
  std::unique_ptr<CommHandle> all_gather_async(const Tensor& send, const Tensor& recv);

  // send [size * n], recv [size * n]: recv chunk r = rank r's send chunk number rank().
  // Its own adjoint. send and recv must not overlap.
  void all_to_all(const Tensor& send, const Tensor& recv);

  // buf [n]: afterwards every rank holds root's buf.
  void broadcast(const Tensor& buf, int root);

  // Point to point within the group; tag in [0, kMaxTag]. recv's element count must equal the
  // matching send's. A blocking send may wait for the matching recv: use the async forms (or an
  // even/odd order) for rings. At size 1 a rank may send to itself.
  void send(const Tensor& buf, int peer, int tag = 0);
  void recv(const Tensor& buf, int peer, int tag = 0);
  std::unique_ptr<CommHandle> send_async(const Tensor& buf, int peer, int tag = 0);
  std::unique_ptr<CommHandle> recv_async(const Tensor& buf, int peer, int tag = 0);

  // send [n] to `dest` while receiving recv [m] from `source`, as one operation: a ring step
  // (every rank sends to rank + 1 and receives from rank - 1) cannot deadlock, also on
  // transports that match transfers between two ranks in issue order (NCCL), where a separate
  // send_async then recv_async can. Same tag rules as send/recv; send and recv must not overlap.
  void sendrecv(const Tensor& send, int dest, const Tensor& recv, int source, int tag = 0);
  std::unique_ptr<CommHandle> sendrecv_async(const Tensor& send, int dest, const Tensor& recv,
                                             int source, int tag = 0);

  void barrier();

  // Device transports (NCCL) run on a stream of their own. This orders each later operation of
  // this communicator after the device work queued on `stream` when the operation starts
  // (`stream` is Backend::device_stream(), an opaque handle), and makes the calling thread the
  // one whose waits are stream dependencies (CommHandle::wait); communicators split from it
  // afterwards inherit both. Transports on host memory ignore it: there every op of the backend
  // has finished when it returns.
  virtual void set_compute_stream(void* /*stream*/) {}

  // Collective over this group: the ranks passing the same color (>= 0) form a new group,
  // ordered by key (ties by rank()). Grid axes: split(topology.color(axis), topology.key(axis)).
  // The result is named "<name()>/<name>" (or "/color<c>") and inherits options().
  std::unique_ptr<Communicator> split(int color, int key, std::string_view name = {});

  // Ends every process of this job with `exit_code`, now; for abort_world.
  [[noreturn]] virtual void abort(int exit_code) = 0;

  // Device memory this communicator's transport holds outside every tensor passed to it (NCCL:
  // its channel buffers, its stream and its staging for host tensors), as the driver measured
  // it while the communicator was made; 0 for transports on host memory. A run's ledger and
  // plan count it (ParallelGrid::transport_device_bytes).
  virtual int64_t transport_device_bytes() const { return 0; }
  // How many times the thread that set the compute stream has waited on the host for an op of
  // this communicator (NCCL: an op on host tensors, a barrier, a group of one's copy of host
  // memory); 0 for transports on host memory, whose every op
  // completes on the host (their device copies are the backend's to count).
  virtual int64_t host_waits() const { return 0; }
  // Makes this rank's point-to-point connections with `peers` (group ranks, distinct, not this
  // rank) now, where a transport would make them at their first transfer (NCCL), so that their
  // memory is made, and counted in transport_device_bytes(), before a run allocates. Every peer
  // named must name this rank in its own call (the pairs are matched); the collectives'
  // connections are the transport's at creation. Nothing on host transports.
  virtual void connect_peers(std::span<const int> /*peers*/) {}

 protected:
  Communicator(int rank, int size, std::string name, CommOptions options);

  // Backends implement the ops for size() > 1 (send/recv at any size) on arguments already
  // validated. The blocking forms are start_*(...)->wait().
  virtual std::unique_ptr<CommHandle> start_all_reduce(const Tensor& buf, ReduceOp op) = 0;
  virtual std::unique_ptr<CommHandle> start_reduce_scatter(const Tensor& send, const Tensor& recv,
                                                           ReduceOp op) = 0;
  virtual std::unique_ptr<CommHandle> start_all_gather(const Tensor& send, const Tensor& recv,
                                                       bool in_place) = 0;
  virtual std::unique_ptr<CommHandle> start_all_to_all(const Tensor& send, const Tensor& recv) = 0;
  virtual std::unique_ptr<CommHandle> start_broadcast(const Tensor& buf, int root) = 0;
  virtual std::unique_ptr<CommHandle> start_send(const Tensor& buf, int peer, int tag) = 0;
  virtual std::unique_ptr<CommHandle> start_recv(const Tensor& buf, int peer, int tag) = 0;
  // Default: start_send and start_recv under one handle (both already started, so neither
  // waits for the other on MPI); NCCL overrides it with one grouped transfer.
  virtual std::unique_ptr<CommHandle> start_sendrecv(const Tensor& send, int dest,
                                                     const Tensor& recv, int source, int tag);
  virtual std::unique_ptr<CommHandle> start_barrier() = 0;
  virtual std::unique_ptr<Communicator> split_impl(int color, int key, std::string name) = 0;
  // The size-1 fast paths' copy (dst <- src, same byte count, distinct): memcpy, for host
  // memory; a device transport copies on its device.
  virtual void copy_local(const Tensor& dst, const Tensor& src);

 private:
  std::string what(std::string_view op) const;
  void check_peer(std::string_view op, int peer, int tag) const;
  void copy_bytes(const Tensor& dst, const Tensor& src);  // copy_local unless empty or same

  int rank_ = 0;
  int size_ = 1;
  std::string name_;
  CommOptions options_;
};

// A handle for an operation that finished when it was started (size-1 fast paths).
class CompletedHandle final : public CommHandle {
 public:
  void wait() override {}
  bool test() override { return true; }
};

// In place: element-wise sums of host f64 values over `group`, added in rank order from the
// all-gathered values, so every rank gets the same bits (an all-reduce may add in another
// order on each rank). For a few scalars (gradient-norm parts), not for tensors.
void ordered_sum(Communicator& group, std::span<double> values);

// Rank `root`'s text on every rank of the group (moved as 32-bit words: every transport moves
// them). Collective.
std::string broadcast_text(Communicator& group, std::string text, int root);

// Communicator::connect_peers with this rank's neighbours in the group, rank - 1 and rank + 1
// (wrapping round when `ring`); every member calls it.
void connect_neighbours(Communicator& group, bool ring);
// Communicator::connect_peers with every other member (an all-to-all's pairs); every member
// calls it.
void connect_all_peers(Communicator& group);

// For cli/ when this rank has failed and the others may be waiting in a collective: prints
// "shardlm: rank R of N: <message>; aborting all ranks" to stderr and ends the whole job with
// exit_code (MPI_Abort under MPI, exit() alone). Library code never calls it.
[[noreturn]] void abort_world(Communicator& comm, const std::string& message, int exit_code = 1);

}  // namespace shardlm
