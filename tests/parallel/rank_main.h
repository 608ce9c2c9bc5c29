// What the per-rank GoogleTest mains (mpi_main.cpp, tcp_main.cpp) share: run every test on
// this rank with the world communicator the main made, print the full report on rank 0 and only
// failures (prefixed "[rank R]") elsewhere, and make every rank return the same code (the
// failure flags are max-reduced), so the launcher fails the test when any rank failed.
// Tests only.
#pragma once

#include <gtest/gtest.h>

#include <cstdio>
#include <string>

#include "shardlm/comm/communicator.h"

namespace shardlm::test {

class RankFailurePrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit RankFailurePrinter(int rank) : rank_(rank) {}
  void OnTestPartResult(const ::testing::TestPartResult& r) override {
    if (!r.failed()) return;
    std::fprintf(stderr, "[rank %d] %s:%d: failure\n%s\n", rank_,
                 r.file_name() ? r.file_name() : "?", r.line_number(), r.message());
  }
  void OnTestEnd(const ::testing::TestInfo& info) override {
    if (info.result()->Failed()) {
      std::fprintf(stderr, "[rank %d] FAILED %s.%s\n", rank_, info.test_suite_name(), info.name());
    }
  }

 private:
  int rank_;
};

// RUN_ALL_TESTS on this rank of `world`; 1 when any rank failed.
inline int run_tests_on_every_rank(Communicator& world) {
  auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
  if (world.rank() != 0) {
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new RankFailurePrinter(world.rank()));
  }
  const int32_t failed_here = RUN_ALL_TESTS() != 0 ? 1 : 0;
  int32_t failed_anywhere = failed_here;
  try {
    world.all_reduce(Tensor(&failed_anywhere, DType::kI32, {1}), ReduceOp::kMax);
  } catch (const std::exception& e) {
    abort_world(world, std::string("could not agree on the test result: ") + e.what());
  }
  if (world.rank() == 0 && failed_anywhere && !failed_here) {
    std::printf("FAILED on another rank: see the [rank R] lines above\n");
  }
  return failed_anywhere ? 1 : 0;
}

}  // namespace shardlm::test
