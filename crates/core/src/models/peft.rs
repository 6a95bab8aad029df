//! Adapter folders in the layout `peft` writes and reads: what
//! `PeftModel.from_pretrained(base, DIR)` loads, and what
//! `model.save_pretrained(DIR)` of a LoRA model leaves.
//!
//! A folder holds `adapter_config.json` (`peft_type: LORA`, the rank `r`,
//! `lora_alpha`, `lora_dropout`, `target_modules`, ...) and
//! `adapter_model.safetensors`, whose tensors are named after the base
//! model's modules under `base_model.model.`:
//! `base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`
//! (`[r, in]`) and `...lora_B.weight` (`[out, r]`). A module's name is the
//! base family's name for the layer's weight without `.weight`, so an
//! adapter is only written for layers a family stores as one tensor each
//! (not GPT-NeoX's fused `query_key_value`).
//!
//! Reading takes what stepgraph's adapters express: plain LoRA on linear
//! layers, one rank and one alpha for every layer; a folder asking for more
//! (rsLoRA, DoRA, per-layer ranks, trained biases or whole modules) is
//! refused with the key that asks for it, rather than loaded into a
//! different model.

use std::collections::BTreeSet;
use std::fs;
use std::path::Path;

use serde_json::{json, Map, Value};

use super::checkpoint::{read_safetensors, write_safetensors_atomic};
use super::family::{HfFamily, Join};
use super::hf_dir::{copy_tokenizer_files, save_folder_atomically, sync_dir, write_synced};
use super::lora::{is_adapter_weight, Adapters, BaseStorage, LoraTarget};
use crate::error::{Error, Result};
use crate::host::HostTensor;

/// The adapter settings file.
pub const ADAPTER_CONFIG: &str = "adapter_config.json";
/// The adapter weights file.
pub const ADAPTER_WEIGHTS: &str = "adapter_model.safetensors";
/// What `peft` puts before a base model's module names.
const PEFT_PREFIX: &str = "base_model.model.";

fn folder_error(dir: &Path, reason: impl Into<String>) -> Error {
    Error::Checkpoint { path: dir.display().to_string(), reason: reason.into() }
}

/// The `peft` tensor name of the adapter matrix `name` of the trace
/// (`model.layers.0.self_attn.q_proj.lora_A.weight`) in a model of `family`.
pub fn peft_tensor_name(family: HfFamily, name: &str) -> std::result::Result<String, String> {
    let (layer, matrix) = name
        .strip_suffix(".lora_A.weight")
        .map(|l| (l, "lora_A"))
        .or_else(|| name.strip_suffix(".lora_B.weight").map(|l| (l, "lora_B")))
        .ok_or_else(|| format!("`{name}` is not an adapter matrix"))?;
    let weight = format!("{layer}.weight");
    let f = family.family();
    if let Some((rule, _)) = f.rule_for_param(&weight) {
        if rule.join != Join::Same || rule.trace.len() != 1 {
            return Err(format!(
                "`{}` stores `{weight}` fused with other layers ({}), which a LoRA adapter folder cannot name",
                family.model_type(),
                rule.hf
            ));
        }
    }
    let hf = f.hf_name(&weight).ok_or_else(|| format!("`{}` has no name for `{weight}`", family.model_type()))?;
    let module = hf.strip_suffix(".weight").ok_or_else(|| format!("`{hf}` is not a weight"))?;
    Ok(format!("{PEFT_PREFIX}{module}.{matrix}.weight"))
}

/// The trace's name of the `peft` tensor `name` in a folder for `family`.
fn trace_tensor_name(family: HfFamily, name: &str) -> Option<String> {
    let rest = name.strip_prefix(PEFT_PREFIX)?;
    let (module, matrix) = rest
        .strip_suffix(".lora_A.weight")
        .map(|m| (m, "lora_A"))
        .or_else(|| rest.strip_suffix(".lora_B.weight").map(|m| (m, "lora_B")))?;
    let params = family.family().param_names(&format!("{module}.weight"));
    let [param] = &params[..] else { return None };
    let layer = param.strip_suffix(".weight")?;
    Some(format!("{layer}.{matrix}.weight"))
}

/// What [`save_adapter_dir`] wrote.
#[derive(Clone, Debug)]
pub struct AdapterSaveReport {
    pub tensors: usize,
    pub tensor_bytes: u64,
    pub tokenizer_files: Vec<String>,
}

/// Writes `tensors` (the adapter matrices by trace name, as read from a
/// session) as a `peft` adapter folder at `dir`, whole or not at all (as
/// [`super::hf_dir::save_hf_dir`] writes a model folder), with the
/// tokenizer files of `tokenizer_from`. `base_model` is recorded as
/// `base_model_name_or_path`, which `peft` shows and `AutoPeftModel` loads.
pub fn save_adapter_dir(
    dir: &Path,
    adapters: &Adapters,
    family: HfFamily,
    tensors: &[(String, HostTensor)],
    base_model: Option<&str>,
    tokenizer_from: Option<&Path>,
) -> Result<AdapterSaveReport> {
    let mut named = Vec::with_capacity(tensors.len());
    let mut modules = BTreeSet::new();
    for (name, t) in tensors {
        let peft = peft_tensor_name(family, name).map_err(|reason| folder_error(dir, reason))?;
        let module = peft.trim_end_matches(".weight").rsplit_once('.').map(|(m, _)| m).unwrap_or_default();
        modules.insert(module.rsplit('.').next().unwrap_or_default().to_string());
        named.push((peft, t.clone()));
    }
    if named.is_empty() {
        return Err(folder_error(dir, "the model has no adapters to save"));
    }
    let config = json!({
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": adapters.rank,
        "lora_alpha": adapters.alpha,
        "lora_dropout": adapters.dropout,
        "target_modules": modules.into_iter().collect::<Vec<_>>(),
        "bias": "none",
        "fan_in_fan_out": false,
        "inference_mode": true,
        "init_lora_weights": true,
        "modules_to_save": null,
        "layers_to_transform": null,
        "layers_pattern": null,
        "rank_pattern": {},
        "alpha_pattern": {},
        "use_rslora": false,
        "use_dora": false,
        "revision": null,
    });
    let tensor_bytes = named.iter().map(|(_, t)| t.bytes().len() as u64).sum();
    let count = named.len();
    save_folder_atomically(dir, |temp| {
        write_safetensors_atomic(&temp.join(ADAPTER_WEIGHTS), &named)?;
        write_synced(&temp.join(ADAPTER_CONFIG), &serde_json::to_vec_pretty(&config)?)?;
        let tokenizer_files = copy_tokenizer_files(temp, tokenizer_from, None)?;
        sync_dir(temp)?;
        Ok(AdapterSaveReport { tensors: count, tensor_bytes, tokenizer_files })
    })
}

/// An adapter folder, read.
#[derive(Clone, Debug)]
pub struct AdapterDir {
    /// Rank, alpha, dropout and targets from `adapter_config.json` (the base
    /// stored in the model's dtype: how the base is stored is a choice of
    /// the run, not of the folder).
    pub adapters: Adapters,
    /// The adapter matrices by trace name, as stored.
    pub tensors: Vec<(String, HostTensor)>,
    /// `base_model_name_or_path`, when the folder names one.
    pub base_model: Option<String>,
}

/// Whether `dir` holds an adapter folder (its `adapter_config.json`).
pub fn is_adapter_dir(dir: &Path) -> bool {
    dir.join(ADAPTER_CONFIG).is_file()
}

/// Reads the adapter folder `dir` for a base model of `family`, refusing
/// what stepgraph's adapters cannot express (see the module doc).
pub fn read_adapter_dir(dir: &Path, family: HfFamily) -> Result<AdapterDir> {
    let (adapters, base_model) = read_adapter_config(dir)?;
    let tensors = read_adapter_weights(dir, family)?;
    let mut targets: Vec<LoraTarget> = Vec::new();
    for (name, _) in &tensors {
        let layer = name.trim_end_matches(".weight").rsplit_once('.').map(|(l, _)| l).unwrap_or_default();
        if let Some(t) = LoraTarget::of_layer(layer).filter(|t| !targets.contains(t)) {
            targets.push(t);
        }
    }
    targets.sort();
    if targets != adapters.targets {
        let names = |ts: &[LoraTarget]| ts.iter().map(|t| t.module()).collect::<Vec<_>>().join(", ");
        return Err(folder_error(
            dir,
            format!(
                "{ADAPTER_CONFIG} targets {} but {ADAPTER_WEIGHTS} adapts {}",
                names(&adapters.targets),
                names(&targets)
            ),
        ));
    }
    Ok(AdapterDir { adapters, tensors, base_model })
}

/// The settings of the adapter folder `dir` (`adapter_config.json`) and
/// the base model it names, refusing what stepgraph's adapters cannot
/// express. The base is stored in the model's dtype here: how it is
/// stored is a choice of the run, not of the folder.
pub fn read_adapter_config(dir: &Path) -> Result<(Adapters, Option<String>)> {
    let config_path = dir.join(ADAPTER_CONFIG);
    let text = fs::read_to_string(&config_path).map_err(|e| {
        folder_error(dir, format!("no readable {ADAPTER_CONFIG} ({e}): not an adapter folder (a PEFT save_pretrained)"))
    })?;
    let config: Map<String, Value> =
        serde_json::from_str(&text).map_err(|e| folder_error(&config_path, format!("is not a JSON object: {e}")))?;
    let bad = |reason: String| folder_error(&config_path, reason);
    let peft_type = config.get("peft_type").and_then(Value::as_str).unwrap_or("LORA");
    if peft_type != "LORA" {
        return Err(bad(format!("holds a `{peft_type}` adapter; stepgraph reads LoRA adapters (peft_type LORA)")));
    }
    let truthy = |key: &str| config.get(key).is_some_and(|v| v.as_bool() == Some(true));
    for (key, what) in [("use_rslora", "rank-stabilised scaling"), ("use_dora", "DoRA's magnitude vectors")] {
        if truthy(key) {
            return Err(bad(format!("sets `{key}` ({what}), which stepgraph's adapters do not compute")));
        }
    }
    for key in ["rank_pattern", "alpha_pattern"] {
        if config.get(key).and_then(Value::as_object).is_some_and(|m| !m.is_empty()) {
            return Err(bad(format!("sets `{key}` (a rank or alpha per layer); stepgraph uses one for every layer")));
        }
    }
    match config.get("bias").and_then(Value::as_str) {
        None | Some("none") => {}
        Some(b) => return Err(bad(format!("trains biases (`bias`: \"{b}\"); stepgraph's adapters train none"))),
    }
    if config.get("modules_to_save").is_some_and(|v| !v.is_null() && v.as_array().is_none_or(|a| !a.is_empty())) {
        return Err(bad(
            "saves whole modules beside the adapters (`modules_to_save`), which stepgraph does not load".into()
        ));
    }
    if truthy("fan_in_fan_out") {
        return Err(bad("stores transposed weights (`fan_in_fan_out`), as GPT-2's Conv1D layers need".into()));
    }
    let rank = config
        .get("r")
        .and_then(Value::as_u64)
        .filter(|&r| r > 0)
        .ok_or_else(|| bad("has no positive integer `r` (the adapter rank)".into()))? as usize;
    // `peft`'s defaults for keys a folder leaves out.
    let alpha = config.get("lora_alpha").and_then(Value::as_f64).unwrap_or(8.0);
    let dropout = config.get("lora_dropout").and_then(Value::as_f64).unwrap_or(0.0);
    let targets = match config.get("target_modules") {
        Some(Value::String(s)) if s == "all-linear" => LoraTarget::ALL.to_vec(),
        Some(Value::Array(list)) => {
            let names: Vec<&str> = list.iter().filter_map(Value::as_str).collect();
            LoraTarget::parse_list(&names.join(",")).map_err(|e| bad(format!("`target_modules`: {e}")))?
        }
        Some(Value::String(s)) => {
            return Err(bad(format!(
                "`target_modules` is the pattern \"{s}\"; stepgraph reads a list of module names or \"all-linear\""
            )))
        }
        _ => return Err(bad("has no `target_modules`".into())),
    };
    let base_model = config.get("base_model_name_or_path").and_then(Value::as_str).map(str::to_string);
    let adapters = Adapters { rank, alpha, targets, dropout, base: BaseStorage::Model };
    adapters.validate().map_err(|e| bad(e.to_string()))?;
    Ok((adapters, base_model))
}

/// The adapter matrices of the folder `dir` (`adapter_model.safetensors`)
/// by trace name, for a base model of `family`.
pub fn read_adapter_weights(dir: &Path, family: HfFamily) -> Result<Vec<(String, HostTensor)>> {
    let weights_path = dir.join(ADAPTER_WEIGHTS);
    if !weights_path.is_file() {
        return Err(folder_error(dir, format!("has no {ADAPTER_WEIGHTS}")));
    }
    let mut tensors = Vec::new();
    for (name, t) in read_safetensors(&weights_path)? {
        let trace_name = trace_tensor_name(family, &name)
            .filter(|n| {
                let layer = n.trim_end_matches(".weight").rsplit_once('.').map(|(l, _)| l).unwrap_or_default();
                is_adapter_weight(n) && LoraTarget::of_layer(layer).is_some()
            })
            .ok_or_else(|| {
                folder_error(
                    &weights_path,
                    format!(
                        "tensor `{name}` is not a LoRA matrix of a `{}` layer stepgraph adapts (the q, k, v, o, \
                         gate, up and down projections)",
                        family.model_type()
                    ),
                )
            })?;
        tensors.push((trace_name, t));
    }
    Ok(tensors)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::{DType, TensorType};

    #[test]
    fn llama_adapters_are_named_as_peft_names_them_both_ways() {
        let name = "model.layers.3.self_attn.q_proj.lora_A.weight";
        let peft = peft_tensor_name(HfFamily::Llama, name).unwrap();
        assert_eq!(peft, "base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight");
        assert_eq!(trace_tensor_name(HfFamily::Llama, &peft).as_deref(), Some(name));
        let down = "model.layers.0.mlp.down_proj.lora_B.weight";
        assert_eq!(
            trace_tensor_name(HfFamily::Qwen2, &peft_tensor_name(HfFamily::Qwen2, down).unwrap()).unwrap(),
            down
        );
        // GPT-NeoX fuses q, k and v into one tensor: no adapter of its own.
        let e = peft_tensor_name(HfFamily::GptNeox, name).unwrap_err();
        assert!(e.contains("fused"), "{e}");
    }

    #[test]
    fn a_saved_folder_reads_back_and_unsupported_settings_are_named() {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("adapter");
        let a = Adapters { dropout: 0.05, ..Adapters::new(2, 4.0, vec![LoraTarget::Q, LoraTarget::Down]).unwrap() };
        let t = |shape: [usize; 2], x: f64| {
            let n = shape[0] * shape[1];
            HostTensor::from_f64(TensorType::new(DType::F32, shape), &(0..n).map(|i| x + i as f64).collect::<Vec<_>>())
        };
        let tensors = vec![
            ("model.layers.0.self_attn.q_proj.lora_A.weight".to_string(), t([2, 8], 1.0)),
            ("model.layers.0.self_attn.q_proj.lora_B.weight".to_string(), t([8, 2], 2.0)),
            ("model.layers.0.mlp.down_proj.lora_A.weight".to_string(), t([2, 16], 3.0)),
            ("model.layers.0.mlp.down_proj.lora_B.weight".to_string(), t([8, 2], 4.0)),
        ];
        let r = save_adapter_dir(&dir, &a, HfFamily::Llama, &tensors, Some("meta-llama/Llama-3.1-8B"), None).unwrap();
        assert_eq!(r.tensors, 4);
        let config: Value = serde_json::from_slice(&fs::read(dir.join(ADAPTER_CONFIG)).unwrap()).unwrap();
        assert_eq!(config["target_modules"], json!(["down_proj", "q_proj"]));
        assert_eq!((config["r"].as_u64(), config["lora_alpha"].as_f64()), (Some(2), Some(4.0)));
        let back = read_adapter_dir(&dir, HfFamily::Llama).unwrap();
        assert_eq!(back.adapters, a);
        assert_eq!(back.base_model.as_deref(), Some("meta-llama/Llama-3.1-8B"));
        let mut sorted = tensors.clone();
        sorted.sort_by(|x, y| x.0.cmp(&y.0));
        let mut got = back.tensors.clone();
        got.sort_by(|x, y| x.0.cmp(&y.0));
        assert_eq!(got, sorted);

        // Settings stepgraph does not compute are refused by their key.
        for (key, value) in [
            ("use_dora", json!(true)),
            ("use_rslora", json!(true)),
            ("bias", json!("all")),
            ("rank_pattern", json!({"q_proj": 4})),
        ] {
            let mut c = config.clone();
            c[key] = value;
            fs::write(dir.join(ADAPTER_CONFIG), serde_json::to_vec(&c).unwrap()).unwrap();
            let e = read_adapter_dir(&dir, HfFamily::Llama).unwrap_err().to_string();
            assert!(e.contains(key), "{key}: {e}");
        }
        let e = read_adapter_dir(root.path(), HfFamily::Llama).unwrap_err().to_string();
        assert!(e.contains("not an adapter folder"), "{e}");
    }
}
