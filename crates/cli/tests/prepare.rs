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
