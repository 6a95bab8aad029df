#!/usr/bin/env bash
# GPU tests and benchmarks on a CUDA machine, from the repository root:
#
#   scripts/gpu-test.sh build           # release CLI + CUDA test binaries + kernel cache into .carry/
#   scripts/gpu-test.sh test [NAME...]  # every GPU test binary (or those named, e.g. gpu_dist)
#   scripts/gpu-test.sh bench [W...]    # stepgraph bench (eager, graph) and the PyTorch reference
#                                       # (scripts/torch_reference.py, eager and reduce-overhead),
#                                       # one after the other; default workloads: w3 w1 w1-bf16 w2
#                                       # (BENCH_FLAGS: flags for every `stepgraph bench`,
#                                       # e.g. "--f32-products 3xtf32")
#   scripts/gpu-test.sh bench-ab [W...] # a baseline binary and this one, interleaved, + PyTorch
#                                       # (w6 is `stepgraph generate`'s W6 against
#                                       # scripts/torch_generate.py)
#   scripts/gpu-compare.sh [CASE...]    # loss and gradients against PyTorch (see that script)
#
# Logs and JSON go to $RESULTS (default ./gpu-out).
#
# On a machine with both a Rust toolchain and a GPU, run `build` and then the
# other commands in the same checkout. On a GPU machine without a Rust
# toolchain, run `build` on a machine that has one and copy the repository
# with its `.carry/` folder to the GPU machine; `test`, `bench` and the other
# scripts/gpu-*.sh run from the copy (scripts/carry-env.sh describes the pack).
#
# `build` also compiles every kernel module for sm_90 with NVRTC (the wheel
# .ci/run installs) into a kernel cache, so the GPU machine loads CUBINs
# instead of compiling them at first use (about a minute), and packs binaries
# and cache into .carry/pack.tar.xz; `test`, `bench` and scripts/gpu-compare.sh
# unpack it (`carry_unpack` in scripts/carry-env.sh, which a custom script can
# source too) before use. The PyTorch references run from scripts/ directly.
set -euo pipefail
cd "$(dirname "$0")/.."
RESULTS=${RESULTS:-gpu-out}
mkdir -p "$RESULTS"

# shellcheck source=scripts/carry-env.sh
source scripts/carry-env.sh

case "${1:-}" in
unpack)
    carry_unpack
    ;;
build)
    rm -rf .carry && mkdir -p .carry/tests
    cargo build --release -p stepgraph
    cp target/release/stepgraph .carry/
    cargo test --release -p stepgraph-cuda --no-run --message-format=json 2>/dev/null |
        python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] == ["test"]:
        print(m["target"]["name"], m["executable"])' |
        while read -r name exe; do cp "$exe" ".carry/tests/$name"; done
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
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$RESULTS/gpu.txt"
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
        "$t" --ignored --test-threads=1 2>&1 | tee "$RESULTS/test-$(basename "$t").log" || status=1
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
            .carry/stepgraph bench --workload "$w" --mode "$mode" ${BENCH_FLAGS-} --json | tee -a "$RESULTS/bench.jsonl" || echo "{\"workload\":\"$w\",\"mode\":\"$mode\",\"error\":true}" >>"$RESULTS/bench.jsonl"
        done
        for mode in eager reduce-overhead; do
            echo "== torch $w $mode"
            PYTHONUNBUFFERED=1 python3 scripts/torch_reference.py --workload "$w" --mode "$mode" 2>&1 | grep RESULT | sed 's/^RESULT //' | tee -a "$RESULTS/torch.jsonl" || true
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
                if [ "$w" = w6 ]; then
                    # W6 is generation: graph replay of the decode steps.
                    [ "$mode" = graph ] || continue
                    "$exe" generate --model open_llama_3b --dtype bf16 --random-prompts 1 --prompt-tokens 512 \
                        --max-new-tokens 256 --ignore-eos --json
                else
                    "$exe" bench --workload "$w" --mode "$mode" --json
                fi | sed "s/^{/{\"binary\":\"$bin\",\"workload\":\"$w\",/" | tee -a "$RESULTS/bench-ab.jsonl" ||
                    echo "{\"binary\":\"$bin\",\"workload\":\"$w\",\"mode\":\"$mode\",\"error\":true}" >>"$RESULTS/bench-ab.jsonl"
            done
        done
        for mode in $torch_modes; do
            echo "== torch $w $mode"
            if [ "$w" = w6 ]; then
                # transformers' generate: eager, and with a static cache compiled.
                tmode=static
                [ "$mode" = eager ] && tmode=eager
                PYTHONUNBUFFERED=1 python3 scripts/torch_generate.py --mode "$tmode" --batch 1 2>&1
            else
                PYTHONUNBUFFERED=1 python3 scripts/torch_reference.py --workload "$w" --mode "$mode" 2>&1
            fi | grep RESULT | sed 's/^RESULT //' | tee -a "$RESULTS/torch.jsonl" || true
        done
    done
    ;;
*)
    echo "usage: $0 build|unpack|test|bench|bench-ab [workloads]" >&2
    exit 2
    ;;
esac
