// `shardlm plan` through the binary: its plan is the one `train --dry-run` writes as `planned`
// (which Memory.PlanEqualsLedger* ties to the ledger; the dry run's data bytes from the sizes it
// prints), --json carries the same figures, budgets decide exit 4, config errors exit 2 naming the
// key, and the presets plan without allocating.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <regex>
#include <sstream>

#include "shardlm/plan/plan.h"
#include "test_util.h"

namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

struct CliRun {
  int exit_code;  // -1 when killed by a signal
  std::string out, err;
};

std::string slurp(const fs::path& p) {
  std::ifstream f(p);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// `env`: variable assignments put before the command ("OMP_NUM_THREADS=1 ").
CliRun run_shardlm(const std::string& args, const std::string& env = "") {
  // CTest runs these in parallel processes: files per process.
  const std::string tag = std::to_string(getpid());
  const fs::path out = shardlm::test::scratch_root() / ("shardlm_plan_stdout_" + tag + ".txt");
  const fs::path err = shardlm::test::scratch_root() / ("shardlm_plan_stderr_" + tag + ".txt");
  const std::string cmd =
      env + SHARDLM_BINARY + " " + args + " > " + out.string() + " 2> " + err.string();
  const int status = std::system(cmd.c_str());
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, slurp(out), slurp(err)};
}

// A config naming the test corpus (validation wants data.train; plan never reads it).
std::string config_file() {
  const fs::path p =
      shardlm::test::scratch_root() / ("shardlm_plan_config_" + std::to_string(getpid()) + ".json");
  std::ofstream(p) << R"({"data": {"train": ")" << SHARDLM_SOURCE_DIR
                   << R"(/tests/data/genesis_1_12.txt"}, "train": {"max_steps": 1}})";
  return p.string();
}

const std::string kSmall =
    " --set model.n_layers=1 --set data.seq_len=32 --set train.micro_batch=2";

// A run's plan less the data's host bytes (category data), which the run plans once it has
// read its data and `plan`, which reads none, leaves at 0.
json without_data(json planned) {
  const int64_t data = planned["host_peak_by_category"]["data"].get<int64_t>();
  planned["host_peak_by_category"]["data"] = 0;
  planned["peak_bytes"]["host"] = planned["peak_bytes"]["host"].get<int64_t>() - data;
  return planned;
}

// The dry run's plan is `plan`'s plus its data's host bytes, and its measured peaks are its plan.
void expect_plan_of_dry_run(const json& p, const json& d) {
  EXPECT_GT(d["planned"]["host_peak_by_category"]["data"].get<int64_t>(), 0);
  EXPECT_EQ(p["planned"], without_data(d["planned"]));
  EXPECT_EQ(d["planned"]["peak_bytes"], d["peak_bytes"]);
  EXPECT_EQ(d["planned"]["host_peak_by_category"], d["host_peak_by_category"]);
}

TEST(CliPlan, EqualsTheDryRunsPlannedReport) {
  const fs::path dir =
      shardlm::test::scratch_root() / ("shardlm_plan_dry_run_" + std::to_string(getpid()));
  fs::remove_all(dir);
  for (const char* extra :
       {"", " --set zero.stage=1 --set zero.offload_optimizer=cpu",
        " --set memory.checkpointing=full --set memory.offload_checkpoints=true"}) {
    SCOPED_TRACE(extra);
    const CliRun dry = run_shardlm("train --dry-run --config " + config_file() + kSmall + extra +
                                   " --set sample.count=0 --set log.dir=" + dir.string());
    ASSERT_EQ(dry.exit_code, 0) << dry.err;
    const CliRun plan = run_shardlm("plan --json --config " + config_file() + kSmall + extra);
    ASSERT_EQ(plan.exit_code, 0) << plan.err;
    const json p = json::parse(plan.out);
    // The ledger's measured peaks are the plan's (the dry run allocates the run's buffers).
    expect_plan_of_dry_run(p, json::parse(slurp(dir / "memory_rank0.json")));
  }
}

// The data's host bytes of a dry run, from the sizes it prints: the training and held-out sources
// (the same text file read twice: tokens and document starts), each set's fill scratch (stream
// packing), and the window orders the run holds, the epoch's and the evaluation's, 8 bytes a
// window each.
TEST(CliPlan, DryRunsDataIsItsSourcesTablesAndBothWindowOrders) {
  const fs::path dir =
      shardlm::test::scratch_root() / ("shardlm_plan_data_" + std::to_string(getpid()));
  fs::remove_all(dir);
  const std::string text = std::string(SHARDLM_SOURCE_DIR) + "/tests/data/genesis_1_12.txt";
  const CliRun dry = run_shardlm("train --dry-run --config " + config_file() + kSmall +
                                 " --set data.valid=" + text +
                                 " --set sample.count=0 --set log.dir=" + dir.string());
  ASSERT_EQ(dry.exit_code, 0) << dry.err;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(
      dry.out, m, std::regex(R"(data: \S+: (\d+) tokens in (\d+) documents.* -> (\d+) windows)")))
      << dry.out;
  const int64_t tokens = std::stoll(m[1]), documents = std::stoll(m[2]), windows = std::stoll(m[3]);
  const int64_t expected = 2 * shardlm::memory_source_host_bytes(tokens, documents, false) +
                           2 * shardlm::data_set_host_bytes({.seq_len = 32, .windows = windows}) +
                           2 * windows * 8;
  const json d = json::parse(slurp(dir / "memory_rank0.json"));
  EXPECT_EQ(d["host_peak_by_category"]["data"].get<int64_t>(), expected);
  EXPECT_EQ(d["planned"]["host_peak_by_category"]["data"].get<int64_t>(), expected);
}

// Under mpiexec the dry run's ranks write their own reports: every rank's `planned` is the
// plan for --world N (all ranks alike), for context parallelism and for ZeRO-3 sharding.
TEST(CliPlan, EqualsEveryRanksDryRunUnderMpi) {
  for (const char* extra : {" --set parallel.cp=2", " --set zero.stage=3"}) {
    SCOPED_TRACE(extra);
    const fs::path dir =
        shardlm::test::scratch_root() / ("shardlm_plan_dry_run_mpi_" + std::to_string(getpid()));
    fs::remove_all(dir);
    const std::string mpiexec =
        std::string(
            "OMP_NUM_THREADS=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 ") +
        shardlm::test::mpiexec() +
        " -n 2 --oversubscribe --mca mpi_yield_when_idle 1 --bind-to none ";
    const std::string cmd =
        mpiexec + SHARDLM_BINARY + " train --dry-run --config " + config_file() + kSmall + extra +
        " --set sample.count=0 --set log.dir=" + dir.string() + " > /dev/null 2>&1";
    const int status = std::system(cmd.c_str());
    ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << cmd;
    // The CPU backend's attention scratch is per thread: plan with the ranks' thread count.
    const CliRun plan = run_shardlm(
        "plan --json --world 2 --config " + config_file() + kSmall + extra, "OMP_NUM_THREADS=1 ");
    ASSERT_EQ(plan.exit_code, 0) << plan.err;
    const json p = json::parse(plan.out);
    for (int r = 0; r < 2; ++r) {
      SCOPED_TRACE("rank " + std::to_string(r));
      expect_plan_of_dry_run(
          p, json::parse(slurp(dir / ("memory_rank" + std::to_string(r) + ".json"))));
    }
  }
}

TEST(CliPlan, JsonHasBytesPerCategoryAndTheEstimate) {
  const CliRun r = run_shardlm("plan --json --config " + config_file() + kSmall);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const json j = json::parse(r.out);
  for (const char* cat : {"params", "grads", "optimizer", "activations", "workspace", "comm",
                          "host_offload", "checkpoints", "data"}) {
    EXPECT_TRUE(j["planned"]["peak_by_category"][cat].is_number_integer()) << cat;
    EXPECT_TRUE(j["planned"]["host_peak_by_category"][cat].is_number_integer()) << cat;
  }
  EXPECT_GT(j["planned"]["peak_by_category"]["params"].get<int64_t>(), 0);
  // `plan` reads no data: the data's host bytes are the run's to plan, once it has read them.
  EXPECT_EQ(j["planned"]["host_peak_by_category"]["data"].get<int64_t>(), 0);
  EXPECT_EQ(j["roles"].size(), 1u);
  EXPECT_EQ(j["roles"][0]["planned"], j["planned"]);
  EXPECT_TRUE(j["fits"].get<bool>());
  EXPECT_GT(j["throughput"]["tokens_per_s"].get<double>(), 0);
  EXPECT_EQ(j["throughput"]["tokens_per_step"].get<int64_t>(), 2 * 32);
}

TEST(CliPlan, TextShowsTheTableAndTheAssumption) {
  const CliRun r = run_shardlm("plan --config " + config_file() + kSmall + " --gpu-mem 1");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  for (const char* s : {"params", "activations", "total (peak)",
                        "device --gpu-mem (1.00 GiB): fits", "TFLOP/s", "one rank", "#"})
    EXPECT_NE(r.out.find(s), std::string::npos) << s << " missing from:\n" << r.out;
}

// DPO's reference lines: under pipeline stages each names its sweep's fill and drain (LoRA's in
// every step, full fine-tuning's once for the pass), and --json carries the figure.
TEST(CliPlan, DpoReferenceLinesCountThePipelineSweepsFillAndDrain) {
  const std::string base = "plan --world 2 --config " + config_file() +
                           " --set model.n_layers=2 --set data.seq_len=32 --set train.micro_batch=1"
                           " --set train.grad_accum=4 --set train.objective=dpo";
  for (const char* lora : {" --set lora.rank=4", ""}) {
    SCOPED_TRACE(lora);
    const std::string line = *lora != 0 ? "dpo with LoRA" : "dpo with full fine-tuning";
    const CliRun flat = run_shardlm(base + lora);
    ASSERT_EQ(flat.exit_code, 0) << flat.err;
    EXPECT_NE(flat.out.find(line), std::string::npos) << flat.out;
    EXPECT_EQ(flat.out.find("fill and drain"), std::string::npos) << flat.out;
    const CliRun staged = run_shardlm(base + lora + " --set parallel.pp=2");
    ASSERT_EQ(staged.exit_code, 0) << staged.err;
    const size_t at = staged.out.find(line);
    ASSERT_NE(at, std::string::npos) << staged.out;
    const std::string rest = staged.out.substr(at, staged.out.find('\n', at) - at);
    EXPECT_NE(rest.find("fill and drain through the pipeline stages"), std::string::npos) << rest;
    const CliRun j = run_shardlm(base + lora + " --set parallel.pp=2 --json");
    ASSERT_EQ(j.exit_code, 0) << j.err;
    EXPECT_GT(json::parse(j.out)["throughput"]["reference_fill_s"].get<double>(), 0);
  }
}

// Several GPU ranks on NCCL: the plan says its figures leave NCCL's buffers to the run; one
// rank, or device tensors staged through the host, have none to leave out.
TEST(CliPlan, SaysNcclBuffersAreMeasuredByTheRun) {
  const std::string base = "plan --config " + config_file() + kSmall + " --set train.device=cuda";
  const CliRun nccl = run_shardlm(base + " --world 2");
  ASSERT_EQ(nccl.exit_code, 0) << nccl.err;
  EXPECT_NE(nccl.out.find("NCCL's own buffers are not in these figures"), std::string::npos)
      << nccl.out;
  for (const std::string& other : {base, base + " --world 2 --set parallel.device_comm=host"}) {
    const CliRun r = run_shardlm(other);
    ASSERT_EQ(r.exit_code, 0) << r.err;
    EXPECT_EQ(r.out.find("NCCL"), std::string::npos) << other << "\n" << r.out;
  }
}

TEST(CliPlan, ContextParallelOverFourRanks) {
  const CliRun r =
      run_shardlm("plan --json --world 4 --set parallel.cp=4 --config " + config_file() + kSmall);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const json j = json::parse(r.out);
  EXPECT_EQ(j["grid"]["cp"].get<int>(), 4);
  EXPECT_EQ(j["grid"]["dp"].get<int>(), 1);
  const CliRun text =
      run_shardlm("plan --world 4 --set parallel.cp=4 --config " + config_file() + kSmall);
  ASSERT_EQ(text.exit_code, 0) << text.err;
  EXPECT_NE(text.out.find("all 4 ranks are alike"), std::string::npos) << text.out;
}

TEST(CliPlan, WorldThatDoesNotFactorExitsTwoNamingTheKey) {
  const CliRun r = run_shardlm("plan --world 3 --set parallel.cp=2 --config " + config_file());
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("parallel.cp"), std::string::npos) << r.err;
}

TEST(CliPlan, TooSmallBudgetsExitFour) {
  CliRun r = run_shardlm("plan --config " + config_file() + kSmall + " --gpu-mem 0.0001");
  EXPECT_EQ(r.exit_code, 4) << r.err;
  EXPECT_NE(r.out.find("DOES NOT FIT"), std::string::npos) << r.out;
  EXPECT_NE(r.err.find("exceeds --gpu-mem"), std::string::npos) << r.err;
  r = run_shardlm("plan --config " + config_file() + kSmall + " --set memory.budget_gib=0.0001");
  EXPECT_EQ(r.exit_code, 4) << r.err;
  EXPECT_NE(r.err.find("memory.budget_gib"), std::string::npos) << r.err;
  r = run_shardlm("plan --json --config " + config_file() + kSmall +
                  " --set zero.offload_optimizer=cpu --set zero.stage=1 --host-mem 0.00001");
  EXPECT_EQ(r.exit_code, 4) << r.err;
  EXPECT_FALSE(json::parse(r.out)["fits"].get<bool>());
}

// The end-of-run sample runs on rank 0 alone after the training buffers are released: its plan
// (the whole model and a key/value cache) is shown apart and held against the device budget, by
// `plan` and by `train` before anything is allocated. Llama-3.1-8B with ZeRO-3 offload fits
// 10 GiB per rank to train but not whole to sample.
TEST(CliPlan, EndOfRunSampleIsPlannedApartAndRefusedOverBudget) {
  CliRun r = run_shardlm("plan --json --config " + config_file() + kSmall);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_FALSE(json::parse(r.out).contains("sample"));
  r = run_shardlm("plan --json --config " + config_file() + kSmall + " --set sample.prompt=\"In\"");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const json j = json::parse(r.out);
  EXPECT_GT(j["sample"]["peak_bytes"]["device"].get<int64_t>(), 0);
  EXPECT_GT(j["sample"]["peak_by_category"]["params"].get<int64_t>(), 0);

  const std::string eight_b =
      " --set model.preset=\"llama3.1-8b\" --set precision.param=\"bf16\" --set "
      "data.seq_len=2048 --set train.micro_batch=1 --set sample.prompt=\"In\" --set "
      "zero.stage=3 --set zero.offload_optimizer=\"cpu\" --set zero.offload_params=\"cpu\" "
      "--set memory.checkpointing=\"full\"";
  r = run_shardlm("plan --config " + config_file() + eight_b + " --world 8 --gpu-mem 10");
  EXPECT_EQ(r.exit_code, 4) << r.err;
  EXPECT_NE(r.out.find("device --gpu-mem (10.00 GiB): fits"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("end-of-run sample"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("DOES NOT FIT --gpu-mem"), std::string::npos) << r.out;
  EXPECT_NE(r.err.find("sample.count = 0"), std::string::npos) << r.err;
  // --fit cannot change the sample's memory: it says so instead of choosing a configuration.
  r = run_shardlm("plan --config " + config_file() + eight_b + " --world 8 --gpu-mem 10 --fit");
  EXPECT_EQ(r.exit_code, 4) << r.err;
  EXPECT_NE(r.out.find("DOES NOT FIT --gpu-mem"), std::string::npos) << r.out;
  EXPECT_NE(r.err.find("the same whatever the grid"), std::string::npos) << r.err;
  r = run_shardlm("train --config " + config_file() + eight_b +
                  " --set memory.budget_gib=10 --set log.dir=\"" +
                  (shardlm::test::scratch_root() / "shardlm_plan_sample_refused").string() + "\"");
  EXPECT_EQ(r.exit_code, 4) << r.err;
  EXPECT_NE(r.err.find("the end-of-run sample needs"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("sample.count = 0"), std::string::npos) << r.err;
}

TEST(CliPlan, BadKeyExitsTwoNamingIt) {
  const CliRun r = run_shardlm("plan --config " + config_file() + " --set train.learning_rate=1");
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("train.learning_rate"), std::string::npos) << r.err;
}

TEST(CliPlan, PresetsPlanWithoutAllocatingTheModel) {
  for (const char* preset : {"llama3.1-8b", "llama3.1-70b"}) {
    const CliRun r = run_shardlm(std::string("plan --json --world 8 --config ") + config_file() +
                                 " --set model.preset=" + preset +
                                 " --set data.seq_len=8192 --set precision.param=bf16"
                                 " --set zero.stage=3 --set memory.checkpointing=full");
    ASSERT_EQ(r.exit_code, 0) << preset << ": " << r.err;
    EXPECT_GT(json::parse(r.out)["model"]["parameters"].get<int64_t>(), int64_t{7'000'000'000});
  }
}

}  // namespace
