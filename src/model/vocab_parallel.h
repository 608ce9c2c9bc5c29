// The vocabulary-parallel embedding and fused LM head + cross-entropy of a tensor-parallel
// shard (Megatron's): tp rank r holds vocabulary rows [r V/tp, (r+1) V/tp) of the embedding
// table and of the LM head; the embedding is summed over the ranks, the loss is computed from
// row statistics reduced over them, and full [N, V] logits never exist. The LlamaModel calls
// these where a whole model calls the backend's embedding and lm_head_loss.
#pragma once

#include <cstdint>

#include "shardlm/backend/backend.h"
#include "shardlm/core/buffer.h"
#include "shardlm/model/config.h"
#include "shardlm/model/tensor_seam.h"

namespace shardlm {

// The rows of the whole vocabulary [0, vocab) this rank holds: [begin, begin + rows).
struct VocabSlice {
  int64_t begin = 0, rows = 0, vocab = 0;
};
VocabSlice vocab_slice(const ModelConfig& shard, const TensorSeam& seam);

// Byte offsets, in a workspace, of the scratch of a loss over slices of the logits (this one's
// vocabulary-parallel loss, llama_head.cpp's head in pieces): one chunk's logits [chunk, rows]
// in the activation dtype, the rows' max [stat_rows] and statistics [stat_rows, 2] f32 (a
// chunk's, or every token's when they outlive the chunk), the walk's loss accumulator [2] f64
// (the finishes add every chunk's loss to it on the device; the walk reads it once) and the
// backend's xent_slice scratch, in that order (the statistics right after the maxima: the
// preference objectives' read takes both in one copy, llama_logps.cpp).
struct SliceLossScratch {
  size_t logits = 0, row_max = 0, stats = 0, loss_acc = 0, backend = 0, end = 0;
};
SliceLossScratch slice_loss_scratch(const Backend& be, int64_t chunk, int64_t rows,
                                    int64_t stat_rows, DType act);

// Scratch of vocab_parallel_loss for chunks of `chunk` rows and of vocab_parallel_last_logits:
// logits [chunk, V/tp] in the activation dtype `act` (the hidden state's), row max [chunk] and
// statistics [chunk, 2] f32, the loss accumulator and the backend's xent_slice scratch; or the
// local [1, V/tp] and whole [1, V] logits of one row, if larger.
size_t vocab_parallel_workspace_bytes(const Backend& backend, const ModelConfig& shard,
                                      int64_t chunk, DType act);

// tokens [N] i32 in [0, V); table [V/tp, D] this rank's rows; partial [N, D]
// (seam.row_output_buffer(out, scratch)) receives this rank's rows' embeddings (zeros
// elsewhere), summed over tp into out, this rank's rows of the residual stream, by the seam's
// row_output: the embedding is a row-parallel region.
void vocab_parallel_embedding_forward(Backend& be, TensorSeam& seam, const ModelConfig& shard,
                                      const Tensor& tokens, const Tensor& table,
                                      const Tensor& partial, const Tensor& out);
// dout [N, D] (the same on every tp rank); dtable [V/tp, D] accumulates the rows it holds.
void vocab_parallel_embedding_backward(Backend& be, TensorSeam& seam, const ModelConfig& shard,
                                       const Tensor& tokens, const Tensor& dout,
                                       const Tensor& dtable);

// The fused LM head + cross-entropy over this rank's vocabulary rows, chunk rows at a time:
// h [N, D] (the same on every tp rank); w [V/tp, D]; targets [N] i32 (kIgnoreIndex = skip).
// Returns the whole model's loss sum and count (the same on every tp rank), read once after the
// last chunk (the chunks' finishes add to a device accumulator). With gradients: dh [N, D]
// overwritten with this rank's share of d(grad_scale * loss)/dh (the head is a
// column-parallel region: the caller sums it with seam.column_input_grad); dw [V/tp, D]
// accumulates (either may be empty). ws: vocab_parallel_workspace_bytes for this chunk.
LossResult vocab_parallel_loss(Backend& be, TensorSeam& seam, const ModelConfig& shard,
                               const Tensor& h, const Tensor& w, const Tensor& targets,
                               int64_t chunk, float grad_scale, const Tensor& dh, const Tensor& dw,
                               const Buffer& ws);

// h_row [1, D]; w [V/tp, D]: returns the whole [1, V] logits of the row (a view into ws),
// gathered over tp.
Tensor vocab_parallel_last_logits(Backend& be, TensorSeam& seam, const ModelConfig& shard,
                                  const Tensor& h_row, const Tensor& w, const Buffer& ws);

}  // namespace shardlm
