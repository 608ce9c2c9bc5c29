// Pipeline parallelism, the pure part: which layers each stage holds, the order in which a
// stage runs its micro-batches (1F1B), and what that order costs (the bubble, the
// micro-batches a stage holds at once). Arithmetic only: the pipeline engine executes these
// schedules, the planner sizes a stage's activations from them, and the tests prove them
// (every send meets its receive, no stage waits forever, the bubble is the textbook one).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace shardlm {

// ---- stage partition -----------------------------------------------------------------------

// Contiguous layer ranges, one per stage: stage s holds decoder layers [begin[s], begin[s+1]).
// The first stage also runs the embeddings, the last the final norm, LM head and loss.
struct StagePartition {
  std::vector<int> begin;    // [stages + 1], begin[0] = 0, begin[stages] = n_layers
  std::vector<double> cost;  // [stages] the stage's cost (layers + embeddings/head)
  int stages() const { return int(cost.size()); }
  int layers(int s) const { return begin[s + 1] - begin[s]; }
  double max_cost() const;
};

// The split of n layers (cost layer_cost[l] each, in any unit: FLOPs, seconds) into `stages`
// contiguous ranges that minimises the largest stage cost, with embed_cost added to the first
// stage and head_cost to the last. Every stage gets at least one layer. Among splits with the
// same largest cost, later stages take the extra layers: under 1F1B stage s holds up to
// stages - s micro-batches in flight, so memory is tightest on the first stages. Throws
// Error(kConfig) naming parallel.pp and model.n_layers when stages > n_layers or stages < 1.
StagePartition partition_layers(const std::vector<double>& layer_cost, double embed_cost,
                                double head_cost, int stages);

// ---- schedules -----------------------------------------------------------------------------

enum class PipeOpKind : uint8_t {
  kRecvActivation,  // from stage - 1: the micro-batch's input hidden states
  kForward,
  kSendActivation,  // to stage + 1
  kRecvGradient,    // from stage + 1: the gradient of this stage's output
  kBackward,
  kSendGradient,  // to stage - 1
};
std::string pipe_op_name(PipeOpKind kind);

struct PipeOp {
  PipeOpKind kind;
  int micro;  // the micro-batch, in [0, micro_batches)
  bool operator==(const PipeOp&) const = default;
};

// The 1F1B schedule of one stage (PipeDream-Flush, Megatron's non-interleaved schedule):
// warm-up forwards (stages - stage - 1 of them, at most micro_batches), then one forward and
// one backward alternately, then the remaining backwards. The first stage has no receives of
// activations nor sends of gradients, the last no sends of activations nor receives of
// gradients. Throws Error(kConfig) when micro_batches < 1 or stage is out of range.
std::vector<PipeOp> one_f_one_b(int stages, int stage, int micro_batches);

// The neighbour a transfer goes to or comes from: stage + 1 for activations sent and gradients
// received, stage - 1 for activations received and gradients sent (-1 for a compute op).
int pipe_peer(PipeOpKind kind, int stage);

// One step of a stage's schedule as the executor issues it: a forward or a backward, or an
// exchange with a neighbour. An exchange is a send, a receive, or a send followed at once by a
// receive from the same neighbour (after a forward in the steady state: this micro-batch's
// activation out, a gradient back; after a backward: its gradient out, the next activation
// back), which travel as one grouped transfer (Communicator::sendrecv): on a transport that
// runs a communicator's operations in order on one stream (NCCL), two neighbours' separate
// sends would each wait behind the other's pending receive.
struct PipeStep {
  std::optional<PipeOp> compute;  // kForward or kBackward (then no send, no recv)
  std::optional<PipeOp> send;     // kSendActivation or kSendGradient
  std::optional<PipeOp> recv;     // kRecvActivation or kRecvGradient
};

// A schedule's ops (one_f_one_b's) as steps, in order: each compute op a step, each send joined
// with the receive right after it when that comes from the same neighbour, every other
// transfer a step of its own.
std::vector<PipeStep> pipe_steps(const std::vector<PipeOp>& ops);

// What running the stages' schedules costs, found by simulating them against each other:
// every op waits for its inputs (a receive for the matching send on the neighbour, which
// blocks until it is received: synchronous point to point), forward costs forward_cost,
// backward backward_cost, transfers transfer_cost. Throws Error(kInternal) naming the stages
// that wait on each other when the schedules deadlock, or when a send has no receive.
struct PipelineRun {
  double makespan = 0;             // time until the last backward ends
  std::vector<double> busy;        // [stages] time spent computing
  std::vector<double> idle;        // [stages] makespan - busy
  std::vector<int> max_in_flight;  // [stages] micro-batches forwarded, not yet backwarded
  double bubble_fraction() const;  // mean idle / makespan over stages
};
PipelineRun simulate_pipeline(const std::vector<std::vector<PipeOp>>& schedules,
                              double forward_cost, double backward_cost, double transfer_cost = 0);

// (stages - 1) / (micro_batches + stages - 1): the bubble of 1F1B with equal stages and free
// transfers, the figure the simulation reproduces.
double one_f_one_b_bubble(int stages, int micro_batches);

}  // namespace shardlm
