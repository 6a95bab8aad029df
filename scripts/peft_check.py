"""stepgraph's adapters against `peft`'s, on a CUDA machine with PyTorch,
transformers, peft and safetensors (scripts/gpu-lora.sh runs it):

    python3 scripts/peft_check.py make-base --out DIR [--family llama|mixtral|qwen3_moe]
        a tiny folder of that family (f32, random weights, no tokenizer)
        whose config sets what changes the math away from the defaults:
        grouped-query heads, RoPE base, RMSNorm epsilon, untied head; for
        the mixtures of experts 4 experts, 2 per token (Qwen3-MoE: a head
        size other than width / heads and a dense second layer), whose
        adapters on the experts peft holds through `target_parameters`;
    python3 scripts/peft_check.py make-adapter --base DIR --out DIR [--targets all-linear|q_proj,v_proj,...]
        an adapter folder made by peft itself over the base (rank 4, alpha 8,
        every matrix drawn at random so the adapters change the model), for
        `stepgraph hf --adapter` to read; on a mixture of experts peft's
        `all-linear` adapts the experts (their fused gate and up pair at
        twice the rank) and the router;
    python3 scripts/peft_check.py ids --out FILE [--vocab N]
        `input_ids` [2, 24] for `stepgraph hf --ids`;
    python3 scripts/peft_check.py compare --base DIR --adapter DIR [--merged DIR] \
        --ids FILE --logits FILE --grads FILE --dtype f32|bf16
        loads the base with transformers and stepgraph's adapter folder with
        `PeftModel.from_pretrained`, and compares peft's logits with
        stepgraph's (`hf --adapter --logits-out`), the adapters' gradients of
        one backward pass with stepgraph's (`hf --adapter --grads-out`), and
        the merged folder (`train --merge`) loaded by transformers with
        peft's logits. Prints one `RESULT {json}` line with the largest
        differences relative to the largest magnitude and whether each is
        within the bound (f32: 1e-5; bf16 gradients: 3e-2).
"""

import argparse
import json
import sys

import torch


def make_base(out, family):
    import transformers

    torch.manual_seed(0)
    common = dict(
        vocab_size=320, hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=256, rope_theta=50000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
        torch_dtype="float32",
    )
    if family == "llama":
        config = transformers.LlamaConfig(intermediate_size=320, attention_bias=False, mlp_bias=False, **common)
        cls = transformers.LlamaForCausalLM
    elif family == "mixtral":
        config = transformers.MixtralConfig(intermediate_size=96, num_local_experts=4, num_experts_per_tok=2, **common)
        cls = transformers.MixtralForCausalLM
    else:
        config = transformers.Qwen3MoeConfig(
            intermediate_size=192, moe_intermediate_size=96, num_experts=4, num_experts_per_tok=2,
            norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1], head_dim=48, **common,
        )
        cls = transformers.Qwen3MoeForCausalLM
    model = cls(config).to(torch.float32)
    # Norm weights away from one, so a wrong norm shows.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif "experts" in name or name.endswith("mlp.gate.weight"):
                # A wider draw than the default, so the router's choices
                # are clear and the experts' adapters matter.
                p.normal_(0.0, 0.1)
    model.save_pretrained(out, safe_serialization=True)


def make_adapter(base, out, targets):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(2)
    model = AutoModelForCausalLM.from_pretrained(base, torch_dtype=torch.float32)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=targets if targets == "all-linear" else targets.split(","))
    model = get_peft_model(model, config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, 0.05)
    model.save_pretrained(out)


def make_ids(out, vocab):
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(1)
    save_file({"input_ids": torch.randint(0, vocab, (2, 24), generator=g, dtype=torch.int64)}, out)


def rel(a, b):
    a, b = a.double().flatten(), b.double().flatten()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def compare(args):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    dtype = {"f32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    ids = load_file(args.ids)["input_ids"].to(dev)
    base = AutoModelForCausalLM.from_pretrained(args.base, torch_dtype=dtype, attn_implementation="eager").to(dev)
    model = PeftModel.from_pretrained(base, args.adapter, is_trainable=True).to(dev)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    ours_logits = load_file(args.logits)
    ours_grads = load_file(args.grads)
    row = {"dtype": args.dtype, "torch": torch.__version__}
    row["logits_rel"] = rel(ours_logits["logits"].to(dev), out.logits.detach().float())
    row["loss_ours"], row["loss_peft"] = ours_logits["loss"].item(), out.loss.item()
    worst, compared = 0.0, 0
    for name, p in model.named_parameters():
        if "lora_" not in name:
            continue
        key = name.replace(".default", "")
        if key not in ours_grads:
            row.setdefault("missing", []).append(key)
            continue
        worst = max(worst, rel(ours_grads[key].to(dev), p.grad.float()))
        compared += 1
    row["grads_rel"], row["grads_compared"] = worst, compared
    merged_ok = True
    if args.merged:
        merged = AutoModelForCausalLM.from_pretrained(args.merged, torch_dtype=dtype, attn_implementation="eager")
        with torch.no_grad():
            ours_merged = merged.to(dev)(input_ids=ids).logits.float()
            row["merged_rel"] = rel(ours_merged, out.logits.detach().float())
            # Merging changes rounding (W + s·B·A in one product instead of
            # two), and a mixture of experts routes on rounded scores, so the
            # merged folder is held to peft's own merge of the same adapter,
            # and the unmerged model only where peft's merge meets it too.
            peft_merged = model.merge_and_unload()(input_ids=ids).logits.float()
            row["peft_merge_rel"] = rel(peft_merged, out.logits.detach().float())
            row["merged_vs_peft_merge_rel"] = rel(ours_merged, peft_merged)
        bound = 1e-5 if args.dtype == "f32" else 3e-2
        merged_ok = row["merged_vs_peft_merge_rel"] <= bound and row["merged_rel"] <= max(bound, 2 * row["peft_merge_rel"])
    logits_bound = 1e-5 if args.dtype == "f32" else 3e-2
    grads_bound = 1e-5 if args.dtype == "f32" else 3e-2
    row["ok"] = (
        row["logits_rel"] <= logits_bound and worst <= grads_bound and compared > 0 and "missing" not in row
        and merged_ok
    )
    print("RESULT " + json.dumps(row), flush=True)
    return 0 if row["ok"] else 1


def main():
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("make-base")
    b.add_argument("--out", required=True)
    b.add_argument("--family", choices=["llama", "mixtral", "qwen3_moe"], default="llama")
    a = sub.add_parser("make-adapter")
    a.add_argument("--base", required=True)
    a.add_argument("--out", required=True)
    a.add_argument("--targets", default="all-linear")
    i = sub.add_parser("ids")
    i.add_argument("--out", required=True)
    i.add_argument("--vocab", type=int, default=320)
    c = sub.add_parser("compare")
    for flag in ["--base", "--adapter", "--ids", "--logits", "--grads"]:
        c.add_argument(flag, required=True)
    c.add_argument("--merged", default=None)
    c.add_argument("--dtype", choices=["f32", "bf16"], default="f32")
    args = ap.parse_args()
    if args.cmd == "make-base":
        make_base(args.out, args.family)
    elif args.cmd == "make-adapter":
        make_adapter(args.base, args.out, args.targets)
    elif args.cmd == "ids":
        make_ids(args.out, args.vocab)
    else:
        sys.exit(compare(args))


if __name__ == "__main__":
    main()
