//! Errors that point at the fix: an unknown model name suggests the
//! closest known ones (and close spellings resolve), a broken `config.json`
//! names its file once and the key that is wrong, a missing file or folder
//! says what was expected there, and a flag's error quotes the flag and
//! the value the user typed.

mod common;
use common::stepgraph;

use std::path::Path;

/// `args` fails and its stderr holds every one of `want`.
fn fails_with(args: &[&str], want: &[&str]) -> String {
    let (ok, out, err) = stepgraph(args);
    assert!(!ok, "{args:?} should fail: {out}");
    for w in want {
        assert!(err.contains(w), "{args:?}: expected `{w}` in: {err}");
    }
    err
}

#[test]
fn unknown_models_suggest_the_closest_and_close_spellings_resolve() {
    let err = fails_with(
        &["plan", "--model", "qwen2.5-7"],
        &["unknown model name `qwen2.5-7`", "did you mean `Qwen2.5-7B`, "],
    );
    assert!(err.contains("known models: open_llama_3b"), "{err}");
    // Equally close names are all offered.
    fails_with(&["plan", "--model", "qwen2.5-8b"], &["did you mean `Qwen2.5-3B`, `Qwen2.5-7B`, `Qwen2.5-0.5B`?"]);
    fails_with(&["plan", "--model", "pythia-14"], &["did you mean `pythia-14m`, `pythia-160m`?"]);
    let err = fails_with(&["plan", "--model", "gpt-17"], &["unknown model name `gpt-17`"]);
    assert!(!err.contains("did you mean"), "nothing is close to gpt-17: {err}");
    // Case-insensitive names, Hugging Face repo ids and litgpt names resolve.
    for name in [
        "qwen2.5-7b",
        "Qwen/Qwen2.5-7B",
        "Qwen/Qwen2.5-0.5B-Instruct",
        "meta-llama/Meta-Llama-3-8B",
        "Llama-3-8B",
        "TINY-LLAMA",
    ] {
        let (ok, _, err) = stepgraph(&["plan", "--model", name, "--n-layer", "1", "--seq", "8"]);
        assert!(ok, "{name}: {err}");
    }
}

/// Writes `text` to `dir/name` and returns the path.
fn write(dir: &Path, name: &str, text: &str) -> String {
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path.to_str().unwrap().to_string()
}

#[test]
fn a_broken_config_json_names_the_file_once_and_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let cases: [(&str, &str, &[&str]); 5] = [
        ("truncated.json", r#"{"model_type": "llama", "hidden_size": 64"#, &["is not valid JSON", "EOF while parsing"]),
        (
            "string.json",
            r#"{"model_type": "llama", "hidden_size": "64", "num_attention_heads": 4}"#,
            &["key `hidden_size` must be a non-negative integer, got \"64\""],
        ),
        (
            "missing.json",
            r#"{"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 256, "intermediate_size": 128}"#,
            &["missing required key `num_hidden_layers`"],
        ),
        ("gpt2.json", r#"{"model_type": "gpt2"}"#, &["model_type `gpt2` is not supported (supported: llama"]),
        (
            "heads.json",
            r#"{"model_type": "llama", "hidden_size": 64, "num_attention_heads": 3, "num_hidden_layers": 1, "vocab_size": 256, "intermediate_size": 128}"#,
            &["hidden_size 64 is not divisible by num_attention_heads 3"],
        ),
    ];
    for (name, text, want) in cases {
        let file = write(d, name, text);
        for command in [&["plan"][..], &["trace"], &["train", "--steps", "1", "--device", "cpu"]] {
            let args: Vec<&str> = command.iter().copied().chain(["--config", &file]).collect();
            let err = fails_with(&args, want);
            assert_eq!(err.matches(&file).count(), 1, "{args:?} names the file once: {err}");
            for w in want {
                assert_eq!(err.matches(w).count(), 1, "{args:?} says `{w}` once: {err}");
            }
        }
    }
    // A folder without config.json says what --config takes.
    let empty = d.join("empty");
    std::fs::create_dir(&empty).unwrap();
    let e = empty.to_str().unwrap();
    fails_with(&["plan", "--config", e], &[&format!("--config {e}"), "config.json", "give a Hugging Face config.json"]);
    // So does a folder given as a Hugging Face model.
    fails_with(&["hf", "--init-from", e, "--out", d.join("out").to_str().unwrap()], &[e, "has no config.json"]);
    // And a reference folder for compare names the file once.
    let err = fails_with(&["compare", "--reference", e, "--loss", "ce"], &["reading the reference's model config"]);
    assert_eq!(err.matches("config.json").count(), 1, "{err}");
}

#[test]
fn flag_errors_quote_the_flag_and_value() {
    fails_with(&["plan", "--n-layer", "0"], &["--n-layer 0", "n_layer must be positive, got 0"]);
    fails_with(&["plan", "--n-head", "3"], &["--n-head 3", "n_embd 64 is not divisible by n_head 3"]);
    fails_with(&["plan", "--gpus", "0"], &["--gpus must be at least 1, got 0"]);
    fails_with(&["plan", "--batch", "0"], &["--batch 0"]);
    fails_with(&["trace", "--seq", "0"], &["--seq 0"]);
    fails_with(&["plan", "--seq", "300"], &["--seq 300 exceeds the block size 256 of `tiny-llama`", "--block-size"]);
    fails_with(&["plan", "--router-z-loss", "0.001"], &["--router-z-loss: `tiny-llama` has no experts"]);
    fails_with(
        &["plan", "--model", "Mixtral-8x7B-v0.1", "--n-layer", "1", "--router-z-loss=-1"],
        &["--router-z-loss -1: give a weight above 0"],
    );
    fails_with(&["bench", "--workload", "w3", "--steps", "0"], &["--steps must be at least 1, got 0"]);
    fails_with(
        &["bench", "--workload", "w1", "--clip-grad-norm", "1"],
        &["--clip-grad-norm needs a train workload (w5, l8-2l, g3-1b, q3moe-4l): w1 computes gradients only"],
    );
    fails_with(
        &["bench", "--workload", "w3", "--optimizer-state", "8bit"],
        &["--state-dtype needs a train workload (w5, l8-2l, g3-1b, q3moe-4l): w3 has no optimizer"],
    );
    fails_with(
        &["bench", "--workload", "w5", "--clip-grad-norm=-1"],
        &["--clip-grad-norm must be a finite number >= 0"],
    );
    fails_with(
        &["bench", "--workload", "w1", "--documents", "100-200"],
        &["--documents needs a cross-entropy workload"],
    );
    fails_with(
        &["bench", "--workload", "w5", "--documents", "300-200"],
        &["`300-200` is not a range of document lengths"],
    );
    fails_with(&["train", "--packing", "padded"], &["`padded` is not a packing", "documents, stream, none"]);
}
