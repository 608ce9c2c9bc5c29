// TensorSeam: where a decoder layer meets tensor parallelism. The model calls it at Megatron's
// two conjugate points and nowhere else: entering a column-parallel region (the q/k/v and the
// gate/up projections and the LM head read the whole normed input) and leaving a row-parallel
// one (the o and down projections and the vocabulary-parallel embedding each give a partial
// output that is summed). The seam hands back the view the model computes on, so the model has
// one code path: without sequence parallelism the residual stream is replicated and the points
// are f (identity forward, all-reduce backward) and g (all-reduce forward, identity backward);
// with it the stream is split by rows across the tp group and they become an all-gather and a
// reduce-scatter, the gathered rows living in a scratch tensor the model passes in. The
// vocabulary-parallel embedding and loss (model/vocab_parallel) also ask for the rank's place in
// the group and for max / sum reductions of small row statistics. parallel/tensor implements it
// over the tp group, SingleRankSeam is the model without tensor parallelism.
#pragma once

#include "shardlm/core/tensor.h"

namespace shardlm {

class TensorSeam {
 public:
  virtual ~TensorSeam() = default;

  // Whether the residual stream's N rows are split into tp contiguous blocks of n = N/tp rows,
  // block r on tp rank r (sequence parallelism); otherwise every rank holds all N (n = N).
  virtual bool splits_rows() const = 0;
  // This rank's rows of a tensor [N, ...]: a view, the tensor itself unless splits_rows().
  virtual Tensor local_rows(const Tensor& full) const = 0;

  // Entering a column-parallel region, forward. local [n, D] f32 holds this rank's rows of the
  // region's input; returns the [N, D] input the region's projections read: local itself, or
  // every rank's block gathered into scratch [N, D] in rank order (local may be scratch's own
  // block, local_rows(scratch)).
  virtual Tensor column_input(const Tensor& local, const Tensor& scratch) = 0;
  // Its adjoint. d_full [N, D] f32 holds this rank's share of the gradient of the region's
  // input; returns the gradient of local [n, D]: the sum over the group, in d_full itself, or
  // (rows split) this rank's rows of the sum in scratch's first n rows.
  virtual Tensor column_input_grad(const Tensor& d_full, const Tensor& scratch) = 0;

  // Leaving a row-parallel region: where the region writes its partial output [N, D] f32:
  // local [n, D] itself, or (rows split) scratch [N, D].
  virtual Tensor row_output_buffer(const Tensor& local, const Tensor& scratch) const = 0;
  // Forward: partial (what row_output_buffer returned) holds this rank's partial output;
  // afterwards local holds this rank's rows of the sum over the group.
  virtual void row_output(const Tensor& partial, const Tensor& local) = 0;
  // Its adjoint. d_local [n, D] f32 holds the gradient of this rank's rows of the output;
  // returns the gradient of the partial output [N, D]: d_local itself, or (rows split) every
  // rank's block gathered into scratch.
  virtual Tensor row_output_grad(const Tensor& d_local, const Tensor& scratch) = 0;
  // Whether row_output changes nothing (one rank, rows whole): the region's partial output is
  // then its output, so the residual can be summed by the region's last GEMM; otherwise the
  // sum over the group comes first.
  bool row_output_is_local() const { return tp_size() == 1 && !splits_rows(); }

  // This rank's index in the tp group and the group's size (the vocabulary rows it holds).
  virtual int tp_rank() const = 0;
  virtual int tp_size() const = 0;
  // x [n] f32 (small row statistics of the vocabulary-parallel loss): afterwards the element-wise
  // max / sum over the tp group, on every rank.
  virtual void all_reduce_max(const Tensor& x) = 0;
  virtual void all_reduce_sum(const Tensor& x) = 0;
};

// The seam of a model that is not tensor-parallel: one rank holds every row and every head, so
// each point is the identity and the views are the model's own tensors.
class SingleRankSeam final : public TensorSeam {
 public:
  bool splits_rows() const override { return false; }
  Tensor local_rows(const Tensor& full) const override { return full; }
  Tensor column_input(const Tensor& local, const Tensor&) override { return local; }
  Tensor column_input_grad(const Tensor& d_full, const Tensor&) override { return d_full; }
  Tensor row_output_buffer(const Tensor& local, const Tensor&) const override { return local; }
  void row_output(const Tensor&, const Tensor&) override {}
  Tensor row_output_grad(const Tensor& d_local, const Tensor&) override { return d_local; }
  int tp_rank() const override { return 0; }
  int tp_size() const override { return 1; }
  void all_reduce_max(const Tensor&) override {}
  void all_reduce_sum(const Tensor&) override {}
};

}  // namespace shardlm
