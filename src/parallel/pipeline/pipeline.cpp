// The pipeline executor (parallel/pipeline.h): 1F1B and forward-only sweeps of one stage over
// its pipeline group, with asynchronous sends from a ring of buffers, blocking activation
// receives and gradient receives posted ahead. Activations and gradients travel on two
// communicators: a device transport (NCCL) runs each communicator's operations in order on a
// stream of its own, where one stream for both directions lets two neighbours' sends wait on
// each other's receives queued behind them. Nothing here waits for the device: a transport
// orders itself after the compute queued so far, and the stage's busy time is read from marks
// on the backend's queue.
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

constexpr int kActivationTag = 1, kGradientTag = 2;

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

PipelineExecutor::PipelineExecutor(Communicator& pp, Communicator& pp_gradients, Backend& backend,
                                   MemoryLedger& ledger, int64_t act_elems, int micro_batches,
                                   DType act)
    : pp_(pp),
      grad_comm_(pp_gradients),
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
  // A schedule that failed midway (a peer gone, a timeout) may leave sends (and a gradient
  // receive) that nothing will ever match; destroying their handles would wait for them. The
  // run is failing (the caller reports the error and aborts the job): they are dropped.
  for (Ring* r : {act_ring_.get(), grad_ring_.get()})
    for (auto& h : r->handles) (void)h.release();
  (void)grad_recv_.release();
}

Communicator& PipelineExecutor::comm(int tag) { return tag == kGradientTag ? grad_comm_ : pp_; }

void PipelineExecutor::recv_gradient(int64_t elems, PipelineStats& st) {
  const auto t0 = Clock::now();
  if (grad_recv_) {  // posted after the previous backward: overlapped with the forward since
    grad_recv_->wait();
    grad_recv_.reset();
  } else {
    grad_comm_.recv(grad_in_.view(act_, {elems}), stage_ + 1, kGradientTag);
  }
  st.recv_s += since(t0);
}

void PipelineExecutor::post_gradient_recv(int64_t elems) {
  // grad_in_ is free once the backward that read it has run: a device transport queues the
  // receive after the compute issued so far (on the gradient stream, behind this stage's own
  // gradient send, which was posted first), and a staged one writes it with Backend::copy,
  // queued after that backward too.
  grad_recv_ = grad_comm_.recv_async(grad_in_.view(act_, {elems}), stage_ + 1, kGradientTag);
}

void PipelineExecutor::send(Ring& ring, const Tensor& src, int peer, int tag, PipelineStats& st) {
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
  h = comm(tag).send_async(dst, peer, tag);
  ring.next = (ring.next + 1) % ring.n;
  st.send_s += since(t0);
}

void PipelineExecutor::wait_all(PipelineStats& st) {
  const auto t0 = Clock::now();
  for (Ring* r : {act_ring_.get(), grad_ring_.get()})
    for (auto& h : r->handles)
      if (h) {
        h->wait();
        h.reset();
      }
  SHARDLM_CHECK(!grad_recv_,
                "pipeline stage {}: a gradient receive was posted past the last "
                "backward",
                stage_);
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
  for (const PipeOp& op : one_f_one_b(stages_, stage_, micro_batches)) {
    const int slot = op.micro % slots;
    switch (op.kind) {
      case PipeOpKind::kRecvActivation: {
        const Tensor in = ops.input(slot);
        const auto t0 = Clock::now();
        pp_.recv(in.view({in.numel()}), stage_ - 1, kActivationTag);
        st.recv_s += since(t0);
        break;
      }
      case PipeOpKind::kForward:
        clock.begin_pass();
        ops.load(op.micro, slot);
        out = ops.forward(op.micro, slot, nullptr);
        clock.end_pass();
        break;
      case PipeOpKind::kSendActivation:
        send(*act_ring_, out, stage_ + 1, kActivationTag, st);
        break;
      case PipeOpKind::kRecvGradient:
        recv_gradient(elems, st);
        break;
      case PipeOpKind::kBackward: {
        clock.begin_pass();
        const Tensor d_out = stage_ + 1 < stages_ ? grad_in_.view(act_, {elems}) : Tensor();
        st.loss_sum += ops.backward(op.micro, slot, d_out);
        clock.end_pass();
        break;
      }
      case PipeOpKind::kSendGradient:
        send(*grad_ring_, ops.input_grad(), stage_ - 1, kGradientTag, st);
        break;
    }
    // The next micro-batch's gradient, received while this stage runs its next forward: after
    // the backward (and its gradient's send, which comes first on the gradient stream).
    const bool backward_done =
        stage_ > 0 ? op.kind == PipeOpKind::kSendGradient : op.kind == PipeOpKind::kBackward;
    if (backward_done && stage_ + 1 < stages_ && op.micro + 1 < micro_batches)
      post_gradient_recv(elems);
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
      pp_.recv(in.view({in.numel()}), stage_ - 1, kActivationTag);
      st.recv_s += since(t0);
    }
    clock.begin_pass();
    ops.load(i, 0);
    LossResult loss{};
    const Tensor out = ops.forward(i, 0, &loss);
    clock.end_pass();
    st.loss_sum += loss.loss_sum;
    st.n_valid += loss.n_valid;
    if (stage_ + 1 < stages_) send(*act_ring_, out, stage_ + 1, kActivationTag, st);
  }
  wait_all(st);
  clock.finish(st);
  return st;
}

}  // namespace shardlm
