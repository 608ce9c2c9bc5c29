// The world communicator of a tests/parallel executable, made by its main (mpi_main.cpp under
// mpiexec, tcp_main.cpp under its own launcher) before any test runs. Tests split or use it;
// they never initialise a transport themselves. Tests only.
#pragma once

#include <string_view>

#include "shardlm/comm/communicator.h"

namespace shardlm::test {

Communicator& world();
// How the ranks were started and connected: "mpi" (mpiexec) or "tcp" (torchrun-style variables).
std::string_view world_launch();

}  // namespace shardlm::test
