// Private to src/train's checkpoint storage (checkpoint.cpp writes, checkpoint_reader.cpp
// reads): the on-disk names, the manifest's format number, CRC-32 helpers and the directory
// queries both sides use.
#pragma once

#include <zlib.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "shardlm/core/check.h"

namespace shardlm::checkpoint_files {

// 1: whole files only; 2: also vectors in ranges ("vectors", per-file "ranges"). Readers take
// both; writers write 2.
constexpr int kManifestFormat = 2;
constexpr int kOldestManifestFormat = 1;
constexpr const char* kManifestName = "manifest.json";
constexpr const char* kLatestName = "latest";
constexpr const char* kTmpPrefix = ".tmp-";
constexpr size_t kIoChunk = size_t{4} << 20;  // streaming unit for CRC and copies

inline std::string step_dir_name(int64_t step) { return fmt::format("step_{:08d}", step); }

// The step of a "step_<digits>" name, or -1.
inline int64_t parse_step_dir_name(const std::string& name) {
  if (name.size() <= 5 || name.compare(0, 5, "step_") != 0 || name.size() > 5 + 18) return -1;
  int64_t step = 0;
  for (size_t i = 5; i < name.size(); ++i) {
    if (name[i] < '0' || name[i] > '9') return -1;
    step = step * 10 + (name[i] - '0');
  }
  return step;
}

inline bool valid_file_name(const std::string& name) {
  return !name.empty() && name.find('/') == std::string::npos &&
         name.find('\0') == std::string::npos && name.find("..") == std::string::npos &&
         name != ".";
}

inline uint32_t crc32_empty() { return static_cast<uint32_t>(::crc32(0, Z_NULL, 0)); }

inline uint32_t crc32_update(uint32_t crc, const void* data, size_t bytes) {
  const auto* p = static_cast<const Bytef*>(data);
  while (bytes > 0) {
    const uInt n = static_cast<uInt>(std::min(bytes, kIoChunk));
    crc = static_cast<uint32_t>(::crc32(crc, p, n));
    p += n;
    bytes -= n;
  }
  return crc;
}

inline std::string crc_hex(uint32_t crc) { return fmt::format("{:08x}", crc); }

// "0123abcd" -> its value; throws std::runtime_error naming `what` when malformed.
inline uint32_t parse_crc_hex(const std::string& text, const std::string& what) {
  if (text.size() != 8 || text.find_first_not_of("0123456789abcdef") != std::string::npos)
    throw std::runtime_error(fmt::format("bad crc32 \"{}\" for {}", text, what));
  return static_cast<uint32_t>(std::stoul(text, nullptr, 16));
}

bool is_dir(const std::string& path);
bool is_file(const std::string& path);
// `latest`'s step directory name, "" when there is no `latest`; kData when it names none.
std::string read_latest_name(const std::string& checkpoints_dir);

}  // namespace shardlm::checkpoint_files
