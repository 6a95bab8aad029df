//! The CPU backend refuses a plan larger than the host memory available
//! before allocating it, with both numbers, instead of aborting when an
//! allocation fails; `STEPGRAPH_HOST_MEMORY_LIMIT` stands for a small machine.

use std::process::{Command, Output};

const LIMIT_ENV: &str = "STEPGRAPH_HOST_MEMORY_LIMIT";

fn stepgraph(args: &[&str], limit: Option<&str>) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_stepgraph"));
    cmd.args(args).current_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/../..")).env_remove(LIMIT_ENV);
    if let Some(limit) = limit {
        cmd.env(LIMIT_ENV, limit);
    }
    cmd.output().expect("run stepgraph")
}

/// Fails with exit status 1 (an error, not a signal such as SIGABRT); returns stderr.
fn error(args: &[&str], limit: Option<&str>) -> String {
    let out = stepgraph(args, limit);
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    assert_eq!(out.status.code(), Some(1), "{args:?} should fail with an error: {err}");
    assert!(!err.contains("panicked") && !err.contains("memory allocation of"), "{err}");
    err
}

/// The planned peak of `plan --json` with `args`.
fn planned_bytes(args: &[&str]) -> u64 {
    let mut all = vec!["plan", "--json", "--step", "train"];
    all.extend(args);
    let out = stepgraph(&all, None);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    report["planned_peak_bytes"].as_u64().unwrap()
}

#[test]
fn a_plan_larger_than_the_limit_is_refused_with_both_numbers() {
    let planned = planned_bytes(&["--seq", "16"]);
    let limit = planned / 2;
    let err = error(&["train", "--device", "cpu", "--steps", "1", "--seq", "16"], Some(&limit.to_string()));
    let wants = [
        format!("needs {planned} bytes"),
        format!("but {limit} bytes"),
        LIMIT_ENV.into(),
        "nothing was allocated".into(),
    ];
    for want in wants {
        assert!(err.contains(&want), "expected `{want}` in: {err}");
    }
    // Just enough memory: it trains.
    let out = stepgraph(&["train", "--device", "cpu", "--steps", "1", "--seq", "16"], Some(&(2 * planned).to_string()));
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}

#[test]
fn a_huge_batch_is_an_error_not_an_abort() {
    // 2^40 rows: a plan of petabytes, refused before a batch is drawn.
    let args = ["train", "--device", "cpu", "--steps", "1", "--batch", "1099511627776", "--seq", "2"];
    let err = error(&args, Some("1000000000"));
    assert!(err.contains("of host memory, but 1000000000 bytes (1.00 GB) are available"), "{err}");
    // With the machine's own numbers (MemAvailable or a cgroup limit).
    let err = error(&args, None);
    assert!(err.contains("of host memory, but") && err.contains("are available ("), "{err}");
}

#[test]
fn a_malformed_limit_is_named() {
    let err = error(&["train", "--device", "cpu", "--steps", "1", "--seq", "16"], Some("8GB"));
    assert!(err.contains(&format!("{LIMIT_ENV}=\"8GB\": expected a number of bytes")), "{err}");
}

#[test]
fn memory_budget_auto_on_the_cpu_plans_for_the_limit() {
    // No GPU in CI: `auto` is the host memory available, here the limit.
    if stepgraph_cuda::session::gpu_available() {
        return;
    }
    let err = error(&["plan", "--memory-budget", "auto"], Some("1000"));
    assert!(err.contains("the memory budget of 1000 B") && err.contains("cannot be met"), "{err}");
}
