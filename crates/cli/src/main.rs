//! The `stepgraph` command line: `plan` (the memory plan of a step, without
//! allocating the model; with `--gpus N` the plan of one data-parallel rank
//! next to the 1-GPU plan), `trace` (the forward or step trace as text),
//! `train` (a training run on the CPU backend, or data-parallel on N GPUs
//! with `--gpus N`: one process per GPU, see [`train`]), `bench` (a benchmark
//! workload on the GPU) and `compare` (one step's loss and gradients against
//! a PyTorch reference, on the CPU or the CUDA backend).

mod bench;
mod compare;
mod train;

use std::path::PathBuf;

use anyhow::{bail, Result};
use clap::{Args, Parser, Subcommand, ValueEnum};

use stepgraph_core::autodiff::{StepKind, TrainOptions};
use stepgraph_core::dist::{plan_data_parallel, DataParallel, DEFAULT_BUCKET_BYTES};
use stepgraph_core::ir::DType;
use stepgraph_core::models::{Config, LossKind, ModelSpec, Overrides};
use stepgraph_core::pipeline::{compile_step, trace_step, StepOptions};
use stepgraph_core::plan::plan_report;

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
    /// Train on a text file (byte-level tokens) on the CPU backend, or data-parallel on N GPUs (--gpus N).
    Train {
        #[command(flatten)]
        model: ModelArgs,
        #[command(flatten)]
        train: train::TrainArgs,
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
            let c = compile_step(&model.spec()?, &StepOptions::new(model.step_kind(StepKind::Grads)))?;
            let report = plan_report(&c.step, &c.plan, top);
            if json {
                println!("{}", serde_json::to_string_pretty(&report)?);
            } else {
                print!("{report}");
            }
        }
        Command::Trace { model, which } => {
            let t = trace_step(&model.spec()?, &StepOptions::new(model.step_kind(StepKind::Grads)))?;
            match which {
                Which::Forward => print!("{}", t.forward),
                Which::Step => print!("{}", t.step),
            }
        }
        Command::Bench(args) => bench::run(&args)?,
        Command::Compare(args) => compare::run(&args)?,
        Command::Train { model, train } => train::run(&model, &train)?,
    }
    Ok(())
}
