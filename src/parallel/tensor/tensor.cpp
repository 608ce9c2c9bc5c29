// TensorParallel's collectives (parallel/tensor.h): the in-place all-reduce over the tp
// group that both of Megatron's conjugate operators (and the vocabulary-parallel loss's row
// statistics) reduce to, sequence parallelism's all-gather and reduce-scatter of contiguous row
// blocks, with the size-1 fast paths, and the seam's choice between them.
#include "shardlm/parallel/tensor.h"

#include "shardlm/core/check.h"

namespace shardlm {

namespace {

// Checks a (local [n, ...], full [tp * n, ...]) pair of a sequence-parallel collective.
void check_blocks(const char* op, const Tensor& local, const Tensor& full, int tp) {
  SHARDLM_CHECK(local.dtype() == full.dtype() &&
                    (local.dtype() == DType::kF32 || local.dtype() == DType::kBF16),
                "{}: sequence-parallel collectives move f32 or bf16 activations of one dtype, got "
                "{} and {}",
                op, dtype_name(local.dtype()), dtype_name(full.dtype()));
  SHARDLM_CHECK(full.numel() == local.numel() * tp && full.rank() >= 1 && full.dim(0) % tp == 0 &&
                    full.dim(0) / tp == local.dim(0),
                "{}: the full tensor ({} elements, {} rows) must be {} blocks of the local one "
                "({} elements, {} rows)",
                op, full.numel(), full.rank() >= 1 ? full.dim(0) : 0, tp, local.numel(),
                local.rank() >= 1 ? local.dim(0) : 0);
}

}  // namespace

void TensorParallel::all_reduce(const Tensor& t, ReduceOp op) {
  if (tp_.size() == 1) return;  // one rank: the partial sum is the sum
  SHARDLM_CHECK(t.dtype() == DType::kF32 || t.dtype() == DType::kBF16,
                "tensor-parallel reductions are of f32 or bf16 activations, got {}",
                dtype_name(t.dtype()));
  tp_.all_reduce(t, op);
}

// On one rank the communicator's all_gather and reduce_scatter are the copy local -> full
// (or none when local is full); a device transport copies on its device.
void TensorParallel::all_gather(const Tensor& local, const Tensor& full) {
  check_blocks("sequence all-gather", local, full, tp_.size());
  tp_.all_gather(local.view({local.numel()}), full.view({full.numel()}));
}

void TensorParallel::reduce_scatter(const Tensor& full, const Tensor& local) {
  check_blocks("sequence reduce-scatter", local, full, tp_.size());
  tp_.reduce_scatter(full.view({full.numel()}), local.view({local.numel()}), ReduceOp::kSum);
}

Tensor TensorParallel::local_rows(const Tensor& full) const {
  if (!split_rows_) return full;
  const int tp = tp_.size();
  SHARDLM_CHECK(full.rank() >= 1 && full.dim(0) % tp == 0,
                "sequence parallelism: {} rows do not split into {} tp blocks",
                full.rank() >= 1 ? full.dim(0) : 0, tp);
  const int64_t n = full.dim(0) / tp;
  return full.rows(tp_.rank() * n, n);
}

Tensor TensorParallel::column_input(const Tensor& local, const Tensor& scratch) {
  if (!split_rows_) return local;  // f: the identity
  all_gather(local, scratch);
  return scratch;
}

Tensor TensorParallel::column_input_grad(const Tensor& d_full, const Tensor& scratch) {
  if (!split_rows_) {
    all_reduce(d_full);  // f's adjoint
    return d_full;
  }
  const Tensor d_local = scratch.rows(0, d_full.dim(0) / tp_.size());
  reduce_scatter(d_full, d_local);  // the all-gather's adjoint
  return d_local;
}

void TensorParallel::row_output(const Tensor& partial, const Tensor& local) {
  if (!split_rows_) {
    SHARDLM_CHECK(partial.data() == local.data() && partial.numel() == local.numel(),
                  "row_output: without sequence parallelism the partial output is the output "
                  "(row_output_buffer)");
    all_reduce(local);  // g
    return;
  }
  reduce_scatter(partial, local);
}

Tensor TensorParallel::row_output_grad(const Tensor& d_local, const Tensor& scratch) {
  if (!split_rows_) return d_local;  // g's adjoint: the identity
  all_gather(d_local, scratch);      // the reduce-scatter's adjoint
  return scratch;
}

}  // namespace shardlm
