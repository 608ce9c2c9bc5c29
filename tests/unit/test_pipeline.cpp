// Pipeline schedules and stage partitions (plan/pipeline.h): 1F1B runs every micro-batch
// forward then backward on every stage, never deadlocks, holds at most stages - s micro-batches
// on stage s, and has the textbook bubble (pp - 1) / (m + pp - 1); the partition is the
// optimum a brute-force search finds.
#include "shardlm/plan/pipeline.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <random>

#include "shardlm/core/check.h"
#include "shardlm/model/layout.h"
#include "shardlm/plan/zero_layout.h"

namespace shardlm {
namespace {

std::vector<std::vector<PipeOp>> schedules(int stages, int m) {
  std::vector<std::vector<PipeOp>> s;
  for (int i = 0; i < stages; ++i) s.push_back(one_f_one_b(stages, i, m));
  return s;
}

TEST(OneFOneB, EveryMicroBatchForwardThenBackwardInOrder) {
  for (int stages = 1; stages <= 6; ++stages)
    for (int m = 1; m <= 9; ++m)
      for (int s = 0; s < stages; ++s) {
        SCOPED_TRACE(testing::Message()
                     << stages << " stages, " << m << " micro-batches, stage " << s);
        const std::vector<PipeOp> ops = one_f_one_b(stages, s, m);
        std::vector<int> fwd, bwd;
        std::vector<int> done_forward(size_t(m), 0);
        for (const PipeOp& op : ops) {
          if (op.kind == PipeOpKind::kForward) {
            fwd.push_back(op.micro);
            done_forward[op.micro] = 1;
          }
          if (op.kind == PipeOpKind::kBackward) {
            EXPECT_TRUE(done_forward[op.micro]) << "backward before forward of " << op.micro;
            bwd.push_back(op.micro);
          }
          if (s == 0) {
            EXPECT_NE(op.kind, PipeOpKind::kRecvActivation);
            EXPECT_NE(op.kind, PipeOpKind::kSendGradient);
          }
          if (s == stages - 1) {
            EXPECT_NE(op.kind, PipeOpKind::kSendActivation);
            EXPECT_NE(op.kind, PipeOpKind::kRecvGradient);
          }
        }
        std::vector<int> order(static_cast<size_t>(m));
        for (int i = 0; i < m; ++i) order[i] = i;
        EXPECT_EQ(fwd, order);
        EXPECT_EQ(bwd, order);
      }
}

TEST(OneFOneB, SimulationGivesTheTextbookBubbleAndInFlightCounts) {
  for (int stages = 1; stages <= 8; ++stages)
    for (int m = 1; m <= 16; ++m) {
      SCOPED_TRACE(testing::Message() << stages << " stages, " << m << " micro-batches");
      // Backward twice the forward, transfers free: every stage's idle time is the bubble.
      const PipelineRun run = simulate_pipeline(schedules(stages, m), 1.0, 2.0);
      EXPECT_DOUBLE_EQ(run.makespan, 3.0 * (m + stages - 1));
      EXPECT_NEAR(run.bubble_fraction(), one_f_one_b_bubble(stages, m), 1e-12);
      for (int s = 0; s < stages; ++s) {
        EXPECT_DOUBLE_EQ(run.busy[s], 3.0 * m);
        EXPECT_EQ(run.max_in_flight[s], std::min(stages - s, m)) << "stage " << s;
      }
    }
}

TEST(OneFOneB, TransfersLengthenTheStepButNeverDeadlock) {
  const PipelineRun free = simulate_pipeline(schedules(4, 8), 1.0, 2.0, 0.0);
  const PipelineRun slow = simulate_pipeline(schedules(4, 8), 1.0, 2.0, 0.25);
  EXPECT_GT(slow.makespan, free.makespan);
  EXPECT_GT(slow.bubble_fraction(), free.bubble_fraction());
}

TEST(SimulatePipeline, ReportsADeadlockNamingTheStages) {
  // Stage 0 waits for micro-batch 0's gradient before it sends the activation stage 1 needs.
  const std::vector<std::vector<PipeOp>> bad = {{{PipeOpKind::kForward, 0},
                                                 {PipeOpKind::kRecvGradient, 0},
                                                 {PipeOpKind::kSendActivation, 0},
                                                 {PipeOpKind::kBackward, 0}},
                                                {{PipeOpKind::kRecvActivation, 0},
                                                 {PipeOpKind::kForward, 0},
                                                 {PipeOpKind::kBackward, 0},
                                                 {PipeOpKind::kSendGradient, 0}}};
  try {
    simulate_pipeline(bad, 1, 2);
    FAIL() << "no error";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("deadlocks"), std::string::npos) << msg;
    EXPECT_NE(msg.find("stage 0 waits to recv_gradient micro-batch 0"), std::string::npos) << msg;
    EXPECT_NE(msg.find("stage 1 waits to recv_activation micro-batch 0"), std::string::npos) << msg;
  }
  // A send nobody receives is an error too.
  const std::vector<std::vector<PipeOp>> orphan = {
      {{PipeOpKind::kForward, 0}, {PipeOpKind::kSendActivation, 0}}, {}};
  EXPECT_THROW(simulate_pipeline(orphan, 1, 2), Error);
}

// The smallest largest stage cost over every way to cut n layers into `stages` ranges.
double brute_force(const std::vector<double>& c, double embed, double head, int stages) {
  const int n = int(c.size());
  double best = 1e300;
  std::vector<int> cuts;  // begin of stages 1 .. stages-1
  std::function<void(int, int)> rec = [&](int s, int from) {
    if (s == stages) {
      std::vector<int> b = {0};
      b.insert(b.end(), cuts.begin(), cuts.end());
      b.push_back(n);
      double worst = 0;
      for (int i = 0; i < stages; ++i) {
        double cost = (i == 0 ? embed : 0) + (i == stages - 1 ? head : 0);
        for (int l = b[i]; l < b[i + 1]; ++l) cost += c[l];
        worst = std::max(worst, cost);
      }
      best = std::min(best, worst);
      return;
    }
    for (int j = from; j <= n - (stages - s); ++j) {
      cuts.push_back(j);
      rec(s + 1, j + 1);
      cuts.pop_back();
    }
  };
  rec(1, 1);
  return best;
}

TEST(PartitionLayers, IsTheOptimumOfABruteForceSearch) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<double> cost(0.5, 2.0);
  for (int trial = 0; trial < 200; ++trial) {
    const int n = 1 + int(rng() % 10);
    const int stages = 1 + int(rng() % std::min(n, 4));
    std::vector<double> c(static_cast<size_t>(n));
    for (double& x : c) x = cost(rng);
    const double embed = cost(rng) * (rng() % 2), head = cost(rng) * 2;
    const StagePartition p = partition_layers(c, embed, head, stages);
    ASSERT_EQ(p.stages(), stages);
    EXPECT_EQ(p.begin.front(), 0);
    EXPECT_EQ(p.begin.back(), n);
    for (int s = 0; s < stages; ++s) EXPECT_GE(p.layers(s), 1);
    EXPECT_NEAR(p.max_cost(), brute_force(c, embed, head, stages), 1e-9)
        << n << " layers, " << stages << " stages";
  }
}

TEST(PartitionLayers, LaterStagesTakeTheExtraLayersOnTies) {
  // 8 equal layers over 3 stages: 3 is the best largest stage; the first stage gets 2.
  const StagePartition p = partition_layers(std::vector<double>(8, 1.0), 0, 0, 3);
  EXPECT_EQ(p.begin, (std::vector<int>{0, 2, 5, 8}));
  // A head that costs two layers moves layers off the last stage.
  const StagePartition h = partition_layers(std::vector<double>(8, 1.0), 0, 2.0, 2);
  EXPECT_EQ(h.begin, (std::vector<int>{0, 5, 8}));
  EXPECT_DOUBLE_EQ(h.max_cost(), 5.0);
}

TEST(PartitionLayers, MoreStagesThanLayersNamesTheKeys) {
  try {
    partition_layers(std::vector<double>(2, 1.0), 0, 0, 3);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kConfig);
    EXPECT_NE(std::string(e.what()).find("parallel.pp"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("model.n_layers"), std::string::npos) << e.what();
  }
}

// A stage's layout keeps every unit of the whole model, the other stages' empty; its entries
// are the whole model's for its layers (same names, same shapes, in order), and ZeRO's buckets
// over it all have elements and count only the units that have some. With tied embeddings the
// last stage holds a copy of the matrix.
TEST(StageLayout, KeepsTheUnitsAndZeroBucketsSkipTheEmptyOnes) {
  ModelConfig full = model_preset("tiny");
  full.n_layers = 5;
  const ParamLayout whole = make_param_layout(full);
  const StagePartition part = partition_layers(std::vector<double>(5, 1.0), 0.0, 1.0, 3);
  int64_t total = 0;
  for (int s = 0; s < 3; ++s) {
    ModelConfig c = full;
    c.pp_begin = part.begin[s];
    c.pp_end = part.begin[s + 1];
    c.validate();
    const ParamLayout L = make_param_layout(c);
    ASSERT_EQ(L.units.size(), whole.units.size());
    for (int u = 0; u < int(L.units.size()); ++u) {
      const bool held = (u == 0 && s == 0) || (u == L.head_unit && s == 2) ||
                        (u >= 1 && u <= full.n_layers && c.holds_layer(u - 1));
      EXPECT_EQ(L.unit_size(u), held ? whole.unit_size(u) : 0) << "stage " << s << " unit " << u;
      if (u > 0) {
        EXPECT_EQ(L.units[u].begin, L.units[u - 1].end);
      }
    }
    size_t w = 0;
    for (const ParamEntry& e : L.entries) {
      while (w < whole.entries.size() && whole.entries[w].name != e.name) ++w;
      ASSERT_LT(w, whole.entries.size()) << e.name;
      EXPECT_EQ(whole.entries[w].shape, e.shape);
    }
    total += L.total;
    for (int64_t bucket : {int64_t{1}, int64_t{5000}, int64_t{1} << 30}) {
      const ZeroLayout z = make_zero_layout(L, 2, bucket);
      int live = 0;
      for (const ZeroBucket& b : z.buckets) {
        EXPECT_GT(b.size(), 0);
        live += b.live_parts;
      }
      int nonempty = 0;
      for (int u = 0; u < int(L.units.size()); ++u) nonempty += L.unit_size(u) > 0;
      EXPECT_EQ(live, nonempty);
    }
  }
  EXPECT_EQ(total, whole.total);
  // Tied embeddings: the first and the last stage each hold the matrix (unit 0, their LM head),
  // a middle stage neither.
  ModelConfig tied = full;
  tied.tie_embeddings = true;
  for (int s = 0; s < 3; ++s) {
    tied.pp_begin = part.begin[s];
    tied.pp_end = part.begin[s + 1];
    const ParamLayout L = make_param_layout(tied);
    EXPECT_EQ(L.unit_size(0), s == 1 ? 0 : whole.unit_size(0)) << "stage " << s;
    EXPECT_EQ(L.lm_head_unit, s == 1 ? L.head_unit : 0) << "stage " << s;
  }
}

}  // namespace
}  // namespace shardlm
