// Context parallelism under mpiexec (1, 2, 4 ranks): for each kind (ulysses, ring, hybrid) and
// cp degree that divides the world (the rest of the world is data parallel), a model whose
// attention is the ContextParallel core, fed its shard of packed rows, must give the loss and
// (summed over all ranks) the gradients of one model on the whole global batch, within fp32
// tolerance. Also: the ring's causal work is balanced across ranks, and the layout's
// communication volume is what the core sends.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <vector>

#include "parallel/mpi_test_env.h"
#include "shardlm/backend/forwarding.h"
#include "shardlm/backend/queued.h"
#include "shardlm/comm/local.h"
#include "shardlm/model/llama.h"
#include "shardlm/parallel/context.h"
#include "shardlm/parallel/topology.h"
#include "tolerance.h"

namespace shardlm {
namespace {

using test::world;

constexpr int64_t kB = 2;  // rows per data-parallel replica
constexpr int64_t kVocab = 48;

// qwen3: q/k norms before RoPE, and heads of 12 (q is 48 wide, the model 32); gemma3: those
// with Gemma's post-norms, GeGLU, (1 + w) norms, scaled embeddings and queries, a local layer.
ModelConfig tiny(int64_t kv_heads, bool qwen3 = false, bool gemma3 = false) {
  ModelConfig c = model_preset("tiny");
  c.dim = 32;
  c.n_layers = 2;
  c.n_heads = 4;
  c.n_kv_heads = kv_heads;
  c.ffn_dim = 40;
  c.vocab_size = kVocab;
  c.tie_embeddings = false;
  c.qk_norm = qwen3 || gemma3;
  c.explicit_head_dim = qwen3 || gemma3 ? 12 : 0;
  if (gemma3) {
    c.post_norms = c.norm_one_plus_weight = c.embed_scale = true;
    c.mlp_activation = "gelu_tanh";
    c.query_pre_attn_scalar = 20;
    c.global_layer_every = 2;
  }
  return c;
}

// Global row r of T tokens: packed documents (starts depend on r, some inside a cp piece, some
// on a piece boundary), positions restarting per document, next-token targets within it.
struct Rows {
  std::vector<int32_t> tokens, targets, positions, seg;
};
Rows make_rows(int64_t rows, int64_t T, bool one_document) {
  Rows x;
  for (int64_t r = 0; r < rows; ++r) {
    std::vector<int64_t> starts = {0};
    if (!one_document) {
      for (int64_t s = 3 + 5 * r; s < T; s += T / 3 + 1 + r) starts.push_back(s);
      starts.push_back(T / 2);  // a piece boundary
      std::sort(starts.begin(), starts.end());
      starts.erase(std::unique(starts.begin(), starts.end()), starts.end());
    }
    uint64_t h = uint64_t(r * 977 + 13);
    int64_t doc = 0;
    for (int64_t t = 0; t < T; ++t) {
      while (doc + 1 < int64_t(starts.size()) && starts[doc + 1] <= t) ++doc;
      h = h * 6364136223846793005ull + 1442695040888963407ull;
      x.tokens.push_back(int32_t((h >> 33) % kVocab));
      x.positions.push_back(int32_t(t - starts[doc]));
      x.seg.push_back(int32_t(starts[doc]));
    }
    for (int64_t t = 0; t < T; ++t) {
      const bool last = t + 1 == T || x.seg[r * T + t + 1] != x.seg[r * T + t];
      x.targets.push_back(last ? kIgnoreIndex : x.tokens[r * T + t + 1]);
    }
  }
  return x;
}

void put(const std::vector<int32_t>& src, int64_t first, const Tensor& dst) {
  std::copy_n(src.begin() + first, dst.numel(), dst.i32());
}

struct Result {
  double loss_sum = 0;
  std::vector<float> grads;
  int64_t calls_with_docs = 0, calls_without_docs = 0;  // the core's attention kernel calls
  int64_t calls_with_spans = 0;  // of those with document starts, the ones also given spans
};

// The CPU backend, counting the attention calls that get document starts (and spans: cuDNN's
// ragged form; the CPU checks them against the starts) and those that get none (cuDNN's dense
// form).
class DocumentProbe final : public ForwardingBackend {
 public:
  DocumentProbe() : ForwardingBackend(make_backend(DeviceKind::kCpu)) {}
  std::string name() const override { return "cpu+probe"; }
  int64_t with_docs = 0, without_docs = 0, with_spans = 0;

 private:
  void run(OpFamily, HostWaits, std::function<void()> op) override { op(); }
  void count(const Tensor& seg, const DocumentSpans& docs = {}) {
    ++(seg.empty() ? without_docs : with_docs);
    with_spans += docs.count > 0;
  }
  void do_attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& seg,
                            const Tensor& out, const Tensor& lse, Workspace ws,
                            const DocumentSpans& docs, int64_t window, float softcap) override {
    count(seg, docs);
    inner().attention_forward(q, k, v, seg, out, lse, ws, docs, window, softcap);
  }
  void do_attention_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& seg,
                             const Tensor& out, const Tensor& lse, const Tensor& dout,
                             const Tensor& dq, const Tensor& dk, const Tensor& dv, Workspace ws,
                             const DocumentSpans& docs, int64_t window, float softcap) override {
    count(seg, docs);
    inner().attention_backward(q, k, v, seg, out, lse, dout, dq, dk, dv, ws, docs, window, softcap);
  }
  void do_attention_block_forward(const Tensor& q, const Tensor& k, const Tensor& v,
                                  const Tensor& seg, int64_t q_off, int64_t k_off,
                                  const Tensor& out, const Tensor& lse, Workspace ws,
                                  int64_t window, float softcap) override {
    count(seg);
    inner().attention_block_forward(q, k, v, seg, q_off, k_off, out, lse, ws, window, softcap);
  }
  void do_attention_block_backward(const Tensor& q, const Tensor& k, const Tensor& v,
                                   const Tensor& seg, int64_t q_off, int64_t k_off,
                                   const Tensor& out, const Tensor& lse, const Tensor& dout,
                                   const Tensor& dq, const Tensor& dk, const Tensor& dv,
                                   Workspace ws, int64_t window, float softcap) override {
    count(seg);
    inner().attention_block_backward(q, k, v, seg, q_off, k_off, out, lse, dout, dq, dk, dv, ws,
                                     window, softcap);
  }
};

// One model over all `rows` rows, no parallelism.
Result reference(const ModelConfig& cfg, const Rows& x, int64_t rows, int64_t T) {
  auto be = make_backend(DeviceKind::kCpu);
  MemoryLedger ledger;
  ModelOptions opt;
  opt.max_batch = rows;
  opt.max_seq = T;
  LlamaModel model(cfg, opt, *be, ledger);
  model.init_weights(7);
  BatchInputs in = model.inputs(rows, T);
  put(x.tokens, 0, in.tokens);
  put(x.targets, 0, in.targets);
  put(x.positions, 0, in.positions);
  put(x.seg, 0, in.seg_start);
  int64_t valid = 0;
  for (int32_t t : x.targets) valid += t != kIgnoreIndex;
  model.zero_grads();
  Result r;
  r.loss_sum = model.forward_backward(rows, T, 1.f / float(valid)).loss_sum;
  const Tensor g = model.grads();
  r.grads.assign(g.f32(), g.f32() + g.numel());
  return r;
}

struct Case {
  CpKind kind;
  int cp;
  int64_t ulysses = 0;
  int64_t kv_heads = 2;
  int64_t T = 64;
  Checkpointing checkpointing = Checkpointing::kNone;  // recompute calls the core again
  CheckpointPlacement placement{};                     // host layers and checkpoint_every
  int64_t mlp_chunk_tokens = 1024;
  bool qwen3 = false;   // tiny(kv_heads, qwen3)
  bool gemma3 = false;  // tiny(kv_heads, false, gemma3)
  bool glm4 = false;    // GLM-4-0414's layers: half of each head rotated in interleaved pairs,
                        // q/k/v biases, post-norms
  bool keep = false;    // the core keeps the forward's gathered q, k, v (cp_keep_gathered)
  std::vector<int64_t> windows{};  // per-layer sliding windows (ModelConfig::layer_windows)
  double attn_softcap = 0;         // Gemma 2's cap on the attention scores (0: none)
  bool one_document = false;       // every row one document: the kernels get no document starts
};

// The sharded run: returns this rank's loss and gradients summed over every rank.
Result sharded(const Case& c, const ModelConfig& cfg, const Rows& x, CpStats* stats = nullptr) {
  Communicator& w = world();
  ParallelDims dims;
  dims.cp = c.cp;
  const Topology topo(dims, w.size(), w.rank());
  auto cp_comm = w.split(int(topo.color(Axis::kCp)), int(topo.key(Axis::kCp)), "cp");
  const ContextLayout L = make_context_layout(cfg, c.T, c.cp, c.kind, c.ulysses);
  auto be = std::make_unique<DocumentProbe>();
  MemoryLedger ledger;
  const int kept = cp_kept_sets(L, c.keep, c.checkpointing == Checkpointing::kFull, cfg.n_layers);
  const ContextGroups groups(*cp_comm, L.U);
  ContextParallel core(cfg, L, kB, groups, *be, ledger, DType::kF32, 1, kept);
  ModelOptions opt;
  opt.max_batch = kB;
  opt.max_seq = L.local();
  opt.checkpointing = c.checkpointing;
  opt.checkpoint_placement = c.placement;
  opt.mlp_chunk_tokens = c.mlp_chunk_tokens;
  LlamaModel model(cfg, opt, *be, ledger, {.attention = &core});
  model.init_weights(7);
  const int64_t d = topo.coord(Axis::kDp);
  BatchInputs full = core.full_inputs(kB);
  put(x.tokens, d * kB * c.T, full.tokens);
  put(x.targets, d * kB * c.T, full.targets);
  put(x.positions, d * kB * c.T, full.positions);
  put(x.seg, d * kB * c.T, full.seg_start);
  // The rank's share cut on the host, then sent up (the trainer's InputStaging does it async).
  std::vector<int32_t> rows(size_t(4 * kB * L.local()));
  auto host_row = [&](int i) {
    return Tensor(rows.data() + i * kB * L.local(), DType::kI32, {kB * L.local()}, MemPool::kHost);
  };
  const BatchInputs local_host{host_row(0), host_row(1), host_row(2), host_row(3), Tensor()};
  const BatchInputs local = model.inputs(kB, L.local());
  core.shard(full, local_host, local, kB);
  be->copy(local_host.tokens, local.tokens);
  be->copy(local_host.targets, local.targets);
  be->copy(local_host.positions, local.positions);
  be->copy(local_host.seg_start, local.seg_start);
  int64_t valid = 0;
  for (int32_t t : x.targets) valid += t != kIgnoreIndex;
  model.zero_grads();
  Result r;
  float loss = float(model.forward_backward(kB, L.local(), 1.f / float(valid)).loss_sum);
  w.all_reduce(Tensor(&loss, DType::kF32, {1}, MemPool::kHost));
  r.loss_sum = loss;
  w.all_reduce(model.grads());
  const Tensor g = model.grads();
  r.grads.assign(g.f32(), g.f32() + g.numel());
  if (stats != nullptr) *stats = core.stats();
  r.calls_with_docs = be->with_docs;
  r.calls_without_docs = be->without_docs;
  r.calls_with_spans = be->with_spans;
  return r;
}

void expect_matches(const Case& c) {
  Communicator& w = world();
  if (w.size() % c.cp != 0) GTEST_SKIP() << "cp = " << c.cp << " does not divide " << w.size();
  ModelConfig cfg = tiny(c.kv_heads, c.qwen3, c.gemma3);
  if (c.glm4) {
    cfg.rope_partial_factor = 0.5;
    cfg.rope_interleaved = cfg.post_norms = cfg.attn_bias = true;
    cfg.post_norm_names = "glm4";
  }
  if (!c.windows.empty()) cfg.layer_windows = c.windows;
  cfg.attn_softcap = c.attn_softcap;
  const int64_t rows = kB * (w.size() / c.cp);
  const Rows x = make_rows(rows, c.T, c.one_document);
  const Result ref = reference(cfg, x, rows, c.T);
  const Result got = sharded(c, cfg, x);
  if (c.cp > 1) {  // cp = 1 on one rank: the model's own attention, not the core
    EXPECT_GT(got.calls_with_docs + got.calls_without_docs, 0);
    EXPECT_EQ(c.one_document ? got.calls_with_docs : got.calls_without_docs, 0)
        << got.calls_with_docs << " calls with document starts, " << got.calls_without_docs
        << " without";
    // Ulysses alone gathers whole rows: their packed documents go as spans too.
    const bool whole_rows = make_context_layout(cfg, c.T, c.cp, c.kind, c.ulysses).R() == 1;
    EXPECT_EQ(got.calls_with_spans, whole_rows ? got.calls_with_docs : 0);
  }
  // The ranks' key blocks, softmax statistics and gradients summed in another order.
  const double tol = test::reorder_tolerance(test::reduction_chain(cfg, c.T, rows));
  EXPECT_NEAR(got.loss_sum, ref.loss_sum, tol * std::abs(ref.loss_sum));
  float scale = 0;
  for (float g : ref.grads) scale = std::max(scale, std::abs(g));
  ASSERT_EQ(got.grads.size(), ref.grads.size());
  int bad = 0;
  for (size_t i = 0; i < ref.grads.size() && bad < 5; ++i) {
    if (std::abs(got.grads[i] - ref.grads[i]) > tol * scale) {
      ++bad;
      ADD_FAILURE() << "gradient " << i << ": " << got.grads[i] << " vs " << ref.grads[i]
                    << " (max |g| " << scale << ")";
    }
  }
}

TEST(ContextParallel, UlyssesMatchesOneRank) {
  for (int cp : {2, 4}) expect_matches({CpKind::kUlysses, cp});
}

TEST(ContextParallel, UlyssesReplicatesKvHeadsWhenFewerThanRanks) {
  for (int cp : {2, 4}) expect_matches({CpKind::kUlysses, cp, 0, 1});
}

TEST(ContextParallel, RingMatchesOneRank) {
  for (int cp : {2, 4}) expect_matches({CpKind::kRing, cp});
}

// Chunks longer than the kernel's 64-token tiles and not a multiple of them (T = 520 over 4
// ranks: chunks of 65).
TEST(ContextParallel, LongChunksSpanSeveralTiles) {
  for (CpKind kind : {CpKind::kRing, CpKind::kUlysses}) {
    SCOPED_TRACE(cp_kind_name(kind));
    expect_matches({kind, 2, 0, 2, 520});
    expect_matches({kind, 4, 0, 2, 520});
  }
}

TEST(ContextParallel, RingWithGroupedQueryAttention) {
  for (int cp : {2, 4}) expect_matches({CpKind::kRing, cp, 0, 1});
}

TEST(ContextParallel, HybridMatchesOneRank) {
  expect_matches({CpKind::kHybrid, 4, 2});
  expect_matches({CpKind::kHybrid, 4, 2, 1});  // kv heads replicated inside the groups
  expect_matches({CpKind::kHybrid, 2, 2});     // degenerate: one Ulysses group
}

// Rows of one document each: the core gives the kernels no document starts (the causal mask
// says the same), the form cuDNN's fused attention takes, with and without sliding windows.
TEST(ContextParallel, OneDocumentRowsReachTheKernelsWithoutDocumentStarts) {
  for (CpKind kind : {CpKind::kUlysses, CpKind::kRing}) {
    SCOPED_TRACE(cp_kind_name(kind));
    for (int cp : {2, 4}) {
      Case c{kind, cp};
      c.one_document = true;
      expect_matches(c);
      c.windows = {24, 0};
      expect_matches(c);
    }
  }
  Case hybrid{CpKind::kHybrid, 4, 2};
  hybrid.one_document = true;
  expect_matches(hybrid);
}

// Activation checkpointing recomputes attention in backward, communication and all: every kind
// under selective and full (+ host offload) recompute, and with only layer 0's input kept
// (layer 1's recomputed from it, one more forward with its exchanges), with the MLP in several
// chunks.
TEST(ContextParallel, UnderActivationCheckpointing) {
  Communicator& w = world();
  const int cp = w.size() >= 4 ? 4 : w.size();
  for (CpKind kind : {CpKind::kUlysses, CpKind::kRing, CpKind::kHybrid}) {
    if (kind == CpKind::kHybrid && cp < 4) continue;
    const int64_t ulysses = kind == CpKind::kHybrid ? 2 : 0;
    SCOPED_TRACE(cp_kind_name(kind));
    const int all = CheckpointPlacement::kAll;
    expect_matches({kind, cp, ulysses, 2, 64, Checkpointing::kSelective, {}, 24});
    expect_matches({kind, cp, ulysses, 2, 64, Checkpointing::kFull, {1, all}, 24});
    expect_matches({kind, cp, ulysses, 2, 64, Checkpointing::kFull, {2, all}, 24});
  }
}

// Qwen3's layers (q/k norms on each rank's tokens before the exchange, heads wider than dim /
// heads) under every kind, and under full recompute.
TEST(ContextParallel, QkNormsAndWideHeadsMatchOneRank) {
  const int cp = world().size() >= 4 ? 4 : 2;
  for (CpKind kind : {CpKind::kUlysses, CpKind::kRing, CpKind::kHybrid}) {
    if (kind == CpKind::kHybrid && cp < 4) continue;
    SCOPED_TRACE(cp_kind_name(kind));
    const int64_t ulysses = kind == CpKind::kHybrid ? 2 : 0;
    expect_matches({.kind = kind, .cp = cp, .ulysses = ulysses, .qwen3 = true});
    expect_matches({.kind = kind,
                    .cp = cp,
                    .ulysses = ulysses,
                    .checkpointing = Checkpointing::kFull,
                    .mlp_chunk_tokens = 24,
                    .qwen3 = true});
  }
}

// Sliding windows on packed documents under every kind: layer 0 windowed, layer 1 full or with
// a window longer than any document; windows shorter than a cp piece (most ring blocks wholly
// outside, skipped), about a piece long, and crossing several pieces; long rows whose chunks
// span several kernel tiles; full recompute calls the core again with each layer's window.
TEST(ContextParallel, SlidingWindowsMatchOneRank) {
  const int cp = world().size();
  for (CpKind kind : {CpKind::kUlysses, CpKind::kRing, CpKind::kHybrid}) {
    if (kind == CpKind::kHybrid && cp < 4) continue;
    SCOPED_TRACE(cp_kind_name(kind));
    const int64_t ulysses = kind == CpKind::kHybrid ? 2 : 0;
    for (const std::vector<int64_t>& windows :
         {std::vector<int64_t>{3, 0}, std::vector<int64_t>{9, 70}, std::vector<int64_t>{20, 33}}) {
      SCOPED_TRACE("windows " + std::to_string(windows[0]) + ", " + std::to_string(windows[1]));
      expect_matches({.kind = kind, .cp = cp, .ulysses = ulysses, .windows = windows});
    }
    expect_matches({.kind = kind, .cp = cp, .ulysses = ulysses, .T = 520, .windows = {40, 150}});
    expect_matches({.kind = kind,
                    .cp = cp,
                    .ulysses = ulysses,
                    .checkpointing = Checkpointing::kFull,
                    .windows = {5, 0}});
  }
}

// A ring under a sliding window counts only the pairs inside it: summed over the ranks, the
// windowed causal pairs of the rows, per layer.
TEST(ContextParallel, RingCountsOnlyWindowedPairs) {
  Communicator& w = world();
  if (w.size() < 2) GTEST_SKIP() << "needs 2 ranks";
  const Case c{.kind = CpKind::kRing, .cp = w.size(), .T = 256, .windows = {10, 100}};
  ModelConfig cfg = tiny(2);
  cfg.layer_windows = c.windows;
  const Rows x = make_rows(kB, c.T, true);
  CpStats stats;
  sharded(c, cfg, x, &stats);
  float mine = float(stats.attention_flops), sum = 0;
  w.all_reduce(Tensor(&mine, DType::kF32, {1}, MemPool::kHost));
  sum = mine;
  double pairs = 0;  // min(t + 1, W) keys per query t, summed over the layers
  for (int64_t W : c.windows)
    for (int64_t t = 0; t < c.T; ++t) pairs += double(std::min(t + 1, W));
  EXPECT_NEAR(sum, 4.0 * pairs * cfg.n_heads * cfg.head_dim() * kB, 1e-3 * sum);
}

// Gemma 3's layers: q scaled for query_pre_attn_scalar before the exchange, so every kind's
// core computes Gemma's scale; and under full recompute.
TEST(ContextParallel, GemmaLayersMatchOneRank) {
  const int cp = world().size() >= 4 ? 4 : 2;
  for (CpKind kind : {CpKind::kUlysses, CpKind::kRing, CpKind::kHybrid}) {
    if (kind == CpKind::kHybrid && cp < 4) continue;
    SCOPED_TRACE(cp_kind_name(kind));
    const int64_t ulysses = kind == CpKind::kHybrid ? 2 : 0;
    expect_matches({.kind = kind, .cp = cp, .ulysses = ulysses, .gemma3 = true});
    expect_matches({.kind = kind,
                    .cp = cp,
                    .ulysses = ulysses,
                    .checkpointing = Checkpointing::kFull,
                    .mlp_chunk_tokens = 24,
                    .gemma3 = true});
  }
}

// GLM-4-0414's layers: each rank rotates its tokens' q and k by their own positions (GLM's
// interleaved pairs over half of each head) before the exchange, under every kind and under
// full recompute.
TEST(ContextParallel, GlmLayersMatchOneRank) {
  const int cp = world().size() >= 4 ? 4 : 2;
  for (CpKind kind : {CpKind::kUlysses, CpKind::kRing, CpKind::kHybrid}) {
    if (kind == CpKind::kHybrid && cp < 4) continue;
    SCOPED_TRACE(cp_kind_name(kind));
    const int64_t ulysses = kind == CpKind::kHybrid ? 2 : 0;
    expect_matches({.kind = kind, .cp = cp, .ulysses = ulysses, .glm4 = true});
    expect_matches({.kind = kind,
                    .cp = cp,
                    .ulysses = ulysses,
                    .checkpointing = Checkpointing::kFull,
                    .mlp_chunk_tokens = 24,
                    .glm4 = true});
  }
}

// Gemma 2's attention soft cap acts per score, so every kind's blocks and merges carry it
// unchanged: a cap below the scores' range with a sliding window on layer 0, and on Gemma's
// layers under full recompute.
TEST(ContextParallel, SoftcappedAttentionMatchesOneRank) {
  const int cp = world().size() >= 4 ? 4 : 2;
  for (CpKind kind : {CpKind::kUlysses, CpKind::kRing, CpKind::kHybrid}) {
    if (kind == CpKind::kHybrid && cp < 4) continue;
    SCOPED_TRACE(cp_kind_name(kind));
    const int64_t ulysses = kind == CpKind::kHybrid ? 2 : 0;
    expect_matches(
        {.kind = kind, .cp = cp, .ulysses = ulysses, .windows = {9, 0}, .attn_softcap = 0.3});
    expect_matches({.kind = kind,
                    .cp = cp,
                    .ulysses = ulysses,
                    .checkpointing = Checkpointing::kFull,
                    .gemma3 = true,
                    .attn_softcap = 0.3});
  }
}

TEST(ContextParallel, OneRankIsTheLocalKernel) {
  for (CpKind k : {CpKind::kUlysses, CpKind::kRing}) expect_matches({k, 1});
}

// Zig-zag chunks: under causal masking every ring position computes the same number of
// visible (query, key) pairs, so the counted forward FLOPs agree within 5% (exactly, here).
TEST(ContextParallel, RingBalancesCausalWork) {
  Communicator& w = world();
  if (w.size() < 2) GTEST_SKIP() << "needs 2 ranks";
  const Case c{CpKind::kRing, w.size(), 0, 2, 256};
  const ModelConfig cfg = tiny(2);
  const Rows x = make_rows(kB, c.T, true);
  CpStats stats;
  sharded(c, cfg, x, &stats);
  std::vector<float> all(w.size());
  float mine = float(stats.attention_flops);
  w.all_gather(Tensor(&mine, DType::kF32, {1}, MemPool::kHost),
               Tensor(all.data(), DType::kF32, {w.size()}, MemPool::kHost));
  const auto [lo, hi] = std::minmax_element(all.begin(), all.end());
  EXPECT_GT(*lo, 0.f);
  EXPECT_LE(*hi, 1.05f * *lo) << "per-rank attention FLOPs " << *lo << " .. " << *hi;
  // The whole causal attention, counted once over the ranks (2 layers, B rows, Hq heads).
  const double pairs = double(c.T) * double(c.T + 1) / 2;
  double sum = 0;
  for (float f : all) sum += f;
  EXPECT_NEAR(sum, 4.0 * pairs * cfg.n_heads * cfg.head_dim() * kB * cfg.n_layers, 1e-3 * sum);
}

// What the core sends in one forward and backward is the layout's analytic volume (recompute
// included).
TEST(ContextParallel, SendsTheAnalyticVolume) {
  Communicator& w = world();
  if (w.size() < 2) GTEST_SKIP() << "needs 2 ranks";
  const ModelConfig cfg = tiny(2);
  std::vector<Case> cases = {{CpKind::kUlysses, w.size()}, {CpKind::kRing, w.size()}};
  if (w.size() == 4) cases.push_back({CpKind::kHybrid, 4, 2});
  for (const Case& c : cases) {
    const Rows x = make_rows(kB, c.T, false);
    CpStats stats;
    sharded(c, cfg, x, &stats);
    const ContextLayout L = make_context_layout(cfg, c.T, c.cp, c.kind, c.ulysses);
    const CpCommVolume v = cp_comm_volume(cfg, L, kB, DType::kF32);
    EXPECT_EQ(stats.bytes_sent, (v.forward + v.backward) * cfg.n_layers) << cp_kind_name(c.kind);
    // Full checkpointing runs every layer's forward twice: its traffic and FLOPs count twice.
    Case full = c;
    full.checkpointing = Checkpointing::kFull;
    CpStats recomputed;
    sharded(full, cfg, x, &recomputed);
    EXPECT_EQ(recomputed.bytes_sent, (2 * v.forward + v.backward) * cfg.n_layers);
    EXPECT_DOUBLE_EQ(recomputed.attention_flops, 2 * stats.attention_flops);
  }
}

// Ulysses and hybrid keeping each layer's gathered q, k, v for the backward: the same loss and
// gradients as the one-rank run without checkpointing, under selective and full recompute
// (one kept set) and with layer 1 recomputed from layer 0's input (other layers' forwards run
// between a layer's forward and its backward); the backward's q, k, v all-to-alls are gone
// from the traffic.
TEST(ContextParallel, KeptGatheredQkvMatchOneRankAndSaveTheirExchanges) {
  Communicator& w = world();
  if (w.size() < 2) GTEST_SKIP() << "needs 2 ranks";
  const ModelConfig cfg = tiny(2);
  const int all = CheckpointPlacement::kAll;
  for (CpKind kind : {CpKind::kUlysses, CpKind::kHybrid}) {
    if (kind == CpKind::kHybrid && w.size() < 4) continue;
    SCOPED_TRACE(cp_kind_name(kind));
    const int64_t ulysses = kind == CpKind::kHybrid ? 2 : 0;
    Case c{kind, w.size(), ulysses};
    c.keep = true;
    expect_matches(c);
    for (const auto& [mode, placement] :
         {std::pair{Checkpointing::kSelective, CheckpointPlacement{}},
          std::pair{Checkpointing::kFull, CheckpointPlacement{}},
          std::pair{Checkpointing::kFull, CheckpointPlacement{2, all}}}) {
      Case r = c;
      r.checkpointing = mode;
      r.placement = placement;
      r.mlp_chunk_tokens = 24;
      expect_matches(r);
    }
    const Rows x = make_rows(kB, c.T, false);
    const ContextLayout L = make_context_layout(cfg, c.T, c.cp, c.kind, c.ulysses);
    const CpCommVolume v = cp_comm_volume(cfg, L, kB, DType::kF32);
    const CpCommVolume kept = cp_comm_volume(cfg, L, kB, DType::kF32, true);
    EXPECT_LT(kept.backward, v.backward);
    EXPECT_EQ(kept.forward, v.forward);
    CpStats stats;
    sharded(c, cfg, x, &stats);
    EXPECT_EQ(stats.bytes_sent, (kept.forward + kept.backward) * cfg.n_layers);
    Case full = c;  // every layer's forward recomputed right before its backward: one set
    full.checkpointing = Checkpointing::kFull;
    sharded(full, cfg, x, &stats);
    EXPECT_EQ(stats.bytes_sent, (2 * kept.forward + kept.backward) * cfg.n_layers);
  }
}

// Ulysses' document starts go up with copy_async from host halves used in turn: on a device one
// micro-batch behind (the queued backend runs no copy until something waits for it), sharding
// the next micro-batch into the same slot must not wait for the host; only the third, which
// writes the halves the first one's copies read, may. The halves are in the ledger with the
// bytes cp_buffers plans.
TEST(ContextParallel, UlyssesShardsAheadOfADeviceOneMicroBatchBehind) {
  Communicator& w = world();
  if (w.size() < 2) GTEST_SKIP() << "needs 2 ranks";
  const ModelConfig cfg = tiny(2);
  constexpr int64_t T = 64;
  constexpr int kMicroBatches = 3;
  const ContextLayout L = make_context_layout(cfg, T, w.size(), CpKind::kUlysses, 0);
  QueuedBackend be(make_backend(DeviceKind::kCpu));
  MemoryLedger ledger;
  const ContextGroups groups(w, L.U);
  ContextParallel core(cfg, L, kB, groups, be, ledger);
  int64_t planned_host = 0;
  for (const CpBuffer& b :
       cp_buffers(cfg, L, kB, ContextParallel::kernel_workspace_bytes(be, cfg, L, kB), DType::kF32))
    if (b.pool == MemPool::kHost) planned_host += b.bytes;
  EXPECT_EQ(ledger.current(MemPool::kHost, MemCategory::kActivations), planned_host);

  const Rows x = make_rows(kMicroBatches * kB, T, false);  // packed documents in every row
  const int64_t n = kB * L.local();
  std::vector<int32_t> host_rows(size_t(4 * n));
  auto host_row = [&](int i) {
    return Tensor(host_rows.data() + i * n, DType::kI32, {n}, MemPool::kHost);
  };
  const BatchInputs local_host{host_row(0), host_row(1), host_row(2), host_row(3), Tensor()};
  const Buffer dev(be, ledger, MemCategory::kActivations, MemPool::kDevice, size_t(4 * n * 4));
  auto dev_row = [&](int i) { return dev.view(DType::kI32, {n}, size_t(i * n * 4)); };
  const BatchInputs local{dev_row(0), dev_row(1), dev_row(2), dev_row(3), Tensor()};
  const BatchInputs full = core.full_inputs(kB);
  for (int m = 0; m < kMicroBatches; ++m) {
    put(x.tokens, m * kB * T, full.tokens);
    put(x.targets, m * kB * T, full.targets);
    put(x.positions, m * kB * T, full.positions);
    put(x.seg, m * kB * T, full.seg_start);
    // The device is behind: every copy of the earlier micro-batches is still queued.
    if (m > 0) {
      EXPECT_GT(be.queued(), 0) << "micro-batch " << m;
    }
    const int64_t before = be.host_waits();
    core.shard(full, local_host, local, kB);
    const int64_t waits = be.host_waits() - before;
    // From the third on it writes the halves of two micro-batches back: the copies out of
    // them (starts, spans) run first.
    EXPECT_EQ(waits, m < 2 ? 0 : 2) << "micro-batch " << m << ", the device " << m << " behind";
  }
}

}  // namespace
}  // namespace shardlm
