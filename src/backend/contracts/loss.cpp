// The contracts of the losses: lm_head_loss (and its workspace query,
// lm_head_loss_workspace_bytes), the vocabulary-parallel xent_slice_max, xent_slice_stats and
// xent_slice_finish, xent_slice_fold, their statistics folded over slices walked in turn, and
// read_loss, the one read of the loss the finishes added up.
// The targets' range is the backend's to check: it reads them.
#include <cmath>

#include "backend/contracts/checks.h"

namespace shardlm {
namespace {

void check_logit_softcap(float softcap, std::string_view op) {
  SHARDLM_CHECK(std::isfinite(softcap) && softcap >= 0.0f,
                "{}: softcap = {} must be 0 (no soft-capping) or a positive finite cap on the "
                "logits",
                op, softcap);
}

using namespace contract;  // NOLINT: the contract helpers are this file's vocabulary

// h [N, D] with D >= 1; w [V, D] of h's dtype; targets [N] i32; dh like h or empty; dw like w or
// empty, f32 or w's dtype
void check_lm_head(const Tensor& h, const Tensor& w, const Tensor& targets, const Tensor& dh,
                   const Tensor& dw) {
  constexpr std::string_view op = "lm_head_loss";
  check_float(h, 2, op, "h");
  check_like(w, h, 2, op, "w", "h");
  SHARDLM_CHECK(h.dim(1) == w.dim(1), "lm_head_loss expects h [N, D] and w [V, D], got {} and {}",
                h.shape().str(), w.shape().str());
  check_tensor(targets, DType::kI32, 1, op, "targets");
  SHARDLM_CHECK(targets.dim(0) == h.dim(0), "lm_head_loss expects targets [{}], got {}", h.dim(0),
                targets.shape().str());
  if (!dh.empty()) {
    check_like(dh, h, 2, op, "dh", "h");
    SHARDLM_CHECK(dh.shape() == h.shape(), "lm_head_loss dh must be empty or {} like h, got {}",
                  h.shape().str(), dh.shape().str());
  }
  if (!dw.empty()) {
    check_float(dw, 2, op, "dw");
    SHARDLM_CHECK(dw.dtype() == DType::kF32 || dw.dtype() == w.dtype(),
                  "{}: dw must be f32 or {}, got {}", op, dtype_name(w.dtype()),
                  dtype_name(dw.dtype()));
    SHARDLM_CHECK(dw.shape() == w.shape(), "lm_head_loss dw must be empty or {} like w, got {}",
                  w.shape().str(), dw.shape().str());
  }
  SHARDLM_CHECK(h.dim(1) >= 1, "lm_head_loss needs D >= 1, got h {}", h.shape().str());
}

// logits [n, Vs] f32 or bf16; row_max [n] f32; targets [n] i32 and stats [n, 2] f32 when given
void check_slice(const Tensor& logits, const Tensor& row_max, const Tensor* targets,
                 const Tensor* stats, std::string_view op) {
  check_float(logits, 2, op, "logits");
  check_tensor(row_max, DType::kF32, 1, op, "row_max");
  const int64_t n = logits.dim(0);
  SHARDLM_CHECK(row_max.dim(0) == n, "{}: row_max must be [{}] like the logits' rows, got {}", op,
                n, row_max.shape().str());
  if (targets != nullptr) {
    check_tensor(*targets, DType::kI32, 1, op, "targets");
    SHARDLM_CHECK(targets->dim(0) == n, "{}: targets must be [{}], got {}", op, n,
                  targets->shape().str());
  }
  if (stats != nullptr) {
    check_tensor(*stats, DType::kF32, 2, op, "stats");
    SHARDLM_CHECK(stats->dim(0) == n && stats->dim(1) == 2, "{}: stats must be [{}, 2], got {}", op,
                  n, stats->shape().str());
  }
}

// logits [n, Vs] hold the ids [vocab_begin, vocab_begin + Vs) of a vocabulary of `vocab`
void check_slice_range(const Tensor& logits, int64_t vocab_begin, int64_t vocab,
                       std::string_view op) {
  SHARDLM_CHECK(vocab_begin >= 0 && vocab_begin + logits.dim(1) <= vocab,
                "{}: the slice [{}, {}) is not inside the vocabulary [0, {})", op, vocab_begin,
                vocab_begin + logits.dim(1), vocab);
}

// loss_acc [2] f64: the (loss sum, count) a walk's finishes add to
void check_loss_accumulator(const Tensor& loss_acc, std::string_view op) {
  check_tensor(loss_acc, DType::kF64, 1, op, "loss_acc");
  SHARDLM_CHECK(loss_acc.dim(0) == 2,
                "{}: loss_acc must be [2] (the loss sum and the count), got {}", op,
                loss_acc.shape().str());
}

}  // namespace

size_t Backend::lm_head_loss_workspace_bytes(int64_t chunk_tokens, int64_t V, DType t) const {
  SHARDLM_CHECK(chunk_tokens >= 1 && V >= 1,
                "lm_head_loss needs chunk_tokens >= 1 and V >= 1, got {} and {}", chunk_tokens, V);
  return do_lm_head_loss_workspace_bytes(chunk_tokens, V, t);
}

LossResult Backend::lm_head_loss(const Tensor& h, const Tensor& w, const Tensor& targets,
                                 int64_t chunk_tokens, float grad_scale, const Tensor& dh,
                                 const Tensor& dw, Workspace ws, float softcap) {
  check_lm_head(h, w, targets, dh, dw);
  check_logit_softcap(softcap, "lm_head_loss");
  check_workspace(ws, lm_head_loss_workspace_bytes(chunk_tokens, w.dim(0), h.dtype()),
                  workspace_threads(), "lm_head_loss", "lm_head_loss_workspace_bytes");
  return do_lm_head_loss(h, w, targets, chunk_tokens, grad_scale, dh, dw, ws, softcap);
}

void Backend::xent_slice_max(const Tensor& logits, const Tensor& row_max, float softcap) {
  check_slice(logits, row_max, nullptr, nullptr, "xent_slice_max");
  check_logit_softcap(softcap, "xent_slice_max");
  do_xent_slice_max(logits, row_max, softcap);
}

void Backend::xent_slice_stats(const Tensor& logits, const Tensor& targets, int64_t vocab_begin,
                               int64_t vocab, const Tensor& row_max, const Tensor& stats,
                               float softcap) {
  constexpr std::string_view op = "xent_slice_stats";
  check_slice(logits, row_max, &targets, &stats, op);
  check_logit_softcap(softcap, op);
  check_slice_range(logits, vocab_begin, vocab, op);
  do_xent_slice_stats(logits, targets, vocab_begin, vocab, row_max, stats, softcap);
}

void Backend::xent_slice_fold(const Tensor& logits, const Tensor& targets, int64_t vocab_begin,
                              int64_t vocab, const Tensor& row_max, const Tensor& stats, bool first,
                              float softcap) {
  constexpr std::string_view op = "xent_slice_fold";
  check_slice(logits, row_max, &targets, &stats, op);
  check_logit_softcap(softcap, op);
  check_slice_range(logits, vocab_begin, vocab, op);
  do_xent_slice_fold(logits, targets, vocab_begin, vocab, row_max, stats, first, softcap);
}

void Backend::xent_slice_finish(const Tensor& logits, const Tensor& targets, int64_t vocab_begin,
                                const Tensor& row_max, const Tensor& stats, float grad_scale,
                                bool want_grad, const Tensor& loss_acc, Workspace ws,
                                float softcap) {
  constexpr std::string_view op = "xent_slice_finish";
  check_slice(logits, row_max, &targets, &stats, op);
  check_logit_softcap(softcap, op);
  if (!loss_acc.empty()) check_loss_accumulator(loss_acc, op);
  check_workspace(ws, xent_slice_workspace_bytes(logits.dim(0)), workspace_threads(), op,
                  "xent_slice_workspace_bytes");
  do_xent_slice_finish(logits, targets, vocab_begin, row_max, stats, grad_scale, want_grad,
                       loss_acc, ws, softcap);
}

LossResult Backend::read_loss(const Tensor& loss_acc) {
  check_loss_accumulator(loss_acc, "read_loss");
  return do_read_loss(loss_acc);
}

}  // namespace shardlm
