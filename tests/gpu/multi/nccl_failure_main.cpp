// A failed NCCL collective that no host waits for ends its rank's process, under mpiexec with
// one GPU per rank (label gpu; exit 77, a skip, with fewer GPUs than ranks). Rank 0's compute
// thread starts an all-reduce nobody else joins (its wait is the compute stream's) and then
// synchronizes the compute stream, which would wait forever: the world's CompletionWatch must
// see the timeout and end the process with exit 1 and a message naming the op. The other ranks
// wait in an MPI barrier that rank 0 never reaches; the launcher ends them once rank 0 is gone.
// check_nccl_failure.sh checks the exit, the time taken and the message.
#include <cuda_runtime.h>

#include <cstdio>
#include <memory>

#include "shardlm/comm/communicator.h"
#include "shardlm/comm/mpi_runtime.h"
#include "shardlm/comm/nccl.h"

int main() {
  shardlm::MpiRuntime runtime;
  std::unique_ptr<shardlm::Communicator> world = runtime.world();
  int gpus = 0;
  if (cudaGetDeviceCount(&gpus) != cudaSuccess || gpus < world->size()) {
    std::printf("skipped: needs one GPU per rank (%d)\n", world->size());
    return 77;
  }
  shardlm::CommOptions quick;
  quick.timeout_s = 2;
  auto nccl = shardlm::make_nccl_world(world.get(), quick);
  if (world->rank() == 0) {
    cudaStream_t compute = nullptr;
    cudaStreamCreateWithFlags(&compute, cudaStreamNonBlocking);
    nccl->set_compute_stream(compute);
    float* d = nullptr;
    cudaMalloc(&d, 8 * sizeof(float));
    nccl->all_reduce(shardlm::Tensor(d, shardlm::DType::kF32, {8}, shardlm::MemPool::kDevice));
    std::printf("rank 0: the all_reduce returned without waiting; synchronizing\n");
    std::fflush(stdout);
    cudaStreamSynchronize(compute);  // never returns: the watch must end the process first
    std::printf("rank 0: the compute stream passed a collective nobody joined\n");
    return 0;
  }
  world->barrier();  // rank 0 never arrives
  return 0;
}
