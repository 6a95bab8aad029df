#!/usr/bin/env python3
"""Builds spike.cu for sm_90a with NVRTC into spike.cubin next to it."""
import os
import sys

here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(here, ".."))
import nvrtc_cubin as n  # noqa: E402

# spike.cu needs no common.cuh, but compile_source prepends it harmlessly.
rc, log = n.compile_source(open(os.path.join(here, "spike.cu")).read(), ["--gpu-architecture=sm_90a"],
                           os.path.join(here, "spike.cubin"))
if rc != 0:
    sys.exit(log)
n.report("spike", log)
