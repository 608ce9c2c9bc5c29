// What the tokenizer parity tests (test_bpe, test_sentencepiece) share: a reference tokenizer
// trained by their Python script in a fresh directory, and the check that `shardlm tokenize`'s
// threads write byte-identical shards. Tests only.
#pragma once

#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "shardlm/io/tokenize.h"
#include "test_util.h"

namespace shardlm::test {

// A fresh scratch directory `name` in which `script make DIR kind CORPUS` trains a reference
// tokenizer of `kind` on the test corpus.
inline std::filesystem::path reference_tokenizer_dir(const std::string& python,
                                                     const std::string& script,
                                                     const std::string& name,
                                                     const std::string& kind) {
  const std::filesystem::path dir = scratch_root() / name;
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  run_command(python + " " + script + " make " + dir.string() + " " + kind + " " +
                  SHARDLM_SOURCE_DIR + "/tests/data/genesis_1_12.txt",
              dir / "make.txt");
  return dir;
}

// tokenize_files of `texts` (as JSONL) on 4 threads writes the same bytes as on 1.
inline void expect_threads_give_the_same_shards(const std::vector<std::string>& texts,
                                                const Tokenizer& tok,
                                                const std::filesystem::path& dir) {
  {
    std::ofstream f(dir / "texts.jsonl", std::ios::binary);
    for (const std::string& t : texts) f << nlohmann::json{{"text", t}}.dump() << "\n";
  }
  std::ostringstream log;
  tokenize_files({(dir / "texts.jsonl").string()}, (dir / "corpus_1").string(), tok, log, 1 << 14,
                 1);
  tokenize_files({(dir / "texts.jsonl").string()}, (dir / "corpus_4").string(), tok, log, 1 << 14,
                 4);
  expect_same_files(dir / "corpus_1", dir / "corpus_4");
}

}  // namespace shardlm::test
