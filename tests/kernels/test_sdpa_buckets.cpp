// The cuDNN attention's problems and buckets (kernels/cuda/host/sdpa_buckets.h, free of CUDA
// headers): every packed-document batch and every window a run meets lands in the finite bucket
// set the plan builds, at the Llama-3.2-1B and 8B head shapes; the set is small and each bucket
// stays within one document per row's docs x max_len; the planned workspace is what the graphs
// ask (no formula caps it); context parallelism's blocks; which GPUs and cuDNN versions take
// packed documents; a model's distinct windows.
#include <gtest/gtest.h>

#include <algorithm>
#include <optional>
#include <vector>

#include "kernels/cuda/host/sdpa_buckets.h"
#include "shardlm/model/config.h"

namespace shardlm::cuda {
namespace {

struct Heads {
  int64_t Hq, Hkv, Dh;
};
constexpr Heads k1B{32, 8, 64}, k8B{32, 8, 128};

bool contains(const std::vector<SdpaShape>& set, const SdpaShape& s) {
  return std::find(set.begin(), set.end(), s) != set.end();
}

int64_t pow2_at_least(int64_t n) {
  int64_t p = 1;
  while (p < n) p <<= 1;
  return p;
}

// Every (document count, longest document, layer window) of B rows of T tokens maps onto a
// bucket of row_buckets, whose docs x max_len stays within pow2(B) x T.
void expect_batches_land_in_buckets(int64_t B, int64_t T, Heads h,
                                    const std::vector<int64_t>& windows) {
  const std::vector<SdpaShape> set = row_buckets(B, T, h.Hq, h.Hkv, h.Dh, windows, true);
  std::vector<int64_t> all_windows = windows;
  all_windows.push_back(0);
  for (int64_t max_len = 1; max_len <= T; max_len += max_len < 130 ? 1 : 37) {
    // The fewest documents a batch with this longest one can hold, and the most.
    for (int64_t count : {int64_t(1), B, (B * T + max_len - 1) / max_len, B * T - max_len + 1}) {
      for (int64_t w : all_windows) {
        const auto r = ragged_groups(B, T, h.Hq, h.Hkv, h.Dh, count, max_len, w);
        ASSERT_TRUE(r.has_value()) << B << "x" << T << " " << count << " docs";
        EXPECT_TRUE(contains(set, r->shape))
            << "B " << B << " T " << T << " count " << count << " max_len " << max_len << " window "
            << w << " -> docs " << r->shape.docs << " len " << r->shape.max_len << " window "
            << r->shape.window << " is not a planned bucket";
        EXPECT_GE(r->shape.max_len, std::min(max_len, T));
        EXPECT_GE(r->groups * r->shape.docs, count);
        EXPECT_LE(r->shape.docs * r->shape.max_len, pow2_at_least(B) * T);
      }
    }
  }
  // The dense row of each window too (one document per row, no spans).
  for (int64_t w : all_windows)
    EXPECT_TRUE(contains(set, *sdpa_shape(B, T, T, h.Hq, h.Hkv, h.Dh, 0, 0, w))) << w;
}

TEST(SdpaBuckets, EveryPackedBatchAtThe1BShapeIsAPlannedBucket) {
  expect_batches_land_in_buckets(2, 2048, k1B, {});
  expect_batches_land_in_buckets(1, 8192, k1B, {});
  expect_batches_land_in_buckets(3, 2048, k1B, {0, 512});
}

TEST(SdpaBuckets, EveryPackedBatchAtThe8BShapeIsAPlannedBucket) {
  expect_batches_land_in_buckets(1, 8192, k8B, {});
  expect_batches_land_in_buckets(2, 4096, k8B, {4096, 1000});
  expect_batches_land_in_buckets(1, 100, k8B, {17});  // shorter than the 64-token bucket
}

// The set is finite and small: one ragged graph per length bucket (64 .. T) and window that
// cuts it, and the dense row of each window.
TEST(SdpaBuckets, TheBucketSetIsOneGraphPerLengthAndWindow) {
  const std::vector<SdpaShape> plain = row_buckets(2, 2048, k1B.Hq, k1B.Hkv, k1B.Dh, {}, true);
  EXPECT_EQ(plain.size(), 1u + 6u);  // the row; 64, 128, 256, 512, 1024, 2048
  const std::vector<int64_t> windows{512};
  const std::vector<SdpaShape> windowed =
      row_buckets(2, 2048, k1B.Hq, k1B.Hkv, k1B.Dh, windows, true);
  EXPECT_EQ(windowed.size(), 2u + 6u + 2u);  // the window cuts the 1024 and 2048 buckets
  for (const SdpaShape& s : windowed)
    EXPECT_TRUE(s.window == 0 || s.window < s.max_len || (s.docs == 0 && s.window < s.Tq));
  EXPECT_EQ(row_buckets(2, 2048, k1B.Hq, k1B.Hkv, k1B.Dh, {}, false).size(), 1u);
  EXPECT_TRUE(row_buckets(2, 2048, k1B.Hq, k1B.Hkv, 60, {}, true).empty());  // Dh % 8 != 0
}

// Context parallelism's blocks: every block cuDNN takes (sdpa_shape) is a planned bucket.
TEST(SdpaBuckets, EveryBlockCudnnTakesIsAPlannedBucket) {
  const int64_t C = 512;
  const std::vector<int64_t> windows{300};
  const std::vector<SdpaShape> set = block_buckets(1, C, C, k8B.Hq, k8B.Hkv, k8B.Dh, windows);
  int taken = 0;
  for (int64_t q_off = 0; q_off < 8 * C; q_off += C)
    for (int64_t k_off = 0; k_off <= q_off; k_off += C)
      for (int64_t w : {int64_t(0), int64_t(300)}) {
        const auto s = sdpa_shape(1, C, C, k8B.Hq, k8B.Hkv, k8B.Dh, q_off, k_off, w);
        if (!s) continue;
        ++taken;
        EXPECT_TRUE(contains(set, *s)) << q_off << " " << k_off << " " << w;
      }
  EXPECT_GT(taken, 8);
  EXPECT_EQ(set.size(), 3u);  // the diagonal with and without the window, the past block
}

// cuDNN's backward workspace for a GQA ragged graph as the frontend 1.32 sizes its own part
// (node/scaled_dot_product_flash_attention.h): the dQ accumulator and, with max_total_seq_len_kv
// set, f32 full-head dK and dV, each B T Hq Dh 4 bytes, and the softmax sums B T Hq 4 bytes.
size_t frontend_bwd_bytes(const SdpaShape& s) {
  const size_t tokens = size_t(s.B * s.Tq), per_token = size_t(s.Hq * s.Dh) * 4;
  return 3 * tokens * per_token + tokens * size_t(s.Hq) * 4;
}

// The plan holds what the graphs ask, however much more than the old formula (two f32 copies
// of dq and 1 MiB): at the 1B shape the frontend's part alone is about 96 MiB.
TEST(SdpaBuckets, ThePlannedWorkspaceIsWhatTheGraphsAsk) {
  const int64_t B = 2, T = 2048;
  const std::vector<SdpaShape> set = row_buckets(B, T, k1B.Hq, k1B.Hkv, k1B.Dh, {}, true);
  const size_t own = size_t(B * T * k1B.Hq) * 4;
  const size_t plan = planned_workspace(
      set, own, [](const SdpaShape& s) { return std::optional<size_t>(frontend_bwd_bytes(s)); });
  const size_t old_formula = size_t(B * k1B.Hq * T) * size_t(2 * k1B.Dh + 4) * 4 + (1u << 20);
  EXPECT_GT(plan, old_formula);
  for (const SdpaShape& s : set) EXPECT_GE(plan, ragged_run_bytes(s) + frontend_bwd_bytes(s));
  EXPECT_EQ(plan, ragged_run_bytes(set.back()) + frontend_bwd_bytes(set.back()));
  // Declined shapes add nothing; with every shape declined, the own kernel's scratch remains.
  EXPECT_EQ(planned_workspace(set, own, [](const SdpaShape&) { return std::nullopt; }), own);
  const size_t dense_only = planned_workspace(set, own, [](const SdpaShape& s) {
    return s.docs == 0 ? std::optional<size_t>(frontend_bwd_bytes(s)) : std::nullopt;
  });
  EXPECT_EQ(dense_only, frontend_bwd_bytes(set.front()));
}

TEST(SdpaBuckets, RaggedRunBytesHoldTheIndexAndTheTokenMajorStats) {
  const auto r = ragged_groups(2, 2048, k1B.Hq, k1B.Hkv, k1B.Dh, 100, 40);
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->shape.max_len, 64);
  EXPECT_EQ(r->shape.docs, 64);
  EXPECT_EQ(r->groups, 2);
  EXPECT_GE(ragged_run_bytes(r->shape), size_t(64 + 3 * 65) * 4 + size_t(2 * 2048 * 32) * 4);
  EXPECT_EQ(ragged_run_bytes(*sdpa_shape(2, 2048, 2048, 32, 8, 64, 0, 0)), 0u);
}

// The frontend 1.32's rules: THD only from SM90 before cuDNN 9.18.1
// (sdpa_support_surface.h), and from 9.18.1 no ragged stats in the backward on SM8x and SM12x
// (CompositeSDPABackwardNode::pre_validate_node).
TEST(SdpaBuckets, WhichGpusTakePackedDocuments) {
  EXPECT_EQ(ragged_unsupported(90, 91400), "");
  EXPECT_EQ(ragged_unsupported(90, 91900), "");
  EXPECT_EQ(ragged_unsupported(100, 91900), "");
  EXPECT_EQ(ragged_unsupported(120, 91400), "");
  EXPECT_EQ(ragged_unsupported(0, 91400), "");
  EXPECT_NE(ragged_unsupported(80, 91400).find("SM90"), std::string::npos);
  EXPECT_NE(ragged_unsupported(86, 91801).find("stats"), std::string::npos);
  EXPECT_NE(ragged_unsupported(89, 91900).find("stats"), std::string::npos);
  EXPECT_NE(ragged_unsupported(120, 91801).find("SM12x"), std::string::npos);
}

TEST(SdpaBuckets, AModelsWindowsAreItsLayersDistinctOnes) {
  ModelConfig cfg;
  cfg.n_layers = 6;
  EXPECT_EQ(cfg.attention_windows(), std::vector<int64_t>{0});
  cfg.sliding_window = 4096;
  cfg.global_layer_every = 3;
  EXPECT_EQ(cfg.attention_windows(), (std::vector<int64_t>{0, 4096}));
  cfg.layer_windows = {512, 0, 128, 512, 128, 0};
  EXPECT_EQ(cfg.attention_windows(), (std::vector<int64_t>{0, 128, 512}));
}

}  // namespace
}  // namespace shardlm::cuda
