#!/usr/bin/env bash
# Run-time switches measured with one build, no baseline binary needed, on a
# CUDA machine after `scripts/gpu-test.sh build` (see that script for building
# on another machine):
#
#   bash scripts/gpu-switches.sh
#
# 1. The GPU tests named in TESTS (default: gpu_attention gpu_generate
#    gpu_basic), once per `;`-separated group of settings in TEST_ENV
#    (`VAR=VALUE` words; one empty group, the defaults, when unset): the
#    default paths, or those switches turn on, checked against the CPU
#    backend before they are timed. All output in tests.log. `CASES=`
#    (empty) runs the tests alone.
# 2. Each case of CASES, `SETTINGS|WORKLOADS` (settings `VAR=VALUE` joined by
#    commas; workloads `w6:B` for W6 at batch B, as in gpu-generate.sh, or a
#    bench workload run in graph mode), interleaved with runs without its
#    settings: off, on, on, off per workload.
# 3. The PyTorch references of the workloads measured (TORCH=0 skips them).
#
# CASES defaults to the switches that are off until measured:
# STEPGRAPH_GEMM_SKINNY=1 (our few-row tensor-core products in tuning) on
# W6 at batch 1 and 16, STEPGRAPH_GEMM_TILED=1 (our small-tile f32
# products) on W3, STEPGRAPH_PDL=1 (programmatic dependent launch of every
# kernel) on the launch-bound workloads, W6 at batch 1, W3 and W2. To keep a
# run short, pass fewer cases or TORCH=0 (on an H200 a W6 run takes about
# 2 s, W2 or W3 1 s, W5 7 s; PyTorch's references take minutes). Results in $RESULTS (default
# ./gpu-out): switches.jsonl (every summary row, tagged "switch": "off",
# the case's settings, or "torch"), switches.log, tests.log.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/carry-env.sh
gpu_script_start
CASES=${CASES-STEPGRAPH_GEMM_SKINNY=1|w6:1,w6:16 STEPGRAPH_GEMM_TILED=1|w3 STEPGRAPH_PDL=1|w6:1,w3,w2}
log_start "$RESULTS/switches.log"
ROWS=$RESULTS/switches.jsonl
: >"$ROWS"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >>"$LOG" 2>&1
status=0

# Each `;`-separated group of TEST_ENV runs every test of TESTS once.
IFS=';' read -r -a test_envs <<<"${TEST_ENV-}"
[ ${#test_envs[@]} -eq 0 ] && test_envs=("")
: >"$RESULTS/tests.log"
for group in "${test_envs[@]}"; do
    # shellcheck disable=SC2206 # a group is a list of VAR=VALUE words
    settings=($group)
    for t in ${TESTS-gpu_attention gpu_generate gpu_basic}; do
        stamp "test $t ${settings[*]}"
        echo "===== $t ${settings[*]}" >>"$RESULTS/tests.log"
        env "${settings[@]}" timeout "${TEST_LIMIT:-300}" ".carry/tests/$t" --ignored --test-threads=1 >/tmp/switch-test.log 2>&1 ||
            status=1
        cat /tmp/switch-test.log >>"$RESULTS/tests.log"
        echo "$t ${settings[*]}: $(grep -E '^test result' /tmp/switch-test.log || echo 'no result (failed or timed out)')" | tee -a "$LOG"
    done
done

# One measurement under `env SETTING...`, its summary rows tagged with `label`.
measure() {
    local label=$1 what=$2 arg=$3
    shift 3
    local tmp=/tmp/switch-run.jsonl
    stamp "$what $arg [$label]"
    case $what in
    w6)
        env "$@" timeout 300 "$SG" generate --model open_llama_3b --dtype bf16 --random-prompts "$arg" \
            --prompt-tokens 512 --max-new-tokens 256 --ignore-eos --json >"$tmp" 2>>"$LOG" &&
            grep '"summary"' "$tmp" | sed "s/^{/{\"switch\":\"$label\",\"workload\":\"w6\",\"batch\":$arg,/" >>"$ROWS"
        ;;
    bench)
        env "$@" timeout 300 "$SG" bench --workload "$arg" --mode graph --json >"$tmp" 2>>"$LOG" &&
            sed "s/^{/{\"switch\":\"$label\",/" "$tmp" >>"$ROWS"
        ;;
    esac || {
        echo "FAILED: $what $arg [$label]" | tee -a "$LOG"
        status=1
    }
    tail -n 1 "$ROWS" | cut -c1-300 >>"$LOG"
}

measured=()
for c in $CASES; do
    IFS=, read -r -a settings <<<"${c%%|*}"
    IFS=, read -r -a workloads <<<"${c#*|}"
    label=${c%%|*}
    for w in "${workloads[@]}"; do
        measured+=("$w")
        if [ "${w%%:*}" = w6 ]; then what=w6 arg=${w#w6:}; else what=bench arg=$w; fi
        for setting in off on on off; do
            if [ $setting = on ]; then measure "$label" $what "$arg" "${settings[@]}"; else measure off $what "$arg"; fi
        done
    done
done

if [ "${TORCH:-1}" = 1 ]; then
    w6_batches=$(printf '%s\n' "${measured[@]}" | sed -n 's/^w6://p' | sort -un | tr '\n' ' ')
    if [ -n "$w6_batches" ]; then
        stamp "torch_generate.py --mode static --batch $w6_batches"
        # shellcheck disable=SC2086 # one argument per batch size
        torch_rows torch 300 torch_generate.py --mode static --batch $w6_batches >>"$ROWS"
    fi
    for w in $(printf '%s\n' "${measured[@]}" | grep -v '^w6:' | sort -u); do
        for mode in eager reduce-overhead; do
            stamp "torch_reference.py $w $mode"
            torch_rows torch 300 torch_reference.py --workload "${w/-/}" --mode "$mode" >>"$ROWS"
        done
    done
fi
stamp done
exit $status
