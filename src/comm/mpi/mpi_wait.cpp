// Waiting for MPI requests with a deadline, and naming the ranks to blame when it passes.
// While a rank waits it answers peers' status queries on the communicator's side channel; a rank
// whose wait times out asks every peer what it is waiting for, and the Error lists the ranks
// waiting in the same op, those waiting in another (a mismatched call order), and the silent.
#include <algorithm>
#include <chrono>
#include <thread>

#include "comm/mpi/mpi_check.h"
#include "comm/mpi/mpi_communicator.h"

namespace shardlm::mpi {

namespace {

using Clock = std::chrono::steady_clock;

constexpr int kQueryTag = 1;
constexpr int kReplyTag = 2;

// Polls with yields for the first millisecond, then sleeps between polls for 1/32 of the time
// waited so far (16 us to 1 ms): a rank waiting on a slow peer must not steal the core the
// peer needs (tests run 4 ranks on 2 cores), while nonblocking collectives, which advance a
// round only when polled, lose at most ~3% to the sleeps.
class Backoff {
 public:
  void pause() {
    const auto waited = Clock::now() - start_;
    if (waited < std::chrono::milliseconds(1)) {
      std::this_thread::yield();
      return;
    }
    std::this_thread::sleep_for(std::clamp<Clock::duration>(
        waited / 32, std::chrono::microseconds(16), std::chrono::milliseconds(1)));
  }

 private:
  Clock::time_point start_ = Clock::now();
};

Clock::duration seconds(double s) {
  return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s));
}

std::string join_ranks(const std::vector<std::string>& labels) {
  std::string out = labels.size() == 1 ? "rank " : "ranks ";
  for (size_t i = 0; i < labels.size(); ++i) out += (i ? ", " : "") + labels[i];
  return out;
}

}  // namespace

bool MpiCommunicator::test_request(MPI_Request& request, MPI_Status* status) {
  std::lock_guard lock(session_->mutex);
  int done = 0;
  SHARDLM_MPI_CHECK(MPI_Test(&request, &done, status));
  serve_queries();
  return done != 0;
}

void MpiCommunicator::wait_request(MPI_Request& request, MPI_Status* status, const OpInfo& op) {
  SHARDLM_CHECK(!broken(),
                "{} on communicator '{}' (rank {}): the communicator is unusable after "
                "an earlier failure: {}",
                op.describe(), name(), rank(), broken_reason_);
  const Clock::time_point start = Clock::now();
  const Clock::time_point deadline = start + seconds(options().timeout_s);
  // Queries only come after a peer's timeout (seconds), and the asker waits at least 0.5 s for
  // answers: short waits skip the probe.
  const Clock::time_point serve_from = start + std::chrono::milliseconds(20);
  Backoff backoff;
  while (true) {
    {
      std::lock_guard lock(session_->mutex);
      int done = 0;
      SHARDLM_MPI_CHECK(MPI_Test(&request, &done, status));
      if (done) {
        waiting_.reset();
        return;
      }
      if (Clock::now() >= serve_from) {
        waiting_ = op;
        serve_queries();
      }
    }
    if (Clock::now() >= deadline) fail_timeout(op);
    backoff.pause();
  }
}

void MpiCommunicator::serve_queries() {
  while (true) {
    int queued = 0;
    MPI_Status st;
    SHARDLM_MPI_CHECK(MPI_Iprobe(MPI_ANY_SOURCE, kQueryTag, side_, &queued, &st));
    if (!queued) break;
    int64_t ignored = 0;
    SHARDLM_MPI_CHECK(
        MPI_Recv(&ignored, 1, MPI_INT64_T, st.MPI_SOURCE, kQueryTag, side_, MPI_STATUS_IGNORE));
    auto reply = std::make_unique<PendingSend>();
    if (waiting_) reply->payload = {1, static_cast<int64_t>(waiting_->kind), waiting_->seq};
    SHARDLM_MPI_CHECK(MPI_Isend(reply->payload.data(), 3, MPI_INT64_T, st.MPI_SOURCE, kReplyTag,
                                side_, &reply->request));
    pending_sends_.push_back(std::move(reply));
  }
  std::erase_if(pending_sends_, [](std::unique_ptr<PendingSend>& p) {
    int done = 0;
    SHARDLM_MPI_CHECK(MPI_Test(&p->request, &done, MPI_STATUS_IGNORE));
    return done != 0;
  });
}

void MpiCommunicator::fail_timeout(const OpInfo& op) {
  session_->poisoned = true;  // the request stays active: MPI cannot cancel a collective
  const std::string msg = timeout_message(op, ask_peers_what_they_wait_for());
  {
    std::lock_guard lock(session_->mutex);
    waiting_.reset();
    broken_reason_ = msg;
  }
  SHARDLM_FAIL(ErrorKind::kInternal, "{}", msg);
}

std::vector<MpiCommunicator::PeerReply> MpiCommunicator::ask_peers_what_they_wait_for() {
  // Ask every peer what it is waiting for; peers blocked in any op of this communicator answer
  // within a poll interval. The grace period covers ranks that arrive a little late.
  const double grace_s = std::clamp(options().timeout_s / 4, 0.5, 10.0);
  std::vector<PeerReply> replies(size());
  {
    std::lock_guard lock(session_->mutex);
    for (int peer = 0; peer < size(); ++peer) {
      if (peer == rank()) continue;
      auto query = std::make_unique<PendingSend>();
      SHARDLM_MPI_CHECK(MPI_Isend(query->payload.data(), 1, MPI_INT64_T, peer, kQueryTag, side_,
                                  &query->request));
      pending_sends_.push_back(std::move(query));
    }
  }
  const Clock::time_point grace_end = Clock::now() + seconds(grace_s);
  int answered = 0;
  Backoff backoff;
  while (answered < size() - 1 && Clock::now() < grace_end) {
    {
      std::lock_guard lock(session_->mutex);
      serve_queries();
      int queued = 0;
      MPI_Status st;
      SHARDLM_MPI_CHECK(MPI_Iprobe(MPI_ANY_SOURCE, kReplyTag, side_, &queued, &st));
      if (queued) {
        std::array<int64_t, 3> reply{};
        SHARDLM_MPI_CHECK(MPI_Recv(reply.data(), 3, MPI_INT64_T, st.MPI_SOURCE, kReplyTag, side_,
                                   MPI_STATUS_IGNORE));
        if (!replies[st.MPI_SOURCE]) ++answered;
        replies[st.MPI_SOURCE] = reply;
        continue;
      }
    }
    backoff.pause();
  }
  return replies;
}

std::string MpiCommunicator::timeout_message(const OpInfo& op,
                                             const std::vector<PeerReply>& replies) const {
  const bool collective = op.kind != OpKind::kSend && op.kind != OpKind::kRecv;
  std::vector<int> same = {rank()};
  std::vector<std::string> silent, elsewhere, other;
  for (int peer = 0; peer < size(); ++peer) {
    if (peer == rank()) continue;
    if (!replies[peer]) {
      silent.push_back(rank_label(peer));
      continue;
    }
    const auto& [is_waiting, kind, seq] = *replies[peer];
    if (!is_waiting) {
      elsewhere.push_back(rank_label(peer));
    } else if (collective && kind == static_cast<int64_t>(op.kind) && seq == op.seq) {
      same.push_back(peer);
    } else {
      OpInfo theirs{.kind = static_cast<OpKind>(kind), .seq = seq};
      const bool p2p = theirs.kind == OpKind::kSend || theirs.kind == OpKind::kRecv;
      other.push_back(fmt::format("rank {} is waiting in {}", rank_label(peer),
                                  p2p ? std::string(op_kind_name(theirs.kind))
                                      : fmt::format("{} #{}", op_kind_name(theirs.kind), seq)));
    }
  }

  std::string msg = fmt::format(
      "{} on communicator '{}' did not complete within {} s on rank {} "
      "of {}.",
      op.describe(), name(), options().timeout_s, rank_label(rank()), size());
  if (!silent.empty()) {
    msg += fmt::format(" Not responding (hung in computation, blocked elsewhere, or dead): {}.",
                       join_ranks(silent));
  }
  if (!other.empty()) {
    msg += " Mismatched calls: ";
    for (size_t i = 0; i < other.size(); ++i) msg += (i ? "; " : "") + other[i];
    msg += ".";
  }
  if (!elsewhere.empty()) {
    msg += fmt::format(" Running but not waiting on this communicator: {}.", join_ranks(elsewhere));
  }
  if (collective) {
    std::sort(same.begin(), same.end());
    std::vector<std::string> labels;
    for (int r : same) labels.push_back(rank_label(r));
    msg += fmt::format(" Waiting in the same op: {}.", join_ranks(labels));
  }
  msg +=
      " The communicator is unusable now; raise SHARDLM_COMM_TIMEOUT_S if a rank legitimately "
      "needs longer.";
  return msg;
}

void wait_setup_request(Session& session, MPI_Request& request, double timeout_s,
                        const std::string& what) {
  const Clock::time_point deadline = Clock::now() + seconds(timeout_s);
  Backoff backoff;
  while (true) {
    {
      std::lock_guard lock(session.mutex);
      int done = 0;
      SHARDLM_MPI_CHECK(MPI_Test(&request, &done, MPI_STATUS_IGNORE));
      if (done) return;
    }
    if (Clock::now() >= deadline) {
      session.poisoned = true;
      SHARDLM_FAIL(ErrorKind::kInternal,
                   "{} did not complete within {} s on world rank {} of {}: some rank never "
                   "called it (hung, dead, or on another code path)",
                   what, timeout_s, session.world_rank, session.world_size);
    }
    backoff.pause();
  }
}

}  // namespace shardlm::mpi
