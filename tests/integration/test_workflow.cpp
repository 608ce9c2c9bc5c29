// The training workflow through the binary: tokenize -> train with exact epoch accounting,
// SIGTERM + resume reproducing the uninterrupted run bit for bit, corrupt checkpoints named
// with exit 3, chat loss masks, flat host memory across epochs, the non-finite guard.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <thread>

#include "test_util.h"

namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

const std::string kBinary = SHARDLM_BINARY;
const std::string kCorpus = std::string(SHARDLM_SOURCE_DIR) + "/tests/data/genesis_1_12.txt";

struct Result {
  int exit_code;
  std::string out, err;
};

using shardlm::test::slurp;

fs::path fresh_dir(const std::string& name) {
  const fs::path d = shardlm::test::scratch_root() / ("shardlm_wf_" + name);
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

Result run(const std::string& args, const fs::path& scratch) {
  const std::string cmd = kBinary + " " + args + " > " + (scratch / "out.txt").string() + " 2> " +
                          (scratch / "err.txt").string();
  const int status = std::system(cmd.c_str());
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, slurp(scratch / "out.txt"),
          slurp(scratch / "err.txt")};
}

std::string write_config(const fs::path& dir, const std::string& data, const std::string& train) {
  const fs::path p = dir / "config.json";
  std::ofstream(p) << R"({"model": {"preset": "tiny", "n_layers": 2},
    "data": {"train": ")" +
                          data + R"(", "seq_len": 64, "valid_fraction": 0.1},
    "train": )" + train + R"(,
    "log": {"dir": ")" + (dir / "run").string() +
                          R"("}})";
  return p.string();
}

std::vector<json> read_metrics(const fs::path& run_dir) {
  std::vector<json> lines;
  std::ifstream f(run_dir / "metrics.jsonl");
  for (std::string line; std::getline(f, line);) lines.push_back(json::parse(line));
  return lines;
}

std::vector<double> step_losses(const fs::path& run_dir) {
  std::vector<double> losses;
  for (const json& m : read_metrics(run_dir))
    if (m.contains("grad_norm")) losses.push_back(m["loss"].get<double>());
  return losses;
}

// On the corpus's first 9,000 bytes (cut at a line's end): each run one epoch of ~20 steps.
TEST(Workflow, TokenizeThenTrainOneEpochSeesEveryTokenOnce) {
  const fs::path d = fresh_dir("epoch");
  std::string text = slurp(kCorpus);
  text.resize(text.find('\n', 9000) + 1);
  std::ofstream(d / "corpus.txt") << text;
  const Result tk = run(
      "tokenize --input " + (d / "corpus.txt").string() + " --output " + (d / "corpus").string(),
      d);
  ASSERT_EQ(tk.exit_code, 0) << tk.err;
  const json index = json::parse(slurp(d / "corpus" / "index.json"));
  const int64_t n_tokens = index["n_tokens"].get<int64_t>();
  // 3 x 2 sequences of 64 per step: the corpus is not a multiple of a step's tokens.
  ASSERT_NE(n_tokens % (6 * 64), 0);
  const std::string cfg = write_config(
      d, (d / "corpus").string(),
      R"({"micro_batch": 3, "grad_accum": 2, "epochs": 1, "eval_every": 0, "eval_batches": 1})");
  const Result r = run("train --config " + cfg + " --set data.valid_fraction=0.05", d);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("nothing is dropped"), std::string::npos) << r.out;
  const json summary = json::parse(slurp(d / "run" / "summary.json"));
  const int64_t train_tokens = summary["tokens_per_epoch"].get<int64_t>();
  const int64_t valid_tokens = n_tokens - train_tokens;  // the held-out tail
  EXPECT_GT(valid_tokens, 0);
  EXPECT_EQ(summary["tokens_seen_per_epoch"][0].get<int64_t>(), train_tokens);
  EXPECT_EQ(summary["tokens_seen"].get<int64_t>(), train_tokens);
  // And with no held-out split taken from it, exactly the shard header's count.
  const fs::path valid = d / "valid.txt";
  std::ofstream(valid) << "A held-out line.\n";
  const Result r2 = run("train --config " + cfg + " --set data.valid=\"" + valid.string() +
                            "\" --set train.resume=\"none\"",
                        d);
  ASSERT_EQ(r2.exit_code, 0) << r2.err;
  const json s2 = json::parse(slurp(d / "run" / "summary.json"));
  EXPECT_EQ(s2["tokens_seen_per_epoch"][0].get<int64_t>(), n_tokens);
  EXPECT_EQ(s2["tokens_seen"].get<int64_t>(), n_tokens);
}

TEST(Workflow, SigtermAndResumeReproduceTheUninterruptedRunBitForBit) {
  const std::string train =
      R"({"micro_batch": 8, "max_steps": 40, "eval_every": 8, "eval_batches": 2})";
  // Uninterrupted reference.
  const fs::path a = fresh_dir("ref");
  const Result ra = run("train --config " + write_config(a, kCorpus, train), a);
  ASSERT_EQ(ra.exit_code, 0) << ra.err;
  const std::vector<double> ref = step_losses(a / "run");
  ASSERT_EQ(ref.size(), 40u);

  // Interrupted at a random step, then resumed.
  const fs::path b = fresh_dir("kill");
  const std::string cfg = write_config(b, kCorpus, train);
  std::mt19937 rng(std::random_device{}());
  const int kill_after = 3 + int(rng() % 20);
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    const std::string out = (b / "out1.txt").string();
    freopen(out.c_str(), "w", stdout);
    freopen((b / "err1.txt").string().c_str(), "w", stderr);
    execl(kBinary.c_str(), kBinary.c_str(), "train", "--config", cfg.c_str(), (char*)nullptr);
    _exit(127);
  }
  // Wait until the run has logged `kill_after` steps, then SIGTERM it.
  for (int i = 0; i < 6000; ++i) {
    int steps = 0;
    std::ifstream f(b / "run" / "metrics.jsonl");
    for (std::string line; std::getline(f, line);)
      steps += line.find("grad_norm") != std::string::npos;
    if (steps >= kill_after) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  kill(pid, SIGTERM);
  int status = 0;
  waitpid(pid, &status, 0);
  ASSERT_TRUE(WIFEXITED(status)) << "killed by a signal";
  ASSERT_EQ(WEXITSTATUS(status), 0) << slurp(b / "err1.txt");
  const std::string out1 = slurp(b / "out1.txt");
  EXPECT_NE(out1.find("to resume"), std::string::npos) << out1;
  const size_t stopped_at = step_losses(b / "run").size();
  ASSERT_GE(stopped_at, size_t(kill_after));
  ASSERT_LT(stopped_at, 40u) << "the run finished before the signal arrived";

  const Result rb = run("train --config " + cfg, b);
  ASSERT_EQ(rb.exit_code, 0) << rb.err;
  EXPECT_NE(rb.out.find("resume: continuing from"), std::string::npos) << rb.out;
  const std::vector<double> resumed = step_losses(b / "run");
  ASSERT_EQ(resumed.size(), ref.size());
  for (size_t i = 0; i < ref.size(); ++i)
    EXPECT_EQ(resumed[i], ref[i]) << "step " << i + 1 << " (stopped after " << stopped_at << ")";
  // The final weights are identical byte for byte.
  const std::string pa =
      slurp(a / "run" / "checkpoints" / "step_00000040" / "params-00000-of-00001.bin");
  const std::string pb =
      slurp(b / "run" / "checkpoints" / "step_00000040" / "params-00000-of-00001.bin");
  ASSERT_FALSE(pa.empty());
  EXPECT_TRUE(pa == pb) << "final parameters differ";
}

TEST(Workflow, CorruptCheckpointExitsThreeNamingTheFile) {
  const fs::path d = fresh_dir("corrupt");
  const std::string cfg = write_config(
      d, kCorpus, R"({"micro_batch": 4, "max_steps": 6, "eval_every": 0, "eval_batches": 1})");
  ASSERT_EQ(run("train --config " + cfg, d).exit_code, 0);
  // A one-rank run's parameters: the one file of the "params" vector.
  const fs::path params = d / "run" / "checkpoints" / "step_00000006" / "params-00000-of-00001.bin";
  ASSERT_TRUE(fs::exists(params));
  {
    std::fstream f(params, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(1000);
    char c;
    f.read(&c, 1);
    c ^= 0x5a;
    f.seekp(1000);
    f.write(&c, 1);
  }
  const Result r = run("train --config " + cfg + " --set train.max_steps=8", d);
  EXPECT_EQ(r.exit_code, 3) << r.err;
  EXPECT_NE(r.err.find("params-00000-of-00001.bin"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("params elements [0, "), std::string::npos) << r.err;
  const Result g = run("generate --checkpoint " + (d / "run" / "checkpoints").string() +
                           " --prompt hi --max-new-tokens 4",
                       d);
  EXPECT_EQ(g.exit_code, 3) << g.err;
  EXPECT_NE(g.err.find("params-00000-of-00001.bin"), std::string::npos) << g.err;
}

TEST(Workflow, CheckpointAtEndFalseKeepsOnlyThePeriodicOnes) {
  const fs::path d = fresh_dir("at_end");
  const std::string cfg = write_config(
      d, kCorpus, R"({"micro_batch": 2, "max_steps": 5, "eval_every": 0, "eval_batches": 1})");
  const Result r = run(
      "train --config " + cfg + " --set checkpoint.at_end=false --set checkpoint.every_steps=2", d);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const fs::path ck = d / "run" / "checkpoints";
  EXPECT_TRUE(fs::exists(ck / "step_00000004" / "manifest.json"));
  EXPECT_FALSE(fs::exists(ck / "step_00000005"));
  // And with no periodic ones, nothing at all.
  const Result none =
      run("train --config " + cfg + " --set checkpoint.at_end=false --set train.resume=\"none\"" +
              " --set log.dir=\"" + (d / "run2").string() + "\"",
          d);
  ASSERT_EQ(none.exit_code, 0) << none.err;
  EXPECT_FALSE(fs::exists(d / "run2" / "checkpoints" / "step_00000005"));
  EXPECT_TRUE(fs::exists(d / "run2" / "summary.json"));
}

TEST(Workflow, ChatDataTrainsOnlyAssistantTokens) {
  const fs::path d = fresh_dir("chat");
  // Assistant replies of known length; everything else (roles, system, user) is context.
  const std::vector<std::string> replies = {"In the beginning.", "Let there be light!",
                                            "And it was so.", "Evening and morning."};
  int64_t expected = 0;
  {
    std::ofstream f(d / "chat.jsonl");
    for (int rep = 0; rep < 40; ++rep)
      for (const std::string& a : replies) {
        f << json{{"messages",
                   {{{"role", "system"}, {"content", "You answer briefly."}},
                    {{"role", "user"}, {"content", "Say something, " + std::to_string(rep)}},
                    {{"role", "assistant"}, {"content", a}}}}}
                 .dump()
          << "\n";
        expected += int64_t(a.size()) + 1;  // the reply's bytes and the <eos> ending the turn
      }
  }
  ASSERT_EQ(run("tokenize --input " + (d / "chat.jsonl").string() + " --output " +
                    (d / "corpus").string(),
                d)
                .exit_code,
            0);
  std::ofstream(d / "valid.txt") << "held out\n";
  const std::string cfg =
      write_config(d, (d / "corpus").string(),
                   R"({"micro_batch": 4, "epochs": 1, "eval_every": 0, "eval_batches": 1})");
  // Each chat (about 90 tokens) is trained whole: it fits a sequence of 128, not one of 64.
  const Result cut = run("train --config " + cfg + " --set data.valid=\"" +
                             (d / "valid.txt").string() + "\" --set data.overlong=error",
                         d);
  EXPECT_EQ(cut.exit_code, 3) << cut.err;
  EXPECT_NE(cut.err.find("more than data.seq_len = 64"), std::string::npos) << cut.err;
  // Truncated to 64 tokens (the default data.overlong), no reply is left to learn.
  const Result none =
      run("train --config " + cfg + " --set data.valid=\"" + (d / "valid.txt").string() + "\"", d);
  EXPECT_EQ(none.exit_code, 3) << none.err;
  EXPECT_NE(none.err.find("no target tokens to train on"), std::string::npos) << none.err;
  EXPECT_NE(none.err.find("160 longer than data.seq_len = 64 truncated"), std::string::npos)
      << none.err;
  const Result r = run("train --config " + cfg + " --set data.valid=\"" +
                           (d / "valid.txt").string() + "\" --set data.seq_len=128",
                       d);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("packing: samples: 160 documents whole"), std::string::npos) << r.out;
  const json summary = json::parse(slurp(d / "run" / "summary.json"));
  EXPECT_EQ(summary["tokens_per_epoch"].get<int64_t>(), expected);
  EXPECT_EQ(summary["tokens_seen"].get<int64_t>(), expected);
  const json index = json::parse(slurp(d / "corpus" / "index.json"));
  EXPECT_GT(index["n_tokens"].get<int64_t>(), 3 * expected);  // most tokens are context
}

TEST(Workflow, HostMemoryStaysFlatAcrossEpochs) {
  const fs::path d = fresh_dir("rss");
  // A small corpus (the first chapters) so that epochs are short.
  const std::string text = slurp(kCorpus).substr(0, 6000);
  std::ofstream(d / "small.txt") << text;
  const std::string cfg =
      write_config(d, (d / "small.txt").string(),
                   R"({"micro_batch": 4, "epochs": 8, "eval_every": 0, "eval_batches": 1})");
  const Result r = run("train --config " + cfg + " --set data.valid_fraction=0.2", d);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  std::map<int64_t, int64_t> rss_at_epoch_end;  // epoch -> RSS at its last step
  for (const json& m : read_metrics(d / "run"))
    if (m.contains("host_rss_bytes"))
      rss_at_epoch_end[m["epoch"].get<int64_t>()] = m["host_rss_bytes"].get<int64_t>();
  ASSERT_EQ(rss_at_epoch_end.size(), 8u);
  // After the first epoch (allocator warm-up), the resident set may not grow by more than
  // 1 MiB over the remaining seven epoch boundaries.
  const int64_t base = rss_at_epoch_end[2];
  for (const auto& [epoch, rss] : rss_at_epoch_end)
    if (epoch >= 2) {
      EXPECT_LE(rss - base, int64_t(1) << 20) << "epoch " << epoch;
    }
}

TEST(Workflow, NonFiniteStepsAreSkippedThenAbortNamingTheLayer) {
  const fs::path d = fresh_dir("nan");
  const std::string cfg = write_config(
      d, kCorpus,
      R"({"micro_batch": 2, "max_steps": 50, "lr": 1e30, "min_lr": 0, "warmup_steps": 0,
          "grad_clip": 0, "max_bad_steps": 2, "eval_every": 0, "eval_batches": 1})");
  const Result r = run("train --config " + cfg, d);
  EXPECT_EQ(r.exit_code, 1) << r.out << r.err;
  EXPECT_NE(r.err.find("consecutive steps with non-finite"), std::string::npos) << r.err;
  EXPECT_NE(r.out.find("update skipped"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("first non-finite gradients"), std::string::npos) << r.out;
}

}  // namespace
