"""PyTorch side of stepgraph's training-step benchmarks (docs/benchmarks.md).

Builds one workload as a Hugging Face `transformers` model from a config
(nothing is downloaded; random weights and random token ids), runs its step
in one PyTorch mode and prints one line

    RESULT {"workload": ..., "mode": ..., "step_ms_median": ..., "peak_alloc_MB": ..., ...}

Usage (one mode per process, so the memory statistics of one mode do not
leak into another's):

    python3 scripts/torch_reference.py --workload w5 --mode eager
    python3 scripts/torch_reference.py --workload w1-bf16 --mode reduce-overhead
    python3 scripts/torch_reference.py --workload w2 --save /tmp/ref-w2 --iters 1 --warmup 0

Workloads (the same geometry, dtype, batch and loss as `stepgraph bench
--workload ID`; `w1-bf16` may be spelt `w1bf16`, `l8-2l` `l82l`):

    w1       open_llama_3b geometry, 10 layers, f32, 1 x 2048, loss = sum(logits)
    w1-bf16  W1 in bf16
    w2       Qwen2.5-7B geometry, 5 layers, hidden size 28 (head size 1), bf16, 1 x 4096, cross-entropy
    w3       tiny Llama (2 layers, width 256), f32, 1 x 256, loss = sum(logits)
    w5       open_llama_3b (26 layers), bf16, 4 x 2048, cross-entropy, AdamW
    l8-2l    Meta-Llama-3-8B with 2 layers, bf16, 1 x 4096, as w5
    g3-1b    Gemma-3-1B (text), bf16, 1 x 8192, as w5
    q3moe-4l Qwen3-30B-A3B with 4 layers (128 experts, 8 per token), bf16,
             1 x 4096, as w5
    w7       Meta-Llama-3-8B (32 layers), bf16, 1 x 4096, cross-entropy, gradient
             clipping at 1.0, AdamW (about 105 GB in eager mode; --checkpointing
             recomputes each layer in backward to fit a smaller GPU)

Modes: `eager`, `compile` (torch.compile's default) and `reduce-overhead`
(torch.compile with CUDA graph trees).

Measurement: --warmup steps (default 3), then --iters timed steps (default
10), each with the device synchronised before and after; the step time is
the median (and min) of the timed steps, the memory the largest
`torch.cuda.max_memory_allocated` / `max_memory_reserved` of a timed step
(MB = 1e6 bytes). Under CUDA graph trees "allocated" leaves out the graph
pool: compare reserved there.

`--save DIR` first runs one step without an optimizer update on fresh
weights and writes what `stepgraph compare --reference DIR` reads:

    config.json          the Hugging Face config
    weights.safetensors  the state dict before the step, Hugging Face names
    io.safetensors       `input_ids` (int64 [batch, seq]) and `loss` ([1])
    grads.safetensors    every parameter's gradient of that step, Hugging Face names

Other scripts import this module: `build(name)` returns `(model, ids, step)`,
where `step(fn)` runs one step through `fn` (the model or its compiled
form) and returns the loss, and `WORKLOADS[name]` is the tuple
`(config builder, dtype, batch, seq, loss, optimizer)`.
"""

import argparse
import json
import os
import statistics
import time

import torch

MB = 1e6


def canonical(name):
    """A workload's name without hyphens, lower case: `w1-bf16` and `w1bf16` are one."""
    return name.replace("-", "").replace("_", "").lower()


class Workloads(dict):
    """A dict whose keys are looked up by `canonical` name."""

    def __getitem__(self, key):
        return super().__getitem__(canonical(key))

    def __setitem__(self, key, value):
        super().__setitem__(canonical(key), value)

    def __contains__(self, key):
        return super().__contains__(canonical(key))


def llama_config(layers, width, heads, mlp, vocab=32000, kv_heads=None, rope_theta=10000.0,
                 rms_eps=1e-6, max_positions=2048):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab, hidden_size=width, intermediate_size=mlp, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads or heads,
        max_position_embeddings=max_positions, rms_norm_eps=rms_eps, rope_theta=rope_theta,
        tie_word_embeddings=False, attention_bias=False, mlp_bias=False, hidden_act="silu",
    )


def open_llama_3b(layers):
    return llama_config(layers, 3200, 32, 8640)


def llama3_8b(layers):
    return llama_config(layers, 4096, 32, 14336, vocab=128256, kv_heads=8, rope_theta=500000.0,
                        rms_eps=1e-5, max_positions=8192)


def qwen25_7b_head_size_1():
    """Qwen2.5-7B's geometry with 5 layers and the hidden size cut to the
    number of heads (28), so each head is one wide."""
    from transformers import Qwen2Config

    cfg = Qwen2Config(
        vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=5,
        num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=32768,
        rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False, hidden_act="silu",
    )
    cfg.hidden_size = cfg.num_attention_heads
    return cfg


def gemma3_1b():
    """Gemma-3-1B's text geometry: 26 layers of 4 query heads and 1 kv head
    of 256, sliding windows of 512 on five layers of every six (their RoPE
    base 10,000, the global layers' 1,000,000), a 262,144-token tied head."""
    from transformers import Gemma3TextConfig

    cfg = Gemma3TextConfig(
        vocab_size=262144, hidden_size=1152, intermediate_size=6912, num_hidden_layers=26,
        num_attention_heads=4, num_key_value_heads=1, head_dim=256, max_position_embeddings=32768,
        rms_norm_eps=1e-6, query_pre_attn_scalar=256, sliding_window=512, tie_word_embeddings=True,
        hidden_activation="gelu_pytorch_tanh", final_logit_softcapping=None, attn_logit_softcapping=None,
    )
    # transformers 5 takes both RoPE bases in `rope_parameters`, 4 in two keys.
    if hasattr(cfg, "rope_parameters") and isinstance(cfg.rope_parameters, dict) and \
            "full_attention" in cfg.rope_parameters:
        cfg.rope_parameters["full_attention"]["rope_theta"] = 1000000.0
        cfg.rope_parameters["sliding_attention"]["rope_theta"] = 10000.0
    else:
        cfg.rope_theta, cfg.rope_local_base_freq = 1000000.0, 10000.0
    return cfg


def qwen3_30b_a3b(layers):
    """Qwen3-30B-A3B's geometry with `layers` layers: width 2048, 32 query
    heads and 4 kv heads of 128 with per-head q/k norms, 128 experts of
    width 768 per layer, 8 per token, their probabilities renormalised."""
    from transformers import Qwen3MoeConfig

    cfg = Qwen3MoeConfig(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=layers,
        num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=40960, rms_norm_eps=1e-6,
        moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False, output_router_logits=False,
    )
    # transformers 5 derives the head size from the width unless told.
    cfg.head_dim = 128
    if hasattr(cfg, "rope_parameters") and isinstance(cfg.rope_parameters, dict):
        cfg.rope_parameters["rope_theta"] = 1000000.0
    else:
        cfg.rope_theta = 1000000.0
    return cfg


# name: (config builder, dtype, batch, seq, loss, optimizer)
#   loss: "sum" (sum of the logits) or "ce" (cross-entropy, labels = input ids)
#   optimizer: None (gradients only), "adamw", or "adamw-clip" (global norm clipped to 1.0 first)
WORKLOADS = Workloads()
WORKLOADS["w1"] = (lambda: open_llama_3b(10), torch.float32, 1, 2048, "sum", None)
WORKLOADS["w1-bf16"] = (lambda: open_llama_3b(10), torch.bfloat16, 1, 2048, "sum", None)
WORKLOADS["w2"] = (qwen25_7b_head_size_1, torch.bfloat16, 1, 4096, "ce", None)
WORKLOADS["w3"] = (lambda: llama_config(2, 256, 4, 688), torch.float32, 1, 256, "sum", None)
WORKLOADS["w5"] = (lambda: open_llama_3b(26), torch.bfloat16, 4, 2048, "ce", "adamw")
WORKLOADS["l8-2l"] = (lambda: llama3_8b(2), torch.bfloat16, 1, 4096, "ce", "adamw")
WORKLOADS["w7"] = (lambda: llama3_8b(32), torch.bfloat16, 1, 4096, "ce", "adamw-clip")
WORKLOADS["g3-1b"] = (gemma3_1b, torch.bfloat16, 1, 8192, "ce", "adamw")
WORKLOADS["q3moe-4l"] = (lambda: qwen3_30b_a3b(4), torch.bfloat16, 1, 4096, "ce", "adamw")


def build(name, seed=0, checkpointing=False, device="cuda"):
    """The workload's model on `device`, its token ids and its step.

    Weights are initialised in float32 by transformers' own initialiser and
    then rounded to the workload's dtype, so a float32 run of the same seed
    holds the same values before rounding."""
    from transformers import AutoModelForCausalLM

    make_cfg, dtype, batch, seq, loss_kind, optimizer = WORKLOADS[name]
    cfg = make_cfg()
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg).to(dtype)
        ids = torch.randint(0, cfg.vocab_size, (batch, seq), dtype=torch.int64)
    if checkpointing:
        model.gradient_checkpointing_enable()
    model.train()
    opt = None
    if optimizer in ("adamw", "adamw-clip"):
        # fused: one kernel family for every parameter, as PyTorch users run it;
        # bf16 parameters are updated in place (no float32 master copy).
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=True)

    def step(fn, update=True):
        if loss_kind == "sum":
            loss = fn(input_ids=ids).logits.sum()
        else:
            loss = fn(input_ids=ids, labels=ids).loss
        loss.backward()
        if opt is not None and update:
            if optimizer == "adamw-clip":
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
        return loss

    return model, ids, step


def compiled(model, mode):
    if mode == "eager":
        return model
    if mode == "compile":
        return torch.compile(model)
    if mode == "reduce-overhead":
        return torch.compile(model, mode="reduce-overhead")
    raise ValueError(f"unknown mode {mode!r}")


def save_reference(model, ids, step, folder):
    """One step without an update; what `stepgraph compare --reference` reads."""
    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    save_file({k: v.detach().contiguous() for k, v in model.state_dict().items()},
              os.path.join(folder, "weights.safetensors"))
    model.config.to_json_file(os.path.join(folder, "config.json"))
    model.zero_grad(set_to_none=True)
    loss = step(model, update=False)
    grads = {}
    for name, p in model.named_parameters():
        if p.grad is None:
            raise SystemExit(f"the step left no gradient for {name}")
        grads[name] = p.grad.contiguous()
    save_file(grads, os.path.join(folder, "grads.safetensors"))
    save_file({"input_ids": ids.contiguous(), "loss": loss.detach().reshape(1).contiguous()},
              os.path.join(folder, "io.safetensors"))
    model.zero_grad(set_to_none=True)
    return loss.item()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", required=True, help="w1, w1-bf16, w2, w3, w5, l8-2l, w7, g3-1b or q3moe-4l")
    ap.add_argument("--mode", default="eager", choices=["eager", "compile", "reduce-overhead"])
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    ap.add_argument("--iters", type=int, default=10, help="timed steps (default 10)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--checkpointing", action="store_true",
                    help="recompute each layer in backward (transformers' gradient checkpointing)")
    ap.add_argument("--device", default="cuda",
                    help="torch device (default cuda; cpu runs the small workloads for checking --save, "
                         "with no memory statistics)")
    ap.add_argument("--save", metavar="DIR",
                    help="write config, weights, input ids, loss and gradients of one step here first")
    args = ap.parse_args()
    if args.workload not in WORKLOADS:
        ap.error(f"unknown workload {args.workload!r}; known: w1 w1-bf16 w2 w3 w5 l8-2l w7 g3-1b q3moe-4l")
    if args.iters < 0 or args.warmup < 0:
        ap.error("--iters and --warmup must not be negative")

    import transformers

    model, ids, step = build(args.workload, seed=args.seed, checkpointing=args.checkpointing, device=args.device)
    cuda = torch.device(args.device).type == "cuda"

    def sync():
        if cuda:
            torch.cuda.synchronize()

    _, dtype, batch, seq, loss_kind, optimizer = WORKLOADS[args.workload]
    res = {
        "workload": canonical(args.workload), "mode": args.mode,
        "dtype": str(dtype).replace("torch.", ""), "batch": batch, "seq": seq,
        "loss_kind": loss_kind, "optimizer": optimizer, "checkpointing": args.checkpointing,
        "torch": torch.__version__, "transformers": transformers.__version__,
        "gpu": torch.cuda.get_device_name(torch.device(args.device)) if cuda else None,
        "params": sum(p.numel() for p in model.parameters()),
    }
    if args.save:
        res["save"] = args.save
        res["saved_loss"] = save_reference(model, ids, step, args.save)

    fn = compiled(model, args.mode)
    mark_step = getattr(getattr(torch, "compiler", None), "cudagraph_mark_step_begin", None)
    times, alloc, reserved, losses = [], [], [], []
    for i in range(args.warmup + args.iters):
        model.zero_grad(set_to_none=True)
        if args.mode == "reduce-overhead" and mark_step is not None:
            mark_step()
        sync()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        loss = step(fn)
        sync()
        elapsed = (time.perf_counter() - t0) * 1e3
        if i >= args.warmup:
            times.append(elapsed)
            if cuda:
                alloc.append(torch.cuda.max_memory_allocated() / MB)
                reserved.append(torch.cuda.max_memory_reserved() / MB)
            losses.append(float(loss.detach().float().item()))
    if times:
        median = statistics.median(times)
        res.update({
            "warmup": args.warmup, "iters": args.iters,
            "step_ms_median": median, "step_ms_min": min(times),
            "tokens_per_s": batch * seq / (median / 1e3),
            "peak_alloc_MB": max(alloc) if alloc else None,
            "peak_reserved_MB": max(reserved) if reserved else None,
            "loss_first": losses[0], "loss_last": losses[-1],
        })
    print("RESULT " + json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
