// TensorSeam: where a decoder layer meets tensor parallelism. The model calls it at Megatron's
// two conjugate points and nowhere else: entering a column-parallel region (the q/k/v and the
// gate/up projections read the whole normed input; backward sums the ranks' input gradients)
// and leaving a row-parallel one (the o and down projections each give a partial output that
// is summed forward). The vocabulary-parallel embedding and loss (model/vocab_parallel) also
// ask it for the rank's place in the group and for max / sum reductions of small row
// statistics. parallel/tensor implements it over the tp group; the model knows only the seam.
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
};

}  // namespace shardlm
