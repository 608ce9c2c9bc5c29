// Private to src/train's checkpoint storage (checkpoint.cpp writes, checkpoint_reader.cpp
// reads): the on-disk names, the manifest's format number, CRC-32 helpers and the directory
// queries both sides use.
#pragma once

#include <zlib.h>

#include <algorithm>
#include <cstdint>
#include <queue>
#include <string>
#include <utility>
#include <vector>

#include "shardlm/core/check.h"

namespace shardlm::checkpoint_files {

// 1: whole files only; 2: also vectors in ranges ("vectors", per-file "ranges"); 3: a range may
// be a strided run (six fields instead of four). Readers take all three; writers write 3 when a
// range is a strided run, else 2 (what a reader of format 2 reads as it is).
constexpr int kManifestFormat = 3;
constexpr int kPlainRangesManifestFormat = 2;
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

// Elements begin + k * stride + [0, count) of a vector for k < repeat (a tp rank's share of a
// column-split matrix is one such run: a row piece every row), held back to back in the file.
// repeat 1 is a plain range [begin, begin + count) (stride 0). A run's rows never overlap one
// another and ascend: repeat > 1 needs stride > count.
struct RunShape {
  int64_t begin = 0, count = 0, stride = 0, repeat = 1;
  int64_t elems() const { return count * repeat; }
  int64_t row_begin(int64_t k) const { return begin + k * stride; }
  int64_t end() const { return row_begin(repeat - 1) + count; }  // past the last element
};

// "" when the run's fields make sense in a vector of `elems` elements, else what is wrong.
inline std::string run_shape_error(const RunShape& r, int64_t elems) {
  if (r.count <= 0 || r.begin < 0 || r.repeat < 1) return "empty or negative";
  if (r.repeat == 1) return r.stride == 0 && r.count <= elems - r.begin ? "" : "past the vector";
  if (r.stride <= r.count) return "rows overlap (stride <= count)";
  // end() <= elems without overflow: (repeat - 1) * stride <= elems - begin - count.
  if (r.count > elems - r.begin || r.stride > (elems - r.begin - r.count) / (r.repeat - 1))
    return "past the vector";
  return "";
}

// "[b, e)" for a plain range; "[b, b + count) + k * stride for k < repeat (in [b, end))".
inline std::string run_text(const RunShape& r) {
  if (r.repeat == 1) return fmt::format("[{}, {})", r.begin, r.begin + r.count);
  return fmt::format("[{}, {}) + k * {} for k < {} (in [{}, {}))", r.begin, r.begin + r.count,
                     r.stride, r.repeat, r.begin, r.end());
}

// The first element of [0, elems) that `runs` do not hold exactly once, as a message; "" when
// they tile it. Merges the runs' rows in order through a heap of one cursor a run: memory in
// the number of runs, not of rows.
inline std::string tiling_error(const std::vector<RunShape>& runs, int64_t elems) {
  using Cursor = std::pair<int64_t, std::pair<size_t, int64_t>>;  // (row begin, (run, k))
  std::priority_queue<Cursor, std::vector<Cursor>, std::greater<>> rows;
  for (size_t i = 0; i < runs.size(); ++i)
    if (runs[i].count > 0 && runs[i].repeat > 0) rows.push({runs[i].begin, {i, 0}});
  int64_t at = 0;
  while (!rows.empty()) {
    const auto [begin, cursor] = rows.top();
    rows.pop();
    const RunShape& r = runs[cursor.first];
    if (begin > at) return fmt::format("elements [{}, {}) are in no file", at, begin);
    if (begin < at) return fmt::format("element {} is in two files", begin);
    at = begin + r.count;
    if (cursor.second + 1 < r.repeat)
      rows.push({r.row_begin(cursor.second + 1), {cursor.first, cursor.second + 1}});
  }
  if (at != elems) return fmt::format("elements [{}, {}) are in no file", at, elems);
  return "";
}

bool is_dir(const std::string& path);
bool is_file(const std::string& path);
// `latest`'s step directory name, "" when there is no `latest`; kData when it names none.
std::string read_latest_name(const std::string& checkpoints_dir);

}  // namespace shardlm::checkpoint_files
