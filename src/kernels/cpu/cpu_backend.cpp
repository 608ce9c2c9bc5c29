// CpuBackend: the Backend table for the CPU, forwarding to the kernels of ops.h once the entry
// point has checked the arguments. Every float op takes f32 or bf16 storage (AdamW's state is
// f32 by contract) and computes in f32.
// Memory for both pools comes from aligned host allocations; the pools stay separate in the
// ledger so that offload paths are exercised without a GPU.
#include "kernels/cpu/cpu_backend.h"

#include <omp.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string_view>

#include "kernels/cpu/ops.h"
#include "shardlm/core/fault_injection.h"
#include "shardlm/core/host_memory.h"

namespace shardlm::cpu {
namespace {

// Document spans restate seg_start [B, T]: the CPU kernels read seg_start, and check here that
// the spans given with it say the same (the form a variable-length kernel elsewhere reads), so
// that every CPU run of the model tests the spans its loader writes.
void check_spans_match(const DocumentSpans& docs, const Tensor& seg_start, std::string_view op) {
  if (docs.count == 0) return;
  const int64_t T = seg_start.dim(1), N = seg_start.numel();
  const int32_t* starts = docs.starts.i32();
  const int32_t* seg = seg_start.i32();
  SHARDLM_CHECK(starts[0] == 0 && starts[docs.count] == N,
                "{}: docs.starts must run from 0 to B * T = {}, got {} .. {}", op, N, starts[0],
                starts[docs.count]);
  for (int64_t d = 0; d < docs.count; ++d) {
    const int64_t begin = starts[d], end = starts[d + 1];
    SHARDLM_CHECK(begin < end && end - begin <= docs.max_len && begin / T == (end - 1) / T,
                  "{}: document {} = tokens [{}, {}) is empty, longer than docs.max_len = {} or "
                  "crosses a row of T = {}",
                  op, d, begin, end, docs.max_len, T);
    for (int64_t i = begin; i < end; ++i)
      SHARDLM_CHECK(seg[i] == begin % T,
                    "{}: token {} starts its document at {} by seg_start but at {} by docs", op, i,
                    seg[i], begin % T);
  }
}

}  // namespace

CpuBackend::CpuBackend() : gemm_scratch_(kGemmScratchFloats) {}

int CpuBackend::workspace_threads() const { return omp_get_max_threads(); }

void* CpuBackend::allocate(size_t bytes, MemPool pool) {
  const size_t rounded = align_up(bytes == 0 ? 1 : bytes);
  void* p = pool == MemPool::kHost && fault::host_alloc_fault(bytes)
                ? nullptr
                : std::aligned_alloc(kAlignBytes, rounded);
  if (p == nullptr) SHARDLM_FAIL(ErrorKind::kOutOfMemory, "{}", host_refusal_text(bytes, false));
  std::memset(p, 0, rounded);
  return p;
}

void CpuBackend::deallocate(void* ptr, size_t /*bytes*/, MemPool /*pool*/) { std::free(ptr); }

void CpuBackend::do_zero(const Tensor& x) { cpu::zero(x); }
void CpuBackend::do_copy(const Tensor& src, const Tensor& dst) { cpu::copy(src, dst); }
void CpuBackend::do_copy_blocks(const Tensor& src, const Tensor& dst, const BlockCopy& layout) {
  cpu::copy_blocks(src, dst, layout);
}
void CpuBackend::do_convert(const Tensor& src, const Tensor& dst) { cpu::convert(src, dst); }
void CpuBackend::do_add(const Tensor& a, const Tensor& b, const Tensor& out) {
  cpu::add(a, b, out);
}
void CpuBackend::do_scale(const Tensor& x, float s) { cpu::scale(x, s); }
void CpuBackend::do_scale_rows(const Tensor& x, const Tensor& s) { cpu::scale_rows(x, s); }
void CpuBackend::do_dropout(const Tensor& x, const Tensor& out, float p, uint64_t seed,
                            int64_t first, int64_t width, int64_t row_stride) {
  cpu::dropout(x, out, p, seed, first, width, row_stride);
}
double CpuBackend::do_sum_squares(const Tensor& x) { return cpu::sum_squares(x); }
void CpuBackend::do_nf4_dequantize(const Tensor& codes, const Tensor& absmax, const Tensor& out) {
  cpu::nf4_dequantize(codes, absmax, out);
}

void CpuBackend::do_sum_squares_segments(std::span<const Tensor> xs, std::span<double> sums) {
  for (size_t i = 0; i < xs.size(); ++i) sums[i] = cpu::sum_squares(xs[i]);
}

void CpuBackend::do_linear_forward(const Tensor& x, const Tensor& w, const Tensor& b,
                                   const Tensor& y, OutputMode y_mode, const Tensor& residual) {
  cpu::linear_forward(x, w, b, y, gemm_scratch(), y_mode, residual);
}
void CpuBackend::do_linear_backward(const Tensor& x, const Tensor& w, const Tensor& dy,
                                    const Tensor& dx, const Tensor& dw, const Tensor& db,
                                    OutputMode dx_mode) {
  cpu::linear_backward(x, w, dy, dx, dw, db, gemm_scratch(), dx_mode);
}

void CpuBackend::do_embedding_forward_slice(const Tensor& tokens, const Tensor& table,
                                            int64_t vocab_begin, int64_t vocab, const Tensor& out) {
  cpu::embedding_forward_slice(tokens, table, vocab_begin, vocab, out);
}
void CpuBackend::do_embedding_backward_slice(const Tensor& tokens, const Tensor& dout,
                                             int64_t vocab_begin, int64_t vocab,
                                             const Tensor& dtable) {
  cpu::embedding_backward_slice(tokens, dout, vocab_begin, vocab, dtable);
}

void CpuBackend::do_rmsnorm_forward(const Tensor& x, const Tensor& w, float eps, const Tensor& y,
                                    const Tensor& rstd, float w_offset) {
  cpu::rmsnorm_forward(x, w, eps, y, rstd, w_offset);
}
void CpuBackend::do_add_rmsnorm_forward(const Tensor& x, const Tensor& residual, const Tensor& w,
                                        float eps, const Tensor& y, const Tensor& rstd,
                                        float w_offset) {
  cpu::add_rmsnorm_forward(x, residual, w, eps, y, rstd, w_offset);
}
void CpuBackend::do_rmsnorm_backward(const Tensor& x, const Tensor& w, const Tensor& rstd,
                                     const Tensor& dy, const Tensor& dx, const Tensor& dw,
                                     float w_offset) {
  cpu::rmsnorm_backward(x, w, rstd, dy, dx, dw, w_offset);
}

void CpuBackend::do_rope_forward(const Tensor& x, const Tensor& positions, const Tensor& inv_freq,
                                 RopePairs pairs) {
  cpu::rope_forward(x, positions, inv_freq, pairs);
}
void CpuBackend::do_rope_backward(const Tensor& dx, const Tensor& positions, const Tensor& inv_freq,
                                  RopePairs pairs) {
  cpu::rope_backward(dx, positions, inv_freq, pairs);
}
void CpuBackend::do_rope_qk_forward(const Tensor& q, const Tensor& k, const Tensor& positions,
                                    const Tensor& inv_freq, RopePairs pairs) {
  cpu::rope_qk_forward(q, k, positions, inv_freq, pairs);
}
void CpuBackend::do_rope_qk_backward(const Tensor& dq, const Tensor& dk, const Tensor& positions,
                                     const Tensor& inv_freq, RopePairs pairs) {
  cpu::rope_qk_backward(dq, dk, positions, inv_freq, pairs);
}

void CpuBackend::do_swiglu_forward(const Tensor& gate, const Tensor& up, const Tensor& h) {
  cpu::swiglu_forward(gate, up, h);
}
void CpuBackend::do_swiglu_backward(const Tensor& gate, const Tensor& up, const Tensor& dh,
                                    const Tensor& dgate, const Tensor& dup) {
  cpu::swiglu_backward(gate, up, dh, dgate, dup);
}
void CpuBackend::do_geglu_forward(const Tensor& gate, const Tensor& up, const Tensor& h) {
  cpu::geglu_forward(gate, up, h);
}
void CpuBackend::do_geglu_backward(const Tensor& gate, const Tensor& up, const Tensor& dh,
                                   const Tensor& dgate, const Tensor& dup) {
  cpu::geglu_backward(gate, up, dh, dgate, dup);
}

size_t CpuBackend::attention_workspace_bytes(int64_t B, int64_t T, int64_t Hq, int64_t Hkv,
                                             int64_t Dh) const {
  return cpu::attention_workspace_bytes(B, T, Hq, Hkv, Dh);
}
void CpuBackend::do_attention_forward(const Tensor& q, const Tensor& k, const Tensor& v,
                                      const Tensor& seg_start, const Tensor& out, const Tensor& lse,
                                      Workspace ws, const DocumentSpans& docs, int64_t window,
                                      float softcap) {
  check_spans_match(docs, seg_start, "attention_forward");
  cpu::attention_forward(q, k, v, seg_start, out, lse, ws, window, softcap);
}
void CpuBackend::do_attention_backward(const Tensor& q, const Tensor& k, const Tensor& v,
                                       const Tensor& seg_start, const Tensor& out,
                                       const Tensor& lse, const Tensor& dout, const Tensor& dq,
                                       const Tensor& dk, const Tensor& dv, Workspace ws,
                                       const DocumentSpans& docs, int64_t window, float softcap) {
  check_spans_match(docs, seg_start, "attention_backward");
  cpu::attention_backward(q, k, v, seg_start, out, lse, dout, dq, dk, dv, ws, window, softcap);
}

size_t CpuBackend::attention_block_workspace_bytes(int64_t B, int64_t Tq, int64_t Tk, int64_t Hq,
                                                   int64_t Hkv, int64_t Dh) const {
  return cpu::attention_block_workspace_bytes(B, Tq, Tk, Hq, Hkv, Dh);
}
void CpuBackend::do_attention_block_forward(const Tensor& q, const Tensor& k, const Tensor& v,
                                            const Tensor& seg_start, int64_t q_offset,
                                            int64_t k_offset, const Tensor& out, const Tensor& lse,
                                            Workspace ws, int64_t window, float softcap) {
  cpu::attention_block_forward(q, k, v, seg_start, q_offset, k_offset, out, lse, ws, window,
                               softcap);
}
void CpuBackend::do_attention_block_backward(const Tensor& q, const Tensor& k, const Tensor& v,
                                             const Tensor& seg_start, int64_t q_offset,
                                             int64_t k_offset, const Tensor& out, const Tensor& lse,
                                             const Tensor& dout, const Tensor& dq, const Tensor& dk,
                                             const Tensor& dv, Workspace ws, int64_t window,
                                             float softcap) {
  cpu::attention_block_backward(q, k, v, seg_start, q_offset, k_offset, out, lse, dout, dq, dk, dv,
                                ws, window, softcap);
}
void CpuBackend::do_attention_merge(const Tensor& out, const Tensor& lse, const Tensor& out_b,
                                    const Tensor& lse_b) {
  cpu::attention_merge(out, lse, out_b, lse_b);
}

size_t CpuBackend::attention_decode_workspace_bytes(int64_t B, int64_t Tq, int64_t Tmax, int64_t Hq,
                                                    int64_t Dh) const {
  return cpu::attention_decode_workspace_bytes(B, Tq, Tmax, Hq, Dh);
}
void CpuBackend::do_attention_decode(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                                     int64_t cache_len, const Tensor& out, Workspace ws,
                                     float softcap) {
  cpu::attention_decode(q, k_cache, v_cache, cache_len, out, ws, softcap);
}

size_t CpuBackend::do_lm_head_loss_workspace_bytes(int64_t chunk_tokens, int64_t V,
                                                   DType /*t: f32 logits for every dtype*/) const {
  return cpu::lm_head_loss_workspace_bytes(chunk_tokens, V);
}
LossResult CpuBackend::do_lm_head_loss(const Tensor& h, const Tensor& w, const Tensor& targets,
                                       int64_t chunk_tokens, float grad_scale, const Tensor& dh,
                                       const Tensor& dw, Workspace ws, float softcap) {
  return cpu::lm_head_loss(h, w, targets, chunk_tokens, grad_scale, dh, dw, ws, gemm_scratch(),
                           softcap);
}

void CpuBackend::do_xent_slice_max(const Tensor& logits, const Tensor& row_max, float softcap) {
  cpu::xent_slice_max(logits, row_max, softcap);
}
void CpuBackend::do_xent_slice_stats(const Tensor& logits, const Tensor& targets,
                                     int64_t vocab_begin, int64_t vocab, const Tensor& row_max,
                                     const Tensor& stats, float softcap) {
  cpu::xent_slice_stats(logits, targets, vocab_begin, vocab, row_max, stats, softcap);
}
void CpuBackend::do_xent_slice_fold(const Tensor& logits, const Tensor& targets,
                                    int64_t vocab_begin, int64_t vocab, const Tensor& row_max,
                                    const Tensor& stats, bool first, float softcap) {
  cpu::xent_slice_fold(logits, targets, vocab_begin, vocab, row_max, stats, first, softcap);
}
void CpuBackend::do_xent_slice_finish(const Tensor& logits, const Tensor& targets,
                                      int64_t vocab_begin, const Tensor& row_max,
                                      const Tensor& stats, float grad_scale, bool want_grad,
                                      const Tensor& loss_acc, Workspace /*ws*/, float softcap) {
  const LossResult part = cpu::xent_slice_finish(logits, targets, vocab_begin, row_max, stats,
                                                 grad_scale, want_grad, softcap);
  if (loss_acc.empty()) return;
  // The chunk's f64 sum added once, as a caller's running total adds each chunk's: the same
  // bits as summing the returned parts on the host. The count is exact in f64 below 2^53.
  loss_acc.f64()[0] += part.loss_sum;
  loss_acc.f64()[1] += double(part.n_valid);
}
LossResult CpuBackend::do_read_loss(const Tensor& loss_acc) {
  return {loss_acc.f64()[0], int64_t(std::llround(loss_acc.f64()[1]))};
}
void CpuBackend::do_adamw_step(const Tensor& param, const Tensor& grad, const Tensor& m,
                               const Tensor& v, const AdamWHyper& hyper) {
  cpu::adamw_step(param, grad, m, v, hyper);
}
void CpuBackend::do_adamw_step_segments(std::span<const AdamWSegment> segments,
                                        const AdamWHyper& hyper) {
  cpu::adamw_step_segments(segments, hyper);
}
void CpuBackend::do_segment_logp_sums(const Tensor& row_max, const Tensor& stats,
                                      const Tensor& segments, const Tensor& sums) {
  cpu::segment_logp_sums(row_max, stats, segments, sums);
}
void CpuBackend::do_preference_coefficients(const PreferenceLossSpec& loss, const Tensor& policy,
                                            const Tensor& reference, double norm,
                                            const Tensor& coef, const Tensor& metrics) {
  cpu::preference_coefficients(loss, policy, reference, norm, coef, metrics);
}
void CpuBackend::do_gather_segment_weights(const Tensor& coef, const Tensor& segments,
                                           const Tensor& weights) {
  cpu::gather_segment_weights(coef, segments, weights);
}

}  // namespace shardlm::cpu
