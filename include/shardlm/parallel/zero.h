// ZeroEngine: data parallelism over the ranks of one group with ZeRO stages 0-3, as the
// ParamStore of a LlamaModel. It owns the parameters, gradients and AdamW state, split as
// plan/zero_layout.h describes:
//   stage 0  everything replicated; gradients all-reduced per bucket
//   stage 1  optimizer state (moments, f32 master) sharded; gradients reduce-scattered per
//            bucket after the step's last micro-batch; updated chunks all-gathered
//   stage 2  also gradients sharded: each bucket's gradients live in a small rotating buffer
//            only until backward has finished the bucket, then are reduce-scattered into the
//            rank's f32 shard (every micro-batch: there is no full-size gradient buffer)
//   stage 3  also parameters sharded: a bucket is all-gathered just before the model uses it,
//            the next `prefetch` buckets ahead of it, into a small pool of gather buffers
// From stage 2 on the embeddings' and the untied LM head's tables are handed out in pieces of
// rows (ParamStore::piece_rows, split_tables), so buckets and their buffers are bounded by a
// layer or the bucket size, not by the vocabulary.
// Offload: optimizer state (f32 master, moments) in the host pool with AdamW run there on the
// host backend, updated parameters copied back; at stage 3 the parameter shard too. From stage
// 2 on the f32 gradient shard is then on the host as well: each reduced chunk is copied out on
// the backend's copy stream and accumulated there (plan/zero_layout.h, zero_streams_gradients).
// The reductions' wire format is f32, or bf16 from stage 2 on (reduce_dtype): a bucket's f32
// gradients are rounded into a bf16 send buffer and the reduced chunk is widened to f32 before
// it is accumulated.
// Collectives run on a communication thread (overlap) or inline; the compute thread never
// talks to the group while they are in flight (see CommWorker).
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "shardlm/backend/backend.h"
#include "shardlm/comm/communicator.h"
#include "shardlm/core/buffer.h"
#include "shardlm/model/layout.h"
#include "shardlm/model/param_store.h"
#include "shardlm/parallel/grad_axes.h"
#include "shardlm/plan/plan.h"
#include "shardlm/plan/zero_layout.h"

namespace shardlm {

class CommWorker;

struct ZeroOptions {
  int stage = 0;                     // 0..3
  bool offload_optimizer = false;    // AdamW state in the host pool, step on the host
  bool offload_params = false;       // stage 3: the parameter shard in the host pool
  bool overlap_comm = true;          // collectives on a communication thread
  int64_t bucket_elems = 1 << 22;    // see make_zero_layout
  int prefetch = 1;                  // stage 3: buckets gathered ahead of use
  DType reduce_dtype = DType::kF32;  // gradient reductions' wire format: f32, or bf16 (stage >= 2)
  // Stage >= 2: the embeddings' and the untied LM head's tables are handed out, gathered and
  // reduced in pieces of rows no larger than a layer or a bucket (plan/zero_layout.h), so no
  // buffer is sized by the vocabulary. Off under tensor parallelism, whose vocabulary-parallel
  // loss reduces each token's statistics over the ranks once per whole slice.
  bool split_tables = true;
};

// Sets the planner's data-parallel inputs to what an engine with these options over `ranks`
// ranks allocates (the one mapping from ZeroOptions to PlanInputs).
void set_plan_inputs(const ZeroOptions& opt, int ranks, PlanInputs& in);

class ZeroEngine final : public ParamStore {
 public:
  // device: the backend of the model's buffers; host: a CPU backend for offloaded state
  // (the same object is fine on a CPU build). Allocates everything here.
  ZeroEngine(const ParamLayout& layout, DType param_dtype, const ZeroOptions& opt, Communicator& dp,
             Backend& device, Backend& host, MemoryLedger& ledger);
  ~ZeroEngine() override;
  ZeroEngine(const ZeroEngine&) = delete;
  ZeroEngine& operator=(const ZeroEngine&) = delete;

  const ZeroLayout& zero_layout() const { return z_; }
  const ZeroOptions& options() const { return opt_; }

  // Sets unit u's parameters (and f32 master) from f32 values [unit_size(u)], identical on
  // every rank. Call for every unit before training.
  void set_unit_values(int u, const float* values);

  // A step: begin_step(micro_batches) zeroes the gradients; the model runs that many
  // forward_backward()s (gradients of each bucket are reduced as soon as the last one has
  // finished it, or at stage >= 2 after every one); then step().
  void begin_step(int micro_batches);
  // Waits for every reduction, computes the global gradient norm over all ranks (collective),
  // and unless it is non-finite clips by grad_clip (> 0) and applies AdamW (h.lr, betas, eps,
  // weight_decay on matrices only; h.step and h.grad_scale are set here). Then the parameters
  // are whole again (stage 1-2: updated chunks all-gathered). Returns the norm before clipping.
  double step(const AdamWHyper& h, double grad_clip);
  // The grid's other axes (tied embeddings, tensor and sequence parallelism, the pipeline's
  // stages): step() hands them the slices of the arena this rank owns once its group's
  // reductions are done, and the norm's parts summed over its group. Without them the
  // gradients are this group's alone.
  void set_gradient_axes(const GradientAxes& axes) { axes_ = &axes; }
  int64_t steps_taken() const { return t_; }
  void set_steps_taken(int64_t t) { t_ = t; }

  // Waits for everything in flight: call before the caller's own collectives on the group.
  void drain();
  // Seconds the compute thread has waited on communication since construction.
  double comm_wait_seconds() const;

  // The first unit (in arena order) whose reduced gradients hold a NaN or infinity, as
  // ParamLayout::unit_name says; "" when none (collective). Valid once the step's micro-batches
  // are done, whether or not step() ran.
  std::string first_nonfinite_unit();

  // The state of a checkpoint, each a flat vector in arena order (ParamLayout offsets):
  // params [total] in the parameter dtype; Adam m and v [total] f32; the f32 master
  // weights [total] when the parameters are bf16 (has_master()).
  enum class State { kParams, kAdamM, kAdamV, kMaster };
  bool has_master() const { return param_dtype_ != DType::kF32; }
  // No communication: this rank's share of the vector for a sharded checkpoint, chunk r of
  // every bucket (r its rank in the group; replicated state too, so that the group's ranks
  // write disjoint shares that cover the vector). `sink(begin, count, data)` gets elements
  // [begin, begin + count) in arena order, at most zero_checkpoint_stage_elems at a time, in
  // the engine's host staging buffer (valid during the call).
  void save_owned(State s,
                  const std::function<void(int64_t begin, int64_t count, const void* data)>& sink);
  // Every rank fetches what it holds: `source(begin, count, dst)` must write elements
  // [begin, begin + count) of the stored vector into host memory dst (the staging buffer; at
  // most zero_checkpoint_stage_elems at a time).
  void load(State s, const std::function<void(int64_t begin, int64_t count, void* dst)>& source);

  // ParamStore
  void begin_pass(Pass pass) override;
  void end_pass() override;
  Tensor acquire_params(int u) override;
  void release_params(int u) override;
  Tensor acquire_grads(int u) override;
  void release_grads(int u) override;
  int64_t piece_rows(int u) const override;
  Tensor acquire_piece_params(int u, int piece) override;
  void release_piece_params(int u, int piece) override;
  Tensor acquire_piece_grads(int u, int piece) override;
  void release_piece_grads(int u, int piece) override;

 private:
  struct Segment;  // an owned, unpadded, same-decay stretch of the arena
  struct GradBuf;  // stage >= 2: one bucket's gradients between backward and the reduction
  struct Gather;   // stage 3: one bucket's gathered parameters
  bool sharded_state() const { return opt_.stage >= 1; }
  bool streams_grads() const { return zero_streams_gradients(opt_.stage, opt_.offload_optimizer); }
  // The backend that reads the reduced gradients: the host's when they are streamed there.
  Backend& grad_backend() const { return streams_grads() ? host_ : be_; }
  void allocate_grad_buffers(MemoryLedger& ledger);
  void build_segments();
  struct StateBuffer {
    const Buffer* buf;
    DType dtype;
    bool replicated;  // whole on every rank (in the padded layout), else this rank's shard
  };
  StateBuffer state_buffer(State s) const;  // where a checkpoint state lives
  int64_t state_elems() const { return sharded_state() ? z_.shard : z_.padded_total; }
  Tensor params_padded() const;  // [padded_total] (stage 0-2)
  Tensor param_shard() const;    // [shard] (stage 3)
  Tensor grads_padded() const;   // [padded_total] (stage 0-1)
  Tensor grad_source() const;    // the reduced gradients, indexed by state offsets
  Tensor grad_shard() const;     // [shard] f32: where stage >= 1 accumulates them
  Tensor state(const Buffer& b) const;
  void bucket_complete(int b);
  GradBuf& take_grad_buffer(int b);
  Tensor reduced_chunk(const GradBuf& g, int64_t chunk) const;  // [chunk] wire dtype
  Tensor widened_chunk(const GradBuf& g, int64_t chunk) const;  // [chunk] f32
  // After g's reduction: its chunk into the device shard, or (streaming) on its way to the host.
  void settle(GradBuf& g);
  void settle_on_device(GradBuf& g);
  void stream_out(GradBuf& g);           // starts the copy of g's reduced chunk to the host
  void land(GradBuf& g);                 // once it has arrived: accumulates it into the host shard
  void land_through(GradBuf* g);         // lands the copies in issue order up to g's (null: all)
  Gather* gather(int b, bool prefetch);  // null: a prefetch found no free buffer
  void prefetch_after(int b);
  // dp_'s all_gather / reduce_scatter; on one rank a copy through the backend (the
  // communicator's own size-1 copy is a host memcpy, and the tensors may be in device memory).
  void dp_all_gather(const Tensor& send, const Tensor& recv);
  void dp_reduce_scatter(const Tensor& send, const Tensor& recv);
  void forget_gathers();  // after an update or a load: every gathered bucket is stale
  // step()'s parts: the last reductions, the norm's parts over this group, the update.
  void finish_gradients();
  void drop_pending_gradients();
  std::vector<GradSlice> grad_slices() const;  // the owned segments' reduced gradients
  std::vector<double> segment_sums(std::span<const GradSlice> slices);  // sum_squares of each
  GradNormParts norm_parts(std::span<const GradSlice> slices);
  void apply_update(const AdamWHyper& h, float clip);
  // The step's hyper-parameters: h at this engine's step count, gradients scaled by `clip`.
  AdamWHyper step_hyper(const AdamWHyper& h, float clip) const;
  // AdamW's tensors for elements [off, off + n) of segment s, with its weight decay (h's or 0).
  AdamWSegment adamw_segment(const Segment& s, int64_t off, int64_t n, const AdamWHyper& h,
                             const Tensor& grads) const;
  Backend& optimizer_backend();  // the host's when the optimizer is offloaded
  Tensor device_params(const Segment& s, int64_t off, int64_t n) const;  // [n] of segment s
  void step_and_return_in_pieces(const AdamWHyper& h, float clip, const Tensor& grads);
  void gather_params_after_update();
  void write_params_from_master();

  const ParamLayout& layout_;
  DType param_dtype_;
  ZeroOptions opt_;
  Communicator& dp_;
  const GradientAxes* axes_ = nullptr;  // the other axes' sums and norm rules, if any
  Backend& be_;
  Backend& host_;
  ZeroLayout z_;
  int rank_ = 0, world_ = 1;
  std::vector<Segment> segments_;

  Buffer params_;      // [padded_total] (stage 0-2) or [shard] (stage 3) param dtype
  Buffer grads_;       // [padded_total] f32 (stage 0-1)
  Buffer grad_shard_;  // [shard] f32 (stage 1-3) on the device, unless streamed
  Buffer m_, v_;       // [state_elems] f32 (optimizer; host pool when offloaded)
  Buffer master_;      // [state_elems] f32 when params are bf16 or the optimizer is offloaded
  Buffer host_grads_;  // [state_elems] f32 host gradients (offload): a copy of the device's at
                       // stages 0-1, the streamed shard itself from stage 2
  // [piece] param dtype host, rotating: updated bf16 parameters on their way to the device
  std::vector<Buffer> param_return_;
  int64_t param_piece_ = 0;  // elements of a piece (zero_param_return_elems)
  Buffer send_stage_;        // [max_chunk] param dtype: stage 3 + offload, a chunk to send
  // [zero_checkpoint_stage_elems] f32-sized host: checkpoint state on its way to or from disk
  Buffer ckpt_stage_;
  std::vector<std::unique_ptr<GradBuf>> grad_bufs_;
  std::vector<std::unique_ptr<Gather>> gathers_;
  std::unique_ptr<CommWorker> worker_;

  int micro_batches_ = 1, micro_ = 0;  // of the step; backward passes seen
  Pass pass_ = Pass::kForward;
  int last_part_ = -1;                   // in this pass, for prefetch direction
  std::vector<int> parts_done_;          // per bucket: parts whose grads are complete
  std::vector<int> grad_of_bucket_;      // per bucket: index into grad_bufs_, or -1
  std::deque<GradBuf*> landing_;         // streaming: copies to the host not yet landed, in order
  std::vector<uint64_t> bucket_ticket_;  // stage 0-1: the bucket's reduction
  std::vector<char> reduced_once_;       // stage >= 2: a micro-batch's reduction landed
  uint64_t clock_ = 0;                   // LRU clock of the gather pool
  int64_t t_ = 0;
};

}  // namespace shardlm
