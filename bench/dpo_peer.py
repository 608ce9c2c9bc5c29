"""The peer column of BENCHMARKS.md's "longest preference pair": how long a DPO pair (its chosen
and rejected sequences together, in tokens) TRL's DPOTrainer trains under DeepSpeed ZeRO-3 on 1
and 8 cards of 78 GiB, from DeepSpeed's own model-state estimators plus the activation model
below. An estimate, not a measurement; its assumptions are printed with the table.

Usage: python bench/dpo_peer.py   (the reference venv: deepspeed and trl must import)

The reference model (TRL 1.16, DPOTrainer.__init__):
  - LoRA: none; the reference is the policy with its adapters disabled (`is_peft_model`).
  - full fine-tuning: none with `precompute_ref_log_probs=True` (the setting assumed here: a
    pass before training); without it TRL loads a second copy of the model, which ZeRO-3 shards
    like the first (2 bytes a parameter over the cards: printed separately).
Model states (DeepSpeed's estimators):
  - LoRA: estimate_zero3_model_states_mem_needs(adapters, largest layer, ...) with the frozen bf16
    base (2 bytes a parameter) sharded over the cards, or in host memory with parameter offload.
  - full: estimate_zero3_model_states_mem_needs(all parameters, largest layer, ...) without
    offload, with optimizer offload, and with optimizer and parameter offload.
Activations, transformers with gradient checkpointing, bf16, flash/SDPA attention, per token of
the pair (TRL concatenates chosen and rejected along the batch, each padded to the longer: a pair
of two equal halves is taken, so its tokens are the batch's):
  - a checkpoint of every layer's input: 2 h bytes a layer;
  - the layer being recomputed and differentiated: its saved tensors, 2 (4 h + 2 q + 2 kv + 4 F)
    bytes;
  - the logits: bf16 (2 V) and their gradient (2 V); TRL's fused Triton log-probability kernel
    (`selective_log_softmax` on a GPU) materialises no log-softmax, and the reference forward's
    logits are freed before the policy's forward.
Plus 1 GiB for the CUDA context and allocator slack. The longest pair is the largest multiple of
1024 whose total stays within the card. DPOTrainer has no sequence parallelism: 8 cards shard the
states, never a pair's tokens.
"""
import contextlib
import io
import sys

from small_gpu_peer import longest, shapes

GIB = 1024**3
CARD = 78 * GIB

# name: hidden, layers, heads, kv heads, head_dim, ffn, vocab, tied (the shardlm preset)
MODELS = {"Llama-3.1-8B": (4096, 32, 32, 8, 128, 14336, 128256, False)}
LOGITS_BYTES = 4  # bf16 logits and their gradient, a vocabulary entry of a token


def main():
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
            import trl  # noqa: F401 - the trainer whose reference rules the docstring reads
    except Exception as e:  # noqa: BLE001 - any import failure means "no peer here"
        print(f"cannot import deepspeed and trl: {e!r}", file=sys.stderr)
        sys.exit(3)

    def states(params, largest, n, offload, offload_params):
        cpu, gpu, _ = estimate_zero3_model_states_mem_needs(
            params, largest, num_gpus_per_node=n, num_nodes=1, cpu_offload=offload,
            cpu_offload_params=offload_params)
        return gpu, cpu

    print("| model | cards | setting | device model states | host (node) | longest pair |")
    print("|---|---|---|---|---|---|")
    for name, m in MODELS.items():
        total, lora, largest, per_token = shapes(m, LOGITS_BYTES)
        for n in (1, 8):
            rows = [
                # (setting, device and host states, the frozen base's device and host bytes)
                ("LoRA r16, ZeRO-3", *states(lora, largest, n, False, False), 2 * total / n, 0),
                ("LoRA r16, ZeRO-3 + parameter offload", *states(lora, largest, n, True, True), 0,
                 2 * total),
                ("full, ZeRO-3", *states(total, largest, n, False, False), 0, 0),
                ("full, ZeRO-3 + optimizer offload", *states(total, largest, n, True, False), 0, 0),
                ("full, ZeRO-3 + optimizer and parameter offload",
                 *states(total, largest, n, True, True), 0, 0),
            ]
            for setting, gpu, cpu, base, base_host in rows:
                used = gpu + base
                free = CARD - GIB - used
                print(f"| {name} DPO | {n} | {setting} | {used / GIB:.1f} GiB | "
                      f"{(cpu + base_host) / GIB:.0f} GiB | {longest(free, per_token)} |")
        print()
        print(f"per-token activation bytes: {per_token / 1e6:.2f} MB; without "
              f"precompute_ref_log_probs a full run's reference copy adds "
              f"{2 * total / GIB:.1f} GiB / cards per card")


if __name__ == "__main__":
    main()
