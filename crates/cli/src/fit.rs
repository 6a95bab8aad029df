//! `plan --gpu-memory`: will a step fit a GPU, and if not, what would.
//!
//! The verdict is made of real plans, never estimates: the step as asked,
//! then the same step under a memory budget of the GPU's usable bytes
//! (every recomputation and MLP tiling the planner has), then variants a
//! user can ask for with one flag (no gradient clipping, shorter
//! sequences, ZeRO-1 data parallelism over more GPUs), each planned to the
//! same budget. It names the least this step can plan and the first
//! variants that fit.

use std::fmt;

use anyhow::Result;
use serde::Serialize;

use stepgraph_core::autodiff::{StepKind, TrainOptions};
use stepgraph_core::dist::{DataParallel, DEFAULT_BUCKET_BYTES};
use stepgraph_core::models::{Adapters, BaseStorage, LoraTarget, ModelSpec};
use stepgraph_core::passes::recompute::RecomputePolicy;
use stepgraph_core::pipeline::{compile_step, CompiledStep, StepOptions};
use stepgraph_core::plan::{Category, Timeline};
use stepgraph_core::Error as CoreError;

use crate::memory_args::parse_size;

/// What a GPU holds that a step's plan does not: the CUDA context, the
/// kernel modules and cuBLASLt's workspace. Measured on an H200 (context
/// about 0.5 GiB; modules and workspace 41 MB above the plan), rounded up.
pub const CONTEXT_RESERVE: u64 = 768 << 20;

/// The GPU a verdict is for.
#[derive(Clone, Debug, Serialize)]
pub struct Gpu {
    /// As the user named it (`24GB`), or `GPU 0 (free memory)`.
    pub label: String,
    /// Bytes a step's plan may take on it.
    pub usable_bytes: u64,
}

impl Gpu {
    /// A GPU sold as `text` (`24GB`, `80GB`, `141GB`): cards are sold in
    /// binary gigabytes (an "80GB" H100 holds 79.6 GiB, a "24GB" card 24
    /// GiB), so `GB` and `TB` here are GiB and TiB; less what the CUDA
    /// context and libraries hold.
    pub fn sold_as(text: &str) -> Result<Gpu> {
        let t = text.trim();
        let bytes = parse_size("--gpu-memory", t, "", true)?;
        if bytes <= CONTEXT_RESERVE {
            anyhow::bail!(
                "--gpu-memory {text:?}: {bytes} bytes is less than the CUDA context and libraries alone take \
                 ({:.2} GB); give the GPU's memory, such as 24GB or 80GB",
                CONTEXT_RESERVE as f64 / 1e9
            );
        }
        Ok(Gpu { label: format!("a GPU with {t}"), usable_bytes: bytes - CONTEXT_RESERVE })
    }
}

/// Bytes live at the plan's peak, by what they are.
#[derive(Clone, Debug, Default, Serialize)]
pub struct PeakBytes {
    pub weights: u64,
    pub optimizer_state: u64,
    pub gradients: u64,
    pub activations: u64,
    pub temporaries: u64,
}

impl PeakBytes {
    pub fn of(step: &CompiledStep) -> PeakBytes {
        let timeline = Timeline::new(&step.step, &step.plan, &step.recompute().nodes());
        let Some(live) = timeline.live.iter().max_by_key(|l| l.iter().sum::<u64>()) else {
            return PeakBytes::default();
        };
        let at = |c: Category| live[Category::ALL.iter().position(|&x| x == c).unwrap()];
        PeakBytes {
            weights: at(Category::Parameters),
            optimizer_state: at(Category::OptimizerState),
            gradients: at(Category::Gradients),
            activations: at(Category::SavedActivations) + at(Category::Recomputed),
            temporaries: at(Category::Temporaries),
        }
    }
}

impl fmt::Display for PeakBytes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "weights {}, optimizer state {}, gradients {}, activations {}, temporaries {}",
            gb(self.weights),
            gb(self.optimizer_state),
            gb(self.gradients),
            gb(self.activations),
            gb(self.temporaries)
        )
    }
}

/// A variant of the step that fits, with the flags that ask for it.
#[derive(Clone, Debug, Serialize)]
pub struct Alternative {
    pub flags: String,
    pub planned_bytes: u64,
    pub note: String,
}

#[derive(Clone, Debug, Serialize)]
pub struct Verdict {
    pub gpu: Gpu,
    pub fits: bool,
    /// The step as asked.
    pub planned_bytes: u64,
    pub at_peak: PeakBytes,
    /// When the step as asked does not fit but does under a memory budget
    /// of the GPU's usable bytes: what it plans then.
    pub budgeted_bytes: Option<u64>,
    /// When not even that fits: the least the step plans with every memory
    /// option (every recomputation, MLP tiles).
    pub least_bytes: Option<u64>,
    /// Weights and optimizer state: what no recomputation lowers.
    pub persistent_bytes: u64,
    pub would_fit: Vec<Alternative>,
}

/// The verdict for `asked` (planned with `opts`) on `gpu`.
pub fn verdict(spec: &ModelSpec, opts: &StepOptions, asked: &CompiledStep, gpu: Gpu) -> Result<Verdict> {
    let planned = asked.plan.planned_peak_bytes();
    let mut v = Verdict {
        fits: planned <= gpu.usable_bytes,
        planned_bytes: planned,
        at_peak: PeakBytes::of(asked),
        budgeted_bytes: None,
        least_bytes: None,
        persistent_bytes: asked.plan.persistent_bytes,
        would_fit: Vec::new(),
        gpu,
    };
    if v.fits {
        return Ok(v);
    }
    // The budget every variant is planned to, as the flag prints it (whole
    // hundredths of a GB, rounded down), so the printed flags plan exactly
    // what the verdict says.
    let hundredths = v.gpu.usable_bytes / 10_000_000;
    let budget = hundredths * 10_000_000;
    let budget_flag = format!("--memory-budget {}.{:02}GB", hundredths / 100, hundredths % 100);
    // Planned bytes under the budget and, where the plan keeps values or
    // optimizer state in host memory, what that costs (for the note); or
    // the least the budget search reached.
    let budgeted = |spec: &ModelSpec, opts: &StepOptions| -> Result<std::result::Result<(u64, String), u64>> {
        let opts = StepOptions { recompute: RecomputePolicy::Budget(budget), ..opts.clone() };
        match compile_step(spec, &opts) {
            Ok(step) => {
                let report = stepgraph_core::plan::plan_report(&step.step, &step.plan, 0);
                let offloaded = report.host_bytes.saturating_sub(report.host_table_bytes);
                let offload = match report.offloaded_values {
                    0 => String::new(),
                    _ => format!(
                        "; {} waits in host memory, {} copied per step",
                        gb(offloaded),
                        gb(report.copied_bytes_per_step)
                    ),
                };
                Ok(Ok((step.plan.planned_peak_bytes(), offload)))
            }
            Err(CoreError::MemoryBudget { least, .. }) => Ok(Err(least)),
            Err(e) => Err(e.into()),
        }
    };
    match budgeted(spec, opts)? {
        Ok((bytes, offload)) => {
            v.budgeted_bytes = Some(bytes);
            v.would_fit.push(Alternative {
                flags: budget_flag.clone(),
                planned_bytes: bytes,
                note: format!("recomputes activations in backward instead of keeping them{offload}"),
            });
            return Ok(v);
        }
        // Recomputing everything can plan more than the step as asked
        // (its recomputed values are live at a peak it did not lower).
        Err(least) => v.least_bytes = Some(least.min(planned)),
    }
    let clips = opts.train.clip_grad_norm.is_some_and(|c| c > 0.0) && opts.kind == StepKind::Train;
    if clips {
        let unclipped =
            StepOptions { train: TrainOptions { clip_grad_norm: None, ..opts.train.clone() }, ..opts.clone() };
        if let Ok((bytes, offload)) = budgeted(spec, &unclipped)? {
            v.would_fit.push(Alternative {
                flags: format!("--clip-grad-norm 0 {budget_flag}"),
                planned_bytes: bytes,
                note: format!("without clipping, each gradient is freed by its update in backward{offload}"),
            });
        }
        if !opts.train.clip_by_previous_norm {
            let previous = StepOptions {
                train: TrainOptions { clip_by_previous_norm: true, ..opts.train.clone() },
                ..opts.clone()
            };
            if let Ok((bytes, offload)) = budgeted(spec, &previous)? {
                v.would_fit.push(Alternative {
                    flags: format!("--clip-by-previous-norm {budget_flag}"),
                    planned_bytes: bytes,
                    note: format!("clipped by the step before's norm, so updates run in backward{offload}"),
                });
            }
        }
    }
    // AdamW's moments in 8 bits: a quarter of f32 moments, half of 16-bit
    // ones, at the cost of quantizing them (the step is not the same).
    if opts.kind == StepKind::Train && !opts.train.moments_8bit && spec.adapters.is_none() {
        let eight = StepOptions { train: TrainOptions { moments_8bit: true, ..opts.train.clone() }, ..opts.clone() };
        if let Ok((bytes, offload)) = budgeted(spec, &eight)? {
            v.would_fit.push(Alternative {
                flags: format!("--optimizer-state 8bit {budget_flag}"),
                planned_bytes: bytes,
                note: format!("AdamW's moments quantized to 8 bits per weight{offload}"),
            });
        }
    }
    // Shorter sequences, the tokens of a step kept with --grad-accum.
    let mut seq = spec.seq / 2;
    while seq >= 64 {
        let shorter = ModelSpec { seq, ..spec.clone() };
        if let Ok((bytes, offload)) = budgeted(&shorter, opts)? {
            let accum = spec.seq.div_ceil(seq) * opts.grad_accum.max(1);
            v.would_fit.push(Alternative {
                flags: format!("--seq {seq} --grad-accum {accum} {budget_flag}"),
                planned_bytes: bytes,
                note: format!("{seq}-token sequences, {accum} of them per update{offload}"),
            });
            break;
        }
        seq /= 2;
    }
    // ZeRO-1 over more GPUs: each holds 1/N of the AdamW state.
    if opts.kind == StepKind::Train {
        for world in [2usize, 4, 8] {
            let dp = DataParallel { world, bucket_bytes: DEFAULT_BUCKET_BYTES, zero1: true };
            let global = ModelSpec { batch: spec.batch * world, ..spec.clone() };
            let ranked = StepOptions {
                data_parallel: Some(dp),
                train: TrainOptions { clip_grad_norm: None, ..opts.train.clone() },
                ..opts.clone()
            };
            if let Ok((bytes, offload)) = budgeted(&global, &ranked)? {
                v.would_fit.push(Alternative {
                    flags: format!("--gpus {world} --zero1 --batch {} {budget_flag}", global.batch),
                    planned_bytes: bytes,
                    note: format!("{world} such GPUs, each holding 1/{world} of the AdamW state{offload}"),
                });
                break;
            }
        }
    }
    // Another method: adapters over the frozen base, which trains far
    // fewer weights and keeps no optimizer state for the base (LoRA, then
    // QLoRA with the base in 4 bits).
    if opts.kind == StepKind::Train && spec.adapters.is_none() {
        let methods = [
            ("", BaseStorage::Model, "LoRA: rank-16 adapters on every linear layer, the base frozen"),
            (
                " --base-dtype nf4 --double-quant",
                BaseStorage::Nf4 { double_quant: true },
                "QLoRA: rank-16 adapters, the frozen base in 4 bits",
            ),
        ];
        for (flags, base, note) in methods {
            let adapters = Adapters { base, ..Adapters::new(16, 32.0, LoraTarget::ALL.to_vec())? };
            let lora = ModelSpec { adapters: Some(adapters), ..spec.clone() };
            // A model the adapters cannot go on is no alternative.
            if let Ok(Ok((bytes, offload))) = budgeted(&lora, opts) {
                v.would_fit.push(Alternative {
                    flags: format!("--lora-rank 16{flags} {budget_flag}"),
                    planned_bytes: bytes,
                    note: format!("{note}{offload}"),
                });
                break;
            }
        }
    }
    Ok(v)
}

fn gb(bytes: u64) -> String {
    format!("{:.2} GB", bytes as f64 / 1e9)
}

impl fmt::Display for Verdict {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "at the peak: {}", self.at_peak)?;
        if self.fits {
            return writeln!(
                f,
                "verdict: fits {} with {} to spare ({} planned of {} usable)",
                self.gpu.label,
                gb(self.gpu.usable_bytes - self.planned_bytes),
                gb(self.planned_bytes),
                gb(self.gpu.usable_bytes)
            );
        }
        write!(
            f,
            "verdict: does not fit {} ({} usable): this step plans {}",
            self.gpu.label,
            gb(self.gpu.usable_bytes),
            gb(self.planned_bytes)
        )?;
        if self.budgeted_bytes.is_some() {
            write!(f, ", but fits under a memory budget")?;
        }
        if let Some(least) = self.least_bytes {
            write!(f, "; the least it can plan with every memory option is {}", gb(least))?;
        }
        if self.persistent_bytes > self.gpu.usable_bytes {
            write!(
                f,
                ", and its weights and optimizer state take {} (no recomputation lowers that; a budget keeps optimizer state, and then weights, in host memory)",
                gb(self.persistent_bytes)
            )?;
        }
        writeln!(f)?;
        if self.would_fit.is_empty() {
            return writeln!(
                f,
                "  nothing tried fits (a memory budget, no clipping, 8-bit AdamW moments, sequences down to 64 \
                 tokens, ZeRO-1 over up to 8 GPUs, LoRA and QLoRA adapters): a smaller model, or a GPU with more \
                 memory"
            );
        }
        writeln!(f, "  would fit:")?;
        for a in &self.would_fit {
            writeln!(f, "    {:<56} plans {} ({})", a.flags, gb(a.planned_bytes), a.note)?;
        }
        Ok(())
    }
}

/// This machine's GPU, by its free memory less what the CUDA libraries
/// take beside a plan (as `--memory-budget auto` counts it); `None`
/// without a GPU.
pub fn local_gpu() -> Result<Option<Gpu>> {
    if !stepgraph_cuda::session::gpu_available() {
        return Ok(None);
    }
    let usable = crate::memory_args::free_bytes()?;
    Ok(Some(Gpu { label: "GPU 0".into(), usable_bytes: usable }))
}
