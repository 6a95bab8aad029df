//! The run configuration: one structure that builds a training run (its
//! step, its data) and, serialized, is the identity a resumed run must
//! share with its checkpoint.
//!
//! **Invariant:** every serialized field of [`RunConfig`] is part of the
//! resume identity, and the identity is nothing but that serialization,
//! flattened to dotted keys (`model.config.n_layer`, `step.f32_products`,
//! `switches.gemm_tiled`). A setting added to the model, the step options
//! or the switches is therefore checked on resume with no list to edit.
//! What changes no bits of any step (the number of steps, the schedule, the
//! evaluation and checkpoint cadence) lives in [`Course`], which is not
//! serialized.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::Result;
use serde::{Serialize, Serializer};

use stepgraph_core::autodiff::DecayScope;
use stepgraph_core::ir::Trace;
use stepgraph_core::models::ModelSpec;
use stepgraph_core::ops::Op;
use stepgraph_core::pipeline::{compile_step_timed, CompileTimes, CompiledStep, StepOptions};
use stepgraph_cuda::Switches;

use stepgraph_data::Packing;

use crate::data::{self, TrainData};
use crate::schedule::LrSchedule;

/// Everything a training run is.
#[derive(Clone, Debug, Serialize)]
pub struct RunConfig {
    /// The model, the batch (rows of one micro-batch), the sequence and the dtype.
    pub model: ModelSpec,
    /// How the step is built: optimizer, accumulation, recomputation,
    /// data parallelism, precision of products.
    pub step: StepOptions,
    pub data: DataConfig,
    /// Seeds the initial weights and the batch order.
    pub seed: u64,
    /// Processes training together: 1 on the CPU or one GPU.
    pub gpus: usize,
    /// The run-time switches the sessions open with.
    pub switches: Switches,
    /// How far and how the run goes; not part of the identity.
    #[serde(skip)]
    pub course: Course,
}

/// The training data.
#[derive(Clone, Debug, Serialize)]
pub struct DataConfig {
    /// A token file of `stepgraph prepare`, or any other file as byte-level text.
    #[serde(serialize_with = "display_path")]
    pub path: PathBuf,
    /// The fraction at the end of byte-level text held out for validation.
    pub val_fraction: f64,
    /// How a token file's documents share rows.
    pub packing: Packing,
}

fn display_path<S: Serializer>(path: &Path, s: S) -> std::result::Result<S::Ok, S::Error> {
    s.serialize_str(&path.display().to_string())
}

/// The parts of a run that change no bits of its steps: a resumed run may
/// change them (a run may be extended; a changed schedule is noted).
#[derive(Clone, Debug, PartialEq)]
pub struct Course {
    /// Optimizer steps of the whole run.
    pub steps: usize,
    /// The last step this process trains, when before `steps`.
    pub stop_after: Option<usize>,
    pub schedule: LrSchedule,
    /// Evaluate every N steps and at the end (0: never).
    pub eval_every: usize,
    /// Batches of the held-out split each evaluation runs.
    pub eval_batches: usize,
    pub checkpoints: Option<Checkpoints>,
    /// The JSONL metrics file.
    pub metrics: Option<PathBuf>,
    /// Stop with an error at the step the loss diverges, instead of a warning.
    pub fail_on_divergence: bool,
}

impl Course {
    /// `steps` steps with `schedule`, no evaluation, checkpoints or metrics.
    pub fn new(steps: usize, schedule: LrSchedule) -> Self {
        Course {
            steps,
            stop_after: None,
            schedule,
            eval_every: 0,
            eval_batches: 0,
            checkpoints: None,
            metrics: None,
            fail_on_divergence: false,
        }
    }

    /// The last step this process trains.
    pub fn last(&self) -> usize {
        self.stop_after.unwrap_or(self.steps)
    }
}

/// Where and how often checkpoints are saved.
#[derive(Clone, Debug, PartialEq)]
pub struct Checkpoints {
    pub dir: PathBuf,
    /// Also save every N steps, not only at the end (0: only at the end).
    pub save_every: usize,
    /// The newest checkpoints kept.
    pub keep: usize,
}

impl RunConfig {
    /// The resume identity: this configuration, serialized and flattened to
    /// dotted keys (see the module doc).
    pub fn identity(&self) -> Result<BTreeMap<String, serde_json::Value>> {
        let mut id = BTreeMap::new();
        flatten("", &serde_json::to_value(self)?, &mut id);
        Ok(id)
    }

    /// The settings checkpoints of format 1 recorded, under their keys then,
    /// so that a run saved by an earlier stepgraph can still be resumed;
    /// `step` is the step as built.
    pub fn legacy_identity(&self, step: &Trace) -> BTreeMap<String, serde_json::Value> {
        let (spec, opts) = (&self.model, &self.step);
        let mut id = BTreeMap::new();
        if let Ok(serde_json::Value::Object(config)) = serde_json::to_value(&spec.config) {
            for (k, v) in config {
                id.insert(format!("model.{k}"), v);
            }
        }
        let zero1 = opts.data_parallel.as_ref().is_some_and(|dp| dp.zero1);
        id.insert("batch".into(), spec.batch.into());
        id.insert("seq".into(), spec.seq.into());
        id.insert("dtype".into(), spec.dtype.to_string().into());
        id.insert("state-dtype".into(), state_dtype(step).into());
        id.insert("weight-decay".into(), opts.train.adamw.weight_decay.into());
        id.insert("decay-all".into(), (opts.train.decay == DecayScope::All).into());
        id.insert("clip-grad-norm".into(), opts.train.clip_grad_norm.unwrap_or(0.0).into());
        id.insert("grad-accum".into(), opts.grad_accum.into());
        id.insert("gpus".into(), self.gpus.into());
        id.insert("zero1".into(), zero1.into());
        id.insert("data".into(), self.data.path.display().to_string().into());
        id.insert("val-fraction".into(), self.data.val_fraction.into());
        id.insert("seed".into(), self.seed.into());
        id
    }

    /// Builds the step: traced, transformed, scheduled and planned.
    pub fn compile(&self) -> Result<(CompiledStep, CompileTimes)> {
        Ok(compile_step_timed(&self.model, &self.step)?)
    }

    /// Opens the data: batches of every micro-batch of a step.
    pub fn open_data(&self) -> Result<Box<dyn TrainData>> {
        data::open(
            &self.data.path,
            self.model.batch * self.step.grad_accum,
            self.model.seq,
            self.data.val_fraction,
            self.seed,
            self.data.packing,
        )
    }
}

/// `{"a": {"b": 1}}` as `a.b = 1`; arrays and scalars are leaves.
fn flatten(prefix: &str, value: &serde_json::Value, out: &mut BTreeMap<String, serde_json::Value>) {
    match value {
        serde_json::Value::Object(map) if !map.is_empty() => {
            for (k, v) in map {
                let key = if prefix.is_empty() { k.clone() } else { format!("{prefix}.{k}") };
                flatten(&key, v, out);
            }
        }
        _ => {
            out.insert(prefix.to_string(), value.clone());
        }
    }
}

/// The dtype of the step's AdamW moments, read from its optimizer nodes
/// (whose third input is the first moment): `8bit` for block-quantized
/// ones. Other state the step keeps (master weights, the previous gradient
/// norm that `--clip-by-previous-norm` keeps) says nothing of them.
pub fn state_dtype(step: &Trace) -> Option<String> {
    step.nodes.iter().find_map(|n| match &n.op {
        Op::AdamW8bit(_) => Some("8bit".to_string()),
        Op::AdamW(_) => Some(step.ty(n.inputs[2]).dtype.to_string()),
        _ => None,
    })
}

#[cfg(test)]
mod tests {
    use stepgraph_core::autodiff::StepKind;
    use stepgraph_core::ir::DType;
    use stepgraph_core::models::LossKind;

    use super::*;

    fn config() -> RunConfig {
        let model = ModelSpec::named("tiny-llama", 2, 8, DType::F32, LossKind::CrossEntropy).unwrap();
        RunConfig {
            model,
            step: StepOptions::new(StepKind::Train),
            data: DataConfig { path: "data/tiny.txt".into(), val_fraction: 0.1, packing: Packing::Documents },
            seed: 3,
            gpus: 1,
            switches: Switches::default(),
            course: Course::new(10, LrSchedule::new(1e-3, 2, 1e-4, 10).unwrap()),
        }
    }

    /// The run header's moments: 8-bit, bf16 and f32 ones are named as such
    /// whatever other state the step keeps (the previous gradient norm, an
    /// f32 scalar; f32 master weights or bf16 compensations), and a step
    /// without an optimizer has none.
    #[test]
    fn the_moments_dtype_is_the_moments_not_other_state() {
        use stepgraph_core::autodiff::{build_step, TrainOptions};
        use stepgraph_core::ops::optim::MasterWeights;
        for (dtype, dense) in [(DType::BF16, "bf16"), (DType::F16, "f32")] {
            let spec = ModelSpec::named("tiny-llama", 2, 8, dtype, LossKind::CrossEntropy).unwrap();
            let forward = stepgraph_core::models::gpt::build_forward(&spec).unwrap();
            for master_weights in [MasterWeights::None, MasterWeights::Kahan, MasterWeights::F32] {
                for clip_by_previous_norm in [false, true] {
                    let moments = |moments_8bit| {
                        let opts = TrainOptions {
                            moments_8bit,
                            clip_by_previous_norm,
                            clip_grad_norm: Some(1.0),
                            master_weights,
                            ..Default::default()
                        };
                        state_dtype(&build_step(&forward, StepKind::Train, &opts).unwrap())
                    };
                    let case = format!("{dtype} {master_weights:?}, previous norm {clip_by_previous_norm}");
                    assert_eq!(moments(true).as_deref(), Some("8bit"), "{case}");
                    assert_eq!(moments(false).as_deref(), Some(dense), "{case}");
                }
            }
            let grads = build_step(&forward, StepKind::Grads, &TrainOptions::default()).unwrap();
            assert_eq!(state_dtype(&grads), None);
        }
    }

    #[test]
    fn the_identity_is_the_serialized_configuration_without_its_course() {
        let mut c = config();
        let id = c.identity().unwrap();
        assert_eq!(id["model.batch"], 2);
        assert_eq!(id["data.path"], "data/tiny.txt");
        assert_eq!((&id["seed"], &id["gpus"]), (&serde_json::json!(3), &serde_json::json!(1)));
        assert!(id.keys().any(|k| k.starts_with("step.")) && id.keys().any(|k| k.starts_with("switches.")));
        assert!(!id.keys().any(|k| k.starts_with("course")), "{id:?}");
        // The course changes no bits: a longer run has the same identity.
        c.course.steps = 100;
        c.course.eval_every = 5;
        assert_eq!(c.identity().unwrap(), id);
        c.step.grad_accum = 2;
        assert_ne!(c.identity().unwrap(), id);
        // Where the plan keeps a frozen table changes no value either, and
        // checkpoints written before that choice existed still resume.
        c.step.grad_accum = 1;
        c.step.plan.host_tables = true;
        assert_eq!(c.identity().unwrap(), id);
        assert!(id.contains_key("step.plan.reuse") && !id.keys().any(|k| k.contains("host")), "{id:?}");
    }
}
