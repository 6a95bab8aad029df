//! `stepgraph generate` on the CPU: a tiny Hugging Face folder (written by
//! the shared fixture, with the README's tokenizer and its chat template)
//! continued from a prompt, a JSONL file of prompts split over buckets,
//! stop strings, sampling that a seed reproduces, and bad input refused
//! with its reason.

mod common;
use common::{fails_with, s, stepgraph, write_model};

use serde_json::Value;

fn run_ok(args: &[&str]) -> (String, String) {
    let (ok, out, err) = stepgraph(args);
    assert!(ok, "{args:?} failed:\n{err}");
    (out, err)
}

/// JSON lines of stdout: the per-prompt rows and the summary.
fn rows(out: &str) -> (Vec<Value>, Value) {
    let all: Vec<Value> = out.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let (summary, rows): (Vec<Value>, Vec<Value>) = all.into_iter().partition(|v| v.get("summary").is_some());
    (rows, summary.into_iter().next().expect("a summary line")["summary"].clone())
}

#[test]
fn a_prompt_streams_its_greedy_continuation_and_json_agrees() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("llama");
    write_model(&model, "llama", false, None);
    let base = ["generate", "--device", "cpu", "--init-from", s(&model), "--max-new-tokens", "12"];
    let (streamed, err) = run_ok(&[&base[..], &["--prompt", "The cat sat"]].concat());
    assert!(err.contains("time to first token") && err.contains("generation plan"), "{err}");
    // What the program is on a Hopper GPU, counted without one.
    let launches = err.lines().find(|l| l.starts_with("launches on an sm_90 GPU: prefill ")).expect(&err);
    assert!(launches.contains("(bucket 1)"), "{launches}");
    let (out, _) = run_ok(&[&base[..], &["--prompt", "The cat sat", "--json"]].concat());
    let (rows, summary) = rows(&out);
    assert_eq!(rows.len(), 1);
    let text = rows[0]["text"].as_str().unwrap();
    assert_eq!(streamed.trim_end_matches('\n'), text, "the streamed text is not the JSON text");
    let finish = rows[0]["finish"].as_str().unwrap();
    let tokens = rows[0]["tokens"].as_array().unwrap().len();
    assert!(finish == "eos" || (finish == "length" && tokens == 12), "{finish} after {tokens} tokens");
    assert_eq!(summary["prompts"], 1);
    assert_eq!(summary["buckets"], serde_json::json!([1]));
}

#[test]
fn prompts_of_a_file_split_over_buckets_match_each_prompt_alone() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("qwen2");
    write_model(&model, "qwen2", true, None);
    let prompts = dir.path().join("prompts.jsonl");
    std::fs::write(
        &prompts,
        "{\"prompt\": \"Once upon a time\"}\n{\"text\": \"a\"}\n\n\
         {\"messages\": [{\"role\": \"user\", \"content\": \"Say hi\"}]}\n{\"prompt\": \"The end\"}\n\
         {\"prompt\": \"one two three four five\"}\n",
    )
    .unwrap();
    let base = ["generate", "--device", "cpu", "--init-from", s(&model), "--max-new-tokens", "6", "--json"];
    // Five prompts over buckets of at most 2: three batches.
    let (out, _) = run_ok(&[&base[..], &["--prompts", s(&prompts), "--buckets", "1,2"]].concat());
    let (batched, summary) = rows(&out);
    assert_eq!(batched.len(), 5);
    assert_eq!(summary["batches"].as_array().unwrap().len(), 3, "{summary}");
    for (i, row) in batched.iter().enumerate() {
        assert_eq!(row["index"], i);
        let prompt = row["prompt"].as_str().unwrap();
        if i == 2 {
            assert!(prompt.contains("Say hi") && prompt.contains("assistant"), "chat template not applied: {prompt}");
            continue;
        }
        let (alone, _) = run_ok(&[&base[..], &["--prompt", prompt]].concat());
        assert_eq!(rows(&alone).0[0]["tokens"], row["tokens"], "prompt {i} alone differs from its batch");
    }
}

#[test]
fn stop_strings_cut_the_text_and_sampling_follows_the_seed() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("llama");
    write_model(&model, "llama", false, None);
    let base = ["generate", "--device", "cpu", "--init-from", s(&model), "--json", "--prompt", "In the morning"];
    let sampled =
        [&base[..], &["--max-new-tokens", "16", "--temperature", "1.0", "--top-k", "50", "--top-p", "0.9"]].concat();
    let one = rows(&run_ok(&[&sampled[..], &["--seed", "3"]].concat()).0).0[0].clone();
    let again = rows(&run_ok(&[&sampled[..], &["--seed", "3"]].concat()).0).0[0].clone();
    let other = rows(&run_ok(&[&sampled[..], &["--seed", "4"]].concat()).0).0[0].clone();
    assert_eq!(one, again, "the same seed drew different tokens");
    assert_ne!(one["tokens"], other["tokens"], "seeds 3 and 4 drew the same 16 tokens");
    // A stop string taken from the greedy text ends it right before.
    let greedy = rows(&run_ok(&[&base[..], &["--max-new-tokens", "16", "--ignore-eos"]].concat()).0).0[0].clone();
    let text = greedy["text"].as_str().unwrap().to_string();
    let chars: Vec<char> = text.chars().collect();
    assert!(chars.len() >= 6, "too little text to cut: {text:?}");
    let stop: String = chars[3..5].iter().collect();
    let at = text.find(&stop).unwrap();
    let cut = rows(&run_ok(&[&base[..], &["--max-new-tokens", "16", "--ignore-eos", "--stop", &stop]].concat()).0).0[0]
        .clone();
    assert_eq!(cut["text"].as_str().unwrap(), &text[..at]);
    assert_eq!(cut["finish"], "stop");
}

#[test]
fn bad_input_is_refused_with_its_reason() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("llama");
    write_model(&model, "llama", false, None);
    let m = s(&model);
    fails_with(&["generate", "--device", "cpu", "--init-from", m, "--prompt", ""], "empty");
    let long = "word ".repeat(200);
    fails_with(
        &["generate", "--device", "cpu", "--init-from", m, "--prompt", &long],
        "the model's context is 64 tokens",
    );
    fails_with(
        &["generate", "--device", "cpu", "--init-from", m, "--tokenizer", "/nonexistent/tok", "--prompt", "x"],
        "tokenizer",
    );
    fails_with(&["generate", "--device", "cpu", "--init-from", m], "nothing to continue");
    fails_with(&["generate", "--device", "cpu", "--init-from", m, "--prompt", "x", "--top-p", "0"], "top-p");
    fails_with(
        &["generate", "--device", "cpu", "--init-from", m, "--prompt", "x", "--max-new-tokens", "0"],
        "at least 1",
    );
    let bad = dir.path().join("bad.jsonl");
    std::fs::write(&bad, "{\"prompt\": \"ok\"}\n{\"question\": 1}\n").unwrap();
    fails_with(&["generate", "--device", "cpu", "--init-from", m, "--prompts", s(&bad)], "line 2");
    // A named model has no tokenizer: text prompts need one, random ones do not.
    fails_with(&["generate", "--device", "cpu", "--prompt", "hi"], "needs a tokenizer");
    let (ok, _, err) = stepgraph(&[
        "generate",
        "--device",
        "cpu",
        "--random-prompts",
        "3",
        "--prompt-tokens",
        "5",
        "--max-new-tokens",
        "3",
    ]);
    assert!(ok, "{err}");
}

/// `--max-new-tokens` of any size is clamped to the model's context with
/// a note (a wrapped sum once generated a single token).
#[test]
fn a_huge_max_new_tokens_is_clamped_to_the_context() {
    let (ok, _, err) = stepgraph(&[
        "generate",
        "--device",
        "cpu",
        "--n-layer",
        "1",
        "--block-size",
        "24",
        "--random-prompts",
        "1",
        "--prompt-tokens",
        "4",
        "--max-new-tokens",
        "18446744073709551615",
    ]);
    assert!(ok, "{err}");
    assert!(err.contains("18446744073709551615 new tokens") && err.contains("at most 20 new tokens"), "{err}");
    assert!(err.contains("generated 20 tokens"), "{err}");
}

/// Flags `generate` and `eval` cannot use are not theirs: not in their
/// help, and refused by the parser.
#[test]
fn generate_and_eval_list_only_the_flags_they_use() {
    let (ok, help, _) = stepgraph(&["generate", "--help"]);
    assert!(ok);
    for flag in ["--batch", "--seq ", "--loss"] {
        assert!(!help.contains(flag), "generate --help lists {flag}:\n{help}");
    }
    assert!(help.contains("--dtype") && help.contains("--n-layer"), "{help}");
    fails_with(&["generate", "--random-prompts", "1", "--batch", "4"], "unexpected argument '--batch'");
    let (ok, help, _) = stepgraph(&["eval", "--help"]);
    assert!(ok);
    assert!(!help.contains("--loss") && !help.contains("--n-layer"), "eval --help:\n{help}");
    assert!(help.contains("--batch") && help.contains("--seq") && help.contains("--dtype"), "{help}");
    fails_with(&["eval", "--init-from", "x", "--loss", "sum"], "unexpected argument '--loss'");
}

/// Overwrites the first value of tensor `name` in the folder's
/// `model.safetensors` with NaN (an f32 tensor).
fn poison(dir: &std::path::Path, name: &str) {
    let path = dir.join("model.safetensors");
    let mut bytes = std::fs::read(&path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    assert_eq!(header[name]["dtype"], "F32");
    let at = 8 + n + header[name]["data_offsets"][0].as_u64().unwrap() as usize;
    bytes[at..at + 4].copy_from_slice(&f32::NAN.to_le_bytes());
    std::fs::write(&path, bytes).unwrap();
}

/// A model whose outputs are NaN fails `generate` and `eval` with a
/// reason, instead of printing text or a NaN loss with success.
#[test]
fn non_finite_outputs_fail_generate_and_eval() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("llama");
    write_model(&model, "llama", false, None);
    poison(&model, "model.norm.weight");
    let m = s(&model);
    let (ok, out, err) =
        stepgraph(&["generate", "--device", "cpu", "--init-from", m, "--prompt", "Once", "--max-new-tokens", "3"]);
    assert!(!ok, "generate succeeded on NaN logits: {out}");
    assert!((err.contains("NaN") || err.contains("not finite")) && !err.contains("panicked"), "{err}");
    let tokens = dir.path().join("x.tokens");
    let (ok, _, err) = stepgraph(&[
        "prepare",
        "--tokenizer",
        common::README_TOKENIZER,
        "--input",
        "data/tiny.txt",
        "--val-docs",
        "2",
        "--out",
        s(&tokens),
    ]);
    assert!(ok, "{err}");
    let (ok, out, err) = stepgraph(&["eval", "--device", "cpu", "--init-from", m, "--data", s(&tokens), "--seq", "16"]);
    assert!(!ok, "eval succeeded on NaN outputs: {out}");
    assert!((err.contains("NaN") || err.contains("not finite")) && !err.contains("panicked"), "{err}");
}
