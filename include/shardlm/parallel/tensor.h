// TensorParallel: the model's TensorSeam over a tensor-parallel group (a Communicator of the tp
// ranks, Topology's tp axis). Each collective is defined beside its adjoint. Replicated rows:
// f (identity forward) has the all-reduce as its backward, g (all-reduce forward) the identity.
// Rows split (sequence parallelism): entering a column-parallel region all-gathers the rows
// (backward: reduce-scatter), leaving a row-parallel one reduce-scatters the partial outputs
// (backward: all-gather). On a group of one the reductions are no-ops and the gathers copies.
// Reductions are f32 (sums, and the max of the vocabulary-parallel loss's row statistics).
#pragma once

#include "shardlm/comm/communicator.h"
#include "shardlm/model/tensor_seam.h"

namespace shardlm {

class TensorParallel final : public TensorSeam {
 public:
  // split_rows: sequence parallelism (the shard's ModelConfig::sequence_parallel).
  TensorParallel(Communicator& tp, bool split_rows) : tp_(tp), split_rows_(split_rows) {}
  int size() const { return tp_.size(); }
  int rank() const { return tp_.rank(); }
  Communicator& comm() const { return tp_; }

  bool splits_rows() const override { return split_rows_; }
  Tensor local_rows(const Tensor& full) const override;
  Tensor column_input(const Tensor& local, const Tensor& scratch) override;
  Tensor column_input_grad(const Tensor& d_full, const Tensor& scratch) override;
  Tensor row_output_buffer(const Tensor& local, const Tensor& scratch) const override {
    return split_rows_ ? scratch : local;
  }
  void row_output(const Tensor& partial, const Tensor& local) override;
  Tensor row_output_grad(const Tensor& d_local, const Tensor& scratch) override;

  int tp_rank() const override { return tp_.rank(); }
  int tp_size() const override { return tp_.size(); }
  void all_reduce_max(const Tensor& x) override { all_reduce(x, ReduceOp::kMax); }
  void all_reduce_sum(const Tensor& x) override { all_reduce(x); }

 private:
  void all_reduce(const Tensor& t, ReduceOp op = ReduceOp::kSum);
  void all_gather(const Tensor& local, const Tensor& full);
  void reduce_scatter(const Tensor& full, const Tensor& local);
  Communicator& tp_;
  bool split_rows_;
};

}  // namespace shardlm
