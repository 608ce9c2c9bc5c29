// Sharded vectors in checkpoint storage (src/train/checkpoint.cpp, checkpoint_reader.cpp):
// ranges written out of order over several files read back as the whole vector and as any
// sub-range, merged ranges keep their CRC-32, the commit refuses shares that leave a gap or
// hold an element twice, a corrupt range is named by file, vector and elements, a missing file
// by the ranges it held, the verification split over parts covers every file, a failure in a
// group commits nothing, and old whole-file vectors (<name>.bin) still read.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <numeric>
#include <string>
#include <vector>

#include "shardlm/comm/local.h"
#include "shardlm/core/check.h"
#include "shardlm/train/checkpoint.h"
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

}  // namespace
}  // namespace shardlm
