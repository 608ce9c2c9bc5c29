// Checkpoint directories: written under a temporary name, every file and the directory
// fsynced, then renamed into place; a manifest lists each file's size and CRC-32; `latest`
// is replaced (atomically) only after a complete write. Readers verify the manifest and name
// the file that is truncated or corrupt. Layout of a run's checkpoints:
//   checkpoints/step_00000120/{manifest.json, <files>}   complete checkpoints
//   checkpoints/latest                                    text file: "step_00000120\n"
//   checkpoints/.tmp-step_00000130/                       an interrupted write (ignored)
// What goes into a checkpoint is the trainer's business; this file only stores bytes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

namespace shardlm {

class CheckpointWriter {
 public:
  // Starts checkpoints_dir/.tmp-step_<step> (created if needed). Every stale `.tmp-*` entry
  // in checkpoints_dir (an interrupted write or rotation) is removed first, so at most one
  // writer may work in a checkpoints directory at a time. A commit onto an existing step
  // directory replaces it atomically (renameat2 RENAME_EXCHANGE).
  CheckpointWriter(const std::string& checkpoints_dir, int64_t step);
  ~CheckpointWriter();  // an uncommitted write is removed
  CheckpointWriter(const CheckpointWriter&) = delete;
  CheckpointWriter& operator=(const CheckpointWriter&) = delete;

  // Writes one file (name without '/' or "..", not manifest.json, each name once; else
  // kInternal), computing its CRC-32 as it streams out, then fsyncs it.
  // Same as begin_file(name), append(data, bytes), end_file().
  void add_file(const std::string& name, const void* data, size_t bytes);
  void add_json(const std::string& name, const nlohmann::json& value);

  // A file written piece by piece, for data that arrives in parts (e.g. other ranks' shards
  // received one at a time): begin_file takes add_file's name rules; append writes the bytes
  // and folds them into the file's CRC-32 as they arrive; end_file fsyncs the file and records
  // its size and CRC-32 for the manifest. One file is open at a time: append or end_file with
  // no file open, begin_file while one is open, and commit while one is open are kInternal.
  // After an I/O error (kData) the writer is only fit to be destroyed.
  void begin_file(const std::string& name);
  void append(const void* data, size_t bytes);
  void end_file();

  // fsyncs, writes manifest.json, renames to step_<step>, fsyncs the parent, updates
  // `latest`, then deletes the oldest complete checkpoints beyond keep_last (0 = keep all;
  // never the new one nor the one `latest` names).
  // Returns the final directory.
  std::string commit(int64_t keep_last);

 private:
  struct Impl;
  Impl* impl_;
};

class CheckpointReader {
 public:
  // How much of the checkpoint the constructor verifies. kContents reads every file through
  // its CRC-32. kSizesOnly reads the manifest and checks that every listed file exists with
  // its size, without reading the contents: for readers that open what another process
  // already verified, e.g. in a multi-rank run rank 0 verifies the contents and the other
  // ranks, which each read only their own byte ranges, take kSizesOnly instead of reading
  // every file once more.
  enum class Verify { kContents, kSizesOnly };

  // `dir` is a step directory, or a checkpoints directory (then `latest` is followed).
  // Verifies the manifest: every listed file present with its size and (kContents) CRC-32.
  // Throws Error(kData) naming the file when anything is missing, truncated or corrupt.
  explicit CheckpointReader(const std::string& dir, Verify verify = Verify::kContents);

  const std::string& dir() const { return dir_; }
  int64_t step() const { return step_; }
  bool has(const std::string& name) const;
  size_t size(const std::string& name) const;  // kData naming the file if absent
  // Reads a whole file into dst, which must be exactly size(name) bytes (else kData naming
  // the file: usually a checkpoint of another model). The size is re-checked on disk.
  void read(const std::string& name, void* dst, size_t bytes) const;
  std::vector<char> read_all(const std::string& name) const;
  // Reads bytes [offset, offset + bytes) of a file into dst (pread: safe from several threads).
  // A range past the manifest's size is kData naming the file and the range; so is a file
  // whose size on disk is not the manifest's (truncated or grown since it was verified).
  void read_range(const std::string& name, uint64_t offset, void* dst, size_t bytes) const;
  nlohmann::json read_json(const std::string& name) const;

 private:
  std::string dir_;
  int64_t step_ = -1;
  std::vector<std::pair<std::string, size_t>> files_;
};

// The directory `latest` names, or "" when there is no `latest` (no complete checkpoint was
// ever committed). A `latest` that does not hold a step directory's name throws kData naming it, so
// that a damaged run is never silently restarted; CheckpointReader verifies what it names.
std::string latest_checkpoint(const std::string& checkpoints_dir);
// Complete checkpoints (step directories with a manifest), newest first.
std::vector<std::string> list_checkpoints(const std::string& checkpoints_dir);

}  // namespace shardlm
