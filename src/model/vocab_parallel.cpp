// The vocabulary-parallel embedding and fused loss (model/vocab_parallel.h). The loss per chunk:
// local logits = h W_shard^T [n, V/tp]; row max, all-reduced (max) over tp; the sum of
// exp(logit - max) and the target's logit (its owner only, else 0), all-reduced (sum); loss and
// dlogits = grad_scale (softmax - onehot) on the local slice; dW_shard += dlogits^T h and
// dh partial = dlogits W_shard, summed over tp by the caller (the column-parallel input adjoint).
#include "vocab_parallel.h"

#include <algorithm>

#include "shardlm/core/check.h"

namespace shardlm {

SliceLossScratch slice_loss_scratch(const Backend& be, int64_t chunk, int64_t rows,
                                    int64_t stat_rows, DType act) {
  SliceLossScratch s;
  s.row_max = align_up(size_t(chunk) * size_t(rows) * dtype_size(act));
  s.stats = s.row_max + align_up(size_t(stat_rows) * sizeof(float));
  s.loss_acc = s.stats + align_up(size_t(stat_rows) * 2 * sizeof(float));
  s.backend = s.loss_acc + align_up(2 * sizeof(double));
  s.end = s.backend + align_up(be.xent_slice_workspace_bytes(chunk));
  return s;
}

VocabSlice vocab_slice(const ModelConfig& shard, const TensorSeam& seam) {
  SHARDLM_CHECK(seam.tp_size() == shard.tp_shards,
                "the tp group has {} ranks but the model is a shard of {}", seam.tp_size(),
                shard.tp_shards);
  const int64_t rows = shard.vocab_rows();
  return {seam.tp_rank() * rows, rows, shard.vocab_size};
}

size_t vocab_parallel_workspace_bytes(const Backend& backend, const ModelConfig& shard,
                                      int64_t chunk, DType act) {
  const size_t loss = slice_loss_scratch(backend, chunk, shard.vocab_rows(), chunk, act).end;
  const size_t logits = align_up(size_t(shard.vocab_rows()) * dtype_size(act)) +
                        align_up(size_t(shard.vocab_size) * dtype_size(act));
  return std::max(loss, logits);
}

void vocab_parallel_embedding_forward(Backend& be, TensorSeam& seam, const ModelConfig& shard,
                                      const Tensor& tokens, const Tensor& table,
                                      const Tensor& partial, const Tensor& out) {
  const VocabSlice v = vocab_slice(shard, seam);
  be.embedding_forward_slice(tokens, table, v.begin, v.vocab, partial);
  seam.row_output(partial, out);
}

void vocab_parallel_embedding_backward(Backend& be, TensorSeam& seam, const ModelConfig& shard,
                                       const Tensor& tokens, const Tensor& dout,
                                       const Tensor& dtable) {
  const VocabSlice v = vocab_slice(shard, seam);
  be.embedding_backward_slice(tokens, dout, v.begin, v.vocab, dtable);
}

LossResult vocab_parallel_loss(Backend& be, TensorSeam& seam, const ModelConfig& shard,
                               const Tensor& h, const Tensor& w, const Tensor& targets,
                               int64_t chunk, float grad_scale, const Tensor& dh, const Tensor& dw,
                               const Buffer& ws) {
  const VocabSlice v = vocab_slice(shard, seam);
  const int64_t N = h.dim(0), D = h.dim(1);
  SHARDLM_CHECK(w.rank() == 2 && w.dim(0) == v.rows && w.dim(1) == D,
                "vocab_parallel_loss expects w [{}, {}] (this rank's vocabulary rows), got {}",
                v.rows, D, w.shape().str());
  SHARDLM_CHECK(chunk >= 1, "vocab_parallel_loss needs chunk >= 1, got {}", chunk);
  const SliceLossScratch sc = slice_loss_scratch(be, chunk, v.rows, chunk, h.dtype());
  SHARDLM_CHECK(ws.bytes() >= sc.end,
                "the model workspace has {} bytes, the vocabulary-parallel loss needs {}; size it "
                "with vocab_parallel_workspace_bytes",
                ws.bytes(), sc.end);
  const bool want_grad = !dh.empty() || !dw.empty();
  const float cap = float(shard.final_softcap);  // every slice op caps the logits it reads
  if (N == 0) return {};
  const Tensor loss_acc = ws.view(DType::kF64, {2}, sc.loss_acc);  // [2] the chunks' sum, count
  be.zero(loss_acc);
  for (int64_t r0 = 0; r0 < N; r0 += chunk) {
    const int64_t n = std::min(chunk, N - r0);
    const Tensor h_c = h.rows(r0, n), t_c = targets.rows(r0, n);       // [n, D], [n]
    const Tensor logits = ws.view(h.dtype(), {n, v.rows}, sc.logits);  // [n, V/tp] h's dtype
    const Tensor row_max = ws.view(DType::kF32, {n}, sc.row_max);      // [n]
    const Tensor stats = ws.view(DType::kF32, {n, 2}, sc.stats);       // [n, 2]
    be.linear_forward(h_c, w, Tensor(), logits);
    be.xent_slice_max(logits, row_max, cap);
    seam.all_reduce_max(row_max);
    be.xent_slice_stats(logits, t_c, v.begin, v.vocab, row_max, stats, cap);
    seam.all_reduce_sum(stats);
    be.xent_slice_finish(logits, t_c, v.begin, row_max, stats, grad_scale, want_grad, loss_acc,
                         {ws.data() + sc.backend, ws.bytes() - sc.backend}, cap);
    // dh_c [n, D] = dlogits [n, V/tp] W_shard [V/tp, D] (partial); dW_shard += dlogits^T h_c
    if (want_grad)
      be.linear_backward(h_c, w, logits, dh.empty() ? Tensor() : dh.rows(r0, n), dw, Tensor());
  }
  return be.read_loss(loss_acc);  // the one wait of the walk
}

Tensor vocab_parallel_last_logits(Backend& be, TensorSeam& seam, const ModelConfig& shard,
                                  const Tensor& h_row, const Tensor& w, const Buffer& ws) {
  const VocabSlice v = vocab_slice(shard, seam);
  const DType dt = h_row.dtype();
  const size_t local_bytes = align_up(size_t(v.rows) * dtype_size(dt));
  SHARDLM_CHECK(ws.bytes() >= local_bytes + size_t(v.vocab) * dtype_size(dt),
                "the model workspace is too small for the logits");
  const Tensor local = ws.view(dt, {1, v.rows});               // [1, V/tp]
  const Tensor full = ws.view(dt, {1, v.vocab}, local_bytes);  // [1, V]
  be.linear_forward(h_row, w, Tensor(), local);
  be.zero(full);
  be.copy(local, ws.view(dt, {1, v.rows}, local_bytes + v.begin * dtype_size(dt)));
  seam.all_reduce_sum(full);  // the other ranks' slices are zeros here: the sum is the gather
  return full;
}

}  // namespace shardlm
