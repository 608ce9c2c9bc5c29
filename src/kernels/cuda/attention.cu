// Flash attention on CUDA cores in f32 arithmetic (bf16 or f32 storage): causal, grouped-query,
// document-masked, one query block against one key block (the full attention is the special
// case q_offset = k_offset = 0). O(T) memory: scores exist 32 at a time in registers.
//
// Forward: a thread block takes 16 queries of one (batch row, head); each warp owns 4 of them.
// Key/value tiles of 32 rows are staged in shared memory (keys padded to an odd row stride, so
// the 32 lanes reading 32 different key rows hit 32 different banks). Lane j scores key j of
// the tile, the warp reduces max and sum (online softmax), and every lane accumulates its
// columns d = lane + 32 i of the output.
//
// Backward (as FlashAttention-2, without atomics, so it is deterministic): delta = rowsum(dout *
// out); a dq kernel shaped like the forward, and a dk/dv kernel where each warp owns 4 keys and
// walks the query tiles of every query head of its kv group. Scores are recomputed from lse.
// Under Gemma 2's soft cap each scaled score is capped before the mask and softmax, and dS is
// multiplied by the cap's slope 1 - tanh^2.
#include <algorithm>
#include <cmath>
#include <type_traits>

#include "kernels/cuda/common.cuh"

namespace shardlm::cuda {
namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kQPerWarp = 4;
constexpr int kQTile = kWarps * kQPerWarp;  // queries per forward / dq block
constexpr int kKTile = 32;                  // keys per staged tile
constexpr int kKPerWarp = 4;
constexpr int kKBlock = kWarps * kKPerWarp;  // keys per dk/dv block
constexpr float kNegInf = -INFINITY;

struct Dims {
  int64_t B, Tq, Tk, Hq, Hkv, Dh, q_offset, k_offset, kbs;
  int64_t window;  // sliding window in keys, 0: none
  int32_t group;   // Hq / Hkv
  float scale;
  float softcap;  // attention logit soft-capping of the scaled scores, 0: none
};

Dims dims_of(const AttnArgs& a) {
  return Dims{a.B,
              a.Tq,
              a.Tk,
              a.Hq,
              a.Hkv,
              a.Dh,
              a.q_offset,
              a.k_offset,
              a.k_batch_stride,
              a.window,
              int32_t(a.Hq / a.Hkv),
              float(1.0 / std::sqrt(double(a.Dh))),
              a.softcap};
}

// A scaled score after Gemma 2's soft-capping (softcap * tanh(score / softcap); unchanged
// without a cap), and in slope its derivative with respect to the scaled score (1 - tanh^2).
__device__ __forceinline__ float capped(float score, const Dims& p, float& slope) {
  if (p.softcap <= 0.f) {
    slope = 1.f;
    return score;
  }
  const float t = tanhf(score / p.softcap);
  slope = 1.f - t * t;
  return p.softcap * t;
}

// The first key (full-row index) query t of row b sees: its document's start, or under a
// sliding window the key window - 1 before it if later (Backend's first_visible_key, the rule of
// transformers' sliding_window_overlay: kv_idx > q_idx - window). Every mask below compares
// keys against this one value, so the window costs nothing past it.
__device__ __forceinline__ int32_t seg_of(const int32_t* seg, const Dims& p, int64_t b, int64_t t) {
  const int64_t doc = seg == nullptr ? 0 : seg[b * p.Tq + t];
  const int64_t first = p.q_offset + t - p.window + 1;
  return int32_t(p.window > 0 && first > doc ? first : doc);
}

// Loads rows [r0, r0 + count) of one head of x [.., rows, H, Dh] into dst[r][d] with row stride
// `stride` (zeros past `limit`).
template <typename T>
__device__ __forceinline__ void stage_rows(float* dst, int stride, const T* x, int64_t base,
                                           int64_t r0, int count, int64_t limit, int64_t H,
                                           int64_t h, int64_t Dh) {
  for (int64_t idx = threadIdx.x; idx < int64_t(count) * Dh; idx += blockDim.x) {
    const int r = int(idx / Dh);
    const int64_t d = idx % Dh;
    const int64_t row = r0 + r;
    dst[r * stride + d] = row < limit ? load(x, base + (row * H + h) * Dh + d) : 0.f;
  }
}

// Loads the first visible keys of queries [t0, t0 + kQTile) into segs (INT_MAX past Tq), then,
// after a block barrier, gives the keys [s_lo, s_hi) that any of these queries can see.
__device__ __forceinline__ void query_tile_keys(const int32_t* seg, const Dims& p, int64_t b,
                                                int64_t t0, int* segs, int64_t& s_lo,
                                                int64_t& s_hi) {
  if (threadIdx.x < kQTile) {
    const int64_t t = t0 + threadIdx.x;
    segs[threadIdx.x] = t < p.Tq ? seg_of(seg, p, b, t) : 0x7fffffff;
  }
  __syncthreads();
  int seg_min = 0x7fffffff;
  for (int i = 0; i < kQTile; ++i) seg_min = min(seg_min, segs[i]);
  const int64_t t_last = min(p.Tq, t0 + kQTile) - 1;
  s_hi = min(p.Tk, p.q_offset + t_last - p.k_offset + 1);
  s_lo = max(int64_t(0), int64_t(seg_min) - p.k_offset);
}

__device__ __forceinline__ float dot_smem(const float* a, const float* b, int64_t Dh) {
  float acc = 0.f;
  for (int64_t d = 0; d < Dh; ++d) acc = fmaf(a[d], b[d], acc);
  return acc;
}

template <typename T, int MAXD>
__global__ void __launch_bounds__(kThreads)
    attention_forward_kernel(const T* q, const T* k, const T* v, const int32_t* seg, Dims p, T* out,
                             float* lse) {
  constexpr int R = MAXD / 32;
  extern __shared__ float smem[];
  const int64_t Dh = p.Dh;
  float* qs = smem;                                          // [kQTile][Dh]
  float* ks = qs + kQTile * Dh;                              // [kKTile][Dh + 1]
  float* vs = ks + kKTile * (Dh + 1);                        // [kKTile][Dh]
  float* ps = vs + kKTile * Dh;                              // [kWarps][kKTile]
  int* segs = reinterpret_cast<int*>(ps + kWarps * kKTile);  // [kQTile]

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t b = blockIdx.z, h = blockIdx.y, t0 = int64_t(blockIdx.x) * kQTile;
  const int64_t kvh = h / p.group;
  const int64_t q_base = b * p.Tq * p.Hq * Dh;
  const int64_t k_base = b * p.kbs;
  stage_rows(qs, int(Dh), q, q_base, t0, kQTile, p.Tq, p.Hq, h, Dh);
  int64_t s_lo, s_hi;
  query_tile_keys(seg, p, b, t0, segs, s_lo, s_hi);

  float m[kQPerWarp], l[kQPerWarp], acc[kQPerWarp][R];
#pragma unroll
  for (int i = 0; i < kQPerWarp; ++i) {
    m[i] = kNegInf;
    l[i] = 0.f;
#pragma unroll
    for (int r = 0; r < R; ++r) acc[i][r] = 0.f;
  }

  for (int64_t s0 = s_lo; s0 < s_hi; s0 += kKTile) {
    __syncthreads();  // the previous tile is no longer read
    stage_rows(ks, int(Dh + 1), k, k_base, s0, kKTile, s_hi, p.Hkv, kvh, Dh);
    stage_rows(vs, int(Dh), v, k_base, s0, kKTile, s_hi, p.Hkv, kvh, Dh);
    __syncthreads();
    const int64_t key = p.k_offset + s0 + lane;  // absolute position of this lane's key
#pragma unroll
    for (int i = 0; i < kQPerWarp; ++i) {
      const int tq = warp * kQPerWarp + i;
      const int64_t t = t0 + tq;
      if (t >= p.Tq) continue;  // warp-uniform
      const bool visible = s0 + lane < s_hi && key <= p.q_offset + t && key >= segs[tq];
      float slope;
      const float score =
          visible ? capped(dot_smem(qs + tq * Dh, ks + lane * (Dh + 1), Dh) * p.scale, p, slope)
                  : kNegInf;
      const float m_new = fmaxf(m[i], warp_max(score));
      if (m_new == kNegInf) continue;  // warp-uniform: nothing visible yet
      const float pr = visible ? expf(score - m_new) : 0.f;
      const float corr = expf(m[i] - m_new);
      l[i] = l[i] * corr + warp_sum(pr);
      m[i] = m_new;
      ps[warp * kKTile + lane] = pr;
      __syncwarp();
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const int64_t d = lane + 32 * r;
        if (d < Dh) {
          float a = acc[i][r] * corr;
#pragma unroll 8
          for (int j = 0; j < kKTile; ++j) a = fmaf(ps[warp * kKTile + j], vs[j * Dh + d], a);
          acc[i][r] = a;
        }
      }
      __syncwarp();
    }
  }

#pragma unroll
  for (int i = 0; i < kQPerWarp; ++i) {
    const int64_t t = t0 + warp * kQPerWarp + i;
    if (t >= p.Tq) continue;
    const bool any = l[i] > 0.f;
    const float inv = any ? 1.f / l[i] : 0.f;
    const int64_t o = q_base + (t * p.Hq + h) * Dh;
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const int64_t d = lane + 32 * r;
      if (d < Dh) store(out, o + d, acc[i][r] * inv);
    }
    if (lse != nullptr && lane == 0)
      lse[(b * p.Hq + h) * p.Tq + t] = any ? m[i] + logf(l[i]) : kNegInf;
  }
}

// delta[b, h, t] = sum_d dout * out: one warp per (b, t, h).
template <typename T>
__global__ void delta_kernel(const T* out, const T* dout, float* delta, int64_t B, int64_t Tq,
                             int64_t Hq, int64_t Dh) {
  const int64_t row = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x & 31;
  if (row >= B * Tq * Hq) return;
  const int64_t h = row % Hq, bt = row / Hq, b = bt / Tq, t = bt % Tq;
  float acc = 0.f;
  for (int64_t d = lane; d < Dh; d += 32) acc += load(out, row * Dh + d) * load(dout, row * Dh + d);
  acc = warp_sum(acc);
  if (lane == 0) delta[(b * Hq + h) * Tq + t] = acc;
}

template <typename T, int MAXD>
__global__ void __launch_bounds__(kThreads)
    attention_dq_kernel(const T* q, const T* k, const T* v, const int32_t* seg, Dims p,
                        const float* lse, const T* dout, const float* delta, T* dq) {
  constexpr int R = MAXD / 32;
  extern __shared__ float smem[];
  const int64_t Dh = p.Dh;
  float* qs = smem;                      // [kQTile][Dh]
  float* dos = qs + kQTile * Dh;         // [kQTile][Dh]
  float* ks = dos + kQTile * Dh;         // [kKTile][Dh + 1]
  float* vs = ks + kKTile * (Dh + 1);    // [kKTile][Dh + 1]
  float* ds_s = vs + kKTile * (Dh + 1);  // [kWarps][kKTile]
  int* segs = reinterpret_cast<int*>(ds_s + kWarps * kKTile);

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t b = blockIdx.z, h = blockIdx.y, t0 = int64_t(blockIdx.x) * kQTile;
  const int64_t kvh = h / p.group;
  const int64_t q_base = b * p.Tq * p.Hq * Dh, k_base = b * p.kbs;
  stage_rows(qs, int(Dh), q, q_base, t0, kQTile, p.Tq, p.Hq, h, Dh);
  stage_rows(dos, int(Dh), dout, q_base, t0, kQTile, p.Tq, p.Hq, h, Dh);
  int64_t s_lo, s_hi;
  query_tile_keys(seg, p, b, t0, segs, s_lo, s_hi);

  float L[kQPerWarp], Dl[kQPerWarp], acc[kQPerWarp][R];
#pragma unroll
  for (int i = 0; i < kQPerWarp; ++i) {
    const int64_t t = t0 + warp * kQPerWarp + i;
    const int64_t li = (b * p.Hq + h) * p.Tq + t;
    L[i] = t < p.Tq ? lse[li] : kNegInf;
    Dl[i] = t < p.Tq ? delta[li] : 0.f;
#pragma unroll
    for (int r = 0; r < R; ++r) acc[i][r] = 0.f;
  }

  for (int64_t s0 = s_lo; s0 < s_hi; s0 += kKTile) {
    __syncthreads();
    stage_rows(ks, int(Dh + 1), k, k_base, s0, kKTile, s_hi, p.Hkv, kvh, Dh);
    stage_rows(vs, int(Dh + 1), v, k_base, s0, kKTile, s_hi, p.Hkv, kvh, Dh);
    __syncthreads();
    const int64_t key = p.k_offset + s0 + lane;
#pragma unroll
    for (int i = 0; i < kQPerWarp; ++i) {
      const int tq = warp * kQPerWarp + i;
      const int64_t t = t0 + tq;
      if (t >= p.Tq || L[i] == kNegInf) continue;  // warp-uniform
      const bool visible = s0 + lane < s_hi && key <= p.q_offset + t && key >= segs[tq];
      float ds = 0.f;
      if (visible) {
        float slope;
        const float score =
            capped(dot_smem(qs + tq * Dh, ks + lane * (Dh + 1), Dh) * p.scale, p, slope);
        const float pr = expf(score - L[i]);
        const float dp = dot_smem(dos + tq * Dh, vs + lane * (Dh + 1), Dh);
        ds = pr * (dp - Dl[i]) * slope;
      }
      ds_s[warp * kKTile + lane] = ds;
      __syncwarp();
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const int64_t d = lane + 32 * r;
        if (d < Dh) {
          float a = acc[i][r];
#pragma unroll 8
          for (int j = 0; j < kKTile; ++j)
            a = fmaf(ds_s[warp * kKTile + j], ks[j * (Dh + 1) + d], a);
          acc[i][r] = a;
        }
      }
      __syncwarp();
    }
  }

#pragma unroll
  for (int i = 0; i < kQPerWarp; ++i) {
    const int64_t t = t0 + warp * kQPerWarp + i;
    if (t >= p.Tq) continue;
    const int64_t o = q_base + (t * p.Hq + h) * Dh;
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const int64_t d = lane + 32 * r;
      if (d < Dh) store(dq, o + d, acc[i][r] * p.scale);
    }
  }
}

template <typename T, int MAXD>
__global__ void __launch_bounds__(kThreads)
    attention_dkdv_kernel(const T* q, const T* k, const T* v, const int32_t* seg, Dims p,
                          const float* lse, const T* dout, const float* delta, T* dk, T* dv) {
  constexpr int R = MAXD / 32;
  extern __shared__ float smem[];
  const int64_t Dh = p.Dh;
  float* kown = smem;                                    // [kKBlock][Dh]
  float* vown = kown + kKBlock * Dh;                     // [kKBlock][Dh]
  float* qs = vown + kKBlock * Dh;                       // [kKTile][Dh + 1]
  float* dos = qs + kKTile * (Dh + 1);                   // [kKTile][Dh + 1]
  float* p_s = dos + kKTile * (Dh + 1);                  // [kWarps][kKTile]
  float* ds_s = p_s + kWarps * kKTile;                   // [kWarps][kKTile]
  float* lse_s = ds_s + kWarps * kKTile;                 // [kKTile]
  float* delta_s = lse_s + kKTile;                       // [kKTile]
  int* segs = reinterpret_cast<int*>(delta_s + kKTile);  // [kKTile]

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t b = blockIdx.z, kvh = blockIdx.y, s_first = int64_t(blockIdx.x) * kKBlock;
  const int64_t q_base = b * p.Tq * p.Hq * Dh, k_base = b * p.kbs;
  stage_rows(kown, int(Dh), k, k_base, s_first, kKBlock, p.Tk, p.Hkv, kvh, Dh);
  stage_rows(vown, int(Dh), v, k_base, s_first, kKBlock, p.Tk, p.Hkv, kvh, Dh);

  float adk[kKPerWarp][R], adv[kKPerWarp][R];
#pragma unroll
  for (int i = 0; i < kKPerWarp; ++i)
#pragma unroll
    for (int r = 0; r < R; ++r) adk[i][r] = adv[i][r] = 0.f;

  // Queries before t_lo cannot see any key of this block (causality), nor, under a sliding
  // window, queries from t_end on (the window has passed its last key).
  const int64_t t_lo = max(int64_t(0), p.k_offset + s_first - p.q_offset);
  const int64_t t_end =
      p.window > 0
          ? min(p.Tq, max(int64_t(0), p.k_offset + s_first + kKBlock - 1 + p.window - p.q_offset))
          : p.Tq;
  for (int g = 0; g < p.group; ++g) {
    const int64_t h = kvh * p.group + g;
    for (int64_t t0 = t_lo; t0 < t_end; t0 += kKTile) {
      __syncthreads();
      stage_rows(qs, int(Dh + 1), q, q_base, t0, kKTile, p.Tq, p.Hq, h, Dh);
      stage_rows(dos, int(Dh + 1), dout, q_base, t0, kKTile, p.Tq, p.Hq, h, Dh);
      if (threadIdx.x < kKTile) {
        const int64_t t = t0 + threadIdx.x;
        const int64_t li = (b * p.Hq + h) * p.Tq + t;
        lse_s[threadIdx.x] = t < p.Tq ? lse[li] : kNegInf;
        delta_s[threadIdx.x] = t < p.Tq ? delta[li] : 0.f;
        segs[threadIdx.x] = t < p.Tq ? seg_of(seg, p, b, t) : 0x7fffffff;
      }
      __syncthreads();
      const int64_t t = t0 + lane;  // this lane's query
#pragma unroll
      for (int i = 0; i < kKPerWarp; ++i) {
        const int ko = warp * kKPerWarp + i;
        const int64_t s = s_first + ko;
        if (s >= p.Tk) continue;  // warp-uniform
        const int64_t key = p.k_offset + s;
        const bool visible =
            t < p.Tq && key <= p.q_offset + t && key >= segs[lane] && lse_s[lane] != kNegInf;
        float pr = 0.f, ds = 0.f;
        if (visible) {
          float slope;
          const float score =
              capped(dot_smem(qs + lane * (Dh + 1), kown + ko * Dh, Dh) * p.scale, p, slope);
          pr = expf(score - lse_s[lane]);
          const float dp = dot_smem(dos + lane * (Dh + 1), vown + ko * Dh, Dh);
          ds = pr * (dp - delta_s[lane]) * slope;
        }
        p_s[warp * kKTile + lane] = pr;
        ds_s[warp * kKTile + lane] = ds;
        __syncwarp();
#pragma unroll
        for (int r = 0; r < R; ++r) {
          const int64_t d = lane + 32 * r;
          if (d < Dh) {
            float a = adv[i][r], c = adk[i][r];
#pragma unroll 8
            for (int j = 0; j < kKTile; ++j) {
              a = fmaf(p_s[warp * kKTile + j], dos[j * (Dh + 1) + d], a);
              c = fmaf(ds_s[warp * kKTile + j], qs[j * (Dh + 1) + d], c);
            }
            adv[i][r] = a;
            adk[i][r] = c;
          }
        }
        __syncwarp();
      }
    }
  }

#pragma unroll
  for (int i = 0; i < kKPerWarp; ++i) {
    const int64_t s = s_first + warp * kKPerWarp + i;
    if (s >= p.Tk) continue;
    const int64_t o =
        b * p.Tk * p.Hkv * Dh + (s * p.Hkv + kvh) * Dh;  // dk, dv are [B, Tk, Hkv, Dh]
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const int64_t d = lane + 32 * r;
      if (d < Dh) {
        store(dk, o + d, adk[i][r] * p.scale);
        store(dv, o + d, adv[i][r]);
      }
    }
  }
}

// One warp per (token, head) row: out row merged in f32 and rounded once to T.
template <typename T>
__global__ void merge_kernel(T* out, float* lse, const T* out_b, const float* lse_b, int64_t B,
                             int64_t seq_len, int64_t Hq, int64_t Dh) {
  const int64_t item = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;  // (row, h)
  const int lane = threadIdx.x & 31;
  if (item >= B * seq_len * Hq) return;
  const int64_t h = item % Hq, row = item / Hq, b = row / seq_len, t = row % seq_len;
  const int64_t i = (b * Hq + h) * seq_len + t;
  const float la = lse[i], lb = lse_b[i];
  T* o = out + item * Dh;
  const T* ob = out_b + item * Dh;
  if (lb == kNegInf) return;
  if (la == kNegInf) {
    for (int64_t d = lane; d < Dh; d += 32) o[d] = ob[d];
  } else {
    const float m = fmaxf(la, lb);
    const float e = expf(fminf(la, lb) - m);
    const float inv = 1.f / (1.f + e);
    const float wa = (la >= lb ? 1.f : e) * inv, wb = (la >= lb ? e : 1.f) * inv;
    for (int64_t d = lane; d < Dh; d += 32) store(o, d, wa * load(o, d) + wb * load(ob, d));
  }
  __syncwarp();
  if (lane == 0)
    lse[i] = la == kNegInf ? lb : fmaxf(la, lb) + log1pf(expf(fminf(la, lb) - fmaxf(la, lb)));
}

size_t forward_smem(int64_t Dh) {
  return sizeof(float) * (kQTile * Dh + kKTile * (Dh + 1) + kKTile * Dh + kWarps * kKTile) +
         sizeof(int) * kQTile;
}
size_t dq_smem(int64_t Dh) {
  return sizeof(float) * (2 * kQTile * Dh + 2 * kKTile * (Dh + 1) + kWarps * kKTile) +
         sizeof(int) * kQTile;
}
size_t dkdv_smem(int64_t Dh) {
  return sizeof(float) *
             (2 * kKBlock * Dh + 2 * kKTile * (Dh + 1) + 2 * kWarps * kKTile + 2 * kKTile) +
         sizeof(int) * kKTile;
}

template <typename Kernel, typename... Args>
cudaError_t launch_with_smem(Kernel kernel, dim3 grid, size_t smem, cudaStream_t s, Args... args) {
  if (smem > 48 * 1024) {
    const cudaError_t e =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
    if (e != cudaSuccess) return e;
  }
  kernel<<<grid, kThreads, smem, s>>>(args...);
  return cudaGetLastError();
}

// Calls f(T*, std::integral_constant<int, MAXD>) for the element type and head-dim bound.
template <typename F>
cudaError_t dispatch_attn(Elem t, int64_t Dh, F&& f) {
  return dispatch(t, [&](auto* tag) {
    if (Dh <= 32) return f(tag, std::integral_constant<int, 32>{});
    if (Dh <= 64) return f(tag, std::integral_constant<int, 64>{});
    if (Dh <= 128) return f(tag, std::integral_constant<int, 128>{});
    return f(tag, std::integral_constant<int, 256>{});
  });
}

}  // namespace

cudaError_t launch_attention_forward(const AttnArgs& a, void* out, float* lse, cudaStream_t s) {
  if (a.B == 0 || a.Tq == 0 || a.Hq == 0) return cudaSuccess;
  const Dims p = dims_of(a);
  const dim3 grid(unsigned((a.Tq + kQTile - 1) / kQTile), unsigned(a.Hq), unsigned(a.B));
  return dispatch_attn(a.t, a.Dh, [&](auto* tag, auto maxd) {
    using T = std::remove_pointer_t<decltype(tag)>;
    return launch_with_smem(attention_forward_kernel<T, decltype(maxd)::value>, grid,
                            forward_smem(a.Dh), s, static_cast<const T*>(a.q),
                            static_cast<const T*>(a.k), static_cast<const T*>(a.v), a.seg, p,
                            static_cast<T*>(out), lse);
  });
}

cudaError_t launch_attention_backward(const AttnArgs& a, const void* out, const float* lse,
                                      const void* dout, float* delta, void* dq, void* dk, void* dv,
                                      cudaStream_t s) {
  if (a.B == 0 || a.Hq == 0 || (a.Tq == 0 && a.Tk == 0)) return cudaSuccess;
  const Dims p = dims_of(a);
  return dispatch_attn(a.t, a.Dh, [&](auto* tag, auto maxd) {
    using T = std::remove_pointer_t<decltype(tag)>;
    constexpr int MAXD = decltype(maxd)::value;
    const int64_t rows = a.B * a.Tq * a.Hq;
    if (rows > 0) {
      delta_kernel<<<grid_for(rows * 32, 256, 1LL << 30), 256, 0, s>>>(
          static_cast<const T*>(out), static_cast<const T*>(dout), delta, a.B, a.Tq, a.Hq, a.Dh);
      const dim3 grid(unsigned((a.Tq + kQTile - 1) / kQTile), unsigned(a.Hq), unsigned(a.B));
      cudaError_t e = launch_with_smem(
          attention_dq_kernel<T, MAXD>, grid, dq_smem(a.Dh), s, static_cast<const T*>(a.q),
          static_cast<const T*>(a.k), static_cast<const T*>(a.v), a.seg, p, lse,
          static_cast<const T*>(dout), static_cast<const float*>(delta), static_cast<T*>(dq));
      if (e != cudaSuccess) return e;
    }
    if (a.Tk == 0 || a.Hkv == 0) return cudaGetLastError();
    const dim3 grid(unsigned((a.Tk + kKBlock - 1) / kKBlock), unsigned(a.Hkv), unsigned(a.B));
    return launch_with_smem(attention_dkdv_kernel<T, MAXD>, grid, dkdv_smem(a.Dh), s,
                            static_cast<const T*>(a.q), static_cast<const T*>(a.k),
                            static_cast<const T*>(a.v), a.seg, p, lse, static_cast<const T*>(dout),
                            static_cast<const float*>(delta), static_cast<T*>(dk),
                            static_cast<T*>(dv));
  });
}

cudaError_t launch_attention_merge(void* out, float* lse, const void* out_b, const float* lse_b,
                                   Elem t, int64_t B, int64_t T, int64_t Hq, int64_t Dh,
                                   cudaStream_t s) {
  const int64_t items = B * T * Hq;
  if (items == 0) return cudaSuccess;
  return dispatch(t, [&](auto* tag) {
    using E = std::remove_pointer_t<decltype(tag)>;
    merge_kernel<<<grid_for(items * 32, 256, 1LL << 30), 256, 0, s>>>(
        static_cast<E*>(out), lse, static_cast<const E*>(out_b), lse_b, B, T, Hq, Dh);
    return cudaGetLastError();
  });
}

}  // namespace shardlm::cuda
