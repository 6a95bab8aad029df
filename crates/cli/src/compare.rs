//! `stepgraph compare`: one `grads` step of stepgraph against a PyTorch
//! reference on identical weights and tokens.
//!
//! The reference is the folder `shared/bench/torch_reference.py --save DIR`
//! writes: `config.json` (the Hugging Face config), `weights.safetensors`
//! (the state dict), `io.safetensors` (`input_ids` [B, T] and the first
//! step's `loss` [1]) and `grads.safetensors` (every parameter's gradient of
//! that step, Hugging Face names). The model is built from `config.json`, the
//! batch shape from `input_ids`; the step runs on the CPU backend. The report
//! gives both losses with their relative difference and, per parameter, the
//! relative error ‖g − g_ref‖ / ‖g_ref‖ computed in f64, worst first.
//!
//! With `--tolerance X` the command fails (non-zero exit) when the loss's
//! relative difference or any gradient's relative error is above X, or is
//! not a number.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use serde_json::json;

use stepgraph_core::autodiff::{build_step, StepKind, TrainOptions};
use stepgraph_core::cpu::exec::CpuSession;
use stepgraph_core::ir::DType;
use stepgraph_core::models::checkpoint::{load_params, read_safetensors, reference_batch};
use stepgraph_core::models::{build_forward, Config, LossKind, ModelSpec};
use stepgraph_core::plan::{check_plan, plan, PlanOptions};
use stepgraph_core::testing::HostTensor;

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
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
    /// Fail when the loss's relative difference or any gradient's relative
    /// error exceeds this.
    #[arg(long)]
    pub tolerance: Option<f64>,
}

/// One parameter's gradient against the reference's.
struct GradRow {
    name: String,
    shape: Vec<usize>,
    /// ‖g − g_ref‖ / ‖g_ref‖ (0 when both are zero, infinite when only the
    /// reference is).
    rel_err: f64,
    /// ‖g_ref‖.
    ref_norm: f64,
    /// ‖g‖.
    norm: f64,
    /// max |g − g_ref|.
    max_abs_diff: f64,
}

/// Runs `stepgraph compare`: prints the report, then fails if a tolerance
/// was given and is exceeded.
pub fn run(args: &CompareArgs) -> Result<()> {
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
    let dtype = match args.dtype {
        Some(CompareDType::F32) => DType::F32,
        Some(CompareDType::Bf16) => DType::BF16,
        None => weights_dtype(&weights, &weights_path)?,
    };
    let loss = match args.loss {
        CompareLoss::Sum => LossKind::Sum,
        CompareLoss::Ce => LossKind::CrossEntropy,
    };
    let spec = ModelSpec { config, batch, seq, dtype, loss };
    let forward = build_forward(&spec)?;
    let step = build_step(&forward, StepKind::Grads, &TrainOptions::default())?;
    let memory = plan(&step, PlanOptions::default())?;
    check_plan(&step, &memory)?;

    // Checked against the whole trace before the session allocates anything;
    // the raw weights go before the session's buffers arrive.
    let params = load_params(&step, &weights, true)
        .with_context(|| format!("loading {} into `{}`", weights_path.display(), spec.config.name))?;
    drop(weights);
    let mut session = CpuSession::new(step, memory)?;
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
    let loss_rel_diff = rel_diff(our_loss, ref_loss);

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
        let ours = session.read(grad);
        if reference.ty.shape != ours.ty.shape {
            bail!(
                "the reference's gradient of `{name}` has shape {:?}, stepgraph's has {:?}",
                reference.ty.shape,
                ours.ty.shape
            );
        }
        rows.push(grad_row(name, &ours, &reference));
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
    rows.sort_by(|a, b| sort_key(b.rel_err).total_cmp(&sort_key(a.rel_err)).then_with(|| a.name.cmp(&b.name)));
    let worst = rows.first().map(|r| (r.name.as_str(), r.rel_err));
    let max_rel_err = worst.map_or(0.0, |(_, e)| e);

    let verdict = args.tolerance.map(|tol| {
        let within = |x: f64| x.is_finite() && x <= tol;
        within(loss_rel_diff) && rows.iter().all(|r| within(r.rel_err))
    });

    let dtype_name = dtype.name();
    let loss_name = match args.loss {
        CompareLoss::Sum => "sum",
        CompareLoss::Ce => "ce",
    };
    if args.json {
        let report = json!({
            "reference": dir.display().to_string(),
            "model": spec.config.name,
            "dtype": dtype_name,
            "loss_kind": loss_name,
            "batch": batch,
            "seq": seq,
            "step_seconds": step_seconds,
            "loss": { "stepgraph": our_loss, "reference": ref_loss, "rel_diff": loss_rel_diff },
            "max_grad_rel_err": max_rel_err,
            "worst": worst.map(|(name, _)| name),
            "grads": rows.iter().map(|r| json!({
                "name": r.name,
                "shape": r.shape,
                "rel_err": r.rel_err,
                "ref_norm": r.ref_norm,
                "norm": r.norm,
                "max_abs_diff": r.max_abs_diff,
            })).collect::<Vec<_>>(),
            "unmatched_reference_grads": unmatched,
            "tolerance": args.tolerance,
            "pass": verdict,
        });
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        println!(
            "compare {}: `{}` in {dtype_name}, loss {loss_name}, batch {batch} x {seq} tokens, step {step_seconds:.2} s on the CPU",
            dir.display(),
            spec.config.name
        );
        println!("loss: stepgraph {our_loss:.9e}, reference {ref_loss:.9e}, relative difference {loss_rel_diff:.3e}");
        println!("gradients, relative error |g - g_ref| / |g_ref| per parameter, worst first:");
        let shape_width = rows.iter().map(|r| format!("{:?}", r.shape).len()).max().unwrap_or(5).max(5);
        println!("  {:>10}  {:>10}  {:>10}  {:<shape_width$}  name", "rel err", "|g_ref|", "max |diff|", "shape");
        for r in &rows {
            println!(
                "  {:>10.3e}  {:>10.3e}  {:>10.3e}  {:<shape_width$}  {}",
                r.rel_err,
                r.ref_norm,
                r.max_abs_diff,
                format!("{:?}", r.shape),
                r.name
            );
        }
        if !unmatched.is_empty() {
            println!("reference gradients with no parameter here: {}", unmatched.join(", "));
        }
        match worst {
            Some((name, err)) => println!("max gradient relative error {err:.3e} ({name})"),
            None => println!("the model has no parameters"),
        }
    }
    if let (Some(tol), Some(false)) = (args.tolerance, verdict) {
        let over = |x: f64| !(x.is_finite() && x <= tol);
        let mut failures = Vec::new();
        if over(loss_rel_diff) {
            failures.push(format!("the loss differs by {loss_rel_diff:.3e}"));
        }
        let bad: Vec<&GradRow> = rows.iter().filter(|r| over(r.rel_err)).collect();
        if let Some(first) = bad.first() {
            failures.push(format!(
                "{} of {} gradients are off by more, worst `{}` at {:.3e}",
                bad.len(),
                rows.len(),
                first.name,
                first.rel_err
            ));
        }
        bail!("above the tolerance {tol:e}: {}", failures.join("; "));
    }
    Ok(())
}

/// Every tensor of `dir/file`, by name.
fn read_file(dir: &Path, file: &str, what: &str) -> Result<HashMap<String, HostTensor>> {
    let path = dir.join(file);
    let tensors = read_safetensors(&path).with_context(|| format!("reading {what} {}", path.display()))?;
    Ok(tensors.into_iter().collect())
}

/// The one dtype of the float tensors of a checkpoint.
fn weights_dtype(weights: &[(String, HostTensor)], path: &Path) -> Result<DType> {
    let mut dtypes: Vec<DType> = Vec::new();
    for (_, tensor) in weights {
        if tensor.ty.dtype.is_float() && !dtypes.contains(&tensor.ty.dtype) {
            dtypes.push(tensor.ty.dtype);
        }
    }
    match dtypes.as_slice() {
        [one] => Ok(*one),
        [] => bail!("{} holds no float tensors", path.display()),
        many => bail!(
            "{} mixes float dtypes ({}); choose one with --dtype",
            path.display(),
            many.iter().map(|d| d.name()).collect::<Vec<_>>().join(", ")
        ),
    }
}

/// |a − b| / |b|, or |a − b| when `b` is zero.
fn rel_diff(a: f64, b: f64) -> f64 {
    let diff = (a - b).abs();
    if b == 0.0 {
        diff
    } else {
        diff / b.abs()
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

/// The f64 comparison of one gradient with its reference.
fn grad_row(name: String, ours: &HostTensor, reference: &HostTensor) -> GradRow {
    let (g, r) = (ours.to_f64(), reference.to_f64());
    let (mut diff_sq, mut ref_sq, mut our_sq, mut max_abs_diff) = (0.0f64, 0.0f64, 0.0f64, 0.0f64);
    for (&x, &y) in g.iter().zip(&r) {
        let d = x - y;
        diff_sq += d * d;
        ref_sq += y * y;
        our_sq += x * x;
        // `max` would drop a NaN difference; keep it.
        if d.is_nan() || d.abs() > max_abs_diff {
            max_abs_diff = d.abs();
        }
    }
    let (diff, ref_norm) = (diff_sq.sqrt(), ref_sq.sqrt());
    let rel_err = if ref_norm > 0.0 {
        diff / ref_norm
    } else if diff == 0.0 {
        0.0
    } else {
        f64::INFINITY
    };
    GradRow { name, shape: ours.ty.shape.clone(), rel_err, ref_norm, norm: our_sq.sqrt(), max_abs_diff }
}
