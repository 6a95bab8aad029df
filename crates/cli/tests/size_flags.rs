//! No size makes the CLI panic or plan a wrapped number: every size flag of
//! `plan`, `trace` and `train` at 2^62 and at `usize::MAX` is refused with
//! an error that names the flag, and a `config.json` key at such a value
//! with an error that names the key and the file.

mod common;
use common::stepgraph;

use std::path::Path;

const SIZE_FLAGS: [&str; 9] = [
    "--batch",
    "--seq",
    "--vocab",
    "--n-embd",
    "--n-layer",
    "--n-head",
    "--n-query-groups",
    "--intermediate-size",
    "--block-size",
];

const HUGE: [&str; 2] = ["4611686018427387904", "18446744073709551615"];

/// `args` fails with one error line that contains every one of `want`, and no panic.
fn refused(args: &[&str], want: &[&str]) -> String {
    let (ok, out, err) = stepgraph(args);
    assert!(!ok, "{args:?} should fail, printed: {out}");
    assert!(!err.contains("panicked") && !err.contains("RUST_BACKTRACE"), "{args:?} panicked: {err}");
    assert!(err.starts_with("error: "), "{args:?}: {err}");
    for w in want {
        assert!(err.contains(w), "{args:?}: expected `{w}` in: {err}");
    }
    err
}

#[test]
fn every_size_flag_at_huge_values_is_refused_by_name() {
    let commands: [&[&str]; 3] = [&["plan"], &["trace"], &["train", "--steps", "1", "--device", "cpu"]];
    for command in commands {
        for flag in SIZE_FLAGS {
            for value in HUGE {
                let args: Vec<&str> = command.iter().copied().chain([flag, value]).collect();
                refused(&args, &[&format!("{flag} {value}")]);
            }
        }
    }
}

#[test]
fn sizes_that_multiply_past_the_limit_name_each_flag() {
    // Each fits on its own; their product (the hidden states) does not.
    refused(
        &["plan", "--batch", "1099511627776", "--n-layer", "64"],
        &["--batch 1099511627776", "--n-layer 64", "the most one plan can hold"],
    );
    refused(&["plan", "--n-embd", "1073741824", "--n-head", "4"], &["--n-embd 1073741824", "--n-head 4", "parameters"]);
    // A width that leaves a derived size wrapping: pythia's GELU MLP is 4 × n_embd.
    let err = refused(&["plan", "--model", "pythia-14m", "--n-embd", "4611686018427387904"], &["--n-embd"]);
    assert!(!err.contains("must be positive"), "{err}");
}

#[test]
fn huge_sizes_that_fit_plan_exact_numbers() {
    // 2^40 rows of 256 tokens: 2^50 bytes of token ids, planned, not wrapped.
    let (ok, out, err) = stepgraph(&["plan", "--json", "--batch", "1099511627776", "--seq", "16", "--step", "forward"]);
    assert!(ok, "{err}");
    let report: serde_json::Value = serde_json::from_str(&out).unwrap();
    let peak = report["planned_peak_bytes"].as_u64().unwrap();
    // At least the token ids and the hidden states [2^40, 16, 64] in f32.
    assert!(peak >= (1u64 << 40) * 16 * 64 * 4, "{peak}");
    assert!(peak <= 1 << 60, "{peak}");
}

fn write_config(dir: &Path, key: &str, value: &str) -> String {
    let mut fields = [
        ("model_type", "\"llama\"".to_string()),
        ("hidden_size", "64".into()),
        ("num_attention_heads", "4".into()),
        ("num_hidden_layers", "2".into()),
        ("intermediate_size", "128".into()),
        ("vocab_size", "256".into()),
        ("max_position_embeddings", "256".into()),
    ];
    for f in fields.iter_mut().filter(|f| f.0 == key) {
        f.1 = value.to_string();
    }
    let text = format!("{{{}}}", fields.iter().map(|(k, v)| format!("\"{k}\": {v}")).collect::<Vec<_>>().join(", "));
    let file = dir.join(format!("{key}-{value}.json"));
    std::fs::write(&file, text).unwrap();
    file.to_str().unwrap().to_string()
}

#[test]
fn config_json_keys_at_huge_values_name_the_key_and_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let keys = ["hidden_size", "num_hidden_layers", "intermediate_size", "vocab_size", "max_position_embeddings"];
    for key in keys {
        for value in HUGE {
            let file = write_config(dir.path(), key, value);
            refused(&["plan", "--config", &file], &[&file, key, value]);
            refused(&["train", "--steps", "1", "--device", "cpu", "--config", &file], &[&file, key, value]);
        }
    }
    // Head counts that do not divide the width.
    for value in HUGE {
        let file = write_config(dir.path(), "num_attention_heads", value);
        refused(&["plan", "--config", &file], &[&file, &format!("num_attention_heads {value}")]);
    }
    // Sizes from the file that multiply past the limit with a flag's: both named.
    let file = write_config(dir.path(), "hidden_size", "1048576");
    refused(
        &["plan", "--config", &file, "--batch", "1099511627776", "--seq", "16"],
        &["--batch 1099511627776, --seq 16", &format!("{file} (key hidden_size)"), "the hidden states"],
    );
}
