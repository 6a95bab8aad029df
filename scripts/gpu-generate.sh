#!/usr/bin/env bash
# Generation on a CUDA machine with PyTorch and transformers installed,
# after `scripts/gpu-test.sh build` (see that script for building on another
# machine):
#
#   bash scripts/gpu-generate.sh
#
# 1. W6 (docs/benchmarks.md): `stepgraph generate` of the open_llama_3b
#    geometry in bf16 with random weights, 512-token prompts, 256 new
#    tokens (EOS ignored), batch 1 and 16 (BATCHES); then the PyTorch
#    reference scripts/torch_generate.py (transformers `generate`, static
#    cache compiled with CUDA graphs, and eager: TORCH_MODES) right after.
# 2. Greedy tokens against transformers `generate` on the same weights and
#    prompt ids: a Qwen2.5-0.5B-geometry folder (scripts/make_hf_model.py)
#    in f32 (64 new tokens must be identical) and in bf16 (the first
#    divergence is reported).
#
# Results in $RESULTS (default ./gpu-out): generate.log (every command's
# output), w6.jsonl (stepgraph's summaries and torch's RESULT rows) and
# hf_generate.jsonl (the comparisons).
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/carry-env.sh
gpu_script_start
LOG=$RESULTS/generate.log
W6=$RESULTS/w6.jsonl
HFJ=$RESULTS/hf_generate.jsonl
WORK=${WORK:-/tmp/generate}
rm -rf "$WORK" && mkdir -p "$WORK"
: >"$LOG"
: >"$W6"
: >"$HFJ"
status=0
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >>"$LOG" 2>&1

for b in ${BATCHES:-1 16}; do
    echo "== $(date +%T) stepgraph W6 batch $b" | tee -a "$LOG"
    if "$SG" generate --model open_llama_3b --dtype bf16 --random-prompts "$b" --prompt-tokens 512 \
        --max-new-tokens 256 --ignore-eos --json >"$WORK/w6-$b.jsonl" 2>>"$LOG"; then
        grep '"summary"' "$WORK/w6-$b.jsonl" | sed "s/^{/{\"run\":\"stepgraph\",\"batch\":$b,/" | tee -a "$W6" >>"$LOG"
    else
        echo "FAILED: stepgraph W6 batch $b" | tee -a "$LOG"
        status=1
    fi
done
for mode in ${TORCH_MODES:-static eager}; do
    echo "== $(date +%T) torch_generate.py --mode $mode" | tee -a "$LOG"
    PYTHONUNBUFFERED=1 python3 scripts/torch_generate.py --mode "$mode" --batch ${BATCHES:-1 16} 2>&1 |
        tee -a "$LOG" | grep '^RESULT ' | sed 's/^RESULT //' >>"$W6"
done

echo "== $(date +%T) transformers greedy against stepgraph" | tee -a "$LOG"
for dtype in f32 bf16; do
    python3 scripts/make_hf_model.py --geometry qwen2.5-0.5b --dtype "$dtype" --corpus-bytes 1000000 --out "$WORK/m-$dtype" >>"$LOG" 2>&1 ||
        { echo "FAILED: make_hf_model $dtype" | tee -a "$LOG"; status=1; continue; }
    printf '%s\n' '{"prompt": "The history of the city begins"}' '{"prompt": "def fibonacci(n):"}' \
        '{"messages": [{"role": "user", "content": "Name three colors."}]}' >"$WORK/prompts.jsonl"
    "$SG" generate --init-from "$WORK/m-$dtype" --dtype "$dtype" --prompts "$WORK/prompts.jsonl" \
        --max-new-tokens 64 --ignore-eos --json >"$WORK/sg-$dtype.jsonl" 2>>"$LOG" ||
        { echo "FAILED: stepgraph generate $dtype" | tee -a "$LOG"; status=1; continue; }
    python3 - "$WORK/m-$dtype" "$WORK/sg-$dtype.jsonl" "$dtype" "$HFJ" <<'PY' 2>&1 | tee -a "$LOG"
import json, sys
import torch
from transformers import AutoModelForCausalLM
folder, sg, dtype, out = sys.argv[1:5]
torch_dtype = torch.float32 if dtype == "f32" else torch.bfloat16
torch.backends.cuda.matmul.allow_tf32 = False
model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch_dtype).cuda().eval()
rows = [json.loads(l) for l in open(sg) if '"index"' in l]
ok = True
for r in rows:
    ids = torch.tensor([r["prompt_ids"]], device="cuda")
    with torch.no_grad():
        g = model.generate(ids, max_new_tokens=64, min_new_tokens=64, do_sample=False, eos_token_id=None,
                           pad_token_id=0)
    theirs = g[0, ids.shape[1]:].tolist()
    ours = r["tokens"]
    first = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
    row = {"dtype": dtype, "index": r["index"], "prompt_tokens": len(r["prompt_ids"]), "new": len(ours),
           "identical": ours == theirs, "first_divergence": first}
    print(json.dumps(row))
    open(out, "a").write(json.dumps(row) + "\n")
    if dtype == "f32" and ours != theirs:
        ok = False
sys.exit(0 if ok else 1)
PY
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
done
echo "== done (status $status)" | tee -a "$LOG"
exit $status
