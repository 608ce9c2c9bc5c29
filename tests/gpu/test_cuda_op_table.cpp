// The op table (tests/kernels/op_table.h) on the CUDA backend: every case, f32 and bf16 (also
// the bf16 variants the CPU backend does not take), against the same f64 references as the CPU.
#include "kernels/cuda/cuda_backend.h"
#include "kernels/op_table.h"

namespace shardlm::test::ops {
namespace {

class CudaOpTable : public ::testing::TestWithParam<OpCase> {};

TEST_P(CudaOpTable, MatchesTheF64Reference) {
  const OpCase& c = GetParam();
  cuda::CudaBackend be(0);
  OpRun run(be, c.dtype, c.tol);
  c.body(run);
}

INSTANTIATE_TEST_SUITE_P(Ops, CudaOpTable, ::testing::ValuesIn(op_cases()),
                         [](const ::testing::TestParamInfo<OpCase>& info) {
                           return test_name(info.param, info.index);
                         });

}  // namespace
}  // namespace shardlm::test::ops
