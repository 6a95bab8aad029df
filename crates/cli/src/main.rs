//! The `stepgraph` command line: `plan` (the memory plan of a step, without
//! allocating the model; with `--gpus N` the plan of one data-parallel rank
//! next to the 1-GPU plan), `trace` (the forward or step trace as text),
//! `train` (a training run on the CPU, on one GPU, or data-parallel on N
//! GPUs with `--gpus N`: one process per GPU, see [`train`]), `bench` (a
//! benchmark workload on the GPU), `compare` (one step's loss and gradients
//! against a PyTorch reference, on the CPU or the CUDA backend), `hf` (a
//! Hugging Face model folder loaded, run and written back, see [`hf_cmd`]),
//! `prepare` (text and JSONL files tokenized into a token file for
//! training, see [`prepare`]) and `eval` (a model folder's validation loss
//! on the held-out split of the training data, see [`eval`]) and `generate`
//! (text from a model, see [`generate`]).

mod adapter_args;
mod bench;
mod compare;
mod eval;
mod export;
mod fit;
mod generate;
mod hf_cmd;
mod memory_args;
mod output_paths;
mod prepare;
mod profile;
mod train;

use std::ffi::OsString;
use std::path::PathBuf;

use anyhow::{bail, Result};
use clap::{Args, CommandFactory, FromArgMatches, Parser, Subcommand, ValueEnum};

use stepgraph_core::autodiff::{DecayScope, StepKind, TrainOptions};
use stepgraph_core::dist::{DataParallel, DEFAULT_BUCKET_BYTES};
use stepgraph_core::ir::DType;
use stepgraph_core::models::{Config, LossKind, ModelSpec, Overrides};
use stepgraph_core::ops::optim::MasterWeights;
use stepgraph_core::pipeline::{compile_step, plan_data_parallel, trace_step, CompiledStep, StepOptions};
use stepgraph_core::plan::{memory_timeline_html, plan_report, TimelineOptions};

#[derive(Parser)]
#[command(name = "stepgraph", version, about = "Compile a whole training step into one planned program")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

// Parsed once per process, so the size of the largest variant (train's
// flags) costs nothing worth boxing for.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand)]
enum Command {
    /// Plan the memory of one step (no model is allocated) and report it.
    Plan {
        #[command(flatten)]
        model: ModelArgs,
        /// What one step computes [default: train, the step `train` runs].
        #[arg(long, value_enum)]
        step: Option<StepArg>,
        #[command(flatten)]
        optim: OptimArgs,
        #[command(flatten)]
        memory: memory_args::MemoryArgs,
        /// Print the report as JSON.
        #[arg(long)]
        json: bool,
        /// How many of the largest values live at the peak to list (with --verbose or --json).
        #[arg(long, default_value_t = 10)]
        top: usize,
        /// Also print the floor (the most bytes live at any one node) and the largest values live at
        /// the peak, by their ids in the trace.
        #[arg(long)]
        verbose: bool,
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
        /// Also write the memory timeline as one self-contained HTML page
        /// (bytes live per node by category, the peak, every allocation);
        /// with --gpus, the timeline of one rank.
        #[arg(long, value_name = "FILE")]
        html: Option<PathBuf>,
        /// End with a verdict: does the step fit a GPU of this much memory
        /// (24GB, 80GB, 141GB: as cards are sold, in GiB), and if not, the
        /// least it can plan and what would fit [default: the free memory
        /// of this machine's GPU, when it has one].
        #[arg(long, value_name = "SIZE")]
        gpu_memory: Option<String>,
        /// Plan the training step with validation, as `train --eval-every N`
        /// runs it: the evaluation forward in the step's arena, and what it
        /// adds to the plan.
        #[arg(long)]
        validation: bool,
    },
    /// Print a trace as text.
    Trace {
        #[command(flatten)]
        model: ModelArgs,
        /// What one step computes [default: grads].
        #[arg(long, value_enum)]
        step: Option<StepArg>,
        #[command(flatten)]
        optim: OptimArgs,
        #[command(flatten)]
        memory: memory_args::MemoryArgs,
        /// Which trace: the forward pass, or the step (`--step`): the step as
        /// it runs, after the optimizer placement and recomputation passes.
        #[arg(long, value_enum, default_value_t = Which::Step)]
        which: Which,
    },
    /// Run a benchmark workload (docs/benchmarks.md) on the GPU (eager or as one CUDA graph).
    Bench(bench::BenchArgs),
    /// Compare one grads step's loss and gradients with a PyTorch reference (torch_reference.py --save DIR).
    Compare(compare::CompareArgs),
    /// Load a Hugging Face model folder (--init-from), write its logits or gradients, or write it back (--out).
    Hf(hf_cmd::HfArgs),
    /// Write a training checkpoint (`--checkpoint-dir DIR`'s `step-NNNNNN`) as a Hugging Face model folder.
    Export(export::ExportArgs),
    /// Tokenize text, JSONL, JSON and Parquet files (plain, instruction, chat and ShareGPT records), one or a weighted mixture, into a token file for training.
    Prepare(prepare::PrepareArgs),
    /// The validation loss and perplexity of a Hugging Face model folder on the held-out split of --data.
    Eval {
        #[command(flatten)]
        model: EvalModelArgs,
        #[command(flatten)]
        eval: eval::EvalArgs,
    },
    /// Generate text from a Hugging Face folder (--init-from) or a named model with random weights: prompts in,
    /// tokens streamed out; decode steps replayed as CUDA graphs per batch bucket over one planned arena.
    Generate {
        #[command(flatten)]
        model: GenerateModelArgs,
        #[command(flatten)]
        generate: generate::GenerateArgs,
    },
    /// Train on a token file or byte-level text, from scratch or from a Hugging Face folder (--init-from),
    /// on the CPU, one GPU, or data-parallel on N GPUs (--gpus N).
    Train {
        #[command(flatten)]
        model: ModelArgs,
        #[command(flatten)]
        optim: OptimArgs,
        #[command(flatten)]
        train: train::TrainArgs,
        #[command(flatten)]
        memory: memory_args::MemoryArgs,
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

/// Which model: a name or a config, with its geometry overridden.
#[derive(Args, Clone)]
struct ModelChoiceArgs {
    /// A litgpt or Hugging Face model name (e.g. open_llama_3b, Qwen/Qwen2.5-7B) or a test config (tiny-llama).
    #[arg(help_heading = "Model", long, default_value = "tiny-llama")]
    model: String,
    /// A Hugging Face config.json (or its directory) instead of a named model.
    #[arg(help_heading = "Model", long)]
    config: Option<PathBuf>,
    /// Number of transformer layers (overrides the model's).
    #[arg(help_heading = "Model", long)]
    n_layer: Option<usize>,
    /// Embedding width (overrides the model's).
    #[arg(help_heading = "Model", long)]
    n_embd: Option<usize>,
    /// Attention heads (overrides the model's).
    #[arg(help_heading = "Model", long)]
    n_head: Option<usize>,
    /// Key/value head groups for grouped-query attention (overrides the model's).
    #[arg(help_heading = "Model", long)]
    n_query_groups: Option<usize>,
    /// Vocabulary size, the embedding rows (overrides the model's).
    #[arg(help_heading = "Model", long)]
    vocab: Option<usize>,
    /// Longest sequence the model supports (overrides the model's).
    #[arg(help_heading = "Model", long)]
    block_size: Option<usize>,
    /// Hidden width of the MLP (overrides the model's).
    #[arg(help_heading = "Model", long)]
    intermediate_size: Option<usize>,
}

impl ModelChoiceArgs {
    /// The default model with nothing overridden: what a command whose
    /// model comes from `--init-from` alone stands on.
    fn folder_only() -> Self {
        ModelChoiceArgs {
            model: "tiny-llama".into(),
            config: None,
            n_layer: None,
            n_embd: None,
            n_head: None,
            n_query_groups: None,
            vocab: None,
            block_size: None,
            intermediate_size: None,
        }
    }
}

/// Flags of the commands that run a step (`plan`, `trace`, `train`): which
/// model, which batch, which loss.
#[derive(Args, Clone)]
struct ModelArgs {
    #[command(flatten)]
    choice: ModelChoiceArgs,
    /// Rows (sequences) per step.
    #[arg(help_heading = "Data", long, default_value_t = 1)]
    batch: usize,
    /// Tokens per sequence (default: the block size, at most 2048).
    #[arg(help_heading = "Data", long)]
    seq: Option<usize>,
    /// dtype of the parameters and activations [default: bf16 on a GPU, f32 on the CPU].
    #[arg(help_heading = "Model", long, value_enum)]
    dtype: Option<DTypeArg>,
    /// Whether the step runs on (or is planned for) a GPU: the dtype's
    /// default follows it. Set by the command, not a flag.
    #[arg(skip)]
    on_gpu: bool,
    /// The loss: cross-entropy on next-token targets, or the sum of the logits (benchmarks).
    #[arg(help_heading = "Model", long, value_enum, default_value_t = LossArg::Ce)]
    loss: LossArg,
    /// A mixture of experts only: add the router z-loss (the mean squared
    /// log-sum-exp of the router's scores, ST-MoE's) to the training loss
    /// with this weight, such as 0.001; metrics report it as router_z_loss.
    #[arg(help_heading = "Model", long, value_name = "WEIGHT")]
    router_z_loss: Option<f64>,
    #[command(flatten)]
    adapters: adapter_args::AdapterArgs,
}

/// `eval`'s model flags: the model is the `--init-from` folder; the batch,
/// sequence and dtype are the run's (the loss is always cross-entropy).
#[derive(Args, Clone)]
struct EvalModelArgs {
    /// Rows (sequences) per batch.
    #[arg(long, default_value_t = 1)]
    batch: usize,
    /// Tokens per sequence (default: the block size, at most 2048).
    #[arg(long)]
    seq: Option<usize>,
    /// dtype of the parameters and activations [default: bf16 on a GPU, f32 on the CPU].
    #[arg(long, value_enum)]
    dtype: Option<DTypeArg>,
}

impl EvalModelArgs {
    fn model_args(&self) -> ModelArgs {
        ModelArgs {
            choice: ModelChoiceArgs::folder_only(),
            batch: self.batch,
            seq: self.seq,
            dtype: self.dtype,
            on_gpu: false,
            loss: LossArg::Ce,
            router_z_loss: None,
            adapters: Default::default(),
        }
    }
}

/// `generate`'s model flags: which model and its dtype (batches and lengths
/// come from the prompts and `--max-new-tokens`, and there is no loss).
#[derive(Args, Clone)]
struct GenerateModelArgs {
    #[command(flatten)]
    choice: ModelChoiceArgs,
    /// dtype of the parameters and activations [default: bf16 on a GPU, f32 on the CPU].
    #[arg(long, value_enum)]
    dtype: Option<DTypeArg>,
}

impl GenerateModelArgs {
    fn model_args(&self) -> ModelArgs {
        ModelArgs {
            choice: self.choice.clone(),
            batch: 1,
            seq: None,
            dtype: self.dtype,
            on_gpu: false,
            loss: LossArg::Ce,
            router_z_loss: None,
            adapters: Default::default(),
        }
    }
}

#[derive(Copy, Clone, ValueEnum, Debug, PartialEq)]
pub(crate) enum StateDTypeArg {
    /// float32 for f16 parameters, the parameter dtype otherwise.
    Auto,
    /// float32 moments for every parameter.
    F32,
    /// The parameter's own dtype (PyTorch's default; f16 moments underflow).
    Param,
    /// 8 bits a moment with a scale per 2048 elements (as bitsandbytes' 8-bit
    /// optimizers): 2 bytes a weight for both moments.
    #[value(name = "8bit")]
    EightBit,
}

impl StateDTypeArg {
    /// Sets the moments' dtype (or their 8-bit quantization) of `t`, whose
    /// parameters are `param`.
    pub(crate) fn apply(self, t: &mut TrainOptions, param: DType) {
        t.state_dtype = match self {
            StateDTypeArg::F32 => Some(DType::F32),
            StateDTypeArg::Auto | StateDTypeArg::EightBit => None,
            StateDTypeArg::Param => Some(param),
        };
        t.moments_8bit = self == StateDTypeArg::EightBit;
    }
}

/// What bf16/f16 parameters keep so that small updates are not rounded away.
#[derive(Copy, Clone, ValueEnum, Debug, PartialEq)]
pub(crate) enum MasterWeightsArg {
    /// An f32 copy of each parameter as optimizer state (4 bytes a weight).
    F32,
    /// A compensation of the parameter's dtype carried by the update (2 bytes a weight).
    Kahan,
    /// Nothing: updates below half a unit in the parameter's last place are lost.
    None,
}

impl MasterWeightsArg {
    /// The mode a train step takes when none is asked for.
    fn default_mode() -> Self {
        match MasterWeights::default() {
            MasterWeights::F32 => MasterWeightsArg::F32,
            MasterWeights::Kahan => MasterWeightsArg::Kahan,
            MasterWeights::None => MasterWeightsArg::None,
        }
    }

    pub(crate) fn mode(self) -> MasterWeights {
        match self {
            MasterWeightsArg::F32 => MasterWeights::F32,
            MasterWeightsArg::Kahan => MasterWeights::Kahan,
            MasterWeightsArg::None => MasterWeights::None,
        }
    }
}

/// The AdamW settings of a train step, shared by `plan`, `trace` and
/// `train` so that the step they plan and print is the step `train` runs.
#[derive(Args, Clone, Debug)]
struct OptimArgs {
    /// AdamW weight decay.
    #[arg(help_heading = "Optimization", long, default_value_t = 0.0)]
    weight_decay: f64,
    /// dtype of the AdamW moments: auto keeps them in float32 for f16
    /// parameters (f16 cannot hold (1-β2)·g²) and in the parameter dtype otherwise;
    /// 8bit quantizes them (also --optimizer-state 8bit).
    #[arg(help_heading = "Optimization", long, alias = "optimizer-state", value_enum, default_value_t = StateDTypeArg::Auto)]
    state_dtype: StateDTypeArg,
    /// Keep the AdamW moments in float32 (the same as --state-dtype f32).
    #[arg(help_heading = "Optimization", long, conflicts_with = "state_dtype")]
    f32_state: bool,
    /// What bf16/f16 parameters keep so that updates below half a unit in
    /// their last place are not rounded away: an f32 master copy, a
    /// compensation of the parameter's dtype, or nothing (f32 parameters
    /// need neither; docs/mixed-precision.md compares them).
    #[arg(help_heading = "Optimization", long, value_enum, value_name = "MODE", default_value_t = MasterWeightsArg::default_mode())]
    master_weights: MasterWeightsArg,
    /// Apply --weight-decay to every parameter; without it norm weights,
    /// biases and embedding tables are not decayed.
    #[arg(help_heading = "Optimization", long)]
    decay_all: bool,
    /// Clip the global gradient norm to X before each update, computed in
    /// the step (0: no clipping) [default: 1.0, as the Hugging Face Trainer
    /// (max_grad_norm), GPT-3, Llama 2 and nanoGPT; none with --zero1,
    /// whose sharded gradients are not clipped yet].
    #[arg(help_heading = "Optimization", long, value_name = "X")]
    clip_grad_norm: Option<f64>,
    /// Clip each step's gradients by the previous step's norm instead of its
    /// own (an approximation: a spike is clipped one step late), so that
    /// every update runs inside backward and frees its gradient at once.
    #[arg(help_heading = "Optimization", long)]
    clip_by_previous_norm: bool,
    /// Micro-batches of gradient accumulation in each step: --batch rows
    /// each, forward and backward in turn, one update (N x --batch rows a step).
    #[arg(help_heading = "Optimization", long, value_name = "N", default_value_t = 1)]
    grad_accum: usize,
}

/// `--clip-grad-norm`'s default: 1.0, the Hugging Face Trainer's
/// `max_grad_norm` and the clipping of the GPT-3 (Brown et al. 2020, appendix
/// B) and Llama 2 (Touvron et al. 2023, section 2.2) pre-training runs.
const DEFAULT_CLIP_GRAD_NORM: f64 = 1.0;

impl OptimArgs {
    /// The optimizer settings, with the user's values checked and quoted.
    /// `zero1`: the step shards its gradients (ZeRO-1), which clipping
    /// does not support yet: no clipping by default, an error when asked.
    fn train_options(&self, param: DType, zero1: bool) -> Result<TrainOptions> {
        let wd = self.weight_decay;
        if !(wd.is_finite() && wd >= 0.0) {
            bail!("--weight-decay must be a finite non-negative number, got {wd}");
        }
        let clip = match (self.clip_grad_norm, zero1) {
            (Some(c), _) if !(c.is_finite() && c >= 0.0) => {
                bail!("--clip-grad-norm must be a finite non-negative norm (0 turns clipping off), got {c}")
            }
            (Some(c), true) if c > 0.0 => bail!(
                "--clip-grad-norm {c} needs every gradient whole, and --zero1 shards them: clipping sharded \
                 gradients is not supported yet (drop --clip-grad-norm, or --zero1)"
            ),
            (Some(c), _) => c,
            (None, false) => DEFAULT_CLIP_GRAD_NORM,
            (None, true) => 0.0,
        };
        if self.clip_by_previous_norm && clip <= 0.0 {
            bail!("--clip-by-previous-norm clips by a norm: give --clip-grad-norm X (above 0)");
        }
        let mut t = TrainOptions::default();
        t.adamw.weight_decay = wd;
        t.clip_grad_norm = (clip > 0.0).then_some(clip);
        t.clip_by_previous_norm = self.clip_by_previous_norm;
        t.decay = if self.decay_all { DecayScope::All } else { DecayScope::Matrices };
        t.master_weights = self.master_weights.mode();
        let state = if self.f32_state { StateDTypeArg::F32 } else { self.state_dtype };
        state.apply(&mut t, param);
        Ok(t)
    }

    /// The step of `kind` with these settings (the optimizer's for a train
    /// step; the micro-batches for any step with a backward pass).
    fn step_options(&self, kind: StepKind, param: DType, zero1: bool) -> Result<StepOptions> {
        if self.grad_accum == 0 {
            bail!("--grad-accum 0 runs no micro-batch: use 1 (no accumulation) or more");
        }
        if self.grad_accum > 1 && kind == StepKind::Forward {
            bail!("--grad-accum {} accumulates gradients, and a forward step has none", self.grad_accum);
        }
        Ok(StepOptions {
            train: self.train_options(param, zero1)?,
            grad_accum: self.grad_accum,
            ..StepOptions::new(kind)
        })
    }
}

impl ModelArgs {
    fn config(&self) -> Result<Config> {
        let c = &self.choice;
        let base = match &c.config {
            Some(path) => Config::from_hf_file(path).map_err(|e| match e {
                stepgraph_core::Error::Io { path: file, cause } => anyhow::anyhow!(
                    "--config {}: reading {file}: {cause}; give a Hugging Face config.json or the folder that holds one",
                    path.display()
                ),
                e => e.into(),
            })?,
            None => Config::named(&c.model)?,
        };
        let o = Overrides {
            n_layer: c.n_layer,
            n_embd: c.n_embd,
            n_head: c.n_head,
            n_query_groups: c.n_query_groups,
            vocab_size: c.vocab,
            block_size: c.block_size,
            intermediate_size: c.intermediate_size,
        };
        Ok(base.with_overrides(&o)?)
    }

    fn spec(&self) -> Result<ModelSpec> {
        self.spec_of(self.config()?)
    }

    /// The spec of `config` with these flags' batch, sequence, dtype and
    /// loss, the batch and sequence checked against it.
    fn spec_of(&self, mut config: Config) -> Result<ModelSpec> {
        if let Some(weight) = self.router_z_loss {
            if !(weight.is_finite() && weight > 0.0) {
                bail!("--router-z-loss {weight}: give a weight above 0, such as 0.001");
            }
            let Some(moe) = config.moe.as_mut() else {
                bail!(
                    "--router-z-loss: `{}` has no experts (it is a loss on a mixture of experts' router)",
                    config.name
                )
            };
            moe.z_loss_coef = Some(weight);
        }
        if self.batch == 0 {
            bail!("--batch 0 holds no rows: ask for at least 1");
        }
        let seq = match self.seq {
            Some(0) => bail!("--seq 0 holds no tokens: ask for at least 1"),
            Some(seq) if seq > config.block_size => bail!(
                "--seq {seq} exceeds the block size {} of `{}`: give a shorter --seq, or a larger --block-size",
                config.block_size,
                config.name
            ),
            Some(seq) => seq,
            None => config.block_size.min(2048),
        };
        Ok(ModelSpec {
            batch: self.batch,
            seq,
            dtype: self.dtype(),
            loss: match self.loss {
                LossArg::Sum => LossKind::Sum,
                LossArg::Ce => LossKind::CrossEntropy,
            },
            config,
            adapters: self.adapters.adapters()?,
            documents: false,
        })
    }

    fn dtype(&self) -> DType {
        match self.dtype {
            Some(DTypeArg::F32) => DType::F32,
            Some(DTypeArg::Bf16) => DType::BF16,
            Some(DTypeArg::F16) => DType::F16,
            // A GPU's tensor cores run bf16 products many times faster than
            // f32 ones; the CPU backend has no bf16 arithmetic of its own.
            None if self.on_gpu => DType::BF16,
            None => DType::F32,
        }
    }

    /// These flags for a step that runs on (or is planned for) a GPU, or not.
    fn on_gpu(&self, on_gpu: bool) -> ModelArgs {
        ModelArgs { on_gpu, ..self.clone() }
    }

    /// Whether `--dtype` was left to its default.
    fn dtype_defaulted(&self) -> bool {
        self.dtype.is_none()
    }

    /// The flags that change the model's geometry, with whether each is given.
    fn geometry_flags(&self) -> [(bool, &'static str); 7] {
        let c = &self.choice;
        [
            (c.n_layer.is_some(), "--n-layer"),
            (c.n_embd.is_some(), "--n-embd"),
            (c.n_head.is_some(), "--n-head"),
            (c.n_query_groups.is_some(), "--n-query-groups"),
            (c.vocab.is_some(), "--vocab"),
            (c.block_size.is_some(), "--block-size"),
            (c.intermediate_size.is_some(), "--intermediate-size"),
        ]
    }
}

/// The size keys of a model and its batch: `batch`, `seq` and the config's.
fn size_keys() -> Vec<&'static str> {
    ["batch", "seq"].into_iter().chain(stepgraph_core::models::config::SIZE_KEYS).collect()
}

impl ModelArgs {
    /// The flags that set size `key` (a config key, or `batch` and `seq`),
    /// with the user's values: `head_size` follows `--n-embd` and
    /// `--n-head`. Flags left out, and the default `--batch 1`, are not
    /// listed.
    fn size_flags(&self, key: &str) -> Vec<String> {
        let flag = |name: &str, value: Option<usize>| value.map(|v| format!("--{name} {v}"));
        let c = &self.choice;
        let flags = match key {
            // 1 is the default.
            "batch" => vec![flag("batch", Some(self.batch).filter(|&b| b != 1))],
            "seq" => vec![flag("seq", self.seq)],
            "n_layer" => vec![flag("n-layer", c.n_layer)],
            "n_embd" => vec![flag("n-embd", c.n_embd)],
            "n_head" => vec![flag("n-head", c.n_head)],
            "n_query_groups" => vec![flag("n-query-groups", c.n_query_groups)],
            "head_size" => vec![flag("n-embd", c.n_embd), flag("n-head", c.n_head)],
            "vocab_size" | "padded_vocab_size" => vec![flag("vocab", c.vocab)],
            "block_size" => vec![flag("block-size", c.block_size)],
            "intermediate_size" => vec![flag("intermediate-size", c.intermediate_size)],
            _ => vec![],
        };
        flags.into_iter().flatten().collect()
    }

    /// `e` with what set the sizes it is about named first, when it is a
    /// size or config error of the model, or a plan refused for the host
    /// memory: the flags the user gave, then the keys of the `--config`
    /// file for the rest. A size error lists the keys its size is made of
    /// (none for a plan too large as a whole: then every size flag given
    /// is named); a config error names its keys in its text.
    fn name_size_sources(&self, e: anyhow::Error) -> anyhow::Error {
        use stepgraph_core::Error as CoreError;
        // Errors from reading `--config` name the file and its keys, and
        // come before any flag is applied.
        let file = self.choice.config.as_ref().map(|path| {
            let file = if path.is_dir() { path.join("config.json") } else { path.clone() };
            file.display().to_string()
        });
        if file.as_ref().is_some_and(|f| format!("{e:#}").contains(f.as_str())) {
            return e;
        }
        // Which keys, and whether the error says so itself (a plan past
        // the cap as a whole, or past the host memory, names none: then
        // every size flag given is named, and no file key).
        let (keys, explicit): (Vec<&str>, bool) = match e.chain().find_map(|c| c.downcast_ref::<CoreError>()) {
            Some(CoreError::Size { keys, .. }) if keys.is_empty() => (size_keys(), false),
            Some(CoreError::HostMemory { .. }) => (size_keys(), false),
            Some(CoreError::Size { keys, .. }) => (keys.clone(), true),
            Some(CoreError::Config { reason, .. }) => (stepgraph_core::models::config::keys_named_in(reason), true),
            _ => return e,
        };
        let mut sources: Vec<String> = Vec::new();
        let mut file_keys: Vec<&str> = Vec::new();
        for key in &keys {
            let flags = self.size_flags(key);
            if flags.is_empty() {
                if let Some(k) = stepgraph_core::models::hf::hf_key(key).filter(|_| explicit) {
                    if !file_keys.contains(&k) {
                        file_keys.push(k);
                    }
                }
            }
            for flag in flags {
                if !sources.contains(&flag) {
                    sources.push(flag);
                }
            }
        }
        if let (Some(file), false) = (file, file_keys.is_empty()) {
            sources.push(format!("{file} (key {})", file_keys.join(", key ")));
        }
        if sources.is_empty() {
            e
        } else {
            e.context(sources.join(", "))
        }
    }
}

/// The timeline page's heading: model, layers, dtype, batch × tokens, step.
fn timeline_title(spec: &ModelSpec, kind: StepKind) -> String {
    let step = match kind {
        StepKind::Forward => "forward",
        StepKind::Grads => "forward + backward",
        StepKind::Train => "training step (AdamW)",
    };
    format!(
        "{} ({} layers), {}, {} × {} tokens, {} loss, {step}",
        spec.config.name,
        spec.config.n_layer,
        spec.dtype,
        spec.batch,
        spec.seq,
        match spec.loss {
            LossKind::Sum => "sum(logits)",
            LossKind::CrossEntropy => "cross-entropy",
        }
    )
}

/// Writes the memory timeline of `c` to `path` through a temporary file
/// renamed into place, so a failed write never leaves half a page.
fn write_timeline(path: &std::path::Path, c: &stepgraph_core::pipeline::CompiledStep, title: String) -> Result<()> {
    use anyhow::Context;
    let page = memory_timeline_html(&c.step, &c.plan, &TimelineOptions { title, recomputed: c.recompute().nodes() });
    stepgraph_core::models::checkpoint::write_atomic(path, |out| out.write_all(page.as_bytes()))
        .with_context(|| format!("--html: writing {}", path.display()))?;
    eprintln!("memory timeline written to {}", path.display());
    Ok(())
}

/// The step `--step` asks for, or `default` without it (`plan`: the train
/// step, what `train` runs; `trace`: the gradients step).
fn step_kind(step: Option<StepArg>, default: StepKind) -> StepKind {
    match step {
        None => default,
        Some(StepArg::Grads) => StepKind::Grads,
        Some(StepArg::Forward) => StepKind::Forward,
        Some(StepArg::Train) => StepKind::Train,
    }
}

/// Parses the command line; for `train --run-config FILE`, the file's flags
/// go before the command line's, for the flags the command line did not set
/// ([`train::config_file`]).
fn parse(argv: Vec<OsString>) -> Result<Cli> {
    let matches = Cli::command().get_matches_from(&argv);
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    let Command::Train { train: ref args, .. } = cli.command else { return Ok(cli) };
    let Some(file) = args.run_config.clone() else { return Ok(cli) };
    let mut cmd = Cli::command();
    cmd.build();
    let train_cmd = cmd.find_subcommand("train").expect("train is a subcommand");
    let given = matches.subcommand_matches("train").expect("parsed as train");
    let extra = train::config_file::file_args(train_cmd, &file, given)?;
    // `stepgraph train` has no options before the subcommand: argv[1] is `train`.
    let merged: Vec<OsString> = argv[..2].iter().cloned().chain(extra).chain(argv[2..].iter().cloned()).collect();
    Ok(Cli::parse_from(merged))
}

fn main() {
    let result = parse(std::env::args_os().collect()).and_then(run);
    if let Err(e) = result {
        eprintln!("error: {e:#}");
        // A run stopped by a signal exits as the shell reports one the signal ended.
        let code = e.downcast_ref::<train::signals::Interrupted>().map_or(1, |i| i.exit_code());
        std::process::exit(code);
    }
}

/// Runs the command; an error about the model's sizes names the flags
/// (or `config.json` keys) they came from.
fn run(cli: Cli) -> Result<()> {
    let model = match &cli.command {
        Command::Plan { model, .. } | Command::Trace { model, .. } | Command::Train { model, .. } => {
            Some(model.clone())
        }
        _ => None,
    };
    match (run_command(cli), model) {
        (Err(e), Some(model)) => Err(model.name_size_sources(e)),
        (result, _) => result,
    }
}

fn run_command(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Plan { gpus: Some(0), .. } => bail!("--gpus must be at least 1, got 0"),
        Command::Plan { model, step, optim, memory, json, top, gpus: Some(gpus), zero1, bucket_mb, html, .. } => {
            let bucket_bytes = crate::memory_args::mib_flag("--bucket-mb", bucket_mb, DEFAULT_BUCKET_BYTES)?;
            let dp = DataParallel { world: gpus, bucket_bytes, zero1 };
            // Several GPUs are planned for: the dtype defaults as on a GPU.
            let model = model.on_gpu(true);
            let kind = step_kind(step, StepKind::Train);
            if zero1 && kind != StepKind::Train {
                bail!("--zero1 shards the AdamW state, so it needs a train step: add --step train");
            }
            let spec = model.spec()?;
            let mut opts = optim.step_options(kind, spec.dtype, zero1)?;
            memory.apply(&mut opts, memory_args::free_bytes)?;
            let report = plan_data_parallel(&spec, &opts, &dp, top)?;
            if let Some(path) = &html {
                let opts = StepOptions { data_parallel: Some(dp.clone()), ..opts };
                let rank = compile_step(&spec, &opts)?;
                let title = format!("{} (one rank of {gpus} GPUs)", timeline_title(&spec, kind));
                write_timeline(path, &rank, title)?;
            }
            if json {
                println!("{}", serde_json::to_string_pretty(&report)?);
            } else {
                print!("{report}");
            }
        }
        Command::Plan { model, step, optim, memory, json, top, html, gpu_memory, verbose, validation, .. } => {
            let switches = stepgraph_cuda::Switches::from_env()?;
            let gpu = match gpu_memory.as_deref() {
                Some(size) => Some(fit::Gpu::sold_as(size)?),
                None => fit::local_gpu()?,
            };
            // Planned for a GPU (named, or this machine's): what `train` would run there.
            let model = model.on_gpu(gpu.is_some());
            let spec = model.spec()?;
            let mut opts = optim.step_options(step_kind(step, StepKind::Train), spec.dtype, false)?;
            memory.apply(&mut opts, memory_args::free_bytes)?;
            let c = compile_step(&spec, &opts)?;
            if validation && opts.kind != StepKind::Train {
                bail!("--validation plans the evaluation beside a training step: drop --step, or use --step train");
            }
            // What the training step is on a Hopper GPU, lowered here without one
            // (a dtype without CUDA kernels, such as f64, has no count).
            const ARCH: &str = "sm_90";
            let census = stepgraph_cuda::lower::step_launches(&c.step, &c.plan, ARCH, &switches)
                .ok()
                .map(|step| profile::census(&step.launches));
            // The training program with its evaluation segment, as `train` plans it.
            let (c, eval_extra) = match validation {
                true => {
                    let p = stepgraph_core::train_program::with_validation(&c, opts.plan)?;
                    let extra = p.eval_extra_bytes;
                    (CompiledStep { step: p.trace, plan: p.plan, ..c }, Some(extra))
                }
                false => (c, None),
            };
            let report = plan_report(&c.step, &c.plan, top);
            if let Some(path) = &html {
                write_timeline(path, &c, timeline_title(&spec, opts.kind))?;
            }
            if json {
                let mut value = serde_json::to_value(&report)?;
                value["recompute"] = serde_json::to_value(c.recompute())?;
                value["offload"] = serde_json::to_value(&c.passes.offload)?;
                value["optimizer"] = serde_json::to_value(c.placement())?;
                value["epilogues"] = serde_json::to_value(c.fusion())?;
                value["f32_products"] = serde_json::to_value(opts.f32_products)?;
                value["fp8"] = serde_json::to_value(&c.passes.fp8)?;
                value["experts"] = serde_json::to_value(stepgraph_core::models::moe::ExpertsReport::of(&spec))?;
                value["switches"] = serde_json::to_value(switches)?;
                value["validation_extra_bytes"] = serde_json::to_value(eval_extra)?;
                if let Some(gpu) = gpu.clone() {
                    value["verdict"] = serde_json::to_value(fit::verdict(&spec, &opts, &c, gpu)?)?;
                }
                value["launches_sm90"] = match &census {
                    Some(census) => serde_json::json!({
                        "total": census.iter().map(|c| c.1).sum::<usize>(),
                        "by_class": census
                            .iter()
                            .map(|(class, n)| serde_json::json!({ "class": class, "launches": n }))
                            .collect::<Vec<_>>(),
                    }),
                    None => serde_json::Value::Null,
                };
                println!("{}", serde_json::to_string_pretty(&value)?);
            } else {
                if verbose {
                    print!("{report}");
                } else {
                    print!("{}", report.brief());
                }
                if let Some(experts) = stepgraph_core::models::moe::ExpertsReport::of(&spec) {
                    print!("{experts}");
                }
                if let Some(p) = c.placement() {
                    print!("{p}");
                }
                print!("{}", c.recompute());
                if let Some(offload) = &c.passes.offload {
                    print!("{offload}");
                }
                if opts.epilogues == stepgraph_core::passes::fusion::Epilogues::On {
                    println!("{}", c.fusion());
                }
                if opts.f32_products == stepgraph_core::passes::F32Products::Split3xTf32 {
                    let count =
                        |f: &dyn Fn(&stepgraph_core::ops::Op) -> bool| c.step.nodes.iter().filter(|n| f(&n.op)).count();
                    let products = count(&|op| matches!(op, stepgraph_core::ops::Op::MatMul(m) if m.tf32));
                    let splits = count(&|op| matches!(op, stepgraph_core::ops::Op::SplitTf32(_)));
                    println!(
                        "3xTF32: {} f32 products as {products} TF32 products of {splits} operand splits",
                        products / 3
                    );
                }
                if let Some(r) = &c.passes.fp8 {
                    println!(
                        "FP8: {} products of quantized operands ({} quantizations, {} of them in both layouts; {} \
                         scales); {} marked products of unfit shapes (not multiples of 16) kept in {}",
                        r.products, r.quantizations, r.both_layouts, r.scales, r.kept, spec.dtype
                    );
                }
                if let Some(extra) = eval_extra {
                    println!(
                        "validation: in the training arena, {} beyond the step's plan (its inputs, its loss, and its \
                         forward's working set where that exceeds the step's)",
                        output_paths::human_bytes(extra)
                    );
                }
                if let Some(census) = &census {
                    println!("{}", profile::census_line(ARCH, census));
                }
                let set = switches.not_default_line();
                if !set.is_empty() {
                    println!("switches: {set} (not the defaults)");
                }
                if let Some(gpu) = gpu {
                    print!("{}", fit::verdict(&spec, &opts, &c, gpu)?);
                }
            }
        }
        Command::Trace { model, step, optim, memory, which } => {
            let spec = model.on_gpu(stepgraph_cuda::session::gpu_available()).spec()?;
            let mut opts = optim.step_options(step_kind(step, StepKind::Grads), spec.dtype, false)?;
            memory.apply(&mut opts, memory_args::free_bytes)?;
            match which {
                Which::Forward => print!("{}", trace_step(&spec, &opts)?.forward),
                Which::Step => print!("{}", compile_step(&spec, &opts)?.step),
            }
        }
        Command::Bench(args) => bench::run(&args)?,
        Command::Compare(args) => compare::run(&args)?,
        Command::Hf(args) => hf_cmd::run(&args)?,
        Command::Export(args) => export::run(&args)?,
        Command::Prepare(args) => prepare::run(&args)?,
        Command::Eval { model, eval } => eval::run(&model.model_args(), &eval)?,
        Command::Generate { model, generate } => generate::run(&model.model_args(), &generate)?,
        Command::Train { model, optim, train, memory } => train::run(&model, &optim, &train, &memory)?,
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    /// Every flag of every command says what it does in `--help`.
    #[test]
    fn every_argument_has_help_text() {
        fn walk(cmd: &clap::Command, path: &str, missing: &mut Vec<String>) {
            for a in cmd.get_arguments() {
                let builtin = matches!(a.get_id().as_str(), "help" | "version");
                if !builtin && !a.is_hide_set() && a.get_help().is_none() && a.get_long_help().is_none() {
                    missing.push(format!("{path} --{}", a.get_long().unwrap_or(a.get_id().as_str())));
                }
            }
            for sub in cmd.get_subcommands() {
                walk(sub, &format!("{path} {}", sub.get_name()), missing);
            }
        }
        let mut missing = Vec::new();
        walk(&super::Cli::command(), "stepgraph", &mut missing);
        assert!(missing.is_empty(), "arguments without help: {missing:?}");
    }
}

#[cfg(test)]
mod dtype_defaults {
    use super::*;
    use clap::Parser;

    fn model(args: &[&str]) -> ModelArgs {
        let cli = Cli::try_parse_from([&["stepgraph", "train"], args].concat()).unwrap();
        let Command::Train { model, .. } = cli.command else { unreachable!() };
        model
    }

    /// bf16 on a GPU, f32 on the CPU, unless `--dtype` says otherwise.
    #[test]
    fn the_dtype_follows_the_device_unless_given() {
        assert_eq!(model(&[]).on_gpu(true).spec().unwrap().dtype, DType::BF16);
        assert_eq!(model(&[]).on_gpu(false).spec().unwrap().dtype, DType::F32);
        for (flag, dtype) in [("f32", DType::F32), ("bf16", DType::BF16), ("f16", DType::F16)] {
            for gpu in [false, true] {
                assert_eq!(model(&["--dtype", flag]).on_gpu(gpu).spec().unwrap().dtype, dtype, "{flag} {gpu}");
            }
        }
        assert!(model(&[]).dtype_defaulted() && !model(&["--dtype", "f32"]).dtype_defaulted());
    }
}
