"""Writes a Hugging Face model folder with random weights and a freshly trained
byte-level BPE tokenizer, for runs that cannot download a model (the GPU
machine has no network). Also writes a JSONL corpus to train on.

    python3 scripts/make_hf_model.py --geometry qwen2.5-0.5b --out DIR [--dtype bf16] \
        [--corpus-out corpus.jsonl] [--vocab-trained 8192] [--seed 0] [--json-out summary.json]

The corpus is the docstrings of Python's standard library on this machine
(real English and code-like text, a few MB, no network): one `{"text": ...}`
record per docstring. The tokenizer is trained on it with the `tokenizers`
library (byte-level BPE, EOS `<|endoftext|>`), padded to the model's
vocabulary size by the model's embedding, which is larger: ids above the
trained vocabulary never occur. `tokenizer_config.json` carries a ChatML
chat template, as Qwen2's does.
"""

import argparse
import ast
import json
import os
import pathlib
import sysconfig

import torch

GEOMETRIES = {
    # Qwen/Qwen2.5-0.5B's config.json values (494M parameters, tied embeddings).
    "qwen2.5-0.5b": dict(
        family="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
        num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
        max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=True,
    ),
    # meta-llama/Llama-3.2-1B's geometry (1.24B parameters, tied, llama3 RoPE scaling).
    "llama-3.2-1b": dict(
        family="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
        max_position_embeddings=131072, rope_theta=500000.0, rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    ),
}

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def docstrings(limit_bytes):
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    total = 0
    for path in sorted(root.rglob("*.py")):
        if "test" in path.parts or "site-packages" in path.parts:
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) > 200:
                    yield doc
                    total += len(doc)
                    if total >= limit_bytes:
                        return


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--geometry", required=True, choices=sorted(GEOMETRIES))
    ap.add_argument("--out", required=True)
    ap.add_argument("--dtype", default="bf16", choices=["f32", "bf16"])
    ap.add_argument("--corpus-out")
    ap.add_argument("--corpus-bytes", type=int, default=8_000_000)
    ap.add_argument("--vocab-trained", type=int, default=8192)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json-out", help="also write the summary line to this file")
    args = ap.parse_args()

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    texts = list(docstrings(args.corpus_bytes))
    if args.corpus_out:
        with open(args.corpus_out, "w", encoding="utf-8") as f:
            for t in texts:
                f.write(json.dumps({"text": t}) + "\n")

    geo = dict(GEOMETRIES[args.geometry])
    family = geo.pop("family")
    cls = {"qwen2": Qwen2Config, "llama": LlamaConfig}[family]
    eos = "<|endoftext|>"
    specials = [eos, "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=args.vocab_trained, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    eos_id = tok.token_to_id(eos)

    cfg = cls(**geo, bos_token_id=eos_id, eos_token_id=eos_id, hidden_act="silu")
    torch.manual_seed(args.seed)
    dtype = {"f32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    model = AutoModelForCausalLM.from_config(cfg).to(dtype)
    os.makedirs(args.out, exist_ok=True)
    model.save_pretrained(args.out)
    tok.save(os.path.join(args.out, "tokenizer.json"))
    with open(os.path.join(args.out, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos, "pad_token": eos,
                   "bos_token": None, "chat_template": CHATML, "model_max_length": 32768}, f, indent=2)
    n = sum(p.numel() for p in model.parameters())
    summary = json.dumps({"out": args.out, "family": family, "params": n, "docs": len(texts),
                          "corpus_bytes": sum(map(len, texts)), "tokenizer_vocab": tok.get_vocab_size()})
    print(summary)
    if args.json_out:
        with open(args.json_out, "w") as f:
            f.write(summary + "\n")


if __name__ == "__main__":
    main()
