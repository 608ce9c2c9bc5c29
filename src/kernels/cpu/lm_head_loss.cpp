// Fused LM head + cross-entropy on the CPU, chunked over tokens: logits exist only for one
// chunk at a time, in the caller's workspace [chunk_tokens, V], f32 whatever the dtype of h and
// w (f32 or bf16), and are turned into dlogits in place. The three matmuls go to gemm.h
// (OpenBLAS, its own threads; bf16 operands converted in the GemmScratch); the per-row softmax
// uses OpenMP. dw accumulates once per chunk: a bf16 dw rounds once per chunk, an f32 dw never.
// Must not allocate, and must not touch dh / dw when it throws (targets are validated first).
// Under a final-logit soft cap the logits are capped in place before the softmax and their
// gradient taken through the cap.
#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>

#include "kernels/cpu/ops.h"

namespace shardlm::cpu {

// chunk_tokens, V >= 1 (the Backend entry point checks them)
size_t lm_head_loss_workspace_bytes(int64_t chunk_tokens, int64_t V) {
  return static_cast<size_t>(chunk_tokens) * static_cast<size_t>(V) * sizeof(float);
}

namespace {

// cblas takes int extents and leading dimensions.
void check_blas_extents(const Tensor& h, const Tensor& w) {
  SHARDLM_CHECK(h.dim(0) <= INT_MAX && w.dim(0) <= INT_MAX && h.dim(1) <= INT_MAX,
                "lm_head_loss extents {} x {} exceed the BLAS int range", h.shape().str(),
                w.shape().str());
}

void check_targets(const int32_t* targets, int64_t N, int64_t V) {
  for (int64_t i = 0; i < N; ++i) {
    const int32_t t = targets[i];
    SHARDLM_CHECK_KIND(ErrorKind::kData, t == kIgnoreIndex || (t >= 0 && t < V),
                       "target id {} at token {} is outside the vocabulary [0, {}) and is not "
                       "the ignore index {}; check the tokenizer / data vocab size",
                       t, i, V, kIgnoreIndex);
  }
}

// A row of capped logits c [V] (softcap * tanh(logit / softcap)) with max row_max and
// sum_j exp(c_j - row_max) = sum_exp, in place -> its gradient with respect to the uncapped
// logits: (softmax - onehot(t)) * grad_scale times the cap's slope 1 - (c / softcap)^2.
void capped_row_gradient(float* row, int64_t V, int32_t t, float row_max, double sum_exp,
                         float grad_scale, float softcap) {
  const float p_scale = static_cast<float>(grad_scale / sum_exp);
  for (int64_t j = 0; j < V; ++j) {
    const float tanh_c = row[j] / softcap;
    float g = std::exp(row[j] - row_max) * p_scale;
    if (j == t) g -= grad_scale;
    row[j] = g * (1.0f - tanh_c * tanh_c);
  }
}

// One chunk's logits [rows, V] (targets t_chunk [rows]) turned into the chunk's loss and count,
// added to result, and, when want_grad, into dlogits = (softmax - onehot(target)) * grad_scale
// in place; an ignored row's dlogits are 0. softcap > 0: the softmax of the capped logits, and
// dlogits through the cap.
void softmax_xent_rows(float* logits, const int32_t* t_chunk, int64_t rows, int64_t V,
                       float grad_scale, bool want_grad, float softcap, LossResult& result) {
  double chunk_loss = 0.0;
  int64_t chunk_valid = 0;
#pragma omp parallel for schedule(static) reduction(+ : chunk_loss, chunk_valid)
  for (int64_t r = 0; r < rows; ++r) {
    float* row = logits + r * V;  // [V]
    const int32_t t = t_chunk[r];
    if (t == kIgnoreIndex) {
      if (want_grad) std::fill(row, row + V, 0.0f);
      continue;
    }
    if (softcap > 0.0f)
      for (int64_t j = 0; j < V; ++j) row[j] = softcap * std::tanh(row[j] / softcap);
    float row_max = row[0];
    for (int64_t j = 1; j < V; ++j) row_max = std::max(row_max, row[j]);
    const float target_logit = row[t];
    if (softcap > 0.0f) {  // the capped logits stay in place for the gradient's slope
      double sum_exp = 0.0;
      for (int64_t j = 0; j < V; ++j) sum_exp += std::exp(row[j] - row_max);
      chunk_loss += static_cast<double>(row_max) + std::log(sum_exp) - target_logit;
      ++chunk_valid;
      if (want_grad) capped_row_gradient(row, V, t, row_max, sum_exp, grad_scale, softcap);
      continue;
    }
    // exp(x - max) is in (0, 1]; summing in f64 keeps V ~ 1e5 terms exact enough.
    double sum_exp = 0.0;
    for (int64_t j = 0; j < V; ++j) {
      const float e = std::exp(row[j] - row_max);
      row[j] = e;
      sum_exp += e;
    }
    chunk_loss += static_cast<double>(row_max) + std::log(sum_exp) - target_logit;
    ++chunk_valid;
    if (want_grad) {
      const float p_scale = static_cast<float>(grad_scale / sum_exp);
      for (int64_t j = 0; j < V; ++j) row[j] *= p_scale;
      row[t] -= grad_scale;
    }
  }
  result.loss_sum += chunk_loss;
  result.n_valid += chunk_valid;
}

}  // namespace

// h [N, D]; w [V, D]; targets [N]; dh [N, D] overwritten (or empty); dw [V, D] accumulates (or
// empty); ws [chunk_tokens, V] f32
LossResult lm_head_loss(const Tensor& h, const Tensor& w, const Tensor& targets,
                        int64_t chunk_tokens, float grad_scale, const Tensor& dh, const Tensor& dw,
                        Workspace ws, GemmScratch scratch, float softcap) {
  check_blas_extents(h, w);
  const int64_t N = h.dim(0);
  const int64_t V = w.dim(0);
  SHARDLM_CHECK(reinterpret_cast<uintptr_t>(ws.data) % alignof(float) == 0,
                "lm_head_loss workspace is not aligned for f32");
  const int32_t* target_data = targets.i32();  // [N]
  const bool want_grad = !dh.empty() || !dw.empty();
  check_targets(target_data, N, V);

  LossResult result;
  for (int64_t begin = 0; begin < N; begin += chunk_tokens) {
    const int64_t rows = std::min(chunk_tokens, N - begin);
    const Tensor h_chunk = h.rows(begin, rows);                 // [rows, D]
    const Tensor logits(ws.data, DType::kF32, Shape{rows, V});  // [rows, V], then dlogits
    // logits [rows, V] = h_chunk [rows, D] . w^T [D, V]
    gemm(h_chunk, false, w, true, logits, false, Tensor(), scratch);
    softmax_xent_rows(logits.f32(), target_data + begin, rows, V, grad_scale, want_grad, softcap,
                      result);
    // dh_chunk [rows, D] = dlogits [rows, V] . w [V, D]
    if (!dh.empty()) gemm(logits, false, w, false, dh.rows(begin, rows), false, Tensor(), scratch);
    // dw [V, D] += dlogits^T [V, rows] . h_chunk [rows, D]
    if (!dw.empty()) gemm(logits, true, h_chunk, false, dw, true, Tensor(), scratch);
  }
  return result;
}

}  // namespace shardlm::cpu
