"""Helpers shared by the GPU peers of scripts/gpu-check.sh: a clear failure when torch is not
usable, a timer that uses CUDA events on a GPU (host clock on the CPU, where the peers' smoke
test runs them), medians, one JSON line out. Not a test."""

import json
import statistics
import sys
import time


def die(prog, msg):
    print(f"{prog}: {msg}", file=sys.stderr)
    sys.exit(2)


def import_torch(prog, device):
    """torch, checked usable on `device` (cuda: a GPU must be visible)."""
    try:
        import torch
    except ImportError as e:
        die(prog, f"PyTorch is not importable ({e}); set PYTHON to an interpreter that has it")
    if device == "cuda" and not torch.cuda.is_available():
        die(prog, f"torch {torch.__version__} sees no CUDA device")
    return torch


class Timer:
    """Seconds between start() and stop() of device work: CUDA events on a GPU (no host
    synchronisation inside the timed region), the host clock after the work on the CPU."""

    def __init__(self, torch, device):
        self.torch, self.cuda = torch, device == "cuda"

    def mark(self):
        if self.cuda:
            e = self.torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def seconds(self, a, b):
        if self.cuda:
            b.synchronize()
            return a.elapsed_time(b) / 1e3
        return b - a


def median(values):
    return statistics.median(values) if values else float("nan")


def emit(obj):
    print(json.dumps(obj), flush=True)


def is_oom(torch, err):
    """A device (or, on the CPU, host) allocation failure, as opposed to a bug."""
    oom = getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError
    return isinstance(err, oom) or "out of memory" in str(err).lower()
