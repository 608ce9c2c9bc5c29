// Full fine-tuning DPO's reference sums (preference_reference.h): the table's layout, the key of
// the data, the forward-only pass that fills it, and dpo_reference.json.
#include "preference_reference.h"

#include <zlib.h>

#include <algorithm>
#include <fstream>
#include <limits>
#include <optional>

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

// `order` must hold data's windows in order: anything else would key another pass.
void check_window_order(const Dataset& data, const std::vector<int64_t>& order) {
  bool in_order = int64_t(order.size()) == data.num_windows();
  for (size_t w = 0; in_order && w < order.size(); ++w) in_order = order[w] == int64_t(w);
  SHARDLM_CHECK(in_order, "the reference pass over {} needs its {} windows in order", data.name(),
                data.num_windows());
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
    t.window_first[size_t(w + 1)] = t.window_first[size_t(w)] + data.window_document_count(w) / 2;
  t.chosen.assign(size_t(t.window_first.back()), 0.0);
  t.rejected.assign(size_t(t.window_first.back()), 0.0);
  t.key_rows.assign(size_t(5 * data.seq_len() + 1), 0);
  return t;
}

json reference_data_key(Dataset& data, const std::vector<int64_t>& order, std::span<int32_t> rows) {
  check_window_order(data, order);
  // Window by window what fill() gives the model: the pass's inputs exactly.
  const int64_t T = data.seq_len();
  SHARDLM_CHECK(int64_t(rows.size()) >= 5 * T + 1,
                "the reference key's rows hold {} ids, one window of {} tokens needs {}",
                rows.size(), T, 5 * T + 1);
  int32_t* host = rows.data();
  auto at = [&](int i, int64_t len) {
    return Tensor(host + i * T, DType::kI32, {len}, MemPool::kHost);
  };
  BatchInputs in{at(0, T), at(1, T), at(2, T), at(3, T), at(4, T + 1)};
  uint32_t crc = 0;
  for (int64_t w = 0; w < data.num_windows(); ++w) {
    data.fill(order, w, 1, in);
    // tokens, targets, positions, document starts
    crc = crc32_continue(crc, host, size_t(4 * T) * sizeof(int32_t));
  }
  return {{"name", data.name()},
          {"tokens", data.num_tokens()},
          {"documents", data.num_documents()},
          {"windows", data.num_windows()},
          {"seq_len", T},
          {"packing", std::string(packing_name(data.packing().packing))},
          {"crc32", crc}};
}

namespace {

// The pairs of the micro-batch at `first` (its logps in rows.local): their sums over this rank's
// tokens, added over the cp group (in rank order: every cp rank gets the same bits), into the
// table when this rank counts. Collective over the cp group.
void add_pairs(const ReferencePass& pass, const std::vector<int64_t>& order, int64_t first,
               PreferenceEvalRows& rows, ReferenceTable& table) {
  for (size_t i = 0; i < rows.row_index.size(); ++i)
    rows.row[size_t(rows.row_index[i])] = rows.local[i];
  micro_batch_pairs(pass.data, order, first, pass.B, rows.pairs);
  const std::vector<PairSpans>& pairs = rows.pairs;
  std::vector<double> sums(2 * pairs.size());  // per pair: chosen, rejected
  for (size_t k = 0; k < pairs.size(); ++k) {
    int64_t count = 0;
    sum_span(pairs[k].chosen, rows.row, rows.targets, sums[2 * k], count);
    sum_span(pairs[k].rejected, rows.row, rows.targets, sums[2 * k + 1], count);
  }
  if (pass.cp != nullptr) ordered_sum(*pass.cp_group, sums);
  if (!pass.counts) return;
  for (size_t k = 0; k < pairs.size(); ++k) {
    const size_t i = size_t(table.pair_index(pairs[k].window, pairs[k].nth));
    table.chosen[i] = sums[2 * k];
    table.rejected[i] = sums[2 * k + 1];
  }
}

}  // namespace

void compute_reference(const ReferencePass& pass, ReferenceTable& table) {
  Dataset& data = pass.data;
  const int64_t B = pass.B, T = data.seq_len(), Tl = pass.Tl > 0 ? pass.Tl : T;
  const std::vector<int64_t>& order = pass.order;
  check_window_order(data, order);
  const int64_t batches = (data.num_windows() + B - 1) / B;
  const int64_t rounds = (batches + pass.dp_size - 1) / pass.dp_size;
  std::fill(table.chosen.begin(), table.chosen.end(), 0.0);
  std::fill(table.rejected.begin(), table.rejected.end(), 0.0);
  // The run's rows (held and counted), else rows of the pass's own.
  std::optional<PreferenceEvalRows> own;
  PreferenceEvalRows& rows = pass.rows != nullptr ? *pass.rows : own.emplace(B, T, Tl);
  SHARDLM_CHECK(int64_t(rows.local.size()) == B * Tl && int64_t(rows.row.size()) == B * T,
                "the reference pass's rows hold {} and {} tokens, its micro-batches {} and {}",
                rows.local.size(), rows.row.size(), B * Tl, B * T);
  // Where each of this rank's B * Tl tokens sits in the micro-batch's full rows [B * T].
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < Tl; ++i)
      rows.row_index[size_t(b * Tl + i)] =
          b * T +
          (pass.cp != nullptr ? pass.cp->layout().global_index(pass.cp_group->rank(), i) : i);
  // Round i's micro-batch on this replica: its first window, or -1 past the last batch.
  auto first_of = [&](int64_t i) {
    const int64_t b = i * pass.dp_size + pass.dp_rank;
    return b < batches ? b * B : -1;
  };
  auto load = [&](int64_t i, int slot) {
    if (pass.progress) pass.progress(i + 1, rounds);
    fill_batch(pass.model, pass.cp, data, order, std::max<int64_t>(first_of(i), 0), B, pass.backend,
               pass.staging, slot);
    rank_row_targets(pass.cp, pass.staging, B, T, rows.row_index, rows.targets);
  };
  auto add = [&](int64_t i) {
    if (first_of(i) >= 0) add_pairs(pass, order, first_of(i), rows, table);
  };
  if (pass.pipe == nullptr) {
    for (int64_t i = 0; i < rounds; ++i) {
      load(i, -1);
      pass.model.forward_target_logps(B, Tl, /*base_only=*/false, rows.local);  // [B*Tl]
      add(i);
    }
  } else {
    // The executor loads each micro-batch right before its forward, so rows.targets is the
    // forward's when the last stage adds its pairs.
    SHARDLM_CHECK(rounds <= std::numeric_limits<int>::max(), "{} micro-batches in one sweep",
                  rounds);
    const bool last = pass.pipe->stage() + 1 == pass.pipe->stages();
    PipelineStageOps ops;
    ops.input = [&](int slot) { return pass.model.stage_input(slot, B, Tl); };
    ops.load = [&](int a, int slot) { load(a, slot); };
    ops.forward = [&](int a, int slot, LossResult*) {
      const Tensor out = pass.model.stage_forward_target_logps(slot, B, Tl, false, rows.local);
      if (last) add(a);
      return out;
    };
    (void)pass.pipe->evaluate(ops, int(rounds), pass.stage_output_elems);
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
