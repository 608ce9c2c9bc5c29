// CudaBackend's attention ops: causal (document-masked) attention, block attention and
// its merge for context parallelism, and decoding against a KV cache (kernels: attention.cu),
// with cuDNN's fused SDPA (cudnn_attention.h) taking the calls it can express: bf16, a head dim
// that is a multiple of 8 up to 256, and whole rows (one document each, or packed documents
// given as spans: cuDNN's ragged sequences), or for a block the diagonal (causal) or a key
// block wholly before the queries (no mask); a sliding window rides on each as the frontend's
// diagonal band (a past block only where the window covers it whole). The problems a run can
// meet form a finite bucket set (host/sdpa_buckets.h), every window included: the workspace
// query builds them all and plans the largest workspace they ask, so a step builds nothing and
// cuDNN runs every call whose graph fits the plan. Every other call (a soft-capped one among
// them: the fused SDPA has no score modifier here), and a shape cuDNN declines, runs on the own
// kernels.
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

// The workspace cuDNN needs for `s`, its graphs built on first sight (nullopt when cuDNN is not
// selected or declines it). Building the graphs loads cuDNN's kernels onto the device: that
// memory joins the baseline of driver_device_bytes, as the CUDA context's does, since the
// ledger never holds it.
std::optional<size_t> cudnn_workspace_query(CudaBackend::Impl& m, const SdpaShape& s) {
  if (m.attention_own_only || !m.cudnn->available()) return std::nullopt;
  const int64_t before = m.driver_used();
  const std::optional<size_t> ws = m.cudnn->workspace_bytes(s);
  m.exclude_driver_growth(before);
  return ws;
}

// The planned workspace of `buckets` (planned_workspace over cuDNN's answers, at least `own`),
// remembered under `key` so that a step's entry-point check finds it without a query.
size_t planned(CudaBackend::Impl& m, std::vector<int64_t> key,
               const std::vector<SdpaShape>& buckets, size_t own) {
  std::lock_guard<std::mutex> lock(m.attention_plans_mu);
  const auto it = m.attention_plans.find(key);
  if (it != m.attention_plans.end()) return it->second;
  const size_t bytes = planned_workspace(
      buckets, own, [&](const SdpaShape& s) { return cudnn_workspace_query(m, s); });
  m.attention_plans.emplace(std::move(key), bytes);
  return bytes;
}

// The memo key of a query: its form, its sizes, then its windows.
std::vector<int64_t> plan_key(std::initializer_list<int64_t> sizes,
                              std::span<const int64_t> windows) {
  std::vector<int64_t> key(sizes);
  key.insert(key.end(), windows.begin(), windows.end());
  return key;
}

// A full-row call with document spans that cuDNN may take as ragged sequences: selected, bf16,
// 16-byte aligned tensors, and ragged_groups's conditions.
std::optional<RaggedGroups> ragged_call(const CudaBackend::Impl& m, const AttnArgs& a,
                                        const DocumentSpans& docs,
                                        std::initializer_list<const void*> ptrs) {
  if (docs.count == 0 || m.attention_own_only || !m.cudnn->available() || a.t != Elem::kBF16 ||
      a.softcap > 0.0f || !m.cudnn->ragged_refused().empty())
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
  {
    // The planned workspaces followed the former choice.
    std::lock_guard<std::mutex> lock(impl_->attention_plans_mu);
    impl_->attention_plans.clear();
  }
  if (impl == "own") return "own kernels";
  if (!c.available()) return fmt::format("own kernels ({})", c.status());
  // Packed documents go to the own kernel where cuDNN refuses ragged sequences: say so, since
  // such a run is several times slower than one on a GPU that takes them.
  const std::string documents =
      c.ragged_refused().empty()
          ? std::string("packed documents as ragged sequences")
          : fmt::format("packed documents on the own kernel: {}", c.ragged_refused());
  return fmt::format("cuDNN SDPA ({}) for bf16 rows ({}), own kernels for the rest", c.status(),
                     documents);
}

int64_t CudaBackend::cudnn_attention_calls() const { return impl_->cudnn_calls; }

int64_t CudaBackend::cudnn_attention_unbuilt_calls() const { return impl_->cudnn->unbuilt_calls(); }

std::string CudaBackend::cudnn_attention_declined(int64_t B, int64_t Tq, int64_t Tk, int64_t Hq,
                                                  int64_t Hkv, int64_t Dh, bool causal) {
  return impl_->cudnn->declined({B, Tq, Tk, Hq, Hkv, Dh, causal});
}

std::string CudaBackend::cudnn_ragged_declined(int64_t B, int64_t T, int64_t Hq, int64_t Hkv,
                                               int64_t Dh, int64_t count, int64_t max_len,
                                               int64_t window) {
  const auto r = ragged_groups(B, T, Hq, Hkv, Dh, count, max_len, window);
  if (!r) return "cuDNN's ragged layout cannot express this problem";
  return impl_->cudnn->declined(r->shape);
}

size_t CudaBackend::attention_workspace_bytes(int64_t B, int64_t T, int64_t Hq, int64_t Hkv,
                                              int64_t Dh) const {
  return attention_plan_workspace_bytes(B, T, Hq, Hkv, Dh, {});
}

// Whole rows: the dense row and every packed-document bucket, for each window (row_buckets).
size_t CudaBackend::attention_plan_workspace_bytes(int64_t B, int64_t T, int64_t Hq, int64_t Hkv,
                                                   int64_t Dh,
                                                   std::span<const int64_t> windows) const {
  Impl& m = *impl_;
  const bool ragged = m.cudnn->available() && m.cudnn->ragged_refused().empty();
  auto plan = [&](std::span<const int64_t> w) {
    return planned(m, plan_key({0, B, T, Hq, Hkv, Dh}, w),
                   row_buckets(B, T, Hq, Hkv, Dh, w, ragged), delta_bytes(B, T, Hq));
  };
  // The entry points check each call against the plain query: remembered now too, so that a
  // step's check is a look-up.
  plan({});
  return plan(windows);
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

size_t CudaBackend::attention_block_workspace_bytes(int64_t B, int64_t Tq, int64_t Tk, int64_t Hq,
                                                    int64_t Hkv, int64_t Dh) const {
  return attention_block_plan_workspace_bytes(B, Tq, Tk, Hq, Hkv, Dh, {});
}

// The blocks cuDNN may take: the diagonal one (Tq == Tk) for each window and those wholly in
// the past (block_buckets).
size_t CudaBackend::attention_block_plan_workspace_bytes(int64_t B, int64_t Tq, int64_t Tk,
                                                         int64_t Hq, int64_t Hkv, int64_t Dh,
                                                         std::span<const int64_t> windows) const {
  auto plan = [&](std::span<const int64_t> w) {
    return planned(*impl_, plan_key({1, B, Tq, Tk, Hq, Hkv, Dh}, w),
                   block_buckets(B, Tq, Tk, Hq, Hkv, Dh, w), delta_bytes(B, Tq, Hq));
  };
  plan({});  // the entry points' check, remembered (as for whole rows)
  return plan(windows);
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
