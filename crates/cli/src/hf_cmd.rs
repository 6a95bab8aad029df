//! `stepgraph hf`: a Hugging Face model folder through stepgraph, for
//! checking the loader and the writer against `transformers`
//! (`scripts/hf_roundtrip.py` drives it on the GPU machine).
//!
//! It opens `--init-from DIR` ([`HfModelDir`]), checks it against the model
//! its `config.json` describes, and then, as asked:
//! - `--ids FILE --logits-out FILE`: runs the forward pass on `input_ids`
//!   (i64 or i32 `[batch, seq]` in a safetensors file) and writes `logits`
//!   (f32 `[batch, seq, vocab]`) and the cross-entropy `loss` (`labels =
//!   input_ids`, as `transformers` computes it);
//! - `--ids FILE --grads-out FILE`: runs one grads step on the same batch
//!   and writes `loss` and every parameter's gradient under its Hugging Face
//!   name and layout (GPT-NeoX's fused q/k/v included);
//! - `--out DIR`: writes the loaded model back as a Hugging Face folder
//!   ([`save_hf_dir`]), with the tokenizer files of `--init-from`;
//! - with `--adapter DIR` (a peft folder), the logits are the adapted
//!   model's and the gradients the adapters' (under peft's names), as
//!   `peft`'s model computes them.
//!
//! No output may replace an input: an output path that resolves (through
//! `..` and links) to `--init-from` or `--ids`, lies inside `--init-from`,
//! or is a folder holding either, is refused before anything is read.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};

use crate::output_paths::refuse_overwriting_inputs;

use stepgraph_core::autodiff::{build_step, StepKind, TrainOptions};
use stepgraph_core::host::HostTensor;
use stepgraph_core::ir::{DType, OutputKind, TensorType};
use stepgraph_core::models::checkpoint::{read_safetensors, reference_batch, write_safetensors_atomic};
use stepgraph_core::models::gpt::{build_forward_with_logits, LOGITS_OUTPUT};
use stepgraph_core::models::hf_dir::{save_hf_dir, to_hf_tensors, HfModelDir, SaveOptions};
use stepgraph_core::models::{LossKind, ModelSpec};
use stepgraph_core::pipeline::{compile_step, StepOptions};
use stepgraph_core::plan::{check_plan, plan, PlanOptions};

use stepgraph_core::models::peft::{peft_layout, peft_tensor_name, read_adapter_config, read_adapter_weights};
use stepgraph_train::trainer::load_adapters;
use stepgraph_train::{open_session, Backend, SessionOptions};

/// Flags of `stepgraph hf`.
#[derive(clap::Args, Clone, Debug)]
pub struct HfArgs {
    /// The Hugging Face model folder to load (config.json and safetensors weights).
    #[arg(long, value_name = "DIR")]
    pub init_from: PathBuf,
    /// A safetensors file holding `input_ids` ([batch, seq], i64 or i32) for --logits-out and --grads-out.
    #[arg(long, value_name = "FILE")]
    pub ids: Option<PathBuf>,
    /// Write the forward pass's `logits` (f32) and cross-entropy `loss` on --ids to this safetensors file.
    #[arg(long, value_name = "FILE", requires = "ids")]
    pub logits_out: Option<PathBuf>,
    /// Write one grads step's `loss` and gradients on --ids (Hugging Face names) to this safetensors file.
    #[arg(long, value_name = "FILE", requires = "ids")]
    pub grads_out: Option<PathBuf>,
    /// A PEFT adapter folder over the model: --logits-out runs the model with its adapters, and
    /// --grads-out writes the adapters' gradients under peft's tensor names.
    #[arg(long, value_name = "DIR", conflicts_with = "out")]
    pub adapter: Option<PathBuf>,
    /// Write the loaded model as a Hugging Face folder here (replaced atomically if it exists).
    #[arg(long, value_name = "DIR")]
    pub out: Option<PathBuf>,
    /// With --out: the largest weight file in MiB; larger models are sharded with an index [default: 5 GB].
    #[arg(long, value_name = "MIB")]
    pub max_shard_mb: Option<f64>,
    /// The dtype the model runs in; weights of another float dtype are cast.
    #[arg(long, value_enum, default_value_t = HfDType::F32)]
    pub dtype: HfDType,
    /// Where to run; `--backend` is the same flag under its older name.
    #[arg(long = "device", alias = "backend", value_enum, default_value_t = Backend::Cpu)]
    pub backend: Backend,
}

/// The dtype `stepgraph hf` runs the model in.
#[derive(Copy, Clone, PartialEq, Eq, Debug, clap::ValueEnum)]
pub enum HfDType {
    F32,
    Bf16,
    F16,
}

impl HfDType {
    fn dtype(self) -> DType {
        match self {
            HfDType::F32 => DType::F32,
            HfDType::Bf16 => DType::BF16,
            HfDType::F16 => DType::F16,
        }
    }
}

pub fn run(args: &HfArgs) -> Result<()> {
    if args.logits_out.is_none() && args.grads_out.is_none() && args.out.is_none() {
        bail!("nothing to do: give --logits-out, --grads-out (both with --ids) or --out");
    }
    let max_shard_bytes = crate::memory_args::mib_flag(
        "--max-shard-mb",
        args.max_shard_mb,
        stepgraph_core::models::hf_dir::DEFAULT_MAX_SHARD_BYTES,
    )?;
    let mut inputs = vec![("--init-from", args.init_from.as_path())];
    inputs.extend(args.ids.as_deref().map(|ids| ("--ids", ids)));
    for (flag, out) in [("--out", &args.out), ("--logits-out", &args.logits_out), ("--grads-out", &args.grads_out)] {
        if let Some(out) = out {
            refuse_overwriting_inputs(flag, out, &inputs)?;
        }
    }
    let hf = HfModelDir::open(&args.init_from)?;
    let config = hf.config().clone();
    let dtype = args.dtype.dtype();

    let ids = match &args.ids {
        None => None,
        Some(path) => {
            let mut tensors = read_safetensors(path)?;
            let k = tensors
                .iter()
                .position(|(name, _)| name == "input_ids")
                .with_context(|| format!("{} has no tensor `input_ids`", path.display()))?;
            let ids = tensors.swap_remove(k).1;
            if ids.ty.rank() != 2 || ids.ty.numel() == 0 {
                bail!("`input_ids` in {} must be a non-empty [batch, seq] tensor, got {}", path.display(), ids.ty);
            }
            Some(ids)
        }
    };
    let (batch, seq) = ids.as_ref().map_or((1, 1), |ids| (ids.ty.shape[0], ids.ty.shape[1]));
    let adapter = match &args.adapter {
        Some(dir) => {
            let context = || format!("--adapter {}", dir.display());
            let (adapters, _) = read_adapter_config(dir).with_context(context)?;
            let tensors = read_adapter_weights(dir, hf.family(), &adapters).with_context(context)?;
            Some((adapters, tensors))
        }
        None => None,
    };
    let adapters = adapter.as_ref().map(|(a, _)| a.clone());
    let spec = ModelSpec {
        config: config.clone(),
        batch,
        seq,
        dtype,
        loss: LossKind::CrossEntropy,
        adapters,
        documents: false,
    };

    // The forward pass with its logits kept: checked, loaded, run, and saved from.
    let forward = build_forward_with_logits(&spec)?;
    hf.check(&forward)?;
    let step = build_step(&forward, StepKind::Forward, &TrainOptions::default())?;
    let memory = plan(&step, PlanOptions::default())?;
    check_plan(&step, &memory)?;
    let mut session = open_session(args.backend, step, memory, SessionOptions::default())?.session;
    hf.load_into(&forward, session.as_mut())?;
    if let Some((_, tensors)) = &adapter {
        load_adapters(session.as_mut(), &forward, tensors)?;
    }

    if let (Some(out), Some(ids)) = (&args.logits_out, &ids) {
        for (name, value) in reference_batch(ids, LossKind::CrossEntropy)? {
            session.write_named(name, &value)?;
        }
        session.run_eager()?;
        let loss = session.loss()?;
        let logits_id = session
            .trace()
            .outputs
            .iter()
            .find(|o| o.kind == OutputKind::Named(LOGITS_OUTPUT.into()))
            .map(|o| o.value)
            .context("the forward trace has no logits output")?;
        let logits = session.read(logits_id)?;
        let logits = HostTensor::from_f64(logits.ty.with_dtype(DType::F32), &logits.to_f64());
        let loss = HostTensor::from_f64(TensorType::new(DType::F32, [1]), &[loss]);
        write_safetensors_atomic(out, &[("logits".into(), logits), ("loss".into(), loss)])?;
        println!("hf: wrote logits {:?} and loss of `{}` to {}", spec_shape(&spec), config.name, out.display());
    }

    if let Some(out) = &args.out {
        let options = SaveOptions {
            tokenizer_from: Some(&args.init_from),
            model_from: Some(&args.init_from),
            max_shard_bytes,
            family: Some(hf.family()),
            source_config: Some(hf.raw_config()),
        };
        let report = save_hf_dir(out, &config, &forward, session.as_mut(), &options)?;
        println!(
            "hf: saved `{}` as {} to {} ({} tensors, {} bytes, {} file(s), tokenizer files: {})",
            config.name,
            hf.family().model_type(),
            out.display(),
            report.tensors,
            report.tensor_bytes,
            report.shards.len(),
            if report.tokenizer_files.is_empty() { "none".to_string() } else { report.tokenizer_files.join(", ") }
        );
    }

    if let (Some(out), Some(ids)) = (&args.grads_out, &ids) {
        // A second session: the forward one keeps no gradients.
        drop(session);
        let compiled = compile_step(&spec, &StepOptions::new(StepKind::Grads))?;
        let mut grads = open_session(args.backend, compiled.step, compiled.plan, SessionOptions::default())?.session;
        hf.load_into(&compiled.forward, grads.as_mut())?;
        if let Some((_, tensors)) = &adapter {
            load_adapters(grads.as_mut(), &compiled.forward, tensors)?;
        }
        for (name, value) in reference_batch(ids, LossKind::CrossEntropy)? {
            grads.write_named(name, &value)?;
        }
        grads.run_eager()?;
        let loss = grads.loss()?;
        if let Some((adapters, _)) = &adapter {
            // The adapters' gradients, named and laid out as peft holds its parameters.
            let mut tensors = Vec::new();
            for p in compiled.forward.params() {
                let name = compiled.forward.value(p).kind.leaf_name().unwrap_or_default().to_string();
                let v = grads.trace().leaf_by_name(&name).and_then(|p| grads.trace().grad_of(p));
                let g = grads.read(v.with_context(|| format!("no gradient of `{name}`"))?)?;
                let peft = peft_tensor_name(hf.family(), &name, &adapters.targets).map_err(anyhow::Error::msg)?;
                let g = HostTensor::from_f64(g.ty.with_dtype(DType::F32), &g.to_f64());
                tensors.push((peft, peft_layout(&name, &g)));
            }
            tensors.push(("loss".into(), HostTensor::from_f64(TensorType::new(DType::F32, [1]), &[loss])));
            write_safetensors_atomic(out, &tensors)?;
            println!("hf: wrote loss {loss} and {} adapter gradients to {}", tensors.len() - 1, out.display());
            return Ok(());
        }
        let mut tensors = to_hf_tensors(hf.family(), &compiled.forward, config.n_head, |name| {
            let trace = grads.trace();
            let param = trace.leaf_by_name(name).with_context(|| format!("the step has no parameter `{name}`"));
            let grad = param.and_then(|p| trace.grad_of(p).with_context(|| format!("no gradient of `{name}`")));
            match grad {
                Ok(g) => grads.read(g),
                Err(e) => Err(stepgraph_core::error::Error::Input { name: name.into(), reason: e.to_string() }),
            }
        })?;
        tensors.push(("loss".into(), HostTensor::from_f64(TensorType::new(DType::F32, [1]), &[loss])));
        write_safetensors_atomic(out, &tensors)?;
        println!("hf: wrote loss {loss} and {} gradients to {}", tensors.len() - 1, out.display());
    }
    Ok(())
}

fn spec_shape(spec: &ModelSpec) -> [usize; 3] {
    [spec.batch, spec.seq, spec.config.padded_vocab_size]
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;
    use std::path::Path;

    use stepgraph_core::models::hf_dir::{HfFamily, INDEX_FILE};
    use stepgraph_core::models::{init_params, Config};

    use stepgraph_core::cpu::exec::CpuSession;

    use super::*;

    /// `name` saved from its named config with `init_params(seed)` into `dir`.
    fn save_named(name: &str, dir: &Path) {
        let config = Config::named(name).unwrap();
        let spec = ModelSpec {
            config: config.clone(),
            batch: 1,
            seq: 2,
            dtype: DType::F32,
            loss: LossKind::Sum,
            adapters: None,
            documents: false,
        };
        let c = compile_step(&spec, &StepOptions::new(StepKind::Forward)).unwrap();
        let mut s = CpuSession::new(c.step.clone(), c.plan.clone()).unwrap();
        for (v, t) in init_params(&c.forward, 11) {
            s.write_named(c.forward.value(v).kind.leaf_name().unwrap(), &t).unwrap();
        }
        save_hf_dir(dir, &config, &c.forward, &mut s, &SaveOptions::default()).unwrap();
        std::fs::write(dir.join("tokenizer.json"), b"{}").unwrap();
    }

    fn args(init_from: &Path) -> HfArgs {
        HfArgs {
            init_from: init_from.to_path_buf(),
            ids: None,
            logits_out: None,
            grads_out: None,
            adapter: None,
            out: None,
            max_shard_mb: None,
            dtype: HfDType::F32,
            backend: Backend::Cpu,
        }
    }

    #[test]
    fn logits_grads_and_a_saved_folder_from_one_command() {
        let root = tempfile::tempdir().unwrap();
        let src = root.path().join("src");
        save_named("tiny-neox", &src);
        let vocab = Config::named("tiny-neox").unwrap().padded_vocab_size;
        let (batch, seq) = (2, 6);
        let ids: Vec<f64> = (0..batch * seq).map(|i| ((i * 37 + 1) % vocab) as f64).collect();
        let ids = HostTensor::from_f64(TensorType::new(DType::I64, [batch, seq]), &ids);
        let ids_path = root.path().join("ids.safetensors");
        write_safetensors_atomic(&ids_path, &[("input_ids".into(), ids.clone())]).unwrap();

        let a = HfArgs {
            ids: Some(ids_path),
            logits_out: Some(root.path().join("logits.safetensors")),
            grads_out: Some(root.path().join("grads.safetensors")),
            out: Some(root.path().join("out")),
            max_shard_mb: Some(0.05),
            ..args(&src)
        };
        run(&a).unwrap();

        // The loss is the cross-entropy of the logits against the next token.
        let logits: HashMap<String, HostTensor> =
            read_safetensors(a.logits_out.as_ref().unwrap()).unwrap().into_iter().collect();
        assert_eq!(logits["logits"].ty, TensorType::new(DType::F32, [batch, seq, vocab]));
        let (l, id) = (logits["logits"].to_f64(), ids.to_f64());
        let mut total = 0.0;
        for b in 0..batch {
            for t in 0..seq - 1 {
                let row = &l[(b * seq + t) * vocab..][..vocab];
                let max = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let lse = max + row.iter().map(|x| (x - max).exp()).sum::<f64>().ln();
                total += lse - row[id[b * seq + t + 1] as usize];
            }
        }
        let want = total / (batch * (seq - 1)) as f64;
        let loss = logits["loss"].to_f64()[0];
        assert!((loss - want).abs() < 1e-5 * want.abs(), "{loss} vs {want}");

        // Gradients under GPT-NeoX names, from the same loss.
        let grads: HashMap<String, HostTensor> =
            read_safetensors(a.grads_out.as_ref().unwrap()).unwrap().into_iter().collect();
        assert_eq!(grads["loss"].to_f64()[0], loss);
        let n = Config::named("tiny-neox").unwrap().n_embd;
        assert_eq!(grads["gpt_neox.layers.0.attention.query_key_value.weight"].ty.shape, vec![3 * n, n]);
        assert!(grads["embed_out.weight"].to_f64().iter().any(|g| *g != 0.0));

        // The written folder: sharded, tokenizer copied, and it loads.
        let out = a.out.as_ref().unwrap();
        assert!(out.join(INDEX_FILE).exists());
        assert!(out.join("tokenizer.json").exists());
        assert_eq!(HfModelDir::open(out).unwrap().family(), HfFamily::GptNeox);
    }

    #[test]
    fn bad_flags_are_refused_with_the_value() {
        let root = tempfile::tempdir().unwrap();
        let src = root.path().join("src");
        save_named("tiny-llama", &src);
        let text = run(&args(&src)).unwrap_err().to_string();
        assert!(text.contains("nothing to do"), "{text}");
        let zero = HfArgs { out: Some(root.path().join("o")), max_shard_mb: Some(0.0), ..args(&src) };
        let text = run(&zero).unwrap_err().to_string();
        assert!(text.contains("--max-shard-mb must be a positive size in MiB, got 0"), "{text}");
        let missing = HfArgs { out: Some(root.path().join("o")), ..args(&root.path().join("nowhere")) };
        let text = format!("{:#}", run(&missing).unwrap_err());
        assert!(text.contains("nowhere") && text.contains("not a directory"), "{text}");
    }
}
