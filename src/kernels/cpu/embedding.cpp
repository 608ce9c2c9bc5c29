// Token embedding on the CPU: a row gather forward, a scatter-add backward into the table's
// gradient, over the whole table or over a vocabulary slice of it (the vocabulary-parallel
// embedding: ids another rank holds give zero rows forward and are skipped backward). Token ids
// are validated against the whole vocabulary before any write (a bad id is a data error, not a
// crash). The backward splits the work over columns of D, so repeated tokens never race and
// every element is summed in token order: bit-identical for any thread count. The table and out
// (forward) and dout (backward) are f32 or bf16; the table's gradient is f32 and accumulates in
// f32. No allocation.
#include <algorithm>
#include <cstring>

#include "kernels/cpu/element.h"
#include "kernels/cpu/ops.h"

namespace shardlm::cpu {
namespace {

// Columns of D per backward work item.
constexpr int64_t kColumnBlock = 64;

// Every id in [0, vocab): a data error otherwise, raised before any write.
void check_ids(const Tensor& tokens, int64_t vocab, std::string_view op) {
  const int32_t* ids = tokens.i32();
  const int64_t n = tokens.dim(0);
  for (int64_t i = 0; i < n; ++i) {
    SHARDLM_CHECK_KIND(ErrorKind::kData, ids[i] >= 0 && ids[i] < vocab,
                       "{}: token id {} at position {} is outside the vocabulary [0, {}); "
                       "the data and the model's vocab_size disagree",
                       op, ids[i], i, vocab);
  }
}

}  // namespace

// tokens [N] i32 in [0, vocab); table [Vs, D] = ids [vocab_begin, vocab_begin + Vs);
// out [N, D] of table's dtype, overwritten (zeros for ids outside the slice)
void embedding_forward_slice(const Tensor& tokens, const Tensor& table, int64_t vocab_begin,
                             int64_t vocab, const Tensor& out) {
  check_ids(tokens, vocab, "embedding_forward");
  const int64_t n = tokens.dim(0);
  const int64_t d = table.dim(1);
  const int64_t rows = table.dim(0);
  if (n == 0 || d == 0) return;
  const int32_t* ids = tokens.i32();
  with_float(table, [&](auto tag) {
    using T = decltype(tag);
    const T* pt = elems<T>(table);
    T* po = elems<T>(out);
#pragma omp parallel for schedule(static) if (n * d > 32768)
    for (int64_t i = 0; i < n; ++i) {
      const int64_t local = int64_t{ids[i]} - vocab_begin;
      if (local >= 0 && local < rows)
        std::memcpy(po + i * d, pt + local * d, static_cast<size_t>(d) * sizeof(T));
      else
        std::fill(po + i * d, po + (i + 1) * d, T{});  // all-zero bits: +0 in f32 and bf16
    }
  });
}

// tokens [N] i32 in [0, vocab); dout [N, D] f32 or bf16; dtable [Vs, D] f32 accumulates the
// rows it holds
void embedding_backward_slice(const Tensor& tokens, const Tensor& dout, int64_t vocab_begin,
                              int64_t vocab, const Tensor& dtable) {
  check_ids(tokens, vocab, "embedding_backward");
  const int64_t n = tokens.dim(0);
  const int64_t d = dtable.dim(1);
  const int64_t rows = dtable.dim(0);
  if (n == 0 || d == 0) return;
  const int32_t* ids = tokens.i32();
  float* pdt = dtable.f32();
  const int64_t blocks = (d + kColumnBlock - 1) / kColumnBlock;
  with_float(dout, [&](auto tag) {
    using T = decltype(tag);
    const T* pdo = elems<T>(dout);
#pragma omp parallel for schedule(static) if (n * d > 32768)
    for (int64_t blk = 0; blk < blocks; ++blk) {
      const int64_t j0 = blk * kColumnBlock;
      const int64_t width = std::min(kColumnBlock, d - j0);
      for (int64_t i = 0; i < n; ++i) {
        const int64_t local = int64_t{ids[i]} - vocab_begin;
        if (local < 0 || local >= rows) continue;  // another rank's row
        float* dst = pdt + local * d + j0;
        const T* src = pdo + i * d + j0;
#pragma omp simd
        for (int64_t j = 0; j < width; ++j) dst[j] += load(src + j);
      }
    }
  });
}

// tokens [N] i32 in [0, V); table [V, D]; out [N, D] overwritten
void embedding_forward(const Tensor& tokens, const Tensor& table, const Tensor& out) {
  embedding_forward_slice(tokens, table, 0, table.rank() == 2 ? table.dim(0) : 0, out);
}

// tokens [N] i32 in [0, V); dout [N, D]; dtable [V, D] accumulates
void embedding_backward(const Tensor& tokens, const Tensor& dout, const Tensor& dtable) {
  embedding_backward_slice(tokens, dout, 0, dtable.rank() == 2 ? dtable.dim(0) : 0, dtable);
}

}  // namespace shardlm::cpu
