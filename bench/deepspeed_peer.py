#!/usr/bin/env python3
"""DeepSpeed ZeRO peer of a shardlm ZeRO run on CPU ranks (DeepSpeed's CPU accelerator, gloo):
the same model, rows, optimizer settings, clipping and timing as fsdp_peer.py, whose Run class
it uses. Rank 0 prints one JSON line on stdout (progress goes to stderr). Not a test.

  DS_ACCELERATOR=cpu python -m torch.distributed.run --standalone --nproc_per_node N \\
      bench/deepspeed_peer.py --config bench/configs/zero_small.json --stage 3 [--offload]

--stage 0..3 is DeepSpeed's zero_optimization.stage, fp32 (no fp16/bf16 section), with
torch.optim.AdamW as the client optimizer (zero_allow_untested_optimizer). --offload sets
offload_optimizer (and, at stage 3, offload_param) to "cpu"; DeepSpeed then requires its own
DeepSpeedCPUAdam (AdamW mode; a C++ extension it compiles on first use), so that row measures
another AdamW implementation too. DeepSpeed's overlap_comm and bucket sizes keep their defaults.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fsdp_peer  # noqa: E402
import torch_peer as tp  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    fsdp_peer.common_args(ap)
    ap.add_argument("--stage", type=int, required=True, choices=(0, 1, 2, 3))
    ap.add_argument("--offload", action="store_true",
                    help="offload_optimizer (and at stage 3 offload_param) to cpu")
    args = ap.parse_args()
    if args.offload and args.stage == 0:
        tp.die("--offload needs --stage 1, 2 or 3", "deepspeed_peer")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before deepspeed is imported
    try:  # before Run, so that its baseline RSS includes DeepSpeed's modules
        import deepspeed
    except ImportError as e:
        tp.die(f"DeepSpeed is not importable ({e}); pip install deepspeed into the venv",
               "deepspeed_peer")
    run = fsdp_peer.Run("deepspeed_peer", args)
    from deepspeed.accelerator import get_accelerator
    if get_accelerator().device_name() != "cpu":
        run.die(f"DeepSpeed chose accelerator '{get_accelerator().device_name()}', not cpu; "
                "set DS_ACCELERATOR=cpu")
    deepspeed.init_distributed(dist_backend="gloo")  # adopts the process group Run opened
    torch, c = run.torch, run.c
    import torch.nn.functional as F
    model = run.build_model()

    zero = {"stage": args.stage}
    if args.offload:
        zero["offload_optimizer"] = {"device": "cpu"}
        if args.stage == 3:
            zero["offload_param"] = {"device": "cpu"}
    groups = tp.param_groups(model.named_parameters(), c, run.decay_names)
    if args.offload:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        opt = DeepSpeedCPUAdam(groups, lr=c["lr"], betas=c["betas"], eps=c["eps"],
                               adamw_mode=True)
    else:
        opt = torch.optim.AdamW(groups, lr=c["lr"], betas=c["betas"], eps=c["eps"])
    ds_config = {
        "train_micro_batch_size_per_gpu": run.B,
        "gradient_accumulation_steps": run.accum,
        "train_batch_size": run.rows_per_step,
        "gradient_clipping": c["grad_clip"],
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }
    engine, ds_opt, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config)
    label = f"stage{args.stage}" + ("+offload" if args.offload else "")
    run.log(f"torch {torch.__version__}, transformers {run.transformers.__version__}, "
            f"deepspeed {deepspeed.__version__} ZeRO {label}, {run.world} ranks x {run.threads} "
            f"thread(s), {run.params / 1e6:.2f}M parameters, {run.steps} steps of {run.world} x "
            f"{run.accum} x {run.B} x {run.T} tokens")

    def micro_step(x, y, a):
        logits = engine(input_ids=x).logits  # [B, T, V]
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
        engine.backward(loss)  # DeepSpeed divides by gradient_accumulation_steps
        if a < run.accum - 1:
            engine.step()  # not a boundary: DeepSpeed only accumulates
        return loss.item()

    def finish_step(lr):
        for g in ds_opt.param_groups:
            g["lr"] = lr
        engine.step()  # the boundary: reduce, clip, AdamW

    step_s, losses = run.train(micro_step, finish_step)
    run.report("deepspeed", label, args.stage, step_s, losses,
               {"deepspeed": deepspeed.__version__})


if __name__ == "__main__":
    main()
