// Samples packing against transformers: chat records of varied lengths (some longer than the
// sequence, truncated) tokenized with their loss mask and trained on by a tiny random Llama that
// transformers made. The first step's loss of the packed batch equals the summed cross-entropy
// transformers computes on each sample alone (its first data.seq_len tokens), over their
// targets, on one rank and under context parallelism (Ulysses and ring, cp = 2), tensor
// parallelism (tp = 2), two pipeline stages, and two data-parallel ranks at ZeRO stage 3 (the
// same windows in one step); the run trains the same number of targets.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "integration/tiny_runs.h"
#include "shardlm/hf/hf.h"
#include "shardlm/io/shards.h"
#include "shardlm/train/data.h"
#include "test_util.h"
#include "tolerance.h"

namespace shardlm {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

constexpr int64_t kSeqLen = 128;

// Chats of one or two exchanges, 29 to 109 tokens (byte tokenizer, plain template), and one of
// 171 that a sequence of kSeqLen truncates.
void write_chats(const fs::path& file) {
  std::ofstream f(file);
  const std::vector<std::string> asks = {
      "Hi",
      "Name a colour.",
      "What is two and two?",
      "Tell me about the sea and the sky.",
      "Why do rivers bend?",
      "Count to five, please, slowly and clearly.",
      "Say yes.",
      "Describe a long winding road through hills, forests, rivers and small villages at dusk."};
  for (size_t i = 0; i < asks.size(); ++i) {
    json messages = json::array();
    if (i % 3 == 1) messages.push_back({{"role", "system"}, {"content", "Be brief."}});
    messages.push_back({{"role", "user"}, {"content", asks[i]}});
    messages.push_back({{"role", "assistant"}, {"content", std::string(2 + 5 * i, 'a' + i)}});
    if (i % 4 == 2) {
      messages.push_back({{"role", "user"}, {"content", "And then?"}});
      messages.push_back({{"role", "assistant"}, {"content", "Then more."}});
    }
    f << json{{"messages", messages}}.dump() << "\n";
  }
}

// The corpus's documents as transformers takes them alone: their first kSeqLen tokens, each
// input's target the next token where its mask is 1, else -1, and none for the last.
json reference_documents(const TokenCorpus& corpus) {
  const std::vector<int64_t>& starts = corpus.doc_starts();
  json docs = json::array();
  for (size_t d = 0; d < starts.size(); ++d) {
    const int64_t end = d + 1 < starts.size() ? starts[d + 1] : corpus.info().n_tokens;
    const int64_t n = std::min(end - starts[d], kSeqLen);
    std::vector<int32_t> tokens(size_t(n), 0);
    std::vector<uint8_t> mask(size_t(n), 0);
    corpus.read(starts[d], n, tokens.data(), mask.data());
    std::vector<int32_t> targets(size_t(n), -1);
    for (int64_t j = 0; j + 1 < n; ++j) targets[j] = mask[j + 1] ? tokens[j + 1] : -1;
    docs.push_back({{"tokens", tokens}, {"targets", targets}});
  }
  return docs;
}

TEST(SamplePackingHf, PackedLossIsTheSumOfEachSampleAloneInTransformers) {
  const std::string python = test::venv_python("transformers");
  if (python.empty()) SHARDLM_MISSING_REFERENCE(test::venv_skip_reason("transformers"));
  const fs::path root = test::scratch_root() / "sample_packing_hf";
  fs::remove_all(root);
  fs::create_directories(root);
  const std::string script = test::source_dir() + "/tests/integration/hf_reference.py";
  const fs::path model = root / "model", corpus = root / "corpus";
  test::run_command(python + " " + script + " make " + model.string() + " llama", root / "make.txt",
                    true);
  write_chats(root / "chats.jsonl");
  test::run_command(test::shardlm_binary() + " tokenize --input " +
                        (root / "chats.jsonl").string() + " --output " + corpus.string(),
                    root / "tokenize.txt", true);
  const TokenCorpus tokens(corpus.string());
  const std::vector<int64_t>& starts = tokens.doc_starts();
  int64_t overlong = 0;
  for (size_t d = 0; d < starts.size(); ++d)
    overlong +=
        (d + 1 < starts.size() ? starts[d + 1] : tokens.info().n_tokens) - starts[d] > kSeqLen;
  ASSERT_GE(overlong, 1) << "a chat should be truncated";
  std::ofstream(root / "docs.json") << reference_documents(tokens).dump();
  const json ref = json::parse(test::run_command(
      python + " " + script + " loss " + model.string() + " " + (root / "docs.json").string(),
      root / "loss.txt", false));
  const double want = ref["sum"].get<double>() / ref["count"].get<double>();

  const Dataset packed(load_corpus_source(corpus.string()), kSeqLen, 0, 0, -1,
                       {Packing::kSamples, Overlong::kTruncate});
  ASSERT_GT(packed.num_windows(), 2);  // samples share windows, and there are several
  ASSERT_LT(packed.num_windows(), int64_t(tokens.doc_starts().size()));
  std::ofstream(root / "train.json") << json{
      {"data", {{"train", corpus.string()}, {"valid", corpus.string()}, {"seq_len", kSeqLen}}},
      {"model", {{"hf_dir", model.string()}}},
      {"train",
       {{"micro_batch", packed.num_windows()},
        {"max_steps", 1},
        {"lr", 1e-30},
        {"min_lr", 1e-30},
        {"warmup_steps", 0},
        {"eval_every", 0},
        {"eval_batches", 1}}},
      {"sample", {{"count", 0}}}};
  const ModelConfig cfg = read_hf_config(model.string()).config;
  const double tol =
      test::reorder_tolerance(test::reduction_chain(cfg, kSeqLen, packed.num_windows()));
  struct Grid {
    const char* name;
    int ranks;
    std::string sets;
  };
  for (const Grid& g :
       {Grid{"one_rank", 1, ""},
        Grid{"ulysses_cp2", 2, "--set parallel.cp=2 --set parallel.cp_kind=ulysses"},
        Grid{"ring_cp2", 2, "--set parallel.cp=2 --set parallel.cp_kind=ring"},
        Grid{"tp2", 2, "--set parallel.tp=2"}, Grid{"pp2", 2, "--set parallel.pp=2"},
        Grid{"dp2_zero3", 2,
             fmt::format("--set train.micro_batch={} --set zero.stage=3",
                         (packed.num_windows() + 1) / 2)}}) {
    SCOPED_TRACE(g.name);
    const fs::path run = root / g.name;
    fs::remove_all(run);
    const int code = test::run_shardlm(g.ranks,
                                       " train --config " + (root / "train.json").string() +
                                           " --set log.dir=" + run.string() + " " + g.sets,
                                       root / "train.txt");
    ASSERT_EQ(code, 0) << test::slurp(root / "train.txt");
    EXPECT_NE(test::slurp(root / "train.txt").find("packing: samples"), std::string::npos);
    const std::vector<double> loss = test::metric_series(run, "loss");
    ASSERT_EQ(loss.size(), 1u);
    EXPECT_NEAR(loss[0], want, tol * want);
    const json summary = json::parse(test::slurp(run / "summary.json"));
    EXPECT_EQ(summary["tokens_per_epoch"].get<int64_t>(), ref["count"].get<int64_t>());
    EXPECT_EQ(summary["packing"]["truncated"].get<int64_t>(), overlong);
  }
}

}  // namespace
}  // namespace shardlm
