// `shardlm tokenize --input FILE... --output DIR [--tokenizer PATH] [--threads N] [--format F]
// [--column FIELD=KEY...] [--tag TAG=VALUE...] [--skip-bad-records]`: text and record (.jsonl,
// .json) files into a token-shard corpus that `shardlm train` reads with data.train = DIR; with
// `--print-ids`, the ids of each input file (the whole file as one text) on a line instead,
// for checking a tokenizer against another implementation. The formats and the chat template
// are in shardlm/io/tokenize.h and records.h.
#include <algorithm>
#include <fstream>
#include <iostream>
#include <sstream>
#include <thread>

#include "commands.h"
#include "shardlm/io/tokenize.h"

namespace shardlm::cli {
namespace {

// "FIELD=KEY" pairs into the named fields of RecordColumns or RecordTags; an unknown field or a
// pair without '=' is Error(kConfig) naming the option.
template <class Fields>
void map_fields(const std::vector<std::string>& pairs, const char* option,
                const std::vector<std::pair<const char*, std::string Fields::*>>& fields,
                Fields& out) {
  for (const std::string& pair : pairs) {
    const size_t eq = pair.find('=');
    const std::string field = pair.substr(0, eq);
    const auto it =
        std::find_if(fields.begin(), fields.end(), [&](const auto& f) { return field == f.first; });
    if (eq == std::string::npos || eq + 1 == pair.size() || it == fields.end()) {
      std::string names;
      for (const auto& f : fields) names += (names.empty() ? "" : ", ") + std::string(f.first);
      SHARDLM_FAIL(ErrorKind::kConfig, "{} \"{}\": give FIELD=NAME with FIELD one of {}", option,
                   pair, names);
    }
    out.*(it->second) = pair.substr(eq + 1);
  }
}

RecordOptions record_options(const std::string& format, const std::vector<std::string>& columns,
                             const std::vector<std::string>& tags, bool skip_bad_records) {
  RecordOptions o;
  o.format = parse_record_format(format, "--format");
  map_fields<RecordColumns>(columns, "--column",
                            {{"messages", &RecordColumns::messages},
                             {"instruction", &RecordColumns::instruction},
                             {"input", &RecordColumns::input},
                             {"output", &RecordColumns::output},
                             {"system", &RecordColumns::system},
                             {"history", &RecordColumns::history},
                             {"prompt", &RecordColumns::prompt},
                             {"completion", &RecordColumns::completion},
                             {"text", &RecordColumns::text}},
                            o.columns);
  map_fields<RecordTags>(tags, "--tag",
                         {{"role", &RecordTags::role},
                          {"content", &RecordTags::content},
                          {"user", &RecordTags::user},
                          {"assistant", &RecordTags::assistant},
                          {"system", &RecordTags::system}},
                         o.tags);
  o.skip_bad_records = skip_bad_records;
  return o;
}

}  // namespace

Command add_tokenize_command(CLI::App& app) {
  struct Options {
    std::vector<std::string> inputs;
    std::string output;
    std::string tokenizer;
    bool print_ids = false;
    std::string format = "auto";
    std::vector<std::string> columns, tags;
    bool skip_bad_records = false;
    int threads = int(std::max(1u, std::thread::hardware_concurrency()));
  };
  auto opt = std::make_shared<Options>();
  CLI::App* sub = app.add_subcommand(
      "tokenize",
      "turn text and record files (.jsonl, .json: chats, instructions, prompt/completion pairs, "
      "texts) into token shards");
  sub->add_option("--input", opt->inputs,
                  "input files, in order: .jsonl (one record per line) and .json (a JSON array of "
                  "records) hold records (see --format); anything else is plain text with blank "
                  "lines between documents")
      ->required();
  sub->add_option("--format", opt->format,
                  "how records are read: auto (each by its keys), messages, alpaca, sharegpt, "
                  "prompt_completion or text (the config's data.format)")
      ->capture_default_str();
  sub->add_option("--column", opt->columns,
                  "FIELD=KEY: read a record field from another key, e.g. instruction=question "
                  "output=answer (FIELD: messages, instruction, input, output, system, history, "
                  "prompt, completion, text; the config's data.columns.*)");
  sub->add_option("--tag", opt->tags,
                  "TAG=VALUE: ShareGPT's turn keys and roles, e.g. role=from user=human (TAG: "
                  "role, content, user, assistant, system; the config's data.tags.*)");
  sub->add_flag("--skip-bad-records", opt->skip_bad_records,
                "skip and count bad records (the count and first messages are logged per file) "
                "instead of stopping with exit code 3 at the first");
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
            const RecordOptions records =
                record_options(opt->format, opt->columns, opt->tags, opt->skip_bad_records);
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
                           opt->threads, records);
            return 0;
          }};
}

}  // namespace shardlm::cli
