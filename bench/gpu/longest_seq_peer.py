#!/usr/bin/env python3
"""PyTorch's side of gpu-check.sh's memory phase: the longest sequence with which transformers'
LlamaForCausalLM (SDPA, gradient checkpointing, the model's own loss) trains one step on this
GPU, found by real steps: doubling from --lo until a step runs out of memory, then bisecting to
--granularity tokens. One sequence per step.
  lora: a bf16 base frozen, PEFT LoRA adapters (rank 16, alpha 32, every linear projection of
        the layers), forward and backward under bf16 autocast, AdamW on the adapters;
  full: fp32 weights under bf16 autocast and fused AdamW (16 bytes per parameter before any
        activation): reported as not fitting, without a run, when those alone exceed the GPU.
One JSON line. Not a test.

Usage: longest_seq_peer.py --config CFG --mode lora|full [--lo 4096] [--hi 1048576]
                           [--granularity 4096] [--budget-s 240] [--probe T] [--device cuda|cpu]
--probe T runs one step at T and reports it (the smoke test's use)."""

import argparse
import gc
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from gpu_common import emit, import_torch, is_oom  # noqa: E402
from torch_gpu_peer import param_count  # noqa: E402
from torch_peer import build_model, load_config  # noqa: E402

PROG = "longest_seq_peer"
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build(torch, c, mode, dev):
    """The model and its optimizer, as a user of transformers + PEFT would set them up."""
    dtype = torch.bfloat16 if mode == "lora" else torch.float32
    model = build_model(c, PROG, device=dev, dtype=dtype)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if mode == "lora":
        from peft import LoraConfig, get_peft_model
        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0,
                                                 target_modules=LORA_TARGETS, bias="none"))
    trainable = [p for p in model.parameters() if p.requires_grad]
    fused = {"fused": True} if dev == "cuda" else {}
    return model, torch.optim.AdamW(trainable, lr=1e-5, **fused)


def one_step(torch, model, opt, T, dev, vocab):
    """Forward (the model's loss), backward and the optimizer step on one random row of T."""
    x = torch.randint(0, vocab, (1, T), device=dev)
    with torch.autocast(dev, dtype=torch.bfloat16):
        loss = model(input_ids=x, labels=x).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(loss.detach())


def attempt(torch, model, opt, T, dev, vocab):
    """(fits, seconds, peak device bytes) of one step at T; memory released either way."""
    if dev == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    fits = True
    try:
        one_step(torch, model, opt, T, dev, vocab)
        if dev == "cuda":
            torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001  (only an OOM is an answer; a bug is re-raised)
        if not is_oom(torch, e):
            raise
        fits = False
    opt.zero_grad(set_to_none=True)
    gc.collect()
    peak = torch.cuda.max_memory_allocated() if dev == "cuda" else 0
    if dev == "cuda":
        torch.cuda.empty_cache()
    return fits, time.perf_counter() - t0, peak


def search(torch, model, opt, args, vocab, result):
    tries, start = [], time.perf_counter()
    best, worst = 0, None  # longest that fit, shortest that did not
    T = args.lo
    while T <= args.hi:
        if time.perf_counter() - start > args.budget_s:
            result["search"] = f"stopped by the {args.budget_s:.0f} s budget"
            break
        fits, s, peak = attempt(torch, model, opt, T, args.device, vocab)
        tries.append({"T": T, "fits": fits, "seconds": round(s, 2), "peak_device_bytes": peak})
        print(f"{PROG}: T={T}: {'fits' if fits else 'out of memory'} ({s:.1f} s)", file=sys.stderr)
        if fits:
            best, result["peak_device_bytes"] = T, peak
        else:
            worst = T
        if worst is None:
            T *= 2
        else:
            mid = (best + worst) // 2 // args.granularity * args.granularity
            if mid <= best:
                break
            T = mid
    result.setdefault("search", "complete" if worst is not None else f"fits up to --hi {args.hi}")
    result.update(longest_seq=best, tries=tries)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True, help="shardlm JSON config (the model's shapes)")
    ap.add_argument("--mode", choices=("lora", "full"), required=True)
    ap.add_argument("--lo", type=int, default=4096)
    ap.add_argument("--hi", type=int, default=1 << 20)
    ap.add_argument("--granularity", type=int, default=4096)
    ap.add_argument("--budget-s", type=float, default=240)
    ap.add_argument("--probe", type=int, default=0)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    args = ap.parse_args()
    torch = import_torch(PROG, args.device)
    import transformers

    c = load_config(args.config)
    m = c["model"]
    result = {"engine": "pytorch", "mode": args.mode, "torch": torch.__version__,
              "transformers": transformers.__version__, "params": param_count(m),
              "gradient_checkpointing": True}
    if args.device == "cuda":
        total = torch.cuda.get_device_properties(0).total_memory
        if args.mode == "full" and 16 * result["params"] > total:
            result["longest_seq"] = 0
            result["search"] = (f"does not fit at any length: {result['params'] / 1e9:.2f}B "
                                f"parameters x 16 bytes = {16 * result['params'] / 2**30:.0f} GiB "
                                f"> {total / 2**30:.0f} GiB before activations")
            emit(result)
            return
    c["seq_len"] = max(args.hi, args.probe)  # the model's max_position_embeddings
    torch.manual_seed(c["seed"])
    model, opt = build(torch, c, args.mode, args.device)
    if args.probe:
        fits, s, peak = attempt(torch, model, opt, args.probe, args.device, m["vocab_size"])
        result.update(probe=args.probe, fits=fits, seconds=s, peak_device_bytes=peak)
    else:
        search(torch, model, opt, args, m["vocab_size"], result)
    emit(result)


if __name__ == "__main__":
    main()
