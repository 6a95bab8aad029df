"""torch_reference.py with another number of layers.

Imports the shared PyTorch reference (`torch_reference.py`, from --reference
DIR), replaces the chosen workload's config builder by one that returns the
same config with `num_hidden_layers = --n-layer`, and runs its `main()` with
every other argument. Everything else (dtype, batch, sequence, loss, seed,
`--save`) is the workload's own, so

    python3 scripts/torch_reference_layers.py --n-layer 2 --workload w1 --save DIR --iters 1 --warmup 0

writes W1 with 2 layers in the format `stepgraph compare --reference DIR`
reads (its `config.json` says 2 layers). The shared script is not modified.
"""

import argparse
import importlib
import os
import sys


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], add_help=False)
    ap.add_argument("--n-layer", type=int, required=True, help="num_hidden_layers of the workload's model")
    ap.add_argument("--reference", default=".carry/bench",
                    help="folder holding torch_reference.py (default: .carry/bench)")
    ap.add_argument("--workload", help="passed on to torch_reference.py")
    ours, rest = ap.parse_known_args()
    if ours.n_layer < 1:
        ap.error(f"--n-layer must be at least 1, got {ours.n_layer}")
    script = os.path.join(ours.reference, "torch_reference.py")
    if not os.path.isfile(script):
        ap.error(f"no torch_reference.py in {ours.reference!r} (give its folder with --reference)")

    sys.path.insert(0, os.path.abspath(ours.reference))
    ref = importlib.import_module("torch_reference")
    if ours.workload is not None:
        if ours.workload not in ref.WORKLOADS:
            ap.error(f"unknown workload {ours.workload!r}; torch_reference.py has {sorted(ref.WORKLOADS)}")
        make_cfg, *spec = ref.WORKLOADS[ours.workload]
        ref.WORKLOADS[ours.workload] = (with_layers(make_cfg, ours.n_layer), *spec)
        rest = ["--workload", ours.workload] + rest
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


if __name__ == "__main__":
    main()
