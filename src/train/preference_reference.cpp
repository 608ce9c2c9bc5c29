// Full fine-tuning DPO's reference sums (preference_reference.h): the table's layout, the key of
// the data, the forward-only pass that fills it, and dpo_reference.json.
#include "preference_reference.h"

#include <zlib.h>

#include <algorithm>
#include <fstream>

#include "preference.h"
#include "shardlm/core/check.h"
#include "shardlm/train/report.h"
#include "step_runner.h"

namespace shardlm::trainer_detail {
namespace {

using json = nlohmann::json;

constexpr int kFormat = 1;

// The first top-level part of the key ("objective", "data", "model") in which a and b differ.
std::string first_difference(const json& a, const json& b) {
  for (const auto& [part, value] : a.items())
    if (!b.contains(part) || b.at(part) != value) return part;
  return "format";
}

}  // namespace

uint32_t crc32_continue(uint32_t crc, const void* data, size_t bytes) {
  const auto* p = static_cast<const Bytef*>(data);
  while (bytes > 0) {  // zlib takes at most uInt bytes a call
    const size_t n = std::min<size_t>(bytes, size_t(1) << 30);
    crc = uint32_t(::crc32(crc, p, uInt(n)));
    p += n;
    bytes -= n;
  }
  return crc;
}

ReferenceTable reference_layout(const Dataset& data) {
  ReferenceTable t;
  t.window_first.assign(size_t(data.num_windows() + 1), 0);
  for (int64_t w = 0; w < data.num_windows(); ++w)
    t.window_first[size_t(w + 1)] =
        t.window_first[size_t(w)] + int64_t(data.window_documents(w).size()) / 2;
  t.chosen.assign(size_t(t.window_first.back()), 0.0);
  t.rejected.assign(size_t(t.window_first.back()), 0.0);
  return t;
}

json reference_data_key(Dataset& data) {
  // Window by window what fill() gives the model: the pass's inputs exactly.
  const int64_t T = data.seq_len();
  std::vector<int32_t> host(size_t(5 * T + 1));
  auto at = [&](int i, int64_t len) {
    return Tensor(host.data() + i * T, DType::kI32, {len}, MemPool::kHost);
  };
  BatchInputs in{at(0, T), at(1, T), at(2, T), at(3, T), at(4, T + 1)};
  std::vector<int64_t> order(size_t(data.num_windows()));
  for (size_t w = 0; w < order.size(); ++w) order[w] = int64_t(w);
  uint32_t crc = 0;
  for (int64_t w = 0; w < data.num_windows(); ++w) {
    data.fill(order, w, 1, in);
    // tokens, targets, positions, document starts
    crc = crc32_continue(crc, host.data(), size_t(4 * T) * sizeof(int32_t));
  }
  return {{"name", data.name()},
          {"tokens", data.num_tokens()},
          {"documents", data.num_documents()},
          {"windows", data.num_windows()},
          {"seq_len", T},
          {"packing", std::string(packing_name(data.packing().packing))},
          {"crc32", crc}};
}

void compute_reference(const ReferencePass& pass, ReferenceTable& table) {
  Dataset& data = pass.data;
  const int64_t B = pass.B, T = data.seq_len(), n = B * T;
  std::vector<int64_t> order(size_t(data.num_windows()));
  for (size_t w = 0; w < order.size(); ++w) order[w] = int64_t(w);
  const int64_t batches = (data.num_windows() + B - 1) / B;
  const int64_t rounds = (batches + pass.dp_size - 1) / pass.dp_size;
  std::fill(table.chosen.begin(), table.chosen.end(), 0.0);
  std::fill(table.rejected.begin(), table.rejected.end(), 0.0);
  std::vector<double> logps(static_cast<size_t>(n));
  std::vector<int32_t> targets(static_cast<size_t>(n));
  for (int64_t i = 0; i < rounds; ++i) {
    if (pass.progress) pass.progress(i + 1, rounds);
    const int64_t b = i * pass.dp_size + pass.dp_rank;
    const int64_t first = b < batches ? b * B : 0;
    fill_batch(pass.model, nullptr, data, order, first, B, pass.backend, pass.staging);
    pass.model.forward_target_logps(B, T, /*base_only=*/false, logps);  // [B*T]
    if (b >= batches) continue;  // a replica without a batch of its own this round
    // fill_batch's host staging holds the targets second (step_runner.cpp).
    std::copy_n(pass.staging.begin() + n, n, targets.begin());
    for (const PairSpans& s : micro_batch_pairs(data, order, first, B)) {
      const size_t k = size_t(table.pair_index(s.window, s.nth));
      int64_t count = 0;
      sum_span(s.chosen, logps, targets, table.chosen[k], count);
      sum_span(s.rejected, logps, targets, table.rejected[k], count);
    }
  }
  if (pass.reduce) {
    pass.reduce(table.chosen);
    pass.reduce(table.rejected);
  }
}

std::filesystem::path reference_file(const std::filesystem::path& run_dir) {
  return run_dir / "dpo_reference.json";
}

void write_reference(const std::filesystem::path& path, const json& key,
                     const ReferenceTable& table) {
  const json file = {{"format", kFormat},
                     {"key", key},
                     {"pairs", table.pairs()},
                     {"chosen", table.chosen},
                     {"rejected", table.rejected}};
  write_file_atomic(path.string(), file.dump() + "\n");
}

std::optional<ReferenceTable> read_reference(const std::filesystem::path& path, const json& key,
                                             const ReferenceTable& layout, std::string& why) {
  std::ifstream in(path);
  if (!in) {
    why = "there is none yet";
    return std::nullopt;
  }
  json file;
  try {
    file = json::parse(in);
    if (file.at("format").get<int>() != kFormat) {
      why =
          fmt::format("it has format {}, this build writes {}", file.at("format").dump(), kFormat);
      return std::nullopt;
    }
    const json& stored = file.at("key");
    if (stored != key) {
      const std::string part = first_difference(key, stored);
      why = fmt::format("its {} differs (stored {}, this run {})", part,
                        stored.value(part, json()).dump(), key.value(part, json()).dump());
      return std::nullopt;
    }
    ReferenceTable t = layout;
    t.chosen = file.at("chosen").get<std::vector<double>>();
    t.rejected = file.at("rejected").get<std::vector<double>>();
    if (t.pairs() != layout.pairs() || t.rejected.size() != t.chosen.size())
      SHARDLM_FAIL(ErrorKind::kData,
                   "{}: holds {} chosen and {} rejected sums under a key that says {} pairs; "
                   "delete it and `shardlm dpo-reference` (or the run) computes it again",
                   path.string(), t.chosen.size(), t.rejected.size(), layout.pairs());
    return t;
  } catch (const json::exception& e) {
    SHARDLM_FAIL(ErrorKind::kData,
                 "{}: not a DPO reference table ({}); delete it and `shardlm dpo-reference` (or "
                 "the run) computes it again",
                 path.string(), e.what());
  }
}

}  // namespace shardlm::trainer_detail
