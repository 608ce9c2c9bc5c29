// TensorParallel's collectives (parallel/tensor.h): the in-place f32 all-reduce over the tp
// group that both of Megatron's conjugate operators (and the vocabulary-parallel loss's row
// statistics) reduce to, with the size-1 fast path.
#include "shardlm/parallel/tensor.h"

#include "shardlm/core/check.h"

namespace shardlm {

void TensorParallel::all_reduce(const Tensor& t, ReduceOp op) {
  if (tp_.size() == 1) return;  // one rank: the partial sum is the sum
  SHARDLM_CHECK(t.dtype() == DType::kF32, "tensor-parallel reductions are f32, got {}",
                dtype_name(t.dtype()));
  tp_.all_reduce(t, op);
}

}  // namespace shardlm
