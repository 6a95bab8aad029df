//! What the CLI integration tests share: running the built binary from the
//! repository root and checking that a command fails with a message.
//! (Each test file includes this module; not every file uses every item.)
#![allow(dead_code)]

use std::path::Path;
use std::process::Command;

use serde_json::{json, Value};

use stepgraph_core::autodiff::StepKind;
use stepgraph_core::cpu::exec::CpuSession;
use stepgraph_core::ir::DType;
use stepgraph_core::models::hf_dir::{save_hf_dir, HfFamily, SaveOptions};
use stepgraph_core::models::{init_params, Config, LossKind, ModelSpec};
use stepgraph_core::pipeline::{compile_step, StepOptions};

/// The repository root, where the tests run the binary (so `data/` resolves).
pub fn root() -> &'static Path {
    Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../.."))
}

/// A path as a command-line argument.
pub fn s(p: &Path) -> &str {
    p.to_str().expect("a UTF-8 path")
}

/// Runs `stepgraph ARGS` from the repository root: success, stdout, stderr.
/// `RUST_BACKTRACE` is removed so a panic's output is the same everywhere.
pub fn stepgraph(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_stepgraph"))
        .args(args)
        .env_remove("RUST_BACKTRACE")
        .current_dir(root())
        .output()
        .expect("run stepgraph");
    (out.status.success(), String::from_utf8_lossy(&out.stdout).into(), String::from_utf8_lossy(&out.stderr).into())
}

/// `args` fails and its stderr holds `want`; returns the stderr.
pub fn fails_with(args: &[&str], want: &str) -> String {
    let (ok, out, err) = stepgraph(args);
    assert!(!ok, "{args:?} should fail: {out}");
    assert!(err.contains(want), "{args:?}: expected `{want}` in:\n{err}");
    err
}

/// A token file of the README's chat records and `data/tiny.txt` in `dir`,
/// with two validation documents.
pub fn chat_token_file(dir: &Path) -> std::path::PathBuf {
    let out = dir.join("chat.tokens");
    let args = ["prepare", "--tokenizer", README_TOKENIZER, "--input", "data/tiny-chat.jsonl", "data/tiny.txt"];
    let mut args = args.to_vec();
    args.extend(["--chat", "--val-docs", "2", "--out", s(&out)]);
    let (ok, _, err) = stepgraph(&args);
    assert!(ok, "{args:?} failed:\n{err}");
    out
}

/// The tokenizer the README's example uses, committed in `data/tokenizer`.
pub const README_TOKENIZER: &str = "data/tokenizer";
/// Embedding rows of the fixture models: the tokenizer's ids fit.
pub const VOCAB: usize = 512;

/// `config.json` of a tiny model of `family` (`llama`, `mistral`, `qwen2`
/// or `gpt_neox`), with the keys `transformers` writes.
pub fn config_json(family: &str, tied: bool) -> Value {
    match family {
        "gpt_neox" => json!({
            "architectures": ["GPTNeoXForCausalLM"], "model_type": "gpt_neox", "attention_bias": true,
            "bos_token_id": 0, "eos_token_id": 0, "hidden_act": "gelu", "hidden_size": 32,
            "intermediate_size": 128, "layer_norm_eps": 1e-5, "max_position_embeddings": 64,
            "num_attention_heads": 4, "num_hidden_layers": 2, "rotary_emb_base": 10000,
            "rotary_pct": 0.5, "tie_word_embeddings": tied, "torch_dtype": "float32",
            "use_parallel_residual": true, "vocab_size": VOCAB
        }),
        _ => {
            let arch = match family {
                "llama" => "LlamaForCausalLM",
                "mistral" => "MistralForCausalLM",
                "qwen2" => "Qwen2ForCausalLM",
                "mixtral" => "MixtralForCausalLM",
                other => panic!("no fixture family {other}"),
            };
            let mut config = json!({
                "architectures": [arch], "model_type": family, "bos_token_id": 1, "eos_token_id": 2,
                "hidden_act": "silu", "hidden_size": 32, "intermediate_size": 64,
                "max_position_embeddings": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
                "num_hidden_layers": 2, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
                "sliding_window": null, "tie_word_embeddings": tied, "torch_dtype": "float32",
                "vocab_size": VOCAB
            });
            if family == "mixtral" {
                // 4 experts 24 wide, 2 per token.
                for (key, value) in [("num_local_experts", 4), ("num_experts_per_tok", 2), ("intermediate_size", 24)] {
                    config[key] = json!(value);
                }
            }
            config
        }
    }
}

/// Writes a tiny Hugging Face model of `family` into `dir`: its
/// `config.json`, seeded weights (in shards of at most `shard_bytes`, with
/// an index, when given) and the README tokenizer's files.
pub fn write_model(dir: &Path, family: &str, tied: bool, shard_bytes: Option<u64>) {
    let config_value = config_json(family, tied);
    let config = Config::from_hf_json(&config_value.to_string(), family).unwrap();
    let spec = ModelSpec {
        config: config.clone(),
        batch: 1,
        seq: 2,
        dtype: DType::F32,
        loss: LossKind::CrossEntropy,
        adapters: None,
        documents: false,
    };
    let c = compile_step(&spec, &StepOptions::new(StepKind::Forward)).unwrap();
    let mut session = CpuSession::new(c.step.clone(), c.plan.clone()).unwrap();
    for (v, t) in init_params(&c.forward, 7) {
        session.write_named(c.forward.value(v).kind.leaf_name().unwrap(), &t).unwrap();
    }
    let source = config_value.as_object().unwrap().clone();
    let tokenizer = root().join(README_TOKENIZER);
    let options = SaveOptions {
        tokenizer_from: Some(&tokenizer),
        model_from: None,
        max_shard_bytes: shard_bytes.unwrap_or(u64::MAX),
        family: HfFamily::from_model_type(family),
        source_config: Some(&source),
    };
    save_hf_dir(dir, &config, &c.forward, &mut session, &options).unwrap();
}

/// Every tensor of a folder's weight files, by name, as bytes.
pub fn folder_tensors(dir: &Path) -> std::collections::BTreeMap<String, Vec<u8>> {
    let mut all = std::collections::BTreeMap::new();
    for entry in std::fs::read_dir(dir).unwrap().flatten() {
        if entry.path().extension().is_some_and(|e| e == "safetensors") {
            for (name, t) in stepgraph_core::models::checkpoint::read_safetensors(&entry.path()).unwrap() {
                all.insert(name, t.bytes().to_vec());
            }
        }
    }
    all
}
