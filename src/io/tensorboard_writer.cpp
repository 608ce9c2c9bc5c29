// TensorBoard event files (tensorboard_writer.h): TFRecord framing with CRC-32C (Boost.CRC),
// Events serialized by libprotobuf, appends and rewrites through posix_file.
#include "tensorboard_writer.h"

#include <fcntl.h>

#include <boost/crc.hpp>
#include <chrono>
#include <cstring>
#include <filesystem>

#include "shardlm/core/check.h"
#include "tensorboard_event.pb.h"

namespace shardlm {
namespace {

namespace fs = std::filesystem;
namespace pb = shardlm::tensorboard;

constexpr const char* kFilePrefix = "events.out.tfevents.";

// TFRecord's checksum: CRC-32C (Castagnoli), rotated and offset ("masked") so that a CRC of
// data holding CRCs stays well distributed.
uint32_t masked_crc32c(const void* data, size_t n) {
  boost::crc_optimal<32, 0x1EDC6F41, 0xFFFFFFFF, 0xFFFFFFFF, true, true> crc;
  crc.process_bytes(data, n);
  const uint32_t c = crc.checksum();
  return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

// [u64 length][u32 masked crc of the length][data][u32 masked crc of the data], little-endian.
std::string frame(const std::string& data) {
  std::string out(12 + data.size() + 4, '\0');
  const uint64_t n = data.size();
  std::memcpy(out.data(), &n, 8);
  const uint32_t len_crc = masked_crc32c(out.data(), 8);
  std::memcpy(out.data() + 8, &len_crc, 4);
  std::memcpy(out.data() + 12, data.data(), data.size());
  const uint32_t data_crc = masked_crc32c(data.data(), data.size());
  std::memcpy(out.data() + 12 + data.size(), &data_crc, 4);
  return out;
}

double wall_time_now() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

std::string serialize(const pb::Event& e) {
  std::string s;
  SHARDLM_CHECK(e.SerializeToString(&s), "tensorboard: an Event did not serialize");
  return s;
}

// Drops the events past `last_step` from the event file `path`, and a last record cut short,
// rewriting it atomically when anything goes.
void drop_events_after(const std::string& path, int64_t last_step) {
  bool cut_tail = false;
  const std::vector<std::string> events = read_tensorboard_events(path, &cut_tail);
  std::string kept;
  size_t dropped = 0;
  for (size_t i = 0; i < events.size(); ++i) {
    if (i > 0 && tensorboard_event_step(events[i]) > last_step) {
      ++dropped;
      continue;
    }
    kept += frame(events[i]);
  }
  if (dropped > 0 || cut_tail) posix::replace_file(path, kept);
}

}  // namespace

std::vector<std::string> read_tensorboard_events(const std::string& path, bool* cut_tail) {
  posix::UniqueFd fd = posix::open_file(path, O_RDONLY);
  std::vector<std::string> events;
  if (cut_tail != nullptr) *cut_tail = false;
  // A record that ends past the end of the file: the file's last, cut short.
  auto cut = [&](size_t record) {
    if (cut_tail == nullptr)
      SHARDLM_FAIL(ErrorKind::kData, "{}: record {}: cut short", path, record);
    *cut_tail = true;
  };
  for (size_t record = 0;; ++record) {
    char head[12];
    const size_t got = posix::read_up_to(fd.get(), head, 12, path);
    if (got == 0) break;
    if (got < 12) {
      cut(record);
      break;
    }
    uint64_t n = 0;
    uint32_t len_crc = 0;
    std::memcpy(&n, head, 8);
    std::memcpy(&len_crc, head + 8, 4);
    if (len_crc != masked_crc32c(head, 8) || n > (uint64_t{1} << 30))
      SHARDLM_FAIL(ErrorKind::kData, "{}: record {}: its length is corrupt", path, record);
    std::string data(n + 4, '\0');
    uint32_t data_crc = 0;
    if (posix::read_up_to(fd.get(), data.data(), data.size(), path) != data.size()) {
      cut(record);
      break;
    }
    std::memcpy(&data_crc, data.data() + n, 4);
    data.resize(n);
    if (data_crc != masked_crc32c(data.data(), n))
      SHARDLM_FAIL(ErrorKind::kData, "{}: record {}: CRC-32C mismatch", path, record);
    events.push_back(std::move(data));
  }
  return events;
}

int64_t tensorboard_event_step(const std::string& serialized) {
  pb::Event e;
  if (!e.ParseFromString(serialized))
    SHARDLM_FAIL(ErrorKind::kData, "tensorboard: an event does not parse");
  return e.step();
}

TensorBoardWriter::TensorBoardWriter(const std::string& dir, int64_t first_step) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) SHARDLM_FAIL(ErrorKind::kData, "{}: cannot create: {}", dir, ec.message());
  for (const auto& entry : fs::directory_iterator(dir)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind(kFilePrefix, 0) != 0 || name.ends_with(".tmp")) continue;
    if (first_step <= 1)
      fs::remove(entry.path(), ec);
    else
      drop_events_after(entry.path().string(), first_step - 1);
  }
  // Readers take a directory's files in name order: the seconds, then the first step, order a
  // resumed run's file after the ones before it.
  const auto seconds = int64_t(wall_time_now());
  path_ = (fs::path(dir) /
           fmt::format("{}{:011d}.shardlm-step{:010d}", kFilePrefix, seconds, first_step))
              .string();
  fd_ = posix::open_file(path_, O_WRONLY | O_CREAT | O_TRUNC);
  pb::Event e;
  e.set_wall_time(wall_time_now());
  e.set_file_version("brain.Event:2");
  write_event(serialize(e));
}

void TensorBoardWriter::scalars(int64_t step,
                                const std::vector<std::pair<std::string, double>>& values) {
  pb::Event e;
  e.set_wall_time(wall_time_now());
  e.set_step(step);
  for (const auto& [tag, value] : values) {
    pb::Summary::Value* v = e.mutable_summary()->add_value();
    v->set_tag(tag);
    v->set_simple_value(float(value));
  }
  write_event(serialize(e));
}

void TensorBoardWriter::text(int64_t step, const std::string& tag, const std::string& markdown) {
  pb::Event e;
  e.set_wall_time(wall_time_now());
  e.set_step(step);
  pb::Summary::Value* v = e.mutable_summary()->add_value();
  v->set_tag(tag);
  v->mutable_metadata()->mutable_plugin_data()->set_plugin_name("text");
  pb::TensorProto* t = v->mutable_tensor();
  t->set_dtype(pb::DT_STRING);
  t->mutable_tensor_shape();  // a scalar: no dims
  t->add_string_val(markdown);
  write_event(serialize(e));
}

void TensorBoardWriter::write_event(const std::string& serialized) {
  const std::string record = frame(serialized);
  posix::write_all(fd_.get(), record.data(), record.size(), path_);
}

}  // namespace shardlm
