#!/usr/bin/env bash
# GPU tests and benchmarks, in two halves because the GPU machine has no Rust:
#
#   scripts/gpu-test.sh build        # here: release CLI + CUDA test binaries + torch_reference.py into .carry/
#   scripts/gpu-test.sh test [NAME...] # on the GPU machine: every GPU test binary (or those named, e.g. gpu_dist)
#   scripts/gpu-test.sh bench [W...] # on the GPU machine: stepgraph bench + the PyTorch reference, same call
#                                    # (BENCH_FLAGS: flags for every `stepgraph bench`, e.g. "--f32-products 3xtf32")
#   scripts/gpu-test.sh bench-ab [W...] # on the GPU machine: the baseline binary and this one, interleaved, + PyTorch
#   scripts/gpu-compare.sh [CASE...] # on the GPU machine: loss and gradients against PyTorch (see that script)
#
# With the `device` tool: build here, then run with carry [".carry"], e.g.
#   run(command="bash scripts/gpu-test.sh test && bash scripts/gpu-test.sh bench", carry=[".carry"])
# Logs and JSON go to $OUT (or ./gpu-out when $OUT is unset).
#
# `build` also compiles every kernel module for sm_90 with NVRTC (the wheel
# .ci/run installs) into a kernel cache, so the GPU machine loads CUBINs
# instead of compiling them (a minute of device time), and packs binaries and
# cache into .carry/pack.tar.xz (the carry is limited to 64 MiB); `test`,
# `bench` and scripts/gpu-compare.sh unpack it (`carry_unpack` in scripts/carry-env.sh,
# which a custom device script can source too) before use.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"

# shellcheck source=scripts/carry-env.sh
source scripts/carry-env.sh

case "${1:-}" in
unpack)
    carry_unpack
    ;;
build)
    rm -rf .carry && mkdir -p .carry/tests .carry/bench
    cargo build --release -p stepgraph
    cp target/release/stepgraph .carry/
    cargo test --release -p stepgraph-cuda --no-run --message-format=json 2>/dev/null |
        python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] == ["test"]:
        print(m["target"]["name"], m["executable"])' |
        while read -r name exe; do cp "$exe" ".carry/tests/$name"; done
    cp ../shared/bench/torch_reference.py ../shared/bench/torch_generate.py scripts/torch_profile.py .carry/bench/
    nvrtc=${NVRTC_DIR:-${HOME:-/tmp}/.cache/stepgraph/nvrtc-13.0}/nvidia/cu13
    if [ -e "$nvrtc/lib/libnvrtc.so.13" ]; then
        LD_LIBRARY_PATH="$nvrtc/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" CUDA_INCLUDE="$nvrtc/include" \
            STEPGRAPH_KERNEL_CACHE=$PWD/.carry/kcache cargo run --release -q -p stepgraph-cuda --example compile_kernels
    else
        echo "NVRTC not found under $nvrtc (run .ci/run once): kernels will compile on the GPU machine" >&2
    fi
    # A baseline to compare against (bench-ab): BASELINE=DIR names a checkout
    # whose `cargo build --release -p stepgraph` and `cargo build --release
    # -p stepgraph-cuda --examples` are done (the second alone builds no CLI)
    # in its own target directory: a target shared with this checkout hands
    # one tree's artifacts to the other. Its CLI is packed as stepgraph-base
    # and its kernels join the cache (keyed by source hash, so both versions
    # live side by side).
    base=()
    if [ -n "${BASELINE:-}" ]; then
        cp "$BASELINE/target/release/stepgraph" .carry/stepgraph-base
        base=(stepgraph-base)
        if [ -e "$nvrtc/lib/libnvrtc.so.13" ]; then
            LD_LIBRARY_PATH="$nvrtc/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" CUDA_INCLUDE="$nvrtc/include" \
                STEPGRAPH_KERNEL_CACHE=$PWD/.carry/kcache "$BASELINE/target/release/examples/compile_kernels"
        fi
    fi
    (cd .carry && tar -cJf pack.tar.xz stepgraph "${base[@]}" tests $([ -d kcache ] && echo kcache) && rm -rf stepgraph "${base[@]}" tests kcache)
    ls -la .carry
    du -sh .carry
    ;;
test)
    carry_unpack
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
    shift
    status=0
    tests=()
    if [ $# -gt 0 ]; then
        for n in "$@"; do tests+=(".carry/tests/$n"); done
    else
        tests=(.carry/tests/*)
    fi
    for t in "${tests[@]}"; do
        echo "== $(basename "$t")"
        "$t" --ignored --test-threads=1 2>&1 | tee "$OUT/test-$(basename "$t").log" || status=1
    done
    exit $status
    ;;
bench)
    carry_unpack
    shift
    workloads=${*:-w3 w1 w1-bf16 w2}
    for w in $workloads; do
        for mode in eager graph; do
            echo "== stepgraph $w $mode"
            # shellcheck disable=SC2086 # BENCH_FLAGS is a list of flags
            .carry/stepgraph bench --workload "$w" --mode "$mode" ${BENCH_FLAGS-} --json | tee -a "$OUT/bench.jsonl" || echo "{\"workload\":\"$w\",\"mode\":\"$mode\",\"error\":true}" >>"$OUT/bench.jsonl"
        done
        tw=${w/-/}
        for mode in eager reduce-overhead; do
            echo "== torch $tw $mode"
            PYTHONUNBUFFERED=1 python3 .carry/bench/torch_reference.py --workload "$tw" --mode "$mode" 2>&1 | grep RESULT | sed 's/^RESULT //' | tee -a "$OUT/torch.jsonl" || true
        done
    done
    ;;
bench-ab)
    # The baseline (stepgraph-base, see build) and this build alternate per
    # workload and mode, so drift of the machine hits both alike; then the
    # PyTorch reference. Rows carry "binary": "base" or "new".
    carry_unpack
    shift
    workloads=${*:-w3 w1 w1-bf16 w2 w5}
    modes=${MODES:-eager graph}
    torch_modes=${TORCH_MODES:-eager reduce-overhead}
    for w in $workloads; do
        for mode in $modes; do
            for bin in base new new base; do
                exe=.carry/stepgraph
                [ "$bin" = base ] && exe=.carry/stepgraph-base
                echo "== $bin $w $mode"
                "$exe" bench --workload "$w" --mode "$mode" --json | sed "s/^{/{\"binary\":\"$bin\",/" | tee -a "$OUT/bench-ab.jsonl" ||
                    echo "{\"binary\":\"$bin\",\"workload\":\"$w\",\"mode\":\"$mode\",\"error\":true}" >>"$OUT/bench-ab.jsonl"
            done
        done
        tw=${w/-/}
        for mode in $torch_modes; do
            echo "== torch $tw $mode"
            PYTHONUNBUFFERED=1 python3 .carry/bench/torch_reference.py --workload "$tw" --mode "$mode" 2>&1 | grep RESULT | sed 's/^RESULT //' | tee -a "$OUT/torch.jsonl" || true
        done
    done
    ;;
*)
    echo "usage: $0 build|unpack|test|bench|bench-ab [workloads]" >&2
    exit 2
    ;;
esac
