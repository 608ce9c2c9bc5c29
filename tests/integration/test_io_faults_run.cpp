// The binary with an I/O error injected at each write-side call in turn (SHARDLM_FAULT, see
// shardlm/core/fault_injection.h): for N = 1, 2, ... until a run completes without reaching N,
//   - a training run with periodic checkpoints, synchronous and asynchronous, on one rank, and
//     on two ranks (through `shardlm launch`) with the fault on rank 1 only;
//   - `shardlm tokenize`, `convert hf-export` and `convert hf-import`.
// For every N: exit 3 with a message naming the operation, the file and errno's text; `latest`
// (when there is one) names a checkpoint that verifies, every checkpoint directory present
// verifies, and no temporary is left; the source data is intact; and the same command run again
// without the fault finishes with the uninterrupted run's bytes (a training run resumes and ends
// with the same losses and parameters, bit for bit). Then what the guard around saves adds: a
// disk short of space skips a periodic save with both numbers and trains on, and
// checkpoint.on_save_error = "continue" carries on past a failed save; a host allocation the OS
// refuses is out of memory (exit 4) with the plan's host figure.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "shardlm/io/safetensors.h"
#include "shardlm/io/shards.h"
#include "tiny_runs.h"

namespace {

namespace fs = std::filesystem;
using shardlm::CheckpointReader;
using shardlm::test::metric_series;
using shardlm::test::slurp;

const std::string kBinary = SHARDLM_BINARY;

// Runs `shardlm <args>` (as `ranks` processes through `shardlm launch`) with the environment
// `env` prepended, output into `out`; returns the exit code.
int run_with(const std::string& env, int ranks, const std::string& args, const fs::path& out) {
  std::string cmd = "OMP_NUM_THREADS=1 " + env + " " + kBinary;
  if (ranks > 1) cmd += " launch --nproc " + std::to_string(ranks) + " --";
  cmd += " " + args + " > " + out.string() + " 2>&1";
  const int status = std::system(cmd.c_str());
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

std::string train_args(const fs::path& run, const std::string& extra) {
  return "train --config " + std::string(SHARDLM_SOURCE_DIR) + "/configs/demo.json" +
         " --set data.train=" + shardlm::test::kTinyCorpus +
         " --set data.seq_len=32 --set model.n_layers=1 --set model.dim=64" +
         " --set model.ffn_dim=128 --set train.max_steps=4" +
         " --set train.micro_batch=2 --set train.eval_every=100 --set train.eval_batches=1" +
         " --set sample.count=0 --set checkpoint.every_steps=2 --set checkpoint.keep_last=1" +
         " --set log.dir=" + run.string() + " " + extra;
}

// What the Nth call's fault is: ENOSPC after a short write on odd N, EIO every third.
std::string fault_env(int64_t n, const fs::path& log, const std::string& rank) {
  const std::string err = n % 3 == 0 ? "EIO" : "ENOSPC";
  std::string env = "SHARDLM_FAULT=io:" + std::to_string(n) + ":" + err +
                    (n % 2 == 1 ? ":short" : "") + " SHARDLM_FAULT_LOG=" + log.string();
  if (!rank.empty()) env += " SHARDLM_FAULT_RANK=" + rank;
  return env;
}

// The fault log's line "fired N OP PATH": the path of the failed call.
std::string fired_path(const fs::path& log) {
  const std::string line = slurp(log);
  std::string path = line.substr(line.rfind(' ') + 1);
  while (!path.empty() && path.back() == '\n') path.pop_back();
  return path;
}

// Every complete checkpoint directory verifies, `latest` names one of them, and no temporary
// of a save is left.
void expect_checkpoints_intact(const fs::path& checkpoints) {
  if (!fs::exists(checkpoints)) return;
  for (const auto& e : fs::directory_iterator(checkpoints)) {
    const std::string name = e.path().filename().string();
    EXPECT_FALSE(name.starts_with(".tmp-") || name.ends_with(".tmp")) << name << " left behind";
    if (!name.starts_with("step_") || !fs::exists(e.path() / "manifest.json")) continue;
    try {
      CheckpointReader r(e.path().string());
    } catch (const std::exception& ex) {
      ADD_FAILURE() << name << " does not verify: " << ex.what();
    }
  }
  const std::string latest = shardlm::latest_checkpoint(checkpoints.string());
  if (!latest.empty()) {
    EXPECT_TRUE(fs::exists(fs::path(latest) / "manifest.json")) << latest;
  }
}

// Walks N over the I/O calls of `command(dir)` run in a fresh `dir`; after each failure checks
// the message and `intact(dir)`, then reruns the command without the fault and checks
// `finished(dir)`. Returns the number of calls walked.
struct WalkSpec {
  std::string name;
  int ranks = 1;
  std::string fault_rank;  // "" = every rank
  std::function<std::string(const fs::path&)> command;
  std::function<void(const fs::path&)> prepare = [](const fs::path&) {};
  std::function<void(const fs::path&)> intact;
  std::function<void(const fs::path&)> finished;
};

int64_t walk(const WalkSpec& w) {
  const fs::path root = shardlm::test::scratch_root() / ("shardlm_iofault_" + w.name);
  for (int64_t n = 1;; ++n) {
    SCOPED_TRACE(fmt::format("{}: I/O call {}", w.name, n));
    fs::remove_all(root);
    fs::create_directories(root);
    const fs::path dir = root / "work", log = root / "fault.log";
    w.prepare(dir);
    const int rc =
        run_with(fault_env(n, log, w.fault_rank), w.ranks, w.command(dir), root / "out.txt");
    const std::string out = slurp(root / "out.txt");
    if (!fs::exists(log)) {
      EXPECT_EQ(rc, 0) << out;
      fs::remove_all(root);
      return n - 1;
    }
    EXPECT_EQ(rc, 3) << "fault: " << slurp(log) << out;
    const std::string err = std::strerror(n % 3 == 0 ? EIO : ENOSPC);
    EXPECT_NE(out.find("failed: " + err), std::string::npos) << slurp(log) << out;
    EXPECT_NE(out.find(fired_path(log)), std::string::npos) << slurp(log) << out;
    w.intact(dir);
    const int again = run_with("", w.ranks, w.command(dir), root / "again.txt");
    EXPECT_EQ(again, 0) << slurp(root / "again.txt");
    w.finished(dir);
    if (::testing::Test::HasFailure()) return n;
  }
}

// The training walks: after each failure the checkpoints are intact; the rerun resumes and ends
// with the uninterrupted run's losses and final parameters.
void walk_training(const std::string& name, int ranks, const std::string& fault_rank,
                   const std::string& extra) {
  const fs::path ref_root = shardlm::test::scratch_root() / ("shardlm_iofault_ref_" + name);
  fs::remove_all(ref_root);
  fs::create_directories(ref_root);
  const fs::path ref = ref_root / "run";
  ASSERT_EQ(run_with("", ranks, train_args(ref, extra), ref_root / "out.txt"), 0)
      << slurp(ref_root / "out.txt");
  const std::vector<double> losses = metric_series(ref, "loss");
  const std::string params = shardlm::test::checkpoint_vector(ref, 4, "params");
  const std::string adam_v = shardlm::test::checkpoint_vector(ref, 4, "adam_v");
  WalkSpec w;
  w.name = name;
  w.ranks = ranks;
  w.fault_rank = fault_rank;
  w.command = [&](const fs::path& dir) { return train_args(dir / "run", extra); };
  w.intact = [](const fs::path& dir) { expect_checkpoints_intact(dir / "run" / "checkpoints"); };
  w.finished = [&](const fs::path& dir) {
    EXPECT_EQ(metric_series(dir / "run", "loss"), losses);
    EXPECT_TRUE(shardlm::test::checkpoint_vector(dir / "run", 4, "params") == params);
    EXPECT_TRUE(shardlm::test::checkpoint_vector(dir / "run", 4, "adam_v") == adam_v);
    expect_checkpoints_intact(dir / "run" / "checkpoints");
  };
  const int64_t calls = walk(w);
  std::cout << name << ": " << calls << " I/O calls walked\n";
  // Two checkpoints of five files each (rank 1 of two: its three vector files), the reports,
  // metrics.jsonl.
  EXPECT_GE(calls, fault_rank.empty() ? 60 : 15);
  fs::remove_all(ref_root);
}

TEST(IoFaultRuns, SynchronousCheckpointsAtEveryCall) { walk_training("sync", 1, "", ""); }

TEST(IoFaultRuns, AsynchronousCheckpointsAtEveryCall) {
  walk_training("async", 1, "", "--set checkpoint.async=true");
}

TEST(IoFaultRuns, OneRankOfTwoFailsAndNoneCommits) {
  walk_training("ranks", 2, "1", "--set zero.stage=1 --set train.micro_batch=1");
}

TEST(IoFaultRuns, TokenizeAtEveryCall) {
  const fs::path root = shardlm::test::scratch_root() / "shardlm_iofault_tok_ref";
  fs::remove_all(root);
  fs::create_directories(root);
  const std::string source_before = slurp(shardlm::test::kTinyCorpus);
  auto command = [](const fs::path& dir) {
    return "tokenize --input " + shardlm::test::kTinyCorpus + " --output " +
           (dir / "corpus").string();
  };
  ASSERT_EQ(run_with("", 1, command(root), root / "out.txt"), 0) << slurp(root / "out.txt");
  const std::string index = slurp(root / "corpus" / "index.json");
  WalkSpec w;
  w.name = "tokenize";
  w.command = command;
  w.intact = [&](const fs::path& dir) {
    EXPECT_EQ(slurp(shardlm::test::kTinyCorpus), source_before);
    // index.json is written last: when it is there, every shard it names is whole.
    if (fs::exists(dir / "corpus" / "index.json")) {
      EXPECT_EQ(shardlm::TokenCorpus((dir / "corpus").string()).info().n_tokens,
                shardlm::TokenCorpus((root / "corpus").string()).info().n_tokens);
    }
  };
  w.finished = [&](const fs::path& dir) {
    EXPECT_EQ(slurp(dir / "corpus" / "index.json"), index);
    for (const auto& e : fs::directory_iterator(root / "corpus"))
      EXPECT_TRUE(slurp(e.path()) == slurp(dir / "corpus" / e.path().filename())) << e.path();
  };
  const int64_t calls = walk(w);
  std::cout << "tokenize: " << calls << " I/O calls walked\n";
  EXPECT_GE(calls, 10);
  fs::remove_all(root);
}

// A checkpoint to export and its export to import, made once.
fs::path hf_fixture() {
  const fs::path root = shardlm::test::scratch_root() / "shardlm_iofault_hf";
  if (fs::exists(root / "export" / "config.json")) return root;
  fs::remove_all(root);
  fs::create_directories(root);
  EXPECT_EQ(run_with("", 1, train_args(root / "run", ""), root / "out.txt"), 0);
  EXPECT_EQ(run_with("", 1,
                     "convert hf-export " + (root / "run" / "checkpoints").string() + " --output " +
                         (root / "export").string(),
                     root / "export.txt"),
            0)
      << slurp(root / "export.txt");
  return root;
}

TEST(IoFaultRuns, HfExportAtEveryCall) {
  const fs::path fix = hf_fixture();
  WalkSpec w;
  w.name = "export";
  w.command = [&](const fs::path& dir) {
    return "convert hf-export " + (fix / "run" / "checkpoints").string() + " --output " +
           (dir / "export").string();
  };
  w.intact = [&](const fs::path& dir) {
    expect_checkpoints_intact(fix / "run" / "checkpoints");  // the source
    EXPECT_FALSE(fs::exists(dir / "export" / "model.safetensors.tmp"));
  };
  w.finished = [&](const fs::path& dir) {
    for (const char* f : {"config.json", "model.safetensors"})
      EXPECT_TRUE(slurp(dir / "export" / f) == slurp(fix / "export" / f)) << f;
  };
  const int64_t calls = walk(w);
  std::cout << "hf-export: " << calls << " I/O calls walked\n";
  EXPECT_GE(calls, 8);
}

TEST(IoFaultRuns, HfImportAtEveryCall) {
  const fs::path fix = hf_fixture();
  const std::string weights = slurp(fix / "export" / "model.safetensors");
  WalkSpec w;
  w.name = "import";
  w.command = [&](const fs::path& dir) {
    return "convert hf-import " + (fix / "export").string() + " --output " +
           (dir / "imported").string();
  };
  w.intact = [&](const fs::path& dir) {
    EXPECT_TRUE(slurp(fix / "export" / "model.safetensors") == weights);  // the source
    expect_checkpoints_intact(dir / "imported");
  };
  w.finished = [&](const fs::path& dir) {
    const CheckpointReader r(shardlm::latest_checkpoint((dir / "imported").string()));
    EXPECT_GT(r.vector_bytes("params"), 0u);
  };
  const int64_t calls = walk(w);
  std::cout << "hf-import: " << calls << " I/O calls walked\n";
  EXPECT_GE(calls, 10);
}

// A disk that reports 4 KiB free: every periodic save is skipped with both numbers and the step
// of the next one, training goes on, and the final save (which this disk in fact has room for)
// is attempted and written.
TEST(IoFaultRuns, PeriodicSaveSkippedWhenTheDiskLacksSpace) {
  const fs::path root = shardlm::test::scratch_root() / "shardlm_iofault_space";
  fs::remove_all(root);
  fs::create_directories(root);
  const int rc = run_with("SHARDLM_FAULT=free_space:4096", 1,
                          train_args(root / "run", "--set train.max_steps=6"), root / "out.txt");
  const std::string out = slurp(root / "out.txt");
  EXPECT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("checkpoint: step 2 not saved: it needs "), std::string::npos) << out;
  EXPECT_NE(out.find("which has 4.0 KiB free; training goes on (the next save is at step 4"),
            std::string::npos)
      << out;
  EXPECT_NE(out.find("checkpoint: step 4 not saved"), std::string::npos) << out;
  EXPECT_NE(out.find("the next save is the final one"), std::string::npos) << out;
  EXPECT_EQ(shardlm::latest_checkpoint((root / "run" / "checkpoints").string()),
            (root / "run" / "checkpoints" / "step_00000006").string());
  fs::remove_all(root);
}

// checkpoint.on_save_error = "continue": the first periodic save fails on its first write, the
// run says so with the disk's message, trains on, and the next saves are written.
TEST(IoFaultRuns, FailedPeriodicSaveContinues) {
  const fs::path root = shardlm::test::scratch_root() / "shardlm_iofault_continue";
  fs::remove_all(root);
  fs::create_directories(root);
  const fs::path log = root / "fault.log";
  // Without TensorBoard's files, call 1 opens metrics.jsonl, 2 writes step 1's line, 3 step 2's,
  // and 4 is the save's mkdir.
  const int rc = run_with("SHARDLM_FAULT=io:4:ENOSPC SHARDLM_FAULT_LOG=" + log.string(), 1,
                          train_args(root / "run",
                                     "--set checkpoint.on_save_error=continue "
                                     "--set log.tensorboard=false"),
                          root / "out.txt");
  const std::string out = slurp(root / "out.txt");
  EXPECT_EQ(rc, 0) << out;
  EXPECT_NE(slurp(log).find("mkdir"), std::string::npos) << slurp(log);
  EXPECT_NE(out.find("checkpoint: step 2 not saved: "), std::string::npos) << out;
  EXPECT_NE(out.find("mkdir failed: No space left on device"), std::string::npos) << out;
  EXPECT_NE(out.find("training goes on"), std::string::npos) << out;
  EXPECT_EQ(shardlm::latest_checkpoint((root / "run" / "checkpoints").string()),
            (root / "run" / "checkpoints" / "step_00000004").string());
  fs::remove_all(root);
}

// The same failure under the default ("stop"): exit 3, the disk's message, the free space and
// what a save needs.
TEST(IoFaultRuns, FailedPeriodicSaveStopsByDefault) {
  const fs::path root = shardlm::test::scratch_root() / "shardlm_iofault_stop";
  fs::remove_all(root);
  fs::create_directories(root);
  const int rc =
      run_with("SHARDLM_FAULT=io:4:ENOSPC", 1,
               train_args(root / "run", "--set log.tensorboard=false"), root / "out.txt");
  const std::string out = slurp(root / "out.txt");
  EXPECT_EQ(rc, 3) << out;
  EXPECT_NE(out.find("mkdir failed: No space left on device"), std::string::npos) << out;
  EXPECT_NE(out.find("free; a save needs "), std::string::npos) << out;
  EXPECT_NE(out.find("The last committed checkpoint, none, is intact"), std::string::npos) << out;
  fs::remove_all(root);
}

// A host allocation the OS refuses (the optimizer's state in host memory): out of memory, exit
// 4, with the refused size, what the machine has available and the plan's figures.
TEST(IoFaultRuns, RefusedHostAllocationIsOutOfMemory) {
  const fs::path root = shardlm::test::scratch_root() / "shardlm_iofault_alloc";
  fs::remove_all(root);
  fs::create_directories(root);
  const int rc =
      run_with("SHARDLM_FAULT=host_alloc:1", 1,
               train_args(root / "run", "--set zero.stage=1 --set zero.offload_optimizer=cpu"),
               root / "out.txt");
  const std::string out = slurp(root / "out.txt");
  EXPECT_EQ(rc, 4) << out;
  EXPECT_NE(out.find("out of host memory: the operating system refused"), std::string::npos) << out;
  EXPECT_NE(out.find("available"), std::string::npos) << out;
  EXPECT_NE(out.find("the plan for rank 0 holds"), std::string::npos) << out;
  EXPECT_NE(out.find("on the host pool"), std::string::npos) << out;
  fs::remove_all(root);
}

}  // namespace
