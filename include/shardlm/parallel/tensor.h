// TensorParallel: the model's TensorSeam over a tensor-parallel group (a Communicator of the tp
// ranks, Topology's tp axis). Each collective is defined beside its adjoint: f (identity
// forward) has the all-reduce as its backward, g (all-reduce forward) the identity; on a group
// of one both are no-ops. Reductions are f32 (sums, and the max of the vocabulary-parallel
// loss's row statistics).
#pragma once

#include "shardlm/comm/communicator.h"
#include "shardlm/model/tensor_seam.h"

namespace shardlm {

class TensorParallel final : public TensorSeam {
 public:
  explicit TensorParallel(Communicator& tp) : tp_(tp) {}
  int size() const { return tp_.size(); }
  int rank() const { return tp_.rank(); }
  Communicator& comm() const { return tp_; }

  // f: forward identity (nothing to call); backward all-reduce.
  void column_input_backward(const Tensor& dx) override { all_reduce(dx); }
  // g: forward all-reduce; backward identity (nothing to call).
  void row_output_forward(const Tensor& y) override { all_reduce(y); }

  int tp_rank() const override { return tp_.rank(); }
  int tp_size() const override { return tp_.size(); }
  void all_reduce_max(const Tensor& x) override { all_reduce(x, ReduceOp::kMax); }
  void all_reduce_sum(const Tensor& x) override { all_reduce(x); }

  // Sequence parallelism: the all-gather and its adjoint, the reduce-scatter.
  void sequence_gather_forward(const Tensor& local, const Tensor& full) override {
    all_gather(local, full);
  }
  void sequence_gather_backward(const Tensor& d_full, const Tensor& d_local) override {
    reduce_scatter(d_full, d_local);
  }
  // The reduce-scatter and its adjoint, the all-gather.
  void sequence_scatter_forward(const Tensor& partial_full, const Tensor& local) override {
    reduce_scatter(partial_full, local);
  }
  void sequence_scatter_backward(const Tensor& d_local, const Tensor& d_full) override {
    all_gather(d_local, d_full);
  }
  Tensor sequence_rows(const Tensor& full) const override;

 private:
  void all_reduce(const Tensor& t, ReduceOp op = ReduceOp::kSum);
  void all_gather(const Tensor& local, const Tensor& full);
  void reduce_scatter(const Tensor& full, const Tensor& local);
  Communicator& tp_;
};

}  // namespace shardlm
