// `shardlm config --doc`: the configuration reference, every key with its default and meaning,
// as markdown on stdout. docs/config.md is this output (`shardlm config --doc >
// docs/config.md`), so the page is regenerated rather than edited.
#include <iostream>
#include <memory>

#include "commands.h"
#include "shardlm/config/config_doc.h"

namespace shardlm::cli {

Command add_config_command(CLI::App& app) {
  auto doc = std::make_shared<bool>(false);
  CLI::App* sub = app.add_subcommand("config", "describe the run config's keys");
  // Required: the subcommand has no other output yet, and a bare `shardlm config` then says
  // what it takes instead of printing nothing.
  sub->add_flag("--doc", *doc,
                "print the configuration reference (docs/config.md): every key by section with "
                "its default and meaning, as markdown")
      ->required();
  return {sub, [doc] {
            if (*doc) std::cout << config_reference_markdown();
            return 0;
          }};
}

}  // namespace shardlm::cli
