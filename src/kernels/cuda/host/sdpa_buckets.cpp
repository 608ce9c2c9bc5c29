// The SDPA problems and buckets of the CUDA backend's attention, host-only (sdpa_buckets.h).
#include "kernels/cuda/host/sdpa_buckets.h"

#include <algorithm>
#include <set>

#include "shardlm/core/buffer.h"
#include "shardlm/core/check.h"

namespace shardlm::cuda {

namespace {

int64_t pow2_at_least(int64_t n) {
  int64_t p = 1;
  while (p < n) p <<= 1;
  return p;
}

int64_t pow2_at_most(int64_t n) {
  int64_t p = 1;
  while (p * 2 <= n) p <<= 1;
  return p;
}

bool head_dim_taken(int64_t Dh) { return Dh % 8 == 0 && Dh > 0 && Dh <= 256; }

// The windows a run's graphs carry: 0 and each positive one, without repeats.
std::set<int64_t> with_none(std::span<const int64_t> windows) {
  std::set<int64_t> w{0};
  for (int64_t x : windows)
    if (x > 0) w.insert(x);
  return w;
}

}  // namespace

std::optional<SdpaShape> sdpa_shape(int64_t B, int64_t Tq, int64_t Tk, int64_t Hq, int64_t Hkv,
                                    int64_t Dh, int64_t q_offset, int64_t k_offset,
                                    int64_t window) {
  if (B == 0 || Tq == 0 || Tk == 0 || Hq == 0 || !head_dim_taken(Dh)) return std::nullopt;
  if (q_offset == k_offset && Tq == Tk) {
    SdpaShape s{B, Tq, Tk, Hq, Hkv, Dh, true};
    s.window = window < Tq ? window : 0;  // a window as long as the block masks nothing
    return s;
  }
  const bool inside_window = window == 0 || q_offset + Tq - 1 - k_offset < window;
  if (k_offset + Tk <= q_offset + 1 && inside_window)
    return SdpaShape{B, Tq, Tk, Hq, Hkv, Dh, false};
  return std::nullopt;
}

std::optional<RaggedGroups> ragged_groups(int64_t B, int64_t T, int64_t Hq, int64_t Hkv, int64_t Dh,
                                          int64_t count, int64_t max_len, int64_t window) {
  constexpr int64_t kI32Max = 2147483647;
  if (B == 0 || T == 0 || Hq == 0 || !head_dim_taken(Dh) || count < 1) return std::nullopt;
  if (B * T * std::max(Hq, Hkv) * Dh > kI32Max) return std::nullopt;
  const int64_t len = std::min(std::max<int64_t>(64, pow2_at_least(max_len)), T);
  const int64_t docs = std::min(pow2_at_most(pow2_at_least(B) * T / len), B * T);
  const int64_t w = window > 0 && window < len ? window : 0;
  return RaggedGroups{SdpaShape{B, T, T, Hq, Hkv, Dh, true, docs, len, w},
                      (count + docs - 1) / docs};
}

std::vector<SdpaShape> row_buckets(int64_t B, int64_t T, int64_t Hq, int64_t Hkv, int64_t Dh,
                                   std::span<const int64_t> windows, bool ragged) {
  std::set<SdpaShape> out;
  const std::set<int64_t> ws = with_none(windows);
  for (int64_t w : ws)
    if (const auto s = sdpa_shape(B, T, T, Hq, Hkv, Dh, 0, 0, w)) out.insert(*s);
  // Every length bucket ragged_groups can pick: max_len 1 .. T lands on 64, 128, ... or T.
  for (int64_t len = 64; ragged; len *= 2) {
    for (int64_t w : ws)
      if (const auto r = ragged_groups(B, T, Hq, Hkv, Dh, 1, std::min(len, T), w))
        out.insert(r->shape);
    if (len >= T) break;
  }
  return {out.begin(), out.end()};
}

std::vector<SdpaShape> block_buckets(int64_t B, int64_t Tq, int64_t Tk, int64_t Hq, int64_t Hkv,
                                     int64_t Dh, std::span<const int64_t> windows) {
  std::set<SdpaShape> out;
  for (int64_t w : with_none(windows))
    if (const auto s = sdpa_shape(B, Tq, Tk, Hq, Hkv, Dh, 0, 0, w)) out.insert(*s);
  // A key block wholly in the past: unmasked whatever the window (one that cuts it is the own
  // kernel's), the same graph at every offset.
  if (const auto s = sdpa_shape(B, Tq, Tk, Hq, Hkv, Dh, Tk, 0)) out.insert(*s);
  return {out.begin(), out.end()};
}

size_t ragged_run_bytes(const SdpaShape& s) {
  if (s.docs == 0) return 0;
  return align_up(size_t(s.docs) * 4) + 3 * align_up(size_t(s.docs + 1) * 4) +
         align_up(size_t(s.B * s.Tq * s.Hq) * sizeof(float));
}

size_t planned_workspace(
    std::span<const SdpaShape> buckets, size_t own_bytes,
    const std::function<std::optional<size_t>(const SdpaShape&)>& graph_bytes) {
  size_t most = align_up(own_bytes);
  for (const SdpaShape& s : buckets)
    if (const std::optional<size_t> need = graph_bytes(s))
      most = std::max(most, ragged_run_bytes(s) + align_up(*need));
  return most;
}

std::string ragged_unsupported(int sm, int64_t version) {
  if (sm <= 0) return {};
  if (sm < 90 && version < 91801)
    return fmt::format(
        "cuDNN {} takes packed documents (THD) only from SM90 (this GPU is SM{}; 9.18.1 and "
        "newer take them on SM80+)",
        version, sm);
  if ((sm / 10 == 8 || sm / 10 == 12) && version >= 91801)
    return fmt::format(
        "cuDNN {}'s backward refuses packed documents' ragged softmax stats on SM{} (SM8x and "
        "SM12x)",
        version, sm);
  return {};
}

}  // namespace shardlm::cuda
