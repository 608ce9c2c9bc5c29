// ParallelGrid under mpiexec at 1, 2 and 4 ranks: each group holds exactly the ranks the
// Topology names for it, in its order; ZeRO's group is dp x cp ordered by world rank; the tied
// group pairs the end stages; the context core's Ulysses and ring groups are the grid's too, and
// its transport total counts every group it made; the f64/i64 reductions and the step totals'
// counting rules; and GradientAxes' sums and norm parts over slices cut anywhere in the arena (the
// model's, and LoRA's adapters split with their base projections under tp).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <map>
#include <span>
#include <utility>
#include <vector>

#include "parallel/mpi_test_env.h"
#include "shardlm/model/tensor_shard.h"
#include "shardlm/parallel/grad_axes.h"
#include "shardlm/parallel/grid.h"

namespace shardlm {
namespace {

using test::world;

// The world ranks of `group`, gathered from its members in group order.
std::vector<int64_t> members(Communicator& group) {
  int64_t mine = world().rank();
  std::vector<int64_t> all(size_t(group.size()));
  group.all_gather(Tensor(&mine, DType::kI64, {1}, MemPool::kHost),
                   Tensor(all.data(), DType::kI64, {group.size()}, MemPool::kHost));
  return all;
}

// Every grid shape the world size allows, with and without tied embeddings.
std::vector<ParallelDims> shapes() {
  const int64_t n = world().size();
  std::vector<ParallelDims> out = {{-1, 1, 1, 1}};
  if (n % 2 == 0) out.insert(out.end(), {{-1, 1, 1, 2}, {-1, 2, 1, 1}, {-1, 1, 2, 1}});
  if (n % 4 == 0) out.insert(out.end(), {{1, 2, 1, 2}, {1, 1, 2, 2}, {1, 2, 2, 1}, {1, 4, 1, 1}});
  return out;
}

TEST(ParallelGrid, GroupsHoldTheTopologysRanksInOrder) {
  for (const ParallelDims& dims : shapes()) {
    for (const bool tied : {false, true}) {
      const Topology topo(dims, world().size(), world().rank());
      const ParallelGrid grid(topo, world(), {.tied_embeddings = tied});
      SCOPED_TRACE(testing::Message() << "pp " << dims.pp << " cp " << dims.cp << " tp " << dims.tp
                                      << (tied ? " tied" : ""));
      for (const Axis axis : {Axis::kCp, Axis::kTp, Axis::kPp}) {
        ASSERT_EQ(grid.has(axis), topo.size(axis) > 1) << axis_name(axis);
        if (!grid.has(axis)) continue;
        EXPECT_EQ(grid.group(axis).rank(), topo.coord(axis));
        EXPECT_EQ(members(grid.group(axis)), topo.group_ranks(axis)) << axis_name(axis);
      }
      EXPECT_THROW(grid.group(Axis::kDp), Error);
      // ZeRO: the ranks with this rank's pp and tp coordinates, by world rank.
      std::vector<int64_t> zero;
      for (int64_t r = 0; r < world().size(); ++r) {
        const RankCoords c = topo.coords_of(r);
        if (c.pp == topo.coords().pp && c.tp == topo.coords().tp) zero.push_back(r);
      }
      EXPECT_EQ(members(grid.zero()), zero);
      if (topo.size(Axis::kTp) == 1 && topo.size(Axis::kPp) == 1) {
        EXPECT_EQ(&grid.zero(), &world());
      }
      // Tied: under pp > 1 the first and last stages' ranks at one place; a middle stage alone.
      ASSERT_EQ(grid.tied() != nullptr, tied && dims.pp > 1);
      if (grid.tied() == nullptr) continue;
      const int64_t stage = topo.coords().pp, last = dims.pp - 1;
      std::vector<int64_t> want = {world().rank()};
      if (stage == 0 || stage == last) {
        RankCoords other = topo.coords();
        other.pp = stage == 0 ? last : 0;
        const int64_t peer = topo.rank_of(other);
        want = stage == 0 ? std::vector<int64_t>{world().rank(), peer}
                          : std::vector<int64_t>{peer, world().rank()};
      }
      EXPECT_EQ(members(*grid.tied()), want);
    }
  }
}

// What a TransportProbe saw: each communicator's own figure, in creation order, and the peers
// each was asked to connect.
struct ProbeLog {
  std::vector<int64_t> made;
  std::map<const Communicator*, std::vector<int>> connected;
};

// The world as a transport that holds device memory: every communicator it (or a split of it)
// makes reports its own figure, 1000 x its creation number, and is listed in the log with the
// peers it connects; the ops go to the wrapped communicator.
class TransportProbe final : public Communicator {
 public:
  TransportProbe(Communicator& inner, std::unique_ptr<Communicator> owned, ProbeLog& log)
      : Communicator(inner.rank(), inner.size(), inner.name(), inner.options()),
        inner_(inner),
        owned_(std::move(owned)),
        log_(log),
        bytes_(1000 * int64_t(log.made.size() + 1)) {
    log_.made.push_back(bytes_);
  }
  std::string_view backend() const override { return inner_.backend(); }
  int local_rank() const override { return inner_.local_rank(); }
  [[noreturn]] void abort(int exit_code) override {
    inner_.abort(exit_code);
    std::abort();  // unreachable: the wrapped communicator's abort never returns
  }
  int64_t transport_device_bytes() const override { return bytes_; }
  void connect_peers(std::span<const int> peers) override {
    std::vector<int>& mine = log_.connected[this];
    mine.insert(mine.end(), peers.begin(), peers.end());
  }

 protected:
  std::unique_ptr<CommHandle> start_all_reduce(const Tensor& buf, ReduceOp op) override {
    return inner_.all_reduce_async(buf, op);
  }
  std::unique_ptr<CommHandle> start_reduce_scatter(const Tensor& send, const Tensor& recv,
                                                   ReduceOp op) override {
    return inner_.reduce_scatter_async(send, recv, op);
  }
  std::unique_ptr<CommHandle> start_all_gather(const Tensor& send, const Tensor& recv,
                                               bool /*in_place*/) override {
    return inner_.all_gather_async(send, recv);
  }
  std::unique_ptr<CommHandle> start_all_to_all(const Tensor& send, const Tensor& recv) override {
    inner_.all_to_all(send, recv);
    return std::make_unique<CompletedHandle>();
  }
  std::unique_ptr<CommHandle> start_broadcast(const Tensor& buf, int root) override {
    inner_.broadcast(buf, root);
    return std::make_unique<CompletedHandle>();
  }
  std::unique_ptr<CommHandle> start_send(const Tensor& buf, int peer, int tag) override {
    return inner_.send_async(buf, peer, tag);
  }
  std::unique_ptr<CommHandle> start_recv(const Tensor& buf, int peer, int tag) override {
    return inner_.recv_async(buf, peer, tag);
  }
  std::unique_ptr<CommHandle> start_barrier() override {
    inner_.barrier();
    return std::make_unique<CompletedHandle>();
  }
  std::unique_ptr<Communicator> split_impl(int color, int key, std::string name) override {
    auto part = inner_.split(color, key, name.substr(name.rfind('/') + 1));
    Communicator& inner = *part;
    return std::make_unique<TransportProbe>(inner, std::move(part), log_);
  }

 private:
  Communicator& inner_;
  std::unique_ptr<Communicator> owned_;
  ProbeLog& log_;
  int64_t bytes_;
};

std::vector<int> sorted_peers(std::vector<int> peers) {
  std::sort(peers.begin(), peers.end());
  return peers;
}

// This rank's neighbours in the group, sorted (the expected connect_peers of a chain or ring).
std::vector<int> neighbours(const Communicator& group, bool ring) {
  std::vector<int> out;
  const int n = group.size(), me = group.rank();
  for (const int peer : {me - 1, me + 1}) {
    const int p = ring ? (peer + n) % n : peer;
    if (p >= 0 && p < n && p != me && std::find(out.begin(), out.end(), p) == out.end())
      out.push_back(p);
  }
  return sorted_peers(out);
}

// Every group a run uses comes from the grid (the context core's Ulysses and ring groups too), so
// the grid's transport total is every communicator's; the groups that move tensors point to point
// have their pairs connected there: the stages' neighbours, every pair of a Ulysses group, the
// ring's neighbours; no other group.
TEST(ParallelGrid, MakesEveryGroupAndCountsEveryTransport) {
  std::vector<ParallelDims> all = shapes();
  if (world().size() % 4 == 0) all.push_back({1, 1, 4, 1});
  for (const ParallelDims& dims : all) {
    for (const bool extras : {false, true}) {
      const Topology topo(dims, world().size(), world().rank());
      const int64_t cp = topo.size(Axis::kCp), ulysses = cp == 4 ? 2 : cp;
      ProbeLog log;
      TransportProbe probe(world(), nullptr, log);
      const ParallelGrid grid(topo, probe,
                              {.tied_embeddings = extras,
                               .base_group = extras,
                               .cp_ulysses = extras && cp > 1 ? ulysses : 0});
      SCOPED_TRACE(testing::Message() << "pp " << dims.pp << " cp " << dims.cp << " tp " << dims.tp
                                      << (extras ? " with every group" : ""));
      int64_t sum = 0;
      for (const int64_t b : log.made) sum += b;
      EXPECT_EQ(grid.transport_device_bytes(), sum);
      std::map<const Communicator*, std::vector<int>> want_connected;
      if (topo.size(Axis::kPp) > 1)
        want_connected[&grid.group(Axis::kPp)] = neighbours(grid.group(Axis::kPp), false);
      if (extras && cp > 1) {
        const ContextGroups& groups = grid.context();
        std::vector<int> everyone;
        for (int r = 0; r < groups.ulysses()->size(); ++r)
          if (r != groups.ulysses()->rank()) everyone.push_back(r);
        want_connected[groups.ulysses()] = everyone;
        if (groups.ring() != nullptr)
          want_connected[groups.ring()] = neighbours(*groups.ring(), /*ring=*/true);
      }
      std::map<const Communicator*, std::vector<int>> connected;
      for (const auto& [group, peers] : log.connected) connected[group] = sorted_peers(peers);
      EXPECT_EQ(connected, want_connected);
      if (!(extras && cp > 1)) {
        EXPECT_THROW(grid.context(), Error);
        continue;
      }
      // The cp ranks in groups of `ulysses` consecutive ones; the ring across the groups.
      const ContextGroups& groups = grid.context();
      const std::vector<int64_t> cp_ranks = topo.group_ranks(Axis::kCp);
      const int64_t c = topo.coord(Axis::kCp), g = c / ulysses, u = c % ulysses;
      std::vector<int64_t> want_ulysses, want_ring;
      for (int64_t i = 0; i < cp; ++i) {
        if (i / ulysses == g) want_ulysses.push_back(cp_ranks[size_t(i)]);
        if (i % ulysses == u) want_ring.push_back(cp_ranks[size_t(i)]);
      }
      ASSERT_NE(groups.ulysses(), nullptr);
      EXPECT_EQ(members(*groups.ulysses()), want_ulysses);
      if (ulysses == cp) {
        EXPECT_EQ(groups.ulysses(), &grid.group(Axis::kCp));
        EXPECT_EQ(groups.ring(), nullptr);
      } else {
        ASSERT_NE(groups.ring(), nullptr);
        EXPECT_EQ(members(*groups.ring()), want_ring);
      }
    }
  }
}

TEST(ParallelGrid, ScalarReductionsAreExactAndAgreed) {
  const Topology topo({-1, 1, 1, 1}, world().size(), world().rank());
  const ParallelGrid grid(topo, world());
  const int n = world().size(), rank = world().rank();
  // Past f32's 24 bits and i32's 31: sums that the old float/i32 reductions would round.
  double loss[2] = {16777216.0 + 0.25 * (rank + 1), 3.0};
  int64_t tokens[1] = {(int64_t{1} << 33) + rank};
  grid.sum(loss);
  grid.sum(tokens);
  EXPECT_EQ(loss[0], 16777216.0 * n + 0.25 * n * (n + 1) / 2);
  EXPECT_EQ(loss[1], 3.0 * n);
  EXPECT_EQ(tokens[0], (int64_t{1} << 33) * n + int64_t(n) * (n - 1) / 2);
  EXPECT_EQ(grid.any(rank == n - 1), true);
  EXPECT_EQ(grid.any(false), false);
}

// Each tp rank of a slice computed the same loss (its cp share); every cp, tp and pp rank
// counted its rows' pairs: the totals count each once.
TEST(ParallelGrid, StepTotalsCountEachReplicaOnce) {
  for (const ParallelDims& dims : shapes()) {
    const Topology topo(dims, world().size(), world().rank());
    const ParallelGrid grid(topo, world());
    const int64_t dp = topo.size(Axis::kDp);
    const bool has_loss = topo.coords().pp == topo.size(Axis::kPp) - 1;
    // Replica d's loss is 10 (d + 1), split over its cp ranks (each holds its share of the
    // rows' tokens); its rows' pairs 1000 (d + 1), counted whole by each of its ranks.
    const double d = double(topo.coords().dp + 1), cp = double(topo.size(Axis::kCp));
    const StepTotals t = grid.step_totals(has_loss ? 10 * d / cp : 0, 1000 * d);
    const double replicas = double(dp * (dp + 1) / 2);
    EXPECT_DOUBLE_EQ(t.loss_sum, 10 * replicas) << "pp " << dims.pp << " cp " << dims.cp;
    EXPECT_DOUBLE_EQ(t.pairs, 1000 * replicas) << "tp " << dims.tp;
  }
}

// Under tp = 2, over a rank's arena cut into slices at arbitrary points: sum_shared() sums the
// partial ranges over the tp group and nothing else (with sequence parallelism every norm's
// weights; with Qwen3's q/k norms those always, and without sequence parallelism only those);
// local_parts counts every element once, in the replicated part exactly when
// tp_replicated_ranges holds it.
void expect_sums_partial_ranges(bool qk_norm, bool sequence_parallel) {
  const Topology topo({-1, 1, 1, 2}, world().size(), world().rank());
  const ParallelGrid grid(topo, world());
  ModelConfig whole = model_preset("tiny");
  whole.n_layers = 2;
  whole.qk_norm = qk_norm;
  ModelConfig shard = tp_shard_config(whole, 2);
  shard.sequence_parallel = sequence_parallel;
  const ParamLayout layout = make_param_layout(shard);
  const auto replicated = tp_replicated_ranges(layout);
  const auto partial = tp_partial_ranges(layout, sequence_parallel);
  ASSERT_FALSE(partial.empty());
  int64_t partial_elems = 0;
  for (auto [b, e] : partial) partial_elems += e - b;
  const int64_t head_norms = qk_norm ? whole.n_layers * 2 * whole.head_dim() : 0;
  // Without sequence parallelism the q/k norms only; with it also two per layer and the final.
  EXPECT_EQ(partial_elems,
            head_norms + (sequence_parallel ? (2 * whole.n_layers + 1) * whole.dim : 0));
  auto in = [](const std::vector<std::pair<int64_t, int64_t>>& ranges, int64_t i) {
    for (auto [b, e] : ranges)
      if (i >= b && i < e) return true;
    return false;
  };
  const float mine = float(grid.coord(Axis::kTp) + 1);  // 1 on tp rank 0, 2 on tp rank 1
  std::vector<float> grads(size_t(layout.total), mine);
  const int64_t cut1 = partial[0].first + 1, cut2 = layout.total * 2 / 3;
  auto slice = [&](int64_t b, int64_t e) {
    return GradSlice{b, Tensor(grads.data() + b, DType::kF32, {e - b}, MemPool::kHost)};
  };
  const std::vector<GradSlice> slices = {slice(0, cut1), slice(cut1, cut2),
                                         slice(cut2, layout.total)};
  auto backend = make_backend(DeviceKind::kCpu);
  const GradientAxes axes(grid, shard, LoraConfig{});
  axes.sum_shared(slices);
  GradNormParts want;
  for (int64_t i = 0; i < layout.total; ++i) {
    const float expect = in(partial, i) ? 3.f : mine;
    ASSERT_EQ(grads[size_t(i)], expect) << "element " << i;
    (in(replicated, i) ? want.replicated : want.split) += double(expect) * expect;
  }
  const GradNormParts got = axes.local_parts(slices, *backend);
  EXPECT_DOUBLE_EQ(got.split, want.split);
  EXPECT_DOUBLE_EQ(got.replicated, want.replicated);
}

TEST(GradientAxes, SumPartialRangesAndSplitTheNormByTheLayout) {
  if (world().size() % 2 != 0) GTEST_SKIP() << "needs an even number of ranks";
  for (const auto& [qk_norm, sp] :
       std::vector<std::pair<bool, bool>>{{false, true}, {true, false}, {true, true}}) {
    SCOPED_TRACE(::testing::Message() << "qk_norm " << qk_norm << " sequence_parallel " << sp);
    expect_sums_partial_ranges(qk_norm, sp);
  }
}

// LoRA under tp = 2: the adapters every tp rank holds whole (A of q/k/v/gate/up, B of o/down)
// take a partial gradient on each rank, so sum_shared sums exactly them over the tp group and
// local_parts counts them as replicated; the split adapters stay as they are.
TEST(GradientAxes, WholeAdaptersAreSummedOverTpAndCountedOnce) {
  if (world().size() % 2 != 0) GTEST_SKIP() << "needs an even number of ranks";
  const Topology topo({-1, 1, 1, 2}, world().size(), world().rank());
  const ParallelGrid grid(topo, world());
  ModelConfig whole = model_preset("tiny");
  whole.n_layers = 2;
  const ModelConfig shard = tp_shard_config(whole, 2);
  LoraConfig lora;
  lora.rank = 4;
  lora.targets = lora_targets_from_string("all");
  const LoraLayout layout = make_lora_layout(shard, lora);
  const int64_t total = layout.params.total;
  auto whole_on_every_rank = [&](int64_t i) {
    for (int l = 0; l < whole.n_layers; ++l)
      for (int t = 0; t < kNumLoraTargets; ++t) {
        const bool row_parallel = t == int(LoraTarget::kO) || t == int(LoraTarget::kDown);
        const int64_t b = row_parallel ? layout.b[l][t] : layout.a[l][t];
        const int64_t n = lora.rank * whole.dim;  // A [r, dim] or B [dim, r]
        if (i >= b && i < b + n) return true;
      }
    return false;
  };
  const float mine = float(grid.coord(Axis::kTp) + 1);
  std::vector<float> grads(size_t(total), mine);
  const int64_t cut = total / 3 + 1;
  const std::vector<GradSlice> slices = {
      {0, Tensor(grads.data(), DType::kF32, {cut}, MemPool::kHost)},
      {cut, Tensor(grads.data() + cut, DType::kF32, {total - cut}, MemPool::kHost)}};
  auto backend = make_backend(DeviceKind::kCpu);
  const GradientAxes axes(grid, shard, lora);
  axes.sum_shared(slices);
  GradNormParts want;
  int64_t summed = 0;
  for (int64_t i = 0; i < total; ++i) {
    const bool shared = whole_on_every_rank(i);
    summed += shared;
    ASSERT_EQ(grads[size_t(i)], shared ? 3.f : mine) << "element " << i;
    (shared ? want.replicated : want.split) += double(grads[size_t(i)]) * grads[size_t(i)];
  }
  EXPECT_GT(summed, 0);
  EXPECT_LT(summed, total);
  const GradNormParts got = axes.local_parts(slices, *backend);
  EXPECT_DOUBLE_EQ(got.split, want.split);
  EXPECT_DOUBLE_EQ(got.replicated, want.replicated);
}

// pp = 2 with the embedding matrix tied across the end stages: sum_shared sums unit 0 over the
// two stages and nothing else; only the first stage counts it in the norm, also from a slice
// that straddles its end.
TEST(GradientAxes, TiedMatrixIsSummedOverTheEndStagesAndCountedOnce) {
  if (world().size() % 2 != 0) GTEST_SKIP() << "needs an even number of ranks";
  const Topology topo({-1, 2, 1, 1}, world().size(), world().rank());
  const ParallelGrid grid(topo, world(), {.tied_embeddings = true});
  ModelConfig stage = model_preset("tiny");
  stage.n_layers = 2;
  stage.tie_embeddings = true;
  const int64_t pp = grid.coord(Axis::kPp);
  stage.pp_begin = pp;
  stage.pp_end = pp + 1;
  const ParamLayout layout = make_param_layout(stage);
  const int64_t tied_end = layout.units[0].end;
  ASSERT_GT(tied_end, 0);
  ASSERT_LT(tied_end, layout.total);
  const float mine = float(pp + 1);  // 1 on the first stage, 2 on the last
  std::vector<float> grads(size_t(layout.total), mine);
  const int64_t cut = tied_end + 3;  // the first slice straddles the tied matrix's end
  const std::vector<GradSlice> slices = {
      {0, Tensor(grads.data(), DType::kF32, {cut}, MemPool::kHost)},
      {cut, Tensor(grads.data() + cut, DType::kF32, {layout.total - cut}, MemPool::kHost)}};
  auto backend = make_backend(DeviceKind::kCpu);
  const GradientAxes axes(grid, stage, LoraConfig{});
  axes.sum_shared(slices);
  double want = 0;
  for (int64_t i = 0; i < layout.total; ++i) {
    const bool tied = i < tied_end;
    ASSERT_EQ(grads[size_t(i)], tied ? 3.f : mine) << "element " << i;
    if (!tied || pp == 0) want += double(grads[size_t(i)]) * grads[size_t(i)];
  }
  const GradNormParts got = axes.local_parts(slices, *backend);
  EXPECT_DOUBLE_EQ(got.split, want);
  EXPECT_EQ(got.replicated, 0.0);
}

}  // namespace
}  // namespace shardlm
