// CommStaging: the staging buffer's allocation and the communicator's attach/detach.
#include "comm_staging.h"

#include <span>

namespace shardlm::trainer_detail {

CommStaging::CommStaging(StagedCommunicator& comm, Backend& backend, MemoryLedger& ledger,
                         int64_t bytes)
    : comm_(comm),
      copier_(backend),
      staging_(backend, ledger, MemCategory::kComm, MemPool::kHost, size_t(bytes)) {
  comm_.attach(copier_, std::span<std::byte>(staging_.data(), staging_.bytes()));
}

CommStaging::~CommStaging() {
  try {
    comm_.detach();
  } catch (const Error&) {
    // A run that failed mid-transfer: the process is ending; the staging memory is freed anyway.
  }
}

}  // namespace shardlm::trainer_detail
