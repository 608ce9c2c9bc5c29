// Internal to train/: the run directory's JSON reports and small host utilities the trainer
// uses (resident set size). Not a public header.
#pragma once

#include <cstdint>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>

#include "shardlm/core/ledger.h"
#include "shardlm/plan/plan.h"

namespace shardlm {

// memory_rank{R}.json: measured peaks by pool and category, and the plan with the same fields.
nlohmann::json memory_report(int rank, const MemoryLedger& ledger, const MemoryPlan& plan);
// The end-of-run table: planned vs measured peak bytes per pool and category (categories
// that are zero in both left out), with the difference of each.
std::string memory_comparison_text(const MemoryLedger& ledger, const MemoryPlan& plan);
// Through write_file_atomic (report.h): temporary name, fsync, rename.
void write_json_atomic(const std::filesystem::path& path, const nlohmann::json& j);
// This process's resident set size in bytes (0 where /proc is not available).
int64_t host_rss_bytes();
// This process's peak resident set size so far in bytes (VmHWM; 0 where /proc is not available).
int64_t host_peak_rss_bytes();

}  // namespace shardlm
