// Fault injection for tests: makes the Nth call of a chosen kind of system call fail, so that a
// test can walk N over every write, fsync, rename and allocation of a writer and check that each
// failure is reported and loses nothing (SQLite's I/O-error tests are the model). Off unless a
// test arms it, or the process starts with SHARDLM_FAULT set; off, a call costs one relaxed
// atomic load.
//
// SHARDLM_FAULT="io:N:ERRNO[:short]" fails the Nth write-side file call (open for writing,
// write, fsync, directory fsync, rename, mkdir) with ERRNO (ENOSPC, EIO, EDQUOT or a number);
// "short" makes a failed write first write part of its buffer, as a full disk does.
// SHARDLM_FAULT="host_alloc:N" fails the Nth host allocation; "free_space:BYTES" makes every
// free-space query (statvfs) answer BYTES, a full disk without filling one.
// SHARDLM_FAULT_RANK=R limits it to the process whose RANK (or OMPI_COMM_WORLD_RANK) is R. When
// the fault fires, a line naming the call goes to the file SHARDLM_FAULT_LOG (if set), so that a
// test tells a walked-past N from a swallowed error.
//
// The plan is process-wide by nature (it reaches calls deep inside every writer); it is the one
// piece of global state in the engine, and only tests set it.
#pragma once

#include <cstdint>
#include <string>

namespace shardlm::fault {

enum class Call : uint8_t {
  kOpen,      // open(2) of a file for writing
  kWrite,     // write(2) / pwrite(2)
  kFsync,     // fsync(2) of a file
  kDirFsync,  // fsync(2) of a directory
  kRename,    // rename(2)
  kMkdir,     // mkdir(2)
  kHostAlloc  // a host-pool allocation
};
const char* call_name(Call call);

enum class Family : uint8_t { kNone, kIo, kHostAlloc, kFreeSpace };

struct Plan {
  Family family = Family::kNone;
  int64_t nth = 0;  // 1-based index of the failing call among the family's calls; free bytes
  int err = 0;      // the errno it fails with (io)
  bool short_write = false;
};

// Arms `plan` (counting from zero again); disarm() turns it off. Tests only.
void arm(const Plan& plan);
void disarm();
// Calls of the armed family counted since arm(), and whether the fault has fired.
int64_t calls();
bool fired();

// The errno the current call must fail with, or 0 to go ahead. `short_write` is set when a
// failing write should first write part of its buffer.
int io_fault(Call call, const std::string& path, bool* short_write = nullptr);
// Whether the current host allocation must fail.
bool host_alloc_fault(size_t bytes);
// The free bytes a free-space query must answer, or -1 for the file system's own answer.
int64_t free_space_override();

// "io:3:ENOSPC:short" -> Plan; throws Error(kConfig) naming the text when it does not parse.
Plan parse_plan(const std::string& text);

}  // namespace shardlm::fault
