#!/usr/bin/env python3
"""PyTorch data-parallel peer of a shardlm ZeRO run on CPU ranks: the same Llama shapes (read
from the shardlm JSON config through torch_peer.py), the same per-rank micro-batch, the same
global batch, fp32, AdamW with the config's settings and global-norm clipping, over gloo with
one thread per rank. Rank 0 prints one JSON line on stdout (progress goes to stderr). Not a test.

Launch with torchrun, one process per rank:

  python -m torch.distributed.run --standalone --nproc_per_node N bench/fsdp_peer.py \\
      --config bench/configs/zero_small.json --strategy full_shard

--strategy, and the ZeRO stage it stands in for:
  ddp            stage 0: DistributedDataParallel (everything replicated, gradients all-reduced)
  no_shard       stage 0: FSDP ShardingStrategy.NO_SHARD
  zero1          stage 1: DDP + torch's ZeroRedundancyOptimizer (AdamW state sharded)
  shard_grad_op  stage 2: FSDP SHARD_GRAD_OP (gradients and optimizer state sharded; parameters
                 stay gathered between forward and backward)
  full_shard     stage 3: FSDP FULL_SHARD (parameters sharded too, gathered per decoder layer)
FSDP wraps every decoder layer as its own unit (embedding, final norm and head in the root).

Also a module: deepspeed_peer.py uses start(), train() and report() from here;
long_context_fsdp.py uses wrap_fsdp() and fsdp_param_groups().
"""

import argparse
import contextlib
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_peer as tp  # noqa: E402  (the shared config reader, model and data)

STAGES = {"ddp": 0, "no_shard": 0, "zero1": 1, "shard_grad_op": 2, "full_shard": 3}


def common_args(ap):
    ap.add_argument("--config", required=True, help="shardlm JSON config (model, data, train)")
    ap.add_argument("--steps", type=int, default=0, help="optimizer steps (default: max_steps)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank")


class Run:
    """What every data-parallel peer shares: the config, the rank, the corpus, the model."""

    def __init__(self, prog, args):
        self.prog = prog
        self.c = c = tp.load_config(args.config)
        self.steps = args.steps or c["max_steps"]
        if self.steps <= tp.WARMUP_STEPS:
            self.die(f"--steps/train.max_steps must exceed the {tp.WARMUP_STEPS} warm-up steps, "
                     f"got {self.steps}")
        for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            if var not in os.environ:
                self.die(f"${var} is not set: launch through torchrun (python -m "
                         "torch.distributed.run --standalone --nproc_per_node N "
                         f"{sys.argv[0]} ...)")
        self.torch, self.transformers = tp.import_torch(prog)
        import torch.distributed as dist
        self.dist = dist
        self.threads = args.threads
        self.torch.set_num_threads(args.threads)
        dist.init_process_group("gloo")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.T, self.B, self.accum = c["seq_len"], c["micro_batch"], c["grad_accum"]
        self.rows_per_step = self.B * self.accum * self.world
        self.base_rss = tp.current_rss_bytes()  # interpreter, torch and gloo, before the model
        self.data, self.windows = tp.load_corpus(c, prog)

    def die(self, msg):
        tp.die(msg, self.prog)

    def build_model(self):
        """The unwrapped model (identical on every rank: same seed), its parameter count, and
        the names of the parameters that take weight decay."""
        self.torch.manual_seed(self.c["seed"])
        model = tp.build_model(self.c, self.prog)
        self.params = sum(p.numel() for p in model.parameters())
        self.all_names = {n for n, _ in model.named_parameters()}
        self.decay_names = {n for n, p in model.named_parameters() if tp.decays(n, p.shape)}
        return model

    def log(self, msg):
        if self.rank == 0:
            print(f"{self.prog}: {msg}", file=sys.stderr, flush=True)

    def train(self, micro_step, finish_step):
        """The step loop. micro_step(x, y, a) runs forward and backward of micro-batch a and
        returns its mean loss (a float); finish_step(lr) clips and updates. Returns the step
        times (s) and this rank's losses."""
        step_s, losses = [], []
        for step in range(1, self.steps + 1):
            t0 = time.perf_counter()
            loss_sum = 0.0
            for a in range(self.accum):
                # shardlm's layout: rank r takes the r-th block of B x accum rows of every step.
                first = ((step - 1) * self.rows_per_step + self.rank * self.B * self.accum
                         + a * self.B)
                x, y = tp.batch_at(self.data, self.windows, self.T, first, self.B)  # [B, T] each
                loss_sum += micro_step(x, y, a)
            finish_step(tp.lr_at(self.c, step, self.steps))
            dt = time.perf_counter() - t0
            step_s.append(dt)
            losses.append(loss_sum / self.accum)  # this rank's rows only
            self.log(f"step {step}/{self.steps} | rank-0 loss {losses[-1]:.4f} | "
                     f"{dt * 1e3:.0f} ms")
        return step_s, losses

    def report(self, engine, strategy, stage, step_s, losses, extra=None):
        """Gathers every rank's median step time and peak RSS; rank 0 prints the JSON line."""
        timed = step_s[tp.WARMUP_STEPS:]
        mine = {"step_ms": statistics.median(timed) * 1e3, "peak_rss_bytes": tp.peak_rss_bytes(),
                "base_rss_bytes": self.base_rss, "final_loss": losses[-1]}
        every = [None] * self.world
        self.dist.all_gather_object(every, mine)
        if self.rank == 0:
            tokens_per_step = self.rows_per_step * self.T
            out = {
                "engine": engine,
                "strategy": strategy,
                "zero_stage": stage,
                "world_size": self.world,
                "threads_per_rank": self.threads,
                "torch": self.torch.__version__,
                "transformers": self.transformers.__version__,
                "params": self.params,
                "steps": self.steps,
                "timed_steps": len(timed),
                "global_sequences": self.rows_per_step,
                "tokens_per_step": tokens_per_step,
                "step_ms": mine["step_ms"],  # rank 0's median, as shardlm's metrics.jsonl
                "tokens_per_s": tokens_per_step / (mine["step_ms"] / 1e3),
                "step_ms_per_rank": [r["step_ms"] for r in every],
                "peak_rss_bytes_per_rank": [r["peak_rss_bytes"] for r in every],
                "base_rss_bytes_per_rank": [r["base_rss_bytes"] for r in every],
                "final_loss_per_rank": [r["final_loss"] for r in every],
                "flops_per_token": tp.train_flops_per_token(self.c["model"], self.T),
            }
            out.update(extra or {})
            print(json.dumps(out), flush=True)
        self.dist.barrier()
        self.dist.destroy_process_group()


def wrap_fsdp(torch, model, strategy):
    """The model under FSDP with ShardingStrategy `strategy` (no_shard, shard_grad_op,
    full_shard), every decoder layer its own unit (embedding, final norm and head in the root)."""
    import functools
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer
    return FSDP(
        model,
        sharding_strategy={"no_shard": ShardingStrategy.NO_SHARD,
                           "shard_grad_op": ShardingStrategy.SHARD_GRAD_OP,
                           "full_shard": ShardingStrategy.FULL_SHARD}[strategy],
        auto_wrap_policy=functools.partial(transformer_auto_wrap_policy,
                                           transformer_layer_cls={LlamaDecoderLayer}),
        device_id=torch.device("cpu"),
        use_orig_params=True)  # per-parameter weight-decay groups


def fsdp_param_groups(model, c, all_names, decay_names, die):
    """AdamW's groups for a wrap_fsdp() model, decided by the unwrapped model's parameter names
    (all_names, decay_names), since FSDP may prefix the names and flattens the shards."""
    named = [(n.replace("_fsdp_wrapped_module.", ""), p) for n, p in model.named_parameters()]
    unknown = [n for n, _ in named if n not in all_names]
    if unknown:
        die(f"FSDP parameter names {unknown[:3]} do not match the model's; the weight-decay "
            "groups would be wrong")
    return tp.param_groups(named, c, decay_names)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common_args(ap)
    ap.add_argument("--strategy", required=True, choices=sorted(STAGES))
    args = ap.parse_args()
    run = Run("fsdp_peer", args)
    torch, c, strategy = run.torch, run.c, args.strategy
    import torch.nn.functional as F
    model = run.build_model()

    if strategy in ("ddp", "zero1"):
        from torch.nn.parallel import DistributedDataParallel as DDP
        model = DDP(model)
        groups = tp.param_groups(model.module.named_parameters(), c, run.decay_names)
        if strategy == "ddp":
            opt = torch.optim.AdamW(groups, lr=c["lr"], betas=c["betas"], eps=c["eps"])
        else:
            from torch.distributed.optim import ZeroRedundancyOptimizer
            opt = ZeroRedundancyOptimizer(groups, optimizer_class=torch.optim.AdamW, lr=c["lr"],
                                          betas=c["betas"], eps=c["eps"])

        def clip(max_norm):  # gradients are identical on every rank after DDP's all-reduce
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    else:
        model = wrap_fsdp(torch, model, strategy)
        opt = torch.optim.AdamW(fsdp_param_groups(model, c, run.all_names, run.decay_names,
                                                  run.die),
                                lr=c["lr"], betas=c["betas"], eps=c["eps"])
        clip = model.clip_grad_norm_  # the norm over every rank's shards

    run.log(f"torch {torch.__version__}, transformers {run.transformers.__version__}, "
            f"{strategy} (~ZeRO stage {STAGES[strategy]}), {run.world} ranks x {run.threads} "
            f"thread(s), {run.params / 1e6:.2f}M parameters, {run.steps} steps of {run.world} x "
            f"{run.accum} x {run.B} x {run.T} tokens")

    def micro_step(x, y, a):
        if a == 0:
            opt.zero_grad(set_to_none=True)
        # DDP and NO_SHARD all-reduce on the last micro-batch only; the sharded strategies
        # reduce-scatter every micro-batch (FSDP's no_sync would keep whole gradients).
        sync = a == run.accum - 1 or strategy in ("shard_grad_op", "full_shard")
        with contextlib.nullcontext() if sync else model.no_sync():
            logits = model(input_ids=x).logits  # [B, T, V]
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
            (loss / run.accum).backward()
        return loss.item()

    def finish_step(lr):
        if c["grad_clip"] > 0:
            clip(c["grad_clip"])
        for g in opt.param_groups:
            g["lr"] = lr
        opt.step()

    step_s, losses = run.train(micro_step, finish_step)
    engine = "pytorch-ddp" if strategy in ("ddp", "zero1") else "pytorch-fsdp"
    run.report(engine, strategy, STAGES[strategy], step_s, losses)


if __name__ == "__main__":
    main()
