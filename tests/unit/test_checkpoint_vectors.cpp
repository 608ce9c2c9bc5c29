// Sharded vectors in checkpoint storage (src/checkpoint/checkpoint.cpp, checkpoint_reader.cpp):
// ranges written out of order over several files read back as the whole vector and as any
// sub-range, merged ranges keep their CRC-32, the commit refuses shares that leave a gap or
// hold an element twice, a corrupt range is named by file, vector and elements, a missing file
// by the ranges it held, the verification split over parts covers every file, a failure in a
// group commits nothing, and old whole-file vectors (<name>.bin) still read. Strided runs:
// equal rows at a regular stride (a tp rank's columns of a matrix) fold into one manifest entry,
// irregular ones start new entries, overlapping or repeated rows never fold, a corrupt run is
// named with its rows, and a format-2 manifest of one range a row still reads.
#include <gtest/gtest.h>
#include <unistd.h>
#include <zlib.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <numeric>
#include <string>
#include <tuple>
#include <vector>

#include "shardlm/checkpoint/checkpoint.h"
#include "shardlm/comm/local.h"
#include "shardlm/core/check.h"
#include "test_util.h"

namespace shardlm {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// f throws Error of `kind` whose message contains `part`.
template <class F>
void expect_error(F&& f, ErrorKind kind, const std::string& part) {
  try {
    f();
    ADD_FAILURE() << "no error; expected one containing \"" << part << "\"";
  } catch (const Error& e) {
    EXPECT_EQ(static_cast<int>(e.kind()), static_cast<int>(kind)) << e.what();
    EXPECT_NE(std::string(e.what()).find(part), std::string::npos)
        << "message \"" << e.what() << "\" lacks \"" << part << "\"";
  }
}

// The manifest's spelling of the CRC-32 of `bytes`.
std::string crc32_hex(const std::string& bytes) {
  const auto crc = ::crc32(::crc32(0, Z_NULL, 0), reinterpret_cast<const Bytef*>(bytes.data()),
                           uInt(bytes.size()));
  return fmt::format("{:08x}", crc);
}

class CheckpointVectors : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = test::scratch_root() / fmt::format("shardlm_ckvec_{}_{}", info->name(), getpid());
    fs::remove_all(dir_);
  }
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }
  // values[i] = i: elements [0, 100) of "v" (f32) in two files, out of order and in runs that
  // merge (a's [40, 60) is written as [40, 50) + [50, 60)).
  std::string write_two_files(CheckpointWriter& w) {
    w.declare_vector("v", 4, 100);
    w.begin_vector_file("a.bin", "v");
    w.append_elements(40, values_.data() + 40, 10);
    w.append_elements(50, values_.data() + 50, 10);
    w.append_elements(0, values_.data(), 20);
    w.end_file();
    w.begin_vector_file("b.bin", "v");
    w.append_elements(60, values_.data() + 60, 40);
    w.append_elements(20, values_.data() + 20, 20);
    w.end_file();
    return w.commit(0);
  }
  std::string dir() const { return dir_.string(); }
  fs::path dir_;
  std::vector<float> values_ = [] {
    std::vector<float> v(100);
    std::iota(v.begin(), v.end(), 0.0f);
    return v;
  }();
};

TEST_F(CheckpointVectors, RangesOverFilesReadBackWholeAndInParts) {
  CheckpointWriter w(dir(), 3);
  const std::string step = write_two_files(w);
  const json m = json::parse(test::slurp(fs::path(step) / "manifest.json"));
  EXPECT_EQ(m["format"], 2);  // plain ranges only
  EXPECT_EQ(m["vectors"]["v"]["elems"], 100);
  ASSERT_EQ(m["files"]["a.bin"]["ranges"].size(), 2u);  // [40, 60) merged, then [0, 20)
  EXPECT_EQ(m["files"]["a.bin"]["ranges"][0][1], 20);
  const CheckpointReader r(step);  // verifies every range's CRC-32 and the files'
  EXPECT_TRUE(r.has_vector("v"));
  EXPECT_EQ(r.vector_bytes("v"), 400u);
  std::vector<float> all(100, -1.0f);
  r.read_vector("v", 0, all.data(), 400);
  EXPECT_EQ(all, values_);
  std::vector<float> part(45, -1.0f);  // [15, 60): three ranges in two files
  r.read_vector("v", 15 * 4, part.data(), part.size() * 4);
  EXPECT_EQ(part, std::vector<float>(values_.begin() + 15, values_.begin() + 60));
}

TEST_F(CheckpointVectors, CommitRefusesAGapOrAnElementHeldTwice) {
  {
    CheckpointWriter w(dir(), 1);
    w.declare_vector("v", 4, 100);
    w.begin_vector_file("a.bin", "v");
    w.append_elements(0, values_.data(), 90);
    w.end_file();
    expect_error([&] { w.commit(0); }, ErrorKind::kInternal, "elements [90, 100)");
  }
  CheckpointWriter w(dir(), 1);
  w.declare_vector("v", 4, 100);
  w.begin_vector_file("a.bin", "v");
  w.append_elements(0, values_.data(), 60);
  w.append_elements(50, values_.data() + 50, 50);
  w.end_file();
  expect_error([&] { w.commit(0); }, ErrorKind::kInternal, "element 50 is in two files");
  EXPECT_EQ(latest_checkpoint(dir()), "");
}

TEST_F(CheckpointVectors, ACorruptRangeOrAMissingFileIsNamed) {
  CheckpointWriter w(dir(), 2);
  const std::string step = write_two_files(w);
  const std::string b = step + "/b.bin";
  {
    std::fstream f(b, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(40 * 4 + 5);  // inside b's second range, elements [20, 40)
    f.put('\x7f');
  }
  expect_error([&] { CheckpointReader r(step); }, ErrorKind::kData,
               "b.bin: checksum mismatch in v elements [20, 40)");
  // Split over two parts, the file is part 1's (a.bin is 0, b.bin 1).
  const CheckpointReader sizes(step, CheckpointReader::Verify::kSizesOnly);
  EXPECT_NO_THROW(sizes.verify_contents(0, 2));
  expect_error([&] { sizes.verify_contents(1, 2); }, ErrorKind::kData, "b.bin");
  fs::remove(b);
  expect_error([&] { CheckpointReader r(step, CheckpointReader::Verify::kSizesOnly); },
               ErrorKind::kData, "b.bin: missing (holds v elements [60, 100), [20, 40))");
}

TEST_F(CheckpointVectors, AGroupCommitsNothingWhenARankFailed) {
  LocalCommunicator one;
  {
    CheckpointWriter w(dir(), 4, one);
    w.declare_vector("v", 4, 100);
    w.begin_vector_file("a.bin", "v");
    w.append_elements(0, values_.data(), 100);
    w.end_file();
    expect_error([&] { w.commit(0, "disk full"); }, ErrorKind::kData, "rank 0: disk full");
  }
  EXPECT_EQ(latest_checkpoint(dir()), "");
  EXPECT_TRUE(list_checkpoints(dir()).empty());
  CheckpointWriter w(dir(), 5, one);
  const std::string step = write_two_files(w);
  EXPECT_EQ(latest_checkpoint(dir()), step);
  EXPECT_NO_THROW(CheckpointReader r(step));
}

TEST_F(CheckpointVectors, AWholeFileIsTheVectorOfItsName) {
  CheckpointWriter w(dir(), 6);
  w.add_file("params.bin", values_.data(), 400);
  const CheckpointReader r(w.commit(0));
  EXPECT_TRUE(r.has_vector("params"));
  EXPECT_FALSE(r.has_vector("v"));
  EXPECT_EQ(r.vector_bytes("params"), 400u);
  float x = 0;
  r.read_vector("params", 7 * 4, &x, 4);
  EXPECT_EQ(x, 7.0f);
  expect_error([&] { (void)r.vector_bytes("adam_m"); }, ErrorKind::kData, "adam_m");
}

// Columns [c0, c1) of every row of a [rows, cols] matrix of `values` (row-major), row by row.
void append_columns(CheckpointWriter& w, const std::vector<float>& values, int64_t rows,
                    int64_t cols, int64_t c0, int64_t c1) {
  for (int64_t r = 0; r < rows; ++r)
    w.append_elements(r * cols + c0, values.data() + r * cols + c0, c1 - c0);
}

// v [10, 10] split by columns as tp splits a matrix: a.bin holds columns [0, 4) of every row,
// b.bin columns [4, 10); committed as `step`, whose directory is returned.
std::string commit_column_split(const std::string& dir, int64_t step,
                                const std::vector<float>& values) {
  CheckpointWriter w(dir, step);
  w.declare_vector("v", 4, 100);
  w.begin_vector_file("a.bin", "v");
  append_columns(w, values, 10, 10, 0, 4);
  w.end_file();
  w.begin_vector_file("b.bin", "v");
  append_columns(w, values, 10, 10, 4, 10);
  w.end_file();
  return w.commit(0);
}

TEST_F(CheckpointVectors, RegularRowsFoldIntoOneStridedRun) {
  // One run each in a.bin and b.bin.
  const std::string step = commit_column_split(dir(), 7, values_);
  const json m = json::parse(test::slurp(fs::path(step) / "manifest.json"));
  EXPECT_EQ(m["format"], 3);  // strided runs: format 2 readers cannot take it
  ASSERT_EQ(m["files"]["a.bin"]["ranges"].size(), 1u) << m.dump();
  const json& a = m["files"]["a.bin"]["ranges"][0];  // [begin, count, offset, crc, stride, repeat]
  EXPECT_EQ(a, json::array({0, 4, 0, m["files"]["a.bin"]["crc32"], 10, 10}));
  EXPECT_EQ(m["files"]["b.bin"]["ranges"],
            json::array({json::array({4, 6, 0, m["files"]["b.bin"]["crc32"], 10, 10})}));
  const CheckpointReader r(step);
  std::vector<float> all(100, -1.0f);
  r.read_vector("v", 0, all.data(), 400);
  EXPECT_EQ(all, values_);
  std::vector<float> part(59, -1.0f);  // [13, 72): rows 1 to 7 of both runs, cut mid-row
  r.read_vector("v", 13 * 4, part.data(), part.size() * 4);
  EXPECT_EQ(part, std::vector<float>(values_.begin() + 13, values_.begin() + 72));
  float x = 0;
  r.read_vector("v", 99 * 4, &x, 4);
  EXPECT_EQ(x, 99.0f);
}

TEST_F(CheckpointVectors, IrregularRowsStartNewRuns) {
  CheckpointWriter w(dir(), 8);
  w.declare_vector("v", 4, 48);
  w.begin_vector_file("a.bin", "v");
  for (auto [b, n] :
       {std::pair<int64_t, int64_t>{0, 4}, {8, 4}, {16, 4}, {26, 2}, {30, 2}, {40, 4}})
    w.append_elements(b, values_.data() + b, n);
  w.end_file();
  w.begin_vector_file("b.bin", "v");
  // [20, 26) breaks the stride of [4, 4) + [12, 4); [32, 4) + [36, 4) join up, a single row
  for (auto [b, n] :
       {std::pair<int64_t, int64_t>{4, 4}, {12, 4}, {20, 6}, {28, 2}, {32, 4}, {36, 4}, {44, 4}})
    w.append_elements(b, values_.data() + b, n);
  w.end_file();
  const std::string step = w.commit(0);
  const json m = json::parse(test::slurp(fs::path(step) / "manifest.json"));
  auto shapes = [&](const std::string& file) {  // (begin, count, stride, repeat) of each range
    std::vector<std::vector<int64_t>> out;
    for (const json& r : m["files"][file]["ranges"])
      out.push_back({r[0].get<int64_t>(), r[1].get<int64_t>(),
                     r.size() == 6 ? r[4].get<int64_t>() : 0,
                     r.size() == 6 ? r[5].get<int64_t>() : 1});
    return out;
  };
  using Shapes = std::vector<std::vector<int64_t>>;
  EXPECT_EQ(shapes("a.bin"), (Shapes{{0, 4, 8, 3}, {26, 2, 4, 2}, {40, 4, 0, 1}}));
  EXPECT_EQ(shapes("b.bin"),
            (Shapes{{4, 4, 8, 2}, {20, 6, 0, 1}, {28, 2, 0, 1}, {32, 8, 0, 1}, {44, 4, 0, 1}}));
  const CheckpointReader r(step);  // every run's CRC-32 verified
  std::vector<float> all(48, -1.0f);
  r.read_vector("v", 0, all.data(), all.size() * 4);
  EXPECT_EQ(all, std::vector<float>(values_.begin(), values_.begin() + 48));
}

TEST_F(CheckpointVectors, RepeatedOrBackwardRowsNeverFold) {
  {  // the same row twice (stride 0) stays two ranges: the commit finds the element held twice
    CheckpointWriter w(dir(), 9);
    w.declare_vector("v", 4, 8);
    w.begin_vector_file("a.bin", "v");
    w.append_elements(0, values_.data(), 4);
    w.append_elements(0, values_.data(), 4);
    w.append_elements(4, values_.data() + 4, 4);
    w.end_file();
    expect_error([&] { w.commit(0); }, ErrorKind::kInternal, "element 0 is in two files");
  }
  {  // rows closer than their length overlap: no run; the commit names the first overlap
    CheckpointWriter w(dir(), 9);
    w.declare_vector("v", 4, 12);
    w.begin_vector_file("a.bin", "v");
    w.append_elements(0, values_.data(), 4);
    w.append_elements(2, values_.data() + 2, 4);
    w.append_elements(6, values_.data() + 6, 6);
    w.end_file();
    expect_error([&] { w.commit(0); }, ErrorKind::kInternal, "element 2 is in two files");
  }
  // Rows written backwards are ranges of their own and read back.
  CheckpointWriter w(dir(), 9);
  w.declare_vector("v", 4, 12);
  w.begin_vector_file("a.bin", "v");
  for (int64_t b : {8, 4, 0}) w.append_elements(b, values_.data() + b, 4);
  w.end_file();
  const std::string step = w.commit(0);
  EXPECT_EQ(
      json::parse(test::slurp(fs::path(step) / "manifest.json"))["files"]["a.bin"]["ranges"].size(),
      3u);
  std::vector<float> all(12, -1.0f);
  CheckpointReader(step).read_vector("v", 0, all.data(), 48);
  EXPECT_EQ(all, std::vector<float>(values_.begin(), values_.begin() + 12));
}

TEST_F(CheckpointVectors, AGapInStridedRunsIsNamedAtCommit) {
  CheckpointWriter w(dir(), 10);
  w.declare_vector("v", 4, 100);
  w.begin_vector_file("a.bin", "v");
  append_columns(w, values_, 10, 10, 0, 4);
  w.end_file();
  w.begin_vector_file("b.bin", "v");
  append_columns(w, values_, 6, 10, 4, 10);   // rows 6 to 9 of columns [4, 10) missing
  append_columns(w, values_, 1, 10, 74, 80);  // the last row of it comes back alone
  w.end_file();
  expect_error([&] { w.commit(0); }, ErrorKind::kInternal,
               "checkpoint vector \"v\": elements [64, 70) are in no file");
}

TEST_F(CheckpointVectors, ACorruptStridedRunIsNamedWithItsRows) {
  const std::string step = commit_column_split(dir(), 11, values_);
  {
    std::fstream f(step + "/b.bin", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(33 * 4 + 1);  // row 5 of the run
    f.put('\x7f');
  }
  const std::string rows = "v elements [4, 10) + k * 10 for k < 10 (in [4, 100))";
  expect_error([&] { CheckpointReader r(step); }, ErrorKind::kData,
               "b.bin: checksum mismatch in " + rows);
  fs::remove(step + "/b.bin");
  expect_error([&] { CheckpointReader r(step, CheckpointReader::Verify::kSizesOnly); },
               ErrorKind::kData, "b.bin: missing (holds " + rows + ")");
}

// What the format-2 writer wrote for the column split above: a range a row, by hand.
TEST_F(CheckpointVectors, AFormatTwoManifestOfARangeARowStillReads) {
  const fs::path step = dir_ / "step_00000012";
  fs::create_directories(step);
  json files = json::object();
  for (const auto& [name, c0, c1] :
       {std::tuple<std::string, int64_t, int64_t>{"a.bin", 0, 4}, {"b.bin", 4, 10}}) {
    std::string bytes;
    json ranges = json::array();
    for (int64_t r = 0; r < 10; ++r) {
      const auto* row = reinterpret_cast<const char*>(values_.data() + r * 10 + c0);
      const std::string piece(row, size_t(c1 - c0) * 4);
      ranges.push_back({r * 10 + c0, c1 - c0, bytes.size(), crc32_hex(piece)});
      bytes += piece;
    }
    std::ofstream(step / name, std::ios::binary) << bytes;
    files[name] = {
        {"bytes", bytes.size()}, {"crc32", crc32_hex(bytes)}, {"vector", "v"}, {"ranges", ranges}};
  }
  json manifest = {{"format", 2},
                   {"step", 12},
                   {"files", files},
                   {"vectors", {{"v", {{"elem_bytes", 4}, {"elems", 100}}}}}};
  std::ofstream(step / "manifest.json") << manifest.dump(1);
  const CheckpointReader r(step.string());
  std::vector<float> all(100, -1.0f);
  r.read_vector("v", 0, all.data(), 400);
  EXPECT_EQ(all, values_);
  // A strided run's six fields are format 3's: a format-2 manifest holding one is refused.
  manifest["files"]["a.bin"]["ranges"][0] = {0, 4, 0, "00000000", 10, 10};
  std::ofstream(step / "manifest.json", std::ios::trunc) << manifest.dump(1);
  expect_error([&] { CheckpointReader x(step.string()); }, ErrorKind::kData, "a range of 6 fields");
  // Rows of a run that overlap (stride 0 or below the count) are refused in any format.
  manifest["format"] = 3;
  for (int64_t stride : {0, 2}) {
    manifest["files"]["a.bin"]["ranges"] =
        json::array({json::array({0, 4, 0, "00000000", stride, 10})});
    std::ofstream(step / "manifest.json", std::ios::trunc) << manifest.dump(1);
    expect_error([&] { CheckpointReader x(step.string(), CheckpointReader::Verify::kSizesOnly); },
                 ErrorKind::kData, "a.bin: bad range of \"v\" (rows overlap");
  }
}

}  // namespace
}  // namespace shardlm
