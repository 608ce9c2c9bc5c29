// The subcommands of the shardlm binary. Each add_*_command registers its options on the
// app and returns the action to run when it was chosen; actions throw shardlm::Error and
// main() maps the error kind to the exit code.
#pragma once

#include <CLI/CLI.hpp>
#include <functional>
#include <string>
#include <vector>

#include "shardlm/comm/communicator.h"
#include "shardlm/config/config.h"
#include "shardlm/core/check.h"

namespace shardlm::cli {

struct Command {
  CLI::App* app = nullptr;
  std::function<int()> run;  // returns the exit code on success paths (normally 0)
};

// "config error", "data error", "out of memory", "error": what precedes an error's message.
const char* error_label(ErrorKind kind);

Command add_train_command(CLI::App& app);          // train_command.cpp
Command add_tokenize_command(CLI::App& app);       // tokenize_command.cpp
Command add_generate_command(CLI::App& app);       // generate_command.cpp
Command add_plan_command(CLI::App& app);           // plan_command.cpp
Command add_convert_command(CLI::App& app);        // convert_command.cpp
Command add_launch_command(CLI::App& app);         // launch_command.cpp
Command add_config_command(CLI::App& app);         // config_command.cpp
Command add_dpo_reference_command(CLI::App& app);  // dpo_reference_command.cpp

// Runs `body` on every rank of `world`; an error on one rank aborts the others (which would
// wait in a collective) with its label and exit code, then is thrown again (train_command.cpp).
void run_on_world(Communicator& world, const std::function<void()>& body);

// The run config: --config, then --deepspeed's mapping (when a path is given), then --set.
// The DeepSpeed keys that are not honoured are printed as warnings, also when the load then
// fails (`lead`: this process prints them, so that N ranks do not print them N times).
RunConfig load_cli_config(const std::string& config_path, const std::string& deepspeed_path,
                          const std::vector<std::string>& overrides, int64_t world_size,
                          bool lead);  // train_command.cpp

}  // namespace shardlm::cli
