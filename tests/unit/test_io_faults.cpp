// Every write-side I/O call of the file writers made to fail in turn (core/fault_injection.h),
// as SQLite's I/O-error tests do: for N = 1, 2, ... the Nth open, write, fsync, directory fsync,
// rename or mkdir fails with ENOSPC (odd N: after a short write) or EIO, until a write completes
// without reaching N. Each failure must be an Error(kData) naming the operation, the file and
// errno's text; what was there before (the last committed checkpoint, the previous file, no
// corpus index) must be intact; and the same write, with the fault gone, must then succeed.
// Covers the checkpoint writer (whole files, vector ranges, the commit and rotation),
// replace_file (reports), the safetensors writer and the token-shard writer; the seam itself
// (plan parsing, counting, a host allocation refused).
#include <gtest/gtest.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "io/posix_file.h"
#include "shardlm/backend/backend.h"
#include "shardlm/checkpoint/checkpoint.h"
#include "shardlm/core/buffer.h"
#include "shardlm/core/check.h"
#include "shardlm/core/fault_injection.h"
#include "shardlm/core/ledger.h"
#include "shardlm/io/safetensors.h"
#include "shardlm/io/shards.h"
#include "test_util.h"

namespace shardlm {
namespace {

namespace fs = std::filesystem;

fs::path fresh_dir(const std::string& name) {
  const fs::path dir = test::scratch_root() / fmt::format("shardlm_iofault_{}_{}", name, getpid());
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

// Disarms the seam at scope exit, whatever a failed expectation did.
struct Disarm {
  ~Disarm() { fault::disarm(); }
};

fault::Plan plan_for(int64_t n) {
  fault::Plan p;
  p.family = fault::Family::kIo;
  p.nth = n;
  p.err = n % 3 == 0 ? EIO : ENOSPC;
  p.short_write = n % 2 == 1;
  return p;
}

// The message of an injected failure names an operation, a path under `dir`, and errno's text.
void expect_named_failure(const Error& e, const fault::Plan& p, const fs::path& dir) {
  const std::string msg = e.what();
  EXPECT_EQ(e.kind(), ErrorKind::kData) << msg;
  EXPECT_NE(msg.find(std::strerror(p.err)), std::string::npos) << msg;
  EXPECT_NE(msg.find(dir.string()), std::string::npos) << msg;
  bool op = false;
  for (const char* name : {"open", "write", "fsync", "rename", "mkdir"})
    op = op || msg.find(std::string(name) + " ") != std::string::npos ||
         msg.find(std::string(name) + " failed") != std::string::npos;
  EXPECT_TRUE(op) << "no operation named: " << msg;
}

// Walks N over every I/O call of `write` (which writes into `dir`), checking after each failure
// with `intact`; returns the number of calls walked. `write` must be repeatable.
int64_t walk(const fs::path& dir, const std::function<void()>& write,
             const std::function<void()>& intact) {
  Disarm disarm;
  for (int64_t n = 1;; ++n) {
    SCOPED_TRACE(fmt::format("I/O call {}", n));
    const fault::Plan p = plan_for(n);
    fault::arm(p);
    bool failed = false;
    try {
      write();
    } catch (const Error& e) {
      failed = true;
      expect_named_failure(e, p, dir);
    }
    const bool fired = fault::fired();
    fault::disarm();
    EXPECT_EQ(failed, fired) << (failed ? "an error with no fault" : "an injected fault swallowed");
    intact();
    if (!fired) return n - 1;
    if (::testing::Test::HasFailure()) return n;
  }
}

// A checkpoint holding a file and a vector in two range files, as the trainer writes one.
void write_checkpoint(const std::string& dir, int64_t step, float fill) {
  CheckpointWriter w(dir, step);
  std::string failure;
  try {
    w.add_json("state.json", nlohmann::json{{"step", step}});
    w.declare_vector("params", 4, 64);
    std::vector<float> v(64, fill);
    w.begin_vector_file("params-00000-of-00002.bin", "params");
    w.append_elements(0, v.data(), 32);
    w.end_file();
    w.begin_vector_file("params-00001-of-00002.bin", "params");
    w.append_elements(32, v.data() + 32, 32);
    w.end_file();
  } catch (const std::exception& e) {
    failure = e.what();  // as the trainer does: the failure goes through commit
  }
  w.commit(/*keep_last=*/1, failure);
}

float checkpoint_fill(const std::string& dir) {
  const CheckpointReader r(latest_checkpoint(dir));
  std::vector<float> v(64);
  r.read_vector("params", 0, v.data(), v.size() * 4);
  for (float x : v) EXPECT_EQ(x, v[0]);
  return v[0];
}

TEST(IoFaults, CheckpointWriterAtEveryCall) {
  const fs::path root = fresh_dir("ckpt");
  const std::string dir = (root / "checkpoints").string();
  write_checkpoint(dir, 1, 1.0f);
  const int64_t calls = walk(
      root, [&] { write_checkpoint(dir, 2, 2.0f); },
      [&] {
        // `latest` names a complete checkpoint: the old one, or the new one when only the
        // rotation after the commit failed; no temporary directory is left behind.
        const std::string latest = latest_checkpoint(dir);
        EXPECT_TRUE(latest == dir + "/step_00000001" || latest == dir + "/step_00000002") << latest;
        EXPECT_EQ(checkpoint_fill(dir), latest.ends_with("1") ? 1.0f : 2.0f);
        for (const auto& e : fs::directory_iterator(dir))
          EXPECT_FALSE(e.path().filename().string().starts_with(".tmp-step"))
              << e.path() << " left behind";
        // A rerun with the fault gone writes the new checkpoint (over one already in place).
        write_checkpoint(dir, 2, 2.0f);
        EXPECT_EQ(latest_checkpoint(dir), dir + "/step_00000002");
        EXPECT_EQ(checkpoint_fill(dir), 2.0f);
        EXPECT_FALSE(fs::exists(dir + "/step_00000001"));  // rotated out (keep_last = 1)
        fs::remove_all(dir);
        write_checkpoint(dir, 1, 1.0f);
      });
  // mkdir, three files (open, write(s), fsync), the manifest, renames and directory fsyncs,
  // `latest` (open, write, fsync, rename, directory fsync) and the rotation.
  EXPECT_GE(calls, 20);
  std::cout << "checkpoint writer: " << calls << " I/O calls walked\n";
  fs::remove_all(root);
}

TEST(IoFaults, ReplaceFileAtEveryCall) {
  const fs::path root = fresh_dir("replace");
  const std::string path = (root / "summary.json").string();
  posix::replace_file(path, "old\n");
  const int64_t calls = walk(
      root, [&] { posix::replace_file(path, "new\n"); },
      [&] {
        const std::string now = test::slurp(path);
        EXPECT_TRUE(now == "old\n" || now == "new\n") << now;
        EXPECT_FALSE(fs::exists(path + ".tmp"));
        posix::replace_file(path, "old\n");
      });
  EXPECT_EQ(calls, 5);  // open, write, fsync, rename, directory fsync
  fs::remove_all(root);
}

TEST(IoFaults, SafetensorsWriterAtEveryCall) {
  const fs::path root = fresh_dir("st");
  const std::string path = (root / "model.safetensors").string();
  std::vector<float> a(1000, 1.5f), b(300, -2.0f);
  auto write = [&] {
    SafetensorsWriter w(path, {{"a", StDType::kF32, {1000}}, {"b", StDType::kF32, {300}}});
    w.write("a", a.data(), 2000);
    w.write("a", a.data() + 500, 2000);
    w.write("b", b.data(), b.size() * 4);
    w.commit();
  };
  const int64_t calls = walk(root, write, [&] {
    // Either no file or the whole one; never the temporary.
    if (fs::exists(path)) {
      const SafetensorsFile f(path);
      EXPECT_TRUE(f.contains("a") && f.contains("b"));
    }
    EXPECT_FALSE(fs::exists(path + ".tmp"));
    fs::remove(path);
  });
  EXPECT_GE(calls, 8);  // open, header (2 writes), 3 writes, fsync, rename, directory fsync
  fs::remove_all(root);
}

TEST(IoFaults, ShardWriterAtEveryCall) {
  const fs::path root = fresh_dir("shards");
  const std::string dir = (root / "corpus").string();
  std::vector<int32_t> doc(5000);
  for (size_t i = 0; i < doc.size(); ++i) doc[i] = int32_t(i % 250);
  auto write = [&] {
    ShardWriter w(dir, "byte", 259, /*max_shard_tokens=*/4000);
    for (int d = 0; d < 3; ++d) w.add_document(doc.data(), int64_t(doc.size()));
    w.finish();
  };
  const int64_t calls = walk(root, write, [&] {
    // index.json is written last: present only when every shard it names is whole.
    if (fs::exists(dir + "/index.json")) {
      EXPECT_EQ(TokenCorpus(dir).info().n_tokens, 15000);
    }
    fs::remove_all(dir);
  });
  EXPECT_GE(calls, 10);
  fs::remove_all(root);
}

TEST(IoFaults, PlanParsing) {
  const fault::Plan p = fault::parse_plan("io:7:EDQUOT:short");
  EXPECT_EQ(p.family, fault::Family::kIo);
  EXPECT_EQ(p.nth, 7);
  EXPECT_EQ(p.err, EDQUOT);
  EXPECT_TRUE(p.short_write);
  EXPECT_EQ(fault::parse_plan("io:2:5").err, 5);
  EXPECT_EQ(fault::parse_plan("host_alloc:3").family, fault::Family::kHostAlloc);
  EXPECT_EQ(fault::parse_plan("free_space:4096").nth, 4096);
  for (const char* bad : {"io", "io:0:ENOSPC", "io:x:ENOSPC", "io:1:ENOWHAT", "io:1:EIO:long",
                          "host_alloc:1:2", "disk:1"}) {
    try {
      fault::parse_plan(bad);
      ADD_FAILURE() << bad << " parsed";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kConfig);
      EXPECT_NE(std::string(e.what()).find(bad), std::string::npos) << e.what();
    }
  }
}

TEST(IoFaults, HostAllocationRefusedIsOutOfMemory) {
  Disarm disarm;
  const std::unique_ptr<Backend> be = make_backend(DeviceKind::kCpu);
  MemoryLedger ledger;
  fault::Plan p;
  p.family = fault::Family::kHostAlloc;
  p.nth = 2;
  fault::arm(p);
  Buffer device(*be, ledger, MemCategory::kWorkspace, MemPool::kDevice, 1024);  // not counted
  Buffer first(*be, ledger, MemCategory::kHostOffload, MemPool::kHost, 1024);
  try {
    Buffer second(*be, ledger, MemCategory::kHostOffload, MemPool::kHost, 3 << 20);
    ADD_FAILURE() << "the second host allocation was not refused";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kOutOfMemory);
    const std::string msg = e.what();
    EXPECT_NE(msg.find("out of host memory"), std::string::npos) << msg;
    EXPECT_NE(msg.find("3.0 MiB"), std::string::npos) << msg;
    EXPECT_NE(msg.find("available"), std::string::npos) << msg;
  }
  EXPECT_TRUE(fault::fired());
  EXPECT_EQ(ledger.current_total(MemPool::kHost),
            1024);  // the refused one never reached the ledger
}

}  // namespace
}  // namespace shardlm
