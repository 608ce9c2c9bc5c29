// The GGUF writer (io/gguf.h) byte by byte: the head (magic, version, counts, a key, a tensor
// info with its dimensions innermost first and its offset), the data section and each tensor
// padded to 32 bytes; f16 rounding at its edges; a Q8_0 block; declared order enforced; and no
// file left behind without commit. test_gguf reads whole exports back with llama.cpp's reader.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>

#include "shardlm/core/check.h"
#include "shardlm/io/gguf.h"
#include "test_util.h"

namespace shardlm {
namespace {

namespace fs = std::filesystem;

template <typename T>
T at(const std::string& bytes, size_t off) {
  T v;
  std::memcpy(&v, bytes.data() + off, sizeof(T));
  return v;
}

TEST(GgufWriter, F16RoundsToNearestEven) {
  EXPECT_EQ(f32_to_f16(1.0f), 0x3c00);
  EXPECT_EQ(f32_to_f16(-2.0f), 0xc000);
  EXPECT_EQ(f32_to_f16(65504.0f), 0x7bff);
  EXPECT_EQ(f32_to_f16(65519.0f), 0x7bff);
  EXPECT_EQ(f32_to_f16(65520.0f), 0x7c00);            // the tie past the largest half is infinity
  EXPECT_EQ(f32_to_f16(1.0f + 1.0f / 2048), 0x3c00);  // a tie goes to the even neighbour
  EXPECT_EQ(f32_to_f16(1.0f + 3.0f / 2048), 0x3c02);
  EXPECT_EQ(f32_to_f16(std::ldexp(1.0f, -24)), 0x0001);  // the smallest subnormal
  EXPECT_EQ(f32_to_f16(std::ldexp(1.0f, -25)), 0x0000);  // half of it: a tie, to zero
  EXPECT_EQ(f32_to_f16(std::ldexp(3.0f, -26)), 0x0001);
  EXPECT_EQ(f32_to_f16(std::ldexp(3.0f, -25)), 0x0002);  // 1.5 units: a tie, to even
  EXPECT_EQ(f32_to_f16(std::ldexp(1.0f, -14)), 0x0400);  // the smallest normal
  EXPECT_EQ(f32_to_f16(std::nanf("")) & 0x7e00, 0x7e00);
}

TEST(GgufWriter, Q8BlockIsScaleAndRoundedCodes) {
  std::vector<float> x(32, 0.0f);
  x[0] = 1.27f;   // the largest: code 127, d = 0.01
  x[1] = -0.5f;   // -50
  x[2] = 0.006f;  // 0.6 units: 1
  std::vector<std::byte> out(gguf_type_bytes(GgufType::kQ8_0, 32));
  ASSERT_EQ(out.size(), 34u);
  gguf_encode(GgufType::kQ8_0, x.data(), 32, out.data());
  uint16_t d;
  std::memcpy(&d, out.data(), 2);
  EXPECT_EQ(d, f32_to_f16(1.27f / 127.0f));
  EXPECT_EQ(int8_t(out[2]), 127);
  EXPECT_EQ(int8_t(out[3]), -50);
  EXPECT_EQ(int8_t(out[4]), 1);
  EXPECT_EQ(int8_t(out[5]), 0);
}

TEST(GgufWriter, HeadThenAlignedData) {
  const fs::path path = test::scratch_root() / "writer.gguf";
  GgufMetadata meta;
  meta.add_u32("a.n", 7);
  {
    GgufWriter w(path.string(), meta, {{"t", GgufType::kF32, {2, 3}}, {"u", GgufType::kF16, {5}}});
    const float t[6] = {1, 2, 3, 4, 5, 6};
    w.write("t", t, 12);
    w.write("t", t + 3, 12);  // in parts
    const uint16_t u[5] = {1, 2, 3, 4, 5};
    w.write("u", u, 10);
    w.commit();
  }
  EXPECT_FALSE(fs::exists(path.string() + ".tmp"));
  const std::string b = test::slurp(path);
  EXPECT_EQ(b.substr(0, 4), "GGUF");
  EXPECT_EQ(at<uint32_t>(b, 4), 3u);
  EXPECT_EQ(at<uint64_t>(b, 8), 2u);   // tensors
  EXPECT_EQ(at<uint64_t>(b, 16), 1u);  // keys
  size_t p = 24;
  EXPECT_EQ(at<uint64_t>(b, p), 3u);
  EXPECT_EQ(b.substr(p + 8, 3), "a.n");
  EXPECT_EQ(at<uint32_t>(b, p + 11), 4u);  // u32
  EXPECT_EQ(at<uint32_t>(b, p + 15), 7u);
  p += 19;
  EXPECT_EQ(b.substr(p + 8, 1), "t");
  EXPECT_EQ(at<uint32_t>(b, p + 9), 2u);   // dimensions
  EXPECT_EQ(at<uint64_t>(b, p + 13), 3u);  // innermost first
  EXPECT_EQ(at<uint64_t>(b, p + 21), 2u);
  EXPECT_EQ(at<uint32_t>(b, p + 29), 0u);  // F32
  EXPECT_EQ(at<uint64_t>(b, p + 33), 0u);
  p += 41;
  EXPECT_EQ(at<uint64_t>(b, p + 13), 5u);
  EXPECT_EQ(at<uint32_t>(b, p + 21), 1u);   // u: F16
  EXPECT_EQ(at<uint64_t>(b, p + 25), 32u);  // after t's 24 bytes padded
  p += 33;
  const size_t data = (p + 31) / 32 * 32;
  EXPECT_EQ(at<float>(b, data + 20), 6.0f);
  EXPECT_EQ(at<uint16_t>(b, data + 32 + 8), 5u);
  EXPECT_EQ(b.size(), data + 64);  // the last tensor padded too
}

TEST(GgufWriter, OrderIsEnforcedAndNothingIsLeftWithoutCommit) {
  const fs::path path = test::scratch_root() / "unfinished.gguf";
  {
    GgufWriter w(path.string(), GgufMetadata(), {{"a", GgufType::kF32, {1}}});
    const float x = 1;
    EXPECT_THROW(w.write("b", &x, 4), Error);
    EXPECT_THROW(w.write("a", &x, 8), Error);
    EXPECT_THROW(w.commit(), Error);
  }
  EXPECT_FALSE(fs::exists(path));
  EXPECT_FALSE(fs::exists(path.string() + ".tmp"));
  GgufMetadata meta;
  meta.add_bool("k", true);
  EXPECT_THROW(meta.add_string("k", "again"), Error);
}

}  // namespace
}  // namespace shardlm
