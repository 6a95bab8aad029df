//! `stepgraph eval`: the validation loss and perplexity of a Hugging Face
//! model folder (one written by `train --out`, say, or any checkpoint a run
//! saved, read through [`stepgraph_train::export`]) on the held-out split of
//! the training data: a token file's validation documents, or the last
//! `--val-fraction` of a byte-level text. The batches are the ones a
//! training run with the same `--batch`, `--seq` and `--eval-batches`
//! evaluates, so the number compares with its `validation at step …` lines.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Args;

use stepgraph_core::autodiff::StepKind;
use stepgraph_core::models::peft::{read_adapter_config, read_adapter_weights};
use stepgraph_core::models::BaseStorage;
use stepgraph_core::pipeline::{compile_step, StepOptions};
use stepgraph_data::Packing;
use stepgraph_train::data;
use stepgraph_train::export::model_folders;
use stepgraph_train::trainer::{load_adapters, Evaluator};
use stepgraph_train::{open_session, Backend, SessionOptions};

use crate::adapter_args::BaseDTypeArg;
use crate::train;
use crate::ModelArgs;

/// `stepgraph eval`'s own flags (the batch, sequence and dtype flags are `EvalModelArgs`).
#[derive(Args, Clone, Debug)]
pub struct EvalArgs {
    /// The Hugging Face model folder to evaluate (config.json and safetensors weights), or a
    /// checkpoint a run saved (`DIR/step-000050`).
    #[arg(long, value_name = "DIR")]
    pub init_from: PathBuf,
    /// A PEFT adapter folder (adapter_config.json, adapter_model.safetensors), or a checkpoint of a
    /// run of adapters, to evaluate over the --init-from base.
    #[arg(long, value_name = "DIR")]
    pub adapter: Option<PathBuf>,
    /// With --adapter: how the base is stored, as the adapter was trained (nf4 for QLoRA) [default:
    /// model, or what an adapter checkpoint records].
    #[arg(long, value_enum, requires = "adapter")]
    pub base_dtype: Option<BaseDTypeArg>,
    /// With --base-dtype nf4: the block scales quantized too, as --double-quant trained.
    #[arg(long, requires = "base_dtype")]
    pub double_quant: bool,
    /// The data whose held-out split is evaluated: a token file of `stepgraph prepare`, or byte-level text.
    #[arg(long, default_value = "data/tiny.txt")]
    pub data: PathBuf,
    /// Batches of the held-out split to evaluate (a token file's split gives at most one pass).
    #[arg(long, default_value_t = 4)]
    pub eval_batches: usize,
    /// For byte-level text: the fraction at the end held out (as `train --val-fraction`).
    #[arg(long, default_value_t = 0.1)]
    pub val_fraction: f64,
    /// How a token file's documents share rows (as `train --packing`): documents, stream or none.
    #[arg(long, default_value = "documents", value_parser = crate::train::parse_packing)]
    pub packing: Packing,
    /// Evaluate on the CPU or on one GPU [default: cuda when this machine has an NVIDIA GPU].
    #[arg(long, value_enum)]
    pub device: Option<Backend>,
    /// Print the result as JSON.
    #[arg(long)]
    pub json: bool,
}

pub fn run(model: &ModelArgs, args: &EvalArgs) -> Result<()> {
    if args.eval_batches == 0 {
        bail!("--eval-batches 0 evaluates nothing: ask for at least 1");
    }
    // Checkpoints are read through folders written from them; messages
    // name what was given.
    let folders = model_folders(&args.init_from, args.adapter.as_deref(), None)?;
    for note in &folders.notes {
        eprintln!("{note}");
    }
    let given = args;
    let args = &EvalArgs { init_from: folders.init_from.clone(), adapter: folders.adapter.clone(), ..args.clone() };
    let backend = Backend::or_default(args.device);
    let model = &model.on_gpu(backend == Backend::Cuda);
    let (mut spec, hf) = train::model_spec(model, Some(&args.init_from))?;
    let hf = hf.expect("a folder was given");
    // An adapter folder: the model is the base with its adapters beside
    // the layers they adapt, as it trained.
    let adapter = match &args.adapter {
        Some(dir) => {
            let shown = given.adapter.as_deref().unwrap_or(dir);
            let context = || format!("--adapter {}", shown.display());
            let (mut adapters, _) = read_adapter_config(dir).with_context(context)?;
            adapters.base = match (args.base_dtype, args.double_quant) {
                (Some(BaseDTypeArg::Nf4), double_quant) => BaseStorage::Nf4 { double_quant },
                (_, true) => bail!("--double-quant applies to an nf4 base: add --base-dtype nf4"),
                (Some(BaseDTypeArg::Model), _) => BaseStorage::Model,
                (None, _) => folders.recorded_base.unwrap_or(BaseStorage::Model),
            };
            let tensors = read_adapter_weights(dir, hf.family(), &adapters).with_context(context)?;
            spec.adapters = Some(adapters);
            Some(tensors)
        }
        None => None,
    };
    let data = data::open(&args.data, spec.batch, spec.seq, args.val_fraction, 0, args.packing)?;
    spec.documents = data.has_positions();
    data.check_vocab(spec.config.padded_vocab_size, &spec.config.name)?;
    data::check_tokenizer(data.as_ref(), None, Some(&args.init_from))?;
    let (model_name, adapter_name) = (given.init_from.display(), given.adapter.as_ref().map(|a| a.display()));
    let batches = data.validation_batches(args.eval_batches)?;
    let compiled = compile_step(&spec, &StepOptions::new(StepKind::Forward))?;
    // The folder must fit before a session allocates anything.
    hf.check(&compiled.forward)?;
    let mut session = open_session(backend, compiled.step, compiled.plan, SessionOptions::default())?.session;
    hf.load_into(&compiled.forward, session.as_mut())
        .with_context(|| format!("loading the weights of {model_name}"))?;
    if let (Some(tensors), Some(name)) = (&adapter, &adapter_name) {
        load_adapters(session.as_mut(), &compiled.forward, tensors).with_context(|| format!("--adapter {name}"))?;
    }
    let n = batches.len();
    let mut eval = Evaluator::on_loaded_session(session, batches);
    let loss = eval.mean_loss(0, 1)?;
    if !loss.is_finite() {
        bail!(
            "the validation loss of {model_name} on {} is {loss}: the model's outputs are not finite. Check the \
             weights of --init-from {model_name} for NaN or Inf values, or evaluate in a wider --dtype (f32)",
            args.data.display(),
        );
    }
    if args.json {
        let row = serde_json::json!({
            "model": given.init_from, "adapter": given.adapter, "data": args.data, "batches": n, "batch": spec.batch, "seq": spec.seq,
            "val_loss": loss, "val_ppl": loss.exp(),
        });
        println!("{row}");
    } else {
        println!(
            "validation loss {loss:.4}, perplexity {:.2} ({n} batch{} of {} x {} tokens from {}, model {}{})",
            loss.exp(),
            if n == 1 { "" } else { "es" },
            spec.batch,
            spec.seq,
            args.data.display(),
            model_name,
            adapter_name.map(|a| format!(" with adapter {a}")).unwrap_or_default()
        );
    }
    Ok(())
}
