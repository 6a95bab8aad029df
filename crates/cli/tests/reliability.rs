//! What `stepgraph train` promises about a user's files and runs, tested as
//! a user meets it: one run per checkpoint directory, signals that save,
//! damaged checkpoints named, a resume that is the same run, and runs
//! killed (SIGKILL) or stopped (SIGTERM) at random moments that always
//! leave a loadable folder and end, resumed, bit for bit where a straight
//! run ends. `docs/reliability.md` lists these promises and their tests.

mod common;
use common::{fails_with, root, s};

use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use rand::{Rng, SeedableRng};
use stepgraph_core::host::HostTensor;
use stepgraph_core::models::checkpoint::{read_safetensors, write_safetensors_atomic};

/// A small, fast run: one layer, 2 x 16 tokens, CPU, no validation.
fn small(extra: &[&str]) -> Vec<String> {
    let base = ["train", "--device", "cpu", "--n-layer", "1", "--seq", "16", "--batch", "2", "--eval-every", "0"];
    base.iter().chain(["--log-every", "0"].iter()).chain(extra).map(|a| a.to_string()).collect()
}

fn run(args: &[String], env: &[(&str, &str)]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_stepgraph"))
        .args(args)
        .envs(env.iter().copied())
        .env_remove("RUST_BACKTRACE")
        .current_dir(root())
        .output()
        .unwrap();
    (out.status.success(), String::from_utf8_lossy(&out.stdout).into(), String::from_utf8_lossy(&out.stderr).into())
}

fn run_ok(args: &[String]) -> String {
    let (ok, out, err) = run(args, &[]);
    assert!(ok, "{args:?} failed: {err}");
    out + &err
}

fn spawn(args: &[String]) -> Child {
    Command::new(env!("CARGO_BIN_EXE_stepgraph"))
        .args(args)
        .current_dir(root())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

fn signal(child: &Child, signal: i32) {
    // SAFETY: kill(2) on the pid of a child this test started and has not reaped.
    assert_eq!(unsafe { libc::kill(child.id() as i32, signal) }, 0);
}

/// Rows of the metrics file that have a training loss.
fn metric_rows(path: &Path) -> usize {
    std::fs::read_to_string(path).map(|t| t.lines().filter(|l| l.contains("\"loss\"")).count()).unwrap_or(0)
}

fn wait_for_rows(path: &Path, rows: usize) {
    let t0 = Instant::now();
    while metric_rows(path) < rows {
        assert!(t0.elapsed() < Duration::from_secs(120), "no {rows} metrics rows in {} after 120 s", path.display());
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// `step-…` directories of `dir` by name.
fn step_dirs(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .map(|e| e.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect())
        .unwrap_or_default();
    names.retain(|n| n.starts_with("step-"));
    names.sort();
    names
}

/// The losses of the metrics file as bits, by step.
fn loss_bits(path: &Path) -> Vec<(u64, u64)> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|r| r.get("loss").is_some())
        .map(|r| (r["step"].as_u64().unwrap(), r["loss"].as_f64().unwrap().to_bits()))
        .collect()
}

/// Every tensor of a folder's safetensors files, by name.
fn tensors(dir: &Path) -> Vec<(String, HostTensor)> {
    let mut all = Vec::new();
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        if e.path().extension().is_some_and(|x| x == "safetensors") {
            all.extend(read_safetensors(&e.path()).unwrap());
        }
    }
    all.sort_by(|a, b| a.0.cmp(&b.0));
    all
}

#[test]
fn a_second_run_on_a_checkpoint_directory_is_refused_naming_the_first() {
    let d = tempfile::tempdir().unwrap();
    let ck = d.path().join("ck");
    let mut first = spawn(&small(&["--steps", "1000000", "--checkpoint-dir", s(&ck)]));
    wait_for_rows(&ck.join("metrics.jsonl"), 3);
    let second = small(&["--steps", "1000000", "--resume", "auto", "--checkpoint-dir", s(&ck)]);
    let (ok, _, err) = run(&second, &[]);
    assert!(!ok, "{err}");
    let holder = format!("in use by another training run (pid {} on host", first.id());
    assert!(err.contains(&holder), "{err}");
    // The first run's metrics were not touched by the second.
    let rows = metric_rows(&ck.join("metrics.jsonl"));
    signal(&first, libc::SIGTERM);
    let status = first.wait().unwrap();
    assert_eq!(status.code(), Some(128 + libc::SIGTERM), "{status:?}");
    assert!(metric_rows(&ck.join("metrics.jsonl")) >= rows);
}

#[test]
fn sigterm_finishes_the_step_saves_a_checkpoint_and_says_how_to_resume() {
    let d = tempfile::tempdir().unwrap();
    let ck = d.path().join("ck");
    let args = small(&["--steps", "1000000", "--checkpoint-dir", s(&ck), "--out", s(&d.path().join("out"))]);
    let mut child = spawn(&args);
    wait_for_rows(&ck.join("metrics.jsonl"), 3);
    signal(&child, libc::SIGTERM);
    let status = child.wait().unwrap();
    let mut err = String::new();
    std::io::Read::read_to_string(child.stderr.as_mut().unwrap(), &mut err).unwrap();
    assert_eq!(status.code(), Some(128 + libc::SIGTERM), "{err}");
    let saved = step_dirs(&ck);
    assert_eq!(saved.len(), 1, "{saved:?}");
    let step: usize = saved[0].strip_prefix("step-").unwrap().parse().unwrap();
    let want = format!("stopped by SIGTERM after step {step} of 1000000; its checkpoint is");
    assert!(err.contains(&want) && err.contains("--resume auto"), "{err}");
    assert!(err.contains("--out") && err.contains("is written only when the run reaches step 1000000"), "{err}");
    // Without a checkpoint directory the message says what is lost.
    let mut child = spawn(&small(&["--steps", "1000000", "--metrics", s(&d.path().join("m.jsonl"))]));
    wait_for_rows(&d.path().join("m.jsonl"), 2);
    signal(&child, libc::SIGINT);
    let status = child.wait().unwrap();
    let mut err = String::new();
    std::io::Read::read_to_string(child.stderr.as_mut().unwrap(), &mut err).unwrap();
    assert_eq!(status.code(), Some(128 + libc::SIGINT), "{err}");
    assert!(err.contains("stopped by SIGINT") && err.contains("no checkpoint was saved"), "{err}");
}

#[test]
fn stop_after_needs_a_checkpoint_to_continue_from() {
    let err = fails_with(&["train", "--steps", "4", "--stop-after", "2"], "--stop-after 2 stops the run");
    assert!(err.contains("--checkpoint-dir"), "{err}");
}

#[test]
fn a_damaged_newest_checkpoint_is_named_up_front_and_the_run_completes() {
    let d = tempfile::tempdir().unwrap();
    let (ck, straight) = (d.path().join("ck"), d.path().join("straight"));
    run_ok(&small(&["--steps", "9", "--save-every", "3", "--checkpoint-dir", s(&straight)]));
    run_ok(&small(&["--steps", "9", "--save-every", "3", "--stop-after", "6", "--checkpoint-dir", s(&ck)]));
    // The newest checkpoint's weights cut short, as by a full disk.
    let weights = ck.join("step-000006/weights.safetensors");
    let len = std::fs::metadata(&weights).unwrap().len();
    std::fs::File::options().write(true).open(&weights).unwrap().set_len(len / 2).unwrap();
    let resume = small(&["--steps", "9", "--save-every", "3", "--resume", "auto", "--checkpoint-dir", s(&ck)]);
    let text = run_ok(&resume);
    assert!(
        text.contains("--resume auto skips") && text.contains("step-000006") && text.contains("weights.safetensors"),
        "{text}"
    );
    assert!(text.contains("step-000006.damaged") && text.contains("resumed     from"), "{text}");
    assert_eq!(step_dirs(&ck), ["step-000003", "step-000006", "step-000006.damaged", "step-000009"]);
    // Resumed from step 3, the run is the straight run.
    assert_eq!(loss_bits(&ck.join("metrics.jsonl")), loss_bits(&straight.join("metrics.jsonl")));
}

#[test]
fn a_non_finite_optimizer_moment_is_named_on_resume() {
    let d = tempfile::tempdir().unwrap();
    let ck = d.path().join("ck");
    run_ok(&small(&["--steps", "4", "--stop-after", "2", "--checkpoint-dir", s(&ck)]));
    let file = ck.join("step-000002/optimizer.safetensors");
    let mut state = read_safetensors(&file).unwrap();
    let (name, t) = &mut state[1];
    let name = name.clone();
    let mut values = t.to_f64();
    values[3] = f64::NAN;
    *t = HostTensor::from_f64(t.ty.clone(), &values);
    write_safetensors_atomic(&file, &state).unwrap();
    let args = small(&["--steps", "4", "--resume", "auto", "--checkpoint-dir", s(&ck)]);
    let (ok, _, err) = run(&args, &[]);
    assert!(!ok, "{err}");
    assert!(
        err.contains(&format!("holds NaN in `{name}` (element 3)")) && err.contains("optimizer.safetensors"),
        "{err}"
    );
    assert!(!err.contains("lower the learning rate"), "{err}");
}

#[test]
fn a_resume_built_differently_is_refused_naming_the_setting() {
    let d = tempfile::tempdir().unwrap();
    let ck = d.path().join("ck");
    let first = ["--steps", "4", "--stop-after", "2", "--f32-products", "3xtf32", "--checkpoint-dir", s(&ck)];
    run_ok(&small(&first));
    let resume = |extra: &[&str], env: &[(&str, &str)]| {
        let mut args = vec!["--resume", "auto", "--checkpoint-dir", s(&ck)];
        if !extra.contains(&"--steps") {
            args.extend(["--steps", "4"]);
        }
        args.extend_from_slice(extra);
        run(&small(&args), env)
    };
    let (ok, _, err) = resume(&["--f32-products", "exact"], &[]);
    assert!(!ok && err.contains("step.f32_products = \"3xtf32\", this run has step.f32_products = \"exact\""), "{err}");
    let (ok, _, err) = resume(&["--f32-products", "3xtf32", "--epilogues", "off"], &[]);
    assert!(!ok && err.contains("step.epilogues"), "{err}");
    let (ok, _, err) = resume(&["--f32-products", "3xtf32"], &[("STEPGRAPH_MULTI_TENSOR", "0")]);
    assert!(!ok && err.contains("switches.multi_tensor = true, this run has switches.multi_tensor = false"), "{err}");
    // The same run continues; more steps are a longer run of the same settings.
    let (ok, _, err) = resume(&["--f32-products", "3xtf32", "--steps", "6"], &[]);
    assert!(ok, "{err}");
}

/// The outcome of one interrupted run.
enum Ended {
    Finished,
    Killed,
    Stopped,
}

/// Kills (SIGKILL) and stops (SIGTERM) a run with checkpoints and `--out`
/// at random moments, at least 20 times, resuming it each time: the
/// checkpoint directory and the model folder are loadable after every
/// interruption, and the run's losses and final weights equal those of a
/// run never interrupted, bit for bit.
///
/// The moments are drawn from the first twelfth of the straight run's wall
/// time, measured here, so the run is interrupted many times on a slow
/// machine and on a fast one alike. Should it still finish before 20
/// interruptions, it is checked against the straight run and started again
/// from nothing, the interruptions adding up across attempts.
#[test]
fn runs_killed_or_stopped_at_random_moments_end_as_a_straight_run() {
    let d = tempfile::tempdir().unwrap();
    let steps = "200";
    let straight = |ck: &PathBuf, out: &PathBuf| {
        small(&["--steps", steps, "--save-every", "4", "--keep", "2", "--checkpoint-dir", s(ck), "--out", s(out)])
    };
    let (ck_a, out_a) = (d.path().join("straight"), d.path().join("straight-out"));
    let started = Instant::now();
    run_ok(&straight(&ck_a, &out_a));
    let latest_moment_us = (started.elapsed().as_micros() as u64 / 12).max(2_000);
    let (ck, out) = (d.path().join("ck"), d.path().join("out"));
    let mut args = straight(&ck, &out);
    args.extend(["--resume".to_string(), "auto".to_string()]);
    let seed: u64 = std::env::var("STEPGRAPH_FAULT_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(|| {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64
    });
    eprintln!("fault-injection seed {seed} (STEPGRAPH_FAULT_SEED={seed} repeats it)");
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let (mut killed, mut stopped, mut rounds, mut attempts) = (0, 0, 0, 0);
    let enough = |killed: i32, stopped: i32| killed + stopped >= 24 && killed > 0 && stopped > 0;
    while !enough(killed, stopped) {
        attempts += 1;
        let _ = std::fs::remove_dir_all(&ck);
        let _ = std::fs::remove_dir_all(&out);
        loop {
            rounds += 1;
            assert!(rounds < 400, "the run never finished (seed {seed})");
            let interrupt = !enough(killed, stopped);
            let mut child = spawn(&args);
            let ended = if interrupt {
                std::thread::sleep(Duration::from_micros(rng.gen_range(0..latest_moment_us)));
                let kill = rng.gen_bool(0.5);
                signal(&child, if kill { libc::SIGKILL } else { libc::SIGTERM });
                let status = child.wait().unwrap();
                match (status.code(), status.signal()) {
                    (Some(0), _) => Ended::Finished,
                    (_, Some(libc::SIGKILL)) => Ended::Killed,
                    // A SIGTERM before the handler is installed ends the process as a kill would.
                    (_, Some(libc::SIGTERM)) => Ended::Killed,
                    (Some(c), _) if c == 128 + libc::SIGTERM => Ended::Stopped,
                    other => {
                        let mut err = String::new();
                        std::io::Read::read_to_string(child.stderr.as_mut().unwrap(), &mut err).unwrap();
                        panic!("round {rounds} (seed {seed}) ended {other:?}: {err}")
                    }
                }
            } else {
                let status = child.wait().unwrap();
                let mut err = String::new();
                std::io::Read::read_to_string(child.stderr.as_mut().unwrap(), &mut err).unwrap();
                assert!(status.success(), "round {rounds} (seed {seed}): {err}");
                Ended::Finished
            };
            match ended {
                Ended::Killed => killed += 1,
                Ended::Stopped => stopped += 1,
                Ended::Finished => {}
            }
            // Whatever happened, every checkpoint there is complete and the model folder is whole or absent.
            for name in step_dirs(&ck) {
                let state = ck.join(&name).join("state.json");
                assert!(state.is_file(), "round {rounds} (seed {seed}): {name} is not complete");
                assert!(!tensors(&ck.join(&name)).is_empty());
            }
            if out.exists() {
                assert!(out.join("config.json").is_file(), "round {rounds} (seed {seed})");
                assert_eq!(tensors(&out).len(), tensors(&out_a).len(), "round {rounds} (seed {seed})");
            }
            if matches!(ended, Ended::Finished) {
                break;
            }
        }
        let at = format!("attempt {attempts}, seed {seed}");
        assert_eq!(loss_bits(&ck.join("metrics.jsonl")), loss_bits(&ck_a.join("metrics.jsonl")), "{at}");
        assert_eq!(tensors(&out), tensors(&out_a), "{at}");
        assert_eq!(step_dirs(&ck), step_dirs(&ck_a), "{at}");
        assert_eq!(tensors(&ck.join("step-000200")), tensors(&ck_a.join("step-000200")), "{at}");
    }
    eprintln!("{killed} kills and {stopped} stops in {rounds} rounds over {attempts} attempt(s)");
}

/// An output that cannot be written, or that is an input, is refused
/// before step 1: no run trains for hours and then fails to save.
#[test]
fn outputs_are_checked_before_step_one() {
    let d = tempfile::tempdir().unwrap();
    let refused = |extra: &[&str], want: &str| {
        let mut args = small(&["--steps", "3"]);
        args.extend(extra.iter().map(|a| a.to_string()));
        let (ok, out, err) = run(&args, &[]);
        assert!(!ok && err.contains(want), "{extra:?}: expected `{want}` in:\n{err}");
        assert!(!err.contains("start-up") && !out.contains("final loss"), "{extra:?} did work first:\n{err}");
        err
    };
    refused(&["--out", "/proc/stepgraph-out"], "--out");
    refused(&["--checkpoint-dir", "/proc/stepgraph-ck"], "--checkpoint-dir");
    refused(&["--metrics", "/proc/stepgraph/metrics.jsonl"], "--metrics");
    // The data file is an input: neither the metrics nor the model may replace it.
    let text = d.path().join("text.txt");
    std::fs::write(&text, "some text to train on, long enough for a few batches of sixteen tokens each. ".repeat(8))
        .unwrap();
    let linked = d.path().join("sub/../text.txt");
    std::fs::create_dir_all(d.path().join("sub")).unwrap();
    let err = refused(&["--data", s(&text), "--metrics", s(&linked)], "--metrics");
    assert!(err.contains("is the --data file"), "{err}");
    refused(&["--data", s(&text), "--out", s(d.path())], "holds the --data file");
    assert!(std::fs::read_to_string(&text).unwrap().starts_with("some text"));
}

/// A second signal ends the run at once, without waiting for the step.
#[test]
fn a_second_signal_ends_the_run_at_once() {
    let d = tempfile::tempdir().unwrap();
    let metrics = d.path().join("m.jsonl");
    let args = ["train", "--device", "cpu", "--seq", "256", "--steps", "1000000", "--eval-every", "0"];
    let mut args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
    args.extend(["--metrics".to_string(), s(&metrics).to_string()]);
    let mut child = spawn(&args);
    wait_for_rows(&metrics, 2);
    // Two different signals, back to back (two of one kind could merge into one).
    signal(&child, libc::SIGTERM);
    signal(&child, libc::SIGINT);
    let status = child.wait().unwrap();
    let mut err = String::new();
    std::io::Read::read_to_string(child.stderr.as_mut().unwrap(), &mut err).unwrap();
    let by_signal = matches!(status.signal(), Some(libc::SIGTERM | libc::SIGINT))
        || matches!(status.code(), Some(c) if c == 128 + libc::SIGTERM || c == 128 + libc::SIGINT);
    assert!(by_signal && !err.contains("stopped by"), "{status:?}: {err}");
}
