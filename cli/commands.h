// The subcommands of the shardlm binary. Each add_*_command registers its options on the
// app and returns the action to run when it was chosen; actions throw shardlm::Error and
// main() maps the error kind to the exit code.
#pragma once

#include <CLI/CLI.hpp>
#include <functional>

namespace shardlm::cli {

struct Command {
  CLI::App* app = nullptr;
  std::function<int()> run;  // returns the exit code on success paths (normally 0)
};

Command add_train_command(CLI::App& app);     // train_command.cpp
Command add_tokenize_command(CLI::App& app);  // tokenize_command.cpp
Command add_generate_command(CLI::App& app);  // generate_command.cpp

}  // namespace shardlm::cli
