// CudnnAttention with cuDNN 9 and its C++ frontend (cudnn_attention.h): one SDPA forward and
// one backward graph per shape, built at the workspace query (plan and setup time, for the
// run's whole bucket set: sdpa_buckets.h) and only looked up in a step, executed on the
// backend's compute stream with the caller's planned workspace. bf16 in and out, f32 softmax and
// accumulation, the Backend's [B, T, H, Dh] layouts expressed as strides (no transposes), GQA
// through k/v with fewer heads. Packed documents run as cuDNN's ragged sequences over the same
// memory: each tensor's batch axis becomes the documents, placed by per-document offsets
// (RaggedIndex), with the padding mask bounding each to its length.
#include <cudnn.h>
#include <cudnn_frontend.h>

#include <cmath>
#include <exception>
#include <map>
#include <mutex>
#include <unordered_map>

#include "kernels/cuda/cudnn_attention.h"
#include "shardlm/core/check.h"

namespace shardlm::cuda {

namespace fe = cudnn_frontend;

namespace {

// Tensor uids of the variant packs.
enum Uid : int64_t {
  kQ = 1,
  kK,
  kV,
  kO,
  kStats,
  kDO,
  kDQ,
  kDK,
  kDV,
  kSeqQ,
  kSeqKV,
  kQOff,
  kKVOff,
  kLseOff  // packed documents (RaggedIndex)
};

using GraphPtr = std::shared_ptr<fe::graph::Graph>;
using TensorPtr = std::shared_ptr<fe::graph::Tensor_attributes>;

GraphPtr new_graph() {
  auto g = std::make_shared<fe::graph::Graph>();
  g->set_io_data_type(fe::DataType_t::BFLOAT16)
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  return g;
}

// The i32 index tensor [n, 1, 1, 1] of a ragged graph (a sequence length or an offset).
TensorPtr index_tensor(const GraphPtr& g, const char* name, int64_t uid, int64_t n) {
  return g->tensor(fe::graph::Tensor_attributes()
                       .set_name(name)
                       .set_uid(uid)
                       .set_dim({n, 1, 1, 1})
                       .set_stride({1, 1, 1, 1})
                       .set_data_type(fe::DataType_t::INT32));
}

// A graph's view of the Backend's layouts: x [B, T, H, Dh] as dims [B, H, T, Dh] with strides;
// packed documents as dims [docs, H, max_len, Dh] with the same head and token strides, each
// document placed by its offset (q_off for q-shaped tensors, kv_off for k and v).
struct Layout {
  const SdpaShape& s;
  TensorPtr q_off, kv_off, lse_off, seq_q, seq_kv;  // null for dense rows

  Layout(const GraphPtr& g, const SdpaShape& shape) : s(shape) {
    if (s.docs == 0) return;
    q_off = index_tensor(g, "q_off", kQOff, s.docs + 1);
    kv_off = index_tensor(g, "kv_off", kKVOff, s.docs + 1);
    lse_off = index_tensor(g, "lse_off", kLseOff, s.docs + 1);
    seq_q = index_tensor(g, "seq_len_q", kSeqQ, s.docs);
    seq_kv = index_tensor(g, "seq_len_kv", kSeqKV, s.docs);
  }
  // Dims and strides of a q-shaped (kv = false) or k-shaped tensor.
  void shape(fe::graph::Tensor_attributes& t, int64_t uid, bool kv) const {
    const int64_t H = kv ? s.Hkv : s.Hq, T = kv ? s.Tk : s.Tq;
    const int64_t b = s.docs ? s.docs : s.B, len = s.docs ? s.max_len : T;
    t.set_uid(uid).set_dim({b, H, len, s.Dh}).set_stride({len * H * s.Dh, s.Dh, H * s.Dh, 1});
    if (s.docs) t.set_ragged_offset(kv ? kv_off : q_off);
  }
  TensorPtr input(const GraphPtr& g, const char* name, int64_t uid, bool kv) const {
    fe::graph::Tensor_attributes t;
    t.set_name(name);
    shape(t, uid, kv);
    return g->tensor(t);
  }
  void output(const TensorPtr& t, int64_t uid, bool kv) const {
    t->set_output(true);
    shape(*t, uid, kv);
  }
  // lse [B, Hq, Tq] f32: cuDNN's stats [B, Hq, Tq, 1]. Packed documents: token-major
  // [B * T, Hq], a document's stats starting at its lse_off, heads adjacent.
  void stats(const TensorPtr& t) const {
    t->set_uid(kStats).set_data_type(fe::DataType_t::FLOAT);
    if (s.docs == 0) {
      t->set_dim({s.B, s.Hq, s.Tq, 1}).set_stride({s.Hq * s.Tq, s.Tq, 1, 1});
      return;
    }
    t->set_dim({s.docs, s.Hq, s.max_len, 1})
        .set_stride({s.max_len * s.Hq, 1, s.Hq, 1})
        .set_ragged_offset(lse_off);
  }
  // The padding mask bounding each document to its length, and the workspace bound by the
  // tokens there are rather than by docs x max_len.
  template <typename Attributes>
  void mask(Attributes& opt) const {
    if (s.causal) opt.set_causal_mask(true);  // top-left: key s <= query t
    if (s.window > 0) opt.set_diagonal_band_left_bound(int(s.window));  // key s > query t - window
    if (s.docs == 0) return;
    opt.set_padding_mask(true).set_seq_len_q(seq_q).set_seq_len_kv(seq_kv);
    opt.set_max_total_seq_len_q(s.B * s.Tq).set_max_total_seq_len_kv(s.B * s.Tk);
  }
};

float scale_of(const SdpaShape& s) { return float(1.0 / std::sqrt(double(s.Dh))); }

GraphPtr forward_graph(const SdpaShape& s) {
  GraphPtr g = new_graph();
  const Layout l(g, s);
  const TensorPtr q = l.input(g, "q", kQ, false);
  const TensorPtr k = l.input(g, "k", kK, true);
  const TensorPtr v = l.input(g, "v", kV, true);
  auto opt = fe::graph::SDPA_attributes()
                 .set_name("attention_forward")
                 .set_generate_stats(true)
                 .set_attn_scale(scale_of(s));
  l.mask(opt);
  auto [o, stats] = g->sdpa(q, k, v, opt);
  l.output(o, kO, false);
  stats->set_output(true);
  l.stats(stats);
  return g;
}

GraphPtr backward_graph(const SdpaShape& s) {
  GraphPtr g = new_graph();
  const Layout l(g, s);
  const TensorPtr q = l.input(g, "q", kQ, false);
  const TensorPtr k = l.input(g, "k", kK, true);
  const TensorPtr v = l.input(g, "v", kV, true);
  const TensorPtr o = l.input(g, "out", kO, false);
  const TensorPtr dout = l.input(g, "dout", kDO, false);
  const TensorPtr stats = g->tensor(fe::graph::Tensor_attributes().set_name("lse"));
  l.stats(stats);
  auto opt = fe::graph::SDPA_backward_attributes()
                 .set_name("attention_backward")
                 .set_attn_scale(scale_of(s));
  l.mask(opt);
  auto [dq, dk, dv] = g->sdpa_backward(q, k, v, o, dout, stats, opt);
  l.output(dq, kDQ, false);
  l.output(dk, kDK, true);
  l.output(dv, kDV, true);
  return g;
}

// The variant pack's entries for a ragged shape's index (none for dense rows).
void add_ragged(std::unordered_map<int64_t, void*>& pack, const SdpaShape& s,
                const RaggedIndex& r) {
  if (s.docs == 0) return;
  pack.insert({{kSeqQ, r.seq_len},
               {kSeqKV, r.seq_len},
               {kQOff, r.q_off},
               {kKVOff, r.kv_off},
               {kLseOff, r.lse_off}});
}

// The built graph's workspace, or nullopt (with why) when cuDNN does not take it.
std::optional<int64_t> build(cudnnHandle_t h, const GraphPtr& g, std::string& why) {
  try {
    fe::error_t e = g->build(h, {fe::HeurMode_t::A, fe::HeurMode_t::FALLBACK});
    if (!e.is_good()) {
      why = e.get_message();
      return std::nullopt;
    }
    int64_t ws = 0;
    e = g->get_workspace_size(ws);
    if (!e.is_good()) {
      why = fmt::format("its workspace query failed: {}", e.get_message());
      return std::nullopt;
    }
    return ws;
  } catch (const std::exception& ex) {
    why = ex.what();
    return std::nullopt;
  }
}

// The GPU's compute capability as 10 x major + minor (90 for an H100), 0 when unknown.
int device_sm() {
  int dev = 0, major = 0, minor = 0;
  if (cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) != cudaSuccess)
    return 0;
  return 10 * major + minor;
}

}  // namespace

struct CudnnAttention::State {
  cudnnHandle_t handle = nullptr;
  std::string status;
  std::string ragged_refused;  // why this GPU and cuDNN take no ragged sequences (empty: they do)
  struct Graphs {
    GraphPtr fwd, bwd;
    int64_t fwd_ws = 0, bwd_ws = 0;
    bool ok = false;
    std::string why;  // of a declined shape
  };
  std::map<SdpaShape, Graphs> cache;
  int64_t unbuilt = 0;
  // One handle, one lock around every use of it: cuDNN forbids two threads using a handle at
  // once, and the workspace query (which builds) may come from any thread (a queued backend's
  // caller) while the backend's own thread executes. An execute only enqueues, so holding the
  // lock through it costs little.
  std::mutex mu;

  // The graphs of s, built on first sight. Under mu.
  const Graphs& build_graphs(const SdpaShape& s) {
    auto [it, fresh] = cache.try_emplace(s);
    Graphs& g = it->second;
    if (!fresh || handle == nullptr) return g;
    if (s.docs > 0 && !ragged_refused.empty()) {
      g.why = ragged_refused;
      return g;
    }
    g.fwd = forward_graph(s);
    g.bwd = backward_graph(s);
    const auto fw = build(handle, g.fwd, g.why);
    const auto bw = fw ? build(handle, g.bwd, g.why) : std::nullopt;
    g.ok = fw && bw;
    if (g.ok) {
      g.fwd_ws = *fw;
      g.bwd_ws = *bw;
    } else {
      g.fwd.reset();
      g.bwd.reset();
    }
    return g;
  }

  // The graphs of s when built and taken, else null (a shape never built is counted: a step
  // builds nothing, so it runs on the own kernel). Under mu.
  const Graphs* find(const SdpaShape& s) {
    const auto it = cache.find(s);
    if (it == cache.end()) ++unbuilt;
    return it != cache.end() && it->second.ok ? &it->second : nullptr;
  }
};

CudnnAttention::CudnnAttention(cudaStream_t stream) : st_(std::make_unique<State>()) {
  const size_t v = cudnnGetVersion();
  if (v < 90000) {
    st_->status = fmt::format("cuDNN {} is older than 9", v);
    return;
  }
  cudnnHandle_t h = nullptr;
  const cudnnStatus_t e = cudnnCreate(&h);
  if (e != CUDNN_STATUS_SUCCESS) {
    st_->status = fmt::format("cudnnCreate failed: {}", cudnnGetErrorString(e));
    return;
  }
  if (cudnnSetStream(h, stream) != CUDNN_STATUS_SUCCESS) {
    cudnnDestroy(h);
    st_->status = "cudnnSetStream failed";
    return;
  }
  st_->handle = h;
  st_->ragged_refused = ragged_unsupported(device_sm(), int64_t(v));
  st_->status = fmt::format("cuDNN {}.{}.{}, frontend {}.{}.{}", v / 10000, v / 100 % 100, v % 100,
                            CUDNN_FRONTEND_MAJOR_VERSION, CUDNN_FRONTEND_MINOR_VERSION,
                            CUDNN_FRONTEND_PATCH_VERSION);
}

CudnnAttention::~CudnnAttention() {
  st_->cache.clear();
  if (st_->handle) cudnnDestroy(st_->handle);
}

bool CudnnAttention::available() const { return st_->handle != nullptr; }

std::string CudnnAttention::status() const { return st_->status; }

std::string CudnnAttention::ragged_refused() const { return st_->ragged_refused; }

int64_t CudnnAttention::unbuilt_calls() const {
  std::lock_guard<std::mutex> lock(st_->mu);
  return st_->unbuilt;
}

std::optional<size_t> CudnnAttention::workspace_bytes(const SdpaShape& s) {
  std::lock_guard<std::mutex> lock(st_->mu);
  const State::Graphs& g = st_->build_graphs(s);
  if (!g.ok) return std::nullopt;
  return size_t(std::max(g.fwd_ws, g.bwd_ws));
}

std::string CudnnAttention::declined(const SdpaShape& s) {
  if (!available()) return st_->status;
  std::lock_guard<std::mutex> lock(st_->mu);
  const State::Graphs& g = st_->build_graphs(s);
  return g.ok ? std::string() : g.why;
}

bool CudnnAttention::forward(const SdpaShape& s, const void* q, const void* k, const void* v,
                             void* out, float* lse, void* ws, size_t ws_bytes,
                             const RaggedIndex& ragged) {
  std::lock_guard<std::mutex> lock(st_->mu);
  const State::Graphs* g = st_->find(s);
  if (g == nullptr || size_t(g->fwd_ws) > ws_bytes) return false;
  std::unordered_map<int64_t, void*> pack = {{kQ, const_cast<void*>(q)},
                                             {kK, const_cast<void*>(k)},
                                             {kV, const_cast<void*>(v)},
                                             {kO, out},
                                             {kStats, lse}};
  add_ragged(pack, s, ragged);
  fe::error_t e = g->fwd->execute(st_->handle, pack, ws);
  SHARDLM_CHECK_KIND(ErrorKind::kInternal, e.is_good(), "attention_forward: cuDNN SDPA failed: {}",
                     e.get_message());
  return true;
}

bool CudnnAttention::backward(const SdpaShape& s, const void* q, const void* k, const void* v,
                              const void* out, const float* lse, const void* dout, void* dq,
                              void* dk, void* dv, void* ws, size_t ws_bytes,
                              const RaggedIndex& ragged) {
  std::lock_guard<std::mutex> lock(st_->mu);
  const State::Graphs* g = st_->find(s);
  if (g == nullptr || size_t(g->bwd_ws) > ws_bytes) return false;
  std::unordered_map<int64_t, void*> pack = {{kQ, const_cast<void*>(q)},
                                             {kK, const_cast<void*>(k)},
                                             {kV, const_cast<void*>(v)},
                                             {kO, const_cast<void*>(out)},
                                             {kStats, const_cast<float*>(lse)},
                                             {kDO, const_cast<void*>(dout)},
                                             {kDQ, dq},
                                             {kDK, dk},
                                             {kDV, dv}};
  add_ragged(pack, s, ragged);
  fe::error_t e = g->bwd->execute(st_->handle, pack, ws);
  SHARDLM_CHECK_KIND(ErrorKind::kInternal, e.is_good(),
                     "attention_backward: cuDNN SDPA backward failed: {}", e.get_message());
  return true;
}

}  // namespace shardlm::cuda
