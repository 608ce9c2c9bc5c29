// `shardlm train --config FILE [--set key=value]... [--dry-run]` (one process, or every rank
// under mpirun: data parallel), with SIGINT/SIGTERM handling: the first
// signal asks the trainer to finish the step, checkpoint and return; a second one exits at
// once (checkpoints are written atomically, so `latest` stays valid).
#include <unistd.h>

#include <fmt/format.h>

#include <csignal>
#include <iostream>
#include <optional>

#include "commands.h"
#include "shardlm/comm/world.h"
#include "shardlm/config/config.h"
#include "shardlm/config/deepspeed.h"
#include "shardlm/train/trainer.h"

namespace shardlm::cli {
namespace {

// The only process-wide state of the binary: what a signal handler may touch.
volatile std::sig_atomic_t g_stop_signal = 0;

void on_signal(int sig) {
  if (g_stop_signal != 0) {
    static const char kMsg[] = "\nshardlm: second signal, exiting now\n";
    (void)!write(STDERR_FILENO, kMsg, sizeof(kMsg) - 1);
    _exit(128 + sig);
  }
  g_stop_signal = sig;
  static const char kMsg[] =
      "\nshardlm: signal received; finishing the step and writing a checkpoint (again to "
      "exit now)\n";
  (void)!write(STDERR_FILENO, kMsg, sizeof(kMsg) - 1);
}

void install_handlers() {
  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
}

}  // namespace

RunConfig load_cli_config(const std::string& config_path, const std::string& deepspeed_path,
                          const std::vector<std::string>& overrides, int64_t world_size,
                          bool lead) {
  if (deepspeed_path.empty()) return load_run_config(config_path, overrides);
  std::vector<std::string> warnings;
  const auto print = [&] {
    if (lead)
      for (const auto& w : warnings) std::cerr << "shardlm: warning: deepspeed: " << w << "\n";
  };
  try {
    RunConfig cfg = load_run_config_with_deepspeed(config_path, deepspeed_path, overrides,
                                                   world_size, warnings);
    print();
    return cfg;
  } catch (...) {
    print();
    throw;
  }
}

const char* error_label(ErrorKind kind) {
  switch (kind) {
    case ErrorKind::kConfig:
      return "config error";
    case ErrorKind::kData:
      return "data error";
    case ErrorKind::kOutOfMemory:
      return "out of memory";
    case ErrorKind::kInternal:
      return "error";
  }
  return "error";
}

Command add_train_command(CLI::App& app) {
  struct Options {
    std::string config_path;
    std::string deepspeed_path;
    std::vector<std::string> overrides;
    bool dry_run = false;
  };
  auto opt = std::make_shared<Options>();
  CLI::App* sub = app.add_subcommand("train", "train a model from a JSON config");
  sub->add_option("--config", opt->config_path, "JSON config file (see configs/)")->required();
  sub->add_option("--deepspeed", opt->deepspeed_path,
                  "DeepSpeed ds_config.json mapped onto shardlm keys (applied after --config, "
                  "before --set; unsupported keys are warnings or errors)");
  sub->add_option("--set", opt->overrides, "override a config key: --set train.lr=1e-3")
      ->take_all();
  sub->add_flag("--dry-run", opt->dry_run,
                "build everything the run would allocate (data, model, ZeRO engine: every buffer "
                "through the memory ledger, under memory.budget_gib), write "
                "memory_rank{R}.json, print rank 0's device/host peak bytes and exit 0 without "
                "training. Every buffer is allocated at construction and a training step "
                "allocates nothing, so this is the run's real footprint; over budget it exits 4 "
                "as the run would");
  return {sub, [opt] {
            // Under mpirun every rank runs this (the MPI world), under `shardlm launch` or
            // torchrun-style variables too (the TCP world); otherwise the world is this process.
            std::unique_ptr<Communicator> world = make_world_communicator();
            run_on_world(*world, [&] {
              const RunConfig cfg =
                  load_cli_config(opt->config_path, opt->deepspeed_path, opt->overrides,
                                  world->size(), world->rank() == 0);
              if (opt->dry_run) {
                dry_run(cfg, std::cout, world.get());
                return;
              }
              install_handlers();
              train(cfg, std::cout, &g_stop_signal, world.get());
            });
            return 0;
          }};
}

void run_on_world(Communicator& world, const std::function<void()>& body) {
  try {
    body();
  } catch (const Error& e) {
    // One rank failing must not leave the others waiting in a collective.
    // The label as one process would print it: scripts read "out of memory".
    if (world.size() > 1)
      abort_world(world, fmt::format("{}: {}", error_label(e.kind()), e.what()),
                  static_cast<int>(e.kind()));
    throw;
  } catch (const std::exception& e) {
    if (world.size() > 1) abort_world(world, e.what(), 1);
    throw;
  }
}

}  // namespace shardlm::cli
