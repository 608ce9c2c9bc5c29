// LlamaModel's side of the preference objectives (llama.h): the head's row statistics handed
// to the caller on the device (or read back as per-token target log-probabilities), and the
// backward of a per-token weighted negative log-likelihood whose weights the caller writes on
// the device. Both are llama_head.cpp's walks of the pieced loss (one piece when whole; a
// vocabulary slice under tp, its statistics reduced over the tp group): walk 1 (head_row_stats)
// leaves each token's statistics (max, sum of exponentials, the target's logit); walk 2
// (head_grad_walk) with per-token weights turns each piece's logits into weight * (softmax -
// onehot) before the dh and dW GEMMs. A preference loss's derivative with respect to one token's
// log-probability is a per-sequence coefficient, so this is its whole gradient through the head.
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

size_t target_logps_host_bytes(const ModelOptions& opt) {
  // slice_loss_scratch's row maxima [N] (their slot aligned), then the statistics [N, 2]
  const size_t N = size_t(opt.max_batch * opt.max_seq);
  return align_up(N * sizeof(float)) + 2 * N * sizeof(float);
}

size_t token_weights_bytes(const ModelOptions& opt) {
  return align_up(size_t(opt.max_batch * opt.max_seq) * sizeof(float));
}

void LlamaModel::check_token_weights() const {
  SHARDLM_CHECK_KIND(ErrorKind::kConfig, opt_.token_weights,
                     "preference objectives need a model built with token weights "
                     "(ModelOptions::token_weights)");
}

HeadRowStats LlamaModel::row_stats(const StepViews& s) const {
  const HeadWalkScratch sc = head_walk_scratch(be_, workspace_, opt_, s.B * s.T,
                                               unit_pieces_[layout_.lm_head_unit][0].rows);
  return {sc.row_max, sc.stats};
}

void LlamaModel::read_target_logps(const StepViews& s, std::span<double> logps) {
  const int64_t N = s.B * s.T;
  SHARDLM_CHECK(int64_t(logps.size()) == N, "logps has {} entries for {} tokens", logps.size(), N);
  const HeadWalkScratch sc =
      head_walk_scratch(be_, workspace_, opt_, N, unit_pieces_[layout_.lm_head_unit][0].rows);
  // The row maxima and the statistics lie one after the other in the workspace
  // (slice_loss_scratch): one copy, one wait on a device. A token without a target has the
  // statistics (0, 0) (the xent_slice ops' contract) and one with a target a sum of at least
  // exp(max - max) = 1, so the targets need no copy of their own.
  const int64_t stats_at = int64_t((sc.at.stats - sc.at.row_max) / sizeof(float));
  const int64_t n = stats_at + 2 * N;
  SHARDLM_CHECK(!logps_host_.empty() && size_t(n) * sizeof(float) <= logps_host_.bytes(),
                "read_target_logps: {} tokens' statistics need {} host bytes, the model holds {} "
                "(a model with token weights and the head has them)",
                N, n * 4, logps_host_.bytes());
  const Tensor host = logps_host_.view(DType::kF32, {n});
  be_.copy(workspace_.view(DType::kF32, {n}, sc.at.row_max), host);
  const float* row_max = host.f32();           // [N]
  const float* stats = host.f32() + stats_at;  // [N, 2]
  // log softmax at the target: its (capped) logit - max - log(sum of exp(logit - max)), as the
  // backend's segment_logp_sums computes it
  for (int64_t i = 0; i < N; ++i)
    logps[i] = stats[2 * i] == 0.f
                   ? 0.0
                   : double(stats[2 * i + 1]) - double(row_max[i]) - std::log(double(stats[2 * i]));
}

void LlamaModel::forward_row_stats(int64_t B, int64_t T, bool base_only, const RowStatsSink& sink) {
  (void)row_stats_forward(B, T, base_only, sink);
}

void LlamaModel::forward_target_logps(int64_t B, int64_t T, bool base_only,
                                      std::span<double> logps) {
  (void)row_stats_forward(B, T, base_only,
                          [&](const HeadRowStats&) { read_target_logps(bind(B, T), logps); });
}

Tensor LlamaModel::row_stats_forward(int64_t B, int64_t T, bool base_only,
                                     const RowStatsSink& sink) {
  SHARDLM_CHECK(!base_only || lora(), "forward_row_stats: base_only needs LoRA adapters");
  check_token_weights();
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
  Tensor out = s.x_final;  // a stage before the last: the hidden state to send
  if (cfg_.holds_head()) {
    out = Tensor();
    final_norm_unit_forward(s);
    head_row_stats(s, /*backward_order=*/false);
  }
  end_pass();
  if (cfg_.holds_head()) sink(row_stats(s));
  return out;
}

void LlamaModel::weighted_head(const StepViews& s, const TokenWeigher& weigh) {
  check_token_weights();
  head_row_stats(s, /*backward_order=*/true);
  const int64_t N = s.B * s.T;
  const size_t w_at = scratch_of(be_, opt_, cfg_.vocab_rows()).end;
  SHARDLM_CHECK(workspace_.bytes() >= w_at + token_weights_bytes(opt_),
                "the model workspace has {} bytes, the weighted head {}", workspace_.bytes(),
                w_at + token_weights_bytes(opt_));
  const Tensor weights = workspace_.view(DType::kF32, {N}, w_at);  // [N]
  weigh(row_stats(s), weights);                                    // device ops: nothing read back
  head_grad_walk(s, 1.f, weights);
}

void LlamaModel::forward_backward_weighted(int64_t B, int64_t T, const TokenWeigher& weigh) {
  check_token_weights();
  const StepViews& s = forward_for_backward(B, T);
  begin_pass(ParamStore::Pass::kBackward);
  weighted_head(s, weigh);
  layers_backward(s, /*embed_held=*/whole_tied_head());
  end_pass();
  dropout_active_ = false;
}

}  // namespace shardlm
