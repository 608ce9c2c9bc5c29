// `shardlm tokenize --input FILE... --output DIR [--tokenizer PATH] [--threads N]`: text and
// JSONL files into a token-shard corpus that `shardlm train` reads with data.train = DIR; with
// `--print-ids`, the ids of each input file (the whole file as one text) on a line instead,
// for checking a tokenizer against another implementation. The formats and the chat template
// are in shardlm/io/tokenize.h.
#include <algorithm>
#include <fstream>
#include <iostream>
#include <sstream>
#include <thread>

#include "commands.h"
#include "shardlm/io/tokenize.h"

namespace shardlm::cli {

Command add_tokenize_command(CLI::App& app) {
  struct Options {
    std::vector<std::string> inputs;
    std::string output;
    std::string tokenizer;
    bool print_ids = false;
    int threads = int(std::max(1u, std::thread::hardware_concurrency()));
  };
  auto opt = std::make_shared<Options>();
  CLI::App* sub = app.add_subcommand(
      "tokenize", "turn text (.txt) and JSONL (.jsonl: text or chat) files into token shards");
  sub->add_option("--input", opt->inputs,
                  "input files, in order: .jsonl holds {\"text\"} or {\"messages\"} records; "
                  "anything else is plain text with blank lines between documents")
      ->required();
  sub->add_option("--output", opt->output, "corpus directory to write (index.json + shards)");
  sub->add_option("--tokenizer", opt->tokenizer,
                  "\"byte\" (the default), or a directory holding tokenizer.json, vocab.json + "
                  "merges.txt or tokenizer.model (SentencePiece or tiktoken), or one of those "
                  "files");
  sub->add_option("--threads", opt->threads,
                  "threads encoding documents (default: the number of cores); the shards are "
                  "the same bytes for any number")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  sub->add_flag("--print-ids", opt->print_ids,
                "print each input file's ids (the file as one text, no special tokens added), "
                "one line per file, instead of writing shards");
  return {sub, [opt] {
            const auto tok = load_tokenizer(opt->tokenizer);
            if (opt->print_ids) {
              for (const std::string& path : opt->inputs) {
                std::ifstream f(path, std::ios::binary);
                if (!f) SHARDLM_FAIL(ErrorKind::kData, "{}: cannot read", path);
                std::stringstream text;
                text << f.rdbuf();
                const std::vector<int32_t> ids = tok->encode(text.str());
                for (size_t i = 0; i < ids.size(); ++i) std::cout << (i ? " " : "") << ids[i];
                std::cout << "\n";
              }
              return 0;
            }
            if (opt->output.empty())
              SHARDLM_FAIL(ErrorKind::kConfig, "--output is required (or --print-ids)");
            tokenize_files(opt->inputs, opt->output, *tok, std::cout, int64_t(1) << 28,
                           opt->threads);
            return 0;
          }};
}

}  // namespace shardlm::cli
