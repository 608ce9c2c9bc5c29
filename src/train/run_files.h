// Internal to train/: the run directory's JSON reports and small host utilities the trainer
// uses (resident set size). Not a public header.
#pragma once

#include <cstdint>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>

#include "io/posix_file.h"
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
// metrics.jsonl on rank 0: each line one write(2), so that a failing disk is reported at the
// step that met it, naming the file (an ofstream would buffer the error away). Default
// constructed (the other ranks), it drops what it is given.
class MetricsLog {
 public:
  MetricsLog() = default;
  MetricsLog(std::string path, bool append);
  void write(const nlohmann::json& line);

 private:
  std::string path_;
  posix::UniqueFd fd_;
};
// The free bytes of the file system holding `dir` for an unprivileged writer (statvfs
// f_bavail), or -1 where it cannot be told.
int64_t free_disk_bytes(const std::string& dir);
// This process's resident set size in bytes (0 where /proc is not available).
int64_t host_rss_bytes();
// This process's peak resident set size so far in bytes (VmHWM; 0 where /proc is not available).
int64_t host_peak_rss_bytes();

}  // namespace shardlm
