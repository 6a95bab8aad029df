"""PyTorch side of the W6 generation benchmark (docs/benchmarks.md):
`transformers` `generate` on the open_llama_3b geometry (26 layers) in bf16
with random weights, random prompts of --prompt tokens (default 512), greedy,
--new new tokens (default 256) with EOS ignored.

    python3 scripts/torch_generate.py --mode static --batch 1 16
    python3 scripts/torch_generate.py --mode eager --batch 1 16

Modes:
    eager             the dynamic cache, no compilation
    static            the static cache; transformers compiles the decode
                      forward itself with torch.compile and CUDA graphs
    static-nocompile  the static cache without compilation

Prints one line `RESULT {json}` per batch size with
    prefill_ms          generate() of one new token: the prompt's forward and
                        the first token (time to first token)
    decode_ms_per_step  (t(new + 1 tokens) - t(1 token)) / new: one new token
                        for every sequence of the batch, the steady state
    tokens_per_s        batch * new / that time
    peak_alloc_MB, peak_reserved_MB   torch.cuda.max_memory_allocated /
                        reserved over the timed runs (MB = 1e6 bytes)
Each time is the median of --reps runs (default 3) after --warmup full-length
runs (default 2; the first one compiles in `static` mode), the device
synchronised around each run.
"""

import argparse
import json
import statistics
import time

import torch

MB = 1e6


def build(seed=0):
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(
        vocab_size=32000, hidden_size=3200, intermediate_size=8640, num_hidden_layers=26,
        num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=2048,
        rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False, hidden_act="silu",
        attention_bias=False, mlp_bias=False,
    )
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)
    model.eval()
    return model, cfg


def median_ms(fn, reps):
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", default="static", choices=["eager", "static", "static-nocompile"])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16], help="batch sizes, one RESULT each")
    ap.add_argument("--prompt", type=int, default=512, help="prompt tokens per sequence")
    ap.add_argument("--new", type=int, default=256, help="new tokens per sequence")
    ap.add_argument("--warmup", type=int, default=2, help="untimed full-length runs per batch size")
    ap.add_argument("--reps", type=int, default=3, help="timed runs of each length")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.new < 1 or args.prompt < 1 or args.reps < 1:
        ap.error("--new, --prompt and --reps must be at least 1")

    import transformers

    model, cfg = build(args.seed)
    for batch in args.batch:
        ids = torch.randint(0, cfg.vocab_size, (batch, args.prompt), device="cuda")
        mask = torch.ones_like(ids)
        options = dict(do_sample=False, eos_token_id=None, pad_token_id=0, attention_mask=mask)
        if args.mode != "eager":
            options["cache_implementation"] = "static"
        if args.mode == "static-nocompile":
            options["disable_compile"] = True

        def generate(n):
            return lambda: model.generate(ids, max_new_tokens=n, min_new_tokens=n, **options)

        with torch.no_grad():
            for _ in range(args.warmup):
                generate(args.new + 1)()
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            first = median_ms(generate(1), args.reps)
            full = median_ms(generate(args.new + 1), args.reps)
        decode = (full - first) / args.new
        res = {
            "workload": "w6", "mode": args.mode, "batch": batch, "prompt": args.prompt, "new": args.new,
            "torch": torch.__version__, "transformers": transformers.__version__,
            "gpu": torch.cuda.get_device_name(0),
            "prefill_ms": first, "decode_ms_per_step": decode,
            "tokens_per_s": batch / (decode / 1e3) if decode > 0 else None,
            "peak_alloc_MB": torch.cuda.max_memory_allocated() / MB,
            "peak_reserved_MB": torch.cuda.max_memory_reserved() / MB,
        }
        print("RESULT " + json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
