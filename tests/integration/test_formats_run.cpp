// A run whose data.train is a .jsonl of alpaca records: tokenized in memory through the same
// reader as `shardlm tokenize` (the same tokens, document starts and loss mask as the corpus it
// writes), it trains, and its losses are those of the run on that corpus, bit for bit (the same
// targets in the same windows). Bad records stop it with a data error naming the file and line,
// or are counted at start-up under data.skip_bad_records.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "shardlm/config/config.h"
#include "shardlm/core/check.h"
#include "shardlm/io/tokenize.h"
#include "shardlm/train/data.h"
#include "shardlm/train/trainer.h"
#include "test_util.h"

namespace shardlm {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

// 40 alpaca records, some with an input, a system prompt or history.
std::string alpaca_jsonl() {
  std::string out;
  for (int i = 0; i < 40; ++i) {
    json r = {{"instruction", fmt::format("Count to {}.", i % 7 + 1)},
              {"output", std::string(size_t(i % 7 + 1), char('a' + i % 26))}};
    if (i % 3 == 0) r["input"] = "slowly";
    if (i % 5 == 0) r["system"] = "You count.";
    if (i % 4 == 0) r["history"] = json::array({json::array({"Ready?", "Yes."})});
    out += r.dump() + "\n";
  }
  return out;
}

RunConfig run_config(const std::string& train, const fs::path& dir,
                     const std::vector<std::string>& extra = {}) {
  std::vector<std::string> overrides = {"data.train=\"" + train + "\"",
                                        "log.dir=\"" + dir.string() + "\""};
  overrides.insert(overrides.end(), extra.begin(), extra.end());
  fs::remove_all(dir);
  return parse_run_config(R"({
    "model": {"preset": "tiny", "n_layers": 2, "dim": 32, "n_heads": 2, "n_kv_heads": 2,
              "ffn_dim": 64},
    "data": {"seq_len": 64, "valid_fraction": 0.1},
    "train": {"micro_batch": 2, "grad_accum": 1, "max_steps": 4, "warmup_steps": 1,
              "eval_every": 0, "eval_batches": 1, "seed": 7},
    "log": {"every_steps": 1}
  })",
                          overrides, SHARDLM_SOURCE_DIR);
}

TEST(FormatsRun, AlpacaJsonlTrainsOnTheTokenizedCorpusTargets) {
  const fs::path root = test::scratch_root() / "formats_run";
  fs::remove_all(root);
  fs::create_directories(root);
  const std::string data = (root / "alpaca.jsonl").string();
  std::ofstream(data) << alpaca_jsonl();
  const std::string corpus = (root / "corpus").string();
  std::ostringstream tokenize_log;
  ByteTokenizer tok;
  tokenize_files({data}, corpus, tok, tokenize_log);

  // The in-memory source is the corpus: tokens, documents and mask.
  const auto memory = open_source(data, tok);
  const auto shards = open_source(corpus, tok);
  ASSERT_EQ(memory->num_tokens(), shards->num_tokens());
  EXPECT_EQ(memory->doc_starts(), shards->doc_starts());
  ASSERT_TRUE(memory->has_loss_mask());
  const int64_t n = memory->num_tokens();
  std::vector<int32_t> mt(n), st(n);
  std::vector<uint8_t> mm(n), sm(n);
  memory->read(0, n, mt.data(), mm.data());
  shards->read(0, n, st.data(), sm.data());
  EXPECT_EQ(mt, st);
  EXPECT_EQ(mm, sm);
  EXPECT_EQ(memory->doc_starts().size(), 40u);

  std::ostringstream from_jsonl_log, from_corpus_log;
  const TrainResult from_jsonl = train(run_config(data, root / "run_jsonl"), from_jsonl_log);
  const TrainResult from_corpus = train(run_config(corpus, root / "run_corpus"), from_corpus_log);
  ASSERT_EQ(from_jsonl.steps, 4) << from_jsonl_log.str();
  EXPECT_TRUE(std::isfinite(from_jsonl.final_loss));
  EXPECT_EQ(from_jsonl.losses, from_corpus.losses);  // the same targets, bit for bit
  EXPECT_EQ(from_jsonl.tokens_seen, from_corpus.tokens_seen);
  EXPECT_NE(from_jsonl_log.str().find("data files tokenized in memory:\n  " + data +
                                      ": 40 documents (40 masked)"),
            std::string::npos)
      << from_jsonl_log.str();
}

TEST(FormatsRun, BadRecordsStopTheRunOrAreCounted) {
  const fs::path root = test::scratch_root() / "formats_run_bad";
  fs::remove_all(root);
  fs::create_directories(root);
  const std::string data = (root / "qa.jsonl").string();
  std::ofstream(data) << alpaca_jsonl() << R"({"question": "q", "answer": ""})"
                      << "\n";
  std::ostringstream log;
  try {
    train(run_config(data, root / "run"), log);
    ADD_FAILURE() << "a bad record did not stop the run";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kData);
    EXPECT_NE(std::string(e.what()).find(data + ":41: the record fits no format"),
              std::string::npos)
        << e.what();
  }
  const TrainResult r = train(run_config(data, root / "run", {"data.skip_bad_records=true"}), log);
  EXPECT_EQ(r.steps, 4);
  EXPECT_NE(log.str().find(data + ": 1 bad record skipped"), std::string::npos) << log.str();
  // An unknown data.format is a config error naming the key.
  try {
    run_config(data, root / "run", {"data.format=\"csv\""});
    ADD_FAILURE() << "data.format = csv was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kConfig);
    EXPECT_NE(std::string(e.what()).find("data.format"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace shardlm
