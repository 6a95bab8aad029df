#!/usr/bin/env python3
"""Registers and spills of each attention variant (bf16, padded head sizes
DPS, default 112 and 128), from NVRTC's ptxas report: no GPU needed. With
CUBIN_DIR set, also writes each variant's CUBIN there (NAME-dDP.cubin),
compiled as stepgraph compiles it, for run.sh to time; ATTN_SRC picks
another source than the checkout's kernels/attention_mma.cu.

    regs.py NAME[:FLAGS]...     e.g. regs.py new: "x:-DSOME_KNOB=1"
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from nvrtc_cubin import KERNELS, compile_source, report  # noqa: E402

src = open(os.environ.get("ATTN_SRC", os.path.join(KERNELS, "attention_mma.cu"))).read()
for spec in sys.argv[1:]:
    name, _, flags = spec.partition(":")
    for dp in (int(d) for d in os.environ.get("DPS", "112,128").split(",")):
        head = "#define SGM_SFX bf16\n#define SGM_TYPE __nv_bfloat16\n#define SGM_DP %d\n" % dp
        out = os.environ.get("CUBIN_DIR")
        cubin = os.path.join(out, f"{name}-d{dp}.cubin") if out else None
        if out:
            os.makedirs(out, exist_ok=True)
        rc, log = compile_source(head + src, flags.split(), cubin)
        if rc != 0:
            sys.exit(f"{name} d{dp}: FAILED\n{log}")
        report(f"{name} d{dp}", log)
