#!/usr/bin/env bash
# Times builds of the tensor-core attention kernels against each other and
# against PyTorch's attention, on a CUDA machine with nvcc and PyTorch:
#
#   # first (on any machine with the NVRTC wheel .ci/run installs): a CUBIN
#   # per build and padded head size, e.g. the last commit's kernels against
#   # the working tree's, plus their register reports
#   git show HEAD:crates/cuda/kernels/attention_mma.cu > /tmp/old.cu
#   ATTN_SRC=/tmp/old.cu CUBIN_DIR=scripts/attention-variants/cubins python3 scripts/attention-variants/regs.py old:
#   CUBIN_DIR=scripts/attention-variants/cubins python3 scripts/attention-variants/regs.py new: "x:-DSOME_KNOB=1"
#   # then on the GPU machine, with scripts/attention-variants/cubins/
#   # copied there if the CUBINs were built elsewhere (the folder is ignored by git):
#   VARIANTS="old:new
#   new:new" bash scripts/attention-variants/run.sh
#
# (ABI `new` launches with this checkout's geometry; see harness.cu.)
#
# harness.cu times each build on each shape (SHAPES) with events and writes
# its outputs; compare.py checks them against PyTorch's f32 attention on the
# same inputs and against the first build, and times PyTorch's own bf16
# attention on the shapes. Results: $RESULTS/attention-variants.txt
# (default folder scripts/attention-variants/out).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
RESULTS=${RESULTS:-$here/out}
work=$(mktemp -d)
mkdir -p "$RESULTS"
# NAME:ABI: the CUBIN cubins/NAME-dDP.cubin, which regs.py wrote on the
# build machine (NVRTC, exactly as stepgraph compiles), launched with the
# geometry of ABI (see harness.cu).
VARIANTS=${VARIANTS:-"base:base
new:new"}
# B T Hq Hkv D
SHAPES=${SHAPES:-"4 2048 32 32 100
1 4096 32 8 128"}
log=$RESULTS/attention-variants.txt
: >"$log"
nvcc -O3 -std=c++17 -arch=sm_90 "$here/harness.cu" -lcuda -o "$work/harness"
while read -r B T Hq Hkv D; do
    dp=$(( (D + 15) / 16 * 16 ))
    shape="b${B}_t${T}_h${Hq}_kv${Hkv}_d${D}"
    first=1
    while IFS=: read -r name abi; do
        d=$work/$shape/$name
        mkdir -p "$d"
        if [ $first = 1 ]; then export WRITE_INPUTS=1; else unset WRITE_INPUTS; fi
        c=$here/cubins/$name-d$dp.cubin
        echo "$shape $name: $("$work/harness" "$c" "$abi" "$d" "$B" "$T" "$Hq" "$Hkv" "$D" 20 2>&1)" | tee -a "$log"
        if [ $first = 1 ]; then mv "$d"/{q,k,v,go}.bin "$work/$shape/"; first=0; fi
    done <<<"$VARIANTS"
    python3 "$here/compare.py" "$work/$shape" "$B" "$T" "$Hq" "$Hkv" "$D" $(echo "$VARIANTS" | cut -d: -f1) 2>&1 | tee -a "$log"
done <<<"$SHAPES"
rm -rf "$work"
