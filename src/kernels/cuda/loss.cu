// The softmax cross-entropy half of the fused LM head (the GEMMs are cuBLASLt's): one block per
// row of a chunk's logits (f32, or bf16 with f32 statistics), turned in place into
// grad_scale * (softmax - onehot), and the
// chunk's row losses added in row order (deterministic) to a running f64 total on the device.
// Also the vocabulary-parallel form over a rank's slice of the logits (xent_slice_*: row max,
// then the sum of exponentials and the target's logit, then loss and gradient from the
// statistics the caller reduced over the ranks), its logits f32 or bf16, and the same
// statistics folded over slices walked one after another (xent_slice_fold, online softmax).
// Under a final-logit soft cap (softcap > 0) every kernel caps each logit as it reads it,
// softcap * tanh(logit / softcap), and the gradients are taken through the cap (times
// 1 - tanh^2); the logits in memory stay uncapped until they become gradients.
#include <type_traits>

#include "kernels/cuda/common.cuh"

namespace shardlm::cuda {
namespace {

constexpr int kThreads = 256;

// Element j of a logits row as the loss sees it: capped when softcap > 0.
template <typename T>
__device__ __forceinline__ float logit_at(const T* row, int64_t j, float softcap) {
  const float x = load(row, j);
  return softcap > 0.f ? softcap * tanhf(x / softcap) : x;
}

// The gradient of the loss at logit x (uncapped) of softmax term p_scale * exp(capped - mx),
// minus grad_scale at the target: through the cap's slope where there is one.
template <typename T>
__device__ __forceinline__ float logit_grad(const T* row, int64_t j, bool target, float mx,
                                            float p_scale, float grad_scale, float softcap) {
  if (softcap <= 0.f) {
    float g = expf(load(row, j) - mx) * p_scale;
    return target ? g - grad_scale : g;
  }
  const float th = tanhf(load(row, j) / softcap);
  float g = expf(softcap * th - mx) * p_scale;
  if (target) g -= grad_scale;
  return g * (1.f - th * th);
}

template <typename T>
__global__ void softmax_xent_kernel(T* logits, const int32_t* targets, int64_t V, float grad_scale,
                                    bool want_grad, double* row_loss, float softcap) {
  __shared__ float fshared[32];
  __shared__ double dshared[32];
  const int64_t r = blockIdx.x;
  T* row = logits + r * V;
  const int32_t t = targets[r];
  // The ignore index, or a target outside the vocabulary: lm_head_loss flags that one and
  // raises it at its read, so the row only has to be left out here, never read out of bounds.
  if (t < 0 || t >= V) {
    if (want_grad)
      for (int64_t j = threadIdx.x; j < V; j += blockDim.x) store(row, j, 0.f);
    if (threadIdx.x == 0) row_loss[2 * r] = row_loss[2 * r + 1] = 0.0;
    return;
  }
  const float target_logit = logit_at(row, t, softcap);
  float mx = -INFINITY;
  for (int64_t j = threadIdx.x; j < V; j += blockDim.x) mx = fmaxf(mx, logit_at(row, j, softcap));
  mx = block_max(mx, fshared);
  float part = 0.f;
  for (int64_t j = threadIdx.x; j < V; j += blockDim.x)
    part += expf(logit_at(row, j, softcap) - mx);
  const double sum = block_sum(double(part), dshared);
  if (threadIdx.x == 0) {
    row_loss[2 * r] = double(mx) + log(sum) - double(target_logit);
    row_loss[2 * r + 1] = 1.0;
  }
  if (!want_grad) return;
  const float p_scale = float(double(grad_scale) / sum);
  for (int64_t j = threadIdx.x; j < V; j += blockDim.x)
    store(row, j, logit_grad(row, j, j == t, mx, p_scale, grad_scale, softcap));
}

__global__ void add_row_losses(const double* row_loss, int64_t rows, double* acc) {
  __shared__ double shared[32];
  double loss = 0.0, valid = 0.0;
  for (int64_t r = threadIdx.x; r < rows; r += blockDim.x) {
    loss += row_loss[2 * r];
    valid += row_loss[2 * r + 1];
  }
  loss = block_sum(loss, shared);
  valid = block_sum(valid, shared);
  if (threadIdx.x == 0) {
    acc[0] += loss;
    acc[1] += valid;
  }
}

template <typename T>
__global__ void xent_slice_max_kernel(const T* logits, float* row_max, int64_t Vs, float softcap) {
  __shared__ float fshared[32];
  const int64_t r = blockIdx.x;
  const T* row = logits + r * Vs;
  float mx = -INFINITY;
  for (int64_t j = threadIdx.x; j < Vs; j += blockDim.x) mx = fmaxf(mx, logit_at(row, j, softcap));
  mx = block_max(mx, fshared);
  if (threadIdx.x == 0) row_max[r] = mx;
}

template <typename T>
__global__ void xent_slice_stats_kernel(const T* logits, const int32_t* targets,
                                        int64_t vocab_begin, int64_t vocab, const float* row_max,
                                        float* stats, int64_t Vs, float softcap) {
  __shared__ double dshared[32];
  const int64_t r = blockIdx.x;
  const int32_t t = targets[r];
  if (t < 0 || t >= vocab) {  // the ignore index, or a flagged bad target: left out alike
    if (threadIdx.x == 0) stats[2 * r] = stats[2 * r + 1] = 0.f;
    return;
  }
  const T* row = logits + r * Vs;
  const float mx = row_max[r];
  double part = 0.0;
  for (int64_t j = threadIdx.x; j < Vs; j += blockDim.x)
    part += expf(logit_at(row, j, softcap) - mx);
  const double sum = block_sum(part, dshared);
  if (threadIdx.x == 0) {
    const int64_t local = int64_t(t) - vocab_begin;
    stats[2 * r] = float(sum);
    stats[2 * r + 1] = local >= 0 && local < Vs ? logit_at(row, local, softcap) : 0.f;
  }
}

// Every thread reads the previous statistics before the first barrier and thread 0 overwrites
// them after the last, so the row's update needs no second buffer.
template <typename T>
__global__ void xent_slice_fold_kernel(const T* logits, const int32_t* targets, int64_t vocab_begin,
                                       int64_t vocab, float* row_max, float* stats, int64_t Vs,
                                       bool first, float softcap) {
  __shared__ float fshared[32];
  __shared__ double dshared[32];
  const int64_t r = blockIdx.x;
  const T* row = logits + r * Vs;
  const float old_max = first ? -INFINITY : row_max[r];
  const float old_sum = first ? 0.f : stats[2 * r];
  const float old_target = first ? 0.f : stats[2 * r + 1];
  float mx = old_max;
  for (int64_t j = threadIdx.x; j < Vs; j += blockDim.x) mx = fmaxf(mx, logit_at(row, j, softcap));
  mx = block_max(mx, fshared);
  const int32_t t = targets[r];
  if (t < 0 || t >= vocab) {  // the ignore index, or a flagged bad target: left out alike
    if (threadIdx.x == 0) {
      row_max[r] = mx;
      stats[2 * r] = stats[2 * r + 1] = 0.f;
    }
    return;
  }
  double part = 0.0;
  for (int64_t j = threadIdx.x; j < Vs; j += blockDim.x)
    part += expf(logit_at(row, j, softcap) - mx);
  const double sum = block_sum(part, dshared);
  if (threadIdx.x == 0) {
    // A zero old sum carries nothing and its max may be -inf: skipping it keeps -inf - -inf out.
    const double carried = old_sum == 0.f ? 0.0 : double(old_sum) * exp(double(old_max) - mx);
    const int64_t local = int64_t(t) - vocab_begin;
    row_max[r] = mx;
    stats[2 * r] = float(carried + sum);
    stats[2 * r + 1] =
        old_target + (local >= 0 && local < Vs ? logit_at(row, local, softcap) : 0.f);
  }
}

// The gradient of an element is computed in f32 and rounded once to T. A row whose sum of
// exponentials is 0 is left out like an ignored one: the stats and fold kernels write (0, 0) for
// a flagged bad target (on every rank and piece alike, the targets being the same), while a row
// with a target always sums at least exp(max - max) = 1.
template <typename T>
__global__ void xent_slice_finish_kernel(T* logits, const int32_t* targets, int64_t vocab_begin,
                                         const float* row_max, const float* stats, float grad_scale,
                                         bool want_grad, double* row_loss, int64_t Vs,
                                         float softcap) {
  const int64_t r = blockIdx.x;
  T* row = logits + r * Vs;
  const int32_t t = targets[r];
  if (t < 0 || stats[2 * r] == 0.f) {
    if (want_grad)
      for (int64_t j = threadIdx.x; j < Vs; j += blockDim.x) store(row, j, 0.f);
    if (threadIdx.x == 0) row_loss[2 * r] = row_loss[2 * r + 1] = 0.0;
    return;
  }
  const double sum = stats[2 * r];
  const float mx = row_max[r];
  if (threadIdx.x == 0) {
    row_loss[2 * r] = log(sum) + double(mx) - double(stats[2 * r + 1]);
    row_loss[2 * r + 1] = 1.0;
  }
  if (!want_grad) return;
  const float p_scale = float(double(grad_scale) / sum);
  const int64_t local = int64_t(t) - vocab_begin;
  for (int64_t j = threadIdx.x; j < Vs; j += blockDim.x)
    store(row, j, logit_grad(row, j, j == local, mx, p_scale, grad_scale, softcap));
}

}  // namespace

cudaError_t launch_xent_slice_max(const void* logits, Elem t, float* row_max, int64_t rows,
                                  int64_t Vs, float softcap, cudaStream_t s) {
  if (rows == 0) return cudaSuccess;
  return dispatch(t, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    xent_slice_max_kernel<<<unsigned(rows), kThreads, 0, s>>>(static_cast<const T*>(logits),
                                                              row_max, Vs, softcap);
    return cudaGetLastError();
  });
}

cudaError_t launch_xent_slice_stats(const void* logits, Elem t, const int32_t* targets,
                                    int64_t vocab_begin, int64_t vocab, const float* row_max,
                                    float* stats, int64_t rows, int64_t Vs, float softcap,
                                    cudaStream_t s) {
  if (rows == 0) return cudaSuccess;
  return dispatch(t, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    xent_slice_stats_kernel<<<unsigned(rows), kThreads, 0, s>>>(
        static_cast<const T*>(logits), targets, vocab_begin, vocab, row_max, stats, Vs, softcap);
    return cudaGetLastError();
  });
}

cudaError_t launch_xent_slice_fold(const void* logits, Elem t, const int32_t* targets,
                                   int64_t vocab_begin, int64_t vocab, float* row_max, float* stats,
                                   bool first, int64_t rows, int64_t Vs, float softcap,
                                   cudaStream_t s) {
  if (rows == 0) return cudaSuccess;
  return dispatch(t, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    xent_slice_fold_kernel<<<unsigned(rows), kThreads, 0, s>>>(static_cast<const T*>(logits),
                                                               targets, vocab_begin, vocab, row_max,
                                                               stats, Vs, first, softcap);
    return cudaGetLastError();
  });
}

cudaError_t launch_xent_slice_finish(void* logits, Elem t, const int32_t* targets,
                                     int64_t vocab_begin, const float* row_max, const float* stats,
                                     float grad_scale, bool want_grad, double* row_loss,
                                     double* acc, int64_t rows, int64_t Vs, float softcap,
                                     cudaStream_t s) {
  if (rows == 0) return cudaSuccess;
  return dispatch(t, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    xent_slice_finish_kernel<<<unsigned(rows), kThreads, 0, s>>>(
        static_cast<T*>(logits), targets, vocab_begin, row_max, stats, grad_scale, want_grad,
        row_loss, Vs, softcap);
    if (acc != nullptr) add_row_losses<<<1, kThreads, 0, s>>>(row_loss, rows, acc);
    return cudaGetLastError();
  });
}

cudaError_t launch_softmax_xent(void* logits, Elem t, const int32_t* targets, int64_t rows,
                                int64_t V, float grad_scale, bool want_grad, double* row_loss,
                                double* acc, float softcap, cudaStream_t s) {
  if (rows == 0) return cudaSuccess;
  return dispatch(t, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    softmax_xent_kernel<<<unsigned(rows), kThreads, 0, s>>>(
        static_cast<T*>(logits), targets, V, grad_scale, want_grad, row_loss, softcap);
    add_row_losses<<<1, kThreads, 0, s>>>(row_loss, rows, acc);
    return cudaGetLastError();
  });
}

}  // namespace shardlm::cuda
