// load_record_source (data.h): a .jsonl / .json file of records tokenized in memory by io's
// record reader, the same documents and loss mask `shardlm tokenize` writes into shards.
#include <algorithm>
#include <ostream>
#include <thread>

#include "shardlm/io/tokenize.h"
#include "shardlm/train/data.h"

namespace shardlm {

std::shared_ptr<TokenSource> load_record_source(const std::string& path, const Tokenizer& tok,
                                                const RecordOptions& options, std::ostream& log) {
  std::vector<int32_t> tokens;
  std::vector<int64_t> docs;
  std::vector<uint8_t> mask;
  const int threads = int(std::max(1u, std::thread::hardware_concurrency()));
  const FileStats stats = read_documents(path, tok, options, threads, [&](const DocumentTokens& d) {
    docs.push_back(int64_t(tokens.size()));
    tokens.insert(tokens.end(), d.tokens.begin(), d.tokens.end());
    // The mask is built once some document has one; the documents before it are all targets.
    if (!d.mask.empty() && mask.empty()) mask.assign(tokens.size() - d.tokens.size(), 1);
    if (!d.mask.empty())
      mask.insert(mask.end(), d.mask.begin(), d.mask.end());
    else if (!mask.empty())
      mask.insert(mask.end(), d.tokens.size(), 1);
  });
  log << describe_file(path, stats);
  if (stats.pairs > 0 && stats.pairs * 2 != stats.docs)
    SHARDLM_FAIL(ErrorKind::kData,
                 "{}: holds {} preference records and {} documents of other records; a "
                 "preference file holds only prompt/chosen/rejected records",
                 path, stats.pairs, stats.docs - 2 * stats.pairs);
  return make_memory_source(std::move(tokens), std::move(docs), path, std::move(mask),
                            stats.pairs > 0);
}

}  // namespace shardlm
