//! The `stepgraph` command line: `plan` (the memory plan of a step, without
//! allocating the model; with `--gpus N` the plan of one data-parallel rank
//! next to the 1-GPU plan), `trace` (the forward or step trace as text),
//! `train` (a training run on the CPU backend), `bench` (a benchmark
//! workload on the GPU) and `compare` (one step's loss and gradients against
//! a PyTorch reference, on the CPU or the CUDA backend).

mod bench;
mod compare;

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};
use rand::{Rng, SeedableRng};

use stepgraph_core::autodiff::{build_step, StepKind, TrainOptions, LR_INPUT, STEP_INPUT};
use stepgraph_core::cpu::exec::CpuSession;
use stepgraph_core::dist::{plan_data_parallel, DataParallel, DEFAULT_BUCKET_BYTES};
use stepgraph_core::ir::{DType, Trace, ValueKind};
use stepgraph_core::models::gpt::{TARGETS_INPUT, TOKENS_INPUT};
use stepgraph_core::models::{build_forward, init_params, Config, LossKind, ModelSpec, Overrides};
use stepgraph_core::plan::{check_plan, plan, plan_report, PlanOptions};
use stepgraph_core::testing::HostTensor;

#[derive(Parser)]
#[command(name = "stepgraph", version, about = "Compile a whole training step into one planned program")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Plan the memory of one step (no model is allocated) and report it.
    Plan {
        #[command(flatten)]
        model: ModelArgs,
        /// Print the report as JSON.
        #[arg(long)]
        json: bool,
        /// How many of the largest values live at the peak to list.
        #[arg(long, default_value_t = 10)]
        top: usize,
        /// Plan one rank of data-parallel training over N GPUs, next to the
        /// 1-GPU plan; `--batch` is the global batch, split by rows over the GPUs.
        #[arg(long)]
        gpus: Option<usize>,
        /// With --gpus: shard the AdamW state over the GPUs (ZeRO-1; needs --step train).
        #[arg(long, requires = "gpus")]
        zero1: bool,
        /// With --gpus: gradient bucket size in MiB, like PyTorch DDP's bucket_cap_mb [default: 25].
        #[arg(long, requires = "gpus")]
        bucket_mb: Option<f64>,
    },
    /// Print a trace as text.
    Trace {
        #[command(flatten)]
        model: ModelArgs,
        /// Which trace: the forward pass, or the step (`--step`).
        #[arg(long, value_enum, default_value_t = Which::Step)]
        which: Which,
    },
    /// Run a benchmark workload of BENCHMARKS.md on the GPU (eager or as one CUDA graph).
    Bench(bench::BenchArgs),
    /// Compare one grads step's loss and gradients with a PyTorch reference (torch_reference.py --save DIR).
    Compare(compare::CompareArgs),
    /// Train on a text file on the CPU backend (byte-level tokens).
    Train {
        #[command(flatten)]
        model: ModelArgs,
        /// Text to train on.
        #[arg(long, default_value = "data/tiny.txt")]
        data: PathBuf,
        /// Optimizer steps.
        #[arg(long, default_value_t = 200)]
        steps: usize,
        /// Peak learning rate.
        #[arg(long, default_value_t = 3e-3)]
        lr: f64,
        /// Linear warm-up steps.
        #[arg(long, default_value_t = 10)]
        warmup: usize,
        /// AdamW weight decay.
        #[arg(long, default_value_t = 0.0)]
        weight_decay: f64,
        /// Keep the AdamW moments in float32 (default: the parameter dtype, as PyTorch).
        #[arg(long)]
        f32_state: bool,
        /// Seed for initial weights and batch sampling.
        #[arg(long, default_value_t = 0)]
        seed: u64,
    },
}

#[derive(Copy, Clone, ValueEnum)]
enum Which {
    Forward,
    Step,
}

#[derive(Copy, Clone, ValueEnum)]
enum DTypeArg {
    F32,
    Bf16,
    F16,
}

#[derive(Copy, Clone, ValueEnum)]
enum LossArg {
    Sum,
    Ce,
}

#[derive(Copy, Clone, ValueEnum)]
enum StepArg {
    Forward,
    Grads,
    Train,
}

/// Flags shared by every subcommand: which model, which batch, which step.
#[derive(Args, Clone)]
struct ModelArgs {
    /// A litgpt or Hugging Face model name (e.g. open_llama_3b, Qwen/Qwen2.5-7B) or a test config (tiny-llama).
    #[arg(long, default_value = "tiny-llama")]
    model: String,
    /// A Hugging Face config.json (or its directory) instead of a named model.
    #[arg(long)]
    config: Option<PathBuf>,
    #[arg(long)]
    n_layer: Option<usize>,
    #[arg(long)]
    n_embd: Option<usize>,
    #[arg(long)]
    n_head: Option<usize>,
    #[arg(long)]
    n_query_groups: Option<usize>,
    #[arg(long)]
    vocab: Option<usize>,
    #[arg(long)]
    block_size: Option<usize>,
    #[arg(long)]
    intermediate_size: Option<usize>,
    #[arg(long, default_value_t = 1)]
    batch: usize,
    /// Tokens per sequence (default: the block size, at most 2048).
    #[arg(long)]
    seq: Option<usize>,
    #[arg(long, value_enum, default_value_t = DTypeArg::F32)]
    dtype: DTypeArg,
    #[arg(long, value_enum, default_value_t = LossArg::Ce)]
    loss: LossArg,
    /// What one step computes (default: grads for plan/trace, train for train).
    #[arg(long, value_enum)]
    step: Option<StepArg>,
}

impl ModelArgs {
    fn config(&self) -> Result<Config> {
        let base = match &self.config {
            Some(path) => Config::from_hf_file(path)?,
            None => Config::named(&self.model)?,
        };
        let o = Overrides {
            n_layer: self.n_layer,
            n_embd: self.n_embd,
            n_head: self.n_head,
            n_query_groups: self.n_query_groups,
            vocab_size: self.vocab,
            block_size: self.block_size,
            intermediate_size: self.intermediate_size,
        };
        Ok(base.with_overrides(&o)?)
    }

    fn spec(&self) -> Result<ModelSpec> {
        let config = self.config()?;
        let seq = self.seq.unwrap_or(config.block_size.min(2048));
        Ok(ModelSpec {
            batch: self.batch,
            seq,
            dtype: match self.dtype {
                DTypeArg::F32 => DType::F32,
                DTypeArg::Bf16 => DType::BF16,
                DTypeArg::F16 => DType::F16,
            },
            loss: match self.loss {
                LossArg::Sum => LossKind::Sum,
                LossArg::Ce => LossKind::CrossEntropy,
            },
            config,
        })
    }

    fn step_kind(&self, default: StepKind) -> StepKind {
        match self.step {
            None => default,
            Some(StepArg::Forward) => StepKind::Forward,
            Some(StepArg::Grads) => StepKind::Grads,
            Some(StepArg::Train) => StepKind::Train,
        }
    }
}

fn step_trace(args: &ModelArgs, default: StepKind, opts: &TrainOptions) -> Result<(ModelSpec, Trace, Trace)> {
    let spec = args.spec()?;
    let forward = build_forward(&spec)?;
    let step = build_step(&forward, args.step_kind(default), opts)?;
    Ok((spec, forward, step))
}

fn main() {
    let cli = Cli::parse();
    if let Err(e) = run(cli) {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Plan { model, json, top, gpus: Some(gpus), zero1, bucket_mb } => {
            let bucket_bytes = match bucket_mb {
                None => DEFAULT_BUCKET_BYTES,
                Some(mb) if mb.is_finite() && mb * 1048576.0 >= 1.0 => (mb * 1048576.0).round() as u64,
                Some(mb) => bail!("--bucket-mb must be a positive size in MiB, got {mb}"),
            };
            let dp = DataParallel { world: gpus, bucket_bytes, zero1 };
            let kind = model.step_kind(StepKind::Grads);
            if zero1 && kind != StepKind::Train {
                bail!("--zero1 shards the AdamW state, so it needs a train step: add --step train");
            }
            let report = plan_data_parallel(&model.spec()?, kind, &TrainOptions::default(), &dp, top)?;
            if json {
                println!("{}", serde_json::to_string_pretty(&report)?);
            } else {
                print!("{report}");
            }
        }
        Command::Plan { model, json, top, .. } => {
            let (_, _, step) = step_trace(&model, StepKind::Grads, &TrainOptions::default())?;
            let p = plan(&step, PlanOptions::default())?;
            check_plan(&step, &p)?;
            let report = plan_report(&step, &p, top);
            if json {
                println!("{}", serde_json::to_string_pretty(&report)?);
            } else {
                print!("{report}");
            }
        }
        Command::Trace { model, which } => {
            let (_, forward, step) = step_trace(&model, StepKind::Grads, &TrainOptions::default())?;
            match which {
                Which::Forward => print!("{forward}"),
                Which::Step => print!("{step}"),
            }
        }
        Command::Bench(args) => bench::run(&args)?,
        Command::Compare(args) => compare::run(&args)?,
        Command::Train { model, data, steps, lr, warmup, weight_decay, f32_state, seed } => {
            train(&model, &data, steps, lr, warmup, weight_decay, f32_state, seed)?;
        }
    }
    Ok(())
}

#[allow(clippy::too_many_arguments)]
fn train(
    args: &ModelArgs,
    data: &PathBuf,
    steps: usize,
    lr: f64,
    warmup: usize,
    weight_decay: f64,
    f32_state: bool,
    seed: u64,
) -> Result<()> {
    if !matches!(args.loss, LossArg::Ce) {
        bail!("training needs the cross-entropy loss (--loss ce)");
    }
    let text = std::fs::read(data).with_context(|| format!("reading training text {}", data.display()))?;
    let mut opts = TrainOptions { state_dtype: f32_state.then_some(DType::F32), ..TrainOptions::default() };
    opts.adamw.weight_decay = weight_decay;
    let (spec, _, step) = step_trace(args, StepKind::Train, &opts)?;
    if spec.config.vocab_size < 256 {
        bail!(
            "byte-level training needs a vocabulary of at least 256 tokens; `{}` has {}",
            spec.config.name,
            spec.config.vocab_size
        );
    }
    let (bsz, seq) = (spec.batch, spec.seq);
    if text.len() < seq + 2 {
        bail!("{} has {} bytes; a sequence of {seq} tokens needs at least {}", data.display(), text.len(), seq + 2);
    }
    let p = plan(&step, PlanOptions::default())?;
    check_plan(&step, &p)?;
    let planned = p.planned_peak_bytes();
    let mut session = CpuSession::new(step, p)?;
    let params: Vec<_> = session.trace().params().collect();
    let forward = build_forward(&spec)?;
    for (fp, value) in init_params(&forward, seed) {
        let name = forward.value(fp).kind.leaf_name().unwrap_or_default().to_string();
        session.write_named(&name, &value)?;
    }
    let states: Vec<_> = session
        .trace()
        .leaves()
        .filter(|v| matches!(session.trace().value(*v).kind, ValueKind::State { .. }))
        .collect();
    for s in states {
        let zeros = HostTensor::zeros(session.trace().ty(s).clone());
        session.write(s, &zeros)?;
    }
    eprintln!(
        "training {} ({} parameters, {} layers) on {} ({} bytes): batch {bsz} x {seq} tokens, {steps} steps, planned {:.1} MB",
        spec.config.name,
        params.iter().map(|p| session.trace().ty(*p).numel()).sum::<usize>(),
        spec.config.n_layer,
        data.display(),
        text.len(),
        planned as f64 / 1e6
    );
    let record = session.record();
    let bar = ProgressBar::new(steps as u64);
    bar.set_style(
        ProgressStyle::with_template("{spinner} [{elapsed_precise}] {bar:30} {pos}/{len} {msg}")
            .expect("valid template"),
    );
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed ^ 0x5eed);
    let ids_ty = session.trace().ty(session.trace().leaf_by_name(TOKENS_INPUT).expect("tokens input")).clone();
    let (mut first, mut last) = (f64::NAN, f64::NAN);
    let t0 = Instant::now();
    for it in 1..=steps {
        let mut tokens = Vec::with_capacity(bsz * seq);
        let mut targets = Vec::with_capacity(bsz * seq);
        for _ in 0..bsz {
            let o = rng.gen_range(0..text.len() - seq - 1);
            tokens.extend(text[o..o + seq].iter().map(|&b| b as f64));
            targets.extend(text[o + 1..o + seq + 1].iter().map(|&b| b as f64));
        }
        let lr_now = if it <= warmup { lr * it as f64 / warmup.max(1) as f64 } else { lr };
        session.write_named(TOKENS_INPUT, &HostTensor::from_f64(ids_ty.clone(), &tokens))?;
        session.write_named(TARGETS_INPUT, &HostTensor::from_f64(ids_ty.clone(), &targets))?;
        session.write_named(LR_INPUT, &stepgraph_core::cpu::exec::scalar_input(lr_now))?;
        session.write_named(STEP_INPUT, &stepgraph_core::cpu::exec::scalar_input(it as f64))?;
        session.replay()?;
        let loss = session.loss()?;
        if !loss.is_finite() {
            bar.abandon();
            bail!("the loss became {loss} at step {it}: lower the learning rate (--lr, now {lr})");
        }
        if it == 1 {
            first = loss;
        }
        last = loss;
        let tps = (it * bsz * seq) as f64 / t0.elapsed().as_secs_f64();
        bar.set_message(format!("loss {loss:.4}  {tps:.0} tok/s"));
        bar.inc(1);
    }
    bar.finish();
    println!(
        "final loss {last:.4} (first {first:.4}) after {steps} steps in {:.1}s; launch list recorded in {:.2} ms",
        t0.elapsed().as_secs_f64(),
        record.as_secs_f64() * 1e3
    );
    Ok(())
}
