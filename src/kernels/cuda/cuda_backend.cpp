// CudaBackend: once an op's entry point has checked its shapes and dtypes, checks that its
// tensors live on the device and enqueues the kernels of launch.h and cuBLASLt GEMMs on the
// compute stream. This file: the lifecycle, allocation, memory movement, elementwise ops and
// AdamW (one segment or a list, adamw.cu); the other op families in cuda_linear.cpp, cuda_norm.cpp,
// cuda_attention_ops.cpp and cuda_loss_ops.cpp (backend_impl.h).
#include "kernels/cuda/backend_impl.h"

#include <unistd.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "shardlm/core/fault_injection.h"
#include "shardlm/core/host_memory.h"

namespace shardlm::cuda {

int visible_devices() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // clear it: the backend's constructor reports the reason
    return 0;
  }
  return count;
}

CudaBackend::CudaBackend(int device, bool device_shared) : impl_(std::make_unique<Impl>()) {
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
  cuda_ok(cudaMalloc(&m.d_scratch, (kSumBlocks + kSegmentSums) * sizeof(double)),
          "cudaMalloc (scratch)");
  cuda_ok(cudaMallocHost(&m.h_scratch, kSegmentSums * sizeof(double)), "cudaMallocHost");
  cuda_ok(cudaMallocHost(&m.h_stage, kStageElems * 4), "cudaMallocHost (staging)");
  cuda_ok(cudaMalloc(&m.d_words, sizeof(ResultWords)), "cudaMalloc (result words)");
  cuda_ok(cudaMallocHost(&m.h_words, sizeof(ResultWords)), "cudaMallocHost (result words)");
  cuda_ok(cudaMemsetAsync(m.d_bad(), 0xff, kIdChecks * sizeof(uint64_t), m.stream),
          "cudaMemsetAsync (id flags)");  // kNoBadId
  // cuDNN's handle allocates a little device memory: before the baseline, like the context.
  m.cudnn = std::make_unique<CudnnAttention>(m.stream);
  if (device_shared) {
    char bus_id[32] = {};
    cuda_ok(cudaDeviceGetPCIBusId(bus_id, sizeof(bus_id), device), "cudaDeviceGetPCIBusId");
    m.nvml = std::make_unique<NvmlProcessMemory>("libnvidia-ml.so.1", bus_id, unsigned(getpid()));
  }
  // Last: the context and everything above are in the baseline.
  m.used_at_start = m.driver_used();
}

int64_t CudaBackend::Impl::driver_used() const {
  if (nvml) return nvml->used_bytes();
  size_t free_b = 0, total_b = 0;
  cuda_ok(cudaSetDevice(device), "cudaSetDevice");
  cuda_ok(cudaMemGetInfo(&free_b, &total_b), "cudaMemGetInfo");
  return int64_t(total_b - free_b);
}

void CudaBackend::Impl::exclude_driver_growth(int64_t before) {
  const int64_t now = driver_used();
  if (before >= 0 && now >= 0 && used_at_start >= 0) used_at_start += now - before;
}

void CudaBackend::Impl::flag_ids(const Tensor& ids, int64_t V, bool allow_ignore, IdCheck which,
                                 std::string_view op, std::string_view what) {
  const auto k = size_t(which);
  id_text[k] = {op, what, V, allow_ignore};
  flag_thread = std::this_thread::get_id();
  cuda_ok(launch_flag_ids(ids.i32(), ids.numel(), V, allow_ignore, d_bad() + k, stream), op);
}

void CudaBackend::Impl::copy_id_flags(std::string_view op) {
  if (!reads_flags()) return;
  cuda_ok(
      cudaMemcpyAsync(h_words->bad, d_bad(), sizeof(h_words->bad), cudaMemcpyDeviceToHost, stream),
      op);
}

void CudaBackend::Impl::raise_flagged_ids() {
  if (!reads_flags()) return;
  for (size_t k = 0; k < size_t(kIdChecks); ++k) {
    const uint64_t bad = h_words->bad[k];
    if (bad == kNoBadId) continue;
    // Cleared first: the caller may go on (a test does) and must not meet this id again.
    cuda_ok(cudaMemsetAsync(d_bad(), 0xff, sizeof(h_words->bad), stream), id_text[k].op);
    std::fill(std::begin(h_words->bad), std::end(h_words->bad), kNoBadId);
    const IdCheckText& t = id_text[k];
    const auto at = bad >> 32;
    const int32_t value = int32_t(uint32_t(bad & 0xffffffffu));
    // The caller's own ids, an engine error as on the CPU backend. The flag keeps the first bad
    // position of every call since the last read, so the op and its S are not named: the last
    // call's may not be the one that flagged it.
    SHARDLM_CHECK(IdCheck(k) != IdCheck::kSegments,
                  "a preference op (segment_logp_sums, gather_segment_weights) read segments[{}] "
                  "= {}, outside [-1, S) of its call (-1: no segment)",
                  at, value);
    SHARDLM_FAIL(ErrorKind::kData,
                 "{}: {} {} at position {} is outside the vocabulary [0, {}){}; the data and the "
                 "model's vocab_size disagree",
                 t.op, t.what, value, at, t.V,
                 t.allow_ignore ? " and is not the ignore index -1" : "");
  }
}

DriverDeviceBytes CudaBackend::driver_device_bytes() const {
  const Impl& m = *impl_;
  const int64_t now = m.driver_used();
  DriverDeviceBytes d;
  d.source = m.nvml ? "nvml_process" : "cudaMemGetInfo";
  if (now >= 0 && m.used_at_start >= 0)
    d.bytes = now - m.used_at_start;
  else if (m.nvml)
    d.unavailable = m.nvml->unavailable();
  return d;
}

CudaBackend::~CudaBackend() {
  Impl& m = *impl_;
  if (m.stream) cudaStreamSynchronize(m.stream);
  if (m.copy_stream) cudaStreamSynchronize(m.copy_stream);
  m.cudnn.reset();
  for (cudaEvent_t e : m.fences)
    if (e) cudaEventDestroy(e);
  for (cudaEvent_t e : m.marks)
    if (e) cudaEventDestroy(e);
  if (m.copy_after) cudaEventDestroy(m.copy_after);
  if (m.copy_stream) cudaStreamDestroy(m.copy_stream);
  cudaFreeHost(m.h_stage);
  cudaFreeHost(m.h_words);
  cudaFree(m.d_words);
  cudaFreeHost(m.h_scratch);
  cudaFree(m.d_scratch);
  cudaFree(m.lt_ws);
  m.gemm_plans.clear();  // the descriptors, before the handle they were planned with
  if (m.lt) cublasLtDestroy(m.lt);
  if (m.stream) cudaStreamDestroy(m.stream);
}

void CudaBackend::synchronize() {
  impl_->sync();
  cuda_ok(cudaStreamSynchronize(impl_->copy_stream), "cudaStreamSynchronize (copies)");
}

void* CudaBackend::device_stream() { return impl_->stream; }

int64_t CudaBackend::host_waits() const { return impl_->host_waits.load(); }

size_t CudaBackend::fixed_device_bytes() const {
  return kLtWorkspaceBytes + (kSumBlocks + kSegmentSums) * sizeof(double) + 2 * sizeof(int32_t);
}

void* CudaBackend::allocate(size_t bytes, MemPool pool) {
  const size_t rounded = align_up(bytes == 0 ? 1 : bytes);
  void* p = nullptr;
  if (pool == MemPool::kDevice) {
    cuda_ok(cudaSetDevice(impl_->device), "cudaSetDevice");  // the caller's thread may be another's
    if (cudaMalloc(&p, rounded) != cudaSuccess) {
      cudaGetLastError();  // clear the sticky-free allocation error
      size_t free_b = 0, total_b = 0;
      cudaMemGetInfo(&free_b, &total_b);
      SHARDLM_FAIL(ErrorKind::kOutOfMemory,
                   "out of GPU memory allocating {} (the GPU has {} free of {})",
                   format_bytes(int64_t(bytes)), format_bytes(int64_t(free_b)),
                   format_bytes(int64_t(total_b)));
    }
    // On the compute stream: cudaMemset would queue on the legacy default stream, which the
    // non-blocking compute and copy streams do not wait for, so the first op to use the buffer
    // could run before (or under) its zeroing. Every later user of the memory (compute, copy
    // stream after copy_after, a communicator after set_compute_stream) is ordered after it.
    const cudaError_t zeroed = cudaMemsetAsync(p, 0, rounded, impl_->stream);
    if (zeroed != cudaSuccess) {
      cudaFree(p);  // never handed out: the ledger does not know it
      cuda_ok(zeroed, "cudaMemsetAsync");
    }
  } else {
    if (fault::host_alloc_fault(bytes) || cudaMallocHost(&p, rounded) != cudaSuccess) {
      cudaGetLastError();
      SHARDLM_FAIL(ErrorKind::kOutOfMemory, "{}", host_refusal_text(bytes, true));
    }
    std::memset(p, 0, rounded);
  }
  return p;
}

void CudaBackend::deallocate(void* ptr, size_t /*bytes*/, MemPool pool) {
  if (ptr == nullptr) return;
  ++impl_->host_waits;
  cudaStreamSynchronize(impl_->stream);  // no kernel or copy may still use it
  cudaStreamSynchronize(impl_->copy_stream);
  if (pool == MemPool::kDevice)
    cudaFree(ptr);
  else
    cudaFreeHost(ptr);
}

// ---- memory movement ------------------------------------------------------------------------

void CudaBackend::do_zero(const Tensor& x) {
  if (x.numel() == 0) return;
  if (x.pool() == MemPool::kHost) {
    impl_->sync();
    std::memset(x.data(), 0, x.bytes());
    return;
  }
  cuda_ok(cudaMemsetAsync(x.data(), 0, x.bytes(), impl_->stream), "zero");
}

void CudaBackend::do_copy(const Tensor& src, const Tensor& dst) {
  if (src.numel() == 0 || src.data() == dst.data()) return;
  // Copies also come from other threads (the ZeRO worker staging device tensors for MPI), whose
  // current device is 0 unless set: this backend's device may be another.
  cuda_ok(cudaSetDevice(impl_->device), "cudaSetDevice");
  cuda_ok(cudaMemcpyAsync(dst.data(), src.data(), src.bytes(), cudaMemcpyDefault, impl_->stream),
          "copy");
  // The caller may read or reuse a host buffer as soon as this returns. A copy to the host is
  // a result the host reads: the id checks queued before it come along, in the same wait.
  if (src.pool() == MemPool::kHost || dst.pool() == MemPool::kHost) {
    const bool result = dst.pool() == MemPool::kHost;
    if (result) impl_->copy_id_flags("copy");
    impl_->sync();
    if (result) impl_->raise_flagged_ids();
  }
}

void CudaBackend::do_copy_blocks(const Tensor& src, const Tensor& dst, const BlockCopy& layout) {
  const int64_t e = int64_t(dtype_size(src.dtype()));
  const int64_t ss[3] = {layout.src[0] * e, layout.src[1] * e, layout.src[2] * e};
  const int64_t ds[3] = {layout.dst[0] * e, layout.dst[1] * e, layout.dst[2] * e};
  cuda_ok(cudaSetDevice(impl_->device), "cudaSetDevice");
  if (src.pool() == MemPool::kDevice && dst.pool() == MemPool::kDevice) {
    cuda_ok(launch_copy_blocks(src.data(), dst.data(), layout.n, layout.block * e, ss, ds,
                               impl_->stream),
            "copy_blocks");
    return;
  }
  // Host memory may be pageable, which no kernel reads: a copy per block (the input sharding's
  // few rows), finished before returning as copy's.
  const auto* s = static_cast<const std::byte*>(src.data());
  auto* d = static_cast<std::byte*>(dst.data());
  for (int64_t i = 0; i < layout.n[0]; ++i)
    for (int64_t j = 0; j < layout.n[1]; ++j)
      for (int64_t l = 0; l < layout.n[2]; ++l)
        cuda_ok(cudaMemcpyAsync(d + i * ds[0] + j * ds[1] + l * ds[2],
                                s + i * ss[0] + j * ss[1] + l * ss[2], size_t(layout.block * e),
                                cudaMemcpyDefault, impl_->stream),
                "copy_blocks");
  impl_->sync();
}

uint64_t CudaBackend::do_copy_async(const Tensor& src, const Tensor& dst) {
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

uint64_t CudaBackend::mark() {
  Impl& m = *impl_;
  if (m.marks.empty()) m.marks.assign(kMarksKept, nullptr);
  const uint64_t id = ++m.mark_count;
  cudaEvent_t& e = m.marks[id % kMarksKept];
  if (e == nullptr) cuda_ok(cudaEventCreate(&e), "cudaEventCreate (mark)");
  cuda_ok(cudaEventRecord(e, m.stream), "mark");
  return id;
}

double CudaBackend::seconds_between(uint64_t a, uint64_t b) {
  Impl& m = *impl_;
  SHARDLM_CHECK(a >= 1 && a <= b && b <= m.mark_count && m.mark_count - a < kMarksKept,
                "seconds_between: marks {} and {} are not both among the last {} (last {})", a, b,
                kMarksKept, m.mark_count);
  ++m.host_waits;
  cuda_ok(cudaEventSynchronize(m.marks[b % kMarksKept]), "seconds_between");
  float ms = 0;
  cuda_ok(cudaEventElapsedTime(&ms, m.marks[a % kMarksKept], m.marks[b % kMarksKept]),
          "seconds_between");
  return double(ms) * 1e-3;
}

void CudaBackend::host_wait_fence(uint64_t fence) {
  Impl& m = *impl_;
  if (fence == 0) return;
  SHARDLM_CHECK(fence <= m.fence_count, "host_wait_fence: fence {} was never issued (last {})",
                fence, m.fence_count);
  // As wait_fence: a later event in the slot covers this copy too. Counted as a wait only when
  // the copies have not finished yet (a double-buffered upload's slot is normally free again).
  const cudaEvent_t e = m.fences[fence % kFenceEvents];
  const cudaError_t done = cudaEventQuery(e);
  if (done == cudaSuccess) return;
  if (done != cudaErrorNotReady) cuda_ok(done, "host_wait_fence");
  ++m.host_waits;
  cuda_ok(cudaEventSynchronize(e), "host_wait_fence");
}

void CudaBackend::do_convert(const Tensor& src, const Tensor& dst) {
  const int64_t n = src.numel();
  if (n == 0) return;
  if (src.dtype() == dst.dtype()) return do_copy(src, dst);
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

void CudaBackend::do_add(const Tensor& a, const Tensor& b, const Tensor& out) {
  const Elem t = elem(a, "add", "a");
  on_device(b, "add", "b");
  on_device(out, "add", "out");
  cuda_ok(launch_add(a.data(), b.data(), out.data(), t, a.numel(), impl_->stream), "add");
}

void CudaBackend::do_scale(const Tensor& x, float s) {
  const Elem t = elem(x, "scale", "x");
  cuda_ok(launch_scale(x.data(), t, s, x.numel(), impl_->stream), "scale");
}

void CudaBackend::do_scale_rows(const Tensor& x, const Tensor& s) {
  const Elem t = elem(x, "scale_rows", "x");
  on_device(s, "scale_rows", "s");
  cuda_ok(launch_scale_rows(x.data(), t, s.f32(), x.dim(0), x.dim(1), impl_->stream), "scale_rows");
}

void CudaBackend::do_nf4_dequantize(const Tensor& codes, const Tensor& absmax, const Tensor& out) {
  const Elem t = elem(out, "nf4_dequantize", "out");
  on_device(codes, "nf4_dequantize", "codes");
  on_device(absmax, "nf4_dequantize", "absmax");
  cuda_ok(
      launch_nf4_dequantize(codes.data(), absmax.f32(), out.data(), t, out.numel(), impl_->stream),
      "nf4_dequantize");
}

void CudaBackend::do_dropout(const Tensor& x, const Tensor& out, float p, uint64_t seed,
                             int64_t first, int64_t width, int64_t row_stride) {
  const Elem t = elem(x, "dropout", "x");
  on_device(out, "dropout", "out");
  cuda_ok(launch_dropout(x.data(), out.data(), t, x.numel(), p, seed, first, width, row_stride,
                         impl_->stream),
          "dropout");
}

double CudaBackend::do_sum_squares(const Tensor& x) {
  if (x.numel() == 0) return 0.0;
  const Elem t = elem(x, "sum_squares", "x");
  Impl& m = *impl_;
  cuda_ok(
      launch_sum_squares(x.data(), t, x.numel(), m.d_scratch, m.d_scratch + kSumBlocks, m.stream),
      "sum_squares");
  cuda_ok(cudaMemcpyAsync(m.h_scratch, m.d_scratch + kSumBlocks, sizeof(double),
                          cudaMemcpyDeviceToHost, m.stream),
          "sum_squares");
  m.copy_id_flags("sum_squares");
  m.sync();
  m.raise_flagged_ids();
  return m.h_scratch[0];
}

// Each tensor's sum into its own slot of the results, the partials' scratch reused in stream
// order; one copy and one wait per kSegmentSums tensors.
void CudaBackend::do_sum_squares_segments(std::span<const Tensor> xs, std::span<double> sums) {
  constexpr std::string_view op = "sum_squares_segments";
  Impl& m = *impl_;
  double* results = m.d_scratch + kSumBlocks;
  for (size_t first = 0; first < xs.size(); first += kSegmentSums) {
    const size_t n = std::min(kSegmentSums, xs.size() - first);
    for (size_t i = 0; i < n; ++i) {
      const Tensor& x = xs[first + i];
      if (x.numel() == 0) {
        cuda_ok(cudaMemsetAsync(results + i, 0, sizeof(double), m.stream), op);
        continue;
      }
      cuda_ok(launch_sum_squares(x.data(), elem(x, op, "x"), x.numel(), m.d_scratch, results + i,
                                 m.stream),
              op);
    }
    cuda_ok(
        cudaMemcpyAsync(m.h_scratch, results, n * sizeof(double), cudaMemcpyDeviceToHost, m.stream),
        op);
    m.copy_id_flags(op);
    m.sync();
    m.raise_flagged_ids();
    std::copy(m.h_scratch, m.h_scratch + n, sums.begin() + std::ptrdiff_t(first));
  }
}

// ---- optimizer ----------------------------------------------------------------------------------

namespace {

// The step's constants as the CPU kernel forms them (f64 on the host, rounded once).
AdamWConstants adamw_constants(const AdamWHyper& h) {
  const double bc1 = 1.0 - std::pow(double(h.beta1), double(h.step));
  const double bc2 = 1.0 - std::pow(double(h.beta2), double(h.step));
  return {h.beta1,
          h.beta2,
          float(1.0 - h.beta1),
          float(1.0 - h.beta2),
          float(h.lr / bc1),
          float(1.0 / std::sqrt(bc2)),
          h.eps,
          h.grad_scale};
}

float adamw_decay(const AdamWHyper& h, float weight_decay) {
  return float(1.0 - double(h.lr) * weight_decay);
}

// Every segment's tensors on the device, then a few launches for the whole list.
void step_segments(CudaBackend::Impl& impl, std::span<const AdamWSegment> segments,
                   const AdamWHyper& hyper, std::string_view op) {
  std::vector<AdamWSegmentArgs> args;
  args.reserve(segments.size());
  for (const AdamWSegment& s : segments) {
    for (const auto& [t, name] :
         {std::pair{&s.param, "param"}, {&s.grad, "grad"}, {&s.m, "m"}, {&s.v, "v"}})
      on_device(*t, op, name);
    args.push_back({s.param.f32(), s.grad.f32(), s.m.f32(), s.v.f32(), s.param.numel(),
                    adamw_decay(hyper, s.weight_decay)});
  }
  cuda_ok(launch_adamw(args.data(), int64_t(args.size()), adamw_constants(hyper), impl.stream), op);
}

}  // namespace

void CudaBackend::do_adamw_step(const Tensor& param, const Tensor& grad, const Tensor& m,
                                const Tensor& v, const AdamWHyper& hyper) {
  const AdamWSegment one{param, grad, m, v, hyper.weight_decay};
  step_segments(*impl_, {&one, 1}, hyper, "adamw_step");
}

void CudaBackend::do_adamw_step_segments(std::span<const AdamWSegment> segments,
                                         const AdamWHyper& hyper) {
  step_segments(*impl_, segments, hyper, "adamw_step_segments");
}

}  // namespace shardlm::cuda
