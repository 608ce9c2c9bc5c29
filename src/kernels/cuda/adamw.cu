// AdamW on CUDA over a list of f32 segments (param, grad, m, v, decay), many segments per launch:
// their descriptors travel as one kernel parameter (batches of kAdamWBatch, no device buffer), and
// each block steps kBlockElems elements of one segment, in packs of 16-byte accesses where the
// segment's four pointers are aligned. One step of one tensor is a list of one segment.
#include "kernels/cuda/common.cuh"

namespace shardlm::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kBlockElems = int64_t(kThreads) * kPack;  // one pack per thread
// Segments per launch: the batch stays under the 4 KiB a kernel parameter may always take.
constexpr int kAdamWBatch = 48;

struct AdamWBatch {
  AdamWSegmentArgs seg[kAdamWBatch];
  int64_t first_block[kAdamWBatch + 1];  // segment i owns blocks [first_block[i], first_block[i+1])
  uint64_t packed = 0;                   // bit i: segment i's pointers are 16-byte aligned
  int count = 0;
};
static_assert(sizeof(AdamWBatch) + sizeof(AdamWConstants) <= 4096, "kernel parameter limit");

// PyTorch's AdamW on one element (torch.optim.AdamW; the CPU kernel's arithmetic).
__device__ __forceinline__ void adamw_update(float& p, float g, float& m, float& v,
                                             const AdamWConstants& c, float decay) {
  g *= c.grad_scale;
  const float mi = c.beta1 * m + c.one_minus_beta1 * g;
  const float vi = c.beta2 * v + c.one_minus_beta2 * g * g;
  m = mi;
  v = vi;
  const float denom = sqrtf(vi) * c.inv_sqrt_bc2 + c.eps;
  p = p * decay - c.step_size * mi / denom;
}

// __grid_constant__: the batch is read in place from parameter space, indexed by segment,
// without a per-thread copy.
__global__ void adamw_kernel(const __grid_constant__ AdamWBatch b,
                             const __grid_constant__ AdamWConstants c) {
  int lo = 0, hi = b.count - 1;  // the last segment whose first block is <= this block
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (b.first_block[mid] <= int64_t(blockIdx.x))
      lo = mid;
    else
      hi = mid - 1;
  }
  const AdamWSegmentArgs& s = b.seg[lo];
  const int64_t base = (int64_t(blockIdx.x) - b.first_block[lo]) * kBlockElems;
  if ((b.packed >> lo) & 1) {
    const int64_t i = base + int64_t(threadIdx.x) * kPack;
    if (i + kPack <= s.n) {
      float p[kPack], g[kPack], m[kPack], v[kPack];
      load_pack(s.p + i, p);
      load_pack(s.g + i, g);
      load_pack(s.m + i, m);
      load_pack(s.v + i, v);
#pragma unroll
      for (int j = 0; j < kPack; ++j) adamw_update(p[j], g[j], m[j], v[j], c, s.decay);
      store_pack(s.p + i, p);
      store_pack(s.m + i, m);
      store_pack(s.v + i, v);
    } else {
      for (int64_t e = i; e < s.n; ++e) adamw_update(s.p[e], s.g[e], s.m[e], s.v[e], c, s.decay);
    }
  } else {
#pragma unroll
    for (int j = 0; j < kPack; ++j) {
      const int64_t e = base + int64_t(j) * kThreads + threadIdx.x;
      if (e < s.n) adamw_update(s.p[e], s.g[e], s.m[e], s.v[e], c, s.decay);
    }
  }
}

}  // namespace

cudaError_t launch_adamw(const AdamWSegmentArgs* segments, int64_t count, const AdamWConstants& c,
                         cudaStream_t s) {
  AdamWBatch b;
  int64_t blocks = 0;
  auto launch = [&]() -> cudaError_t {
    if (b.count == 0) return cudaSuccess;
    b.first_block[b.count] = blocks;
    adamw_kernel<<<unsigned(blocks), kThreads, 0, s>>>(b, c);
    b.count = 0;
    b.packed = 0;
    blocks = 0;
    return cudaGetLastError();
  };
  for (int64_t i = 0; i < count; ++i) {
    const AdamWSegmentArgs& seg = segments[i];
    if (seg.n == 0) continue;
    if (b.count == kAdamWBatch) {
      const cudaError_t e = launch();
      if (e != cudaSuccess) return e;
    }
    b.seg[b.count] = seg;
    b.first_block[b.count] = blocks;
    if (all_aligned16(seg.p, seg.g, seg.m, seg.v)) b.packed |= uint64_t(1) << b.count;
    blocks += (seg.n + kBlockElems - 1) / kBlockElems;
    ++b.count;
  }
  return launch();
}

}  // namespace shardlm::cuda
