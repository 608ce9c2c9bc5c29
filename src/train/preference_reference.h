// Private to src/train: full fine-tuning DPO's reference log-probabilities (train.objective =
// "dpo", lora.rank = 0). Without a frozen base to switch the adapters off from, the reference is
// the initial weights themselves: before the first step a forward-only pass over every training
// pair sums each sequence's completion log-probabilities (LlamaModel::forward_target_logps), and
// training reads those two numbers per pair instead of a second forward.
//
// The table lives in the run directory, dpo_reference.json (the run directory and not the data
// directory: the sums belong to one model's initial weights, one packing and one data.seq_len,
// and a data directory is shared by runs of other models and read-only for some), keyed by
// what determines its numbers: the objective, the packed training windows' contents (a CRC-32
// of every window's tokens, targets, positions and document starts, with the set's name, sizes
// and packing) and the initial weights (a CRC-32 of their f32 values as loaded, their source,
// the parameter and activation dtypes and the model's config). A start-up or
// `shardlm dpo-reference` with a file of the same key reads it; any other key is computed anew.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <nlohmann/json.hpp>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "preference.h"
#include "shardlm/comm/communicator.h"
#include "shardlm/parallel/context.h"
#include "shardlm/parallel/pipeline.h"
#include "shardlm/train/data.h"

namespace shardlm::trainer_detail {

class InputStaging;

// Two sums per pair, in the data set's pair order: window by window, each window's pairs in
// the order fill() places them.
struct ReferenceTable {
  std::vector<int64_t> window_first;  // [windows + 1]: window w's first pair
  std::vector<double> chosen, rejected;
  // [5 T + 1] i32: one window's inputs as fill() writes them, the key's scratch
  // (reference_data_key), held with the table so that the ledger counts it (plan.h's
  // reference_table_host_bytes).
  std::vector<int32_t> key_rows;
  int64_t pairs() const { return int64_t(chosen.size()); }
  int64_t pair_index(int64_t window, int64_t nth) const {
    return window_first[size_t(window)] + nth;
  }
};

// CRC-32 (zlib's) of `bytes` continued from `crc` (0 to start).
uint32_t crc32_continue(uint32_t crc, const void* data, size_t bytes);

// The table's shape for `data` (samples packing of a paired source), its sums zero.
ReferenceTable reference_layout(const Dataset& data);

// The data part of the key: what the reference pass reads of `data`, its windows in `order`
// (0, 1, ...: the caller's held buffer, which the ledger counts), each filled into `rows` (at
// least 5 T + 1: the table's key_rows).
nlohmann::json reference_data_key(Dataset& data, const std::vector<int64_t>& order,
                                  std::span<int32_t> rows);

// A forward-only pass's host rows for micro-batches of B rows of T tokens, Tl of them on this rank:
// the held-out evaluation's (preference_eval.h) and the reference pass's below, which run at
// different times. The run sizes them once at setup and holds them (plan.h's
// preference_host_bytes counts them).
struct PreferenceEvalRows {
  PreferenceEvalRows(int64_t B, int64_t T, int64_t Tl)
      : local(size_t(B * Tl)),
        row(size_t(B * T)),
        targets(size_t(B * T)),
        row_index(size_t(B * Tl)) {
    pairs.reserve(size_t(max_micro_batch_pairs(B, T)));
  }
  std::vector<double> local;       // [B*Tl] this rank's tokens' logps
  std::vector<double> row;         // [B*T] the same at their row positions
  std::vector<int32_t> targets;    // [B*T] this rank's targets at their row positions
  std::vector<int64_t> row_index;  // [B*Tl] a local token's row position
  std::vector<PairSpans> pairs;    // the micro-batch's pair list (micro_batch_pairs)
  int64_t host_bytes() const {
    return int64_t((local.capacity() + row.capacity()) * sizeof(double) +
                   targets.capacity() * sizeof(int32_t) + row_index.capacity() * sizeof(int64_t) +
                   pairs.capacity() * sizeof(PairSpans));
  }
};

// The pass: every window of `data` once, micro-batches of B windows dealt round-robin over the
// dp_size replicas; every replica runs the same number of forwards (one without a batch of its
// own repeats its first and ignores it), since at ZeRO stage 3 each gathers parameters
// collectively. Every rank of a replica runs its micro-batches:
//   - context parallelism (cp, cp_group): each rank holds Tl tokens of every row, placed at
//     their row positions as the step runner does; each pair's two sums over the rank's own
//     tokens are added over the cp group in rank order, micro-batch by micro-batch;
//   - tensor parallelism: every tp rank reads the same logps (the head's row statistics are
//     reduced over the tp group);
//   - pipeline stages (pipe): the micro-batches go through the stages in one forward-only sweep
//     (PipelineExecutor::evaluate, the same as LoRA DPO's reference), the last stage reading
//     their logps.
// `counts`: this rank's sums are its replica's (one rank per replica: the last stage's first tp
// and cp rank); every other rank's table stays zero, so that `reduce`, an element-wise sum over
// every rank, is exact (each pair has one nonzero term) and leaves the whole table on every
// rank. The table is overwritten.
struct ReferencePass {
  LlamaModel& model;
  Dataset& data;
  Backend& backend;
  InputStaging& staging;  // the trainer's (fill_batch's host rows and upload slots)
  // data's windows in order (0, 1, ...): the caller's held buffer, which the ledger counts.
  const std::vector<int64_t>& order;
  PreferenceEvalRows* rows = nullptr;  // the run's, sized for B, T, Tl; null: its own
  int64_t B = 1;
  int64_t Tl = 0;  // tokens of each row this rank holds (T / cp); 0: data.seq_len()
  int64_t dp_rank = 0, dp_size = 1;
  ContextParallel* cp = nullptr;  // cp > 1, with cp_group
  Communicator* cp_group = nullptr;
  PipelineExecutor* pipe = nullptr;  // pp > 1, with stage_output_elems
  int64_t stage_output_elems = 0;    // one micro-batch's hidden state between stages
  bool counts = true;
  std::function<void(std::span<double>)> reduce = nullptr;  // null: one rank
  std::function<void(int64_t, int64_t)> progress =
      nullptr;  // (done, total) micro-batches; may be null
};
void compute_reference(const ReferencePass& pass, ReferenceTable& table);

// dpo_reference.json: {"format", "key", "pairs", "chosen", "rejected"} (doubles round-trip
// exactly through nlohmann's printing).
std::filesystem::path reference_file(const std::filesystem::path& run_dir);
void write_reference(const std::filesystem::path& path, const nlohmann::json& key,
                     const ReferenceTable& table);
// The file's table when its key is `key` and its shape `layout`'s; otherwise nullopt with
// `why` saying what differs (no file, the data, the model, the objective). A file that cannot
// be parsed is Error(kData) naming it.
std::optional<ReferenceTable> read_reference(const std::filesystem::path& path,
                                             const nlohmann::json& key,
                                             const ReferenceTable& layout, std::string& why);

}  // namespace shardlm::trainer_detail
