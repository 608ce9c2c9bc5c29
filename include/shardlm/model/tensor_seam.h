// TensorSeam: where a decoder layer meets tensor parallelism. The model calls it at Megatron's
// two conjugate points and nowhere else: entering a column-parallel region (the q/k/v and the
// gate/up projections read the whole normed input; backward sums the ranks' input gradients)
// and leaving a row-parallel one (the o and down projections each give a partial output that
// is summed forward). With sequence parallelism the residual stream between those regions is
// split by rows across the tp group instead of replicated, and the two points become an
// all-gather (entering) and a reduce-scatter (leaving). The vocabulary-parallel embedding and
// loss (model/vocab_parallel) also ask it for the rank's place in the group and for max / sum
// reductions of small row statistics. parallel/tensor implements it over the tp group; the
// model knows only the seam.
#pragma once

#include "shardlm/core/tensor.h"

namespace shardlm {

class TensorSeam {
 public:
  virtual ~TensorSeam() = default;

  // f, backward (its forward is the identity): dx [n, D] f32 holds this rank's share of the
  // gradient of a column-parallel region's input; afterwards, the sum over the tp group.
  virtual void column_input_backward(const Tensor& dx) = 0;
  // g, forward (its backward is the identity): y [n, D] f32 holds this rank's partial output of
  // a row-parallel projection; afterwards, the sum over the tp group.
  virtual void row_output_forward(const Tensor& y) = 0;

  // This rank's index in the tp group and the group's size (the vocabulary rows it holds).
  virtual int tp_rank() const = 0;
  virtual int tp_size() const = 0;
  // x [n] f32 (small row statistics of the vocabulary-parallel loss): afterwards the element-wise
  // max / sum over the tp group, on every rank.
  virtual void all_reduce_max(const Tensor& x) = 0;
  virtual void all_reduce_sum(const Tensor& x) = 0;

  // Sequence parallelism: the N rows of the residual stream are split into tp contiguous
  // blocks of N/tp rows, block r on tp rank r. All tensors f32; `local` is [N/tp, ...] and
  // `full` [N, ...] of the same row width.
  // Entering a column-parallel region, forward: all-gather. local holds this rank's block;
  // afterwards full holds every rank's block in rank order (local may be full's own block).
  virtual void sequence_gather_forward(const Tensor& local, const Tensor& full) = 0;
  // Its adjoint, a reduce-scatter: d_full holds this rank's share of the gradient of full;
  // afterwards d_local = the sum over the tp group of their d_full's rows of this rank's block.
  virtual void sequence_gather_backward(const Tensor& d_full, const Tensor& d_local) = 0;
  // Leaving a row-parallel region, forward: reduce-scatter. partial_full holds this rank's
  // partial output; afterwards local = this rank's block of the sum over the tp group.
  virtual void sequence_scatter_forward(const Tensor& partial_full, const Tensor& local) = 0;
  // Its adjoint, an all-gather of the blocks' gradients.
  virtual void sequence_scatter_backward(const Tensor& d_local, const Tensor& d_full) = 0;
  // This rank's block of rows of a tensor [N, ...] (a view, no copy): where the rank writes its
  // own block before an in-place all-gather (the final norm's output for the LM head).
  virtual Tensor sequence_rows(const Tensor& full) const = 0;
};

}  // namespace shardlm
