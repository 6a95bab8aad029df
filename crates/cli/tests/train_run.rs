//! `stepgraph train` as a run a user leaves going: checkpoints and exact
//! resume (50 + 50 steps equal 100 bit for bit), a save killed with SIGKILL,
//! the metrics file, validation, the TOML run config, the NaN stop that
//! keeps the last good checkpoint, and clear errors for every bad input.

mod common;
use common::{fails_with, root, s, stepgraph};

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// A fresh directory for one test.
fn scratch(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("stepgraph-train-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A small, fast run: one layer, 2 x 16 tokens, CPU.
const SMALL: [&str; 12] =
    ["train", "--device", "cpu", "--n-layer", "1", "--seq", "16", "--batch", "2", "--eval-every", "0", "--log-every"];

fn small(extra: &[&str]) -> Vec<String> {
    SMALL.iter().chain(["0"].iter()).chain(extra).map(|a| a.to_string()).collect()
}

fn run_ok(args: &[String]) -> (String, String) {
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    let (ok, out, err) = stepgraph(&refs);
    assert!(ok, "{args:?} failed: {err}");
    (out, err)
}

fn metrics(path: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(path).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect()
}

fn losses(rows: &[serde_json::Value]) -> Vec<(u64, u64)> {
    rows.iter()
        .filter(|r| r.get("loss").is_some())
        .map(|r| (r["step"].as_u64().unwrap(), r["loss"].as_f64().unwrap().to_bits()))
        .collect()
}

/// Complete checkpoints in `dir` (a `step-…` directory with its state.json), by step.
fn checkpoints(dir: &Path) -> Vec<u64> {
    let mut steps: Vec<u64> = std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .flatten()
                .filter(|e| e.path().join("state.json").is_file())
                .filter_map(|e| e.file_name().to_str()?.strip_prefix("step-")?.parse().ok())
                .collect()
        })
        .unwrap_or_default();
    steps.sort();
    steps
}

#[test]
fn fifty_steps_resumed_for_fifty_more_equal_a_hundred_straight_bit_for_bit() {
    let d = scratch("resume");
    let (straight, split) = (d.join("straight"), d.join("split"));
    run_ok(&small(&["--steps", "100", "--checkpoint-dir", s(&straight)]));
    let (_, err) = run_ok(&small(&[
        "--steps",
        "100",
        "--stop-after",
        "50",
        "--save-every",
        "20",
        "--keep",
        "2",
        "--checkpoint-dir",
        s(&split),
    ]));
    assert!(err.contains("checkpoint: "), "{err}");
    // Saved at 20 and 40 and where it stopped; the oldest went beyond --keep 2.
    assert_eq!(checkpoints(&split), [40, 50]);
    let (out, err) = run_ok(&small(&["--steps", "100", "--resume", "auto", "--checkpoint-dir", s(&split)]));
    assert!(err.contains("resumed     from") && err.contains("step-000050"), "{err}");
    assert!(out.contains("after 50 steps"), "{out}");
    for file in ["weights.safetensors", "optimizer.safetensors"] {
        let a = std::fs::read(straight.join("step-000100").join(file)).unwrap();
        let b = std::fs::read(split.join("step-000100").join(file)).unwrap();
        assert!(a == b, "{file} differs between the straight and the resumed run");
    }
    let (a, b) = (metrics(&straight.join("metrics.jsonl")), metrics(&split.join("metrics.jsonl")));
    assert_eq!(losses(&a).len(), 100);
    assert_eq!(losses(&a), losses(&b), "the losses differ");
    // Resuming a finished run trains nothing and says so.
    let (out, _) = run_ok(&small(&["--steps", "100", "--resume", "auto", "--checkpoint-dir", s(&split)]));
    assert!(out.contains("the run is complete"), "{out}");
    std::fs::remove_dir_all(&d).unwrap();
}

/// 8-bit moments (`--optimizer-state 8bit`): the checkpoint holds each
/// moment's codes and scales, 10 steps resumed for 10 more equal 20
/// straight bit for bit, and resuming with dense moments is refused by name.
#[test]
fn eight_bit_moments_checkpoint_and_resume_bit_for_bit() {
    let d = scratch("eight-bit");
    let (straight, split) = (d.join("straight"), d.join("split"));
    let eight = ["--optimizer-state", "8bit"];
    let (_, err) = run_ok(&small(&[&eight[..], &["--steps", "20", "--checkpoint-dir", s(&straight)]].concat()));
    assert!(err.contains("8bit"), "{err}");
    run_ok(&small(&[&eight[..], &["--steps", "20", "--stop-after", "10", "--checkpoint-dir", s(&split)]].concat()));
    let state =
        stepgraph_core::models::checkpoint::read_safetensors(&split.join("step-000010/optimizer.safetensors")).unwrap();
    let names: Vec<&str> = state.iter().map(|(n, _)| n.as_str()).collect();
    assert!(names.iter().any(|n| n.ends_with(".exp_avg.codes")), "{names:?}");
    assert!(names.iter().any(|n| n.ends_with(".exp_avg_sq.absmax")), "{names:?}");
    assert!(!names.iter().any(|n| n.ends_with(".exp_avg")), "{names:?}");
    let (_, err) = stepgraph_refused(&small(&["--steps", "20", "--resume", "auto", "--checkpoint-dir", s(&split)]));
    assert!(err.contains("moments_8bit = true"), "{err}");
    run_ok(&small(&[&eight[..], &["--steps", "20", "--resume", "auto", "--checkpoint-dir", s(&split)]].concat()));
    for file in ["weights.safetensors", "optimizer.safetensors"] {
        let a = std::fs::read(straight.join("step-000020").join(file)).unwrap();
        let b = std::fs::read(split.join("step-000020").join(file)).unwrap();
        assert!(a == b, "{file} differs between the straight and the resumed run");
    }
    std::fs::remove_dir_all(&d).unwrap();
}

/// Clipping by the previous step's norm: the run keeps that norm as state
/// (in the checkpoint), reports each step's own norm, and 5 steps resumed
/// for 5 more equal 10 straight bit for bit; without a norm to clip to it
/// is refused.
#[test]
fn clipping_by_the_previous_norm_reports_norms_and_resumes_bit_for_bit() {
    let d = scratch("previous-norm");
    let (straight, split) = (d.join("straight"), d.join("split"));
    let clip = ["--clip-grad-norm", "0.5", "--clip-by-previous-norm"];
    let metrics_file = straight.join("metrics.jsonl");
    let m = s(&metrics_file).to_string();
    run_ok(&small(&[&clip[..], &["--steps", "10", "--checkpoint-dir", s(&straight), "--metrics", &m]].concat()));
    let rows = metrics(&metrics_file);
    let norms: Vec<f64> = rows.iter().filter_map(|r| r.get("grad_norm")?.as_f64()).collect();
    assert_eq!(norms.len(), 10, "{rows:?}");
    assert!(norms.iter().all(|n| n.is_finite() && *n > 0.0), "{norms:?}");
    run_ok(&small(&[&clip[..], &["--steps", "10", "--stop-after", "5", "--checkpoint-dir", s(&split)]].concat()));
    let state =
        stepgraph_core::models::checkpoint::read_safetensors(&split.join("step-000005/optimizer.safetensors")).unwrap();
    let kept = state.iter().find(|(n, _)| n == stepgraph_core::autodiff::PREVIOUS_GRAD_NORM_STATE);
    assert_eq!(kept.map(|(_, t)| t.to_f64()[0]), Some(norms[4]));
    run_ok(&small(&[&clip[..], &["--steps", "10", "--resume", "auto", "--checkpoint-dir", s(&split)]].concat()));
    for file in ["weights.safetensors", "optimizer.safetensors"] {
        let a = std::fs::read(straight.join("step-000010").join(file)).unwrap();
        let b = std::fs::read(split.join("step-000010").join(file)).unwrap();
        assert!(a == b, "{file} differs between the straight and the resumed run");
    }
    let (_, err) = stepgraph_refused(&small(&["--steps", "2", "--clip-grad-norm", "0", "--clip-by-previous-norm"]));
    assert!(err.contains("--clip-by-previous-norm") && err.contains("--clip-grad-norm X"), "{err}");
    std::fs::remove_dir_all(&d).unwrap();
}

/// A run that must fail: its stdout and stderr.
fn stepgraph_refused(args: &[String]) -> (String, String) {
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    let (ok, out, err) = stepgraph(&refs);
    assert!(!ok, "{args:?} succeeded");
    (out, err)
}

#[test]
fn a_run_killed_while_saving_resumes_from_its_last_complete_checkpoint() {
    let d = scratch("kill");
    let ck = d.join("ck");
    let mut newest = 0;
    // Saving at every step, killed at a different moment each time.
    for round in 0..3u64 {
        let args = small(&[
            "--steps",
            "100000",
            "--save-every",
            "1",
            "--keep",
            "2",
            "--resume",
            "auto",
            "--checkpoint-dir",
            s(&ck),
        ]);
        let mut child = Command::new(env!("CARGO_BIN_EXE_stepgraph"))
            .args(&args)
            .current_dir(root())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let t0 = Instant::now();
        while checkpoints(&ck).last().copied().unwrap_or(0) < newest + 3 {
            assert!(t0.elapsed() < Duration::from_secs(120), "no checkpoint after 120 s");
            std::thread::sleep(Duration::from_millis(5));
        }
        std::thread::sleep(Duration::from_millis(3 + 11 * round));
        // SIGKILL, on the child this test started.
        child.kill().unwrap();
        child.wait().unwrap();
        let now = checkpoints(&ck);
        assert!(!now.is_empty() && *now.last().unwrap() > newest, "{now:?}");
        newest = *now.last().unwrap();
    }
    let target = (newest + 2).to_string();
    let (out, err) = run_ok(&small(&["--steps", &target, "--resume", "auto", "--checkpoint-dir", s(&ck)]));
    assert!(err.contains("resumed     from") && out.contains("final loss"), "{err}");
    // What the killed saves left behind is gone; only complete checkpoints remain.
    let left: Vec<String> =
        std::fs::read_dir(&ck).unwrap().flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect();
    assert!(left.iter().all(|n| !n.starts_with(".step-")), "{left:?}");
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn metrics_rows_and_validation() {
    let d = scratch("metrics");
    let file = d.join("m.jsonl");
    let mut args = small(&["--steps", "10", "--eval-batches", "2", "--lr", "0.01", "--metrics", s(&file)]);
    args[10] = "5".into(); // --eval-every
    let (_, err) = run_ok(&args);
    assert!(err.contains("validation at step 5: loss ") && err.contains("perplexity"), "{err}");
    let rows = metrics(&file);
    let train: Vec<&serde_json::Value> = rows.iter().filter(|r| r.get("loss").is_some()).collect();
    let val: Vec<&serde_json::Value> = rows.iter().filter(|r| r.get("val_loss").is_some()).collect();
    assert_eq!(train.len(), 10);
    assert_eq!(val.iter().map(|r| r["step"].as_u64().unwrap()).collect::<Vec<_>>(), [5, 10]);
    for r in &train {
        for key in ["step", "loss", "lr", "grad_norm", "tokens_per_s", "planned_bytes", "held_bytes"] {
            assert!(r.get(key).is_some(), "no `{key}` in {r}");
        }
        // No MFU on the CPU: there is no peak to measure against.
        assert!(r.get("mfu").is_none(), "{r}");
    }
    // The cosine ends at 10% of the peak, and warm-up starts low.
    assert_eq!(train[9]["lr"].as_f64().unwrap(), 0.001);
    assert!(train[0]["lr"].as_f64().unwrap() <= 0.01);
    let v = val[0]["val_loss"].as_f64().unwrap();
    assert!((val[0]["val_ppl"].as_f64().unwrap() - v.exp()).abs() < 1e-9 * v.exp());
    // TensorBoard's event file beside it holds every row's scalars (its
    // frames and contents are checked in the library's tests).
    let events = std::fs::read(d.join("m.jsonl.tfevents")).expect("an event file next to the metrics");
    let count = |tag: &str| events.windows(tag.len()).filter(|w| *w == tag.as_bytes()).count();
    assert_eq!(count("train/loss"), 10);
    assert_eq!(count("val/loss"), 2);
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn the_settings_in_force_and_the_plan_are_printed_before_step_one() {
    let (_, err) = run_ok(&small(&["--steps", "2"]));
    for needle in [
        "training tiny-llama",
        "batch 2 x 16 = 32 tokens per step",
        "lr          peak 3e-3 (default for pre-training",
        "warm-up     1 step (default",
        "decay       cosine to 3e-4 at step 2",
        "dtype       f32, AdamW moments f32",
        "seed 0",
        "on the CPU",
        "plan for `train`",
        "start-up ",
        ": build ",
        ", plan ",
        ", backend ",
        ", weights ",
    ] {
        assert!(err.contains(needle), "no `{needle}` in\n{err}");
    }
    // The start-up line comes after the plan and before the first step's line.
    assert!(err.find("plan for `train`").unwrap() < err.find("start-up ").unwrap(), "{err}");
}

#[test]
fn a_run_config_file_sets_flags_and_the_command_line_overrides_it() {
    let d = scratch("config");
    let file = d.join("run.toml");
    std::fs::write(
        &file,
        "steps = 3\nn_layer = 1\nseq = 16\neval-every = 0\ndevice = \"cpu\"\nfail_on_divergence = true\n",
    )
    .unwrap();
    let (ok, out, err) = stepgraph(&["train", "--run-config", s(&file), "--steps", "2"]);
    assert!(ok, "{err}");
    assert!(out.contains("after 2 steps"), "{out}");
    assert!(err.contains("1 layers") && err.contains("x 16 = 16 tokens"), "{err}");
    std::fs::write(&file, "steps = 3\nstpes = 4\n").unwrap();
    let e = fails_with(&["train", "--run-config", s(&file)], "unknown key `stpes`");
    assert!(e.contains(s(&file)) && e.contains("the accepted keys are") && e.contains("steps"), "{e}");
    std::fs::write(&file, "steps = \"ten\"\n").unwrap();
    fails_with(&["train", "--run-config", s(&file)], "`steps` = \"ten\" is not accepted");
    fails_with(&["train", "--run-config", "no/such/run.toml"], "reading the run config no/such/run.toml");
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn a_non_finite_loss_stops_the_run_and_keeps_the_last_good_checkpoint() {
    let d = scratch("nan");
    let ck = d.join("ck");
    // A learning rate far too high for float16, warmed up slowly: the
    // weights overflow some steps in (step 13 today), after checkpoints.
    let args = [
        "train",
        "--device",
        "cpu",
        "--dtype",
        "f16",
        "--lr",
        "1",
        "--warmup",
        "40",
        "--steps",
        "40",
        "--seq",
        "16",
        "--eval-every",
        "0",
        "--save-every",
        "2",
        "--keep",
        "100",
        "--checkpoint-dir",
        s(&ck),
    ];
    let err = fails_with(&args, "the loss became NaN at step ");
    let step: u64 =
        err.split("the loss became NaN at step ").nth(1).unwrap().split(':').next().unwrap().parse().unwrap();
    let saved = checkpoints(&ck);
    assert!(saved.len() >= 2 && saved.iter().all(|&s| s < step), "NaN at {step}, saved {saved:?}");
    let last = format!("step-{:06}", saved.last().unwrap());
    assert!(err.contains("the last good checkpoint is") && err.contains(&last), "{err}");
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn bad_input_gets_clear_errors() {
    let d = scratch("bad");
    let ck = d.join("ck");
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (vec!["train", "--resume", "auto"], "--resume auto looks for checkpoints in --checkpoint-dir"),
        (vec!["train", "--stop-after", "0"], "--stop-after 0 must be a step of the run, from 1 to --steps 200"),
        (vec!["train", "--steps", "10", "--stop-after", "11"], "--stop-after 11"),
        (vec!["train", "--keep", "0"], "--keep 0"),
        (vec!["train", "--eval-batches", "0"], "--eval-batches 0 evaluates nothing"),
        (
            vec!["train", "--device", "cpu", "--save-every", "5"],
            "--save-every 5 saves checkpoints: give them a --checkpoint-dir",
        ),
        (
            vec!["train", "--device", "cpu", "--val-fraction", "1.5"],
            "--val-fraction must be at least 0 and below 1, got 1.5",
        ),
        (vec!["train", "--device", "cpu", "--min-lr-ratio", "2"], "--min-lr-ratio must lie in [0, 1], got 2"),
        (
            vec!["train", "--device", "cpu", "--lr", "0.1", "--min-lr", "1"],
            "(--min-lr) must lie in [0, --lr = 0.1], got 1",
        ),
        (
            vec!["train", "--device", "cpu", "--steps", "10", "--warmup", "11"],
            "--warmup 11 is longer than the run (--steps 10)",
        ),
        (vec!["train", "--device", "cpu", "--gpus", "2"], "--device cpu and --gpus 2 contradict each other"),
        (
            vec!["train", "--device", "cpu", "--resume", "no/such/step-000005"],
            "no/such/step-000005 is not a complete checkpoint",
        ),
        (vec!["train", "--device", "cpu", "--seq", "2000"], "exceeds the block size"),
    ];
    for (args, want) in &cases {
        fails_with(args, want);
    }
    // A checkpoint directory in use is not overwritten by a new run, and a
    // resume with another batch names the setting.
    run_ok(&small(&["--steps", "2", "--checkpoint-dir", s(&ck)]));
    let e = fails_with(
        &small(&["--steps", "4", "--checkpoint-dir", s(&ck)]).iter().map(String::as_str).collect::<Vec<_>>(),
        "already holds checkpoints",
    );
    assert!(e.contains("--resume auto"), "{e}");
    let early = small(&["--steps", "4", "--stop-after", "2", "--resume", "auto", "--checkpoint-dir", s(&ck)]);
    fails_with(
        &early.iter().map(String::as_str).collect::<Vec<_>>(),
        "--stop-after 2 is not after the checkpoint's step 2",
    );
    // Extending a finished run is allowed, and the changed schedule is pointed out.
    let (_, err) = run_ok(&small(&["--steps", "3", "--resume", "auto", "--checkpoint-dir", s(&ck)]));
    assert!(err.contains("the checkpoint followed another schedule") && err.contains("at step 2"), "{err}");
    let mut other = small(&["--steps", "4", "--resume", "auto", "--checkpoint-dir", s(&ck)]);
    other[8] = "4".into();
    let e = fails_with(
        &other.iter().map(String::as_str).collect::<Vec<_>>(),
        "it was trained with model.batch = 2, this run has model.batch = 4",
    );
    assert!(e.contains("step-000003"), "{e}");
    // A checkpoint named by its directory resumes too, saving next to it.
    let named = ck.join("step-000003");
    let (_, err) = run_ok(&small(&["--steps", "4", "--resume", s(&named)]));
    assert!(err.contains("resumed     from") && err.contains("(step 3)"), "{err}");
    assert!(ck.join("step-000004").join("state.json").is_file());
    if !stepgraph_cuda::session::gpu_available() {
        fails_with(&["train", "--device", "cuda"], "--device cuda needs 1 NVIDIA GPU");
        fails_with(&["train", "--gpus", "1"], "--gpus 1 needs 1 NVIDIA GPU");
    }
    std::fs::remove_dir_all(&d).unwrap();
}

/// On one GPU (`cargo test -p stepgraph --test train_run -- --ignored` on a
/// machine with a GPU and Rust): 50 + 50 resumed steps equal 100 straight
/// bit for bit, and the run holds its plan plus a few MB, with no NCCL.
#[test]
#[ignore = "needs a GPU"]
fn on_one_gpu_resume_is_bitwise_and_memory_is_the_plan() {
    let d = scratch("gpu");
    let (straight, split) = (d.join("straight"), d.join("split"));
    let gpu = |extra: &[&str]| {
        let mut a: Vec<String> = ["train", "--device", "cuda", "--n-layer", "2", "--seq", "64", "--batch", "4"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        a.extend(extra.iter().map(|s| s.to_string()));
        run_ok(&a)
    };
    let (out, err) = gpu(&["--steps", "100", "--checkpoint-dir", s(&straight)]);
    gpu(&["--steps", "100", "--stop-after", "50", "--checkpoint-dir", s(&split)]);
    gpu(&["--steps", "100", "--resume", "auto", "--checkpoint-dir", s(&split)]);
    for file in ["weights.safetensors", "optimizer.safetensors"] {
        let a = std::fs::read(straight.join("step-000100").join(file)).unwrap();
        let b = std::fs::read(split.join("step-000100").join(file)).unwrap();
        assert!(a == b, "{file} differs between the straight and the resumed run on the GPU");
    }
    assert_eq!(losses(&metrics(&straight.join("metrics.jsonl"))), losses(&metrics(&split.join("metrics.jsonl"))));
    // "device peak X MB for a Y MB plan (NCCL 0.0 MB)"
    let after = out.split("device peak ").nth(1).unwrap_or_else(|| panic!("{out}\n{err}"));
    let nums: Vec<f64> =
        after.split(|c: char| !(c.is_ascii_digit() || c == '.')).filter_map(|t| t.parse().ok()).take(3).collect();
    let (held, planned, nccl) = (nums[0], nums[1], nums[2]);
    assert_eq!(nccl, 0.0, "{out}");
    assert!(held <= planned + 64.0, "held {held} MB for a {planned} MB plan: {out}");
    assert!(err.contains("MFU"), "{err}");
    std::fs::remove_dir_all(&d).unwrap();
}

/// Validation reads the weights and changes nothing: the training losses
/// are the same bits with and without it.
#[test]
fn validation_does_not_change_training() {
    let d = scratch("evalsame");
    let (with, without) = (d.join("with.jsonl"), d.join("without.jsonl"));
    let mut args = small(&["--steps", "12", "--metrics", s(&with)]);
    args[10] = "3".into(); // --eval-every
    run_ok(&args);
    run_ok(&small(&["--steps", "12", "--metrics", s(&without)]));
    let (a, b) = (metrics(&with), metrics(&without));
    assert_eq!(a.iter().filter(|r| r.get("val_loss").is_some()).count(), 4);
    assert_eq!(losses(&a), losses(&b));
    std::fs::remove_dir_all(&d).unwrap();
}

/// Gradient accumulation, clipping and the decay scope as flags: two
/// micro-batches of one row train like batches of two rows; the gradient
/// norm is logged while clipping (the default) and not without; bad values
/// and a resume with other settings are refused naming the flag.
#[test]
fn accumulation_and_clipping_flags_reach_the_step() {
    let d = scratch("accum");
    let (whole, accum, unclipped) = (d.join("whole.jsonl"), d.join("accum.jsonl"), d.join("unclipped.jsonl"));
    let base = |extra: &[&str], m: &Path| {
        let mut a = small(&["--steps", "6", "--metrics", s(m)]);
        a.extend(extra.iter().map(|x| x.to_string()));
        a
    };
    run_ok(&base(&[], &whole));
    let mut one_row = base(&["--grad-accum", "2"], &accum);
    one_row[8] = "1".into(); // --batch 1
    let (_, err) = run_ok(&one_row);
    assert!(err.contains("batch 1 x 16 x 2 micro-batches = 32 tokens per step"), "{err}");
    assert!(err.contains("clipping    global gradient norm to 1"), "{err}");
    let (a, b) = (metrics(&whole), metrics(&accum));
    for (x, y) in a.iter().zip(&b) {
        let (x, y) = (x["loss"].as_f64().unwrap(), y["loss"].as_f64().unwrap());
        assert!((x - y).abs() < 1e-4 * x.abs(), "{x} vs {y}");
    }
    assert!(a.iter().all(|r| r["grad_norm"].as_f64().is_some_and(|g| g > 0.0)));
    run_ok(&base(&["--clip-grad-norm", "0"], &unclipped));
    assert!(metrics(&unclipped).iter().all(|r| r.get("grad_norm").is_none()));
    for (args, want) in [
        (vec!["train", "--grad-accum", "0"], "--grad-accum 0 runs no micro-batch"),
        (vec!["train", "--clip-grad-norm=-1"], "--clip-grad-norm must be a finite non-negative norm"),
        (vec!["train", "--gpus", "2", "--batch", "2", "--zero1", "--clip-grad-norm", "1"], "--zero1 shards them"),
        (vec!["plan", "--step", "forward", "--grad-accum", "2"], "a forward step has none"),
    ] {
        fails_with(&args, want);
    }
    let ck = d.join("ck");
    run_ok(&small(&["--steps", "2", "--checkpoint-dir", s(&ck)]));
    let resumed = small(&["--steps", "4", "--resume", "auto", "--grad-accum", "2", "--checkpoint-dir", s(&ck)]);
    fails_with(
        &resumed.iter().map(String::as_str).collect::<Vec<_>>(),
        "step.grad_accum = 1, this run has step.grad_accum = 2",
    );
    std::fs::remove_dir_all(&d).unwrap();
}

/// Loss of step `step` in a metrics file.
fn loss_at(path: &Path, step: u64) -> f64 {
    metrics(path).iter().find(|r| r["step"].as_u64() == Some(step) && r.get("loss").is_some()).unwrap()["loss"]
        .as_f64()
        .unwrap()
}

#[test]
fn a_trained_model_goes_out_as_a_hugging_face_folder_and_comes_back_in() {
    let d = scratch("hf-out");
    let a = d.join("model-a");
    let (a_metrics, b_metrics) = (d.join("a.jsonl"), d.join("b.jsonl"));
    // From scratch, written out when the run ends.
    let (_, err) = run_ok(&small(&["--steps", "30", "--out", s(&a), "--metrics", s(&a_metrics)]));
    assert!(err.contains("Hugging Face folder") && err.contains(s(&a)), "{err}");
    for f in ["config.json", "model.safetensors"] {
        assert!(a.join(f).is_file(), "{f} missing in {}", a.display());
    }
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(a.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["num_hidden_layers"], 1);
    // Fine-tuned from it: the geometry comes from its config.json (one
    // layer, no --n-layer given), the weights are the trained ones, so the
    // first loss is far below a fresh model's ln(256) ≈ 5.55.
    let b = d.join("model-b");
    let tune = [
        "train",
        "--device",
        "cpu",
        "--seq",
        "16",
        "--batch",
        "2",
        "--eval-every",
        "0",
        "--log-every",
        "0",
        "--steps",
        "2",
        "--init-from",
        s(&a),
        "--out",
        s(&b),
        "--metrics",
        s(&b_metrics),
    ];
    let (ok, _, err) = stepgraph(&tune);
    assert!(ok, "{err}");
    let (scratch_first, tuned_first) = (loss_at(&a_metrics, 1), loss_at(&b_metrics, 1));
    let trained_last = loss_at(&a_metrics, 30);
    assert!(scratch_first > 5.0, "a fresh byte-level model starts near ln 256: {scratch_first}");
    assert!(
        tuned_first < scratch_first - 1.0 && (tuned_first - trained_last).abs() < 1.0,
        "fine-tuning starts where training ended ({trained_last}), not from scratch ({scratch_first}): {tuned_first}"
    );
    assert!(b.join("model.safetensors").is_file() && b.join("config.json").is_file());
    // A run stopped early leaves --out for the run that finishes it.
    let c = d.join("model-c");
    let ckpt = d.join("ckpt");
    let (_, err) = run_ok(&small(&["--steps", "4", "--stop-after", "2", "--checkpoint-dir", s(&ckpt), "--out", s(&c)]));
    assert!(err.contains("is written when the run reaches step 4") && !c.exists(), "{err}");
    run_ok(&small(&["--steps", "4", "--resume", "auto", "--checkpoint-dir", s(&ckpt), "--out", s(&c)]));
    assert!(c.join("model.safetensors").is_file());
}

/// The summary's ms/step counts the training steps alone: a run that
/// evaluates 8 batches after every step spends most of its time
/// evaluating, and its ms/step says what a step took, not the total over
/// the steps.
#[test]
fn the_summary_counts_training_steps_alone() {
    let mut args = small(&["--steps", "6", "--eval-batches", "8"]);
    args[10] = "1".into(); // --eval-every
    let (out, _) = run_ok(&args);
    let line = out.lines().find(|l| l.starts_with("final loss")).expect(&out);
    let total_ms = {
        let t = line.split(" in ").nth(1).unwrap();
        let (n, unit) = t.split_once(' ').unwrap();
        n.parse::<f64>().unwrap() * if unit.starts_with("ms") { 1.0 } else { 1e3 }
    };
    let per_step: f64 = line.split('(').nth(2).unwrap().split(" ms/step").next().unwrap().parse().unwrap();
    assert!(per_step > 0.0 && per_step * 6.0 < 0.7 * total_ms, "{line}");
}

/// `--epochs N` instead of `--steps`: the run trains N passes over the
/// training sequences, rounded up to whole steps, and says so; it cannot
/// be given with --steps, and must be positive.
#[test]
fn epochs_set_the_steps_from_the_data() {
    let d = scratch("epochs");
    let file = d.join("m.jsonl");
    let (_, err) = run_ok(&small(&["--epochs", "1.5", "--metrics", s(&file)]));
    let line = err.lines().find(|l| l.starts_with("training ")).expect(&err);
    let steps: usize = line.split(", ").last().unwrap().split(" steps").next().unwrap().parse().unwrap();
    let sequences: usize =
        line.split("epochs of ").nth(1).unwrap().split(" sequences").next().unwrap().parse().unwrap();
    // small(): 2 rows a step.
    assert_eq!(steps, (1.5 * sequences as f64 / 2.0).ceil() as usize, "{line}");
    assert_eq!(metrics(&file).iter().filter(|r| r.get("loss").is_some()).count(), steps);
    let (ok, _, err) =
        stepgraph(&small(&["--epochs", "1", "--steps", "3"]).iter().map(String::as_str).collect::<Vec<_>>());
    assert!(!ok && err.contains("'--epochs <N>' cannot be used with '--steps <STEPS>'"), "{err}");
    let (ok, _, err) = stepgraph(&small(&["--epochs", "0"]).iter().map(String::as_str).collect::<Vec<_>>());
    assert!(!ok && err.contains("--epochs 0: give a positive number"), "{err}");
    std::fs::remove_dir_all(&d).unwrap();
}
