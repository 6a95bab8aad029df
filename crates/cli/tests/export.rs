//! `stepgraph export`: every checkpoint a run saves becomes a Hugging Face
//! folder that `eval`, `generate` and `transformers` load: the last one
//! equals the run's `--out` bit for bit, an intermediate one evaluates to
//! the validation loss the run printed at its step, and `eval` and
//! `generate` read a checkpoint as it is.

mod common;
use common::{chat_token_file, fails_with, folder_tensors, s, stepgraph};

fn run_ok(args: &[&str]) -> (String, String) {
    let (ok, out, err) = stepgraph(args);
    assert!(ok, "{args:?} failed:\n{err}");
    (out, err)
}

#[test]
fn checkpoints_export_as_folders_that_evaluate_and_generate() {
    let d = tempfile::tempdir().unwrap();
    let data = chat_token_file(d.path());
    let (ck, out) = (d.path().join("ck"), d.path().join("out"));
    let (_, err) = run_ok(&[
        "train",
        "--device",
        "cpu",
        "--model",
        "tiny-llama",
        "--vocab",
        "512",
        "--data",
        s(&data),
        "--seq",
        "16",
        "--batch",
        "2",
        "--steps",
        "8",
        "--eval-every",
        "4",
        "--save-every",
        "4",
        "--checkpoint-dir",
        s(&ck),
        "--out",
        s(&out),
        "--tokenizer",
        common::README_TOKENIZER,
        "--log-every",
        "0",
    ]);
    // The last checkpoint, named by its checkpoint directory, is the run's --out.
    let last = d.path().join("last");
    let (_, said) = run_ok(&["export", s(&ck), "--out", s(&last), "--tokenizer", common::README_TOKENIZER]);
    assert!(said.contains("exported step 8 of"), "{said}");
    assert_eq!(folder_tensors(&last), folder_tensors(&out));
    assert!(last.join("config.json").is_file() && last.join("tokenizer.json").is_file());
    // An intermediate one evaluates to what the run printed at its step.
    let mid = d.path().join("mid");
    run_ok(&["export", s(&ck.join("step-000004")), "--out", s(&mid), "--init-from", s(&out)]);
    let printed = err.split("validation at step 4: loss ").nth(1).unwrap()[..6].to_string();
    let (eval, _) =
        run_ok(&["eval", "--device", "cpu", "--init-from", s(&mid), "--data", s(&data), "--seq", "16", "--batch", "2"]);
    assert_eq!(eval.split("validation loss ").nth(1).unwrap()[..6], printed, "{eval}");
    let (_, gen) =
        run_ok(&["generate", "--device", "cpu", "--init-from", s(&mid), "--prompt", "The", "--max-new-tokens", "4"]);
    assert!(gen.contains("time to first token"), "{gen}");
    // `eval` and `generate` read a checkpoint as it is: the same loss, and
    // text once a tokenizer is named (a checkpoint holds none).
    let step4 = ck.join("step-000004");
    let (direct, said) = run_ok(&[
        "eval",
        "--device",
        "cpu",
        "--init-from",
        s(&step4),
        "--data",
        s(&data),
        "--seq",
        "16",
        "--batch",
        "2",
    ]);
    assert_eq!(direct.split("validation loss ").nth(1).unwrap()[..6], printed, "{direct}");
    assert!(said.contains("reading step 4 of") && direct.contains(s(&step4)), "{said}{direct}");
    let e = fails_with(
        &["generate", "--device", "cpu", "--init-from", s(&step4), "--prompt", "The", "--max-new-tokens", "4"],
        "--tokenizer",
    );
    assert!(e.contains("holds no tokenizer"), "{e}");
    let (_, gen) = run_ok(&[
        "generate",
        "--device",
        "cpu",
        "--init-from",
        s(&step4),
        "--tokenizer",
        common::README_TOKENIZER,
        "--prompt",
        "The",
        "--max-new-tokens",
        "4",
    ]);
    assert!(gen.contains("time to first token"), "{gen}");
    // No temporary folder outlives the command.
    let left = std::fs::read_dir(std::env::temp_dir())
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().starts_with("stepgraph-checkpoint-"))
        .count();
    assert_eq!(left, 0, "a temporary checkpoint folder was left behind");
    // The export never writes over its inputs, and a folder without checkpoints is named.
    fails_with(&["export", s(&ck.join("step-000004")), "--out", s(&ck)], "--out");
    fails_with(&["export", s(d.path()), "--out", s(&d.path().join("x"))], "holds no complete checkpoint");
}
