// The settings of tiny Gemma 2 and Gemma 3 models on the tiny demo model, as --set options of
// the integration and GPU suites' runs. Tests only.
#pragma once

#include <string>

namespace shardlm::test {

// Tiny Gemma 2 and Gemma 3 layers on the tiny demo model, as --set options of the integration
// and GPU suites' runs (tied, a sliding window of 16 on the local layer 0; Gemma 3's heads 48
// wide, wider than the model): Gemma 2's soft caps below the scores' and logits' range, so
// that they bend them.
inline const std::string kTinyGemmaLayers =
    "--set model.post_norms=true --set model.norm_one_plus_weight=true "
    "--set model.embed_scale=true --set model.mlp_activation=gelu_tanh "
    "--set model.tie_embeddings=true --set model.sliding_window=16 "
    "--set model.global_layer_every=2 --set model.query_pre_attn_scalar=24 ";
inline const std::string kTinyGemma2 =
    kTinyGemmaLayers + "--set model.attn_softcap=2 --set model.final_softcap=3 ";
inline const std::string kTinyGemma3 =
    kTinyGemmaLayers +
    "--set model.qk_norm=true --set model.head_dim=48 --set model.rope_theta=1000000 "
    "--set model.rope_local_theta=10000 ";

}  // namespace shardlm::test
