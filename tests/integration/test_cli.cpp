// The shardlm binary on bad input: every malformed config exits 2 with a message naming the
// key, unreadable data exits 3 naming the file, and nothing crashes (no signal, no abort).
// Also `train --dry-run`: the same memory report as the run it stands for, and exit 4 over budget.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "test_util.h"

namespace {

namespace fs = std::filesystem;

struct CliRun {
  int exit_code;  // -1 when killed by a signal
  std::string err;
};

CliRun run_shardlm(const std::string& args) {
  // CTest runs these in parallel processes: one stderr file per process.
  const fs::path err =
      shardlm::test::scratch_root() / ("shardlm_cli_stderr_" + std::to_string(getpid()) + ".txt");
  const std::string cmd =
      std::string(SHARDLM_BINARY) + " " + args + " > /dev/null 2> " + err.string();
  const int status = std::system(cmd.c_str());
  std::ifstream f(err);
  std::stringstream ss;
  ss << f.rdbuf();
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, ss.str()};
}

std::string write_config(const std::string& name, const std::string& text) {
  const fs::path p = shardlm::test::scratch_root() / ("shardlm_cli_" + name + ".json");
  std::ofstream(p) << text;
  return p.string();
}

const std::string kCorpus = std::string(SHARDLM_SOURCE_DIR) + "/tests/data/genesis_1_12.txt";

struct BadConfig {
  const char* name;
  std::string json;
  const char* must_mention;
};

class CliBadConfig : public ::testing::TestWithParam<BadConfig> {};

TEST_P(CliBadConfig, ExitsTwoNamingTheKey) {
  const BadConfig& c = GetParam();
  const CliRun r = run_shardlm("train --config " + write_config(c.name, c.json));
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find(c.must_mention), std::string::npos)
      << "stderr does not mention '" << c.must_mention << "': " << r.err;
}

std::string with(const std::string& train_section) {
  return R"({"data": {"train": ")" + kCorpus + R"("}, "train": )" + train_section + "}";
}

INSTANTIATE_TEST_SUITE_P(
    Malformed, CliBadConfig,
    ::testing::Values(
        BadConfig{"unknown_key", with(R"({"max_steps": 1, "learning_rate": 0.1})"),
                  "train.learning_rate"},
        BadConfig{"suggests", with(R"({"max_steps": 1, "learning_rate": 0.1})"), "train.lr"},
        BadConfig{"wrong_type", with(R"({"max_steps": 1, "micro_batch": "8"})"),
                  "train.micro_batch"},
        BadConfig{"float_for_int", with(R"({"max_steps": 1.5})"), "train.max_steps"},
        BadConfig{"negative_lr", with(R"({"max_steps": 1, "lr": -1})"), "train.lr"},
        BadConfig{"both_stops", with(R"({"max_steps": 10, "epochs": 2})"), "train.epochs"},
        BadConfig{"no_stop", with(R"({"lr": 0.001})"), "train.max_steps"},
        BadConfig{"bad_preset",
                  R"({"model": {"preset": "llama9"}, "data": {"train": "x"},
                      "train": {"max_steps": 1}})",
                  "model.preset"},
        BadConfig{"heads_dont_divide",
                  R"({"model": {"n_heads": 3}, "data": {"train": "x"},
                      "train": {"max_steps": 1}})",
                  "model.n_heads"},
        BadConfig{"bad_precision",
                  R"({"precision": {"param": "fp8"}, "data": {"train": "x"},
                      "train": {"max_steps": 1}})",
                  "precision.param"},
        BadConfig{"unknown_section",
                  R"({"optimizer": {"lr": 1}, "data": {"train": "x"},
                      "train": {"max_steps": 1}})",
                  "optimizer"},
        BadConfig{"section_not_object", R"({"train": 5, "data": {"train": "x"}})", "train"},
        BadConfig{"syntax_error", R"({"train": {"max_steps": 1,}})", "shardlm_cli_syntax_error"},
        BadConfig{"not_an_object", R"([1, 2, 3])", "object"},
        BadConfig{"missing_train_data", R"({"train": {"max_steps": 1}})", "data.train"},
        BadConfig{"zero_micro_batch", with(R"({"max_steps": 1, "micro_batch": 0})"),
                  "train.micro_batch"},
        BadConfig{"vocab_too_small",
                  R"({"model": {"vocab_size": 100}, "data": {"train": ")" + kCorpus +
                      R"("}, "train": {"max_steps": 1}})",
                  "model.vocab_size"},
        BadConfig{"empty_file", "", "shardlm_cli_empty_file"}),
    [](const auto& info) { return std::string(info.param.name); });

TEST(Cli, MissingConfigFileExitsTwo) {
  const CliRun r = run_shardlm("train --config /nonexistent/config.json");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("/nonexistent/config.json"), std::string::npos) << r.err;
}

TEST(Cli, BadUsageExitsTwo) {
  EXPECT_EQ(run_shardlm("").exit_code, 2);
  EXPECT_EQ(run_shardlm("frobnicate").exit_code, 2);
  EXPECT_EQ(run_shardlm("train").exit_code, 2);  // --config is required
}

TEST(Cli, BadSetOverrideExitsTwo) {
  const std::string cfg = write_config("good", with(R"({"max_steps": 1})"));
  const CliRun r = run_shardlm("train --config " + cfg + " --set train.nope=3");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("train.nope"), std::string::npos) << r.err;
}

TEST(Cli, MissingDataFileExitsThreeNamingTheFile) {
  const std::string cfg =
      write_config("missing_data",
                   R"({"data": {"train": "/nonexistent/corpus.txt"}, "train": {"max_steps": 1}})");
  const CliRun r = run_shardlm("train --config " + cfg);
  EXPECT_EQ(r.exit_code, 3) << r.err;
  EXPECT_NE(r.err.find("/nonexistent/corpus.txt"), std::string::npos) << r.err;
}

TEST(Cli, OverBudgetExitsFourWithTheBreakdown) {
  const std::string cfg = write_config(
      "budget", with(R"({"max_steps": 1})").insert(1, R"("memory": {"budget_gib": 0.001}, )"));
  const CliRun r =
      run_shardlm("train --config " + cfg + " --set log.dir=\"" +
                  (shardlm::test::scratch_root() / "shardlm_cli_budget").string() + "\"");
  EXPECT_EQ(r.exit_code, 4) << r.err;
  EXPECT_NE(r.err.find("params"), std::string::npos) << r.err;
  // The planner refuses it before anything is allocated, and says what to change.
  EXPECT_NE(r.err.find("before anything is allocated"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("memory.checkpointing"), std::string::npos) << r.err;
}

nlohmann::json read_json(const fs::path& p) {
  std::ifstream f(p);
  return nlohmann::json::parse(f);
}

// The dry run's peaks are the reference run's: the same config trained for one step.
TEST(Cli, DryRunWritesTheRunsMemoryReportWithoutTraining) {
  const std::string cfg = write_config("dry_run", with(R"({"max_steps": 1})"));
  const std::string small =
      " --set model.n_layers=1 --set data.seq_len=32 --set train.micro_batch=2"
      " --set sample.count=0 --set train.resume=none --set log.dir=";
  const fs::path dry = shardlm::test::scratch_root() / "shardlm_cli_dry_run";
  const fs::path real = shardlm::test::scratch_root() / "shardlm_cli_dry_run_reference";
  fs::remove_all(dry);
  fs::remove_all(real);
  CliRun r = run_shardlm("train --dry-run --config " + cfg + small + dry.string());
  ASSERT_EQ(r.exit_code, 0) << r.err;
  ASSERT_TRUE(fs::exists(dry / "memory_rank0.json")) << r.err;
  EXPECT_FALSE(fs::exists(dry / "metrics.jsonl"));
  EXPECT_FALSE(fs::exists(dry / "checkpoints" / "latest"));
  r = run_shardlm("train --config " + cfg + small + real.string());
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const nlohmann::json d = read_json(dry / "memory_rank0.json");
  const nlohmann::json t = read_json(real / "memory_rank0.json");
  EXPECT_GT(d["peak_bytes"]["device"].get<int64_t>(), 0);
  EXPECT_EQ(d["peak_bytes"], t["peak_bytes"]);
  EXPECT_EQ(d["peak_by_category"], t["peak_by_category"]);
}

TEST(Cli, DryRunOverBudgetExitsFour) {
  const std::string cfg = write_config("dry_run_budget", with(R"({"max_steps": 1})"));
  const CliRun r = run_shardlm(
      "train --dry-run --config " + cfg + " --set memory.budget_gib=0.001 --set log.dir=" +
      (shardlm::test::scratch_root() / "shardlm_cli_dry_run_budget").string());
  EXPECT_EQ(r.exit_code, 4) << r.err;
  EXPECT_NE(r.err.find("memory.budget_gib"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("shardlm plan --fit"), std::string::npos) << r.err;  // the way out
}

TEST(Cli, DeepSpeedConfigWarnsAndErrorsExitTwo) {
  const std::string cfg = write_config("deepspeed", with(R"({"max_steps": 1})"));
  const std::string dir = std::string(SHARDLM_SOURCE_DIR) + "/tests/data/deepspeed/";
  CliRun r =
      run_shardlm("train --config " + cfg + " --deepspeed " + dir + "fp16_dynamic_loss_scale.json");
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("fp16.enabled is true"), std::string::npos) << r.err;
  // Stage 2 maps, prints the warnings and trains.
  const std::string run_dir = (shardlm::test::scratch_root() / "shardlm_cli_ds_zero2").string();
  fs::remove_all(run_dir);
  r = run_shardlm("train --config " + cfg + " --deepspeed " + dir + "zero2_bf16_auto.json" +
                  " --set model.n_layers=1 --set data.seq_len=32 --set sample.count=0" +
                  " --set log.dir=" + run_dir);
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.err.find("shardlm: warning: deepspeed: zero_optimization.round_robin_gradients"),
            std::string::npos)
      << r.err;
  EXPECT_TRUE(fs::exists(fs::path(run_dir) / "checkpoints" / "step_00000001")) << r.err;
  r = run_shardlm("train --config " + cfg + " --deepspeed /nonexistent/ds_config.json");
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("/nonexistent/ds_config.json"), std::string::npos) << r.err;
}

}  // namespace
