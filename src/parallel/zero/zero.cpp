// ZeRO stages 0-3 over the padded bucket layout of plan/zero_layout.h (see zero.h).
#include "shardlm/parallel/zero.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "shardlm/core/check.h"
#include "zero_parts.h"

namespace shardlm {

void set_plan_inputs(const ZeroOptions& opt, int ranks, PlanInputs& in) {
  in.dp = ranks;
  in.zero_stage = opt.stage;
  in.offload_optimizer = opt.offload_optimizer;
  in.offload_params = opt.offload_params;
  in.bucket_elems = opt.bucket_elems;
  in.prefetch = opt.prefetch;
  in.reduce_dtype = opt.reduce_dtype;
  in.split_tables = opt.split_tables;
}

// Owned segments: per bucket, this rank's part of the arena (all of it at stage 0), cut at unit
// boundaries and where weight decay changes, padding excluded. An entry may span buckets (a
// table in pieces).
void ZeroEngine::build_segments() {
  const std::vector<ParamEntry>& entries = layout_.entries;  // in arena order
  size_t first = 0;
  for (const ZeroBucket& b : z_.buckets) {
    int64_t lo = b.padded_begin, hi = b.padded_begin + b.size();  // owned, padded offsets
    if (sharded_state()) {
      lo = b.padded_begin + rank_ * b.chunk;
      hi = std::min(lo + b.chunk, hi);
    }
    while (first < entries.size() &&
           entries[first].offset + entries[first].shape.numel() <= b.begin)
      ++first;
    for (size_t i = first; i < entries.size() && entries[i].offset < b.end; ++i) {
      const ParamEntry& e = entries[i];
      const int64_t from = std::max(e.offset, b.begin);  // the entry's flat range in b
      const int64_t to = std::min(e.offset + e.shape.numel(), b.end);
      const int64_t a = std::max(lo, b.padded_begin + (from - b.begin));
      const int64_t z = std::min(hi, b.padded_begin + (to - b.begin));
      if (a >= z) continue;
      Segment s;
      s.flat = b.begin + (a - b.padded_begin);
      s.padded = a;
      s.state = sharded_state() ? b.shard_begin + (a - lo) : a;
      s.count = z - a;
      s.decay = e.decay;
      if (!segments_.empty()) {
        Segment& p = segments_.back();
        if (p.decay == s.decay && p.padded + p.count == s.padded && p.state + p.count == s.state &&
            p.flat + p.count == s.flat &&
            zero_unit_of(layout_, p.flat) == zero_unit_of(layout_, s.flat)) {
          p.count += s.count;
          continue;
        }
      }
      segments_.push_back(s);
    }
  }
}

ZeroEngine::ZeroEngine(const ParamLayout& layout, DType param_dtype, const ZeroOptions& opt,
                       Communicator& dp, Backend& device, Backend& host, MemoryLedger& ledger)
    : layout_(layout),
      param_dtype_(param_dtype),
      opt_(opt),
      dp_(dp),
      be_(device),
      host_(host),
      z_(make_zero_layout(layout, dp.size(), opt.bucket_elems,
                          zero_splits_tables(opt.stage, opt.split_tables))),
      rank_(dp.rank()),
      world_(dp.size()) {
  SHARDLM_CHECK(opt.stage >= 0 && opt.stage <= 3, "zero stage {} is not 0..3", opt.stage);
  SHARDLM_CHECK(!opt.offload_params || (opt.stage == 3 && opt.offload_optimizer),
                "parameter offload needs stage 3 with optimizer offload");
  SHARDLM_CHECK(opt.prefetch >= 0, "prefetch {} < 0", opt.prefetch);
  SHARDLM_CHECK(
      opt.reduce_dtype == DType::kF32 || (opt.reduce_dtype == DType::kBF16 && opt.stage >= 2),
      "zero reduce dtype {}: reductions run in f32, or in bf16 from stage 2 on (its "
      "bucket buffers hold the rounded copy; stages 0-1 reduce the f32 arena in place)",
      dtype_name(opt.reduce_dtype));
  const size_t pb = dtype_size(param_dtype);
  const MemPool dev = MemPool::kDevice, hostp = MemPool::kHost;
  const MemPool opt_pool = opt.offload_optimizer ? hostp : dev;
  const int64_t S = state_elems();

  build_segments();

  if (opt.stage <= 2) {
    params_ = Buffer(be_, ledger, MemCategory::kParams, dev, z_.padded_total * pb);
  } else {
    params_ =
        Buffer(be_, ledger, MemCategory::kParams, opt.offload_params ? hostp : dev, z_.shard * pb);
  }
  if (opt.stage <= 1) grads_ = Buffer(be_, ledger, MemCategory::kGrads, dev, z_.padded_total * 4);
  if (opt.stage >= 1 && !streams_grads())
    grad_shard_ = Buffer(be_, ledger, MemCategory::kGrads, dev, z_.shard * 4);
  m_ = Buffer(be_, ledger, MemCategory::kOptimizer, opt_pool, S * 4);
  v_ = Buffer(be_, ledger, MemCategory::kOptimizer, opt_pool, S * 4);
  if (param_dtype != DType::kF32 || opt.offload_optimizer)
    master_ = Buffer(be_, ledger, MemCategory::kOptimizer, opt_pool, S * 4);
  if (opt.offload_optimizer) {
    // Streamed, it is the gradient shard itself; else a copy of the device's, made at the step.
    host_grads_ =
        Buffer(be_, ledger, streams_grads() ? MemCategory::kGrads : MemCategory::kHostOffload,
               hostp, S * 4);
  }
  if (zero_returns_params_in_pieces(param_dtype, opt.offload_optimizer, opt.offload_params)) {
    param_piece_ = zero_param_return_elems(z_, opt.bucket_elems);
    for (int i = 0; i < kZeroParamReturnBuffers; ++i)
      param_return_.emplace_back(be_, ledger, MemCategory::kHostOffload, hostp, param_piece_ * pb);
  }
  ckpt_stage_ = Buffer(be_, ledger, MemCategory::kHostOffload, hostp,
                       zero_checkpoint_stage_elems(z_, opt.bucket_elems) * 4);
  if (opt.stage >= 2) allocate_grad_buffers(ledger);
  if (opt.stage == 3) {
    for (int i = 0; i < zero_gather_buffers(opt.prefetch); ++i) {
      auto g = std::make_unique<Gather>();
      g->buf = Buffer(be_, ledger, MemCategory::kComm, dev, z_.max_bucket * pb);
      gathers_.push_back(std::move(g));
    }
    if (opt.offload_params)
      send_stage_ = Buffer(be_, ledger, MemCategory::kComm, dev, z_.max_chunk * pb);
  }
  const size_t nb = z_.buckets.size();
  parts_done_.assign(nb, 0);
  grad_of_bucket_.assign(nb, -1);
  bucket_ticket_.assign(nb, 0);
  reduced_once_.assign(nb, 0);
  worker_ = std::make_unique<CommWorker>(opt.overlap_comm && world_ > 1);
}

ZeroEngine::~ZeroEngine() = default;

Tensor ZeroEngine::params_padded() const { return params_.view(param_dtype_, {z_.padded_total}); }
Tensor ZeroEngine::param_shard() const { return params_.view(param_dtype_, {z_.shard}); }
Tensor ZeroEngine::state(const Buffer& b) const { return b.view(DType::kF32, {state_elems()}); }

double ZeroEngine::comm_wait_seconds() const { return worker_->wait_seconds(); }

void ZeroEngine::drain() { worker_->drain(); }

// ---- initial values -------------------------------------------------------------------------

void ZeroEngine::set_unit_values(int u, const float* values) {
  const int64_t begin = layout_.units[u].begin, n = layout_.unit_size(u);
  if (n == 0) return;  // another pipeline stage's unit
  auto host_f32 = [&](int64_t flat, int64_t count) {
    return Tensor(const_cast<float*>(values) + (flat - begin), DType::kF32, {count},
                  MemPool::kHost);
  };
  if (opt_.stage <= 2)
    be_.convert(host_f32(begin, n), params_padded().rows(z_.padded_offset(begin), n));
  for (const Segment& s : segments_) {
    if (s.flat < begin || s.flat >= begin + n) continue;
    if (opt_.stage == 3)
      be_.convert(host_f32(s.flat, s.count), param_shard().rows(s.state, s.count));
    if (!master_.empty())
      be_.copy(host_f32(s.flat, s.count), state(master_).rows(s.state, s.count));
  }
}

// ---- the step -------------------------------------------------------------------------------

void ZeroEngine::begin_step(int micro_batches) {
  SHARDLM_CHECK(micro_batches >= 1, "a step needs at least one micro-batch");
  micro_batches_ = micro_batches;
  micro_ = 0;
  // A step skipped after backward (a non-finite loss) leaves reductions behind.
  drop_pending_gradients();
  if (opt_.stage <= 1) be_.zero(grads_padded());
  std::fill(reduced_once_.begin(), reduced_once_.end(), 0);
}

void ZeroEngine::begin_pass(Pass pass) {
  pass_ = pass;
  last_part_ = -1;
  if (pass == Pass::kBackward) {
    ++micro_;
    std::fill(parts_done_.begin(), parts_done_.end(), 0);
  }
}

void ZeroEngine::end_pass() {}

int64_t ZeroEngine::piece_rows(int u) const { return z_.piece_rows[u]; }

Tensor ZeroEngine::acquire_params(int u) {
  SHARDLM_CHECK(z_.piece_rows[u] == 0, "zero: unit {} is handed out in pieces", u);
  return acquire_piece_params(u, 0);
}

void ZeroEngine::release_params(int u) { release_piece_params(u, 0); }

Tensor ZeroEngine::acquire_piece_params(int u, int piece) {
  const int p = z_.part_of(u, piece);
  const ZeroPart& part = z_.parts[p];
  const int64_t n = part.end - part.begin;
  if (opt_.stage <= 2) return params_padded().rows(z_.padded_offset(part.begin), n);
  const int b = z_.part_bucket[p];
  Gather* g = gather(b, false);
  ++g->holds;
  g->prefetched = false;
  g->used = ++clock_;
  // The tied LM head is unit 0 used out of the walk's order: no prefetch from there.
  const bool head_use =
      u == 0 && layout_.lm_head_unit == 0 && (pass_ == Pass::kBackward || last_part_ >= 0);
  // A table's pieces walked again from the top in backward (the loss's gradient walk after its
  // statistics walk) start a new descending walk.
  const bool rewalk = pass_ == Pass::kBackward && last_part_ >= 0 && p > last_part_ &&
                      z_.parts[last_part_].unit == u;
  const bool in_order =
      pass_ == Pass::kForward ? p > last_part_ : (last_part_ < 0 || p < last_part_ || rewalk);
  if (!head_use && in_order) {
    last_part_ = p;
    prefetch_after(b);
  }
  return g->buf.view(param_dtype_, {n},
                     (part.begin - z_.buckets[b].begin) * dtype_size(param_dtype_));
}

void ZeroEngine::release_piece_params(int u, int piece) {
  if (opt_.stage <= 2) return;
  const int b = z_.bucket_of(u, piece);
  for (auto& g : gathers_)
    if (g->bucket == b) {
      SHARDLM_CHECK(g->holds > 0, "unit {} released more often than acquired", u);
      --g->holds;  // the gathered values stay cached until the buffer is needed again
      return;
    }
  SHARDLM_FAIL(ErrorKind::kInternal, "unit {} released but not gathered", u);
}

ZeroEngine::Gather* ZeroEngine::gather(int b, bool prefetch) {
  for (auto& g : gathers_)
    if (g->bucket == b) {
      if (!prefetch) worker_->wait(g->ticket);
      return g.get();
    }
  Gather* victim = nullptr;
  for (auto& g : gathers_) {
    if (g->holds > 0 || g->prefetched) continue;
    if (victim == nullptr || (g->bucket < 0 && victim->bucket >= 0) ||
        ((g->bucket < 0) == (victim->bucket < 0) && g->used < victim->used))
      victim = g.get();
  }
  if (victim == nullptr) {
    SHARDLM_CHECK(prefetch, "zero stage 3: every gather buffer is in use ({})", gathers_.size());
    return nullptr;  // a prefetch waits for a free buffer no longer than this
  }
  worker_->wait(victim->ticket);
  const ZeroBucket& bk = z_.buckets[b];
  Tensor send = param_shard().rows(bk.shard_begin, bk.chunk);
  if (opt_.offload_params) {
    // Host shard -> device staging (the previous gather's send must have left it).
    for (auto& g : gathers_) worker_->wait(g->ticket);
    const Tensor stage = send_stage_.view(param_dtype_, {bk.chunk});
    be_.copy(send, stage);
    send = stage;
  }
  const Tensor recv = victim->buf.view(param_dtype_, {int64_t(world_) * bk.chunk});
  victim->bucket = b;
  victim->prefetched = prefetch;
  victim->used = ++clock_;
  victim->ticket = worker_->submit([this, send, recv] { dp_all_gather(send, recv); });
  if (!prefetch) worker_->wait(victim->ticket);
  return victim;
}

void ZeroEngine::prefetch_after(int b) {
  const int nb = int(z_.buckets.size());
  for (int i = 1; i <= opt_.prefetch; ++i) {
    const int next = pass_ == Pass::kForward ? b + i : b - i;
    if (next < 0 || next >= nb) return;
    // Backward never reads the embeddings' parameters (the tied head is used at its start).
    if (pass_ == Pass::kBackward && z_.parts[z_.buckets[next].last_part].unit == 0) return;
    if (gather(next, true) == nullptr) return;  // no free buffer: gathered on demand
  }
}

void ZeroEngine::dp_all_gather(const Tensor& send, const Tensor& recv) {
  if (world_ == 1)
    be_.copy(send, recv.view({recv.numel()}).rows(0, send.numel()));
  else
    dp_.all_gather(send, recv);
}

double ZeroEngine::step(const AdamWHyper& h, double grad_clip) {
  SHARDLM_CHECK(micro_ == micro_batches_, "zero step after {} of {} micro-batches", micro_,
                micro_batches_);
  finish_gradients();
  const std::vector<GradSlice> slices = grad_slices();
  if (axes_ != nullptr) axes_->sum_shared(slices);  // what the other axes share, summed
  const GradNormParts parts = norm_parts(slices);
  const double norm =
      std::sqrt(axes_ != nullptr ? axes_->norm_sq(parts) : parts.split + parts.replicated);
  if (!std::isfinite(norm)) return norm;
  ++t_;
  float clip = 1.f;
  if (grad_clip > 0 && norm > grad_clip) clip = float(grad_clip / (norm + 1e-6));
  apply_update(h, clip);
  return norm;
}

// Each slice's sum of squares, by one backend call (one wait for the results on a GPU).
std::vector<double> ZeroEngine::segment_sums(std::span<const GradSlice> slices) {
  std::vector<Tensor> grads;
  grads.reserve(slices.size());
  for (const GradSlice& s : slices) grads.push_back(s.grads);
  std::vector<double> sums(grads.size());
  grad_backend().sum_squares_segments(grads, sums);
  return sums;
}

std::vector<GradSlice> ZeroEngine::grad_slices() const {
  const Tensor grads = grad_source();
  std::vector<GradSlice> out;
  out.reserve(segments_.size());
  for (const Segment& s : segments_) out.push_back({s.flat, grads.rows(s.state, s.count)});
  return out;
}

// The squared norm of the gradients this engine's group holds (split tensors and replicated
// ranges apart, as the axes say): every rank's owned part, summed in rank order so that all
// agree exactly.
GradNormParts ZeroEngine::norm_parts(std::span<const GradSlice> slices) {
  GradNormParts local;
  if (axes_ != nullptr) {
    local = axes_->local_parts(slices, grad_backend());
  } else {
    for (double sum : segment_sums(slices)) local.split += sum;
  }
  if (!sharded_state() || world_ == 1) return local;
  double parts[2] = {local.split, local.replicated};
  ordered_sum(dp_, parts);
  return {parts[0], parts[1]};
}

// AdamW on every segment this rank owns (gradients scaled by `clip`), then the parameters made
// whole again.
void ZeroEngine::apply_update(const AdamWHyper& h, float clip) {
  const Tensor grads = grad_source();
  const bool off = opt_.offload_optimizer;
  if (off && !streams_grads()) be_.copy(grads, host_grads_.view(DType::kF32, {state_elems()}));
  const Tensor g_used = off ? host_grads_.view(DType::kF32, {state_elems()}) : grads;
  if (!param_return_.empty()) {
    step_and_return_in_pieces(h, clip, g_used);
  } else {
    std::vector<AdamWSegment> all;  // every owned segment, stepped by one call
    all.reserve(segments_.size());
    for (const Segment& s : segments_) all.push_back(adamw_segment(s, 0, s.count, h, g_used));
    optimizer_backend().adamw_step_segments(all, step_hyper(h, clip));
    if (!master_.empty()) write_params_from_master();
  }
  if (opt_.stage == 3) {
    forget_gathers();  // stale: gather again
  } else if (opt_.stage >= 1 && world_ > 1) {
    gather_params_after_update();
  }
}

AdamWHyper ZeroEngine::step_hyper(const AdamWHyper& h, float clip) const {
  AdamWHyper hh = h;
  hh.step = t_;
  hh.grad_scale = clip;
  return hh;
}

AdamWSegment ZeroEngine::adamw_segment(const Segment& s, int64_t off, int64_t n,
                                       const AdamWHyper& h, const Tensor& grads) const {
  const int64_t at = s.state + off;
  Tensor w;  // [n] f32: the master, or the parameters themselves
  if (!master_.empty())
    w = state(master_).rows(at, n);
  else if (opt_.stage == 3)
    w = param_shard().rows(at, n);
  else
    w = params_padded().rows(s.padded + off, n);
  return {w, grads.rows(at, n), state(m_).rows(at, n), state(v_).rows(at, n),
          s.decay ? h.weight_decay : 0.f};
}

Backend& ZeroEngine::optimizer_backend() { return opt_.offload_optimizer ? host_ : be_; }

Tensor ZeroEngine::device_params(const Segment& s, int64_t off, int64_t n) const {
  return opt_.stage == 3 ? param_shard().rows(s.state + off, n)
                         : params_padded().rows(s.padded + off, n);
}

// Offloaded optimizer, bf16 parameters on the device: the host steps the segments a piece at a
// time, rounds each piece's master into one of the rotating return buffers and starts its copy
// to the device; a buffer is written again only once its last copy has finished. AdamW is
// elementwise, so stepping in pieces is the same arithmetic as stepping whole segments.
void ZeroEngine::step_and_return_in_pieces(const AdamWHyper& h, float clip, const Tensor& grads) {
  const size_t pb = dtype_size(param_dtype_);
  std::vector<uint64_t> fence(param_return_.size(), 0);
  size_t k = 0;
  int64_t used = 0;  // elements of buffer k filled
  for (const Segment& s : segments_) {
    for (int64_t off = 0; off < s.count;) {
      if (used == param_piece_) {  // the next buffer, once its previous piece has left
        k = (k + 1) % param_return_.size();
        be_.host_wait_fence(fence[k]);
        used = 0;
      }
      const int64_t n = std::min(s.count - off, param_piece_ - used);
      const AdamWSegment piece_step = adamw_segment(s, off, n, h, grads);
      optimizer_backend().adamw_step_segments({&piece_step, 1}, step_hyper(h, clip));
      const Tensor piece = param_return_[k].view(param_dtype_, {n}, used * pb);  // [n] host
      host_.convert(state(master_).rows(s.state + off, n), piece);
      fence[k] = be_.copy_async(piece, device_params(s, off, n));
      used += n;
      off += n;
    }
  }
  be_.host_wait_fence(fence[k]);  // the last copy, and every one before it
}

// The master rounded into the parameters: each run of segments that lie end to end in both (a
// bucket's segments, cut only where the unit or the weight decay changes) by one call, so a
// device step converts per bucket rather than per segment.
void ZeroEngine::write_params_from_master() {
  const bool off = opt_.offload_optimizer;
  auto param_offset = [&](const Segment& s) { return opt_.stage == 3 ? s.state : s.padded; };
  for (size_t i = 0, j = 0; i < segments_.size(); i = j) {
    const Segment& s = segments_[i];
    int64_t n = 0;
    for (j = i; j < segments_.size() && segments_[j].state == s.state + n &&
                param_offset(segments_[j]) == param_offset(s) + n;
         ++j)
      n += segments_[j].count;
    const Tensor src = state(master_).rows(s.state, n);
    const Tensor dst = device_params(s, 0, n);
    if (!off)
      be_.convert(src, dst);
    else if (dst.pool() == MemPool::kHost)
      host_.convert(src, dst);
    else
      be_.copy(src, dst);  // f32 parameters, host -> device
  }
}

void ZeroEngine::gather_params_after_update() {
  const Tensor p = params_padded();
  for (const ZeroBucket& bk : z_.buckets) {
    const Tensor all = p.rows(bk.padded_begin, int64_t(world_) * bk.chunk);
    const Tensor mine = p.rows(bk.padded_begin + rank_ * bk.chunk, bk.chunk);
    worker_->submit([this, mine, all] { dp_.all_gather(mine, all); });
  }
  worker_->drain();
}

std::string ZeroEngine::first_nonfinite_unit() {
  finish_gradients();  // idempotent after step()
  const int nu = int(layout_.units.size());
  std::vector<float> bad(nu, 0.f);
  const std::vector<GradSlice> slices = grad_slices();
  const std::vector<double> sums = segment_sums(slices);
  for (size_t i = 0; i < slices.size(); ++i)
    if (!std::isfinite(sums[i]))
      bad[zero_unit_of(layout_, slices[i].flat)] = 1.f;  // a segment never crosses a unit
  if (sharded_state() && world_ > 1)
    dp_.all_reduce(Tensor(bad.data(), DType::kF32, {nu}, MemPool::kHost), ReduceOp::kMax);
  for (int u = 0; u < nu; ++u)
    if (bad[u] > 0) return layout_.unit_name(u);
  return "";
}

void ZeroEngine::forget_gathers() {
  for (auto& g : gathers_) {
    SHARDLM_CHECK(g->holds == 0, "zero: parameters of bucket {} still in use", g->bucket);
    g->bucket = -1;
    g->prefetched = false;
  }
}

}  // namespace shardlm
