// train(), dry_run() and dpo_reference(): the communicator a run uses (the host world: MPI or TCP;
// the NCCL world on several GPUs; or the host world with device tensors staged through host memory:
// parallel.device_comm = "host") and the TrainRun built on it. The run itself lives in
// train_run.h and the train_*.cpp files (setup, loop, checkpoint, reports); nothing here touches
// its state.
#include "shardlm/train/trainer.h"

#include <optional>

#include "shardlm/comm/local.h"
#include "shardlm/comm/nccl.h"
#include "shardlm/comm/rendezvous.h"
#include "shardlm/comm/staged.h"
#include "train_run.h"

namespace shardlm {

namespace {

// train.device = cuda on several ranks: the NCCL world, bootstrapped over `host` (the MPI or
// TCP world) or, when the caller gave no world, over TCP from the torchrun-style variables;
// every collective of the run, host scalars included (NCCL stages them), goes through it.
// parallel.device_comm = "host" (alias "mpi") on several ranks (any device): `host` with device
// tensors staged through host memory (TrainRun attaches the backend's copies and the staging
// buffer). Null where `host` is the run's communicator.
std::unique_ptr<Communicator> device_world_for(const RunConfig& cfg, Communicator& host) {
  const std::optional<LaunchEnv> env = host.size() == 1 ? launch_env() : std::nullopt;
  const bool torchrun = env && env->world_size > 1;
  if (cfg.parallel.device_comm_staged() || cfg.train.device != "cuda") {
    // Only NCCL can make a world of its own from the variables; the host world is the caller's
    // (make_world_communicator makes the TCP world of such a launch).
    if (torchrun)
      SHARDLM_FAIL(ErrorKind::kConfig,
                   "WORLD_SIZE={} is set (a torchrun-style launch), but this run was given no "
                   "world communicator over those ranks, and parallel.device_comm = \"{}\" with "
                   "train.device = \"{}\" communicates through one: start the ranks with "
                   "`shardlm launch --nproc N -- train ...` (or pass make_world_communicator()), "
                   "or use train.device = \"cuda\" with parallel.device_comm = \"nccl\"",
                   env->world_size, cfg.parallel.device_comm, cfg.train.device);
    // The queued CPU backend's device memory is current only after a wait: the host world
    // must move it through the backend's copies, as it moves a GPU's.
    if (cfg.train.device == "cpu-queued" && host.size() > 1 && !cfg.parallel.device_comm_staged())
      SHARDLM_FAIL(ErrorKind::kConfig,
                   "train.device = \"cpu-queued\" on {} ranks needs parallel.device_comm = "
                   "\"host\" (device tensors staged through host memory, as on a shared GPU), "
                   "got \"{}\"",
                   host.size(), cfg.parallel.device_comm);
    if (!cfg.parallel.device_comm_staged() || host.size() == 1) return nullptr;
    return std::make_unique<StagedCommunicator>(host);
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

std::string dpo_reference(const RunConfig& cfg, std::ostream& out, Communicator* world) {
  LocalCommunicator local("world");
  Communicator& host = world != nullptr ? *world : local;
  const std::unique_ptr<Communicator> device_world = device_world_for(cfg, host);
  return TrainRun(cfg, out, nullptr, device_world ? *device_world : host).dpo_reference();
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
