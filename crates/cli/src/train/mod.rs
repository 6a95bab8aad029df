//! `stepgraph train`: the flags of a training run, the roles a process
//! takes, and what the run prints. The run itself is the library's
//! ([`stepgraph_train::Trainer`]); this module turns the flags into its
//! [`RunConfig`] and reports on stderr.
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
//! **What it prints.** The settings in force first (the learning rate,
//! warm-up and cosine floor chosen from the model's size when not given:
//! [`stepgraph_train::schedule`]), then the memory plan; a progress bar on a
//! terminal, or a line every `--log-every` steps; validation lines and
//! divergence warnings; the closing summary. **Settings** may come from a
//! TOML file ([`config_file`]). SIGTERM and SIGINT ask the run to stop
//! after its step, with a checkpoint ([`signals`]).
//!
//! **Models in and out.** `--init-from DIR` takes the model from a Hugging
//! Face folder's `config.json` ([`model_spec`]; the flags that would change
//! its geometry are refused), fitted to the step before any session
//! allocates and loaded tensor by tensor. `--out DIR` is checked before
//! step 1 and written at the last step ([`save_out`]): a folder
//! `transformers` loads, replaced atomically, with the tokenizer files of
//! `--tokenizer` or `--init-from`.

pub mod config_file;
pub mod launch;
pub mod signals;

use std::io::IsTerminal;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};

use stepgraph_core::autodiff::{DecayScope, StepKind};
use stepgraph_core::dist::{rank_batch, DataParallel, DEFAULT_BUCKET_BYTES};
use stepgraph_core::ir::{DType, Trace, ValueKind};
use stepgraph_core::models::hf_dir::{save_hf_dir, HfFamily, HfModelDir, SaveOptions, SaveReport};
use stepgraph_core::models::lora::{adapted_layers, MergedWeights};
use stepgraph_core::models::peft::{
    is_adapter_dir, peft_tensor_name, read_adapter_config, read_adapter_weights, save_adapter_dir, AdapterSaveReport,
};
use stepgraph_core::models::{build_forward, BaseStorage, ModelSpec};
use stepgraph_core::pipeline::trace_step;
use stepgraph_core::plan::plan_report;
use stepgraph_cuda::nccl::{NcclGroup, NcclId};
use stepgraph_cuda::session::gpu_available;
use stepgraph_cuda::Switches;
use stepgraph_data::Packing;
use stepgraph_train::checkpoint::{self, CheckpointDir};
use stepgraph_train::data;
use stepgraph_train::lock::RunLock;
use stepgraph_train::schedule::{self, short, LrSchedule};
use stepgraph_train::trainer::{eval_step, read_resumable};
use stepgraph_train::{
    Backend, Checkpoints, Course, DataConfig, Placement, Reporter, RunConfig, RunEnd, Start, StepReport, Trainer,
};

use crate::memory_args::{free_bytes, MemoryArgs};
use crate::output_paths::{check_writable, refuse_overwriting_inputs};
use crate::{LossArg, ModelArgs, OptimArgs};

/// `stepgraph train`'s own flags (the model flags are shared).
#[derive(Args, Clone, Debug)]
pub struct TrainArgs {
    /// What to train on: a token file written by `stepgraph prepare` (known
    /// by its header), or any other file as byte-level text (one token per byte).
    #[arg(help_heading = "Data", long, default_value = "data/tiny.txt")]
    pub data: PathBuf,
    /// Start from a Hugging Face model folder (config.json and safetensors
    /// weights): the model comes from its config.json, the weights are
    /// loaded and cast to --dtype, and the default learning rate is a
    /// fine-tuning one.
    #[arg(help_heading = "Model", long, value_name = "DIR", conflicts_with_all = ["model", "config"])]
    pub init_from: Option<PathBuf>,
    /// The model's tokenizer folder (or its tokenizer.json): token files of --data must be made with it, and
    /// --out copies its files [default: the --init-from folder's].
    #[arg(help_heading = "Model", long, value_name = "DIR")]
    pub tokenizer: Option<PathBuf>,
    /// Optimizer steps of the whole run.
    #[arg(help_heading = "Schedule", long, default_value_t = 200)]
    pub steps: usize,
    /// Peak learning rate [default: from the model's size; printed at start].
    #[arg(help_heading = "Optimization", long)]
    pub lr: Option<f64>,
    /// Linear warm-up steps [default: 5% of --steps, at most 2000].
    #[arg(help_heading = "Schedule", long)]
    pub warmup: Option<usize>,
    /// The learning rate the cosine decay ends at, on the last step [default: 10% of the peak].
    #[arg(help_heading = "Schedule", long)]
    pub min_lr: Option<f64>,
    /// The cosine floor as a fraction of the peak learning rate (instead of --min-lr).
    #[arg(help_heading = "Schedule", long, conflicts_with = "min_lr")]
    pub min_lr_ratio: Option<f64>,
    /// Train for this many passes over the training data instead of --steps (fractions allowed: 0.5):
    /// the steps are the epochs' sequences over the rows of a step (--batch x --grad-accum), rounded up.
    #[arg(help_heading = "Schedule", long, value_name = "N", conflicts_with = "steps")]
    pub epochs: Option<f64>,
    /// Stop (exit non-zero) at the step the loss diverges: the mean of the
    /// last 5 losses above twice its best and 1 nat over it, or the
    /// uniform model's loss with a zero gradient; without it a warning is
    /// printed at that step. Either way --keep keeps the last checkpoint
    /// saved before the best loss.
    #[arg(help_heading = "Optimization", long)]
    pub fail_on_divergence: bool,
    /// Seed for initial weights and batch sampling.
    #[arg(help_heading = "Data", long, default_value_t = 0)]
    pub seed: u64,
    /// Evaluate the loss and perplexity on the held-out split every N steps and at the end (0: never).
    #[arg(help_heading = "Validation", long, default_value_t = 50)]
    pub eval_every: usize,
    /// Batches of the held-out split each evaluation runs.
    #[arg(help_heading = "Validation", long, default_value_t = 4)]
    pub eval_batches: usize,
    /// The fraction at the end of the text held out for validation.
    #[arg(help_heading = "Data", long, default_value_t = 0.1)]
    pub val_fraction: f64,
    /// How a token file's documents share rows: `documents` packs them back to back, none seeing another
    /// (positions restart and attention stops at each boundary); `stream` lets each token see everything
    /// before it in its row (pre-training style); `none` gives each document rows of its own, padded.
    #[arg(help_heading = "Data", long, default_value = "documents", value_parser = parse_packing)]
    pub packing: Packing,
    /// Save checkpoints in DIR (one `step-NNNNNN/` each); without it none are saved.
    #[arg(help_heading = "Checkpoints", long)]
    pub checkpoint_dir: Option<PathBuf>,
    /// With --checkpoint-dir: also save every N steps, not only at the end (0: only at the end).
    #[arg(help_heading = "Checkpoints", long, default_value_t = 0)]
    pub save_every: usize,
    /// With --checkpoint-dir: keep the newest K checkpoints, deleting older ones.
    #[arg(help_heading = "Checkpoints", long, default_value_t = 3)]
    pub keep: usize,
    /// Continue a run: `auto` (the newest complete checkpoint in --checkpoint-dir,
    /// or a fresh start when there is none) or a checkpoint's `step-NNNNNN` directory.
    #[arg(help_heading = "Checkpoints", long)]
    pub resume: Option<String>,
    /// Stop after step N of the --steps run (saving a checkpoint), to continue later with --resume.
    #[arg(help_heading = "Checkpoints", long)]
    pub stop_after: Option<usize>,
    /// At the end of the run, write the model as a Hugging Face folder here
    /// (config.json, safetensors shards and index, the tokenizer files),
    /// replacing a previous save atomically.
    #[arg(help_heading = "Output", long, value_name = "DIR")]
    pub out: Option<PathBuf>,
    /// With adapters (--lora-rank or --adapter): write --out as a merged Hugging Face model folder
    /// (the base with every adapter folded in) instead of a PEFT adapter folder.
    #[arg(help_heading = "Output", long, requires = "out")]
    pub merge: bool,
    /// Continue training the adapters of a PEFT adapter folder (adapter_config.json and
    /// adapter_model.safetensors) over the --init-from base: its rank, alpha, dropout and
    /// targets, its weights as the start.
    #[arg(help_heading = "Adapters (LoRA)", long, value_name = "DIR")]
    pub adapter: Option<PathBuf>,
    /// With --out: the largest weight file in MiB; larger models are sharded with an index [default: 5 GB].
    #[arg(help_heading = "Output", long, value_name = "MIB", requires = "out")]
    pub max_shard_mb: Option<f64>,
    /// When stderr is not a terminal, log the loss every N steps (0: never).
    #[arg(help_heading = "Output", long, default_value_t = 10)]
    pub log_every: usize,
    /// A JSONL file with one row per step and per validation [default: metrics.jsonl in --checkpoint-dir].
    #[arg(help_heading = "Output", long)]
    pub metrics: Option<PathBuf>,
    /// Read flags from a TOML file whose keys are this command's flag names
    /// (`steps = 100`, `n-layer = 2` or `n_layer = 2`, `zero1 = true`); flags
    /// on the command line override it.
    #[arg(long)]
    pub run_config: Option<PathBuf>,
    /// Train on the CPU or on one GPU [default: cuda when this machine has an NVIDIA GPU].
    #[arg(help_heading = "Devices", long, value_enum)]
    pub device: Option<Backend>,
    /// Train on N GPUs: 1 is the same as --device cuda; N > 1 trains
    /// data-parallel through NCCL, one process per GPU (`--batch` is the
    /// global batch, split by rows).
    #[arg(help_heading = "Devices", long)]
    pub gpus: Option<usize>,
    /// With --gpus: shard the AdamW state over the GPUs (ZeRO-1).
    #[arg(help_heading = "Devices", long, requires = "gpus")]
    pub zero1: bool,
    /// With --gpus: gradient bucket size in MiB, like PyTorch DDP's bucket_cap_mb [default: 25].
    #[arg(help_heading = "Devices", long, requires = "gpus")]
    pub bucket_mb: Option<f64>,
    /// With --gpus: run every step eagerly instead of replaying a captured CUDA graph.
    #[arg(help_heading = "Devices", long, requires = "gpus")]
    pub eager: bool,
    /// With --gpus: run the collectives on a second stream, overlapping the
    /// backward work that does not touch their gradients.
    #[arg(help_heading = "Devices", long, requires = "gpus")]
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
        let cpu_asked = self.device == Some(Backend::Cpu);
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
                Some(Backend::Cpu) => Ok(Role::Cpu),
                Some(Backend::Cuda) => Ok(Role::Gpu),
                None if gpu_present => Ok(Role::Gpu),
                None => Ok(Role::Cpu),
            },
        }
    }

    /// The files and folders the run reads, by flag: no output may be one of them.
    pub fn inputs(&self) -> Vec<(&'static str, &Path)> {
        let mut inputs = vec![("--data", self.data.as_path())];
        let optional = [
            ("--init-from", &self.init_from),
            ("--tokenizer", &self.tokenizer),
            ("--run-config", &self.run_config),
            ("--adapter", &self.adapter),
        ];
        inputs.extend(optional.into_iter().filter_map(|(flag, p)| p.as_deref().map(|p| (flag, p))));
        if let Some(r) = self.resume.as_deref().filter(|r| *r != "auto") {
            inputs.push(("--resume", Path::new(r)));
        }
        inputs
    }

    pub fn data_parallel(&self, world: usize) -> Result<DataParallel> {
        let bucket_bytes = crate::memory_args::mib_flag("--bucket-mb", self.bucket_mb, DEFAULT_BUCKET_BYTES)?;
        Ok(DataParallel { world, bucket_bytes, zero1: self.zero1 })
    }

    /// The learning-rate schedule: the flags, or the defaults for a model
    /// of `params` parameters, each with where it came from.
    pub fn schedule(&self, params: usize, fine_tuning: bool, adapters: bool) -> Result<(LrSchedule, [String; 3])> {
        let (peak, peak_src) = match self.lr {
            Some(lr) => (lr, "--lr".to_string()),
            None if adapters => {
                let d = schedule::default_adapter_lr(params);
                (d.value, format!("default for adapters over {:.1}M parameters: {}", params as f64 / 1e6, d.source))
            }
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

/// `--packing NAME`.
pub(crate) fn parse_packing(s: &str) -> std::result::Result<Packing, String> {
    Packing::parse(s).ok_or_else(|| format!("`{s}` is not a packing; use one of {}", Packing::NAMES.join(", ")))
}

/// `--stop-after N` is a step of the run.
fn check_stop_after(args: &TrainArgs) -> Result<()> {
    match args.stop_after {
        Some(n) if n == 0 || n > args.steps => {
            bail!("--stop-after {n} must be a step of the run, from 1 to --steps {}", args.steps)
        }
        _ => Ok(()),
    }
}

/// `stepgraph train`.
pub fn run(model: &ModelArgs, optim: &OptimArgs, args: &TrainArgs, memory: &MemoryArgs) -> Result<()> {
    if let Some(e) = args.epochs {
        if !(e.is_finite() && e > 0.0) {
            bail!("--epochs {e}: give a positive number of passes over the data, such as 3 or 0.5");
        }
    }
    let role = args.role(gpu_available())?;
    // The dtype's default follows where the run trains.
    let model = &model.on_gpu(role != Role::Cpu);
    let switches = Switches::from_env()?;
    if args.steps == 0 {
        bail!("--steps 0 trains nothing: ask for at least 1 step");
    }
    if args.epochs.is_none() {
        check_stop_after(args)?;
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
    // An adapter folder to continue: its settings are the run's adapters.
    let adapter_folder = match &args.adapter {
        Some(dir) => {
            let (folder, _) = read_adapter_config(dir).with_context(|| format!("--adapter {}", dir.display()))?;
            let adapters = model.adapters.with_folder(&folder, dir)?;
            Some((dir.clone(), ModelArgs { adapters, ..model.clone() }))
        }
        None => None,
    };
    let model = adapter_folder.as_ref().map_or(model, |(_, m)| m);
    let (mut spec, pretrained) = model_spec(model, args.init_from.as_deref())?;
    if args.merge && spec.adapters.is_none() {
        bail!("--merge folds trained adapters into the base model: train adapters with --lora-rank R or --adapter DIR");
    }
    let adapter_start = match &adapter_folder {
        Some((dir, _)) => {
            let family = hf_family(&spec, pretrained.as_ref(), "--adapter")?;
            let adapters = spec.adapters.as_ref().context("an adapter folder gives adapters")?;
            Some(read_adapter_weights(dir, family, adapters).with_context(|| format!("--adapter {}", dir.display()))?)
        }
        None => None,
    };
    let out = match &args.out {
        Some(dir) => Some(OutTarget::new(dir, args, &spec, pretrained.as_ref())?),
        None => None,
    };
    spec.validate()?;
    let mut opts = optim.step_options(StepKind::Train, spec.dtype, args.zero1 && args.gpus.is_some_and(|g| g > 1))?;
    // The data before anything is compiled: a token id the model has no
    // embedding row for is refused here, naming the file. Its batches hold
    // every micro-batch of a step.
    let data =
        data::open(&args.data, spec.batch * opts.grad_accum, spec.seq, args.val_fraction, args.seed, args.packing)?;
    data.check_vocab(spec.config.padded_vocab_size, &spec.config.name)?;
    // Packed documents: the step takes each token's position in its document.
    spec.documents = data.has_positions();
    data::check_tokenizer(data.as_ref(), args.tokenizer.as_deref(), args.init_from.as_deref())?;
    // --epochs: the run's steps from the data's size, then every setting
    // that reads --steps sees them.
    let with_epochs;
    let args = match args.epochs {
        Some(epochs) => {
            let rows_per_step = (spec.batch * opts.grad_accum) as f64;
            let steps = (epochs * data.sequences_per_epoch() as f64 / rows_per_step).ceil().max(1.0) as usize;
            with_epochs = TrainArgs { steps, ..args.clone() };
            check_stop_after(&with_epochs)?;
            &with_epochs
        }
        None => args,
    };
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
    let mut config = RunConfig {
        model: spec,
        step: opts,
        data: DataConfig { path: args.data.clone(), val_fraction: args.val_fraction, packing: args.packing },
        seed: args.seed,
        gpus: world,
        switches,
        course: Course {
            steps: args.steps,
            stop_after: args.stop_after,
            // The default schedule follows the model's size, known once
            // the step is built: set below.
            schedule: LrSchedule::new(0.0, 0, 0.0, args.steps)?,
            eval_every: args.eval_every,
            eval_batches: args.eval_batches,
            checkpoints: ckpt.as_ref().map(|d| Checkpoints {
                dir: d.root.clone(),
                save_every: args.save_every,
                keep: args.keep,
            }),
            metrics: args.metrics.clone().or_else(|| ckpt.as_ref().map(|d| d.root.join("metrics.jsonl"))),
            fail_on_divergence: args.fail_on_divergence,
        },
    };
    let (compiled, compile_times) = config.compile()?;
    if role == Role::Cpu {
        // Before any batch is drawn; the session checks again as it allocates.
        stepgraph_core::host::memory::check_fits(compiled.plan.planned_peak_bytes(), "the planned training step")?;
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
    let base_params: usize = compiled.forward.frozen().map(|p| compiled.forward.ty(p).numel()).sum();
    let (schedule, sources) = match compiled.spec.adapters.is_some() {
        true => args.schedule(base_params, pretrained.is_some(), true)?,
        false => args.schedule(params, pretrained.is_some(), false)?,
    };
    config.course.schedule = schedule;
    if ckpt.is_none() && args.save_every > 0 {
        bail!("--save-every {} saves checkpoints: give them a --checkpoint-dir", args.save_every);
    }
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
            // A damaged checkpoint newer than the one resumed from is named
            // now (and moved aside by rank 0).
            let (newest, moved) = dir.resume_point(rank == 0)?;
            for (d, kept) in moved {
                eprintln!(
                    "note: --resume auto skips {}: {}; it is kept as {}",
                    d.dir.display(),
                    d.reason,
                    kept.display()
                );
            }
            newest
        }
        // `--resume auto` without --checkpoint-dir was refused above.
        (Some(path), _) => Some(PathBuf::from(path)),
    };
    let resumed = match resume_from {
        Some(dir) => {
            let state = read_resumable(&dir, &config, &compiled.step)?;
            if state.format == 1 && rank == 0 {
                eprintln!(
                    "note: {} was written by an earlier stepgraph that recorded only part of a run's settings; \
                     those were checked, the rest could not be",
                    dir.display()
                );
            }
            config.check_resume(&dir, &state)?;
            Some((dir, state))
        }
        None => None,
    };
    let resumed_from = resumed.as_ref().map(|(d, s)| (d.clone(), s.step, s.schedule));
    let placement = match &role {
        Role::Cpu => Placement::Cpu,
        Role::Gpu => Placement::Gpu,
        Role::Rank { rank, world, id_file } => {
            let id = NcclId::read_file(id_file)
                .with_context(|| format!("rank {rank}: reading the NCCL id the launcher wrote"))?;
            Placement::Rank { group: NcclGroup { id, rank: *rank, world: *world }, overlap: args.overlap }
        }
        Role::Launcher { .. } => unreachable!("the launcher starts ranks and trains nothing itself"),
    };
    let eval = eval_step(&config, &compiled, data.as_ref(), &placement)?;
    let start = Start {
        compiled,
        eval,
        data,
        placement,
        eager: args.eager,
        pretrained: pretrained.as_ref(),
        adapters: adapter_start,
        resume: resumed,
    };
    let mut trainer = Trainer::start(config, start)?;
    // The shards' maps are not needed past the initial weights.
    drop(pretrained);
    let talk = rank == 0;
    if talk {
        let gpu_default_dtype = model.on_gpu && model.dtype_defaulted();
        print_settings(args, &trainer, &sources, out.as_ref(), resumed_from.as_ref(), gpu_default_dtype);
        let session = trainer.session();
        let report = plan_report(session.trace(), session.plan(), 3);
        eprint!("{}", report.brief());
        if let (true, Some(speed)) = (report.offloaded_values > 0, session.host_link_bytes_per_second()) {
            eprintln!(
                "    bus            {:.1} GB/s (measured now): {:.1} ms of copies per step, beside the compute",
                speed / 1e9,
                report.copied_bytes_per_step as f64 / speed * 1e3
            );
        }
        // Where the time before step 1 went: tracing, planning, the session
        // (kernel load and GEMM tuning among its phases on a GPU), the weights.
        eprintln!("{}", trainer.startup(compile_times));
    }
    let steps = args.steps;
    if trainer.next_step() > steps {
        if talk {
            println!("the run is complete: its checkpoint holds step {} of {}", trainer.next_step() - 1, steps);
        }
        // Its model folder, from the checkpoint's weights.
        if let Some(report) = save_out(&mut trainer, out.as_ref(), args)? {
            eprintln!("{}", out_line(&report));
        }
        return Ok(());
    }
    if matches!(role, Role::Cpu | Role::Gpu) {
        signals::install();
    }
    let outcome = train_and_report(&mut trainer, args, out.as_ref());
    if let (Ok(()), true, Some(m)) = (&outcome, talk, trainer.metrics_path()) {
        eprintln!("metrics: {}", m.display());
    }
    if world > 1 {
        return outcome.with_context(|| format!("rank {rank} of {world}"));
    }
    outcome
}

/// Trains the steps of this process with the progress bar or log lines,
/// then prints how the run ended (rank 0).
fn train_and_report(trainer: &mut Trainer, args: &TrainArgs, out: Option<&OutTarget>) -> Result<()> {
    let steps = args.steps;
    let talk = trainer.rank() == 0;
    let start = trainer.next_step();
    let mut progress = Progress::new(talk, steps, start, args.log_every);
    let outcome = trainer.run(&mut progress, &mut || signals::requested().is_some());
    // Clear the bar so that what follows starts on its own line.
    progress.bar.finish_and_clear();
    let summary = match outcome? {
        RunEnd::Finished(summary) => summary,
        RunEnd::Stopped { step, saved, ran } => {
            let signal = signals::requested().unwrap_or(libc::SIGTERM);
            let kept = match &saved {
                Some(dir) => {
                    format!("its checkpoint is {}: continue with the same command and --resume auto", dir.display())
                }
                None => format!("no checkpoint was saved (--checkpoint-dir saves them): the {ran} steps are lost"),
            };
            let out = match out {
                Some(out) => format!("; --out {} is written only when the run reaches step {steps}", out.dir.display()),
                None => String::new(),
            };
            return Err(signals::Interrupted {
                signal,
                message: format!("stopped by {} after step {step} of {steps}; {kept}{out}", signals::name(signal)),
            }
            .into());
        }
    };
    let wrote_out = if trainer.next_step() > steps { save_out(trainer, out, args)? } else { None };
    if let (Some(msg), true) = (&summary.diverged, talk) {
        eprintln!("warning: {msg}");
    }
    let note = closing_note(trainer)?;
    if talk {
        if let Some(dir) = &summary.saved {
            eprintln!("checkpoint: {}", dir.display());
        }
        match (&wrote_out, out) {
            (Some(report), _) => eprintln!("{}", out_line(report)),
            (None, Some(out)) => eprintln!(
                "--out {} is written when the run reaches step {steps}: continue it with --resume",
                out.dir.display()
            ),
            (None, None) => {}
        }
        let ran = summary.ran;
        // A replayed GPU step of a small model takes a millisecond: say ms below a second.
        let secs = summary.took.as_secs_f64();
        let took = if secs < 1.0 { format!("{:.1} ms", secs * 1e3) } else { format!("{secs:.1} s") };
        let skipped = summary.skipped;
        if skipped > 0 {
            eprintln!(
                "skipped {skipped} batch{} without a loss target in some part (the loss mask covered every token)",
                if skipped == 1 { "" } else { "es" }
            );
        }
        // Per training step: what evaluation, checkpoints, graph capture
        // and start-up took is in the total, not here.
        let per_step = summary.step_time.as_secs_f64() * 1e3 / ran.max(1) as f64;
        let (first, last_loss) = (summary.first_loss, summary.last_loss);
        println!(
            "final loss {last_loss:.4} (first {first:.4}) after {ran} steps in {took} ({per_step:.2} ms/step); {note}"
        );
    }
    Ok(())
}

/// The run's progress on stderr: on a terminal a progress bar; otherwise
/// (a log file, CI) plain lines every `--log-every` steps.
struct Progress {
    bar: ProgressBar,
    tty: bool,
    log_every: usize,
}

impl Progress {
    fn new(talk: bool, steps: usize, start: usize, log_every: usize) -> Self {
        let tty = std::io::stderr().is_terminal();
        let bar = if talk && tty { ProgressBar::new(steps as u64) } else { ProgressBar::hidden() };
        bar.set_style(
            ProgressStyle::with_template("{spinner} [{elapsed_precise}] {bar:30} {pos}/{len} ETA {eta} {msg}")
                .expect("valid template"),
        );
        bar.set_position(start as u64 - 1);
        bar.reset_eta();
        Progress { bar, tty, log_every }
    }
}

impl Reporter for Progress {
    fn step(&mut self, r: &StepReport) {
        let (it, loss, tps, mem) = (r.step, r.loss, r.tokens_per_s, &r.memory);
        let mfu_text = r.mfu.map(|m| format!("  MFU {:.1}%", m * 100.0)).unwrap_or_default();
        let mem_text = if mem.measured {
            format!("  mem {:.0}/{:.0} MB held/planned", mb(mem.held_bytes), mb(mem.planned_bytes))
        } else {
            format!("  mem {:.1} MB planned", mb(mem.planned_bytes))
        };
        let norm_text = r.grad_norm.map(|g| format!("  |g| {g:.3}")).unwrap_or_default();
        self.bar.set_message(format!("loss {loss:.4}{norm_text}  {tps:.0} tok/s{mfu_text}{mem_text}"));
        self.bar.inc(1);
        if !self.tty && self.log_every > 0 && (it % self.log_every == 0 || it == r.last) {
            let norm_text = r.grad_norm.map(|g| format!(", grad norm {g:.3}")).unwrap_or_default();
            let (steps, lr) = (r.steps, r.lr);
            eprintln!("step {it}/{steps}: loss {loss:.4}{norm_text}, lr {lr:.3e}, {tps:.0} tok/s{mfu_text}{mem_text}");
        }
    }

    fn validation(&mut self, step: usize, val: f64) {
        self.bar.suspend(|| eprintln!("validation at step {step}: loss {val:.4}, perplexity {:.2}", val.exp()));
    }

    fn divergence(&mut self, msg: &str) {
        self.bar.suspend(|| eprintln!("warning: {msg}; the run goes on (--fail-on-divergence stops it here)"));
    }
}

/// A closing note on how the steps ran: the recording, and where the
/// backend measures its memory, the peak it held (a data-parallel rank 0's
/// evaluation session included) against the plan.
fn closing_note(trainer: &mut Trainer) -> Result<String> {
    let how = match trainer.recorded() {
        Some((label, t)) => format!("{label} in {:.2} ms", t.as_secs_f64() * 1e3),
        None => "eager".to_string(),
    };
    let m = trainer.memory()?;
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

/// The Hugging Face family of the run's model: the `--init-from` folder's,
/// or the one whose class computes the model; `flag` is what needs it.
fn hf_family(spec: &ModelSpec, pretrained: Option<&HfModelDir>, flag: &str) -> Result<HfFamily> {
    match pretrained {
        Some(hf) => Ok(hf.family()),
        None => HfFamily::of_config(&spec.config).map_err(|reason| {
            anyhow::anyhow!("{flag} needs `{}` as a Hugging Face model, which it is not: {reason}", spec.config.name)
        }),
    }
}

/// Where `--out` writes the model, checked before the run starts so that a
/// destination the save would refuse costs no training.
struct OutTarget {
    dir: PathBuf,
    /// The family and the `config.json` of `--init-from`, kept so the saved
    /// config carries the keys stepgraph does not read (token ids, ...).
    source: Option<(HfFamily, serde_json::Map<String, serde_json::Value>)>,
    /// The family the folder is written for.
    family: HfFamily,
    /// Write a peft adapter folder (a run with adapters, without --merge).
    adapter_folder: bool,
    /// The folder whose tokenizer files are copied.
    tokenizer: Option<PathBuf>,
    max_shard_bytes: u64,
}

impl OutTarget {
    fn new(dir: &Path, args: &TrainArgs, spec: &ModelSpec, pretrained: Option<&HfModelDir>) -> Result<Self> {
        let max_shard_bytes = crate::memory_args::mib_flag(
            "--max-shard-mb",
            args.max_shard_mb,
            stepgraph_core::models::hf_dir::DEFAULT_MAX_SHARD_BYTES,
        )?;
        if dir.exists() && !dir.is_dir() {
            bail!("--out {} exists and is not a folder; refusing to replace it", dir.display());
        }
        // What --out writes: an adapter folder when the run trains adapters
        // (unless --merge), a model folder otherwise.
        let adapter_folder = spec.adapters.is_some() && !args.merge;
        let replaceable = if adapter_folder { is_adapter_dir(dir) } else { HfModelDir::open(dir).is_ok() };
        if !replaceable && dir.read_dir().is_ok_and(|mut d| d.next().is_some()) {
            // A folder of something else is not replaced.
            let what = if adapter_folder {
                "no adapter folder (adapter_config.json)"
            } else {
                "no Hugging Face model (config.json and weights)"
            };
            bail!(
                "--out {} is a folder that holds files but {what}; refusing to replace it: give a new folder or \
                 one of that kind",
                dir.display()
            );
        }
        if let Some(parent) = dir.parent().filter(|p| !p.as_os_str().is_empty()) {
            std::fs::create_dir_all(parent).with_context(|| format!("--out: creating {}", parent.display()))?;
        }
        let family = hf_family(spec, pretrained, "--out")?;
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
        if adapter_folder {
            // Every adapted layer must have a name a peft folder can hold.
            if let Some(a) = &spec.adapters {
                for layer in adapted_layers(&build_forward(spec)?) {
                    peft_tensor_name(family, &format!("{layer}.lora_A.weight"), &a.targets)
                        .map_err(|e| anyhow::anyhow!("--out cannot hold these adapters as a peft folder: {e}"))?;
                }
            }
        }
        Ok(OutTarget { dir: dir.to_path_buf(), source, family, adapter_folder, tokenizer, max_shard_bytes })
    }
}

/// One line on a written `--out` folder.
fn out_line(r: &OutReport) -> String {
    let files = |names: &[String]| if names.is_empty() { "none".to_string() } else { names.join(", ") };
    match r {
        OutReport::Model(r) => format!(
            "model: {} (Hugging Face folder: {} tensors, {:.1} MB in {} file{}; tokenizer files: {})",
            r.dir.display(),
            r.tensors,
            mb(r.tensor_bytes),
            r.shards.len(),
            if r.shards.len() == 1 { "" } else { "s" },
            files(&r.tokenizer_files)
        ),
        OutReport::Adapters { dir, report } => format!(
            "adapters: {} (peft folder: {} tensors, {:.1} MB; tokenizer files: {}; load with \
             PeftModel.from_pretrained(base, DIR), or generate/eval --adapter DIR)",
            dir.display(),
            report.tensors,
            mb(report.tensor_bytes),
            files(&report.tokenizer_files)
        ),
    }
}

/// Writes the `--out` folder from the trainer's parameters (rank 0; the
/// others hold the same parameters). `None` without `--out`.
fn save_out(trainer: &mut Trainer, out: Option<&OutTarget>, args: &TrainArgs) -> Result<Option<OutReport>> {
    let Some(out) = out else { return Ok(None) };
    if trainer.rank() > 0 {
        return Ok(None);
    }
    let options = SaveOptions {
        tokenizer_from: out.tokenizer.as_deref(),
        model_from: args.init_from.as_deref(),
        max_shard_bytes: out.max_shard_bytes,
        family: out.source.as_ref().map(|(f, _)| *f),
        source_config: out.source.as_ref().map(|(_, c)| c),
    };
    let config = trainer.config().model.config.clone();
    let forward = trainer.forward().clone();
    let adapters = trainer.config().model.adapters.clone();
    if let (true, Some(adapters)) = (out.adapter_folder, &adapters) {
        let tensors = checkpoint::read_leaves(trainer.session(), true)?;
        let base = args.init_from.as_ref().map(|p| p.display().to_string());
        let r = save_adapter_dir(&out.dir, adapters, out.family, &tensors, base.as_deref(), out.tokenizer.as_deref())
            .with_context(|| format!("--out {}: writing the adapter folder", out.dir.display()))?;
        return Ok(Some(OutReport::Adapters { dir: out.dir.clone(), report: r }));
    }
    let report = match &adapters {
        // --merge: the base with every adapter folded in.
        Some(a) => {
            let mut merged = MergedWeights::new(trainer.session(), &forward, a)?;
            save_hf_dir(&out.dir, &config, &forward, &mut merged, &options)
        }
        None => save_hf_dir(&out.dir, &config, &forward, trainer.session(), &options),
    }
    .with_context(|| format!("--out {}: writing the model folder", out.dir.display()))?;
    Ok(Some(OutReport::Model(report)))
}

/// What `--out` wrote.
enum OutReport {
    Model(SaveReport),
    Adapters { dir: PathBuf, report: AdapterSaveReport },
}

/// A parameter count in words: `41.9M`, `8.03B`.
fn count(n: usize) -> String {
    match n {
        n if n >= 1_000_000_000 => format!("{:.2}B", n as f64 / 1e9),
        n if n >= 1_000_000 => format!("{:.1}M", n as f64 / 1e6),
        n if n >= 1_000 => format!("{:.1}K", n as f64 / 1e3),
        n => n.to_string(),
    }
}

/// The settings in force, each default with where it came from.
fn print_settings(
    args: &TrainArgs,
    trainer: &Trainer,
    sources: &[String; 3],
    out: Option<&OutTarget>,
    resumed: Option<&(PathBuf, usize, LrSchedule)>,
    gpu_default_dtype: bool,
) {
    let config = trainer.config();
    let (spec, s, world) = (&config.model, &config.course.schedule, config.gpus);
    let grad_accum = config.step.grad_accum;
    let per_rank = match rank_batch(spec.batch, world) {
        Ok(rows) if world > 1 => format!(" ({rows} rows per GPU)"),
        _ => String::new(),
    };
    let micro = match grad_accum {
        1 => String::new(),
        n => format!(" x {n} micro-batches"),
    };
    let epochs = match args.epochs {
        Some(e) => format!(
            " ({e} epoch{} of {} sequences)",
            if e == 1.0 { "" } else { "s" },
            trainer.data().sequences_per_epoch()
        ),
        None => String::new(),
    };
    eprintln!(
        "training {} ({} parameters, {} layers) on {}: batch {} x {}{micro} = {} tokens per step{per_rank}, {} steps{epochs}",
        spec.config.name,
        trainer.params(),
        spec.config.n_layer,
        trainer.device(),
        spec.batch,
        spec.seq,
        spec.batch * spec.seq * grad_accum,
        args.steps
    );
    eprintln!("  data        {}", trainer.data().describe());
    match &args.init_from {
        Some(dir) => eprintln!("  weights     {} (Hugging Face folder, cast to {})", dir.display(), spec.dtype),
        None => eprintln!("  weights     random (--seed {})", args.seed),
    }
    if let Some(a) = &spec.adapters {
        let forward = trainer.forward();
        let base: usize = forward.frozen().map(|v| forward.ty(v).numel()).sum();
        let trained = trainer.params();
        let storage = match a.base {
            BaseStorage::Model => format!("{} (--base-dtype nf4 stores it in 4 bits)", spec.dtype),
            BaseStorage::Nf4 { double_quant: false } => "nf4, a scale per 64 weights".to_string(),
            BaseStorage::Nf4 { double_quant: true } => "nf4, its scales quantized too (--double-quant)".to_string(),
        };
        let targets: Vec<&str> = a.targets.iter().map(|t| t.short()).collect();
        // Targets with a rank of their own (from a folder's rank_pattern).
        let own: String = a
            .ranks
            .iter()
            .map(|r| format!(" ({} rank {}, alpha {})", r.target.short(), r.rank, short(r.alpha)))
            .collect();
        let from = match &args.adapter {
            Some(dir) => format!(", continuing {}", dir.display()),
            None => String::new(),
        };
        eprintln!(
            "  adapters    LoRA rank {}, alpha {} (scale {}), dropout {} on {}{own}{from}: {} trained of {} ({:.2}%)",
            a.rank,
            short(a.alpha),
            short(a.scale()),
            a.dropout,
            targets.join(","),
            count(trained),
            count(base + trained),
            100.0 * trained as f64 / (base + trained).max(1) as f64
        );
        eprintln!("  base        frozen, {storage}");
    }
    if let Some(out) = out {
        let tok = match &out.tokenizer {
            Some(t) => format!("tokenizer files from {}", t.display()),
            None => "no tokenizer files (--tokenizer DIR copies them)".to_string(),
        };
        eprintln!("  out         {} at the end of the run ({tok})", out.dir.display());
    }
    eprintln!("  lr          peak {} ({})", short(s.peak), sources[0]);
    eprintln!("  warm-up     {} step{} ({})", s.warmup, if s.warmup == 1 { "" } else { "s" }, sources[1]);
    eprintln!("  decay       cosine to {} at step {} ({})", short(s.min), s.total, sources[2]);
    let train = trainer.train_options();
    let scope = if train.decay == DecayScope::All || train.adamw.weight_decay == 0.0 {
        ""
    } else {
        " (not on norms, biases or embeddings; --decay-all for every parameter)"
    };
    let why = if gpu_default_dtype { " (the default on a GPU; --dtype f32 for float32)" } else { "" };
    eprintln!(
        "  dtype       {}{why}, AdamW moments {}, weight decay {}{scope}, seed {}",
        spec.dtype,
        trainer.state_dtype().unwrap_or("none"),
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
    if config.step.fp8 == stepgraph_core::pipeline::Fp8Mode::Products {
        let (fp8, kept) = trainer.fp8_products();
        let kept = if kept > 0 {
            format!(", {kept} of unfit shapes (not multiples of 16) kept in {}", spec.dtype)
        } else {
            String::new()
        };
        eprintln!(
            "  fp8         {fp8} products of the decoder layers' linear layers (e4m3 activations and weights, e5m2 \
             gradients, each tensor scaled by its own amax){kept}; head and attention in {}",
            spec.dtype
        );
    }
    match train.clip_grad_norm {
        Some(c) if c > 0.0 => {
            eprintln!("  clipping    global gradient norm to {c} (--clip-grad-norm; 0 turns it off)")
        }
        _ if args.zero1 => eprintln!("  clipping    none (ZeRO-1's sharded gradients are not clipped yet)"),
        _ => eprintln!("  clipping    none"),
    }
    match (&config.course.checkpoints, resumed) {
        (None, _) => eprintln!("  checkpoints none (--checkpoint-dir DIR saves them)"),
        (Some(c), r) => {
            let every =
                if args.save_every > 0 { format!("every {} steps and ", args.save_every) } else { String::new() };
            eprintln!("  checkpoints {} ({every}at the end, keeping {})", c.dir.display(), args.keep);
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
        // Where it runs, and what it adds to the plan.
        let human = crate::output_paths::human_bytes;
        let place = match (trainer.eval_extra_bytes(), trainer.step_budget_for_validation()) {
            (Some(extra), None) => format!("; in the training arena, +{} planned", human(extra)),
            (Some(extra), Some(step)) => format!(
                "; in the training arena, +{} planned (the step planned again to {} to leave it that room \
                 under --memory-budget)",
                human(extra),
                human(step)
            ),
            (None, _) => "; its own session, with a copy of the weights".to_string(),
        };
        eprintln!("  validation  every {} steps, {} batches{place}", args.eval_every, args.eval_batches);
    }
    let set = config.switches.not_default_line();
    if !set.is_empty() {
        eprintln!("  switches    {set} (not the defaults)");
    }
}

fn mb(bytes: u64) -> f64 {
    bytes as f64 / 1e6
}

#[cfg(test)]
mod tests {
    use clap::Parser;
    use stepgraph_core::ir::OutputKind;
    use stepgraph_core::pipeline::{compile_step, StepOptions};
    use stepgraph_train::trainer::grad_norm_output;

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
        let (s, src) = t.schedule(3_000_000, false, false).unwrap();
        assert_eq!((s.peak, s.warmup, s.total), (3e-3, 5, 100));
        assert!((s.min - 3e-4).abs() < 1e-15, "{}", s.min);
        assert!(
            src[0].contains("3.0M parameters") && src[1].starts_with("default") && src[2].contains("10%"),
            "{src:?}"
        );
        let (s, _) = t.schedule(7_000_000_000, false, false).unwrap();
        assert_eq!(s.peak, 1.2e-4);
        let (s, _) = t.schedule(7_000_000_000, true, false).unwrap();
        assert_eq!(s.peak, 2e-5);
        // Adapters over an 8B base: QLoRA's rate.
        let (s, src) = t.schedule(8_000_000_000, true, true).unwrap();
        assert_eq!(s.peak, 2e-4);
        assert!(src[0].contains("adapters"), "{src:?}");
        let t = parse(&["--steps", "100", "--lr", "0.01", "--warmup", "0", "--min-lr-ratio", "0.5"]).unwrap().train;
        let (s, src) = t.schedule(3_000_000, false, false).unwrap();
        assert_eq!((s.peak, s.warmup, s.min), (0.01, 0, 0.005));
        assert_eq!(src[0], "--lr");
        let t = parse(&["--min-lr-ratio", "2"]).unwrap().train;
        assert!(t
            .schedule(1, false, false)
            .unwrap_err()
            .to_string()
            .contains("--min-lr-ratio must lie in [0, 1], got 2"));
        assert!(parse(&["--min-lr", "0.1", "--min-lr-ratio", "0.1"]).is_err());
    }
}
