// `shardlm launch --nproc N -- <shardlm args>`: several ranks of this shardlm on this machine,
// as `torchrun --standalone --nproc-per-node N` starts them (launch_local: the torchrun-style
// variables on a free port, signals forwarded, the first failure's exit code), so that a node
// without MPI trains on several ranks over the TCP communicator.
#include <unistd.h>

#include <climits>
#include <memory>

#include "commands.h"
#include "shardlm/comm/launcher.h"

namespace shardlm::cli {

namespace {

// This executable, so that every rank runs the same shardlm as the launcher.
std::string self_path(const char* fallback) {
  char path[PATH_MAX] = {};
  const ssize_t n = ::readlink("/proc/self/exe", path, sizeof(path) - 1);
  return n > 0 ? std::string(path, size_t(n)) : std::string(fallback);
}

}  // namespace

Command add_launch_command(CLI::App& app) {
  struct Options {
    int nproc = 1;
    std::vector<std::string> args;
  };
  auto opt = std::make_shared<Options>();
  CLI::App* sub = app.add_subcommand(
      "launch",
      "run N ranks of shardlm on this machine without MPI (like torchrun --standalone): "
      "shardlm launch --nproc 2 -- train --config run.json; the ranks talk over TCP");
  sub->add_option("--nproc", opt->nproc, "number of ranks (processes) to start")
      ->required()
      ->check(CLI::Range(1, 1 << 16));
  sub->add_option("args", opt->args, "the shardlm arguments of every rank, after --")->required();
  return {sub, [opt] {
            LocalLaunch launch;
            launch.nproc = opt->nproc;
            launch.command.push_back(self_path("shardlm"));
            launch.command.insert(launch.command.end(), opt->args.begin(), opt->args.end());
            return launch_local(launch);
          }};
}

}  // namespace shardlm::cli
