"""The peer column of BENCHMARKS.md's "long instructions on 24 GiB cards": how long an instruction
LoRA fine-tunes under DeepSpeed ZeRO-2 and ZeRO-3 (with parameter offload) on N cards of 24 GiB,
from DeepSpeed's own model-state estimators plus the activation model below. An estimate, not
a measurement; its assumptions are printed with the table.

Usage: python bench/small_gpu_peer.py   (the reference venv: deepspeed must import)

Model states (DeepSpeed's estimators, given the LoRA adapters as the trainable parameters):
  - ZeRO-2: estimate_zero2_model_states_mem_needs(trainable, cpu_offload=True) on the GPU, plus
    the frozen bf16 base (2 bytes a parameter) whole on every GPU: ZeRO-2 partitions only the
    optimizer states and gradients.
  - ZeRO-3, parameters offloaded: estimate_zero3_model_states_mem_needs(trainable, largest layer,
    cpu_offload=True, cpu_offload_params=True): 4 bytes a parameter of the largest layer (the
    gathered layer), the base in host memory.
  - ZeRO-3, not offloaded: the base's 2 bytes a parameter sharded over the N cards, plus the
    estimator's figure.
Activations, Hugging Face transformers with gradient checkpointing, bf16, flash/SDPA attention,
per token of the sequence:
  - a checkpoint of every layer's input: 2 h bytes a layer;
  - the layer being recomputed and differentiated: its saved tensors, 2 (4 h + 2 q + 2 kv + 4 F)
    bytes (the norms' outputs, q/k/v and the attention output, the MLP's gate, up, activation and
    product);
  - the logits: bf16 (2 V), their f32 copy in the loss (4 V) and its gradient (4 V) live
    together, 10 V bytes (transformers computes the whole [T, V] logits in training).
Plus 1 GiB for the CUDA context and allocator slack. The longest sequence is the largest
multiple of 1024 whose total stays within the card.
"""
import contextlib
import io
import sys

GIB = 1024**3

# name: hidden, layers, heads, kv heads, head_dim, ffn, vocab, tied (the shardlm presets)
MODELS = {
    "Llama-3.1-8B": (4096, 32, 32, 8, 128, 14336, 128256, False),
    "Qwen3-8B": (4096, 36, 32, 8, 128, 12288, 151936, False),
    "GLM-4-9B": (4096, 40, 32, 2, 128, 13696, 151552, False),
}


def shapes(m, logits_bytes=10):
    """(parameters, LoRA r16 parameters on q and v, the largest layer's parameters, activation
    bytes a token), the logits taking `logits_bytes` a vocabulary entry of each token."""
    h, layers, heads, kv, hd, f, v, tied = m
    q, kvd = heads * hd, kv * hd
    layer = h * q + 2 * h * kvd + q * h + 3 * h * f + 2 * h
    embed = v * h
    total = layers * layer + embed * (1 if tied else 2) + h
    # LoRA r16 on q and v (shardlm's default lora.targets, as in plan_context.sh): r (in + out)
    r = 16
    lora = layers * r * ((h + q) + (h + kvd))
    largest = max(layer, embed)
    per_token = 2 * h * layers + 2 * (4 * h + 2 * q + 2 * kvd + 4 * f) + logits_bytes * v
    return total, lora, largest, per_token


def longest(budget, per_token):
    n = int(budget // per_token) // 1024 * 1024
    return max(n, 0)


def main():
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
            from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs
    except Exception as e:  # noqa: BLE001 - any import failure means "no DeepSpeed here"
        print(f"cannot import deepspeed: {e!r}", file=sys.stderr)
        sys.exit(3)
    card = 24 * GIB
    print("| model | cards | DeepSpeed ZeRO-2 + optimizer offload | ZeRO-3 | "
          "ZeRO-3 + parameter offload |")
    print("|---|---|---|---|---|")
    for name, m in MODELS.items():
        total, lora, largest, per_token = shapes(m)
        for n in (1, 2, 4):
            z2 = estimate_zero2_model_states_mem_needs(lora, num_gpus_per_node=n, num_nodes=1,
                                                       cpu_offload=True)[1]
            z3 = estimate_zero3_model_states_mem_needs(lora, largest, num_gpus_per_node=n,
                                                       num_nodes=1, cpu_offload=True,
                                                       cpu_offload_params=False)[1]
            z3o = estimate_zero3_model_states_mem_needs(lora, largest, num_gpus_per_node=n,
                                                        num_nodes=1, cpu_offload=True,
                                                        cpu_offload_params=True)[1]
            free2 = card - GIB - z2 - 2 * total
            free3 = card - GIB - z3 - 2 * total / n
            free3o = card - GIB - z3o
            print(f"| {name} LoRA r16 | {n} | {longest(free2, per_token)} | "
                  f"{longest(free3, per_token)} | {longest(free3o, per_token)} |")
    print()
    print("per-token activation bytes: " + ", ".join(
        f"{name} {shapes(m)[3] / 1e6:.2f} MB" for name, m in MODELS.items()))


if __name__ == "__main__":
    main()
