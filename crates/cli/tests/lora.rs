//! Adapter runs through the commands: `train --lora-rank` writes a peft
//! folder that `eval --adapter` and `generate --adapter` read (agreeing with
//! the run's own validation and with the merged model `--merge` writes),
//! `--adapter` continues a folder's adapters, a stopped adapter run resumes
//! bit for bit, and flags that contradict each other are refused first.

mod common;
use common::{chat_token_file, fails_with, folder_tensors, s, stepgraph, write_model};

use std::path::Path;

use serde_json::Value;

fn run_ok(args: &[&str]) -> (String, String) {
    let (ok, out, err) = stepgraph(args);
    assert!(ok, "{args:?} failed:\n{err}");
    (out, err)
}

/// The number after `key` in `text` (`validation at step 6: loss 5.1234`).
fn number_after(text: &str, key: &str) -> f64 {
    let at = text.find(key).unwrap_or_else(|| panic!("no `{key}` in:\n{text}")) + key.len();
    let digits: String = text[at..].trim_start().chars().take_while(|c| c.is_ascii_digit() || *c == '.').collect();
    digits.parse().unwrap_or_else(|_| panic!("no number after `{key}` in:\n{text}"))
}

/// The token ids `generate --json` printed for its one prompt.
fn generated_ids(out: &str) -> Vec<u64> {
    let row: Value = out.lines().find_map(|l| serde_json::from_str(l).ok()).expect("a JSON row");
    row["ids"]
        .as_array()
        .or_else(|| row["tokens"].as_array())
        .expect("generated ids")
        .iter()
        .filter_map(Value::as_u64)
        .collect()
}

/// `eval`'s validation loss of `folder` (with `adapter` and `extra` flags)
/// on the batches `train_args` validates on.
fn eval_loss(folder: &Path, adapter: Option<&Path>, data: &Path, extra: &[&str]) -> f64 {
    let mut args = vec!["eval", "--init-from", s(folder), "--data", s(data), "--device", "cpu"];
    args.extend(["--seq", "32", "--batch", "2", "--eval-batches", "2"]);
    if let Some(a) = adapter {
        args.extend(["--adapter", s(a)]);
    }
    args.extend(extra);
    let (out, _) = run_ok(&args);
    if adapter.is_some() {
        assert!(out.contains("with adapter"), "{out}");
    }
    number_after(&out, "validation loss")
}

fn train_args<'a>(base: &'a str, data: &'a str, out: &'a str) -> Vec<&'a str> {
    vec![
        "train",
        "--init-from",
        base,
        "--data",
        data,
        "--device",
        "cpu",
        "--seq",
        "32",
        "--batch",
        "2",
        "--steps",
        "6",
        "--lr",
        "1e-2",
        "--eval-every",
        "6",
        "--eval-batches",
        "2",
        "--lora-rank",
        "4",
        "--lora-targets",
        "q,v,down",
        "--lora-dropout",
        "0.1",
        "--out",
        out,
    ]
}

#[test]
fn an_adapter_run_writes_a_peft_folder_that_eval_and_generate_read() {
    let tmp = tempfile::tempdir().unwrap();
    let base = tmp.path().join("base");
    write_model(&base, "llama", false, None);
    let data = chat_token_file(tmp.path());
    let (adapter, merged) = (tmp.path().join("adapter"), tmp.path().join("merged"));
    let (_, err) = run_ok(&train_args(s(&base), s(&data), s(&adapter)));
    assert!(err.contains("adapters    LoRA rank 4, alpha 8 (scale 2), dropout 0.1 on q,v,down"), "{err}");
    assert!(err.contains("base (f32)") && err.contains("(frozen)"), "{err}");
    let val = number_after(&err, "validation at step 6: loss");

    // The folder peft reads: its config, its tensors under peft's names, the tokenizer.
    let config: Value = serde_json::from_slice(&std::fs::read(adapter.join("adapter_config.json")).unwrap()).unwrap();
    assert_eq!((config["peft_type"].as_str(), config["r"].as_u64()), (Some("LORA"), Some(4)));
    assert_eq!(config["target_modules"], serde_json::json!(["down_proj", "q_proj", "v_proj"]));
    assert!(adapter.join("tokenizer.json").is_file());
    let tensors = folder_tensors(&adapter);
    assert!(
        tensors.contains_key("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"),
        "{:?}",
        tensors.keys()
    );
    assert!(tensors.keys().all(|k| k.starts_with("base_model.model.model.layers.")), "{:?}", tensors.keys());

    // eval over the base with the adapter: the run's own validation.
    assert_eq!(eval_loss(&base, Some(&adapter), &data, &[]), val);

    // The same run with --merge writes the base with the adapters folded in.
    let mut args = train_args(s(&base), s(&data), s(&merged));
    args.push("--merge");
    run_ok(&args);
    assert!(merged.join("config.json").is_file() && !merged.join("adapter_config.json").exists());
    let merged_loss = eval_loss(&merged, None, &data, &[]);
    assert!((merged_loss - val).abs() <= 2e-4, "{merged_loss} vs {val}");

    // generate with the adapter merges it as the base loads: the merged folder's tokens.
    let gen = |folder: &Path, adapter: Option<&Path>| {
        let mut args = vec![
            "generate",
            "--init-from",
            s(folder),
            "--device",
            "cpu",
            "--prompt",
            "Hello",
            "--max-new-tokens",
            "12",
        ];
        args.extend(["--ignore-eos", "--json"]);
        if let Some(a) = adapter {
            args.extend(["--adapter", s(a)]);
        }
        generated_ids(&run_ok(&args).0)
    };
    let with_adapter = gen(&base, Some(&adapter));
    assert_eq!(with_adapter, gen(&merged, None));
    assert_eq!(with_adapter.len(), 12);
}

/// On a mixture of experts the default targets (all-linear) adapt the
/// routed experts too: the folder holds them as peft does (its
/// `target_parameters`, one adapter per expert), eval and generate read
/// it, and --merge folds them into the experts' weights.
#[test]
fn expert_adapters_go_through_the_folder_and_merge_into_the_experts() {
    let tmp = tempfile::tempdir().unwrap();
    let base = tmp.path().join("base");
    write_model(&base, "mixtral", false, None);
    let data = chat_token_file(tmp.path());
    let (adapter, merged) = (tmp.path().join("adapter"), tmp.path().join("merged"));
    fn args<'a>(base: &'a Path, data: &'a Path, out: &'a Path) -> Vec<&'a str> {
        let mut a = vec!["train", "--init-from", s(base), "--data", s(data), "--device", "cpu"];
        a.extend(["--seq", "32", "--batch", "2", "--steps", "6", "--lr", "1e-2", "--eval-every", "6"]);
        a.extend(["--eval-batches", "2", "--lora-rank", "4", "--out", s(out)]);
        a
    }
    let (_, err) = run_ok(&args(&base, &data, &adapter));
    assert!(err.contains("on q,k,v,o,gate,up,down,experts_gate_up,experts_down"), "{err}");
    let val = number_after(&err, "validation at step 6: loss");
    let config: Value = serde_json::from_slice(&std::fs::read(adapter.join("adapter_config.json")).unwrap()).unwrap();
    assert_eq!(config["target_modules"], serde_json::json!(["k_proj", "o_proj", "q_proj", "v_proj"]));
    assert_eq!(config["target_parameters"], serde_json::json!(["mlp.experts.down_proj", "mlp.experts.gate_up_proj"]));
    let tensors = folder_tensors(&adapter);
    // gate_up_proj's adapter nests inside down_proj's: [E·r, C] f32.
    let a = &tensors["base_model.model.model.layers.1.mlp.experts.base_layer.lora_A.weight"];
    assert_eq!(a.len(), 4 * 4 * 32 * 4);
    let b = &tensors["base_model.model.model.layers.1.mlp.experts.lora_B.weight"];
    assert_eq!(b.len(), 32 * 4 * 4 * 4);

    assert_eq!(eval_loss(&base, Some(&adapter), &data, &[]), val);
    let mut merge = args(&base, &data, &merged);
    merge.push("--merge");
    run_ok(&merge);
    let merged_loss = eval_loss(&merged, None, &data, &[]);
    assert!((merged_loss - val).abs() <= 2e-4, "{merged_loss} vs {val}");
    let gen = |folder: &Path, adapter: Option<&Path>| {
        let mut args = vec!["generate", "--init-from", s(folder), "--device", "cpu", "--prompt", "Hello"];
        args.extend(["--max-new-tokens", "12", "--ignore-eos", "--json"]);
        if let Some(a) = adapter {
            args.extend(["--adapter", s(a)]);
        }
        generated_ids(&run_ok(&args).0)
    };
    assert_eq!(gen(&base, Some(&adapter)), gen(&merged, None));
}

#[test]
fn a_qlora_run_evaluates_over_the_same_nf4_base() {
    // A dense model, and a mixture of experts whose stacked expert weights
    // are NF4 too (with adapters on the experts, no dropout).
    for family in ["llama", "mixtral"] {
        let tmp = tempfile::tempdir().unwrap();
        let base = tmp.path().join("base");
        write_model(&base, family, false, None);
        let data = chat_token_file(tmp.path());
        let adapter = tmp.path().join("adapter");
        let mut args = train_args(s(&base), s(&data), s(&adapter));
        if family == "mixtral" {
            let at = args.iter().position(|a| *a == "--lora-targets").unwrap();
            args.drain(at..at + 2);
            let at = args.iter().position(|a| *a == "--lora-dropout").unwrap();
            args.drain(at..at + 2);
        }
        args.extend(["--base-dtype", "nf4", "--double-quant"]);
        let (_, err) = run_ok(&args);
        assert!(err.contains("base (nf4)") && err.contains("its scales quantized too"), "{family}: {err}");
        let val = number_after(&err, "validation at step 6: loss");
        assert_eq!(eval_loss(&base, Some(&adapter), &data, &["--base-dtype", "nf4", "--double-quant"]), val);
        // Over the unquantized base the same adapters see other weights.
        assert_ne!(eval_loss(&base, Some(&adapter), &data, &[]), val, "{family}");
    }
}

#[test]
fn an_adapter_run_resumes_bit_for_bit_and_continues_a_folder() {
    let tmp = tempfile::tempdir().unwrap();
    let base = tmp.path().join("base");
    write_model(&base, "llama", false, None);
    let data = chat_token_file(tmp.path());
    let (straight, resumed, ck) = (tmp.path().join("straight"), tmp.path().join("resumed"), tmp.path().join("ck"));
    run_ok(&train_args(s(&base), s(&data), s(&straight)));
    let mut first = train_args(s(&base), s(&data), s(&resumed));
    first.extend(["--checkpoint-dir", s(&ck), "--stop-after", "3"]);
    run_ok(&first);
    // The checkpoint holds the adapters and their moments, not the base.
    let ck3 = ck.join("step-000003");
    let weights = folder_tensors(&ck3);
    assert!(!weights.is_empty() && weights.keys().all(|k| k.contains(".lora_")), "{:?}", weights.keys());
    let mut second = train_args(s(&base), s(&data), s(&resumed));
    second.extend(["--checkpoint-dir", s(&ck), "--resume", "auto"]);
    run_ok(&second);
    assert_eq!(folder_tensors(&resumed), folder_tensors(&straight));
    // The last checkpoint exported is the run's adapter folder.
    let exported = tmp.path().join("exported");
    run_ok(&["export", s(&ck), "--out", s(&exported), "--init-from", s(&base)]);
    assert_eq!(folder_tensors(&exported), folder_tensors(&straight));
    assert!(exported.join("adapter_config.json").is_file() && exported.join("tokenizer.json").is_file());
    // `eval --adapter` reads the checkpoint as it is.
    let newest = std::fs::read_dir(&ck)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.file_name().unwrap().to_string_lossy().starts_with("step-"))
        .max()
        .unwrap();
    assert_eq!(eval_loss(&base, Some(&newest), &data, &[]), eval_loss(&base, Some(&exported), &data, &[]));
    // A checkpoint of adapters is no model.
    fails_with(&["eval", "--device", "cpu", "--init-from", s(&newest), "--data", s(&data)], "holds no model");

    // --adapter continues the folder: its settings, its weights as the start.
    let more = tmp.path().join("more");
    // The same flags as the folder's are accepted beside it.
    let mut args = train_args(s(&base), s(&data), s(&more));
    args.extend(["--adapter", s(&straight)]);
    let (_, err) = run_ok(&args);
    assert!(err.contains(&format!("continuing {}", straight.display())), "{err}");
    assert_eq!(folder_tensors(&more).len(), folder_tensors(&straight).len());
    assert_ne!(folder_tensors(&more), folder_tensors(&straight));
}

#[test]
fn contradicting_adapter_flags_are_refused_before_any_work() {
    let tmp = tempfile::tempdir().unwrap();
    let base = tmp.path().join("base");
    write_model(&base, "llama", false, None);
    let data = chat_token_file(tmp.path());
    let adapter = tmp.path().join("adapter");
    let mut args = vec!["train", "--init-from", s(&base), "--data", s(&data), "--device", "cpu", "--seq", "16"];
    args.extend(["--steps", "1", "--eval-every", "0", "--lora-rank", "2", "--out", s(&adapter)]);
    run_ok(&args);
    fails_with(
        &["train", "--init-from", s(&base), "--adapter", s(&adapter), "--lora-rank", "8", "--device", "cpu"],
        "--lora-rank 8 differs from the rank 2",
    );
    fails_with(
        &["train", "--device", "cpu", "--out", s(&tmp.path().join("m")), "--merge"],
        "--merge folds trained adapters",
    );
    fails_with(&["plan", "--base-dtype", "nf4"], "--lora-rank");
    fails_with(&["train", "--device", "cpu", "--lora-rank", "4", "--lora-targets", "q,lm_head"], "`lm_head`");
    // The plan of an adapter run names the frozen base and the adapters.
    let (out, _) = run_ok(&["plan", "--model", "tiny-llama", "--lora-rank", "4", "--gpu-memory", "24GB"]);
    assert!(out.contains("base (") && out.contains("adapters"), "{out}");
}

#[test]
fn hf_runs_a_model_with_its_adapter_as_the_merged_model_runs() {
    use stepgraph_core::host::HostTensor;
    use stepgraph_core::ir::{DType, TensorType};
    use stepgraph_core::models::checkpoint::{read_safetensors, write_safetensors_atomic};
    let tmp = tempfile::tempdir().unwrap();
    let base = tmp.path().join("base");
    write_model(&base, "llama", false, None);
    let data = chat_token_file(tmp.path());
    let (adapter, merged) = (tmp.path().join("adapter"), tmp.path().join("merged"));
    run_ok(&train_args(s(&base), s(&data), s(&adapter)));
    let mut args = train_args(s(&base), s(&data), s(&merged));
    args.push("--merge");
    run_ok(&args);
    let ids = tmp.path().join("ids.safetensors");
    let x: Vec<f64> = (0..10).map(|i| (i * 7 % 50) as f64).collect();
    write_safetensors_atomic(
        &ids,
        &[("input_ids".into(), HostTensor::from_f64(TensorType::new(DType::I32, [2, 5]), &x))],
    )
    .unwrap();
    let logits = |folder: &Path, adapter: Option<&Path>, out: &Path| {
        let mut args = vec!["hf", "--init-from", s(folder), "--ids", s(&ids), "--logits-out", s(out)];
        if let Some(a) = adapter {
            args.extend(["--adapter", s(a)]);
        }
        run_ok(&args);
        read_safetensors(out).unwrap().into_iter().find(|(n, _)| n == "logits").unwrap().1.to_f64()
    };
    let a = logits(&base, Some(&adapter), &tmp.path().join("a.safetensors"));
    let m = logits(&merged, None, &tmp.path().join("m.safetensors"));
    let worst = a.iter().zip(&m).map(|(x, y)| (x - y).abs()).fold(0.0, f64::max);
    assert!(worst < 1e-4, "adapted and merged logits differ by {worst}");
    let grads = tmp.path().join("g.safetensors");
    let (out, _) =
        run_ok(&["hf", "--init-from", s(&base), "--adapter", s(&adapter), "--ids", s(&ids), "--grads-out", s(&grads)]);
    assert!(out.contains("adapter gradients"), "{out}");
    let names: Vec<String> = read_safetensors(&grads).unwrap().into_iter().map(|(n, _)| n).collect();
    assert!(names.contains(&"base_model.model.model.layers.0.mlp.down_proj.lora_B.weight".to_string()), "{names:?}");
    assert_eq!(names.len(), folder_tensors(&adapter).len() + 1);
}
