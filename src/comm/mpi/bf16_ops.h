// The bf16 reductions of the MPI transport. MPI has no bf16 type (bf16 moves as MPI_UINT16_T),
// so each ReduceOp gets a user-defined commutative MPI_Op over MPI_UINT16_T whose function
// combines two buffers element-wise in f32 and rounds every result to bf16 (nearest even, as
// core/dtype.h's f32_to_bf16), as NCCL's ncclBfloat16 does. MPI calls it wherever its algorithm
// combines two partial results, so a sum over P ranks is rounded P - 1 times, in MPI's order.
// The handles belong to the Session: created after MPI_Init, freed before MPI_Finalize.
#pragma once

#include <mpi.h>

#include <array>

#include "shardlm/comm/communicator.h"

namespace shardlm::mpi {

class Bf16Ops {
 public:
  // MPI_Op_create for every ReduceOp; MPI must be initialised. Frees what it made if one fails.
  void create();
  // MPI_Op_free of each op created; a no-op once freed. Call before MPI_Finalize.
  void free();
  // The op for `op`, for MPI_UINT16_T buffers holding bf16; create() must have run.
  MPI_Op op(ReduceOp op) const;

 private:
  std::array<MPI_Op, 3> ops_{MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL};  // by ReduceOp
};

}  // namespace shardlm::mpi
