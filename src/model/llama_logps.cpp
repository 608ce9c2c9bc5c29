// LlamaModel's side of the preference objectives (llama.h): per-token target log-probabilities
// read from the head's row statistics, and the backward of a per-token weighted negative
// log-likelihood. Both walk the head's table in the pieces its store hands out (one piece when
// whole), as llama_head.cpp's pieced loss does: walk 1 folds each token's statistics (running
// max, sum of exponentials, the target's logit); walk 2 recomputes each piece's logits, turns
// them into softmax - onehot, scales each token's row by its weight (scale_rows) and runs the
// dh and dW GEMMs. A preference loss's derivative with respect to one token's log-probability
// is a per-sequence coefficient, so this is its whole gradient through the head.
#include <algorithm>
#include <cmath>

#include "llama_views.h"
#include "vocab_parallel.h"

namespace shardlm {
namespace {

// The pieced loss's scratch at the options' largest micro-batch, then the weights.
SliceLossScratch scratch_of(const Backend& be, const ModelOptions& opt, int64_t rows) {
  const int64_t N = opt.max_batch * opt.max_seq;
  return slice_loss_scratch(be, std::min<int64_t>(opt.loss_chunk_tokens, N), rows, N,
                            opt.activation_dtype);
}

}  // namespace

size_t token_weights_bytes(const ModelOptions& opt) {
  return align_up(size_t(opt.max_batch * opt.max_seq) * sizeof(float));
}

void LlamaModel::head_row_stats(const StepViews& s, bool backward_order) {
  SHARDLM_CHECK_KIND(ErrorKind::kConfig, cfg_.tp_shards == 1 && opt_.token_weights,
                     "preference objectives need a model built with token weights and the whole "
                     "vocabulary on one rank (no tensor parallelism)");
  const int lm = layout_.lm_head_unit;
  const std::vector<UnitPiece>& pieces = unit_pieces_[lm];
  const int P = int(pieces.size());
  const int64_t N = s.B * s.T, D = cfg_.dim, V = cfg_.vocab_rows();
  const int64_t chunk = std::min<int64_t>(opt_.loss_chunk_tokens, N);
  const DType act = opt_.activation_dtype;
  const SliceLossScratch sc = slice_loss_scratch(be_, chunk, pieces[0].rows, N, act);
  const Tensor row_max = workspace_.view(DType::kF32, {N}, sc.row_max);  // [N]
  const Tensor stats = workspace_.view(DType::kF32, {N, 2}, sc.stats);   // [N, 2]
  for (int i = 0; i < P; ++i) {
    const int k = backward_order ? P - 1 - i : i;
    const UnitPiece& p = pieces[k];
    acquire_piece(lm, k);
    const Tensor w = weight(lm, layout_.lm_head + p.row_begin * D, {p.rows, D});
    for (int64_t r0 = 0; r0 < N; r0 += chunk) {
      const int64_t n = std::min(chunk, N - r0);
      const Tensor logits = workspace_.view(act, {n, p.rows}, sc.logits);  // [n, rows] = h W_p^T
      be_.linear_forward(s.xn_final.rows(r0, n), w, Tensor(), logits);
      be_.xent_slice_fold(logits, s.in.targets.rows(r0, n), p.row_begin, V, row_max.rows(r0, n),
                          stats.rows(r0, n), i == 0, float(cfg_.final_softcap));
    }
    release_piece(lm, k);
  }
}

void LlamaModel::read_target_logps(const StepViews& s, std::span<double> logps) {
  const int64_t N = s.B * s.T;
  SHARDLM_CHECK(int64_t(logps.size()) == N, "logps has {} entries for {} tokens", logps.size(), N);
  const SliceLossScratch sc =
      slice_loss_scratch(be_, std::min<int64_t>(opt_.loss_chunk_tokens, N),
                         unit_pieces_[layout_.lm_head_unit][0].rows, N, opt_.activation_dtype);
  std::vector<float> row_max(static_cast<size_t>(N)), stats(static_cast<size_t>(2 * N));
  std::vector<int32_t> targets(static_cast<size_t>(N));
  be_.copy(workspace_.view(DType::kF32, {N}, sc.row_max),
           Tensor(row_max.data(), DType::kF32, {N}, MemPool::kHost));
  be_.copy(workspace_.view(DType::kF32, {N, 2}, sc.stats),
           Tensor(stats.data(), DType::kF32, {N, 2}, MemPool::kHost));
  be_.copy(s.in.targets, Tensor(targets.data(), DType::kI32, {N}, MemPool::kHost));
  // log softmax at the target: its (capped) logit - max - log(sum of exp(logit - max))
  for (int64_t i = 0; i < N; ++i)
    logps[i] = targets[i] == kIgnoreIndex
                   ? 0.0
                   : double(stats[2 * i + 1]) - double(row_max[i]) - std::log(double(stats[2 * i]));
}

void LlamaModel::weighted_head_backward(const StepViews& s, std::span<const float> weights) {
  const int lm = layout_.lm_head_unit, h = layout_.head_unit;
  const std::vector<UnitPiece>& pieces = unit_pieces_[lm];
  const int P = int(pieces.size());
  const int64_t N = s.B * s.T, D = cfg_.dim;
  const int64_t chunk = std::min<int64_t>(opt_.loss_chunk_tokens, N);
  const DType act = opt_.activation_dtype;
  const SliceLossScratch sc = slice_loss_scratch(be_, chunk, pieces[0].rows, N, act);
  const size_t w_at = scratch_of(be_, opt_, cfg_.vocab_rows()).end;
  SHARDLM_CHECK(workspace_.bytes() >= w_at + token_weights_bytes(opt_),
                "the model workspace has {} bytes, the weighted head {}", workspace_.bytes(),
                w_at + token_weights_bytes(opt_));
  const Tensor w_dev = workspace_.view(DType::kF32, {N}, w_at);  // [N]
  be_.copy(Tensor(const_cast<float*>(weights.data()), DType::kF32, {N}, MemPool::kHost), w_dev);
  const Tensor row_max = workspace_.view(DType::kF32, {N}, sc.row_max);
  const Tensor stats = workspace_.view(DType::kF32, {N, 2}, sc.stats);
  const Workspace xent{workspace_.data() + sc.backend, workspace_.bytes() - sc.backend};
  const float cap = float(cfg_.final_softcap);
  for (int k = P - 1; k >= 0; --k) {
    const UnitPiece& p = pieces[k];
    acquire_piece(lm, k);
    acquire_piece_grads(lm, k);
    const Tensor w = weight(lm, layout_.lm_head + p.row_begin * D, {p.rows, D});
    const Tensor dw = grad(lm, layout_.lm_head + p.row_begin * D, {p.rows, D});
    for (int64_t r0 = 0; r0 < N; r0 += chunk) {
      const int64_t n = std::min(chunk, N - r0);
      const Tensor logits = workspace_.view(act, {n, p.rows}, sc.logits);  // [n, rows]
      be_.linear_forward(s.xn_final.rows(r0, n), w, Tensor(), logits);
      // dlogits = weights[t] * (softmax - onehot(target)) on each token's row
      be_.xent_slice_finish(logits, s.in.targets.rows(r0, n), p.row_begin, row_max.rows(r0, n),
                            stats.rows(r0, n), 1.f, /*want_grad=*/true, xent, cap);
      be_.scale_rows(logits, w_dev.rows(r0, n));
      be_.linear_backward(s.xn_final.rows(r0, n), w, logits, s.tr.d_norm.rows(r0, n), dw, Tensor(),
                          k == P - 1 ? OutputMode::kOverwrite : OutputMode::kAccumulate);
    }
    if (k == 0 && lm == h) final_norm_backward(s);
    release_piece_grads(lm, k);
    release_piece(lm, k);
  }
  if (lm != h) {
    acquire(h);
    acquire_grads(h);
    final_norm_backward(s);
    release_grads(h);
    release(h);
  }
}

void LlamaModel::forward_target_logps(int64_t B, int64_t T, bool base_only,
                                      std::span<double> logps) {
  SHARDLM_CHECK(!base_only || lora(), "forward_target_logps: base_only needs LoRA adapters");
  begin_pass(ParamStore::Pass::kForward);
  adapters_off_ = base_only;
  try {
    forward_layers(B, T, /*for_backward=*/false);
  } catch (...) {
    adapters_off_ = false;
    throw;
  }
  adapters_off_ = false;
  const StepViews& s = bind(B, T);
  final_norm_unit_forward(s);
  head_row_stats(s, /*backward_order=*/false);
  end_pass();
  read_target_logps(s, logps);
}

void LlamaModel::forward_backward_weighted(int64_t B, int64_t T, std::span<double> logps,
                                           const TokenWeigher& weigh) {
  SHARDLM_CHECK(opt_.backward, "this model runs forward only (ModelOptions::backward = false)");
  dropout_active_ = lora() && opt_.lora.dropout > 0;
  begin_pass(ParamStore::Pass::kForward);
  forward_layers(B, T, /*for_backward=*/true);
  const StepViews& s = bind(B, T);
  final_norm_unit_forward(s);
  end_pass();

  begin_pass(ParamStore::Pass::kBackward);
  head_row_stats(s, /*backward_order=*/true);
  read_target_logps(s, logps);
  std::vector<float> weights(size_t(B * T), 0.f);
  weigh(logps, weights);
  weighted_head_backward(s, weights);
  layers_backward(s, /*embed_held=*/false);  // a tied head's gradients were released by piece
  end_pass();
  dropout_active_ = false;
}

}  // namespace shardlm
