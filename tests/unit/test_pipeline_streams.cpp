// The pipeline executor's transfer order (parallel/pipeline.cpp) on a transport that runs each
// communicator's operations in order on one stream, finishes a grouped transfer only when all
// its parts have matched, and completes a send only together with its receive (NCCL, large
// messages). Each stage issues plan/pipeline.h's pipe_steps of its 1F1B ops on its one pipeline
// communicator: an exchange (a send and the receive after it, facing the same neighbour) as
// one group, waited for; a lone send from a ring of min(m, pp - s) buffers, not waited for; a
// lone receive, waited for. Every schedule of 2-8 stages and 1-16 micro-batches completes; the
// same transfers issued one by one deadlock on two stages from two micro-batches on. A model of
// the executor's order, kept beside it: the order is what the test pins.
#include <gtest/gtest.h>

#include <algorithm>
#include <deque>
#include <memory>
#include <vector>

#include "shardlm/plan/pipeline.h"

namespace shardlm {
namespace {

struct Transfer {
  bool send;
  int peer, micro;
  bool activation;
  bool done = false;
};

// One operation on a stage's stream: a transfer, or a send and a receive issued as one group.
struct Group {
  std::vector<Transfer> parts;
  bool done() const {
    return std::all_of(parts.begin(), parts.end(), [](const Transfer& t) { return t.done; });
  }
};
using GroupPtr = std::shared_ptr<Group>;

Transfer transfer(const PipeOp& op, int stage) {
  const bool send = op.kind == PipeOpKind::kSendActivation || op.kind == PipeOpKind::kSendGradient;
  const bool activation =
      op.kind == PipeOpKind::kSendActivation || op.kind == PipeOpKind::kRecvActivation;
  return {send, pipe_peer(op.kind, stage), op.micro, activation};
}

class StreamModel {
 public:
  // grouped: the executor's steps; else every transfer of them issued on its own.
  StreamModel(int stages, int micro_batches, bool grouped)
      : S_(stages),
        M_(micro_batches),
        pc_(size_t(stages), 0),
        waiting_(size_t(stages)),
        rings_(size_t(stages) * 2),
        streams_(size_t(stages)) {
    for (int s = 0; s < S_; ++s) {
      std::vector<PipeStep> steps = pipe_steps(one_f_one_b(S_, s, M_));
      if (!grouped) steps = one_by_one(steps);
      steps_.push_back(std::move(steps));
    }
  }

  // True when every stage finished its steps and every transfer completed.
  bool completes() {
    for (bool changed = true; changed;) changed = match() | step_hosts();
    for (int s = 0; s < S_; ++s)
      if (pc_[s] < steps_[s].size() || (waiting_[s] && !waiting_[s]->done())) return false;
    for (const auto& q : streams_)
      for (const GroupPtr& g : q)
        if (!g->done()) return false;
    return true;
  }

 private:
  static std::vector<PipeStep> one_by_one(const std::vector<PipeStep>& steps) {
    std::vector<PipeStep> out;
    for (const PipeStep& st : steps) {
      if (st.send && st.recv) {
        PipeStep send, recv;
        send.send = st.send;
        recv.recv = st.recv;
        out.push_back(send);
        out.push_back(recv);
      } else {
        out.push_back(st);
      }
    }
    return out;
  }

  // Completes the parts of the two head groups of neighbouring streams that match.
  bool match() {
    bool any = false;
    for (bool moved = true; moved;) {
      moved = false;
      for (int s = 0; s < S_; ++s) {
        auto& q = streams_[s];
        while (!q.empty() && q.front()->done()) q.pop_front();
        if (q.empty()) continue;
        for (Transfer& t : q.front()->parts) {
          if (t.done) continue;
          auto& pq = streams_[t.peer];
          while (!pq.empty() && pq.front()->done()) pq.pop_front();
          if (pq.empty()) continue;
          for (Transfer& u : pq.front()->parts)
            if (!u.done && u.send != t.send && u.peer == s && u.micro == t.micro &&
                u.activation == t.activation) {
              t.done = u.done = true;
              moved = any = true;
              break;
            }
        }
      }
    }
    return any;
  }

  // Runs each stage's steps until it blocks (a receive or a busy ring buffer).
  bool step_hosts() {
    bool any = false;
    for (int s = 0; s < S_; ++s)
      while (pc_[s] < steps_[s].size()) {
        if (waiting_[s] && !waiting_[s]->done()) break;
        waiting_[s].reset();
        const PipeStep& st = steps_[s][pc_[s]];
        auto group = std::make_shared<Group>();
        if (st.send) {
          std::vector<GroupPtr>& ring =
              rings_[size_t(s) * 2 + (st.send->kind == PipeOpKind::kSendGradient)];
          const size_t slots = size_t(std::min(M_, S_ - s));
          if (ring.size() >= slots && !ring[ring.size() - slots]->done()) {
            waiting_[s] = ring[ring.size() - slots];
            break;
          }
          ring.push_back(group);
          group->parts.push_back(transfer(*st.send, s));
        }
        if (st.recv) {
          group->parts.push_back(transfer(*st.recv, s));
          waiting_[s] = group;  // a receive, alone or grouped, is waited for
        }
        if (!group->parts.empty()) streams_[s].push_back(group);
        ++pc_[s];
        any = true;
      }
    return any;
  }

  int S_, M_;
  std::vector<std::vector<PipeStep>> steps_;
  std::vector<size_t> pc_;
  std::vector<GroupPtr> waiting_;
  std::vector<std::vector<GroupPtr>> rings_;   // [stage][direction]: the ring's sends in order
  std::vector<std::deque<GroupPtr>> streams_;  // [stage]: its one communicator's stream
};

TEST(PipelineStreams, GroupedExchangesOnOneCommunicatorNeverDeadlock) {
  for (int stages = 2; stages <= 8; ++stages)
    for (int m = 1; m <= 16; ++m)
      EXPECT_TRUE(StreamModel(stages, m, /*grouped=*/true).completes())
          << stages << " stages, " << m << " micro-batches";
}

TEST(PipelineStreams, TransfersOneByOneOnOneCommunicatorDeadlock) {
  EXPECT_TRUE(StreamModel(2, 1, /*grouped=*/false).completes());
  for (int m = 2; m <= 8; ++m)
    EXPECT_FALSE(StreamModel(2, m, /*grouped=*/false).completes()) << m << " micro-batches";
}

// The exchanges are Megatron's: after a steady-state forward the activation out and a gradient
// back from the next stage, after a backward the gradient out and the next activation back;
// the warm-up's activation sends and the cool-down's gradient sends travel alone.
TEST(PipelineStreams, StepsJoinASendWithTheReceiveFromTheSameNeighbour) {
  const std::vector<PipeStep> steps = pipe_steps(one_f_one_b(4, 1, 4));
  int grouped = 0, ops = 0;
  for (const PipeStep& st : steps) {
    ops += int(st.compute.has_value()) + int(st.send.has_value()) + int(st.recv.has_value());
    EXPECT_TRUE(st.compute.has_value() != (st.send || st.recv));
    if (st.send && st.recv) {
      ++grouped;
      EXPECT_EQ(pipe_peer(st.send->kind, 1), pipe_peer(st.recv->kind, 1));
    }
  }
  EXPECT_EQ(ops, int(one_f_one_b(4, 1, 4).size()));
  // Stage 1 of 4: two warm-up forwards, two steady pairs (each with two exchanges, but the last
  // backward's send has no activation left to receive), two cool-down backwards.
  EXPECT_EQ(grouped, 3);
}

}  // namespace
}  // namespace shardlm
