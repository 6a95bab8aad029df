//! Hugging Face model folders through the commands that read and write
//! them: a folder as `transformers` saves it keeps every file a loader
//! reads through `train --out` and `hf --out`; an `hf --out` that would
//! replace its own source is refused before any work; a NaN or an infinity
//! in the weights is named by `train`, `eval` and `generate` instead of
//! surfacing as a diverged run or empty text; and `compare` reads a
//! GPT-NeoX reference by the names `--init-from` reads.
//!
//! The fixtures are tiny models written by [`write_model`] (seeded weights
//! saved through `save_hf_dir`, the README tokenizer), with the files
//! `transformers`' `save_pretrained` adds beside them written here.

mod common;
use common::{chat_token_file, config_json, fails_with, s, stepgraph, write_model};

use std::collections::BTreeMap;
use std::path::Path;

use serde_json::Value;

use stepgraph_core::autodiff::StepKind;
use stepgraph_core::cpu::exec::CpuSession;
use stepgraph_core::host::HostTensor;
use stepgraph_core::ir::{DType, TensorType};
use stepgraph_core::models::checkpoint::{name_params, read_safetensors, reference_batch, write_safetensors_atomic};
use stepgraph_core::models::hf_dir::SINGLE_FILE;
use stepgraph_core::models::{init_params, Config, LossKind, ModelSpec};
use stepgraph_core::pipeline::{compile_step, StepOptions};

fn run_ok(args: &[&str]) -> (String, String) {
    let (ok, out, err) = stepgraph(args);
    assert!(ok, "{args:?} failed:\n{err}");
    (out, err)
}

/// A tiny Llama folder laid out as `save_pretrained` of a model and its
/// tokenizer writes it (`transformers` 4.4x and later): config.json,
/// generation_config.json, model.safetensors, tokenizer.json,
/// tokenizer_config.json without the template, special_tokens_map.json and
/// chat_template.jinja, plus `tokenizer.model` for a SentencePiece
/// tokenizer. Returns the files written beside the weights and config.
fn write_saved_folder(dir: &Path, sentencepiece: bool) -> BTreeMap<String, Vec<u8>> {
    write_model(dir, "llama", false, None);
    let config_path = dir.join("tokenizer_config.json");
    let mut config: Value = serde_json::from_slice(&std::fs::read(&config_path).unwrap()).unwrap();
    let template = config.as_object_mut().unwrap().remove("chat_template").unwrap();
    let mut files = BTreeMap::new();
    files.insert("tokenizer_config.json".to_string(), serde_json::to_vec_pretty(&config).unwrap());
    files.insert("chat_template.jinja".to_string(), template.as_str().unwrap().as_bytes().to_vec());
    files.insert(
        "generation_config.json".to_string(),
        br#"{"bos_token_id": 1, "eos_token_id": 2, "temperature": 0.7, "top_p": 0.9, "transformers_version": "4.57.1"}"#
            .to_vec(),
    );
    files.insert(
        "special_tokens_map.json".to_string(),
        br#"{"eos_token": {"content": "<|im_end|>", "lstrip": false, "normalized": false, "rstrip": false, "single_word": false}}"#
            .to_vec(),
    );
    if sentencepiece {
        // SentencePiece's serialized model: binary, not UTF-8.
        files.insert("tokenizer.model".to_string(), vec![0x0a, 0x0e, 0x0a, 0x05, 0xff, 0x00, 0x80, 0x15]);
    }
    for (name, bytes) in &files {
        std::fs::write(dir.join(name), bytes).unwrap();
    }
    files.insert("tokenizer.json".to_string(), std::fs::read(dir.join("tokenizer.json")).unwrap());
    files
}

/// Every file of `dir` by name.
fn listing(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> =
        std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    names.sort();
    names
}

#[test]
fn a_saved_folder_keeps_every_loader_file_through_train_and_hf_out() {
    let d = tempfile::tempdir().unwrap();
    let data = chat_token_file(d.path());
    for sentencepiece in [false, true] {
        let src = d.path().join(format!("src-{sentencepiece}"));
        let files = write_saved_folder(&src, sentencepiece);
        let trained = d.path().join(format!("trained-{sentencepiece}"));
        let copied = d.path().join(format!("copied-{sentencepiece}"));
        run_ok(&[
            "train",
            "--device",
            "cpu",
            "--init-from",
            s(&src),
            "--data",
            s(&data),
            "--seq",
            "16",
            "--batch",
            "2",
            "--steps",
            "1",
            "--eval-every",
            "0",
            "--log-every",
            "0",
            "--out",
            s(&trained),
        ]);
        run_ok(&["hf", "--init-from", s(&src), "--out", s(&copied)]);
        for out in [&trained, &copied] {
            for (name, bytes) in &files {
                let written =
                    std::fs::read(out.join(name)).unwrap_or_else(|e| panic!("{}: {e}", out.join(name).display()));
                assert!(written == *bytes, "{} differs from the source's", out.join(name).display());
            }
            let mut want: Vec<String> =
                files.keys().cloned().chain(["config.json".to_string(), SINGLE_FILE.to_string()]).collect();
            want.sort();
            assert_eq!(listing(out), want, "{}", out.display());
            // The template went along: a chat prompt renders with it.
            let (_, err) = run_ok(&[
                "generate",
                "--device",
                "cpu",
                "--init-from",
                s(out),
                "--chat",
                "--prompt",
                "Say hi",
                "--max-new-tokens",
                "2",
            ]);
            assert!(!err.contains("has none"), "{err}");
        }
    }
}

/// With the tokenizer from another folder (`--tokenizer`), the model's own
/// generation settings still come from the model's folder.
#[test]
fn the_generation_settings_come_from_the_model_folder() {
    let d = tempfile::tempdir().unwrap();
    let data = chat_token_file(d.path());
    let src = d.path().join("src");
    let files = write_saved_folder(&src, false);
    let tokenizer = d.path().join("tokenizer");
    std::fs::create_dir_all(&tokenizer).unwrap();
    for name in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(src.join(name), tokenizer.join(name)).unwrap();
    }
    std::fs::write(tokenizer.join("generation_config.json"), br#"{"temperature": 1.5}"#).unwrap();
    let out = d.path().join("out");
    let (t, o, m) = (s(&tokenizer), s(&out), s(&src));
    let args = ["train", "--device", "cpu", "--init-from", m, "--tokenizer", t, "--data", s(&data), "--seq", "16"];
    let mut args = args.to_vec();
    args.extend(["--steps", "1", "--eval-every", "0", "--out", o]);
    run_ok(&args);
    assert_eq!(std::fs::read(out.join("generation_config.json")).unwrap(), files["generation_config.json"]);
}

#[test]
fn hf_out_onto_its_source_is_refused_before_any_work() {
    let d = tempfile::tempdir().unwrap();
    let src = d.path().join("models").join("src");
    std::fs::create_dir_all(d.path().join("models")).unwrap();
    write_saved_folder(&src, false);
    let before: Vec<(String, Vec<u8>)> =
        listing(&src).into_iter().map(|n| (n.clone(), std::fs::read(src.join(&n)).unwrap())).collect();
    let link = d.path().join("link");
    std::os::unix::fs::symlink(&src, &link).unwrap();
    let ids = d.path().join("ids.safetensors");
    let ids_tensor = HostTensor::from_f64(
        stepgraph_core::ir::TensorType::new(stepgraph_core::ir::DType::I64, [1, 4]),
        &[1.0, 2.0, 3.0, 4.0],
    );
    write_safetensors_atomic(&ids, &[("input_ids".into(), ids_tensor)]).unwrap();
    let m = s(&src);
    let cases: Vec<(Vec<String>, &str)> = vec![
        (vec!["--out".into(), m.into()], "--out"),
        (vec!["--out".into(), format!("{m}/../src")], "is the --init-from"),
        (vec!["--out".into(), s(&link).into()], "is the --init-from"),
        (vec!["--out".into(), format!("{m}/copy")], "is inside the --init-from"),
        (vec!["--out".into(), s(&d.path().join("models")).into()], "holds the --init-from"),
        (vec!["--out".into(), s(d.path()).into()], "holds the --init-from"),
        (vec!["--ids".into(), s(&ids).into(), "--logits-out".into(), format!("{m}/{SINGLE_FILE}")], "--logits-out"),
        (vec!["--ids".into(), s(&ids).into(), "--grads-out".into(), s(&ids).into()], "is the --ids"),
    ];
    for (extra, want) in cases {
        let mut args = vec!["hf".to_string(), "--init-from".into(), m.into()];
        args.extend(extra);
        let refs: Vec<&str> = args.iter().map(String::as_str).collect();
        let err = fails_with(&refs, want);
        assert!(err.contains("writing") && err.contains("would"), "{err}");
    }
    let after: Vec<(String, Vec<u8>)> =
        listing(&src).into_iter().map(|n| (n.clone(), std::fs::read(src.join(&n)).unwrap())).collect();
    assert!(before == after, "the source folder changed");
    assert_eq!(listing(d.path()), ["ids.safetensors", "link", "models"]);
}

/// `dir/model.safetensors` with element `at` of `tensor` set to `x`.
fn damage(dir: &Path, tensor: &str, at: usize, x: f64) {
    let path = dir.join(SINGLE_FILE);
    let mut tensors = read_safetensors(&path).unwrap();
    let (_, t) = tensors.iter_mut().find(|(n, _)| n == tensor).unwrap();
    let mut data = t.to_f64();
    data[at] = x;
    *t = HostTensor::from_f64(t.ty.clone(), &data);
    write_safetensors_atomic(&path, &tensors).unwrap();
}

#[test]
fn a_nan_or_an_infinity_in_the_weights_is_named_by_train_eval_and_generate() {
    let d = tempfile::tempdir().unwrap();
    let data = chat_token_file(d.path());
    let cases = [
        ("model.layers.0.self_attn.q_proj.weight", 17, f64::NAN, "NaN"),
        ("model.norm.weight", 5, f64::INFINITY, "inf"),
    ];
    for (k, (tensor, at, x, shown)) in cases.into_iter().enumerate() {
        let model = d.path().join(format!("damaged{k}"));
        write_model(&model, "llama", false, None);
        damage(&model, tensor, at, x);
        let m = s(&model);
        let want = format!("tensor `{tensor}` holds {shown} at element {at}");
        let out = d.path().join(format!("out{k}"));
        let commands: [Vec<&str>; 3] = [
            vec![
                "train",
                "--device",
                "cpu",
                "--init-from",
                m,
                "--data",
                s(&data),
                "--seq",
                "16",
                "--batch",
                "2",
                "--steps",
                "2",
                "--eval-every",
                "0",
                "--out",
                s(&out),
            ],
            vec!["eval", "--device", "cpu", "--init-from", m, "--data", s(&data), "--seq", "16", "--batch", "2"],
            vec!["generate", "--device", "cpu", "--init-from", m, "--prompt", "The cat", "--max-new-tokens", "3"],
        ];
        for args in commands {
            let err = fails_with(&args, &want);
            assert!(err.contains(SINGLE_FILE) && err.contains("the folder is damaged"), "{args:?}: {err}");
            assert!(!err.contains("learning rate"), "{args:?} blames the learning rate: {err}");
        }
        assert!(!out.exists(), "train wrote --out from damaged weights");
    }
}

/// Trace-named GPT-NeoX tensors (parameters or their gradients) in the
/// layout `transformers` saves, converted by hand from its conventions
/// rather than by the name table under test: `gpt_neox.*` names,
/// `embed_out` for the head, and q, k, v fused into `query_key_value`
/// viewed as `[n_head, 3, head_size, ...]`.
fn as_neox(tensors: &[(String, HostTensor)], heads: usize) -> Vec<(String, HostTensor)> {
    let by_name: BTreeMap<&str, &HostTensor> = tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
    let mut out = Vec::new();
    for (name, t) in tensors {
        if name.contains(".k_proj.") || name.contains(".v_proj.") {
            continue;
        }
        if name.contains(".q_proj.") {
            let parts: Vec<&HostTensor> =
                ["q_proj", "k_proj", "v_proj"].iter().map(|p| by_name[name.replace("q_proj", p).as_str()]).collect();
            let block = t.bytes().len() / heads;
            let mut shape = t.ty.shape.clone();
            shape[0] *= 3;
            let mut fused = HostTensor::zeros(TensorType::new(t.ty.dtype, shape));
            for h in 0..heads {
                for (j, part) in parts.iter().enumerate() {
                    fused.bytes_mut()[(h * 3 + j) * block..][..block]
                        .copy_from_slice(&part.bytes()[h * block..][..block]);
                }
            }
            let fused_name = name
                .replace("model.layers", "gpt_neox.layers")
                .replace("self_attn.q_proj", "attention.query_key_value");
            out.push((fused_name, fused));
            continue;
        }
        let renamed = name
            .replace("model.embed_tokens", "gpt_neox.embed_in")
            .replace("model.norm", "gpt_neox.final_layer_norm")
            .replace("model.layers", "gpt_neox.layers")
            .replace("self_attn.o_proj", "attention.dense")
            .replace("mlp.up_proj", "mlp.dense_h_to_4h")
            .replace("mlp.down_proj", "mlp.dense_4h_to_h")
            .replace("lm_head", "embed_out");
        out.push((renamed, t.clone()));
    }
    out
}

/// A reference folder for `compare` of a tiny GPT-NeoX, as
/// `torch_reference.py --save` writes it: `config.json`, the state dict
/// and the gradients under `transformers`' names, the ids and the loss.
/// The step is stepgraph's own CPU step on trace names, so the comparison
/// must be exact.
fn write_neox_reference(dir: &Path) {
    std::fs::create_dir_all(dir).unwrap();
    let config_value = config_json("gpt_neox", false);
    std::fs::write(dir.join("config.json"), serde_json::to_vec_pretty(&config_value).unwrap()).unwrap();
    let config = Config::from_hf_json(&config_value.to_string(), "neox").unwrap();
    let heads = config.n_head;
    let spec = ModelSpec {
        config,
        batch: 2,
        seq: 5,
        dtype: DType::F32,
        loss: LossKind::CrossEntropy,
        adapters: None,
        documents: false,
    };
    let c = compile_step(&spec, &StepOptions::new(StepKind::Grads)).unwrap();
    let weights = name_params(&c.forward, init_params(&c.forward, 5)).unwrap();
    write_safetensors_atomic(&dir.join("weights.safetensors"), &as_neox(&weights, heads)).unwrap();
    let ids: Vec<f64> = (0..10).map(|i| ((i * 37 + 11) % 500) as f64).collect();
    let ids = HostTensor::from_f64(TensorType::new(DType::I64, [2, 5]), &ids);
    let mut session = CpuSession::new(c.step, c.plan).unwrap();
    for (name, value) in &weights {
        session.write_named(name, value).unwrap();
    }
    for (name, value) in reference_batch(&ids, LossKind::CrossEntropy).unwrap() {
        session.write_named(name, &value).unwrap();
    }
    session.run_eager().unwrap();
    let loss = HostTensor::from_f64(TensorType::new(DType::F32, [1]), &[session.loss().unwrap()]);
    write_safetensors_atomic(&dir.join("io.safetensors"), &[("input_ids".into(), ids), ("loss".into(), loss)]).unwrap();
    let grads: Vec<(String, HostTensor)> = weights
        .iter()
        .map(|(name, _)| {
            let trace = session.trace();
            let g = trace.grad_of(trace.leaf_by_name(name).unwrap()).unwrap();
            (name.clone(), session.read(g))
        })
        .collect();
    write_safetensors_atomic(&dir.join("grads.safetensors"), &as_neox(&grads, heads)).unwrap();
}

#[test]
fn compare_reads_a_gpt_neox_reference_by_its_transformers_names() {
    let d = tempfile::tempdir().unwrap();
    let reference = d.path().join("neox");
    write_neox_reference(&reference);
    let names: Vec<String> =
        read_safetensors(&reference.join("weights.safetensors")).unwrap().into_iter().map(|(n, _)| n).collect();
    assert!(names.iter().any(|n| n == "gpt_neox.layers.1.attention.query_key_value.weight"), "{names:?}");
    let args = ["compare", "--reference", s(&reference), "--loss", "ce", "--device", "cpu", "--json"];
    let (out, _) = run_ok(&args);
    let report: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(report["pass"], true, "{report}");
    assert_eq!(report["loss"]["rel"], 0.0, "{report}");
    // Every parameter (16 a layer, q, k and v among them; embedding, head, final norm) compared exactly.
    let grads = report["grads"].as_array().unwrap();
    assert_eq!(grads.len(), 2 * 16 + 4, "{report}");
    assert!(grads.iter().all(|g| g["rel"] == 0.0), "{report}");

    // A wrong element in the k part of a fused gradient fails as k_proj's.
    let path = reference.join("grads.safetensors");
    let mut grads = read_safetensors(&path).unwrap();
    let (_, qkv) = grads.iter_mut().find(|(n, _)| n == "gpt_neox.layers.1.attention.query_key_value.bias").unwrap();
    let mut data = qkv.to_f64();
    // Head 2's block is [q, k, v] of head_size 8 each: its k starts at 2·24 + 8.
    data[2 * 24 + 8 + 3] += 1.0;
    *qkv = HostTensor::from_f64(qkv.ty.clone(), &data);
    write_safetensors_atomic(&path, &grads).unwrap();
    let err = fails_with(&args[..7], "1 of 36 gradients fail");
    assert!(err.contains("model.layers.1.self_attn.k_proj.bias"), "{err}");
}
