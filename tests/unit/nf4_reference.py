"""NF4 reference for test_nf4: bitsandbytes' own quantize_4bit / dequantize_4bit (CPU path) on
seeded tensors, written as raw little-endian arrays into the directory given, with cases.json
listing them. Per case: x.f32 (the input, as f32), codes.u8 and absmax.f32 (blocksize 64, no
double quantization), deq.f32 (dequantize_4bit of those), and with double quantization
nested_codes.u8, nested_absmax2.f32, nested_offset.f32, nested_deq.f32; dynamic_code.f32 is
create_dynamic_map(signed=True)."""
import json
import os
import sys

# bitsandbytes wraps its generic dequantizer in torch.compile; eager gives the same values
# without a minute of compiling.
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import numpy as np
import torch
import bitsandbytes.functional as F


def cases():
    g = torch.Generator().manual_seed(26)
    yield "randn_1000", torch.randn(1000, generator=g)
    yield "odd_999", torch.randn(999, generator=g) * 3
    z = torch.randn(64 * 40, generator=g)
    z[128:192] = 0  # a block of zeros
    z[5] = 1e-30  # a tiny value beside large ones
    yield "zero_block", z
    # Midpoints and code values exactly: scaled values on the boundaries of the buckets.
    code = F.get_4bit_type("nf4", device="cpu")
    mids = (code[:-1] + code[1:]) / 2
    yield "on_midpoints", torch.cat([torch.tensor([1.0]), mids, code, -mids]).repeat(8)
    # Real-shaped: Llama-3.1-8B's k_proj [1024, 4096] as bf16 weights (std 0.02), heavy tails.
    w = (torch.randn(1024, 4096, generator=g) * 0.02).to(torch.bfloat16)
    w[0, :7] = torch.tensor([0.5, -0.7, 0.3, 0.0, -0.0, 1e-3, -2.0]).to(torch.bfloat16)
    yield "kproj_bf16", w
    yield "gate_f32", torch.randn(1376, 512, generator=g) * 0.05


def write(path, t):
    t.detach().contiguous().cpu().numpy().tofile(path)


def main(out):
    listed = []
    for name, x in cases():
        d = os.path.join(out, name)
        os.makedirs(d, exist_ok=True)
        write(os.path.join(d, "x.f32"), x.float())
        q, st = F.quantize_4bit(x, blocksize=64, quant_type="nf4", compress_statistics=False)
        write(os.path.join(d, "codes.u8"), q.view(torch.uint8).reshape(-1))
        write(os.path.join(d, "absmax.f32"), st.absmax.float())
        st.dtype = torch.float32
        write(os.path.join(d, "deq.f32"), F.dequantize_4bit(q, st).reshape(-1))
        qn, sn = F.quantize_4bit(x, blocksize=64, quant_type="nf4", compress_statistics=True)
        assert torch.equal(qn, q)
        write(os.path.join(d, "nested_codes.u8"), sn.absmax.reshape(-1))
        write(os.path.join(d, "nested_absmax2.f32"), sn.state2.absmax.float())
        write(os.path.join(d, "nested_offset.f32"), sn.offset.float().reshape(1))
        sn.dtype = torch.float32
        write(os.path.join(d, "nested_deq.f32"), F.dequantize_4bit(qn, sn).reshape(-1))
        listed.append({"name": name, "n": x.numel()})
    write(os.path.join(out, "dynamic_code.f32"), F.create_dynamic_map(signed=True).float())
    with open(os.path.join(out, "cases.json"), "w") as f:
        json.dump(listed, f)


if __name__ == "__main__":
    main(sys.argv[1])
