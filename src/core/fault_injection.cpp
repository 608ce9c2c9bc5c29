// The fault-injection plan (fault_injection.h): one process-wide counter of the armed family's
// calls, read by the file layer and the host allocators.
#include "shardlm/core/fault_injection.h"

#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <vector>

#include "shardlm/core/check.h"

namespace shardlm::fault {
namespace {

struct State {
  std::atomic<bool> armed{false};
  std::mutex mu;  // guards plan and log_path while arming and when the fault fires
  Plan plan;
  std::string log_path;
  std::atomic<int64_t> calls{0};
  std::atomic<bool> fired{false};
};

int errno_of(const std::string& name) {
  if (name == "ENOSPC") return ENOSPC;
  if (name == "EIO") return EIO;
  if (name == "EDQUOT") return EDQUOT;
  if (name == "EACCES") return EACCES;
  if (name == "EROFS") return EROFS;
  char* end = nullptr;
  const long v = std::strtol(name.c_str(), &end, 10);
  return (end != name.c_str() && *end == '\0' && v > 0) ? int(v) : 0;
}

// The plan SHARDLM_FAULT names, for this process (SHARDLM_FAULT_RANK against RANK).
void load_from_env(State& s) {
  const char* text = std::getenv("SHARDLM_FAULT");
  if (text == nullptr || *text == '\0') return;
  const char* only = std::getenv("SHARDLM_FAULT_RANK");
  const char* rank = std::getenv("RANK");  // shardlm launch, torchrun; else mpirun's
  if (rank == nullptr) rank = std::getenv("OMPI_COMM_WORLD_RANK");
  if (only != nullptr && *only != '\0' && (rank == nullptr || std::strcmp(only, rank) != 0)) return;
  s.plan = parse_plan(text);
  if (const char* log = std::getenv("SHARDLM_FAULT_LOG")) s.log_path = log;
  s.armed.store(s.plan.family != Family::kNone, std::memory_order_release);
}

State& state() {
  static State* s = [] {
    auto* st = new State;  // never destroyed: writers may still run during static destruction
    load_from_env(*st);
    return st;
  }();
  return *s;
}

// Counts a call of `family`; true when it is the one that fails (the first time only).
bool count_and_check(State& s, Family family, Call call, const std::string& what) {
  if (!s.armed.load(std::memory_order_relaxed)) return false;
  std::lock_guard<std::mutex> lock(s.mu);
  if (s.plan.family != family) return false;
  const int64_t n = s.calls.fetch_add(1, std::memory_order_relaxed) + 1;
  if (n != s.plan.nth) return false;
  s.fired.store(true, std::memory_order_relaxed);
  if (!s.log_path.empty()) {
    const std::string line = fmt::format("fired {} {} {}\n", n, call_name(call), what);
    const int fd = ::open(s.log_path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    if (fd >= 0) {
      (void)!::write(fd, line.data(), line.size());
      ::close(fd);
    }
  }
  return true;
}

}  // namespace

const char* call_name(Call call) {
  switch (call) {
    case Call::kOpen:
      return "open";
    case Call::kWrite:
      return "write";
    case Call::kFsync:
      return "fsync";
    case Call::kDirFsync:
      return "directory fsync";
    case Call::kRename:
      return "rename";
    case Call::kMkdir:
      return "mkdir";
    case Call::kHostAlloc:
      return "host allocation";
  }
  return "?";
}

Plan parse_plan(const std::string& text) {
  std::vector<std::string> parts;
  for (size_t at = 0;;) {
    const size_t colon = text.find(':', at);
    parts.push_back(text.substr(at, colon == std::string::npos ? std::string::npos : colon - at));
    if (colon == std::string::npos) break;
    at = colon + 1;
  }
  Plan p;
  char* end = nullptr;
  p.nth = parts.size() >= 2 ? std::strtoll(parts[1].c_str(), &end, 10) : 0;
  const bool nth_ok = parts.size() >= 2 && end != parts[1].c_str() && *end == '\0' && p.nth > 0;
  if (parts[0] == "io" && nth_ok && (parts.size() == 3 || parts.size() == 4)) {
    p.family = Family::kIo;
    p.err = errno_of(parts[2]);
    p.short_write = parts.size() == 4 && parts[3] == "short";
    if (p.err != 0 && (parts.size() == 3 || p.short_write)) return p;
  } else if (parts[0] == "host_alloc" && nth_ok && parts.size() == 2) {
    p.family = Family::kHostAlloc;
    p.err = ENOMEM;
    return p;
  } else if (parts[0] == "free_space" && nth_ok && parts.size() == 2) {
    p.family = Family::kFreeSpace;
    return p;
  }
  SHARDLM_FAIL(
      ErrorKind::kConfig,
      "SHARDLM_FAULT=\"{}\": expected \"io:N:ERRNO[:short]\" (ERRNO: ENOSPC, EIO, "
      "EDQUOT, EACCES, EROFS or a number), \"host_alloc:N\" or \"free_space:BYTES\", N >= 1",
      text);
}

void arm(const Plan& plan) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  s.plan = plan;
  s.calls.store(0, std::memory_order_relaxed);
  s.fired.store(false, std::memory_order_relaxed);
  s.armed.store(plan.family != Family::kNone, std::memory_order_release);
}

void disarm() { arm(Plan{}); }

int64_t calls() { return state().calls.load(std::memory_order_relaxed); }
bool fired() { return state().fired.load(std::memory_order_relaxed); }

int io_fault(Call call, const std::string& path, bool* short_write) {
  State& s = state();
  if (!count_and_check(s, Family::kIo, call, path)) return 0;
  if (short_write != nullptr) *short_write = s.plan.short_write;
  return s.plan.err;
}

bool host_alloc_fault(size_t bytes) {
  return count_and_check(state(), Family::kHostAlloc, Call::kHostAlloc,
                         fmt::format("{} bytes", bytes));
}

int64_t free_space_override() {
  State& s = state();
  if (!s.armed.load(std::memory_order_relaxed)) return -1;
  std::lock_guard<std::mutex> lock(s.mu);
  return s.plan.family == Family::kFreeSpace ? s.plan.nth : -1;
}

}  // namespace shardlm::fault
