// The planner against the ledger over a grid of configurations: for each, `shardlm plan
// --json --world N` predicts one rank's peaks before launch, then `shardlm train` runs two
// steps (under mpiexec when N > 1) and every rank's memory_rank{R}.json holds what its ledger
// measured. Per pool the predicted peak must be within 3% of the measured one, per category
// within 5% (the planner is exact today; the tolerances are the contract), the data's host bytes
// apart: `plan` reads no data, and the run's own plan of them must equal its ledger. Also: `plan
// --fit` on a budget picks a configuration that, run, stays under the budget on every rank, and
// for DPO measures exactly the plan it was chosen by.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "integration/tiny_runs.h"
#include "test_util.h"
#include "tiny_gemma.h"

namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

std::string slurp(const fs::path& p) {
  std::ifstream f(p);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// A scratch directory per test process (CTest runs the grid's cases in parallel).
fs::path scratch(const std::string& name) {
  const fs::path dir =
      shardlm::test::scratch_root() / ("shardlm_plan_grid_" + std::to_string(getpid())) / name;
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

struct CmdResult {
  int exit_code;
  std::string out;
};

// One thread per rank: the CPU backend's attention scratch is per thread, and the plan is
// made for the thread count the run has.
CmdResult run(const std::string& cmd, const fs::path& dir) {
  const fs::path out = dir / "out.txt";
  const std::string full =
      "OMP_NUM_THREADS=1 OMPI_ALLOW_RUN_AS_ROOT=1 "
      "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 " +
      cmd + " > " + out.string() + " 2>&1";
  const int status = std::system(full.c_str());
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, slurp(out)};
}

std::string launcher(int world) {
  if (world == 1) return SHARDLM_BINARY;
  return shardlm::test::mpiexec() + " -n " + std::to_string(world) +
         " --oversubscribe --mca mpi_yield_when_idle 1 --bind-to none " + SHARDLM_BINARY;
}

std::string config_file(const fs::path& dir) {
  const fs::path p = dir / "config.json";
  std::ofstream(p) << R"({"data": {"train": ")" << SHARDLM_SOURCE_DIR
                   << R"(/tests/data/genesis_1_12.txt"},
  "model": {"n_layers": 2}, "train": {"max_steps": 2, "eval_every": 0, "eval_batches": 1},
  "sample": {"count": 0}})";
  return p.string();
}

struct GridCase {
  const char* name;
  int world;
  std::string sets;
};

std::string base_sets(int micro, bool bf16) {
  return " --set data.seq_len=32 --set train.micro_batch=" + std::to_string(micro) +
         (bf16 ? " --set precision.param=bf16" : "");
}

std::vector<GridCase> grid() {
  std::vector<GridCase> g;
  // One rank: every checkpointing policy, fp32 and bf16, micro-batch 1 and 2.
  static const char* const kCkpt[][2] = {
      {"none", ""},
      {"selective", " --set memory.checkpointing=selective"},
      {"full", " --set memory.checkpointing=full"},
      {"full_offload", " --set memory.checkpointing=full --set memory.offload_checkpoints=true"},
      {"selective_offload",
       " --set memory.checkpointing=selective --set memory.offload_checkpoints=true"},
  };
  static std::vector<std::string> names;  // GridCase holds const char*
  names.reserve(200);
  auto add = [&](std::string name, int world, std::string sets) {
    names.push_back(std::move(name));
    g.push_back({names.back().c_str(), world, std::move(sets)});
  };
  for (const auto& ck : kCkpt)
    for (const bool bf16 : {false, true})
      for (const int micro : {1, 2})
        add(std::string("w1_") + ck[0] + (bf16 ? "_bf16" : "_fp32") + "_mb" + std::to_string(micro),
            1, base_sets(micro, bf16) + ck[1]);
  // One rank with the MLP cut into chunks, and ZeRO-3 with offload (a world of one).
  add("w1_mlp_chunk", 1, base_sets(2, false) + " --set memory.mlp_chunk_tokens=24");
  add("w1_zero3_offload", 1,
      base_sets(1, true) +
          " --set zero.stage=3 --set zero.offload_optimizer=cpu --set zero.offload_params=cpu");
  // Gradients streamed to the host (stage >= 2, optimizer offloaded), accumulated over two
  // micro-batches; bf16 reductions into the device shard and streamed.
  add("w1_zero2_offload_bf16_accum2", 1,
      base_sets(1, true) +
          " --set zero.stage=2 --set zero.offload_optimizer=cpu --set train.grad_accum=2");
  add("w1_zero2_bf16_wire", 1,
      base_sets(2, false) + " --set zero.stage=2 --set zero.reduce_dtype=bf16");
  add("w1_zero3_offload_bf16_wire", 1,
      base_sets(1, true) +
          " --set zero.stage=3 --set zero.offload_optimizer=cpu --set zero.offload_params=cpu "
          "--set zero.reduce_dtype=bf16 --set train.grad_accum=2");
  add("dp2_zero2_offload_bf16_wire", 2,
      base_sets(1, true) +
          " --set zero.stage=2 --set zero.offload_optimizer=cpu --set zero.reduce_dtype=bf16");
  // Two data-parallel ranks: every ZeRO stage, with and without offload, fp32 and bf16.
  for (int stage = 0; stage <= 3; ++stage)
    for (const bool bf16 : {false, true}) {
      const std::string z = " --set zero.stage=" + std::to_string(stage);
      add("dp2_zero" + std::to_string(stage) + (bf16 ? "_bf16" : "_fp32"), 2,
          base_sets(1, bf16) + z);
      add("dp2_zero" + std::to_string(stage) + "_offload" + (bf16 ? "_bf16" : "_fp32"), 2,
          base_sets(2, bf16) + z + " --set zero.offload_optimizer=cpu" +
              (stage == 3 ? " --set zero.offload_params=cpu" : ""));
    }
  add("dp2_zero3_prefetch2_full", 2,
      base_sets(2, true) +
          " --set zero.stage=3 --set zero.prefetch_layers=2 --set memory.checkpointing=full");
  // Context parallelism, each kind, with checkpointing and its offload.
  for (const char* kind : {"ulysses", "ring"})
    for (const auto& ck : {kCkpt[0], kCkpt[1], kCkpt[3]})
      add(std::string("cp2_") + kind + "_" + ck[0], 2,
          base_sets(1, false) + " --set parallel.cp=2 --set parallel.cp_kind=" + kind + ck[1]);
  add("cp2_ring_zero3_bf16_mb2", 2,
      base_sets(2, true) + " --set parallel.cp=2 --set parallel.cp_kind=ring --set zero.stage=3");
  for (const char* kind : {"ulysses", "ring", "hybrid"})
    add(std::string("cp4_") + kind, 4,
        base_sets(1, false) + " --set parallel.cp=4 --set parallel.cp_kind=" + kind);
  add("cp4_hybrid_full_offload_bf16", 4,
      base_sets(2, true) +
          " --set parallel.cp=4 --set parallel.cp_kind=hybrid --set memory.checkpointing=full "
          "--set memory.offload_checkpoints=true");
  add("dp2_cp2_ulysses_zero2", 4,
      base_sets(1, false) +
          " --set parallel.cp=2 --set parallel.cp_kind=ulysses --set zero.stage=2");
  add("dp2_cp2_ring_zero3_offload", 4,
      base_sets(2, true) +
          " --set parallel.cp=2 --set parallel.cp_kind=ring --set zero.stage=3 "
          "--set zero.offload_optimizer=cpu --set memory.checkpointing=selective");
  // Tensor parallelism: each rank plans and holds its shard (tiny's 2 kv heads: tp = 2), with
  // sequence parallelism (the default) and without.
  add("tp2", 2, base_sets(2, false));
  g.back().sets += " --set parallel.tp=2";
  add("tp2_no_sequence_parallel", 2,
      base_sets(2, false) + " --set parallel.tp=2 --set parallel.sequence_parallel=false");
  add("tp2_selective_bf16", 2,
      base_sets(1, true) + " --set parallel.tp=2 --set memory.checkpointing=selective");
  add("dp2_tp2_zero1", 4, base_sets(1, false) + " --set parallel.tp=2 --set zero.stage=1");
  add("dp2_tp2_zero3_offload", 4,
      base_sets(2, true) +
          " --set parallel.tp=2 --set zero.stage=3 --set zero.offload_optimizer=cpu "
          "--set memory.checkpointing=full");
  add("cp2_tp2_ring_zero2", 4,
      base_sets(1, false) +
          " --set parallel.tp=2 --set parallel.cp=2 --set parallel.cp_kind=ring --set "
          "zero.stage=2");
  // Gemma's post-norms under tp: the MLP's summed output kept on each rank's rows (sequence
  // parallelism) or a chunk's recomputed (without).
  add("tp2_gemma3_full_bf16", 2,
      base_sets(2, true) + " " + shardlm::test::kTinyGemma3 +
          "--set parallel.tp=2 --set memory.checkpointing=full");
  add("dp2_tp2_gemma2_zero3_no_sequence_parallel", 4,
      base_sets(1, false) + " " + shardlm::test::kTinyGemma2 +
          "--set parallel.tp=2 --set parallel.sequence_parallel=false --set zero.stage=3 "
          "--set memory.checkpointing=selective");
  // Pipeline parallelism: each stage plans its layers, its micro-batches in flight and the
  // executor's buffers (4 layers, 4 micro-batches).
  const std::string pp = " --set model.n_layers=4 --set train.grad_accum=4 --set parallel.pp=";
  add("pp2", 2, base_sets(1, false) + pp + "2");
  add("pp4_selective_bf16", 4, base_sets(1, true) + pp + "4 --set memory.checkpointing=selective");
  add("dp2_pp2_zero3_full", 4,
      base_sets(2, false) + pp + "2 --set zero.stage=3 " + "--set memory.checkpointing=full");
  add("pp2_tp2_zero2_offload", 4,
      base_sets(1, true) + pp + "2 --set parallel.tp=2 --set zero.stage=2 " +
          "--set zero.offload_optimizer=cpu");
  add("pp4_tied_zero2", 4,
      base_sets(1, false) + pp + "4 --set model.tie_embeddings=true --set zero.stage=2");
  add("pp2_cp2_ring_zero1", 4,
      base_sets(1, false) + pp + "2 --set parallel.cp=2 --set parallel.cp_kind=ring " +
          "--set zero.stage=1");
  // LoRA: a frozen replicated base, the f32 adapters in the ZeRO engine, with dropout.
  const std::string lora = " --set lora.rank=4 --set lora.targets=all --set lora.dropout=0.1";
  add("w1_lora_bf16_selective", 1,
      base_sets(2, true) + lora + " --set memory.checkpointing=selective");
  add("dp2_lora_zero3_offload", 2,
      base_sets(1, true) + lora +
          " --set zero.stage=3 --set zero.offload_optimizer=cpu --set zero.offload_params=cpu");
  add("cp2_ring_lora_zero2", 2,
      base_sets(1, false) + lora +
          " --set parallel.cp=2 --set parallel.cp_kind=ring --set zero.stage=2");
  // Pipeline stages with placements (a set per micro-batch in flight, host places included)
  // and with LoRA (each stage's base and adapters).
  add("pp2_full_every2_half_offload", 2,
      base_sets(1, false) + pp +
          "2 --set memory.checkpointing=full --set memory.checkpoint_every=2 "
          "--set memory.offload_checkpoints=0.5");
  add("pp4_selective_offload_bf16", 4,
      base_sets(1, true) + pp + "4 --set memory.checkpointing=selective " +
          "--set memory.offload_checkpoints=true");
  add("pp2_lora_offload_base_zero3", 2,
      base_sets(1, true) + pp + "2" + lora +
          " --set lora.offload_base=true --set zero.stage=3 --set memory.checkpointing=full "
          "--set memory.offload_checkpoints=true");
  // A dense base sharded by ZeRO 3: a chunk of each layer a rank, a layer gathered on use (on
  // the device, or staged from host memory), also per tp shard and per pipeline stage.
  add("dp4_lora_bf16_zero3", 4, base_sets(1, true) + lora + " --set zero.stage=3");
  add("dp2_lora_zero3_base_on_host", 2,
      base_sets(1, false) + lora + " --set zero.stage=3 --set lora.offload_base=true");
  add("dp2_tp2_lora_bf16_zero3_base_on_host", 4,
      base_sets(1, true) + lora +
          " --set parallel.tp=2 --set zero.stage=3 --set lora.offload_base=true");
  add("dp2_pp2_lora_zero3", 4, base_sets(1, false) + pp + "2" + lora + " --set zero.stage=3");
  add("cp2_ulysses_lora_zero3", 2,
      base_sets(1, true) + lora +
          " --set parallel.cp=2 --set parallel.cp_kind=ulysses --set zero.stage=3");
  // QLoRA: the base's projections in NF4, one layer dequantized on use.
  add("dp2_qlora_bf16_zero3_full", 2,
      base_sets(1, true) + lora +
          " --set lora.base_dtype=nf4 --set zero.stage=3 --set memory.checkpointing=full");
  add("dp2_qlora_base_on_host_zero2", 2,
      base_sets(1, false) + lora +
          " --set lora.base_dtype=nf4 --set lora.offload_base=true --set zero.stage=2");
  // LoRA under tp: each rank holds its shard of the base and of the split adapters.
  add("dp2_tp2_lora_zero3", 4,
      base_sets(1, true) + lora + " --set parallel.tp=2 --set zero.stage=3");
  // QLoRA split: each tp rank's shard of the NF4 projections (sharded again by ZeRO 3 over
  // dp = 2), each pipeline stage's layers' codes.
  add("dp2_tp2_qlora_zero3", 4,
      base_sets(1, true) + lora +
          " --set lora.base_dtype=nf4 --set parallel.tp=2 --set zero.stage=3");
  add("tp2_qlora_base_on_host", 2,
      base_sets(1, false) + lora +
          " --set lora.base_dtype=nf4 --set parallel.tp=2 --set lora.offload_base=true");
  // The NF4 codes sharded by ZeRO 3 in host memory, a chunk staged with the layer's dense parts.
  add("dp2_qlora_base_on_host_zero3", 2,
      base_sets(1, true) + lora +
          " --set lora.base_dtype=nf4 --set lora.offload_base=true --set zero.stage=3");
  add("pp2_qlora_zero1", 2,
      base_sets(1, false) + pp + "2" + lora + " --set lora.base_dtype=nf4 --set zero.stage=1");
  // LoRA on stages split by tp: each (stage, tp shard) plans its base and adapters.
  add("pp2_tp2_lora_zero2", 4,
      base_sets(1, true) + pp + "2 --set parallel.tp=2" + lora + " --set zero.stage=2");
  add("pp2_tp2_qlora_base_on_host", 4,
      base_sets(1, false) + pp + "2 --set parallel.tp=2" + lora +
          " --set lora.base_dtype=nf4 --set lora.offload_base=true");
  return g;
}

void PrintTo(const GridCase& c, std::ostream* os) { *os << c.name << " (" << c.world << " ranks)"; }

class PlanGrid : public ::testing::TestWithParam<GridCase> {};

void expect_within(int64_t planned, int64_t measured, double tol, const std::string& what) {
  const double diff = std::abs(double(planned - measured));
  EXPECT_LE(diff, tol * double(std::max<int64_t>(measured, 1)))
      << what << ": planned " << planned << ", measured " << measured;
}

TEST_P(PlanGrid, PlannedPeaksMatchEveryRanksLedger) {
  const GridCase& c = GetParam();
  const fs::path dir = scratch(c.name);
  const std::string cfg = config_file(dir);
  const CmdResult plan = run(std::string(SHARDLM_BINARY) + " plan --json --world " +
                                 std::to_string(c.world) + " --config " + cfg + c.sets,
                             dir);
  ASSERT_EQ(plan.exit_code, 0) << plan.out;
  const json report = json::parse(plan.out);
  const fs::path log = dir / "run";
  const CmdResult train =
      run(launcher(c.world) + " train --config " + cfg + c.sets + " --set log.dir=" + log.string(),
          dir);
  ASSERT_EQ(train.exit_code, 0) << train.out;
  for (int r = 0; r < c.world; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    const json m = json::parse(slurp(log / ("memory_rank" + std::to_string(r) + ".json")));
    // Under pipeline parallelism each stage is a role with a plan of its own (pp slowest in
    // the rank order: rank r is in stage r / (world / pp)).
    const json& roles = report["roles"];
    const json& p = roles.size() > 1 ? roles[size_t(r / (c.world / int(roles.size())))]["planned"]
                                     : report["planned"];
    // `plan` reads no data, so it plans none of the data's host bytes (category data: the
    // run plans them once it has read the data, and memory_rank{R}.json's own plan holds them,
    // checked against the ledger by the suites that train); the rest is compared here.
    EXPECT_EQ(p["host_peak_by_category"]["data"].get<int64_t>(), 0);
    const int64_t data = m["host_peak_by_category"]["data"].get<int64_t>();
    EXPECT_EQ(m["planned"]["host_peak_by_category"]["data"].get<int64_t>(), data);
    for (const char* pool : {"device", "host"})
      expect_within(p["peak_bytes"][pool].get<int64_t>(),
                    m["peak_bytes"][pool].get<int64_t>() - (pool == std::string("host") ? data : 0),
                    0.03, std::string(pool) + " peak");
    for (const auto& [section, pool] :
         {std::pair{"peak_by_category", "device"}, std::pair{"host_peak_by_category", "host"}})
      for (const auto& [cat, measured] : m[section].items())
        if (cat != "data" || section == std::string("peak_by_category"))
          expect_within(p[section][cat].get<int64_t>(), measured.get<int64_t>(), 0.05,
                        std::string(pool) + " " + cat);
  }
  // The run prints the same comparison at its end.
  EXPECT_NE(train.out.find("memory, planned vs measured peak"), std::string::npos) << train.out;
}

INSTANTIATE_TEST_SUITE_P(Grid, PlanGrid, ::testing::ValuesIn(grid()),
                         [](const ::testing::TestParamInfo<GridCase>& info) {
                           return std::string(info.param.name);
                         });

TEST(PlanGridSize, HasAtLeastFortyConfigurations) { EXPECT_GE(grid().size(), 40u); }

// --fit on a budget between the smallest and the largest plan: the chosen configuration,
// written whole by --fit-output and run as it is, stays under the budget on every rank.
TEST(PlanFit, ChosenConfigurationRunsWithinTheBudget) {
  const fs::path dir = scratch("fit");
  const std::string cfg = config_file(dir);
  const int world = 2;
  const std::string sets = " --set data.seq_len=64 --set train.micro_batch=4";
  // The given configuration's own peak, and a budget 25% under it.
  const CmdResult plan =
      run(std::string(SHARDLM_BINARY) + " plan --json --world 2 --config " + cfg + sets, dir);
  ASSERT_EQ(plan.exit_code, 0) << plan.out;
  const int64_t given = json::parse(plan.out)["planned"]["peak_bytes"]["device"].get<int64_t>();
  const double budget_gib = 0.75 * double(given) / double(int64_t{1} << 30);
  const fs::path chosen = dir / "chosen.json";
  const CmdResult fit =
      run(std::string(SHARDLM_BINARY) + " plan --fit --json --world 2 --config " + cfg + sets +
              " --gpu-mem " + std::to_string(budget_gib) + " --fit-output " + chosen.string(),
          dir);
  ASSERT_EQ(fit.exit_code, 0) << fit.out;
  const json f = json::parse(fit.out);
  ASSERT_TRUE(f["fits"].get<bool>());
  EXPECT_GT(f["searched"].get<int64_t>(), 100);
  EXPECT_FALSE(f["chosen"]["set"].get<std::string>().empty());  // the given config did not fit
  const int64_t budget = int64_t(budget_gib * double(int64_t{1} << 30));
  EXPECT_LE(f["chosen"]["planned"]["peak_bytes"]["device"].get<int64_t>(), budget);
  // Every runner-up says why it lost.
  for (const json& r : f["runner_ups"]) EXPECT_FALSE(r["why"].get<std::string>().empty());

  const fs::path log = dir / "run";
  const CmdResult train = run(launcher(world) + " train --config " + chosen.string() +
                                  " --set log.dir=" + log.string() + " --set train.resume=none",
                              dir);
  ASSERT_EQ(train.exit_code, 0) << train.out;
  for (int r = 0; r < world; ++r) {
    const json m = json::parse(slurp(log / ("memory_rank" + std::to_string(r) + ".json")));
    EXPECT_LE(m["peak_bytes"]["device"].get<int64_t>(), budget) << "rank " << r;
  }
}

// A rank's measured peaks against a plan that read no data (`plan`, `plan --fit`): equal in every
// category of both pools, the data's host bytes apart, which the run's own plan holds.
void expect_run_is_plan(const json& planned, const json& measured) {
  EXPECT_EQ(planned["host_peak_by_category"]["data"].get<int64_t>(), 0);
  const int64_t data = measured["host_peak_by_category"]["data"].get<int64_t>();
  EXPECT_EQ(measured["planned"]["host_peak_by_category"]["data"].get<int64_t>(), data);
  EXPECT_EQ(planned["peak_by_category"], measured["peak_by_category"]);
  for (const auto& [cat, bytes] : measured["host_peak_by_category"].items())
    if (cat != "data") {
      EXPECT_EQ(planned["host_peak_by_category"][cat], bytes) << "host " << cat;
    }
  EXPECT_EQ(planned["peak_bytes"]["device"], measured["peak_bytes"]["device"]);
  EXPECT_EQ(planned["peak_bytes"]["host"].get<int64_t>(),
            measured["peak_bytes"]["host"].get<int64_t>() - data);
}

// --fit for DPO, with LoRA (the reference is the adapters-off forward) and with full fine-tuning
// (the reference table's start-up pass): on budgets of three quarters and three tenths of the
// given configuration's peak, the chosen layout, written by --fit-output and run for two steps and
// an evaluation on 2 ranks, measures on every rank the plan --fit chose it by, category by
// category.
TEST(PlanFit, DpoChoicesRunAsPlanned) {
  const fs::path pairs = shardlm::test::write_pairs_file("plan_grid_pairs.jsonl");
  const int world = 2;
  for (const char* lora : {" --set lora.rank=4", ""}) {
    SCOPED_TRACE(*lora != 0 ? "LoRA" : "full fine-tuning");
    const fs::path dir = scratch(*lora != 0 ? "fit_dpo_lora" : "fit_dpo_full");
    const std::string sets = " --set data.train=" + pairs.string() +
                             " --set data.packing=samples --set train.objective=dpo"
                             " --set data.seq_len=64 --set train.micro_batch=4" +
                             lora;
    const std::string cfg = config_file(dir);
    const CmdResult plan =
        run(std::string(SHARDLM_BINARY) + " plan --json --world 2 --config " + cfg + sets, dir);
    ASSERT_EQ(plan.exit_code, 0) << plan.out;
    const int64_t given = json::parse(plan.out)["planned"]["peak_bytes"]["device"].get<int64_t>();
    bool split = false;  // some choice splits the model or the rows (tp or cp), not only the batch
    for (const double share : {0.75, 0.3}) {
      SCOPED_TRACE(share);
      const std::string budget_gib = std::to_string(share * double(given) / double(1 << 30));
      const fs::path chosen = dir / ("chosen_" + std::to_string(int(share * 100)) + ".json");
      const CmdResult fit =
          run(std::string(SHARDLM_BINARY) + " plan --fit --json --world 2 " + "--config " + cfg +
                  sets + " --gpu-mem " + budget_gib + " --fit-output " + chosen.string(),
              dir);
      ASSERT_EQ(fit.exit_code, 0) << fit.out;
      const json f = json::parse(fit.out);
      ASSERT_TRUE(f["fits"].get<bool>());
      const json c = json::parse(slurp(chosen));
      const json parallel = c.value("parallel", json::object());
      split = split || parallel.value("tp", 1) > 1 || parallel.value("cp", 1) > 1;
      // Without stages every rank has the chosen plan; with them each stage its own, and the
      // search judged the fullest.
      std::vector<json> roles{f["chosen"]["planned"]};
      if (parallel.value("pp", 1) > 1) {
        const CmdResult staged = run(
            std::string(SHARDLM_BINARY) + " plan --json --world 2 " + "--config " + chosen.string(),
            dir);
        ASSERT_EQ(staged.exit_code, 0) << staged.out;
        roles.clear();
        for (const json& r : json::parse(staged.out)["roles"]) roles.push_back(r["planned"]);
      }
      const fs::path log = dir / ("run_" + std::to_string(int(share * 100)));
      const CmdResult train = run(launcher(world) + " train --config " + chosen.string() +
                                      " --set log.dir=" + log.string() + " --set train.resume=none",
                                  dir);
      ASSERT_EQ(train.exit_code, 0) << train.out;
      EXPECT_NE(train.out.find("eval loss"), std::string::npos) << train.out;
      for (int r = 0; r < world; ++r) {
        SCOPED_TRACE("rank " + std::to_string(r));
        const json m = json::parse(slurp(log / ("memory_rank" + std::to_string(r) + ".json")));
        expect_run_is_plan(roles[size_t(r / (world / int(roles.size())))], m);
      }
    }
    EXPECT_TRUE(split);
  }
}

// --fit-output writes every path absolute, as the config meant it: a file's relative path
// against the file's directory (the config given by a relative path), a --set one against the
// working directory.
TEST(PlanFit, FitOutputPathsResolveAsTheConfigMeantThem) {
  const fs::path dir = scratch("fit_paths");
  fs::create_directories(dir / "configs");
  fs::copy_file(fs::path(SHARDLM_SOURCE_DIR) / "tests/data/genesis_1_12.txt", dir / "text.txt",
                fs::copy_options::overwrite_existing);
  std::ofstream(dir / "configs/c.json") << R"({"data": {"train": "../text.txt"},
  "model": {"n_layers": 2}, "train": {"max_steps": 1, "eval_every": 0, "eval_batches": 1}})";
  const CmdResult fit = run("cd " + dir.string() + " && " + SHARDLM_BINARY +
                                " plan --fit --gpu-mem 1 --config configs/c.json"
                                " --set log.dir=\\\"runs/a\\\" --fit-output chosen.json",
                            dir);
  ASSERT_EQ(fit.exit_code, 0) << fit.out;
  const json chosen = json::parse(slurp(dir / "chosen.json"));
  const fs::path root = fs::weakly_canonical(dir);
  EXPECT_EQ(fs::path(chosen["data"]["train"].get<std::string>()), root / "text.txt");
  EXPECT_EQ(fs::path(chosen["log"]["dir"].get<std::string>()), root / "runs/a");
}

// A budget under every configuration's peak: nothing fits, exit 4, the closest shown.
TEST(PlanFit, NothingFitsExitsFour) {
  const fs::path dir = scratch("fit_none");
  const CmdResult fit = run(std::string(SHARDLM_BINARY) + " plan --fit --config " +
                                config_file(dir) + " --set data.seq_len=64 --gpu-mem 0.0001",
                            dir);
  EXPECT_EQ(fit.exit_code, 4) << fit.out;
  EXPECT_NE(fit.out.find("nothing fits the budget"), std::string::npos) << fit.out;
  EXPECT_NE(fit.out.find("does not fit: device peak"), std::string::npos) << fit.out;
}

// Under mpiexec every rank refuses an over-budget plan with the label one process prints
// ("out of memory"), which scripts (bench/long_context.sh) look for, and exit code 4.
TEST(PlanFit, RanksRefuseAnOverBudgetPlanAsOutOfMemory) {
  const fs::path dir = scratch("refuse_mpi");
  const CmdResult r =
      run(launcher(2) + " train --dry-run --config " + config_file(dir) +
              " --set memory.budget_gib=0.0001 --set log.dir=" + (dir / "run").string(),
          dir);
  EXPECT_EQ(r.exit_code, 4) << r.out;
  EXPECT_NE(r.out.find("rank 0 of 2: out of memory: the plan"), std::string::npos) << r.out;
}

TEST(PlanFit, NeedsABudget) {
  const fs::path dir = scratch("fit_budget");
  const CmdResult fit =
      run(std::string(SHARDLM_BINARY) + " plan --fit --config " + config_file(dir), dir);
  EXPECT_EQ(fit.exit_code, 2) << fit.out;
  EXPECT_NE(fit.out.find("--gpu-mem"), std::string::npos) << fit.out;
}

}  // namespace
