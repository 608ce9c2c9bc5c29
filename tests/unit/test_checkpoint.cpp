// Checkpoint storage (src/checkpoint/checkpoint.cpp): round trips checked against a reference
// CRC-32, `latest` and keep_last rotation, one case per kind of damage (kData naming the
// file), what a sizes-only reader still catches, byte-range reads, name validation, files
// streamed piece by piece (equal to add_file's) and their misuse, clean-up of uncommitted and
// interrupted writes, and a child process killed with SIGKILL at random moments while it
// writes, after which the last complete checkpoint must still load.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "shardlm/checkpoint/checkpoint.h"
#include "shardlm/core/check.h"
#include "test_util.h"

namespace shardlm {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// A fresh directory per test, removed afterwards.
class TempDir {
 public:
  TempDir() {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    path_ = shardlm::test::scratch_root() /
            fmt::format("shardlm_ckpt_{}_{}_{}", info->test_suite_name(), info->name(), getpid());
    fs::remove_all(path_);
    fs::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  std::string str() const { return path_.string(); }
  std::string operator/(const std::string& name) const { return (path_ / name).string(); }

 private:
  fs::path path_;
};

// Reference CRC-32 (IEEE 802.3, reflected 0xEDB88320), independent of zlib.
uint32_t reference_crc32(const std::vector<char>& data) {
  static const auto table = [] {
    std::array<uint32_t, 256> t{};
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
      t[i] = c;
    }
    return t;
  }();
  uint32_t crc = 0xFFFFFFFFu;
  for (char ch : data) crc = table[(crc ^ static_cast<uint8_t>(ch)) & 0xFF] ^ (crc >> 8);
  return crc ^ 0xFFFFFFFFu;
}

std::vector<char> random_bytes(size_t n, uint64_t seed) {
  std::vector<char> v(n);
  std::mt19937_64 rng(seed);
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const uint64_t r = rng();
    std::memcpy(v.data() + i, &r, 8);
  }
  for (; i < n; ++i) v[i] = static_cast<char>(rng());
  return v;
}

std::string read_text(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

std::vector<std::string> tmp_entries(const std::string& dir) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) {
    const std::string name = e.path().filename().string();
    if (name.rfind(".tmp", 0) == 0 || name.find(".tmp") != std::string::npos) out.push_back(name);
  }
  return out;
}

// Runs fn, expecting Error(kind) whose message contains every one of `parts`.
template <typename Fn>
void expect_error(Fn&& fn, ErrorKind kind, const std::vector<std::string>& parts) {
  try {
    fn();
    ADD_FAILURE() << "no error thrown; expected one containing " << parts.front();
  } catch (const Error& e) {
    EXPECT_EQ(static_cast<int>(e.kind()), static_cast<int>(kind)) << e.what();
    for (const auto& p : parts)
      EXPECT_NE(std::string(e.what()).find(p), std::string::npos)
          << "message \"" << e.what() << "\" lacks \"" << p << "\"";
  }
}

TEST(Checkpoint, RoundTripOfSeveralFilesWithManifestAndLatest) {
  TempDir tmp;
  const std::string ck = tmp / "checkpoints";  // created by the writer
  const auto small = random_bytes(1000, 1);
  const auto big = random_bytes((size_t{20} << 20) + 13, 2);  // ~20 MB, not chunk-aligned
  const json state = {{"step", 7}, {"rng", {1, 2, 3}}, {"name", "tiny & <odd>"}};

  CheckpointWriter w(ck, 7);
  EXPECT_TRUE(fs::is_directory(ck + "/.tmp-step_00000007"));
  w.add_file("small.bin", small.data(), small.size());
  w.add_file("params.bin", big.data(), big.size());
  w.add_file("empty.bin", nullptr, 0);
  w.add_json("state.json", state);
  const std::string dir = w.commit(0);

  EXPECT_EQ(dir, ck + "/step_00000007");
  EXPECT_EQ(read_text(ck + "/latest"), "step_00000007\n");
  EXPECT_EQ(latest_checkpoint(ck), dir);
  EXPECT_EQ(list_checkpoints(ck), std::vector<std::string>{dir});
  EXPECT_TRUE(tmp_entries(ck).empty());

  // The manifest: format, step, and each file's size and CRC-32 against the reference.
  const json m = json::parse(read_text(dir + "/manifest.json"));
  EXPECT_EQ(m["format"], 2);  // no strided runs: readers of format 2 take it
  EXPECT_EQ(m["step"], 7);
  ASSERT_EQ(m["files"].size(), 4u);
  EXPECT_EQ(m["files"]["params.bin"]["bytes"], big.size());
  EXPECT_EQ(m["files"]["params.bin"]["crc32"], fmt::format("{:08x}", reference_crc32(big)));
  EXPECT_EQ(m["files"]["small.bin"]["crc32"], fmt::format("{:08x}", reference_crc32(small)));
  EXPECT_EQ(m["files"]["empty.bin"]["crc32"], "00000000");

  for (const std::string& where : {ck, dir}) {  // through `latest`, and the step dir itself
    CheckpointReader r(where);
    EXPECT_EQ(r.dir(), dir);
    EXPECT_EQ(r.step(), 7);
    EXPECT_TRUE(r.has("params.bin"));
    EXPECT_FALSE(r.has("manifest.json"));
    EXPECT_FALSE(r.has("other.bin"));
    EXPECT_EQ(r.size("params.bin"), big.size());
    EXPECT_EQ(r.read_all("params.bin"), big);
    EXPECT_EQ(r.read_all("small.bin"), small);
    EXPECT_TRUE(r.read_all("empty.bin").empty());
    std::vector<char> dst(small.size());
    r.read("small.bin", dst.data(), dst.size());
    EXPECT_EQ(dst, small);
    EXPECT_EQ(r.read_json("state.json"), state);
    expect_error([&] { r.size("other.bin"); }, ErrorKind::kData, {dir + "/other.bin", "missing"});
    expect_error([&] { r.read("small.bin", dst.data(), dst.size() - 1); }, ErrorKind::kData,
                 {dir + "/small.bin", "1000 bytes"});
    expect_error([&] { r.read_json("small.bin"); }, ErrorKind::kData, {dir + "/small.bin"});
  }
}

TEST(Checkpoint, KeepLastKeepsTheNewestAndTheOneJustWritten) {
  TempDir tmp;
  const std::string ck = tmp.str();
  auto write = [&](int64_t step, int64_t keep_last) {
    CheckpointWriter w(ck, step);
    const std::string text = fmt::format("step {}", step);
    w.add_file("data.txt", text.data(), text.size());
    return w.commit(keep_last);
  };
  for (int64_t s = 1; s <= 5; ++s) write(s * 10, 2);
  EXPECT_EQ(list_checkpoints(ck),
            (std::vector<std::string>{ck + "/step_00000050", ck + "/step_00000040"}));
  EXPECT_EQ(latest_checkpoint(ck), ck + "/step_00000050");

  // keep_last 0 keeps everything.
  write(60, 0);
  write(70, 0);
  EXPECT_EQ(list_checkpoints(ck).size(), 4u);

  // An older step written last survives its own rotation and becomes `latest`.
  write(5, 2);
  EXPECT_EQ(list_checkpoints(ck),
            (std::vector<std::string>{ck + "/step_00000070", ck + "/step_00000060",
                                      ck + "/step_00000005"}));
  EXPECT_EQ(latest_checkpoint(ck), ck + "/step_00000005");
  EXPECT_EQ(CheckpointReader(ck).step(), 5);
  EXPECT_TRUE(tmp_entries(ck).empty());
}

TEST(Checkpoint, RecommittingAStepReplacesIt) {
  TempDir tmp;
  const std::string ck = tmp.str();
  for (const std::string text : {"first", "second version"}) {
    CheckpointWriter w(ck, 3);
    w.add_file("data.txt", text.data(), text.size());
    w.commit(0);
    const CheckpointReader r(ck);
    const auto got = r.read_all("data.txt");
    EXPECT_EQ(std::string(got.begin(), got.end()), text);
  }
  EXPECT_EQ(list_checkpoints(ck).size(), 1u);
  EXPECT_TRUE(tmp_entries(ck).empty());
}

TEST(Checkpoint, ListingAndLatestIgnoreWhatIsNotACompleteCheckpoint) {
  TempDir tmp;
  const std::string ck = tmp.str();
  EXPECT_EQ(latest_checkpoint(ck), "");
  EXPECT_EQ(latest_checkpoint(ck + "/absent"), "");
  EXPECT_TRUE(list_checkpoints(ck + "/absent").empty());
  for (int64_t step : {2, 100, 9}) {
    CheckpointWriter w(ck, step);
    w.commit(0);
  }
  fs::create_directories(ck + "/step_00000500");  // no manifest: not complete
  fs::create_directories(ck + "/.tmp-step_00000600");
  fs::create_directories(ck + "/step_abc");
  std::ofstream(ck + "/step_00000700") << "a file, not a directory";
  EXPECT_EQ(list_checkpoints(ck),
            (std::vector<std::string>{ck + "/step_00000100", ck + "/step_00000009",
                                      ck + "/step_00000002"}));
  std::ofstream(ck + "/latest") << "../../etc\n";
  expect_error([&] { latest_checkpoint(ck); }, ErrorKind::kData, {ck + "/latest"});
  expect_error([&] { CheckpointReader r(ck); }, ErrorKind::kData, {ck + "/latest"});
  expect_error([&] { CheckpointReader r(tmp / "nothing"); }, ErrorKind::kData,
               {tmp / "nothing/manifest.json", "missing"});
}

// ---- damage: each kind is reported as kData naming the damaged file -------------------------

class CheckpointDamage : public ::testing::Test {
 protected:
  void SetUp() override {
    CheckpointWriter w(tmp_.str(), 42);
    w.add_file("a.bin", a_.data(), a_.size());
    w.add_file("b.bin", b_.data(), b_.size());
    w.add_json("c.json", json{{"x", 1}});
    dir_ = w.commit(0);
  }
  std::string path(const std::string& name) const { return dir_ + "/" + name; }
  void expect_load_fails(const std::string& file, const std::string& what) {
    expect_error([&] { CheckpointReader r(tmp_.str()); }, ErrorKind::kData, {path(file), what});
  }

  TempDir tmp_;
  std::string dir_;
  std::vector<char> a_ = random_bytes(4096, 3);
  std::vector<char> b_ = random_bytes((size_t{5} << 20) + 7, 4);  // spans several read chunks
};

TEST_F(CheckpointDamage, OneFlippedByteIsAChecksumMismatch) {
  std::mt19937_64 rng(5);
  for (int trial = 0; trial < 3; ++trial) {
    const size_t offset = rng() % b_.size();
    {
      std::fstream f(path("b.bin"), std::ios::in | std::ios::out | std::ios::binary);
      f.seekp(static_cast<std::streamoff>(offset));
      f.put(static_cast<char>(b_[offset] ^ (1 << (trial % 8))));
    }
    expect_load_fails("b.bin", "checksum mismatch");
    {
      std::fstream f(path("b.bin"), std::ios::in | std::ios::out | std::ios::binary);
      f.seekp(static_cast<std::streamoff>(offset));
      f.put(b_[offset]);
    }
    EXPECT_NO_THROW(CheckpointReader r(tmp_.str()));
  }
}

TEST_F(CheckpointDamage, TruncatedFileNamesItsSizes) {
  fs::resize_file(path("b.bin"), 1000);
  expect_load_fails("b.bin", fmt::format("truncated (1000 of {} bytes)", b_.size()));
}

TEST_F(CheckpointDamage, LongerFileIsAWrongSize) {
  std::ofstream(path("a.bin"), std::ios::app) << "extra";
  expect_load_fails("a.bin", "wrong size");
}

TEST_F(CheckpointDamage, DeletedFileIsMissing) {
  fs::remove(path("a.bin"));
  expect_load_fails("a.bin", "missing");
}

TEST_F(CheckpointDamage, BrokenManifestIsUnreadable) {
  const std::string good = read_text(path("manifest.json"));
  std::ofstream(path("manifest.json")) << good.substr(0, good.size() / 2);
  expect_load_fails("manifest.json", "manifest unreadable");

  json m = json::parse(good);
  m["format"] = 4;  // a format newer than this reader
  std::ofstream(path("manifest.json")) << m.dump();
  expect_load_fails("manifest.json", "manifest unreadable");

  m = json::parse(good);
  m["files"]["../../escape"] = m["files"]["a.bin"];
  std::ofstream(path("manifest.json")) << m.dump();
  expect_load_fails("manifest.json", "manifest unreadable");

  m = json::parse(good);
  m["files"]["a.bin"]["crc32"] = 12345;
  std::ofstream(path("manifest.json")) << m.dump();
  expect_load_fails("manifest.json", "manifest unreadable");

  fs::remove(path("manifest.json"));
  expect_load_fails("manifest.json", "missing");
}

TEST_F(CheckpointDamage, DamageAfterVerificationIsCaughtOnRead) {
  const CheckpointReader r(tmp_.str());
  fs::resize_file(path("b.bin"), 10);
  expect_error([&] { r.read_all("b.bin"); }, ErrorKind::kData, {path("b.bin"), "truncated"});
  fs::remove(path("c.json"));
  expect_error([&] { r.read_json("c.json"); }, ErrorKind::kData, {path("c.json")});
}

TEST_F(CheckpointDamage, SizesOnlyTrustsTheContentsButNotTheSizes) {
  // A flipped byte keeps the size: kSizesOnly opens the checkpoint (and reads the flipped
  // byte), the default names the file.
  const size_t offset = b_.size() / 3;
  {
    std::fstream f(path("b.bin"), std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(static_cast<std::streamoff>(offset));
    f.put(static_cast<char>(b_[offset] ^ 0x10));
  }
  {
    const CheckpointReader r(tmp_.str(), CheckpointReader::Verify::kSizesOnly);
    EXPECT_EQ(r.step(), 42);
    EXPECT_EQ(r.size("b.bin"), b_.size());
    char got = 0;
    r.read_range("b.bin", offset, &got, 1);
    EXPECT_EQ(got, static_cast<char>(b_[offset] ^ 0x10));
    EXPECT_EQ(r.read_all("a.bin"), a_);
  }
  expect_load_fails("b.bin", "checksum mismatch");
  expect_error([&] { CheckpointReader r(tmp_.str(), CheckpointReader::Verify::kContents); },
               ErrorKind::kData, {path("b.bin"), "checksum mismatch"});

  // Sizes and presence are still checked, one damage at a time.
  const auto sizes_only = [&] {
    CheckpointReader r(tmp_.str(), CheckpointReader::Verify::kSizesOnly);
  };
  fs::resize_file(path("b.bin"), 1000);
  expect_error(sizes_only, ErrorKind::kData,
               {path("b.bin"), fmt::format("truncated (1000 of {} bytes)", b_.size())});
  fs::remove(path("b.bin"));
  expect_error(sizes_only, ErrorKind::kData, {path("b.bin"), "missing"});
  std::ofstream(path("b.bin"), std::ios::binary).write(b_.data(), std::streamsize(b_.size()));
  EXPECT_NO_THROW(sizes_only());
  std::ofstream(path("a.bin"), std::ios::app) << "extra";
  expect_error(sizes_only, ErrorKind::kData, {path("a.bin"), "wrong size"});
}

TEST_F(CheckpointDamage, ReadRangeReadsAnyRangeWithinTheManifestSize) {
  const CheckpointReader r(tmp_.str());
  // Offsets at both ends, inside, and across the reader's 4 MiB chunk boundary.
  const size_t mib = size_t{1} << 20;
  const std::pair<size_t, size_t> ranges[] = {
      {0, 1},         {0, b_.size()},     {1, 4095},  {b_.size() - 1, 1}, {4 * mib - 3, 9},
      {777, 3 * mib}, {b_.size() - 7, 7}, {12345, 0}, {b_.size(), 0}};
  for (const auto& [offset, bytes] : ranges) {
    SCOPED_TRACE(fmt::format("[{}, +{})", offset, bytes));
    std::vector<char> got(bytes);
    r.read_range("b.bin", offset, got.data(), bytes);
    EXPECT_TRUE(std::equal(got.begin(), got.end(), b_.begin() + static_cast<ptrdiff_t>(offset)));
  }
  std::vector<char> got(100);
  r.read_range("a.bin", 4000, got.data(), 96);
  EXPECT_TRUE(std::equal(got.begin(), got.begin() + 96, a_.begin() + 4000));
}

TEST_F(CheckpointDamage, ReadRangePastTheEndOrOfAShortFileNamesTheFile) {
  const CheckpointReader r(tmp_.str(), CheckpointReader::Verify::kSizesOnly);
  std::vector<char> buf(200);
  expect_error([&] { r.read_range("a.bin", 4000, buf.data(), 97); }, ErrorKind::kData,
               {path("a.bin"), "[4000, 4097)", "4096 bytes"});
  expect_error([&] { r.read_range("a.bin", 5000, buf.data(), 0); }, ErrorKind::kData,
               {path("a.bin"), "[5000, 5000)"});
  // An offset near 2^64 must not wrap around the end check.
  expect_error([&] { r.read_range("a.bin", ~uint64_t{0} - 10, buf.data(), 100); }, ErrorKind::kData,
               {path("a.bin"), "[18446744073709551605, 18446744073709551705)"});
  expect_error([&] { r.read_range("other.bin", 0, buf.data(), 1); }, ErrorKind::kData,
               {path("other.bin"), "missing"});
  // Shortened after the reader opened: even a range that is still on disk fails, naming it.
  fs::resize_file(path("b.bin"), 1000);
  expect_error([&] { r.read_range("b.bin", 0, buf.data(), 100); }, ErrorKind::kData,
               {path("b.bin"), fmt::format("truncated (1000 of {} bytes)", b_.size())});
  fs::remove(path("a.bin"));
  expect_error([&] { r.read_range("a.bin", 0, buf.data(), 100); }, ErrorKind::kData,
               {path("a.bin")});
}

// ---- writer rules and clean-up ------------------------------------------------------------

TEST(CheckpointWriter, StreamedFileEqualsTheSameBytesAddedAtOnce) {
  TempDir tmp;
  // Pieces of every kind: empty, tiny, larger than the 4 MiB streaming chunk, odd sizes.
  const auto data = random_bytes((size_t{9} << 20) + 5, 7);
  const size_t pieces[] = {0, 1, 1000, 0, (size_t{5} << 20) + 3, 17, 65536};
  CheckpointWriter w(tmp.str(), 4);
  w.add_file("whole.bin", data.data(), data.size());
  w.begin_file("streamed.bin");
  size_t done = 0;
  for (size_t n : pieces) {
    w.append(data.data() + done, n);
    done += n;
  }
  w.append(data.data() + done, data.size() - done);
  w.end_file();
  w.begin_file("empty.bin");
  w.end_file();
  const std::string dir = w.commit(0);

  const json m = json::parse(read_text(dir + "/manifest.json"));
  EXPECT_EQ(m["files"]["streamed.bin"], m["files"]["whole.bin"]);
  EXPECT_EQ(m["files"]["streamed.bin"]["bytes"], data.size());
  EXPECT_EQ(m["files"]["streamed.bin"]["crc32"], fmt::format("{:08x}", reference_crc32(data)));
  EXPECT_EQ(m["files"]["empty.bin"]["bytes"], 0);
  EXPECT_EQ(m["files"]["empty.bin"]["crc32"], "00000000");
  const CheckpointReader r(dir);  // verifies the CRCs
  EXPECT_EQ(r.read_all("streamed.bin"), data);
  EXPECT_EQ(read_text(dir + "/streamed.bin"), read_text(dir + "/whole.bin"));
  EXPECT_TRUE(r.read_all("empty.bin").empty());
}

TEST(CheckpointWriter, StreamingMisuseIsAnInternalError) {
  TempDir tmp;
  CheckpointWriter w(tmp.str(), 5);
  const char x = 'x';
  expect_error([&] { w.append(&x, 1); }, ErrorKind::kInternal, {"no file open"});
  expect_error([&] { w.end_file(); }, ErrorKind::kInternal, {"no file open"});
  for (const std::string bad : {"a/b", "..", "", "manifest.json"})
    expect_error([&] { w.begin_file(bad); }, ErrorKind::kInternal, {"file name"});

  w.begin_file("a.bin");
  w.append(&x, 1);
  expect_error([&] { w.begin_file("b.bin"); }, ErrorKind::kInternal,
               {"\"b.bin\"", "\"a.bin\" is still open"});
  expect_error([&] { w.add_file("b.bin", &x, 1); }, ErrorKind::kInternal,
               {"\"a.bin\" is still open"});
  expect_error([&] { w.commit(0); }, ErrorKind::kInternal, {"\"a.bin\" is still open"});
  w.append(&x, 1);  // the refused calls changed nothing
  w.end_file();
  expect_error([&] { w.begin_file("a.bin"); }, ErrorKind::kInternal, {"twice"});
  expect_error([&] { w.add_file("a.bin", &x, 1); }, ErrorKind::kInternal, {"twice"});
  expect_error([&] { w.append(&x, 1); }, ErrorKind::kInternal, {"no file open"});
  const std::string dir = w.commit(0);
  EXPECT_EQ(CheckpointReader(dir).read_all("a.bin"), std::vector<char>({'x', 'x'}));
  expect_error([&] { w.begin_file("c.bin"); }, ErrorKind::kInternal, {"already committed"});
}

TEST(CheckpointWriter, AFileLeftOpenIsRemovedWithTheUncommittedWrite) {
  TempDir tmp;
  {
    CheckpointWriter w(tmp.str(), 6);
    w.begin_file("partial.bin");
    w.append("abc", 3);
  }
  EXPECT_FALSE(fs::exists(tmp / ".tmp-step_00000006"));
  EXPECT_TRUE(list_checkpoints(tmp.str()).empty());
}

TEST(CheckpointWriter, RejectsUnsafeOrDuplicateNames) {
  TempDir tmp;
  CheckpointWriter w(tmp.str(), 1);
  const char x = 'x';
  for (const std::string bad : {"a/b", "..", "../x", "x..y", "", "manifest.json"})
    expect_error([&] { w.add_file(bad, &x, 1); }, ErrorKind::kInternal, {"file name"});
  w.add_file("ok.bin", &x, 1);
  expect_error([&] { w.add_file("ok.bin", &x, 1); }, ErrorKind::kInternal, {"twice"});
  EXPECT_EQ(fs::path(w.commit(0)).filename(), "step_00000001");
}

TEST(CheckpointWriter, UncommittedWriteIsRemovedByTheDestructor) {
  TempDir tmp;
  const auto data = random_bytes(1 << 20, 6);
  {
    CheckpointWriter w(tmp.str(), 12);
    w.add_file("params.bin", data.data(), data.size());
    EXPECT_TRUE(fs::exists(tmp / ".tmp-step_00000012/params.bin"));
  }
  EXPECT_FALSE(fs::exists(tmp / ".tmp-step_00000012"));
  EXPECT_FALSE(fs::exists(tmp / "latest"));
  EXPECT_TRUE(list_checkpoints(tmp.str()).empty());
}

TEST(CheckpointWriter, StartingRemovesStaleTemporaries) {
  TempDir tmp;
  {
    CheckpointWriter w(tmp.str(), 1);
    w.commit(0);
  }
  fs::create_directories(tmp / ".tmp-step_00000099/sub");
  std::ofstream(tmp / ".tmp-step_00000099/sub/x") << "junk";
  fs::create_directories(tmp / ".tmp-delete-step_00000000");
  std::ofstream(tmp / "latest.tmp") << "step_0000";
  CheckpointWriter w(tmp.str(), 2);
  EXPECT_EQ(tmp_entries(tmp.str()), std::vector<std::string>{".tmp-step_00000002"});
  EXPECT_EQ(CheckpointReader(tmp.str()).step(), 1);  // untouched
}

// ---- SIGKILL during a write ------------------------------------------------------------------

// The child commits checkpoint 1, then writes checkpoint 2 (a large file and a json) until the
// parent kills it; it only ever leaves through _exit.
[[noreturn]] void child_write(const std::string& ck, size_t big_bytes) {
  try {
    {
      const auto first = random_bytes(1 << 16, 100);
      CheckpointWriter w(ck, 1);
      w.add_file("params.bin", first.data(), first.size());
      w.add_json("state.json", json{{"step", 1}});
      w.commit(2);
    }
    const auto second = random_bytes(big_bytes, 200);
    CheckpointWriter w(ck, 2);
    w.add_file("params.bin", second.data(), second.size());
    w.add_json("state.json", json{{"step", 2}});
    w.commit(2);
  } catch (...) {
    _exit(3);
  }
  _exit(0);
}

TEST(CheckpointWriter, SigkillDuringWriteLeavesTheLastCompleteCheckpoint) {
  TempDir tmp;
  std::mt19937_64 rng(std::random_device{}());
  const size_t kMiB = size_t{1} << 20;
  // Large files are mostly killed mid-write; small ones sometimes finish, or die while
  // committing, so that every stage of a write is hit now and then.
  const size_t sizes[] = {200 * kMiB, 64 * kMiB, 16 * kMiB, 4 * kMiB, 1 * kMiB,
                          200 * kMiB, 32 * kMiB, 8 * kMiB,  2 * kMiB, 100 * kMiB};
  int completed = 0, killed = 0;
  for (size_t trial = 0; trial < std::size(sizes); ++trial) {
    const std::string ck = tmp / fmt::format("run{}", trial);
    const pid_t pid = fork();
    ASSERT_GE(pid, 0) << "fork failed";
    if (pid == 0) child_write(ck, sizes[trial]);

    // Wait for checkpoint 2's temporary directory (or the child's end), then kill at random.
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    int status = 0;
    bool exited = false;
    while (!fs::exists(ck + "/.tmp-step_00000002")) {
      if (waitpid(pid, &status, WNOHANG) == pid) {
        exited = true;
        break;
      }
      ASSERT_LT(std::chrono::steady_clock::now(), deadline) << "child never started checkpoint 2";
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    if (!exited) {
      std::this_thread::sleep_for(std::chrono::microseconds(rng() % 50000));
      kill(pid, SIGKILL);
      ASSERT_EQ(waitpid(pid, &status, 0), pid);
    }
    ASSERT_TRUE(WIFSIGNALED(status) || (WIFEXITED(status) && WEXITSTATUS(status) == 0))
        << "child failed with exit status " << WEXITSTATUS(status);
    WIFSIGNALED(status) ? ++killed : ++completed;

    // `latest` names checkpoint 1, or 2 if that finished; either loads and holds its data.
    const std::string latest = latest_checkpoint(ck);
    ASSERT_TRUE(latest == ck + "/step_00000001" || latest == ck + "/step_00000002") << latest;
    const int64_t step = latest == ck + "/step_00000001" ? 1 : 2;
    if (WIFEXITED(status)) {
      EXPECT_EQ(step, 2);
    }
    const CheckpointReader r(ck);
    EXPECT_EQ(r.step(), step);
    EXPECT_EQ(r.read_json("state.json"), json({{"step", step}}));
    EXPECT_EQ(r.read_all("params.bin"),
              step == 1 ? random_bytes(1 << 16, 100) : random_bytes(sizes[trial], 200));

    // A new writer clears what the killed one left; committing step 2 again works.
    {
      CheckpointWriter w(ck, 3);
      EXPECT_EQ(tmp_entries(ck), std::vector<std::string>{".tmp-step_00000003"});
    }
    CheckpointWriter w(ck, 2);
    w.add_json("state.json", json{{"step", 2}, {"again", true}});
    EXPECT_EQ(w.commit(1), ck + "/step_00000002");
    EXPECT_EQ(list_checkpoints(ck), std::vector<std::string>{ck + "/step_00000002"});
    EXPECT_EQ(CheckpointReader(ck).read_json("state.json")["again"], true);
    fs::remove_all(ck);
  }
  std::cout << "[          ] " << killed << " writes killed, " << completed << " completed\n";
  EXPECT_GT(killed, 0);
}

}  // namespace
}  // namespace shardlm
