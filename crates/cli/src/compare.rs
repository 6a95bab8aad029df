//! `stepgraph compare`: one `grads` step of stepgraph against a PyTorch
//! reference on identical weights and tokens, on the CPU or the CUDA
//! backend.
//!
//! The reference is the folder `shared/bench/torch_reference.py --save DIR`
//! writes: `config.json` (the Hugging Face config), `weights.safetensors`
//! (the state dict), `io.safetensors` (`input_ids` [B, T] and the first
//! step's `loss` [1]) and `grads.safetensors` (every parameter's gradient of
//! that step, Hugging Face names). The model is built from `config.json`, the
//! batch shape from `input_ids`. The step is compiled once
//! ([`compile_step`]) and then bound to a backend session (a `dyn Session`:
//! the CPU reference backend or a `CudaSession` on GPU 0); everything else — loading, running, reading back
//! and the comparison itself — is the same code for both.
//!
//! The metric, per tensor (the loss counts as a tensor of one element), with
//! `a` stepgraph's values and `b` the reference's, computed in f64:
//! - `rel` = ‖a − b‖₂ / ‖b‖₂, the primary metric, which the verdict uses;
//! - `rel_max` = max |a − b| / max |b|, reported next to it.
//!
//! A tensor passes when its `rel` is a number no larger than the tolerance
//! (`--tol`; by default 1e-4 when the step and the reference are f32, 2e-2
//! when either is bf16 or f16). The command exits non-zero when the loss or
//! any gradient fails.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use serde::Serialize;

use stepgraph_core::autodiff::StepKind;
use stepgraph_core::cpu::exec::CpuSession;
use stepgraph_core::host::HostTensor;
use stepgraph_core::ir::{DType, Trace};
use stepgraph_core::models::checkpoint::{load_params, read_safetensors, reference_batch};
use stepgraph_core::models::{Config, LossKind, ModelSpec};
use stepgraph_core::pipeline::{compile_step, StepOptions};
use stepgraph_core::plan::MemoryPlan;
use stepgraph_core::session::Session;
use stepgraph_cuda::session::{gpu_available, CudaOptions, CudaSession};

/// The default tolerance on `rel` when the step and the reference are f32.
pub const F32_TOLERANCE: f64 = 1e-4;
/// The default tolerance on `rel` when the step or the reference is bf16 or f16.
pub const HALF_TOLERANCE: f64 = 2e-2;

/// The loss the reference computed; it is not recorded in the reference
/// folder, so it must be named.
#[derive(Copy, Clone, PartialEq, Eq, Debug, clap::ValueEnum)]
pub enum CompareLoss {
    /// `logits.sum()`.
    Sum,
    /// Hugging Face's `labels=input_ids`: mean cross-entropy of each token's
    /// logits against the next token.
    Ce,
}

/// The dtype stepgraph runs the step in.
#[derive(Copy, Clone, PartialEq, Eq, Debug, clap::ValueEnum)]
pub enum CompareDType {
    F32,
    Bf16,
    F16,
}

/// The backend that runs stepgraph's step.
#[derive(Copy, Clone, PartialEq, Eq, Debug, clap::ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    /// The CPU reference backend.
    Cpu,
    /// The CUDA backend on GPU 0 (eager launches).
    Cuda,
}

/// Flags of `stepgraph compare`.
#[derive(clap::Args, Clone, Debug)]
pub struct CompareArgs {
    /// The folder `torch_reference.py --save DIR` wrote (config.json,
    /// weights.safetensors, io.safetensors, grads.safetensors).
    #[arg(long)]
    pub reference: PathBuf,
    /// The loss the reference computed: `sum` (logits.sum()) or `ce`
    /// (labels=input_ids).
    #[arg(long, value_enum)]
    pub loss: CompareLoss,
    /// The dtype to run stepgraph's step in (default: the dtype of the
    /// reference's weights); weights of another dtype are converted.
    #[arg(long, value_enum)]
    pub dtype: Option<CompareDType>,
    /// The backend to run the step on (default: cuda when a GPU is present,
    /// else cpu).
    #[arg(long, value_enum)]
    pub backend: Option<Backend>,
    /// The largest relative error ‖a − b‖₂ / ‖b‖₂ a tensor (the loss or a
    /// gradient) may have (default: 1e-4 for f32, 2e-2 when the step or the
    /// reference is bf16 or f16).
    #[arg(long = "tol", visible_alias = "tolerance")]
    pub tol: Option<f64>,
    /// Print the report as JSON instead of text.
    #[arg(long)]
    pub json: bool,
    /// Also write the report as JSON to this file.
    #[arg(long, value_name = "PATH")]
    pub json_out: Option<PathBuf>,
}

/// `a` against `b`, one tensor's worth. See the module doc for the metric.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Diff {
    /// ‖a − b‖₂ / ‖b‖₂: 0 when both are zero, infinite when only `b` is,
    /// NaN when a difference is.
    pub rel: f64,
    /// max |a − b| / max |b|, with the same conventions.
    pub rel_max: f64,
    /// ‖b‖₂.
    pub ref_norm: f64,
    /// ‖a‖₂.
    pub norm: f64,
    /// max |a − b| (NaN when a difference is).
    pub max_abs_diff: f64,
    /// max |b|.
    pub ref_max_abs: f64,
}

/// Compares `a` (stepgraph's) with `b` (the reference's), element by element, in f64.
pub fn diff(a: &[f64], b: &[f64]) -> Diff {
    assert_eq!(a.len(), b.len(), "diff of tensors of different sizes");
    let (mut diff_sq, mut ref_sq, mut our_sq) = (0.0f64, 0.0f64, 0.0f64);
    let (mut max_abs_diff, mut ref_max_abs) = (0.0f64, 0.0f64);
    for (&x, &y) in a.iter().zip(b) {
        let d = x - y;
        diff_sq += d * d;
        ref_sq += y * y;
        our_sq += x * x;
        // `f64::max` would drop a NaN; keep it.
        if d.is_nan() || d.abs() > max_abs_diff {
            max_abs_diff = d.abs();
        }
        if y.is_nan() || y.abs() > ref_max_abs {
            ref_max_abs = y.abs();
        }
    }
    let ratio = |num: f64, den: f64| {
        if num.is_nan() || den.is_nan() {
            f64::NAN
        } else if den > 0.0 {
            num / den
        } else if num == 0.0 {
            0.0
        } else {
            f64::INFINITY
        }
    };
    let ref_norm = ref_sq.sqrt();
    Diff {
        rel: ratio(diff_sq.sqrt(), ref_norm),
        rel_max: ratio(max_abs_diff, ref_max_abs),
        ref_norm,
        norm: our_sq.sqrt(),
        max_abs_diff,
        ref_max_abs,
    }
}

/// Does an error pass the tolerance? NaN and infinity never do.
fn within(err: f64, tol: f64) -> bool {
    err.is_finite() && err <= tol
}

/// One tensor of the report: the loss or a parameter's gradient.
#[derive(Clone, Debug, Serialize)]
pub struct TensorRow {
    pub name: String,
    pub shape: Vec<usize>,
    #[serde(flatten)]
    pub diff: Diff,
    /// `rel` within the tolerance.
    pub pass: bool,
}

/// The loss of both sides.
#[derive(Clone, Debug, Serialize)]
pub struct LossRow {
    pub stepgraph: f64,
    pub reference: f64,
    #[serde(flatten)]
    pub diff: Diff,
    pub pass: bool,
}

/// Everything `stepgraph compare` found.
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    pub reference: String,
    pub model: String,
    pub backend: Backend,
    /// The device that ran the step, in words.
    pub device: String,
    pub dtype: String,
    pub loss_kind: String,
    pub batch: usize,
    pub seq: usize,
    pub step_seconds: f64,
    /// How `rel` and `rel_max` are defined.
    pub metric: &'static str,
    pub tolerance: f64,
    pub loss: LossRow,
    /// The worst `rel` over the gradients (0 with no parameters).
    pub max_grad_rel: f64,
    /// The gradient with that `rel`.
    pub worst: Option<String>,
    /// Every gradient, worst `rel` first (NaN counts as the worst of all).
    pub grads: Vec<TensorRow>,
    /// Reference gradients with no parameter of that name here.
    pub unmatched_reference_grads: Vec<String>,
    /// The loss and every gradient within the tolerance.
    pub pass: bool,
}

const METRIC: &str = "per tensor, a = stepgraph, b = reference, in f64: rel = |a - b|_2 / |b|_2 (the verdict: pass \
                      when rel <= tolerance), rel_max = max|a - b| / max|b|";

/// The backend to use: the one asked for, else CUDA when `gpu_present()`
/// says a GPU is there and the CPU otherwise. Asking for CUDA without a GPU
/// is an error, found before anything is loaded.
fn resolve_backend(asked: Option<Backend>, gpu_present: impl FnOnce() -> bool) -> Result<Backend> {
    match asked {
        Some(Backend::Cpu) => Ok(Backend::Cpu),
        Some(Backend::Cuda) => {
            if !gpu_present() {
                bail!(
                    "--backend cuda needs an NVIDIA GPU, and this machine has none (no driver library or no \
                     device); use --backend cpu"
                );
            }
            Ok(Backend::Cuda)
        }
        None => Ok(if gpu_present() { Backend::Cuda } else { Backend::Cpu }),
    }
}

/// Binds the planned step to a session of `backend`.
fn open_session(backend: Backend, step: Trace, memory: MemoryPlan) -> Result<Box<dyn Session>> {
    Ok(match backend {
        Backend::Cpu => Box::new(CpuSession::new(step, memory)?),
        Backend::Cuda => Box::new(
            CudaSession::new(step, memory, CudaOptions::default()).context("opening the CUDA session on GPU 0")?,
        ),
    })
}

/// The default tolerance for a step in `run` against a reference whose
/// weights are `reference` (its float dtypes): the f32 one only when
/// neither side has a 16-bit float.
fn default_tolerance(run: DType, reference: &[DType]) -> f64 {
    let half = std::iter::once(&run).chain(reference).any(|d| d.is_float() && d.size() < 4);
    if half {
        HALF_TOLERANCE
    } else {
        F32_TOLERANCE
    }
}

/// Runs `stepgraph compare`: prints the report, then fails if the loss or
/// any gradient is outside the tolerance.
pub fn run(args: &CompareArgs) -> Result<()> {
    let backend = resolve_backend(args.backend, gpu_available)?;
    let report = compare(args, backend)?;
    if let Some(path) = &args.json_out {
        std::fs::write(path, serde_json::to_string_pretty(&report)? + "\n")
            .with_context(|| format!("writing the JSON report to {}", path.display()))?;
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print_text(&report);
    }
    if !report.pass {
        bail!("{}", failure_summary(&report));
    }
    Ok(())
}

/// Runs the step on `backend` and compares it with the reference in `args.reference`.
fn compare(args: &CompareArgs, backend: Backend) -> Result<Report> {
    let dir = &args.reference;
    let config_path = dir.join("config.json");
    let config = Config::from_hf_file(&config_path)
        .with_context(|| format!("reading the reference's model config {}", config_path.display()))?;
    let mut io = read_file(dir, "io.safetensors", "the reference's input and loss")?;
    let ids = io
        .remove("input_ids")
        .with_context(|| format!("{} has no `input_ids`", dir.join("io.safetensors").display()))?;
    let ref_loss =
        io.remove("loss").with_context(|| format!("{} has no `loss`", dir.join("io.safetensors").display()))?;
    if ref_loss.ty.numel() != 1 {
        bail!("the reference's `loss` must hold one number, got {}", ref_loss.ty);
    }
    let ref_loss = ref_loss.to_f64()[0];
    if ids.ty.rank() != 2 {
        bail!("the reference's `input_ids` must be [batch, seq], got {}", ids.ty);
    }
    let (batch, seq) = (ids.ty.shape[0], ids.ty.shape[1]);

    let weights_path = dir.join("weights.safetensors");
    let weights = read_safetensors(&weights_path)
        .with_context(|| format!("reading the reference's weights {}", weights_path.display()))?;
    let reference_dtypes = float_dtypes(&weights);
    let dtype = match args.dtype {
        Some(CompareDType::F32) => DType::F32,
        Some(CompareDType::Bf16) => DType::BF16,
        Some(CompareDType::F16) => DType::F16,
        None => weights_dtype(&reference_dtypes, &weights_path)?,
    };
    let tolerance = args.tol.unwrap_or_else(|| default_tolerance(dtype, &reference_dtypes));
    if tolerance.is_nan() || tolerance < 0.0 {
        bail!("--tol must be a number of at least 0, got {tolerance}");
    }
    let loss = match args.loss {
        CompareLoss::Sum => LossKind::Sum,
        CompareLoss::Ce => LossKind::CrossEntropy,
    };
    let spec = ModelSpec { config, batch, seq, dtype, loss };
    let compiled = compile_step(&spec, &StepOptions::new(StepKind::Grads))?;
    let (step, memory) = (compiled.step, compiled.plan);

    // Checked against the whole trace before the session allocates anything;
    // the raw weights go before the session's buffers arrive.
    let params = load_params(&step, &weights, true)
        .with_context(|| format!("loading {} into `{}`", weights_path.display(), spec.config.name))?;
    drop(weights);
    let mut session = open_session(backend, step, memory)?;
    for (param, value) in params {
        session.write(param, &value)?;
    }
    for (name, value) in reference_batch(&ids, loss)? {
        session.write_named(name, &value).with_context(|| format!("writing the reference's `{name}`"))?;
    }
    let t0 = Instant::now();
    session.run_eager()?;
    let step_seconds = t0.elapsed().as_secs_f64();
    let our_loss = session.loss()?;
    let loss_diff = diff(&[our_loss], &[ref_loss]);
    let loss_row =
        LossRow { stepgraph: our_loss, reference: ref_loss, pass: within(loss_diff.rel, tolerance), diff: loss_diff };

    let mut ref_grads = read_file(dir, "grads.safetensors", "the reference's gradients")?;
    let trace_params: Vec<_> = session.trace().params().collect();
    let mut rows = Vec::with_capacity(trace_params.len());
    let mut missing = Vec::new();
    for param in trace_params {
        let name = session.trace().value(param).kind.leaf_name().unwrap_or_default().to_string();
        let grad = session.trace().grad_of(param).with_context(|| format!("the step has no gradient of `{name}`"))?;
        // Removed as used, so each reference gradient is freed once compared.
        let Some(reference) = ref_grads.remove(&name) else {
            missing.push(name);
            continue;
        };
        let ours = session.read(grad).with_context(|| format!("reading the gradient of `{name}`"))?;
        if reference.ty.shape != ours.ty.shape {
            bail!(
                "the reference's gradient of `{name}` has shape {:?}, stepgraph's has {:?}",
                reference.ty.shape,
                ours.ty.shape
            );
        }
        let d = diff(&ours.to_f64(), &reference.to_f64());
        rows.push(TensorRow { name, shape: ours.ty.shape.clone(), pass: within(d.rel, tolerance), diff: d });
    }
    if !missing.is_empty() {
        bail!(
            "{} has no gradient for {} of the model's parameters: {}",
            dir.join("grads.safetensors").display(),
            missing.len(),
            missing.iter().take(5).map(|n| format!("`{n}`")).collect::<Vec<_>>().join(", ")
        );
    }
    let mut unmatched: Vec<String> = ref_grads.into_keys().collect();
    unmatched.sort();
    // Worst first; NaN counts as the worst of all.
    rows.sort_by(|a, b| sort_key(b.diff.rel).total_cmp(&sort_key(a.diff.rel)).then_with(|| a.name.cmp(&b.name)));
    let pass = loss_row.pass && rows.iter().all(|r| r.pass);
    Ok(Report {
        reference: dir.display().to_string(),
        model: spec.config.name.clone(),
        backend,
        device: session.device(),
        dtype: dtype.name().to_string(),
        loss_kind: match args.loss {
            CompareLoss::Sum => "sum",
            CompareLoss::Ce => "ce",
        }
        .to_string(),
        batch,
        seq,
        step_seconds,
        metric: METRIC,
        tolerance,
        loss: loss_row,
        max_grad_rel: rows.first().map_or(0.0, |r| r.diff.rel),
        worst: rows.first().map(|r| r.name.clone()),
        grads: rows,
        unmatched_reference_grads: unmatched,
        pass,
    })
}

fn verdict(pass: bool) -> &'static str {
    if pass {
        "ok"
    } else {
        "FAIL"
    }
}

/// The report as text: a header, the metric, the loss, one line per
/// gradient (worst first) and the verdict.
fn print_text(r: &Report) {
    println!(
        "compare {}: `{}` in {}, loss {}, batch {} x {} tokens, step {:.2} s, {} backend on {}",
        r.reference,
        r.model,
        r.dtype,
        r.loss_kind,
        r.batch,
        r.seq,
        r.step_seconds,
        r.backend_name(),
        r.device
    );
    println!("metric: {METRIC}; tolerance {:e}", r.tolerance);
    println!(
        "loss: stepgraph {:.9e}, reference {:.9e}, rel {:.3e}  {}",
        r.loss.stepgraph,
        r.loss.reference,
        r.loss.diff.rel,
        verdict(r.loss.pass)
    );
    println!("gradients, worst rel first:");
    let shape_width = r.grads.iter().map(|g| format!("{:?}", g.shape).len()).max().unwrap_or(5).max(5);
    println!(
        "  {:>10}  {:>10}  {:>10}  {:>10}  {:<shape_width$}  {:<4}  name",
        "rel", "rel_max", "|b|_2", "max|a-b|", "shape", ""
    );
    for g in &r.grads {
        println!(
            "  {:>10.3e}  {:>10.3e}  {:>10.3e}  {:>10.3e}  {:<shape_width$}  {:<4}  {}",
            g.diff.rel,
            g.diff.rel_max,
            g.diff.ref_norm,
            g.diff.max_abs_diff,
            format!("{:?}", g.shape),
            verdict(g.pass),
            g.name
        );
    }
    if !r.unmatched_reference_grads.is_empty() {
        println!("reference gradients with no parameter here: {}", r.unmatched_reference_grads.join(", "));
    }
    match &r.worst {
        Some(name) => println!("max gradient rel {:.3e} ({name})", r.max_grad_rel),
        None => println!("the model has no parameters"),
    }
    let passed = r.grads.iter().filter(|g| g.pass).count();
    println!(
        "{}: loss {}, {passed} of {} gradients ok (rel <= {:e})",
        if r.pass { "PASS" } else { "FAIL" },
        verdict(r.loss.pass),
        r.grads.len(),
        r.tolerance
    );
}

impl Report {
    fn backend_name(&self) -> &'static str {
        match self.backend {
            Backend::Cpu => "cpu",
            Backend::Cuda => "cuda",
        }
    }
}

/// Why a report failed, in one line: the loss, and how many gradients
/// failed with the worst of them.
fn failure_summary(r: &Report) -> String {
    let mut failures = Vec::new();
    if !r.loss.pass {
        failures.push(format!("the loss's rel is {:.3e}", r.loss.diff.rel));
    }
    let bad: Vec<&TensorRow> = r.grads.iter().filter(|g| !g.pass).collect();
    if let Some(first) = bad.first() {
        failures.push(format!(
            "{} of {} gradients fail, worst `{}` at rel {:.3e}",
            bad.len(),
            r.grads.len(),
            first.name,
            first.diff.rel
        ));
    }
    format!("above the tolerance {:e} on {}: {}", r.tolerance, r.device, failures.join("; "))
}

/// Every tensor of `dir/file`, by name.
fn read_file(dir: &Path, file: &str, what: &str) -> Result<HashMap<String, HostTensor>> {
    let path = dir.join(file);
    let tensors = read_safetensors(&path).with_context(|| format!("reading {what} {}", path.display()))?;
    Ok(tensors.into_iter().collect())
}

/// The distinct float dtypes of a checkpoint's tensors, in order of appearance.
fn float_dtypes(weights: &[(String, HostTensor)]) -> Vec<DType> {
    let mut dtypes: Vec<DType> = Vec::new();
    for (_, tensor) in weights {
        if tensor.ty.dtype.is_float() && !dtypes.contains(&tensor.ty.dtype) {
            dtypes.push(tensor.ty.dtype);
        }
    }
    dtypes
}

/// The one float dtype of a checkpoint (`dtypes` from [`float_dtypes`]).
fn weights_dtype(dtypes: &[DType], path: &Path) -> Result<DType> {
    match dtypes {
        [one] => Ok(*one),
        [] => bail!("{} holds no float tensors", path.display()),
        many => bail!(
            "{} mixes float dtypes ({}); choose one with --dtype",
            path.display(),
            many.iter().map(|d| d.name()).collect::<Vec<_>>().join(", ")
        ),
    }
}

/// The error as a sort key: NaN sorts above everything.
fn sort_key(x: f64) -> f64 {
    if x.is_nan() {
        f64::INFINITY
    } else {
        x
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;
    use stepgraph_core::ir::TensorType;
    use stepgraph_core::ir::ValueId;
    use stepgraph_core::models::checkpoint::{name_params, write_safetensors_atomic};
    use stepgraph_core::models::init_params;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: CompareArgs,
    }

    fn parse(args: &[&str]) -> std::result::Result<CompareArgs, clap::Error> {
        Cli::try_parse_from(std::iter::once("compare").chain(args.iter().copied())).map(|c| c.args)
    }

    #[test]
    fn diff_of_equal_tensors_is_zero() {
        let d = diff(&[1.0, -2.0, 3.0], &[1.0, -2.0, 3.0]);
        assert_eq!((d.rel, d.rel_max, d.max_abs_diff), (0.0, 0.0, 0.0));
        assert_eq!(d.ref_max_abs, 3.0);
        assert!((d.ref_norm - 14f64.sqrt()).abs() < 1e-15 && d.norm == d.ref_norm);
    }

    #[test]
    fn diff_is_the_l2_and_the_max_relative_error() {
        // a − b = [0, 0.3, −0.4]: ‖a − b‖ = 0.5, ‖b‖ = 5, max|a − b| = 0.4, max|b| = 4.
        let d = diff(&[0.0, 3.3, 3.6], &[0.0, 3.0, 4.0]);
        assert!((d.rel - 0.1).abs() < 1e-12, "{d:?}");
        assert!((d.rel_max - 0.1).abs() < 1e-12, "{d:?}");
        assert!((d.max_abs_diff - 0.4).abs() < 1e-12 && d.ref_max_abs == 4.0 && d.ref_norm == 5.0);
        // One large error among many small values: rel_max sees it relative to the largest |b|.
        let d = diff(&[1.0, 0.0, 0.0, 0.5], &[1.0, 0.0, 0.0, 0.0]);
        assert_eq!((d.rel, d.rel_max), (0.5, 0.5));
    }

    #[test]
    fn diff_against_zero_and_nan() {
        assert_eq!(diff(&[0.0, 0.0], &[0.0, 0.0]).rel, 0.0);
        let d = diff(&[1e-30, 0.0], &[0.0, 0.0]);
        assert_eq!((d.rel, d.rel_max), (f64::INFINITY, f64::INFINITY));
        let d = diff(&[f64::NAN, 1.0], &[1.0, 1.0]);
        assert!(d.rel.is_nan() && d.rel_max.is_nan() && d.max_abs_diff.is_nan());
        let d = diff(&[1.0], &[f64::NAN]);
        assert!(d.rel.is_nan() && d.rel_max.is_nan());
        assert!(!within(f64::NAN, 1.0) && !within(f64::INFINITY, 1.0) && within(1.0, 1.0) && !within(1.5, 1.0));
    }

    #[test]
    fn default_tolerance_follows_the_narrowest_float() {
        assert_eq!(default_tolerance(DType::F32, &[DType::F32]), F32_TOLERANCE);
        assert_eq!(default_tolerance(DType::BF16, &[DType::BF16]), HALF_TOLERANCE);
        assert_eq!(default_tolerance(DType::F32, &[DType::BF16]), HALF_TOLERANCE);
        assert_eq!(default_tolerance(DType::F16, &[DType::F32]), HALF_TOLERANCE);
        assert_eq!(default_tolerance(DType::F32, &[]), F32_TOLERANCE);
    }

    #[test]
    fn backend_defaults_to_cuda_only_with_a_gpu() {
        assert_eq!(resolve_backend(None, || true).unwrap(), Backend::Cuda);
        assert_eq!(resolve_backend(None, || false).unwrap(), Backend::Cpu);
        assert_eq!(resolve_backend(Some(Backend::Cuda), || true).unwrap(), Backend::Cuda);
        // Asking for the CPU does not even probe for a GPU.
        assert_eq!(resolve_backend(Some(Backend::Cpu), || panic!("probed")).unwrap(), Backend::Cpu);
        let err = resolve_backend(Some(Backend::Cuda), || false).unwrap_err().to_string();
        assert!(err.contains("--backend cuda needs an NVIDIA GPU") && err.contains("--backend cpu"), "{err}");
    }

    #[test]
    fn arguments_parse_with_their_defaults_and_aliases() {
        let a = parse(&["--reference", "r", "--loss", "sum"]).unwrap();
        assert_eq!((a.backend, a.tol, a.dtype, a.json, a.json_out), (None, None, None, false, None));
        let a = parse(&["--reference", "r", "--loss", "ce", "--backend", "cuda", "--tol", "3e-2", "--dtype", "bf16"])
            .unwrap();
        assert_eq!(
            (a.loss, a.backend, a.tol, a.dtype),
            (CompareLoss::Ce, Some(Backend::Cuda), Some(3e-2), Some(CompareDType::Bf16))
        );
        let a = parse(&["--reference", "r", "--loss", "sum", "--tolerance", "1e-5", "--json", "--json-out", "o.json"])
            .unwrap();
        assert_eq!((a.tol, a.json, a.json_out), (Some(1e-5), true, Some(PathBuf::from("o.json"))));
        assert!(parse(&["--reference", "r", "--loss", "sum", "--backend", "tpu"]).is_err());
        assert!(parse(&["--reference", "r"]).is_err(), "--loss is required");
    }

    /// A fresh, empty directory for one test.
    fn temp_dir(test: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("stepgraph-compare-{}-{test}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    /// A reference folder as `torch_reference.py --save` writes it, for a
    /// tiny Llama, made by stepgraph's own CPU step: the comparison of the
    /// CPU backend against it must be exact.
    fn write_reference(dir: &Path, loss: LossKind) {
        let config = r#"{
            "model_type": "llama", "vocab_size": 64, "hidden_size": 16, "intermediate_size": 24,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 32, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
            "tie_word_embeddings": false, "attention_bias": false, "mlp_bias": false, "hidden_act": "silu"
        }"#;
        std::fs::write(dir.join("config.json"), config).unwrap();
        let spec = ModelSpec {
            config: Config::from_hf_json(config, "tiny").unwrap(),
            batch: 2,
            seq: 5,
            dtype: DType::F32,
            loss,
        };
        let c = compile_step(&spec, &StepOptions::new(StepKind::Grads)).unwrap();
        let weights = name_params(&c.forward, init_params(&c.forward, 3)).unwrap();
        write_safetensors_atomic(&dir.join("weights.safetensors"), &weights).unwrap();
        let ids: Vec<f64> = (0..10).map(|i| ((i * 37 + 11) % 64) as f64).collect();
        let ids = HostTensor::from_f64(TensorType::new(DType::I64, [2, 5]), &ids);

        let mut s = CpuSession::new(c.step, c.plan).unwrap();
        for (name, value) in &weights {
            s.write_named(name, value).unwrap();
        }
        for (name, value) in reference_batch(&ids, loss).unwrap() {
            s.write_named(name, &value).unwrap();
        }
        s.run_eager().unwrap();
        let loss = HostTensor::from_f64(TensorType::new(DType::F32, [1]), &[s.loss().unwrap()]);
        write_safetensors_atomic(&dir.join("io.safetensors"), &[("input_ids".into(), ids), ("loss".into(), loss)])
            .unwrap();
        let params: Vec<ValueId> = s.trace().params().collect();
        let grads: Vec<(String, HostTensor)> = params
            .into_iter()
            .map(|p| {
                let name = s.trace().value(p).kind.leaf_name().unwrap().to_string();
                let g = s.trace().grad_of(p).unwrap();
                (name, s.read(g))
            })
            .collect();
        write_safetensors_atomic(&dir.join("grads.safetensors"), &grads).unwrap();
    }

    fn args(dir: &Path, loss: CompareLoss) -> CompareArgs {
        CompareArgs {
            reference: dir.to_path_buf(),
            loss,
            dtype: None,
            backend: Some(Backend::Cpu),
            tol: None,
            json: false,
            json_out: None,
        }
    }

    #[test]
    fn the_cpu_backend_matches_a_reference_it_made() {
        for (loss, kind, test) in
            [(LossKind::Sum, CompareLoss::Sum, "sum"), (LossKind::CrossEntropy, CompareLoss::Ce, "ce")]
        {
            let dir = temp_dir(test);
            write_reference(&dir, loss);
            let report = compare(&args(&dir, kind), Backend::Cpu).unwrap();
            assert!(report.pass, "{report:?}");
            assert_eq!(report.tolerance, F32_TOLERANCE);
            assert_eq!(report.loss.diff.rel, 0.0);
            assert_eq!(report.grads.len(), 2 * 9 + 3, "every parameter of 2 layers, the embedding, norm and head");
            assert!(report.grads.iter().all(|g| g.diff.rel == 0.0 && g.diff.ref_norm > 0.0), "{report:?}");
            assert!(report.unmatched_reference_grads.is_empty());
            let json = serde_json::to_value(&report).unwrap();
            assert_eq!(json["backend"], "cpu");
            assert_eq!(json["grads"][0]["rel"], 0.0);
            assert!(json["grads"][0]["rel_max"].is_number() && json["loss"]["pass"] == true);
            std::fs::remove_dir_all(&dir).unwrap();
        }
    }

    #[test]
    fn a_wrong_gradient_fails_and_is_named() {
        let dir = temp_dir("wrong");
        write_reference(&dir, LossKind::Sum);
        let path = dir.join("grads.safetensors");
        let mut grads = read_safetensors(&path).unwrap();
        let (name, g) = grads.iter_mut().find(|(n, _)| n == "model.layers.1.mlp.up_proj.weight").unwrap();
        let scaled: Vec<f64> = g.to_f64().iter().map(|x| x * 1.01).collect();
        *g = HostTensor::from_f64(g.ty.clone(), &scaled);
        let name = name.clone();
        write_safetensors_atomic(&path, &grads).unwrap();

        // 1% off: above the f32 default, within a looser --tol.
        let report = compare(&args(&dir, CompareLoss::Sum), Backend::Cpu).unwrap();
        assert!(!report.pass && report.loss.pass);
        assert_eq!(report.worst.as_deref(), Some(name.as_str()));
        assert!((report.max_grad_rel - 0.01 / 1.01).abs() < 1e-6, "{}", report.max_grad_rel);
        assert_eq!(report.grads.iter().filter(|g| !g.pass).count(), 1);
        let summary = failure_summary(&report);
        assert!(summary.contains("1 of 21 gradients fail") && summary.contains(&name), "{summary}");
        let loose = CompareArgs { tol: Some(2e-2), ..args(&dir, CompareLoss::Sum) };
        assert!(compare(&loose, Backend::Cpu).unwrap().pass);
        // And `run` turns the failure into an error (the exit status).
        assert!(run(&args(&dir, CompareLoss::Sum)).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_missing_reference_is_a_clear_error() {
        let dir = temp_dir("missing");
        let err = format!("{:#}", compare(&args(&dir, CompareLoss::Sum), Backend::Cpu).unwrap_err());
        assert!(err.contains("reading the reference's model config") && err.contains("config.json"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
