// TensorBoard event files read back by TensorBoard's own reader (EventAccumulator, in the
// reference venv): every scalar of metrics.jsonl, at its step and with its value (as float32),
// and nothing else at those tags; a resumed run drops the events past its checkpoint and logs
// each step once; the plan's bytes and the resolved config at the first step of each start; a
// DeepSpeed config's tensorboard section puts the files where DeepSpeed would. The CRC-32C of
// the TFRecord framing is checked by shardlm's own reader against a damaged file too.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "io/tensorboard_writer.h"
#include "shardlm/core/check.h"
#include "tiny_runs.h"

namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using shardlm::test::slurp;

// tag -> [(step, value)] from metrics.jsonl: the training lines' numbers (nested ones as
// "key/sub") and the evaluation lines' eval_loss and eval_ppl.
std::map<std::string, std::vector<std::pair<int64_t, float>>> metrics_scalars(const fs::path& run) {
  std::map<std::string, std::vector<std::pair<int64_t, float>>> out;
  std::ifstream f(run / "metrics.jsonl");
  for (std::string text; std::getline(f, text);) {
    const json line = json::parse(text);
    const int64_t step = line.at("step").get<int64_t>();
    const bool eval = line.contains("eval_loss");
    for (const auto& [key, value] : line.items()) {
      if (key == "step" || (eval && key == "tokens_seen")) continue;
      if (value.is_object()) {
        for (const auto& [sub, v] : value.items())
          out[key + "/" + sub].emplace_back(step, v.get<float>());
      } else if (value.is_number()) {
        out[key].emplace_back(step, value.get<float>());
      }
    }
  }
  return out;
}

// TensorBoard's reading of the event directory (tensorboard_reference.py).
json tensorboard_view(const fs::path& dir) {
  const std::string python = shardlm::test::venv_python("tensorboard");
  if (python.empty()) return json();
  const std::string out =
      shardlm::test::run_command(python + " " + SHARDLM_SOURCE_DIR +
                                     "/tests/integration/tensorboard_reference.py " + dir.string(),
                                 dir.parent_path() / "tb_view.json");
  return json::parse(out);
}

void expect_scalars_are_the_metrics(const json& view, const fs::path& run) {
  const auto metrics = metrics_scalars(run);
  ASSERT_FALSE(metrics.empty());
  for (const auto& [tag, series] : metrics) {
    SCOPED_TRACE(tag);
    ASSERT_TRUE(view["scalars"].contains(tag)) << "no TensorBoard scalar for " << tag;
    const json& tb = view["scalars"][tag];
    ASSERT_EQ(tb.size(), series.size());
    for (size_t i = 0; i < series.size(); ++i) {
      EXPECT_EQ(tb[i][0].get<int64_t>(), series[i].first);
      const float v = tb[i][1].get<float>();
      if (std::isnan(series[i].second))
        EXPECT_TRUE(std::isnan(v));
      else
        EXPECT_EQ(v, series[i].second) << "step " << series[i].first;
    }
  }
  for (const auto& [tag, series] : view["scalars"].items())  // nothing TensorBoard has extra
    EXPECT_TRUE(metrics.count(tag) == 1 || tag.rfind("plan/", 0) == 0) << tag;
}

TEST(TensorBoard, ScalarsAreTheMetricsAcrossAResume) {
  const std::string every = "--set checkpoint.every_steps=3 --set train.eval_every=2";
  const fs::path run = shardlm::test::train_tiny(1, 2, 1, "shardlm_tb", 6, true, every);
  // A stop after step 6 was logged but before its checkpoint: the resume from step 3 logs steps
  // 4.. again, and TensorBoard must see each once.
  shardlm::test::rewind_run(run, 3, 6);
  shardlm::test::train_tiny(1, 2, 1, "shardlm_tb", 8, false, every);
  const json view = tensorboard_view(run / "tb");
  if (view.is_null()) SHARDLM_MISSING_REFERENCE(shardlm::test::venv_skip_reason("tensorboard"));
  expect_scalars_are_the_metrics(view, run);
  // The plan and the config at the first step of each start: 0, then 3 on the resume.
  for (const char* tag : {"plan/device/params", "plan/device/optimizer", "plan/host/params"}) {
    ASSERT_TRUE(view["scalars"].contains(tag)) << tag;
    ASSERT_EQ(view["scalars"][tag].size(), 2u) << tag;
    EXPECT_EQ(view["scalars"][tag][0][0].get<int64_t>(), 0);
    EXPECT_EQ(view["scalars"][tag][1][0].get<int64_t>(), 3);
  }
  const json summary = json::parse(slurp(run / "summary.json"));
  EXPECT_GT(view["scalars"]["plan/device/params"][0][1].get<double>(), 0);
  ASSERT_TRUE(view["text"].contains("config"));
  ASSERT_EQ(view["text"]["config"].size(), 2u);
  const std::string text = view["text"]["config"][1][1].get<std::string>();
  ASSERT_TRUE(text.starts_with("```json\n"));
  EXPECT_EQ(json::parse(text.substr(8, text.size() - 8 - 4)), summary["config"]);
}

TEST(TensorBoard, DeepSpeedSectionChoosesTheDirectory) {
  const fs::path root = shardlm::test::scratch_root() / "shardlm_tb_ds";
  fs::remove_all(root);
  fs::create_directories(root);
  std::ofstream(root / "ds.json") << json{
      {"tensorboard",
       {{"enabled", true}, {"output_path", (root / "ds_tb").string()}, {"job_name", "job1"}}}};
  const fs::path run = shardlm::test::train_tiny(1, 2, 1, "shardlm_tb_ds_run", 2, true,
                                                 "--deepspeed " + (root / "ds.json").string());
  EXPECT_FALSE(fs::exists(run / "tb"));
  size_t files = 0;
  for (const auto& e : fs::directory_iterator(root / "ds_tb" / "job1"))
    files += e.path().filename().string().starts_with("events.out.tfevents.");
  EXPECT_EQ(files, 1u);
  const std::string out = slurp(run.parent_path() / "out.txt");
  EXPECT_EQ(out.find("tensorboard"), std::string::npos) << "a warning about it: " << out;
  fs::remove_all(root);
}

TEST(TensorBoard, RecordsCarryTheirChecksums) {
  const fs::path dir = shardlm::test::scratch_root() / "shardlm_tb_crc";
  fs::remove_all(dir);
  std::string path;
  {
    shardlm::TensorBoardWriter w(dir.string(), 1);
    w.scalars(1, {{"loss", 2.5}, {"lr", 1e-3}});
    w.text(1, "note", "hello");
    path = w.path();
  }
  const std::vector<std::string> events = shardlm::read_tensorboard_events(path);
  ASSERT_EQ(events.size(), 3u);  // the file version, the scalars, the text
  EXPECT_EQ(shardlm::tensorboard_event_step(events[1]), 1);
  std::string bytes = slurp(path);
  bytes[bytes.size() - 7] ^= 0x20;  // a bit of the last record's payload
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
  try {
    shardlm::read_tensorboard_events(path);
    ADD_FAILURE() << "a flipped bit passed the CRC-32C";
  } catch (const shardlm::Error& e) {
    EXPECT_EQ(e.kind(), shardlm::ErrorKind::kData);
    EXPECT_NE(std::string(e.what()).find("record 2: CRC-32C mismatch"), std::string::npos)
        << e.what();
  }
  fs::remove_all(dir);
}

}  // namespace
