"""Gradients of two saved references, tensor by tensor.

    python3 scripts/compare_grads.py A B [--json PATH] [--top N] [--device cpu|cuda]

A and B are folders that `torch_reference.py --save` (or
`torch_reference_layers.py --save`) wrote. For every gradient in both
`grads.safetensors`, with a from A and b from B, in float64:

    rel     = |a - b|_2 / |b|_2
    rel_max = max|a - b| / max|b|

(the metric of `stepgraph compare`: 0 when both are zero, infinite when only
b is, NaN when a difference is). Prints the loss of both, whether the inputs
and the weights are the same, a table worst `rel` first (NaN first of all),
and one summary line; `--json PATH` writes all of it (NaN and infinity as
null). Typical use: PyTorch's bf16 reference against the float32 one on the
same weights (`--compute-dtype float32`), i.e. bf16 error against the exact
gradients. Exits 2 when a folder lacks a file or the two hold no gradient in
common, 0 otherwise.
"""

import argparse
import filecmp
import json
import math
import os
import statistics
import sys


def ratio(num, den):
    """num / den with the conventions of `stepgraph compare`."""
    if math.isnan(num) or math.isnan(den):
        return math.nan
    if den > 0:
        return num / den
    return 0.0 if num == 0 else math.inf


def diff(a, b, device):
    """rel, rel_max and the norms behind them of a against b, in float64."""
    import torch

    a = a.to(device=device, dtype=torch.float64).reshape(-1)
    b = b.to(device=device, dtype=torch.float64).reshape(-1)
    d = a - b
    diff_norm = torch.linalg.vector_norm(d).item()
    ref_norm = torch.linalg.vector_norm(b).item()
    norm = torch.linalg.vector_norm(a).item()
    # torch's max propagates NaN, as the metric wants; an empty tensor has 0.
    max_abs_diff = d.abs().max().item() if d.numel() else 0.0
    ref_max_abs = b.abs().max().item() if b.numel() else 0.0
    return {
        "rel": ratio(diff_norm, ref_norm),
        "rel_max": ratio(max_abs_diff, ref_max_abs),
        "norm_a": norm,
        "norm_b": ref_norm,
        "max_abs_diff": max_abs_diff,
        "max_abs_b": ref_max_abs,
    }


def sort_key(x):
    """Worst first: NaN above everything, then larger first."""
    return math.inf if math.isnan(x) else x


def dtype_name(t):
    return str(t.dtype).replace("torch.", "")


def weights_match(a_dir, b_dir, device):
    """How the two weights.safetensors relate: 'identical bytes', 'equal
    values' (same names, dtypes, shapes and values, other bytes), 'differ:
    ...', or None when either is missing."""
    import torch
    from safetensors import safe_open

    pa, pb = (os.path.join(d, "weights.safetensors") for d in (a_dir, b_dir))
    if not (os.path.isfile(pa) and os.path.isfile(pb)):
        return None
    if filecmp.cmp(pa, pb, shallow=False):
        return "identical bytes"
    with safe_open(pa, framework="pt", device="cpu") as fa, safe_open(pb, framework="pt", device="cpu") as fb:
        ka, kb = set(fa.keys()), set(fb.keys())
        if ka != kb:
            return f"differ: {len(ka - kb)} names only in A, {len(kb - ka)} only in B"
        bad = []
        for k in sorted(ka):
            x, y = fa.get_tensor(k), fb.get_tensor(k)
            if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(x.to(device), y.to(device)):
                bad.append(k)
    if bad:
        return f"differ: {len(bad)} of {len(ka)} tensors ({', '.join(bad[:3])}{', ...' if len(bad) > 3 else ''})"
    return "equal values"


def io_of(d):
    """(input_ids, loss as a float) of a reference folder, or (None, None)."""
    from safetensors.torch import load_file

    p = os.path.join(d, "io.safetensors")
    if not os.path.isfile(p):
        return None, None
    io = load_file(p)
    loss = io.get("loss")
    return io.get("input_ids"), (None if loss is None else float(loss.double().reshape(-1)[0]))


def finite_or_none(x):
    """JSON has no NaN or infinity: null, as `stepgraph compare` writes them."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: finite_or_none(v) for k, v in x.items()}
    if isinstance(x, list):
        return [finite_or_none(v) for v in x]
    return x


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog="rel = |a - b|_2 / |b|_2, rel_max = max|a - b| / max|b|, b from B")
    ap.add_argument("a", help="reference folder A (a: the values compared)")
    ap.add_argument("b", help="reference folder B (b: the values compared against)")
    ap.add_argument("--json", metavar="PATH", help="also write the report as JSON here")
    ap.add_argument("--top", type=int, default=0, help="print only the N worst rows of the table (default: all)")
    ap.add_argument("--device", choices=["cpu", "cuda"],
                    help="where to compute (default: cuda when available, else cpu)")
    args = ap.parse_args()

    import torch
    from safetensors import safe_open

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    paths = [os.path.join(d, "grads.safetensors") for d in (args.a, args.b)]
    for p in paths:
        if not os.path.isfile(p):
            print(f"compare_grads: no {p}", file=sys.stderr)
            return 2

    ids_a, loss_a = io_of(args.a)
    ids_b, loss_b = io_of(args.b)
    if ids_a is None or ids_b is None:
        same_inputs = None
    else:
        same_inputs = ids_a.shape == ids_b.shape and bool(torch.equal(ids_a, ids_b))
    loss = None
    if loss_a is not None and loss_b is not None:
        loss = {"a": loss_a, "b": loss_b, "rel": ratio(abs(loss_a - loss_b), abs(loss_b))}
    weights = weights_match(args.a, args.b, device)

    rows = []
    with safe_open(paths[0], framework="pt", device="cpu") as fa, \
            safe_open(paths[1], framework="pt", device="cpu") as fb:
        ka, kb = set(fa.keys()), set(fb.keys())
        only_a, only_b = sorted(ka - kb), sorted(kb - ka)
        for name in sorted(ka & kb):
            x, y = fa.get_tensor(name), fb.get_tensor(name)
            if x.shape != y.shape:
                print(f"compare_grads: {name} has shape {list(x.shape)} in A and {list(y.shape)} in B",
                      file=sys.stderr)
                return 2
            row = {"name": name, "shape": list(y.shape), "dtype_a": dtype_name(x), "dtype_b": dtype_name(y)}
            row.update(diff(x, y, device))
            rows.append(row)
    if not rows:
        print(f"compare_grads: {args.a} and {args.b} have no gradient in common", file=sys.stderr)
        return 2
    rows.sort(key=lambda r: (-sort_key(r["rel"]), r["name"]))
    worst = rows[0]
    worst_max = max(rows, key=lambda r: sort_key(r["rel_max"]))
    rels = [r["rel"] for r in rows]
    median = statistics.median(rels) if not any(math.isnan(x) for x in rels) else math.nan

    print(f"A: {args.a}")
    print(f"B: {args.b}")
    print("metric: per tensor, a from A, b from B, in float64: rel = |a - b|_2 / |b|_2, "
          "rel_max = max|a - b| / max|b|")
    print(f"input_ids: {'same' if same_inputs else 'DIFFERENT' if same_inputs is not None else 'not in both'}; "
          f"weights.safetensors: {weights or 'not in both'}")
    if loss is not None:
        print(f"loss: A {loss['a']:.9g}, B {loss['b']:.9g}, rel {loss['rel']:.3e}")
    dtypes = sorted({(r["dtype_a"], r["dtype_b"]) for r in rows})
    print("gradient dtypes (A, B): " + ", ".join(f"{x}/{y}" for x, y in dtypes))
    width = max(len(r["name"]) for r in rows)
    shown = rows[:args.top] if args.top > 0 else rows
    print(f"{'tensor':<{width}}  {'shape':<16} {'rel':>10} {'rel_max':>10} {'|b|_2':>10} {'max|a-b|':>10}")
    for r in shown:
        print(f"{r['name']:<{width}}  {str(r['shape']):<16} {r['rel']:>10.3e} {r['rel_max']:>10.3e} "
              f"{r['norm_b']:>10.3e} {r['max_abs_diff']:>10.3e}")
    if len(shown) < len(rows):
        print(f"... {len(rows) - len(shown)} more")
    for label, names in (("only in A", only_a), ("only in B", only_b)):
        if names:
            print(f"{label}: {len(names)} ({', '.join(names[:5])}{', ...' if len(names) > 5 else ''})")
    summary = (f"summary: {len(rows)} gradients, max rel {worst['rel']:.3e} ({worst['name']}), "
               f"median rel {median:.3e}, max rel_max {worst_max['rel_max']:.3e} ({worst_max['name']})"
               + (f", loss rel {loss['rel']:.3e}" if loss is not None else ""))
    print(summary)

    if args.json:
        report = {
            "a": args.a, "b": args.b,
            "metric": "per tensor, a from A, b from B, in float64: rel = |a - b|_2 / |b|_2, "
                      "rel_max = max|a - b| / max|b|",
            "same_input_ids": same_inputs, "weights": weights, "loss": loss,
            "max_rel": worst["rel"], "worst": worst["name"], "median_rel": median,
            "max_rel_max": worst_max["rel_max"], "worst_rel_max": worst_max["name"],
            "grads": rows, "only_in_a": only_a, "only_in_b": only_b, "summary": summary,
        }
        with open(args.json, "w") as f:
            json.dump(finite_or_none(report), f, indent=2)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
