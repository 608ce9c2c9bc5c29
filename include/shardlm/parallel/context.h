// Context parallelism: every sequence is split over the P ranks of a cp group (the load-balanced
// split of plan/context_layout.h), so each rank holds and computes only T / P tokens of every
// activation. Everything but attention is per token and runs on the local shard unchanged (the
// model's RMSNorm, MLP, embeddings, loss); ContextParallel is the model's AttentionCore:
//
//   ulysses: an all-to-all turns sequence shards into head shards (the whole sequence, Hq / P
//            query heads and the kv heads they read, replicated when Hkv < P), the attention
//            kernel runs locally, the inverse all-to-all returns the output;
//   ring:    each rank keeps its queries and passes key/value blocks around the ring, sending
//            the next block while computing on the current one and merging block results with
//            the online softmax; backward passes k, v and the accumulating dk, dv around;
//   hybrid:  Ulysses inside groups of U ranks, ring across the P / U groups.
//
// Document masking works under every kind: seg_start holds full-row indices. shard() cuts each
// micro-batch's group document starts from the loader's full rows once, into a device buffer
// (what the Ulysses group attends) and a host one (which ring blocks to launch, the FLOP
// count), one of each per micro-batch in flight (the host one in two halves used in turn, so
// that cutting the next micro-batch never waits for a device one behind): attention never
// reads them back from the device nor gathers them. Head packing and token reordering around an
// all-to-all are one Backend::copy_blocks each. Backward redoes the forward's all-to-alls of out
// and dout, and of q, k, v unless the core keeps each layer's gathered q, k, v (kept_sets > 0,
// parallel.cp_keep_gathered): then the forward gathers into a set per layer (one set when full
// checkpointing recomputes each layer's forward just before its backward) and the backward
// reads it if it still holds that layer (else it gathers again). Without kept sets the core
// holds no per-layer state, so activation checkpointing applies to it unchanged.
// backward() uses the caller's dq as scratch before it writes the result there.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "shardlm/backend/backend.h"
#include "shardlm/comm/communicator.h"
#include "shardlm/model/attention_core.h"
#include "shardlm/model/llama.h"
#include "shardlm/parallel/context_groups.h"
#include "shardlm/plan/context_layout.h"

namespace shardlm {

// What this rank's core did since reset_stats(): every forward() counts, the recomputing ones
// of activation checkpointing included.
struct CpStats {
  double attention_flops = 0;  // forward attention FLOPs (visible pairs counted)
  int64_t bytes_sent = 0;      // bytes sent (all-to-all, all-gather, ring sends)
};

class ContextParallel final : public AttentionCore {
 public:
  // groups: the cp group (its rank is the cp coordinate) and its Ulysses and ring sub-groups
  // for the layout's U, which must outlive the core. B: rows per micro-batch; the layout's T:
  // full row length.
  // act: the activation dtype of q, k, v, out and their gradients (every float buffer here).
  // slots: micro-batches in flight at once (a pipeline stage's slots), each sharded into its own.
  // kept_sets: layer sets of gathered q, k, v kept per slot for the backward (cp_kept_sets).
  ContextParallel(const ModelConfig& cfg, const ContextLayout& layout, int64_t B,
                  const ContextGroups& groups, Backend& backend, MemoryLedger& ledger,
                  DType act = DType::kF32, int slots = 1, int kept_sets = 0);
  ~ContextParallel() override;

  const ContextLayout& layout() const { return L_; }
  int64_t local_len() const { return L_.local(); }

  // Views of the full rows [B * T] (host pool) for the data loader to fill.
  BatchInputs full_inputs(int64_t B);
  // This rank's Tl tokens of each of B full rows, cut on the host into `local_host` (B * Tl
  // host rows: tokens, targets, positions, seg_start) for the caller to send up to `local`, the
  // model's inputs (the trainer's InputStaging: no host wait); and the group's document starts
  // into `slot`'s buffers, sent to the device with copy_async: attention on local.seg_start
  // reads them until another micro-batch is sharded into the same slot. The host buffers come
  // in two halves used in turn (kCpHostHalves), so the host waits only where the copies out of
  // the half it writes, two micro-batches back, have not run yet.
  void shard(const BatchInputs& full, const BatchInputs& local_host, const BatchInputs& local,
             int64_t B, int slot = 0);

  // Every layer alike: the core keeps no per-layer state. Document spans are never given to a
  // core that sees shards of rows (AttentionCore); seg_start's full-row indices describe them.
  void forward(int layer, const Tensor& q, const Tensor& k, const Tensor& v,
               const Tensor& seg_start, const DocumentSpans& docs, const Tensor& out,
               const Tensor& lse) override;
  void backward(int layer, const Tensor& q, const Tensor& k, const Tensor& v,
                const Tensor& seg_start, const DocumentSpans& docs, const Tensor& out,
                const Tensor& lse, const Tensor& dout, const Tensor& dq, const Tensor& dk,
                const Tensor& dv) override;

  const CpStats& stats() const { return stats_; }
  void reset_stats() { stats_ = {}; }

  // The backend's attention scratch for the shapes the core runs (plan/context_layout.h).
  static int64_t kernel_workspace_bytes(const Backend& backend, const ModelConfig& cfg,
                                        const ContextLayout& layout, int64_t B);

 private:
  // Views of the Ulysses buffers for B rows: the group sequence with this member's heads.
  struct Group {
    Tensor q, k, v, dk, dv, seg;
  };
  // The group tensors of `layer`'s micro-batch in `slot`: q, k, v in the layer's kept set, or
  // in the one set of gathered tensors when none are kept.
  Group group(int64_t B, int slot, int layer) const;
  int kept_index(int slot, int layer) const { return slot * kept_sets_ + layer % kept_sets_; }
  // The group's q, k and v (the all-to-alls forward and backward start with), with the slot's
  // document starts.
  Group gather(const Tensor& q, const Tensor& k, const Tensor& v, int slot, int layer);
  // The slot shard() filled for the micro-batch whose local document starts are seg_start.
  int slot_of(const Tensor& seg_start) const;
  // A view of the named cp_buffers() buffer (checked to fit), of the activation dtype or `dtype`.
  Tensor buf(const char* name, Shape shape) const { return buf(name, shape, act_); }
  Tensor buf(const char* name, Shape shape, DType dtype) const;
  // Where member u's heads of a tensor with H heads, Hg per member, sit (replicated kv heads:
  // `rep` members read each).
  struct HeadSplit {
    int64_t rep, row;  // members per distinct head group; elements of one token's Hg heads
  };
  HeadSplit head_split(int64_t H, int64_t Hg, bool kv) const;
  void to_group(const Tensor& x, int64_t H, int64_t Hg, bool kv, const Tensor& xg);
  void from_group(const Tensor& xg, int64_t H, int64_t Hg, bool kv, const Tensor& x);
  // seg: the group's document starts on the device, seg_h the same on the host ([B, G]).
  void attend_forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& seg,
                      const int32_t* seg_h, const Tensor& out, const Tensor& lse);
  void attend_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& seg,
                       const int32_t* seg_h, const Tensor& out, const Tensor& lse,
                       const Tensor& dout, const Tensor& dq, const Tensor& dk, const Tensor& dv);
  void ring_forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& seg,
                    const int32_t* seg_h, const Tensor& out, const Tensor& lse);
  void ring_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& seg,
                     const int32_t* seg_h, const Tensor& out, const Tensor& lse, const Tensor& dout,
                     const Tensor& dq, const Tensor& dk, const Tensor& dv);
  Workspace workspace() const;
  // The document starts a kernel call gets: none where every row of the group is one document
  // (the causal mask alone says the same; cuDNN's fused attention takes only such calls), else
  // the group's seg [B, G], or rows [row0, row0 + n) of it as [1, n].
  Tensor kernel_seg(const Tensor& seg) const;
  Tensor kernel_seg_rows(const Tensor& seg, int64_t row0, int64_t n) const;
  // The packed documents of a slot's gathered whole rows as spans (shard(), Ulysses alone).
  DocumentSpans document_spans(const Tensor& seg_h, int slot);
  // [B, G] i32: a slot's group document starts on the host (half `half` of its two; by
  // default the one holding its current micro-batch), and (Ulysses) on the device.
  Tensor seg_host(int slot, int64_t B) const { return seg_host(slot, B, slot_half_[size_t(slot)]); }
  Tensor seg_host(int slot, int64_t B, int half) const;
  Tensor seg_device(int slot, int64_t B) const;

  ModelConfig cfg_;
  ContextLayout L_;
  // The sliding window of the layer being run (ModelConfig::window_of_layer; 0: none) and the
  // model's attention soft cap (attn_softcap; 0: none), set by forward and backward: every
  // kernel call and skip decision of that layer reads them.
  int64_t window_ = 0;
  float softcap_ = 0.0f;
  bool one_document_ = false;  // the slot being run: every row of its group is one document
  DocumentSpans spans_;        // the slot being run: its documents as spans, or none
  int64_t max_B_;
  DType act_;
  int slots_;
  int kept_sets_;
  std::vector<const void*> slot_seg_;       // [slots] the local seg_start each slot was sharded for
  std::vector<uint8_t> slot_one_document_;  // [slots] every group row one document (seg all 0)
  std::vector<DocumentSpans> slot_spans_;   // [slots] Ulysses alone: packed documents as spans
  std::vector<int> kept_layer_;             // [slots * kept_sets] the layer a kept set holds, or -1
  // The host buffers copied up come in kCpHostHalves halves used in turn, each with the fence
  // of the last copy_async out of it (0: none): the host writes a half again only after that
  // copy has run. slot_half_ [slots]: the half of each slot's host document starts that holds
  // its current micro-batch (the one attention reads); slot_seg_fence_ [slots * halves];
  // spans_fence_ [halves] and next_spans_half_: Ulysses' host document spans, every slot's.
  std::vector<int> slot_half_;
  std::vector<uint64_t> slot_seg_fence_;
  std::vector<uint64_t> spans_fence_;
  int next_spans_half_ = 0;
  Communicator& cp_;
  Communicator* ulysses_ = nullptr;  // the all-to-all group (size U)
  Communicator* ring_ = nullptr;     // the ring (size R)
  Backend& be_;
  std::vector<std::pair<std::string, Buffer>> buffers_;  // cp_buffers(), by name
  CpStats stats_;
};

}  // namespace shardlm
