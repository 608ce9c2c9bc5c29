// The strided block copy (Backend::copy_blocks) as one kernel: context parallelism packs heads
// and reorders tokens around its all-to-alls with one launch per exchange instead of one copy
// per token. Each thread moves words of the widest size the layout's alignment allows.
#include <cstdint>

#include "kernels/cuda/common.cuh"

namespace shardlm::cuda {
namespace {

constexpr int kThreads = 256;

struct alignas(16) Word16 {
  uint4 v;
};

// Strides and counts in words of W bytes.
struct WordLayout {
  int64_t n1, n2, block;
  int64_t src[3], dst[3];
};

template <typename W>
__global__ void copy_blocks_kernel(const W* __restrict__ src, W* __restrict__ dst, WordLayout L,
                                   int64_t words) {
  for (int64_t w = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; w < words;
       w += int64_t(gridDim.x) * blockDim.x) {
    const int64_t b = w / L.block, e = w % L.block;
    const int64_t i = b / (L.n1 * L.n2), j = b / L.n2 % L.n1, l = b % L.n2;
    dst[i * L.dst[0] + j * L.dst[1] + l * L.dst[2] + e] =
        src[i * L.src[0] + j * L.src[1] + l * L.src[2] + e];
  }
}

template <typename W>
cudaError_t launch_words(const void* src, void* dst, const int64_t (&n)[3], int64_t block_bytes,
                         const int64_t (&ss)[3], const int64_t (&ds)[3], cudaStream_t s) {
  constexpr int64_t k = sizeof(W);
  WordLayout L{n[1],
               n[2],
               block_bytes / k,
               {ss[0] / k, ss[1] / k, ss[2] / k},
               {ds[0] / k, ds[1] / k, ds[2] / k}};
  const int64_t words = n[0] * n[1] * n[2] * L.block;
  copy_blocks_kernel<W><<<grid_for(words, kThreads), kThreads, 0, s>>>(
      static_cast<const W*>(src), static_cast<W*>(dst), L, words);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_copy_blocks(const void* src, void* dst, const int64_t (&n)[3],
                               int64_t block_bytes, const int64_t (&src_stride)[3],
                               const int64_t (&dst_stride)[3], cudaStream_t s) {
  if (n[0] * n[1] * n[2] * block_bytes == 0) return cudaSuccess;
  // The widest word every address of the copy is a multiple of.
  uint64_t bits = reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(dst) |
                  uint64_t(block_bytes) | 16u;
  for (int d = 0; d < 3; ++d) bits |= uint64_t(src_stride[d]) | uint64_t(dst_stride[d]);
  switch (bits & ~(bits - 1)) {  // the lowest set bit
    case 16:
      return launch_words<Word16>(src, dst, n, block_bytes, src_stride, dst_stride, s);
    case 8:
      return launch_words<uint64_t>(src, dst, n, block_bytes, src_stride, dst_stride, s);
    case 4:
      return launch_words<uint32_t>(src, dst, n, block_bytes, src_stride, dst_stride, s);
    case 2:
      return launch_words<uint16_t>(src, dst, n, block_bytes, src_stride, dst_stride, s);
    default:
      return launch_words<uint8_t>(src, dst, n, block_bytes, src_stride, dst_stride, s);
  }
}

}  // namespace shardlm::cuda
