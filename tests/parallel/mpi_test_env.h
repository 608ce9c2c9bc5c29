// The world communicator of a tests/parallel executable, made by mpi_main.cpp before any test
// runs. Tests split or use it; they never initialise MPI themselves. Tests only.
#pragma once

#include "shardlm/comm/communicator.h"

namespace shardlm::test {

Communicator& world();

}  // namespace shardlm::test
