"""stepgraph's tuned cuBLASLt products against PyTorch's on the same shapes.

Reads the tuning report that `stepgraph bench --profile` (or `generate
--profile`) prints to stderr, one line per product shape:

    gemm_bf16_8192x3200x8640_tb   52x  candidate 3/8  1.234 ms (heuristic's first 1.301 ms)

and times each shape with PyTorch (`torch.matmul`, `addmm_` for an addend,
`addmm` for a bias: cuBLAS's own heuristics, the kernels PyTorch's step runs),
CUDA events around each run, the median of --runs after --warmup. Prints one
JSON line per shape and a table sorted by what the shape costs per step over
PyTorch (calls × (ours − PyTorch)), so a product class where cuBLASLt's tuned
choice loses to cuBLAS shows at the top.

    stepgraph bench --workload w5 --mode eager --profile 2> w5-profile.txt
    python3 scripts/torch_gemm_shapes.py w5-profile.txt [--json out.jsonl]

Shape names (crates/cuda/src/blas/mod.rs, `shape_name`): row-major
C[m, n] = op(A)[m, k] · op(B)[k, n]; `_ta`: A stored [k, m]; `_tb`: B stored
[n, k]; `_b<batch>`: that many products, each its own operands; `_acc`: C is
added to (beta = 1); `_bias`: a row vector of n is added.
"""

import argparse
import json
import re
import sys

# A shape line of the report (crates/cli/src/profile.rs, `tuning_lines`);
# parse_shape reads the name.
LINE = re.compile(r"^\s*(gemm_\S+)\s+(?P<calls>\d+)x\s+candidate \d+/\d+(?:, split-k \d+|, cuBLAS)?\s+(?P<ms>[0-9.]+|-) ms")


def parse_shape(name):
    """(dtype, m, n, k, ta, tb, batch, addend) of a shape name, or None."""
    m = re.match(r"^gemm_(f32|bf16|f16)_(\d+)x(\d+)x(\d+)((?:_ta)?)((?:_tb)?)((?:_b\d+)?)((?:_acc|_bias)?)$", name)
    if not m:
        return None
    dt, mm, nn, kk, ta, tb, batch, addend = m.groups()
    return dt, int(mm), int(nn), int(kk), bool(ta), bool(tb), int(batch[2:]) if batch else 1, addend[1:] or None


def parse_report(text):
    """[(name, calls, ours_ms)] from a tuning report (ours_ms None when untimed)."""
    rows = []
    for line in text.splitlines():
        m = LINE.match(line)
        if m:
            ms = None if m.group("ms") == "-" else float(m.group("ms"))
            rows.append((m.group(1), int(m.group("calls")), ms))
    return rows


def time_shape(torch, shape, warmup, runs):
    """Median milliseconds of PyTorch's product of `shape`."""
    dt, m, n, k, ta, tb, batch, addend = shape
    dtype = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}[dt]
    dev = "cuda"
    lead = (batch,) if batch > 1 else ()

    def operand(rows, cols, transposed):
        x = torch.randn(*lead, cols, rows, device=dev, dtype=dtype) if transposed else torch.randn(
            *lead, rows, cols, device=dev, dtype=dtype)
        return x.transpose(-1, -2) if transposed else x

    a, b = operand(m, k, ta), operand(k, n, tb)
    c = torch.randn(*lead, m, n, device=dev, dtype=dtype)
    bias = torch.randn(n, device=dev, dtype=dtype)
    if addend == "acc":
        run = (lambda: c.baddbmm_(a, b)) if batch > 1 else (lambda: c.addmm_(a, b))
    elif addend == "bias":
        run = (lambda: torch.baddbmm(bias, a, b, out=c)) if batch > 1 else (lambda: torch.addmm(bias, a, b, out=c))
    else:
        run = lambda: torch.matmul(a, b, out=c)
    for _ in range(warmup):
        run()
    times = []
    for _ in range(runs):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        run()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    times.sort()
    return times[len(times) // 2]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("report", help="stderr of `stepgraph bench|generate --profile`")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--json", help="also write the rows here, one JSON object per line")
    args = ap.parse_args()
    rows = parse_report(open(args.report).read())
    if not rows:
        sys.exit(f"no tuning report lines in {args.report} (run stepgraph with --profile)")
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    out = []
    for name, calls, ours in rows:
        shape = parse_shape(name)
        if shape is None:
            print(f"skipped {name}: not a shape name", file=sys.stderr)
            continue
        theirs = time_shape(torch, shape, args.warmup, args.runs)
        over = None if ours is None else calls * (ours - theirs)
        out.append({"shape": name, "calls": calls, "stepgraph_ms": ours, "torch_ms": theirs, "over_ms_per_step": over})
        print("RESULT " + json.dumps(out[-1]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            for r in out:
                f.write(json.dumps(r) + "\n")
    out.sort(key=lambda r: -(r["over_ms_per_step"] or 0.0))
    print(f"{'shape':<44} {'calls':>5} {'stepgraph ms':>12} {'torch ms':>9} {'over/step ms':>12}")
    for r in out:
        ours = "-" if r["stepgraph_ms"] is None else f"{r['stepgraph_ms']:.3f}"
        over = "-" if r["over_ms_per_step"] is None else f"{r['over_ms_per_step']:.2f}"
        print(f"{r['shape']:<44} {r['calls']:>5} {ours:>12} {r['torch_ms']:>9.3f} {over:>12}")
    total = sum(r["over_ms_per_step"] or 0.0 for r in out)
    print(f"stepgraph's products over PyTorch's, per step: {total:.2f} ms")


if __name__ == "__main__":
    main()
