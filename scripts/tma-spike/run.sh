#!/usr/bin/env bash
# On a Hopper GPU with nvcc: how the tensor copy engine fills 128-byte-
# swizzled shared memory and how wgmma reads it (see tma_spike.cu). Each
# case runs in a process of its own: one that faults ends its context.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
nvcc -O2 -std=c++17 -gencode=arch=compute_90a,code=sm_90a "$here/tma_spike.cu" -lcuda -o /tmp/tma-spike || exit 1
/tmp/tma-spike copy
/tmp/tma-spike k_k
for config in 0 1 2 3 4 5; do /tmp/tma-spike k_mn "$config"; done
