// TrainRun's output: progress lines on the terminal, the run directory's charts (loss.svg,
// memory.svg), and the dry run (setup, then the memory report). Nothing here trains, steps the
// optimizer or touches a checkpoint.
#include "run_files.h"
#include "shardlm/train/report.h"
#include "train_run.h"

namespace shardlm::trainer_detail {

void TrainRun::log_line(const std::string& line, bool keep) {
  if (interactive_) {
    out_ << "\r\033[K" << line << (keep ? "\n" : "");
  } else {
    out_ << line << "\n";
  }
  out_.flush();
}

void TrainRun::write_reports(int64_t step) {
  write_file_atomic((dir_ / "loss.svg").string(),
                    loss_curve_svg(loss_points_, eval_points_,
                                   fmt::format("{}: loss (step {})", cfg_.model.name, step)));
  std::vector<std::string> names;
  std::vector<int64_t> planned, measured;
  for (int c = 0; c < kNumMemCategories; ++c) {
    names.emplace_back(mem_category_name(MemCategory(c)));
    planned.push_back(plan_.by_category[0][c]);
    measured.push_back(ledger_.peak(MemPool::kDevice, MemCategory(c)));
  }
  write_file_atomic((dir_ / "memory.svg").string(),
                    memory_chart_svg(names, planned, measured,
                                     "device memory by category: planned vs measured peak"));
}

DryRunResult TrainRun::dry_run() {
  setup();  // allocates everything; throws kOutOfMemory past memory.budget_gib
  DryRunResult r;
  r.device_peak_bytes = ledger_.peak_total(MemPool::kDevice);
  r.host_peak_bytes = ledger_.peak_total(MemPool::kHost);
  r.memory_report = (dir_ / fmt::format("memory_rank{}.json", world_.rank())).string();
  write_memory_report();  // the run's report: on a GPU the driver's count beside the ledger's
  if (world_.size() > 1) world_.barrier();  // every rank's report is written before rank 0 says so
  out_ << fmt::format(
      "dry run: rank 0 peak device {} ({} bytes), host {} ({} bytes), {} allocations; "
      "{}; nothing trained\n",
      format_bytes(r.device_peak_bytes), r.device_peak_bytes, format_bytes(r.host_peak_bytes),
      r.host_peak_bytes, ledger_.alloc_count(),
      world_.size() == 1 ? r.memory_report
                         : fmt::format("{}/memory_rank{{R}}.json for R = 0..{}", dir_.string(),
                                       world_.size() - 1));
  return r;
}

}  // namespace shardlm::trainer_detail
