// Attention of new queries against a KV cache, for incremental decoding on the CPU. Query i of a
// chunk sits at absolute position cache_len + i and sees cache rows [0, cache_len + i]. One
// (batch row, query head, query) per OpenMP item, each with a score row of Tmax floats in its
// thread's workspace slot: O(Tmax) memory, never [T, T]. No lse and no backward (inference
// only); cache rows past cache_len + Tq are never read. f32 arithmetic throughout.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string_view>

#include "kernels/cpu/ops.h"

namespace shardlm::cpu {
namespace {

struct DecodeDims {
  int64_t B, Tq, Tmax, Hq, Hkv, Dh;
  int64_t group() const { return Hq / Hkv; }
  int64_t q_row() const { return Hq * Dh; }    // floats between tokens of q, out
  int64_t kv_row() const { return Hkv * Dh; }  // floats between positions of the caches
  int64_t items() const { return B * Hq * Tq; }
};

// One score row per thread, 64-byte aligned.
size_t slot_bytes(int64_t Tmax) { return align_up(static_cast<size_t>(Tmax) * sizeof(float)); }

// Threads that can have work: more than the items would only hold idle slots.
int decode_threads(int64_t items) {
  return static_cast<int>(std::clamp<int64_t>(items, 1, omp_get_max_threads()));
}

// f32 dot product of two Dh-vectors; the simd reduction lets it vectorise without fast-math.
inline float dot(const float* a, const float* b, int64_t n) {
  float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
  for (int64_t e = 0; e < n; ++e) acc += a[e] * b[e];
  return acc;
}

// out row of query i of (b, h): softmax(q K^T * scale) V over cache rows [0, cache_len + i].
void decode_row(const DecodeDims& d, const float* q, const float* k, const float* v,
                int64_t cache_len, float* out, int64_t b, int64_t h, int64_t i, float* scores) {
  const int64_t Dh = d.Dh;
  const int64_t keys = cache_len + i + 1;
  const float scale = 1.0f / std::sqrt(static_cast<float>(Dh));
  const float* q_row = q + ((b * d.Tq + i) * d.Hq + h) * Dh;                 // [Dh]
  const int64_t kv_offset = b * d.Tmax * d.kv_row() + (h / d.group()) * Dh;  // row 0 of the head
  const float* k_head = k + kv_offset;
  const float* v_head = v + kv_offset;
  float* o = out + ((b * d.Tq + i) * d.Hq + h) * Dh;  // [Dh]

  float m = -std::numeric_limits<float>::infinity();
  for (int64_t s = 0; s < keys; ++s) {
    scores[s] = dot(q_row, k_head + s * d.kv_row(), Dh) * scale;
    m = std::max(m, scores[s]);
  }
  float l = 0.0f;
  for (int64_t s = 0; s < keys; ++s) {
    scores[s] = std::exp(scores[s] - m);
    l += scores[s];
  }
  std::fill_n(o, Dh, 0.0f);
  for (int64_t s = 0; s < keys; ++s) {
    const float p = scores[s];
    const float* v_row = v_head + s * d.kv_row();
#pragma omp simd
    for (int64_t e = 0; e < Dh; ++e) o[e] += p * v_row[e];
  }
  const float inv_l = 1.0f / l;
#pragma omp simd
  for (int64_t e = 0; e < Dh; ++e) o[e] *= inv_l;
}

}  // namespace

size_t attention_decode_workspace_bytes(int64_t B, int64_t Tq, int64_t Tmax, int64_t Hq,
                                        int64_t Dh) {
  return static_cast<size_t>(decode_threads(B * Hq * Tq)) * slot_bytes(Tmax);
}

// q [B, Tq, Hq, Dh]; k_cache, v_cache [B, Tmax, Hkv, Dh]; out [B, Tq, Hq, Dh] overwritten
void attention_decode(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                      int64_t cache_len, const Tensor& out, Workspace ws) {
  const DecodeDims d{q.dim(0), q.dim(1), k_cache.dim(1), q.dim(2), k_cache.dim(2), q.dim(3)};
  const int threads = decode_threads(d.items());
  const size_t slot = slot_bytes(d.Tmax);  // ws holds threads slots: the entry point checked it
  if (q.numel() == 0) return;
  const float* qp = q.f32();
  const float* kp = k_cache.f32();
  const float* vp = v_cache.f32();
  float* outp = out.f32();

#pragma omp parallel num_threads(threads)
  {
    float* scores = reinterpret_cast<float*>(ws.data + omp_get_thread_num() * slot);  // [Tmax]
    // Later queries see more keys: they go first, so the dynamic schedule ends evenly.
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < d.items(); ++item) {
      const int64_t i = d.Tq - 1 - item / (d.B * d.Hq);
      const int64_t bh = item % (d.B * d.Hq);
      decode_row(d, qp, kp, vp, cache_len, outp, bh / d.Hq, bh % d.Hq, i, scores);
    }
  }
}

}  // namespace shardlm::cpu
