// The inputs the DeepSpeed mapping tests share: a minimal shardlm config, the realistic
// ds_configs of tests/data/deepspeed/ and a scratch directory for whole-load files. Tests only.
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "shardlm/config/config.h"
#include "test_util.h"

namespace shardlm::test {

inline constexpr const char* kShardlmConfig =
    R"({"data": {"train": "/data/t.txt"}, "train": {"max_steps": 10}})";

inline std::string data_path(const std::string& name) {
  return std::string(SHARDLM_SOURCE_DIR) + "/tests/data/deepspeed/" + name;
}

inline nlohmann::json read_ds(const std::string& name) {
  std::ifstream in(data_path(name));
  EXPECT_TRUE(in.good()) << name;
  return nlohmann::json::parse(in);
}

inline RunConfig base_config(const std::vector<std::string>& sets = {}) {
  return parse_run_config(kShardlmConfig, sets, "");
}

class TempDir {
 public:
  TempDir() {
    path_ = scratch_root() /
            ("shardlm_test_deepspeed_" + std::to_string(getpid()) + "_" + std::to_string(next_++));
    std::filesystem::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  std::string write(const std::string& name, const std::string& text) const {
    std::ofstream(path_ / name) << text;
    return (path_ / name).string();
  }

 private:
  static inline int next_ = 0;
  std::filesystem::path path_;
};

}  // namespace shardlm::test
