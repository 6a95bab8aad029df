//! `stepgraph compare`: one `grads` step of stepgraph against a PyTorch
//! reference on identical weights and tokens, on the CPU or the CUDA
//! backend.
//!
//! The reference is the folder `scripts/torch_reference.py --save DIR`
//! writes: `config.json` (the Hugging Face config), `weights.safetensors`
//! (the state dict), `io.safetensors` (`input_ids` [B, T] and the first
//! step's `loss` \[1\]) and `grads.safetensors` (every parameter's gradient of
//! that step, Hugging Face names). The model is built from `config.json`, the
//! batch shape from `input_ids`. Weights and gradients are read under the
//! trace's names by the same table `train --init-from` reads
//! ([`from_hf_tensors`]): Llama-style names as they are, GPT-NeoX's
//! `gpt_neox.*` renamed and its fused `query_key_value` split into q, k and
//! v, whose gradients are then compared (and reported) one by one. The step is compiled once
//! ([`compile_step`]) and then bound to a backend session (a `dyn Session`:
//! the CPU reference backend or a `CudaSession` on GPU 0); everything else — loading, running, reading back
//! and the comparison itself — is the same code for both.
//!
//! The metric, per tensor (the loss counts as a tensor of one element), with
//! `a` stepgraph's values and `b` the reference's, computed in f64:
//! - `rel` = ‖a − b‖₂ / ‖b‖₂, the primary metric, which the verdict uses;
//! - `rel_max` = max |a − b| / max |b|, reported next to it.
//!
//! Every input is checked before the step runs, so a bad reference costs no
//! step: `--tol` (a finite number above 0), the `--json-out` path (it can be
//! written), every reference tensor (finite; the gradients float, one per
//! parameter of the model's shape and none besides). Once the step has run
//! the report is printed even if `--json-out` then cannot be written.
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
use stepgraph_core::host::HostTensor;
use stepgraph_core::ir::{DType, Trace, ValueId};
use stepgraph_core::models::checkpoint::{load_params, read_safetensors, reference_batch};
use stepgraph_core::models::hf_dir::{from_hf_tensors, HfFamily};
use stepgraph_core::models::{Config, LossKind, ModelSpec};
use stepgraph_core::pipeline::{compile_step, StepOptions};
use stepgraph_core::plan::MemoryPlan;
use stepgraph_core::session::Session;
use stepgraph_cuda::session::gpu_available;
pub use stepgraph_train::Backend;
use stepgraph_train::SessionOptions;

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
    /// Where to run the step (default: cuda when a GPU is present, else
    /// cpu); `--backend` is the same flag under its older name.
    #[arg(long = "device", alias = "backend", value_enum)]
    pub backend: Option<Backend>,
    /// The largest relative error ‖a − b‖₂ / ‖b‖₂ a tensor (the loss or a
    /// gradient) may have: a finite number above 0 (default: 1e-4 for f32,
    /// 2e-2 when the step or the reference is bf16 or f16).
    #[arg(long = "tol", visible_alias = "tolerance", value_parser = parse_tolerance, allow_hyphen_values = true)]
    pub tol: Option<f64>,
    /// Print the report as JSON instead of text.
    #[arg(long)]
    pub json: bool,
    /// Also write the report as JSON to this file.
    #[arg(long, value_name = "PATH")]
    pub json_out: Option<PathBuf>,
    /// Fold adds into the kernels that produce their operands (on, as
    /// every other command) or keep each add a kernel (off).
    #[arg(long, value_enum, default_value_t = crate::memory_args::EpilogueArg::On)]
    pub epilogues: crate::memory_args::EpilogueArg,
    /// How f32 products are computed, as every other command: exactly, or
    /// as 3xTF32 (three TF32 products of split operands), whose gradients
    /// this command checks against an f64 reference.
    #[arg(long, value_enum, default_value_t = crate::memory_args::F32ProductsArg::Exact)]
    pub f32_products: crate::memory_args::F32ProductsArg,
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
                    "--device cuda needs an NVIDIA GPU, and this machine has none (no driver library or no \
                     device); use --device cpu"
                );
            }
            Ok(Backend::Cuda)
        }
        None => Ok(if gpu_present() { Backend::Cuda } else { Backend::Cpu }),
    }
}

/// Binds the planned step to a session of `backend` on GPU 0 (eager launches) or the CPU.
fn open_session(backend: Backend, step: Trace, memory: MemoryPlan) -> Result<Box<dyn Session>> {
    Ok(stepgraph_train::open_session(backend, step, memory, SessionOptions::default())?.session)
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
    run_with(args, backend, &mut std::io::stdout().lock(), open_session)
}

/// [`run`] with the report written to `out` and the session opened by
/// `open`, so tests can see what is printed and when the step would run.
///
/// Everything that can be checked without the step is checked before
/// `open` is called: the `--json-out` path, `--tol` and every file of the
/// reference. Once the step has run its report is always printed, even when
/// `--json-out` then cannot be written.
fn run_with(
    args: &CompareArgs,
    backend: Backend,
    out: &mut dyn std::io::Write,
    open: impl FnOnce(Backend, Trace, MemoryPlan) -> Result<Box<dyn Session>>,
) -> Result<()> {
    if let Some(path) = &args.json_out {
        check_writable(path)?;
    }
    let report = compare(args, backend, open)?;
    let json = serde_json::to_string_pretty(&report)? + "\n";
    let printed = if args.json { json.clone() } else { render_text(&report) };
    out.write_all(printed.as_bytes()).and_then(|()| out.flush()).context("printing the report")?;
    let saved = match &args.json_out {
        Some(path) => std::fs::write(path, &json).with_context(|| {
            format!("writing the JSON report to --json-out {} (the report is printed above)", path.display())
        }),
        None => Ok(()),
    };
    match (saved, report.pass) {
        (Ok(()), true) => Ok(()),
        (Ok(()), false) => bail!("{}", failure_summary(&report)),
        (Err(e), true) => Err(e),
        (Err(e), false) => Err(e.context(failure_summary(&report))),
    }
}

/// Finds a `--json-out` path that cannot be written before any work is
/// done: a folder, a missing folder, or a file that cannot be opened for
/// writing. A file that is there is not changed; one that is not is
/// created to prove it can be, then removed again.
fn check_writable(path: &Path) -> Result<()> {
    let fix = "give the path of a file in an existing, writable folder";
    if path.is_dir() {
        bail!("--json-out {} is a folder; {fix}", path.display());
    }
    let existed = path.exists();
    std::fs::OpenOptions::new()
        .append(true)
        .create(true)
        .open(path)
        .with_context(|| format!("--json-out {} cannot be written; {fix}", path.display()))?;
    if !existed {
        std::fs::remove_file(path).with_context(|| format!("removing the probe of --json-out {}", path.display()))?;
    }
    Ok(())
}

/// `--tol`'s parser: a finite number above 0.
fn parse_tolerance(text: &str) -> std::result::Result<f64, String> {
    let value: f64 = text.trim().parse().map_err(|_| format!("`{text}` is not a number; {TOL_ACCEPTS}"))?;
    check_tolerance(value).map_err(|e| e.to_string())
}

const TOL_ACCEPTS: &str = "the tolerance must be a finite number above 0, e.g. 1e-4 or 2e-2";

fn check_tolerance(tol: f64) -> Result<f64> {
    if !(tol.is_finite() && tol > 0.0) {
        bail!("--tol {tol} is out of range; {TOL_ACCEPTS}");
    }
    Ok(tol)
}

/// Runs the step on the session `open` gives and compares it with the
/// reference in `args.reference`. Every input is read and checked before
/// `open` is called, so a bad reference costs no step.
fn compare(
    args: &CompareArgs,
    backend: Backend,
    open: impl FnOnce(Backend, Trace, MemoryPlan) -> Result<Box<dyn Session>>,
) -> Result<Report> {
    if let Some(tol) = args.tol {
        check_tolerance(tol)?;
    }
    let dir = &args.reference;
    let config_path = dir.join("config.json");
    // The error names the file.
    let config = Config::from_hf_file(&config_path).context("reading the reference's model config")?;
    let family = family_of(&config_path)?;
    let io_path = dir.join("io.safetensors");
    let mut io = read_file(dir, "io.safetensors", "the reference's input and loss")?;
    let ids = io.remove("input_ids").with_context(|| format!("{} has no `input_ids`", io_path.display()))?;
    let ref_loss = io.remove("loss").with_context(|| format!("{} has no `loss`", io_path.display()))?;
    if ref_loss.ty.numel() != 1 {
        bail!("the reference's `loss` in {} must hold one number, got {}", io_path.display(), ref_loss.ty);
    }
    let ref_loss = ref_loss.to_f64()[0];
    if !ref_loss.is_finite() {
        bail!("the reference's `loss` in {} is {ref_loss}; a finite loss is needed to compare", io_path.display());
    }
    if ids.ty.rank() != 2 {
        bail!("the reference's `input_ids` in {} must be [batch, seq], got {}", io_path.display(), ids.ty);
    }
    let (batch, seq) = (ids.ty.shape[0], ids.ty.shape[1]);

    let weights_path = dir.join("weights.safetensors");
    let weights = read_safetensors(&weights_path)
        .with_context(|| format!("reading the reference's weights {}", weights_path.display()))?;
    for (name, tensor) in &weights {
        check_finite(&weights_path, name, tensor)?;
    }
    let weights = from_hf_tensors(family, &config, weights)
        .with_context(|| format!("reading the reference's weights {}", weights_path.display()))?;
    let reference_dtypes = float_dtypes(&weights);
    let dtype = match args.dtype {
        Some(CompareDType::F32) => DType::F32,
        Some(CompareDType::Bf16) => DType::BF16,
        Some(CompareDType::F16) => DType::F16,
        None => weights_dtype(&reference_dtypes, &weights_path)?,
    };
    let tolerance = args.tol.unwrap_or_else(|| default_tolerance(dtype, &reference_dtypes));
    let loss = match args.loss {
        CompareLoss::Sum => LossKind::Sum,
        CompareLoss::Ce => LossKind::CrossEntropy,
    };
    let spec = ModelSpec { config, batch, seq, dtype, loss, adapters: None, documents: false };
    let opts = StepOptions {
        epilogues: args.epilogues.into(),
        f32_products: args.f32_products.into(),
        ..StepOptions::new(StepKind::Grads)
    };
    let compiled = compile_step(&spec, &opts)?;
    let (step, memory) = (compiled.step, compiled.plan);

    // Checked against the whole trace before the session allocates anything;
    // the raw weights go before the session's buffers arrive.
    let params = load_params(&step, &weights, true)
        .with_context(|| format!("loading {} into `{}`", weights_path.display(), spec.config.name))?;
    drop(weights);
    let batch_inputs = reference_batch(&ids, loss)?;
    let ref_grads = reference_grads(&dir.join("grads.safetensors"), &step, family, &spec.config)?;

    let mut session = open(backend, step, memory)?;
    for (param, value) in params {
        session.write(param, &value)?;
    }
    for (name, value) in batch_inputs {
        session.write_named(name, &value).with_context(|| format!("writing the reference's `{name}`"))?;
    }
    let t0 = Instant::now();
    session.run_eager()?;
    let step_seconds = t0.elapsed().as_secs_f64();
    let our_loss = session.loss()?;
    let loss_diff = diff(&[our_loss], &[ref_loss]);
    let loss_row =
        LossRow { stepgraph: our_loss, reference: ref_loss, pass: within(loss_diff.rel, tolerance), diff: loss_diff };

    let mut rows = Vec::with_capacity(ref_grads.len());
    // Consumed as compared, so each reference gradient is freed once used.
    for ReferenceGrad { name, grad, reference } in ref_grads {
        let ours = session.read(grad).with_context(|| format!("reading the gradient of `{name}`"))?;
        let d = diff(&ours.to_f64(), &reference.to_f64());
        rows.push(TensorRow { name, shape: ours.ty.shape.clone(), pass: within(d.rel, tolerance), diff: d });
    }
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
        pass,
    })
}

/// A reference gradient, matched with the step's gradient of that parameter.
struct ReferenceGrad {
    name: String,
    grad: ValueId,
    reference: HostTensor,
}

/// The family of the reference's `config.json` (already read as a
/// [`Config`], so its `model_type` is one stepgraph loads).
fn family_of(config_path: &Path) -> Result<HfFamily> {
    let text = std::fs::read_to_string(config_path).with_context(|| format!("reading {}", config_path.display()))?;
    let value: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("{} is not valid JSON", config_path.display()))?;
    let model_type = value.get("model_type").and_then(serde_json::Value::as_str).unwrap_or_default();
    HfFamily::from_model_type(model_type)
        .with_context(|| format!("{}: model_type `{model_type}` is not supported", config_path.display()))
}

/// Reads the reference's gradients at `path` (Hugging Face names of
/// `family`) and matches them with the parameters of `step`: one float,
/// finite gradient of the parameter's shape for every parameter, and
/// nothing else.
fn reference_grads(
    path: &Path,
    step: &Trace,
    family: HfFamily,
    config: &stepgraph_core::models::Config,
) -> Result<Vec<ReferenceGrad>> {
    let tensors =
        read_safetensors(path).with_context(|| format!("reading the reference's gradients {}", path.display()))?;
    for (name, tensor) in &tensors {
        if !tensor.ty.dtype.is_float() {
            bail!(
                "{}: the gradient `{name}` is {}; gradients must be f32, f64, bf16 or f16",
                path.display(),
                tensor.ty.dtype.name()
            );
        }
        check_finite(path, name, tensor)?;
    }
    let tensors = from_hf_tensors(family, config, tensors)
        .with_context(|| format!("reading the reference's gradients {}", path.display()))?;
    let mut by_name: HashMap<String, HostTensor> = HashMap::with_capacity(tensors.len());
    for (name, tensor) in tensors {
        if by_name.insert(name.clone(), tensor).is_some() {
            bail!("{}: the gradient `{name}` appears twice", path.display());
        }
    }
    let mut matched = Vec::new();
    let mut missing = Vec::new();
    for param in step.params() {
        let name = step.value(param).kind.leaf_name().unwrap_or_default().to_string();
        let grad = step.grad_of(param).with_context(|| format!("the step has no gradient of `{name}`"))?;
        let Some(reference) = by_name.remove(&name) else {
            missing.push(name);
            continue;
        };
        let ours = &step.ty(grad).shape;
        if &reference.ty.shape != ours {
            bail!(
                "{}: the gradient `{name}` has shape {:?}, the model's parameter has shape {ours:?}",
                path.display(),
                reference.ty.shape
            );
        }
        matched.push(ReferenceGrad { name, grad, reference });
    }
    if !missing.is_empty() {
        bail!(
            "{} has no gradient for {} of the model's parameters: {}",
            path.display(),
            missing.len(),
            name_list(&missing)
        );
    }
    if !by_name.is_empty() {
        let mut extra: Vec<String> = by_name.into_keys().collect();
        extra.sort();
        bail!(
            "{} has {} gradient{} of no parameter of the model: {}; the reference must be of the same model (its \
             config.json)",
            path.display(),
            extra.len(),
            if extra.len() == 1 { "" } else { "s" },
            name_list(&extra)
        );
    }
    Ok(matched)
}

/// The first few of `names`, quoted, for an error.
fn name_list(names: &[String]) -> String {
    let mut list = names.iter().take(5).map(|n| format!("`{n}`")).collect::<Vec<_>>().join(", ");
    if names.len() > 5 {
        list += &format!(" and {} more", names.len() - 5);
    }
    list
}

/// An error naming `file` and `name` when the float tensor holds a NaN or an infinity.
fn check_finite(file: &Path, name: &str, tensor: &HostTensor) -> Result<()> {
    if !tensor.ty.dtype.is_float() {
        return Ok(());
    }
    if let Some((at, x)) = tensor.to_f64().into_iter().enumerate().find(|(_, x)| !x.is_finite()) {
        bail!(
            "{}: `{name}` {} holds {x} at element {at}; the reference's tensors must be finite",
            file.display(),
            tensor.ty
        );
    }
    Ok(())
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
fn render_text(r: &Report) -> String {
    let mut text = String::new();
    write_text(&mut text, r).expect("writing to a String cannot fail");
    text
}

fn write_text(out: &mut String, r: &Report) -> std::fmt::Result {
    use std::fmt::Write;
    writeln!(
        out,
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
    )?;
    writeln!(out, "metric: {METRIC}; tolerance {:e}", r.tolerance)?;
    writeln!(
        out,
        "loss: stepgraph {:.9e}, reference {:.9e}, rel {:.3e}  {}",
        r.loss.stepgraph,
        r.loss.reference,
        r.loss.diff.rel,
        verdict(r.loss.pass)
    )?;
    writeln!(out, "gradients, worst rel first:")?;
    let shape_width = r.grads.iter().map(|g| format!("{:?}", g.shape).len()).max().unwrap_or(5).max(5);
    writeln!(
        out,
        "  {:>10}  {:>10}  {:>10}  {:>10}  {:<shape_width$}  {:<4}  name",
        "rel", "rel_max", "|b|_2", "max|a-b|", "shape", ""
    )?;
    for g in &r.grads {
        writeln!(
            out,
            "  {:>10.3e}  {:>10.3e}  {:>10.3e}  {:>10.3e}  {:<shape_width$}  {:<4}  {}",
            g.diff.rel,
            g.diff.rel_max,
            g.diff.ref_norm,
            g.diff.max_abs_diff,
            format!("{:?}", g.shape),
            verdict(g.pass),
            g.name
        )?;
    }
    match &r.worst {
        Some(name) => writeln!(out, "max gradient rel {:.3e} ({name})", r.max_grad_rel)?,
        None => writeln!(out, "the model has no parameters")?,
    }
    let passed = r.grads.iter().filter(|g| g.pass).count();
    writeln!(
        out,
        "{}: loss {}, {passed} of {} gradients ok (rel <= {:e})",
        if r.pass { "PASS" } else { "FAIL" },
        verdict(r.loss.pass),
        r.grads.len(),
        r.tolerance
    )?;
    Ok(())
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
    use stepgraph_core::cpu::exec::CpuSession;

    use super::*;
    use clap::Parser;
    use stepgraph_core::ir::TensorType;
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
        assert!(err.contains("--device cuda needs an NVIDIA GPU") && err.contains("--device cpu"), "{err}");
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
            adapters: None,
            documents: false,
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
            epilogues: crate::memory_args::EpilogueArg::On,
            f32_products: crate::memory_args::F32ProductsArg::Exact,
        }
    }

    #[test]
    fn the_cpu_backend_matches_a_reference_it_made() {
        for (loss, kind, test) in
            [(LossKind::Sum, CompareLoss::Sum, "sum"), (LossKind::CrossEntropy, CompareLoss::Ce, "ce")]
        {
            let dir = temp_dir(test);
            write_reference(&dir, loss);
            let report = compare(&args(&dir, kind), Backend::Cpu, open_session).unwrap();
            assert!(report.pass, "{report:?}");
            assert_eq!(report.tolerance, F32_TOLERANCE);
            assert_eq!(report.loss.diff.rel, 0.0);
            assert_eq!(report.grads.len(), 2 * 9 + 3, "every parameter of 2 layers, the embedding, norm and head");
            assert!(report.grads.iter().all(|g| g.diff.rel == 0.0 && g.diff.ref_norm > 0.0), "{report:?}");
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
        let report = compare(&args(&dir, CompareLoss::Sum), Backend::Cpu, open_session).unwrap();
        assert!(!report.pass && report.loss.pass);
        assert_eq!(report.worst.as_deref(), Some(name.as_str()));
        assert!((report.max_grad_rel - 0.01 / 1.01).abs() < 1e-6, "{}", report.max_grad_rel);
        assert_eq!(report.grads.iter().filter(|g| !g.pass).count(), 1);
        let summary = failure_summary(&report);
        assert!(summary.contains("1 of 21 gradients fail") && summary.contains(&name), "{summary}");
        let loose = CompareArgs { tol: Some(2e-2), ..args(&dir, CompareLoss::Sum) };
        assert!(compare(&loose, Backend::Cpu, open_session).unwrap().pass);
        // And `run` turns the failure into an error (the exit status).
        assert!(run(&args(&dir, CompareLoss::Sum)).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_missing_reference_is_a_clear_error() {
        let dir = temp_dir("missing");
        let err = format!("{:#}", compare(&args(&dir, CompareLoss::Sum), Backend::Cpu, open_session).unwrap_err());
        assert!(err.contains("reading the reference's model config") && err.contains("config.json"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// An opener for steps that must never run: every fault below is found first.
    fn never_open(_: Backend, _: Trace, _: MemoryPlan) -> Result<Box<dyn Session>> {
        panic!("the step ran before its inputs were checked")
    }

    /// Rewrites one tensor of `dir/file` with `change`.
    fn rewrite(dir: &Path, file: &str, change: impl FnOnce(&mut Vec<(String, HostTensor)>)) {
        let path = dir.join(file);
        let mut tensors = read_safetensors(&path).unwrap();
        change(&mut tensors);
        write_safetensors_atomic(&path, &tensors).unwrap();
    }

    /// `tensor` with element `at` set to `x`.
    fn with_element(tensor: &HostTensor, at: usize, x: f64) -> HostTensor {
        let mut data = tensor.to_f64();
        data[at] = x;
        HostTensor::from_f64(tensor.ty.clone(), &data)
    }

    #[test]
    fn tol_must_be_a_finite_number_above_zero() {
        for bad in ["0", "-1e-3", "inf", "-inf", "NaN", "1e400", "abc", ""] {
            let err = parse(&["--reference", "r", "--loss", "sum", "--tol", bad]).expect_err(bad).to_string();
            assert!(err.contains("--tol") && err.contains("finite number above 0"), "{bad}: {err}");
        }
        assert_eq!(parse(&["--reference", "r", "--loss", "sum", "--tol", "2.5e-2"]).unwrap().tol, Some(2.5e-2));
        // Arguments made in code meet the same rule, before anything is read.
        let dir = temp_dir("tol");
        for bad in [0.0, -1.0, f64::INFINITY, f64::NAN] {
            let a = CompareArgs { tol: Some(bad), ..args(&dir, CompareLoss::Sum) };
            let err = format!("{:#}", compare(&a, Backend::Cpu, never_open).unwrap_err());
            assert!(err.contains("--tol") && err.contains("finite number above 0"), "{err}");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn every_faulty_reference_is_an_input_error_found_before_the_step() {
        type Fault = fn(&Path);
        let faults: [(&str, Fault, &[&str]); 9] = [
            (
                "nan-weight",
                |d| rewrite(d, "weights.safetensors", |t| t[1].1 = with_element(&t[1].1, 3, f64::NAN)),
                &["weights.safetensors", "holds NaN at element 3", "must be finite"],
            ),
            (
                "inf-weight",
                |d| {
                    rewrite(d, "weights.safetensors", |t| {
                        let (_, w) = t.iter_mut().find(|(n, _)| n == "lm_head.weight").unwrap();
                        *w = with_element(w, 0, f64::NEG_INFINITY);
                    })
                },
                &["weights.safetensors", "`lm_head.weight`", "holds -inf at element 0"],
            ),
            (
                "extra-grad",
                |d| {
                    rewrite(d, "grads.safetensors", |t| {
                        let extra = HostTensor::from_f64(TensorType::new(DType::F32, [2]), &[1.0, 2.0]);
                        t.push(("model.layers.7.mlp.up_proj.weight".into(), extra));
                    })
                },
                &["grads.safetensors", "1 gradient of no parameter", "`model.layers.7.mlp.up_proj.weight`"],
            ),
            (
                "int-grad",
                |d| {
                    rewrite(d, "grads.safetensors", |t| {
                        let (_, g) = t.iter_mut().find(|(n, _)| n == "lm_head.weight").unwrap();
                        *g = HostTensor::from_f64(TensorType::new(DType::I64, g.ty.shape.clone()), &g.to_f64());
                    })
                },
                &["grads.safetensors", "`lm_head.weight` is i64", "must be f32"],
            ),
            (
                "nan-grad",
                |d| rewrite(d, "grads.safetensors", |t| t[0].1 = with_element(&t[0].1, 1, f64::NAN)),
                &["grads.safetensors", "holds NaN at element 1"],
            ),
            (
                "missing-grad",
                |d| rewrite(d, "grads.safetensors", |t| t.retain(|(n, _)| n != "lm_head.weight")),
                &["grads.safetensors", "no gradient for 1 of the model's parameters", "`lm_head.weight`"],
            ),
            (
                "shape-grad",
                |d| {
                    rewrite(d, "grads.safetensors", |t| {
                        let (_, g) = t.iter_mut().find(|(n, _)| n == "lm_head.weight").unwrap();
                        *g = HostTensor::from_f64(TensorType::new(DType::F32, [4]), &[0.0; 4]);
                    })
                },
                &["grads.safetensors", "`lm_head.weight` has shape [4]"],
            ),
            (
                "no-grads-file",
                |d| std::fs::remove_file(d.join("grads.safetensors")).unwrap(),
                &["reading the reference's gradients", "grads.safetensors"],
            ),
            (
                "inf-loss",
                |d| {
                    rewrite(d, "io.safetensors", |t| {
                        let (_, l) = t.iter_mut().find(|(n, _)| n == "loss").unwrap();
                        *l = with_element(l, 0, f64::INFINITY);
                    })
                },
                &["io.safetensors", "`loss`", "is inf"],
            ),
        ];
        for (test, fault, wanted) in faults {
            let dir = temp_dir(test);
            write_reference(&dir, LossKind::Sum);
            fault(&dir);
            let err = format!("{:#}", compare(&args(&dir, CompareLoss::Sum), Backend::Cpu, never_open).unwrap_err());
            for w in wanted {
                assert!(err.contains(w), "{test}: `{w}` is not in: {err}");
            }
            std::fs::remove_dir_all(&dir).unwrap();
        }
    }

    #[test]
    fn an_unwritable_json_out_is_found_before_the_step() {
        let dir = temp_dir("json-early");
        write_reference(&dir, LossKind::Sum);
        for (out, why) in [(dir.join("no/such/folder/r.json"), "cannot be written"), (dir.clone(), "is a folder")] {
            let a = CompareArgs { json_out: Some(out.clone()), ..args(&dir, CompareLoss::Sum) };
            let mut printed = Vec::new();
            let err = format!("{:#}", run_with(&a, Backend::Cpu, &mut printed, never_open).unwrap_err());
            assert!(
                err.contains("--json-out") && err.contains(&out.display().to_string()) && err.contains(why),
                "{err}"
            );
            assert!(printed.is_empty());
        }
        // The probe leaves no file behind when a later check fails, and a file
        // already there unchanged.
        let fresh = dir.join("fresh.json");
        let old = dir.join("old.json");
        std::fs::write(&old, "yesterday's report").unwrap();
        std::fs::remove_file(dir.join("grads.safetensors")).unwrap();
        for out in [&fresh, &old] {
            let a = CompareArgs { json_out: Some(out.clone()), ..args(&dir, CompareLoss::Sum) };
            assert!(run_with(&a, Backend::Cpu, &mut Vec::new(), never_open).is_err());
        }
        assert!(!fresh.exists());
        assert_eq!(std::fs::read_to_string(&old).unwrap(), "yesterday's report");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn the_report_is_printed_even_when_json_out_then_fails() {
        for json in [false, true] {
            let dir = temp_dir(&format!("json-late-{json}"));
            write_reference(&dir, LossKind::Sum);
            let out_dir = dir.join("reports");
            std::fs::create_dir_all(&out_dir).unwrap();
            let out = out_dir.join("report.json");
            let a = CompareArgs { json_out: Some(out.clone()), json, ..args(&dir, CompareLoss::Sum) };
            // The folder passes the early check, then goes away while the step runs.
            let vanishing = |backend, step, plan| {
                std::fs::remove_dir_all(&out_dir).unwrap();
                open_session(backend, step, plan)
            };
            let mut printed = Vec::new();
            let err = format!("{:#}", run_with(&a, Backend::Cpu, &mut printed, vanishing).unwrap_err());
            assert!(err.contains(&out.display().to_string()) && err.contains("printed above"), "{err}");
            let printed = String::from_utf8(printed).unwrap();
            if json {
                let report: serde_json::Value = serde_json::from_str(&printed).unwrap();
                assert_eq!(
                    (report["pass"].as_bool(), report["grads"].as_array().map(Vec::len)),
                    (Some(true), Some(21))
                );
            } else {
                assert!(printed.contains("PASS: loss ok, 21 of 21 gradients ok"), "{printed}");
            }
            std::fs::remove_dir_all(&dir).unwrap();
        }
    }

    #[test]
    fn json_out_holds_the_printed_report() {
        let dir = temp_dir("json-ok");
        write_reference(&dir, LossKind::Sum);
        let out = dir.join("report.json");
        let a = CompareArgs { json_out: Some(out.clone()), json: true, ..args(&dir, CompareLoss::Sum) };
        let mut printed = Vec::new();
        run_with(&a, Backend::Cpu, &mut printed, open_session).unwrap();
        assert_eq!(std::fs::read_to_string(&out).unwrap(), String::from_utf8(printed).unwrap());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
