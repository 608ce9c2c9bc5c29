// Fused LM head + cross-entropy on the CPU, chunked over tokens: logits exist only for one
// chunk at a time, in the caller's workspace [chunk_tokens, V], and are turned into dlogits in
// place. The three matmuls go to OpenBLAS (its own threads); the per-row softmax uses OpenMP.
// Must not allocate, and must not touch dh / dw when it throws (targets are validated first).
#include <cblas.h>

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

}  // namespace

LossResult lm_head_loss(const Tensor& h, const Tensor& w, const Tensor& targets,
                        int64_t chunk_tokens, float grad_scale, const Tensor& dh, const Tensor& dw,
                        Workspace ws) {
  check_blas_extents(h, w);
  const int64_t N = h.dim(0);
  const int64_t D = h.dim(1);
  const int64_t V = w.dim(0);
  SHARDLM_CHECK(reinterpret_cast<uintptr_t>(ws.data) % alignof(float) == 0,
                "lm_head_loss workspace is not aligned for f32");

  const float* h_data = h.f32();                      // [N, D]
  const float* w_data = w.f32();                      // [V, D]
  const int32_t* target_data = targets.i32();         // [N]
  float* dh_data = dh.empty() ? nullptr : dh.f32();   // [N, D]
  float* dw_data = dw.empty() ? nullptr : dw.f32();   // [V, D]
  float* logits = reinterpret_cast<float*>(ws.data);  // [chunk_tokens, V], then dlogits
  const bool want_grad = dh_data != nullptr || dw_data != nullptr;
  check_targets(target_data, N, V);

  LossResult result;
  if (N == 0) return result;
  const int n_vocab = static_cast<int>(V);
  const int n_dim = static_cast<int>(D);

  for (int64_t begin = 0; begin < N; begin += chunk_tokens) {
    const int64_t rows = std::min(chunk_tokens, N - begin);
    const float* h_chunk = h_data + begin * D;     // [rows, D]
    const int32_t* t_chunk = target_data + begin;  // [rows]

    // logits [rows, V] = h_chunk [rows, D] . w^T [D, V]
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(rows), n_vocab, n_dim,
                1.0f, h_chunk, n_dim, w_data, n_dim, 0.0f, logits, n_vocab);

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
      float row_max = row[0];
      for (int64_t j = 1; j < V; ++j) row_max = std::max(row_max, row[j]);
      const float target_logit = row[t];
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
        // dlogits = (softmax - onehot(target)) * grad_scale
        const float p_scale = static_cast<float>(grad_scale / sum_exp);
        for (int64_t j = 0; j < V; ++j) row[j] *= p_scale;
        row[t] -= grad_scale;
      }
    }
    result.loss_sum += chunk_loss;
    result.n_valid += chunk_valid;

    if (dh_data != nullptr) {
      // dh_chunk [rows, D] = dlogits [rows, V] . w [V, D]
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<int>(rows), n_dim, n_vocab,
                  1.0f, logits, n_vocab, w_data, n_dim, 0.0f, dh_data + begin * D, n_dim);
    }
    if (dw_data != nullptr) {
      // dw [V, D] += dlogits^T [V, rows] . h_chunk [rows, D]
      cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, n_vocab, n_dim, static_cast<int>(rows),
                  1.0f, logits, n_vocab, h_chunk, n_dim, 1.0f, dw_data, n_dim);
    }
  }
  return result;
}

}  // namespace shardlm::cpu
