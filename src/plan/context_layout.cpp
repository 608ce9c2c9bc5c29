// Context-parallel sequence split and buffer tables (see context_layout.h).
#include "shardlm/plan/context_layout.h"

#include <fmt/format.h>

#include <algorithm>
#include <string_view>

#include "shardlm/core/check.h"

namespace shardlm {

std::string_view cp_kind_name(CpKind kind) {
  switch (kind) {
    case CpKind::kUlysses:
      return "ulysses";
    case CpKind::kRing:
      return "ring";
    case CpKind::kHybrid:
      return "hybrid";
  }
  return "?";
}

CpKind parse_cp_kind(std::string_view name) {
  if (name == "ulysses") return CpKind::kUlysses;
  if (name == "ring") return CpKind::kRing;
  if (name == "hybrid") return CpKind::kHybrid;
  SHARDLM_FAIL(ErrorKind::kConfig,
               "parallel.cp_kind = \"{}\" is not one of \"ulysses\", \"ring\", \"hybrid\"", name);
}

int64_t ContextLayout::chunk_start(int g, int h) const {
  return (h == 0 ? g : 2 * R() - 1 - g) * chunk();
}

int64_t ContextLayout::group_global_index(int g, int64_t j) const {
  return chunk_start(g, int(j / chunk())) + j % chunk();
}

int64_t ContextLayout::group_index(int u, int64_t i) const {
  return (i / piece()) * chunk() + u * piece() + i % piece();
}

int64_t ContextLayout::global_index(int c, int64_t i) const {
  return group_global_index(c / U, group_index(c % U, i));
}

namespace {

// Ulysses members split Hq query heads evenly; kv heads split evenly too, or (fewer kv heads
// than members) each member takes the one kv head its query heads read.
bool heads_split(const ModelConfig& cfg, int64_t U) {
  const int64_t Hq = cfg.n_heads, Hkv = cfg.n_kv_heads;
  return Hq % U == 0 && (Hkv % U == 0 || U % Hkv == 0);
}

}  // namespace

ContextLayout make_context_layout(const ModelConfig& cfg, int64_t T, int P, CpKind kind,
                                  int64_t ulysses) {
  SHARDLM_CHECK_KIND(ErrorKind::kConfig, P >= 1, "parallel.cp must be >= 1, got {}", P);
  ContextLayout L;
  L.T = T;
  L.P = P;
  if (kind == CpKind::kUlysses) {
    L.U = P;
  } else if (kind == CpKind::kRing) {
    L.U = 1;
  } else if (ulysses > 0) {
    L.U = int(ulysses);
  } else {
    L.U = 1;  // auto: the largest U <= P/2 dividing P that the heads allow
    for (int u = P / 2; u >= 2; --u) {
      if (P % u == 0 && heads_split(cfg, u)) {
        L.U = u;
        break;
      }
    }
  }
  if (P % L.U != 0)
    SHARDLM_FAIL(ErrorKind::kConfig, "parallel.cp_ulysses ({}) must divide parallel.cp ({})", L.U,
                 P);
  if (!heads_split(cfg, L.U)) {
    // Under tensor parallelism cfg is a tp rank's shard: name the keys and the division.
    const auto heads = [&](std::string_view key, int64_t n) {
      return cfg.tp_shards > 1 ? fmt::format("{} / parallel.tp ({} / {} = {})", key,
                                             n * cfg.tp_shards, cfg.tp_shards, n)
                               : fmt::format("{} ({})", key, n);
    };
    SHARDLM_FAIL(ErrorKind::kConfig,
                 "{} all-to-all over {} ranks needs {} divisible by {} and {} a multiple or a "
                 "divisor of {}; use parallel.cp_kind = \"ring\" (no head limit) or \"hybrid\" "
                 "with a parallel.cp_ulysses that does",
                 kind == CpKind::kHybrid ? "the hybrid's Ulysses" : "Ulysses", L.U,
                 heads("model.n_heads", cfg.n_heads), L.U,
                 heads("model.n_kv_heads", cfg.n_kv_heads), L.U);
  }
  if (T % (2 * P) != 0)
    SHARDLM_FAIL(ErrorKind::kConfig,
                 "data.seq_len ({}) must be a multiple of 2 x parallel.cp = {}: every sequence is "
                 "cut into 2 x cp equal pieces (a load-balanced causal split); use data.seq_len = "
                 "{}",
                 T, 2 * P, std::max<int64_t>(2 * P, T / (2 * P) * (2 * P)));
  return L;
}

int64_t cp_q_heads(const ModelConfig& cfg, const ContextLayout& L) { return cfg.n_heads / L.U; }

int64_t cp_kv_heads(const ModelConfig& cfg, const ContextLayout& L) {
  return std::max<int64_t>(1, cfg.n_kv_heads / L.U);
}

int64_t cp_kv_head_of(const ModelConfig& cfg, const ContextLayout& L, int u) {
  return int64_t(u) * cfg.n_kv_heads / L.U;
}

CpKernelShape cp_kernel_shape(const ModelConfig& cfg, const ContextLayout& L, int64_t B) {
  const int64_t Hg = cp_q_heads(cfg, L), Kg = cp_kv_heads(cfg, L), Dh = cfg.head_dim();
  if (L.R() > 1) return {1, L.chunk(), L.chunk(), Hg, Kg, Dh, true};
  return {B, L.group_len(), L.group_len(), Hg, Kg, Dh, false};
}

std::vector<CpBuffer> cp_buffers(const ModelConfig& cfg, const ContextLayout& L, int64_t B,
                                 int64_t kernel_ws_bytes, DType act_dtype, int slots,
                                 int kept_sets) {
  const int64_t Hq = cfg.n_heads, Dh = cfg.head_dim();
  const int64_t e = int64_t(dtype_size(act_dtype));  // bytes of an activation element
  const int64_t Hg = cp_q_heads(cfg, L), Kg = cp_kv_heads(cfg, L);
  const int64_t G = L.group_len(), Tl = L.local(), C = L.chunk();
  const MemCategory act = MemCategory::kActivations, comm = MemCategory::kComm;
  const MemPool dev = MemPool::kDevice;
  std::vector<CpBuffer> out;
  auto add = [&](std::string name, MemCategory cat, MemPool pool, int64_t bytes) {
    out.push_back({std::move(name), cat, pool, bytes});
  };
  // The data loader's full rows (tokens, targets, positions, document starts) before they are
  // cut into this rank's shard.
  add("inputs.full_rows", act, MemPool::kHost, 4 * B * L.T * 4);
  if (L.U > 1) {
    const int64_t qg = B * G * Hg * Dh * e, kvg = B * G * Kg * Dh * e;
    // The group's out, dout and dq live in the staging and the caller's dq (context.cpp).
    if (kept_sets > 0) {  // the forward gathers into the kept sets, the backward reads them
      add("ulysses.kept", act, dev, slots * kept_sets * (qg + 2 * kvg));
    } else {
      add("ulysses.q", act, dev, qg);
      for (const char* n : {"ulysses.k", "ulysses.v"}) add(n, act, dev, kvg);
    }
    for (const char* n : {"ulysses.dk", "ulysses.dv"}) add(n, act, dev, kvg);
    // Each micro-batch in flight's group document starts, written once when it is sharded.
    add("ulysses.seg", act, dev, slots * B * G * 4);
    if (L.R() == 1) {
      // The gathered rows are whole rows: their packed documents as spans (DocumentSpans), for
      // a kernel that takes variable-length sequences (cuDNN's ragged SDPA), per micro-batch in
      // flight, and the host rows they are written from: two, used in turn, so that the host
      // writes one only after the copy out of it two micro-batches back (context.cpp).
      add("ulysses.doc_starts", act, dev, slots * (B * G + 1) * 4);
      add("ulysses.doc_starts_host", act, MemPool::kHost, kCpHostHalves * (B * G + 1) * 4);
    }
    const int64_t staging = std::max(B * Tl * Hq * Dh, L.U * B * Tl * Kg * Dh) * e;
    add("ulysses.send", comm, dev, staging);
    add("ulysses.recv", comm, dev, staging);
  }
  if (L.R() > 1) {
    const int64_t kv = 2 * B * G * Kg * Dh * e;  // k and v of one group sequence
    add("ring.kv", comm, dev, 2 * kv);           // the block in use and the one arriving
    // Backward: the gradients of the block in hand (this rank's part, accumulated while the
    // previous exchange is in flight), the accumulator arriving and the one leaving.
    add("ring.dkv", comm, dev, 3 * kv);
    add("ring.block_out", act, dev, C * Hg * Dh * e);
    add("ring.block_lse", act, dev, Hg * C * 4);
    add("ring.block_dq", act, dev, C * Hg * Dh * e);
    add("ring.block_dkv", act, dev, 2 * C * Kg * Dh * e);
  }
  // The group's document starts on the host, per micro-batch in flight (cut from the loader's
  // full rows): which ring blocks to launch, the FLOP count, without reading the device. Two
  // per slot, used in turn: Ulysses' copy out of one may still be queued when the slot's next
  // micro-batch is cut into the other (context.cpp).
  add("attention.seg_host", act, MemPool::kHost, kCpHostHalves * slots * B * G * 4);
  add("attention.workspace", MemCategory::kWorkspace, dev, kernel_ws_bytes);
  return out;
}

int cp_kept_sets(const ContextLayout& L, bool keep, bool attention_recomputed, int stage_layers) {
  if (!keep || L.U == 1) return 0;
  return attention_recomputed ? 1 : stage_layers;
}

CpCommVolume cp_comm_volume(const ModelConfig& cfg, const ContextLayout& L, int64_t B, DType act,
                            bool kept) {
  const int64_t Hq = cfg.n_heads, Dh = cfg.head_dim();
  const int64_t e = int64_t(dtype_size(act));
  const int64_t Kg = cp_kv_heads(cfg, L), G = L.group_len(), Tl = L.local();
  const int64_t U = L.U, R = L.R();
  CpCommVolume v;
  if (U > 1) {
    // All-to-all: a rank keeps its own chunk and sends the other U - 1.
    const int64_t q = B * Tl * Hq * Dh / U * (U - 1) * e;  // q, out, dout, dq
    const int64_t kv = B * Tl * Kg * Dh * (U - 1) * e;     // k, v, dk, dv
    v.forward += 2 * q + 2 * kv;                           // q, k, v in; out back
    v.backward += 3 * q + 2 * kv + q + 2 * kv;             // q, k, v, out, dout in; dq, dk, dv
    if (kept) v.backward -= q + 2 * kv;                    // q, k, v kept from the forward
  }
  if (R > 1) {
    const int64_t kv = 2 * B * G * Kg * Dh * e;
    v.ring_forward = (R - 1) * kv;
    v.ring_backward = (R - 1) * kv + R * kv;  // k, v around the ring; dk, dv once more home
    v.forward += v.ring_forward;
    v.backward += v.ring_backward;
  }
  return v;
}

}  // namespace shardlm
