// `shardlm train --config FILE [--set key=value]...`, with SIGINT/SIGTERM handling: the first
// signal asks the trainer to finish the step, checkpoint and return; a second one exits at
// once (checkpoints are written atomically, so `latest` stays valid).
#include <unistd.h>

#include <csignal>
#include <iostream>

#include "commands.h"
#include "shardlm/train/config.h"
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

Command add_train_command(CLI::App& app) {
  struct Options {
    std::string config_path;
    std::vector<std::string> overrides;
  };
  auto opt = std::make_shared<Options>();
  CLI::App* sub = app.add_subcommand("train", "train a model from a JSON config");
  sub->add_option("--config", opt->config_path, "JSON config file (see configs/)")->required();
  sub->add_option("--set", opt->overrides, "override a config key: --set train.lr=1e-3")
      ->take_all();
  return {sub, [opt] {
            const RunConfig cfg = load_run_config(opt->config_path, opt->overrides);
            install_handlers();
            train(cfg, std::cout, &g_stop_signal);
            return 0;
          }};
}

}  // namespace shardlm::cli
