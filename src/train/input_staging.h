// InputStaging: a micro-batch's inputs on their way from the data to the model. The trainer
// writes them into host rows it keeps (and its readers, the preference runner's targets among
// them, read there; a third slot of the same buffer); they go up to the model's inputs from two
// pinned host slots with
// Backend::copy_async, so that the host does not wait for the device to take them: the compute
// stream waits for the copies, and a slot is written again only after the copies out of it
// two micro-batches earlier have finished (a host wait only where the device is that far
// behind). The rows and the slots are host-pool bytes in the run's ledger (category activations;
// the planner counts the same bytes: plan.h's input_staging_bytes).
#pragma once

#include <array>
#include <cstdint>

#include "shardlm/backend/backend.h"
#include "shardlm/core/buffer.h"
#include "shardlm/model/llama.h"
#include "shardlm/plan/plan.h"

namespace shardlm::trainer_detail {

class InputStaging {
 public:
  // No slots (a run being torn down; rows() and upload() refuse).
  InputStaging() = default;
  // Rows and slots for micro-batches of up to `tokens` tokens, from `backend`'s host pool.
  InputStaging(Backend& backend, MemoryLedger& ledger, int64_t tokens);

  // The host rows of a micro-batch of n tokens [5 n + 1] int32, in BatchInputs order: tokens,
  // targets, positions, segment starts at i * n, then the n + 1 document starts. Valid until
  // the next rows() call; readers index them from begin() (the targets at begin() + n). More
  // tokens than the slots hold are refused.
  BatchInputs rows(int64_t n);
  const int32_t* begin() const { return rows_; }

  // Starts the copies of the rows of the last rows(n) call to `dev`, the first `docs` + 1
  // document starts only, and makes the compute work issued afterwards wait for them.
  void upload(Backend& backend, const BatchInputs& dev, int64_t docs);

 private:
  int64_t n_ = 0;                    // tokens of the last rows() call
  int64_t tokens_ = 0;               // tokens one slot holds
  Buffer slots_;                     // [3][5 tokens_ + 1] int32, host pool: 2 slots, the rows
  int32_t* rows_ = nullptr;          // slots_' third part
  std::array<uint64_t, 2> fence_{};  // each slot's last copy (0: none yet)
  int next_ = 0;                     // the slot the next upload writes
};

}  // namespace shardlm::trainer_detail
