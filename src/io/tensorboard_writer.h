// TensorBoard event files: the run's scalars and text as TensorBoard (and `wandb sync
// --sync-tensorboard`) read them. A file `events.out.tfevents.<seconds>.shardlm-step<N>` is a
// sequence of TFRecords (length, masked CRC-32C of the length, a serialized Event, masked
// CRC-32C of the Event), the first Event naming the file version. Events are protobuf messages
// from tensorboard_event.proto (TensorBoard's field numbers), serialized by libprotobuf; each
// record is one write(2) through posix_file, so a live TensorBoard sees a step as it is logged
// and a failing disk is reported at the step that met it. Nothing here knows about training.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "posix_file.h"

namespace shardlm {

class TensorBoardWriter {
 public:
  // A new event file in `dir` (created if missing) for a run that starts after `first_step - 1`.
  // The event files already there lose every event past that step (a resumed run logs those
  // steps again), or all of them when first_step is 1 (a run started over).
  TensorBoardWriter(const std::string& dir, int64_t first_step);

  // One event at `step` holding every (tag, value) as a scalar.
  void scalars(int64_t step, const std::vector<std::pair<std::string, double>>& values);
  // Markdown text under `tag` (TensorBoard's text plugin).
  void text(int64_t step, const std::string& tag, const std::string& markdown);

  const std::string& path() const { return path_; }

 private:
  void write_event(const std::string& serialized);

  std::string path_;
  posix::UniqueFd fd_;
};

// The serialized Events of an event file, in order, each record's CRCs checked (Error(kData)
// naming the file and the record on a mismatch or a cut record). With `cut_tail`, a last record
// cut short (a write that a crash or a full disk interrupted) ends the list instead, and
// *cut_tail says whether there was one.
std::vector<std::string> read_tensorboard_events(const std::string& path, bool* cut_tail = nullptr);
// An Event's step (0 for the file-version event).
int64_t tensorboard_event_step(const std::string& serialized);

}  // namespace shardlm
