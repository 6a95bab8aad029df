"""The Hugging Face + peft reference for adapter training: a Llama model of
a named geometry with random weights, LoRA of rank R on all seven linear
layers (q, k, v, o, gate, up, down), gradient checkpointing and SDPA
attention, AdamW on the adapters; the time of a training step and the
device memory PyTorch allocated and reserved. On a CUDA machine with
PyTorch, transformers and peft:

    python3 scripts/peft_reference.py [--geometry llama-3-8b] [--seq 4096] [--batch 1] \
        [--rank 16] [--alpha 32] [--steps 8] [--warmup 2]

Prints one `RESULT {json}` line: step_ms_median, tokens_per_s,
peak_alloc_MB, peak_reserved_MB.
"""

import argparse
import json
import time

import torch

GEOMETRIES = {
    # meta-llama/Meta-Llama-3-8B's config.json values.
    "llama-3-8b": dict(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
        rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
    ),
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--geometry", default="llama-3-8b", choices=sorted(GEOMETRIES))
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--alpha", type=float, default=32.0)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args()

    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    row = {"geometry": args.geometry, "seq": args.seq, "batch": args.batch, "rank": args.rank,
           "torch": torch.__version__, "gpu": torch.cuda.get_device_name(0)}
    config = LlamaConfig(**GEOMETRIES[args.geometry], attn_implementation="sdpa")
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config)
    torch.set_default_dtype(torch.float32)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    model.config.use_cache = False
    lora = LoraConfig(r=args.rank, lora_alpha=args.alpha, lora_dropout=0.0, bias="none", task_type="CAUSAL_LM",
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    model = get_peft_model(model, lora)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    row["trained_params"] = sum(p.numel() for p in params)
    opt = torch.optim.AdamW(params, lr=2e-4, weight_decay=0.0)
    g = torch.Generator(device="cuda").manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (args.batch, args.seq), device="cuda", generator=g)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for it in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if it >= args.warmup:
            times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    median = times[len(times) // 2]
    row.update({
        "step_ms_median": median, "step_ms_min": times[0],
        "tokens_per_s": args.batch * args.seq / (median / 1e3),
        "peak_alloc_MB": torch.cuda.max_memory_allocated() / 1e6,
        "peak_reserved_MB": torch.cuda.max_memory_reserved() / 1e6,
        "loss_last": loss.item(),
    })
    print("RESULT " + json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
