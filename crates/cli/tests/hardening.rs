//! Runs that did nothing or went wrong, and the small things a user sees:
//! empty runs, divergence, honest NaN messages, user values quoted, flags a
//! command cannot use, plain progress lines off a terminal, and the train
//! step that `trace` and `plan` show.

mod common;
use common::{fails_with, stepgraph};

#[test]
fn an_empty_run_is_refused() {
    fails_with(&["train", "--steps", "0"], "--steps 0 trains nothing");
}

#[test]
fn divergence_is_reported_and_can_fail_the_run() {
    let args = ["train", "--lr", "30", "--steps", "30", "--seq", "16", "--warmup", "2"];
    let (ok, _, err) = stepgraph(&args);
    assert!(ok, "{err}");
    // Warned at the step it happened, not after the run.
    assert!(err.contains("warning: the loss diverged at step 2") && err.contains("x its best"), "{err}");
    let mut strict = args.to_vec();
    strict.push("--fail-on-divergence");
    let err = fails_with(&strict, "the loss diverged at step 2");
    assert!(!err.contains("final loss"), "{err}");
    // A healthy run says nothing of the kind.
    let (ok, _, err) = stepgraph(&["train", "--steps", "20", "--seq", "16", "--fail-on-divergence"]);
    assert!(ok && !err.contains("diverged") && !err.contains("collapsed"), "{err}");
}

/// A learning rate that blows the weights up and leaves a dead model (the
/// uniform loss, a zero gradient) stops the run at the step it blew up.
#[test]
fn a_run_that_kills_its_model_stops_at_once() {
    let args = ["train", "--lr", "1e3", "--steps", "40", "--eval-every", "0", "--fail-on-divergence"];
    let (ok, out, err) = stepgraph(&args);
    assert!(!ok && !out.contains("final loss"), "{out}{err}");
    assert!(err.contains("at step 2") && err.contains("stopped by --fail-on-divergence"), "{err}");
}

/// Checkpoints deleted by --keep never include the last one saved before
/// the divergence began, and the warning names it.
#[test]
fn keep_never_deletes_the_last_checkpoint_before_a_divergence() {
    let dir = tempfile::tempdir().unwrap();
    let ck = dir.path().join("ck");
    let ck_s = ck.to_str().unwrap();
    let args = ["train", "--lr", "3", "--steps", "12", "--seq", "16", "--warmup", "0", "--eval-every", "0"];
    let mut args = args.to_vec();
    args.extend(["--checkpoint-dir", ck_s, "--save-every", "1", "--keep", "2"]);
    let (ok, _, err) = stepgraph(&args);
    assert!(ok, "{err}");
    assert!(err.contains("warning: the loss diverged") && err.contains("step-000001 (--keep keeps it)"), "{err}");
    let mut kept: Vec<String> = std::fs::read_dir(&ck)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("step-"))
        .collect();
    kept.sort();
    assert_eq!(kept, ["step-000001", "step-000011", "step-000012"]);
    // With --fail-on-divergence the run stops before the next save.
    let strict_dir = dir.path().join("strict");
    let mut strict = args.clone();
    let at = strict.iter().position(|a| *a == ck_s).unwrap();
    strict[at] = strict_dir.to_str().unwrap();
    strict.push("--fail-on-divergence");
    let err = fails_with(&strict, "the last checkpoint saved before it is");
    assert!(err.contains("step-000001"), "{err}");
}

#[test]
fn the_nan_message_names_its_cause() {
    // f16 moments (PyTorch's default) underflow: the message says so and
    // suggests float32 moments, not a lower learning rate.
    let err = fails_with(
        &["train", "--dtype", "f16", "--state-dtype", "param", "--lr", "1e-3", "--steps", "30", "--seq", "16"],
        "the loss became NaN",
    );
    assert!(err.contains("--state-dtype") && err.contains("float32"), "{err}");
    assert!(!err.contains("lower the learning rate"), "{err}");
    // The default keeps f16 moments in float32 and trains.
    let (ok, out, err) = stepgraph(&["train", "--dtype", "f16", "--lr", "1e-3", "--steps", "30", "--seq", "16"]);
    assert!(ok && out.contains("final loss"), "{err}");
}

#[test]
fn messages_quote_what_the_user_typed() {
    fails_with(&["train", "--lr=-1", "--steps", "2"], "--lr must be a finite non-negative learning rate, got -1");
    fails_with(&["train", "--weight-decay=-0.5", "--steps", "2"], "got -0.5");
    let dir = std::env::temp_dir().join(format!("stepgraph-bad-json-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("config.json");
    std::fs::write(&file, "{bad").unwrap();
    let err = fails_with(&["plan", "--config", file.to_str().unwrap()], "is not valid JSON");
    assert_eq!(err.matches(file.to_str().unwrap()).count(), 1, "{err}");
    assert_eq!(err.matches("key must be a string").count(), 1, "serde's text twice: {err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn flags_a_command_cannot_use_are_rejected_by_the_parser() {
    let err = fails_with(&["train", "--step", "grads", "--steps", "1"], "unexpected argument '--step'");
    assert!(!err.contains("has no leaf"), "{err}");
}

#[test]
fn progress_is_logged_as_lines_off_a_terminal_and_the_summary_has_its_own_line() {
    let (ok, out, err) = stepgraph(&["train", "--steps", "12", "--seq", "16", "--log-every", "5"]);
    assert!(ok, "{err}");
    let lines: Vec<&str> = err.lines().filter(|l| l.starts_with("step ")).collect();
    assert_eq!(lines.len(), 3, "{err}");
    assert!(lines[0].starts_with("step 5/12: loss ") && lines[2].starts_with("step 12/12: loss "), "{err}");
    assert!(out.starts_with("final loss "), "{out}");
}

#[test]
fn trace_and_plan_show_the_step_train_runs() {
    let (ok, out, err) = stepgraph(&["trace", "--step", "train", "--seq", "8"]);
    assert!(ok, "{err}");
    assert!(out.contains("weight_decay=0.0}"), "{out}");
    assert!(!out.contains("weight_decay=0.01"), "{out}");
    // f16 parameters keep float32 moments by default, in the trace and the plan.
    let (ok, out, err) = stepgraph(&["trace", "--step", "train", "--seq", "8", "--dtype", "f16"]);
    assert!(ok, "{err}");
    let moment = out.lines().find(|l| l.contains("exp_avg_sq")).unwrap_or_else(|| panic!("{out}"));
    assert!(moment.contains("f32["), "{moment}");
    let state_bytes = |extra: &[&str]| {
        // Moments alone: the f16 parameters keep no master state here.
        let mut args = vec!["plan", "--step", "train", "--dtype", "f16", "--json", "--master-weights", "none"];
        args.extend_from_slice(extra);
        let (ok, out, err) = stepgraph(&args);
        assert!(ok, "{err}");
        let v: serde_json::Value = serde_json::from_str(&out).unwrap();
        v["optimizer_state_bytes"].as_u64().unwrap_or_else(|| panic!("{v}"))
    };
    assert_eq!(state_bytes(&[]), 2 * state_bytes(&["--state-dtype", "param"]));
    assert_eq!(state_bytes(&["--f32-state"]), state_bytes(&[]));
}
