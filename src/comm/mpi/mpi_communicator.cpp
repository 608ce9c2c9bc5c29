// MpiCommunicator's operations: each validated call (see communicator.cpp) becomes one
// nonblocking MPI call (MPI_Iallreduce, MPI_Ireduce_scatter_block, MPI_Iallgather,
// MPI_Ialltoall, MPI_Ibcast, MPI_Isend/Irecv, MPI_Ibarrier) wrapped in a Handle; bf16
// reductions use the session's user-defined ops (bf16_ops.h). Waiting, timeouts and their
// diagnosis live in mpi_wait.cpp.
#include "comm/mpi/mpi_communicator.h"

#include <climits>
#include <cstdio>
#include <cstdlib>

#include "comm/mpi/mpi_check.h"

namespace shardlm::mpi {

namespace {

MPI_Datatype mpi_type(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return MPI_FLOAT;
    case DType::kI32:
      return MPI_INT32_T;
    case DType::kF64:
      return MPI_DOUBLE;
    case DType::kI64:
      return MPI_INT64_T;
    case DType::kBF16:
      return MPI_UINT16_T;  // raw 16-bit words: moved as they are, reduced by bf16_ops only
    case DType::kU8:
      return MPI_UINT8_T;  // packed NF4 codes: moved, never reduced
  }
  SHARDLM_CHECK(false, "no MPI type for dtype {}", dtype_name(dtype));
  return MPI_DATATYPE_NULL;
}

// MPI's built-in ops for the types MPI knows; bf16 (raw MPI_UINT16_T words, which MPI_SUM would
// add as integers) takes the session's user-defined ops, which add as bf16.
MPI_Op mpi_op(ReduceOp op, DType dtype, const Session& session) {
  if (dtype == DType::kBF16) return session.bf16_ops.op(op);
  switch (op) {
    case ReduceOp::kSum:
      return MPI_SUM;
    case ReduceOp::kMax:
      return MPI_MAX;
    case ReduceOp::kMin:
      return MPI_MIN;
  }
  SHARDLM_CHECK(false, "unknown ReduceOp {}", static_cast<int>(op));
  return MPI_OP_NULL;
}

// MPI counts are int: larger transfers must be bucketed by the caller.
int mpi_count(int64_t n, std::string_view op) {
  SHARDLM_CHECK(n <= INT_MAX,
                "{} of {} elements exceeds MPI's int count; split it into buckets of at most "
                "{} elements",
                op, n, INT_MAX);
  return static_cast<int>(n);
}

int comm_rank(MPI_Comm comm) {
  int r = 0;
  SHARDLM_MPI_CHECK(MPI_Comm_rank(comm, &r));
  return r;
}

int comm_size(MPI_Comm comm) {
  int s = 0;
  SHARDLM_MPI_CHECK(MPI_Comm_size(comm, &s));
  return s;
}

}  // namespace

std::string_view op_kind_name(OpKind kind) {
  switch (kind) {
    case OpKind::kAllReduce:
      return "all_reduce";
    case OpKind::kReduceScatter:
      return "reduce_scatter";
    case OpKind::kAllGather:
      return "all_gather";
    case OpKind::kAllToAll:
      return "all_to_all";
    case OpKind::kBroadcast:
      return "broadcast";
    case OpKind::kBarrier:
      return "barrier";
    case OpKind::kSend:
      return "send";
    case OpKind::kRecv:
      return "recv";
  }
  return "?";
}

std::string OpInfo::describe() const {
  const std::string_view name = op_kind_name(kind);
  switch (kind) {
    case OpKind::kBarrier:
      return fmt::format("{} #{}", name, seq);
    case OpKind::kBroadcast:
      return fmt::format("{} #{} of {} {} from root {}", name, seq, count, dtype_name(dtype), peer);
    case OpKind::kSend:
      return fmt::format("send of {} {} to rank {} (tag {})", count, dtype_name(dtype), peer, tag);
    case OpKind::kRecv:
      return fmt::format("recv of {} {} from rank {} (tag {})", count, dtype_name(dtype), peer,
                         tag);
    default:
      return fmt::format("{} #{} of {} {}", name, seq, count, dtype_name(dtype));
  }
}

// One MPI request. An unfinished handle is waited for on destruction (its buffers may still be
// in use by MPI), except on a communicator already broken by a timeout, where it is abandoned.
class MpiCommunicator::Handle final : public CommHandle {
 public:
  Handle(MpiCommunicator& comm, OpInfo op) : comm_(comm), op_(std::move(op)) {}
  ~Handle() override {
    if (done_ || request == MPI_REQUEST_NULL || comm_.broken()) return;
    try {
      wait();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "shardlm: dropping an unfinished %s: %s\n", op_.describe().c_str(),
                   e.what());
    }
  }

  void wait() override {
    if (done_) return;
    comm_.wait_request(request, &status_, op_);
    finish();
  }

  bool test() override {
    if (!done_ && comm_.test_request(request, &status_)) finish();
    return done_;
  }

  MPI_Request request = MPI_REQUEST_NULL;

 private:
  void finish() {
    done_ = true;
    if (op_.kind != OpKind::kRecv) return;
    int received = 0;
    SHARDLM_MPI_CHECK(MPI_Get_count(&status_, mpi_type(op_.dtype), &received));
    SHARDLM_CHECK(received == op_.count,
                  "{} on communicator '{}' (rank {}): the matching send had {} elements; sizes "
                  "must agree",
                  op_.describe(), comm_.name(), comm_.rank(), received);
  }

  MpiCommunicator& comm_;
  OpInfo op_;
  MPI_Status status_{};
  bool done_ = false;
};

MpiCommunicator::MpiCommunicator(std::shared_ptr<Session> session, MPI_Comm comm, std::string name,
                                 CommOptions options)
    : Communicator(comm_rank(comm), comm_size(comm), std::move(name), options),
      session_(std::move(session)),
      comm_(comm) {
  std::lock_guard lock(session_->mutex);
  SHARDLM_MPI_CHECK(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN));
  SHARDLM_MPI_CHECK(MPI_Comm_dup(comm_, &side_));

  MPI_Comm node = MPI_COMM_NULL;
  SHARDLM_MPI_CHECK(MPI_Comm_split_type(comm_, MPI_COMM_TYPE_SHARED, rank(), MPI_INFO_NULL, &node));
  local_rank_ = comm_rank(node);
  local_size_ = comm_size(node);
  SHARDLM_MPI_CHECK(MPI_Comm_free(&node));

  MPI_Group group = MPI_GROUP_NULL, world_group = MPI_GROUP_NULL;
  SHARDLM_MPI_CHECK(MPI_Comm_group(comm_, &group));
  SHARDLM_MPI_CHECK(MPI_Comm_group(MPI_COMM_WORLD, &world_group));
  std::vector<int> members(size());
  for (int r = 0; r < size(); ++r) members[r] = r;
  world_ranks_.resize(size());
  SHARDLM_MPI_CHECK(
      MPI_Group_translate_ranks(group, size(), members.data(), world_group, world_ranks_.data()));
  SHARDLM_MPI_CHECK(MPI_Group_free(&group));
  SHARDLM_MPI_CHECK(MPI_Group_free(&world_group));
}

MpiCommunicator::~MpiCommunicator() {
  std::lock_guard lock(session_->mutex);
  // Replies to peers' queries that never completed: their buffers are left to MPI.
  for (auto& p : pending_sends_) {
    int done = 0;
    MPI_Test(&p->request, &done, MPI_STATUS_IGNORE);
    if (!done) {
      MPI_Request_free(&p->request);
      (void)p.release();
    }
  }
  if (broken()) return;  // requests were abandoned on it; leave it to the dying process
  MPI_Comm_free(&side_);
  MPI_Comm_free(&comm_);
}

void MpiCommunicator::abort(int exit_code) {
  // No lock: another thread may hold it inside a wait, and MPI_Abort must not wait for it.
  MPI_Abort(MPI_COMM_WORLD, exit_code);
  std::abort();
}

std::string MpiCommunicator::rank_label(int rank) const {
  if (world_ranks_[rank] == rank) return std::to_string(rank);
  return fmt::format("{} (world rank {})", rank, world_ranks_[rank]);
}

std::unique_ptr<MpiCommunicator::Handle> MpiCommunicator::begin(OpInfo op) {
  SHARDLM_CHECK(!broken(),
                "{} on communicator '{}' (rank {}): the communicator is unusable after "
                "an earlier failure: {}",
                op.describe(), name(), rank(), broken_reason_);
  if (op.kind != OpKind::kSend && op.kind != OpKind::kRecv) op.seq = next_seq_++;
  return std::make_unique<Handle>(*this, std::move(op));
}

// ---- all_reduce  <->  identity copy ---------------------------------------------------------

std::unique_ptr<CommHandle> MpiCommunicator::start_all_reduce(const Tensor& buf, ReduceOp op) {
  const int n = mpi_count(buf.numel(), "all_reduce");
  const MPI_Op reduce = mpi_op(op, buf.dtype(), *session_);
  auto h = begin({.kind = OpKind::kAllReduce, .count = buf.numel(), .dtype = buf.dtype()});
  std::lock_guard lock(session_->mutex);
  SHARDLM_MPI_CHECK(MPI_Iallreduce(MPI_IN_PLACE, buf.data(), n, mpi_type(buf.dtype()), reduce,
                                   comm_, &h->request));
  return h;
}

// ---- reduce_scatter  <->  all_gather --------------------------------------------------------

std::unique_ptr<CommHandle> MpiCommunicator::start_reduce_scatter(const Tensor& send,
                                                                  const Tensor& recv, ReduceOp op) {
  const int n = mpi_count(recv.numel(), "reduce_scatter");
  const MPI_Op reduce = mpi_op(op, send.dtype(), *session_);
  auto h = begin({.kind = OpKind::kReduceScatter, .count = send.numel(), .dtype = send.dtype()});
  std::lock_guard lock(session_->mutex);
  SHARDLM_MPI_CHECK(MPI_Ireduce_scatter_block(send.data(), recv.data(), n, mpi_type(send.dtype()),
                                              reduce, comm_, &h->request));
  return h;
}

std::unique_ptr<CommHandle> MpiCommunicator::start_all_gather(const Tensor& send,
                                                              const Tensor& recv, bool in_place) {
  const int n = mpi_count(send.numel(), "all_gather");
  mpi_count(recv.numel(), "all_gather");
  auto h = begin({.kind = OpKind::kAllGather, .count = recv.numel(), .dtype = recv.dtype()});
  const MPI_Datatype type = mpi_type(recv.dtype());
  std::lock_guard lock(session_->mutex);
  SHARDLM_MPI_CHECK(MPI_Iallgather(in_place ? MPI_IN_PLACE : send.data(), n, type, recv.data(), n,
                                   type, comm_, &h->request));
  return h;
}

// ---- all_to_all  <->  all_to_all ------------------------------------------------------------

std::unique_ptr<CommHandle> MpiCommunicator::start_all_to_all(const Tensor& send,
                                                              const Tensor& recv) {
  mpi_count(send.numel(), "all_to_all");
  const int n = static_cast<int>(send.numel() / size());
  auto h = begin({.kind = OpKind::kAllToAll, .count = send.numel(), .dtype = send.dtype()});
  const MPI_Datatype type = mpi_type(send.dtype());
  std::lock_guard lock(session_->mutex);
  SHARDLM_MPI_CHECK(MPI_Ialltoall(send.data(), n, type, recv.data(), n, type, comm_, &h->request));
  return h;
}

// ---- broadcast  <->  sum-reduce to root -----------------------------------------------------

std::unique_ptr<CommHandle> MpiCommunicator::start_broadcast(const Tensor& buf, int root) {
  const int n = mpi_count(buf.numel(), "broadcast");
  auto h =
      begin({.kind = OpKind::kBroadcast, .count = buf.numel(), .dtype = buf.dtype(), .peer = root});
  std::lock_guard lock(session_->mutex);
  SHARDLM_MPI_CHECK(MPI_Ibcast(buf.data(), n, mpi_type(buf.dtype()), root, comm_, &h->request));
  return h;
}

// ---- send  <->  recv ------------------------------------------------------------------------

std::unique_ptr<CommHandle> MpiCommunicator::start_send(const Tensor& buf, int peer, int tag) {
  const int n = mpi_count(buf.numel(), "send");
  auto h = begin({.kind = OpKind::kSend,
                  .count = buf.numel(),
                  .dtype = buf.dtype(),
                  .peer = peer,
                  .tag = tag});
  std::lock_guard lock(session_->mutex);
  SHARDLM_MPI_CHECK(MPI_Isend(buf.data(), n, mpi_type(buf.dtype()), peer, tag, comm_, &h->request));
  return h;
}

std::unique_ptr<CommHandle> MpiCommunicator::start_recv(const Tensor& buf, int peer, int tag) {
  const int n = mpi_count(buf.numel(), "recv");
  auto h = begin({.kind = OpKind::kRecv,
                  .count = buf.numel(),
                  .dtype = buf.dtype(),
                  .peer = peer,
                  .tag = tag});
  std::lock_guard lock(session_->mutex);
  SHARDLM_MPI_CHECK(MPI_Irecv(buf.data(), n, mpi_type(buf.dtype()), peer, tag, comm_, &h->request));
  return h;
}

std::unique_ptr<CommHandle> MpiCommunicator::start_barrier() {
  auto h = begin({.kind = OpKind::kBarrier});
  std::lock_guard lock(session_->mutex);
  SHARDLM_MPI_CHECK(MPI_Ibarrier(comm_, &h->request));
  return h;
}

std::unique_ptr<Communicator> MpiCommunicator::split_impl(int color, int key, std::string name) {
  // MPI has no nonblocking split: a timed barrier first, so a rank that never arrives is an
  // Error naming it rather than a hang inside MPI_Comm_split.
  barrier();
  MPI_Comm sub = MPI_COMM_NULL;
  {
    std::lock_guard lock(session_->mutex);
    SHARDLM_MPI_CHECK(MPI_Comm_split(comm_, color, key, &sub));
  }
  return std::make_unique<MpiCommunicator>(session_, sub, std::move(name), options());
}

}  // namespace shardlm::mpi
