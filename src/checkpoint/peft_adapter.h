// A LoRA checkpoint's adapters as a PEFT adapter directory (adapter_model.safetensors and
// adapter_config.json), with GLM's fused gate_up_proj adapter. Private to src/checkpoint.
#pragma once

#include <string>

#include "shardlm/checkpoint/checkpoint.h"
#include "shardlm/checkpoint/model_io.h"
#include "shardlm/core/dtype.h"
#include "shardlm/model/lora.h"

namespace shardlm {

// Writes `dir` from the checkpoint's f32 adapters (layout A) in `dtype` (f32 or bf16). Where the
// base fuses the gate and up projections (GLM's gate_up_proj [2F, D], gate rows first), a layer's
// gate and up adapters become one PEFT adapter on gate_up_proj that computes exactly what they do
// (peft_adapter.cpp).
void write_peft_adapter(const CheckpointReader& ckpt, const StoredModel& stored,
                        const LoraLayout& A, const std::string& dir, DType dtype);

}  // namespace shardlm
