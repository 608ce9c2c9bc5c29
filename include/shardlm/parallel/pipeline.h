// PipelineExecutor: runs one pipeline stage's schedule (plan/pipeline.h's 1F1B for training, a
// plain forward sweep for evaluation) over the rank's pipeline group: activations and
// gradients [B*T, D] f32 (a tp rank's B*T/tp rows under sequence parallelism) travel point to
// point to the neighbouring stages (the buffers are the backend's: device memory on a GPU),
// all on the one pipeline communicator. Each exchange of the schedule (plan/pipeline.h's
// pipe_steps) is one operation: a send followed by a receive from the same neighbour travels
// as one grouped sendrecv (Megatron's send_forward_recv_backward and
// send_backward_recv_forward), so a transport that runs a communicator's operations in order
// on one stream (NCCL) never queues a receive behind a send its peer can only match later, and
// never needs two communicators progressing at once (which NCCL does not promise). A lone send
// is posted asynchronously from the executor's own ring of buffers (a buffer is reused only
// after its send has completed); receives block. What a stage computes is the caller's,
// through PipelineStageOps (the trainer binds a LlamaModel stage's entry points), so parallel/
// keeps no knowledge of the model. It measures the stage's compute and its time blocked in
// communication: the bubble a run reports.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "shardlm/backend/backend.h"
#include "shardlm/comm/communicator.h"
#include "shardlm/core/buffer.h"
#include "shardlm/plan/pipeline.h"

namespace shardlm {

// One stage's work, for the executor; micro in [0, micro_batches), slot in [0, slots()).
struct PipelineStageOps {
  // Fills micro-batch `micro`'s inputs into `slot` (before its forward).
  std::function<void(int micro, int slot)> load;
  // Stages after the first: where the received activation of `slot` goes [B*T, D] f32.
  std::function<Tensor(int slot)> input;
  // Forward of `slot`; returns the activation to send [B*T, D] (stages before the last; read
  // before the next call). eval_loss: evaluation; the last stage adds its loss there.
  std::function<Tensor(int micro, int slot, LossResult* eval_loss)> forward;
  // Backward of `slot`: d_out is the received gradient of its output (stages before the
  // last; empty on the last). Returns the loss sum (the last stage), else 0.
  std::function<double(int micro, int slot, const Tensor& d_out)> backward;
  // Stages after the first, after a backward: the gradient of the input to send [B*T, D].
  std::function<Tensor()> input_grad;
};

// Time of one schedule run on this stage, in seconds: compute and total as the device ran
// them (Backend::mark), the host's time blocked in communication.
struct PipelineStats {
  double compute_s = 0;  // load/forward/backward passes, start to end of each on the device
  double recv_s = 0;     // the host blocked in receives
  double send_s = 0;     // the host posting sends and waiting for a send buffer to free up
  double total_s = 0;    // the whole run on the device, its start to its last op's end
  double loss_sum = 0;   // the last stage's loss sum (0 elsewhere)
  int64_t n_valid = 0;   // evaluation: the last stage's counted targets
  // Idle (not computing) / total: this stage's measured bubble.
  double bubble() const { return total_s > 0 ? 1.0 - compute_s / total_s : 0; }
};

class PipelineExecutor {
 public:
  // pp: the rank's pipeline group (rank = stage), which must outlive the executor. act_elems:
  // elements of one activation (B*T*D at the largest micro-batch), of dtype `act`. The send
  // rings and the gradient receive buffer come from `ledger` (category comm):
  // min(micro_batches, stages - stage) buffers per direction.
  PipelineExecutor(Communicator& pp, Backend& backend, MemoryLedger& ledger, int64_t act_elems,
                   int micro_batches, DType act = DType::kF32);
  ~PipelineExecutor();
  PipelineExecutor(const PipelineExecutor&) = delete;
  PipelineExecutor& operator=(const PipelineExecutor&) = delete;

  int stages() const { return stages_; }
  int stage() const { return stage_; }
  // Micro-batches this stage holds at once under 1F1B: min(micro_batches, stages - stage).
  int slots() const { return slots_; }
  // Bytes of the executor's buffers (the planner's pipeline comm buffers).
  static size_t buffer_bytes(int stages, int stage, int micro_batches, int64_t act_elems,
                             DType act);

  // A failure (an exception from the callbacks or the transport) leaves the executor's sends
  // abandoned, not waited for: the run is failing.
  // One training step: the 1F1B schedule over `micro_batches` (<= the constructor's) micro-
  // batches of `elems` (<= act_elems) activation elements; micro-batch i uses slot i % slots().
  PipelineStats train(const PipelineStageOps& ops, int micro_batches, int64_t elems);
  // Evaluation: forwards only, in order, every micro-batch in slot 0.
  PipelineStats evaluate(const PipelineStageOps& ops, int micro_batches, int64_t elems);

 private:
  struct Ring;
  PipelineStats run_train(const PipelineStageOps& ops, int micro_batches, int64_t elems);
  PipelineStats run_evaluate(const PipelineStageOps& ops, int micro_batches, int64_t elems);
  // One exchange of the schedule: `out` is the last forward's activation (its send's source).
  void exchange(const PipelineStageOps& ops, const PipeStep& step, int slots, int64_t elems,
                const Tensor& out, PipelineStats& st);
  Tensor to_ring(Ring& ring, const Tensor& src, PipelineStats& st);  // the send's buffer
  void send(Ring& ring, const Tensor& src, int peer, PipelineStats& st);
  void wait_all(PipelineStats& st);
  void abandon_sends();  // after a failure: drop unfinished sends without waiting for them

  Communicator& pp_;
  Backend& be_;
  int stages_ = 1, stage_ = 0, micro_batches_ = 1, slots_ = 1;
  int64_t act_elems_ = 0;
  DType act_ = DType::kF32;
  std::unique_ptr<Ring> act_ring_, grad_ring_;
  Buffer grad_in_;  // [act_elems] (act_): the received gradient
};

}  // namespace shardlm
