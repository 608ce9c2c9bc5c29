// LlamaModel's side of the preference objectives (llama.h): per-token target log-probabilities
// read from the head's row statistics, and the backward of a per-token weighted negative
// log-likelihood. Both are llama_head.cpp's walks of the pieced loss (one piece when whole; a
// vocabulary slice under tp, its statistics reduced over the tp group): walk 1 (head_row_stats)
// leaves each token's statistics (max, sum of exponentials, the target's logit), read back here
// as log-probabilities; walk 2 (head_grad_walk) with per-token weights turns each piece's
// logits into weight * (softmax - onehot) before the dh and dW GEMMs. A preference loss's
// derivative with respect to one token's log-probability is a per-sequence coefficient, so this
// is its whole gradient through the head.
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

size_t token_weights_host_bytes(const ModelConfig& cfg, const ModelOptions& opt) {
  return opt.token_weights && cfg.holds_head() ? token_weights_bytes(opt) : 0;
}

void LlamaModel::check_token_weights() const {
  SHARDLM_CHECK_KIND(ErrorKind::kConfig, opt_.token_weights,
                     "preference objectives need a model built with token weights "
                     "(ModelOptions::token_weights)");
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
  std::vector<float> host(static_cast<size_t>(stats_at + 2 * N));
  be_.copy(workspace_.view(DType::kF32, {int64_t(host.size())}, sc.at.row_max),
           Tensor(host.data(), DType::kF32, {int64_t(host.size())}, MemPool::kHost));
  const float* row_max = host.data();           // [N]
  const float* stats = host.data() + stats_at;  // [N, 2]
  // log softmax at the target: its (capped) logit - max - log(sum of exp(logit - max))
  for (int64_t i = 0; i < N; ++i)
    logps[i] = stats[2 * i] == 0.f
                   ? 0.0
                   : double(stats[2 * i + 1]) - double(row_max[i]) - std::log(double(stats[2 * i]));
}

void LlamaModel::weighted_head_backward(const StepViews& s) {
  const int64_t N = s.B * s.T;
  const size_t w_at = scratch_of(be_, opt_, cfg_.vocab_rows()).end;
  SHARDLM_CHECK(workspace_.bytes() >= w_at + token_weights_bytes(opt_),
                "the model workspace has {} bytes, the weighted head {}", workspace_.bytes(),
                w_at + token_weights_bytes(opt_));
  const Tensor w_dev = workspace_.view(DType::kF32, {N}, w_at);  // [N]
  // Up on the copy stream, the walk's ops waiting for it on the device: no host wait.
  weights_fence_ = be_.copy_async(weights_host_.view(DType::kF32, {N}), w_dev);
  be_.wait_fence(weights_fence_);
  head_grad_walk(s, 1.f, w_dev);
}

void LlamaModel::forward_target_logps(int64_t B, int64_t T, bool base_only,
                                      std::span<double> logps) {
  (void)logps_forward(B, T, base_only, logps);
}

Tensor LlamaModel::logps_forward(int64_t B, int64_t T, bool base_only, std::span<double> logps) {
  SHARDLM_CHECK(!base_only || lora(), "forward_target_logps: base_only needs LoRA adapters");
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
  if (cfg_.holds_head()) read_target_logps(s, logps);
  return out;
}

void LlamaModel::weighted_head(const StepViews& s, std::span<double> logps,
                               const TokenWeigher& weigh) {
  check_token_weights();
  head_row_stats(s, /*backward_order=*/true);
  read_target_logps(s, logps);
  // The pinned buffer is written again once its last upload has run (already, in practice:
  // the read above waited for the compute that waited for that upload).
  be_.host_wait_fence(weights_fence_);
  const std::span<float> weights(reinterpret_cast<float*>(weights_host_.data()), size_t(s.B * s.T));
  std::fill(weights.begin(), weights.end(), 0.f);
  weigh(logps, weights);
  weighted_head_backward(s);
}

void LlamaModel::forward_backward_weighted(int64_t B, int64_t T, std::span<double> logps,
                                           const TokenWeigher& weigh) {
  check_token_weights();
  const StepViews& s = forward_for_backward(B, T);
  begin_pass(ParamStore::Pass::kBackward);
  weighted_head(s, logps, weigh);
  layers_backward(s, /*embed_held=*/whole_tied_head());
  end_pass();
  dropout_active_ = false;
}

}  // namespace shardlm
