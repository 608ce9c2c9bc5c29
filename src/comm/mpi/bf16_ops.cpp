// The user-defined MPI_Ops that reduce bf16 buffers (see bf16_ops.h): element-wise, f32
// arithmetic, one rounding to bf16 per pairwise combination. Max and min are fmaxf and fminf
// (a NaN loses to a number), as NCCL's bf16 max and min are.
#include "comm/mpi/bf16_ops.h"

#include <cmath>
#include <cstdint>

#include "comm/mpi/mpi_check.h"

namespace shardlm::mpi {

namespace {

// inout[i] = combine(in[i], inout[i]) for the len elements MPI hands over (a whole buffer or a
// segment of one). The op is commutative, so MPI may pass either partial result as `in`.
template <typename Combine>
void combine_bf16(const void* in, void* inout, const int* len, Combine combine) {
  const auto* a = static_cast<const uint16_t*>(in);
  auto* b = static_cast<uint16_t*>(inout);
  const int n = *len;
  for (int i = 0; i < n; ++i) b[i] = f32_to_bf16(combine(bf16_to_f32(a[i]), bf16_to_f32(b[i])));
}

void sum_bf16(void* in, void* inout, int* len, MPI_Datatype* /*uint16*/) {
  combine_bf16(in, inout, len, [](float a, float b) { return a + b; });
}

void max_bf16(void* in, void* inout, int* len, MPI_Datatype* /*uint16*/) {
  combine_bf16(in, inout, len, [](float a, float b) { return std::fmax(a, b); });
}

void min_bf16(void* in, void* inout, int* len, MPI_Datatype* /*uint16*/) {
  combine_bf16(in, inout, len, [](float a, float b) { return std::fmin(a, b); });
}

size_t index_of(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return 0;
    case ReduceOp::kMax:
      return 1;
    case ReduceOp::kMin:
      return 2;
  }
  SHARDLM_FAIL(ErrorKind::kInternal, "bf16 reduction: unknown ReduceOp {}", static_cast<int>(op));
}

}  // namespace

void Bf16Ops::create() {
  try {
    constexpr int kCommutative = 1;
    SHARDLM_MPI_CHECK(MPI_Op_create(sum_bf16, kCommutative, &ops_[index_of(ReduceOp::kSum)]));
    SHARDLM_MPI_CHECK(MPI_Op_create(max_bf16, kCommutative, &ops_[index_of(ReduceOp::kMax)]));
    SHARDLM_MPI_CHECK(MPI_Op_create(min_bf16, kCommutative, &ops_[index_of(ReduceOp::kMin)]));
  } catch (...) {
    free();
    throw;
  }
}

void Bf16Ops::free() {
  for (MPI_Op& op : ops_) {
    if (op != MPI_OP_NULL) MPI_Op_free(&op);  // sets op to MPI_OP_NULL
  }
}

MPI_Op Bf16Ops::op(ReduceOp op) const {
  const MPI_Op handle = ops_[index_of(op)];
  SHARDLM_CHECK(handle != MPI_OP_NULL, "bf16 {}: the MPI session has no bf16 reduction ops",
                reduce_op_name(op));
  return handle;
}

}  // namespace shardlm::mpi
