// Internal to the CPU flash attention (attention_common.cpp, attention_forward.cpp,
// attention_backward.cpp): the block's dims, tile masks and tile ranges, per-thread scratch
// carving, and the CPU's own checks and workspace sizes the forward and backward share. Masks
// compare full-row indices, so blocks serve ring attention; nothing here allocates or spawns
// threads, and nothing outside the attention files may include it. q, k, v and their gradients
// are f32 or bf16 in memory (element.h) but always f32 in the tiles: packing converts.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string_view>

#include "kernels/cpu/element.h"
#include "shardlm/backend/backend.h"
#include "shardlm/core/tensor.h"

namespace shardlm::cpu::attn {

using shardlm::first_visible_key;  // the mask's rule, shared with the other backends

inline constexpr int64_t kTileQ = 64;  // queries per tile
inline constexpr int64_t kTileK = 64;  // keys per tile
inline constexpr size_t kScratchAlign = 64;
inline constexpr float kLog2e = 1.44269504088896341f;

// ---- shapes, masks, scratch -------------------------------------------------------------------

// Tiles are cut from each block's own start; masks compare full-row indices (local index plus
// the block's offset), so a block behaves exactly like its slice of the full attention.
struct AttnDims {
  int64_t B, Tq, Tk, Hq, Hkv, Dh;
  int64_t q_offset;  // full-row index of query 0
  int64_t k_offset;  // full-row index of key 0
  int64_t window;    // sliding window in keys (0: none): query t sees keys after t - window
  float softcap;     // attention logit soft-capping of the scaled scores (0: none)
  int64_t group() const { return Hq / Hkv; }
  int64_t q_row() const { return Hq * Dh; }    // elements between tokens of q, out, dout, dq
  int64_t kv_row() const { return Hkv * Dh; }  // elements between tokens of k, v, dk, dv
  int64_t q_tiles() const { return (Tq + kTileQ - 1) / kTileQ; }
  int64_t k_tiles() const { return (Tk + kTileK - 1) / kTileK; }
};

enum class TileMask { kNone, kPartial, kFull };

// Which (query, key) pairs of queries [q0, q0+nq) and keys [k0, k0+nk) are visible, all full-row
// indices; seg [nq] are the queries' document starts. Query t sees key s iff
// first_visible_key(seg[t], t, window) <= s <= t. seg nullptr: every query's document starts at
// 0 (one document per row).
inline TileMask classify_tile(const int32_t* seg, int64_t q0, int64_t nq, int64_t k0, int64_t nk,
                              int64_t window) {
  const int64_t k_last = k0 + nk - 1;
  bool any = false;
  bool all = true;
  for (int64_t i = 0; i < nq; ++i) {
    const int64_t start = first_visible_key(seg ? seg[i] : 0, q0 + i, window);
    const int64_t lo = std::max<int64_t>(start, k0);
    const int64_t hi = std::min(q0 + i, k_last);
    any = any || lo <= hi;
    all = all && start <= k0 && k_last <= q0 + i;
  }
  return !any ? TileMask::kNone : all ? TileMask::kFull : TileMask::kPartial;
}

// Key tiles of the block that can hold keys visible to queries [q0, q0+nq) (full-row indices):
// from the earliest first visible key to the last query, clipped to the block; may be empty.
// seg nullptr: one document per row.
inline void key_tile_range(const AttnDims& d, const int32_t* seg, int64_t q0, int64_t nq,
                           int64_t* kt_begin, int64_t* kt_end) {
  int64_t first = q0;
  for (int64_t i = 0; i < nq; ++i)
    first = std::min(first, first_visible_key(seg ? seg[i] : 0, q0 + i, d.window));
  const int64_t lo = std::max<int64_t>(first - d.k_offset, 0);
  const int64_t hi = std::min(q0 + nq - 1 - d.k_offset, d.Tk - 1);
  *kt_begin = lo > hi ? 0 : lo / kTileK;
  *kt_end = lo > hi ? 0 : hi / kTileK + 1;
}

// The first query tile of the block that can see key k0 (full-row index): queries before a key
// never see it.
inline int64_t first_query_tile(const AttnDims& d, int64_t k0) {
  return std::max<int64_t>(k0 - d.q_offset, 0) / kTileQ;
}

// One past the last query tile of the block that can see a key of [k0, k0 + nk) (full-row
// indices): under a sliding window, queries window or more after the last key never see it.
inline int64_t end_query_tile(const AttnDims& d, int64_t k0, int64_t nk) {
  if (d.window == 0) return d.q_tiles();
  const int64_t last = k0 + nk - 1 + d.window - 1 - d.q_offset;  // last query that sees a key
  return last < 0 ? 0 : std::min(last / kTileQ + 1, d.q_tiles());
}

// Hands out 64-byte aligned float arrays from a thread's slot; with a null base it only counts,
// so the workspace query and the kernels share one layout.
class ScratchCarver {
 public:
  explicit ScratchCarver(std::byte* base) : base_(base) {}
  float* floats(int64_t n) { return static_cast<float*>(take(n * sizeof(float))); }
  int32_t* ints(int64_t n) { return static_cast<int32_t*>(take(n * sizeof(int32_t))); }
  size_t used() const { return used_; }

 private:
  void* take(int64_t bytes) {
    const size_t offset = used_;
    used_ += (static_cast<size_t>(bytes) + kScratchAlign - 1) / kScratchAlign * kScratchAlign;
    return base_ == nullptr ? nullptr : base_ + offset;
  }

  std::byte* base_;
  size_t used_ = 0;
};

// Per-query arrays are kTileQ long and rows of score tiles are kTileQ or kTileK floats apart, so
// the softmax loops run whole 8-lane vectors past nq / nk; the extra lanes are never read back.

// Copies `rows` rows of Dh elements (f32 or bf16), `stride` apart, into a dense [rows, Dh] f32
// tile. Tile products read operands from dense tiles: rows Hq * Dh elements apart (a power of
// two, often 2-8 KiB) would fall into a few L1 sets and evict each other.
template <typename T>
void pack_rows(const T* src, int64_t stride, int64_t rows, int64_t Dh, float* dst) {
  for (int64_t r = 0; r < rows; ++r) load_row(src + r * stride, Dh, dst + r * Dh);
}

// First visible keys of queries [q0, q0 + nq) (full-row indices; document starts, 0 where seg is
// nullptr: one document per row, moved up by the window), padded so that the extra lanes see no
// key.
inline void pad_seg(const int32_t* seg, int64_t q0, int64_t nq, int64_t window, int32_t* padded) {
  for (int64_t i = 0; i < nq; ++i)
    padded[i] = static_cast<int32_t>(first_visible_key(seg ? seg[i] : 0, q0 + i, window));
  std::fill(padded + nq, padded + kTileQ, std::numeric_limits<int32_t>::max());
}

template <typename Scratch>
size_t scratch_bytes(int64_t Dh) {
  ScratchCarver counter(nullptr);
  Scratch s(counter, Dh);
  return counter.used();
}

// ---- defined in attention_common.cpp -----------------------------------------------------------

// The dims of q [B, Tq, Hq, Dh] and k [B, Tk, Hkv, Dh] (shapes checked by the Backend entry
// point), after the checks that are the CPU kernels' own: the blocks' full-row indices fit the
// i32 lanes, and every document start seg_start[b, t] (read here) lies in [0, q_offset + t]
// (an empty seg_start: one document per row). window: the sliding window (0: none); softcap:
// the scores' soft cap (0: none).
AttnDims check_attention(const Tensor& q, const Tensor& k, const Tensor& seg_start,
                         int64_t q_offset, int64_t k_offset, int64_t window, float softcap,
                         std::string_view op);

// ---- defined in attention_forward.cpp and attention_backward.cpp -------------------------------

// Bytes of workspace for `threads` threads: one tile-scratch slot each, and for the backward
// D = rowsum(dO * O) [B, Hq, Tq] ahead of the slots.
size_t forward_workspace_bytes(const AttnDims& d, int threads);
size_t backward_workspace_bytes(const AttnDims& d, int threads);

}  // namespace shardlm::cpu::attn
