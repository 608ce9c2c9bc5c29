// SHARDLM_MPI_CHECK: every MPI call of shardlm goes through it, so a failing call throws
// shardlm::Error with MPI's error string, the call, this process's world rank and file:line.
// Only src/comm/mpi includes this (and <mpi.h>).
#pragma once

#include <mpi.h>

namespace shardlm::mpi {

[[noreturn]] void throw_mpi_error(int code, const char* call, const char* file, int line);

}  // namespace shardlm::mpi

#define SHARDLM_MPI_CHECK(call)                                                    \
  do {                                                                             \
    const int shardlm_mpi_rc_ = (call);                                            \
    if (shardlm_mpi_rc_ != MPI_SUCCESS) [[unlikely]] {                             \
      ::shardlm::mpi::throw_mpi_error(shardlm_mpi_rc_, #call, __FILE__, __LINE__); \
    }                                                                              \
  } while (0)
