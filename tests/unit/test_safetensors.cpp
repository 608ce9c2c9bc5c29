// safetensors (io/safetensors.h): bit-exact round trips, sharding with an index, conversions
// to f32, every malformed file giving Error(kData) naming the file and the tensor, and files
// exchanged with the reference implementation (the `safetensors` package, through the venv).
#include "shardlm/io/safetensors.h"

#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "shardlm/core/check.h"
#include "shardlm/core/dtype.h"
#include "test_util.h"

namespace shardlm {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

fs::path fresh(const std::string& name) {
  const fs::path d = test::scratch_root() / ("safetensors_" + name);
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

template <class T>
std::vector<T> iota_vec(size_t n, T start) {
  std::vector<T> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = T(start + T(i));
  return v;
}

TEST(Safetensors, RoundTripIsBitExact) {
  const fs::path dir = fresh("roundtrip");
  const std::string path = (dir / "a.safetensors").string();
  const std::vector<float> f32 = test::random_vec(6 * 5, 1);
  std::vector<uint16_t> bf(7);
  for (size_t i = 0; i < bf.size(); ++i) bf[i] = f32_to_bf16(float(i) * 0.37f - 1.f);
  const std::vector<int32_t> i32 = iota_vec<int32_t>(3, -1);
  const std::vector<int64_t> i64 = iota_vec<int64_t>(2, int64_t{1} << 40);
  const std::vector<uint8_t> u8 = {1, 2, 3, 250};
  const float scalar = 3.5f;
  {
    SafetensorsWriter w(path,
                        {{"w.f32", StDType::kF32, {6, 5}},
                         {"w.bf16", StDType::kBF16, {7}},
                         {"empty", StDType::kF32, {0, 4}},
                         {"i32", StDType::kI32, {3}},
                         {"i64", StDType::kI64, {2, 1}},
                         {"u8", StDType::kU8, {4}},
                         {"scalar", StDType::kF32, {}}},
                        {{"format", "pt"}});
    w.write("w.f32", f32.data(), 10 * 4);  // in parts
    w.write("w.f32", f32.data() + 10, 20 * 4);
    w.write("w.bf16", bf.data(), bf.size() * 2);
    w.write("i32", i32.data(), 12);
    w.write("i64", i64.data(), 16);
    w.write("u8", u8.data(), 4);
    w.write("scalar", &scalar, 4);
    w.commit();
  }
  EXPECT_FALSE(fs::exists(path + ".tmp"));
  const SafetensorsFile f(path);
  EXPECT_EQ(f.metadata().at("format"), "pt");
  EXPECT_EQ(f.tensors().size(), 7u);
  EXPECT_EQ(f.info("w.f32").shape, (std::vector<int64_t>{6, 5}));
  EXPECT_EQ(std::memcmp(f.data("w.f32"), f32.data(), 30 * 4), 0);
  EXPECT_EQ(std::memcmp(f.data("w.bf16"), bf.data(), 14), 0);
  EXPECT_EQ(std::memcmp(f.data("i32"), i32.data(), 12), 0);
  EXPECT_EQ(std::memcmp(f.data("i64"), i64.data(), 16), 0);
  EXPECT_EQ(std::memcmp(f.data("u8"), u8.data(), 4), 0);
  EXPECT_EQ(f.info("scalar").shape.size(), 0u);
  EXPECT_EQ(f.info("scalar").numel(), 1);
  EXPECT_EQ(f.info("empty").numel(), 0);
  std::vector<float> back(7);
  f.read_f32("w.bf16", back.data());
  for (size_t i = 0; i < bf.size(); ++i) EXPECT_EQ(back[i], bf16_to_f32(bf[i]));
  EXPECT_THROW(f.read_f32("i32", back.data()), Error);
}

TEST(Safetensors, WriterRefusesOutOfOrderAndIncompleteTensors) {
  const fs::path dir = fresh("writer_order");
  const std::string path = (dir / "b.safetensors").string();
  const float x[2] = {1, 2};
  {
    SafetensorsWriter w(path, {{"a", StDType::kF32, {2}}, {"b", StDType::kF32, {2}}});
    EXPECT_THROW(w.write("b", x, 8), Error);
    w.write("a", x, 8);
    EXPECT_THROW(w.write("b", x, 12), Error);  // more than declared
    EXPECT_THROW(w.commit(), Error);           // b never written
  }
  EXPECT_FALSE(fs::exists(path));
  EXPECT_FALSE(fs::exists(path + ".tmp"));  // an abandoned write leaves nothing
}

TEST(Safetensors, F16ConvertsExactly) {
  const fs::path dir = fresh("f16");
  const std::string path = (dir / "h.safetensors").string();
  // 1.0, -2.0, 65504 (max), 2^-24 (smallest subnormal), +inf, 0.5
  const uint16_t h[6] = {0x3c00, 0xc000, 0x7bff, 0x0001, 0x7c00, 0x3800};
  {
    SafetensorsWriter w(path, {{"h", StDType::kF16, {6}}});
    w.write("h", h, sizeof h);
    w.commit();
  }
  std::vector<float> v(6);
  SafetensorsFile(path).read_f32("h", v.data());
  EXPECT_EQ(v[0], 1.0f);
  EXPECT_EQ(v[1], -2.0f);
  EXPECT_EQ(v[2], 65504.0f);
  EXPECT_EQ(v[3], std::ldexp(1.0f, -24));
  EXPECT_TRUE(std::isinf(v[4]) && v[4] > 0);
  EXPECT_EQ(v[5], 0.5f);
}

TEST(Safetensors, ShardsWithAnIndex) {
  const fs::path dir = fresh("sharded");
  // Four tensors of 40 bytes, shards of at most 100 bytes: two shards of two.
  const ShardPlan plan = plan_safetensors_shards({40, 40, 40, 40}, 100);
  EXPECT_EQ(plan.shard_of, (std::vector<int>{0, 0, 1, 1}));
  ASSERT_EQ(plan.files.size(), 2u);
  EXPECT_EQ(plan.files[0], "model-00001-of-00002.safetensors");
  EXPECT_EQ(plan_safetensors_shards({40, 40}, 100).files,
            (std::vector<std::string>{"model.safetensors"}));
  EXPECT_EQ(plan_safetensors_shards({10, 500, 10}, 100).shard_of, (std::vector<int>{0, 1, 2}));

  std::map<std::string, std::string> where;
  for (int s = 0; s < 2; ++s) {
    std::vector<SafetensorsWriter::Decl> decls;
    for (int t = 0; t < 4; ++t)
      if (plan.shard_of[t] == s) decls.push_back({"t" + std::to_string(t), StDType::kF32, {10}});
    SafetensorsWriter w((dir / plan.files[s]).string(), decls);
    for (const auto& d : decls) {
      const std::vector<float> v(10, float(d.name[1] - '0'));
      w.write(d.name, v.data(), 40);
      where[d.name] = plan.files[s];
    }
    w.commit();
  }
  write_safetensors_index(dir.string(), where, 160);
  const SafetensorsDir st(dir.string());
  EXPECT_EQ(st.names().size(), 4u);
  std::vector<float> v(10);
  st.file_of("t3").read_f32("t3", v.data());
  EXPECT_EQ(v[0], 3.0f);
  EXPECT_EQ(st.file_of("t0").path(), (dir / plan.files[0]).string());
  EXPECT_THROW(st.file_of("nope"), Error);
  // A shard the index names but that is missing: the index and the file are named.
  fs::remove(dir / plan.files[1]);
  try {
    SafetensorsDir broken(dir.string());
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kData);
    EXPECT_NE(std::string(e.what()).find("model.safetensors.index.json"), std::string::npos);
    EXPECT_NE(std::string(e.what()).find(plan.files[1]), std::string::npos) << e.what();
  }
}

// A file from a header text and a data section of `data_bytes` bytes.
std::string write_raw(const fs::path& dir, const std::string& name, const std::string& header,
                      size_t data_bytes, int64_t claimed_len = -1) {
  const std::string path = (dir / name).string();
  std::ofstream f(path, std::ios::binary);
  const uint64_t n = claimed_len >= 0 ? uint64_t(claimed_len) : header.size();
  f.write(reinterpret_cast<const char*>(&n), 8);
  f << header;
  f << std::string(data_bytes, '\0');
  return path;
}

void expect_data_error(const std::string& path, const std::vector<std::string>& expect) {
  try {
    SafetensorsFile f(path);
    FAIL() << "no error for " << path;
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kData) << e.what();
    const std::string msg = e.what();
    EXPECT_NE(msg.find(path), std::string::npos) << msg;
    for (const auto& s : expect)
      EXPECT_NE(msg.find(s), std::string::npos) << msg << "\nmissing: " << s;
  }
}

TEST(Safetensors, MalformedFilesAreClearErrors) {
  const fs::path dir = fresh("malformed");
  const std::string ok = R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  // Truncated: the 8 data bytes missing.
  expect_data_error(write_raw(dir, "truncated.st", ok, 4), {"'a'", "outside"});
  // Too short for even the length.
  {
    const std::string p = (dir / "tiny.st").string();
    std::ofstream(p) << "abc";
    expect_data_error(p, {"truncated"});
  }
  // The header length runs past the end.
  expect_data_error(write_raw(dir, "len.st", ok, 8, 1 << 20), {"header length"});
  // Not JSON.
  expect_data_error(write_raw(dir, "json.st", "{\"a\": [", 0), {"not valid JSON"});
  // Unknown dtype.
  expect_data_error(write_raw(dir, "dtype.st",
                              R"({"a":{"dtype":"F8_E4M3","shape":[2],"data_offsets":[0,2]}})", 2),
                    {"'a'", "unsupported dtype 'F8_E4M3'"});
  // Shape and span disagree.
  expect_data_error(
      write_raw(dir, "span.st", R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", 8),
      {"'a'", "needs 12"});
  // Overlapping tensors.
  expect_data_error(write_raw(dir, "overlap.st",
                              R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                              R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
                              12),
                    {"'b'", "overlaps"});
  // A hole in the data section.
  expect_data_error(write_raw(dir, "hole.st",
                              R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                              R"("b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})",
                              12),
                    {"'b'", "belong to no tensor"});
  // The same name twice.
  expect_data_error(write_raw(dir, "dup.st",
                              R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                              R"("a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
                              8),
                    {"'a'", "twice"});
  // Offsets that are not [begin, end].
  expect_data_error(
      write_raw(dir, "offsets.st", R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4]}})", 4),
      {"'a'", "data_offsets"});
  // A missing tensor asked for by name.
  const std::string good = write_raw(dir, "good.st", ok, 8);
  const SafetensorsFile f(good);
  try {
    f.info("b");
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'b'"), std::string::npos);
  }
}

// The lines of /proc/self/maps that map `path`: this process's mappings of the file.
int mappings_of(const std::string& path) {
  std::ifstream maps("/proc/self/maps");
  const std::string canonical = fs::canonical(path).string();
  int n = 0;
  for (std::string line; std::getline(maps, line);)
    n += line.size() >= canonical.size() &&
         line.compare(line.size() - canonical.size(), canonical.size(), canonical) == 0;
  return n;
}

// A file refused after it was mapped (a bad header, bad entries) leaves no mapping behind, each
// of many times; a good one is mapped while its reader lives and unmapped after.
TEST(Safetensors, AFileRefusedAfterMappingIsUnmapped) {
  const fs::path dir = fresh("unmapped");
  const std::string entry = R"("a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]})";
  const std::string bad[] = {
      write_raw(dir, "len.st", "{" + entry + "}", 8, 1 << 20),
      write_raw(dir, "json.st", "{\"a\": [", 0),
      write_raw(dir, "span.st", R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", 8),
      write_raw(dir, "dup.st", "{" + entry + "," + entry + "}", 8)};
  for (const std::string& path : bad) {
    SCOPED_TRACE(path);
    for (int i = 0; i < 50; ++i) EXPECT_THROW(SafetensorsFile{path}, Error);
    EXPECT_EQ(mappings_of(path), 0);
  }
  const std::string good = write_raw(dir, "good.st", "{" + entry + "}", 8);
  {
    const SafetensorsFile f(good);
    EXPECT_EQ(mappings_of(good), 1);
  }
  EXPECT_EQ(mappings_of(good), 0);
}

// Files exchanged with the reference implementation, both ways.
TEST(Safetensors, ReadsAndWritesWhatThePythonPackageDoes) {
  const std::string python = test::venv_python("safetensors");
  if (python.empty()) SHARDLM_MISSING_REFERENCE(test::venv_skip_reason("safetensors"));
  const fs::path dir = fresh("python");
  const std::string ours = (dir / "ours.safetensors").string();
  const std::vector<float> x = test::random_vec(12, 3);
  std::vector<uint16_t> xb(12);
  for (size_t i = 0; i < 12; ++i) xb[i] = f32_to_bf16(x[i]);
  {
    SafetensorsWriter w(ours, {{"x", StDType::kF32, {3, 4}}, {"xb", StDType::kBF16, {12}}});
    w.write("x", x.data(), 48);
    w.write("xb", xb.data(), 24);
    w.commit();
  }
  const std::string theirs = (dir / "theirs.safetensors").string();
  const std::string script = R"(
import sys, torch
from safetensors.torch import load_file, save_file
t = load_file(sys.argv[1])
assert t["x"].shape == (3, 4) and t["x"].dtype == torch.float32
assert torch.equal(t["x"].flatten().to(torch.bfloat16), t["xb"]), "bf16 differs"
print(" ".join(repr(float(v)) for v in t["x"].flatten()))
save_file({"y": torch.arange(6, dtype=torch.float16).reshape(2, 3) / 4,
           "z": torch.tensor([7, -8], dtype=torch.int64)}, sys.argv[2], metadata={"m": "v"})
)";
  std::ofstream(dir / "check.py") << script;
  const std::string out = (dir / "out.txt").string();
  const int rc = std::system((python + " " + (dir / "check.py").string() + " " + ours + " " +
                              theirs + " > " + out + " 2>&1")
                                 .c_str());
  ASSERT_EQ(rc, 0) << test::slurp(out);
  std::istringstream values(test::slurp(out));
  for (float v : x) {
    double got;
    values >> got;
    EXPECT_EQ(float(got), v);
  }
  const SafetensorsFile f(theirs);
  EXPECT_EQ(f.metadata().at("m"), "v");
  std::vector<float> y(6);
  f.read_f32("y", y.data());
  for (int i = 0; i < 6; ++i) EXPECT_EQ(y[i], float(i) / 4);
  EXPECT_EQ(f.info("z").dtype, StDType::kI64);
}

}  // namespace
}  // namespace shardlm
