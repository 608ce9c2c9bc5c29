// Hugging Face directories bitsandbytes saved in 4 bits (hf.h): config.json's
// quantization_config checked, and each quantized weight's packed NF4 codes and absmax read
// from its tensors and its quant state (double quantization restored as bitsandbytes does).
#include <fmt/format.h>

#include <array>
#include <cstring>
#include <vector>

#include "shardlm/core/check.h"
#include "shardlm/hf/hf.h"
#include "shardlm/quant/nf4.h"

namespace shardlm {

using json = nlohmann::json;

namespace {

// The quant state's JSON blob (bitsandbytes' QuantState.as_dict(packed=True)): a U8 tensor.
json quant_state(const SafetensorsDir& st, const std::string& name) {
  const std::string key = name + ".quant_state.bitsandbytes__nf4";
  const SafetensorsFile& f = st.file_of(key);
  const StTensorInfo& t = f.info(key);
  SHARDLM_CHECK_KIND(ErrorKind::kData, t.dtype == StDType::kU8,
                     "{}: tensor '{}' must be U8 (a JSON text), got {}", f.path(), key,
                     st_dtype_name(t.dtype));
  const char* text = reinterpret_cast<const char*>(f.data(key));
  try {
    return json::parse(text, text + t.numel());
  } catch (const json::exception& e) {
    SHARDLM_FAIL(ErrorKind::kData, "{}: tensor '{}' is not JSON: {}", f.path(), key, e.what());
  }
}

// Tensor `key` as raw values of dtype `want` [n], Error(kData) naming it otherwise.
template <class T>
std::vector<T> read_raw(const SafetensorsDir& st, const std::string& key, StDType want, int64_t n) {
  const SafetensorsFile& f = st.file_of(key);
  const StTensorInfo& t = f.info(key);
  SHARDLM_CHECK_KIND(ErrorKind::kData, t.dtype == want && t.numel() == n,
                     "{}: tensor '{}' must be {} of {} elements, got {} of {}", f.path(), key,
                     st_dtype_name(want), n, st_dtype_name(t.dtype), t.numel());
  std::vector<T> out(static_cast<size_t>(n));
  std::memcpy(out.data(), f.data(key), size_t(n) * sizeof(T));
  return out;
}

// A stored code book must be shardlm's, bit for bit (it computes with its own).
template <size_t N>
void check_code_book(const SafetensorsDir& st, const std::string& key,
                     const std::array<float, N>& ours, const char* what) {
  const std::vector<float> got = read_raw<float>(st, key, StDType::kF32, int64_t(N));
  SHARDLM_CHECK_KIND(ErrorKind::kData, std::memcmp(got.data(), ours.data(), N * 4) == 0,
                     "{}: tensor '{}' is not bitsandbytes' {} (another code book)", st.dir(), key,
                     what);
}

}  // namespace

bool hf_config_is_bnb_4bit(const json& raw, const std::string& file) {
  if (!raw.contains("quantization_config") || raw["quantization_config"].is_null()) return false;
  const json& q = raw["quantization_config"];
  auto fail = [&](const std::string& what) {
    SHARDLM_FAIL(ErrorKind::kConfig,
                 "{}: quantization_config {}: shardlm reads bitsandbytes' 4-bit NF4 (quant_method "
                 "\"bitsandbytes\", load_in_4bit, bnb_4bit_quant_type \"nf4\", "
                 "bnb_4bit_quant_storage \"uint8\"); dequantize the model to bf16 or f32 first",
                 file, what);
  };
  if (!q.is_object()) fail("is not an object");
  if (q.value("quant_method", std::string()) != "bitsandbytes")
    fail(fmt::format("has quant_method {}",
                     q.contains("quant_method") ? q["quant_method"].dump() : "missing"));
  if (!q.value("load_in_4bit", false)) fail("is not load_in_4bit (8-bit weights)");
  if (q.value("bnb_4bit_quant_type", std::string("fp4")) != "nf4")
    fail(fmt::format("has bnb_4bit_quant_type {}", q.value("bnb_4bit_quant_type", "fp4")));
  if (q.value("bnb_4bit_quant_storage", std::string("uint8")) != "uint8")
    fail(fmt::format("has bnb_4bit_quant_storage {}", q["bnb_4bit_quant_storage"].dump()));
  return true;
}

bool is_bnb_nf4(const SafetensorsDir& st, const std::string& name) {
  return st.contains(name + ".quant_state.bitsandbytes__nf4");
}

Nf4Matrix read_bnb_nf4(const SafetensorsDir& st, const std::string& name,
                       const std::vector<int64_t>& shape) {
  const json qs = quant_state(st, name);
  auto fail = [&](const std::string& what) {
    SHARDLM_FAIL(ErrorKind::kData, "{}: the quant state of '{}' {}", st.dir(), name, what);
  };
  if (qs.value("quant_type", std::string()) != "nf4")
    fail(fmt::format("has quant_type {}, not \"nf4\"", qs.value("quant_type", json()).dump()));
  if (qs.value("blocksize", int64_t{0}) != nf4::kBlock)
    fail(
        fmt::format("has blocksize {}, not {}", qs.value("blocksize", json()).dump(), nf4::kBlock));
  if (qs.value("shape", json()) != json(shape))
    fail(fmt::format("has shape {} but config.json implies {}", qs.value("shape", json()).dump(),
                     json(shape).dump()));
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  const int64_t blocks = nf4::num_blocks(n);
  check_code_book(st, name + ".quant_map", nf4::code(), "NF4 code");
  Nf4Matrix m;
  m.codes = read_raw<uint8_t>(st, name, StDType::kU8, nf4::packed_bytes(n));
  if (!qs.contains("nested_offset")) {  // absmax in f32
    m.absmax = read_raw<float>(st, name + ".absmax", StDType::kF32, blocks);
    return m;
  }
  if (qs.value("nested_blocksize", int64_t{0}) != nf4::kAbsmaxBlock)
    fail(fmt::format("has nested_blocksize {}, not {}", qs.value("nested_blocksize", json()).dump(),
                     nf4::kAbsmaxBlock));
  if (!qs["nested_offset"].is_number()) fail("has a nested_offset that is not a number");
  check_code_book(st, name + ".nested_quant_map", nf4::dynamic_code(), "dynamic 8-bit code");
  const std::vector<uint8_t> codes = read_raw<uint8_t>(st, name + ".absmax", StDType::kU8, blocks);
  const std::vector<float> absmax2 =
      read_raw<float>(st, name + ".nested_absmax", StDType::kF32, nf4::num_absmax_blocks(blocks));
  m.absmax.resize(size_t(blocks));
  nf4::dequantize_absmax(codes.data(), absmax2.data(), qs["nested_offset"].get<float>(), blocks,
                         m.absmax.data());
  return m;
}

}  // namespace shardlm
