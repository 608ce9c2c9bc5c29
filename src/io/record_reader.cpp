// RecordScanner (record_reader.h): JSON Lines and JSON arrays cut into records with their
// starting lines, one byte at a time from the stream's buffer, never the whole file.
#include "record_reader.h"

#include <filesystem>
#include <utility>

#include "shardlm/core/check.h"

namespace shardlm {
namespace {

bool is_blank_byte(int c) { return c == ' ' || c == '\t' || c == '\r' || c == '\n'; }

}  // namespace

RecordScanner::RecordScanner(std::istream& in, std::string path)
    : in_(in), buf_(in.rdbuf()), path_(std::move(path)) {
  if (std::filesystem::path(path_).extension() != ".json") return;
  skip_blank();
  if (peek() == '[') {
    get();
    array_ = true;
  }
}

int RecordScanner::get() {
  const int c = buf_->sbumpc();
  if (c == std::char_traits<char>::eof()) return -1;
  if (c == '\n') ++line_;
  return c;
}

int RecordScanner::peek() {
  const int c = buf_->sgetc();
  return c == std::char_traits<char>::eof() ? -1 : c;
}

void RecordScanner::skip_blank() {
  while (is_blank_byte(peek())) get();
}

void RecordScanner::fail(const std::string& what) const {
  SHARDLM_FAIL(ErrorKind::kData, "{}:{}: {}", path_, line_, what);
}

bool RecordScanner::next(RawRecord& out) {
  if (in_.bad()) SHARDLM_FAIL(ErrorKind::kData, "{}: read error", path_);
  return array_ ? next_element(out) : next_line(out);
}

// The next line that is not blank (empty, or only spaces, tabs and "\r").
bool RecordScanner::next_line(RawRecord& out) {
  for (;;) {
    out.text.clear();
    out.line = line_;
    int c;
    while ((c = get()) != -1 && c != '\n') out.text.push_back(char(c));
    if (out.text.find_first_not_of(" \t\r") != std::string::npos) return true;
    if (c == -1) return false;
  }
}

// The next element of the array: its bytes up to the ',' or ']' that follows it at depth 0
// (outside strings), which is consumed.
bool RecordScanner::next_element(RawRecord& out) {
  if (done_) return false;
  skip_blank();
  if (index_ == 0 && peek() == ']') {  // []
    get();
    close_array();
    return false;
  }
  out.text.clear();
  out.line = line_;
  out.index = index_;
  int depth = 0;
  bool in_string = false, escaped = false;
  for (;;) {
    const int c = peek();
    if (c == -1)
      fail(
          fmt::format("the JSON array ends inside record {} (which starts on line {}): no "
                      "closing ']'",
                      index_, out.line));
    if (!in_string && depth == 0 && (c == ',' || c == ']')) break;
    get();
    out.text.push_back(char(c));
    if (escaped) {
      escaped = false;
    } else if (in_string) {
      escaped = c == '\\';
      in_string = c != '"';
    } else if (c == '"') {
      in_string = true;
    } else if (c == '{' || c == '[') {
      ++depth;
    } else if ((c == '}' || c == ']') && --depth < 0) {
      fail(fmt::format("record {}: a '{}' that closes nothing", index_, char(c)));
    }
  }
  ++index_;
  if (get() == ']') close_array();
  return true;
}

// After the array's ']' only blanks may follow.
void RecordScanner::close_array() {
  done_ = true;
  skip_blank();
  if (peek() != -1) fail("text after the JSON array's closing ']'");
}

}  // namespace shardlm
