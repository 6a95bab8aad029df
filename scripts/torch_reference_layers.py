"""torch_reference.py with another number of layers, or one step in float32.

Imports the PyTorch reference `scripts/torch_reference.py` (or the one in
--reference DIR), replaces the chosen workload's config builder by one that returns the
same config with `num_hidden_layers = --n-layer`, and runs its `main()` with
every other argument. Everything else (dtype, batch, sequence, loss, seed,
`--save`) is the workload's own, so

    python3 scripts/torch_reference_layers.py --n-layer 2 --workload w1 --save DIR --iters 1 --warmup 0

writes W1 with 2 layers in the format `stepgraph compare --reference DIR`
reads (its `config.json` says 2 layers). torch_reference.py itself is not
modified.

`--compute-dtype float32` on a bf16 or f16 workload writes a reference of the
exact gradients of the workload's own weights instead:

    python3 scripts/torch_reference_layers.py --workload w2 --compute-dtype float32 --save DIR

The model is built by `torch_reference.build` with the workload's seed,
config, input and loss, its weights initialised as there and rounded to the
workload's dtype (the same values the workload's own reference holds), and
held in float32 (every bf16 or f16 value is exact in float32); the step's
forward and backward then run in float32 (SDPA in float32, no TF32).
Buffers outside the state dict (RoPE's `inv_freq`) are computed in float32
and not rounded. `--save DIR` writes `weights.safetensors` in the workload's
dtype (byte for byte the file the workload's own `--save` writes, so
`stepgraph compare` loads the same weights and runs in that dtype),
`io.safetensors` (`input_ids`, and the float32 `loss`), `grads.safetensors` in
float32 and `config.json`. This mode runs no timed steps (`--iters` and
`--warmup` are accepted and ignored) and needs `--save`. Without
`--compute-dtype`, or with the workload's own dtype, nothing changes.
"""

import argparse
import importlib
import json
import os
import sys

# --compute-dtype names, as torch spells its dtypes.
COMPUTE_DTYPES = ("float32", "bfloat16", "float16")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], add_help=False)
    ap.add_argument("--n-layer", type=int,
                    help="num_hidden_layers of the workload's model (default: the workload's own)")
    ap.add_argument("--reference", default=os.path.dirname(os.path.abspath(__file__)),
                    help="folder holding torch_reference.py (default: this script's folder)")
    ap.add_argument("--workload", help="passed on to torch_reference.py")
    ap.add_argument("--compute-dtype", choices=COMPUTE_DTYPES,
                    help="dtype of the saved step's forward and backward (default: the workload's); "
                         "float32 on a bf16/f16 workload saves the exact gradients of its weights")
    ours, rest = ap.parse_known_args()
    if ours.n_layer is not None and ours.n_layer < 1:
        ap.error(f"--n-layer must be at least 1, got {ours.n_layer}")
    script = os.path.join(ours.reference, "torch_reference.py")
    if not os.path.isfile(script):
        ap.error(f"no torch_reference.py in {ours.reference!r} (give its folder with --reference)")

    sys.path.insert(0, os.path.abspath(ours.reference))
    ref = importlib.import_module("torch_reference")
    if ours.workload is not None:
        if ours.workload not in ref.WORKLOADS:
            ap.error(f"unknown workload {ours.workload!r}; torch_reference.py has {sorted(ref.WORKLOADS)}")
        if ours.n_layer is not None:
            make_cfg, *spec = ref.WORKLOADS[ours.workload]
            ref.WORKLOADS[ours.workload] = (with_layers(make_cfg, ours.n_layer), *spec)
        rest = ["--workload", ours.workload] + rest

    if ours.compute_dtype is not None:
        if ours.workload is None:
            ap.error("--compute-dtype needs --workload")
        import torch

        compute = getattr(torch, ours.compute_dtype)
        own = ref.WORKLOADS[ours.workload][1]
        if compute != own:
            if compute != torch.float32:
                ap.error(f"--compute-dtype {ours.compute_dtype} on {ours.workload} ({own}): only float32 "
                         "(or the workload's own dtype) is supported")
            save_upcast(ref, ours.workload, rest)
            return
    # torch_reference.main() parses sys.argv itself (and reports a missing --workload).
    sys.argv = [script] + rest
    ref.main()


def with_layers(make_cfg, n_layer):
    """`make_cfg` whose config has `n_layer` hidden layers."""

    def make():
        cfg = make_cfg()
        cfg.num_hidden_layers = n_layer
        # transformers keeps a per-layer list next to the count in some
        # configs (Qwen2's `layer_types`, full or sliding attention); it
        # must have one entry per layer.
        layer_types = getattr(cfg, "layer_types", None)
        if isinstance(layer_types, list) and layer_types:
            cfg.layer_types = (layer_types + [layer_types[-1]] * n_layer)[:n_layer]
        return cfg

    return make


def save_upcast(ref, workload, argv):
    """`torch_reference.py --save` for `workload` with the step in float32 on
    the workload's weights (see the module doc)."""
    import torch
    from safetensors.torch import save_file

    ap = argparse.ArgumentParser(
        prog=f"{os.path.basename(sys.argv[0])} --compute-dtype float32",
        description="saves one float32 step on the workload's weights")
    ap.add_argument("--workload", required=True)
    ap.add_argument("--save", required=True, help="write weights, input, loss and grads of the step here")
    ap.add_argument("--mode", default="eager", choices=["eager"])
    ap.add_argument("--warmup", type=int, default=0, help="accepted and ignored (no timed steps)")
    ap.add_argument("--iters", type=int, default=0, help="accepted and ignored (no timed steps)")
    args = ap.parse_args(argv)

    compute = torch.float32
    make_cfg, dtype, *spec = ref.WORKLOADS[workload]
    # torch_reference.build with the workload's dtype replaced by float32: the
    # same config, seed, initialisation (build initialises, then casts with
    # `.to(dtype)`, which is a no-op here) and input.
    ref.WORKLOADS[workload] = (make_cfg, compute, *spec)
    try:
        model, ids, step = ref.build(workload)
    finally:
        ref.WORKLOADS[workload] = (make_cfg, dtype, *spec)
    # The products in full float32 (PyTorch's default; said here so nothing
    # set elsewhere turns TF32 on).
    torch.set_float32_matmul_precision("highest")

    # The workload's cast: every floating tensor of the state dict rounded to
    # `dtype` exactly as `model.to(dtype)` rounds it, kept in float32 for the
    # step and saved in `dtype`. state_dict() shares storage with the
    # parameters, so `copy_` rounds the model itself.
    weights = {}
    with torch.no_grad():
        for name, value in model.state_dict().items():
            if value.is_floating_point():
                narrow = value.to(dtype)
                value.copy_(narrow)
                weights[name] = narrow.contiguous()
            else:
                weights[name] = value.contiguous()
        for name, p in model.named_parameters():
            if p.dtype != compute or not torch.equal(p, p.to(dtype).to(compute)):
                raise SystemExit(f"parameter {name} is not a {dtype} value held in {compute}")

    os.makedirs(args.save, exist_ok=True)
    save_file(weights, os.path.join(args.save, "weights.safetensors"))
    del weights
    loss = step(model)
    grads = {}
    for name, p in model.named_parameters():
        if p.grad is None:
            raise SystemExit(f"the step left no gradient for {name}")
        if p.grad.dtype != compute:
            raise SystemExit(f"the gradient of {name} is {p.grad.dtype}, not {compute}")
        grads[name] = p.grad.contiguous()
    loss = loss.detach().to(compute).reshape(1)
    save_file({"input_ids": ids, "loss": loss}, os.path.join(args.save, "io.safetensors"))
    save_file(grads, os.path.join(args.save, "grads.safetensors"))
    model.config.to_json_file(os.path.join(args.save, "config.json"))
    res = {"workload": workload, "mode": "save", "compute_dtype": str(compute).replace("torch.", ""),
           "weights_dtype": str(dtype).replace("torch.", ""), "torch": torch.__version__,
           "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
           "params": sum(p.numel() for p in model.parameters()), "loss": loss.item(), "save": args.save}
    print("RESULT " + json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
