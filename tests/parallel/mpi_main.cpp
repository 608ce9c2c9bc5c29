// GoogleTest main for tests/parallel, one process per rank under mpiexec: initialises MPI,
// prints the full report on rank 0 and only failures (prefixed "[rank R]") elsewhere, and makes
// every rank exit with the same code (the failure flags are max-reduced), so mpiexec fails the
// test when any rank failed.
#include <gtest/gtest.h>

#include <cstdio>
#include <memory>

#include "parallel/mpi_test_env.h"
#include "shardlm/comm/mpi_runtime.h"

namespace shardlm::test {

namespace {

Communicator* g_world = nullptr;  // owned by main(); test harness only

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

}  // namespace

Communicator& world() { return *g_world; }

}  // namespace shardlm::test

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  shardlm::MpiRuntime runtime;
  std::unique_ptr<shardlm::Communicator> world = runtime.world();
  shardlm::test::g_world = world.get();

  auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
  if (world->rank() != 0) {
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new shardlm::test::RankFailurePrinter(world->rank()));
  }
  const int32_t failed_here = RUN_ALL_TESTS() != 0 ? 1 : 0;

  int32_t failed_anywhere = failed_here;
  try {
    world->all_reduce(shardlm::Tensor(&failed_anywhere, shardlm::DType::kI32, {1}),
                      shardlm::ReduceOp::kMax);
  } catch (const std::exception& e) {
    shardlm::abort_world(*world, std::string("could not agree on the test result: ") + e.what());
  }
  if (world->rank() == 0 && failed_anywhere && !failed_here) {
    std::printf("FAILED on another rank: see the [rank R] lines above\n");
  }
  return failed_anywhere ? 1 : 0;
}
