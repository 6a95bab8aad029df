#!/usr/bin/env python3
"""Checks each variant's outputs (o, lse, gq, gk, gv) against PyTorch's f32
attention on the same bf16 inputs, and against the first variant; times
PyTorch's own bf16 scaled_dot_product_attention (flash) on the same shapes.

    compare.py DIR B T Hq Hkv D VARIANT...
"""
import sys

import numpy as np
import torch

d, B, T, Hq, Hkv, D = sys.argv[1], *map(int, sys.argv[2:7])
names = sys.argv[7:]
dev = "cuda"


def bf16(path, shape):
    a = np.fromfile(path, dtype=np.uint16).astype(np.uint32) << 16
    return torch.from_numpy(a.view(np.float32).reshape(shape)).to(dev)


def f32(path, shape):
    return torch.from_numpy(np.fromfile(path, dtype=np.float32).reshape(shape)).to(dev)


qs, ks = (B, T, Hq, D), (B, T, Hkv, D)
q, k, v, go = bf16(f"{d}/q.bin", qs), bf16(f"{d}/k.bin", ks), bf16(f"{d}/v.bin", ks), bf16(f"{d}/go.bin", qs)
grp = Hq // Hkv
ref = {}
outs = {n: [] for n in ("o", "lse", "gq", "gk", "gv")}
for b in range(B):  # one batch row at a time: the f32 scores of W5 are 2 GB per row
    qb, kb, vb = (x[b : b + 1].transpose(1, 2).clone().requires_grad_() for x in (q, k, v))
    kx, vx = kb.repeat_interleave(grp, dim=1), vb.repeat_interleave(grp, dim=1)
    s = (qb @ kx.transpose(-1, -2)) / D**0.5
    s = s.masked_fill(torch.ones(T, T, dtype=torch.bool, device=dev).triu(1), float("-inf"))
    lse = torch.logsumexp(s, -1)
    o = torch.softmax(s, -1) @ vx
    o.backward(go[b : b + 1].transpose(1, 2))
    outs["o"].append(o.detach().transpose(1, 2))
    outs["lse"].append(lse.detach())
    outs["gq"].append(qb.grad.transpose(1, 2))
    outs["gk"].append(kb.grad.transpose(1, 2))
    outs["gv"].append(vb.grad.transpose(1, 2))
    del s, o, lse, kx, vx
ref = {n: torch.cat(v) for n, v in outs.items()}
shapes = {"o": qs, "lse": (B, Hq, T), "gq": qs, "gk": ks, "gv": ks}


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


first = None
for n in names:
    got = {x: (f32 if x == "lse" else bf16)(f"{d}/{n}/{x}.bin", shapes[x]) for x in shapes}
    bad = [x for x in got if not torch.isfinite(got[x]).all()]
    line = "  ".join(f"{x} {rel(got[x], ref[x]):.2e}" for x in shapes)
    if first is not None:
        line += "   vs " + names[0] + ": " + "  ".join(f"{x} {rel(got[x], first[x]):.1e}" for x in shapes)
    else:
        first = got
    print(f"  {n:8} rel to f32 ref: {line}" + (f"  NON-FINITE {bad}" if bad else ""))

# PyTorch's flash attention (bf16) on the same shapes.
qh, kh, vh = (x.to(torch.bfloat16).transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v))
goh = go.to(torch.bfloat16).transpose(1, 2).contiguous()


def sdpa():
    return torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=grp > 1)


def med(f, reps=20):
    ts = []
    for _ in range(3):
        f()
    for _ in range(reps):
        a, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        f()
        e.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(e))
    return sorted(ts)[len(ts) // 2]


tf = med(sdpa)
out = sdpa()
tfb = med(lambda: torch.autograd.grad(sdpa(), (qh, kh, vh), goh))
unit = 2.0 * B * Hq * T * (T + 1) / 2 * D
print(f"  torch sdpa bf16: fwd {tf:.3f} ms ({2 * unit / tf / 1e9:.0f} TFLOP/s)  bwd {tfb - tf:.3f} ms "
      f"({5 * unit / (tfb - tf) / 1e9:.0f} TFLOP/s)")
