//! `stepgraph export`: a training checkpoint as a Hugging Face model
//! folder (a peft adapter folder for a run of adapters), so that any step a
//! run saved can be shared or loaded by `transformers`; the writing is
//! [`stepgraph_train::export`]'s.

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;

use stepgraph_core::models::hf_dir::DEFAULT_MAX_SHARD_BYTES;
use stepgraph_train::checkpoint::WEIGHTS_FILE;
use stepgraph_train::export::{checkpoint_of, export_checkpoint, ExportOptions, Written};

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

pub fn run(args: &ExportArgs) -> Result<()> {
    let dir = checkpoint_of(&args.checkpoint)?;
    let max_shard_bytes = crate::memory_args::mib_flag("--max-shard-mb", args.max_shard_mb, DEFAULT_MAX_SHARD_BYTES)?;
    let mut inputs: Vec<(&str, &std::path::Path)> = vec![("checkpoint", dir.as_path())];
    if let Some(d) = &args.init_from {
        inputs.push(("--init-from", d));
    }
    if let Some(d) = &args.tokenizer {
        inputs.push(("--tokenizer", d));
    }
    refuse_overwriting_inputs("--out", &args.out, &inputs)?;
    let weight_bytes = std::fs::metadata(dir.join(WEIGHTS_FILE)).map(|m| m.len()).unwrap_or(0);
    check_writable("--out", &args.out, weight_bytes)?;
    let opts =
        ExportOptions { init_from: args.init_from.as_deref(), tokenizer: args.tokenizer.as_deref(), max_shard_bytes };
    let e =
        export_checkpoint(&dir, &args.out, &opts).map_err(|e| e.context(format!("--out {}", args.out.display())))?;
    let files = |none: &str| {
        if e.tokenizer_files.is_empty() {
            none.to_string()
        } else {
            e.tokenizer_files.join(", ")
        }
    };
    match &e.written {
        Written::Adapter { tensors, adapters } => eprintln!(
            "exported step {} of {} (loss {:.4}) to {}: a peft adapter folder of {tensors} tensors (rank {}); \
             tokenizer files: {}",
            e.step,
            e.checkpoint.display(),
            e.loss,
            args.out.display(),
            adapters.rank,
            files("none")
        ),
        Written::Model { tensors, shards } => eprintln!(
            "exported step {} of {} (loss {:.4}) to {}: {tensors} tensors in {shards} file{}; tokenizer files: {}",
            e.step,
            e.checkpoint.display(),
            e.loss,
            args.out.display(),
            if *shards == 1 { "" } else { "s" },
            files("none (--tokenizer DIR or --init-from DIR copies them)")
        ),
    }
    Ok(())
}
