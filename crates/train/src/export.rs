//! A training checkpoint as a Hugging Face model folder (or, for a run of
//! adapters, a peft adapter folder), so that any step a run saved can be
//! evaluated, sampled from, shared or loaded by `transformers`:
//! `stepgraph export` writes one where asked, and `eval` and `generate`
//! read a checkpoint given for a model folder through a temporary one.
//!
//! A checkpoint records its model in its resume identity (`state.json`'s
//! `run`: the model's configuration, dtype, adapters, and the step's
//! settings); the weights are its `weights.safetensors` under stepgraph's
//! names. The folder is written by the same `save_hf_dir` as `train --out`,
//! so it holds the same files and names. A checkpoint of adapters holds the
//! adapters alone and is written as the peft adapter folder `train --out`
//! writes for such a run.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use serde_json::{Map, Value};

use stepgraph_core::autodiff::StepKind;
use stepgraph_core::host::HostTensor;
use stepgraph_core::ir::DType;
use stepgraph_core::models::checkpoint::read_safetensors;
use stepgraph_core::models::hf_dir::{save_hf_dir, HfFamily, HfModelDir, NamedParams, SaveOptions};
use stepgraph_core::models::lora::TargetRank;
use stepgraph_core::models::peft::save_adapter_dir;
use stepgraph_core::models::{Adapters, BaseStorage, Config, LoraTarget, LossKind, ModelSpec};
use stepgraph_core::pipeline::{trace_step, StepOptions};

use crate::checkpoint::{read_complete, CheckpointDir, WEIGHTS_FILE};

/// Whether `path` is one saved step of a run (`DIR/step-000050`: its
/// state.json and weights), not a model folder.
pub fn is_checkpoint(path: &Path) -> bool {
    path.join("state.json").is_file() && path.join(WEIGHTS_FILE).is_file() && !path.join("config.json").is_file()
}

/// The checkpoint `path` names: itself, or the newest complete one of a
/// checkpoint directory.
pub fn checkpoint_of(path: &Path) -> Result<PathBuf> {
    if path.join("state.json").is_file() {
        return Ok(path.to_path_buf());
    }
    if !path.is_dir() {
        bail!("{} is not a checkpoint or a checkpoint directory (no such folder)", path.display());
    }
    match CheckpointDir::new(path).newest()? {
        Some((_, newest)) => Ok(newest),
        None => bail!(
            "{} holds no complete checkpoint (a `step-NNNNNN` folder with its state.json, as `train \
             --checkpoint-dir` writes them)",
            path.display()
        ),
    }
}

/// The model a checkpoint's run identity records: the `model.config.*`
/// keys gathered back into a [`Config`], and `model.dtype`.
pub fn recorded_model(run: &BTreeMap<String, Value>, at: &Path) -> Result<(Config, DType)> {
    let mut config = Map::new();
    for (key, value) in run {
        if let Some(field) = key.strip_prefix("model.config.") {
            config.insert(field.to_string(), value.clone());
        }
    }
    if config.is_empty() {
        bail!(
            "{} does not record its model (a checkpoint of an older stepgraph): export the run's last --out \
             folder instead, or resume it with this version and save again",
            at.display()
        );
    }
    let config: Config = serde_json::from_value(Value::Object(config))
        .with_context(|| format!("{}: the recorded model configuration does not read back", at.display()))?;
    let dtype = match run.get("model.dtype").and_then(Value::as_str) {
        Some("F32") => DType::F32,
        Some("BF16") => DType::BF16,
        Some("F16") => DType::F16,
        Some("F64") => DType::F64,
        other => bail!("{}: the recorded model.dtype {other:?} is not a dtype", at.display()),
    };
    Ok((config, dtype))
}

/// The adapters a checkpoint's run identity records (`model.adapters.*`),
/// when the run trained adapters.
pub fn recorded_adapters(run: &BTreeMap<String, Value>, at: &Path) -> Result<Option<Adapters>> {
    let key = |k: &str| run.get(&format!("model.adapters.{k}"));
    let Some(rank) = key("rank") else { return Ok(None) };
    let bad = |what: &str| anyhow::anyhow!("{}: the recorded adapters' {what} does not read back", at.display());
    let targets: Vec<&str> = key("targets")
        .and_then(Value::as_array)
        .ok_or_else(|| bad("targets"))?
        .iter()
        .filter_map(Value::as_str)
        .collect();
    let base = match key("base.kind").and_then(Value::as_str) {
        Some("nf4") => {
            BaseStorage::Nf4 { double_quant: key("base.double_quant").and_then(Value::as_bool).unwrap_or(false) }
        }
        _ => BaseStorage::Model,
    };
    let adapters = Adapters {
        rank: rank.as_u64().ok_or_else(|| bad("rank"))? as usize,
        alpha: key("alpha").and_then(Value::as_f64).ok_or_else(|| bad("alpha"))?,
        targets: LoraTarget::parse_list(&targets.join(",")).map_err(|_| bad("targets"))?,
        dropout: key("dropout").and_then(Value::as_f64).unwrap_or(0.0),
        base,
        ranks: match key("ranks") {
            None => Vec::new(),
            Some(list) => list
                .as_array()
                .ok_or_else(|| bad("ranks"))?
                .iter()
                .map(|r| {
                    let target = r["target"].as_str().and_then(|t| LoraTarget::parse_list(t).ok());
                    match (target.as_deref(), r["rank"].as_u64(), r["alpha"].as_f64()) {
                        (Some(&[target]), Some(rank), Some(alpha)) => {
                            Ok(TargetRank { target, rank: rank as usize, alpha })
                        }
                        _ => Err(bad("ranks")),
                    }
                })
                .collect::<Result<_>>()?,
        },
    };
    Ok(Some(adapters))
}

/// A checkpoint's weights by stepgraph name, as `save_hf_dir` reads them.
struct CheckpointWeights {
    name: String,
    tensors: BTreeMap<String, HostTensor>,
}

impl NamedParams for CheckpointWeights {
    fn params_trace_name(&self) -> &str {
        &self.name
    }

    fn has_param(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    fn read_param(&mut self, name: &str) -> stepgraph_core::Result<HostTensor> {
        self.tensors.get(name).cloned().ok_or_else(|| stepgraph_core::Error::Checkpoint {
            path: self.name.clone(),
            reason: format!("it has no weight `{name}` (the model it records has one)"),
        })
    }

    fn write_param(&mut self, name: &str, value: &HostTensor) -> stepgraph_core::Result<()> {
        self.tensors.insert(name.to_string(), value.clone());
        Ok(())
    }
}

/// Where an export reads what the checkpoint does not hold.
#[derive(Clone, Copy, Debug, Default)]
pub struct ExportOptions<'a> {
    /// The folder the run started from (its --init-from): the written
    /// config.json keeps its other keys (token ids, ...), its tokenizer and
    /// generation files are copied, and an adapter folder names it as its base.
    pub init_from: Option<&'a Path>,
    /// The tokenizer folder whose files are copied (default: `init_from`'s).
    pub tokenizer: Option<&'a Path>,
    /// The largest weight file; larger models are sharded with an index.
    pub max_shard_bytes: u64,
}

/// What an export wrote.
#[derive(Clone, Debug)]
pub enum Written {
    /// A model folder: its tensors and weight files.
    Model { tensors: usize, shards: usize },
    /// A peft adapter folder, for a run of adapters.
    Adapter { tensors: usize, adapters: Adapters },
}

/// One exported checkpoint.
#[derive(Clone, Debug)]
pub struct Exported {
    /// The checkpoint (`DIR/step-NNNNNN`) it came from.
    pub checkpoint: PathBuf,
    pub step: usize,
    pub loss: f64,
    pub written: Written,
    /// The tokenizer files copied.
    pub tokenizer_files: Vec<String>,
}

/// Writes the checkpoint `path` names ([`checkpoint_of`]) at `out`: a model
/// folder, or for a run of adapters a peft adapter folder.
pub fn export_checkpoint(path: &Path, out: &Path, opts: &ExportOptions) -> Result<Exported> {
    let dir = checkpoint_of(path)?;
    let state = read_complete(&dir)?;
    let (config, dtype) = recorded_model(&state.run, &dir)?;
    let pretrained = match opts.init_from {
        Some(d) => Some(HfModelDir::open(d).with_context(|| format!("--init-from {}", d.display()))?),
        None => None,
    };
    let weights_path = dir.join(WEIGHTS_FILE);
    let tokenizer = opts.tokenizer.or(opts.init_from);
    let exported = |written, tokenizer_files| Exported {
        checkpoint: dir.clone(),
        step: state.step,
        loss: state.loss,
        written,
        tokenizer_files,
    };
    if let Some(adapters) = recorded_adapters(&state.run, &dir)? {
        let family = match &pretrained {
            Some(hf) => hf.family(),
            None => HfFamily::of_config(&config).map_err(|reason| {
                anyhow::anyhow!("cannot name `{}`'s layers as a Hugging Face model: {reason}", config.name)
            })?,
        };
        let tensors = read_safetensors(&weights_path)?;
        let base = opts.init_from.map(|p| p.display().to_string());
        let r = save_adapter_dir(out, &adapters, family, &tensors, base.as_deref(), tokenizer)
            .with_context(|| format!("{}: writing the adapter folder", out.display()))?;
        return Ok(exported(Written::Adapter { tensors: r.tensors, adapters }, r.tokenizer_files));
    }
    // The forward trace names the parameters and their types; one token of
    // batch is enough, nothing runs.
    let spec = ModelSpec {
        config: config.clone(),
        batch: 1,
        seq: 1,
        dtype,
        loss: LossKind::CrossEntropy,
        adapters: None,
        documents: false,
    };
    let forward = trace_step(&spec, &StepOptions::new(StepKind::Forward))?.forward;
    let tensors: BTreeMap<String, HostTensor> = read_safetensors(&weights_path)?.into_iter().collect();
    let mut weights = CheckpointWeights { name: dir.display().to_string(), tensors };
    let options = SaveOptions {
        tokenizer_from: tokenizer,
        model_from: opts.init_from,
        max_shard_bytes: opts.max_shard_bytes,
        family: pretrained.as_ref().map(HfModelDir::family),
        source_config: pretrained.as_ref().map(HfModelDir::raw_config),
    };
    let report = save_hf_dir(out, &config, &forward, &mut weights, &options)
        .with_context(|| format!("{}: writing the model folder", out.display()))?;
    Ok(exported(Written::Model { tensors: report.tensors, shards: report.shards.len() }, report.tokenizer_files))
}

/// A checkpoint read where a folder is expected: the folder written from it
/// into a temporary directory, removed when this is dropped.
pub struct CheckpointFolder {
    /// The folder to read (inside the temporary directory).
    pub folder: PathBuf,
    pub exported: Exported,
    _temp: tempfile::TempDir,
}

/// `path` as the folder `eval` or `generate` reads: `None` when it is not a
/// training checkpoint (a folder to open as it is), else the checkpoint
/// written as a model (or adapter) folder in a temporary directory. The
/// copy costs the disk space of the weights while the command runs.
pub fn checkpoint_as_folder(path: &Path, opts: &ExportOptions) -> Result<Option<CheckpointFolder>> {
    if !is_checkpoint(path) {
        return Ok(None);
    }
    let temp = tempfile::Builder::new()
        .prefix("stepgraph-checkpoint-")
        .tempdir()
        .context("making a temporary folder for the checkpoint's weights")?;
    let folder = temp.path().join("model");
    let exported = export_checkpoint(path, &folder, opts)?;
    Ok(Some(CheckpointFolder { folder, exported, _temp: temp }))
}

/// The model folder and adapter folder a command reads, where either may
/// be given as a training checkpoint ([`checkpoint_as_folder`]).
pub struct ModelFolders {
    pub init_from: PathBuf,
    pub adapter: Option<PathBuf>,
    /// How the base was stored when the adapters came from a checkpoint
    /// (its run records it): the storage they trained over.
    pub recorded_base: Option<BaseStorage>,
    /// One line per checkpoint read, for the user.
    pub notes: Vec<String>,
    _held: Vec<CheckpointFolder>,
}

/// `init_from` and `adapter` as folders to open: each training checkpoint
/// among them written to a temporary folder first (an adapter checkpoint's
/// peft folder names its layers as the base folder does); `tokenizer`'s
/// files, when given, are copied into a written model folder.
pub fn model_folders(init_from: &Path, adapter: Option<&Path>, tokenizer: Option<&Path>) -> Result<ModelFolders> {
    let mut held = Vec::new();
    let mut notes = Vec::new();
    let mut note = |c: &CheckpointFolder, what: &str| {
        notes.push(format!(
            "reading step {} of {} (loss {:.4}) as {what}, written to a temporary folder",
            c.exported.step,
            c.exported.checkpoint.display(),
            c.exported.loss
        ))
    };
    let opts = ExportOptions {
        tokenizer,
        max_shard_bytes: stepgraph_core::models::hf_dir::DEFAULT_MAX_SHARD_BYTES,
        ..ExportOptions::default()
    };
    let model =
        match checkpoint_as_folder(init_from, &opts).with_context(|| format!("--init-from {}", init_from.display()))? {
            Some(c) if matches!(c.exported.written, Written::Adapter { .. }) => bail!(
                "--init-from {}: a checkpoint of adapters holds no model: give the base as --init-from and this \
             checkpoint as --adapter",
                init_from.display()
            ),
            Some(c) => {
                note(&c, "the model");
                let folder = c.folder.clone();
                held.push(c);
                folder
            }
            None => init_from.to_path_buf(),
        };
    let mut recorded_base = None;
    let adapter = match adapter {
        Some(a) => {
            let opts = ExportOptions { init_from: Some(&model), ..opts };
            match checkpoint_as_folder(a, &opts).with_context(|| format!("--adapter {}", a.display()))? {
                Some(c) => {
                    let Written::Adapter { adapters, .. } = &c.exported.written else {
                        bail!(
                            "--adapter {}: a checkpoint of a full fine-tune is a model, not adapters: give it as \
                             --init-from",
                            a.display()
                        );
                    };
                    recorded_base = Some(adapters.base);
                    note(&c, "the adapters");
                    let folder = c.folder.clone();
                    held.push(c);
                    Some(folder)
                }
                None => Some(a.to_path_buf()),
            }
        }
        None => None,
    };
    Ok(ModelFolders { init_from: model, adapter, recorded_base, notes, _held: held })
}
