//! `stepgraph bench`: one benchmark workload (docs/benchmarks.md) on the
//! GPU, eager or as one CUDA graph, reporting planned and measured memory
//! and step times in the fields that document defines.
//!
//! The step comes from [`compile_step`]; the timed steps drive the session
//! as a `dyn Session` ([`timed_steps`]); the memory details, profile and
//! tuning report are the CUDA session's own.

use std::time::Instant;

use anyhow::{bail, Result};
use clap::{Args, ValueEnum};
use rand::{Rng, SeedableRng};
use serde::Serialize;

use stepgraph_core::autodiff::{StepKind, LR_INPUT, STEP_INPUT};
use stepgraph_core::cpu::exec::scalar_input;
use stepgraph_core::host::HostTensor;
use stepgraph_core::ir::{DType, TensorType};
use stepgraph_core::models::gpt::{IGNORE_INDEX, POSITIONS_INPUT, TARGETS_INPUT, TOKENS_INPUT};
use stepgraph_core::models::{Config, LossKind, ModelSpec, Overrides};
use stepgraph_core::pipeline::{compile_step, StepOptions};
use stepgraph_core::session::Session;
use stepgraph_cuda::session::{device_name, MemoryReport};
use stepgraph_cuda::Switches;

use stepgraph_train::{metrics, open_cuda_session, SessionOptions};

#[derive(Copy, Clone, ValueEnum, Debug, PartialEq, Eq)]
pub enum Workload {
    W1,
    #[value(name = "w1-bf16")]
    W1Bf16,
    W2,
    W3,
    W5,
    /// Meta-Llama-3-8B cut to 2 layers, bf16, AdamW, 1 × 4096: the full
    /// 8B geometry (vocabulary, widths) of a one-card fine-tune.
    #[value(name = "l8-2l")]
    L8TwoLayers,
    /// Gemma-3-1B (text), bf16, AdamW, 1 × 8192: head size 256, sliding
    /// windows of 512 on five layers of every six.
    #[value(name = "g3-1b")]
    G3OneB,
    /// Qwen3-30B-A3B cut to 4 layers, bf16, AdamW, 1 × 4096: 128 experts
    /// of width 768 per layer, 8 per token (32,768 routed rows a layer).
    #[value(name = "q3moe-4l")]
    Qwen3MoeFourLayers,
}

#[derive(Copy, Clone, ValueEnum, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    Eager,
    Graph,
}

#[derive(Args, Debug)]
#[command(group = clap::ArgGroup::new("what").required(true).args(["workload", "model"]))]
pub struct BenchArgs {
    /// Which workload (defined in docs/benchmarks.md); or --model.
    #[arg(long, value_enum)]
    pub workload: Option<Workload>,
    /// Instead of a workload: a named model (a litgpt or Hugging Face name,
    /// as `plan --model` takes, such as Qwen3-0.6B, gemma-3-1b,
    /// Phi-4-mini-instruct) trained in bf16 with AdamW and cross-entropy on
    /// random tokens, from random weights.
    #[arg(long, value_name = "NAME")]
    pub model: Option<String>,
    /// With --model: keep only the first N layers.
    #[arg(long, value_name = "N", requires = "model")]
    pub n_layer: Option<usize>,
    /// With --model: rows per step.
    #[arg(long, value_name = "B", requires = "model")]
    pub batch: Option<usize>,
    /// With --model: tokens per row [default: 4096, or the model's block size if shorter].
    #[arg(long, value_name = "T", requires = "model")]
    pub seq: Option<usize>,
    /// Run every step eagerly, or replay one captured CUDA graph.
    #[arg(long, value_enum, default_value_t = Mode::Graph)]
    pub mode: Mode,
    /// Timed steps (median and min are reported).
    #[arg(long, default_value_t = 10)]
    pub steps: usize,
    /// Untimed steps before the timed ones.
    #[arg(long, default_value_t = 3)]
    pub warmup: usize,
    /// Allow TF32 for f32 matrix products.
    #[arg(long)]
    pub tf32: bool,
    /// Print the report as one line of JSON.
    #[arg(long)]
    pub json: bool,
    /// Also time every launch of one eager step and print the slowest kernels.
    #[arg(long)]
    pub profile: bool,
    /// Clip the global gradient norm to X in train workloads, as `train`
    /// does by default (0: no clipping, the workloads as
    /// docs/benchmarks.md defines them).
    #[arg(long, value_name = "X", default_value_t = 0.0)]
    pub clip_grad_norm: f64,
    /// What bf16/f16 parameters keep beside the AdamW moments. Default none:
    /// the workloads' PyTorch reference updates bf16 parameters in place
    /// with `torch.optim.AdamW`, as this does; `train` defaults to kahan.
    #[arg(long, value_enum, value_name = "MODE", default_value_t = crate::MasterWeightsArg::None)]
    pub master_weights: crate::MasterWeightsArg,
    /// dtype of the AdamW moments in train workloads, as `train`'s: 8bit
    /// quantizes them (also --optimizer-state 8bit).
    #[arg(long, alias = "optimizer-state", value_enum, value_name = "DTYPE", default_value_t = crate::StateDTypeArg::Auto)]
    pub state_dtype: crate::StateDTypeArg,
    /// Fill each row with packed documents of MIN to MAX tokens (lengths
    /// drawn uniformly, seeded), none seeing another (`train --packing
    /// documents`): the step takes their positions and attention skips the
    /// key tiles of earlier documents. A cross-entropy workload only.
    #[arg(long, value_name = "MIN-MAX", value_parser = parse_lengths)]
    pub documents: Option<(usize, usize)>,
    #[command(flatten)]
    pub memory: crate::memory_args::MemoryArgs,
}

/// `--documents MIN-MAX`.
fn parse_lengths(s: &str) -> std::result::Result<(usize, usize), String> {
    let parsed = s.split_once('-').and_then(|(a, b)| Some((a.trim().parse().ok()?, b.trim().parse().ok()?)));
    match parsed {
        Some((lo, hi)) if 1 <= lo && lo <= hi => Ok((lo, hi)),
        _ => Err(format!("`{s}` is not a range of document lengths: give MIN-MAX tokens, such as 100-1500")),
    }
}

/// Positions within documents for `batch` rows of `seq` tokens, packed
/// with documents whose lengths are drawn uniformly from `lengths`.
fn packed_positions(rng: &mut impl Rng, batch: usize, seq: usize, (lo, hi): (usize, usize)) -> Vec<f64> {
    let mut p = Vec::with_capacity(batch * seq);
    for _ in 0..batch {
        let mut left = seq;
        while left > 0 {
            let len = rng.gen_range(lo..=hi).min(left);
            p.extend((0..len).map(|i| i as f64));
            left -= len;
        }
    }
    p
}

/// The fraction of the causal step's 64 × 64 (query, key) tiles that hold
/// no key a query sees, with positions `p` (`batch × seq`): the attention
/// work that packing skips.
pub fn skipped_tile_fraction(p: &[f64], batch: usize, seq: usize) -> f64 {
    const TILE: usize = 64;
    let (mut causal, mut skipped) = (0usize, 0usize);
    for row in p.chunks(seq).take(batch) {
        for q0 in (0..seq).step_by(TILE) {
            // The first key of the tile's first query is the tile's least.
            let first = q0 - row[q0] as usize;
            for k0 in (0..=q0).step_by(TILE) {
                causal += 1;
                if k0 + TILE <= first {
                    skipped += 1;
                }
            }
        }
    }
    skipped as f64 / causal.max(1) as f64
}

/// What one benchmark run reports.
#[derive(Serialize)]
pub struct BenchReport {
    pub workload: String,
    pub mode: Mode,
    /// How the step's f32 products ran (`--f32-products`).
    pub f32_products: stepgraph_core::passes::F32Products,
    /// Which products ran in FP8 (`--fp8`), and how many did.
    pub fp8: stepgraph_core::pipeline::Fp8Mode,
    pub fp8_products: usize,
    /// The run-time switches the session ran under (`STEPGRAPH_*`).
    pub switches: Switches,
    pub gpu_arch: String,
    pub params: u64,
    pub tokens_per_step: usize,
    pub launches_per_step: usize,
    pub planned_peak_bytes: u64,
    pub device_peak_bytes: u64,
    /// Measured minus planned minus the reported fixed costs (workspace, modules, cuBLASLt, graph).
    pub unexplained_bytes: i64,
    pub memory: MemoryReport,
    pub capture_ms: Option<f64>,
    pub step_ms_median: f64,
    pub step_ms_min: f64,
    pub tokens_per_s: f64,
    /// Model FLOPs of one step ([`model_flops`]) and their rate as MFU
    /// (model FLOPs over time): against the GPU's dense peak for the
    /// dtype from training's table ([`metrics::peak_flops`]: 989 TFLOP/s for
    /// an H200 in bf16; `null` for a GPU not in it), and against 769 TFLOP/s,
    /// the bf16 product ceiling measured on the H200 (meaningful there only).
    pub model_tflop_per_step: f64,
    pub mfu: Option<f64>,
    pub mfu_of_769: f64,
    pub loss_first: f64,
    pub loss_last: f64,
}

/// Model FLOPs of one step, counted as training's MFU counts them
/// ([`metrics::train_flops_per_token`]: products and attention, forward and
/// backward); a forward-only step does a third of that.
pub fn model_flops(spec: &ModelSpec, kind: StepKind, params: u64) -> f64 {
    let step =
        metrics::train_flops_per_token(params as usize, 0, &spec.config, spec.seq) * (spec.batch * spec.seq) as f64;
    match kind {
        StepKind::Forward => step / 3.0,
        StepKind::Grads | StepKind::Train => step,
    }
}

/// What `--model` benchmarks: the named model (cut to `n_layer` layers)
/// on `batch` rows of `seq` tokens, bf16, a train step with cross-entropy.
fn model_spec(name: &str, n_layer: Option<usize>, batch: usize, seq: Option<usize>) -> Result<ModelSpec> {
    let config = Config::named(name)?.with_overrides(&Overrides { n_layer, ..Default::default() })?;
    let seq = seq.unwrap_or(config.block_size.min(4096));
    let spec = ModelSpec {
        config,
        batch,
        seq,
        dtype: DType::BF16,
        loss: LossKind::CrossEntropy,
        adapters: None,
        documents: false,
    };
    spec.validate()?;
    Ok(spec)
}

/// The workload's name in reports: its flag value, or the model's name
/// (with `-Nl` when cut to N layers).
fn workload_name(args: &BenchArgs) -> String {
    match (&args.workload, &args.model) {
        (Some(w), _) => w.to_possible_value().map(|v| v.get_name().to_string()).unwrap_or_default(),
        (None, Some(m)) => match args.n_layer {
            Some(n) => format!("{m}-{n}l"),
            None => m.clone(),
        },
        (None, None) => String::new(),
    }
}

fn spec(w: Workload) -> Result<(ModelSpec, StepKind)> {
    let named = |name: &str, o: Overrides| -> Result<Config> { Ok(Config::named(name)?.with_overrides(&o)?) };
    let layers = |n: usize| Overrides { n_layer: Some(n), ..Default::default() };
    // Every workload: random weights, no adapters, one sequence per row.
    let spec = |config: Config, batch: usize, seq: usize, dtype: DType, loss: LossKind| ModelSpec {
        config,
        batch,
        seq,
        dtype,
        loss,
        adapters: None,
        documents: false,
    };
    let (ce, bf16) = (LossKind::CrossEntropy, DType::BF16);
    Ok(match w {
        Workload::W1 | Workload::W1Bf16 => {
            let dtype = if w == Workload::W1 { DType::F32 } else { bf16 };
            (spec(named("open_llama_3b", layers(10))?, 1, 2048, dtype, LossKind::Sum), StepKind::Grads)
        }
        Workload::W2 => {
            let narrow = Overrides { n_layer: Some(5), n_embd: Some(28), ..Default::default() };
            (spec(named("Qwen2.5-7B", narrow)?, 1, 4096, bf16, ce), StepKind::Grads)
        }
        Workload::W3 => {
            (spec(named("w3-llama", Overrides::default())?, 1, 256, DType::F32, LossKind::Sum), StepKind::Grads)
        }
        Workload::L8TwoLayers => (spec(named("Meta-Llama-3-8B", layers(2))?, 1, 4096, bf16, ce), StepKind::Train),
        Workload::G3OneB => (spec(named("gemma-3-1b", Overrides::default())?, 1, 8192, bf16, ce), StepKind::Train),
        Workload::Qwen3MoeFourLayers => (spec(named("Qwen3-30B-A3B", layers(4))?, 1, 4096, bf16, ce), StepKind::Train),
        Workload::W5 => (spec(named("open_llama_3b", Overrides::default())?, 4, 2048, bf16, ce), StepKind::Train),
    })
}

/// What the timed steps measured.
struct Timed {
    capture_ms: Option<f64>,
    /// Milliseconds of each step after the warm-up.
    times: Vec<f64>,
    loss_first: f64,
    loss_last: f64,
}

/// Runs `args.warmup + args.steps` steps on random batches in `args.mode`:
/// eagerly, or by replay of a recording made once after one eager step
/// has warmed up modules and plans.
fn timed_steps(s: &mut dyn Session, args: &BenchArgs, spec: &ModelSpec, kind: StepKind) -> Result<Timed> {
    let (b, t) = (spec.batch, spec.seq);
    let ids_ty = TensorType::new(DType::I32, [b, t]);
    let mut rng = rand::rngs::StdRng::seed_from_u64(0);
    let mut write_batch = |s: &mut dyn Session, it: usize| -> Result<()> {
        let ids: Vec<f64> = (0..b * t).map(|_| rng.gen_range(0..spec.config.vocab_size) as f64).collect();
        s.write_named(TOKENS_INPUT, &HostTensor::from_f64(ids_ty.clone(), &ids))?;
        let positions = args.documents.map(|lengths| packed_positions(&mut rng, b, t, lengths));
        if let Some(p) = &positions {
            s.write_named(POSITIONS_INPUT, &HostTensor::from_f64(ids_ty.clone(), p))?;
        }
        if spec.loss == LossKind::CrossEntropy {
            // Labels are the inputs shifted by one, as Hugging Face's
            // `labels=input_ids`; a packed document's last token has none.
            let mut tg = vec![IGNORE_INDEX as f64; b * t];
            for r in 0..b {
                for c in 0..t - 1 {
                    let ends_document = positions.as_ref().is_some_and(|p| p[r * t + c + 1] == 0.0);
                    if !ends_document {
                        tg[r * t + c] = ids[r * t + c + 1];
                    }
                }
            }
            s.write_named(TARGETS_INPUT, &HostTensor::from_f64(ids_ty.clone(), &tg))?;
        }
        if kind == StepKind::Train {
            s.write_named(LR_INPUT, &scalar_input(1e-4))?;
            s.write_named(STEP_INPUT, &scalar_input(it as f64))?;
        }
        Ok(())
    };
    let mut capture_ms = None;
    let mut times = Vec::new();
    let (mut loss_first, mut loss_last) = (None, f64::NAN);
    for it in 1..=args.warmup + args.steps {
        write_batch(s, it)?;
        if args.mode == Mode::Graph && capture_ms.is_none() {
            // Record once, after one eager step has warmed up modules and
            // plans. Its loss is the run's first: the replay that follows
            // repeats the batch after that step's update.
            s.run_eager()?;
            loss_first.get_or_insert(s.loss()?);
            capture_ms = Some(s.prepare_replay()?.as_secs_f64() * 1e3);
        }
        let t0 = Instant::now();
        match args.mode {
            Mode::Eager => s.run_eager()?,
            Mode::Graph => s.replay()?,
        }
        let dt = t0.elapsed().as_secs_f64() * 1e3;
        let loss = s.loss()?;
        loss_first.get_or_insert(loss);
        loss_last = loss;
        if it > args.warmup {
            times.push(dt);
        }
    }
    Ok(Timed { capture_ms, times, loss_first: loss_first.unwrap_or(f64::NAN), loss_last })
}

pub fn run(args: &BenchArgs) -> Result<()> {
    if args.steps == 0 {
        bail!("--steps must be at least 1, got 0");
    }
    let switches = Switches::from_env()?;
    let (mut spec, kind) = match (args.workload, &args.model) {
        (Some(w), _) => spec(w)?,
        (None, Some(name)) => (model_spec(name, args.n_layer, args.batch.unwrap_or(1), args.seq)?, StepKind::Train),
        (None, None) => bail!("give --workload or --model"),
    };
    let name = workload_name(args);
    if let Some((lo, hi)) = args.documents {
        if spec.loss != LossKind::CrossEntropy {
            bail!(
                "--documents needs a cross-entropy workload (w2, w5, l8-2l, g3-1b, q3moe-4l): packed documents predict their own \
                 tokens"
            );
        }
        spec.documents = true;
        let mut rng = rand::rngs::StdRng::seed_from_u64(0);
        let p = packed_positions(&mut rng, spec.batch, spec.seq, (lo, hi));
        eprintln!(
            "documents of {lo}-{hi} tokens: {:.1}% of the causal 64 x 64 attention tiles see no key",
            100.0 * skipped_tile_fraction(&p, spec.batch, spec.seq)
        );
    }
    let mut opts = StepOptions::new(kind);
    opts.train.adamw.weight_decay = 0.1;
    opts.train.master_weights = args.master_weights.mode();
    if args.state_dtype != crate::StateDTypeArg::Auto && kind != StepKind::Train {
        bail!("--state-dtype needs a train workload (w5, l8-2l, g3-1b, q3moe-4l): {name} has no optimizer");
    }
    args.state_dtype.apply(&mut opts.train, spec.dtype);
    if !(args.clip_grad_norm.is_finite() && args.clip_grad_norm >= 0.0) {
        bail!("--clip-grad-norm must be a finite number >= 0 (0: no clipping), got {}", args.clip_grad_norm);
    }
    if args.clip_grad_norm > 0.0 {
        if kind != StepKind::Train {
            bail!(
                "--clip-grad-norm needs a train workload (w5, l8-2l, g3-1b, q3moe-4l): {name} computes gradients only"
            );
        }
        opts.train.clip_grad_norm = Some(args.clip_grad_norm);
    }
    args.memory.apply(&mut opts, crate::memory_args::free_bytes)?;
    let c = compile_step(&spec, &opts)?;
    let set = switches.not_default_line();
    if !set.is_empty() {
        eprintln!("switches: {set} (not the defaults)");
    }
    eprint!("{}", c.recompute());
    if let Some(p) = c.placement() {
        eprint!("{p}");
    }
    let params = c.param_count() as u64;
    let options = SessionOptions { switches: Some(switches), tf32: args.tf32, ..SessionOptions::default() };
    let mut s = open_cuda_session(c.step, c.plan, options)?;
    Session::init_params(&mut s, 0)?;
    s.zero_state()?;
    let Timed { capture_ms, mut times, loss_first, loss_last } = timed_steps(&mut s, args, &spec, kind)?;
    let (b, t) = (spec.batch, spec.seq);
    times.sort_by(|a, b| a.partial_cmp(b).expect("finite times"));
    let median = if times.len() % 2 == 1 {
        times[times.len() / 2]
    } else {
        (times[times.len() / 2 - 1] + times[times.len() / 2]) / 2.0
    };
    if args.profile {
        crate::profile::print("profile of one eager step", &s.profile()?, 40);
        crate::profile::print_tuning(s.gemm_tuning());
    }
    let mem = s.memory()?;
    let explained = mem.allocation_bytes + mem.modules_bytes + mem.blas_bytes + mem.graph_bytes;
    let flops = model_flops(&spec, kind, params);
    let report = BenchReport {
        workload: name,
        mode: args.mode,
        f32_products: opts.f32_products,
        fp8: opts.fp8,
        fp8_products: c.passes.fp8.as_ref().map_or(0, |r| r.products),
        switches,
        gpu_arch: s.arch.clone(),
        params,
        tokens_per_step: b * t,
        launches_per_step: s.launch_count(),
        planned_peak_bytes: mem.planned_peak_bytes,
        device_peak_bytes: mem.device_peak_bytes,
        unexplained_bytes: mem.device_peak_bytes as i64 - explained as i64,
        capture_ms,
        step_ms_median: median,
        step_ms_min: times[0],
        tokens_per_s: (b * t) as f64 / (median / 1e3),
        model_tflop_per_step: flops / 1e12,
        mfu: device_name(0).ok().and_then(|n| metrics::peak_flops(&n, spec.dtype)).map(|p| flops / (median / 1e3) / p),
        mfu_of_769: flops / (median / 1e3) / 769e12,
        loss_first,
        loss_last,
        memory: mem,
    };
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        let gb = |x: u64| x as f64 / 1e9;
        println!(
            "{} {:?} on {}: planned {:.3} GB, device peak {:.3} GB (allocation {:.3}, modules {:.3}, cuBLASLt {:.3}, graph {:.3}, unexplained {:+.3}), step {:.2} ms median / {:.2} min, {:.0} tokens/s, MFU {} ({:.1}% of the H200's measured 769 TFLOP/s), loss first {} last {}{}",
            report.workload,
            report.mode,
            report.gpu_arch,
            gb(report.planned_peak_bytes),
            gb(report.device_peak_bytes),
            gb(report.memory.allocation_bytes),
            gb(report.memory.modules_bytes),
            gb(report.memory.blas_bytes),
            gb(report.memory.graph_bytes),
            report.unexplained_bytes as f64 / 1e9,
            report.step_ms_median,
            report.step_ms_min,
            report.tokens_per_s,
            report.mfu.map_or("-".to_string(), |m| format!("{:.1}%", 100.0 * m)),
            100.0 * report.mfu_of_769,
            report.loss_first,
            report.loss_last,
            report.capture_ms.map(|c| format!(", capture {c:.1} ms")).unwrap_or_default()
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn g3_1b_is_gemma_3_1b_with_its_sliding_pattern() {
        let (spec, kind) = spec(Workload::G3OneB).unwrap();
        spec.validate().unwrap();
        assert_eq!(
            (kind, spec.batch, spec.seq, spec.config.n_layer, spec.config.head_size),
            (StepKind::Train, 1, 8192, 26, 256)
        );
        // Five sliding layers of 512, then a global one.
        let windows: Vec<usize> = (0..6).map(|l| spec.config.scores(l).window).collect();
        assert_eq!(windows, [512, 512, 512, 512, 512, 0]);
    }

    #[test]
    fn q3moe_4l_is_qwen3_30b_a3b_with_four_sparse_layers() {
        let (spec, kind) = spec(Workload::Qwen3MoeFourLayers).unwrap();
        spec.validate().unwrap();
        let moe = spec.config.moe.as_ref().unwrap();
        assert_eq!((kind, spec.batch, spec.seq, spec.config.n_layer), (StepKind::Train, 1, 4096, 4));
        assert_eq!((moe.experts, moe.experts_per_token, moe.expert_intermediate_size), (128, 8, 768));
        assert!((0..4).all(|l| moe.is_sparse(l)));
    }

    #[test]
    fn a_named_model_is_its_geometry_cut_to_the_layers_asked() {
        let spec = model_spec("Qwen3-0.6B", Some(2), 2, None).unwrap();
        assert_eq!((spec.batch, spec.seq, spec.config.n_layer, spec.dtype), (2, 4096, 2, DType::BF16));
        assert_eq!(spec.config.n_embd, 1024);
        // A model whose block is shorter than 4096 runs at its block size.
        let short = model_spec("pythia-14m", None, 1, None).unwrap();
        assert!(short.config.block_size < 4096 && short.seq == short.config.block_size);
        let e = model_spec("no-such-model", None, 1, None).unwrap_err().to_string();
        assert!(e.contains("no-such-model"), "{e}");
        let e = model_spec("Qwen3-0.6B", None, 1, Some(1 << 20)).unwrap_err().to_string();
        assert!(e.contains("exceeds the block size"), "{e}");
    }

    #[test]
    fn packed_positions_fill_rows_and_count_skipped_tiles() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(1);
        let p = packed_positions(&mut rng, 2, 1000, (100, 300));
        assert_eq!(p.len(), 2000);
        // Every document counts up from 0 and is within the lengths (the
        // last of a row may be cut).
        for row in p.chunks(1000) {
            let starts: Vec<usize> = (0..1000).filter(|&i| row[i] == 0.0).collect();
            for w in starts.windows(2) {
                assert!((100..=300).contains(&(w[1] - w[0])), "{starts:?}");
            }
            assert!((1..1000).all(|i| row[i] == 0.0 || row[i] == row[i - 1] + 1.0));
        }
        // One document per row skips nothing; documents of one tile skip
        // every tile below the diagonal.
        let one: Vec<f64> = (0..256).map(|i| i as f64).collect();
        assert_eq!(skipped_tile_fraction(&one, 1, 256), 0.0);
        let tiles: Vec<f64> = (0..256).map(|i| (i % 64) as f64).collect();
        assert_eq!(skipped_tile_fraction(&tiles, 1, 256), 6.0 / 10.0);
        assert!(parse_lengths("100-1500").is_ok() && parse_lengths("5-2").is_err() && parse_lengths("0-3").is_err());
    }

    /// In graph mode the first loss is the eager warm-up step's, before any
    /// update: the same as an eager run's first loss on the same batch (a
    /// train workload, W5 cut small, whose replay of step 1 follows an update).
    #[test]
    fn the_first_loss_comes_before_any_update_in_either_mode() {
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            bench: BenchArgs,
        }
        let first = |mode: &str| {
            let args = <Cli as clap::Parser>::try_parse_from([
                "bench",
                "--workload",
                "w3",
                "--mode",
                mode,
                "--steps",
                "2",
                "--warmup",
                "0",
            ])
            .unwrap()
            .bench;
            let (spec, kind) = spec(Workload::W5).unwrap();
            let config = spec.config.with_overrides(&tiny()).unwrap();
            let spec = ModelSpec { config, batch: 1, seq: 16, ..spec };
            let c = compile_step(&spec, &StepOptions::new(kind)).unwrap();
            let mut s = stepgraph_core::cpu::exec::CpuSession::new(c.step, c.plan).unwrap();
            Session::init_params(&mut s, 0).unwrap();
            timed_steps(&mut s, &args, &spec, kind).unwrap()
        };
        let (graph, eager) = (first("graph"), first("eager"));
        assert_eq!(graph.loss_first.to_bits(), eager.loss_first.to_bits());
        assert!(graph.capture_ms.is_some() && graph.times.len() == 2);
    }

    /// One small layer, for steps on the CPU.
    fn tiny() -> Overrides {
        Overrides {
            n_layer: Some(1),
            n_embd: Some(64),
            n_head: Some(4),
            n_query_groups: Some(4),
            vocab_size: Some(512),
            intermediate_size: Some(128),
            ..Default::default()
        }
    }

    #[test]
    fn w5_model_flops_are_products_plus_attention() {
        let (spec, kind) = spec(Workload::W5).unwrap();
        // open_llama_3b: 3 426 473 600 parameters, 4 × 2048 tokens, 26 layers of 32 heads of 100.
        let params = 3_426_473_600u64;
        let products = 6.0 * params as f64 * 8192.0;
        let attention = 12.0 * 26.0 * 2048.0 * 3200.0 * 8192.0;
        assert_eq!(kind, StepKind::Train);
        assert!((model_flops(&spec, kind, params) - (products + attention)).abs() < 1.0);
        assert!((model_flops(&spec, StepKind::Forward, params) * 3.0 - (products + attention)).abs() < 1.0);
        // 185.2 TFLOP: at 380.5 ms, 49% of 989 TFLOP/s.
        assert!((model_flops(&spec, kind, params) / 1e12 - 185.2).abs() < 0.1);
    }
}
