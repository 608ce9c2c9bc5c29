// `shardlm tokenize --input FILE... --output DIR [--tokenizer PATH]`: text and JSONL files
// into a token-shard corpus that `shardlm train` reads with data.train = DIR. The formats
// and the chat template are in shardlm/io/tokenize.h.
#include <iostream>

#include "commands.h"
#include "shardlm/io/tokenize.h"

namespace shardlm::cli {

Command add_tokenize_command(CLI::App& app) {
  struct Options {
    std::vector<std::string> inputs;
    std::string output;
    std::string tokenizer;
  };
  auto opt = std::make_shared<Options>();
  CLI::App* sub = app.add_subcommand(
      "tokenize", "turn text (.txt) and JSONL (.jsonl: text or chat) files into token shards");
  sub->add_option("--input", opt->inputs,
                  "input files, in order: .jsonl holds {\"text\"} or {\"messages\"} records; "
                  "anything else is plain text with blank lines between documents")
      ->required();
  sub->add_option("--output", opt->output, "corpus directory to write (index.json + shards)")
      ->required();
  sub->add_option("--tokenizer", opt->tokenizer, "tokenizer: \"byte\" (the default)");
  return {sub, [opt] {
            const auto tok = load_tokenizer(opt->tokenizer);
            tokenize_files(opt->inputs, opt->output, *tok, std::cout);
            return 0;
          }};
}

}  // namespace shardlm::cli
