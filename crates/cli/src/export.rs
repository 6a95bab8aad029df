//! `stepgraph export`: a training checkpoint as a Hugging Face model
//! folder, so that any step a run saved can be evaluated, sampled from,
//! shared or loaded by `transformers`.
//!
//! A checkpoint records its model in its resume identity (`state.json`'s
//! `run`: the model's configuration, dtype, and the step's settings); the
//! weights are its `weights.safetensors` under stepgraph's names. The
//! folder is written by the same `save_hf_dir` as `train --out`, so it
//! holds the same files and names. A checkpoint of adapters (a LoRA run)
//! holds the adapters alone and is written as the peft adapter folder
//! `train --out` writes for such a run.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::Args;
use serde_json::{Map, Value};

use stepgraph_core::autodiff::StepKind;
use stepgraph_core::host::HostTensor;
use stepgraph_core::ir::DType;
use stepgraph_core::models::checkpoint::read_safetensors;
use stepgraph_core::models::hf_dir::HfFamily;
use stepgraph_core::models::hf_dir::{save_hf_dir, HfModelDir, NamedParams, SaveOptions, DEFAULT_MAX_SHARD_BYTES};
use stepgraph_core::models::peft::save_adapter_dir;
use stepgraph_core::models::{Adapters, BaseStorage, Config, LoraTarget, LossKind, ModelSpec};
use stepgraph_core::pipeline::{trace_step, StepOptions};
use stepgraph_train::checkpoint::{read_complete, CheckpointDir, WEIGHTS_FILE};

use crate::output_paths::{check_writable, refuse_overwriting_inputs};

#[derive(Args, Clone, Debug)]
pub struct ExportArgs {
    /// A checkpoint (`DIR/step-000050`), or a --checkpoint-dir for its newest complete checkpoint.
    pub checkpoint: PathBuf,
    /// The Hugging Face folder to write (config.json, safetensors shards and index, tokenizer files).
    #[arg(long, value_name = "DIR")]
    pub out: PathBuf,
    /// The folder the run started from (its --init-from): the written config.json keeps its other keys
    /// (token ids, ...), and its tokenizer and generation files are copied.
    #[arg(long, value_name = "DIR")]
    pub init_from: Option<PathBuf>,
    /// The tokenizer folder whose files are copied [default: the --init-from folder's].
    #[arg(long, value_name = "DIR")]
    pub tokenizer: Option<PathBuf>,
    /// The largest weight file in MiB; larger models are sharded with an index [default: 5 GB].
    #[arg(long, value_name = "MIB")]
    pub max_shard_mb: Option<f64>,
}

/// The checkpoint `path` names: itself, or the newest complete one of a
/// checkpoint directory.
fn checkpoint_of(path: &Path) -> Result<PathBuf> {
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
fn recorded_model(run: &BTreeMap<String, Value>, at: &Path) -> Result<(Config, DType)> {
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
fn recorded_adapters(run: &BTreeMap<String, Value>, at: &Path) -> Result<Option<Adapters>> {
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

pub fn run(args: &ExportArgs) -> Result<()> {
    let dir = checkpoint_of(&args.checkpoint)?;
    let state = read_complete(&dir)?;
    let (config, dtype) = recorded_model(&state.run, &dir)?;
    let pretrained = match &args.init_from {
        Some(d) => Some(HfModelDir::open(d).with_context(|| format!("--init-from {}", d.display()))?),
        None => None,
    };
    let max_shard_bytes = crate::memory_args::mib_flag("--max-shard-mb", args.max_shard_mb, DEFAULT_MAX_SHARD_BYTES)?;
    let mut inputs: Vec<(&str, &Path)> = vec![("checkpoint", dir.as_path())];
    if let Some(d) = &args.init_from {
        inputs.push(("--init-from", d));
    }
    if let Some(d) = &args.tokenizer {
        inputs.push(("--tokenizer", d));
    }
    refuse_overwriting_inputs("--out", &args.out, &inputs)?;
    let weights_path = dir.join(WEIGHTS_FILE);
    let weight_bytes = std::fs::metadata(&weights_path).map(|m| m.len()).unwrap_or(0);
    check_writable("--out", &args.out, weight_bytes)?;

    // A run of adapters: its checkpoint holds the adapters alone, written
    // as the peft folder `train --out` writes.
    if let Some(adapters) = recorded_adapters(&state.run, &dir)? {
        let family = match &pretrained {
            Some(hf) => hf.family(),
            None => HfFamily::of_config(&config).map_err(|reason| {
                anyhow::anyhow!("--out cannot name `{}`'s layers as a Hugging Face model: {reason}", config.name)
            })?,
        };
        let tensors = read_safetensors(&weights_path)?;
        let base = args.init_from.as_ref().map(|p| p.display().to_string());
        let tokenizer = args.tokenizer.as_deref().or(args.init_from.as_deref());
        let r = save_adapter_dir(&args.out, &adapters, family, &tensors, base.as_deref(), tokenizer)
            .with_context(|| format!("--out {}: writing the adapter folder", args.out.display()))?;
        eprintln!(
            "exported step {} of {} (loss {:.4}) to {}: a peft adapter folder of {} tensors (rank {}); tokenizer \
             files: {}",
            state.step,
            dir.display(),
            state.loss,
            args.out.display(),
            r.tensors,
            adapters.rank,
            if r.tokenizer_files.is_empty() { "none".to_string() } else { r.tokenizer_files.join(", ") }
        );
        return Ok(());
    }
    // The forward trace names the parameters and their types; one token of
    // batch is enough, nothing runs.
    let spec =
        ModelSpec { config: config.clone(), batch: 1, seq: 1, dtype, loss: LossKind::CrossEntropy, adapters: None };
    let forward = trace_step(&spec, &StepOptions::new(StepKind::Forward))?.forward;
    let tensors: BTreeMap<String, HostTensor> = read_safetensors(&weights_path)?.into_iter().collect();
    let mut weights = CheckpointWeights { name: dir.display().to_string(), tensors };
    let options = SaveOptions {
        tokenizer_from: args.tokenizer.as_deref().or(args.init_from.as_deref()),
        model_from: args.init_from.as_deref(),
        max_shard_bytes,
        family: pretrained.as_ref().map(HfModelDir::family),
        source_config: pretrained.as_ref().map(HfModelDir::raw_config),
    };
    let report = save_hf_dir(&args.out, &config, &forward, &mut weights, &options)
        .with_context(|| format!("--out {}: writing the model folder", args.out.display()))?;
    eprintln!(
        "exported step {} of {} (loss {:.4}) to {}: {} tensors in {} file{}; tokenizer files: {}",
        state.step,
        dir.display(),
        state.loss,
        report.dir.display(),
        report.tensors,
        report.shards.len(),
        if report.shards.len() == 1 { "" } else { "s" },
        if report.tokenizer_files.is_empty() {
            "none (--tokenizer DIR or --init-from DIR copies them)".to_string()
        } else {
            report.tokenizer_files.join(", ")
        }
    );
    Ok(())
}
