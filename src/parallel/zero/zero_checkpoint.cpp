// The ZeRO engine's checkpoint state (zero.h): parameters, Adam moments and f32 master
// weights, saved as this rank's share of the whole flat vectors in arena order (no
// communication) and loaded into whatever this rank holds, through the engine's host staging
// buffer.
#include <vector>

#include "shardlm/core/check.h"
#include "zero_parts.h"

namespace shardlm {

ZeroEngine::StateBuffer ZeroEngine::state_buffer(State s) const {
  SHARDLM_CHECK(s != State::kMaster || has_master(), "no master weights with f32 parameters");
  switch (s) {
    case State::kParams:
      return {&params_, param_dtype_, opt_.stage <= 2};
    case State::kAdamM:
      return {&m_, DType::kF32, !sharded_state()};
    case State::kAdamV:
      return {&v_, DType::kF32, !sharded_state()};
    case State::kMaster:
      break;
  }
  return {&master_, DType::kF32, !sharded_state()};
}

void ZeroEngine::save_owned(State s,
                            const std::function<void(int64_t, int64_t, const void*)>& sink) {
  worker_->drain();
  const StateBuffer sb = state_buffer(s);
  const DType dt = sb.dtype;
  const size_t eb = dtype_size(dt);
  const int64_t stage = int64_t(ckpt_stage_.bytes() / 4);
  for (const ZeroBucket& bk : z_.buckets) {
    const int64_t first = rank_ * bk.chunk;  // chunk r of the bucket: [first, first + count)
    const int64_t count = std::min(bk.chunk, bk.size() - first);
    const int64_t at = sb.replicated ? bk.padded_begin + first : bk.shard_begin;
    for (int64_t done = 0; done < count; done += stage) {
      const int64_t n = std::min(stage, count - done);  // x [n] of the state, via the host
      be_.copy(sb.buf->view(dt, {n}, size_t(at + done) * eb), ckpt_stage_.view(dt, {n}));
      sink(bk.begin + first + done, n, ckpt_stage_.data());
    }
  }
}

void ZeroEngine::load(State s, const std::function<void(int64_t, int64_t, void*)>& source) {
  worker_->drain();
  const StateBuffer sb = state_buffer(s);
  const Buffer& dst = *sb.buf;
  const DType dt = sb.dtype;
  const size_t eb = dtype_size(dt);
  const bool replicated = sb.replicated;
  const bool is_params = s == State::kParams;
  const int64_t stage = int64_t(ckpt_stage_.bytes() / 4);
  for (const ZeroBucket& bk : z_.buckets) {
    int64_t first = 0, count = bk.size(), at = bk.padded_begin;
    if (!replicated) {
      first = rank_ * bk.chunk;
      count = std::min(bk.chunk, bk.size() - first);
      at = bk.shard_begin;
    }
    for (int64_t done = 0; done < count; done += stage) {
      const int64_t n = std::min(stage, count - done);  // x [n] of the state, via the host
      source(bk.begin + first + done, n, ckpt_stage_.data());
      be_.copy(ckpt_stage_.view(dt, {n}), dst.view(dt, {n}, size_t(at + done) * eb));
    }
  }
  if (is_params && !master_.empty() && !has_master()) {
    // f32 parameters with the optimizer offloaded: the host master is a copy of them.
    for (const Segment& sg : segments_) {
      const Tensor p = opt_.stage == 3 ? param_shard().rows(sg.state, sg.count)
                                       : params_padded().rows(sg.padded, sg.count);
      be_.copy(p, state(master_).rows(sg.state, sg.count));
    }
  }
  forget_gathers();
}

}  // namespace shardlm
