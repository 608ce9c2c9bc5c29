// shardlm command line: parses arguments into configs and maps shardlm::Error kinds onto
// exit codes (0 ok, 2 usage/config, 3 data/checkpoint, 4 out of memory, 1 other).
// The only place in the project that decides exit codes.
#include <CLI/CLI.hpp>
#include <iostream>
#include <new>
#include <string>
#include <vector>

#include "shardlm/core/check.h"
#include "shardlm/train/config.h"
#include "shardlm/train/trainer.h"

namespace {

int exit_code(shardlm::ErrorKind kind) { return static_cast<int>(kind); }

const char* error_label(shardlm::ErrorKind kind) {
  switch (kind) {
    case shardlm::ErrorKind::kConfig:
      return "config error";
    case shardlm::ErrorKind::kData:
      return "data error";
    case shardlm::ErrorKind::kOutOfMemory:
      return "out of memory";
    case shardlm::ErrorKind::kInternal:
      return "error";
  }
  return "error";
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"shardlm: train Llama-family models when memory is the limit"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "shardlm 0.1.0");

  std::string config_path;
  std::vector<std::string> overrides;
  auto* train = app.add_subcommand("train", "train a model from a JSON config");
  train->add_option("--config", config_path, "JSON config file (see configs/)")->required();
  train->add_option("--set", overrides, "override a config key: --set train.lr=1e-3")->take_all();

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int rc = app.exit(e);
    return rc == 0 ? 0 : 2;
  }

  try {
    if (train->parsed()) {
      const shardlm::RunConfig cfg = shardlm::load_run_config(config_path, overrides);
      shardlm::train(cfg, std::cout);
    }
    return 0;
  } catch (const shardlm::Error& e) {
    std::cout.flush();
    std::cerr << "shardlm: " << error_label(e.kind()) << ": " << e.what() << "\n";
    return exit_code(e.kind());
  } catch (const std::bad_alloc&) {
    std::cout.flush();
    std::cerr << "shardlm: out of memory: a host allocation failed; lower train.micro_batch or "
                 "data.seq_len\n";
    return 4;
  } catch (const std::exception& e) {
    std::cout.flush();
    std::cerr << "shardlm: error: " << e.what() << "\n";
    return 1;
  }
}
