//! The trainer through its library API alone: a tiny model trains on the
//! CPU with a collecting reporter, saves checkpoints, and a run resumed
//! from one equals the straight run bit for bit.

use std::path::{Path, PathBuf};

use stepgraph_core::autodiff::StepKind;
use stepgraph_core::ir::DType;
use stepgraph_core::models::{Config, LossKind, ModelSpec, Overrides};
use stepgraph_core::pipeline::StepOptions;
use stepgraph_cuda::Switches;
use stepgraph_data::Packing;
use stepgraph_train::checkpoint::CheckpointDir;
use stepgraph_train::schedule::LrSchedule;
use stepgraph_train::{
    Checkpoints, Course, DataConfig, Placement, Reporter, RunConfig, RunEnd, StepReport, Summary, Trainer,
};

/// Every event a run reports.
#[derive(Default)]
struct Collect {
    steps: Vec<StepReport>,
    validations: Vec<(usize, f64)>,
    divergences: Vec<String>,
}

impl Reporter for Collect {
    fn step(&mut self, report: &StepReport) {
        self.steps.push(report.clone());
    }
    fn validation(&mut self, step: usize, loss: f64) {
        self.validations.push((step, loss));
    }
    fn divergence(&mut self, message: &str) {
        self.divergences.push(message.to_string());
    }
}

impl Collect {
    fn losses(&self) -> Vec<(usize, u64)> {
        self.steps.iter().map(|s| (s.step, s.loss.to_bits())).collect()
    }
}

const STEPS: usize = 6;

fn config(dir: &Path) -> RunConfig {
    let overrides = Overrides { n_layer: Some(1), ..Overrides::default() };
    let config = Config::named("tiny-llama").unwrap().with_overrides(&overrides).unwrap();
    let model = ModelSpec {
        config,
        batch: 2,
        seq: 16,
        dtype: DType::F32,
        loss: LossKind::CrossEntropy,
        adapters: None,
        documents: false,
    };
    let data = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../data/tiny.txt");
    let mut course = Course::new(STEPS, LrSchedule::new(3e-3, 1, 3e-4, STEPS).unwrap());
    course.eval_every = 3;
    course.eval_batches = 1;
    course.checkpoints = Some(Checkpoints { dir: dir.join("ckpt"), save_every: 2, keep: 5 });
    course.metrics = Some(dir.join("metrics.jsonl"));
    RunConfig {
        model,
        step: StepOptions::new(StepKind::Train),
        data: DataConfig { path: data, val_fraction: 0.1, packing: Packing::Documents },
        seed: 7,
        gpus: 1,
        switches: Switches::default(),
        course,
    }
}

fn finished(end: RunEnd) -> Summary {
    match end {
        RunEnd::Finished(s) => s,
        RunEnd::Stopped { step, .. } => panic!("the run stopped after step {step}"),
    }
}

fn scratch(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("stepgraph-trainer-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn a_tiny_model_trains_saves_and_resumes_bit_for_bit() {
    let dir = scratch("straight");
    let mut straight = Collect::default();
    let mut trainer = Trainer::new(config(&dir), Placement::Cpu).unwrap();
    let summary = finished(trainer.run(&mut straight, &mut || false).unwrap());
    assert_eq!(straight.steps.iter().map(|s| s.step).collect::<Vec<_>>(), (1..=STEPS).collect::<Vec<_>>());
    assert!(summary.last_loss < summary.first_loss, "{summary:?}");
    assert_eq!(straight.validations.iter().map(|v| v.0).collect::<Vec<_>>(), [3, 6]);
    assert!(straight.validations.iter().all(|v| v.1.is_finite()) && straight.divergences.is_empty());
    // The metrics file holds what the reporter saw.
    let rows: Vec<serde_json::Value> = std::fs::read_to_string(dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .filter(|r: &serde_json::Value| r.get("loss").is_some())
        .collect();
    let metric_losses: Vec<(usize, u64)> =
        rows.iter().map(|r| (r["step"].as_u64().unwrap() as usize, r["loss"].as_f64().unwrap().to_bits())).collect();
    assert_eq!(metric_losses, straight.losses());
    // Checkpoints every 2 steps and at the end.
    let saved: Vec<usize> = CheckpointDir::new(dir.join("ckpt")).complete().unwrap().iter().map(|c| c.0).collect();
    assert_eq!(saved, [2, 4, 6]);
    assert_eq!(summary.saved, Some(CheckpointDir::new(dir.join("ckpt")).step_dir(STEPS)));

    // A run that stops after step 3 when asked, with a checkpoint of that step...
    let cut = scratch("cut");
    let mut first = Collect::default();
    let mut trainer = Trainer::new(config(&cut), Placement::Cpu).unwrap();
    let mut calls = 0;
    let end = trainer
        .run(&mut first, &mut || {
            calls += 1;
            calls == 3
        })
        .unwrap();
    let RunEnd::Stopped { step: 3, saved: Some(at), ran: 3 } = end else { panic!("{end:?}") };
    drop(trainer);
    // ...resumed by a new trainer through the library, ends where the straight run did.
    let mut trainer = Trainer::new(config(&cut), Placement::Cpu).unwrap();
    let state = trainer.resume(&at).unwrap();
    assert_eq!((state.step, trainer.next_step()), (3, 4));
    let mut rest = Collect::default();
    let resumed = finished(trainer.run(&mut rest, &mut || false).unwrap());
    let mut both = first.losses();
    both.extend(rest.losses());
    assert_eq!(both, straight.losses(), "the resumed run differs from the straight one");
    assert_eq!(resumed.last_loss.to_bits(), summary.last_loss.to_bits());
    assert_eq!(rest.validations.last().map(|v| v.1.to_bits()), straight.validations.last().map(|v| v.1.to_bits()));

    // A checkpoint of another run is refused, naming the setting.
    let mut other = config(&cut);
    other.seed = 8;
    let mut trainer = Trainer::new(other, Placement::Cpu).unwrap();
    let e = trainer.resume(&at).unwrap_err().to_string();
    assert!(e.contains("seed = 7") && e.contains("seed = 8"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
    std::fs::remove_dir_all(&cut).unwrap();
}

/// Validation is a segment of the training session's program: the run
/// plans the training step plus what the evaluation adds (its inputs and
/// loss here), trains exactly as without validation, and its losses are
/// what a session of its own, holding a copy of the weights, computes.
#[test]
fn validation_runs_in_the_training_arena_and_changes_no_step() {
    use stepgraph_train::trainer::{eval_step, EvalRuns, Evaluator};
    use stepgraph_train::{open_session, Backend, SessionOptions};
    let dir = scratch("arena");
    let mut run = config(&dir);
    (run.course.checkpoints, run.course.metrics) = (None, None);
    let mut plain_run = run.clone();
    plain_run.course.eval_every = 0;

    let mut trainer = Trainer::new(run.clone(), Placement::Cpu).unwrap();
    let mut plain = Trainer::new(plain_run, Placement::Cpu).unwrap();
    let extra = trainer.eval_extra_bytes().expect("validation runs in the training arena");
    assert!(extra <= 4096, "validation adds {extra} bytes to a tiny step");
    let planned = |t: &mut Trainer| t.memory().unwrap().planned_bytes;
    assert_eq!(planned(&mut trainer), planned(&mut plain) + extra);
    assert_eq!(plain.eval_extra_bytes(), None);

    let (mut with, mut without) = (Collect::default(), Collect::default());
    finished(trainer.run(&mut with, &mut || false).unwrap());
    finished(plain.run(&mut without, &mut || false).unwrap());
    assert_eq!(with.losses(), without.losses(), "validation changed a training step");
    assert_eq!(with.validations.iter().map(|v| v.0).collect::<Vec<_>>(), [3, 6]);

    let (compiled, _) = run.compile().unwrap();
    let eval = eval_step(&run, &compiled, trainer.data(), &Placement::Cpu).unwrap().unwrap();
    let own = open_session(Backend::Cpu, eval.step, eval.plan, SessionOptions::default()).unwrap().session;
    let batches = trainer.data().validation_batches(run.course.eval_batches).unwrap();
    let mut apart =
        Evaluator { runs: EvalRuns::Session { session: own, frozen_copied: false }, batches, micro_batches: 1 };
    let loss = apart.evaluate(trainer.session(), 0, 1).unwrap();
    assert_eq!(Some(loss.to_bits()), with.validations.last().map(|v| v.1.to_bits()));
    std::fs::remove_dir_all(&dir).unwrap();
}
