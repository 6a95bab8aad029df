"""Where PyTorch's step time goes, for comparing against `stepgraph bench --profile`.

Builds a workload of scripts/torch_reference.py (next to this script, or the
one in --reference DIR), runs warm-up steps, then profiles one step with
torch.profiler and prints the CUDA kernels grouped by a short category and by
name, with total milliseconds and call counts (`--json` writes them too).

    python3 scripts/torch_profile.py --workload w1 [--reference DIR] [--json out.json]
"""

import argparse
import json
import os
import sys


def category(name):
    """The kernel class, named as `stepgraph bench --profile` names its own
    (crates/cli/src/profile.rs), so the two tables line up row for row."""
    n = name.lower()
    # Attention first: flash kernels name their cutlass templates, which
    # would otherwise read as products.
    if "flash" in n or "fmha" in n or "attention" in n or "mem_eff" in n or "sdpa" in n:
        backward = "bwd" in n or "backward" in n or "fmha_cutlassb" in n or "dq_dk_dv" in n or "dot_do_o" in n or "convert_dq" in n
        return "attention backward" if backward else "attention forward"
    if "gemm" in n or "cutlass" in n or "sm90_xmma" in n or "cublas" in n or "ampere_" in n or "sm80_" in n or "nvjet" in n:
        return "products"
    if "adam" in n or "multi_tensor_apply" in n:
        return "optimizer"
    if "nll_loss" in n or "log_softmax" in n or "cross_entropy" in n or "softmax_warp" in n:
        return "loss"
    if "elementwise" in n or "reduce" in n or "norm" in n or "triton" in n or "cat" in n or "copy" in n:
        return "pointwise and row-wise"
    return "other"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", required=True)
    ap.add_argument("--reference", default=os.path.dirname(os.path.abspath(__file__)),
                    help="folder holding torch_reference.py (default: this script's folder)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--json")
    args = ap.parse_args()
    sys.path.insert(0, os.path.abspath(args.reference))
    import torch
    import torch_reference as ref

    model, _ids, step = ref.build(args.workload)
    for _ in range(args.warmup):
        model.zero_grad(set_to_none=True)
        step(model)
    torch.cuda.synchronize()
    model.zero_grad(set_to_none=True)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step(model)
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None)
        if t is None:
            t = e.cuda_time_total
        if t > 0 and e.count > 0:
            rows.append({"name": e.key, "ms": t / 1e3, "calls": e.count, "category": category(e.key)})
    # Only kernels: profiler also lists the CPU-side ops that launched them.
    kernels = [r for r in rows if not r["name"].startswith("aten::") and not r["name"].startswith("autograd")]
    kernels.sort(key=lambda r: -r["ms"])
    cats = {}
    for r in kernels:
        c = cats.setdefault(r["category"], [0.0, 0])
        c[0] += r["ms"]
        c[1] += r["calls"]
    total = sum(r["ms"] for r in kernels)
    print(f"torch {args.workload}: {total:.1f} ms of kernels in one step")
    for c, (ms, n) in sorted(cats.items(), key=lambda kv: -kv[1][0]):
        print(f"  {c:24s} {ms:9.2f} ms  {n:5d} launches")
    for r in kernels[: args.top]:
        print(f"  {r['ms']:9.2f} ms {r['calls']:5d}x  {r['name'][:140]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"workload": args.workload, "total_ms": total, "categories": cats, "kernels": kernels}, f)


if __name__ == "__main__":
    main()
