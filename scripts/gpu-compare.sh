#!/usr/bin/env bash
# stepgraph's loss and every parameter gradient against PyTorch on identical
# weights, on a CUDA machine with PyTorch and transformers installed:
#
#   scripts/gpu-test.sh build          # .carry/stepgraph (see gpu-test.sh for building elsewhere)
#   scripts/gpu-compare.sh [CASE...]   # default: w1-2l w2 w2-truth w2-cpu
#
# The references are written by scripts/torch_reference.py --save (and
# scripts/torch_reference_layers.py for another layer count or a float32
# step) and read by `stepgraph compare --reference DIR`.
#
# Cases (the reference is made once per run and shared by the cases that use it):
#   w1-2l      W1 with 2 layers (open_llama_3b geometry, f32, 1 x 2048, loss sum), CUDA backend, --tol 1e-4
#   w2         W2 (Qwen2.5-7B geometry, 5 layers, hidden 28, bf16, 1 x 4096, loss ce), CUDA backend, --tol 2e-2
#   w2-truth   W2's exact gradients: PyTorch's step in float32 on W2's bf16 weights
#              (torch_reference_layers.py --compute-dtype float32, reference w2-f32); stepgraph
#              (CUDA, bf16) against it, and PyTorch's bf16 reference (w2) against it with
#              scripts/compare_grads.py: which of the two bf16 programs is nearer the truth
#   w2-cpu     W2 on the CPU backend (both backends on record)
#   w1-2l-cpu  W1 with 2 layers on the CPU backend (not in the default: minutes of CPU)
# COMPARE_ARGS adds flags to every `stepgraph compare` (e.g. "--epilogues off").
# The tolerance is compare's default for the dtype; the metric is
# rel = |a - b|_2 / |b|_2 per tensor (rel_max = max|a - b| / max|b| reported too).
#
# References (W1 2 layers: 3.6 GB) go to $REF_DIR (default ${TMPDIR:-/tmp}/stepgraph-ref),
# not under $RESULTS. Under $RESULTS (or ./gpu-out): torch-<ref>.log, compare-<case>.log (text
# report), compare-<case>.json (JSON report) and compare-summary.txt; w2-truth also writes
# torch-vs-truth-w2.{log,json} (compare_grads.py) and truth-w2-table.txt (per tensor, side
# by side: stepgraph vs PyTorch bf16, stepgraph vs truth, PyTorch bf16 vs truth). Exits
# non-zero when a case fails or errs (w2-truth fails when stepgraph is outside compare's
# bf16 tolerance against the truth); every case runs regardless.
set -uo pipefail
cd "$(dirname "$0")/.."
RESULTS=${RESULTS:-gpu-out}
REF_DIR=${REF_DIR:-${TMPDIR:-/tmp}/stepgraph-ref}
mkdir -p "$RESULTS" "$REF_DIR"

# The binaries and kernel cache that `gpu-test.sh build` packed.
# shellcheck source=scripts/carry-env.sh
source scripts/carry-env.sh
carry_unpack

for f in .carry/stepgraph scripts/torch_reference.py; do
    if [ ! -e "$f" ]; then
        echo "missing $f: run scripts/gpu-test.sh build first (and copy .carry/ with the repository)" >&2
        exit 2
    fi
done

made=" "
# reference NAME: torch_reference.py --save into $REF_DIR/NAME, once per run.
reference() {
    local name=$1 dir="$REF_DIR/$1"
    case " $made " in *" $name "*) return 0 ;; esac
    local cmd
    case $name in
    w1-2l) cmd=(scripts/torch_reference_layers.py --reference scripts --n-layer 2 --workload w1) ;;
    w2) cmd=(scripts/torch_reference.py --workload w2) ;;
    w2-f32) cmd=(scripts/torch_reference_layers.py --reference scripts --workload w2 --compute-dtype float32) ;;
    *)
        echo "no reference called $name" >&2
        return 2
        ;;
    esac
    rm -rf "$dir"
    echo "== reference $name: python3 ${cmd[*]} --save $dir --iters 1 --warmup 0"
    PYTHONUNBUFFERED=1 python3 "${cmd[@]}" --save "$dir" --iters 1 --warmup 0 2>&1 | tee "$RESULTS/torch-$name.log"
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
    w2-truth) ref=w2-f32 backend=cuda loss=ce ;;
    *)
        echo "unknown case $name (cases: w1-2l w2 w2-truth w2-cpu w1-2l-cpu)" >&2
        return 2
        ;;
    esac
    if [ "$name" = w2-truth ]; then
        # PyTorch's bf16 reference too: it is compared with the truth below.
        reference w2 || return 1
    fi
    reference "$ref" || return 1
    # shellcheck disable=SC2206 # COMPARE_ARGS is a list of flags, split on purpose
    local cmd=(.carry/stepgraph compare --device "$backend" --reference "$REF_DIR/$ref" --loss "$loss"
        --json-out "$RESULTS/compare-$name.json" ${COMPARE_ARGS:-})
    rm -f "$RESULTS/compare-$name.json"
    echo "== $name: ${cmd[*]}"
    "${cmd[@]}" 2>&1 | tee "$RESULTS/compare-$name.log"
    local rc=${PIPESTATUS[0]}
    if [ "$name" = w2-truth ]; then
        truth_w2 || rc=1
    fi
    return "$rc"
}

# truth_w2: PyTorch's bf16 W2 reference against the float32 one on the same weights.
truth_w2() {
    local a="$REF_DIR/w2" b="$REF_DIR/w2-f32"
    # The two references must hold the same step: same input, same weights
    # (torch_reference_layers.py saves the bf16 weights the bf16 reference saves).
    local rc=0
    if cmp -s "$a/weights.safetensors" "$b/weights.safetensors"; then
        echo "== w2-truth: weights.safetensors of w2 and w2-f32 are identical"
    else
        echo "w2-truth: weights.safetensors of w2 and w2-f32 differ: the comparison is void" >&2
        rc=1
    fi
    local cmd=(python3 scripts/compare_grads.py "$a" "$b" --json "$RESULTS/torch-vs-truth-w2.json")
    rm -f "$RESULTS/torch-vs-truth-w2.json"
    echo "== w2-truth, PyTorch bf16 against the truth: ${cmd[*]}"
    "${cmd[@]}" 2>&1 | tee "$RESULTS/torch-vs-truth-w2.log"
    [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
    return "$rc"
}

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 | tee "$RESULTS/gpu.txt" || true
cases=${*:-w1-2l w2 w2-truth w2-cpu}
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
    echo "== summary (rel = |a - b|_2 / |b|_2 per tensor; a = stepgraph, b = PyTorch; for w2-truth b = PyTorch in f32 on the bf16 weights)"
    printf '%s\n' "${results[@]}"
    for c in $cases; do
        f="$RESULTS/compare-$c.json"
        [ -e "$f" ] && python3 - "$c" "$f" <<'EOF'
import json, sys
case, path = sys.argv[1], sys.argv[2]
r = json.load(open(path))
num = lambda x: float("nan") if x is None else x  # JSON writes NaN and infinity as null
ref = "f32 truth" if case == "w2-truth" else "torch"
bad = [g["name"] for g in r["grads"] if not g["pass"]]
print(f"{case}: {r['backend']} on {r['device']}, {r['dtype']}, tol {r['tolerance']:g}: "
      f"loss rel {num(r['loss']['rel']):.3e} (stepgraph {num(r['loss']['stepgraph']):.9g}, "
      f"{ref} {num(r['loss']['reference']):.9g}), "
      f"max grad rel {num(r['max_grad_rel']):.3e} ({r['worst']}), "
      f"max grad rel_max {max((num(g['rel_max']) for g in r['grads']), default=0):.3e}, "
      f"{len(r['grads']) - len(bad)}/{len(r['grads'])} grads ok, {'PASS' if r['pass'] else 'FAIL'}"
      + (f"; failing: {', '.join(bad[:8])}" if bad else ""))
EOF
        if [ "$c" = w2-truth ]; then
            python3 - "$RESULTS" "$cases" <<'EOF'
# Side by side: stepgraph bf16 and PyTorch bf16, each against the f32 truth.
import json, os, statistics, sys
out, cases = sys.argv[1], sys.argv[2].split()
def load(name):
    p = os.path.join(out, name)
    return json.load(open(p)) if os.path.exists(p) else None
sg, pt = load("compare-w2-truth.json"), load("torch-vs-truth-w2.json")
# stepgraph against PyTorch bf16, when this run did w2 too.
sp = load("compare-w2.json") if "w2" in cases else None
num = lambda x: float("nan") if x is None else x  # JSON writes NaN and infinity as null
key = lambda x: float("inf") if x != x else x  # NaN counts as the worst of all
med = lambda xs: statistics.median(xs) if xs else float("nan")
sg_rel = {g["name"]: num(g["rel"]) for g in sg["grads"]} if sg else {}
pt_rel = {g["name"]: num(g["rel"]) for g in pt["grads"]} if pt else {}
sp_rel = {g["name"]: num(g["rel"]) for g in sp["grads"]} if sp else {}
print("w2-truth side by side (rel against the truth: PyTorch f32 on W2's bf16 weights):")
if pt:
    same = {True: "same", False: "NOT the same", None: "not in both"}[pt.get("same_input_ids")]
    print(f"  references: weights.safetensors {pt.get('weights')}, input_ids {same}")
if sg:
    print(f"  stepgraph bf16: max rel {num(sg['max_grad_rel']):.3e} ({sg['worst']}), "
          f"median {med(list(sg_rel.values())):.3e}, loss rel {num(sg['loss']['rel']):.3e}")
else:
    print("  stepgraph bf16: no compare-w2-truth.json")
if pt:
    print(f"  PyTorch bf16:   max rel {num(pt['max_rel']):.3e} ({pt['worst']}), "
          f"median {num(pt['median_rel']):.3e}, loss rel {num((pt.get('loss') or {}).get('rel')):.3e}")
else:
    print("  PyTorch bf16:   no torch-vs-truth-w2.json")
names = sorted(set(sg_rel) & set(pt_rel), key=lambda n: (-max(key(sg_rel[n]), key(pt_rel[n])), n))
if names:
    print(f"  stepgraph nearer the truth on {sum(1 for n in names if sg_rel[n] < pt_rel[n])}/{len(names)} "
          f"gradients, PyTorch on {sum(1 for n in names if pt_rel[n] < sg_rel[n])}; worst:")
    table = os.path.join(out, "truth-w2-table.txt")
    with open(table, "w") as f:
        f.write("rel = |a - b|_2 / |b|_2 per gradient; truth = PyTorch f32 on W2's bf16 weights; "
                "sg vs torch: stepgraph against PyTorch bf16 (nan: w2 not run this time); "
                "worst against the truth first\n")
        w = max(len(n) for n in names)
        f.write(f"{'tensor':<{w}}  {'sg vs torch':>12} {'sg vs truth':>12} {'torch vs truth':>14}  nearer\n")
        for n in names:
            nearer = "stepgraph" if sg_rel[n] < pt_rel[n] else "torch" if pt_rel[n] < sg_rel[n] else "-"
            f.write(f"{n:<{w}}  {sp_rel.get(n, float('nan')):>12.3e} {sg_rel[n]:>12.3e} "
                    f"{pt_rel[n]:>14.3e}  {nearer}\n")
    for n in names[:5]:
        print(f"    {n}: stepgraph {sg_rel[n]:.3e}, PyTorch {pt_rel[n]:.3e}"
              + (f" (stepgraph vs PyTorch bf16 {sp_rel[n]:.3e})" if n in sp_rel else ""))
    print(f"  every gradient: {table}")
EOF
        fi
    done
} 2>&1 | tee "$RESULTS/compare-summary.txt"
exit $status
