#!/usr/bin/env python3
"""Hugging Face folders through stepgraph and back, checked against PyTorch.

For each supported family (llama, mistral, qwen2, qwen3, olmo2, phi3, gemma2,
gemma3_text, mixtral, qwen2_moe, qwen3_moe, gpt_neox; tied and untied heads; Llama-3.x,
linear and LongRoPE scaling; sliding windows shorter than the sequence;
soft-caps; mixtures of experts with and without renormalised routing and a
dense layer among sparse ones; sharded and single-file), on a machine with
PyTorch and transformers 5.x (no network needed): a GPU machine with
`--backend cuda`, or any machine with `--backend cpu`:

1. build a small random model with `transformers` (f32, eager attention) and
   `save_pretrained` it (sharded for some variants);
2. run `stepgraph hf --init-from SRC --ids IDS --logits-out --grads-out --out OUT`:
   stepgraph loads the folder, computes logits, loss and gradients on IDS,
   and writes the model back to OUT;
3. check that stepgraph's logits and loss match PyTorch's (f32: relative
   L2 error <= 1e-5) and its gradients PyTorch's (<= 1e-4 per tensor), that
   `AutoModelForCausalLM.from_pretrained(OUT)` loads as it is, holds exactly
   the source's tensors and gives stepgraph's logits (<= 1e-5);
4. greedy generation: `stepgraph generate --init-from SRC` from two random
   prompts gives the tokens `transformers`' `generate` gives (32 new
   tokens each, end-of-sequence ignored).

Usage: python3 scripts/hf_roundtrip.py [--stepgraph target/release/stepgraph]
       [--backend cpu|cuda] [--work DIR] [--only NAME ...]
Exits non-zero if any check fails, printing one line per check.
"""

import argparse
import inspect
import json
import os
import subprocess
import sys
import tempfile

import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM

LOGITS_TOL = 1e-5
# Module names whose checkpoint name differs (transformers >= 5 renamed
# GPT-NeoX's `embed_out` module to `lm_head`; its checkpoints keep `embed_out`).
CHECKPOINT_ALIASES = {"lm_head.weight": "embed_out.weight"}
LOSS_TOL = 1e-5
GRAD_TOL = 1e-4

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # Short, so that a 16-wide head has pairs in every band of the adjustment.
    "original_max_position_embeddings": 32,
}


# LongRoPE on 6 rotated pairs (a 16-wide head at 0.75): the 24-token batch
# is past the original context of 16 (the long factors), a generation from
# 8 tokens crosses it (short, then long), and the attention factor comes
# from 64 / 16.
LONGROPE = {
    "rope_type": "longrope",
    "short_factor": [1.0, 1.1, 1.3, 1.7, 2.2, 3.0],
    "long_factor": [1.5, 2.5, 4.0, 7.0, 11.0, 19.0],
}


def variants():
    """(name, model_type, config kwargs, max_shard_size or None)."""
    llama_like = dict(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=80,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
    )
    neox = dict(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=128,
        layer_norm_eps=1e-5,
        hidden_act="gelu",
        use_parallel_residual=True,
        # transformers 4 reads rotary_pct/rotary_emb_base, 5 partial_rotary_factor/rope_theta.
        rotary_pct=0.25,
        partial_rotary_factor=0.25,
        rotary_emb_base=10000,
        rope_theta=10000.0,
        attention_dropout=0.0,
        hidden_dropout=0.0,
    )
    gemma = dict(
        vocab_size=96,
        hidden_size=72,
        intermediate_size=80,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,
        query_pre_attn_scalar=20,
        max_position_embeddings=128,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        sliding_window=5,
        hidden_activation="gelu_pytorch_tanh",
        # No pad id: PyTorch's embedding gives a pad row no gradient, and
        # the random ids here use every row.
        pad_token_id=None,
        eos_token_id=1,
        bos_token_id=2,
    )
    gemma3_layers = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]
    return [
        ("llama", "llama", dict(llama_like, tie_word_embeddings=False), None),
        ("llama-tied-sharded", "llama", dict(llama_like, tie_word_embeddings=True), "40KB"),
        ("llama3-rope", "llama", dict(llama_like, tie_word_embeddings=False, rope_scaling=LLAMA3_ROPE), None),
        ("mistral", "mistral", dict(llama_like, tie_word_embeddings=False, sliding_window=None), "40KB"),
        ("qwen2", "qwen2", dict(llama_like, tie_word_embeddings=False, use_sliding_window=False), None),
        ("qwen2-tied", "qwen2", dict(llama_like, tie_word_embeddings=True, use_sliding_window=False), "40KB"),
        # Qwen3: per-head q/k norms, a head_dim apart from hidden / heads.
        ("qwen3", "qwen3", dict(llama_like, head_dim=24, rms_norm_eps=1e-5, rope_theta=1e6,
                                tie_word_embeddings=False, use_sliding_window=False), None),
        ("qwen3-tied-sharded", "qwen3", dict(llama_like, head_dim=24, tie_word_embeddings=True,
                                             use_sliding_window=False), "40KB"),
        # OLMo 2: norms over all of q and k, norms after the sublayers.
        ("olmo2", "olmo2", dict(llama_like, rms_norm_eps=1e-5, tie_word_embeddings=False), None),
        ("olmo2-tied-sharded", "olmo2", dict(llama_like, tie_word_embeddings=True), "40KB"),
        # Phi-3: q/k/v and gate/up stacked, RoPE on part of each head, a
        # window shorter than the sequence. Its config's default pad and eos
        # ids (32000) lie outside a tiny vocabulary, and a pad id makes
        # PyTorch's embedding leave that row without a gradient, which
        # stepgraph's does not: no pad id, as the other variants.
        ("phi3", "phi3", dict(llama_like, rms_norm_eps=1e-5, partial_rotary_factor=0.75, sliding_window=7,
                              tie_word_embeddings=False, pad_token_id=None, eos_token_id=1, bos_token_id=2), None),
        ("phi3-tied-sharded", "phi3", dict(llama_like, tie_word_embeddings=True, pad_token_id=None, eos_token_id=1,
                                           bos_token_id=2), "40KB"),
        ("phi3-longrope", "phi3", dict(llama_like, rms_norm_eps=1e-5, partial_rotary_factor=0.75,
                                       max_position_embeddings=64, original_max_position_embeddings=16,
                                       rope_scaling=LONGROPE, tie_word_embeddings=False, pad_token_id=None,
                                       eos_token_id=1, bos_token_id=2), None),
        # Mistral with a window shorter than the 24-token sequence.
        ("mistral-window", "mistral", dict(llama_like, tie_word_embeddings=False, sliding_window=5), None),
        # Gemma 2: offset norms before and after each sublayer, GeGLU, scaled
        # embeddings, query_pre_attn_scalar apart from head_dim, head_dim
        # apart from hidden / heads, a window shorter than the sequence on
        # the sliding layers, soft-caps that bite.
        ("gemma2", "gemma2", dict(gemma, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                                  attn_logit_softcapping=1.0, final_logit_softcapping=1.5,
                                  tie_word_embeddings=True), None),
        ("gemma2-untied-sharded", "gemma2", dict(gemma, layer_types=["sliding_attention", "full_attention",
                                                                     "full_attention"],
                                                 attn_logit_softcapping=2.0, final_logit_softcapping=3.0,
                                                 tie_word_embeddings=False), "40KB"),
        # Gemma 3's language model: per-head q/k norms, two RoPE bases (the
        # global layers' scaled linearly), two sliding layers to one global.
        ("gemma3_text", "gemma3_text", dict(gemma, num_hidden_layers=4, layer_types=gemma3_layers,
                                            rope_theta=1e6, rope_local_base_freq=100.0,
                                            rope_scaling={"rope_type": "linear", "factor": 2.0},
                                            tie_word_embeddings=True), None),
        ("gemma3_text-capped-sharded", "gemma3_text", dict(gemma, num_hidden_layers=4, layer_types=gemma3_layers,
                                                           rope_theta=1e4, rope_local_base_freq=500.0,
                                                           attn_logit_softcapping=1.0,
                                                           final_logit_softcapping=1.5,
                                                           tie_word_embeddings=True), "40KB"),
        # Mixtral: 4 experts, 2 per token, renormalised, a window shorter
        # than the sequence, the load-balancing loss in the training loss.
        # Qwen3-MoE: per-head q/k norms, 6 experts of their own width, 2 per
        # token as the softmax gives them, layer 1 of three dense.
        ("mixtral", "mixtral", dict(llama_like, num_local_experts=4, num_experts_per_tok=2, sliding_window=5,
                                    tie_word_embeddings=False, router_jitter_noise=0.0,
                                    output_router_logits=True, router_aux_loss_coef=0.05), None),
        ("mixtral-sharded", "mixtral", dict(llama_like, num_local_experts=3, num_experts_per_tok=2,
                                            sliding_window=None, tie_word_embeddings=True), "40KB"),
        ("qwen3_moe", "qwen3_moe", dict(llama_like, head_dim=24, num_hidden_layers=3, num_experts=6,
                                        num_experts_per_tok=2, moe_intermediate_size=40, norm_topk_prob=False,
                                        mlp_only_layers=[1], decoder_sparse_step=1, use_sliding_window=False,
                                        tie_word_embeddings=False), None),
        ("qwen3_moe-normalized-sharded", "qwen3_moe", dict(llama_like, head_dim=24, num_experts=4,
                                                           num_experts_per_tok=2, moe_intermediate_size=32,
                                                           norm_topk_prob=True, use_sliding_window=False,
                                                           tie_word_embeddings=False), "40KB"),
        # Qwen2-MoE: q/k/v biases, a shared expert with its sigmoid gate
        # beside 4 routed experts, every other layer sparse.
        ("qwen2_moe", "qwen2_moe", dict(llama_like, num_hidden_layers=4, num_experts=4, num_experts_per_tok=2,
                                        moe_intermediate_size=24, shared_expert_intermediate_size=56,
                                        decoder_sparse_step=2, norm_topk_prob=False, use_sliding_window=False,
                                        tie_word_embeddings=False), None),
        ("gpt_neox", "gpt_neox", dict(neox, tie_word_embeddings=False), None),
        ("gpt_neox-sequential-sharded", "gpt_neox", dict(neox, tie_word_embeddings=False, use_parallel_residual=False), "40KB"),
    ]


def make_config(model_type, kwargs):
    """The `transformers` config of `model_type` with `kwargs`, adapted to the
    installed version: transformers 5 takes RoPE (theta, partial rotary
    factor, scaling) in one `rope_parameters` dict, 4 in separate keys."""
    kwargs = dict(kwargs)
    scaling = kwargs.pop("rope_scaling", None)
    config_class = type(AutoConfig.for_model(model_type))
    params = inspect.signature(config_class.__init__).parameters
    accepts_any = any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params.values())
    if model_type == "gemma3_text" and "rope_parameters" in params:
        # transformers 5: one RoPE per layer type, the scaling on the global layers.
        full = dict(scaling or {"rope_type": "default"})
        full["rope_theta"] = kwargs.pop("rope_theta", 1e6)
        local = kwargs.pop("rope_local_base_freq", 10000.0)
        kwargs["rope_parameters"] = {
            "full_attention": full,
            "sliding_attention": {"rope_type": "default", "rope_theta": local},
        }
    elif "rope_parameters" in params:
        rope = dict(scaling or {"rope_type": "default"})
        rope["rope_theta"] = kwargs.get("rope_theta", 10000.0)
        if "partial_rotary_factor" in kwargs:
            rope["partial_rotary_factor"] = kwargs["partial_rotary_factor"]
        kwargs["rope_parameters"] = rope
        for key in ("rope_theta", "rotary_emb_base", "rotary_pct", "partial_rotary_factor"):
            if key not in params:
                kwargs.pop(key, None)
    elif scaling is not None:
        kwargs["rope_scaling"] = scaling
    if not accepts_any:
        kwargs = {k: v for k, v in kwargs.items() if k in params}
    config = config_class(**kwargs)
    config._attn_implementation = "eager"
    return config


def randomize(model, seed):
    """Weights larger than the default init, so every path matters in the
    comparison; norms near 1 (Gemma's, stored as offsets from 1, near 0),
    biases small but non-zero."""
    g = torch.Generator().manual_seed(seed)
    offset_norms = model.config.model_type.startswith("gemma")
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
            if "norm" in name and name.endswith("weight"):
                p.copy_((0.0 if offset_norms else 1.0) + 0.1 * noise)
            elif name.endswith("bias"):
                p.copy_(0.05 * noise)
            else:
                p.copy_(0.08 * noise)


def expert_grad(grads, pname, num_experts):
    """Our gradient of the transformers parameter `pname` when transformers
    holds a layer's experts fused (transformers 5: `experts.gate_up_proj`
    [E, 2F, D], `experts.down_proj` [E, D, F]) and stepgraph writes them as
    the checkpoints name them, one tensor per expert; None otherwise."""
    if not (pname.endswith("experts.gate_up_proj") or pname.endswith("experts.down_proj")):
        return None
    prefix = pname.rsplit("experts.", 1)[0]
    # Mixtral's checkpoints keep the experts under block_sparse_moe, w1 w3 w2.
    legacy = prefix.replace(".mlp.", ".block_sparse_moe.")
    names = {
        "gate": [f"{prefix}experts.{{e}}.gate_proj.weight", f"{legacy}experts.{{e}}.w1.weight"],
        "up": [f"{prefix}experts.{{e}}.up_proj.weight", f"{legacy}experts.{{e}}.w3.weight"],
        "down": [f"{prefix}experts.{{e}}.down_proj.weight", f"{legacy}experts.{{e}}.w2.weight"],
    }

    def expert(part, e):
        for pattern in names[part]:
            name = pattern.format(e=e)
            if name in grads:
                return grads[name]
        return None

    parts = ["gate", "up"] if pname.endswith("gate_up_proj") else ["down"]
    stacked = []
    for e in range(num_experts):
        got = [expert(part, e) for part in parts]
        if any(g is None for g in got):
            return None
        stacked.append(torch.cat(got, dim=0))
    return torch.stack(stacked)


def expert_names(grads, pname):
    """The per-expert names of ours that `expert_grad` used for `pname`."""
    prefix = pname.rsplit("experts.", 1)[0]
    legacy = prefix.replace(".mlp.", ".block_sparse_moe.")
    return {n for n in grads if n.startswith(prefix + "experts.") or n.startswith(legacy + "experts.")}


def rel(a, b):
    a = a.double()
    b = b.double()
    nb = b.norm().item()
    d = (a - b).norm().item()
    return d / nb if nb > 0 else (0.0 if d == 0 else float("inf"))


def version_below(version, floor):
    """Is the release `version` (like "5.17.0" or "5.25.0.dev0") older than `floor`?"""
    def parts(v):
        return [int(x) for x in v.split(".")[:2] if x.isdigit()]
    return parts(version) < parts(floor)


class Checks:
    def __init__(self):
        self.failed = []

    def check(self, name, ok, detail):
        print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)
        if not ok:
            self.failed.append(name)


def run_variant(checks, stepgraph, backend, work, name, model_type, kwargs, shard):
    src = os.path.join(work, name, "src")
    out = os.path.join(work, name, "out")
    os.makedirs(src, exist_ok=True)
    torch.manual_seed(0)
    config = make_config(model_type, kwargs)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").to(torch.float32)
    randomize(model, seed=len(name))
    if config.tie_word_embeddings:
        model.tie_weights()
    model.eval()
    save_kwargs = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(src, **save_kwargs)
    with open(os.path.join(src, "tokenizer_config.json"), "w") as f:
        json.dump({"model_max_length": 128, "roundtrip_marker": name}, f)
    sharded = os.path.exists(os.path.join(src, "model.safetensors.index.json"))
    if shard and not sharded:
        checks.check(f"{name} fixture", False, "save_pretrained wrote one file despite max_shard_size")

    ids = torch.randint(0, config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(7))
    ids_path = os.path.join(work, name, "ids.safetensors")
    save_file({"input_ids": ids.contiguous()}, ids_path)
    logits_path = os.path.join(work, name, "logits.safetensors")
    grads_path = os.path.join(work, name, "grads.safetensors")
    cmd = [
        stepgraph, "hf", "--init-from", src, "--ids", ids_path, "--logits-out", logits_path,
        "--grads-out", grads_path, "--out", out, "--max-shard-mb", "0.05", "--device", backend,
    ]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        checks.check(f"{name} stepgraph hf", False, result.stderr.strip() or result.stdout.strip())
        return
    print(result.stdout.strip())

    # PyTorch on the same weights and batch: labels=input_ids shifts inside transformers.
    model.zero_grad()
    ref = model(input_ids=ids, labels=ids)
    ref.loss.backward()
    ours = load_file(logits_path)
    e = rel(ours["logits"], ref.logits.detach())
    checks.check(f"{name} logits vs PyTorch", e <= LOGITS_TOL, f"rel {e:.3e} (tol {LOGITS_TOL})")
    e = rel(ours["loss"], ref.loss.detach().reshape(1))
    checks.check(f"{name} loss vs PyTorch", e <= LOSS_TOL, f"rel {e:.3e}: {ours['loss'].item():.8f} vs {ref.loss.item():.8f}")

    grads = load_file(grads_path)
    e = rel(grads["loss"], ref.loss.detach().reshape(1))
    checks.check(f"{name} grads-step loss vs PyTorch", e <= LOSS_TOL, f"rel {e:.3e}")
    worst, worst_name, missing = 0.0, None, []
    ref_names = set()
    for pname, p in model.named_parameters():
        # stepgraph names gradients as the checkpoint names their weights;
        # transformers 5 calls GPT-NeoX's output layer `lm_head` in the module
        # tree but still reads and writes it as `embed_out` in checkpoints.
        gname = CHECKPOINT_ALIASES.get(pname, pname) if pname not in grads else pname
        # transformers 5 calls Mixtral's router mlp.gate; its checkpoints block_sparse_moe.gate.
        if gname not in grads and ".mlp.gate." in gname:
            gname = gname.replace(".mlp.gate.", ".block_sparse_moe.gate.")
        fused = expert_grad(grads, pname, p.shape[0]) if gname not in grads else None
        if fused is not None:
            ref_names.update(expert_names(grads, pname))
            e = rel(fused, p.grad)
            if not (e <= worst):
                worst, worst_name = e, pname
            continue
        ref_names.add(gname)
        if gname not in grads:
            missing.append(pname)
            continue
        e = rel(grads[gname], p.grad)
        if not (e <= worst):
            worst, worst_name = e, pname
    extra = sorted(set(grads) - ref_names - {"loss"})
    checks.check(f"{name} gradient names", not missing and not extra, f"missing {missing[:5]}, extra {extra[:5]}")
    checks.check(f"{name} gradients vs PyTorch", worst <= GRAD_TOL, f"worst rel {worst:.3e} ({worst_name})")

    # Our folder loads in transformers as it is, with the source's tensors and our logits.
    again = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager")
    again.eval()
    src_state = {k: v for k, v in model.state_dict().items() if "inv_freq" not in k}
    out_state = {k: v for k, v in again.state_dict().items() if "inv_freq" not in k}
    differ = [k for k in src_state if k not in out_state or not torch.equal(src_state[k], out_state[k])]
    checks.check(f"{name} saved tensors", not differ and set(src_state) == set(out_state), f"differ {differ[:5]}")
    checks.check(f"{name} saved class", type(again) is type(model), f"{type(again).__name__}")
    with torch.no_grad():
        logits_again = again(input_ids=ids).logits
    e = rel(ours["logits"], logits_again)
    checks.check(f"{name} saved folder logits vs stepgraph", e <= LOGITS_TOL, f"rel {e:.3e}")
    with open(os.path.join(out, "tokenizer_config.json")) as f:
        marker = json.load(f).get("roundtrip_marker")
    checks.check(f"{name} tokenizer files copied", marker == name, f"marker {marker!r}")
    out_sharded = os.path.exists(os.path.join(out, "model.safetensors.index.json"))
    checks.check(f"{name} saved shards", out_sharded, "index written for --max-shard-mb 0.05")

    # Greedy decoding: stepgraph's decode graphs against transformers' generate.
    new = 32
    if (kwargs.get("rope_scaling") or {}).get("rope_type") == "longrope" and version_below(transformers.__version__, "5.25"):
        # Generation crosses the original context, where transformers'
        # Phi-3 recomputes the cache; 5.17 does that differently from 5.25
        # (checked on the same CPU: its tokens turn into a cycle right
        # after the crossing), and stepgraph follows 5.25.
        print(f"SKIP {name} greedy generation vs transformers: transformers {transformers.__version__} "
              "is older than 5.25, whose Phi-3 generation past the original context this checks", flush=True)
        return
    cmd = [
        stepgraph, "generate", "--init-from", src, "--random-prompts", "2", "--prompt-tokens", "8",
        "--max-new-tokens", str(new), "--ignore-eos", "--dtype", "f32", "--device", backend, "--seed", "5", "--json",
    ]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        checks.check(f"{name} greedy generation", False, result.stderr.strip() or result.stdout.strip())
        return
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    rows = [r for r in rows if "prompt_ids" in r]
    mismatch = []
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    with torch.no_grad():
        for row in rows:
            prompt = torch.tensor([row["prompt_ids"]])
            want = model.generate(prompt, max_new_tokens=new, min_new_tokens=new, do_sample=False)[0, prompt.shape[1]:]
            if want.tolist() != row["tokens"]:
                mismatch.append((row["tokens"], want.tolist()))
    checks.check(f"{name} greedy generation vs transformers", len(rows) == 2 and not mismatch,
                 f"{len(rows)} prompts x {new} tokens, first difference {mismatch[:1]}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stepgraph", default=os.path.join("target", "release", "stepgraph"))
    ap.add_argument("--backend", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--work", default=None, help="folder for the models (default: a temporary one)")
    ap.add_argument("--only", nargs="*", default=None, help="variant names to run")
    args = ap.parse_args()
    torch.set_grad_enabled(True)
    print(f"torch {torch.__version__}, transformers {transformers.__version__}")
    work = args.work or tempfile.mkdtemp(prefix="hf_roundtrip_")
    checks = Checks()
    for name, model_type, kwargs, shard in variants():
        if args.only and name not in args.only:
            continue
        try:
            run_variant(checks, args.stepgraph, args.backend, work, name, model_type, kwargs, shard)
        except Exception as e:  # one variant's failure must not hide the others'
            checks.check(f"{name}", False, f"{type(e).__name__}: {e}")
    if checks.failed:
        print(f"{len(checks.failed)} check(s) failed: {', '.join(checks.failed)}")
        sys.exit(1)
    print("all checks passed")


if __name__ == "__main__":
    main()
