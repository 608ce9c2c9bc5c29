// `shardlm train --config FILE [--set key=value]...`
#include <iostream>

#include "commands.h"
#include "shardlm/train/config.h"
#include "shardlm/train/trainer.h"

namespace shardlm::cli {

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
            train(cfg, std::cout);
            return 0;
          }};
}

}  // namespace shardlm::cli
