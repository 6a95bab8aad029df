//! `stepgraph prepare` on the formats people bring, as a user runs it:
//! ShareGPT JSONL, an alpaca JSON array, a Parquet file (written here with
//! the `parquet` crate's writer), a weighted mixture of two inputs with its
//! summary, and the errors for a bad role, a wrong column and a bad weight.

mod common;
use common::{s, stepgraph};

use std::path::{Path, PathBuf};

use stepgraph_data::fixtures::{self, TemplateStyle};
use stepgraph_data::TokenFile;

fn tokenizer(dir: &Path) -> String {
    let tiny = concat!(env!("CARGO_MANIFEST_DIR"), "/../../data/tiny.txt");
    let tok = fixtures::train_tokenizer(Path::new(tiny), &dir.join("tok"), 400, TemplateStyle::ChatMl).unwrap();
    tok.display().to_string()
}

fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

/// `prepare --json` of `inputs` (and `extra` flags): the report.
fn prepare_json(tok: &str, inputs: &[&str], out: &Path, extra: &[&str]) -> serde_json::Value {
    let mut args = vec!["prepare", "--tokenizer", tok, "--input"];
    args.extend(inputs);
    args.extend(["--out", s(out), "--val-docs", "0", "--json"]);
    args.extend(extra);
    let (ok, stdout, stderr) = stepgraph(&args);
    assert!(ok, "{stderr}");
    serde_json::from_str(&stdout).unwrap()
}

#[test]
fn prepare_reads_sharegpt_an_alpaca_array_and_parquet() {
    let dir = tempfile::tempdir().unwrap();
    let tok = tokenizer(dir.path());
    let sharegpt = write(dir.path(), "sharegpt.jsonl", fixtures::SHAREGPT_JSONL);
    let report = prepare_json(&tok, &[s(&sharegpt)], &dir.path().join("a.tokens"), &["--chat"]);
    assert_eq!(report["docs"], 2);
    assert!(report["masked_tokens"].as_u64().unwrap() > 0);

    let alpaca = write(dir.path(), "alpaca.json", fixtures::ALPACA_JSON);
    let report = prepare_json(&tok, &[s(&alpaca)], &dir.path().join("b.tokens"), &["--chat"]);
    assert_eq!(report["docs"], 3);

    let parquet = dir.path().join("texts.parquet");
    let texts = [Some("The planner reads the story."), Some("A gradient can sleep."), Some("The graph remembers.")];
    fixtures::write_parquet_texts(&parquet, "content", &texts).unwrap();
    let out = dir.path().join("c.tokens");
    let report = prepare_json(&tok, &[s(&parquet)], &out, &["--column", "content"]);
    assert_eq!(report["docs"], 3);
    // Far more than the handful of tokens its bytes would make as text.
    assert!(report["tokens"].as_u64().unwrap() >= 15, "{report}");
    assert_eq!(TokenFile::open(&out).unwrap().n_docs(), 3);

    // Refused as text, whatever --format says.
    let (ok, _, stderr) = stepgraph(&[
        "prepare",
        "--tokenizer",
        &tok,
        "--input",
        s(&parquet),
        "--format",
        "text",
        "--out",
        s(&dir.path().join("d.tokens")),
    ]);
    assert!(!ok && stderr.contains("a Parquet file"), "{stderr}");
}

#[test]
fn prepare_mixes_inputs_by_weight_and_says_what_each_gave() {
    let dir = tempfile::tempdir().unwrap();
    let tok = tokenizer(dir.path());
    let jsonl: String = (0..200)
        .map(|i| {
            serde_json::json!({ "text": format!("alpha {i}: the planner reads the whole story.") }).to_string() + "\n"
        })
        .collect();
    let a = write(dir.path(), "alpha.jsonl", &jsonl);
    let beta: Vec<String> = (0..300).map(|i| format!("beta {i}: a gradient can sleep where it lived.")).collect();
    let b = dir.path().join("beta.parquet");
    fixtures::write_parquet_texts(&b, "text", &beta.iter().map(|t| Some(t.as_str())).collect::<Vec<_>>()).unwrap();
    let out = dir.path().join("mix.tokens");
    let (a_spec, b_spec) = (format!("{}:0.7", s(&a)), format!("{}:0.3", s(&b)));
    let report = prepare_json(&tok, &[&a_spec, &b_spec], &out, &[]);
    let inputs = report["inputs"].as_array().unwrap();
    let total = report["tokens"].as_f64().unwrap();
    let share = inputs[0]["tokens"].as_f64().unwrap() / total;
    assert!((share - 0.7).abs() <= 0.02, "{report}");
    assert_eq!(inputs[0]["weight"], 0.7);
    assert_eq!(inputs[1]["path"], s(&b));

    // The printed summary names each input's tokens and documents.
    let (ok, stdout, stderr) =
        stepgraph(&["prepare", "--tokenizer", &tok, "--input", &a_spec, &b_spec, "--out", s(&out)]);
    assert!(ok, "{stderr}");
    let line = stdout.lines().find(|l| l.contains("beta.parquet")).unwrap_or_else(|| panic!("{stdout}"));
    assert!(line.contains("tokens (") && line.contains("asked 30.0%") && line.contains("of 300 documents"), "{line}");
}

#[test]
fn prepare_refuses_bad_roles_columns_and_weights() {
    let dir = tempfile::tempdir().unwrap();
    let tok = tokenizer(dir.path());
    let out = dir.path().join("out.tokens");
    let fails = |inputs: &[&str], extra: &[&str], want: &[&str]| {
        let mut args = vec!["prepare", "--tokenizer", tok.as_str(), "--input"];
        args.extend(inputs);
        args.extend(["--out", s(&out), "--chat"]);
        args.extend(extra);
        let (ok, _, stderr) = stepgraph(&args);
        assert!(!ok, "{args:?} succeeded");
        for w in want {
            assert!(stderr.contains(w), "`{w}` in {stderr}");
        }
        assert!(!out.exists());
    };
    let role = write(
        dir.path(),
        "role.jsonl",
        "{\"conversations\": [{\"from\": \"human\", \"value\": \"x\"}, {\"from\": \"tool\", \"value\": \"y\"}]}\n",
    );
    fails(&[s(&role)], &[], &["role.jsonl:1", "conversations[1]", "unknown role `tool`", "gpt"]);

    let parquet = dir.path().join("texts.parquet");
    fixtures::write_parquet_texts(&parquet, "content", &[Some("one"), Some("two")]).unwrap();
    fails(
        &[s(&parquet)],
        &["--column", "body"],
        &["texts.parquet", "no column `body`", "content (string), id (int64)"],
    );

    let a = write(dir.path(), "a.jsonl", fixtures::TEXT_JSONL);
    for bad in ["0", "-1", "inf"] {
        let spec = format!("{}:{bad}", s(&a));
        fails(&[&spec, s(&parquet)], &[], &["must be positive and finite"]);
    }
    let spec = format!("{}:0.5", s(&a));
    fails(&[&spec, s(&parquet)], &[], &["has none", "texts.parquet"]);
}
