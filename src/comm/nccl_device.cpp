// Which GPU a rank of the NCCL world drives, and the config error when a node has more ranks
// than GPUs (nccl.h). Host-only: compiled in every build, so the rule is tested without a GPU.
#include <algorithm>

#include "shardlm/comm/nccl.h"

namespace shardlm {

int nccl_device_for(int rank, int local_rank, int local_size, int devices) {
  SHARDLM_CHECK(local_rank >= 0 && devices >= 1, "rank {}: local rank {} with {} GPUs", rank,
                local_rank, devices);
  // local_size may be unknown (a torchrun-style launch without LOCAL_WORLD_SIZE): this rank's
  // own local rank still bounds it from below.
  const int on_node = std::max(local_size, local_rank + 1);
  if (on_node > devices)
    SHARDLM_FAIL(ErrorKind::kConfig,
                 "rank {} (local rank {}): {} ranks on this node but {} visible GPU{}; "
                 "parallel.device_comm = \"nccl\" needs one GPU per rank (NCCL refuses two "
                 "ranks of a communicator on one GPU). To share GPUs between ranks set "
                 "parallel.device_comm = \"host\" (device tensors staged through host memory), "
                 "or start at most {} rank{} per node",
                 rank, local_rank, on_node, devices, devices == 1 ? "" : "s", devices,
                 devices == 1 ? "" : "s");
  return local_rank;
}

}  // namespace shardlm
