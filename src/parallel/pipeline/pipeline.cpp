// The pipeline executor (parallel/pipeline.h): 1F1B and forward-only sweeps of one stage over
// its pipeline group, one communicator for both directions. Each exchange between two passes
// is one operation: a send and a receive facing the same neighbour go as one grouped sendrecv
// (a device transport (NCCL) runs a communicator's operations in order on one stream, where a
// send queued ahead of a receive, on both neighbours, would wait on each other), a lone send
// is posted asynchronously from a ring of buffers, a lone receive blocks. Nothing here waits
// for the device: a transport orders itself after the compute queued so far, and the stage's
// busy time is read from marks on the backend's queue.
#include "shardlm/parallel/pipeline.h"

#include <algorithm>
#include <chrono>
#include <memory>
#include <utility>
#include <vector>

#include "shardlm/core/check.h"

namespace shardlm {
namespace {

using Clock = std::chrono::steady_clock;
double since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// One tag for every transfer: a link carries activations one way and gradients the other, each
// in micro-batch order, and transfers between two ranks match in issue order.
constexpr int kPipeTag = 1;

int ring_size(int stages, int stage, int micro_batches) {
  return std::min(micro_batches, stages - stage);
}

// A stage's device time with no synchronisation: each pass's busy span and the whole schedule
// between marks on the backend's queue, read back in batches before the backend reuses its
// marks (the reads wait for passes long finished; the last one waits for the schedule's end).
class StageClock {
 public:
  explicit StageClock(Backend& be) : be_(be), start_(be.mark()) {}
  void begin_pass() { open_ = be_.mark(); }
  void end_pass() {
    spans_.push_back({open_, be_.mark()});
    if (spans_.size() >= kSpansKept) fold(spans_.back().second);
  }
  // After the schedule's last op: its compute and total device seconds.
  void finish(PipelineStats& st) {
    fold(be_.mark());
    st.compute_s = busy_s_;
    st.total_s = total_s_;
  }

 private:
  static constexpr size_t kSpansKept = Backend::kMarksKept / 4;
  void fold(uint64_t upto) {
    for (const auto& [a, b] : spans_) busy_s_ += be_.seconds_between(a, b);
    spans_.clear();
    total_s_ += be_.seconds_between(start_, upto);
    start_ = upto;
  }

  Backend& be_;
  uint64_t start_, open_ = 0;
  std::vector<std::pair<uint64_t, uint64_t>> spans_;
  double busy_s_ = 0, total_s_ = 0;
};

}  // namespace

// Buffers of sends in flight: buffer i is reused only after its previous send completed.
struct PipelineExecutor::Ring {
  Buffer buf;  // [n * act_elems] of the activation dtype (comm)
  int n = 0;
  int next = 0;
  std::vector<std::unique_ptr<CommHandle>> handles;  // [n] the send from buffer i, or null
};

size_t PipelineExecutor::buffer_bytes(int stages, int stage, int micro_batches, int64_t act_elems,
                                      DType act) {
  if (stages <= 1) return 0;
  const size_t one = size_t(act_elems) * dtype_size(act);
  const size_t k = size_t(ring_size(stages, stage, micro_batches));
  size_t bytes = 0;
  if (stage + 1 < stages) bytes += k * one + one;  // activation sends, the gradient received
  if (stage > 0) bytes += k * one;                 // gradient sends
  return bytes;
}

PipelineExecutor::PipelineExecutor(Communicator& pp, Backend& backend, MemoryLedger& ledger,
                                   int64_t act_elems, int micro_batches, DType act)
    : pp_(pp),
      be_(backend),
      stages_(pp.size()),
      stage_(pp.rank()),
      micro_batches_(micro_batches),
      act_elems_(act_elems),
      act_(act) {
  SHARDLM_CHECK(micro_batches >= 1 && act_elems >= 1,
                "pipeline executor: micro_batches {} and act_elems {} must be >= 1", micro_batches,
                act_elems);
  slots_ = ring_size(stages_, stage_, micro_batches);
  auto ring = [&](bool used) {
    auto r = std::make_unique<Ring>();
    if (!used) return r;
    r->n = slots_;
    r->buf = Buffer(backend, ledger, MemCategory::kComm, MemPool::kDevice,
                    size_t(r->n) * size_t(act_elems) * dtype_size(act));
    r->handles.resize(r->n);
    return r;
  };
  act_ring_ = ring(stage_ + 1 < stages_);
  grad_ring_ = ring(stage_ > 0);
  if (stage_ + 1 < stages_)
    grad_in_ = Buffer(backend, ledger, MemCategory::kComm, MemPool::kDevice,
                      size_t(act_elems) * dtype_size(act));
}

PipelineExecutor::~PipelineExecutor() = default;

void PipelineExecutor::abandon_sends() {
  // A schedule that failed midway (a peer gone, a timeout) may leave sends that nothing will
  // ever match; destroying their handles would wait for them. The run is failing (the caller
  // reports the error and aborts the job): they are dropped.
  for (Ring* r : {act_ring_.get(), grad_ring_.get()})
    for (auto& h : r->handles) (void)h.release();
}

Tensor PipelineExecutor::to_ring(Ring& ring, const Tensor& src, PipelineStats& st) {
  const auto t0 = Clock::now();
  std::unique_ptr<CommHandle>& h = ring.handles[ring.next];
  if (h) {
    h->wait();  // the buffer's previous send must have left
    h.reset();
  }
  const int64_t n = src.numel();
  const Tensor dst =
      ring.buf.view(act_, {n}, size_t(ring.next) * size_t(act_elems_) * dtype_size(act_));
  be_.copy(src.view({n}), dst);
  // The copy is done before the transport reads the buffer: a host transport runs after the
  // backend's synchronous ops; a device transport (set_compute_stream) queues the send after
  // the compute stream's work, so the host does not wait here.
  st.send_s += since(t0);
  return dst;
}

void PipelineExecutor::send(Ring& ring, const Tensor& src, int peer, PipelineStats& st) {
  const int slot = ring.next;
  const Tensor dst = to_ring(ring, src, st);
  const auto t0 = Clock::now();
  ring.handles[slot] = pp_.send_async(dst, peer, kPipeTag);
  ring.next = (ring.next + 1) % ring.n;
  st.send_s += since(t0);
}

void PipelineExecutor::exchange(const PipelineStageOps& ops, const PipeStep& step, int slots,
                                int64_t elems, const Tensor& out, PipelineStats& st) {
  const bool act = step.send && step.send->kind == PipeOpKind::kSendActivation;
  Ring& ring = act ? *act_ring_ : *grad_ring_;
  if (!step.recv) {
    send(ring, act ? out : ops.input_grad(), pipe_peer(step.send->kind, stage_), st);
    return;
  }
  Tensor into;  // the receive's buffer
  if (step.recv->kind == PipeOpKind::kRecvGradient) {
    into = grad_in_.view(act_, {elems});
  } else {
    const Tensor in = ops.input(step.recv->micro % slots);
    into = in.view({in.numel()});
  }
  const int recv_peer = pipe_peer(step.recv->kind, stage_);
  if (!step.send) {
    const auto t0 = Clock::now();
    pp_.recv(into, recv_peer, kPipeTag);
    st.recv_s += since(t0);
    return;
  }
  // Both, facing one neighbour: one grouped transfer, waited for (the next pass reads what it
  // receives). Its ring buffer keeps no handle: once sendrecv returns the send has left, for
  // everything queued after it (on NCCL the compute stream waits for it, not the host).
  const Tensor dst = to_ring(ring, act ? out : ops.input_grad(), st);
  ring.next = (ring.next + 1) % ring.n;
  const auto t0 = Clock::now();
  pp_.sendrecv(dst, pipe_peer(step.send->kind, stage_), into, recv_peer, kPipeTag);
  st.recv_s += since(t0);
}

void PipelineExecutor::wait_all(PipelineStats& st) {
  const auto t0 = Clock::now();
  for (Ring* r : {act_ring_.get(), grad_ring_.get()})
    for (auto& h : r->handles)
      if (h) {
        h->wait();
        h.reset();
      }
  st.send_s += since(t0);
}

PipelineStats PipelineExecutor::train(const PipelineStageOps& ops, int micro_batches,
                                      int64_t elems) {
  try {
    return run_train(ops, micro_batches, elems);
  } catch (...) {
    abandon_sends();
    throw;
  }
}

PipelineStats PipelineExecutor::evaluate(const PipelineStageOps& ops, int micro_batches,
                                         int64_t elems) {
  try {
    return run_evaluate(ops, micro_batches, elems);
  } catch (...) {
    abandon_sends();
    throw;
  }
}

PipelineStats PipelineExecutor::run_train(const PipelineStageOps& ops, int micro_batches,
                                          int64_t elems) {
  SHARDLM_CHECK(micro_batches >= 1 && micro_batches <= micro_batches_ && elems <= act_elems_,
                "pipeline step of {} micro-batches of {} elements exceeds the executor's {} of {}",
                micro_batches, elems, micro_batches_, act_elems_);
  PipelineStats st;
  StageClock clock(be_);
  const int slots = std::min(slots_, micro_batches);
  Tensor out;  // the last forward's activation, until its send
  for (const PipeStep& step : pipe_steps(one_f_one_b(stages_, stage_, micro_batches))) {
    if (!step.compute) {
      exchange(ops, step, slots, elems, out, st);
      continue;
    }
    const PipeOp& op = *step.compute;
    const int slot = op.micro % slots;
    clock.begin_pass();
    if (op.kind == PipeOpKind::kForward) {
      ops.load(op.micro, slot);
      out = ops.forward(op.micro, slot, nullptr);
    } else {
      const Tensor d_out = stage_ + 1 < stages_ ? grad_in_.view(act_, {elems}) : Tensor();
      st.loss_sum += ops.backward(op.micro, slot, d_out);
    }
    clock.end_pass();
  }
  wait_all(st);
  clock.finish(st);
  return st;
}

PipelineStats PipelineExecutor::run_evaluate(const PipelineStageOps& ops, int micro_batches,
                                             int64_t elems) {
  SHARDLM_CHECK(elems <= act_elems_, "pipeline evaluation of {} elements exceeds the executor's {}",
                elems, act_elems_);
  PipelineStats st;
  StageClock clock(be_);
  for (int i = 0; i < micro_batches; ++i) {
    if (stage_ > 0) {
      const Tensor in = ops.input(0);
      const auto t0 = Clock::now();
      pp_.recv(in.view({in.numel()}), stage_ - 1, kPipeTag);
      st.recv_s += since(t0);
    }
    clock.begin_pass();
    ops.load(i, 0);
    LossResult loss{};
    const Tensor out = ops.forward(i, 0, &loss);
    clock.end_pass();
    st.loss_sum += loss.loss_sum;
    st.n_valid += loss.n_valid;
    if (stage_ + 1 < stages_) send(*act_ring_, out, stage_ + 1, st);
  }
  wait_all(st);
  clock.finish(st);
  return st;
}

}  // namespace shardlm
