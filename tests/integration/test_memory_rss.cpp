// The ledger against something independent: on the CPU backend both memory pools are host
// memory that the backend zero-fills when it allocates it, so every byte the ledger holds is
// resident. Over a grid of one-rank configurations (fp32 and bf16 activations, ZeRO stages,
// offload, checkpointing) the process's resident set at a step, minus the ledger's total, is
// the process's fixed overhead (code, libraries, the allocator, OpenBLAS's and the CPU backend's
// own buffers, the data loader): the same for every configuration within kSlack, where the
// configurations' ledgers differ by hundreds of MiB. A buffer outside the ledger would show as
// a larger overhead in the configuration that allocates it.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "integration/tiny_runs.h"

namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using shardlm::test::metric_series;
using shardlm::test::slurp;

constexpr int64_t kMiB = int64_t(1) << 20;
// Page rounding, allocator bins and the data loader's per-run buffers differ between runs, and
// the runs with bf16 activations measure ~3.7 MiB less overhead than the others (18.7-19.1 against
// 22.3-22.6 MiB on the 2-core development machine, the same before and after the changes of
// 2026-11-27): they run no f32 GEMM, so OpenBLAS's own buffers are likely never touched (not
// isolated). A 4 MiB slack sat at that edge and failed once in CI.
constexpr int64_t kSlack = 6 * kMiB;

struct Measured {
  int64_t ledger = 0;  // device + host peak totals (every buffer is held from setup on)
  int64_t rss = 0;     // the resident set at the last step
};

// A 4-layer model of dim 256 (~4M parameters) with 512-token rows: ledgers of 100-400 MiB.
Measured run(const std::string& name, const std::string& sets) {
  const fs::path dir = shardlm::test::train_tiny(
      1, 4, 1, "shardlm_rss_" + name, 3, true,
      "--set model.dim=256 --set model.n_layers=4 --set model.n_heads=4 --set model.n_kv_heads=2 "
      "--set model.ffn_dim=704 --set data.seq_len=512 --set checkpoint.every_steps=0 " +
          sets);
  const json mem = json::parse(slurp(dir / "memory_rank0.json"));
  Measured m;
  m.ledger = mem["peak_bytes"]["device"].get<int64_t>() + mem["peak_bytes"]["host"].get<int64_t>();
  const std::vector<double> rss = metric_series(dir, "host_rss_bytes");
  EXPECT_FALSE(rss.empty()) << name;
  if (!rss.empty()) m.rss = int64_t(rss.back());
  return m;
}

TEST(MemoryRss, ResidentMemoryIsTheLedgerPlusAFixedOverhead) {
  struct Case {
    const char* name;
    std::string sets;
  };
  const std::vector<Case> cases = {
      {"fp32", ""},
      {"bf16", "--set precision.param=bf16 --set precision.activations=bf16"},
      {"bf16_params_fp32_acts", "--set precision.param=bf16 --set precision.activations=fp32"},
      {"full_offload",
       "--set memory.checkpointing=full --set memory.offload_checkpoints=true "
       "--set precision.param=bf16 --set precision.activations=bf16"},
      {"zero3_offload",
       "--set zero.stage=3 --set zero.offload_optimizer=cpu --set zero.offload_params=cpu"},
      {"selective", "--set memory.checkpointing=selective"},
  };
  std::vector<int64_t> overhead;
  int64_t smallest = INT64_MAX, largest = 0;
  for (const Case& c : cases) {
    const Measured m = run(c.name, c.sets);
    ASSERT_GT(m.rss, 0) << c.name;
    overhead.push_back(m.rss - m.ledger);
    smallest = std::min(smallest, m.ledger);
    largest = std::max(largest, m.ledger);
    RecordProperty(c.name, std::to_string(m.ledger) + " ledger, " + std::to_string(m.rss) + " rss");
  }
  // The grid spans ledgers far apart, so a fixed overhead is a real statement.
  EXPECT_GT(largest - smallest, 8 * kSlack);
  const auto [lo, hi] = std::minmax_element(overhead.begin(), overhead.end());
  EXPECT_LE(*hi - *lo, kSlack) << "resident minus ledger ranges over [" << *lo / kMiB << ", "
                               << *hi / kMiB << "] MiB";
  EXPECT_GT(*lo, 0);           // the ledger never claims more than is resident
  EXPECT_LT(*hi, 256 * kMiB);  // and the overhead is a process's, not a model's
}

}  // namespace
