// The failure modes of the communicator failure tests (comm_failure_main.cpp over MPI,
// tcp_failure_main.cpp over TCP): after a barrier, rank 1 fails in the way `mode` names while
// the other ranks wait in all_reduces of t. "throw": rank 1 throws and calls abort_world;
// "sigkill": it dies by SIGKILL with an all_reduce in flight; "hang": it never arrives; "exit":
// it returns 3 without abort_world; "mismatch": it waits in a recv nobody sends. Returns the
// rank's exit code when it returns at all (0 would mean the failure went unnoticed).
#pragma once

#include <chrono>
#include <csignal>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <thread>

#include "shardlm/comm/communicator.h"

namespace shardlm::test {

inline bool is_failure_mode(const std::string& mode) {
  return mode == "throw" || mode == "sigkill" || mode == "hang" || mode == "exit" ||
         mode == "mismatch";
}

inline int fail_on_rank_1(Communicator& world, const std::string& mode, const Tensor& t) {
  world.barrier();  // every rank holds the communicator the failure is judged on
  try {
    if (world.rank() == 1) {
      if (mode == "exit") return 3;  // no abort_world
      if (mode == "throw") throw std::runtime_error("injected failure on rank 1");
      if (mode == "sigkill") {
        auto in_flight = world.all_reduce_async(t);
        in_flight->test();
        std::raise(SIGKILL);
      }
      if (mode == "hang") std::this_thread::sleep_for(std::chrono::seconds(120));
      if (mode == "mismatch") {
        float one = 0;
        world.recv(Tensor(&one, DType::kF32, {1}), 0, 9);  // never sent
      }
    }
    // Enough collectives that a rank which died after sending its part of one still leaves the
    // others waiting in a later one.
    for (int i = 0; i < 1000; ++i) world.all_reduce(t);
  } catch (const std::exception& e) {
    abort_world(world, e.what(), 3);
  }
  std::printf("rank %d: the all_reduces completed, which they must not\n", world.rank());
  return 0;
}

}  // namespace shardlm::test
