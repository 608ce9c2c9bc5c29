// Where a frozen LoRA base stored in NF4 (LoraConfig::nf4_base, QLoRA) keeps each part of the
// parameter arena: every decoder layer's seven projection matrices (q, k, v, o, gate, up, down)
// as NF4 codes and absmax (quant/nf4.h, one quantized tensor per matrix, as bitsandbytes'
// Linear4bit), everything else (norms, biases, the embeddings, the final norm and an untied LM
// head) dense in the parameter dtype. The model dequantizes an acquired decoder layer into a
// one-layer workspace of the parameter dtype. Pure arithmetic like model/layout: the store
// allocates from this table and the planner sums it.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "shardlm/model/config.h"
#include "shardlm/model/layout.h"
#include "shardlm/model/sharded_base.h"
#include "shardlm/model/tensor_shard.h"

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

// An NF4 base in host memory (LoraConfig::offload_base): its three arrays stay on the host and
// each acquisition stages one part through one of two device slots. A decoder layer is one
// part: its absmax, its dense elements (norms, biases) and its codes, back to back in that
// order (each offset a multiple of its element size), which the store then dequantizes into the
// workspace. A dense unit (embeddings, final norm and head) is one part, or its table in pieces
// of rows no larger than a staged layer, handed out straight from the slot (whole under tensor
// parallelism, whose vocabulary-parallel embedding and loss read the whole slice).
struct Nf4HostPart {
  int unit = 0;
  int64_t begin = 0, end = 0;           // arena elements
  int64_t absmax_at = 0, absmax_n = 0;  // f32 values of the absmax array
  int64_t dense_at = 0, dense_n = 0;    // elements of the dense array
  int64_t code_at = 0, code_n = 0;      // bytes of the codes array
  int64_t bytes(int64_t param_bytes) const { return absmax_n * 4 + dense_n * param_bytes + code_n; }
};
struct Nf4HostLayout {
  std::vector<Nf4HostPart> parts;   // in arena order
  std::vector<int> unit_part;       // unit -> its first part
  std::vector<int64_t> piece_rows;  // unit -> rows of a table piece (0: whole)
  int64_t slot_bytes = 0;           // one device slot: the largest part
};
// param_bytes: the dense parts' element size (the parameter dtype's); split_tables: whether a
// table may be cut into pieces (false under tensor parallelism). shards: the base sharded over
// ZeRO-3's ranks in host memory (nf4_base_sharded), or null: a layer's part is then its dense
// elements and this rank's chunk ([absmax | codes] of the shard layout, whole f32 words), held
// where the absmax range is (absmax_at: the chunk's word in the shard, code_n = 0), which the
// store all-gathers from the slot before dequantizing. The tables' pieces are the same either
// way (no larger than an unsharded layer).
struct Nf4ShardLayout;
Nf4HostLayout make_nf4_host_layout(const ParamLayout& L, const Nf4BaseLayout& N,
                                   int64_t param_bytes, bool split_tables,
                                   const Nf4ShardLayout* shards = nullptr);

// Decoder layer u's part (quantized(u)): its ranges of the three arrays, each contiguous.
Nf4HostPart nf4_layer_part(const ParamLayout& L, const Nf4BaseLayout& N, int u);

// An NF4 base sharded over ZeRO-3's ranks (nf4_base_sharded): each decoder layer's absmax and
// codes, back to back ([absmax f32 | codes u8], absmax_n * 4 + code_n bytes), cut into `world`
// chunks of the same size (a multiple of 4 bytes, the last padded); a rank holds its chunk of
// every layer (on the device, or with LoraConfig::offload_base in host memory, staged with the
// layer's dense elements) and gathers a layer's chunks into a device buffer of world x the
// largest chunk before dequantizing it. The dense parts (tables, norms, biases) stay whole on
// every rank.
struct Nf4ShardLayout {
  std::vector<int64_t> chunk_at;     // unit -> its chunk's byte offset in the shard (layers)
  std::vector<int64_t> chunk_bytes;  // unit -> bytes of one chunk (0: not a quantized layer)
  int64_t shard_bytes = 0;           // a rank's chunks of every layer
  int64_t max_chunk = 0;
};
Nf4ShardLayout make_nf4_shard_layout(const ParamLayout& L, const Nf4BaseLayout& N, int64_t world);
// Whether ZeRO shards an NF4 base: stage 3 over more than one rank, the base on the device or
// in host memory.
inline bool nf4_base_sharded(bool nf4_base, int zero_stage, int64_t world) {
  return nf4_base && lora_base_sharded(zero_stage, world);
}

// A decoder projection already in NF4 (read from a directory bitsandbytes saved in 4 bits):
// its first arena element, its packed codes [packed_bytes(n)] and absmax [num_blocks(n)] f32,
// which the NF4 base takes as they are instead of quantizing the matrix's values.
struct Nf4Matrix {
  int64_t begin = 0;
  std::vector<uint8_t> codes;
  std::vector<float> absmax;
};

// Tensor parallelism over an NF4 base: each rank quantizes its shard of a projection, which
// holds the whole model's blocks of 64 when every shard starts on a block and holds whole
// blocks (a column-parallel projection's rows: (out / tp) x in elements a multiple of 64; a
// row-parallel one's columns: in / tp a multiple of 64). Error(kConfig) naming the projection,
// its shape and parallel.tp otherwise. `full`: the whole model's config.
void check_nf4_tp_blocks(const ModelConfig& full, int64_t tp);

// Matrices read in NF4 (`whole`, by their element in the whole model's arena) cut to what a
// tensor-parallel shard or pipeline stage holds: `pieces` (tensor_shard.h's ShardPiece: full and
// shard element offsets, in arena order) map the whole arena onto the shard's, and each
// matrix's pieces (whole blocks, check_nf4_tp_blocks) become one matrix at its shard offset.
// A matrix the shard does not hold is dropped.
std::vector<Nf4Matrix> nf4_shard_matrices(std::span<const Nf4Matrix> whole,
                                          const ParamLayout& whole_layout,
                                          const std::vector<ShardPiece>& pieces);

// Unit u's values [unit_size(u)] f32 on the host replaced by what the NF4 base holds: each
// quantized matrix quantized and dequantized (bitsandbytes' values), the rest as it is. The
// export and the end-of-run sample merge the adapters into these, the weights they trained on.
void nf4_round_trip_unit(const ParamLayout& L, const Nf4BaseLayout& N, int u, float* values);

}  // namespace shardlm
