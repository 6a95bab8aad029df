"""PyTorch eager reference for a `stepgraph train` run: the same model folder,
dtype, batch and sequence length, AdamW, measured as docs/benchmarks.md
describes (median step time after warm-up, peak allocated / reserved memory).

    python3 scripts/torch_train_reference.py --model DIR --dtype bf16 --batch 8 --seq 1024 \
        [--micro-batches 1] [--max-grad-norm 0] [--iters 10] [--warmup 3] [--mode eager|compile|reduce-overhead]

Prints one line `RESULT {json}`. Token ids are random (the step's time and
memory do not depend on their values); `labels = input_ids` as `transformers`
shifts them. With --micro-batches k each step runs k forward/backward passes
of `batch` rows, accumulating gradients, then one AdamW update, as
`stepgraph train --grad-accum k` does; with --max-grad-norm X > 0 the
gradients are clipped first (`clip_grad_norm_`), as `stepgraph train
--clip-grad-norm X` (default 1.0) does.
"""

import argparse
import json
import statistics
import time

import torch

MB = 1e6
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True, help="a Hugging Face model folder")
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    ap.add_argument("--batch", type=int, required=True)
    ap.add_argument("--seq", type=int, required=True)
    ap.add_argument("--micro-batches", type=int, default=1)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--weight-decay", type=float, default=0.0)
    ap.add_argument("--max-grad-norm", type=float, default=0.0)
    ap.add_argument("--mode", default="eager", choices=["eager", "compile", "reduce-overhead"])
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM

    dtype = DTYPES[args.dtype]
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype, attn_implementation="sdpa").cuda()
    model.train()
    fn = model
    if args.mode == "compile":
        fn = torch.compile(model)
    elif args.mode == "reduce-overhead":
        fn = torch.compile(model, mode="reduce-overhead")
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay, fused=True)
    vocab = model.config.vocab_size
    gen = torch.Generator(device="cuda").manual_seed(0)

    def step():
        total = 0.0
        for _ in range(args.micro_batches):
            ids = torch.randint(0, vocab, (args.batch, args.seq), device="cuda", generator=gen)
            loss = fn(input_ids=ids, labels=ids).loss / args.micro_batches
            loss.backward()
            total += loss.detach()
        if args.max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return total

    times, peaks, rpeaks, losses = [], [], [], []
    for i in range(args.warmup + args.iters):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        loss = step()
        torch.cuda.synchronize()
        if i >= args.warmup:
            times.append((time.perf_counter() - t0) * 1e3)
            peaks.append(torch.cuda.max_memory_allocated() / MB)
            rpeaks.append(torch.cuda.max_memory_reserved() / MB)
            losses.append(float(loss))
    tokens = args.batch * args.seq * args.micro_batches
    median = statistics.median(times)
    res = {
        "model": args.model, "dtype": args.dtype, "mode": args.mode, "batch": args.batch, "seq": args.seq,
        "micro_batches": args.micro_batches, "max_grad_norm": args.max_grad_norm, "torch": torch.__version__, "gpu": torch.cuda.get_device_name(0),
        "params": sum(p.numel() for p in model.parameters()),
        "peak_alloc_MB": max(peaks), "peak_reserved_MB": max(rpeaks),
        "step_ms_median": median, "step_ms_min": min(times), "tokens_per_s": tokens / (median / 1e3),
        "last_loss": losses[-1],
    }
    print("RESULT " + json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
