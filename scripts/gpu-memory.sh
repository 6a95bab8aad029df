#!/usr/bin/env bash
# Memory flags on a CUDA machine (after `scripts/gpu-test.sh build`; see that
# script for building on another machine): stepgraph's bench under the
# memory flags (default, budgets, everything off) and the PyTorch reference
# of the same workload (scripts/torch_reference.py, eager and torch.compile
# reduce-overhead) right after. Usage:
#   scripts/gpu-memory.sh w2        # W2: default, 0.5GB budget, recompute/placement off
#   scripts/gpu-memory.sh w5        # W5: default, 32GB, 24GB, off; and l8-2l
# Results: $RESULTS/memory.jsonl (one JSON line per run, with its flags) and
# $RESULTS/torch.jsonl.
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
*)
    echo "usage: $0 w2|w5" >&2
    exit 2
    ;;
esac
