// Checkpoint directories: written under a temporary name, every file and the directory
// fsynced, then renamed into place; a manifest lists each file's size and CRC-32; `latest`
// is replaced (atomically) only after a complete write. Readers verify the manifest and name
// the file that is truncated or corrupt. Layout of a run's checkpoints:
//   checkpoints/step_00000120/{manifest.json, <files>}   complete checkpoints
//   checkpoints/latest                                    text file: "step_00000120\n"
//   checkpoints/.tmp-step_00000130/                       an interrupted write (ignored)
// What goes into a checkpoint is the trainer's business; this file only stores bytes.
//
// Vectors in shards: a checkpoint may hold named flat vectors ("params", "adam_m", ...) split
// into element ranges over many files, each file written by one rank of a group in parallel.
// The manifest declares every vector (element size and count) and, per file, the ranges it
// holds ({begin, count, offset, crc32}, or a strided run of rows {..., stride, repeat}: a tp
// rank's share of a column-split matrix in one entry); together a vector's ranges tile it
// exactly once, so a reader on any grid preads just the ranges it needs. A vector may also be
// stored the old way, as the whole file "<name>.bin" (read_vector reads both).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

namespace shardlm {

class Communicator;

class CheckpointWriter {
 public:
  // Starts checkpoints_dir/.tmp-step_<step> (created if needed). Every stale `.tmp-*` entry
  // in checkpoints_dir (an interrupted write or rotation) is removed first, so at most one
  // writer may work in a checkpoints directory at a time. A commit onto an existing step
  // directory replaces it atomically (renameat2 RENAME_EXCHANGE).
  CheckpointWriter(const std::string& checkpoints_dir, int64_t step);
  // The multi-rank form (collective over `group`): rank 0 cleans up and creates the temporary
  // directory, then every rank writes its own files into it (names unique over the group) and
  // calls commit, which agrees in one collective that every rank's files are durable before
  // rank 0 writes the manifest, renames and moves `latest`. A rank whose write failed passes
  // its error to commit instead of throwing past it, so that no rank waits forever.
  CheckpointWriter(const std::string& checkpoints_dir, int64_t step, Communicator& group);
  ~CheckpointWriter();  // an uncommitted write is removed (by rank 0 of a group)
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

  // Sharded vectors: declare_vector records a vector's element size and count (every rank
  // of a group declares the same; rank 0's go into the manifest). begin_vector_file opens a
  // file of the vector's ranges; append_elements writes elements [begin, begin + count) of it
  // (count * elem_bytes bytes at data) and records the range with its CRC-32 (a range that
  // continues the previous one extends it; equal rows at a regular stride fold into one
  // strided run). Then end_file. At commit, the ranges of every
  // file of the group must tile each declared vector exactly once (else kInternal naming the
  // vector and the first element missing or held twice).
  void declare_vector(const std::string& name, size_t elem_bytes, int64_t elems);
  void begin_vector_file(const std::string& name, const std::string& vector);
  void append_elements(int64_t begin, const void* data, int64_t count);
  // Free-form JSON recorded in the manifest as "layout" (e.g. the grid that wrote it).
  void set_layout(const nlohmann::json& layout);

  // fsyncs, writes manifest.json, renames to step_<step>, fsyncs the parent, updates
  // `latest`, then deletes the oldest complete checkpoints beyond keep_last (0 = keep all;
  // never the new one nor the one `latest` names).
  // Returns the final directory. In a group it is collective: `failure` is this rank's error
  // ("" when its files are written); if any rank failed, nothing is committed and every rank
  // throws kData naming the first failed rank and its error.
  std::string commit(int64_t keep_last, const std::string& failure = "");

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

  // A named vector: sharded (declared in the manifest) or whole in "<name>.bin".
  bool has_vector(const std::string& name) const;
  size_t vector_bytes(const std::string& name) const;  // kData naming it if absent
  // Bytes [offset, offset + bytes) of the vector, from whichever files hold them (pread). A
  // range no file holds is kData naming the vector and the elements.
  void read_vector(const std::string& name, uint64_t offset, void* dst, size_t bytes) const;
  // Verifies the contents (CRC-32 of every range and file) of the files whose index is
  // `part` modulo `parts`: the ranks of a group verify a checkpoint together. kData names the
  // file and, in a sharded file, the vector's element range that is corrupt.
  void verify_contents(int part, int parts) const;
  // Verifies the contents of the files a reader of `vectors` alone needs: those holding their
  // ranges and every file that holds no vector ranges (model.json, state.json; an old
  // checkpoint's whole-vector files). An export reads the parameters and nothing of the
  // optimizer's state, whose files it need not read through.
  void verify_contents_for(const std::vector<std::string>& vectors) const;

 private:
  // Elements begin + k * stride + [0, count) of a vector for k < repeat (a plain range: repeat
  // 1), back to back from byte `offset` of a file, with their CRC-32.
  struct Range {
    int64_t begin = 0, count = 0, stride = 0, repeat = 1;
    uint64_t offset = 0;
    uint32_t crc = 0;
  };
  struct File {
    std::string name;
    size_t bytes = 0;
    uint32_t crc = 0;
    std::string vector;  // "" when the file holds no vector ranges
    std::vector<Range> ranges;
  };
  struct Vector {
    size_t elem_bytes = 0;
    int64_t elems = 0;
    std::vector<std::pair<Range, size_t>> ranges;  // (range, file index), by begin
    std::vector<int64_t> reach;                    // reach[i]: the furthest end of ranges [0, i]
  };
  void parse_manifest(const std::string& manifest_path);
  void index_vectors();
  // The range of `v` holding element `at` and the row of it that does: kData when none does.
  std::pair<const std::pair<Range, size_t>*, int64_t> locate(const std::string& name,
                                                             const Vector& v, int64_t at) const;
  const File* find(const std::string& name) const;
  std::string holds_text(const File& f) const;  // "params elements [0, 100)" for messages
  void check_size(const File& f) const;
  void verify_file(const File& f) const;
  std::string dir_;
  int64_t step_ = -1;
  std::vector<File> files_;
  std::vector<std::pair<std::string, Vector>> vectors_;
};

// The directory `latest` names, or "" when there is no `latest` (no complete checkpoint was
// ever committed). A `latest` that does not hold a step directory's name throws kData naming it, so
// that a damaged run is never silently restarted; CheckpointReader verifies what it names.
std::string latest_checkpoint(const std::string& checkpoints_dir);
// Complete checkpoints (step directories with a manifest), newest first.
std::vector<std::string> list_checkpoints(const std::string& checkpoints_dir);

}  // namespace shardlm
