// Where each decoder layer's kept tensors (model/layout.h's LayerActivationSpecs::kept) wait
// between its forward and its backward: in a device slot of their own, on the host, or nowhere
// (recomputed in backward from the input of the layer that starts their segment). Pure
// arithmetic, shared by the model (which allocates and walks the slots) and the planner.
#pragma once

#include <limits>

#include "shardlm/model/config.h"
#include "shardlm/model/layout.h"

namespace shardlm {

// memory.checkpoint_every and the share of memory.offload_checkpoints, in layers.
struct CheckpointPlacement {
  // Keep the tensors of every `every`-th layer of the stage, from its first (the segment
  // starts); backward recomputes a segment's other layers' inputs from its start, one forward
  // per layer, before their own backward. > 1 only with full checkpointing (a layer keeps its
  // input alone, so a recomputed input is all a layer needs).
  int every = 1;
  // How many of the kept layers wait on the host: the first ones (written first in forward,
  // read last in backward, so their copies have the most time to overlap); the rest stay in
  // device slots of their own. kAll (or any count above the kept layers) = every kept layer.
  int host_layers = 0;
  static constexpr int kAll = std::numeric_limits<int>::max();
  bool operator==(const CheckpointPlacement&) const = default;
};

// The device slots and host places of one stage's layers under a placement. Slots: one per
// kept layer left on the device ("resident"), then the rotating ones, which the other layers
// take by turn: the host layers' while they travel, the recomputed layers' inputs. Rotating
// slots: every + 1 with host layers (a whole segment in use and the next segment's start
// fetched one layer ahead), every - 1 without (a segment's recomputed inputs; its start is
// resident), never more than the layers that use them.
class CheckpointMap {
 public:
  // Error(kConfig)-free: invalid placements (every < 1, every > 1 without full checkpointing)
  // are SHARDLM_CHECK failures; config validation reports them first, by key.
  CheckpointMap(const ModelConfig& cfg, Checkpointing mode, CheckpointPlacement placement);

  int every() const { return every_; }
  int kept_layers() const { return kept_; }  // the segment starts
  int host_layers() const { return host_; }
  int rotating_slots() const { return rotating_; }
  int device_slots() const { return kept_ - host_ + rotating_; }
  bool kept(int l) const { return (l - begin_) % every_ == 0; }
  bool on_host(int l) const { return kept(l) && (l - begin_) / every_ < host_; }
  // The first layer of l's segment (the kept layer l's input is recomputed from).
  int segment_start(int l) const { return l - (l - begin_) % every_; }
  // The device slot of layer l's kept tensors (its input, while it is on the device).
  int slot(int l) const;
  // The place of a host layer's tensors in the host arena (on_host(l) only).
  int host_index(int l) const { return (l - begin_) / every_; }

 private:
  int begin_, layers_;
  int every_, kept_, host_, rotating_;
};

}  // namespace shardlm
