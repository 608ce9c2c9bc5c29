// CommStaging: what a run lends its StagedCommunicator (parallel.device_comm = "host"): the
// backend's copies and the host staging buffer, allocated through the run's ledger (category
// comm, host pool; the planner counts the same bytes). Taken back when it is destroyed, before
// the backend and the ledger are.
#pragma once

#include <cstdint>

#include "shardlm/backend/backend.h"
#include "shardlm/comm/staged.h"
#include "shardlm/core/buffer.h"

namespace shardlm::trainer_detail {

// Backend::copy: ordered after the compute work queued so far, finished on return when host
// memory is involved (the staging buffer always is).
class BackendCopier final : public DeviceCopier {
 public:
  explicit BackendCopier(Backend& backend) : backend_(backend) {}
  void copy(const Tensor& src, const Tensor& dst) override { backend_.copy(src, dst); }

 private:
  Backend& backend_;
};

class CommStaging {
 public:
  CommStaging(StagedCommunicator& comm, Backend& backend, MemoryLedger& ledger, int64_t bytes);
  ~CommStaging();
  CommStaging(const CommStaging&) = delete;
  CommStaging& operator=(const CommStaging&) = delete;

 private:
  StagedCommunicator& comm_;
  BackendCopier copier_;
  Buffer staging_;  // [bytes] host pool, category comm
};

}  // namespace shardlm::trainer_detail
