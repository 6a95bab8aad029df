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
//! The routed experts of a mixture-of-experts block are parameters of one
//! module (`model.layers.0.mlp.experts`, holding `gate_up_proj`
//! `[E, 2F, C]` and `down_proj` `[E, C, F]` as `transformers` builds
//! Mixtral, Qwen2-MoE and Qwen3-MoE), which `peft` adapts through
//! `target_parameters`: one adapter per targeted parameter with an `A` of
//! `[E·r, in]` (expert `e`'s rows `e·r .. (e+1)·r`) and a `B` of
//! `[out, r·E]` (expert `e`'s column `j` at `j·E + e`). The adapters of one
//! module nest, the first registered parameter innermost, so with both
//! targeted `gate_up_proj`'s matrices are `...experts.base_layer.lora_A.weight`
//! and `down_proj`'s `...experts.lora_A.weight`. The trace holds them per
//! expert (`[E, r, in]` and `[E, out, r]`); [`save_adapter_dir`] and
//! [`read_adapter_weights`] convert.
//!
//! The router (`mlp.gate`, a parameter too: `target_parameters` entry
//! `gate.weight`) is named as its module. `peft` converts an adapter that
//! names Qwen-MoE's `gate_proj`, `up_proj` and `down_proj` (their
//! `transformers` 4 modules) into these targets, with the fused pair at
//! twice the rank and alpha (`rank_pattern`, `alpha_pattern`): a rank and
//! alpha per target is read and written ([`TargetRank`]). A Mixtral folder
//! written before `transformers` 5 holds an adapter per expert and
//! projection (`...block_sparse_moe.experts.3.w1.lora_A.weight`,
//! `target_modules` `w1`, `w2`, `w3`); reading joins them as `peft` does:
//! the down projections stacked, each expert's gate and up adapters one
//! adapter of twice the rank over the pair.
//!
//! Reading takes what stepgraph's adapters express: plain LoRA on linear
//! layers, experts and routers, one rank and alpha per target; a folder asking for more
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
use super::lora::{is_adapter_weight, Adapters, BaseStorage, LoraTarget, TargetRank};
use crate::error::{Error, Result};
use crate::host::HostTensor;
use crate::ir::TensorType;

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
/// (`model.layers.0.self_attn.q_proj.lora_A.weight`) in a model of
/// `family` whose adapters target `targets`.
pub fn peft_tensor_name(family: HfFamily, name: &str, targets: &[LoraTarget]) -> std::result::Result<String, String> {
    let (layer, matrix) = split_adapter_name(name).ok_or_else(|| format!("`{name}` is not an adapter matrix"))?;
    if let Some(target) = LoraTarget::of_layer(layer).filter(|t| t.is_experts()) {
        let module = layer.strip_suffix(&format!(".{}", target.module())).expect("of_layer matched the suffix");
        let experts = format!("{module}.experts");
        expert_rule(family, &experts)?;
        let nesting = expert_targets(targets)
            .into_iter()
            .rev()
            .position(|t| t == target)
            .ok_or_else(|| format!("`{name}` adapts {}, which the adapters do not target", target.short()))?;
        return Ok(format!("{PEFT_PREFIX}{experts}{}.{matrix}.weight", ".base_layer".repeat(nesting)));
    }
    if LoraTarget::of_layer(layer) == Some(LoraTarget::Router) {
        // The router is a parameter of its own module, named as the trace names it.
        let block = layer.strip_suffix(".gate").expect("of_layer matched the name");
        expert_rule(family, &format!("{block}.experts"))?;
        return Ok(format!("{PEFT_PREFIX}{layer}.{matrix}.weight"));
    }
    let module = layer.rsplit('.').next().unwrap_or_default();
    if reads_mlp_names_as_experts(family) && ["gate_proj", "up_proj", "down_proj"].contains(&module) {
        return Err(format!(
            "peft reads `{module}` in the target_modules of a `{}` adapter as the routed experts' projection (its \
             name before transformers 5) and would not load the adapter of `{layer}`: leave the dense projections \
             out (--lora-targets q,k,v,o,experts) or write the merged model (--merge)",
            family.model_type()
        ));
    }
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

/// Whether `peft`, loading an adapter for a model of `family`, takes
/// `gate_proj`, `up_proj` and `down_proj` in `target_modules` for the
/// routed experts' projections (as `transformers` 4 named them, before the
/// experts were fused) and adapts those instead: so a dense MLP's or a
/// shared expert's projections cannot be adapted in such a folder.
fn reads_mlp_names_as_experts(family: HfFamily) -> bool {
    matches!(family, HfFamily::Qwen2Moe | HfFamily::Qwen3Moe)
}

/// `(layer, "lora_A" | "lora_B")` of an adapter matrix's name.
fn split_adapter_name(name: &str) -> Option<(&str, &'static str)> {
    name.strip_suffix(".lora_A.weight")
        .map(|l| (l, "lora_A"))
        .or_else(|| name.strip_suffix(".lora_B.weight").map(|l| (l, "lora_B")))
}

/// The targeted expert products, in the order their module registers them.
fn expert_targets(targets: &[LoraTarget]) -> Vec<LoraTarget> {
    LoraTarget::EXPERTS.into_iter().filter(|t| targets.contains(t)).collect()
}

/// Checks that `family` keeps routed experts under the trace's module
/// `experts` (`model.layers.0.mlp.experts`), whose parameters are then
/// named as `transformers` names its fused expert module.
fn expert_rule(family: HfFamily, experts: &str) -> std::result::Result<(), String> {
    match family.family().rule_for_param(&format!("{experts}.gate_proj.weight")) {
        Some((rule, _)) if rule.join == Join::Experts => Ok(()),
        _ => Err(format!("`{}` has no routed experts at `{experts}` to adapt", family.model_type())),
    }
}

/// The trace's name of the `peft` tensor `name` in a folder for `family`
/// whose adapters target `targets`.
fn trace_tensor_name(family: HfFamily, name: &str, targets: &[LoraTarget]) -> Option<String> {
    let rest = name.strip_prefix(PEFT_PREFIX)?;
    let (module, matrix) = split_adapter_name(rest)?;
    let mut unwrapped = module;
    let mut nesting = 0;
    while let Some(inner) = unwrapped.strip_suffix(".base_layer") {
        unwrapped = inner;
        nesting += 1;
    }
    if unwrapped.ends_with(".experts") && expert_rule(family, unwrapped).is_ok() {
        let target = *expert_targets(targets).iter().rev().nth(nesting)?;
        let block = unwrapped.strip_suffix(".experts")?;
        return Some(format!("{block}.{}.{matrix}.weight", target.module()));
    }
    if nesting > 0 {
        return None;
    }
    if let Some(block) = module.strip_suffix(".gate").filter(|b| expert_rule(family, &format!("{b}.experts")).is_ok()) {
        return Some(format!("{block}.gate.{matrix}.weight"));
    }
    let params = family.family().param_names(&format!("{module}.weight"));
    let [param] = &params[..] else { return None };
    let layer = param.strip_suffix(".weight")?;
    Some(format!("{layer}.{matrix}.weight"))
}

/// The adapter matrix `t` of the trace named `name` in the layout `peft`
/// holds it: as it is for a linear layer's, converted for an expert
/// product's (see the module doc).
pub fn peft_layout(name: &str, t: &HostTensor) -> HostTensor {
    match split_adapter_name(name).and_then(|(l, _)| LoraTarget::of_layer(l)) {
        Some(target) if target.is_experts() => expert_matrix_to_peft(name, t),
        _ => t.clone(),
    }
}

/// An expert adapter matrix of the trace as `peft` stores it: `A`
/// `[E, r, in]` as `[E·r, in]` (the same bytes), `B` `[E, out, r]` as
/// `[out, r·E]` with expert `e`'s column `j` at `j·E + e`.
fn expert_matrix_to_peft(name: &str, t: &HostTensor) -> HostTensor {
    let s = &t.ty.shape;
    if name.ends_with(".lora_A.weight") {
        let mut a = t.clone();
        a.retype(t.ty.with_shape([s[0] * s[1], s[2]]));
        return a;
    }
    let (experts, out, rank) = (s[0], s[1], s[2]);
    let mut b = HostTensor::zeros(t.ty.with_shape([out, rank * experts]));
    let size = t.ty.dtype.size();
    for e in 0..experts {
        for o in 0..out {
            for j in 0..rank {
                let from = ((e * out + o) * rank + j) * size;
                let to = (o * rank * experts + j * experts + e) * size;
                b.bytes_mut()[to..to + size].copy_from_slice(&t.bytes()[from..from + size]);
            }
        }
    }
    b
}

/// The inverse of [`expert_matrix_to_peft`] for adapters of rank `rank`;
/// an error naming the tensor when its shape does not split into experts.
fn expert_matrix_from_peft(name: &str, t: &HostTensor, rank: usize) -> std::result::Result<HostTensor, String> {
    let s = &t.ty.shape;
    let bad = || format!("`{name}` is {}, not an expert adapter of rank {rank}", t.ty);
    if s.len() != 2 || rank == 0 {
        return Err(bad());
    }
    if name.ends_with(".lora_A.weight") {
        if !s[0].is_multiple_of(rank) {
            return Err(bad());
        }
        let mut a = t.clone();
        a.retype(t.ty.with_shape([s[0] / rank, rank, s[1]]));
        return Ok(a);
    }
    if !s[1].is_multiple_of(rank) {
        return Err(bad());
    }
    let (out, experts) = (s[0], s[1] / rank);
    let mut b = HostTensor::zeros(t.ty.with_shape([experts, out, rank]));
    let size = t.ty.dtype.size();
    for e in 0..experts {
        for o in 0..out {
            for j in 0..rank {
                let from = (o * rank * experts + j * experts + e) * size;
                let to = ((e * out + o) * rank + j) * size;
                b.bytes_mut()[to..to + size].copy_from_slice(&t.bytes()[from..from + size]);
            }
        }
    }
    Ok(b)
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
    let mut parameters = BTreeSet::new();
    for (name, t) in tensors {
        let peft = peft_tensor_name(family, name, &adapters.targets).map_err(|reason| folder_error(dir, reason))?;
        let layer = split_adapter_name(name).map(|(l, _)| l).unwrap_or_default();
        if let Some(parameter) = LoraTarget::of_layer(layer).and_then(LoraTarget::peft_parameter) {
            parameters.insert(parameter);
            named.push((peft, peft_layout(name, t)));
        } else {
            let module = peft.trim_end_matches(".weight").rsplit_once('.').map(|(m, _)| m).unwrap_or_default();
            modules.insert(module.rsplit('.').next().unwrap_or_default().to_string());
            named.push((peft, t.clone()));
        }
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
        "target_parameters": if parameters.is_empty() { Value::Null } else { json!(parameters) },
        "bias": "none",
        "fan_in_fan_out": false,
        "inference_mode": true,
        "init_lora_weights": true,
        "modules_to_save": null,
        "layers_to_transform": null,
        "layers_pattern": null,
        "rank_pattern": patterns(adapters, |r| json!(r.rank)),
        "alpha_pattern": patterns(adapters, |r| json!(r.alpha)),
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

/// `peft`'s `rank_pattern` (or `alpha_pattern`) for the targets with a
/// rank of their own: `{".*\\.gate_up_proj": 32}`, a regular expression
/// that matches the target's module or parameter in any layer.
fn patterns(adapters: &Adapters, value: impl Fn(&TargetRank) -> Value) -> Value {
    let map: Map<String, Value> = adapters
        .ranks
        .iter()
        .map(|r| (format!(".*\\.{}", pattern_leaf(r.target).replace('.', "\\.")), value(r)))
        .collect();
    Value::Object(map)
}

/// The last part of the name `peft` matches a target by: a module's name
/// (`q_proj`), or a parameter's (`gate_up_proj`, `gate.weight`).
fn pattern_leaf(target: LoraTarget) -> &'static str {
    match target {
        LoraTarget::ExpertsGateUp => "gate_up_proj",
        LoraTarget::ExpertsDown => "down_proj",
        LoraTarget::Router => "gate.weight",
        t => t.module(),
    }
}

/// The parameter target `name` (a `target_parameters` entry or a pattern
/// key's name: `gate_up_proj`, `mlp.experts.down_proj`, `mlp.gate.weight`).
fn parameter_target(name: &str) -> Option<LoraTarget> {
    [LoraTarget::ExpertsGateUp, LoraTarget::ExpertsDown, LoraTarget::Router]
        .into_iter()
        .find(|&t| name == pattern_leaf(t) || name.ends_with(&format!(".{}", pattern_leaf(t))))
}

/// The target a `rank_pattern` / `alpha_pattern` key names: a regular
/// expression of the form `NAME`, `.*NAME` or `.*\.NAME` (dots of the name
/// escaped or not) for a module or parameter name.
fn pattern_target(key: &str) -> Option<LoraTarget> {
    let name = key.trim_start_matches(".*").trim_start_matches("\\.").replace("\\.", ".");
    parameter_target(&name).or_else(|| {
        LoraTarget::MODULES.into_iter().find(|t| name == t.module() || name.ends_with(&format!(".{}", t.module())))
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
    let tensors = read_adapter_weights(dir, family, &adapters)?;
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
    // peft's `all-linear` names linear modules only; expert parameters
    // come from `target_parameters`.
    let mut legacy_pair = false;
    let mut targets = match config.get("target_modules") {
        Some(Value::String(s)) if s == "all-linear" => LoraTarget::MODULES.to_vec(),
        Some(Value::Array(list)) if list.is_empty() => Vec::new(),
        Some(Value::Array(list)) => {
            // `gate` is a mixture of experts' router (peft takes it for its
            // weight); every other name a linear module.
            let (routers, names): (Vec<&str>, Vec<&str>) = list
                .iter()
                .filter_map(Value::as_str)
                .partition(|n| *n == LoraTarget::Router.module() || n.ends_with(".gate"));
            // Mixtral's experts as `transformers` 4 named their projections.
            let (legacy, names): (Vec<&str>, Vec<&str>) =
                names.into_iter().partition(|n| LEGACY_EXPERT_MODULES.contains(n));
            let mut targets = if names.is_empty() {
                Vec::new()
            } else {
                LoraTarget::parse_list(&names.join(",")).map_err(|e| bad(format!("`target_modules`: {e}")))?
            };
            if let Some(t) = targets.iter().find(|t| t.is_experts()) {
                return Err(bad(format!(
                    "`target_modules` names the experts' `{}`, a parameter: peft adapts it through \
                     `target_parameters`",
                    t.module()
                )));
            }
            if !routers.is_empty() {
                targets.push(LoraTarget::Router);
            }
            match (legacy.contains(&"w1"), legacy.contains(&"w3")) {
                (true, true) => {
                    // One adapter per expert and projection, joined on
                    // reading into one over the gate/up pair of twice the
                    // rank (the pieces side by side): the same update.
                    targets.push(LoraTarget::ExpertsGateUp);
                    legacy_pair = true;
                }
                (false, false) => {}
                _ => {
                    return Err(bad(
                        "`target_modules` names one of `w1` and `w3`, the experts' gate and up projections, which \
                         are one tensor now: stepgraph reads them together"
                            .into(),
                    ))
                }
            }
            if legacy.contains(&"w2") {
                targets.push(LoraTarget::ExpertsDown);
            }
            targets
        }
        Some(Value::String(s)) => {
            return Err(bad(format!(
                "`target_modules` is the pattern \"{s}\"; stepgraph reads a list of module names or \"all-linear\""
            )))
        }
        None | Some(Value::Null) => Vec::new(),
        Some(other) => return Err(bad(format!("`target_modules` is {other}, not a list of module names"))),
    };
    match config.get("target_parameters") {
        None | Some(Value::Null) => {}
        Some(Value::Array(list)) => {
            for entry in list {
                let target = parameter_target(entry.as_str().unwrap_or_default()).ok_or_else(|| {
                    bad(format!(
                        "`target_parameters` names {entry}; stepgraph adapts the routed experts' \
                         `experts.gate_up_proj` and `experts.down_proj` and the router's `gate.weight`"
                    ))
                })?;
                if !targets.contains(&target) {
                    targets.push(target);
                }
            }
        }
        Some(other) => return Err(bad(format!("`target_parameters` is {other}, not a list of parameter names"))),
    }
    targets.sort();
    if targets.is_empty() {
        return Err(bad("has no `target_modules` or `target_parameters`: it adapts nothing".into()));
    }
    // A rank and alpha of their own for some targets: peft gives the
    // experts' fused gate and up pair twice the rank when it converts
    // an adapter that named the two apart.
    let mut ranks: Vec<TargetRank> = Vec::new();
    for (key, is_rank) in [("rank_pattern", true), ("alpha_pattern", false)] {
        let Some(map) = config.get(key).filter(|v| !v.is_null()) else { continue };
        let map = map.as_object().ok_or_else(|| bad(format!("`{key}` is {map}, not an object")))?;
        for (pattern, value) in map {
            let target = pattern_target(pattern).filter(|t| targets.contains(t)).ok_or_else(|| {
                bad(format!(
                    "`{key}` sets \"{pattern}\", which names no one target of these adapters; stepgraph takes a \
                     rank or alpha per target (`.*\\.gate_up_proj`), not per layer"
                ))
            })?;
            let number = value.as_f64().filter(|v| v.is_finite() && *v > 0.0);
            let number = number.ok_or_else(|| bad(format!("`{key}` gives \"{pattern}\" {value}")))?;
            let at = match ranks.iter().position(|r| r.target == target) {
                Some(at) => at,
                None => {
                    ranks.push(TargetRank { target, rank, alpha });
                    ranks.len() - 1
                }
            };
            if is_rank {
                if number.fract() != 0.0 {
                    return Err(bad(format!("`{key}` gives \"{pattern}\" the rank {value}, not an integer")));
                }
                ranks[at].rank = number as usize;
            } else {
                ranks[at].alpha = number;
            }
        }
    }
    if legacy_pair && !ranks.iter().any(|r| r.target == LoraTarget::ExpertsGateUp) {
        ranks.push(TargetRank { target: LoraTarget::ExpertsGateUp, rank: 2 * rank, alpha: 2.0 * alpha });
    }
    ranks.sort_by_key(|r| r.target);
    let base_model = config.get("base_model_name_or_path").and_then(Value::as_str).map(str::to_string);
    let adapters = Adapters { rank, alpha, targets, dropout, base: BaseStorage::Model, ranks };
    adapters.validate().map_err(|e| bad(e.to_string()))?;
    Ok((adapters, base_model))
}

/// The adapter matrices of the folder `dir` (`adapter_model.safetensors`)
/// by trace name and in the trace's layout, for a base model of `family`
/// and the folder's `adapters` ([`read_adapter_config`]).
pub fn read_adapter_weights(dir: &Path, family: HfFamily, adapters: &Adapters) -> Result<Vec<(String, HostTensor)>> {
    let weights_path = dir.join(ADAPTER_WEIGHTS);
    if !weights_path.is_file() {
        return Err(folder_error(dir, format!("has no {ADAPTER_WEIGHTS}")));
    }
    let mut tensors = Vec::new();
    let mut legacy: Vec<LegacyExpert> = Vec::new();
    for (name, t) in read_safetensors(&weights_path)? {
        if let Some(piece) = legacy_expert(family, &name, t.clone()) {
            legacy.push(piece);
            continue;
        }
        let trace_name = trace_tensor_name(family, &name, &adapters.targets)
            .filter(|n| {
                is_adapter_weight(n) && split_adapter_name(n).and_then(|(l, _)| LoraTarget::of_layer(l)).is_some()
            })
            .ok_or_else(|| {
                folder_error(
                    &weights_path,
                    format!(
                        "tensor `{name}` is not a LoRA matrix of a `{}` layer stepgraph adapts (the q, k, v, o, \
                         gate, up and down projections, and the routed experts)",
                        family.model_type()
                    ),
                )
            })?;
        let target = split_adapter_name(&trace_name).and_then(|(l, _)| LoraTarget::of_layer(l));
        let t = match target.filter(|t| t.is_experts()) {
            Some(expert) => expert_matrix_from_peft(&name, &t, adapters.rank_of(expert).0)
                .map_err(|reason| folder_error(&weights_path, reason))?,
            None => t,
        };
        tensors.push((trace_name, t));
    }
    tensors.extend(join_legacy_experts(legacy, adapters.rank).map_err(|reason| folder_error(&weights_path, reason))?);
    Ok(tensors)
}

/// Mixtral's expert projections as `transformers` 4 named them, which a
/// folder's `target_modules` may list.
const LEGACY_EXPERT_MODULES: [&str; 3] = ["w1", "w2", "w3"];

/// One expert's adapter matrix of a folder `peft` wrote before
/// `transformers` 5 fused the experts
/// (`...block_sparse_moe.experts.3.w1.lora_A.weight`).
struct LegacyExpert {
    /// The trace's stacked weight it adapts (`model.layers.0.mlp.experts.gate_proj.weight`).
    weight: String,
    expert: usize,
    /// `lora_A` or `lora_B`.
    matrix: &'static str,
    tensor: HostTensor,
}

/// The piece `name` holds, when it is one expert's adapter matrix in a
/// family whose folders keep a tensor per expert.
fn legacy_expert(family: HfFamily, name: &str, tensor: HostTensor) -> Option<LegacyExpert> {
    let (module, matrix) = split_adapter_name(name.strip_prefix(PEFT_PREFIX)?)?;
    let hf = format!("{module}.weight");
    family.family().rules().iter().filter(|r| r.join == Join::Experts).find_map(|rule| {
        let (layer, expert) = super::family::match_numbers(rule.hf, &hf)?;
        let weight = super::family::instantiate(rule.trace[0], layer);
        Some(LegacyExpert { weight, expert: expert?, matrix, tensor: tensor.clone() })
    })
}

/// The per-expert pieces joined into the trace's stacked adapters: each
/// down projection's `A` and `B` stacked by expert; each expert's gate and
/// up adapters (rank `rank` each) as one adapter of the pair of rank
/// `2·rank`, `A` the two side by side (`[A_gate; A_up]`) and `B`
/// block-diagonal (gate rows from the first `rank` columns, up rows from
/// the second), which computes the same update at the same scale.
fn join_legacy_experts(
    pieces: Vec<LegacyExpert>,
    rank: usize,
) -> std::result::Result<Vec<(String, HostTensor)>, String> {
    let mut by_weight: std::collections::BTreeMap<(String, &'static str), Vec<(usize, HostTensor)>> =
        std::collections::BTreeMap::new();
    for p in pieces {
        by_weight.entry((p.weight, p.matrix)).or_default().push((p.expert, p.tensor));
    }
    // Each stacked piece's experts 0..E in order, all of one type.
    let stacked = |key: &(String, &'static str),
                   by: &mut std::collections::BTreeMap<(String, &'static str), Vec<(usize, HostTensor)>>|
     -> std::result::Result<Vec<HostTensor>, String> {
        let mut v = by.remove(key).ok_or_else(|| format!("no `{}` {} of the experts", key.0, key.1))?;
        v.sort_by_key(|(e, _)| *e);
        if v.iter().enumerate().any(|(i, (e, t))| *e != i || t.ty != v[0].1.ty) {
            return Err(format!("the experts' `{}` {} are not one per expert from 0, of one shape", key.0, key.1));
        }
        Ok(v.into_iter().map(|(_, t)| t).collect())
    };
    let mut out = Vec::new();
    let weights: BTreeSet<String> = by_weight.keys().map(|(w, _)| w.clone()).collect();
    for weight in weights.iter().filter(|w| w.ends_with(".experts.down_proj.weight")) {
        let layer = weight.trim_end_matches(".weight");
        for matrix in ["lora_A", "lora_B"] {
            let parts = stacked(&(weight.clone(), matrix), &mut by_weight)?;
            out.push((format!("{layer}.{matrix}.weight"), stack(&parts)));
        }
    }
    for gate in weights.iter().filter(|w| w.ends_with(".experts.gate_proj.weight")) {
        let block = gate.trim_end_matches(".gate_proj.weight");
        let up = format!("{block}.up_proj.weight");
        let (ga, gb) =
            (stacked(&(gate.clone(), "lora_A"), &mut by_weight)?, stacked(&(gate.clone(), "lora_B"), &mut by_weight)?);
        let (ua, ub) = (stacked(&(up.clone(), "lora_A"), &mut by_weight)?, stacked(&(up, "lora_B"), &mut by_weight)?);
        let (experts, dtype) = (ga.len(), ga[0].ty.dtype);
        let (inp, width) = (ga[0].ty.shape[1], gb[0].ty.shape[0]);
        if ua.len() != experts || ga[0].ty.shape[0] != rank || ga[0].ty != ua[0].ty || gb[0].ty != ub[0].ty {
            return Err(format!("the gate and up adapters of `{block}` differ in experts, rank or shape"));
        }
        let size = dtype.size();
        let mut a = HostTensor::zeros(TensorType::new(dtype, [experts, 2 * rank, inp]));
        let mut b = HostTensor::zeros(TensorType::new(dtype, [experts, 2 * width, 2 * rank]));
        for e in 0..experts {
            for (half, (pa, pb)) in [(&ga[e], &gb[e]), (&ua[e], &ub[e])].into_iter().enumerate() {
                let at = (e * 2 * rank + half * rank) * inp * size;
                a.bytes_mut()[at..at + pa.bytes().len()].copy_from_slice(pa.bytes());
                for row in 0..width {
                    let from = row * rank * size;
                    let to = ((e * 2 * width + half * width + row) * 2 * rank + half * rank) * size;
                    b.bytes_mut()[to..to + rank * size].copy_from_slice(&pb.bytes()[from..from + rank * size]);
                }
            }
        }
        let layer = format!("{block}.{}", LoraTarget::ExpertsGateUp.module().trim_start_matches("experts."));
        out.push((format!("{layer}.lora_A.weight"), a));
        out.push((format!("{layer}.lora_B.weight"), b));
    }
    if let Some(((w, m), _)) = by_weight.into_iter().next() {
        return Err(format!("the experts' `{w}` {m} has no partner to join"));
    }
    Ok(out)
}

/// Tensors of one type stacked along a new first axis.
fn stack(parts: &[HostTensor]) -> HostTensor {
    let mut shape = vec![parts.len()];
    shape.extend(&parts[0].ty.shape);
    let mut t = HostTensor::zeros(parts[0].ty.with_shape(shape));
    let n = parts[0].bytes().len();
    for (i, p) in parts.iter().enumerate() {
        t.bytes_mut()[i * n..(i + 1) * n].copy_from_slice(p.bytes());
    }
    t
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::{DType, TensorType};

    #[test]
    fn llama_adapters_are_named_as_peft_names_them_both_ways() {
        let name = "model.layers.3.self_attn.q_proj.lora_A.weight";
        let all = LoraTarget::ALL;
        let peft = peft_tensor_name(HfFamily::Llama, name, &all).unwrap();
        assert_eq!(peft, "base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight");
        assert_eq!(trace_tensor_name(HfFamily::Llama, &peft, &all).as_deref(), Some(name));
        let down = "model.layers.0.mlp.down_proj.lora_B.weight";
        assert_eq!(
            trace_tensor_name(HfFamily::Qwen2, &peft_tensor_name(HfFamily::Qwen2, down, &all).unwrap(), &all).unwrap(),
            down
        );
        // GPT-NeoX fuses q, k and v into one tensor: no adapter of its own.
        let e = peft_tensor_name(HfFamily::GptNeox, name, &all).unwrap_err();
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
            ("rank_pattern", json!({"lm_head": 4})),
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

    /// The experts' adapters nest as `peft` nests them: with both products
    /// targeted, `gate_up_proj` (registered first) is the inner one.
    #[test]
    fn expert_adapters_are_named_by_their_nesting() {
        let both = [LoraTarget::Q, LoraTarget::ExpertsGateUp, LoraTarget::ExpertsDown];
        let gate_up = "model.layers.1.mlp.experts.gate_up_proj.lora_A.weight";
        let down = "model.layers.1.mlp.experts.down_proj.lora_B.weight";
        for family in [HfFamily::Mixtral, HfFamily::Qwen2Moe, HfFamily::Qwen3Moe] {
            let p = peft_tensor_name(family, gate_up, &both).unwrap();
            assert_eq!(p, "base_model.model.model.layers.1.mlp.experts.base_layer.lora_A.weight");
            assert_eq!(trace_tensor_name(family, &p, &both).as_deref(), Some(gate_up));
            let p = peft_tensor_name(family, down, &both).unwrap();
            assert_eq!(p, "base_model.model.model.layers.1.mlp.experts.lora_B.weight");
            assert_eq!(trace_tensor_name(family, &p, &both).as_deref(), Some(down));
        }
        // Alone, either one is the outer (only) adapter.
        let only = [LoraTarget::ExpertsGateUp];
        let p = peft_tensor_name(HfFamily::Mixtral, gate_up, &only).unwrap();
        assert_eq!(p, "base_model.model.model.layers.1.mlp.experts.lora_A.weight");
        assert_eq!(trace_tensor_name(HfFamily::Mixtral, &p, &only).as_deref(), Some(gate_up));
        let e = peft_tensor_name(HfFamily::Mixtral, down, &only).unwrap_err();
        assert!(e.contains("experts_down"), "{e}");
        // A dense family has no experts to adapt.
        let e = peft_tensor_name(HfFamily::Llama, gate_up, &both).unwrap_err();
        assert!(e.contains("no routed experts"), "{e}");
        // peft takes Qwen-MoE's MLP projection names for the experts'.
        let shared = "model.layers.0.mlp.shared_expert.up_proj.lora_A.weight";
        let e = peft_tensor_name(HfFamily::Qwen2Moe, shared, &LoraTarget::ALL).unwrap_err();
        assert!(e.contains("--lora-targets q,k,v,o,experts") && e.contains("--merge"), "{e}");
        assert!(peft_tensor_name(HfFamily::Mixtral, "model.layers.0.self_attn.o_proj.lora_B.weight", &both).is_ok());
    }

    /// Expert matrices go to `peft`'s layout and back unchanged, and a
    /// folder with them reads back as written, `target_parameters` included.
    #[test]
    fn expert_adapters_convert_to_peft_layout_and_back() {
        let (experts, rank, inp, out) = (3, 2, 4, 5);
        let seq = |shape: Vec<usize>| {
            let n: usize = shape.iter().product();
            HostTensor::from_f64(TensorType::new(DType::F32, shape), &(0..n).map(|i| i as f64).collect::<Vec<_>>())
        };
        let a_name = "model.layers.0.mlp.experts.down_proj.lora_A.weight";
        let b_name = "model.layers.0.mlp.experts.down_proj.lora_B.weight";
        let a = seq(vec![experts, rank, inp]);
        let b = seq(vec![experts, out, rank]);
        let pa = expert_matrix_to_peft(a_name, &a);
        assert_eq!(pa.ty.shape, [experts * rank, inp]);
        assert_eq!(pa.to_f64(), a.to_f64());
        let pb = expert_matrix_to_peft(b_name, &b);
        assert_eq!(pb.ty.shape, [out, rank * experts]);
        // Expert e's column j is peft's column j·E + e.
        let (bv, pv) = (b.to_f64(), pb.to_f64());
        for (e, o, j) in [(0, 0, 0), (2, 4, 1), (1, 3, 0)] {
            assert_eq!(pv[o * rank * experts + j * experts + e], bv[(e * out + o) * rank + j]);
        }
        assert_eq!(expert_matrix_from_peft(b_name, &pb, rank).unwrap(), b);
        assert_eq!(expert_matrix_from_peft(a_name, &pa, rank).unwrap(), a);
        assert!(expert_matrix_from_peft(b_name, &pb, 4).unwrap_err().contains("rank 4"));

        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("adapter");
        let adapters = Adapters::new(rank, 4.0, vec![LoraTarget::ExpertsDown]).unwrap();
        let tensors = vec![(a_name.to_string(), a), (b_name.to_string(), b)];
        save_adapter_dir(&dir, &adapters, HfFamily::Qwen3Moe, &tensors, None, None).unwrap();
        let config: Value = serde_json::from_slice(&fs::read(dir.join(ADAPTER_CONFIG)).unwrap()).unwrap();
        assert_eq!(config["target_modules"], json!([]));
        assert_eq!(config["target_parameters"], json!(["mlp.experts.down_proj"]));
        let back = read_adapter_dir(&dir, HfFamily::Qwen3Moe).unwrap();
        assert_eq!(back.adapters, adapters);
        assert_eq!(back.tensors, tensors);
        // peft's `all-linear` is the linear modules only; a parameter
        // target stepgraph does not adapt is named.
        let mut c = config.clone();
        c["target_modules"] = json!("all-linear");
        c["target_parameters"] = json!(["mlp.experts.gate_up_proj", "mlp.router.weight"]);
        fs::write(dir.join(ADAPTER_CONFIG), serde_json::to_vec(&c).unwrap()).unwrap();
        let e = read_adapter_config(&dir).unwrap_err().to_string();
        assert!(e.contains("mlp.router.weight"), "{e}");
        c["target_parameters"] = json!(["mlp.experts.gate_up_proj"]);
        fs::write(dir.join(ADAPTER_CONFIG), serde_json::to_vec(&c).unwrap()).unwrap();
        let (a, _) = read_adapter_config(&dir).unwrap();
        let mut expect = LoraTarget::MODULES.to_vec();
        expect.push(LoraTarget::ExpertsGateUp);
        assert_eq!(a.targets, expect);
    }

    /// What peft writes for `all-linear` on Qwen3-MoE under transformers 5:
    /// the attention as modules, the experts and the router as parameters,
    /// the fused gate/up pair at twice the rank and alpha. It reads as those
    /// targets with the pair's own rank, and writes back the same patterns.
    #[test]
    fn peft_all_linear_on_a_mixture_of_experts_reads_with_its_rank_pattern() {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path();
        let config = json!({
            "peft_type": "LORA", "r": 2, "lora_alpha": 5, "lora_dropout": 0.0,
            "target_modules": ["q_proj", "v_proj", "k_proj", "o_proj"],
            "target_parameters": ["gate.weight", "down_proj", "gate_up_proj"],
            "rank_pattern": {".*\\.gate_up_proj": 4}, "alpha_pattern": {".*\\.gate_up_proj": 10},
        });
        fs::write(dir.join(ADAPTER_CONFIG), serde_json::to_vec(&config).unwrap()).unwrap();
        let (a, _) = read_adapter_config(dir).unwrap();
        let mut targets = vec![LoraTarget::Q, LoraTarget::K, LoraTarget::V, LoraTarget::O];
        targets.extend([LoraTarget::ExpertsGateUp, LoraTarget::ExpertsDown, LoraTarget::Router]);
        assert_eq!(a.targets, targets);
        assert_eq!(a.ranks, [TargetRank { target: LoraTarget::ExpertsGateUp, rank: 4, alpha: 10.0 }]);
        assert_eq!(a.rank_of(LoraTarget::Router), (2, 5.0));
        assert_eq!(patterns(&a, |r| json!(r.rank)), json!({".*\\.gate_up_proj": 4}));
        // The router is named as transformers 5 names it, in every MoE family.
        let router = "model.layers.2.mlp.gate.lora_B.weight";
        let p = peft_tensor_name(HfFamily::Mixtral, router, &a.targets).unwrap();
        assert_eq!(p, "base_model.model.model.layers.2.mlp.gate.lora_B.weight");
        assert_eq!(trace_tensor_name(HfFamily::Mixtral, &p, &a.targets).as_deref(), Some(router));
        // A per-layer pattern is refused by its key.
        let mut c = config.clone();
        c["rank_pattern"] = json!({"model.layers.0.self_attn.q_proj": 8});
        fs::write(dir.join(ADAPTER_CONFIG), serde_json::to_vec(&c).unwrap()).unwrap();
        let (a, _) = read_adapter_config(dir).unwrap();
        assert_eq!(a.rank_of(LoraTarget::Q), (8, 5.0));
        c["rank_pattern"] = json!({"^model\\.layers\\.0\\..*": 8});
        fs::write(dir.join(ADAPTER_CONFIG), serde_json::to_vec(&c).unwrap()).unwrap();
        let e = read_adapter_config(dir).unwrap_err().to_string();
        assert!(e.contains("rank_pattern") && e.contains("per target"), "{e}");
    }

    /// A Mixtral folder `peft` wrote before `transformers` 5 (an adapter per
    /// expert and projection, `target_modules` `w1`, `w2`, `w3`) reads as
    /// the stacked adapters: down stacked by expert, gate and up joined
    /// into one adapter of twice the rank and alpha whose update is theirs.
    #[test]
    fn mixtral_adapters_of_one_tensor_per_expert_join_into_the_stacked_form() {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path();
        let (experts, rank, c, f) = (3, 2, 4, 5);
        let t = |shape: [usize; 2], seed: usize| {
            let n = shape[0] * shape[1];
            let v: Vec<f64> = (0..n).map(|i| ((i * 7 + seed * 13) % 11) as f64 - 5.0).collect();
            HostTensor::from_f64(TensorType::new(DType::F32, shape), &v)
        };
        let mut named = Vec::new();
        for e in 0..experts {
            for (w, a, b) in [("w1", [rank, c], [f, rank]), ("w3", [rank, c], [f, rank]), ("w2", [rank, f], [c, rank])]
            {
                let module = format!("base_model.model.model.layers.0.block_sparse_moe.experts.{e}.{w}");
                named.push((format!("{module}.lora_A.weight"), t(a, e * 10 + w.len() + 1)));
                named.push((format!("{module}.lora_B.weight"), t(b, e * 10 + w.as_bytes()[1] as usize)));
            }
        }
        write_safetensors_atomic(&dir.join(ADAPTER_WEIGHTS), &named).unwrap();
        let config = json!({"peft_type": "LORA", "r": rank, "lora_alpha": 3, "target_modules": ["w1", "w2", "w3"]});
        fs::write(dir.join(ADAPTER_CONFIG), serde_json::to_vec(&config).unwrap()).unwrap();
        let folder = read_adapter_dir(dir, HfFamily::Mixtral).unwrap();
        assert_eq!(folder.adapters.targets, [LoraTarget::ExpertsGateUp, LoraTarget::ExpertsDown]);
        assert_eq!(folder.adapters.rank_of(LoraTarget::ExpertsGateUp), (2 * rank, 6.0));
        let get = |name: &str| folder.tensors.iter().find(|(n, _)| n == name).unwrap().1.to_f64();
        let piece = |e: usize, w: &str, m: &str| {
            let key = format!("base_model.model.model.layers.0.block_sparse_moe.experts.{e}.{w}.lora_{m}.weight");
            named.iter().find(|(n, _)| *n == key).unwrap().1.to_f64()
        };
        let a = get("model.layers.0.mlp.experts.gate_up_proj.lora_A.weight");
        let b = get("model.layers.0.mlp.experts.gate_up_proj.lora_B.weight");
        for e in 0..experts {
            // A: the gate's rows, then the up's.
            assert_eq!(a[e * 2 * rank * c..(e * 2 * rank + rank) * c], piece(e, "w1", "A")[..]);
            assert_eq!(a[(e * 2 * rank + rank) * c..(e + 1) * 2 * rank * c], piece(e, "w3", "A")[..]);
            // B: block-diagonal, the gate's rows on the first columns.
            for row in 0..2 * f {
                for col in 0..2 * rank {
                    let got = b[(e * 2 * f + row) * 2 * rank + col];
                    let want = match (row < f, col < rank) {
                        (true, true) => piece(e, "w1", "B")[row * rank + col],
                        (false, false) => piece(e, "w3", "B")[(row - f) * rank + col - rank],
                        _ => 0.0,
                    };
                    assert_eq!(got, want, "expert {e} row {row} col {col}");
                }
            }
        }
        let down_b = get("model.layers.0.mlp.experts.down_proj.lora_B.weight");
        assert_eq!(down_b[c * rank..2 * c * rank], piece(1, "w2", "B")[..]);
        // w1 without w3 is refused: the two are one tensor now.
        let one = json!({"peft_type": "LORA", "r": rank, "target_modules": ["w1", "w2"]});
        fs::write(dir.join(ADAPTER_CONFIG), serde_json::to_vec(&one).unwrap()).unwrap();
        let e = read_adapter_config(dir).unwrap_err().to_string();
        assert!(e.contains("`w1` and `w3`"), "{e}");
    }
}
