// Pipeline stages on one GPU, in one process: two LlamaModel stages on the CUDA backend driven
// through both stages' 1F1B schedules (plan/pipeline.h) in an order that respects every
// transfer, the hidden states and their gradients handed over in device buffers, give the
// loss and the gradients of the whole model accumulating the same micro-batches on the GPU:
// with checkpoint placements (every other layer kept, kept layers on the host, whose copies
// run on the copy stream with one set of fences per micro-batch in flight), bf16 activations
// and LoRA adapters with dropout. No communicator is involved (the stage exchange over NCCL
// is the multi-GPU test's). Label gpu.
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <memory>
#include <vector>

#include "parallel/shard_grads.h"
#include "shardlm/model/llama.h"
#include "shardlm/model/tensor_shard.h"
#include "shardlm/plan/pipeline.h"
#include "tolerance.h"

namespace shardlm {
namespace {

constexpr int64_t kB = 2, kT = 16, kVocab = 40;
constexpr int kMicro = 4, kStages = 2;

struct Case {
  Checkpointing checkpointing = Checkpointing::kNone;
  CheckpointPlacement placed = {};
  DType act = DType::kF32;
  bool lora = false;
};

ModelConfig tiny() {
  ModelConfig c = model_preset("tiny");
  c.dim = 32;
  c.n_layers = 8;  // 4 a stage: more than a placement's rotating slots
  c.n_heads = 4;
  c.n_kv_heads = 2;
  c.ffn_dim = 40;
  c.vocab_size = kVocab;
  c.tie_embeddings = false;
  return c;
}

ModelOptions options(const Case& c) {
  ModelOptions o;
  o.max_batch = kB;
  o.max_seq = kT;
  o.checkpointing = c.checkpointing;
  o.checkpoint_placement = c.placed;
  o.activation_dtype = c.act;
  o.mlp_chunk_tokens = 10;
  if (c.lora) o.lora = {.rank = 4, .alpha = 8, .dropout = 0.1, .targets = 0x7f};
  return o;
}

// Micro-batch i's rows, written on the host and copied into the model's device inputs.
void fill(Backend& be, const BatchInputs& dev, int micro) {
  const int64_t n = kB * kT;
  std::vector<int32_t> host(size_t(4 * n));
  auto at = [&](int i) { return Tensor(host.data() + i * n, DType::kI32, {n}, MemPool::kHost); };
  const BatchInputs h{at(0), at(1), at(2), at(3), Tensor()};  // no document starts
  test::fill_two_documents(h, kB, kT, kVocab, 12345 + 977 * uint64_t(micro),
                           [micro](int64_t r) { return 5 + r + micro % 3; });
  be.copy(h.tokens, dev.tokens);
  be.copy(h.targets, dev.targets);
  be.copy(h.positions, dev.positions);
  be.copy(h.seg_start, dev.seg_start);
}

void set_dropout(LlamaModel& m, int micro) { m.set_lora_dropout(99, int64_t(micro) * kB * kT); }

std::vector<float> to_host(Backend& be, const Tensor& t) {
  std::vector<float> v(size_t(t.numel()));
  be.copy(t, Tensor(v.data(), DType::kF32, {t.numel()}, MemPool::kHost));
  be.synchronize();
  return v;
}

// One stage of the run: its model and schedule, and where it is in it.
struct Stage {
  std::unique_ptr<LlamaModel> model;
  std::vector<PipeOp> ops;
  size_t next = 0;
  int slots = 1;
  Tensor out;  // the last forward's hidden state, until its send
};

void expect_matches(const Case& c) {
  auto be = make_backend(DeviceKind::kCuda);
  const ModelConfig full = tiny();
  const float scale = 1.f / float(kMicro * kB * kT);

  MemoryLedger ref_ledger;
  LlamaModel ref(full, options(c), *be, ref_ledger);
  ref.init_weights(7);
  if (c.lora) {  // non-zero adapters (B too), so that every adapter takes a gradient
    std::vector<float> a(size_t(ref.lora_params().numel()));
    for (size_t i = 0; i < a.size(); ++i) a[i] = 0.05f * std::sin(0.37f * float(i));
    be->copy(Tensor(a.data(), DType::kF32, {int64_t(a.size())}, MemPool::kHost), ref.lora_params());
  }
  ref.zero_grads();
  double ref_loss = 0;
  for (int i = 0; i < kMicro; ++i) {
    fill(*be, ref.inputs(kB, kT), i);
    set_dropout(ref, i);
    ref_loss += ref.forward_backward(kB, kT, scale).loss_sum;
  }

  const StagePartition part =
      partition_layers(std::vector<double>(full.n_layers, 1.0), 0.5, 0.5, kStages);
  MemoryLedger ledger;
  std::vector<Stage> stages(kStages);
  for (int s = 0; s < kStages; ++s) {
    ModelConfig sc = full;
    sc.pp_begin = part.begin[s];
    sc.pp_end = part.begin[s + 1];
    ModelOptions o = options(c);
    stages[s].slots = o.pipeline_slots = std::min(kMicro, kStages - s);
    stages[s].model = std::make_unique<LlamaModel>(sc, o, *be, ledger);
    stages[s].ops = one_f_one_b(kStages, s, kMicro);
    LlamaModel& m = *stages[s].model;
    for (const ShardPiece& p : stage_shard_pieces(full, sc.pp_begin, sc.pp_end, 1, 0))
      be->copy(ref.params().rows(p.full, p.count), m.params().rows(p.shard, p.count));
    if (c.lora)
      for (const ShardPiece& p : lora_stage_pieces(ref.lora_layout(), m.lora_layout()))
        be->copy(ref.lora_params().rows(p.full, p.count), m.lora_params().rows(p.shard, p.count));
    m.zero_grads();
  }

  // Hidden states and gradients in flight, by (receiving stage, micro-batch), in device memory.
  const int64_t elems = kB * kT * full.dim;
  std::map<std::pair<int, int>, Buffer> acts, grads;
  auto post = [&](std::map<std::pair<int, int>, Buffer>& box, int to, int micro, const Tensor& t) {
    Buffer b(*be, ledger, MemCategory::kComm, MemPool::kDevice, size_t(elems) * dtype_size(c.act));
    be->copy(t.view({elems}), b.view(c.act, {elems}));
    box.emplace(std::pair{to, micro}, std::move(b));
  };
  double loss = 0;
  for (bool progress = true; progress;) {
    progress = false;
    for (int s = 0; s < kStages; ++s) {
      Stage& st = stages[s];
      LlamaModel& m = *st.model;
      for (; st.next < st.ops.size(); ++st.next, progress = true) {
        const PipeOp op = st.ops[st.next];
        const int slot = op.micro % st.slots;
        if (op.kind == PipeOpKind::kRecvActivation) {
          auto it = acts.find({s, op.micro});
          if (it == acts.end()) break;  // the previous stage has not sent it yet
          const Tensor in = m.stage_input(slot, kB, kT);
          be->copy(it->second.view(c.act, {elems}), in.view({elems}));
          acts.erase(it);
        } else if (op.kind == PipeOpKind::kForward) {
          fill(*be, m.stage_inputs(slot, kB, kT), op.micro);
          set_dropout(m, op.micro);
          st.out = m.stage_forward(slot, kB, kT);
        } else if (op.kind == PipeOpKind::kSendActivation) {
          post(acts, s + 1, op.micro, st.out);
        } else if (op.kind == PipeOpKind::kRecvGradient) {
          if (!grads.count({s, op.micro})) break;
        } else if (op.kind == PipeOpKind::kBackward) {
          Tensor d_out;
          if (s + 1 < kStages) d_out = grads.at({s, op.micro}).view(c.act, {elems});
          set_dropout(m, op.micro);
          loss += m.stage_backward(slot, kB, kT, scale, d_out).loss_sum;
          if (s + 1 < kStages) grads.erase({s, op.micro});
        } else {  // kSendGradient
          post(grads, s - 1, op.micro, m.stage_input_grad(kB, kT));
        }
      }
    }
  }
  for (const Stage& st : stages) ASSERT_EQ(st.next, st.ops.size()) << "a schedule is stuck";
  // The stages' micro-batches accumulated in the schedule's order (tests/tolerance.h).
  const double tol = test::reorder_tolerance(test::reduction_chain(full, kT, kMicro * kB));
  EXPECT_NEAR(loss, ref_loss, tol * std::abs(ref_loss));

  const std::vector<float> ref_grads = to_host(*be, c.lora ? ref.lora_grads() : ref.grads());
  for (int s = 0; s < kStages; ++s) {
    LlamaModel& m = *stages[s].model;
    const std::vector<ShardPiece> pieces =
        c.lora ? lora_stage_pieces(ref.lora_layout(), m.lora_layout())
               : stage_shard_pieces(full, m.config().pp_begin, m.config().stage_end(), 1, 0);
    const std::vector<float> g = to_host(*be, c.lora ? m.lora_grads() : m.grads());
    test::expect_pieces_match(pieces, g.data(), ref_grads.data(), int64_t(ref_grads.size()), tol,
                              "stage " + std::to_string(s) + ": ");
  }
}

TEST(CudaPipelineStages, OneFOneBMatchesTheWholeModel) { expect_matches({}); }

TEST(CudaPipelineStages, CheckpointPlacementsOnTheCopyStream) {
  expect_matches({Checkpointing::kFull, {.every = 2, .host_layers = 1}});
  expect_matches(
      {Checkpointing::kSelective, {.every = 1, .host_layers = CheckpointPlacement::kAll}});
  expect_matches({Checkpointing::kFull, {.every = 2, .host_layers = 1}, DType::kBF16});
}

TEST(CudaPipelineStages, LoraAdaptersWithDropout) {
  expect_matches({Checkpointing::kNone, {}, DType::kF32, true});
  expect_matches({Checkpointing::kFull, {.every = 2, .host_layers = 1}, DType::kBF16, true});
}

}  // namespace
}  // namespace shardlm
