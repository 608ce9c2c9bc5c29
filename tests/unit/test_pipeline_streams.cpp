// The pipeline executor's transfer order (parallel/pipeline.cpp) on a transport that runs each
// communicator's operations in order on one stream and completes a send only together with
// its receive (NCCL, large messages): each stage's 1F1B ops (plan/pipeline.h) issue sends
// from rings of min(m, pp - s) buffers, block in activation receives and post the next
// gradient's receive after a backward and its own send. With gradients on a communicator of
// their own every schedule of 2-8 stages and 1-16 micro-batches completes; with activations
// and gradients on one communicator (the executor's earlier layout) two stages deadlock from
// two micro-batches on. A model of the executor's order, kept beside it: the order is what
// the test pins.
#include <gtest/gtest.h>

#include <algorithm>
#include <deque>
#include <map>
#include <memory>
#include <vector>

#include "shardlm/plan/pipeline.h"

namespace shardlm {
namespace {

struct Transfer {
  bool send;
  int peer, micro, comm;  // comm: 0 activations, 1 gradients (1 = 0 on one communicator)
  bool done = false;
};
using TransferPtr = std::shared_ptr<Transfer>;

class StreamModel {
 public:
  StreamModel(int stages, int micro_batches, bool split)
      : S_(stages),
        M_(micro_batches),
        split_(split),
        pc_(size_t(stages), 0),
        waiting_(size_t(stages)),
        early_(size_t(stages)),
        sends_(size_t(stages) * 2) {
    for (int s = 0; s < S_; ++s) ops_.push_back(one_f_one_b(S_, s, M_));
  }

  // True when every stage finished its ops and every transfer completed.
  bool completes() {
    for (bool changed = true; changed;) changed = match() | step_hosts();
    for (int s = 0; s < S_; ++s)
      if (pc_[s] < ops_[s].size() || (waiting_[s] && !waiting_[s]->done)) return false;
    for (const auto& [key, q] : streams_)
      for (const TransferPtr& t : q)
        if (!t->done) return false;
    return true;
  }

 private:
  TransferPtr issue(int s, bool send, int peer, int micro, int comm) {
    auto t = std::make_shared<Transfer>(Transfer{send, peer, micro, comm});
    streams_[{s, split_ ? comm : 0}].push_back(t);
    return t;
  }

  // Completes every pair of heads of two peers' streams that match.
  bool match() {
    bool any = false;
    for (bool moved = true; moved;) {
      moved = false;
      for (auto& [key, q] : streams_) {
        while (!q.empty() && q.front()->done) q.pop_front();
        if (q.empty()) continue;
        auto& pq = streams_[{q.front()->peer, key.second}];
        while (!pq.empty() && pq.front()->done) pq.pop_front();
        if (pq.empty()) continue;
        Transfer &h = *q.front(), &p = *pq.front();
        if (p.send != h.send && p.peer == key.first && p.micro == h.micro && p.comm == h.comm) {
          h.done = p.done = true;
          moved = any = true;
        }
      }
    }
    return any;
  }

  // Runs each stage's ops until it blocks (a receive or a busy ring buffer).
  bool step_hosts() {
    bool any = false;
    for (int s = 0; s < S_; ++s)
      while (pc_[s] < ops_[s].size()) {
        if (waiting_[s] && !waiting_[s]->done) break;
        waiting_[s].reset();
        const PipeOp op = ops_[s][pc_[s]];
        if (op.kind == PipeOpKind::kRecvActivation) {
          waiting_[s] = issue(s, false, s - 1, op.micro, 0);
        } else if (op.kind == PipeOpKind::kRecvGradient) {
          waiting_[s] = early_[s] ? early_[s] : issue(s, false, s + 1, op.micro, 1);
          early_[s].reset();
        } else if (op.kind == PipeOpKind::kSendActivation || op.kind == PipeOpKind::kSendGradient) {
          const int comm = op.kind == PipeOpKind::kSendGradient ? 1 : 0;
          std::vector<TransferPtr>& ring = sends_[size_t(s) * 2 + comm];
          const size_t slots = size_t(std::min(M_, S_ - s));
          if (ring.size() >= slots && !ring[ring.size() - slots]->done) {
            waiting_[s] = ring[ring.size() - slots];
            break;
          }
          ring.push_back(issue(s, true, comm == 0 ? s + 1 : s - 1, op.micro, comm));
        }
        ++pc_[s];
        any = true;
        const bool backward_done =
            s > 0 ? op.kind == PipeOpKind::kSendGradient : op.kind == PipeOpKind::kBackward;
        if (backward_done && s + 1 < S_ && op.micro + 1 < M_)
          early_[s] = issue(s, false, s + 1, op.micro + 1, 1);
      }
    return any;
  }

  int S_, M_;
  bool split_;
  std::vector<std::vector<PipeOp>> ops_;
  std::vector<size_t> pc_;
  std::vector<TransferPtr> waiting_, early_;
  std::vector<std::vector<TransferPtr>> sends_;  // [stage][comm]: the ring's sends in order
  std::map<std::pair<int, int>, std::deque<TransferPtr>> streams_;  // (stage, comm)
};

TEST(PipelineStreams, GradientsOnTheirOwnCommunicatorNeverDeadlock) {
  for (int stages = 2; stages <= 8; ++stages)
    for (int m = 1; m <= 16; ++m)
      EXPECT_TRUE(StreamModel(stages, m, /*split=*/true).completes())
          << stages << " stages, " << m << " micro-batches";
}

TEST(PipelineStreams, OneCommunicatorForBothDirectionsDeadlocks) {
  EXPECT_TRUE(StreamModel(2, 1, /*split=*/false).completes());
  for (int m = 2; m <= 8; ++m)
    EXPECT_FALSE(StreamModel(2, m, /*split=*/false).completes()) << m << " micro-batches";
}

}  // namespace
}  // namespace shardlm
