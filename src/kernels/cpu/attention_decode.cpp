// Attention of new queries against a KV cache, for incremental decoding on the CPU. Query i of a
// chunk sits at absolute position cache_len + i and sees cache rows [0, cache_len + i]. One
// (batch row, query head, query) per OpenMP item, each with a score row of Tmax floats, its query
// row and its output accumulator in its thread's workspace slot: O(Tmax) memory, never [T, T].
// No lse and no backward (inference only); cache rows past cache_len + Tq are never read. q, the
// caches and out are f32 or bf16; arithmetic is f32 throughout and out is rounded once, at the
// end of its row.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string_view>

#include "kernels/cpu/element.h"
#include "kernels/cpu/ops.h"

namespace shardlm::cpu {
namespace {

struct DecodeDims {
  int64_t B, Tq, Tmax, Hq, Hkv, Dh;
  float softcap;  // attention logit soft-capping (0: none)
  int64_t group() const { return Hq / Hkv; }
  int64_t q_row() const { return Hq * Dh; }    // elements between tokens of q, out
  int64_t kv_row() const { return Hkv * Dh; }  // elements between positions of the caches
  int64_t items() const { return B * Hq * Tq; }
};

// A thread's scratch: scores [Tmax], the query row [Dh] and the output accumulator [Dh], f32
// whatever the storage, each 64-byte aligned.
struct DecodeScratch {
  float* scores;
  float* q;
  float* o;
};
size_t scores_bytes(int64_t Tmax) { return align_up(static_cast<size_t>(Tmax) * sizeof(float)); }
size_t row_bytes(int64_t Dh) { return align_up(static_cast<size_t>(Dh) * sizeof(float)); }
size_t slot_bytes(int64_t Tmax, int64_t Dh) { return scores_bytes(Tmax) + 2 * row_bytes(Dh); }
DecodeScratch carve_slot(std::byte* slot, int64_t Tmax, int64_t Dh) {
  std::byte* q = slot + scores_bytes(Tmax);
  return {reinterpret_cast<float*>(slot), reinterpret_cast<float*>(q),
          reinterpret_cast<float*>(q + row_bytes(Dh))};
}

// Threads that can have work: more than the items would only hold idle slots.
int decode_threads(int64_t items) {
  return static_cast<int>(std::clamp<int64_t>(items, 1, omp_get_max_threads()));
}

// f32 dot product of an f32 Dh-vector and a stored one; the simd reduction lets it vectorise
// without fast-math.
template <typename T>
inline float dot(const float* a, const T* b, int64_t n) {
  float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
  for (int64_t e = 0; e < n; ++e) acc += a[e] * load(b + e);
  return acc;
}

// out row of query i of (b, h): softmax(q K^T * scale) V over cache rows [0, cache_len + i], each
// scaled score soft-capped first where d.softcap > 0.
// T: the storage of q, the caches and out.
template <typename T>
void decode_row(const DecodeDims& d, const T* q, const T* k, const T* v, int64_t cache_len, T* out,
                int64_t b, int64_t h, int64_t i, const DecodeScratch& scratch) {
  const int64_t Dh = d.Dh;
  const int64_t keys = cache_len + i + 1;
  const float scale = 1.0f / std::sqrt(static_cast<float>(Dh));
  load_row(q + ((b * d.Tq + i) * d.Hq + h) * Dh, Dh, scratch.q);
  const float* q_row = scratch.q;                                            // [Dh]
  const int64_t kv_offset = b * d.Tmax * d.kv_row() + (h / d.group()) * Dh;  // row 0 of the head
  const T* k_head = k + kv_offset;
  const T* v_head = v + kv_offset;
  float* scores = scratch.scores;  // [keys]
  float* o = scratch.o;            // [Dh]

  float m = -std::numeric_limits<float>::infinity();
  for (int64_t s = 0; s < keys; ++s) {
    scores[s] = dot(q_row, k_head + s * d.kv_row(), Dh) * scale;
    if (d.softcap > 0.0f) scores[s] = d.softcap * std::tanh(scores[s] / d.softcap);
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
    const T* v_row = v_head + s * d.kv_row();
#pragma omp simd
    for (int64_t e = 0; e < Dh; ++e) o[e] += p * load(v_row + e);
  }
  const float inv_l = 1.0f / l;
  T* out_row = out + ((b * d.Tq + i) * d.Hq + h) * Dh;  // [Dh]
#pragma omp simd
  for (int64_t e = 0; e < Dh; ++e) store(out_row + e, o[e] * inv_l);
}

// Every item of the chunk, on storage T (q, the caches and out: one dtype, checked by the entry
// point).
template <typename T>
void run_decode(const DecodeDims& d, const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                int64_t cache_len, const Tensor& out, Workspace ws) {
  const int threads = decode_threads(d.items());
  const size_t slot = slot_bytes(d.Tmax, d.Dh);  // ws holds threads slots: the entry point checked
  const T* qp = elems<T>(q);
  const T* kp = elems<T>(k_cache);
  const T* vp = elems<T>(v_cache);
  T* outp = elems<T>(out);

#pragma omp parallel num_threads(threads)
  {
    const DecodeScratch scratch = carve_slot(ws.data + omp_get_thread_num() * slot, d.Tmax, d.Dh);
    // Later queries see more keys: they go first, so the dynamic schedule ends evenly.
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < d.items(); ++item) {
      const int64_t i = d.Tq - 1 - item / (d.B * d.Hq);
      const int64_t bh = item % (d.B * d.Hq);
      decode_row(d, qp, kp, vp, cache_len, outp, bh / d.Hq, bh % d.Hq, i, scratch);
    }
  }
}

}  // namespace

size_t attention_decode_workspace_bytes(int64_t B, int64_t Tq, int64_t Tmax, int64_t Hq,
                                        int64_t Dh) {
  return static_cast<size_t>(decode_threads(B * Hq * Tq)) * slot_bytes(Tmax, Dh);
}

// q [B, Tq, Hq, Dh]; k_cache, v_cache [B, Tmax, Hkv, Dh]; out [B, Tq, Hq, Dh] overwritten; all
// one dtype, f32 or bf16
void attention_decode(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                      int64_t cache_len, const Tensor& out, Workspace ws, float softcap) {
  const DecodeDims d{q.dim(0),       q.dim(1), k_cache.dim(1), q.dim(2),
                     k_cache.dim(2), q.dim(3), softcap};
  if (q.numel() == 0) return;
  with_float(
      q, [&](auto tag) { run_decode<decltype(tag)>(d, q, k_cache, v_cache, cache_len, out, ws); });
}

}  // namespace shardlm::cpu
