#!/usr/bin/env bash
# Where the time goes, with the PyTorch references, on a CUDA machine after
# `scripts/gpu-test.sh build` (see that script for building on another
# machine):
#
#   bash scripts/gpu-profiles.sh
#
# 1. Per workload of WORKLOADS (default: w3 w2 w5; bench workloads), the
#    graph-mode step (`bench --json`, rows in bench.jsonl) and one eager
#    step's per-kernel profile with the product tuning's report
#    (`bench --mode eager --profile`, in profiles.tgz as WORKLOAD.txt);
#    under each `;`-separated group of PROFILE_ENV too (`VAR=VALUE` words,
#    e.g. `STEPGRAPH_GEMM_TILED=1`), as WORKLOAD+VAR=VALUE.txt.
# 2. W6 at the batches of W6_BATCHES (default: 1 16): the generation
#    summary (w6.jsonl) and a profiled decode step (`generate --profile`,
#    w6-bB.txt in profiles.tgz).
# 3. PyTorch: scripts/torch_reference.py eager and reduce-overhead per
#    workload, scripts/torch_generate.py --mode static at W6's batches
#    (torch.jsonl); TORCH=0 skips them. Each has a time limit (TORCH_LIMIT
#    seconds, default 150), so a slow compile cannot stall the run; what
#    finished is kept.
# Results in $RESULTS (default ./gpu-out): bench.jsonl, w6.jsonl, torch.jsonl,
# profiles.tgz, profiles.log. On the H200 the steps take seconds; PyTorch's
# references take most of the time (W5 reduce-overhead alone minutes).
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/carry-env.sh
gpu_script_start
P=$(mktemp -d)
log_start "$RESULTS/profiles.log"
status=0

IFS=';' read -r -a envs <<<"${PROFILE_ENV-}"
for w in ${WORKLOADS-w3 w2 w5}; do
    stamp "$w graph"
    timeout 300 "$SG" bench --workload "$w" --mode graph --json >>"$RESULTS/bench.jsonl" 2>>"$LOG" ||
        { echo "FAILED: $w graph" | tee -a "$LOG"; status=1; }
    for group in "" "${envs[@]}"; do
        # shellcheck disable=SC2206 # a group is a list of VAR=VALUE words
        settings=($group)
        name=$w${group:++${group// /+}}
        stamp "$w eager --profile ${settings[*]}"
        env "${settings[@]}" timeout 300 "$SG" bench --workload "$w" --mode eager --profile >"$P/$name.txt" 2>&1 ||
            { echo "FAILED: $name profile" | tee -a "$LOG"; status=1; }
    done
done

for b in ${W6_BATCHES-1 16}; do
    stamp "w6 batch $b --profile"
    timeout 300 "$SG" generate --model open_llama_3b --dtype bf16 --random-prompts "$b" --prompt-tokens 512 \
        --max-new-tokens 256 --ignore-eos --json --profile >"$P/w6.out" 2>"$P/w6-b$b.txt" ||
        { echo "FAILED: w6 batch $b" | tee -a "$LOG"; status=1; }
    grep '"summary"' "$P/w6.out" | sed "s/^{/{\"batch\":$b,/" >>"$RESULTS/w6.jsonl"
done
rm -f "$P/w6.out"
tar czf "$RESULTS/profiles.tgz" -C "$P" .

if [ "${TORCH:-1}" = 1 ]; then
    for w in ${WORKLOADS-w3 w2 w5}; do
        for mode in eager reduce-overhead; do
            stamp "torch_reference.py $w $mode"
            torch_rows "" "${TORCH_LIMIT:-150}" torch_reference.py --workload "${w/-/}" --mode "$mode" >>"$RESULTS/torch.jsonl"
        done
    done
    if [ -n "${W6_BATCHES-1 16}" ]; then
        stamp "torch_generate.py --mode static --batch ${W6_BATCHES-1 16}"
        # shellcheck disable=SC2086 # one argument per batch size
        torch_rows "" "${TORCH_LIMIT:-150}" torch_generate.py --mode static --batch ${W6_BATCHES-1 16} >>"$RESULTS/torch.jsonl"
    fi
fi
stamp done
exit $status
