// The two ends of LlamaModel, which read the vocabulary tables: the token embedding, the final
// norm, the fused LM head + cross-entropy and the last position's logits. Each table is used
// whole, vocabulary-parallel under tensor parallelism (vocab_parallel.h), or in the pieces of
// rows its store hands it out in (ParamStore::piece_rows: ZeRO from stage 2, so that no bucket
// buffer holds a whole 128K-row table):
//   embedding  forward: each piece embeds the tokens it holds (zeros for the others), summed
//              into layer 0's input; backward: each piece's rows accumulate their tokens'
//              gradients, pieces in backward's (descending) order.
//   loss       a first walk over the pieces folds every token's logit statistics (running
//              max and sum of exponentials, the target's logit) piece by piece; with gradients
//              a second walk recomputes each piece's logits, turns them into dlogits with the
//              whole row's statistics and adds the piece's share of d(xn_final) and its dW.
//              The head's first piece also holds the final norm, whose backward closes the walk.
//              The preference objectives (llama_logps.cpp) run the same two walks, the second
//              with per-token weights, also on a tp shard's whole vocabulary slice (walk 1's
//              statistics then reduced over the tp group).
// Piece for piece the arithmetic is the whole table's (the same GEMMs on fewer rows), except
// that the sum of exponentials is folded across pieces in f32: gradients agree with the whole
// table's to rounding, not bitwise.
#include <algorithm>
#include <cmath>

#include "llama_views.h"
#include "vocab_parallel.h"

namespace shardlm {

size_t pieced_loss_workspace_bytes(const Backend& backend, const ModelConfig& cfg,
                                   const ModelOptions& opt) {
  const int64_t N = opt.max_batch * opt.max_seq;
  const int64_t chunk = std::min<int64_t>(opt.loss_chunk_tokens, N);
  return slice_loss_scratch(backend, chunk, cfg.vocab_rows(), N, opt.activation_dtype).end;
}

HeadWalkScratch head_walk_scratch(const Backend& be, const Buffer& workspace,
                                  const ModelOptions& opt, int64_t n_tokens, int64_t piece_rows) {
  HeadWalkScratch w;
  w.workspace = &workspace;
  w.act = opt.activation_dtype;
  w.chunk = std::min<int64_t>(opt.loss_chunk_tokens, n_tokens);
  w.at = slice_loss_scratch(be, w.chunk, piece_rows, n_tokens, w.act);
  SHARDLM_CHECK(workspace.bytes() >= w.at.end,
                "the model workspace has {} bytes, the pieced loss {}", workspace.bytes(),
                w.at.end);
  w.row_max = workspace.view(DType::kF32, {n_tokens}, w.at.row_max);
  w.stats = workspace.view(DType::kF32, {n_tokens, 2}, w.at.stats);
  w.loss_acc = workspace.view(DType::kF64, {2}, w.at.loss_acc);
  w.xent = {workspace.data() + w.at.backend, workspace.bytes() - w.at.backend};
  return w;
}

void LlamaModel::embedding_forward(const StepViews& s) {
  embedding_lookup(s);
  // Gemma: times sqrt(dim) in the activation dtype (x_in [n, D])
  if (cfg_.embed_scale) be_.scale(s.layers[0].x_in, embedding_multiplier());
}

void LlamaModel::embedding_lookup(const StepViews& s) {
  const Tensor out = s.layers[0].x_in;  // [n, D]
  const int64_t V = cfg_.vocab_rows(), D = cfg_.dim;
  if (!in_pieces(0)) {
    acquire(0);
    const Tensor table = weight(0, layout_.embed, {V, D});
    if (cfg_.tp_shards > 1) {
      // Vocabulary-parallel: this rank's vocabulary rows of every token, a row-parallel output
      // (rows split: the partial [N, D] in x_full, idle until layer 0's norm).
      const Tensor partial = seam_->row_output_buffer(out, s.layers[0].x_full);
      vocab_parallel_embedding_forward(be_, *seam_, cfg_, s.in.tokens, table, partial, out);
    } else {
      be_.embedding_forward(s.in.tokens, table, out);
    }
    release(0);
    return;
  }
  // Layer 0's norm output is idle until layer 0 runs: the later pieces' partial sums.
  const Tensor partial = s.layers[0].xn1;  // [N, D]
  for (int k = 0; k < int(unit_pieces_[0].size()); ++k) {
    const UnitPiece& p = unit_pieces_[0][k];
    acquire_piece(0, k);
    const Tensor table = weight(0, layout_.embed + p.row_begin * D, {p.rows, D});
    // out [N, D] = the rows of the tokens piece 0 holds, zeros elsewhere; then each piece's
    // added (an exact sum: every token takes its row from exactly one piece).
    be_.embedding_forward_slice(s.in.tokens, table, p.row_begin, V, k == 0 ? out : partial);
    if (k > 0) be_.add(out, partial, out);
    release_piece(0, k);
  }
}

void LlamaModel::embedding_backward(const StepViews& s, bool held) {
  const int64_t V = cfg_.vocab_rows(), D = cfg_.dim;
  // d(x_in) [n, D], dead after this, becomes the lookup's output gradient
  if (cfg_.embed_scale) be_.scale(s.tr.d_resid, embedding_multiplier());
  const std::vector<UnitPiece>& pieces = unit_pieces_[0];
  for (int k = int(pieces.size()) - 1; k >= 0; --k) {
    if (!held) acquire_piece_grads(0, k);
    const int64_t row_begin = in_pieces(0) ? pieces[k].row_begin : 0;
    const int64_t rows = in_pieces(0) ? pieces[k].rows : V;
    const Tensor dtable = grad(0, layout_.embed + row_begin * D, {rows, D});  // [rows, D]
    if (in_pieces(0)) {
      be_.embedding_backward_slice(s.in.tokens, s.tr.d_resid, row_begin, V, dtable);
    } else if (cfg_.tp_shards == 1) {
      be_.embedding_backward(s.in.tokens, s.tr.d_resid, dtable);
    } else {
      // Vocabulary-parallel: every token's gradient, the same on every tp rank (the adjoint of
      // the embedding's row-parallel output; rows split: gathered into d_norm).
      const Tensor d_embed = seam_->row_output_grad(s.tr.d_resid, s.tr.d_norm);  // [N, D]
      vocab_parallel_embedding_backward(be_, *seam_, cfg_, s.in.tokens, d_embed, dtable);
    }
    release_piece_grads(0, k);
  }
}

void LlamaModel::final_norm_unit_forward(const StepViews& s) {
  const int h = layout_.head_unit;
  acquire_piece(h, 0);
  final_norm_forward(s);
  release_piece(h, 0);
}

LossResult LlamaModel::head_loss_forward(const StepViews& s) {
  const int lm = layout_.lm_head_unit;
  if (in_pieces(lm)) return pieced_head_loss(s, /*with_grads=*/false, 0.f);
  acquire(lm);
  const LossResult loss = head_loss(s, /*with_grads=*/false, 0.f);
  release(lm);
  return loss;
}

LossResult LlamaModel::head_loss_backward(const StepViews& s, float grad_scale) {
  const int h = layout_.head_unit, lm = layout_.lm_head_unit;
  if (in_pieces(lm)) return pieced_head_loss(s, /*with_grads=*/true, grad_scale);
  // Tied embeddings: unit 0's gradients stay acquired from here to the embedding backward.
  acquire(h);
  acquire_grads(h);
  if (lm != h) {
    acquire(lm);
    acquire_grads(lm);
  }
  const LossResult loss = head_loss(s, /*with_grads=*/true, grad_scale);
  if (lm != h) release(lm);
  release_grads(h);
  release(h);
  return loss;
}

LossResult LlamaModel::head_loss(const StepViews& s, bool with_grads, float grad_scale) {
  const int64_t V = cfg_.vocab_rows(), D = cfg_.dim;  // V: this rank's vocabulary rows
  const int lm = layout_.lm_head_unit;
  const int64_t chunk = std::min<int64_t>(opt_.loss_chunk_tokens, s.B * s.T);
  const Tensor w = weight(lm, layout_.lm_head, {V, D});
  const Tensor dh = with_grads ? s.tr.d_norm : Tensor();
  const Tensor dw = with_grads ? grad(lm, layout_.lm_head, {V, D}) : Tensor();
  // The fused head + loss gives d(xn_final) directly (vocabulary-parallel: this rank's share).
  const LossResult loss =
      cfg_.tp_shards > 1
          ? vocab_parallel_loss(be_, *seam_, cfg_, s.xn_final, w, s.in.targets, chunk,
                                with_grads ? grad_scale : 0.f, dh, dw, workspace_)
          : be_.lm_head_loss(s.xn_final, w, s.in.targets, chunk, with_grads ? grad_scale : 0.f, dh,
                             dw, workspace(), float(cfg_.final_softcap));
  if (with_grads) final_norm_backward(s);
  return loss;
}

void LlamaModel::final_norm_backward(const StepViews& s) {
  be_.zero(s.tr.d_resid);
  // The head is a column-parallel region: the ranks' shares summed (rows split: this rank's
  // rows of the sum, in x_full, idle until the last layer's backward).
  const Tensor d_xn_final =
      seam_->column_input_grad(s.tr.d_norm, s.layers[cfg_.stage_end() - 1].x_full);  // [n, D]
  norm_backward(s.x_final, final_norm_weight(s), s.rstd_final, d_xn_final, s.tr.d_resid,
                norm_grad(layout_.head_unit, layout_.final_norm, cfg_.dim));
}

LossResult LlamaModel::pieced_head_loss(const StepViews& s, bool with_grads, float grad_scale) {
  // Walk 1: statistics, in the pass's order (backward walks descending).
  head_row_stats(s, /*backward_order=*/with_grads);
  const int64_t rows = unit_pieces_[layout_.lm_head_unit][0].rows;
  const int64_t N = s.B * s.T;
  const HeadWalkScratch sc = head_walk_scratch(be_, workspace_, opt_, N, rows);
  // Every loss chunk's finish adds to one device accumulator: the walk reads its loss once.
  be_.zero(sc.loss_acc);
  if (with_grads) {
    head_grad_walk(s, grad_scale, Tensor(), sc.loss_acc);
  } else {
    // The loss from the statistics alone (the logits are not read).
    for (int64_t r0 = 0; r0 < N; r0 += sc.chunk) {
      const int64_t n = std::min(sc.chunk, N - r0);
      be_.xent_slice_finish(sc.logits(n, rows), s.in.targets.rows(r0, n), 0, sc.row_max.rows(r0, n),
                            sc.stats.rows(r0, n), 0.f,
                            /*want_grad=*/false, sc.loss_acc, sc.xent, float(cfg_.final_softcap));
    }
  }
  return be_.read_loss(sc.loss_acc);
}

bool LlamaModel::whole_tied_head() const {
  return layout_.lm_head_unit != layout_.head_unit && !in_pieces(layout_.lm_head_unit);
}

// The head's first vocabulary id on this rank: its tp slice's (vocab_parallel.h), else 0.
int64_t LlamaModel::head_vocab_begin() const {
  return cfg_.tp_shards > 1 ? vocab_slice(cfg_, *seam_).begin : 0;
}

void LlamaModel::head_row_stats(const StepViews& s, bool backward_order) {
  const int lm = layout_.lm_head_unit;
  const std::vector<UnitPiece>& pieces = unit_pieces_[lm];
  const int P = int(pieces.size());
  const int64_t N = s.B * s.T, D = cfg_.dim, V = cfg_.vocab_size, v0 = head_vocab_begin();
  const HeadWalkScratch sc = head_walk_scratch(be_, workspace_, opt_, N, pieces[0].rows);
  const float cap = float(cfg_.final_softcap);  // every slice op caps the logits it reads
  for (int i = 0; i < P; ++i) {
    const int k = backward_order ? P - 1 - i : i;
    const UnitPiece& p = pieces[k];
    acquire_piece(lm, k);
    const Tensor w = weight(lm, layout_.lm_head + p.row_begin * D, {p.rows, D});
    for (int64_t r0 = 0; r0 < N; r0 += sc.chunk) {
      const int64_t n = std::min(sc.chunk, N - r0);
      const Tensor logits = sc.logits(n, p.rows);  // [n, rows] = h W_p^T
      const Tensor m = sc.row_max.rows(r0, n), st = sc.stats.rows(r0, n);
      const Tensor t = s.in.targets.rows(r0, n);
      be_.linear_forward(s.xn_final.rows(r0, n), w, Tensor(), logits);
      if (cfg_.tp_shards > 1) {  // a whole vocabulary slice: reduced over the tp group
        be_.xent_slice_max(logits, m, cap);
        seam_->all_reduce_max(m);
        be_.xent_slice_stats(logits, t, v0, V, m, st, cap);
        seam_->all_reduce_sum(st);
      } else {
        be_.xent_slice_fold(logits, t, p.row_begin, V, m, st, i == 0, cap);
      }
    }
    release_piece(lm, k);
  }
}

void LlamaModel::head_grad_walk(const StepViews& s, float grad_scale, const Tensor& token_weights,
                                const Tensor& loss_acc) {
  // The table's unit: the untied head's, whose first piece also holds the final norm, or the
  // tied embeddings', the final norm then a unit of its own.
  const int lm = layout_.lm_head_unit, h = layout_.head_unit;
  const std::vector<UnitPiece>& pieces = unit_pieces_[lm];
  const int P = int(pieces.size());
  const int64_t N = s.B * s.T, D = cfg_.dim, v0 = head_vocab_begin();
  const HeadWalkScratch sc = head_walk_scratch(be_, workspace_, opt_, N, pieces[0].rows);
  const float cap = float(cfg_.final_softcap);
  // dlogits, d(xn_final) [N, D] in d_norm (the first piece overwrites, the others add; under
  // tp this rank's share, summed by the final norm's backward) and each piece's dW; then the
  // final norm's backward (untied: with the first piece, last).
  for (int k = P - 1; k >= 0; --k) {
    const UnitPiece& p = pieces[k];
    acquire_piece(lm, k);
    acquire_piece_grads(lm, k);
    const Tensor w = weight(lm, layout_.lm_head + p.row_begin * D, {p.rows, D});
    const Tensor dw = grad(lm, layout_.lm_head + p.row_begin * D, {p.rows, D});
    for (int64_t r0 = 0; r0 < N; r0 += sc.chunk) {
      const int64_t n = std::min(sc.chunk, N - r0);
      const Tensor logits = sc.logits(n, p.rows);  // [n, rows] = h W_p^T
      be_.linear_forward(s.xn_final.rows(r0, n), w, Tensor(), logits);
      // Every piece gives the whole row's loss: the first piece walked adds it, once.
      be_.xent_slice_finish(logits, s.in.targets.rows(r0, n), v0 + p.row_begin,
                            sc.row_max.rows(r0, n), sc.stats.rows(r0, n), grad_scale,
                            /*want_grad=*/true, k == P - 1 ? loss_acc : Tensor(), sc.xent, cap);
      // weighted: dlogits = weights[t] * (softmax - onehot(target)) on each token's row
      if (!token_weights.empty()) be_.scale_rows(logits, token_weights.rows(r0, n));
      be_.linear_backward(s.xn_final.rows(r0, n), w, logits, s.tr.d_norm.rows(r0, n), dw, Tensor(),
                          k == P - 1 ? OutputMode::kOverwrite : OutputMode::kAccumulate);
    }
    if (k == 0 && lm == h) final_norm_backward(s);
    // A tied piece: reduced now, and again after the embedding. A whole tied table's gradients
    // stay acquired until the embedding's backward (head_loss_backward's hold): a store that
    // reduces a completed unit's whole buffer must see it complete once.
    if (!whole_tied_head()) release_piece_grads(lm, k);
    release_piece(lm, k);
  }
  if (lm != h) {
    acquire(h);
    acquire_grads(h);
    final_norm_backward(s);
    release_grads(h);
    release(h);
  }
}

LossResult LlamaModel::forward_loss(int64_t B, int64_t T) {
  begin_pass(ParamStore::Pass::kForward);
  forward_layers(B, T, /*for_backward=*/false);
  const StepViews& s = bind(B, T);
  final_norm_unit_forward(s);
  const LossResult loss = head_loss_forward(s);
  end_pass();
  return loss;
}

void LlamaModel::forward_last_logits(int64_t T, std::vector<float>& logits) {
  begin_pass(ParamStore::Pass::kForward);
  forward_layers(1, T, /*for_backward=*/false);
  const StepViews& s = bind(1, T);
  const int64_t V = cfg_.vocab_size, D = cfg_.dim;
  const int lm = layout_.lm_head_unit;
  final_norm_unit_forward(s);
  // The kernel workspace is idle after the forward; it holds at least one loss chunk's
  // [chunk, V] logits, so the [1, V] logits fit (vocabulary-parallel: sized for them).
  const Tensor h_row = s.xn_final.rows(T - 1, 1);  // [1, D]
  const DType act = opt_.activation_dtype;
  Tensor out;
  if (cfg_.tp_shards > 1) {
    acquire(lm);
    out = vocab_parallel_last_logits(
        be_, *seam_, cfg_, h_row, weight(lm, layout_.lm_head, {cfg_.vocab_rows(), D}), workspace_);
    release(lm);
  } else {
    SHARDLM_CHECK(workspace_.bytes() >= size_t(V) * 4, "workspace too small for the logits");
    out = workspace_.view(act, {1, V});
    const std::vector<UnitPiece>& pieces = unit_pieces_[lm];
    for (int k = 0; k < int(pieces.size()); ++k) {
      const int64_t row_begin = in_pieces(lm) ? pieces[k].row_begin : 0;
      const int64_t rows = in_pieces(lm) ? pieces[k].rows : V;
      acquire_piece(lm, k);
      // logits [1, rows] of the piece's ids: contiguous in the [1, V] row
      be_.linear_forward(h_row, weight(lm, layout_.lm_head + row_begin * D, {rows, D}), Tensor(),
                         workspace_.view(act, {1, rows}, row_begin * dtype_size(act)));
      release_piece(lm, k);
    }
  }
  end_pass();
  logits.resize(V);
  be_.convert(out, Tensor(logits.data(), DType::kF32, {1, V}, MemPool::kHost));
  // Gemma 2's final soft cap, as the loss applies it: what sampling and its callers read.
  if (const float cap = float(cfg_.final_softcap); cap > 0.0f)
    for (float& x : logits) x = cap * std::tanh(x / cap);
}

}  // namespace shardlm
