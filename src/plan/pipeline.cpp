// Stage partition, 1F1B schedules and their simulation (plan/pipeline.h).
#include "shardlm/plan/pipeline.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <tuple>

#include "shardlm/core/check.h"

namespace shardlm {

double StagePartition::max_cost() const {
  return cost.empty() ? 0 : *std::max_element(cost.begin(), cost.end());
}

StagePartition partition_layers(const std::vector<double>& layer_cost, double embed_cost,
                                double head_cost, int stages) {
  const int n = int(layer_cost.size());
  SHARDLM_CHECK_KIND(ErrorKind::kConfig, stages >= 1 && stages <= n,
                     "parallel.pp = {} pipeline stages for model.n_layers = {}: every stage needs "
                     "at least one decoder layer; use parallel.pp <= {}",
                     stages, n, n);
  std::vector<double> prefix(size_t(n) + 1, 0);
  for (int l = 0; l < n; ++l) prefix[l + 1] = prefix[l] + layer_cost[l];
  // Cost of stage s holding layers [j, k): its layers, plus the ends' extras.
  auto stage_cost = [&](int s, int j, int k) {
    return prefix[k] - prefix[j] + (s == 0 ? embed_cost : 0) + (s == stages - 1 ? head_cost : 0);
  };
  // best[s][k]: the smallest largest cost of stages 0..s holding layers [0, k).
  constexpr double kInf = std::numeric_limits<double>::infinity();
  std::vector<std::vector<double>> best(size_t(stages), std::vector<double>(size_t(n) + 1, kInf));
  for (int k = 1; k <= n; ++k) best[0][k] = stage_cost(0, 0, k);
  for (int s = 1; s < stages; ++s)
    for (int k = s + 1; k <= n; ++k)
      for (int j = s; j < k; ++j)
        best[s][k] = std::min(best[s][k], std::max(best[s - 1][j], stage_cost(s, j, k)));

  // From the last stage back, give each stage as many layers as the optimum allows.
  const double optimum = best[stages - 1][n];
  const double tol = 1e-12 * std::max(1.0, std::abs(optimum));
  StagePartition p;
  p.begin.assign(size_t(stages) + 1, 0);
  p.cost.assign(size_t(stages), 0);
  p.begin[stages] = n;
  for (int s = stages - 1; s >= 1; --s) {
    const int k = p.begin[s + 1];
    for (int j = s; j < k; ++j) {  // smallest j: the most layers for stage s
      if (best[s - 1][j] <= optimum + tol && stage_cost(s, j, k) <= optimum + tol) {
        p.begin[s] = j;
        break;
      }
    }
  }
  for (int s = 0; s < stages; ++s) p.cost[s] = stage_cost(s, p.begin[s], p.begin[s + 1]);
  return p;
}

std::string pipe_op_name(PipeOpKind kind) {
  switch (kind) {
    case PipeOpKind::kRecvActivation:
      return "recv_activation";
    case PipeOpKind::kForward:
      return "forward";
    case PipeOpKind::kSendActivation:
      return "send_activation";
    case PipeOpKind::kRecvGradient:
      return "recv_gradient";
    case PipeOpKind::kBackward:
      return "backward";
    case PipeOpKind::kSendGradient:
      return "send_gradient";
  }
  return "unknown";
}

std::vector<PipeOp> one_f_one_b(int stages, int stage, int micro_batches) {
  SHARDLM_CHECK_KIND(ErrorKind::kConfig, stages >= 1 && stage >= 0 && stage < stages,
                     "pipeline stage {} of {}", stage, stages);
  SHARDLM_CHECK_KIND(ErrorKind::kConfig, micro_batches >= 1,
                     "a pipeline step needs at least one micro-batch (train.grad_accum), got {}",
                     micro_batches);
  const bool first = stage == 0, last = stage == stages - 1;
  std::vector<PipeOp> ops;
  auto forward = [&](int m) {
    if (!first) ops.push_back({PipeOpKind::kRecvActivation, m});
    ops.push_back({PipeOpKind::kForward, m});
    if (!last) ops.push_back({PipeOpKind::kSendActivation, m});
  };
  auto backward = [&](int m) {
    if (!last) ops.push_back({PipeOpKind::kRecvGradient, m});
    ops.push_back({PipeOpKind::kBackward, m});
    if (!first) ops.push_back({PipeOpKind::kSendGradient, m});
  };
  const int warmup = std::min(stages - stage - 1, micro_batches);
  int next_forward = 0, next_backward = 0;
  for (; next_forward < warmup; ++next_forward) forward(next_forward);
  while (next_forward < micro_batches) {  // steady state: one forward, one backward
    forward(next_forward++);
    backward(next_backward++);
  }
  while (next_backward < micro_batches) backward(next_backward++);  // cool-down
  return ops;
}

int pipe_peer(PipeOpKind kind, int stage) {
  switch (kind) {
    case PipeOpKind::kSendActivation:
    case PipeOpKind::kRecvGradient:
      return stage + 1;
    case PipeOpKind::kRecvActivation:
    case PipeOpKind::kSendGradient:
      return stage - 1;
    case PipeOpKind::kForward:
    case PipeOpKind::kBackward:
      break;
  }
  return -1;
}

std::vector<PipeStep> pipe_steps(const std::vector<PipeOp>& ops) {
  const auto is_send = [](PipeOpKind k) {
    return k == PipeOpKind::kSendActivation || k == PipeOpKind::kSendGradient;
  };
  const auto is_recv = [](PipeOpKind k) {
    return k == PipeOpKind::kRecvActivation || k == PipeOpKind::kRecvGradient;
  };
  std::vector<PipeStep> steps;
  for (size_t i = 0; i < ops.size(); ++i) {
    const PipeOp& op = ops[i];
    PipeStep step;
    if (is_send(op.kind)) {
      step.send = op;
      // The stage is unknown here, but both peers are stage +- 1 with the same sign exactly
      // when the send and the receive face the same neighbour.
      if (i + 1 < ops.size() && is_recv(ops[i + 1].kind) &&
          pipe_peer(ops[i + 1].kind, 0) == pipe_peer(op.kind, 0))
        step.recv = ops[++i];
    } else if (is_recv(op.kind)) {
      step.recv = op;
    } else {
      step.compute = op;
    }
    steps.push_back(step);
  }
  return steps;
}

double PipelineRun::bubble_fraction() const {
  if (idle.empty() || makespan <= 0) return 0;
  double sum = 0;
  for (double i : idle) sum += i;
  return sum / double(idle.size()) / makespan;
}

PipelineRun simulate_pipeline(const std::vector<std::vector<PipeOp>>& schedules,
                              double forward_cost, double backward_cost, double transfer_cost) {
  const int S = int(schedules.size());
  SHARDLM_CHECK(S >= 1, "simulate_pipeline: no stages");
  // Messages in flight: (kind sent, micro, receiving stage) -> arrival time. Sends do not
  // block (the engine posts them asynchronously); receives wait for the arrival.
  std::map<std::tuple<PipeOpKind, int, int>, double> arrivals;
  std::vector<size_t> next(size_t(S), 0);
  std::vector<double> clock(size_t(S), 0);
  PipelineRun run;
  run.busy.assign(size_t(S), 0);
  run.max_in_flight.assign(size_t(S), 0);
  std::vector<int> in_flight(size_t(S), 0);
  for (bool progress = true; progress;) {
    progress = false;
    for (int s = 0; s < S; ++s) {
      while (next[s] < schedules[s].size()) {
        const PipeOp& op = schedules[s][next[s]];
        double& t = clock[s];
        if (op.kind == PipeOpKind::kRecvActivation || op.kind == PipeOpKind::kRecvGradient) {
          const PipeOpKind sent = op.kind == PipeOpKind::kRecvActivation
                                      ? PipeOpKind::kSendActivation
                                      : PipeOpKind::kSendGradient;
          const auto it = arrivals.find({sent, op.micro, s});
          if (it == arrivals.end()) break;  // not sent yet: this stage waits
          t = std::max(t, it->second);
          arrivals.erase(it);
        } else if (op.kind == PipeOpKind::kSendActivation || op.kind == PipeOpKind::kSendGradient) {
          const int to = op.kind == PipeOpKind::kSendActivation ? s + 1 : s - 1;
          SHARDLM_CHECK(to >= 0 && to < S, "stage {} sends {} of micro-batch {} to stage {}", s,
                        pipe_op_name(op.kind), op.micro, to);
          const bool fresh =
              arrivals.emplace(std::tuple{op.kind, op.micro, to}, t + transfer_cost).second;
          SHARDLM_CHECK(fresh, "stage {} sends {} of micro-batch {} twice", s,
                        pipe_op_name(op.kind), op.micro);
        } else {
          const double cost = op.kind == PipeOpKind::kForward ? forward_cost : backward_cost;
          t += cost;
          run.busy[s] += cost;
          in_flight[s] += op.kind == PipeOpKind::kForward ? 1 : -1;
          run.max_in_flight[s] = std::max(run.max_in_flight[s], in_flight[s]);
        }
        ++next[s];
        progress = true;
      }
    }
  }
  std::string stuck;
  for (int s = 0; s < S; ++s)
    if (next[s] < schedules[s].size())
      stuck += fmt::format("{}stage {} waits to {} micro-batch {}", stuck.empty() ? "" : "; ", s,
                           pipe_op_name(schedules[s][next[s]].kind), schedules[s][next[s]].micro);
  SHARDLM_CHECK(stuck.empty(), "the pipeline schedule deadlocks: {}", stuck);
  SHARDLM_CHECK(arrivals.empty(), "the pipeline schedule sends {} message(s) nobody receives",
                arrivals.size());
  run.makespan = *std::max_element(clock.begin(), clock.end());
  run.idle.resize(size_t(S));
  for (int s = 0; s < S; ++s) run.idle[s] = run.makespan - run.busy[s];
  return run;
}

double one_f_one_b_bubble(int stages, int micro_batches) {
  return double(stages - 1) / double(micro_batches + stages - 1);
}

}  // namespace shardlm
