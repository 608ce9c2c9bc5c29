// TrainRun's guard around checkpoint saves: a periodic save is skipped, with the numbers, when
// a rank's disk lacks the space for its share, and a failed save either stops the run (the
// default; the last committed checkpoint is intact, as the writer guarantees) or, under
// checkpoint.on_save_error = "continue", is reported and training goes on to the next save. A
// failed save's error is the disk's (the writer names the call, the file and errno's text); the
// guard adds the free space and what a save needs.
#include <iostream>

#include "shardlm/plan/zero_layout.h"
#include "train_run.h"

namespace shardlm::trainer_detail {

int64_t TrainRun::checkpoint_bytes_of_rank(int64_t step) const {
  // The rank's chunk of every state vector (the plan's snapshot of a whole share), and on
  // rank 0 the two JSON files; the manifest is a few KiB more.
  int64_t bytes = zero_checkpoint_snapshot_bytes(
      zero_->zero_layout(), state_elem_bytes(ZeroEngine::State::kParams), zero_->has_master(), 0);
  if (lead_)
    bytes += int64_t(model_to_json(cfg_.model, whole_engine_layout(), model_->options(),
                                   tok_->name(), lora_base())
                         .dump(2)
                         .size() +
                     checkpoint_state_json(step).dump(2).size());
  return bytes;
}

std::string TrainRun::checkpoint_space_text(int64_t step) const {
  const std::string dir = (dir_ / "checkpoints").string();
  const int64_t free = free_disk_bytes(dir);
  return fmt::format("{} has {} free; a save needs {} on rank {}", dir,
                     free < 0 ? std::string("an unknown amount") : format_bytes(free),
                     format_bytes(checkpoint_bytes_of_rank(step)), world_.rank());
}

bool TrainRun::checkpoint_space_fits(int64_t step) {
  const std::string dir = (dir_ / "checkpoints").string();
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);  // else the writer reports it
  const int64_t free = free_disk_bytes(dir);
  const int64_t need = checkpoint_bytes_of_rank(step);
  const bool short_here = free >= 0 && free < need;
  if (!grid_->any(short_here)) return true;
  const int64_t every = cfg_.checkpoint.every_steps;
  const int64_t next = (step / every + 1) * every;
  const std::string then = next < total_steps_ ? fmt::format("the next save is at step {}", next)
                                               : std::string("the next save is the final one");
  const std::string text =
      short_here ? fmt::format(
                       "checkpoint: step {} not saved: it needs {} on rank {} in {}, "
                       "which has {} free; training goes on ({}; the last checkpoint "
                       "is {})",
                       step, format_bytes(need), world_.rank(), dir, format_bytes(free), then,
                       last_checkpoint_.empty() ? "none" : last_checkpoint_)
                 : fmt::format(
                       "checkpoint: step {} not saved: another rank's disk lacks the "
                       "space for its share (its message is on its standard error); "
                       "training goes on ({})",
                       step, then);
  if (lead_)
    log_line(text, true);
  else if (short_here)
    std::cerr << "shardlm: rank " << world_.rank() << ": " << text << "\n";
  return false;
}

void TrainRun::periodic_checkpoint(int64_t step) {
  if (!checkpoint_space_fits(step)) return;
  guard_save(step, true, [&] {
    if (cfg_.checkpoint.async)
      start_async_checkpoint(step);
    else
      save_checkpoint(step);
  });
}

void TrainRun::guard_save(int64_t step, bool may_continue, const std::function<void()>& save) {
  try {
    save();
  } catch (const Error& e) {
    // Only the disk's errors (kData): the writer's collectives have agreed on them, so every
    // rank is here together. Anything else is not a save failing.
    if (e.kind() != ErrorKind::kData) throw;
    const std::string last = last_checkpoint_.empty() ? "none" : last_checkpoint_;
    if (!may_continue || cfg_.checkpoint.on_save_error != "continue")
      SHARDLM_FAIL(ErrorKind::kData,
                   "{} ({}). The last committed checkpoint, {}, is intact; the run resumes from "
                   "it once the disk has room (checkpoint.on_save_error = \"continue\" carries "
                   "on past a failed periodic save instead)",
                   e.what(), checkpoint_space_text(step), last);
    log_line(fmt::format("checkpoint: step {} not saved: {} ({}); training goes on "
                         "(checkpoint.on_save_error = \"continue\"; the last checkpoint is {})",
                         step, e.what(), checkpoint_space_text(step), last),
             true);
  }
}

}  // namespace shardlm::trainer_detail
