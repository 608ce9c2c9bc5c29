// How context parallelism splits every sequence over the P ranks of a cp group, and which
// buffers its attention needs. Pure arithmetic over model/config: the attention cores
// (parallel/context) allocate from these tables and the planner predicts from them.
//
// The group is U x R ranks: Ulysses all-to-all inside groups of U consecutive ranks, a ring
// across the R groups (ulysses: U = P; ring: U = 1; hybrid: both > 1). cp rank c = g * U + u
// (g: ring position, u: place in the Ulysses group).
//
// Load-balanced ("zig-zag") split: a row of T tokens is cut into 2R chunks of C = T / (2R);
// ring position g owns chunks g and 2R-1-g (one early, one late: every ring position does the
// same causal attention work). Each chunk is cut again into U pieces of T / (2P); rank (g, u)
// holds piece u of both its chunks: its Tl = T / P local tokens, in that order. The Ulysses
// all-to-all turns the U ranks' local tokens into the group's 2 chunks ("group sequence",
// T / R tokens in full-row order within each chunk) with a 1/U share of the heads.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "shardlm/core/ledger.h"
#include "shardlm/model/config.h"
#include "shardlm/model/layout.h"

namespace shardlm {

enum class CpKind { kUlysses, kRing, kHybrid };
std::string_view cp_kind_name(CpKind kind);
// "ulysses" | "ring" | "hybrid"; throws Error(kConfig) naming parallel.cp_kind otherwise.
CpKind parse_cp_kind(std::string_view name);

struct ContextLayout {
  int64_t T = 1;  // full row length
  int P = 1;      // ranks in the cp group
  int U = 1;      // Ulysses group size
  int R() const { return P / U; }
  int64_t local() const { return T / P; }          // tokens per rank
  int64_t chunk() const { return T / (2 * R()); }  // C: a ring chunk
  int64_t piece() const { return T / (2 * P); }    // a rank's share of one chunk
  int64_t group_len() const { return T / R(); }    // the group sequence: 2 chunks
  // Full-row index of local token i of cp rank c.
  int64_t global_index(int c, int64_t i) const;
  // Full-row index of token j of ring position g's group sequence.
  int64_t group_global_index(int g, int64_t j) const;
  // Index in the group sequence of local token i of Ulysses member u.
  int64_t group_index(int u, int64_t i) const;
  // Full-row index of the first token of ring position g's chunk half h (0: early, 1: late).
  int64_t chunk_start(int g, int h) const;
};

// The layout for P ranks of `kind`, with `ulysses` the requested all-to-all size for hybrid
// (0 = the largest that the heads allow, at most P / 2). Throws Error(kConfig) naming the
// keys (data.seq_len, parallel.cp, parallel.cp_ulysses, model.n_heads, model.n_kv_heads) when
// T is not a multiple of 2P or the heads do not split over U.
ContextLayout make_context_layout(const ModelConfig& cfg, int64_t T, int P, CpKind kind,
                                  int64_t ulysses);

// Heads each rank attends after the Ulysses all-to-all: Hq / U query heads and
// max(1, Hkv / U) kv heads (kv heads replicated when Hkv < U).
int64_t cp_q_heads(const ModelConfig& cfg, const ContextLayout& L);
int64_t cp_kv_heads(const ModelConfig& cfg, const ContextLayout& L);
// The first kv head Ulysses member u attends.
int64_t cp_kv_head_of(const ModelConfig& cfg, const ContextLayout& L, int u);

// The host buffers the core copies document starts up from come in two halves used in turn
// (per micro-batch slot for the starts, one pair for Ulysses' spans), as the trainer's input
// staging has two slots: the host rewrites a half only after the copy out of it two
// micro-batches back, so it waits only where the device is that far behind.
inline constexpr int kCpHostHalves = 2;

// One buffer of the context-parallel attention core: what it holds, its category, pool, bytes.
struct CpBuffer {
  std::string name;
  MemCategory category;
  MemPool pool;
  int64_t bytes;
};
// Every buffer the core allocates for micro-batches of B rows with activations of dtype `act`;
// kernel_ws_bytes is the backend's attention scratch for the shapes the core runs
// (cp_kernel_shapes); slots: micro-batches in flight at once (pipeline slots), each with its
// own document starts; kept_sets: layer sets of gathered q, k, v kept for the backward
// (cp_kept_sets), each slot's.
std::vector<CpBuffer> cp_buffers(const ModelConfig& cfg, const ContextLayout& L, int64_t B,
                                 int64_t kernel_ws_bytes, DType act, int slots = 1,
                                 int kept_sets = 0);
// Sets of one layer's gathered q, k, v the Ulysses core keeps per micro-batch in flight when
// the backward reuses the forward's (parallel.cp_keep_gathered): one per layer of the stage,
// or one when every layer's attention forward is recomputed just before its backward (full
// checkpointing); 0 when not kept or without an all-to-all group (U = 1).
int cp_kept_sets(const ContextLayout& L, bool keep, bool attention_recomputed, int stage_layers);
// The shapes the core runs its kernel on: B rows (1 for the ring's per-row blocks), Tq, Tk,
// heads; the workspace is the backend's query at these shapes.
struct CpKernelShape {
  int64_t B, Tq, Tk, Hq, Hkv, Dh;
  bool block;  // attention_block_* (ring) or attention_* (whole group sequence)
};
CpKernelShape cp_kernel_shape(const ModelConfig& cfg, const ContextLayout& L, int64_t B);

// Bytes one rank sends per layer for a micro-batch of B rows (forward, backward): the analytic
// communication volume of the core, activations of dtype `act`.
struct CpCommVolume {
  int64_t forward = 0, backward = 0;
  int64_t ring_forward = 0, ring_backward = 0;  // of which the ring's exchanges (overlapped)
};
// kept: the backward reuses the forward's gathered q, k, v (no all-to-all of them again).
CpCommVolume cp_comm_volume(const ModelConfig& cfg, const ContextLayout& L, int64_t B, DType act,
                            bool kept = false);

}  // namespace shardlm
