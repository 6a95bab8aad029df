#!/usr/bin/env bash
# LoRA and QLoRA on a CUDA machine with PyTorch, transformers, peft and
# safetensors, after `scripts/gpu-test.sh build` (it packs the release CLI
# into .carry/; see that script for building on another machine):
#
#   bash scripts/gpu-lora.sh [STAGE...]     # default: peft memory
#
# peft    tiny f32 Llama, Mixtral and Qwen3-MoE folders made by transformers
#         (scripts/peft_check.py make-base); for each, `stepgraph train
#         --lora-rank 4` from it (the experts adapted too), written as an
#         adapter folder and, with --merge, as a merged model folder;
#         `stepgraph hf --adapter` logits and adapter gradients in f32 and
#         bf16; then scripts/peft_check.py compare: peft loads the adapter
#         folder and its logits and gradients are compared with stepgraph's,
#         and transformers loads the merged folder;
# memory  Meta-Llama-3-8B geometry (random weights), rank 16 on all seven
#         linear layers, 1 x 4096, bf16: `stepgraph train` with the base in
#         bf16 under --memory-budget 20GB and at the default plan, and in
#         NF4 with --double-quant under --memory-budget 7GB (planned and held bytes,
#         ms per step, from the metrics file); then the Hugging Face + peft
#         reference with gradient checkpointing and SDPA in the same run
#         (scripts/peft_reference.py);
# context the longest sequences of the fine-tuning guide's table that
#         run on a 24 GB and an 80 GB card (Llama-3.1-8B geometry), trained
#         for CONTEXT_STEPS (default 2) steps under
#         the card's budget (its size in GiB less 768 MiB for the CUDA
#         context): planned and held bytes against the card. Each row is
#         `CARD_GIB SEQ`, in $CONTEXT_LORA and $CONTEXT_QLORA (defaults:
#         the table's 24 GB rows; add the 80 GB ones, "24 16384 80 131072",
#         on a card that holds them: a 131,072-token step takes about a
#         minute on an H100).
# fusion  what folding the adapters into their base products gives: the
#         memory stage's default run with all seven linear layers adapted
#         and with the query projection alone, each with the epilogue pass
#         on (the default: each adapter's up-projection adds into the base
#         output, and its input gradient into the base's, inside the
#         product) and off (separate adds); 10 steps each;
# full    W7, the full fine-tune of the same geometry (no adapters, with
#         validation every 4 steps), and
#         PyTorch eager on it in the same run (scripts/torch_reference.py;
#         it may not fit the card: its error is the row).
#
# Everything lands in $RESULTS (default ./gpu-out): lora.log (every
# command's output) and lora.jsonl (one JSON row per check and run).
# Settings: WORK (default /tmp/lora), STEPS (default 8), PEFT_FAMILIES (the
# peft stage's families, default "llama mixtral qwen3_moe").
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/carry-env.sh
gpu_script_start
WORK=${WORK:-/tmp/lora}
STEPS=${STEPS:-8}
STAGES=${*:-peft memory}
rm -rf "$WORK" && mkdir -p "$WORK"
# Random-weight runs need only enough text for their sequences: the
# sample repeated to 300 kB holds 131,072-token rows and their validation.
TEXT="$WORK/text.txt"
for _ in $(seq 110); do cat data/tiny.txt; done >"$TEXT"
log_start "$RESULTS/lora.log"
OUTJ="$RESULTS/lora.jsonl"

run() { "$@" >>"$LOG" 2>&1; }

peft_stage() {
    # A dense Llama, and two mixtures of experts whose experts carry
    # adapters too (Qwen3-MoE's dense layer keeps its MLP unadapted: peft
    # reads those projection names as the experts').
    for family in ${PEFT_FAMILIES:-llama mixtral qwen3_moe}; do
        local targets=()
        [ "$family" = qwen3_moe ] && targets=(--lora-targets q,k,v,o,experts)
        local w="$WORK/$family"
        mkdir -p "$w"
        stamp "peft: $family base model and ids"
        run python3 scripts/peft_check.py make-base --out "$w/base" --family "$family" || return 1
        run python3 scripts/peft_check.py ids --out "$w/ids.safetensors" || return 1
        local common=(--init-from "$w/base" --data data/tiny.txt --device cuda --dtype f32 --seq 64 --batch 2
            --steps 4 --lr 1e-2 --eval-every 0 --lora-rank 4 --lora-alpha 8 --seed 3 "${targets[@]}")
        stamp "peft: $family: train the adapters, as a peft folder and merged"
        run "$SG" train "${common[@]}" --out "$w/ours" || return 1
        run "$SG" train "${common[@]}" --out "$w/merged" --merge || return 1
        # bf16 for the dense model only: a mixture of experts routes by
        # comparing router scores, and in bf16 near-equal scores rounded
        # differently send a token to other experts on either side (the
        # merged model against the unmerged one in transformers alone
        # differs by percents), so its bf16 logits are not comparable.
        local dtypes=(f32)
        [ "$family" = llama ] && dtypes=(f32 bf16)
        for dt in "${dtypes[@]}"; do
            stamp "peft: $family $dt logits and adapter gradients"
            run "$SG" hf --init-from "$w/base" --adapter "$w/ours" --ids "$w/ids.safetensors" --dtype "$dt" \
                --device cuda --logits-out "$w/logits-$dt.safetensors" --grads-out "$w/grads-$dt.safetensors"
            python3 scripts/peft_check.py compare --base "$w/base" --adapter "$w/ours" --merged "$w/merged" \
                --ids "$w/ids.safetensors" --logits "$w/logits-$dt.safetensors" \
                --grads "$w/grads-$dt.safetensors" --dtype "$dt" 2>>"$LOG" | grep RESULT |
                sed "s/^RESULT {/{\"check\":\"peft\",\"family\":\"$family\",/" | tee -a "$OUTJ"
        done
        # And an adapter peft made itself (its all-linear: on the mixtures
        # of experts the experts, the gate/up pair at twice the rank, and
        # the router), read by stepgraph.
        stamp "peft: $family: peft's own adapter read by stepgraph"
        run python3 scripts/peft_check.py make-adapter --base "$w/base" --out "$w/theirs" || return 1
        run "$SG" hf --init-from "$w/base" --adapter "$w/theirs" --ids "$w/ids.safetensors" --dtype f32 \
            --device cuda --logits-out "$w/theirs-logits.safetensors" --grads-out "$w/theirs-grads.safetensors"
        python3 scripts/peft_check.py compare --base "$w/base" --adapter "$w/theirs" --ids "$w/ids.safetensors" \
            --logits "$w/theirs-logits.safetensors" --grads "$w/theirs-grads.safetensors" --dtype f32 2>>"$LOG" |
            grep RESULT | sed "s/^RESULT {/{\"check\":\"peft-made\",\"family\":\"$family\",/" | tee -a "$OUTJ"
    done
}

# One 8B adapter run: `train_row NAME FLAGS...` appends its row to
# lora.jsonl; ROW_MODEL, ROW_SEQ and ROW_STEPS set its geometry, sequence
# and steps (default Meta-Llama-3-8B, 4096, $STEPS), ROW_ADAPTERS its
# adapter flags (default `--lora-rank 16`; empty for a full fine-tune),
# ROW_EVAL its validation interval (default 0: none).
train_row() {
    local name=$1
    shift
    stamp "memory: $name"
    local metrics="$WORK/metrics-$name.jsonl"
    "$SG" train --model "${ROW_MODEL:-Meta-Llama-3-8B}" --dtype bf16 --batch 1 --seq "${ROW_SEQ:-4096}" \
        --steps "${ROW_STEPS:-$STEPS}" --eval-every "${ROW_EVAL:-0}" \
        --data "$TEXT" ${ROW_ADAPTERS---lora-rank 16} --log-every 1 --metrics "$metrics" "$@" >"$WORK/$name.log" 2>&1
    local rc=$?
    cat "$WORK/$name.log" >>"$LOG"
    python3 - "$name" "$metrics" "$WORK/$name.log" "$rc" <<'EOF' | tee -a "$OUTJ"
import json, re, sys
name, metrics, log, rc = sys.argv[1], sys.argv[2], open(sys.argv[3]).read(), int(sys.argv[4])
rows = [json.loads(l) for l in open(metrics)] if rc == 0 else []
steps = [r for r in rows if "loss" in r]
m = re.search(r"\(([0-9.]+) ms/step\)", log)
row = {"check": "lora-8b", "run": name, "rc": rc}
card = re.search(r"-(\d+)GiB-card", name)
if card:
    row["card_bytes"] = int(card.group(1)) * 2**30
if steps:
    last = steps[-1]
    row.update(planned_bytes=last["planned_bytes"], held_bytes=last["held_bytes"],
               held_minus_planned_MB=(last["held_bytes"] - last["planned_bytes"]) / 2**20,
               tokens_per_s=last["tokens_per_s"], loss_first=steps[0]["loss"], loss_last=last["loss"])
if m:
    row["step_ms"] = float(m.group(1))
if rc != 0:
    row["error"] = log.strip().splitlines()[-1] if log.strip() else "no output"
print(json.dumps(row))
EOF
}

memory_stage() {
    train_row lora-budget-20GB --memory-budget 20GB
    train_row lora-default
    train_row qlora-nf4-dq-7GB --base-dtype nf4 --double-quant --memory-budget 7GB
    stamp "memory: transformers + peft, gradient checkpointing, SDPA"
    python3 scripts/peft_reference.py --seq 4096 --rank 16 --steps "$STEPS" 2>>"$LOG" | grep RESULT |
        sed 's/^RESULT {/{"check":"peft-reference",/' | tee -a "$OUTJ"
}

# `context_rows KIND "CARD SEQ ..." FLAGS...`: one run per card and sequence.
context_rows() {
    local kind=$1 rows=$2
    shift 2
    local -a pairs
    read -r -a pairs <<<"$rows"
    for ((i = 0; i + 1 < ${#pairs[@]}; i += 2)); do
        local card=${pairs[i]} seq=${pairs[i + 1]}
        local budget=$((card * 2 ** 30 - 768 * 2 ** 20))
        ROW_MODEL=Llama-3.1-8B ROW_SEQ=$seq ROW_STEPS=${CONTEXT_STEPS:-2} \
            train_row "$kind-$seq-$card""GiB-card" --memory-budget "$budget" "$@"
    done
}

context_stage() {
    context_rows lora "${CONTEXT_LORA-24 16384}"
    context_rows qlora "${CONTEXT_QLORA-24 32768}" --base-dtype nf4 --double-quant
}

fusion_stage() {
    local epilogues targets
    for epilogues in on off; do
        for targets in all-linear q; do
            ROW_STEPS=10 train_row "lora-$targets-epilogues-$epilogues" --lora-targets "$targets" \
                --epilogues "$epilogues"
        done
    done
}

full_stage() {
    ROW_ADAPTERS="" ROW_EVAL=4 train_row full-w7
    stamp "full: PyTorch eager W7"
    python3 scripts/torch_reference.py --workload w7 --mode eager >"$WORK/torch-w7.log" 2>&1
    local rc=$?
    cat "$WORK/torch-w7.log" >>"$LOG"
    python3 - "$WORK/torch-w7.log" "$rc" <<'EOF' | tee -a "$OUTJ"
import json, sys
log, rc = open(sys.argv[1]).read().strip().splitlines(), int(sys.argv[2])
print(json.dumps({"check": "torch-w7-eager", "rc": rc, "tail": log[-3:]}))
EOF
}

for stage in $STAGES; do
    case $stage in
    peft) peft_stage || stamp "peft stage failed (see $LOG)" ;;
    memory) memory_stage ;;
    context) context_stage ;;
    fusion) fusion_stage ;;
    full) full_stage ;;
    *) echo "unknown stage $stage (peft, memory, context, fusion, full)" >&2 ;;
    esac
done
stamp "done"
