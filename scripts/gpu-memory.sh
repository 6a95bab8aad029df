#!/usr/bin/env bash
# Memory flags on a CUDA machine (after `scripts/gpu-test.sh build`; see that
# script for building on another machine): stepgraph's bench under the
# memory flags (default, budgets, everything off) and the PyTorch reference
# of the same workload (scripts/torch_reference.py, eager and torch.compile
# reduce-overhead) right after. Usage:
#   scripts/gpu-memory.sh w2        # W2: default, 0.5GB budget, recompute/placement off
#   scripts/gpu-memory.sh w5        # W5: default, 32GB, 24GB, off; and l8-2l
#   scripts/gpu-memory.sh families  # `train` on each newer family's geometry: held against planned
# Results: $RESULTS/memory.jsonl (one JSON line per run, with its flags) and
# $RESULTS/torch.jsonl; for families, $RESULTS/families.txt (one line per model).
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/carry-env.sh
gpu_script_start
run() {
    local w=$1
    shift
    echo "== stepgraph $w graph $*"
    if line=$(.carry/stepgraph bench --workload "$w" --mode graph --json "$@" 2>"$RESULTS/last.err"); then
        echo "$line" | sed "s|^{|{\"flags\":\"$*\",|" | tee -a "$RESULTS/memory.jsonl"
    else
        tail -3 "$RESULTS/last.err"
        echo "{\"workload\":\"$w\",\"flags\":\"$*\",\"error\":$(tail -1 "$RESULTS/last.err" | python3 -c 'import json,sys;print(json.dumps(sys.stdin.read().strip()))')}" >>"$RESULTS/memory.jsonl"
    fi
    grep -E 'recompute|optimizer' "$RESULTS/last.err" | head -3
}
torch() {
    for mode in eager reduce-overhead; do
        echo "== torch $1 $mode"
        PYTHONUNBUFFERED=1 python3 scripts/torch_reference.py --workload "$1" --mode "$mode" 2>&1 | grep RESULT | sed 's/^RESULT //' | tee -a "$RESULTS/torch.jsonl"
    done
}
case "${1:-}" in
w2)
    run w2
    run w2 --memory-budget 0.5GB
    run w2 --recompute off --optimizer-in-backward off
    torch w2
    ;;
w5)
    run w5
    run w5 --memory-budget 32GB
    run w5 --memory-budget 24GB
    run w5 --recompute off --optimizer-in-backward off
    run l8-2l
    torch w5
    ;;
families)
    # Six bf16 AdamW steps per family from random weights on byte-level
    # text (graph replay, `train`'s defaults), at a length where the
    # sliding windows bite: the last step's device memory held by the
    # process against the plan.
    head -c 6000000 /dev/urandom | base64 >"$RESULTS/bytes.txt"
    : >"$RESULTS/families.txt"
    while read -r model flags; do
        echo "== train $model $flags"
        # shellcheck disable=SC2086 # flags is a list of flags
        if "$SG" train --model "$model" $flags --dtype bf16 --batch 1 --steps 6 --eval-every 0 \
            --data "$RESULTS/bytes.txt" >"$RESULTS/last.out" 2>&1; then
            mem=$(grep -o 'mem [0-9.]*/[0-9.]* MB held/planned' "$RESULTS/last.out" | tail -1)
            echo "$model $flags: $mem" | tee -a "$RESULTS/families.txt"
        else
            tail -5 "$RESULTS/last.out"
            echo "$model $flags: failed: $(tail -1 "$RESULTS/last.out")" | tee -a "$RESULTS/families.txt"
        fi
    done <<'MODELS'
Qwen3-0.6B --seq 4096
Qwen3-8B --n-layer 4 --seq 4096
gemma-2-2b --seq 8192
gemma-3-1b --seq 8192
Phi-4-mini-instruct --seq 4096
Mistral-7B-v0.1 --n-layer 8 --seq 8192
OLMo-2-0425-1B --seq 4096
MODELS
    ;;
*)
    echo "usage: $0 w2|w5|families" >&2
    exit 2
    ;;
esac
