#!/usr/bin/env bash
# A fine-tune from a Hugging Face folder end to end, on a CUDA machine with
# PyTorch, transformers and tokenizers installed, after `scripts/gpu-test.sh
# build` (it packs the release CLI into .carry/; see that script for building
# on another machine):
#
#   bash scripts/gpu-finetune.sh
#
# 1. a Qwen2.5-0.5B-geometry model with random weights, its tokenizer and a
#    JSONL corpus (scripts/make_hf_model.py: nothing can be downloaded);
# 2. `stepgraph prepare` of the corpus into a token file (1% held out);
# 3. `stepgraph train --init-from` it for STEPS steps (default 200) with
#    validation every 50, a checkpoint at the half, stopped there and
#    resumed (`--resume auto`), `--out` at the end; and the same run
#    straight through, whose final checkpoint must equal the resumed one
#    byte for byte (cuBLASLt autotuning is off so both processes pick the
#    same algorithms: README, "Checkpoints");
# 4. `stepgraph eval` of the --out folder, and the folder loaded by
#    `transformers` with its logits against stepgraph's on the same ids;
# 5. scripts/hf_roundtrip.py (every family through `stepgraph hf`);
# 6. PyTorch eager on the same model, dtype, batch and sequence
#    (scripts/torch_train_reference.py, with the same gradient clipping).
#
# Everything lands in $RESULTS (default ./gpu-out): finetune.log (every command's
# output), results.jsonl (one JSON row per stage), metrics.jsonl (the
# resumed run's metrics, steps 1..STEPS) and summary.json (tokens/s, memory,
# losses, the checks). Settings: STEPS, BATCH, SEQ, DTYPE, GEOMETRY, WORK;
# DEVICE (default cuda), and BASE/CORPUS (an existing model folder and JSONL
# corpus instead of step 1) for a dry run of the stepgraph stages elsewhere.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/carry-env.sh
gpu_script_start
STEPS=${STEPS:-200}
HALF=$((STEPS / 2))
BATCH=${BATCH:-8}
SEQ=${SEQ:-1024}
DTYPE=${DTYPE:-bf16}
GEOMETRY=${GEOMETRY:-qwen2.5-0.5b}
WORK=${WORK:-/tmp/finetune}
DEVICE=${DEVICE:-cuda}
LOG=$RESULTS/finetune.log
RES=$RESULTS/results.jsonl
rm -rf "$WORK" && mkdir -p "$WORK"
: >"$LOG"
: >"$RES"
status=0

stage() {
    echo "== $(date +%T) $*" | tee -a "$LOG"
}
# Runs a command, its output appended to the log; a failure is recorded and the script goes on.
logged() {
    "$@" >>"$LOG" 2>&1
    local rc=$?
    if [ $rc -ne 0 ]; then
        echo "FAILED ($rc): $*" | tee -a "$LOG"
        echo "{\"failed\":$(printf '%s' "$*" | python3 -c 'import json,sys;print(json.dumps(sys.stdin.read()))'),\"rc\":$rc}" >>"$RES"
        status=1
    fi
    return $rc
}

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >>"$LOG" 2>&1

if [ -n "${BASE:-}" ]; then
    cp -r "$BASE" "$WORK/base" && cp "$CORPUS" "$WORK/corpus.jsonl"
else
    stage "make the model ($GEOMETRY, $DTYPE) and the corpus"
    logged python3 scripts/make_hf_model.py --geometry "$GEOMETRY" --dtype "$DTYPE" --out "$WORK/base" \
        --corpus-out "$WORK/corpus.jsonl" --json-out "$WORK/make.json" || exit 1
    echo "{\"stage\":\"make\",\"result\":$(cat "$WORK/make.json")}" >>"$RES"
fi

stage "prepare"
"$SG" prepare --tokenizer "$WORK/base" --input "$WORK/corpus.jsonl" --val-fraction 0.01 \
    --out "$WORK/corpus.tokens" --json >"$WORK/prepare.json" 2>>"$LOG" || { echo "FAILED: prepare" | tee -a "$LOG"; exit 1; }
python3 -c 'import json,sys; print(json.dumps({"stage":"prepare","result":json.load(open(sys.argv[1]))}))' \
    "$WORK/prepare.json" >>"$RES"

# The run's flags, shared by the three train commands and eval.
export STEPGRAPH_GEMM_AUTOTUNE=off
common=(--device "$DEVICE" --init-from "$WORK/base" --data "$WORK/corpus.tokens" --dtype "$DTYPE" --batch "$BATCH"
    --seq "$SEQ" --steps "$STEPS" --eval-every 50 --eval-batches 4 --save-every "$HALF" --keep 2 --log-every 10)

stage "train: steps 1..$HALF, stopped with a checkpoint"
logged "$SG" train "${common[@]}" --checkpoint-dir "$WORK/ck" --stop-after "$HALF"
stage "train: resumed to step $STEPS, --out"
logged "$SG" train "${common[@]}" --checkpoint-dir "$WORK/ck" --resume auto --out "$WORK/ft"
cp "$WORK/ck/metrics.jsonl" "$RESULTS/metrics.jsonl" 2>/dev/null
stage "train: $STEPS steps straight"
logged "$SG" train "${common[@]}" --checkpoint-dir "$WORK/straight"
last=$(printf 'step-%06d' "$STEPS")
same=true
for f in weights.safetensors optimizer.safetensors; do
    cmp -s "$WORK/ck/$last/$f" "$WORK/straight/$last/$f" || same=false
done
echo "{\"stage\":\"resume\",\"bitwise_equal\":$same,\"checkpoint\":\"$last\"}" | tee -a "$RES" >>"$LOG"
[ "$same" = true ] || status=1
rm -rf "$WORK/straight"

stage "eval of the --out folder"
logged "$SG" eval --device "$DEVICE" --init-from "$WORK/ft" --data "$WORK/corpus.tokens" --dtype "$DTYPE" \
    --batch "$BATCH" --seq "$SEQ" --json && grep '"val_loss"' "$LOG" | tail -n 1 |
    sed 's/^/{"stage":"eval","result":/; s/$/}/' >>"$RES"

stage "transformers loads the --out folder; its logits against stepgraph's (f32)"
logged python3 - "$WORK/ft" "$SG" "$RES" <<'PY'
import json, subprocess, sys, tempfile, os
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer
folder, sg, res = sys.argv[1:4]
tok = AutoTokenizer.from_pretrained(folder)
model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").cuda().eval()
text = "The optimizer moves every weight a little, and the next batch comes in."
ids = torch.tensor([tok(text)["input_ids"][:64]], dtype=torch.int64)
with tempfile.TemporaryDirectory() as d:
    save_file({"input_ids": ids}, os.path.join(d, "ids.safetensors"))
    out = os.path.join(d, "logits.safetensors")
    subprocess.run([sg, "hf", "--init-from", folder, "--ids", os.path.join(d, "ids.safetensors"),
                    "--logits-out", out, "--device", "cuda", "--dtype", "f32"], check=True)
    ours = load_file(out)["logits"].double()
with torch.no_grad():
    theirs = model(input_ids=ids.cuda()).logits.double().cpu()
rel = float((ours - theirs).norm() / theirs.norm())
row = {"stage": "transformers", "loads": True, "tokens": ids.shape[1], "logits_rel_l2": rel, "ok": rel <= 1e-4}
print(json.dumps(row))
open(res, "a").write(json.dumps(row) + "\n")
sys.exit(0 if row["ok"] else 1)
PY

stage "hf_roundtrip.py"
logged python3 scripts/hf_roundtrip.py --stepgraph "$SG" --backend cuda &&
    echo '{"stage":"hf_roundtrip","ok":true}' >>"$RES"

stage "PyTorch eager, same shapes"
logged python3 scripts/torch_train_reference.py --model "$WORK/base" --dtype "$DTYPE" --batch "$BATCH" \
    --seq "$SEQ" --max-grad-norm 1.0 --mode eager &&
    grep '^RESULT ' "$LOG" | tail -n 1 | sed 's/^RESULT /{"stage":"torch","result":/; s/$/}/' >>"$RES"

stage "summary"
python3 - "$RESULTS/metrics.jsonl" "$RES" "$RESULTS/summary.json" <<'PY' | tee -a "$LOG"
import json, statistics, sys
metrics, res, out = sys.argv[1:4]
import os
rows = [json.loads(l) for l in open(metrics)] if os.path.exists(metrics) else []
train = [r for r in rows if "loss" in r]
val = [r for r in rows if "val_loss" in r]
stages = {}
for l in open(res):
    r = json.loads(l)
    stages.setdefault(r.get("stage", "failed"), []).append(r)
tps = [r["tokens_per_s"] for r in train[10:]] or [r["tokens_per_s"] for r in train]
s = {
    "steps": len(train),
    "first_loss": train[0]["loss"] if train else None,
    "last_loss": train[-1]["loss"] if train else None,
    "val": [(r["step"], r["val_loss"]) for r in val],
    "stepgraph_tokens_per_s_median": statistics.median(tps) if tps else None,
    "stepgraph_planned_MB": max((r["planned_bytes"] for r in train), default=0) / 1e6,
    "stepgraph_held_MB": max((r["held_bytes"] for r in train), default=0) / 1e6,
    "mfu_median": statistics.median([r["mfu"] for r in train if "mfu" in r]) if any("mfu" in r for r in train) else None,
    "grad_norm_last": train[-1].get("grad_norm") if train else None,
    "stages": stages,
}
torch_rows = stages.get("torch", [])
if torch_rows:
    t = torch_rows[-1]["result"]
    s["torch_tokens_per_s"] = t["tokens_per_s"]
    s["torch_peak_alloc_MB"] = t["peak_alloc_MB"]
    s["torch_peak_reserved_MB"] = t["peak_reserved_MB"]
json.dump(s, open(out, "w"), indent=2)
print(json.dumps({k: v for k, v in s.items() if k != "stages"}))
PY
exit $status
