#!/usr/bin/env python3
"""The node's measured matrix rate, the denominator of every MFU in gpu-check.sh's report:
the median of timed n x n x n products (bf16 operands, f32 accumulation, PyTorch's cuBLAS) on
random data, after warm-up. One JSON line. Not a test.

Usage: gemm_rate.py [--n 8192] [--reps 20] [--device cuda|cpu]"""

import argparse

from gpu_common import Timer, emit, import_torch, median


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    args = ap.parse_args()
    torch = import_torch("gemm_rate", args.device)
    n, dev = args.n, args.device
    out = {"n": n, "device": dev}
    for name, dtype in (("bf16", torch.bfloat16), ("f32", torch.float32)):
        a = torch.randn(n, n, device=dev, dtype=dtype)
        b = torch.randn(n, n, device=dev, dtype=dtype)
        timer = Timer(torch, dev)
        for _ in range(3):
            a @ b
        times = []
        for _ in range(args.reps):
            t0 = timer.mark()
            a @ b
            times.append(timer.seconds(t0, timer.mark()))
        out[f"{name}_tflops"] = 2.0 * n**3 / median(times) / 1e12
    emit(out)


if __name__ == "__main__":
    main()
