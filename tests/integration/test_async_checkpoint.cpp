// Asynchronous checkpoints (checkpoint.async) through the binary: a save written in the
// background holds the state of its step bit for bit (the synchronous save's bytes) and a resume
// from it continues bitwise as the uninterrupted run, on 1 and 2 ranks at ZeRO 1 and 3 and with a
// snapshot budget that leaves some vectors to the save step; the snapshot is the plan's
// (memory_rank*.json); a rank SIGKILLed at several moments of a save in flight leaves `latest` on a
// checkpoint that verifies and resumes; a SIGTERM with a save in flight commits it before the
// stop's own checkpoint. The moments are chosen from outside: each rank starts through a shell
// wrapper whose watcher waits for a path of the step directory to appear, then signals the rank
// (the wrapper execs the binary, so its pid is the rank's).
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <regex>
#include <string>
#include <vector>

#include "tiny_runs.h"

namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

using shardlm::test::checkpoint_vector;
using shardlm::test::metric_series;
using shardlm::test::rewind_run;
using shardlm::test::slurp;

constexpr int kSteps = 20;
const std::string kAsync = " --set checkpoint.async=true";

fs::path train(int ranks, int micro_batch, int grad_accum, const std::string& name,
               int steps = kSteps, bool fresh = true, const std::string& extra = "") {
  return shardlm::test::train_tiny(ranks, micro_batch, grad_accum, "shardlm_async_" + name, steps,
                                   fresh, extra);
}

// Every rank's measured memory, the snapshot included, is the plan's, category by category.
void expect_memory_as_planned(const fs::path& run, int ranks) {
  for (int r = 0; r < ranks; ++r) {
    const json mem = json::parse(slurp(run / ("memory_rank" + std::to_string(r) + ".json")));
    EXPECT_EQ(mem["peak_by_category"], mem["planned"]["peak_by_category"]) << "rank " << r;
  }
}

struct Grid {
  std::string name;
  int ranks, micro, accum;
  std::string extra;
};

// The async run trains as the synchronous one does and its step-10 checkpoint, written in the
// background while steps 11.. ran, holds the step-10 state byte for byte; resumed from it, the
// run repeats steps 11-20 exactly.
void check_async_resume(const Grid& g) {
  SCOPED_TRACE(g.name);
  const fs::path sync = train(g.ranks, g.micro, g.accum, g.name + "_sync", kSteps, true, g.extra);
  const fs::path async =
      train(g.ranks, g.micro, g.accum, g.name + "_async", kSteps, true, g.extra + kAsync);
  expect_memory_as_planned(async, g.ranks);
  const std::string out = slurp(async.parent_path() / "out.txt");
  EXPECT_NE(out.find("checkpoint: step 10: snapshot of"), std::string::npos) << out;
  EXPECT_NE(out.find("checkpoint: step 10: "), std::string::npos);
  EXPECT_NE(out.find("committed"), std::string::npos) << out;
  const bool budget = g.extra.find("async_snapshot_gib") != std::string::npos;
  EXPECT_EQ(out.find("(adam_m, adam_v written at the step") != std::string::npos, budget) << out;
  EXPECT_EQ(metric_series(async, "loss"), metric_series(sync, "loss"));
  const bool master = g.extra.find("bf16") != std::string::npos;
  for (const char* v : {"params", "adam_m", "adam_v", "master"}) {
    if (std::string(v) == "master" && !master) continue;
    EXPECT_TRUE(checkpoint_vector(async, 10, v) == checkpoint_vector(sync, 10, v))
        << v << ": the background write differs from the synchronous save of step 10";
  }

  const fs::path dir = shardlm::test::scratch_root() / ("shardlm_async_" + g.name + "_resumed");
  fs::remove_all(dir);
  fs::create_directories(dir);
  fs::copy(async, dir / "run", fs::copy_options::recursive);
  rewind_run(dir / "run", 10, kSteps);
  const fs::path resumed =
      train(g.ranks, g.micro, g.accum, g.name + "_resumed", kSteps, false, g.extra + kAsync);
  EXPECT_EQ(metric_series(resumed, "loss"), metric_series(async, "loss"));
  EXPECT_TRUE(checkpoint_vector(resumed, kSteps, "params") ==
              checkpoint_vector(async, kSteps, "params"))
      << "the resumed run's final parameters differ from the uninterrupted run's";
}

TEST(AsyncCheckpoint, ResumeContinuesBitwiseAsTheUninterruptedRun) {
  for (const Grid& g : {Grid{"one_z1", 1, 4, 2, "--set zero.stage=1"},
                        Grid{"one_z3", 1, 4, 2, "--set zero.stage=3"},
                        Grid{"two_z1", 2, 2, 2, "--set zero.stage=1"},
                        Grid{"two_z3_bf16", 2, 2, 2,
                             "--set zero.stage=3 --set precision.param=bf16 "
                             "--set zero.reduce_bucket_bytes=60000"},
                        // A snapshot budget that holds the parameters only (1.9 MB of 2.6): m
                        // and v are written at the save step.
                        Grid{"one_budget", 1, 4, 2,
                             "--set zero.stage=1 --set checkpoint.async_snapshot_gib=0.0025"}})
    check_async_resume(g);
}

// The snapshot is planned on any grid: tp and pp shards, LoRA's adapters, offloaded optimizer,
// a budget that holds some of the vectors.
TEST(AsyncCheckpoint, TheSnapshotIsThePlansOnEveryGrid) {
  for (const Grid& g :
       {Grid{"tp2pp2", 4, 2, 2, "--set parallel.tp=2 --set parallel.pp=2"},
        Grid{"lora_tp2", 2, 4, 2,
             "--set lora.rank=4 --set lora.alpha=8 --set parallel.tp=2 --set zero.stage=1"},
        Grid{"offload", 2, 2, 2,
             "--set zero.stage=3 --set zero.offload_optimizer=cpu --set precision.param=bf16"},
        Grid{"bf16_budget", 2, 2, 2,
             "--set zero.stage=2 --set precision.param=bf16 "
             "--set checkpoint.async_snapshot_gib=0.002"}}) {
    SCOPED_TRACE(g.name);
    const fs::path run = train(g.ranks, g.micro, g.accum, g.name, 12, true, g.extra + kAsync);
    expect_memory_as_planned(run, g.ranks);
    EXPECT_NO_THROW(shardlm::CheckpointReader((run / "checkpoints" / "step_00000010").string()));
  }
}

// $1: the rank to signal, $2: the signal, $3: the path whose appearance triggers it, $4 a later
// one that triggers it too (a temporary file may come and go between two looks on a loaded
// machine: the signal then comes at a later moment); the rest is the command to exec. A watcher
// that sees neither leaves the run alone.
constexpr const char* kWrapper = R"(#!/bin/sh
victim=$1 sig=$2 watch=$3 later=$4
shift 4
if [ "$OMPI_COMM_WORLD_RANK" = "$victim" ]; then
  (
    n=0
    while [ ! -e "$watch" ] && [ ! -e "$later" ]; do
      n=$((n + 1))
      [ $n -gt 20000 ] && exit 0
      sleep 0.005
    done
    kill -"$sig" $$
  ) > /dev/null 2>&1 < /dev/null &
fi
exec "$@"
)";

// The tiny model on 2 ranks in dir/run (resumed when it is there) to `max_steps`, an
// asynchronous checkpoint after every step.
std::string signal_run_args(const fs::path& dir, int max_steps) {
  return " train --config " + std::string(SHARDLM_SOURCE_DIR) + "/configs/demo.json" +
         " --set data.train=" + shardlm::test::kTinyCorpus +
         " --set data.seq_len=64 --set model.n_layers=2 --set train.max_steps=" +
         std::to_string(max_steps) +
         " --set train.micro_batch=2 --set train.grad_accum=1 --set train.eval_every=0" +
         " --set sample.count=0 --set checkpoint.every_steps=1 --set checkpoint.keep_last=2" +
         " --set zero.stage=3" + kAsync + " --set log.dir=" + (dir / "run").string();
}

// signal_run_args' run, with `sig` sent to rank `victim` once `watch` or `later` (relative to
// the checkpoints directory) exists. Bounded by a timeout, so a hang fails the test. Returns the
// exit status (-1 when mpiexec did not exit normally); output in dir/out.txt.
int run_and_signal(const fs::path& dir, int victim, const char* sig, const std::string& watch,
                   const std::string& later) {
  const fs::path wrapper = dir / "signal_rank.sh";
  std::ofstream(wrapper) << kWrapper;
  const fs::path ck = dir / "run" / "checkpoints";
  const std::string cmd =
      "OMP_NUM_THREADS=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 "
      "timeout -s KILL 120 " +
      shardlm::test::mpiexec() +
      " -n 2 --oversubscribe --mca mpi_yield_when_idle 1 --bind-to none sh " + wrapper.string() +
      " " + std::to_string(victim) + " " + sig + " " + (ck / watch).string() + " " +
      (ck / later).string() + " " + SHARDLM_BINARY + signal_run_args(dir, 200) + " > " +
      (dir / "out.txt").string() + " 2>&1";
  const int status = std::system(cmd.c_str());
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

// The step `latest` names, after checking that it verifies (every file and range's CRC-32).
int verified_latest_step(const fs::path& ck) {
  const std::string latest = shardlm::latest_checkpoint(ck.string());
  if (latest.empty()) return -1;
  const shardlm::CheckpointReader r(latest);  // throws on anything missing or corrupt
  return int(r.step());
}

TEST(AsyncCheckpoint, ASigkilledRankNeverBreaksLatest) {
  struct Trial {
    int victim;
    std::string watch;  // under checkpoints/: the moment of the kill
    int min_latest;     // the step `latest` has reached by then at the least
  };
  // While the temporary directory is being filled (the victim's first file, the middle of its
  // files, the other rank's last one), and just after the rename, before or after `latest`.
  const std::vector<Trial> trials = {{1, ".tmp-step_00000003", 2},
                                     {1, ".tmp-step_00000004/adam_m-00001-of-00002.bin", 3},
                                     {0, ".tmp-step_00000005/params-00000-of-00002.bin", 4},
                                     {1, ".tmp-step_00000006/adam_v-00000-of-00002.bin", 5},
                                     {0, "step_00000007", 6},
                                     {1, "step_00000008/manifest.json", 7}};
  for (size_t i = 0; i < trials.size(); ++i) {
    const Trial& t = trials[i];
    SCOPED_TRACE(::testing::Message() << "kill rank " << t.victim << " at " << t.watch);
    const fs::path dir = shardlm::test::scratch_root() / ("shardlm_async_kill" + std::to_string(i));
    fs::remove_all(dir);
    fs::create_directories(dir);
    // The step directory two saves on, should the moment pass between two looks.
    const int watched = std::stoi(t.watch.substr(t.watch.find("step_") + 5, 8));
    const int code =
        run_and_signal(dir, t.victim, "KILL", t.watch, fmt::format("step_{:08d}", watched + 2));
    const std::string out = slurp(dir / "out.txt");
    EXPECT_NE(code, 0) << "the run was not killed\n" << out;
    int step = -1;
    EXPECT_NO_THROW(step = verified_latest_step(dir / "run" / "checkpoints")) << out;
    EXPECT_GE(step, t.min_latest) << out;
    if (i != 0) continue;
    // Resumed, the run goes on from `latest` (the next writer removes the temporary directory).
    const std::string latest = shardlm::latest_checkpoint((dir / "run" / "checkpoints").string());
    ASSERT_EQ(shardlm::test::run_shardlm(2, signal_run_args(dir, step + 2), dir / "resumed.txt"), 0)
        << slurp(dir / "resumed.txt");
    EXPECT_NE(slurp(dir / "resumed.txt").find("resume: continuing from " + latest),
              std::string::npos)
        << slurp(dir / "resumed.txt");
    EXPECT_EQ(verified_latest_step(dir / "run" / "checkpoints"), step + 2);
  }
}

// SIGTERM on one rank while a save is in flight: the step finishes, the save in flight is
// committed, then the stop writes its own checkpoint; both verify and `latest` is the stop's.
TEST(AsyncCheckpoint, ASigtermWaitsForTheSaveInFlight) {
  const fs::path dir = shardlm::test::scratch_root() / "shardlm_async_term";
  fs::remove_all(dir);
  fs::create_directories(dir);
  const int code = run_and_signal(dir, 1, "TERM", ".tmp-step_00000004", "step_00000006");
  const std::string out = slurp(dir / "out.txt");
  ASSERT_EQ(code, 0) << out;
  // Rank 0 prints the line; the signal went to rank 1, so rank 0 names no signal of its own.
  std::smatch stop;
  ASSERT_TRUE(
      std::regex_search(out, stop, std::regex("stopped by signal [0-9]+ after step ([0-9]+)")))
      << out;
  const int last = std::stoi(stop[1].str());
  ASSERT_GE(last, 4) << out;
  const fs::path ck = dir / "run" / "checkpoints";
  EXPECT_EQ(verified_latest_step(ck), last);
  // The save of the step before was in flight at the stop (a save commits at the next step
  // boundary at the earliest): committed before the stop's own.
  const std::string committed = fmt::format("checkpoint: step {}: ", last - 1);
  const size_t in_flight = out.rfind(committed);
  ASSERT_NE(in_flight, std::string::npos) << out;
  EXPECT_NE(out.find("committed", in_flight), std::string::npos) << out;
  EXPECT_LT(in_flight, out.find(fmt::format("checkpoint: step {}: ", last))) << out;
  EXPECT_NO_THROW(shardlm::CheckpointReader((ck / fmt::format("step_{:08d}", last - 1)).string()));
}

}  // namespace
