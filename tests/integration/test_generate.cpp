// `shardlm generate` end to end: a checkpoint written with write_model is read back by the
// binary, whose stdout (prompt + continuation) must equal sample_text on the same weights in
// this process, greedy and seeded (f32 and bf16 params, step dir and checkpoints dir); a LoRA
// run's checkpoint generates from its merged model; bad options exit 2 and a missing
// checkpoint exits 3.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <string>

#include "shardlm/backend/backend.h"
#include "shardlm/checkpoint/checkpoint.h"
#include "shardlm/checkpoint/model_io.h"
#include "shardlm/model/decoder.h"
#include "shardlm/train/trainer.h"
#include "test_util.h"

namespace shardlm {
namespace {

namespace fs = std::filesystem;

struct CliRun {
  int exit_code;  // -1 when killed by a signal
  std::string out, err;
};

using shardlm::test::slurp;

CliRun run_shardlm(const std::string& args) {
  // Per process: CTest runs the cases of this file in parallel processes.
  const std::string tag = std::to_string(::getpid());
  const fs::path out = shardlm::test::scratch_root() / ("shardlm_generate_stdout_" + tag + ".txt");
  const fs::path err = shardlm::test::scratch_root() / ("shardlm_generate_stderr_" + tag + ".txt");
  const std::string cmd =
      std::string(SHARDLM_BINARY) + " " + args + " > " + out.string() + " 2> " + err.string();
  const int status = std::system(cmd.c_str());
  CliRun r{WIFEXITED(status) ? WEXITSTATUS(status) : -1, slurp(out), slurp(err)};
  fs::remove(out);
  fs::remove(err);
  return r;
}

ModelConfig generate_config() {
  ModelConfig c;
  c.name = "generate-test";
  c.dim = 32;
  c.n_layers = 2;
  c.n_heads = 4;
  c.n_kv_heads = 2;
  c.ffn_dim = 48;
  c.vocab_size = 272;
  c.rope_theta = 1000.0;
  c.attn_bias = true;
  return c;
}

constexpr int64_t kContext = 40;
constexpr const char* kPrompt = "In the beginning";

class GenerateCommand : public ::testing::TestWithParam<DType> {
 protected:
  void SetUp() override {
    dir_ =
        shardlm::test::scratch_root() / ("shardlm_generate_" + std::string(dtype_name(GetParam())) +
                                         "_" + std::to_string(::getpid()));
    fs::remove_all(dir_);
    ModelOptions opt;
    opt.param_dtype = GetParam();
    opt.activation_dtype = GetParam();  // as `generate` runs a checkpoint (activations = auto)
    opt.max_seq = 1;
    model_ = std::make_unique<LlamaModel>(generate_config(), opt, *be_, ledger_);
    std::vector<float> w = test::random_vec(model_->layout().total, 3, -0.3f, 0.3f);
    for (const auto& e : model_->layout().entries)
      if (e.name.find("norm") != std::string::npos)
        for (int64_t i = 0; i < e.shape.numel(); ++i) w[e.offset + i] += 1.0f;
    be_->convert(Tensor(w.data(), DType::kF32, {model_->layout().total}, MemPool::kHost),
                 model_->params());
    CheckpointWriter writer((dir_ / "checkpoints").string(), 5);
    write_model(writer, *model_, *be_, "byte");
    step_dir_ = writer.commit(0);
  }
  void TearDown() override { fs::remove_all(dir_); }

  // What the binary must print: the prompt, the continuation, a newline.
  std::string expected(const SampleConfig& c, uint64_t seed) {
    KvDecoder dec(*model_, *be_, ledger_, kContext, kContext);
    std::mt19937_64 rng(seed);
    return std::string(kPrompt) + sample_text(dec, tok_, kPrompt, c, rng) + "\n";
  }

  std::unique_ptr<Backend> be_ = make_backend(DeviceKind::kCpu);
  MemoryLedger ledger_;
  std::unique_ptr<LlamaModel> model_;
  ByteTokenizer tok_;
  fs::path dir_;
  std::string step_dir_;
};

TEST_P(GenerateCommand, GreedyMatchesSampleText) {
  SampleConfig c;
  c.max_new_tokens = 50;  // slides the 40-position window once
  c.temperature = 0;
  const CliRun r =
      run_shardlm("generate --checkpoint " + step_dir_ + " --prompt '" + kPrompt +
                  "' --max-new-tokens 50 --temperature 0 --context " + std::to_string(kContext));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out, expected(c, 0));
}

TEST_P(GenerateCommand, SeededSamplingMatchesSampleText) {
  SampleConfig c;
  c.max_new_tokens = 30;
  c.temperature = 1.2;
  c.top_k = 100;
  c.top_p = 0.9;
  const std::string args = "generate --checkpoint " + (dir_ / "checkpoints").string() +
                           " --prompt '" + kPrompt +
                           "' --max-new-tokens 30 --temperature 1.2 --top-k 100 --top-p 0.9 "
                           "--context " +
                           std::to_string(kContext);
  const CliRun a = run_shardlm(args + " --seed 9");
  ASSERT_EQ(a.exit_code, 0) << a.err;
  EXPECT_EQ(a.out, expected(c, 9));
  const CliRun b = run_shardlm(args + " --seed 10");
  ASSERT_EQ(b.exit_code, 0) << b.err;
  EXPECT_EQ(b.out, expected(c, 10));
  EXPECT_NE(a.out, b.out);
}

// A LoRA checkpoint: generate reads its base merged with the adapters unit by unit (as the
// merged export computes them), and the run's own end-of-run sample, read from the same final
// checkpoint instead of gathered from the ranks, is the same greedy text.
TEST(GenerateLora, ReadsTheMergedModelTheRunSampledFrom) {
  const fs::path dir =
      shardlm::test::scratch_root() / ("shardlm_generate_lora_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  const std::string src = shardlm::test::source_dir();
  const CliRun train = run_shardlm(
      "train --config " + src + "/configs/demo.json --set data.train=" + src +
      "/tests/data/genesis_1_12.txt --set data.seq_len=64 --set model.n_layers=2 "
      "--set train.max_steps=6 --set train.eval_batches=0 --set lora.rank=4 --set lora.alpha=8 "
      "--set sample.count=1 --set sample.temperature=0 --set sample.max_new_tokens=16 "
      "--set sample.prompt='" +
      std::string(kPrompt) + "' --set log.dir=" + (dir / "run").string());
  ASSERT_EQ(train.exit_code, 0) << train.out << train.err;
  const size_t at = train.out.rfind("--- sample 1 ---\n");
  ASSERT_NE(at, std::string::npos) << train.out;
  EXPECT_NE(train.out.find("sample: the parameters of"), std::string::npos) << train.out;
  const std::string sampled = train.out.substr(at + std::string("--- sample 1 ---\n").size());
  const CliRun gen = run_shardlm("generate --checkpoint " + (dir / "run" / "checkpoints").string() +
                                 " --prompt '" + kPrompt + "' --max-new-tokens 16 --temperature 0");
  ASSERT_EQ(gen.exit_code, 0) << gen.err;
  EXPECT_EQ(gen.out, sampled.substr(0, gen.out.size()));
  EXPECT_GT(gen.out.size(), std::string(kPrompt).size() + 1);
  fs::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(Params, GenerateCommand, ::testing::Values(DType::kF32, DType::kBF16),
                         [](const auto& info) { return std::string(dtype_name(info.param)); });

TEST(GenerateCommandErrors, BadOptionsExitTwo) {
  for (const char* bad : {"--top-p 0", "--top-p 1.5", "--temperature -1", "--top-k -2",
                          "--max-new-tokens -1", "--context 1"}) {
    const CliRun r =
        run_shardlm(std::string("generate --checkpoint /nonexistent --prompt x ") + bad);
    EXPECT_EQ(r.exit_code, 2) << bad << ": " << r.err;
  }
}

TEST(GenerateCommandErrors, MissingCheckpointExitsThree) {
  const CliRun r = run_shardlm("generate --checkpoint /nonexistent/shardlm_ckpt --prompt x");
  EXPECT_EQ(r.exit_code, 3) << r.err;
  EXPECT_NE(r.err.find("/nonexistent/shardlm_ckpt"), std::string::npos) << r.err;
}

}  // namespace
}  // namespace shardlm
