//! Data knows its tokenizer: `train` and `eval` refuse a token file made by
//! another tokenizer than the model's, and byte-level text for a model that
//! has a tokenizer, before anything is compiled; token files written before
//! tokenizers were recorded still train, with a note.

mod common;
use common::{s, stepgraph, write_model, README_TOKENIZER};

use std::path::{Path, PathBuf};

use stepgraph_data::fixtures::{self, TemplateStyle};

fn prepare(tokenizer: &str, out: &Path) {
    let (ok, _, err) = stepgraph(&["prepare", "--tokenizer", tokenizer, "--input", "data/tiny.txt", "--out", s(out)]);
    assert!(ok, "{err}");
}

/// A token file of `data/tiny.txt` made by a tokenizer other than the
/// README's (fewer merges: the same text, other ids).
fn other_tokens(dir: &Path) -> PathBuf {
    let tiny = common::root().join("data/tiny.txt");
    let tok = fixtures::train_tokenizer(&tiny, &dir.join("other-tok"), 300, TemplateStyle::ChatMl).unwrap();
    let out = dir.join("other.tokens");
    prepare(s(&tok), &out);
    out
}

fn train(extra: &[&str]) -> Vec<String> {
    let base = ["train", "--device", "cpu", "--seq", "16", "--batch", "2", "--steps", "1", "--eval-every", "0"];
    base.iter().chain(extra).map(|x| x.to_string()).collect()
}

fn fails(args: &[String], want: &[&str]) -> String {
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let (ok, out, err) = stepgraph(&args);
    assert!(!ok, "{args:?} should fail: {out}");
    for w in want {
        assert!(err.contains(w), "{args:?}: expected `{w}` in:\n{err}");
    }
    assert!(!err.contains("plan for `train`"), "the run started before failing:\n{err}");
    err
}

#[test]
fn a_token_file_of_another_tokenizer_is_refused_by_train_and_eval() {
    let d = tempfile::tempdir().unwrap();
    let model = d.path().join("model");
    write_model(&model, "llama", false, None);
    let other = other_tokens(d.path());
    let m = s(&model);
    let want = ["was written by another tokenizer", "other.tokens", "tokenizer.json", "stepgraph prepare --tokenizer"];
    let e = fails(&train(&["--init-from", m, "--data", s(&other)]), &want);
    assert!(e.contains(&format!("--init-from {m}")), "{e}");
    let e = fails(
        &train(&["--model", "tiny-llama", "--vocab", "512", "--tokenizer", README_TOKENIZER, "--data", s(&other)]),
        &want,
    );
    assert!(e.contains("--tokenizer data/tokenizer"), "{e}");
    fails(&["eval", "--device", "cpu", "--init-from", m, "--data", s(&other), "--seq", "16"].map(String::from), &want);
    // The model's own tokenizer's file trains.
    let own = d.path().join("own.tokens");
    prepare(README_TOKENIZER, &own);
    let args = train(&["--init-from", m, "--data", s(&own)]);
    let (ok, _, err) = stepgraph(&args.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(ok, "{err}");
}

#[test]
fn text_for_a_model_with_a_tokenizer_is_refused_naming_the_prepare_command() {
    let d = tempfile::tempdir().unwrap();
    let model = d.path().join("model");
    write_model(&model, "llama", false, None);
    let m = s(&model);
    let want =
        ["--data data/tiny.txt is text", "one token per byte", "stepgraph prepare --tokenizer", "data/tiny.tokens"];
    fails(&train(&["--init-from", m, "--data", "data/tiny.txt"]), &want);
    fails(&train(&["--vocab", "512", "--tokenizer", README_TOKENIZER]), &want);
    // eval reads data/tiny.txt unless told otherwise.
    fails(&["eval", "--device", "cpu", "--init-from", m, "--seq", "16"].map(String::from), &want);
}

#[test]
fn a_token_file_without_a_recorded_tokenizer_trains_with_a_note() {
    let d = tempfile::tempdir().unwrap();
    let model = d.path().join("model");
    write_model(&model, "llama", false, None);
    let old = d.path().join("old.tokens");
    prepare(README_TOKENIZER, &old);
    // As files were written before the fingerprint: 0 in its field.
    let mut bytes = std::fs::read(&old).unwrap();
    bytes[56..64].fill(0);
    std::fs::write(&old, bytes).unwrap();
    let args = train(&["--init-from", s(&model), "--data", s(&old)]);
    let (ok, _, err) = stepgraph(&args.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(ok, "{err}");
    assert!(err.contains("records no tokenizer") && err.contains("old.tokens"), "{err}");
}
