//! `stepgraph train`: a training run, on the CPU, on one GPU, or
//! data-parallel on N GPUs.
//!
//! **Where it runs.** `--device cpu|cuda` (default: cuda when this machine
//! has an NVIDIA GPU) and `--gpus N`. The CPU and one GPU (`--device cuda`
//! or `--gpus 1`) run in this process on a step without collectives, so a
//! one-GPU run never loads NCCL and holds only its plan (plus the usual few
//! MB of modules and cuBLASLt). `--gpus N` with N > 1 is the launcher
//! ([`launch`]): it starts N rank processes that join one NCCL group; rank
//! `r` runs on GPU `r`, builds its step of the data-parallel trace, writes
//! the same initial weights as every rank and trains on its rows of the
//! same global batch. Only rank 0 prints, evaluates and writes metrics.
//!
//! **The run.** The settings in force are printed first (the learning rate,
//! warm-up and cosine floor chosen from the model's size when not given:
//! [`schedule`]), then the memory plan. Each step writes its batch
//! ([`data::TrainData`]), its learning rate and its count as step inputs and
//! runs the step: on the CPU by replaying its recorded launch list from
//! step 1, on a GPU eagerly at the first step (modules, and NCCL connecting
//! ranks) and as one captured CUDA graph after, unless `--eager`. Every
//! `--eval-every` steps a second, forward-only step evaluates the held-out
//! split ([`Evaluator`]). A non-finite loss stops the run with the step and
//! what went non-finite first, before any checkpoint of that step is saved.
//!
//! **Checkpoints and resume** ([`checkpoint`]): with `--checkpoint-dir`,
//! every `--save-every` steps and at the end; `--resume auto` continues
//! from the newest complete one with the same weights, moments, schedule
//! and batch order, so the resumed run equals the uninterrupted one bit for
//! bit. **Metrics** ([`metrics`]): a JSONL row per step and per validation.
//! **Settings** may come from a TOML file ([`config_file`]).
//!
//! **Models in and out.** `--init-from DIR` takes the model from a Hugging
//! Face folder's `config.json` ([`model_spec`]; the flags that would change
//! its geometry are refused), fits its weights to the step before any
//! session allocates, and loads them tensor by tensor ([`init_weights`]);
//! the default learning rate is then a fine-tuning one. `--out DIR` is
//! checked before step 1 and written at the last step
//! ([`save_final_model`]): a folder `transformers` loads, replaced
//! atomically, with the tokenizer files of `--tokenizer` or `--init-from`.
//!
//! **Data** ([`data`]): byte-level text, or a token file of `stepgraph
//! prepare` (known by its magic bytes) whose ids are checked against the
//! embedding before anything is compiled. A batch with a part (a rank's
//! rows) whose targets the loss mask covers entirely has no loss and is
//! skipped ([`next_usable_batch`]).

pub mod checkpoint;
pub mod config_file;
pub mod data;
pub mod divergence;
pub mod launch;
pub mod lock;
pub mod metrics;
pub mod schedule;
pub mod signals;

use std::collections::BTreeMap;
use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::{Args, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};

use stepgraph_core::autodiff::{DecayScope, StepKind, GRAD_NORM_OUTPUT, LR_INPUT, STEP_INPUT};
use stepgraph_core::cpu::exec::{scalar_input, CpuSession};
use stepgraph_core::dist::{rank_batch, shard_rows, DataParallel, DEFAULT_BUCKET_BYTES};
use stepgraph_core::host::HostTensor;
use stepgraph_core::ir::{DType, OutputKind, Trace, ValueKind};
use stepgraph_core::models::gpt::{IGNORE_INDEX, TARGETS_INPUT, TOKENS_INPUT};
use stepgraph_core::models::hf_dir::{save_hf_dir, HfFamily, HfModelDir, SaveOptions, SaveReport};
use stepgraph_core::models::ModelSpec;
use stepgraph_core::pipeline::{compile_step, compile_step_timed, trace_step, CompiledStep, StepOptions};
use stepgraph_core::plan::plan_report;
use stepgraph_core::session::{Session, SessionMemory, StartupTimes};
use stepgraph_cuda::nccl::{NcclGroup, NcclId};
use stepgraph_cuda::session::{device_name, gpu_available, CudaOptions, CudaSession, RankOptions};
use stepgraph_cuda::Switches;

use crate::memory_args::{free_bytes, MemoryArgs};
use crate::output_paths::{check_writable, refuse_overwriting_inputs};
use crate::{LossArg, ModelArgs, OptimArgs};
use checkpoint::{CheckpointDir, CheckpointState};
use data::TrainData;
use divergence::DivergenceMonitor;
use lock::RunLock;
use metrics::MetricsFile;
use schedule::LrSchedule;

/// Where a single-process run trains.
#[derive(Copy, Clone, Debug, PartialEq, ValueEnum)]
pub enum DeviceArg {
    Cpu,
    Cuda,
}

/// `stepgraph train`'s own flags (the model flags are shared).
#[derive(Args, Clone, Debug)]
pub struct TrainArgs {
    /// What to train on: a token file written by `stepgraph prepare` (known
    /// by its header), or any other file as byte-level text (one token per byte).
    #[arg(long, default_value = "data/tiny.txt")]
    pub data: PathBuf,
    /// Start from a Hugging Face model folder (config.json and safetensors
    /// weights): the model comes from its config.json, the weights are
    /// loaded and cast to --dtype, and the default learning rate is a
    /// fine-tuning one.
    #[arg(long, value_name = "DIR", conflicts_with_all = ["model", "config"])]
    pub init_from: Option<PathBuf>,
    /// At the end of the run, write the model as a Hugging Face folder here
    /// (config.json, safetensors shards and index, the tokenizer files),
    /// replacing a previous save atomically.
    #[arg(long, value_name = "DIR")]
    pub out: Option<PathBuf>,
    /// The model's tokenizer folder (or its tokenizer.json): token files of --data must be made with it, and
    /// --out copies its files [default: the --init-from folder's].
    #[arg(long, value_name = "DIR")]
    pub tokenizer: Option<PathBuf>,
    /// With --out: the largest weight file in MiB; larger models are sharded with an index [default: 5 GB].
    #[arg(long, value_name = "MIB", requires = "out")]
    pub max_shard_mb: Option<f64>,
    /// Optimizer steps of the whole run.
    #[arg(long, default_value_t = 200)]
    pub steps: usize,
    /// Peak learning rate [default: from the model's size; printed at start].
    #[arg(long)]
    pub lr: Option<f64>,
    /// Linear warm-up steps [default: 5% of --steps, at most 2000].
    #[arg(long)]
    pub warmup: Option<usize>,
    /// The learning rate the cosine decay ends at, on the last step [default: 10% of the peak].
    #[arg(long)]
    pub min_lr: Option<f64>,
    /// The cosine floor as a fraction of the peak learning rate (instead of --min-lr).
    #[arg(long, conflicts_with = "min_lr")]
    pub min_lr_ratio: Option<f64>,
    /// Stop (exit non-zero) at the step the loss diverges: the mean of the
    /// last 5 losses above twice its best and 1 nat over it, or the
    /// uniform model's loss with a zero gradient; without it a warning is
    /// printed at that step. Either way --keep keeps the last checkpoint
    /// saved before the best loss.
    #[arg(long)]
    pub fail_on_divergence: bool,
    /// When stderr is not a terminal, log the loss every N steps (0: never).
    #[arg(long, default_value_t = 10)]
    pub log_every: usize,
    /// Seed for initial weights and batch sampling.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Evaluate the loss and perplexity on the held-out split every N steps and at the end (0: never).
    #[arg(long, default_value_t = 50)]
    pub eval_every: usize,
    /// Batches of the held-out split each evaluation runs.
    #[arg(long, default_value_t = 4)]
    pub eval_batches: usize,
    /// The fraction at the end of the text held out for validation.
    #[arg(long, default_value_t = 0.1)]
    pub val_fraction: f64,
    /// Save checkpoints in DIR (one `step-NNNNNN/` each); without it none are saved.
    #[arg(long)]
    pub checkpoint_dir: Option<PathBuf>,
    /// With --checkpoint-dir: also save every N steps, not only at the end (0: only at the end).
    #[arg(long, default_value_t = 0)]
    pub save_every: usize,
    /// With --checkpoint-dir: keep the newest K checkpoints, deleting older ones.
    #[arg(long, default_value_t = 3)]
    pub keep: usize,
    /// Continue a run: `auto` (the newest complete checkpoint in --checkpoint-dir,
    /// or a fresh start when there is none) or a checkpoint's `step-NNNNNN` directory.
    #[arg(long)]
    pub resume: Option<String>,
    /// Stop after step N of the --steps run (saving a checkpoint), to continue later with --resume.
    #[arg(long)]
    pub stop_after: Option<usize>,
    /// A JSONL file with one row per step and per validation [default: metrics.jsonl in --checkpoint-dir].
    #[arg(long)]
    pub metrics: Option<PathBuf>,
    /// Read flags from a TOML file whose keys are this command's flag names
    /// (`steps = 100`, `n-layer = 2` or `n_layer = 2`, `zero1 = true`); flags
    /// on the command line override it.
    #[arg(long)]
    pub run_config: Option<PathBuf>,
    /// Train on the CPU or on one GPU [default: cuda when this machine has an NVIDIA GPU].
    #[arg(long, value_enum)]
    pub device: Option<DeviceArg>,
    /// Train on N GPUs: 1 is the same as --device cuda; N > 1 trains
    /// data-parallel through NCCL, one process per GPU (`--batch` is the
    /// global batch, split by rows).
    #[arg(long)]
    pub gpus: Option<usize>,
    /// With --gpus: shard the AdamW state over the GPUs (ZeRO-1).
    #[arg(long, requires = "gpus")]
    pub zero1: bool,
    /// With --gpus: gradient bucket size in MiB, like PyTorch DDP's bucket_cap_mb [default: 25].
    #[arg(long, requires = "gpus")]
    pub bucket_mb: Option<f64>,
    /// With --gpus: run every step eagerly instead of replaying a captured CUDA graph.
    #[arg(long, requires = "gpus")]
    pub eager: bool,
    /// With --gpus: run the collectives on a second stream, overlapping the
    /// backward work that does not touch their gradients.
    #[arg(long, requires = "gpus")]
    pub overlap: bool,
    /// Set by the launcher: this process is rank R (on GPU R) of a --gpus run.
    #[arg(long, hide = true, requires_all = ["gpus", "nccl_id"])]
    pub rank: Option<usize>,
    /// Set by the launcher: the file holding the group's NCCL unique id (hex).
    #[arg(long, hide = true, requires = "rank")]
    pub nccl_id: Option<PathBuf>,
}

/// What this process does.
#[derive(Clone, Debug, PartialEq)]
pub enum Role {
    /// Train on the CPU backend.
    Cpu,
    /// Train on GPU 0 in this process, with no collectives and no NCCL.
    Gpu,
    /// Start `gpus` rank processes and wait for them.
    Launcher { gpus: usize },
    /// Rank `rank` of `world`, joining the group through the id in `id_file`.
    Rank { rank: usize, world: usize, id_file: PathBuf },
}

impl TrainArgs {
    /// The role of this process; `gpu_present` is whether the machine has
    /// a GPU (the default device follows it).
    pub fn role(&self, gpu_present: bool) -> Result<Role> {
        let cpu_asked = self.device == Some(DeviceArg::Cpu);
        match (self.gpus, self.rank, &self.nccl_id) {
            (Some(0), _, _) => bail!("--gpus must be at least 1, got 0"),
            (Some(gpus), None, _) if cpu_asked => {
                bail!("--device cpu and --gpus {gpus} contradict each other: drop one")
            }
            (Some(1), None, _) => {
                // One GPU has no group: nothing to shard, reduce or overlap.
                let group_flag =
                    [(self.zero1, "--zero1"), (self.overlap, "--overlap"), (self.bucket_mb.is_some(), "--bucket-mb")]
                        .into_iter()
                        .find_map(|(set, flag)| set.then_some(flag));
                if let Some(flag) = group_flag {
                    bail!("{flag} applies to data-parallel runs over several GPUs; --gpus 1 trains on one GPU without collectives");
                }
                Ok(Role::Gpu)
            }
            (Some(gpus), None, _) => Ok(Role::Launcher { gpus }),
            (Some(world), Some(rank), Some(id)) if rank < world => Ok(Role::Rank { rank, world, id_file: id.clone() }),
            (Some(world), Some(rank), Some(_)) => bail!("--rank {rank} is outside a group of {world} GPUs"),
            (_, Some(_), _) => bail!("--rank needs --gpus and --nccl-id (all are set by the launcher)"),
            (None, None, _) => match self.device {
                Some(DeviceArg::Cpu) => Ok(Role::Cpu),
                Some(DeviceArg::Cuda) => Ok(Role::Gpu),
                None if gpu_present => Ok(Role::Gpu),
                None => Ok(Role::Cpu),
            },
        }
    }

    /// The files and folders the run reads, by flag: no output may be one of them.
    pub fn inputs(&self) -> Vec<(&'static str, &Path)> {
        let mut inputs = vec![("--data", self.data.as_path())];
        let optional =
            [("--init-from", &self.init_from), ("--tokenizer", &self.tokenizer), ("--run-config", &self.run_config)];
        inputs.extend(optional.into_iter().filter_map(|(flag, p)| p.as_deref().map(|p| (flag, p))));
        if let Some(r) = self.resume.as_deref().filter(|r| *r != "auto") {
            inputs.push(("--resume", Path::new(r)));
        }
        inputs
    }

    pub fn data_parallel(&self, world: usize) -> Result<DataParallel> {
        let bucket_bytes = match self.bucket_mb {
            None => DEFAULT_BUCKET_BYTES,
            Some(mb) if mb.is_finite() && mb * 1048576.0 >= 1.0 => (mb * 1048576.0).round() as u64,
            Some(mb) => bail!("--bucket-mb must be a positive size in MiB, got {mb}"),
        };
        Ok(DataParallel { world, bucket_bytes, zero1: self.zero1 })
    }

    /// The learning-rate schedule: the flags, or the defaults for a model
    /// of `params` parameters, each with where it came from.
    pub fn schedule(&self, params: usize, fine_tuning: bool) -> Result<(LrSchedule, [String; 3])> {
        let (peak, peak_src) = match self.lr {
            Some(lr) => (lr, "--lr".to_string()),
            None => {
                let d = schedule::default_peak_lr(params, fine_tuning);
                let what = if fine_tuning { "fine-tuning" } else { "pre-training" };
                (d.value, format!("default for {what} {:.1}M parameters: {}", params as f64 / 1e6, d.source))
            }
        };
        if !(peak.is_finite() && peak >= 0.0) {
            bail!("--lr must be a finite non-negative learning rate, got {peak}");
        }
        let (warmup, warmup_src) = match self.warmup {
            Some(w) => (w, "--warmup".to_string()),
            None => {
                let d = schedule::default_warmup(self.steps);
                (d.value, format!("default: {}", d.source))
            }
        };
        let (min, min_src) = match (self.min_lr, self.min_lr_ratio) {
            (Some(m), _) => (m, "--min-lr".to_string()),
            (None, Some(r)) if r.is_finite() && (0.0..=1.0).contains(&r) => (peak * r, format!("--min-lr-ratio {r}")),
            (None, Some(r)) => bail!("--min-lr-ratio must lie in [0, 1], got {r}"),
            (None, None) => (
                peak * schedule::DEFAULT_MIN_LR_RATIO,
                format!("default: {}% of the peak", schedule::DEFAULT_MIN_LR_RATIO * 100.0),
            ),
        };
        Ok((LrSchedule::new(peak, warmup, min, self.steps)?, [peak_src, warmup_src, min_src]))
    }
}

/// `stepgraph train`.
pub fn run(model: &ModelArgs, optim: &OptimArgs, args: &TrainArgs, memory: &MemoryArgs) -> Result<()> {
    let role = args.role(gpu_available())?;
    let switches = Switches::from_env()?;
    if args.steps == 0 {
        bail!("--steps 0 trains nothing: ask for at least 1 step");
    }
    if let Some(n) = args.stop_after {
        if n == 0 || n > args.steps {
            bail!("--stop-after {n} must be a step of the run, from 1 to --steps {}", args.steps);
        }
    }
    if args.eval_every > 0 && args.eval_batches == 0 {
        bail!("--eval-batches 0 evaluates nothing: ask for at least 1, or turn validation off with --eval-every 0");
    }
    if args.keep == 0 {
        bail!("--keep 0 would delete every checkpoint: keep at least 1");
    }
    if !matches!(model.loss, LossArg::Ce) {
        bail!("training needs the cross-entropy loss (--loss ce)");
    }
    if args.resume.as_deref() == Some("auto") && args.checkpoint_dir.is_none() {
        bail!("--resume auto looks for checkpoints in --checkpoint-dir: give the directory");
    }
    let ckpt = checkpoint_dir(args);
    if let (Some(n), None) = (args.stop_after, &ckpt) {
        bail!(
            "--stop-after {n} stops the run to continue it later, which needs a checkpoint to continue from: \
             give a --checkpoint-dir"
        );
    }
    // No output may be an input: checked before anything is created.
    let inputs = args.inputs();
    if let Some(out) = &args.out {
        refuse_overwriting_inputs("--out", out, &inputs)?;
    }
    if let Some(metrics) = &args.metrics {
        refuse_overwriting_inputs("--metrics", metrics, &inputs)?;
    }
    if let Some(dir) = &args.checkpoint_dir {
        let not_resume: Vec<_> = inputs.iter().copied().filter(|(flag, _)| *flag != "--resume").collect();
        refuse_overwriting_inputs("--checkpoint-dir", dir, &not_resume)?;
    }
    // A checkpoint to resume from is checked before its directory is locked
    // (which would create a directory for a mistyped path).
    if let Some(path) = args.resume.as_deref().filter(|r| *r != "auto") {
        checkpoint::read_complete(Path::new(path))?;
    }
    // One run per checkpoint directory, taken before anything reads or
    // writes it; the ranks of a --gpus run work under their launcher's lock.
    let _lock = match (&ckpt, &role) {
        (Some(dir), Role::Cpu | Role::Gpu | Role::Launcher { .. }) => {
            let lock = RunLock::acquire(&dir.root)?;
            if let Some(previous) = &lock.took_over {
                eprintln!(
                    "note: {} was left by a run that has ended ({previous}); this run takes it over",
                    lock.path().display()
                );
            }
            Some(lock)
        }
        _ => None,
    };
    let (spec, pretrained) = model_spec(model, args.init_from.as_deref())?;
    let out = match &args.out {
        Some(dir) => Some(OutTarget::new(dir, args, &spec, pretrained.as_ref())?),
        None => None,
    };
    spec.validate()?;
    let mut opts = optim.step_options(StepKind::Train, spec.dtype, args.zero1 && args.gpus.is_some_and(|g| g > 1))?;
    // The data before anything is compiled: a token id the model has no
    // embedding row for is refused here, naming the file. Its batches hold
    // every micro-batch of a step.
    let mut data = data::open(&args.data, spec.batch * opts.grad_accum, spec.seq, args.val_fraction, args.seed)?;
    data.check_vocab(spec.config.padded_vocab_size, &spec.config.name)?;
    data::check_tokenizer(data.as_ref(), args.tokenizer.as_deref(), args.init_from.as_deref())?;
    // Every rank must build the same step: a budget measured per process
    // could differ between them.
    let auto_budget = memory.memory_budget.as_deref().is_some_and(|b| b.trim().eq_ignore_ascii_case("auto"));
    if auto_budget && args.gpus.is_some_and(|g| g > 1) {
        bail!("--memory-budget auto with --gpus: give a size, so that every rank plans the same step");
    }
    memory.apply(&mut opts, free_bytes)?;
    let (rank, world) = match &role {
        Role::Cpu => (0, 1),
        Role::Gpu => {
            if !gpu_available() {
                let asked = if args.gpus == Some(1) { "--gpus 1" } else { "--device cuda" };
                bail!(
                    "{asked} needs 1 NVIDIA GPU, and this machine shows 0 (no driver or no GPU): train on the CPU \
                     with --device cpu"
                );
            }
            (0, 1)
        }
        Role::Launcher { gpus } => {
            // The ranks' step, built once here so that a step the group cannot
            // run (a batch or a parameter that does not split) fails before
            // any process starts, with one message instead of N.
            opts.data_parallel = Some(args.data_parallel(*gpus)?);
            let traces = trace_step(&spec, &opts)?;
            if let Some(hf) = &pretrained {
                hf.check(&traces.forward)?;
            }
            return launch::launch(*gpus);
        }
        Role::Rank { rank, world, .. } => {
            opts.data_parallel = Some(args.data_parallel(*world)?);
            (*rank, *world)
        }
    };
    let (compiled, compile_times) = compile_step_timed(&spec, &opts)?;
    if role == Role::Cpu {
        // Before any batch is drawn; the session checks again as it allocates.
        stepgraph_core::cpu::memory::check_fits(compiled.plan.planned_peak_bytes(), "the planned training step")?;
    }
    // The pretrained weights must fit the step's parameters (names, shapes,
    // dtypes that cast) before any session allocates device memory.
    if let Some(hf) = &pretrained {
        hf.check(&compiled.forward)?;
    }
    let params: usize = compiled.forward.params().map(|p| compiled.forward.ty(p).numel()).sum();
    if rank == 0 {
        check_outputs(args, &compiled.step, ckpt.as_ref())?;
    }
    let (schedule, sources) = args.schedule(params, pretrained.is_some())?;
    let eval_step = if args.eval_every > 0 && rank == 0 {
        data.validation_batches(1)?;
        Some(compile_step(&compiled.spec, &StepOptions::new(StepKind::Forward))?)
    } else {
        None
    };
    if ckpt.is_none() && args.save_every > 0 {
        bail!("--save-every {} saves checkpoints: give them a --checkpoint-dir", args.save_every);
    }
    let run_id = run_identity(&spec, &opts, world, args, &switches)?;
    let legacy_id = legacy_run_identity(&spec, &compiled.step, &opts, world, args);
    let resume_from = match (&args.resume, &ckpt) {
        (None, Some(dir)) => {
            if let Some((step, path)) = dir.newest()? {
                bail!(
                    "{} already holds checkpoints (the newest is step {step}, {}): continue that run with \
                     --resume auto, or start a new one in another --checkpoint-dir",
                    dir.root.display(),
                    path.display()
                );
            }
            None
        }
        (None, None) => None,
        (Some(r), Some(dir)) if r == "auto" => {
            let checkpoint::Scan { complete, damaged } = dir.scan()?;
            let newest = complete.last().cloned();
            // A damaged checkpoint newer than the one resumed from is named
            // now and moved aside, so that saving its step again later
            // finds the name free.
            for d in damaged {
                let newer = d.dir.file_name().and_then(|n| n.to_str()).and_then(|n| n.strip_prefix("step-"));
                let newer = newer
                    .and_then(|n| n.parse::<usize>().ok())
                    .is_some_and(|s| newest.as_ref().is_none_or(|(n, _)| s > *n));
                if newer && rank == 0 {
                    let kept = dir.set_aside(&d.dir)?;
                    eprintln!(
                        "note: --resume auto skips {}: {}; it is kept as {}",
                        d.dir.display(),
                        d.reason,
                        kept.display()
                    );
                }
            }
            newest.map(|(_, p)| p)
        }
        // `--resume auto` without --checkpoint-dir was refused above.
        (Some(path), _) => Some(PathBuf::from(path)),
    };
    let resumed = match &resume_from {
        Some(dir) => {
            let state = checkpoint::read_complete(dir)?;
            checkpoint::check_compatible(dir, &state, &run_id, &legacy_id)?;
            if state.format == 1 && rank == 0 {
                eprintln!(
                    "note: {} was written by an earlier stepgraph that recorded only part of a run's settings; \
                     those were checked, the rest could not be",
                    dir.display()
                );
            }
            if state.step > args.steps {
                bail!(
                    "{} holds step {}, past the run's --steps {}: ask for more steps to continue it",
                    dir.display(),
                    state.step,
                    args.steps
                );
            }
            if let Some(stop) = args.stop_after.filter(|&n| n <= state.step) {
                bail!("--stop-after {stop} is not after the checkpoint's step {} ({})", state.step, dir.display());
            }
            Some((dir.clone(), state))
        }
        None => None,
    };

    let CompiledStep { step, plan, forward, .. } = compiled;
    let moments_dtype = state_dtype(&step);
    let shard = opts.data_parallel.as_ref().is_some_and(|dp| dp.zero1 && dp.world > 1);
    let opened = Instant::now();
    let (mut session, replay_from, device, eval) = open_sessions(&role, args, switches, step, plan, eval_step)?;
    let session_time = opened.elapsed();
    let peak = match &role {
        Role::Cpu => None,
        _ => device_name(rank).ok().and_then(|n| metrics::peak_flops(&n, spec.dtype)).map(|p| p * world as f64),
    };
    let run = Run {
        args,
        flops_per_token: metrics::train_flops_per_token(params, &spec.config, spec.seq),
        spec,
        schedule,
        rank,
        world,
        shard,
        ckpt,
        run_id,
        switches,
        train_options: opts.train.clone(),
        state_dtype: moments_dtype,
        peak_flops: peak,
        params,
        forward,
        out,
        grad_accum: opts.grad_accum,
        resumed_divergence: resumed.as_ref().and_then(|(_, s)| s.divergence.clone()),
    };
    let talk = rank == 0;
    let weights_from = Instant::now();
    let start = match &resumed {
        Some((dir, state)) => {
            let opt = checkpoint::optimizer_file(if state.shards == 0 { None } else { Some((rank, state.shards)) });
            checkpoint::load_leaves(session.as_mut(), &dir.join(checkpoint::WEIGHTS_FILE), true)?;
            checkpoint::load_leaves(session.as_mut(), &dir.join(opt), false)?;
            data.restore(&state.data).with_context(|| format!("resuming the batches of {}", dir.display()))?;
            state.step + 1
        }
        None => {
            init_weights(session.as_mut(), &run.forward, pretrained.as_ref(), args.seed)?;
            session.zero_state()?;
            1
        }
    };
    // The shards' maps are not needed past the initial weights.
    drop(pretrained);
    // Where the time before step 1 went: tracing, planning, the session
    // (kernel load and GEMM tuning among its phases on a GPU), the weights.
    let startup = StartupTimes::new(compile_times, session_time, session.startup_phases(), weights_from.elapsed());
    if talk {
        run.print_settings(
            &sources,
            &device,
            data.as_ref(),
            resumed.as_ref().map(|(d, s)| (d.as_path(), s.step, &s.schedule)),
        );
        eprint!("{}", plan_report(session.trace(), session.plan(), 3));
        eprintln!("{startup}");
    }
    if let Some(dir) = &run.ckpt {
        if talk {
            dir.clean_leftovers()?;
        }
    }
    if start > args.steps {
        if talk {
            println!("the run is complete: its checkpoint holds step {} of {}", start - 1, args.steps);
        }
        // Its model folder, from the checkpoint's weights.
        if let Some(report) = run.save_out(session.as_mut())? {
            eprintln!("{}", out_line(&report));
        }
        return Ok(());
    }
    let metrics_path = args.metrics.clone().or_else(|| run.ckpt.as_ref().map(|d| d.root.join("metrics.jsonl")));
    let mut metrics = match (&metrics_path, talk) {
        (Some(p), true) => Some(MetricsFile::open(p, resumed.as_ref().map(|(_, s)| s.step))?),
        _ => None,
    };
    let mut eval = match eval {
        Some(session) => Some(Evaluator {
            session,
            batches: data.validation_batches(args.eval_batches)?,
            micro_batches: opts.grad_accum,
        }),
        None => None,
    };
    if matches!(role, Role::Cpu | Role::Gpu) {
        signals::install();
    }
    let outcome =
        train_loop(&run, session.as_mut(), replay_from, data.as_mut(), start, eval.as_mut(), metrics.as_mut());
    if let (Ok(()), true, Some(m)) = (&outcome, talk, &metrics) {
        eprintln!("metrics: {}", m.path().display());
    }
    if world > 1 {
        return outcome.with_context(|| format!("rank {rank} of {world}"));
    }
    outcome
}

/// The sessions of this process: the train step's, where its replay
/// starts, the device in words, and the evaluation step's (rank 0).
#[allow(clippy::type_complexity)]
fn open_sessions(
    role: &Role,
    args: &TrainArgs,
    switches: Switches,
    step: Trace,
    plan: stepgraph_core::plan::MemoryPlan,
    eval: Option<CompiledStep>,
) -> Result<(Box<dyn Session>, Option<usize>, String, Option<Box<dyn Session>>)> {
    // The backend, chosen once: the CPU replays its recorded launch list
    // from step 1; a GPU runs step 1 eagerly (modules load; NCCL connects
    // the ranks at their first collectives), then replays one captured
    // graph, unless --eager.
    let gpu_replay = if args.eager { None } else { Some(2) };
    let on_gpu = |device: usize, group: Option<NcclGroup>, overlap: bool, step: Trace, plan| {
        let opts = CudaOptions { switches, ..CudaOptions::default() };
        CudaSession::new_rank(step, plan, opts, RankOptions { device, group, overlap })
            .with_context(|| format!("opening the CUDA session on GPU {device}"))
    };
    let open_eval = |device: Option<usize>| -> Result<Option<Box<dyn Session>>> {
        let Some(c) = eval else { return Ok(None) };
        Ok(Some(match device {
            None => Box::new(CpuSession::new(c.step, c.plan)?),
            // The evaluation step has no collectives: no group, no NCCL.
            Some(d) => Box::new(on_gpu(d, None, false, c.step, c.plan)?),
        }))
    };
    match role {
        Role::Cpu => {
            let s = CpuSession::new(step, plan)?;
            let device = s.device();
            Ok((Box::new(s), Some(1), device, open_eval(None)?))
        }
        // One GPU: the step has no collectives, so no group and no NCCL.
        Role::Gpu => {
            let s = on_gpu(0, None, false, step, plan)?;
            let device = format!("{} ({})", s.device(), device_name(0).unwrap_or_default());
            Ok((Box::new(s), gpu_replay, device, open_eval(Some(0))?))
        }
        Role::Rank { rank, world, id_file } => {
            let id = NcclId::read_file(id_file)
                .with_context(|| format!("rank {rank}: reading the NCCL id the launcher wrote"))?;
            let group = NcclGroup { id, rank: *rank, world: *world };
            let s = on_gpu(*rank, Some(group), args.overlap, step, plan)
                .with_context(|| format!("rank {rank} of {world}"))?;
            Ok((Box::new(s), gpu_replay, format!("{world} GPUs"), open_eval(Some(*rank))?))
        }
        Role::Launcher { .. } => unreachable!("the launcher starts ranks and trains nothing itself"),
    }
}

/// Every output of the run is checked writable, with room for what it
/// will hold, before step 1 (so that a run never trains for hours and
/// then fails to save): `--out` the model's weights, `--checkpoint-dir`
/// one more checkpoint (weights and optimizer state: the old ones are
/// deleted only after a new one is complete), `--metrics` its rows.
fn check_outputs(args: &TrainArgs, step: &Trace, ckpt: Option<&CheckpointDir>) -> Result<()> {
    let bytes = |keep: fn(&ValueKind) -> bool| -> u64 {
        step.leaves().filter(|&v| keep(&step.value(v).kind)).map(|v| step.ty(v).bytes()).sum()
    };
    let weights = bytes(|k| matches!(k, ValueKind::Param { .. }));
    let state = bytes(|k| matches!(k, ValueKind::State { .. }));
    if let Some(out) = &args.out {
        // The new folder is written beside the old one and renamed over it.
        check_writable("--out", out, weights)?;
    }
    if let Some(dir) = ckpt {
        check_writable("--checkpoint-dir", &dir.root.join(".write-check"), weights + state)?;
    }
    if let Some(metrics) = &args.metrics {
        check_writable("--metrics", metrics, METRICS_ROOM)?;
    }
    Ok(())
}

/// Room a metrics file is checked for: a row is about 200 bytes.
const METRICS_ROOM: u64 = 1 << 20;

/// The checkpoint directory: `--checkpoint-dir`, or the parent of a
/// `--resume PATH` checkpoint.
fn checkpoint_dir(args: &TrainArgs) -> Option<CheckpointDir> {
    match (&args.checkpoint_dir, &args.resume) {
        (Some(d), _) => Some(CheckpointDir::new(d)),
        (None, Some(path)) if path != "auto" => {
            let parent = Path::new(path).parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
            Some(CheckpointDir::new(parent))
        }
        _ => None,
    }
}

/// The run's configuration, as a resumed run must share it with its
/// checkpoint: the model and batch ([`ModelSpec`]) and the step options
/// ([`StepOptions`]), serialized from the very structures the step is
/// built from (so a setting added to them is covered with no list to
/// edit), the data, the seed, the group, and the run-time switches
/// ([`Switches`], every one with its value, set or default); flattened to
/// dotted keys (`step.f32_products`, `switches.multi_tensor`).
/// Settings that change no bits are left out: the number of steps and the
/// schedule (a run may be extended; a changed schedule is noted), logging,
/// evaluation and checkpoint cadence.
fn run_identity(
    spec: &ModelSpec,
    opts: &StepOptions,
    world: usize,
    args: &TrainArgs,
    switches: &Switches,
) -> Result<BTreeMap<String, serde_json::Value>> {
    let config = serde_json::json!({
        "model": spec,
        "step": opts,
        "data": {"path": args.data.display().to_string(), "val_fraction": args.val_fraction},
        "seed": args.seed,
        "gpus": world,
        "switches": switches,
    });
    let mut id = BTreeMap::new();
    flatten("", &config, &mut id);
    Ok(id)
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

/// The settings checkpoints of format 1 recorded, under their keys then,
/// so that a run saved by an earlier stepgraph can still be resumed.
fn legacy_run_identity(
    spec: &ModelSpec,
    step: &Trace,
    opts: &StepOptions,
    world: usize,
    args: &TrainArgs,
) -> BTreeMap<String, serde_json::Value> {
    let mut id = BTreeMap::new();
    if let Ok(serde_json::Value::Object(config)) = serde_json::to_value(&spec.config) {
        for (k, v) in config {
            id.insert(format!("model.{k}"), v);
        }
    }
    id.insert("batch".into(), spec.batch.into());
    id.insert("seq".into(), spec.seq.into());
    id.insert("dtype".into(), spec.dtype.to_string().into());
    id.insert("state-dtype".into(), state_dtype(step).into());
    id.insert("weight-decay".into(), opts.train.adamw.weight_decay.into());
    id.insert("decay-all".into(), (opts.train.decay == DecayScope::All).into());
    id.insert("clip-grad-norm".into(), opts.train.clip_grad_norm.unwrap_or(0.0).into());
    id.insert("grad-accum".into(), opts.grad_accum.into());
    id.insert("gpus".into(), world.into());
    id.insert("zero1".into(), args.zero1.into());
    id.insert("data".into(), args.data.display().to_string().into());
    id.insert("val-fraction".into(), args.val_fraction.into());
    id.insert("seed".into(), args.seed.into());
    id
}

/// The dtype of the step's optimizer state, as the step was built.
fn state_dtype(step: &Trace) -> Option<String> {
    step.leaves().find(|&v| matches!(step.value(v).kind, ValueKind::State { .. })).map(|v| step.ty(v).dtype.to_string())
}

/// The model of the run and, with `--init-from DIR`, the opened folder:
/// the config comes from `DIR/config.json` (the model flags that change the
/// geometry are refused: the weights fix it) and the batch, sequence and
/// dtype from the flags. Opening validates every shard's header; no tensor
/// is read yet.
pub(crate) fn model_spec(model: &ModelArgs, init_from: Option<&Path>) -> Result<(ModelSpec, Option<HfModelDir>)> {
    let Some(dir) = init_from else { return Ok((model.spec()?, None)) };
    if let Some((_, flag)) = model.geometry_flags().into_iter().find(|(given, _)| *given) {
        bail!(
            "{flag} would change the model of --init-from {}: its geometry comes from {} and must fit its \
             weights; drop {flag}",
            dir.display(),
            dir.join(stepgraph_core::models::hf_dir::CONFIG_FILE).display()
        );
    }
    let hf = HfModelDir::open(dir).with_context(|| format!("--init-from {}", dir.display()))?;
    Ok((model.spec_of(hf.config().clone())?, Some(hf)))
}

/// Writes the initial weights: with `--init-from`, the folder's tensors
/// one at a time (memory-mapped, cast to each parameter's dtype, copied to
/// the device), after [`HfModelDir::check`] has fitted them to `forward`;
/// otherwise the seeded draw, made by the session where it runs (on a GPU,
/// in place, without a host copy of the model).
pub fn init_weights(
    session: &mut dyn Session,
    forward: &Trace,
    pretrained: Option<&HfModelDir>,
    seed: u64,
) -> Result<()> {
    match pretrained {
        Some(hf) => hf
            .load_into(forward, session)
            .with_context(|| format!("loading the weights of --init-from {}", hf.dir().display()))?,
        None => {
            session.init_params(seed)?;
        }
    }
    Ok(())
}

/// Where `--out` writes the model, checked before the run starts so that a
/// destination the save would refuse costs no training.
struct OutTarget {
    dir: PathBuf,
    /// The family and the `config.json` of `--init-from`, kept so the saved
    /// config carries the keys stepgraph does not read (token ids, ...).
    source: Option<(HfFamily, serde_json::Map<String, serde_json::Value>)>,
    /// The folder whose tokenizer files are copied.
    tokenizer: Option<PathBuf>,
    max_shard_bytes: u64,
}

impl OutTarget {
    fn new(dir: &Path, args: &TrainArgs, spec: &ModelSpec, pretrained: Option<&HfModelDir>) -> Result<Self> {
        let max_shard_bytes = match args.max_shard_mb {
            None => stepgraph_core::models::hf_dir::DEFAULT_MAX_SHARD_BYTES,
            Some(mb) if mb.is_finite() && mb * 1048576.0 >= 1.0 => (mb * 1048576.0).round() as u64,
            Some(mb) => bail!("--max-shard-mb must be a positive size in MiB, got {mb}"),
        };
        if dir.exists() && !dir.is_dir() {
            bail!("--out {} exists and is not a folder; refusing to replace it", dir.display());
        }
        if HfModelDir::open(dir).is_err() && dir.read_dir().is_ok_and(|mut d| d.next().is_some()) {
            // A folder of something else is not replaced by a model.
            bail!(
                "--out {} is a folder that holds files but no Hugging Face model (config.json and weights); \
                 refusing to replace it: give a new or a model folder",
                dir.display()
            );
        }
        if let Some(parent) = dir.parent().filter(|p| !p.as_os_str().is_empty()) {
            std::fs::create_dir_all(parent).with_context(|| format!("--out: creating {}", parent.display()))?;
        }
        let family = match pretrained {
            Some(hf) => hf.family(),
            None => HfFamily::of_config(&spec.config).map_err(|reason| {
                anyhow::anyhow!("--out cannot write `{}` as a Hugging Face model: {reason}", spec.config.name)
            })?,
        };
        let tokenizer = match (&args.tokenizer, pretrained) {
            (Some(t), _) => {
                let t = if t.is_file() { t.parent().unwrap_or(Path::new(".")).to_path_buf() } else { t.clone() };
                if !t.join("tokenizer.json").is_file() {
                    bail!("--tokenizer {}: no tokenizer.json there to copy into --out", t.display());
                }
                Some(t)
            }
            (None, Some(hf)) => Some(hf.dir().to_path_buf()),
            (None, None) => None,
        };
        let source = pretrained.map(|hf| (family, hf.raw_config().clone()));
        Ok(OutTarget { dir: dir.to_path_buf(), source, tokenizer, max_shard_bytes })
    }
}

/// One line on a written `--out` folder.
fn out_line(r: &SaveReport) -> String {
    format!(
        "model: {} (Hugging Face folder: {} tensors, {:.1} MB in {} file{}; tokenizer files: {})",
        r.dir.display(),
        r.tensors,
        mb(r.tensor_bytes),
        r.shards.len(),
        if r.shards.len() == 1 { "" } else { "s" },
        if r.tokenizer_files.is_empty() { "none".to_string() } else { r.tokenizer_files.join(", ") }
    )
}

/// Saves the model at the end of the run (the last of `--steps`): the
/// final checkpoint, and with `--out` the Hugging Face folder (rank 0).
fn save_final_model(
    run: &Run,
    session: &mut dyn Session,
    step: usize,
    loss: f64,
    data: &dyn TrainData,
    monitor: &DivergenceMonitor,
) -> Result<Option<SaveReport>> {
    run.save_checkpoint(session, step, loss, data, monitor)?;
    run.save_out(session)
}

/// The fixed facts of a run.
struct Run<'a> {
    args: &'a TrainArgs,
    /// The model and the global batch.
    spec: ModelSpec,
    schedule: LrSchedule,
    rank: usize,
    world: usize,
    /// The AdamW state is sharded over the ranks (ZeRO-1).
    shard: bool,
    ckpt: Option<CheckpointDir>,
    run_id: BTreeMap<String, serde_json::Value>,
    /// The run-time switches the sessions were opened with.
    switches: Switches,
    /// The optimizer settings and the dtype of its state, as the step was built.
    train_options: stepgraph_core::autodiff::TrainOptions,
    state_dtype: Option<String>,
    flops_per_token: f64,
    /// The group's peak FLOP/s for MFU; `None` on the CPU or an unknown GPU.
    peak_flops: Option<f64>,
    params: usize,
    /// The model's forward trace: its parameters by name, for `--out`.
    forward: Trace,
    out: Option<OutTarget>,
    /// Micro-batches of `spec.batch` rows in each step.
    grad_accum: usize,
    /// The divergence check's state in the checkpoint resumed from.
    resumed_divergence: Option<DivergenceMonitor>,
}

/// How long rank 0 waits for the other ranks' optimizer shards.
const SHARD_WAIT: Duration = Duration::from_secs(600);

impl Run<'_> {
    fn print_settings(
        &self,
        sources: &[String; 3],
        device: &str,
        data: &dyn TrainData,
        resumed: Option<(&Path, usize, &LrSchedule)>,
    ) {
        let (spec, s, args) = (&self.spec, &self.schedule, self.args);
        let per_rank = match rank_batch(spec.batch, self.world) {
            Ok(rows) if self.world > 1 => format!(" ({rows} rows per GPU)"),
            _ => String::new(),
        };
        let micro = match self.grad_accum {
            1 => String::new(),
            n => format!(" x {n} micro-batches"),
        };
        eprintln!(
            "training {} ({} parameters, {} layers) on {device}: batch {} x {}{micro} = {} tokens per step{per_rank}, {} steps",
            spec.config.name,
            self.params,
            spec.config.n_layer,
            spec.batch,
            spec.seq,
            spec.batch * spec.seq * self.grad_accum,
            args.steps
        );
        eprintln!("  data        {}", data.describe());
        match &args.init_from {
            Some(dir) => eprintln!("  weights     {} (Hugging Face folder, cast to {})", dir.display(), spec.dtype),
            None => eprintln!("  weights     random (--seed {})", args.seed),
        }
        if let Some(out) = &self.out {
            let tok = match &out.tokenizer {
                Some(t) => format!("tokenizer files from {}", t.display()),
                None => "no tokenizer files (--tokenizer DIR copies them)".to_string(),
            };
            eprintln!("  out         {} at the end of the run ({tok})", out.dir.display());
        }
        eprintln!("  lr          peak {} ({})", short(s.peak), sources[0]);
        eprintln!("  warm-up     {} step{} ({})", s.warmup, if s.warmup == 1 { "" } else { "s" }, sources[1]);
        eprintln!("  decay       cosine to {} at step {} ({})", short(s.min), s.total, sources[2]);
        let train = &self.train_options;
        let scope = if train.decay == DecayScope::All || train.adamw.weight_decay == 0.0 {
            ""
        } else {
            " (not on norms, biases or embeddings; --decay-all for every parameter)"
        };
        eprintln!(
            "  dtype       {}, AdamW moments {}, weight decay {}{scope}, seed {}",
            spec.dtype,
            self.state_dtype.as_deref().unwrap_or("none"),
            train.adamw.weight_decay,
            args.seed
        );
        if matches!(spec.dtype, DType::BF16 | DType::F16) {
            use stepgraph_core::ops::optim::MasterWeights;
            let master = match train.master_weights {
                MasterWeights::Kahan => format!("kahan: a {} compensation per weight", spec.dtype),
                MasterWeights::F32 => "f32: a float32 master copy per weight".to_string(),
                MasterWeights::None => "none: updates below half a unit in the last place are lost".to_string(),
            };
            eprintln!("  master      {master} (--master-weights; docs/mixed-precision.md)");
        }
        match train.clip_grad_norm {
            Some(c) if c > 0.0 => {
                eprintln!("  clipping    global gradient norm to {c} (--clip-grad-norm; 0 turns it off)")
            }
            _ if args.zero1 => eprintln!("  clipping    none (ZeRO-1's sharded gradients are not clipped yet)"),
            _ => eprintln!("  clipping    none"),
        }
        match (&self.ckpt, resumed) {
            (None, _) => eprintln!("  checkpoints none (--checkpoint-dir DIR saves them)"),
            (Some(d), r) => {
                let every =
                    if args.save_every > 0 { format!("every {} steps and ", args.save_every) } else { String::new() };
                eprintln!("  checkpoints {} ({every}at the end, keeping {})", d.root.display(), args.keep);
                if let Some((dir, step, saved)) = r {
                    eprintln!("  resumed     from {} (step {step})", dir.display());
                    if saved != s {
                        // Allowed (a run may be extended), but the rates
                        // from here on are not the ones the checkpoint's run would have used.
                        eprintln!(
                            "  note        the checkpoint followed another schedule (peak {}, warm-up {}, floor {} at step {}); \
                             this run follows the one above",
                            short(saved.peak),
                            saved.warmup,
                            short(saved.min),
                            saved.total
                        );
                    }
                }
            }
        }
        if args.eval_every > 0 {
            eprintln!("  validation  every {} steps, {} batches", args.eval_every, args.eval_batches);
        }
        let set = self.switches.not_default_line();
        if !set.is_empty() {
            eprintln!("  switches    {set} (not the defaults)");
        }
    }

    /// Writes the `--out` folder from the session's parameters (rank 0; the
    /// others hold the same parameters). `None` without `--out`.
    fn save_out(&self, session: &mut dyn Session) -> Result<Option<SaveReport>> {
        let Some(out) = &self.out else { return Ok(None) };
        if self.rank > 0 {
            return Ok(None);
        }
        let options = SaveOptions {
            tokenizer_from: out.tokenizer.as_deref(),
            model_from: self.args.init_from.as_deref(),
            max_shard_bytes: out.max_shard_bytes,
            family: out.source.as_ref().map(|(f, _)| *f),
            source_config: out.source.as_ref().map(|(_, c)| c),
        };
        let report = save_hf_dir(&out.dir, &self.spec.config, &self.forward, session, &options)
            .with_context(|| format!("--out {}: writing the model folder", out.dir.display()))?;
        Ok(Some(report))
    }

    /// Saves a checkpoint of `step` (every rank takes part: ZeRO-1 ranks
    /// write their shards) and deletes the ones beyond `--keep`.
    fn save_checkpoint(
        &self,
        session: &mut dyn Session,
        step: usize,
        loss: f64,
        data: &dyn TrainData,
        monitor: &DivergenceMonitor,
    ) -> Result<()> {
        let Some(dir) = &self.ckpt else { return Ok(()) };
        let shards = if self.shard { self.world } else { 0 };
        if self.rank > 0 {
            if self.shard {
                let state = checkpoint::read_leaves(session, false)?;
                dir.write_shard(step, self.rank, self.world, &state)?;
            }
            return Ok(());
        }
        let weights = checkpoint::read_leaves(session, true)?;
        let optimizer = checkpoint::read_leaves(session, false)?;
        let mut state = CheckpointState::new(step, self.schedule, loss, data.cursor(), self.run_id.clone(), shards);
        state.divergence = Some(monitor.clone());
        dir.save(&state, &weights, &optimizer, SHARD_WAIT)?;
        // The checkpoint at or before the best loss is the one to go back
        // to if the run is diverging (or will): --keep never deletes it.
        dir.prune(self.args.keep, monitor.last_good_step())?;
        Ok(())
    }
}

/// The forward-only step that evaluates the held-out split, with the
/// training step's weights copied in before each evaluation.
///
/// A second session rather than the training one: a train step always
/// applies its AdamW update, so evaluating with it would change the
/// weights. Its memory is its own plan (a forward pass holds no gradients
/// or moments), counted in the run's planned and held bytes.
pub struct Evaluator {
    pub session: Box<dyn Session>,
    /// Batches of the training step's rows: `micro_batches` of the evaluation step's each.
    pub batches: Vec<data::Batch>,
    pub micro_batches: usize,
}

impl Evaluator {
    /// The mean loss over the validation batches, on the weights of `train`.
    fn evaluate(&mut self, train: &mut dyn Session, rank: usize, world: usize) -> Result<f64> {
        let params: Vec<(String, _)> = {
            let t = self.session.trace();
            t.params().map(|p| (t.value(p).kind.leaf_name().unwrap_or_default().to_string(), p)).collect()
        };
        for (name, v) in params {
            let src = train
                .trace()
                .leaf_by_name(&name)
                .with_context(|| format!("the training step has no parameter `{name}` to evaluate"))?;
            let value = train.read(src)?;
            self.session.write(v, &value)?;
        }
        self.mean_loss(rank, world)
    }

    /// The mean loss over the validation batches, on the weights the
    /// evaluation session holds.
    /// Batches whose targets are all masked (a chat prompt, padding) have
    /// no loss (0/0) and are left out of the mean.
    pub fn mean_loss(&mut self, rank: usize, world: usize) -> Result<f64> {
        let (mut total, mut counted) = (0.0, 0usize);
        let n = self.micro_batches.max(1);
        for b in &self.batches {
            for k in 0..n {
                let (tokens, targets) = (shard_rows(&b.tokens, k, n)?, shard_rows(&b.targets, k, n)?);
                let targets = shard_rows(&targets, rank, world)?;
                if !has_target(&targets) {
                    continue;
                }
                self.session.write_named(TOKENS_INPUT, &shard_rows(&tokens, rank, world)?)?;
                self.session.write_named(TARGETS_INPUT, &targets)?;
                self.session.run_eager()?;
                total += self.session.loss()?;
                counted += 1;
            }
        }
        if counted == 0 {
            bail!(
                "none of the {} validation batches has a loss target (the loss mask covers every held-out token): \
                 hold out other documents, or use a longer --seq",
                self.batches.len()
            );
        }
        Ok(total / counted as f64)
    }
}

/// Whether some target of `targets` counts in the loss (is not the ignore index).
fn has_target(targets: &HostTensor) -> bool {
    targets.to_f64().iter().any(|&t| t != IGNORE_INDEX as f64)
}

/// How many batches in a row may lack a loss target before the run gives up.
const MAX_SKIPPED_IN_A_ROW: u64 = 1000;

/// The next training batch in which every part a device computes a mean
/// loss over (the rows of each of `parts` ranks) has a loss target.
///
/// A token file's loss mask can leave a whole short row unmasked-free (a
/// chat prompt longer than the sequence): its mean cross-entropy is 0/0, a
/// NaN that would stop the run. Such batches teach nothing and are skipped;
/// the data cursor counts them, so a resumed run skips the same ones.
fn next_usable_batch(data: &mut dyn TrainData, parts: usize, skipped: &mut u64) -> Result<data::Batch> {
    let mut seq = 0;
    for _ in 0..MAX_SKIPPED_IN_A_ROW {
        let batch = data.next_batch()?;
        seq = batch.targets.ty.shape[1];
        let mut usable = true;
        for p in 0..parts {
            usable &= has_target(&shard_rows(&batch.targets, p, parts)?);
        }
        if usable {
            return Ok(batch);
        }
        *skipped += 1;
    }
    bail!(
        "{MAX_SKIPPED_IN_A_ROW} training batches in a row have a part without a loss target: the token file's loss \
         mask leaves too few targets for --seq {seq} (prepare other data, or use a longer --seq or a larger --batch)"
    )
}

/// The named output `grad_norm` of a step that computes it (gradient clipping).
fn grad_norm_output(trace: &Trace) -> Option<stepgraph_core::ir::ValueId> {
    trace.outputs.iter().find(|o| matches!(&o.kind, OutputKind::Named(n) if n == GRAD_NORM_OUTPUT)).map(|o| o.value)
}

/// A learning rate as people write it: `3e-3`, `1.2e-4`, `0.01`, `30`.
fn short(x: f64) -> String {
    if (1e-2..1e4).contains(&x) {
        return format!("{x}");
    }
    let s = format!("{x:.3e}");
    let (mantissa, exp) = s.split_once('e').unwrap_or((&s, "0"));
    let mantissa = mantissa.trim_end_matches('0').trim_end_matches('.');
    if exp == "0" {
        mantissa.to_string()
    } else {
        format!("{mantissa}e{exp}")
    }
}

fn mb(bytes: u64) -> f64 {
    bytes as f64 / 1e6
}

/// Trains steps `start..=` the last of this process (`--steps`, or
/// `--stop-after`); only rank 0 prints.
fn train_loop(
    run: &Run,
    session: &mut dyn Session,
    replay_from: Option<usize>,
    data: &mut dyn TrainData,
    start: usize,
    mut eval: Option<&mut Evaluator>,
    mut metrics: Option<&mut MetricsFile>,
) -> Result<()> {
    let args = run.args;
    let (rank, world) = (run.rank, run.world);
    let (global, seq, steps) = (run.spec.batch * run.grad_accum, run.spec.seq, args.steps);
    let last = args.stop_after.unwrap_or(steps);
    let talk = rank == 0;
    let grad_norm = grad_norm_output(session.trace());
    // On a terminal a progress bar; otherwise (a log file, CI) plain lines every --log-every steps.
    let tty = std::io::stderr().is_terminal();
    let bar = if talk && tty { ProgressBar::new(steps as u64) } else { ProgressBar::hidden() };
    bar.set_style(
        ProgressStyle::with_template("{spinner} [{elapsed_precise}] {bar:30} {pos}/{len} ETA {eta} {msg}")
            .expect("valid template"),
    );
    bar.set_position(start as u64 - 1);
    bar.reset_eta();
    let (mut first, mut last_loss) = (f64::NAN, f64::NAN);
    let mut monitor =
        run.resumed_divergence.clone().unwrap_or_else(|| DivergenceMonitor::new(run.spec.config.padded_vocab_size));
    let mut diverged: Option<String> = None;
    let mut recorded: Option<Duration> = None;
    let mut saved: Option<PathBuf> = None;
    let mut wrote_out: Option<SaveReport> = None;
    let mut skipped = 0u64;
    let mut eval_time = Duration::ZERO;
    let t0 = Instant::now();
    for it in start..=last {
        let batch = next_usable_batch(data, world * run.grad_accum, &mut skipped)?;
        let lr = run.schedule.at(it);
        session.write_named(TOKENS_INPUT, &shard_rows(&batch.tokens, rank, world)?)?;
        session.write_named(TARGETS_INPUT, &shard_rows(&batch.targets, rank, world)?)?;
        session.write_named(LR_INPUT, &scalar_input(lr))?;
        session.write_named(STEP_INPUT, &scalar_input(it as f64))?;
        if replay_from.is_some_and(|from| it >= from) {
            if recorded.is_none() {
                recorded = Some(session.prepare_replay()?);
            }
            session.replay()?;
        } else {
            session.run_eager()?;
        }
        let loss = session.loss()?;
        if !loss.is_finite() {
            bar.finish_and_clear();
            let cause = diagnose_non_finite(session, run.spec.dtype, it)?;
            let kept = match (&run.ckpt, &saved) {
                (None, _) => "no checkpoint was saved (--checkpoint-dir)".to_string(),
                (Some(d), _) => match d.newest()? {
                    Some((_, p)) => format!("the last good checkpoint is {} (nothing was saved after it)", p.display()),
                    None => "no checkpoint was saved before it".to_string(),
                },
            };
            bail!("the loss became {loss} at step {it}: {cause}; {kept}");
        }
        if it == start {
            first = loss;
        }
        last_loss = loss;
        let train_secs = (t0.elapsed() - eval_time).as_secs_f64();
        let tps = ((it + 1 - start) * global * seq) as f64 / train_secs;
        let mfu = run.peak_flops.map(|peak| run.flops_per_token * tps / peak);
        let mem = memory(session, eval.as_deref_mut())?;
        let grad_norm = match grad_norm {
            Some(v) => Some(session.read(v)?.to_f64()[0]),
            None => None,
        };
        let mfu_text = mfu.map(|m| format!("  MFU {:.1}%", m * 100.0)).unwrap_or_default();
        let mem_text = if mem.measured {
            format!("  mem {:.0}/{:.0} MB held/planned", mb(mem.held_bytes), mb(mem.planned_bytes))
        } else {
            format!("  mem {:.1} MB planned", mb(mem.planned_bytes))
        };
        let norm_text = grad_norm.map(|g| format!("  |g| {g:.3}")).unwrap_or_default();
        bar.set_message(format!("loss {loss:.4}{norm_text}  {tps:.0} tok/s{mfu_text}{mem_text}"));
        bar.inc(1);
        if talk && !tty && args.log_every > 0 && (it % args.log_every == 0 || it == last) {
            let norm_text = grad_norm.map(|g| format!(", grad norm {g:.3}")).unwrap_or_default();
            eprintln!("step {it}/{steps}: loss {loss:.4}{norm_text}, lr {lr:.3e}, {tps:.0} tok/s{mfu_text}{mem_text}");
        }
        if let Some(m) = metrics.as_deref_mut() {
            let mut row = serde_json::json!({
                "step": it, "loss": loss, "lr": lr, "tokens_per_s": tps,
                "planned_bytes": mem.planned_bytes, "held_bytes": mem.held_bytes,
            });
            if let Some(g) = grad_norm {
                row["grad_norm"] = g.into();
            }
            if let Some(m) = mfu {
                row["mfu"] = m.into();
            }
            m.write(&row)?;
        }
        if diverged.is_none() {
            if let Some(d) = monitor.observe(it, loss, grad_norm) {
                let good = match &run.ckpt {
                    None => "no checkpoint was saved (--checkpoint-dir saves them)".to_string(),
                    Some(dir) => match dir.complete()?.into_iter().rev().find(|(s, _)| *s <= d.best_step()) {
                        Some((_, p)) => {
                            format!("the last checkpoint saved before it is {} (--keep keeps it)", p.display())
                        }
                        None => "no checkpoint was saved before it".to_string(),
                    },
                };
                let msg = format!("{}; {good} (lower --lr, now {})", d.describe(it), short(run.schedule.peak));
                if args.fail_on_divergence {
                    bar.finish_and_clear();
                    bail!("{msg}; stopped by --fail-on-divergence");
                }
                if talk {
                    bar.suspend(|| eprintln!("warning: {msg}; the run goes on (--fail-on-divergence stops it here)"));
                }
                diverged = Some(msg);
            }
        }
        if let Some(e) = eval.as_deref_mut() {
            if it % args.eval_every == 0 || it == last {
                let t = Instant::now();
                let val = e.evaluate(session, rank, world)?;
                eval_time += t.elapsed();
                if talk {
                    bar.suspend(|| eprintln!("validation at step {it}: loss {val:.4}, perplexity {:.2}", val.exp()));
                }
                if let Some(m) = metrics.as_deref_mut() {
                    m.write(&serde_json::json!({"step": it, "val_loss": val, "val_ppl": val.exp()}))?;
                }
            }
        }
        let periodic = args.save_every > 0 && it % args.save_every == 0;
        let stop = signals::requested().filter(|_| it < last);
        if it == steps {
            wrote_out = save_final_model(run, session, it, loss, data, &monitor)?;
            saved = run.ckpt.as_ref().map(|d| d.step_dir(it));
        } else if run.ckpt.is_some() && (periodic || it == last || stop.is_some()) {
            run.save_checkpoint(session, it, loss, data, &monitor)?;
            saved = run.ckpt.as_ref().map(|d| d.step_dir(it));
        }
        if let Some(signal) = stop {
            bar.finish_and_clear();
            let kept = match &saved {
                Some(dir) => {
                    format!("its checkpoint is {}: continue with the same command and --resume auto", dir.display())
                }
                None => format!(
                    "no checkpoint was saved (--checkpoint-dir saves them): the {} steps are lost",
                    it + 1 - start
                ),
            };
            let out = match &run.out {
                Some(out) => format!("; --out {} is written only when the run reaches step {steps}", out.dir.display()),
                None => String::new(),
            };
            return Err(signals::Interrupted {
                signal,
                message: format!("stopped by {} after step {it} of {steps}; {kept}{out}", signals::name(signal)),
            }
            .into());
        }
    }
    // Clear the bar so that the summary starts on its own line.
    bar.finish_and_clear();
    if let (Some(msg), true) = (&diverged, talk) {
        eprintln!("warning: {msg}");
    }
    let note = closing_note(session, eval, recorded)?;
    if talk {
        if let Some(dir) = &saved {
            eprintln!("checkpoint: {}", dir.display());
        }
        match (&wrote_out, &run.out) {
            (Some(report), _) => eprintln!("{}", out_line(report)),
            (None, Some(out)) => eprintln!(
                "--out {} is written when the run reaches step {steps}: continue it with --resume",
                out.dir.display()
            ),
            (None, None) => {}
        }
        let ran = last + 1 - start;
        // A replayed GPU step of a small model takes a millisecond: say ms below a second.
        let secs = t0.elapsed().as_secs_f64();
        let took = if secs < 1.0 { format!("{:.1} ms", secs * 1e3) } else { format!("{secs:.1} s") };
        if skipped > 0 {
            eprintln!(
                "skipped {skipped} batch{} without a loss target in some part (the loss mask covered every token)",
                if skipped == 1 { "" } else { "es" }
            );
        }
        let per_step = secs * 1e3 / ran.max(1) as f64;
        println!(
            "final loss {last_loss:.4} (first {first:.4}) after {ran} steps in {took} ({per_step:.2} ms/step); {note}"
        );
    }
    Ok(())
}

/// The run's memory: the training session's and the evaluation's, together.
fn memory(train: &mut dyn Session, eval: Option<&mut Evaluator>) -> Result<SessionMemory> {
    let m = train.memory()?;
    Ok(match eval {
        Some(e) => m.combine(&e.session.memory()?),
        None => m,
    })
}

/// A closing note on how the steps ran: the recording, and where the
/// backend measures its memory, the peak it held (the evaluation session's
/// included) against the plan.
fn closing_note(session: &mut dyn Session, eval: Option<&mut Evaluator>, recorded: Option<Duration>) -> Result<String> {
    let how = match recorded {
        Some(t) => format!("{} in {:.2} ms", session.replay_label(), t.as_secs_f64() * 1e3),
        None => "eager".to_string(),
    };
    let m = memory(session, eval)?;
    if !m.measured {
        return Ok(how);
    }
    Ok(format!(
        "{how}; device peak {:.1} MB for a {:.1} MB plan (NCCL {:.1} MB)",
        m.held_bytes as f64 / 1e6,
        m.planned_bytes as f64 / 1e6,
        m.comm_bytes as f64 / 1e6
    ))
}

/// Names what became non-finite first when the loss of step `it` was not
/// finite, and the fix that applies. That loss is the forward pass of the
/// parameters step `it - 1` wrote, so a non-finite parameter came first (an
/// update overflowed), then a gradient (seen through the first AdamW
/// moment), then the second moment; when all are finite, or at step 1, the
/// forward pass itself overflowed.
fn diagnose_non_finite(session: &mut dyn Session, dtype: DType, it: usize) -> Result<String> {
    let trace = session.trace().clone();
    let finite = |t: &HostTensor| t.to_f64().iter().all(|x| x.is_finite());
    let mut read = |name: &str| -> Result<Option<HostTensor>> {
        match trace.leaf_by_name(name) {
            Some(v) => Ok(Some(session.read(v)?)),
            None => Ok(None),
        }
    };
    let range = match dtype {
        DType::F16 => "float16's range (±65504)",
        DType::BF16 => "bfloat16's precision",
        _ => "the float range",
    };
    let names: Vec<String> =
        trace.params().map(|p| trace.value(p).kind.leaf_name().unwrap_or_default().to_string()).collect();
    if it > 1 {
        for name in &names {
            if read(name)?.is_some_and(|value| !finite(&value)) {
                let state = trace.leaf_by_name(&format!("{name}.exp_avg_sq")).map(|s| trace.ty(s).dtype);
                let fix = if state == Some(DType::F16) {
                    "its AdamW second moment is float16, where (1-β2)·g² underflows to 0 and the update \
                     m/(√v+ε) explodes: keep the moments in float32 (--state-dtype auto or f32)"
                        .to_string()
                } else {
                    format!("the update overflowed {range}: lower the learning rate (--lr)")
                };
                return Ok(format!(
                    "parameter `{name}` became non-finite in the AdamW update of step {}; {fix}",
                    it - 1
                ));
            }
        }
        for name in &names {
            if read(&format!("{name}.exp_avg"))?.is_some_and(|m| !finite(&m)) {
                return Ok(format!(
                    "the gradient of `{name}` was not finite (its AdamW first moment is not): the backward pass \
                     overflowed {range}; lower the learning rate (--lr) or train in a wider dtype (--dtype f32)"
                ));
            }
            if let Some(v) = read(&format!("{name}.exp_avg_sq"))?.filter(|v| !finite(v)) {
                return Ok(format!(
                    "the AdamW second moment of `{name}` overflowed its {} storage: keep the moments in float32 \
                     (--state-dtype f32)",
                    v.ty.dtype
                ));
            }
        }
    }
    Ok(format!(
        "the forward pass overflowed {range} on finite parameters: lower the learning rate (--lr){}",
        if dtype == DType::F16 { " or train in bf16 or f32 (--dtype)" } else { "" }
    ))
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Parser)]
    struct T {
        #[command(flatten)]
        model: ModelArgs,
        #[command(flatten)]
        optim: crate::OptimArgs,
        #[command(flatten)]
        train: TrainArgs,
    }

    fn parse(args: &[&str]) -> std::result::Result<T, clap::Error> {
        T::try_parse_from(std::iter::once("train").chain(args.iter().copied()))
    }

    #[test]
    fn arguments_choose_the_role() {
        let role = |args: &[&str], gpu: bool| parse(args).unwrap().train.role(gpu);
        // The default device follows the machine.
        assert_eq!(role(&[], false).unwrap(), Role::Cpu);
        assert_eq!(role(&[], true).unwrap(), Role::Gpu);
        assert_eq!(role(&["--device", "cpu"], true).unwrap(), Role::Cpu);
        assert_eq!(role(&["--device", "cuda"], false).unwrap(), Role::Gpu);
        // One GPU is the in-process run, not the launcher, and has no group.
        assert_eq!(role(&["--gpus", "1"], true).unwrap(), Role::Gpu);
        assert_eq!(role(&["--gpus", "1", "--eager"], true).unwrap(), Role::Gpu);
        let e = role(&["--gpus", "1", "--zero1"], true).unwrap_err().to_string();
        assert!(e.contains("--zero1 applies to data-parallel runs"), "{e}");
        assert!(role(&["--gpus", "1", "--overlap"], true).unwrap_err().to_string().contains("--overlap"));
        assert_eq!(role(&["--gpus", "2", "--batch", "4"], true).unwrap(), Role::Launcher { gpus: 2 });
        let e = role(&["--gpus", "2", "--device", "cpu"], true).unwrap_err().to_string();
        assert!(e.contains("--device cpu and --gpus 2"), "{e}");
        let r = role(&["--gpus", "2", "--rank", "1", "--nccl-id", "/tmp/id"], true).unwrap();
        assert_eq!(r, Role::Rank { rank: 1, world: 2, id_file: PathBuf::from("/tmp/id") });
        let e = role(&["--gpus", "2", "--rank", "2", "--nccl-id", "/tmp/id"], true).unwrap_err();
        assert!(e.to_string().contains("--rank 2 is outside a group of 2"), "{e}");
        assert!(role(&["--gpus", "0"], true).unwrap_err().to_string().contains("at least 1, got 0"));
        // The rank flags belong to a --gpus run and come together; ZeRO-1 and buckets need --gpus.
        assert!(parse(&["--rank", "0", "--nccl-id", "/tmp/id"]).is_err());
        assert!(parse(&["--gpus", "2", "--rank", "0"]).is_err());
        assert!(parse(&["--zero1"]).is_err());
        assert!(parse(&["--bucket-mb", "4"]).is_err());
        assert!(parse(&["--overlap"]).is_err() && parse(&["--eager"]).is_err());
        assert!(parse(&["--gpus", "2", "--overlap", "--eager"]).unwrap().train.overlap);
        let t = parse(&["--gpus", "2", "--zero1", "--bucket-mb", "0.5"]).unwrap().train;
        assert_eq!(t.data_parallel(2).unwrap(), DataParallel { world: 2, bucket_bytes: 524288, zero1: true });
        let bad = parse(&["--gpus", "2", "--bucket-mb", "0"]).unwrap().train;
        assert!(bad.data_parallel(2).unwrap_err().to_string().contains("--bucket-mb"));
    }

    /// The one-GPU run compiles the plain step: no collective in it, so the
    /// CUDA session neither joins a group nor loads NCCL.
    #[test]
    fn the_single_device_step_has_no_collectives() {
        let t = parse(&["--gpus", "1", "--seq", "16", "--batch", "2"]).unwrap();
        assert_eq!(t.train.role(true).unwrap(), Role::Gpu);
        let spec = t.model.spec().unwrap();
        let single = compile_step(&spec, &StepOptions::new(StepKind::Train)).unwrap();
        assert!(!stepgraph_cuda::session::step_needs_nccl(&single.step));
        // The data-parallel step of the launcher's ranks does need it.
        let dp = StepOptions { data_parallel: Some(DataParallel::new(2)), ..StepOptions::new(StepKind::Train) };
        assert!(stepgraph_cuda::session::step_needs_nccl(&compile_step(&spec, &dp).unwrap().step));
    }

    /// `grad_norm` is read when the step has it (in-graph clipping), by name only.
    #[test]
    fn the_grad_norm_output_is_found_by_name() {
        let spec = parse(&["--seq", "8"]).unwrap().model.spec().unwrap();
        let mut step = compile_step(&spec, &StepOptions::new(StepKind::Train)).unwrap().step;
        assert_eq!(grad_norm_output(&step), None);
        let loss = step.loss().unwrap();
        step.outputs.push(stepgraph_core::ir::Output { kind: OutputKind::Named("grad_norm".into()), value: loss });
        assert_eq!(grad_norm_output(&step), Some(loss));
    }

    #[test]
    fn rates_print_short() {
        assert_eq!(
            [short(3e-3), short(3.0000000000000003e-4), short(1.2e-4), short(30.0)],
            ["3e-3", "3e-4", "1.2e-4", "30"]
        );
    }

    #[test]
    fn the_schedule_comes_from_the_flags_or_the_model() {
        let t = parse(&["--steps", "100"]).unwrap().train;
        let (s, src) = t.schedule(3_000_000, false).unwrap();
        assert_eq!((s.peak, s.warmup, s.total), (3e-3, 5, 100));
        assert!((s.min - 3e-4).abs() < 1e-15, "{}", s.min);
        assert!(
            src[0].contains("3.0M parameters") && src[1].starts_with("default") && src[2].contains("10%"),
            "{src:?}"
        );
        let (s, _) = t.schedule(7_000_000_000, false).unwrap();
        assert_eq!(s.peak, 1.2e-4);
        let (s, _) = t.schedule(7_000_000_000, true).unwrap();
        assert_eq!(s.peak, 2e-5);
        let t = parse(&["--steps", "100", "--lr", "0.01", "--warmup", "0", "--min-lr-ratio", "0.5"]).unwrap().train;
        let (s, src) = t.schedule(3_000_000, false).unwrap();
        assert_eq!((s.peak, s.warmup, s.min), (0.01, 0, 0.005));
        assert_eq!(src[0], "--lr");
        let t = parse(&["--min-lr-ratio", "2"]).unwrap().train;
        assert!(t.schedule(1, false).unwrap_err().to_string().contains("--min-lr-ratio must lie in [0, 1], got 2"));
        assert!(parse(&["--min-lr", "0.1", "--min-lr-ratio", "0.1"]).is_err());
    }
}
