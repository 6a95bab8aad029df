//! The command line as a user meets it: plan JSON for the benchmark
//! workloads, traces, a short training run, and clear errors for bad input.

use std::process::Command;

fn stepgraph(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_stepgraph"))
        .args(args)
        .current_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/../.."))
        .output()
        .expect("run stepgraph");
    (out.status.success(), String::from_utf8_lossy(&out.stdout).into(), String::from_utf8_lossy(&out.stderr).into())
}

fn json_u64(v: &serde_json::Value, key: &str) -> u64 {
    v[key].as_u64().unwrap_or_else(|| panic!("missing `{key}` in {v}"))
}

#[test]
fn plan_w1_json_has_the_acceptance_fields() {
    let (ok, out, err) = stepgraph(&[
        "plan",
        "--model",
        "open_llama_3b",
        "--n-layer",
        "10",
        "--dtype",
        "f32",
        "--batch",
        "1",
        "--seq",
        "2048",
        "--loss",
        "sum",
        "--step",
        "grads",
        "--json",
    ]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let (param, persistent) = (json_u64(&v, "param_bytes"), json_u64(&v, "persistent_bytes"));
    let (peak, floor) = (json_u64(&v, "planned_peak_bytes"), json_u64(&v, "floor_bytes"));
    assert_eq!(param, persistent);
    assert_eq!(peak, persistent + json_u64(&v, "arena_bytes"));
    assert!(peak <= 11_900_000_000, "planned peak {peak}");
    assert!(peak as f64 <= floor as f64 * 1.02, "peak {peak} floor {floor}");
}

#[test]
fn plan_w2_text_report() {
    let (ok, out, err) = stepgraph(&[
        "plan",
        "--model",
        "Qwen2.5-7B",
        "--n-layer",
        "5",
        "--n-embd",
        "28",
        "--dtype",
        "bf16",
        "--seq",
        "4096",
        "--loss",
        "ce",
    ]);
    assert!(ok, "{err}");
    assert!(out.contains("planned peak") && out.contains("largest values live at the peak"), "{out}");
}

#[test]
fn trace_prints_forward_and_step() {
    let (ok, out, err) = stepgraph(&["trace", "--which", "forward", "--seq", "8"]);
    assert!(ok, "{err}");
    assert!(out.starts_with("# after: build\ntrace forward"), "{out}");
    let (ok, out, _) = stepgraph(&["trace", "--step", "train", "--seq", "8"]);
    assert!(ok);
    assert!(out.contains("== optimizer ==") && out.contains("= adamw"), "{out}");
}

#[test]
fn train_lowers_the_loss() {
    let (ok, out, err) = stepgraph(&["train", "--steps", "60", "--seq", "64", "--batch", "4", "--lr", "1e-2"]);
    assert!(ok, "{err}");
    // "final loss X (first Y) after ..."
    let nums: Vec<f64> =
        out.split(|c: char| !(c.is_ascii_digit() || c == '.')).filter_map(|s| s.parse().ok()).take(2).collect();
    let (last, first) = (nums[0], nums[1]);
    assert!(first > 5.0 && last < first - 1.5, "loss went from {first} to {last}: {out}");
}

#[test]
fn bad_input_gets_clear_errors() {
    let cases: [(&[&str], &str); 5] = [
        (&["plan", "--model", "gpt-17"], "unknown model name `gpt-17`"),
        (&["plan", "--model", "open_llama_3b", "--n-head", "3"], "n_embd 3200 is not divisible by n_head 3"),
        (&["plan", "--seq", "100000"], "sequence length 100000 exceeds the block size 256"),
        (&["train", "--data", "no/such/file.txt"], "reading training text no/such/file.txt"),
        (&["train", "--loss", "sum", "--steps", "1"], "training needs the cross-entropy loss"),
    ];
    for (args, want) in cases {
        let (ok, _, err) = stepgraph(args);
        assert!(!ok, "{args:?} should fail");
        assert!(err.contains(want), "{args:?}: expected `{want}` in: {err}");
    }
}

#[test]
fn compare_errors_name_the_missing_gpu_or_reference() {
    // Asking for CUDA without a GPU fails before anything is read.
    if !stepgraph_cuda::session::gpu_available() {
        let (ok, _, err) = stepgraph(&["compare", "--backend", "cuda", "--reference", "no/such/dir", "--loss", "sum"]);
        assert!(!ok);
        assert!(err.contains("--backend cuda needs an NVIDIA GPU") && err.contains("--backend cpu"), "{err}");
    }
    let (ok, _, err) = stepgraph(&["compare", "--backend", "cpu", "--reference", "no/such/dir", "--loss", "sum"]);
    assert!(!ok);
    assert!(err.contains("reading the reference's model config no/such/dir/config.json"), "{err}");
}
