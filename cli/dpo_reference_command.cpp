// `shardlm dpo-reference --config FILE [--set key=value]...`: full fine-tuning DPO's reference
// log-probability sums computed ahead of training into log.dir/dpo_reference.json (one process,
// or every rank under mpirun or `shardlm launch`: the pairs dealt over the data-parallel
// replicas, each replica's tp, cp and pp ranks computing theirs together), so that the run
// starts with them precomputed.
#include <iostream>

#include "commands.h"
#include "shardlm/comm/world.h"
#include "shardlm/train/trainer.h"

namespace shardlm::cli {

Command add_dpo_reference_command(CLI::App& app) {
  struct Options {
    std::string config_path;
    std::string deepspeed_path;
    std::vector<std::string> overrides;
  };
  auto opt = std::make_shared<Options>();
  CLI::App* sub = app.add_subcommand(
      "dpo-reference",
      "full fine-tuning DPO (train.objective = dpo, lora.rank = 0): compute every training "
      "pair's reference log-probability sums with the initial weights into "
      "log.dir/dpo_reference.json, which `shardlm train` with the same config then reads");
  sub->add_option("--config", opt->config_path, "the run's JSON config")->required();
  sub->add_option("--deepspeed", opt->deepspeed_path,
                  "DeepSpeed ds_config.json mapped onto shardlm keys, as for train");
  sub->add_option("--set", opt->overrides, "override a config key, as for train")->take_all();
  return {sub, [opt] {
            std::unique_ptr<Communicator> world = make_world_communicator();
            run_on_world(*world, [&] {
              const RunConfig cfg =
                  load_cli_config(opt->config_path, opt->deepspeed_path, opt->overrides,
                                  world->size(), world->rank() == 0);
              dpo_reference(cfg, std::cout, world.get());
            });
            return 0;
          }};
}

}  // namespace shardlm::cli
