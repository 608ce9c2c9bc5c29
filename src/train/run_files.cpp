// JSON reports of a run and host memory readings.
#include "run_files.h"

#include <fcntl.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <fmt/format.h>

#include <fstream>
#include <string>

#include "shardlm/core/check.h"
#include "shardlm/core/fault_injection.h"
#include "shardlm/planner/plan_inputs.h"
#include "shardlm/train/report.h"

namespace shardlm {

using json = nlohmann::json;

MetricsLog::MetricsLog(std::string path, bool append)
    : path_(std::move(path)),
      fd_(posix::open_file(path_, O_WRONLY | O_CREAT | O_APPEND | (append ? 0 : O_TRUNC))) {}

void MetricsLog::write(const json& line) {
  if (fd_.get() < 0) return;
  const std::string text = line.dump() + "\n";
  posix::write_all(fd_.get(), text.data(), text.size(), path_);
}

int64_t free_disk_bytes(const std::string& dir) {
  const int64_t injected = fault::free_space_override();
  if (injected >= 0) return injected;
  struct statvfs st {};
  if (::statvfs(dir.c_str(), &st) != 0) return -1;
  return int64_t(st.f_bavail) * int64_t(st.f_frsize);
}

json memory_report(int rank, const MemoryLedger& ledger, const MemoryPlan& plan) {
  CategoryBytes dev_peak{}, host_peak{};
  for (int c = 0; c < kNumMemCategories; ++c) {
    dev_peak[c] = ledger.peak(MemPool::kDevice, static_cast<MemCategory>(c));
    host_peak[c] = ledger.peak(MemPool::kHost, static_cast<MemCategory>(c));
  }
  json j;
  j["rank"] = rank;
  j["peak_bytes"] = {{"device", ledger.peak_total(MemPool::kDevice)},
                     {"host", ledger.peak_total(MemPool::kHost)}};
  j["peak_by_category"] = category_json(dev_peak);
  j["at_peak_by_category"] = category_json(ledger.at_peak(MemPool::kDevice));
  j["host_peak_by_category"] = category_json(host_peak);
  j["allocations"] = ledger.alloc_count();
  j["planned"] = plan_json(plan);
  return j;
}

std::string memory_comparison_text(const MemoryLedger& ledger, const MemoryPlan& plan) {
  std::string out =
      fmt::format("memory, planned vs measured peak:\n  {:<6} {:<13}{:>14}{:>14}{:>9}\n", "pool",
                  "category", "planned", "measured", "diff");
  auto row = [&](const char* pool, std::string_view cat, int64_t planned, int64_t measured) {
    const std::string diff =
        planned == measured ? std::string("0")
        : planned > 0
            ? fmt::format("{:+.1f}%", 100.0 * double(measured - planned) / double(planned))
            : std::string("new");
    out += fmt::format("  {:<6} {:<13}{:>14}{:>14}{:>9}\n", pool, cat, format_bytes(planned),
                       format_bytes(measured), diff);
  };
  for (int p = 0; p < kNumMemPools; ++p) {
    const MemPool pool = static_cast<MemPool>(p);
    const char* name = p == 0 ? "device" : "host";
    for (int c = 0; c < kNumMemCategories; ++c) {
      const int64_t planned = plan.by_category[p][c];
      const int64_t measured = ledger.peak(pool, static_cast<MemCategory>(c));
      if (planned != 0 || measured != 0)
        row(name, mem_category_name(static_cast<MemCategory>(c)), planned, measured);
    }
    row(name, "total (peak)", plan.peak_bytes[p], ledger.peak_total(pool));
  }
  return out;
}

void write_json_atomic(const std::filesystem::path& path, const json& j) {
  write_file_atomic(path.string(), j.dump(2) + "\n");
}

int64_t host_rss_bytes() {
  std::ifstream f("/proc/self/statm");
  int64_t size = 0, resident = 0;
  if (!(f >> size >> resident)) return 0;
  return resident * int64_t(sysconf(_SC_PAGESIZE));
}

int64_t host_peak_rss_bytes() {
  std::ifstream f("/proc/self/status");
  for (std::string line; std::getline(f, line);)
    if (line.rfind("VmHWM:", 0) == 0) return std::stoll(line.substr(6)) * 1024;  // "... kB"
  return 0;
}

}  // namespace shardlm
