// The buffers of a preference objective's step on the device (train.objective = "dpo" or
// "simpo"; train/preference.cpp's PreferenceRunner), from sizes alone, so that the runner
// allocates and the plan counts the same bytes. Only the rank that holds the LM head has them.
//
// Per micro-batch the host knows which pair each token belongs to; the device does the rest:
//   segments  [tokens] i32 each local token's sequence (2k: pair k's chosen, 2k + 1 its
//             rejected; -1 none), one set per micro-batch in flight (pipeline slots)
//   policy    [S, 2] f64 each sequence's summed log-probabilities and their count
//   reference [S, 2] f64 the same of DPO's reference: the adapters-off forward's (LoRA; under
//             pipeline stages one set per micro-batch of the step, kept from the reference
//             sweep to the backward), or full fine-tuning's precomputed table's pairs, uploaded
//             with the segment ids (one set per micro-batch in flight)
//   coef      [S] f32 each sequence's coefficient, the token weights' source
//   metrics   [kPreferenceMetrics] f64 the step's metric sums, read once at its end
// and on the host, pinned, kStagingSlots upload slots, each a micro-batch's segment ids and
// (full fine-tuning DPO) its pairs' reference sums.
//
// S, the most sequences a micro-batch can hold: a pair is one item of whole-sample packing,
// its two sequences in one row of T tokens, and the data refuses an empty sequence
// (Dataset::pack_pairs), so B rows hold at most B * T sequences.
#pragma once

#include <cstdint>

namespace shardlm {

// The metrics buffer's length (the backend's kPreferenceMetrics: seven f64 sums).
inline constexpr int64_t kPreferenceStepMetrics = 7;

struct PreferenceStepBuffers {
  // Three pinned slots: a slot is written again three micro-batches after its copies were
  // started. The input staging's wait two micro-batches back (train/input_staging.h) covers
  // the copy started before it, one micro-batch earlier (the copy queue runs in order), so the
  // wait for a slot never blocks where the inputs go up from that staging.
  static constexpr int kStagingSlots = 3;
  static constexpr int64_t kAlign = 256;

  int64_t tokens = 0;             // a micro-batch's local tokens, B * Tl
  int64_t max_segments = 0;       // S = B * T
  int segment_sets = 1;           // micro-batches whose segment ids are held at once
  int reference_sets = 0;         // reference sums held
  bool reference_upload = false;  // the reference sums go up from the staging slots

  static int64_t aligned(int64_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }
  int64_t segments_bytes() const { return aligned(tokens * 4); }
  int64_t sums_bytes() const { return aligned(max_segments * 2 * 8); }
  // Device offsets: the segment sets, the policy's sums, the reference sets, coef, metrics.
  int64_t segments_at(int set) const { return set * segments_bytes(); }
  int64_t policy_at() const { return segment_sets * segments_bytes(); }
  int64_t reference_at(int set) const { return policy_at() + (1 + set) * sums_bytes(); }
  int64_t coef_at() const { return reference_at(reference_sets); }
  int64_t metrics_at() const { return coef_at() + aligned(max_segments * 4); }
  int64_t device_bytes() const {
    return tokens == 0 ? 0 : metrics_at() + aligned(kPreferenceStepMetrics * 8);
  }
  // Host: one slot's segment ids, then (reference_upload) its reference sums.
  int64_t slot_bytes() const { return segments_bytes() + (reference_upload ? sums_bytes() : 0); }
  int64_t host_bytes() const { return tokens == 0 ? 0 : kStagingSlots * slot_bytes(); }
};

// The step's buffers for micro-batches of B rows of T tokens, Tl of them on this rank.
// pipeline_slots: the stage's micro-batches in flight (1 without pipeline stages);
// micro_batches: the step's (train.grad_accum); reference: DPO's (not SimPO); table: full
// fine-tuning DPO's precomputed sums (else LoRA's adapters-off forward). holds_head false:
// none (all sizes 0).
inline PreferenceStepBuffers preference_step_buffers(bool holds_head, int64_t B, int64_t T,
                                                     int64_t Tl, int pipeline_slots,
                                                     int64_t micro_batches, bool pipelined,
                                                     bool reference, bool table) {
  PreferenceStepBuffers b;
  if (!holds_head) return b;
  b.tokens = B * Tl;
  b.max_segments = B * T;
  b.segment_sets = pipeline_slots;
  // the adapters-off forward's: every micro-batch's under pipeline stages (the reference sweep
  // runs them all before the first backward), else one; the table's: one per slot in flight
  b.reference_sets = !reference ? 0 : table ? pipeline_slots : pipelined ? int(micro_batches) : 1;
  b.reference_upload = reference && table;
  return b;
}

}  // namespace shardlm
