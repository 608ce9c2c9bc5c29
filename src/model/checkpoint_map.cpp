// The slot arithmetic of checkpoint placement (model/checkpoint_map.h).
#include "shardlm/model/checkpoint_map.h"

#include <algorithm>

#include "shardlm/core/check.h"

namespace shardlm {

CheckpointMap::CheckpointMap(const ModelConfig& c, Checkpointing mode, CheckpointPlacement p)
    : begin_(int(c.pp_begin)), layers_(int(c.stage_end() - c.pp_begin)), every_(p.every) {
  SHARDLM_CHECK(every_ >= 1, "checkpoint placement: every = {} must be >= 1", every_);
  SHARDLM_CHECK(every_ == 1 || mode == Checkpointing::kFull,
                "checkpoint placement: keeping every {}-th layer needs full checkpointing, got {}",
                every_, checkpointing_name(mode));
  SHARDLM_CHECK(p.host_layers >= 0, "checkpoint placement: host_layers = {} must be >= 0",
                p.host_layers);
  SHARDLM_CHECK(p.host_layers == 0 || mode != Checkpointing::kNone,
                "checkpoint placement: host layers need selective or full checkpointing");
  kept_ = (layers_ + every_ - 1) / every_;
  host_ = std::min(p.host_layers, kept_);
  const int shared = layers_ - (kept_ - host_);  // layers without a resident slot
  rotating_ = shared == 0 ? 0 : std::min(shared, host_ > 0 ? every_ + 1 : every_ - 1);
}

int CheckpointMap::slot(int l) const {
  SHARDLM_CHECK(l >= begin_ && l < begin_ + layers_, "layer {} is not in the stage [{}, {})", l,
                begin_, begin_ + layers_);
  if (kept(l) && !on_host(l)) return host_index(l) - host_;  // resident
  return kept_ - host_ + (l - begin_) % rotating_;
}

}  // namespace shardlm
