#!/usr/bin/env bash
# On a Hopper GPU with nvcc: which shared-memory layouts and descriptor
# offsets wgmma reads as intended (see spike.cu). The CUBIN is built first,
# on any machine with the NVRTC wheel .ci/run installs:
#   python3 scripts/wgmma-spike/build.py   # writes scripts/wgmma-spike/spike.cubin
# (ignored by git: copy it along when running on another machine).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
nvcc -O2 -std=c++17 -arch=sm_90 "$here/harness.cu" -lcuda -o /tmp/wgmma-spike
for kernel in smem_k smem_mn regs_a; do
    for config in $(seq 0 15); do
        /tmp/wgmma-spike "$here/spike.cubin" "$kernel" "$config" || true
    done
done
