// NF4 in bitsandbytes' format (quant/nf4.h) against bitsandbytes itself (nf4_reference.py runs
// its CPU quantize_4bit / dequantize_4bit on seeded tensors: random, an odd length, a block of
// zeros, values on the code's midpoints, a real-shaped bf16 projection): the 4-bit codes, the
// absmax, the dequantized values, the double-quantized absmax (codes and second-level scales)
// and the dynamic code, all bit for bit; the offset (a mean, which torch sums in f32 pairs)
// within one unit in the last place. Without the venv the comparison skips (CI requires it);
// the round trip's error bound and the argument checks run everywhere.
#include "shardlm/quant/nf4.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>

#include "test_util.h"

namespace shardlm {
namespace {

namespace fs = std::filesystem;

template <typename T>
std::vector<T> read_raw(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  EXPECT_TRUE(f.good()) << "cannot read " << p;
  const std::string bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  std::vector<T> v(bytes.size() / sizeof(T));
  std::memcpy(v.data(), bytes.data(), v.size() * sizeof(T));
  return v;
}

// The index of the first element where a and b differ in their bits, or -1.
template <typename T>
int64_t first_difference(const std::vector<T>& a, const std::vector<T>& b) {
  if (a.size() != b.size()) return 0;
  for (size_t i = 0; i < a.size(); ++i)
    if (std::memcmp(&a[i], &b[i], sizeof(T)) != 0) return int64_t(i);
  return -1;
}

// The reference directory, made once per process ("" without bitsandbytes).
const fs::path& reference_dir() {
  static const fs::path dir = [] {
    const std::string python = test::venv_python("bitsandbytes");
    if (python.empty()) return fs::path();
    const fs::path d = test::scratch_root() / "nf4_reference";
    fs::create_directories(d);
    test::run_command(
        python + " " + test::source_dir() + "/tests/unit/nf4_reference.py " + d.string(),
        d / "log.txt", true);
    return d;
  }();
  return dir;
}

// One test, so that the reference runs once.
TEST(Nf4Bitsandbytes, QuantizeAndDequantizeBitForBit) {
  if (reference_dir().empty()) SHARDLM_MISSING_REFERENCE(test::venv_skip_reason("bitsandbytes"));
  const std::vector<float> dynamic(nf4::dynamic_code().begin(), nf4::dynamic_code().end());
  EXPECT_EQ(first_difference(dynamic, read_raw<float>(reference_dir() / "dynamic_code.f32")), -1);
  std::ifstream listing(reference_dir() / "cases.json");
  ASSERT_TRUE(listing.good()) << test::slurp(reference_dir() / "log.txt");
  const auto cases = nlohmann::json::parse(listing);
  ASSERT_EQ(cases.size(), 6u);
  for (const auto& c : cases) {
    const std::string name = c["name"];
    SCOPED_TRACE(name);
    const fs::path d = reference_dir() / name;
    const auto x = read_raw<float>(d / "x.f32");
    const int64_t n = c["n"];
    ASSERT_EQ(int64_t(x.size()), n);
    std::vector<uint8_t> codes(nf4::packed_bytes(n));
    std::vector<float> absmax(nf4::num_blocks(n)), deq(n);
    nf4::quantize(x.data(), n, codes.data(), absmax.data());
    EXPECT_EQ(first_difference(codes, read_raw<uint8_t>(d / "codes.u8")), -1);
    EXPECT_EQ(first_difference(absmax, read_raw<float>(d / "absmax.f32")), -1);
    nf4::dequantize(codes.data(), absmax.data(), 0, n, deq.data());
    EXPECT_EQ(first_difference(deq, read_raw<float>(d / "deq.f32")), -1);

    // Double quantization: the offset within an ulp of torch's f32 mean; from bitsandbytes'
    // offset, the 8-bit codes, the second-level absmax and the restored values bit for bit.
    const int64_t blocks = nf4::num_blocks(n);
    const float want_offset = read_raw<float>(d / "nested_offset.f32").at(0);
    const float offset = nf4::absmax_offset(absmax.data(), blocks);
    EXPECT_LE(std::fabs(offset - want_offset), std::nextafter(want_offset, 1e30f) - want_offset);
    std::vector<uint8_t> qabsmax(blocks);
    std::vector<float> absmax2(nf4::num_absmax_blocks(blocks)), restored(blocks);
    nf4::quantize_absmax(absmax.data(), blocks, want_offset, qabsmax.data(), absmax2.data());
    EXPECT_EQ(first_difference(qabsmax, read_raw<uint8_t>(d / "nested_codes.u8")), -1);
    EXPECT_EQ(first_difference(absmax2, read_raw<float>(d / "nested_absmax2.f32")), -1);
    nf4::dequantize_absmax(qabsmax.data(), absmax2.data(), want_offset, blocks, restored.data());
    nf4::dequantize(codes.data(), restored.data(), 0, n, deq.data());
    EXPECT_EQ(first_difference(deq, read_raw<float>(d / "nested_deq.f32")), -1);
  }
}

// Every value comes back within half the widest gap of the code times its block's absmax,
// exact for the code values themselves; a slice of whole bytes dequantizes on its own.
TEST(Nf4, RoundTripWithinHalfAGapAndSlicesAgree) {
  const int64_t n = 64 * 9 + 13;
  std::mt19937 rng(3);
  std::normal_distribution<float> d(0.f, 0.02f);
  std::vector<float> x(n);
  for (float& v : x) v = d(rng);
  std::vector<uint8_t> codes(nf4::packed_bytes(n));
  std::vector<float> absmax(nf4::num_blocks(n)), back(n);
  nf4::quantize(x.data(), n, codes.data(), absmax.data());
  nf4::dequantize(codes.data(), absmax.data(), 0, n, back.data());
  float widest = 0;
  for (int i = 0; i < 15; ++i) widest = std::max(widest, nf4::code()[i + 1] - nf4::code()[i]);
  for (int64_t i = 0; i < n; ++i)
    ASSERT_LE(std::fabs(back[i] - x[i]), 0.5f * widest * absmax[i / nf4::kBlock] * 1.0001f) << i;
  std::vector<float> slice(100);
  nf4::dequantize(codes.data(), absmax.data(), 130, 100, slice.data());
  for (int64_t i = 0; i < 100; ++i) EXPECT_EQ(slice[i], back[130 + i]);
  EXPECT_THROW(nf4::dequantize(codes.data(), absmax.data(), 131, 10, slice.data()), Error);
}

}  // namespace
}  // namespace shardlm
