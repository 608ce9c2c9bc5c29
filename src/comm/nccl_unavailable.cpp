// The NCCL communicator's factory in a build without CUDA (SHARDLM_CUDA=OFF): CMake compiles
// this file instead of src/comm/nccl/, so callers link either way and learn why at run time.
#include "shardlm/comm/nccl.h"

namespace shardlm {

bool nccl_built() { return false; }

std::unique_ptr<Communicator> make_nccl_world(Communicator* /*host_world*/,
                                              const CommOptions& /*options*/) {
  SHARDLM_FAIL(ErrorKind::kConfig,
               "this shardlm was built without CUDA, so it has no NCCL communicator; rebuild with "
               "-DSHARDLM_CUDA=ON (make build-cuda) for GPU runs on several ranks");
}

}  // namespace shardlm
