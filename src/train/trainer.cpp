// train() and dry_run(): the communicator a run uses (MPI, the NCCL world on several GPUs, or
// MPI with device tensors staged through host memory: parallel.device_comm = "mpi")
// and the TrainRun built on it. The run itself lives in train_run.h and the train_*.cpp files
// (setup, loop, checkpoint, reports); nothing here touches its state.
#include "shardlm/train/trainer.h"

#include <optional>

#include "shardlm/comm/local.h"
#include "shardlm/comm/nccl.h"
#include "shardlm/comm/rendezvous.h"
#include "shardlm/comm/staged.h"
#include "train_run.h"

namespace shardlm {

namespace {

// train.device = cuda on several ranks: the NCCL world, bootstrapped over `host` (mpirun/srun)
// or over TCP from the torchrun-style variables; every collective of the run, host scalars
// included (NCCL stages them), goes through it. parallel.device_comm = "mpi" on several ranks
// (any device): `host` with device tensors staged through host memory (TrainRun attaches the
// backend's copies and the staging buffer). Null where `host` is the run's communicator.
std::unique_ptr<Communicator> device_world_for(const RunConfig& cfg, Communicator& host) {
  const std::optional<LaunchEnv> env = host.size() == 1 ? launch_env() : std::nullopt;
  const bool torchrun = env && env->world_size > 1;
  if (cfg.parallel.device_comm == "mpi") {
    if (torchrun)
      SHARDLM_FAIL(ErrorKind::kConfig,
                   "WORLD_SIZE={} is set (a torchrun-style launch), but parallel.device_comm = "
                   "\"mpi\" needs an MPI launch: start the ranks with mpirun/srun, or set "
                   "parallel.device_comm = \"nccl\"",
                   env->world_size);
    if (host.size() == 1) return nullptr;
    return std::make_unique<StagedCommunicator>(host);
  }
  if (cfg.train.device != "cuda") {
    if (torchrun)
      SHARDLM_FAIL(ErrorKind::kConfig,
                   "WORLD_SIZE={} is set (a torchrun-style launch), but train.device = \"{}\" "
                   "communicates over MPI only: launch with mpirun/srun, or use "
                   "train.device = \"cuda\" (NCCL)",
                   env->world_size, cfg.train.device);
    return nullptr;
  }
  if (host.size() == 1 && !torchrun) return nullptr;
  return make_nccl_world(&host, host.options());
}

}  // namespace

using trainer_detail::TrainRun;

DryRunResult dry_run(const RunConfig& cfg, std::ostream& out, Communicator* world) {
  LocalCommunicator local("world");
  Communicator& host = world != nullptr ? *world : local;
  const std::unique_ptr<Communicator> device_world = device_world_for(cfg, host);
  return TrainRun(cfg, out, nullptr, device_world ? *device_world : host).dry_run();
}

TrainResult train(const RunConfig& cfg, std::ostream& out,
                  const volatile std::sig_atomic_t* stop_signal, Communicator* world) {
  LocalCommunicator local("world");
  Communicator& host = world != nullptr ? *world : local;
  const std::unique_ptr<Communicator> device_world = device_world_for(cfg, host);
  TrainRun run(cfg, out, stop_signal, device_world ? *device_world : host);
  return run.run();
}

}  // namespace shardlm
