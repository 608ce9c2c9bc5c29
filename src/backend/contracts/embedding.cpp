// The contracts of the token embeddings: embedding_forward, embedding_backward and their
// vocabulary-parallel slices embedding_forward_slice and embedding_backward_slice. The ids'
// range is the backend's to check: it reads the tokens, which may live on a device. Also the
// default implementation of the whole-vocabulary ops: the slice [0, V).
#include "backend/contracts/checks.h"

namespace shardlm {
namespace {

using namespace contract;  // NOLINT: the contract helpers are this file's vocabulary

// tokens [N] i32; rows [Vs, D] (the table or its gradient) holding ids [vocab_begin,
// vocab_begin + Vs) of [0, vocab); per_token [N, D] (out or dout)
void check_embedding(const Tensor& tokens, const Tensor& rows, const Tensor& per_token,
                     int64_t vocab_begin, int64_t vocab, std::string_view op,
                     std::string_view rows_name, std::string_view per_token_name) {
  check_tensor(tokens, DType::kI32, 1, op, "tokens");
  SHARDLM_CHECK(per_token.dim(0) == tokens.dim(0) && per_token.dim(1) == rows.dim(1),
                "{}: {} is {}, expected [N, D] = [{}, {}] from tokens {} and {} {}", op,
                per_token_name, per_token.shape().str(), tokens.dim(0), rows.dim(1),
                tokens.shape().str(), rows_name, rows.shape().str());
  SHARDLM_CHECK(vocab_begin >= 0 && vocab_begin + rows.dim(0) <= vocab,
                "{}: the slice [{}, {}) of {} {} is not inside the vocabulary [0, {})", op,
                vocab_begin, vocab_begin + rows.dim(0), rows_name, rows.shape().str(), vocab);
}

void check_forward(const Tensor& tokens, const Tensor& table, int64_t vocab_begin, int64_t vocab,
                   const Tensor& out) {
  constexpr std::string_view op = "embedding_forward";
  check_float(table, 2, op, "table");
  check_like(out, table, 2, op, "out", "table");
  check_embedding(tokens, table, out, vocab_begin, vocab, op, "table", "out");
}

void check_backward(const Tensor& tokens, const Tensor& dout, int64_t vocab_begin, int64_t vocab,
                    const Tensor& dtable) {
  constexpr std::string_view op = "embedding_backward";
  check_float(dout, 2, op, "dout");
  check_tensor(dtable, DType::kF32, 2, op, "dtable");
  check_embedding(tokens, dtable, dout, vocab_begin, vocab, op, "dtable", "dout");
}

}  // namespace

void Backend::embedding_forward(const Tensor& tokens, const Tensor& table, const Tensor& out) {
  check_forward(tokens, table, 0, table.rank() == 2 ? table.dim(0) : 0, out);
  do_embedding_forward(tokens, table, out);
}

void Backend::embedding_backward(const Tensor& tokens, const Tensor& dout, const Tensor& dtable) {
  check_backward(tokens, dout, 0, dtable.rank() == 2 ? dtable.dim(0) : 0, dtable);
  do_embedding_backward(tokens, dout, dtable);
}

void Backend::do_embedding_forward(const Tensor& tokens, const Tensor& table, const Tensor& out) {
  do_embedding_forward_slice(tokens, table, 0, table.dim(0), out);
}

void Backend::do_embedding_backward(const Tensor& tokens, const Tensor& dout,
                                    const Tensor& dtable) {
  do_embedding_backward_slice(tokens, dout, 0, dtable.dim(0), dtable);
}

void Backend::embedding_forward_slice(const Tensor& tokens, const Tensor& table,
                                      int64_t vocab_begin, int64_t vocab, const Tensor& out) {
  check_forward(tokens, table, vocab_begin, vocab, out);
  do_embedding_forward_slice(tokens, table, vocab_begin, vocab, out);
}

void Backend::embedding_backward_slice(const Tensor& tokens, const Tensor& dout,
                                       int64_t vocab_begin, int64_t vocab, const Tensor& dtable) {
  check_backward(tokens, dout, vocab_begin, vocab, dtable);
  do_embedding_backward_slice(tokens, dout, vocab_begin, vocab, dtable);
}

}  // namespace shardlm
