#!/usr/bin/env bash
# stepgraph's loss and every parameter gradient against PyTorch on identical
# weights (the acceptance of issue 3), on the GPU machine:
#
#   scripts/gpu-test.sh build          # here: .carry/stepgraph and .carry/bench/torch_reference.py
#   scripts/gpu-compare.sh [CASE...]   # on the GPU machine (default: w1-2l w2 w2-cpu)
#
# With the `device` tool: build here, then
#   run(command="bash scripts/gpu-compare.sh", carry=[".carry"])
#
# Cases (the reference is made once per call and shared by the cases that use it):
#   w1-2l      W1 with 2 layers (open_llama_3b geometry, f32, 1 x 2048, loss sum), CUDA backend, --tol 1e-4
#   w2         W2 (Qwen2.5-7B geometry, 5 layers, hidden 28, bf16, 1 x 4096, loss ce), CUDA backend, --tol 2e-2
#   w2-cpu     W2 on the CPU backend (both backends on record)
#   w1-2l-cpu  W1 with 2 layers on the CPU backend (not in the default: minutes of CPU)
# The tolerance is compare's default for the dtype; the metric is
# rel = |a - b|_2 / |b|_2 per tensor (rel_max = max|a - b| / max|b| reported too).
#
# References (W1 2 layers: 3.6 GB) go to $REF_DIR (default ${TMPDIR:-/tmp}/stepgraph-ref),
# not under $OUT. Under $OUT (or ./gpu-out): torch-<ref>.log, compare-<case>.log (text
# report), compare-<case>.json (JSON report) and compare-summary.txt. Exits non-zero
# when a case fails or errs; every case runs regardless.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-out}
REF_DIR=${REF_DIR:-${TMPDIR:-/tmp}/stepgraph-ref}
mkdir -p "$OUT" "$REF_DIR"

for f in .carry/stepgraph .carry/bench/torch_reference.py; do
    if [ ! -e "$f" ]; then
        echo "missing $f: run scripts/gpu-test.sh build first (and carry .carry)" >&2
        exit 2
    fi
done

made=" "
# reference NAME: torch_reference.py --save into $REF_DIR/NAME, once per call.
reference() {
    local name=$1 dir="$REF_DIR/$1"
    case " $made " in *" $name "*) return 0 ;; esac
    local cmd
    case $name in
    w1-2l) cmd=(scripts/torch_reference_layers.py --reference .carry/bench --n-layer 2 --workload w1) ;;
    w2) cmd=(.carry/bench/torch_reference.py --workload w2) ;;
    *)
        echo "no reference called $name" >&2
        return 2
        ;;
    esac
    rm -rf "$dir"
    echo "== reference $name: python3 ${cmd[*]} --save $dir --iters 1 --warmup 0"
    PYTHONUNBUFFERED=1 python3 "${cmd[@]}" --save "$dir" --iters 1 --warmup 0 2>&1 | tee "$OUT/torch-$name.log"
    local rc=${PIPESTATUS[0]}
    if [ "$rc" -ne 0 ] || [ ! -e "$dir/grads.safetensors" ]; then
        echo "reference $name failed (exit $rc)" >&2
        return 1
    fi
    made="$made$name "
}

# run_case CASE: the reference, then stepgraph compare on the case's backend.
run_case() {
    local name=$1 ref backend loss
    case $name in
    w1-2l) ref=w1-2l backend=cuda loss=sum ;;
    w1-2l-cpu) ref=w1-2l backend=cpu loss=sum ;;
    w2) ref=w2 backend=cuda loss=ce ;;
    w2-cpu) ref=w2 backend=cpu loss=ce ;;
    *)
        echo "unknown case $name (cases: w1-2l w2 w2-cpu w1-2l-cpu)" >&2
        return 2
        ;;
    esac
    reference "$ref" || return 1
    local cmd=(.carry/stepgraph compare --backend "$backend" --reference "$REF_DIR/$ref" --loss "$loss"
        --json-out "$OUT/compare-$name.json")
    rm -f "$OUT/compare-$name.json"
    echo "== $name: ${cmd[*]}"
    "${cmd[@]}" 2>&1 | tee "$OUT/compare-$name.log"
    return "${PIPESTATUS[0]}"
}

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 | tee "$OUT/gpu.txt" || true
cases=${*:-w1-2l w2 w2-cpu}
status=0
results=()
for c in $cases; do
    start=$SECONDS
    if run_case "$c"; then
        results+=("$c pass ($((SECONDS - start)) s)")
    else
        status=1
        results+=("$c FAIL ($((SECONDS - start)) s)")
    fi
done

{
    echo "== summary (rel = |a - b|_2 / |b|_2 per tensor; a = stepgraph, b = PyTorch)"
    printf '%s\n' "${results[@]}"
    for c in $cases; do
        f="$OUT/compare-$c.json"
        [ -e "$f" ] || continue
        python3 - "$c" "$f" <<'EOF'
import json, sys
case, path = sys.argv[1], sys.argv[2]
r = json.load(open(path))
num = lambda x: float("nan") if x is None else x  # JSON writes NaN and infinity as null
bad = [g["name"] for g in r["grads"] if not g["pass"]]
print(f"{case}: {r['backend']} on {r['device']}, {r['dtype']}, tol {r['tolerance']:g}: "
      f"loss rel {num(r['loss']['rel']):.3e} (stepgraph {num(r['loss']['stepgraph']):.9g}, "
      f"torch {num(r['loss']['reference']):.9g}), "
      f"max grad rel {num(r['max_grad_rel']):.3e} ({r['worst']}), "
      f"max grad rel_max {max((num(g['rel_max']) for g in r['grads']), default=0):.3e}, "
      f"{len(r['grads']) - len(bad)}/{len(r['grads'])} grads ok, {'PASS' if r['pass'] else 'FAIL'}"
      + (f"; failing: {', '.join(bad[:8])}" if bad else ""))
EOF
    done
} 2>&1 | tee "$OUT/compare-summary.txt"
exit $status
