// The cuDNN SDPA problems the CUDA backend's attention can meet, on the host only (no CUDA or
// cuDNN header, so that the CPU build unit-tests it): SdpaShape, how a call maps onto one (a
// whole row, a context-parallel block, packed documents as ragged sequences in groups), the
// finite bucket set a run plans (every graph it may execute, sliding windows included, built
// before the first step), the workspace planned over that set, and which GPUs and cuDNN versions
// take packed documents at all.
#pragma once

#include <compare>
#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <vector>

namespace shardlm::cuda {

// One bf16 SDPA problem in the Backend's layouts: q [B, Tq, Hq, Dh]; k, v [B, Tk, Hkv, Dh];
// out like q; lse [B, Hq, Tq] f32, the natural-log log-sum-exp of the scaled scores (cuDNN's
// softmax stats: the units and layout the ring and merge read), except for packed documents,
// whose stats are token-major [B * T, Hq] (the caller transposes; see RaggedIndex). Scale
// 1/sqrt(Dh). causal: query t sees key s iff s <= t (a whole row, or the diagonal block of one,
// Tq == Tk); else every key. Packed documents (docs > 0, causal, Tq == Tk = T): the B rows'
// tokens are `docs` sequences of at most max_len tokens each (cuDNN's ragged layout), each causal
// on its own, described on the device by a RaggedIndex; docs and max_len are buckets
// (launch_ragged_index pads the rest with empty sequences), so that few graphs serve every
// batch. window > 0 (causal only): a sliding window on top, query t sees key s iff also
// t - s < window (the frontend's diagonal band left bound, top-left aligned: column + window >
// row, transformers' convention); 0: none.
struct SdpaShape {
  int64_t B = 0, Tq = 0, Tk = 0, Hq = 0, Hkv = 0, Dh = 0;
  bool causal = true;
  int64_t docs = 0, max_len = 0;
  int64_t window = 0;
  auto operator<=>(const SdpaShape&) const = default;
};

// cuDNN's problem for a bf16 call without document starts: a whole causal row or a block on the
// diagonal (causal, with the sliding window as a band where it cuts the block), a key block
// wholly before the queries and wholly inside their window (every key visible); nullopt for
// anything else (a block cut by the diagonal or by the window's edge, one after the queries,
// empty tensors, a head dim cuDNN does not take).
std::optional<SdpaShape> sdpa_shape(int64_t B, int64_t Tq, int64_t Tk, int64_t Hq, int64_t Hkv,
                                    int64_t Dh, int64_t q_offset, int64_t k_offset,
                                    int64_t window = 0);

// Packed documents as cuDNN ragged problems: B rows of T tokens holding `count` documents of at
// most max_len tokens run as `groups` calls of the same graph, each over `shape.docs` documents
// in order (the last group's tail padded with empty sequences) of at most shape.max_len tokens.
// The length bucket is a power of two from 64 (at most T); the document bucket is fixed by it,
// pow2_at_most(pow2(B) * T / len), so that docs x max_len stays within one document per row's
// pow2(B) x T (cuDNN sizes parts of its backward workspace by docs x max_len, not by the tokens
// there are: on an H100 with cuDNN 9.14 a batch of a few long documents needed more than one
// document per row) and each length has one graph: rows packed full hold about that many
// documents, so the padding is a few empty sequences, and a batch of more runs in several calls
// (documents are independent in attention: the groups' outputs are the one call's). window: the
// layer's sliding window, kept where it is shorter than the length bucket (a window that masks
// nothing in a document runs the same).
struct RaggedGroups {
  SdpaShape shape;
  int64_t groups = 1;
};
// nullopt where cuDNN cannot express the problem: a head dim it does not take, or element
// offsets past the i32 the index holds.
std::optional<RaggedGroups> ragged_groups(int64_t B, int64_t T, int64_t Hq, int64_t Hkv, int64_t Dh,
                                          int64_t count, int64_t max_len, int64_t window = 0);

// The finite set of graphs a run's whole-row attention can execute: the dense row for each
// window, and with `ragged` the packed-document bucket of each length (64, 128, ... up to T)
// for each window that cuts it. windows: the layers' sliding windows (0 = none; 0 is always
// added, since short documents drop a window). Sorted, without repeats.
std::vector<SdpaShape> row_buckets(int64_t B, int64_t T, int64_t Hq, int64_t Hkv, int64_t Dh,
                                   std::span<const int64_t> windows, bool ragged);
// The same for context parallelism's blocks of Tq queries against Tk keys: the diagonal block
// for each window, and a block wholly in the past (unmasked).
std::vector<SdpaShape> block_buckets(int64_t B, int64_t Tq, int64_t Tk, int64_t Hq, int64_t Hkv,
                                     int64_t Dh, std::span<const int64_t> windows);

// The bytes at the workspace's start of a ragged call (cuDNN's own workspace follows): the
// RaggedIndex of one group and the token-major stats [B * T, Hq] f32 of them all; 0 for a dense
// shape.
size_t ragged_run_bytes(const SdpaShape& s);

// The workspace a run plans for its attention: the largest over `buckets` of what `graph_bytes`
// (cuDNN's get_workspace_size of the shape's forward and backward graphs, the larger; nullopt
// where cuDNN declines the shape) says, plus ragged_run_bytes, and at least `own_bytes` (the
// own kernel's scratch). No formula caps it: the plan holds what the graphs ask, and a call runs
// on cuDNN iff its graph's need fits what was planned.
size_t planned_workspace(std::span<const SdpaShape> buckets, size_t own_bytes,
                         const std::function<std::optional<size_t>(const SdpaShape&)>& graph_bytes);

// Why cuDNN takes no packed documents (ragged sequences) on a GPU of compute capability `sm`
// (e.g. 90) with cuDNN `version` (cudnnGetVersion(), e.g. 91801), empty when it does. The
// frontend (1.32) refuses the THD layout below SM90 before cuDNN 9.18.1, and from 9.18.1 the
// backward's ragged (token-major) softmax stats on SM8x and SM12x. sm 0: unknown, no refusal.
std::string ragged_unsupported(int sm, int64_t version);

}  // namespace shardlm::cuda
