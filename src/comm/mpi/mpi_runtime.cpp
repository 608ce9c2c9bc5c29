// MPI's lifetime: Session initialises MPI (THREAD_SERIALIZED, see mpi_runtime.h for why), makes
// the bf16 reduction ops, and frees them and finalises MPI when the last owner lets go; MpiRuntime
// is the public face that makes world communicators. Also the one definition behind
// SHARDLM_MPI_CHECK.
#include "shardlm/comm/mpi_runtime.h"

#include <cstdio>

#include "comm/mpi/mpi_check.h"
#include "comm/mpi/mpi_communicator.h"
#include "comm/mpi/session.h"

namespace shardlm {

namespace mpi {

void throw_mpi_error(int code, const char* call, const char* file, int line) {
  char text[MPI_MAX_ERROR_STRING] = {};
  int length = 0;
  if (MPI_Error_string(code, text, &length) != MPI_SUCCESS) {
    std::snprintf(text, sizeof(text), "unknown MPI error code %d", code);
  }
  int rank = -1, initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (initialized && !finalized) MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  throw Error(ErrorKind::kInternal,
              fmt::format("MPI error on world rank {}: {} failed: {} [at {}:{}]", rank, call, text,
                          file, line));
}

Session::Session() {
  int initialized = 0, finalized = 0;
  SHARDLM_MPI_CHECK(MPI_Initialized(&initialized));
  SHARDLM_MPI_CHECK(MPI_Finalized(&finalized));
  SHARDLM_CHECK(!finalized, "MPI was already finalised in this process; it cannot be restarted");
  int provided = MPI_THREAD_SINGLE;
  if (!initialized) {
    SHARDLM_MPI_CHECK(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_SERIALIZED, &provided));
    owns_mpi = true;
    SHARDLM_MPI_CHECK(MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN));
  } else {
    SHARDLM_MPI_CHECK(MPI_Query_thread(&provided));
  }
  if (provided < MPI_THREAD_SERIALIZED) {
    if (owns_mpi) MPI_Finalize();
    SHARDLM_FAIL(ErrorKind::kInternal,
                 "MPI provides thread level {} but shardlm needs MPI_THREAD_SERIALIZED ({}); use "
                 "an MPI built with thread support",
                 provided, static_cast<int>(MPI_THREAD_SERIALIZED));
  }
  SHARDLM_MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &world_rank));
  SHARDLM_MPI_CHECK(MPI_Comm_size(MPI_COMM_WORLD, &world_size));
  MPI_Comm node = MPI_COMM_NULL;
  SHARDLM_MPI_CHECK(
      MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, world_rank, MPI_INFO_NULL, &node));
  SHARDLM_MPI_CHECK(MPI_Comm_rank(node, &local_rank));
  SHARDLM_MPI_CHECK(MPI_Comm_size(node, &local_size));
  SHARDLM_MPI_CHECK(MPI_Comm_free(&node));
  bf16_ops.create();
}

Session::~Session() {
  {
    // Every communicator using the ops is gone (they share this session); MPI_Op_free leaves
    // an op that an abandoned request still holds to MPI until that request ends.
    std::lock_guard lock(mutex);
    int finalized = 1;
    if (MPI_Finalized(&finalized) == MPI_SUCCESS && !finalized) bf16_ops.free();
  }
  if (!owns_mpi) return;
  if (poisoned) {
    std::fprintf(stderr,
                 "shardlm: world rank %d exits without MPI_Finalize: a communication timed out "
                 "and its requests are still pending; the launcher ends the job\n",
                 world_rank);
    return;
  }
  // Finalise only once every rank has come this far. Open MPI 4.1's mpirun can hang or crash
  // when a rank aborts while another sits in MPI_Finalize (reproduced here: 2 in 10 jobs), so a
  // rank that returns early waits in this barrier, where an abort from the others is safe.
  try {
    MPI_Request request = MPI_REQUEST_NULL;
    {
      std::lock_guard lock(mutex);
      SHARDLM_MPI_CHECK(MPI_Ibarrier(MPI_COMM_WORLD, &request));
    }
    // Twice the communication timeout: a peer stuck in an operation this rank left reports
    // it (naming this rank) after one timeout, before this rank gives up and exits.
    wait_setup_request(*this, request, 2 * CommOptions::from_env().timeout_s,
                       "the barrier before MPI_Finalize");
  } catch (const std::exception& e) {
    std::fprintf(stderr, "shardlm: world rank %d exits without MPI_Finalize: %s\n", world_rank,
                 e.what());
    return;
  }
  MPI_Finalize();
}

}  // namespace mpi

MpiRuntime::MpiRuntime() : session_(std::make_shared<mpi::Session>()) {}

MpiRuntime::~MpiRuntime() = default;

int MpiRuntime::world_rank() const { return session_->world_rank; }
int MpiRuntime::world_size() const { return session_->world_size; }
int MpiRuntime::local_rank() const { return session_->local_rank; }
int MpiRuntime::local_size() const { return session_->local_size; }

std::unique_ptr<Communicator> MpiRuntime::world(const CommOptions& options) const {
  MPI_Comm dup = MPI_COMM_NULL;
  MPI_Request request = MPI_REQUEST_NULL;
  {
    std::lock_guard lock(session_->mutex);
    SHARDLM_MPI_CHECK(MPI_Comm_idup(MPI_COMM_WORLD, &dup, &request));
  }
  mpi::wait_setup_request(*session_, request, options.timeout_s,
                          "creating the world communicator (MPI_Comm_idup)");
  return std::make_unique<mpi::MpiCommunicator>(session_, dup, "world", options);
}

}  // namespace shardlm
