// Cuts a record file into its records' raw text, streaming, each with the line it starts on:
// JSON Lines (one record per line, blank lines skipped) or a JSON array of records. Only the
// array's structure is read here (strings, nesting, commas); each record's own JSON is parsed
// by its encoder (tokenize.cpp), so that parsing runs on the encoding threads. Private to io.
#pragma once

#include <cstdint>
#include <istream>
#include <string>

namespace shardlm {

struct RawRecord {
  std::string text;
  int64_t line = 0;    // 1-based line where the record starts
  int64_t index = -1;  // its index in a JSON array; -1 in JSON Lines
};

class RecordScanner {
 public:
  // A .json file whose first non-blank character is '[' is an array; anything else (any
  // .jsonl, and a .json holding objects) is read as JSON Lines, as Hugging Face's json loader
  // does.
  RecordScanner(std::istream& in, std::string path);
  // The next record into `out`; false at the end. A broken array (no closing ']', text after
  // it, a missing ',') is Error(kData) naming the file and line.
  bool next(RawRecord& out);

 private:
  int get();  // the next byte, or -1 at the end; counts lines
  int peek();
  void skip_blank();
  bool next_line(RawRecord& out);
  bool next_element(RawRecord& out);
  void close_array();
  [[noreturn]] void fail(const std::string& what) const;

  std::istream& in_;
  std::streambuf* buf_;
  std::string path_;
  bool array_ = false;
  bool done_ = false;
  int64_t line_ = 1;   // the line the next byte is on
  int64_t index_ = 0;  // the next array element's index
};

}  // namespace shardlm
