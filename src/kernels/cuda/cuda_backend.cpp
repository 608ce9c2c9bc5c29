// CudaBackend: checks every op's shapes and dtypes the way the CPU backend does, then enqueues
// the kernels of launch.h and cuBLASLt GEMMs on the compute stream.
#include "kernels/cuda/cuda_backend.h"

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "kernels/cuda/launch.h"
#include "kernels/kernel_checks.h"

namespace shardlm::cuda {
namespace {

void cuda_ok(cudaError_t e, std::string_view what) {
  if (e != cudaSuccess) {
    SHARDLM_FAIL(ErrorKind::kInternal, "CUDA error in {}: {} ({})", what, cudaGetErrorString(e),
                 cudaGetErrorName(e));
  }
}

void lt_ok(cublasStatus_t s, std::string_view what) {
  if (s != CUBLAS_STATUS_SUCCESS) {
    SHARDLM_FAIL(ErrorKind::kInternal, "cuBLASLt error in {}: status {}", what, int(s));
  }
}

constexpr size_t kLtWorkspaceBytes = size_t(32) << 20;  // cuBLASLt's advice for Hopper
constexpr int64_t kStageElems = int64_t(1) << 20;       // host<->device conversion staging
constexpr int kFenceEvents = 64;                        // copy_async fences kept as events

Elem elem_of(DType t) { return t == DType::kBF16 ? Elem::kBF16 : Elem::kF32; }

void on_device(const Tensor& t, std::string_view op, std::string_view name) {
  SHARDLM_CHECK(t.pool() == MemPool::kDevice || t.numel() == 0,
                "{}: {} lives in host memory; the CUDA backend computes on device tensors", op,
                name);
}

// The element type of a float tensor that must live on the device.
Elem elem(const Tensor& t, std::string_view op, std::string_view name) {
  SHARDLM_CHECK(t.dtype() == DType::kF32 || t.dtype() == DType::kBF16,
                "{}: {} must be f32 or bf16, got {}", op, name, dtype_name(t.dtype()));
  on_device(t, op, name);
  return elem_of(t.dtype());
}

// check_tensor's dtype, rank (-1: any) and data, on the device.
void need(const Tensor& t, DType dtype, int rank, std::string_view op, std::string_view name) {
  check_tensor(t, dtype, rank, op, name);
  on_device(t, op, name);
}

void same_type(const Tensor& a, const Tensor& b, std::string_view op, std::string_view an,
               std::string_view bn) {
  SHARDLM_CHECK(a.dtype() == b.dtype(), "{}: {} is {} but {} is {}; one dtype per op", op, an,
                dtype_name(a.dtype()), bn, dtype_name(b.dtype()));
}

cudaDataType_t lt_type(Elem e) { return e == Elem::kBF16 ? CUDA_R_16BF : CUDA_R_32F; }

}  // namespace

struct CudaBackend::Impl {
  int device = 0;
  cudaStream_t stream = nullptr;
  cublasLtHandle_t lt = nullptr;
  void* lt_ws = nullptr;
  double* d_scratch = nullptr;            // [kSumBlocks] partials, then [2] results
  int32_t* d_flags = nullptr;             // [2] id checks
  double* h_scratch = nullptr;            // pinned [4]
  int32_t* h_flags = nullptr;             // pinned [2]
  void* h_stage = nullptr;                // pinned, kStageElems * 4 bytes
  int64_t used_at_start = 0;              // cudaMemGetInfo's total - free after construction
  cudaStream_t copy_stream = nullptr;     // copy_async's, non-blocking
  cudaEvent_t copy_after = nullptr;       // recorded on stream, waited for by copy_stream
  cudaEvent_t fences[kFenceEvents] = {};  // fence f is fences[f % kFenceEvents]
  uint64_t fence_count = 0;               // the last fence issued

  void sync() { cuda_ok(cudaStreamSynchronize(stream), "cudaStreamSynchronize"); }

  // Column-major C[m, n] = op(A)[m, k] op(B)[k, n] + beta C (+ bias[m] on every column).
  void gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, const void* A, Elem at, int64_t lda,
            const void* B, Elem bt, int64_t ldb, void* C, Elem ct, int64_t ldc, float beta,
            const void* bias, std::string_view what) {
    if (m == 0 || n == 0) return;
    SHARDLM_CHECK(k > 0, "{}: inner dimension is 0", what);
    cublasLtMatmulDesc_t op = nullptr;
    cublasLtMatrixLayout_t la = nullptr, lb = nullptr, lc = nullptr;
    cublasLtMatmulPreference_t pref = nullptr;
    struct Cleanup {
      cublasLtMatmulDesc_t& op;
      cublasLtMatrixLayout_t &la, &lb, &lc;
      cublasLtMatmulPreference_t& pref;
      ~Cleanup() {
        if (pref) cublasLtMatmulPreferenceDestroy(pref);
        if (lc) cublasLtMatrixLayoutDestroy(lc);
        if (lb) cublasLtMatrixLayoutDestroy(lb);
        if (la) cublasLtMatrixLayoutDestroy(la);
        if (op) cublasLtMatmulDescDestroy(op);
      }
    } cleanup{op, la, lb, lc, pref};
    lt_ok(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F), what);
    const cublasOperation_t opa = ta ? CUBLAS_OP_T : CUBLAS_OP_N;
    const cublasOperation_t opb = tb ? CUBLAS_OP_T : CUBLAS_OP_N;
    lt_ok(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &opa, sizeof(opa)), what);
    lt_ok(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &opb, sizeof(opb)), what);
    if (bias != nullptr) {
      const cublasLtEpilogue_t epi = CUBLASLT_EPILOGUE_BIAS;
      const cudaDataType_t bias_type = lt_type(ct);
      lt_ok(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof(epi)),
            what);
      lt_ok(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias,
                                           sizeof(bias)),
            what);
      lt_ok(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bias_type,
                                           sizeof(bias_type)),
            what);
    }
    lt_ok(cublasLtMatrixLayoutCreate(&la, lt_type(at), ta ? k : m, ta ? m : k, lda), what);
    lt_ok(cublasLtMatrixLayoutCreate(&lb, lt_type(bt), tb ? n : k, tb ? k : n, ldb), what);
    lt_ok(cublasLtMatrixLayoutCreate(&lc, lt_type(ct), m, n, ldc), what);
    lt_ok(cublasLtMatmulPreferenceCreate(&pref), what);
    const size_t ws = kLtWorkspaceBytes;
    lt_ok(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws,
                                               sizeof(ws)),
          what);
    cublasLtMatmulHeuristicResult_t result{};
    int found = 0;
    lt_ok(cublasLtMatmulAlgoGetHeuristic(lt, op, la, lb, lc, lc, pref, 1, &result, &found), what);
    SHARDLM_CHECK(found > 0, "{}: cuBLASLt has no algorithm for {}x{}x{}", what, m, n, k);
    const float alpha = 1.f;
    lt_ok(cublasLtMatmul(lt, op, &alpha, A, la, B, lb, &beta, C, lc, C, lc, &result.algo, lt_ws, ws,
                         stream),
          what);
  }
};

CudaBackend::CudaBackend(int device) : impl_(std::make_unique<Impl>()) {
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess || count == 0) {
    SHARDLM_FAIL(ErrorKind::kConfig,
                 "no CUDA device is usable ({}); run with the CPU backend (train.device = cpu)",
                 e == cudaSuccess ? "none found" : cudaGetErrorString(e));
  }
  SHARDLM_CHECK_KIND(ErrorKind::kConfig, device >= 0 && device < count,
                     "CUDA device {} does not exist ({} visible)", device, count);
  Impl& m = *impl_;
  m.device = device;
  cuda_ok(cudaSetDevice(device), "cudaSetDevice");
  cuda_ok(cudaStreamCreateWithFlags(&m.stream, cudaStreamNonBlocking), "cudaStreamCreate");
  cuda_ok(cudaStreamCreateWithFlags(&m.copy_stream, cudaStreamNonBlocking), "cudaStreamCreate");
  cuda_ok(cudaEventCreateWithFlags(&m.copy_after, cudaEventDisableTiming), "cudaEventCreate");
  for (cudaEvent_t& e : m.fences)
    cuda_ok(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreate");
  lt_ok(cublasLtCreate(&m.lt), "cublasLtCreate");
  cuda_ok(cudaMalloc(&m.lt_ws, kLtWorkspaceBytes), "cudaMalloc (cuBLASLt workspace)");
  cuda_ok(cudaMalloc(&m.d_scratch, (kSumBlocks + 2) * sizeof(double)), "cudaMalloc (scratch)");
  cuda_ok(cudaMalloc(&m.d_flags, 2 * sizeof(int32_t)), "cudaMalloc (flags)");
  cuda_ok(cudaMallocHost(&m.h_scratch, 4 * sizeof(double)), "cudaMallocHost");
  cuda_ok(cudaMallocHost(&m.h_flags, 2 * sizeof(int32_t)), "cudaMallocHost");
  cuda_ok(cudaMallocHost(&m.h_stage, kStageElems * 4), "cudaMallocHost (staging)");
  size_t free_b = 0, total_b = 0;
  cuda_ok(cudaMemGetInfo(&free_b, &total_b), "cudaMemGetInfo");
  m.used_at_start = int64_t(total_b - free_b);
}

int64_t CudaBackend::driver_device_bytes() const {
  size_t free_b = 0, total_b = 0;
  cuda_ok(cudaSetDevice(impl_->device), "cudaSetDevice");
  cuda_ok(cudaMemGetInfo(&free_b, &total_b), "cudaMemGetInfo");
  return int64_t(total_b - free_b) - impl_->used_at_start;
}

CudaBackend::~CudaBackend() {
  Impl& m = *impl_;
  if (m.stream) cudaStreamSynchronize(m.stream);
  if (m.copy_stream) cudaStreamSynchronize(m.copy_stream);
  for (cudaEvent_t e : m.fences)
    if (e) cudaEventDestroy(e);
  if (m.copy_after) cudaEventDestroy(m.copy_after);
  if (m.copy_stream) cudaStreamDestroy(m.copy_stream);
  cudaFreeHost(m.h_stage);
  cudaFreeHost(m.h_flags);
  cudaFreeHost(m.h_scratch);
  cudaFree(m.d_flags);
  cudaFree(m.d_scratch);
  cudaFree(m.lt_ws);
  if (m.lt) cublasLtDestroy(m.lt);
  if (m.stream) cudaStreamDestroy(m.stream);
}

void CudaBackend::synchronize() {
  impl_->sync();
  cuda_ok(cudaStreamSynchronize(impl_->copy_stream), "cudaStreamSynchronize (copies)");
}

void* CudaBackend::device_stream() { return impl_->stream; }

size_t CudaBackend::fixed_device_bytes() const {
  return kLtWorkspaceBytes + (kSumBlocks + 2) * sizeof(double) + 2 * sizeof(int32_t);
}

void* CudaBackend::allocate(size_t bytes, MemPool pool) {
  const size_t rounded = align_up(bytes == 0 ? 1 : bytes);
  void* p = nullptr;
  if (pool == MemPool::kDevice) {
    if (cudaMalloc(&p, rounded) != cudaSuccess) {
      cudaGetLastError();  // clear the sticky-free allocation error
      size_t free_b = 0, total_b = 0;
      cudaMemGetInfo(&free_b, &total_b);
      SHARDLM_FAIL(ErrorKind::kOutOfMemory,
                   "out of GPU memory allocating {} (the GPU has {} free of {})",
                   format_bytes(int64_t(bytes)), format_bytes(int64_t(free_b)),
                   format_bytes(int64_t(total_b)));
    }
    cuda_ok(cudaMemset(p, 0, rounded), "cudaMemset");
  } else {
    if (cudaMallocHost(&p, rounded) != cudaSuccess) {
      cudaGetLastError();
      SHARDLM_FAIL(ErrorKind::kOutOfMemory, "out of pinned host memory allocating {}",
                   format_bytes(int64_t(bytes)));
    }
    std::memset(p, 0, rounded);
  }
  return p;
}

void CudaBackend::deallocate(void* ptr, size_t /*bytes*/, MemPool pool) {
  if (ptr == nullptr) return;
  cudaStreamSynchronize(impl_->stream);  // no kernel or copy may still use it
  cudaStreamSynchronize(impl_->copy_stream);
  if (pool == MemPool::kDevice)
    cudaFree(ptr);
  else
    cudaFreeHost(ptr);
}

// ---- memory movement ------------------------------------------------------------------------

void CudaBackend::zero(const Tensor& x) {
  if (x.numel() == 0) return;
  SHARDLM_CHECK(!x.empty(), "zero: tensor {} has no data", x.shape().str());
  if (x.pool() == MemPool::kHost) {
    impl_->sync();
    std::memset(x.data(), 0, x.bytes());
    return;
  }
  cuda_ok(cudaMemsetAsync(x.data(), 0, x.bytes(), impl_->stream), "zero");
}

void CudaBackend::copy(const Tensor& src, const Tensor& dst) {
  SHARDLM_CHECK(src.numel() == dst.numel(), "copy: src has {} elements but dst has {}", src.numel(),
                dst.numel());
  SHARDLM_CHECK(src.dtype() == dst.dtype(), "copy: src is {} but dst is {}; use convert",
                dtype_name(src.dtype()), dtype_name(dst.dtype()));
  if (src.numel() == 0 || src.data() == dst.data()) return;
  cuda_ok(cudaMemcpyAsync(dst.data(), src.data(), src.bytes(), cudaMemcpyDefault, impl_->stream),
          "copy");
  // The caller may read or reuse a host buffer as soon as this returns.
  if (src.pool() == MemPool::kHost || dst.pool() == MemPool::kHost) impl_->sync();
}

uint64_t CudaBackend::copy_async(const Tensor& src, const Tensor& dst) {
  SHARDLM_CHECK(src.numel() == dst.numel(), "copy_async: src has {} elements but dst has {}",
                src.numel(), dst.numel());
  SHARDLM_CHECK(src.dtype() == dst.dtype(), "copy_async: src is {} but dst is {}",
                dtype_name(src.dtype()), dtype_name(dst.dtype()));
  Impl& m = *impl_;
  if (src.numel() == 0 || src.data() == dst.data()) return m.fence_count;
  cuda_ok(cudaEventRecord(m.copy_after, m.stream), "copy_async");
  cuda_ok(cudaStreamWaitEvent(m.copy_stream, m.copy_after, 0), "copy_async");
  cuda_ok(cudaMemcpyAsync(dst.data(), src.data(), src.bytes(), cudaMemcpyDefault, m.copy_stream),
          "copy_async");
  ++m.fence_count;
  cuda_ok(cudaEventRecord(m.fences[m.fence_count % kFenceEvents], m.copy_stream), "copy_async");
  return m.fence_count;
}

void CudaBackend::wait_fence(uint64_t fence) {
  Impl& m = *impl_;
  if (fence == 0) return;
  SHARDLM_CHECK(fence <= m.fence_count, "wait_fence: fence {} was never issued (last {})", fence,
                m.fence_count);
  // The copy stream runs in order: an event recorded later (the slot was reused) covers it.
  cuda_ok(cudaStreamWaitEvent(m.stream, m.fences[fence % kFenceEvents], 0), "wait_fence");
}

void CudaBackend::convert(const Tensor& src, const Tensor& dst) {
  SHARDLM_CHECK(src.numel() == dst.numel(), "convert: src has {} elements but dst has {}",
                src.numel(), dst.numel());
  const auto is_float = [](DType t) { return t == DType::kF32 || t == DType::kBF16; };
  SHARDLM_CHECK(is_float(src.dtype()) && is_float(dst.dtype()),
                "convert: f32 <-> bf16 only, got {} -> {}", dtype_name(src.dtype()),
                dtype_name(dst.dtype()));
  const int64_t n = src.numel();
  if (n == 0) return;
  if (src.dtype() == dst.dtype()) return copy(src, dst);
  const Elem st = elem_of(src.dtype()), dt = elem_of(dst.dtype());
  const bool sh = src.pool() == MemPool::kHost, dh = dst.pool() == MemPool::kHost;
  const size_t ss = dtype_size(src.dtype()), ds = dtype_size(dst.dtype());
  auto host_convert = [&](const std::byte* s, std::byte* d, int64_t count) {
    if (st == Elem::kF32) {
      const float* f = reinterpret_cast<const float*>(s);
      uint16_t* b = reinterpret_cast<uint16_t*>(d);
      for (int64_t i = 0; i < count; ++i) b[i] = f32_to_bf16(f[i]);
    } else {
      const uint16_t* b = reinterpret_cast<const uint16_t*>(s);
      float* f = reinterpret_cast<float*>(d);
      for (int64_t i = 0; i < count; ++i) f[i] = bf16_to_f32(b[i]);
    }
  };
  const auto* s = static_cast<const std::byte*>(src.data());
  auto* d = static_cast<std::byte*>(dst.data());
  auto* stage = static_cast<std::byte*>(impl_->h_stage);
  if (!sh && !dh) {
    cuda_ok(launch_convert(src.data(), st, dst.data(), dt, n, impl_->stream), "convert");
  } else if (sh && dh) {
    impl_->sync();
    host_convert(s, d, n);
  } else if (sh) {  // host -> device: convert into pinned staging, then copy
    for (int64_t i = 0; i < n; i += kStageElems) {
      const int64_t c = std::min(kStageElems, n - i);
      impl_->sync();  // the staging buffer is free again
      host_convert(s + i * ss, stage, c);
      cuda_ok(cudaMemcpyAsync(d + i * ds, stage, c * ds, cudaMemcpyHostToDevice, impl_->stream),
              "convert");
    }
    impl_->sync();
  } else {  // device -> host
    for (int64_t i = 0; i < n; i += kStageElems) {
      const int64_t c = std::min(kStageElems, n - i);
      cuda_ok(cudaMemcpyAsync(stage, s + i * ss, c * ss, cudaMemcpyDeviceToHost, impl_->stream),
              "convert");
      impl_->sync();
      host_convert(stage, d + i * ds, c);
    }
  }
}

void CudaBackend::add(const Tensor& a, const Tensor& b, const Tensor& out) {
  const Elem t = elem(a, "add", "a");
  elem(b, "add", "b");
  elem(out, "add", "out");
  same_type(a, b, "add", "a", "b");
  same_type(a, out, "add", "a", "out");
  SHARDLM_CHECK(a.numel() == b.numel() && a.numel() == out.numel(),
                "add: a, b, out must have equal sizes, got {}, {}, {}", a.numel(), b.numel(),
                out.numel());
  cuda_ok(launch_add(a.data(), b.data(), out.data(), t, a.numel(), impl_->stream), "add");
}

void CudaBackend::scale(const Tensor& x, float s) {
  const Elem t = elem(x, "scale", "x");
  cuda_ok(launch_scale(x.data(), t, s, x.numel(), impl_->stream), "scale");
}

void CudaBackend::dropout(const Tensor& x, const Tensor& out, float p, uint64_t seed,
                          int64_t first) {
  need(x, DType::kF32, -1, "dropout", "x");
  need(out, DType::kF32, -1, "dropout", "out");
  SHARDLM_CHECK(x.numel() == out.numel(), "dropout: x {} and out {} differ in element count",
                x.shape().str(), out.shape().str());
  SHARDLM_CHECK(p >= 0.f && p < 1.f, "dropout: p = {} must be in [0, 1)", p);
  cuda_ok(launch_dropout(x.f32(), out.f32(), x.numel(), p, seed, first, impl_->stream), "dropout");
}

double CudaBackend::sum_squares(const Tensor& x) {
  if (x.numel() == 0) return 0.0;
  const Elem t = elem(x, "sum_squares", "x");
  Impl& m = *impl_;
  cuda_ok(
      launch_sum_squares(x.data(), t, x.numel(), m.d_scratch, m.d_scratch + kSumBlocks, m.stream),
      "sum_squares");
  cuda_ok(cudaMemcpyAsync(m.h_scratch, m.d_scratch + kSumBlocks, sizeof(double),
                          cudaMemcpyDeviceToHost, m.stream),
          "sum_squares");
  m.sync();
  return m.h_scratch[0];
}

// ---- linear ------------------------------------------------------------------------------------

void CudaBackend::linear_forward(const Tensor& x, const Tensor& w, const Tensor& b,
                                 const Tensor& y) {
  constexpr std::string_view op = "linear_forward";
  const Elem t = elem(x, op, "x");
  elem(w, op, "w");
  elem(y, op, "y");
  same_type(x, w, op, "x", "w");
  same_type(x, y, op, "x", "y");
  SHARDLM_CHECK(x.rank() == 2 && w.rank() == 2 && y.rank() == 2 && x.dim(1) == w.dim(1) &&
                    y.dim(0) == x.dim(0) && y.dim(1) == w.dim(0),
                "{}: expects x [N, in], w [out, in], y [N, out], got {}, {}, {}", op,
                x.shape().str(), w.shape().str(), y.shape().str());
  if (!b.empty()) {
    elem(b, op, "b");
    same_type(x, b, op, "x", "b");
    SHARDLM_CHECK(b.rank() == 1 && b.dim(0) == w.dim(0), "{}: b must be [{}], got {}", op, w.dim(0),
                  b.shape().str());
  }
  const int64_t N = x.dim(0), in = x.dim(1), out = w.dim(0);
  if (in == 0) {
    zero(y);
    return;
  }
  // y^T [out, N] = W [out, in] x^T [in, N] in column-major terms.
  impl_->gemm(true, false, out, N, in, w.data(), t, in, x.data(), t, in, y.data(), t, out, 0.f,
              b.empty() ? nullptr : b.data(), op);
}

void CudaBackend::linear_backward(const Tensor& x, const Tensor& w, const Tensor& dy,
                                  const Tensor& dx, const Tensor& dw, const Tensor& db) {
  constexpr std::string_view op = "linear_backward";
  const Elem t = elem(x, op, "x");
  elem(w, op, "w");
  elem(dy, op, "dy");
  same_type(x, w, op, "x", "w");
  same_type(x, dy, op, "x", "dy");
  SHARDLM_CHECK(x.rank() == 2 && w.rank() == 2 && dy.rank() == 2 && x.dim(1) == w.dim(1) &&
                    dy.dim(0) == x.dim(0) && dy.dim(1) == w.dim(0),
                "{}: expects x [N, in], w [out, in], dy [N, out], got {}, {}, {}", op,
                x.shape().str(), w.shape().str(), dy.shape().str());
  const int64_t N = x.dim(0), in = x.dim(1), out = w.dim(0);
  if (!dx.empty()) {
    elem(dx, op, "dx");
    same_type(x, dx, op, "x", "dx");
    check_same_shape(x, dx, op, "x", "dx");
    // dx^T [in, N] = W^T [in, out] dy^T [out, N]
    if (out == 0)
      zero(dx);
    else
      impl_->gemm(false, false, in, N, out, w.data(), t, in, dy.data(), t, out, dx.data(), t, in,
                  0.f, nullptr, op);
  }
  if (!dw.empty()) {
    const Elem gt = elem(dw, op, "dw");
    SHARDLM_CHECK(gt == Elem::kF32 || dw.dtype() == x.dtype(), "{}: dw must be f32 or {}", op,
                  dtype_name(x.dtype()));
    check_same_shape(w, dw, op, "w", "dw");
    // dW^T [in, out] += x^T [in, N] dy [N, out]
    if (N > 0)
      impl_->gemm(false, true, in, out, N, x.data(), t, in, dy.data(), t, out, dw.data(), gt, in,
                  1.f, nullptr, op);
  }
  if (!db.empty()) {
    need(db, DType::kF32, 1, op, "db");
    SHARDLM_CHECK(db.dim(0) == out, "{}: db must be [{}], got {}", op, out, db.shape().str());
    cuda_ok(launch_column_sum(dy.data(), t, db.f32(), N, out, impl_->stream), op);
  }
}

// ---- embedding ---------------------------------------------------------------------------------

namespace {
// Bad ids are a data error naming the first position, raised before any output is written.
void check_ids_on_device(CudaBackend::Impl& m, const Tensor& ids, int64_t V, bool allow_ignore,
                         std::string_view op, std::string_view what) {
  if (ids.numel() == 0) return;
  cuda_ok(launch_check_ids(ids.i32(), ids.numel(), V, allow_ignore, m.d_flags, m.stream), op);
  cuda_ok(
      cudaMemcpyAsync(m.h_flags, m.d_flags, 2 * sizeof(int32_t), cudaMemcpyDeviceToHost, m.stream),
      op);
  m.sync();
  if (m.h_flags[0] != 0x7fffffff) {
    SHARDLM_FAIL(ErrorKind::kData,
                 "{}: {} {} at position {} is outside the vocabulary [0, {}){}; the data and the "
                 "model's vocab_size disagree",
                 op, what, m.h_flags[1], m.h_flags[0] - 1, V,
                 allow_ignore ? " and is not the ignore index -1" : "");
  }
}
}  // namespace

void CudaBackend::embedding_forward(const Tensor& tokens, const Tensor& table, const Tensor& out) {
  embedding_forward_slice(tokens, table, 0, table.rank() == 2 ? table.dim(0) : 0, out);
}

void CudaBackend::embedding_backward(const Tensor& tokens, const Tensor& dout,
                                     const Tensor& dtable) {
  embedding_backward_slice(tokens, dout, 0, dtable.rank() == 2 ? dtable.dim(0) : 0, dtable);
}

void CudaBackend::embedding_forward_slice(const Tensor& tokens, const Tensor& table,
                                          int64_t vocab_begin, int64_t vocab, const Tensor& out) {
  constexpr std::string_view op = "embedding_forward";
  need(tokens, DType::kI32, 1, op, "tokens");
  const Elem t = elem(table, op, "table");
  elem(out, op, "out");
  same_type(table, out, op, "table", "out");
  SHARDLM_CHECK(table.rank() == 2 && out.rank() == 2 && out.dim(0) == tokens.dim(0) &&
                    out.dim(1) == table.dim(1),
                "{}: expects tokens [N], table [V, D], out [N, D], got {}, {}, {}", op,
                tokens.shape().str(), table.shape().str(), out.shape().str());
  SHARDLM_CHECK(vocab_begin >= 0 && vocab_begin + table.dim(0) <= vocab,
                "{}: the slice [{}, {}) of table {} is not inside the vocabulary [0, {})", op,
                vocab_begin, vocab_begin + table.dim(0), table.shape().str(), vocab);
  check_ids_on_device(*impl_, tokens, vocab, false, op, "token id");
  cuda_ok(launch_embedding_forward(tokens.i32(), table.data(), out.data(), t, tokens.dim(0),
                                   table.dim(1), vocab_begin, table.dim(0), impl_->stream),
          op);
}

void CudaBackend::embedding_backward_slice(const Tensor& tokens, const Tensor& dout,
                                           int64_t vocab_begin, int64_t vocab,
                                           const Tensor& dtable) {
  constexpr std::string_view op = "embedding_backward";
  need(tokens, DType::kI32, 1, op, "tokens");
  const Elem t = elem(dout, op, "dout");
  need(dtable, DType::kF32, 2, op, "dtable");
  SHARDLM_CHECK(dout.rank() == 2 && dout.dim(0) == tokens.dim(0) && dout.dim(1) == dtable.dim(1),
                "{}: expects tokens [N], dout [N, D], dtable [V, D], got {}, {}, {}", op,
                tokens.shape().str(), dout.shape().str(), dtable.shape().str());
  SHARDLM_CHECK(vocab_begin >= 0 && vocab_begin + dtable.dim(0) <= vocab,
                "{}: the slice [{}, {}) of dtable {} is not inside the vocabulary [0, {})", op,
                vocab_begin, vocab_begin + dtable.dim(0), dtable.shape().str(), vocab);
  check_ids_on_device(*impl_, tokens, vocab, false, op, "token id");
  cuda_ok(launch_embedding_backward(tokens.i32(), dout.data(), t, dtable.f32(), tokens.dim(0),
                                    dtable.dim(1), vocab_begin, dtable.dim(0), impl_->stream),
          op);
}

// ---- RMSNorm, RoPE, SwiGLU
// -----------------------------------------------------------------------

void CudaBackend::rmsnorm_forward(const Tensor& x, const Tensor& w, float eps, const Tensor& y,
                                  const Tensor& rstd) {
  constexpr std::string_view op = "rmsnorm_forward";
  const Elem t = elem(x, op, "x");
  elem(w, op, "w");
  elem(y, op, "y");
  same_type(x, w, op, "x", "w");
  same_type(x, y, op, "x", "y");
  need(rstd, DType::kF32, 1, op, "rstd");
  SHARDLM_CHECK(x.rank() == 2 && w.rank() == 1 && w.dim(0) == x.dim(1) && rstd.dim(0) == x.dim(0),
                "{}: expects x [N, D], w [D], rstd [N], got {}, {}, {}", op, x.shape().str(),
                w.shape().str(), rstd.shape().str());
  check_same_shape(x, y, op, "x", "y");
  cuda_ok(launch_rmsnorm_forward(x.data(), w.data(), t, eps, y.data(), rstd.f32(), x.dim(0),
                                 x.dim(1), impl_->stream),
          op);
}

void CudaBackend::rmsnorm_backward(const Tensor& x, const Tensor& w, const Tensor& rstd,
                                   const Tensor& dy, const Tensor& dx, const Tensor& dw) {
  constexpr std::string_view op = "rmsnorm_backward";
  const Elem t = elem(x, op, "x");
  elem(w, op, "w");
  elem(dy, op, "dy");
  elem(dx, op, "dx");
  same_type(x, w, op, "x", "w");
  same_type(x, dy, op, "x", "dy");
  same_type(x, dx, op, "x", "dx");
  need(rstd, DType::kF32, 1, op, "rstd");
  need(dw, DType::kF32, 1, op, "dw");
  SHARDLM_CHECK(x.rank() == 2 && w.rank() == 1 && w.dim(0) == x.dim(1) && rstd.dim(0) == x.dim(0),
                "{}: expects x [N, D], w [D], rstd [N], got {}, {}, {}", op, x.shape().str(),
                w.shape().str(), rstd.shape().str());
  check_same_shape(x, dy, op, "x", "dy");
  check_same_shape(x, dx, op, "x", "dx");
  check_same_shape(w, dw, op, "w", "dw");
  cuda_ok(launch_rmsnorm_backward(x.data(), w.data(), t, rstd.f32(), dy.data(), dx.data(), dw.f32(),
                                  x.dim(0), x.dim(1), impl_->stream),
          op);
}

namespace {
void rope(CudaBackend::Impl& m, const Tensor& x, const Tensor& positions, const Tensor& inv_freq,
          float direction, std::string_view op) {
  const Elem t = elem(x, op, "x");
  need(positions, DType::kI32, 1, op, "positions");
  need(inv_freq, DType::kF32, 1, op, "inv_freq");
  SHARDLM_CHECK(x.rank() == 3 && x.dim(2) % 2 == 0, "{}: x must be [N, H, Dh] with Dh even, got {}",
                op, x.shape().str());
  SHARDLM_CHECK(positions.dim(0) == x.dim(0), "{}: positions is {} but x is {}", op,
                positions.shape().str(), x.shape().str());
  SHARDLM_CHECK(inv_freq.dim(0) == x.dim(2) / 2, "{}: inv_freq is {}, expected [{}]", op,
                inv_freq.shape().str(), x.dim(2) / 2);
  cuda_ok(launch_rope(x.data(), t, positions.i32(), inv_freq.f32(), x.dim(0), x.dim(1), x.dim(2),
                      direction, m.stream),
          op);
}
}  // namespace

void CudaBackend::rope_forward(const Tensor& x, const Tensor& positions, const Tensor& inv_freq) {
  rope(*impl_, x, positions, inv_freq, 1.f, "rope_forward");
}
void CudaBackend::rope_backward(const Tensor& dx, const Tensor& positions, const Tensor& inv_freq) {
  rope(*impl_, dx, positions, inv_freq, -1.f, "rope_backward");
}

void CudaBackend::swiglu_forward(const Tensor& gate, const Tensor& up, const Tensor& h) {
  constexpr std::string_view op = "swiglu_forward";
  const Elem t = elem(gate, op, "gate");
  elem(up, op, "up");
  elem(h, op, "h");
  same_type(gate, up, op, "gate", "up");
  same_type(gate, h, op, "gate", "h");
  check_same_shape(gate, up, op, "gate", "up");
  check_same_shape(gate, h, op, "gate", "h");
  cuda_ok(launch_swiglu_forward(gate.data(), up.data(), h.data(), t, gate.numel(), impl_->stream),
          op);
}

void CudaBackend::swiglu_backward(const Tensor& gate, const Tensor& up, const Tensor& dh,
                                  const Tensor& dgate, const Tensor& dup) {
  constexpr std::string_view op = "swiglu_backward";
  const Elem t = elem(gate, op, "gate");
  for (const auto& [x, name] :
       {std::pair{&up, "up"}, {&dh, "dh"}, {&dgate, "dgate"}, {&dup, "dup"}}) {
    elem(*x, op, name);
    same_type(gate, *x, op, "gate", name);
    check_same_shape(gate, *x, op, "gate", name);
  }
  cuda_ok(launch_swiglu_backward(gate.data(), up.data(), dh.data(), dgate.data(), dup.data(), t,
                                 gate.numel(), impl_->stream),
          op);
}

// ---- attention
// -----------------------------------------------------------------------------------

namespace {

AttnArgs attn_args(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& seg_start,
                   int64_t q_offset, int64_t k_offset, std::string_view op) {
  AttnArgs a;
  a.t = elem(q, op, "q");
  elem(k, op, "k");
  elem(v, op, "v");
  same_type(q, k, op, "q", "k");
  same_type(q, v, op, "q", "v");
  SHARDLM_CHECK(q.rank() == 4 && k.rank() == 4 && k.shape() == v.shape(),
                "{}: expects q [B, Tq, Hq, Dh] and k, v [B, Tk, Hkv, Dh], got {}, {}, {}", op,
                q.shape().str(), k.shape().str(), v.shape().str());
  a.B = q.dim(0);
  a.Tq = q.dim(1);
  a.Hq = q.dim(2);
  a.Dh = q.dim(3);
  a.Tk = k.dim(1);
  a.Hkv = k.dim(2);
  SHARDLM_CHECK(k.dim(0) == a.B && k.dim(3) == a.Dh, "{}: k {} does not match q {}", op,
                k.shape().str(), q.shape().str());
  SHARDLM_CHECK(a.Hkv > 0 && a.Hq % a.Hkv == 0,
                "{}: Hq = {} query heads must be a multiple of Hkv = {} kv heads", op, a.Hq, a.Hkv);
  SHARDLM_CHECK(a.Dh > 0 && a.Dh <= kMaxHeadDim,
                "{}: head dim {} is outside what the CUDA kernels take (1..{})", op, a.Dh,
                kMaxHeadDim);
  SHARDLM_CHECK(q_offset >= 0 && k_offset >= 0, "{}: offsets must be >= 0, got {} and {}", op,
                q_offset, k_offset);
  if (!seg_start.empty()) {
    need(seg_start, DType::kI32, 2, op, "seg_start");
    SHARDLM_CHECK(seg_start.dim(0) == a.B && seg_start.dim(1) == a.Tq,
                  "{}: seg_start must be [B, Tq] = [{}, {}], got {}", op, a.B, a.Tq,
                  seg_start.shape().str());
    a.seg = seg_start.i32();
  }
  a.q = q.data();
  a.k = k.data();
  a.v = v.data();
  a.q_offset = q_offset;
  a.k_offset = k_offset;
  a.k_batch_stride = a.Tk * a.Hkv * a.Dh;
  return a;
}

void check_out_lse(const AttnArgs& a, const Tensor& q, const Tensor& out, const Tensor& lse,
                   std::string_view op) {
  elem(out, op, "out");
  same_type(q, out, op, "q", "out");
  check_same_shape(q, out, op, "q", "out");
  need(lse, DType::kF32, 3, op, "lse");
  SHARDLM_CHECK(lse.dim(0) == a.B && lse.dim(1) == a.Hq && lse.dim(2) == a.Tq,
                "{}: lse must be [B, Hq, Tq] = [{}, {}, {}], got {}", op, a.B, a.Hq, a.Tq,
                lse.shape().str());
}

size_t delta_bytes(int64_t B, int64_t Tq, int64_t Hq) {
  return align_up(size_t(B) * size_t(Tq) * size_t(Hq) * sizeof(float));
}

void backward(CudaBackend::Impl& m, const AttnArgs& a, const Tensor& q, const Tensor& k,
              const Tensor& out, const Tensor& lse, const Tensor& dout, const Tensor& dq,
              const Tensor& dk, const Tensor& dv, Workspace ws, std::string_view op) {
  check_out_lse(a, q, out, lse, op);
  for (const auto& [x, ref, name] :
       {std::tuple{&dout, &q, "dout"}, {&dq, &q, "dq"}, {&dk, &k, "dk"}, {&dv, &k, "dv"}}) {
    elem(*x, op, name);
    same_type(q, *x, op, "q", name);
    check_same_shape(*ref, *x, op,
                     name == std::string_view("dout") || name == std::string_view("dq") ? "q" : "k",
                     name);
  }
  const size_t need_ws = delta_bytes(a.B, a.Tq, a.Hq);
  SHARDLM_CHECK(ws.bytes >= need_ws && (ws.data != nullptr || need_ws == 0),
                "{}: workspace has {} bytes, needs {}", op, ws.bytes, need_ws);
  cuda_ok(launch_attention_backward(a, out.data(), lse.f32(), dout.data(),
                                    reinterpret_cast<float*>(ws.data), dq.data(), dk.data(),
                                    dv.data(), m.stream),
          op);
}

}  // namespace

size_t CudaBackend::attention_workspace_bytes(int64_t B, int64_t T, int64_t Hq, int64_t Hkv,
                                              int64_t Dh) const {
  return delta_bytes(B, T, Hq);
}

void CudaBackend::attention_forward(const Tensor& q, const Tensor& k, const Tensor& v,
                                    const Tensor& seg_start, const Tensor& out, const Tensor& lse,
                                    Workspace ws) {
  constexpr std::string_view op = "attention_forward";
  const AttnArgs a = attn_args(q, k, v, seg_start, 0, 0, op);
  SHARDLM_CHECK(a.Tk == a.Tq, "{}: q and k must cover the same tokens, got {} and {}", op,
                q.shape().str(), k.shape().str());
  check_out_lse(a, q, out, lse, op);
  cuda_ok(launch_attention_forward(a, out.data(), lse.f32(), impl_->stream), op);
}

void CudaBackend::attention_backward(const Tensor& q, const Tensor& k, const Tensor& v,
                                     const Tensor& seg_start, const Tensor& out, const Tensor& lse,
                                     const Tensor& dout, const Tensor& dq, const Tensor& dk,
                                     const Tensor& dv, Workspace ws) {
  constexpr std::string_view op = "attention_backward";
  const AttnArgs a = attn_args(q, k, v, seg_start, 0, 0, op);
  SHARDLM_CHECK(a.Tk == a.Tq, "{}: q and k must cover the same tokens, got {} and {}", op,
                q.shape().str(), k.shape().str());
  backward(*impl_, a, q, k, out, lse, dout, dq, dk, dv, ws, op);
}

size_t CudaBackend::attention_block_workspace_bytes(int64_t B, int64_t Tq, int64_t Tk, int64_t Hq,
                                                    int64_t Hkv, int64_t Dh) const {
  return delta_bytes(B, Tq, Hq);
}

void CudaBackend::attention_block_forward(const Tensor& q, const Tensor& k, const Tensor& v,
                                          const Tensor& seg_start, int64_t q_offset,
                                          int64_t k_offset, const Tensor& out, const Tensor& lse,
                                          Workspace ws) {
  constexpr std::string_view op = "attention_block_forward";
  const AttnArgs a = attn_args(q, k, v, seg_start, q_offset, k_offset, op);
  check_out_lse(a, q, out, lse, op);
  cuda_ok(launch_attention_forward(a, out.data(), lse.f32(), impl_->stream), op);
}

void CudaBackend::attention_block_backward(const Tensor& q, const Tensor& k, const Tensor& v,
                                           const Tensor& seg_start, int64_t q_offset,
                                           int64_t k_offset, const Tensor& out, const Tensor& lse,
                                           const Tensor& dout, const Tensor& dq, const Tensor& dk,
                                           const Tensor& dv, Workspace ws) {
  constexpr std::string_view op = "attention_block_backward";
  const AttnArgs a = attn_args(q, k, v, seg_start, q_offset, k_offset, op);
  backward(*impl_, a, q, k, out, lse, dout, dq, dk, dv, ws, op);
}

void CudaBackend::attention_merge(const Tensor& out, const Tensor& lse, const Tensor& out_b,
                                  const Tensor& lse_b) {
  constexpr std::string_view op = "attention_merge";
  need(out, DType::kF32, -1, op, "out");
  need(out_b, DType::kF32, -1, op, "out_b");
  need(lse, DType::kF32, 3, op, "lse");
  need(lse_b, DType::kF32, 3, op, "lse_b");
  check_same_shape(out, out_b, op, "out", "out_b");
  check_same_shape(lse, lse_b, op, "lse", "lse_b");
  const int64_t B = lse.dim(0), Hq = lse.dim(1), T = lse.dim(2);
  const int rank = out.rank();
  SHARDLM_CHECK(rank == 3 || rank == 4, "{}: out must be [B * T, Hq, Dh] or [B, T, Hq, Dh], got {}",
                op, out.shape().str());
  const int64_t Dh = out.dim(rank - 1);
  const bool tokens_match = rank == 4 ? out.dim(0) == B && out.dim(1) == T : out.dim(0) == B * T;
  SHARDLM_CHECK(tokens_match && out.dim(rank - 2) == Hq, "{}: out is {} but lse is {}", op,
                out.shape().str(), lse.shape().str());
  cuda_ok(launch_attention_merge(static_cast<float*>(out.data()), lse.f32(),
                                 static_cast<const float*>(out_b.data()), lse_b.f32(), B, T, Hq, Dh,
                                 impl_->stream),
          op);
}

size_t CudaBackend::attention_decode_workspace_bytes(int64_t B, int64_t Tq, int64_t Tmax,
                                                     int64_t Hq, int64_t Dh) const {
  return 0;
}

void CudaBackend::attention_decode(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                                   int64_t cache_len, const Tensor& out, Workspace ws) {
  constexpr std::string_view op = "attention_decode";
  AttnArgs a = attn_args(q, k_cache, v_cache, Tensor(), cache_len, 0, op);
  const int64_t Tmax = a.Tk;
  SHARDLM_CHECK(cache_len >= 0 && cache_len + a.Tq <= Tmax,
                "{}: cache_len {} + {} new queries exceed the cache's {} rows", op, cache_len, a.Tq,
                Tmax);
  a.Tk = cache_len + a.Tq;
  a.k_batch_stride = Tmax * a.Hkv * a.Dh;
  elem(out, op, "out");
  same_type(q, out, op, "q", "out");
  check_same_shape(q, out, op, "q", "out");
  cuda_ok(launch_attention_forward(a, out.data(), nullptr, impl_->stream), op);
}

// ---- fused LM head + cross-entropy ------------------------------------------------------------

namespace {
// Workspace: f32 logits [chunk, V], their copy in bf16 [chunk, V] (bf16 operands only), f64
// (loss, valid) per row [chunk, 2], the running totals [2].
size_t loss_logits_bytes(int64_t chunk, int64_t V) { return align_up(size_t(chunk) * V * 4); }
size_t loss_copy_bytes(int64_t chunk, int64_t V) { return align_up(size_t(chunk) * V * 2); }
size_t loss_rows_bytes(int64_t chunk) { return align_up(size_t(chunk) * 2 * sizeof(double)); }

}  // namespace

size_t CudaBackend::lm_head_loss_workspace_bytes(int64_t chunk_tokens, int64_t V) const {
  SHARDLM_CHECK(chunk_tokens >= 1 && V >= 1,
                "lm_head_loss needs chunk_tokens >= 1 and V >= 1, got {} and {}", chunk_tokens, V);
  return loss_logits_bytes(chunk_tokens, V) + loss_copy_bytes(chunk_tokens, V) +
         loss_rows_bytes(chunk_tokens) + align_up(2 * sizeof(double));
}

LossResult CudaBackend::lm_head_loss(const Tensor& h, const Tensor& w, const Tensor& targets,
                                     int64_t chunk_tokens, float grad_scale, const Tensor& dh,
                                     const Tensor& dw, Workspace ws) {
  constexpr std::string_view op = "lm_head_loss";
  const Elem t = elem(h, op, "h");
  elem(w, op, "w");
  same_type(h, w, op, "h", "w");
  SHARDLM_CHECK(h.rank() == 2 && w.rank() == 2 && h.dim(1) == w.dim(1),
                "{}: expects h [N, D] and w [V, D], got {} and {}", op, h.shape().str(),
                w.shape().str());
  need(targets, DType::kI32, 1, op, "targets");
  SHARDLM_CHECK(targets.dim(0) == h.dim(0), "{}: expects targets [{}], got {}", op, h.dim(0),
                targets.shape().str());
  Elem gw = Elem::kF32;
  if (!dh.empty()) {
    elem(dh, op, "dh");
    same_type(h, dh, op, "h", "dh");
    check_same_shape(h, dh, op, "h", "dh");
  }
  if (!dw.empty()) {
    gw = elem(dw, op, "dw");
    SHARDLM_CHECK(gw == Elem::kF32 || dw.dtype() == w.dtype(), "{}: dw must be f32 or {}", op,
                  dtype_name(w.dtype()));
    check_same_shape(w, dw, op, "w", "dw");
  }
  const int64_t N = h.dim(0), D = h.dim(1), V = w.dim(0);
  const size_t need_ws = lm_head_loss_workspace_bytes(chunk_tokens, V);
  SHARDLM_CHECK(ws.bytes >= need_ws && ws.data != nullptr,
                "{}: workspace has {} bytes, needs {}; size it with lm_head_loss_workspace_bytes",
                op, ws.bytes, need_ws);
  Impl& m = *impl_;
  check_ids_on_device(m, targets, V, true, op, "target id");  // before dh / dw are touched
  LossResult result;
  if (N == 0) return result;
  auto* logits = reinterpret_cast<float*>(ws.data);
  void* copy = ws.data + loss_logits_bytes(chunk_tokens, V);
  auto* rows_f64 =
      reinterpret_cast<double*>(static_cast<std::byte*>(copy) + loss_copy_bytes(chunk_tokens, V));
  auto* acc = reinterpret_cast<double*>(reinterpret_cast<std::byte*>(rows_f64) +
                                        loss_rows_bytes(chunk_tokens));
  cuda_ok(cudaMemsetAsync(acc, 0, 2 * sizeof(double), m.stream), op);
  const bool want_grad = !dh.empty() || !dw.empty();
  const size_t eb = dtype_size(h.dtype());
  for (int64_t begin = 0; begin < N; begin += chunk_tokens) {
    const int64_t rows = std::min(chunk_tokens, N - begin);
    const void* h_chunk = static_cast<const std::byte*>(h.data()) + begin * D * eb;
    // logits^T [V, rows] = W [V, D] h_chunk^T [D, rows], f32 out
    m.gemm(true, false, V, rows, D, w.data(), t, D, h_chunk, t, D, logits, Elem::kF32, V, 0.f,
           nullptr, op);
    cuda_ok(launch_softmax_xent(logits, t == Elem::kBF16 ? copy : nullptr, t, targets.i32() + begin,
                                rows, V, grad_scale, want_grad, rows_f64, acc, m.stream),
            op);
    const void* dlogits = t == Elem::kBF16 ? copy : static_cast<const void*>(logits);
    if (!dh.empty()) {
      // dh_chunk^T [D, rows] = W^T [D, V] dlogits^T [V, rows]
      void* dh_chunk = static_cast<std::byte*>(dh.data()) + begin * D * eb;
      m.gemm(false, false, D, rows, V, w.data(), t, D, dlogits, t, V, dh_chunk, t, D, 0.f, nullptr,
             op);
    }
    if (!dw.empty()) {
      // dW^T [D, V] += h_chunk^T [D, rows] dlogits [rows, V]
      m.gemm(false, true, D, V, rows, h_chunk, t, D, dlogits, t, V, dw.data(), gw, D, 1.f, nullptr,
             op);
    }
  }
  cuda_ok(cudaMemcpyAsync(m.h_scratch, acc, 2 * sizeof(double), cudaMemcpyDeviceToHost, m.stream),
          op);
  m.sync();
  result.loss_sum = m.h_scratch[0];
  result.n_valid = int64_t(std::llround(m.h_scratch[1]));
  return result;
}

// ---- vocabulary-parallel cross-entropy over a slice of the logits ------------------------------

namespace {
// logits [n, Vs] f32; row_max [n] f32; targets [n] i32 and stats [n, 2] f32 when given
void check_xent_slice(const Tensor& logits, const Tensor& row_max, const Tensor* targets,
                      const Tensor* stats, std::string_view op) {
  need(logits, DType::kF32, 2, op, "logits");
  need(row_max, DType::kF32, 1, op, "row_max");
  const int64_t n = logits.dim(0);
  SHARDLM_CHECK(row_max.dim(0) == n, "{}: row_max must be [{}] like the logits' rows, got {}", op,
                n, row_max.shape().str());
  if (targets != nullptr) {
    need(*targets, DType::kI32, 1, op, "targets");
    SHARDLM_CHECK(targets->dim(0) == n, "{}: targets must be [{}], got {}", op, n,
                  targets->shape().str());
  }
  if (stats != nullptr) {
    need(*stats, DType::kF32, 2, op, "stats");
    SHARDLM_CHECK(stats->dim(0) == n && stats->dim(1) == 2, "{}: stats must be [{}, 2], got {}", op,
                  n, stats->shape().str());
  }
}
}  // namespace

void CudaBackend::xent_slice_max(const Tensor& logits, const Tensor& row_max) {
  constexpr std::string_view op = "xent_slice_max";
  check_xent_slice(logits, row_max, nullptr, nullptr, op);
  cuda_ok(launch_xent_slice_max(logits.f32(), row_max.f32(), logits.dim(0), logits.dim(1),
                                impl_->stream),
          op);
}

void CudaBackend::xent_slice_stats(const Tensor& logits, const Tensor& targets, int64_t vocab_begin,
                                   int64_t vocab, const Tensor& row_max, const Tensor& stats) {
  constexpr std::string_view op = "xent_slice_stats";
  check_xent_slice(logits, row_max, &targets, &stats, op);
  SHARDLM_CHECK(vocab_begin >= 0 && vocab_begin + logits.dim(1) <= vocab,
                "{}: the slice [{}, {}) is not inside the vocabulary [0, {})", op, vocab_begin,
                vocab_begin + logits.dim(1), vocab);
  check_ids_on_device(*impl_, targets, vocab, true, op, "target id");  // before any write
  cuda_ok(launch_xent_slice_stats(logits.f32(), targets.i32(), vocab_begin, row_max.f32(),
                                  stats.f32(), logits.dim(0), logits.dim(1), impl_->stream),
          op);
}

// Workspace: f64 (loss, valid) per row [n, 2], the totals [2].
size_t CudaBackend::xent_slice_workspace_bytes(int64_t n) const {
  return loss_rows_bytes(n) + align_up(2 * sizeof(double));
}

LossResult CudaBackend::xent_slice_finish(const Tensor& logits, const Tensor& targets,
                                          int64_t vocab_begin, const Tensor& row_max,
                                          const Tensor& stats, float grad_scale, bool want_grad,
                                          Workspace ws) {
  constexpr std::string_view op = "xent_slice_finish";
  check_xent_slice(logits, row_max, &targets, &stats, op);
  const int64_t n = logits.dim(0);
  SHARDLM_CHECK(ws.data != nullptr && ws.bytes >= xent_slice_workspace_bytes(n),
                "{}: workspace has {} bytes, needs {}; size it with xent_slice_workspace_bytes", op,
                ws.bytes, xent_slice_workspace_bytes(n));
  Impl& m = *impl_;
  auto* rows_f64 = reinterpret_cast<double*>(ws.data);
  auto* acc = reinterpret_cast<double*>(ws.data + loss_rows_bytes(n));
  cuda_ok(
      launch_xent_slice_finish(logits.f32(), targets.i32(), vocab_begin, row_max.f32(), stats.f32(),
                               grad_scale, want_grad, rows_f64, acc, n, logits.dim(1), m.stream),
      op);
  cuda_ok(cudaMemcpyAsync(m.h_scratch, acc, 2 * sizeof(double), cudaMemcpyDeviceToHost, m.stream),
          op);
  m.sync();
  return {m.h_scratch[0], int64_t(std::llround(m.h_scratch[1]))};
}

// ---- optimizer
// -----------------------------------------------------------------------------------

void CudaBackend::adamw_step(const Tensor& param, const Tensor& grad, const Tensor& m,
                             const Tensor& v, const AdamWHyper& hyper) {
  constexpr std::string_view op = "adamw_step";
  need(param, DType::kF32, -1, op, "param");
  need(grad, DType::kF32, -1, op, "grad");
  need(m, DType::kF32, -1, op, "m");
  need(v, DType::kF32, -1, op, "v");
  const int64_t n = param.numel();
  SHARDLM_CHECK(grad.numel() == n && m.numel() == n && v.numel() == n,
                "{} needs param, grad, m, v of equal size, got {}, {}, {}, {}", op, n, grad.numel(),
                m.numel(), v.numel());
  SHARDLM_CHECK(hyper.step >= 1, "{} step is 1-based, got {}", op, hyper.step);
  const double bc1 = 1.0 - std::pow(double(hyper.beta1), double(hyper.step));
  const double bc2 = 1.0 - std::pow(double(hyper.beta2), double(hyper.step));
  cuda_ok(launch_adamw(param.f32(), grad.f32(), m.f32(), v.f32(), n, hyper.beta1, hyper.beta2,
                       float(1.0 - hyper.beta1), float(1.0 - hyper.beta2), float(hyper.lr / bc1),
                       float(1.0 / std::sqrt(bc2)), hyper.eps,
                       float(1.0 - double(hyper.lr) * hyper.weight_decay), hyper.grad_scale,
                       impl_->stream),
          op);
}

}  // namespace shardlm::cuda
