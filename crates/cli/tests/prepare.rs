//! `stepgraph prepare` as a user runs it: a tokenizer trained on
//! `data/tiny.txt`, text and chat inputs, the report, and errors that name
//! the file, line or flag.

mod common;
use common::stepgraph;

use std::path::Path;

use stepgraph_data::fixtures::{self, TemplateStyle};
use stepgraph_data::{Split, TokenFile};

fn tokenizer(dir: &Path) -> String {
    let tiny = concat!(env!("CARGO_MANIFEST_DIR"), "/../../data/tiny.txt");
    let tok = fixtures::train_tokenizer(Path::new(tiny), &dir.join("tok"), 400, TemplateStyle::ChatMl).unwrap();
    tok.display().to_string()
}

#[test]
fn prepare_text_and_chat_into_one_token_file() {
    let dir = tempfile::tempdir().unwrap();
    let tok = tokenizer(dir.path());
    let chat = dir.path().join("chat.jsonl");
    std::fs::write(&chat, fixtures::CHAT_JSONL).unwrap();
    let out = dir.path().join("tiny.tokens");
    let (ok, stdout, stderr) = stepgraph(&[
        "prepare",
        "--tokenizer",
        &tok,
        "--input",
        "data/tiny.txt",
        chat.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--chat",
        "--val-docs",
        "2",
        "--seed",
        "3",
        "--json",
    ]);
    assert!(ok, "{stderr}");
    let report: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(report["docs"], 10);
    assert_eq!(report["validation_docs"], 2);
    assert_eq!(report["files"], 2);
    assert!(report["masked_tokens"].as_u64().unwrap() > 0);
    let file = TokenFile::open(&out).unwrap();
    assert_eq!(file.n_tokens(), report["tokens"].as_u64().unwrap());
    assert_eq!(file.split_docs(Split::Validation), 8..10);
    assert!(file.has_mask());

    // The text report.
    let (ok, stdout, stderr) =
        stepgraph(&["prepare", "--tokenizer", &tok, "--input", "data/tiny.txt", "--out", out.to_str().unwrap()]);
    assert!(ok, "{stderr}");
    assert!(stdout.contains("documents:        8 (7 train, 1 validation)"), "{stdout}");
    assert!(stdout.contains("masked tokens:    0"), "{stdout}");
}

#[test]
fn prepare_errors_name_the_flag_file_and_line() {
    let dir = tempfile::tempdir().unwrap();
    let tok = tokenizer(dir.path());
    let out = dir.path().join("x.tokens");
    let out = out.to_str().unwrap();
    let bad = dir.path().join("bad.jsonl");
    std::fs::write(&bad, "{\"text\": \"ok\"}\n{\"txt\": \"typo\"}\n").unwrap();
    let (ok, _, err) = stepgraph(&["prepare", "--tokenizer", &tok, "--input", bad.to_str().unwrap(), "--out", out]);
    assert!(!ok);
    assert!(err.contains("bad.jsonl:2") && err.contains("missing key") && err.contains("[txt]"), "{err}");
    let (ok, _, err) =
        stepgraph(&["prepare", "--tokenizer", &tok, "--input", "data/tiny.txt", "--out", out, "--val-fraction", "1.5"]);
    assert!(!ok);
    assert!(err.contains("--val-fraction must be in [0, 1), got 1.5"), "{err}");
    let (ok, _, err) = stepgraph(&["prepare", "--tokenizer", &tok, "--input", "data/missing.txt", "--out", out]);
    assert!(!ok);
    assert!(err.contains("data/missing.txt") && err.contains("reading the input"), "{err}");
    assert!(!Path::new(out).exists());
}

/// `--out` onto what `prepare` reads is refused before any tokenizing,
/// however the path is spelled, and the input stays as it was.
#[test]
fn prepare_never_overwrites_an_input() {
    let dir = tempfile::tempdir().unwrap();
    let tok = tokenizer(dir.path());
    let text = dir.path().join("text/x.txt");
    std::fs::create_dir_all(text.parent().unwrap()).unwrap();
    std::fs::write(&text, "One paragraph.\n\nAnother paragraph.\n").unwrap();
    std::os::unix::fs::symlink(dir.path().join("text"), dir.path().join("link")).unwrap();
    let tok_json = Path::new(&tok).join("tokenizer.json");
    let before = |p: &Path| std::fs::read(p).unwrap();
    let (text_bytes, tok_bytes) = (before(&text), before(&tok_json));
    let onto_text = [
        text.clone(),
        dir.path().join("text/../text/x.txt"),
        dir.path().join("link/x.txt"),
        dir.path().join("text/missing/../x.txt"),
    ];
    for out in &onto_text {
        let (ok, _, err) = stepgraph(&[
            "prepare",
            "--tokenizer",
            &tok,
            "--input",
            text.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
        ]);
        assert!(!ok, "--out {} was accepted", out.display());
        assert!(err.contains("is the --input file") && err.contains("choose another path"), "{err}");
    }
    // The tokenizer's files, given as the folder or as tokenizer.json.
    for (tok_arg, out) in [
        (tok.clone(), tok_json.clone()),
        (tok_json.display().to_string(), Path::new(&tok).join("tokenizer_config.json")),
    ] {
        let (ok, _, err) = stepgraph(&[
            "prepare",
            "--tokenizer",
            &tok_arg,
            "--input",
            text.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
        ]);
        assert!(!ok, "--out {} was accepted", out.display());
        assert!(err.contains("--tokenizer folder"), "{err}");
    }
    assert_eq!(before(&text), text_bytes);
    assert_eq!(before(&tok_json), tok_bytes);
}

/// `--out` in folders that do not exist yet creates them; an unwritable
/// place is refused up front, naming the flag, with the OS error once.
#[test]
fn prepare_creates_the_out_folder_and_refuses_unwritable_places() {
    let dir = tempfile::tempdir().unwrap();
    let tok = tokenizer(dir.path());
    let out = dir.path().join("runs/new/x.tokens");
    let (ok, _, err) =
        stepgraph(&["prepare", "--tokenizer", &tok, "--input", "data/tiny.txt", "--out", out.to_str().unwrap()]);
    assert!(ok, "{err}");
    assert!(TokenFile::open(&out).is_ok());
    let file = dir.path().join("plain");
    std::fs::write(&file, "").unwrap();
    let under_file = file.join("x.tokens");
    for (out, want) in
        [("/proc/x.tokens", "cannot write in /proc"), (under_file.to_str().unwrap(), "cannot create the folder")]
    {
        let (ok, _, err) = stepgraph(&["prepare", "--tokenizer", &tok, "--input", "data/tiny.txt", "--out", out]);
        assert!(!ok);
        assert!(err.contains(&format!("--out {out}")) && err.contains(want), "{err}");
        assert_eq!(err.matches("os error").count(), 1, "the cause is said once: {err}");
    }
}
