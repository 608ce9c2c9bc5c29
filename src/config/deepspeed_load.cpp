// Loading a run config with a DeepSpeed ds_config.json: reading the file, layering its
// overrides between the config file and the user's --set, and naming the DeepSpeed key behind
// a validation error. The key mapping itself is deepspeed.cpp's.
#include "shardlm/config/deepspeed.h"

#include <fmt/format.h>

#include <cctype>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "shardlm/config/config.h"
#include "shardlm/core/check.h"
#include "shardlm/parallel/topology.h"

namespace shardlm {
namespace {

using nlohmann::json;

// "[json.exception.parse_error.101] parse error at ..." -> "parse error at ...".
std::string without_exception_id(std::string what) {
  const size_t p = what.find("] ");
  return what.starts_with("[json.exception") && p != std::string::npos ? what.substr(p + 2) : what;
}

json read_deepspeed_file(const std::string& path) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec))
    SHARDLM_FAIL(ErrorKind::kConfig, "DeepSpeed config '{}' is a directory; pass a JSON file",
                 path);
  std::ifstream in(path, std::ios::binary);
  if (!in)
    SHARDLM_FAIL(ErrorKind::kConfig, "cannot read DeepSpeed config '{}': {}", path,
                 std::strerror(errno));
  std::ostringstream text;
  text << in.rdbuf();
  try {
    return json::parse(text.str());
  } catch (const json::parse_error& e) {
    SHARDLM_FAIL(ErrorKind::kConfig, "DeepSpeed config '{}': invalid JSON at byte {}: {}", path,
                 e.byte, without_exception_id(e.what()));
  } catch (const json::exception& e) {
    SHARDLM_FAIL(ErrorKind::kConfig, "DeepSpeed config '{}': invalid JSON: {}", path,
                 without_exception_id(e.what()));
  }
}

// Whether `message` names `key` as a whole key ("parallel.cp" is not in "parallel.cp_kind").
bool names_key(std::string_view message, std::string_view key) {
  for (size_t at = message.find(key); at != std::string_view::npos;
       at = message.find(key, at + 1)) {
    const size_t end = at + key.size();
    const bool word_end =
        end == message.size() || !(std::isalnum(static_cast<unsigned char>(message[end])) ||
                                   message[end] == '_' || message[end] == '.');
    const bool word_start =
        at == 0 || !(std::isalnum(static_cast<unsigned char>(message[at - 1])) ||
                     message[at - 1] == '_' || message[at - 1] == '.');
    if (word_start && word_end) return true;
  }
  return false;
}

}  // namespace

void check_deepspeed_batch(const DeepSpeedMapping& mapping, const RunConfig& cfg) {
  if (mapping.train_batch_size == 0) return;
  const ParallelDims dims{-1, cfg.parallel.pp, cfg.parallel.cp, cfg.parallel.tp};
  const int64_t dp = Topology(dims, mapping.world_size, 0).size(Axis::kDp);
  const int64_t total = cfg.train.micro_batch * cfg.train.grad_accum * dp;
  if (total != mapping.train_batch_size)
    SHARDLM_FAIL(ErrorKind::kConfig,
                 "the DeepSpeed config's train_batch_size ({}) must equal train.micro_batch ({}) x "
                 "train.grad_accum ({}) x data-parallel size ({}) = {}; a --set changed them: "
                 "make them agree, or set train_batch_size to \"auto\"",
                 mapping.train_batch_size, cfg.train.micro_batch, cfg.train.grad_accum, dp, total);
}

RunConfig load_run_config_with_deepspeed(const std::string& config_path,
                                         const std::string& deepspeed_path,
                                         const std::vector<std::string>& overrides,
                                         int64_t world_size, std::vector<std::string>& warnings) {
  const json ds = read_deepspeed_file(deepspeed_path);
  const RunConfig base = load_run_config_unvalidated(config_path, overrides);
  DeepSpeedMapping mapping;
  try {
    mapping = map_deepspeed_config(ds, base, world_size);
  } catch (const Error& e) {
    if (e.kind() != ErrorKind::kConfig) throw;
    SHARDLM_FAIL(ErrorKind::kConfig, "DeepSpeed config '{}': {}", deepspeed_path, e.what());
  }
  warnings.insert(warnings.end(), mapping.warnings.begin(), mapping.warnings.end());

  std::vector<std::string> all = mapping.overrides;
  all.insert(all.end(), overrides.begin(), overrides.end());
  try {
    RunConfig cfg = load_run_config(config_path, all);
    check_deepspeed_batch(mapping, cfg);
    return cfg;
  } catch (const Error& e) {
    if (e.kind() != ErrorKind::kConfig) throw;
    std::string origins;
    for (size_t i = 0; i < mapping.overrides.size(); ++i) {
      const std::string key = mapping.overrides[i].substr(0, mapping.overrides[i].find('='));
      const std::string origin = fmt::format("{} from {}", key, mapping.sources[i]);
      if (names_key(e.what(), key) && origins.find(origin) == std::string::npos)
        origins += (origins.empty() ? "" : ", ") + origin;
    }
    if (origins.empty()) throw;
    SHARDLM_FAIL(ErrorKind::kConfig, "{} (set by the DeepSpeed config '{}': {})", e.what(),
                 deepspeed_path, origins);
  }
}

}  // namespace shardlm
