// Where a frozen LoRA base stored in NF4 (LoraConfig::nf4_base, QLoRA) keeps each part of the
// parameter arena: every decoder layer's seven projection matrices (q, k, v, o, gate, up, down)
// as NF4 codes and absmax (quant/nf4.h, one quantized tensor per matrix, as bitsandbytes'
// Linear4bit), everything else (norms, biases, the embeddings, the final norm and an untied LM
// head) dense in the parameter dtype. The model dequantizes an acquired decoder layer into a
// one-layer workspace of the parameter dtype. Pure arithmetic like model/layout: the store
// allocates from this table and the planner sums it.
#pragma once

#include <cstdint>
#include <vector>

#include "shardlm/model/layout.h"

namespace shardlm {

// A contiguous range of a unit: arena elements [begin, begin + n); quantized: codes from byte
// `code_at` and absmax from index `absmax_at` of the NF4 arrays, else dense elements from
// `dense_at` of the dense array.
struct Nf4Segment {
  int64_t begin = 0, n = 0;
  bool quantized = false;
  int64_t dense_at = 0, code_at = 0, absmax_at = 0;
};

struct Nf4BaseLayout {
  std::vector<std::vector<Nf4Segment>> units;  // per ParamLayout unit, in arena order
  int64_t dense_elems = 0;                     // parameter dtype
  int64_t code_bytes = 0;                      // u8, two codes a byte
  int64_t absmax_values = 0;                   // f32, one per 64 elements of a matrix
  int64_t workspace_elems = 0;                 // the largest decoder layer: the dequantized layer
  // Whether unit u has quantized segments (a decoder layer this layout holds).
  bool quantized(int u) const;
};
Nf4BaseLayout make_nf4_base_layout(const ParamLayout& L);

// Unit u's values [unit_size(u)] f32 on the host replaced by what the NF4 base holds: each
// quantized matrix quantized and dequantized (bitsandbytes' values), the rest as it is. The
// export and the end-of-run sample merge the adapters into these, the weights they trained on.
void nf4_round_trip_unit(const ParamLayout& L, const Nf4BaseLayout& N, int u, float* values);

}  // namespace shardlm
