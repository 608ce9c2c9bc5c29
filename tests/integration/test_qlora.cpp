// QLoRA: LoRA over a frozen base whose decoder projections are NF4 (lora.base_dtype = nf4).
// In the model: the NF4 base computes exactly as a dense f32 base holding its dequantized
// weights (losses and adapter gradients bitwise equal, every checkpointing mode), the adapters'
// gradients over it match finite differences, and its device bytes are the codes, the absmax,
// the dense parts and one dequantized layer; in host memory (offload_base) it computes bitwise
// as on the device. Through the binary: a tiny QLoRA run's loss falls, ZeRO 3 on 2 ranks and
// context parallelism (cp = 2) follow the one-rank run, so does the base in host memory (also
// sharded by ZeRO 3 there, each rank holding about half the codes), a
// checkpoint resumes as the uninterrupted run (and not under a dense base), the merged export holds
// the dequantized base plus the adapters, and bad lora.base_dtype values exit 2 naming the key.
// Under tensor parallelism a rank's quantized shard is the whole model's blocks (codes read in
// NF4 cut to the shard are what the shard quantizes), tp = 2 (also with ZeRO 3 over dp = 2) and
// pp = 2 (also with tp = 2) follow the one-rank run with each rank's plan its ledger, and a
// projection whose shard would cut NF4's blocks is refused naming it; a checkpoint resumes
// across tp and pp.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>

#include <nlohmann/json.hpp>

#include "integration/grad_check_model.h"
#include "integration/lora_runs.h"
#include "integration/tiny_runs.h"
#include "shardlm/backend/backend.h"
#include "shardlm/checkpoint/checkpoint.h"
#include "shardlm/checkpoint/model_io.h"
#include "shardlm/io/safetensors.h"
#include "shardlm/model/llama.h"
#include "shardlm/model/nf4_base.h"
#include "shardlm/model/tensor_shard.h"
#include "shardlm/quant/nf4.h"
#include "test_util.h"

namespace shardlm {
namespace {

namespace fs = std::filesystem;

LoraConfig qlora_config(bool nf4) {
  LoraConfig l;
  l.rank = 3;
  l.alpha = 6;
  l.targets = lora_targets_from_string("all");
  l.nf4_base = nf4;
  return l;
}

// A dense f32 LoRA model with the grad-check weights, its base round-tripped through NF4 (the
// values the NF4 base computes with), and an NF4 model loaded from the same unrounded values;
// both with the same random adapters.
struct Pair {
  std::unique_ptr<Backend> be = make_backend(DeviceKind::kCpu);
  MemoryLedger dense_ledger, nf4_ledger;
  std::unique_ptr<LlamaModel> dense, nf4;
  Pair(const ModelConfig& cfg, ModelOptions opt) {
    opt.lora = qlora_config(false);
    dense = std::make_unique<LlamaModel>(cfg, opt, *be, dense_ledger);
    opt.lora = qlora_config(true);
    nf4 = std::make_unique<LlamaModel>(cfg, opt, *be, nf4_ledger);
    test::set_grad_check_weights(*dense, 7);
    const ParamLayout& L = dense->layout();
    const Nf4BaseLayout N = make_nf4_base_layout(L);
    std::vector<float> unit(size_t(L.max_unit));
    for (int u = 0; u < int(L.units.size()); ++u) {
      dense->read_base_unit(u, unit.data());
      nf4->set_base_unit(u, unit.data());
      nf4_round_trip_unit(L, N, u, unit.data());
      dense->set_base_unit(u, unit.data());
    }
    const std::vector<float> a =
        test::random_vec(dense->lora_layout().params.total, 8, -0.4f, 0.4f);
    std::copy(a.begin(), a.end(), dense->lora_params().f32());
    std::copy(a.begin(), a.end(), nf4->lora_params().f32());
  }
};

TEST(QLora, Nf4BaseComputesAsItsDequantizedWeightsInEveryCheckpointingMode) {
  const ModelConfig cfg = test::grad_check_config("qlora", false, true);
  for (const Checkpointing mode :
       {Checkpointing::kNone, Checkpointing::kSelective, Checkpointing::kFull}) {
    SCOPED_TRACE(checkpointing_name(mode));
    ModelOptions opt;
    opt.max_batch = 2;
    opt.max_seq = 11;
    opt.mlp_chunk_tokens = 7;
    opt.checkpointing = mode;
    Pair p(cfg, opt);
    double loss[2];
    std::vector<float> grads[2];
    int k = 0;
    for (LlamaModel* m : {p.dense.get(), p.nf4.get()}) {
      BatchInputs in = m->inputs(2, 11);
      test::fill_grad_batch(in, 2, 11, cfg.vocab_size, 3);
      m->zero_grads();
      loss[k] = m->forward_backward(2, 11, 1.f).loss_sum;
      grads[k].assign(m->lora_grads().f32(), m->lora_grads().f32() + m->lora_layout().params.total);
      ++k;
    }
    EXPECT_EQ(loss[0], loss[1]);
    EXPECT_TRUE(grads[0] == grads[1]) << "adapter gradients differ";
    // The NF4 base's device bytes: its three arrays (params) and the dequantized layer
    // (workspace), against the dense base's params.
    const Nf4BaseLayout N = make_nf4_base_layout(p.nf4->layout());
    const int64_t dense_params = p.dense_ledger.current(MemPool::kDevice, MemCategory::kParams);
    const int64_t nf4_params = p.nf4_ledger.current(MemPool::kDevice, MemCategory::kParams);
    EXPECT_EQ(dense_params - nf4_params,
              p.nf4->layout().total * 4 - (N.dense_elems * 4 + N.code_bytes + N.absmax_values * 4));
    EXPECT_EQ(p.nf4_ledger.current(MemPool::kDevice, MemCategory::kWorkspace) -
                  p.dense_ledger.current(MemPool::kDevice, MemCategory::kWorkspace),
              N.workspace_elems * 4);
  }
}

// An NF4 base in host memory (lora.offload_base) computes bitwise as on the device: each
// acquisition stages a layer's absmax, dense parts and codes (or a piece of a table) through a
// device slot. bf16 parameters: the tables fit a slot whole, and the results are bitwise the
// device base's; f32: the tables are larger than a staged layer and handed out in pieces, whose
// logits and loss are summed in another order (test_table_pieces), so equal to rounding. Its
// host bytes are the three arrays, its device bytes two slots of the largest part.
TEST(QLora, Nf4BaseInHostMemoryComputesAsOnTheDevice) {
  ModelConfig cfg = test::grad_check_config("qlora", false, true);
  cfg.vocab_size = 30;  // bf16: the final norm and the head (496 elements) fit a staged layer
  for (const DType param : {DType::kF32, DType::kBF16})
    for (const Checkpointing mode : {Checkpointing::kNone, Checkpointing::kFull}) {
      SCOPED_TRACE(std::string(dtype_name(param)) + " " + checkpointing_name(mode));
      ModelOptions opt;
      opt.param_dtype = param;
      opt.max_batch = 2;
      opt.max_seq = 11;
      opt.mlp_chunk_tokens = 7;
      opt.checkpointing = mode;
      opt.lora = qlora_config(true);
      auto be = make_backend(DeviceKind::kCpu);
      MemoryLedger dense_ledger, device_ledger, host_ledger;
      ModelOptions dense_opt = opt;
      dense_opt.param_dtype = DType::kF32;
      dense_opt.lora = qlora_config(false);
      LlamaModel dense(cfg, dense_opt, *be, dense_ledger);  // the weights' source
      test::set_grad_check_weights(dense, 7);
      LlamaModel on_device(cfg, opt, *be, device_ledger);
      opt.lora.offload_base = true;
      LlamaModel on_host(cfg, opt, *be, host_ledger);
      const ParamLayout& L = on_device.layout();
      std::vector<float> unit(size_t(L.max_unit));
      for (int u = 0; u < int(L.units.size()); ++u) {
        dense.read_base_unit(u, unit.data());
        on_device.set_base_unit(u, unit.data());
        on_host.set_base_unit(u, unit.data());
      }
      const std::vector<float> a =
          test::random_vec(on_device.lora_layout().params.total, 8, -0.4f, 0.4f);
      std::copy(a.begin(), a.end(), on_device.lora_params().f32());
      std::copy(a.begin(), a.end(), on_host.lora_params().f32());
      double loss[2];
      std::vector<float> grads[2];
      int k = 0;
      for (LlamaModel* m : {&on_device, &on_host}) {
        for (int step = 0; step < 2; ++step) {  // the slots' contents carried across walks
          BatchInputs in = m->inputs(2, 11);
          test::fill_grad_batch(in, 2, 11, cfg.vocab_size, 3 + step);
          m->zero_grads();
          loss[k] = m->forward_backward(2, 11, 1.f).loss_sum;
        }
        grads[k].assign(m->lora_grads().f32(),
                        m->lora_grads().f32() + m->lora_layout().params.total);
        ++k;
      }
      const int64_t pb = int64_t(dtype_size(param));
      const Nf4BaseLayout N = make_nf4_base_layout(L);
      const Nf4HostLayout H = make_nf4_host_layout(L, N, pb, /*split_tables=*/true);
      const bool pieces = param == DType::kF32;
      EXPECT_EQ(H.piece_rows[0] > 0, pieces);
      EXPECT_EQ(H.piece_rows[L.head_unit] > 0, pieces);
      if (pieces) {  // the tables summed piece by piece (tests/tolerance.h)
        const double tol = test::reorder_tolerance(test::reduction_chain(cfg, 11, 2));
        EXPECT_NEAR(loss[1], loss[0], tol * std::abs(loss[0]));
        float g_max = 0;
        for (float g : grads[0]) g_max = std::max(g_max, std::abs(g));
        ASSERT_GT(g_max, 0.f);
        for (size_t i = 0; i < grads[0].size(); ++i)
          ASSERT_NEAR(grads[1][i], grads[0][i], tol * g_max) << "adapter gradient " << i;
      } else {
        EXPECT_EQ(loss[0], loss[1]);
        EXPECT_TRUE(grads[0] == grads[1]) << "adapter gradients differ";
      }
      EXPECT_EQ(host_ledger.current(MemPool::kHost, MemCategory::kParams),
                N.dense_elems * pb + N.code_bytes + N.absmax_values * 4);
      EXPECT_EQ(device_ledger.current(MemPool::kDevice, MemCategory::kParams) -
                    host_ledger.current(MemPool::kDevice, MemCategory::kParams),
                N.dense_elems * pb + N.code_bytes + N.absmax_values * 4 - 2 * H.slot_bytes);
    }
}

TEST(QLora, AdaptersOverAnNf4BaseMatchFiniteDifferences) {
  const ModelConfig cfg = test::grad_check_config("qlora", true, false);
  ModelOptions opt;
  opt.max_batch = 2;
  opt.max_seq = 11;
  opt.loss_chunk_tokens = 5;
  Pair p(cfg, opt);
  LlamaModel& model = *p.nf4;
  BatchInputs in = model.inputs(2, 11);
  test::fill_grad_batch(in, 2, 11, cfg.vocab_size, 4);
  auto loss_at = [&]() {
    model.zero_grads();
    return model.forward_backward(2, 11, 1.f).loss_sum;
  };
  loss_at();
  const int64_t n = model.lora_layout().params.total;
  std::vector<float> g(model.lora_grads().f32(), model.lora_grads().f32() + n);
  for (const auto& d : test::directional_derivatives(
           model.lora_layout().params.entries, model.lora_params().f32(), g, loss_at, 3e-4f)) {
    EXPECT_NEAR(d.analytic, d.finite_difference, 1e-2 * std::abs(d.finite_difference) + 2e-3)
        << d.name;
    EXPECT_GT(std::abs(d.analytic), 1e-4) << d.name << ": no signal";
  }
}

// Each tp rank quantizes its shard of a projection (column-parallel: its rows; row-parallel:
// its columns of every row): the codes and absmax are the whole matrix's, cut to the shard, so
// a tp run's dequantized weights are the one-rank run's; nf4_shard_matrices cuts matrices read
// in NF4 (a bitsandbytes directory) the same way, and re-bases them into a pipeline stage.
TEST(QLora, TensorParallelShardsQuantizeToTheWholeModelsBlocks) {
  ModelConfig full = model_preset("tiny");  // dim 128, 4 heads, 2 kv heads, ffn 384
  full.n_layers = 2;
  const ParamLayout W = make_param_layout(full);
  const int u = 2;  // the second decoder layer
  std::vector<float> whole(size_t(W.unit_size(u)));
  uint64_t state = 0x9e3779b97f4a7c15ULL;
  for (float& x : whole) {  // uniform in [-1, 1), a few large values so blocks' absmax differ
    state = state * 6364136223846793005ULL + 1442695040888963407ULL;
    x = float(int64_t(state >> 40) - (int64_t{1} << 23)) / float(int64_t{1} << 23);
    if ((state >> 20) % 97 == 0) x *= 8;
  }
  const Nf4BaseLayout WN = make_nf4_base_layout(W);
  std::vector<Nf4Matrix> read;  // as a bitsandbytes directory holds them: whole matrices
  for (const Nf4Segment& seg : WN.units[u]) {
    if (!seg.quantized) continue;
    Nf4Matrix m;
    m.begin = seg.begin;
    m.codes.resize(size_t(nf4::packed_bytes(seg.n)));
    m.absmax.resize(size_t(nf4::num_blocks(seg.n)));
    nf4::quantize(whole.data() + (seg.begin - W.units[u].begin), seg.n, m.codes.data(),
                  m.absmax.data());
    read.push_back(std::move(m));
  }
  ASSERT_EQ(read.size(), 7u);
  for (int64_t rank = 0; rank < 2; ++rank) {
    SCOPED_TRACE("tp rank " + std::to_string(rank));
    const ParamLayout S = make_param_layout(tp_shard_config(full, 2));
    const std::vector<ShardPiece> pieces = tp_shard_pieces(full, 2, rank);
    std::vector<float> shard(size_t(S.total));
    for (const ShardPiece& p : pieces)
      if (p.full >= W.units[u].begin && p.full < W.units[u].end)
        std::copy_n(whole.data() + (p.full - W.units[u].begin), p.count, shard.data() + p.shard);
    const std::vector<Nf4Matrix> cut = nf4_shard_matrices(read, W, pieces);
    ASSERT_EQ(cut.size(), 7u);
    const Nf4BaseLayout SN = make_nf4_base_layout(S);
    size_t k = 0;
    for (const Nf4Segment& seg : SN.units[u]) {
      if (!seg.quantized) continue;
      std::vector<uint8_t> codes(size_t(nf4::packed_bytes(seg.n)));
      std::vector<float> absmax(size_t(nf4::num_blocks(seg.n)));
      nf4::quantize(shard.data() + seg.begin, seg.n, codes.data(), absmax.data());
      ASSERT_EQ(cut[k].begin, seg.begin) << "matrix " << k;
      EXPECT_EQ(cut[k].codes, codes) << "matrix " << k;
      EXPECT_EQ(cut[k].absmax, absmax) << "matrix " << k;
      ++k;
    }
  }
  // A pipeline stage holding layer 1 only: the same matrices, re-based into the stage's arena.
  const std::vector<Nf4Matrix> staged =
      nf4_shard_matrices(read, W, stage_shard_pieces(full, 1, 2, 1, 0));
  ModelConfig stage = full;
  stage.pp_begin = 1;
  stage.pp_end = 2;
  const ParamLayout P = make_param_layout(stage);
  ASSERT_EQ(staged.size(), read.size());
  for (size_t k = 0; k < read.size(); ++k) {
    EXPECT_EQ(staged[k].begin - P.units[u].begin, read[k].begin - W.units[u].begin);
    EXPECT_EQ(staged[k].codes, read[k].codes);
    EXPECT_EQ(staged[k].absmax, read[k].absmax);
  }
}

// ---- through the binary -----------------------------------------------------------------------

using RunOutcome = test::lora_runs::LoraRun;
using test::lora_runs::expect_follows;
using test::lora_runs::expect_plan_equals_ledger;

// 6 steps of a 2-layer tiny model with adapters on every projection over an NF4 base.
RunOutcome train(int ranks, int micro, const std::string& name, const std::string& extra) {
  return test::lora_runs::train_lora(ranks, micro, test::scratch_root() / ("qlora_" + name),
                                     " --set lora.base_dtype=nf4 " + extra);
}

TEST(QLoraRuns, TrainsAndZero3AndContextParallelFollowOneRank) {
  const RunOutcome one = train(1, 4, "one", "");
  ASSERT_EQ(one.exit_code, 0) << one.out;
  EXPECT_NE(one.out.find("the base is frozen (nf4 projections"), std::string::npos) << one.out;
  const std::vector<double> loss = test::metric_series(one.dir, "loss");
  ASSERT_EQ(loss.size(), 6u);
  EXPECT_LT(loss.back(), loss.front()) << "the loss did not fall";
  const RunOutcome zero3 = train(2, 2, "zero3", " --set zero.stage=3");
  ASSERT_EQ(zero3.exit_code, 0) << zero3.out;
  EXPECT_NE(zero3.out.find("nf4 projections sharded over 2 ranks"), std::string::npos) << zero3.out;
  expect_follows(zero3.dir, one.dir);
  const RunOutcome cp = train(2, 4, "cp2", " --set parallel.cp=2 --set parallel.cp_kind=ulysses");
  ASSERT_EQ(cp.exit_code, 0) << cp.out;
  expect_follows(cp.dir, one.dir);
}

// The base in host memory: the run on the device, step for step (the staged parts hold the same
// bytes; the tables may be handed out in pieces).
TEST(QLoraRuns, BaseInHostMemoryFollowsTheBaseOnTheDevice) {
  const RunOutcome one = train(1, 4, "device_base", "");
  ASSERT_EQ(one.exit_code, 0) << one.out;
  const RunOutcome host = train(1, 4, "host_base", " --set lora.offload_base=true");
  ASSERT_EQ(host.exit_code, 0) << host.out;
  expect_follows(host.dir, one.dir);
  // ZeRO 3 on 2 ranks shards the codes in host memory: each rank holds its chunks, stages them
  // with the layer's dense parts and gathers the layer on the device.
  const RunOutcome sharded =
      train(2, 2, "host_base_zero3", " --set lora.offload_base=true --set zero.stage=3");
  ASSERT_EQ(sharded.exit_code, 0) << sharded.out;
  EXPECT_NE(sharded.out.find("nf4 projections sharded over 2 ranks"), std::string::npos)
      << sharded.out;
  expect_follows(sharded.dir, one.dir);
  expect_plan_equals_ledger(sharded.dir, 2);
  auto host_params = [](const RunOutcome& r, int rank) {
    const nlohmann::json mem = nlohmann::json::parse(
        test::slurp(r.dir / ("memory_rank" + std::to_string(rank) + ".json")));
    return mem["host_peak_by_category"].value("params", int64_t{0});
  };
  const Nf4BaseLayout N = make_nf4_base_layout(make_param_layout([] {
    ModelConfig c = model_preset("tiny");
    c.n_layers = 2;
    return c;
  }()));
  for (int r = 0; r < 2; ++r)  // about half the codes and absmax fewer on each rank
    EXPECT_LT(host_params(sharded, r),
              host_params(host, 0) - (N.code_bytes + N.absmax_values * 4) / 2 + 64)
        << "rank " << r;
}

TEST(QLoraRuns, ResumesAsTheUninterruptedRunAndNotOverADenseBase) {
  const RunOutcome one = train(1, 4, "resume_ref", "");
  ASSERT_EQ(one.exit_code, 0) << one.out;
  const std::string step3 = (one.dir / "checkpoints" / "step_00000003").string();
  const RunOutcome dense =
      train(1, 4, "resume_dense", " --set lora.base_dtype=auto --set train.resume=" + step3);
  EXPECT_EQ(dense.exit_code, 2) << dense.out;
  EXPECT_NE(dense.out.find("in nf4"), std::string::npos) << dense.out;
  const RunOutcome rest = train(1, 4, "resume", " --set train.resume=" + step3);
  ASSERT_EQ(rest.exit_code, 0) << rest.out;
  EXPECT_NE(rest.out.find("resume: continuing"), std::string::npos) << rest.out;
  expect_follows(rest.dir, one.dir, 3);
}

// Every tp rank quantizes the whole model's blocks, so a checkpoint moves between tp sizes: one
// written under tp = 2 resumes on one rank, one written on one rank under tp = 2 at pp = 1, under
// pp = 2 and under pp = 2 x tp = 2, each continuing as the uninterrupted one-rank run.
TEST(QLoraRuns, ResumesAcrossTensorAndPipelineParallelism) {
  const RunOutcome one = train(1, 4, "regrid_ref", "");
  ASSERT_EQ(one.exit_code, 0) << one.out;
  const RunOutcome tp2 = train(2, 4, "regrid_tp2", " --set parallel.tp=2");
  ASSERT_EQ(tp2.exit_code, 0) << tp2.out;
  auto step3 = [](const RunOutcome& r) {
    return (r.dir / "checkpoints" / "step_00000003").string();
  };
  for (const RunOutcome& r :
       {train(1, 4, "regrid_to_one", " --set train.resume=" + step3(tp2)),
        train(2, 4, "regrid_to_tp2", " --set parallel.tp=2 --set train.resume=" + step3(one)),
        train(2, 2, "regrid_to_pp2",
              " --set parallel.pp=2 --set train.grad_accum=2 --set train.resume=" + step3(one)),
        train(4, 2, "regrid_to_pp2_tp2",
              " --set parallel.pp=2 --set parallel.tp=2 --set train.grad_accum=2 "
              "--set train.resume=" +
                  step3(one))}) {
    SCOPED_TRACE(r.dir.string());
    ASSERT_EQ(r.exit_code, 0) << r.out;
    EXPECT_NE(r.out.find("resume: continuing"), std::string::npos) << r.out;
    expect_follows(r.dir, one.dir, 3);
  }
}

// The merged export adds the adapters to the dequantized projections: layer 0's q_proj is
// round_trip(W) + alpha/r B A from the checkpoint's adapters (and not the unquantized W's merge).
TEST(QLoraRuns, MergedExportAddsTheAdaptersToTheDequantizedBase) {
  const RunOutcome one = train(1, 4, "export", "");
  ASSERT_EQ(one.exit_code, 0) << one.out;
  const fs::path merged = one.dir.parent_path() / "merged";
  const std::string ck = (one.dir / "checkpoints").string();
  test::run_command(std::string(SHARDLM_BINARY) + " convert hf-export " + ck + " --output " +
                        merged.string() + " --merge --dtype fp32",
                    one.dir.parent_path() / "merge.txt", true);
  const CheckpointReader ckpt(ck);
  const StoredModel stored = read_stored_model(ckpt);
  ASSERT_TRUE(stored.lora.nf4_base);
  const ParamLayout L = make_param_layout(stored.config);
  std::vector<float> unit(size_t(L.unit_size(1)));
  initial_weights(stored.config, L, stored.lora_base.init_seed, [&](int u, const float* v) {
    if (u == 1) std::copy(v, v + L.unit_size(1), unit.begin());
  });
  std::vector<float> plain = unit;
  const LoraLayout A = make_lora_layout(stored.config, stored.lora);
  std::vector<float> adapters(size_t(A.params.unit_size(0)));
  ckpt.read_vector("params", uint64_t(A.params.units[0].begin) * 4, adapters.data(),
                   adapters.size() * 4);
  nf4_round_trip_unit(L, make_nf4_base_layout(L), 1, unit.data());
  merge_lora_layer(stored.config, stored.lora, A, L, 0, adapters.data(), unit.data());
  merge_lora_layer(stored.config, stored.lora, A, L, 0, adapters.data(), plain.data());

  const SafetensorsDir st(merged.string());
  const std::string name = "model.layers.0.self_attn.q_proj.weight";
  std::vector<float> got(size_t(st.file_of(name).info(name).numel()));
  st.file_of(name).read_f32(name, got.data());
  const int64_t at = L.layers[0].wq - L.units[1].begin;
  double worst = 0, from_plain = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    worst = std::max(worst, double(std::abs(got[i] - unit[at + i])));
    from_plain = std::max(from_plain, double(std::abs(got[i] - plain[at + i])));
  }
  EXPECT_LT(worst, 1e-6);
  EXPECT_GT(from_plain, 1e-4) << "the export merged into the unquantized base";
}

// The NF4 base split with its projections over tp ranks (each quantizing its shard: the whole
// model's blocks), alone, with ZeRO 3 sharding each tp shard's codes over dp = 2, and in host
// memory; over pipeline stages (each holding its layers' codes, with ZeRO 3 over dp = 2); and over
// stages split by tp (each rank quantizing its shard of its stage's projections): every run
// follows the one-rank run of the same global batch (4 sequences a step), and the end-of-run
// greedy sample from the merged model (read from the final checkpoint) is the one-rank run's.
TEST(QLoraRuns, TensorAndPipelineParallelFollowOneRank) {
  const std::string greedy =
      " --set sample.count=1 --set sample.temperature=0 --set sample.max_new_tokens=8";
  auto sample_of = [](const RunOutcome& r) {
    const size_t at = r.out.rfind("--- sample 1 ---");
    return at == std::string::npos ? std::string() : r.out.substr(at, 64);
  };
  const RunOutcome one = train(1, 4, "grid_one", greedy);
  ASSERT_EQ(one.exit_code, 0) << one.out;
  ASSERT_FALSE(sample_of(one).empty()) << one.out;
  struct Case {
    int ranks, micro;
    const char* name;
    const char* sets;
  };
  for (const Case c :
       {Case{2, 4, "tp2", " --set parallel.tp=2"},
        Case{4, 2, "dp2_tp2_z3", " --set parallel.tp=2 --set zero.stage=3"},
        Case{2, 4, "tp2_base_on_host", " --set parallel.tp=2 --set lora.offload_base=true"},
        Case{4, 2, "dp2_tp2_z3_base_on_host",
             " --set parallel.tp=2 --set zero.stage=3 --set lora.offload_base=true"},
        Case{2, 2, "pp2", " --set parallel.pp=2 --set train.grad_accum=2"},
        Case{4, 1, "dp2_pp2_z3",
             " --set parallel.pp=2 --set train.grad_accum=2 --set zero.stage=3"},
        Case{4, 2, "pp2_tp2",
             " --set parallel.pp=2 --set parallel.tp=2 --set train.grad_accum=2"}}) {
    SCOPED_TRACE(c.name);
    const RunOutcome r = train(c.ranks, c.micro, c.name, c.sets + greedy);
    ASSERT_EQ(r.exit_code, 0) << r.out;
    EXPECT_NE(r.out.find("nf4 projections"), std::string::npos) << r.out;
    EXPECT_EQ(sample_of(r), sample_of(one));
    expect_follows(r.dir, one.dir);
    expect_plan_equals_ledger(r.dir, c.ranks);
  }
}

TEST(QLoraRuns, BadBaseDtypesExit2NamingTheKey) {
  for (const std::string sets :
       {"--set lora.base_dtype=int4", "--set lora.base_dtype=nf4 --set lora.rank=0",
        "--set lora.base_dtype=bf16 --set precision.param=fp32"}) {
    SCOPED_TRACE(sets);
    const RunOutcome r = train(1, 4, "bad", sets);
    EXPECT_EQ(r.exit_code, 2) << r.out;
    EXPECT_NE(r.out.find("lora.base_dtype"), std::string::npos) << r.out;
  }
  // ffn_dim 320 over tp = 2: down_proj's shard rows of 160 columns would cut NF4's blocks.
  const RunOutcome cut = train(2, 4, "bad_tp", "--set parallel.tp=2 --set model.ffn_dim=320");
  EXPECT_EQ(cut.exit_code, 2) << cut.out;
  EXPECT_NE(cut.out.find("down_proj.weight [128, 320] splits by input columns into shards of 160"),
            std::string::npos)
      << cut.out;
}

}  // namespace
}  // namespace shardlm
