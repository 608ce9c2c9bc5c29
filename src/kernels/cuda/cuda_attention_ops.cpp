// CudaBackend's attention ops: causal (document-masked) attention, block attention and
// its merge for context parallelism, and decoding against a KV cache (kernels: attention.cu),
// with cuDNN's fused SDPA (cudnn_attention.h) taking the calls it can express: bf16, a head dim
// that is a multiple of 8 up to 256, and whole rows (one document each, or packed documents
// given as spans: cuDNN's ragged sequences), or for a block the diagonal (causal) or a key
// block wholly before the queries (no mask); a sliding window rides on each as the frontend's
// diagonal band (a past block only where the window covers it whole). A windowed graph whose
// workspace exceeds the one planned (queried without a window) runs on the own kernels. Every other
// call (a soft-capped one among them: the fused SDPA has no score modifier here), and a shape
// cuDNN declines or a workspace short of its need, runs on the own kernels.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>

#include "kernels/cuda/backend_impl.h"

namespace shardlm::cuda {

namespace {

// The own kernels launch one block per (query or key tile, head, row): heads on the grid's y
// axis and rows on its z axis, each at most 65535 blocks (CUDA's limit). A larger call is
// refused by name here, not left to the launch's "invalid configuration argument".
void check_own_grid(const AttnArgs& a, std::string_view op) {
  constexpr int64_t kMaxGridYZ = 65535;
  SHARDLM_CHECK(a.B <= kMaxGridYZ,
                "{}: {} rows in one attention call, over the {} the CUDA kernels' grid takes "
                "(its z dimension, one block row per batch row): use fewer, longer rows",
                op, a.B, kMaxGridYZ);
  SHARDLM_CHECK(std::max(a.Hq, a.Hkv) <= kMaxGridYZ,
                "{}: {} heads in one attention call, over the {} the CUDA kernels' grid takes "
                "(its y dimension)",
                op, std::max(a.Hq, a.Hkv), kMaxGridYZ);
}

// The launch arguments of q [B, Tq, Hq, Dh] and k, v [B, Tk, Hkv, Dh] (shapes checked by the entry
// point), after the CUDA backend's own checks: device memory and a head dim the kernels take.
AttnArgs attn_args(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& seg_start,
                   int64_t q_offset, int64_t k_offset, std::string_view op, int64_t window = 0,
                   float softcap = 0.0f) {
  AttnArgs a;
  a.t = elem(q, op, "q");
  on_device(k, op, "k");
  on_device(v, op, "v");
  a.B = q.dim(0);
  a.Tq = q.dim(1);
  a.Hq = q.dim(2);
  a.Dh = q.dim(3);
  a.Tk = k.dim(1);
  a.Hkv = k.dim(2);
  SHARDLM_CHECK(a.Dh <= kMaxHeadDim,
                "{}: head dim {} is outside what the CUDA kernels take (1..{})", op, a.Dh,
                kMaxHeadDim);
  if (!seg_start.empty()) {
    on_device(seg_start, op, "seg_start");
    a.seg = seg_start.i32();
  }
  a.q = q.data();
  a.k = k.data();
  a.v = v.data();
  a.q_offset = q_offset;
  a.k_offset = k_offset;
  a.k_batch_stride = a.Tk * a.Hkv * a.Dh;
  a.window = window;
  a.softcap = softcap;
  return a;
}

size_t delta_bytes(int64_t B, int64_t Tq, int64_t Hq) {
  return align_up(size_t(B) * size_t(Tq) * size_t(Hq) * sizeof(float));
}

// cuDNN's problem for a bf16 call without document starts: a whole causal row or a block on
// the diagonal (causal, with the sliding window as a band where it cuts the block), a key block
// wholly before the queries and wholly inside their window (every key visible); nullopt for
// anything else (a block cut by the diagonal or by the window's edge, one after the queries,
// empty tensors).
std::optional<SdpaShape> sdpa_shape(int64_t B, int64_t Tq, int64_t Tk, int64_t Hq, int64_t Hkv,
                                    int64_t Dh, int64_t q_offset, int64_t k_offset,
                                    int64_t window = 0) {
  if (B == 0 || Tq == 0 || Tk == 0 || Hq == 0 || Dh % 8 != 0 || Dh > 256) return std::nullopt;
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

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// The cuDNN problem of a call when cuDNN may take it (selected, bf16, no document starts, no
// soft cap, 16-byte aligned tensors); the rest is sdpa_shape's.
std::optional<SdpaShape> cudnn_call(const CudaBackend::Impl& m, const AttnArgs& a,
                                    std::initializer_list<const void*> ptrs) {
  if (m.attention_own_only || !m.cudnn->available() || a.t != Elem::kBF16 || a.seg != nullptr ||
      a.softcap > 0.0f)
    return std::nullopt;
  for (const void* p : ptrs)
    if (!aligned16(p)) return std::nullopt;
  return sdpa_shape(a.B, a.Tq, a.Tk, a.Hq, a.Hkv, a.Dh, a.q_offset, a.k_offset, a.window);
}

// The workspace cuDNN needs for `s` (nullopt when `s` is none, cuDNN is not selected or
// declines it). Building the graphs loads cuDNN's kernels onto the device: that memory joins the
// baseline of driver_device_bytes, as the CUDA context's does, since the ledger never holds it.
std::optional<size_t> cudnn_workspace_query(CudaBackend::Impl& m,
                                            const std::optional<SdpaShape>& s) {
  if (!s || m.attention_own_only || !m.cudnn->available()) return std::nullopt;
  const int64_t before = m.driver_used();
  const std::optional<size_t> ws = m.cudnn->workspace_bytes(*s);
  m.exclude_driver_growth(before);
  return ws;
}

// The same, 0 where there is none.
size_t cudnn_workspace(CudaBackend::Impl& m, const std::optional<SdpaShape>& s) {
  return cudnn_workspace_query(m, s).value_or(0);
}

// ---- packed documents: cuDNN's ragged sequences ----

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

// Packed documents as cuDNN ragged problems: B rows of T tokens holding `count` documents of at
// most max_len tokens run as `groups` calls of the same graph, each over `shape.docs` documents
// in order (the last group's tail padded with empty sequences) of at most shape.max_len tokens,
// under a sliding window (0: none; dropped where no document is longer than it).
// Both buckets are powers of two (lengths from 64, at most T) so that a few graphs serve every
// batch, and docs x max_len stays within the one-document-per-row bucket's, pow2(B) x T: cuDNN
// sizes parts of its backward workspace by docs x max_len, not by the tokens there are (on an
// H100 with cuDNN 9.14 a batch of a few long documents needed more than one document per row),
// so a batch of many documents runs in several calls rather than needing more memory.
// Documents are independent in attention: the groups' outputs are the one call's.
struct RaggedGroups {
  SdpaShape shape;
  int64_t groups = 1;
};

// nullopt where cuDNN cannot express the problem: a head dim it does not take, or element
// offsets past the i32 the index holds.
std::optional<RaggedGroups> ragged_groups(int64_t B, int64_t T, int64_t Hq, int64_t Hkv, int64_t Dh,
                                          int64_t count, int64_t max_len, int64_t window = 0) {
  constexpr int64_t kI32Max = 2147483647;
  if (B == 0 || T == 0 || Hq == 0 || Dh % 8 != 0 || Dh > 256) return std::nullopt;
  if (B * T * std::max(Hq, Hkv) * Dh > kI32Max) return std::nullopt;
  const int64_t len = std::min(std::max<int64_t>(64, pow2_at_least(max_len)), T);
  const int64_t per_group = pow2_at_most(pow2_at_least(B) * T / len);
  const int64_t docs = std::min({pow2_at_least(count), per_group, B * T});
  return RaggedGroups{
      SdpaShape{B, T, T, Hq, Hkv, Dh, true, docs, len, window < max_len ? window : 0},
      (count + docs - 1) / docs};
}

// The bytes at the workspace's start of a ragged call (cuDNN's own workspace follows): the
// RaggedIndex of one group and the token-major stats [B * T, Hq] f32 of them all.
size_t ragged_run_bytes(const SdpaShape& s) {
  return align_up(size_t(s.docs) * 4) + 3 * align_up(size_t(s.docs + 1) * 4) +
         align_up(size_t(s.B * s.Tq * s.Hq) * sizeof(float));
}

// The workspace packed documents need planned: the largest of the bucket shapes at the ends of
// the range, one document per row and the most documents of the shortest bucket (the index
// sized for the most), each queried (0 when cuDNN declines both). A shape in between needing
// more than planned runs on the own kernel.
size_t ragged_workspace(CudaBackend::Impl& m, int64_t B, int64_t T, int64_t Hq, int64_t Hkv,
                        int64_t Dh) {
  const auto one_per_row = ragged_groups(B, T, Hq, Hkv, Dh, B, T);
  const auto shortest = ragged_groups(B, T, Hq, Hkv, Dh, B * T, 1);
  if (!one_per_row || !shortest) return 0;
  const std::optional<size_t> row_ws = cudnn_workspace_query(m, one_per_row->shape);
  const std::optional<size_t> short_ws = cudnn_workspace_query(m, shortest->shape);
  if (!row_ws && !short_ws) return 0;
  return ragged_run_bytes(shortest->shape) +
         align_up(std::max(row_ws.value_or(0), short_ws.value_or(0)));
}

// A full-row call with document spans that cuDNN may take as ragged sequences: selected, bf16,
// 16-byte aligned tensors, and ragged_groups's conditions.
std::optional<RaggedGroups> ragged_call(const CudaBackend::Impl& m, const AttnArgs& a,
                                        const DocumentSpans& docs,
                                        std::initializer_list<const void*> ptrs) {
  if (docs.count == 0 || m.attention_own_only || !m.cudnn->available() || a.t != Elem::kBF16 ||
      a.softcap > 0.0f)
    return std::nullopt;
  for (const void* p : ptrs)
    if (!aligned16(p)) return std::nullopt;
  return ragged_groups(a.B, a.Tq, a.Hq, a.Hkv, a.Dh, docs.count, docs.max_len, a.window);
}

// The workspace of a ragged call: one group's index at the start (rewritten on the stream before
// each group's cuDNN call reads it), the token-major stats after it, and the rest for cuDNN;
// nullopt when ws cannot hold the index and the stats.
struct RaggedRun {
  RaggedIndex index;
  float* stats = nullptr;  // [B * T, Hq]
  std::byte* ws = nullptr;
  size_t ws_bytes = 0;
};
std::optional<RaggedRun> ragged_run(const SdpaShape& s, Workspace ws) {
  const size_t index_bytes = ragged_run_bytes(s);
  if (ws.bytes < index_bytes) return std::nullopt;
  std::byte* p = ws.data;
  auto take = [&](int64_t n) {
    auto* t = reinterpret_cast<int32_t*>(p);
    p += align_up(size_t(n) * 4);
    return t;
  };
  RaggedRun run;
  run.index.seq_len = take(s.docs);
  run.index.q_off = take(s.docs + 1);
  run.index.kv_off = take(s.docs + 1);
  run.index.lse_off = take(s.docs + 1);
  run.stats = reinterpret_cast<float*>(take(s.B * s.Tq * s.Hq));
  run.ws = p;
  run.ws_bytes = ws.bytes - index_bytes;
  return run;
}

// Runs `call` (a cuDNN forward or backward of r.shape over run's index) for each group of
// documents, the group's index written first; false, with only an index written, when cuDNN
// declines the shape or the workspace is short of its graph (every group's graph is the first's).
template <typename Call>
bool each_ragged_group(CudaBackend::Impl& m, const RaggedGroups& r, const RaggedRun& run,
                       const DocumentSpans& docs, std::string_view op, Call&& call) {
  on_device(docs.starts, op, "docs.starts");
  const SdpaShape& s = r.shape;
  for (int64_t g = 0; g < r.groups; ++g) {
    cuda_ok(launch_ragged_index(docs.starts.i32(), docs.count, g * s.docs, s.docs, s.Hq, s.Hkv,
                                s.Dh, run.index.seq_len, run.index.q_off, run.index.kv_off,
                                run.index.lse_off, m.stream),
            op);
    if (!call()) {
      SHARDLM_CHECK_KIND(ErrorKind::kInternal, g == 0,
                         "{}: cuDNN declined group {} of a ragged call it took before", op, g);
      return false;
    }
  }
  return true;
}

// ws holds at least delta_bytes (the entry point checked it against the workspace query);
// cuDNN runs the call instead when it takes it and ws covers its graph.
void backward(CudaBackend::Impl& m, const AttnArgs& a, const Tensor& out, const Tensor& lse,
              const Tensor& dout, const Tensor& dq, const Tensor& dk, const Tensor& dv,
              Workspace ws, std::string_view op, const DocumentSpans& docs = {}) {
  for (const auto& [x, name] : {std::pair{&out, "out"},
                                {&lse, "lse"},
                                {&dout, "dout"},
                                {&dq, "dq"},
                                {&dk, "dk"},
                                {&dv, "dv"}})
    on_device(*x, op, name);
  if (const auto r = ragged_call(m, a, docs,
                                 {a.q, a.k, a.v, out.data(), lse.data(), dout.data(), dq.data(),
                                  dk.data(), dv.data(), ws.data})) {
    const auto run = ragged_run(r->shape, ws);
    if (run)
      cuda_ok(launch_lse_layout(lse.f32(), run->stats, a.B, a.Tq, a.Hq, false, m.stream), op);
    if (run && each_ragged_group(m, *r, *run, docs, op, [&] {
          return m.cudnn->backward(r->shape, a.q, a.k, a.v, out.data(), run->stats, dout.data(),
                                   dq.data(), dk.data(), dv.data(), run->ws, run->ws_bytes,
                                   run->index);
        })) {
      ++m.cudnn_calls;  // one per call, whatever its groups
      return;
    }
  }
  const auto s = cudnn_call(m, a,
                            {a.q, a.k, a.v, out.data(), lse.data(), dout.data(), dq.data(),
                             dk.data(), dv.data(), ws.data});
  if (s && m.cudnn->backward(*s, a.q, a.k, a.v, out.data(), lse.f32(), dout.data(), dq.data(),
                             dk.data(), dv.data(), ws.data, ws.bytes)) {
    ++m.cudnn_calls;
    return;
  }
  check_own_grid(a, op);
  cuda_ok(launch_attention_backward(a, out.data(), lse.f32(), dout.data(),
                                    reinterpret_cast<float*>(ws.data), dq.data(), dk.data(),
                                    dv.data(), m.stream),
          op);
}

// q [B, Tq, Hq, Dh] -> out [B, Tq, Hq, Dh], lse [B, Hq, Tq]: cuDNN's when it takes the call.
void forward(CudaBackend::Impl& m, const AttnArgs& a, const Tensor& out, const Tensor& lse,
             Workspace ws, std::string_view op, const DocumentSpans& docs = {}) {
  on_device(out, op, "out");
  on_device(lse, op, "lse");
  if (const auto r = ragged_call(m, a, docs, {a.q, a.k, a.v, out.data(), lse.data(), ws.data})) {
    const auto run = ragged_run(r->shape, ws);
    if (run && each_ragged_group(m, *r, *run, docs, op, [&] {
          return m.cudnn->forward(r->shape, a.q, a.k, a.v, out.data(), run->stats, run->ws,
                                  run->ws_bytes, run->index);
        })) {
      cuda_ok(launch_lse_layout(run->stats, lse.f32(), a.B, a.Tq, a.Hq, true, m.stream), op);
      ++m.cudnn_calls;
      return;
    }
  }
  const auto s = cudnn_call(m, a, {a.q, a.k, a.v, out.data(), lse.data(), ws.data});
  if (s && m.cudnn->forward(*s, a.q, a.k, a.v, out.data(), lse.f32(), ws.data, ws.bytes)) {
    ++m.cudnn_calls;
    return;
  }
  check_own_grid(a, op);
  cuda_ok(launch_attention_forward(a, out.data(), lse.f32(), m.stream), op);
}

}  // namespace

std::string CudaBackend::select_attention(std::string_view impl) {
  const CudnnAttention& c = *impl_->cudnn;
  SHARDLM_CHECK_KIND(ErrorKind::kConfig, impl == "auto" || impl == "own" || impl == "cudnn",
                     "train.attention = \"{}\" is not an attention implementation; use \"auto\", "
                     "\"cudnn\" or \"own\"",
                     impl);
  SHARDLM_CHECK_KIND(ErrorKind::kConfig, impl != "cudnn" || c.available(),
                     "train.attention = \"cudnn\", but {}; use \"auto\" or \"own\"", c.status());
  impl_->attention_own_only = impl == "own";
  if (impl == "own") return "own kernels";
  if (!c.available()) return fmt::format("own kernels ({})", c.status());
  return fmt::format(
      "cuDNN SDPA ({}) for bf16 rows (packed documents as ragged sequences), own kernels for "
      "the rest",
      c.status());
}

int64_t CudaBackend::cudnn_attention_calls() const { return impl_->cudnn_calls; }

std::string CudaBackend::cudnn_attention_declined(int64_t B, int64_t Tq, int64_t Tk, int64_t Hq,
                                                  int64_t Hkv, int64_t Dh, bool causal) {
  return impl_->cudnn->declined({B, Tq, Tk, Hq, Hkv, Dh, causal});
}

size_t CudaBackend::attention_workspace_bytes(int64_t B, int64_t T, int64_t Hq, int64_t Hkv,
                                              int64_t Dh) const {
  const size_t cudnn = cudnn_workspace(*impl_, sdpa_shape(B, T, T, Hq, Hkv, Dh, 0, 0));
  return std::max(
      {delta_bytes(B, T, Hq), align_up(cudnn), ragged_workspace(*impl_, B, T, Hq, Hkv, Dh)});
}

void CudaBackend::do_attention_forward(const Tensor& q, const Tensor& k, const Tensor& v,
                                       const Tensor& seg_start, const Tensor& out,
                                       const Tensor& lse, Workspace ws, const DocumentSpans& docs,
                                       int64_t window, float softcap) {
  constexpr std::string_view op = "attention_forward";
  const AttnArgs a = attn_args(q, k, v, seg_start, 0, 0, op, window, softcap);
  forward(*impl_, a, out, lse, ws, op, docs);
}

void CudaBackend::do_attention_backward(const Tensor& q, const Tensor& k, const Tensor& v,
                                        const Tensor& seg_start, const Tensor& out,
                                        const Tensor& lse, const Tensor& dout, const Tensor& dq,
                                        const Tensor& dk, const Tensor& dv, Workspace ws,
                                        const DocumentSpans& docs, int64_t window, float softcap) {
  constexpr std::string_view op = "attention_backward";
  const AttnArgs a = attn_args(q, k, v, seg_start, 0, 0, op, window, softcap);
  backward(*impl_, a, out, lse, dout, dq, dk, dv, ws, op, docs);
}

// The blocks cuDNN may take: the diagonal one (Tq == Tk) and those wholly in the past.
size_t CudaBackend::attention_block_workspace_bytes(int64_t B, int64_t Tq, int64_t Tk, int64_t Hq,
                                                    int64_t Hkv, int64_t Dh) const {
  const size_t diagonal = cudnn_workspace(*impl_, sdpa_shape(B, Tq, Tk, Hq, Hkv, Dh, 0, 0));
  const size_t past = cudnn_workspace(*impl_, sdpa_shape(B, Tq, Tk, Hq, Hkv, Dh, Tk, 0));
  return std::max({delta_bytes(B, Tq, Hq), align_up(diagonal), align_up(past)});
}

void CudaBackend::do_attention_block_forward(const Tensor& q, const Tensor& k, const Tensor& v,
                                             const Tensor& seg_start, int64_t q_offset,
                                             int64_t k_offset, const Tensor& out, const Tensor& lse,
                                             Workspace ws, int64_t window, float softcap) {
  constexpr std::string_view op = "attention_block_forward";
  const AttnArgs a = attn_args(q, k, v, seg_start, q_offset, k_offset, op, window, softcap);
  forward(*impl_, a, out, lse, ws, op);
}

void CudaBackend::do_attention_block_backward(const Tensor& q, const Tensor& k, const Tensor& v,
                                              const Tensor& seg_start, int64_t q_offset,
                                              int64_t k_offset, const Tensor& out,
                                              const Tensor& lse, const Tensor& dout,
                                              const Tensor& dq, const Tensor& dk, const Tensor& dv,
                                              Workspace ws, int64_t window, float softcap) {
  constexpr std::string_view op = "attention_block_backward";
  const AttnArgs a = attn_args(q, k, v, seg_start, q_offset, k_offset, op, window, softcap);
  backward(*impl_, a, out, lse, dout, dq, dk, dv, ws, op);
}

void CudaBackend::do_attention_merge(const Tensor& out, const Tensor& lse, const Tensor& out_b,
                                     const Tensor& lse_b) {
  constexpr std::string_view op = "attention_merge";
  for (const auto& [x, name] :
       {std::pair{&out, "out"}, {&lse, "lse"}, {&out_b, "out_b"}, {&lse_b, "lse_b"}})
    on_device(*x, op, name);
  const int64_t B = lse.dim(0), Hq = lse.dim(1), T = lse.dim(2);
  const int64_t Dh = out.dim(out.rank() - 1);
  cuda_ok(launch_attention_merge(out.data(), lse.f32(), out_b.data(), lse_b.f32(),
                                 elem_of(out.dtype()), B, T, Hq, Dh, impl_->stream),
          op);
}

size_t CudaBackend::attention_decode_workspace_bytes(int64_t B, int64_t Tq, int64_t Tmax,
                                                     int64_t Hq, int64_t Dh) const {
  return 0;
}

void CudaBackend::do_attention_decode(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                                      int64_t cache_len, const Tensor& out, Workspace ws,
                                      float softcap) {
  constexpr std::string_view op = "attention_decode";
  AttnArgs a = attn_args(q, k_cache, v_cache, Tensor(), cache_len, 0, op, 0, softcap);
  const int64_t Tmax = a.Tk;
  a.Tk = cache_len + a.Tq;
  a.k_batch_stride = Tmax * a.Hkv * a.Dh;
  on_device(out, op, "out");
  check_own_grid(a, op);
  cuda_ok(launch_attention_forward(a, out.data(), nullptr, impl_->stream), op);
}

}  // namespace shardlm::cuda
