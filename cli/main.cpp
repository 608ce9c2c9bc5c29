// shardlm command line: dispatches to the subcommands of commands.h and maps shardlm::Error
// kinds onto exit codes (0 ok, 2 usage/config, 3 data/checkpoint, 4 out of memory, 1 other).
// The only place in the project that decides exit codes.
#include <CLI/CLI.hpp>
#include <iostream>
#include <new>
#include <string>
#include <vector>

#include "commands.h"
#include "shardlm/core/check.h"

int main(int argc, char** argv) {
  CLI::App app{"shardlm: train Llama-family models when memory is the limit"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "shardlm 0.1.0");
  std::vector<shardlm::cli::Command> commands = {
      shardlm::cli::add_train_command(app),    shardlm::cli::add_generate_command(app),
      shardlm::cli::add_tokenize_command(app), shardlm::cli::add_plan_command(app),
      shardlm::cli::add_convert_command(app),  shardlm::cli::add_launch_command(app),
      shardlm::cli::add_config_command(app),   shardlm::cli::add_dpo_reference_command(app),
  };

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int rc = app.exit(e);
    return rc == 0 ? 0 : 2;
  }

  try {
    for (const auto& c : commands)
      if (c.app->parsed()) return c.run();
    return 2;
  } catch (const shardlm::Error& e) {
    std::cout.flush();
    std::cerr << "shardlm: " << shardlm::cli::error_label(e.kind()) << ": " << e.what() << "\n";
    return static_cast<int>(e.kind());
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
