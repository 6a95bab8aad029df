//! `stepgraph train` on a user's own model and data: `--init-from` a
//! Hugging Face folder of every family (sharded and not), `--out` a folder
//! that loads back, token files of `stepgraph prepare` with exact resume,
//! `stepgraph eval`, the README's fine-tuning example run as written, and
//! clear errors for folders and data that do not fit, before any training.
//!
//! The fixtures are made here: tiny models written by [`write_model`]
//! (a `config.json` as `transformers` writes it, seeded weights saved
//! through `save_hf_dir`), and the BPE tokenizer in `data/tokenizer`, which
//! [`regenerate_the_readme_tokenizer`] trains with the `tokenizers` crate.

mod common;
use common::{chat_token_file, fails_with, folder_tensors, root, s, stepgraph, write_model, README_TOKENIZER, VOCAB};

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

use serde_json::{json, Value};

use stepgraph_core::models::hf_dir::{HfFamily, HfModelDir, INDEX_FILE};
use stepgraph_data::fixtures::{self, TemplateStyle};

fn run_ok(args: &[&str]) -> (String, String) {
    let (ok, out, err) = stepgraph(args);
    assert!(ok, "{args:?} failed:\n{err}");
    (out, err)
}

/// Trains the README's tokenizer on `data/tiny.txt` (a byte-level BPE of
/// 400 entries with a ChatML template) into `data/tokenizer`, with the
/// `generation_config.json` of a ChatML chat model (generation ends at
/// `<|im_end|>` or `<|endoftext|>`):
/// `cargo test -p stepgraph --test finetune -- --ignored regenerate`.
#[test]
#[ignore = "regenerates the committed data/tokenizer"]
fn regenerate_the_readme_tokenizer() {
    let dir = root().join(README_TOKENIZER);
    fixtures::train_tokenizer(&root().join("data/tiny.txt"), &dir, 400, TemplateStyle::ChatMl).unwrap();
    let tok = stepgraph_data::Tokenizer::load(&dir).unwrap();
    let end_of_turn = tok.token_to_id("<|im_end|>").expect("ChatML's end-of-turn token");
    let config = json!({ "eos_token_id": [end_of_turn, tok.eos_id] });
    std::fs::write(dir.join("generation_config.json"), serde_json::to_string_pretty(&config).unwrap() + "\n").unwrap();
}

/// The committed generation config ends generation at the chat template's
/// end-of-turn token as well as at end-of-sequence.
#[test]
fn the_committed_generation_config_names_the_end_of_turn_token() {
    let dir = root().join(README_TOKENIZER);
    let tok = stepgraph_data::Tokenizer::load(&dir).unwrap();
    let config: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("generation_config.json")).unwrap()).unwrap();
    let ids: Vec<u64> = config["eos_token_id"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap()).collect();
    assert_eq!(ids, [tok.token_to_id("<|im_end|>").unwrap() as u64, tok.eos_id as u64]);
}

/// A short fine-tuning run on the CPU: 2 x 16 tokens, no validation.
fn ft(init: &Path, data: &Path, extra: &[&str]) -> Vec<String> {
    let mut a: Vec<String> = [
        "train",
        "--device",
        "cpu",
        "--init-from",
        s(init),
        "--data",
        s(data),
        "--seq",
        "16",
        "--batch",
        "2",
        "--eval-every",
        "0",
        "--log-every",
        "0",
    ]
    .iter()
    .map(|x| x.to_string())
    .collect();
    a.extend(extra.iter().map(|x| x.to_string()));
    a
}

/// `args` of [`ft`] with validation every `every` steps.
fn evaluating(mut args: Vec<String>, every: usize) -> Vec<String> {
    assert_eq!(args[11], "--eval-every");
    args[12] = every.to_string();
    args
}

fn refs(a: &[String]) -> Vec<&str> {
    a.iter().map(String::as_str).collect()
}

#[test]
fn the_committed_tokenizer_loads() {
    let tok = stepgraph_data::Tokenizer::load(&root().join(README_TOKENIZER)).unwrap();
    assert!(tok.vocab_size() as usize <= VOCAB, "{}", tok.vocab_size());
    assert!(root().join(README_TOKENIZER).join("tokenizer_config.json").is_file());
}

/// Every family, sharded and not: a step at learning rate 0 writes back
/// exactly the weights it loaded, under the family's names, with the
/// tokenizer files; the default rate is the fine-tuning one.
#[test]
fn every_family_loads_from_its_folder_and_saves_back_bit_for_bit() {
    let d = tempfile::tempdir().unwrap();
    let data = chat_token_file(d.path());
    let cases = [
        ("llama", false, None),
        ("mistral", false, Some(20_000)),
        ("qwen2", true, Some(20_000)),
        ("gpt_neox", false, None),
    ];
    for (family, tied, shards) in cases {
        let src = d.path().join(format!("{family}-src"));
        write_model(&src, family, tied, shards);
        assert_eq!(src.join(INDEX_FILE).is_file(), shards.is_some(), "{family}");
        let out = d.path().join(format!("{family}-out"));
        let mb = if shards.is_some() { "0.02" } else { "100" };
        let (_, err) =
            run_ok(&refs(&ft(&src, &data, &["--steps", "1", "--lr", "0", "--out", s(&out), "--max-shard-mb", mb])));
        assert!(err.contains("Hugging Face folder, cast to f32") && err.contains("model: "), "{err}");
        let (a, b) = (folder_tensors(&src), folder_tensors(&out));
        assert_eq!(a.keys().collect::<Vec<_>>(), b.keys().collect::<Vec<_>>(), "{family}");
        assert!(a == b, "{family}: a step at lr 0 changed the weights");
        assert_eq!(out.join(INDEX_FILE).is_file(), shards.is_some(), "{family}");
        for f in ["tokenizer.json", "tokenizer_config.json"] {
            assert!(out.join(f).is_file(), "{family}: no {f} in --out");
        }
        let saved: Value = serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap()).unwrap();
        assert_eq!(saved["model_type"], family);
        assert_eq!(HfModelDir::open(&out).unwrap().config().n_layer, 2);
        // Training from the folder: the default rate is a fine-tuning one, and the weights move.
        let moved = d.path().join(format!("{family}-moved"));
        let (_, err) = run_ok(&refs(&ft(&src, &data, &["--steps", "2", "--out", s(&moved)])));
        assert!(err.contains("(default for fine-tuning"), "{err}");
        assert!(folder_tensors(&moved) != a, "{family}: two steps left every weight as it was");
    }
}

/// A token file trains like text: 3 steps + resume + 3 steps equal 6
/// straight, bit for bit; validation reads the file's held-out documents.
#[test]
fn a_token_file_run_resumes_bit_for_bit() {
    let d = tempfile::tempdir().unwrap();
    let data = chat_token_file(d.path());
    let src = d.path().join("src");
    write_model(&src, "llama", false, None);
    let (straight, split) = (d.path().join("straight"), d.path().join("split"));
    let a = evaluating(ft(&src, &data, &["--steps", "6", "--eval-batches", "2", "--checkpoint-dir", s(&straight)]), 3);
    let (_, err) = run_ok(&refs(&a));
    assert!(err.contains("token file:") && err.contains("loss mask"), "{err}");
    assert!(err.contains("validation at step 3: loss"), "{err}");
    let b =
        ft(&src, &data, &["--steps", "6", "--stop-after", "3", "--eval-batches", "2", "--checkpoint-dir", s(&split)]);
    run_ok(&refs(&evaluating(b, 3)));
    let c =
        ft(&src, &data, &["--steps", "6", "--resume", "auto", "--eval-batches", "2", "--checkpoint-dir", s(&split)]);
    let (_, err) = run_ok(&refs(&evaluating(c, 3)));
    assert!(err.contains("resumed     from"), "{err}");
    for file in ["weights.safetensors", "optimizer.safetensors"] {
        let x = std::fs::read(straight.join("step-000006").join(file)).unwrap();
        let y = std::fs::read(split.join("step-000006").join(file)).unwrap();
        assert!(x == y, "{file} differs between the straight and the resumed run");
    }
    let state: Value =
        serde_json::from_str(&std::fs::read_to_string(split.join("step-000006/state.json")).unwrap()).unwrap();
    assert_eq!(state["data"]["kind"], "token-file");
    assert_eq!(state["data"]["cursor"]["batches"], 6);
    let rows = |p: &Path| -> Vec<String> {
        std::fs::read_to_string(p.join("metrics.jsonl")).unwrap().lines().map(str::to_string).collect()
    };
    let loss_bits = |rows: Vec<String>| -> Vec<(u64, u64)> {
        rows.iter()
            .map(|l| serde_json::from_str::<Value>(l).unwrap())
            .filter(|r| r.get("loss").is_some())
            .map(|r| (r["step"].as_u64().unwrap(), r["loss"].as_f64().unwrap().to_bits()))
            .collect()
    };
    assert_eq!(loss_bits(rows(&straight)), loss_bits(rows(&split)));
}

/// `--packing`: each way of sharing rows trains and says which it is; a
/// resume with another packing than the checkpoint's is refused naming
/// both; an unknown one lists the choices.
#[test]
fn packing_is_chosen_and_kept_across_a_resume() {
    let d = tempfile::tempdir().unwrap();
    let data = chat_token_file(d.path());
    let src = d.path().join("src");
    write_model(&src, "llama", false, None);
    let mut losses = Vec::new();
    for packing in ["documents", "stream", "none"] {
        let (out, err) = run_ok(&refs(&ft(&src, &data, &["--steps", "2", "--packing", packing])));
        assert!(err.contains(&format!("packing {packing}")), "{err}");
        let loss = out.split("final loss ").nth(1).expect("a final loss").split_whitespace().next().unwrap();
        losses.push(loss.to_string());
    }
    // Masking documents from each other changes what the model sees.
    assert_ne!(losses[0], losses[1], "documents and stream packing trained alike");
    let ck = d.path().join("ck");
    run_ok(&refs(&ft(&src, &data, &["--steps", "4", "--stop-after", "2", "--checkpoint-dir", s(&ck)])));
    let resumed =
        ft(&src, &data, &["--steps", "4", "--resume", "auto", "--checkpoint-dir", s(&ck), "--packing", "stream"]);
    let err = fails_with(&refs(&resumed), "data.packing");
    assert!(err.contains("documents") && err.contains("stream"), "{err}");
    fails_with(&refs(&ft(&src, &data, &["--steps", "1", "--packing", "padded"])), "documents, stream, none");
}

/// Folders, flags and data that do not fit fail before the run starts
/// (no plan is printed), naming the file and the tensor or the flag.
#[test]
fn what_does_not_fit_fails_before_training() {
    let d = tempfile::tempdir().unwrap();
    let data = chat_token_file(d.path());
    let src = d.path().join("src");
    write_model(&src, "qwen2", false, Some(20_000));
    let check = |args: Vec<String>, want: &str| {
        let e = fails_with(&refs(&args), want);
        assert!(!e.contains("plan for `train`"), "the run started before failing:\n{e}");
        e
    };
    // Geometry flags and another model contradict the folder.
    check(ft(&src, &data, &["--n-layer", "1"]), "--n-layer would change the model of --init-from");
    check(ft(&src, &data, &["--model", "tiny-llama"]), "cannot be used with");
    // A config whose shapes are not the weights'.
    let wrong = d.path().join("wrong");
    copy_dir(&src, &wrong);
    let mut c: Value = serde_json::from_str(&std::fs::read_to_string(wrong.join("config.json")).unwrap()).unwrap();
    c["intermediate_size"] = json!(96);
    std::fs::write(wrong.join("config.json"), c.to_string()).unwrap();
    let e = check(
        ft(&wrong, &data, &[]),
        "model.layers.0.mlp.gate_proj.weight` has shape [64, 32], the model expects [96, 32]",
    );
    assert!(e.contains("model-0000"), "the error names the shard file: {e}");
    // A config with a layer the weights do not have.
    let deeper = d.path().join("deeper");
    copy_dir(&src, &deeper);
    let mut c: Value = serde_json::from_str(&std::fs::read_to_string(deeper.join("config.json")).unwrap()).unwrap();
    c["num_hidden_layers"] = json!(3);
    std::fs::write(deeper.join("config.json"), c.to_string()).unwrap();
    check(ft(&deeper, &data, &[]), "tensor `model.layers.2.self_attn.q_proj.weight` (parameter");
    // A truncated shard.
    let cut = d.path().join("cut");
    copy_dir(&src, &cut);
    let index: Value = serde_json::from_str(&std::fs::read_to_string(src.join(INDEX_FILE)).unwrap()).unwrap();
    let first = index["weight_map"]["model.embed_tokens.weight"].as_str().unwrap().to_string();
    let shard = cut.join(&first);
    let len = std::fs::metadata(&shard).unwrap().len();
    std::fs::OpenOptions::new().write(true).open(&shard).unwrap().set_len(len - 100).unwrap();
    let e = check(ft(&cut, &data, &[]), &first);
    assert!(e.contains("truncated") || e.contains("model.embed_tokens.weight"), "{e}");
    // A tensor missing from the index's shard.
    let missing = d.path().join("missing");
    copy_dir(&src, &missing);
    let mut index: Value = serde_json::from_str(&std::fs::read_to_string(missing.join(INDEX_FILE)).unwrap()).unwrap();
    index["weight_map"]["model.layers.9.mlp.up_proj.weight"] = json!(first);
    std::fs::write(missing.join(INDEX_FILE), index.to_string()).unwrap();
    check(ft(&missing, &data, &[]), "lacks tensor `model.layers.9.mlp.up_proj.weight`");
    check(ft(&d.path().join("nowhere"), &data, &[]), "not a directory");
    // Token ids the model has no embedding row for.
    let small = ["train", "--device", "cpu", "--data", s(&data), "--seq", "16", "--eval-every", "0"];
    check(small.iter().map(|x| x.to_string()).collect(), "does not fit a model with 256 embedding rows");
    // --out onto a folder of other files, or onto a file.
    let other = d.path().join("other");
    std::fs::create_dir_all(&other).unwrap();
    std::fs::write(other.join("notes.txt"), "mine").unwrap();
    check(ft(&src, &data, &["--out", s(&other)]), "holds files but no Hugging Face model");
    check(ft(&src, &data, &["--out", s(&other.join("notes.txt"))]), "exists and is not a folder");
    // Validation needs held-out documents.
    let noval = d.path().join("noval.tokens");
    run_ok(&[
        "prepare",
        "--tokenizer",
        README_TOKENIZER,
        "--input",
        "data/tiny.txt",
        "--val-docs",
        "0",
        "--out",
        s(&noval),
    ]);
    check(evaluating(ft(&src, &noval, &[]), 5), "or turn validation off with --eval-every 0");
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap().flatten() {
        std::fs::copy(entry.path(), to.join(entry.file_name())).unwrap();
    }
}

/// The `stepgraph` command lines of the README's fine-tuning example, in
/// order, exactly as written.
fn readme_example() -> Vec<String> {
    readme_block("<!-- finetune-example")
}

/// The `stepgraph` lines of the README's code block after `marker`.
fn readme_block(marker: &str) -> Vec<String> {
    let readme = std::fs::read_to_string(root().join("README.md")).unwrap();
    let start = readme.find(marker).unwrap_or_else(|| panic!("the README has no `{marker}` block"));
    let block = &readme[start..];
    let code = &block[block.find("```\n").unwrap() + 4..];
    let code = &code[..code.find("```").unwrap()];
    code.lines().filter(|l| l.starts_with("stepgraph ")).map(str::to_string).collect()
}

/// A copy of the repository's tracked files (what a fresh clone holds) in
/// `to`: no `runs/`, no build outputs.
fn copy_of_the_repository(to: &Path) {
    let listed = Command::new("git").args(["ls-files", "-z"]).current_dir(root()).output();
    let files: Vec<String> = match listed {
        Ok(out) if out.status.success() && !out.stdout.is_empty() => {
            out.stdout.split(|b| *b == 0).filter(|f| !f.is_empty()).map(|f| String::from_utf8_lossy(f).into()).collect()
        }
        // Not a git checkout (a source archive): what the example reads.
        _ => {
            let mut files = vec!["README.md".to_string()];
            for entry in walk(&root().join("data")) {
                files.push(entry.strip_prefix(root()).unwrap().to_string_lossy().into_owned());
            }
            files
        }
    };
    for f in files {
        let (from, dest) = (root().join(&f), to.join(&f));
        if from.is_file() {
            std::fs::create_dir_all(dest.parent().unwrap()).unwrap();
            std::fs::copy(&from, &dest).unwrap();
        }
    }
}

fn walk(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap().flatten() {
        let path = entry.path();
        if path.is_dir() {
            files.extend(walk(&path));
        } else {
            files.push(path);
        }
    }
    files
}

/// The README's fine-tuning example as a new user runs it: every command
/// line exactly as written, through a shell, with `stepgraph` on the
/// PATH, in a copy of the repository that has no `runs/` folder; on the
/// CPU (no GPU is visible to it). The fine-tuned model answers the prompt
/// with text, and `eval` of the saved folder gives the resumed run's last
/// validation loss; then the adapter example over the same base.
#[test]
fn the_readme_fine_tuning_example_runs_as_written() {
    let d = tempfile::tempdir().unwrap();
    let repo = d.path().join("stepgraph");
    copy_of_the_repository(&repo);
    assert!(repo.join("README.md").is_file() && !repo.join("runs").exists());
    let bin = d.path().join("bin");
    std::fs::create_dir(&bin).unwrap();
    std::os::unix::fs::symlink(env!("CARGO_BIN_EXE_stepgraph"), bin.join("stepgraph")).unwrap();
    let path = format!("{}:{}", bin.display(), std::env::var("PATH").unwrap_or_default());
    let mut commands = readme_example();
    let kinds: Vec<&str> = commands.iter().map(|c| c.split_whitespace().nth(1).unwrap()).collect();
    assert_eq!(kinds, ["prepare", "train", "train", "train", "eval", "generate"]);
    // Then the adapter example, over the same base and data.
    let lora = readme_block("<!-- lora-example");
    let kinds: Vec<&str> = lora.iter().map(|c| c.split_whitespace().nth(1).unwrap()).collect();
    assert_eq!(kinds, ["train", "eval", "generate"]);
    commands.extend(lora);
    let outputs: Vec<(String, String)> = commands
        .iter()
        .map(|line| {
            let out = Command::new("sh")
                .args(["-c", line])
                .current_dir(&repo)
                .env("PATH", &path)
                .env("CUDA_VISIBLE_DEVICES", "")
                .output()
                .unwrap();
            let (stdout, stderr) =
                (String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr).into_owned());
            assert!(out.status.success(), "{line}\nfailed:\n{stderr}");
            (stdout, stderr)
        })
        .collect();
    let (base, ft) = (repo.join("runs/base"), repo.join("runs/ft"));
    // The stopped run says where --out will come from; the resumed one writes it.
    assert!(outputs[2].1.contains("is written when the run reaches step 100"), "{}", outputs[2].1);
    assert!(outputs[3].1.contains("resumed     from") && outputs[3].1.contains("model: "), "{}", outputs[3].1);
    assert!(outputs[2].1.contains("(default for fine-tuning"), "{}", outputs[2].1);
    for dir in [&base, &ft] {
        let hf = HfModelDir::open(dir).unwrap();
        assert_eq!(hf.family(), HfFamily::Llama);
        for file in ["tokenizer.json", "tokenizer_config.json", "generation_config.json"] {
            assert!(dir.join(file).is_file(), "{} has no {file}", dir.display());
        }
    }
    assert!(folder_tensors(&base) != folder_tensors(&ft), "fine-tuning left the weights as they were");
    // eval on the saved folder gives the resumed run's last validation loss.
    let validation = outputs[3].1.split("validation at step 100: loss ").nth(1).unwrap()[..6].to_string();
    let eval = outputs[4].0.split("validation loss ").nth(1).unwrap()[..6].to_string();
    assert_eq!(eval, validation, "{}", outputs[4].0);
    // The model answers with text, ended by its end-of-turn token, which is not printed.
    let answer = outputs[5].0.trim();
    assert!(!answer.is_empty(), "the fine-tuned model answered nothing: {}", outputs[5].1);
    assert!(!answer.contains("<|im_end|>"), "{answer}");
    assert!(outputs[5].1.contains("time to first token"), "{}", outputs[5].1);
    // The adapter run writes a peft folder; eval with it gives the run's
    // last validation loss; the base with its adapter answers with text.
    let lora = repo.join("runs/lora");
    for file in ["adapter_config.json", "adapter_model.safetensors", "tokenizer.json"] {
        assert!(lora.join(file).is_file(), "runs/lora has no {file}");
    }
    assert!(outputs[6].1.contains("adapters    LoRA rank 8") && outputs[6].1.contains("default for adapters"));
    let validation = outputs[6].1.split("validation at step 100: loss ").nth(1).unwrap()[..6].to_string();
    let eval = outputs[7].0.split("validation loss ").nth(1).unwrap()[..6].to_string();
    assert_eq!(eval, validation, "{}", outputs[7].0);
    assert!(!outputs[8].0.trim().is_empty(), "the base with its adapter answered nothing: {}", outputs[8].1);
}

/// `train --out` killed with SIGKILL while it writes the folder: the
/// destination is always the previous complete save or the new one (the
/// save's own guarantee, proved in `crates/core/tests/hf_dir.rs`; here
/// through the command, with the run's temporary folder watched so the
/// kills land inside the save), and a later run clears what kills left.
#[test]
fn a_run_killed_while_writing_out_leaves_the_old_or_the_new_folder() {
    let d = tempfile::tempdir().unwrap();
    let run = |seed: u64, out: &Path| -> Vec<String> {
        [
            "train",
            "--device",
            "cpu",
            "--n-embd",
            "256",
            "--n-head",
            "4",
            "--vocab",
            "4096",
            "--intermediate-size",
            "512",
            "--seq",
            "16",
            "--steps",
            "1",
            "--eval-every",
            "0",
            "--max-shard-mb",
            "2",
            "--seed",
            &seed.to_string(),
            "--out",
            s(out),
        ]
        .iter()
        .map(|x| x.to_string())
        .collect()
    };
    // What a complete save of each seed holds.
    let expected: Vec<BTreeMap<String, Vec<u8>>> = [1u64, 2]
        .iter()
        .map(|&seed| {
            let r = d.path().join(format!("ref{seed}"));
            run_ok(&refs(&run(seed, &r)));
            folder_tensors(&r)
        })
        .collect();
    assert!(expected[0] != expected[1]);
    let parent = d.path().join("runs");
    let out = parent.join("model");
    std::fs::create_dir_all(&parent).unwrap();
    run_ok(&refs(&run(1, &out)));
    let mut holds = 1u64;
    let mut torn = 0;
    for round in 0..4u64 {
        let seed = 3 - holds;
        let mut child = Command::new(env!("CARGO_BIN_EXE_stepgraph"))
            .args(run(seed, &out))
            .current_dir(root())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let temp_exists = || {
            std::fs::read_dir(&parent)
                .unwrap()
                .flatten()
                .any(|e| e.file_name().to_string_lossy().starts_with(".model.tmp-"))
        };
        let t0 = std::time::Instant::now();
        while !temp_exists() && child.try_wait().unwrap().is_none() {
            assert!(t0.elapsed() < std::time::Duration::from_secs(60), "the run never started its save");
            std::thread::sleep(std::time::Duration::from_micros(200));
        }
        std::thread::sleep(std::time::Duration::from_millis(round));
        child.kill().unwrap(); // SIGKILL, to the child this test started.
        child.wait().unwrap();
        torn += temp_exists() as usize;
        let now = folder_tensors(&out);
        holds = match expected.iter().position(|e| *e == now) {
            Some(k) => k as u64 + 1,
            None => panic!("round {round}: --out holds neither the previous nor the new save"),
        };
        assert!(HfModelDir::open(&out).is_ok());
    }
    assert!(torn > 0, "no kill landed inside a save");
    // A run that finishes replaces the folder and clears the leftovers.
    run_ok(&refs(&run(2, &out)));
    assert!(folder_tensors(&out) == expected[1]);
    let names: Vec<String> =
        std::fs::read_dir(&parent).unwrap().flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect();
    assert_eq!(names, ["model"]);
}
