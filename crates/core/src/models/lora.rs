//! Low-rank adapters (LoRA) and how the frozen base they adapt is stored.
//!
//! With [`Adapters`] on a [`super::ModelSpec`], the model builder records
//! every weight of the base model as a frozen leaf
//! ([`crate::ir::ValueKind::Frozen`]: persistent, read-only, never
//! differentiated) and gives each chosen linear layer `y = x·Wᵀ` an adapter
//! beside it, as `peft` does:
//!
//! `y = x·Wᵀ + (α/r)·(drop(x)·Aᵀ)·Bᵀ`
//!
//! with `A: [r, in]` (`{layer}.lora_A.weight`) and `B: [out, r]`
//! (`{layer}.lora_B.weight`) the only trained parameters. The routed
//! experts of a mixture of experts take one adapter per expert, stacked
//! (`A: [E, r, in]`, `B: [E, out, r]`) and applied in the grouped products:
//! one over each expert's gate and up pair ([`LoraTarget::ExpertsGateUp`],
//! `B`'s rows gate first) and one over its down product; the router is a
//! linear layer like the others ([`LoraTarget::Router`]). A target may have
//! a rank and alpha of its own ([`TargetRank`]). The scale `α/r`
//! multiplies the `[tokens, r]` product, the narrowest place it can go.
//! Autodiff then gives gradients, moments and master state to the adapters
//! alone; the base's weight-gradient products are never recorded (dead code
//! elimination removes them), and a forward value is saved only where an
//! adapter's gradient or an input's gradient needs it.
//!
//! The base is stored as the model's dtype ([`BaseStorage::Model`]) or, for
//! QLoRA, as 4-bit NormalFloat codes with block scales
//! ([`BaseStorage::Nf4`], see [`crate::ops::nf4`]), quantized on load and
//! dequantized into the arena right before each product that reads it.

use rayon::prelude::*;
use serde::Serialize;

use crate::error::{Error, Result};
use crate::host::HostTensor;
use crate::ir::{TensorType, Trace, ValueId};
use crate::models::hf_dir::NamedParams;
use crate::ops::nf4::{dequantize_nf4, quantize_nf4, Nf4Weight, CODES_SUFFIX};
use crate::ops::Op;

/// A linear layer an adapter can sit beside, by its role in the block.
#[derive(Copy, Clone, PartialEq, Eq, PartialOrd, Ord, Debug, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum LoraTarget {
    Q,
    K,
    V,
    O,
    Gate,
    Up,
    Down,
    /// The routed experts' gate and up products of a mixture-of-experts
    /// layer, one adapter per expert over the pair (`peft`'s
    /// `target_parameters` entry `mlp.experts.gate_up_proj`).
    ExpertsGateUp,
    /// The routed experts' down products (`mlp.experts.down_proj`).
    ExpertsDown,
    /// The router of a mixture-of-experts layer (`mlp.gate`, `[E, C]`):
    /// its adapter changes which experts a token takes, so `all-linear`
    /// leaves it out, as `peft` did before `transformers` 5 made it a
    /// parameter (`target_parameters` entry `mlp.gate.weight`).
    Router,
}

/// What `--lora-targets` accepts, for error messages.
const TARGET_CHOICES: &str =
    "q, k, v, o, gate, up, down, experts_gate_up, experts_down, experts, router (comma-separated) or all-linear";

impl LoraTarget {
    /// Every target, in block order: `all-linear`, which on a
    /// mixture-of-experts model includes the experts' products.
    pub const ALL: [LoraTarget; 9] = [
        LoraTarget::Q,
        LoraTarget::K,
        LoraTarget::V,
        LoraTarget::O,
        LoraTarget::Gate,
        LoraTarget::Up,
        LoraTarget::Down,
        LoraTarget::ExpertsGateUp,
        LoraTarget::ExpertsDown,
    ];

    /// The linear layers `peft`'s `target_modules` can name (the experts
    /// are parameters of one module: `target_parameters`).
    pub const MODULES: [LoraTarget; 7] = [
        LoraTarget::Q,
        LoraTarget::K,
        LoraTarget::V,
        LoraTarget::O,
        LoraTarget::Gate,
        LoraTarget::Up,
        LoraTarget::Down,
    ];

    /// The experts' products, in the order their module registers them
    /// (`gate_up_proj`, then `down_proj`), which is the order `peft` nests
    /// their adapters in.
    pub const EXPERTS: [LoraTarget; 2] = [LoraTarget::ExpertsGateUp, LoraTarget::ExpertsDown];

    /// Whether this target is the routed experts' product rather than a
    /// linear layer.
    pub fn is_experts(self) -> bool {
        LoraTarget::EXPERTS.contains(&self)
    }

    /// Whether `peft` reaches this target through `target_parameters`
    /// (the experts and the router, parameters of a `transformers` 5
    /// module) rather than `target_modules`: such adapters take no dropout
    /// there, and are named by the module that holds the parameter.
    pub fn is_parameter(self) -> bool {
        self.is_experts() || self == LoraTarget::Router
    }

    /// The module name the layer carries in the trace and in Llama-layout
    /// folders (`q_proj`, ..., `down_proj`); for the experts, the name of
    /// their weight under the block's `experts` module (`experts.gate_up_proj`).
    pub fn module(self) -> &'static str {
        match self {
            LoraTarget::Q => "q_proj",
            LoraTarget::K => "k_proj",
            LoraTarget::V => "v_proj",
            LoraTarget::O => "o_proj",
            LoraTarget::Gate => "gate_proj",
            LoraTarget::Up => "up_proj",
            LoraTarget::Down => "down_proj",
            LoraTarget::ExpertsGateUp => "experts.gate_up_proj",
            LoraTarget::ExpertsDown => "experts.down_proj",
            LoraTarget::Router => "gate",
        }
    }

    /// The short name `--lora-targets` takes (`q`, ..., `down`,
    /// `experts_gate_up`, `experts_down`).
    pub fn short(self) -> &'static str {
        match self {
            LoraTarget::Q => "q",
            LoraTarget::K => "k",
            LoraTarget::V => "v",
            LoraTarget::O => "o",
            LoraTarget::Gate => "gate",
            LoraTarget::Up => "up",
            LoraTarget::Down => "down",
            LoraTarget::ExpertsGateUp => "experts_gate_up",
            LoraTarget::ExpertsDown => "experts_down",
            LoraTarget::Router => "router",
        }
    }

    /// The parameter `peft` names for this target, as `target_parameters`
    /// lists it (`mlp.experts.gate_up_proj`, `mlp.gate.weight`); `None`
    /// for a linear module.
    pub fn peft_parameter(self) -> Option<&'static str> {
        match self {
            LoraTarget::ExpertsGateUp => Some("mlp.experts.gate_up_proj"),
            LoraTarget::ExpertsDown => Some("mlp.experts.down_proj"),
            LoraTarget::Router => Some("mlp.gate.weight"),
            _ => None,
        }
    }

    /// The target a linear layer of the trace is, from its prefix
    /// (`model.layers.3.self_attn.q_proj`, `model.layers.3.mlp.experts.down_proj`).
    pub fn of_layer(prefix: &str) -> Option<LoraTarget> {
        if let Some(t) = LoraTarget::EXPERTS.into_iter().find(|t| prefix.ends_with(&format!(".{}", t.module()))) {
            return Some(t);
        }
        let module = prefix.rsplit('.').next()?;
        if module == LoraTarget::Router.module() {
            return Some(LoraTarget::Router);
        }
        LoraTarget::MODULES.into_iter().find(|t| t.module() == module)
    }

    /// Parses a comma-separated list: short names (`q,v`), module names
    /// (`q_proj,v_proj`), `experts` (both expert products), or
    /// `all-linear`; sorted, without repeats.
    pub fn parse_list(text: &str) -> std::result::Result<Vec<LoraTarget>, String> {
        let text = text.trim();
        if text == "all-linear" || text == "all" {
            return Ok(LoraTarget::ALL.to_vec());
        }
        let mut out = Vec::new();
        for part in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let found: Vec<LoraTarget> = if part == "experts" {
                LoraTarget::EXPERTS.to_vec()
            } else {
                // The experts first: `mlp.experts.down_proj` ends like `down_proj`.
                let t = LoraTarget::EXPERTS
                    .into_iter()
                    .find(|t| t.short() == part || t.module() == part || part.ends_with(&format!(".{}", t.module())))
                    .or_else(|| LoraTarget::MODULES.into_iter().find(|t| t.short() == part || t.module() == part))
                    .or_else(|| (part == LoraTarget::Router.short()).then_some(LoraTarget::Router))
                    .ok_or_else(|| format!("unknown adapter target `{part}`: use {TARGET_CHOICES}"))?;
                vec![t]
            };
            for t in found {
                if !out.contains(&t) {
                    out.push(t);
                }
            }
        }
        if out.is_empty() {
            return Err(format!("no adapter targets given: use {TARGET_CHOICES}"));
        }
        out.sort();
        Ok(out)
    }
}

/// How the frozen base weights are stored.
#[derive(Copy, Clone, PartialEq, Eq, Debug, Default, Serialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum BaseStorage {
    /// In the model's dtype, as loaded.
    #[default]
    Model,
    /// Every linear layer of the blocks (q, k, v, o, gate, up, down,
    /// adapted or not, and the routed experts' stacked weights) as 4-bit
    /// NormalFloat codes with a scale per block of 64 (those scales
    /// themselves quantized with `double_quant`), as QLoRA stores them;
    /// embeddings, norms, routers and the head stay in the model's dtype.
    Nf4 { double_quant: bool },
}

/// A rank and alpha of its own for one target (`peft`'s `rank_pattern`
/// and `alpha_pattern`): `peft` gives the experts' fused gate and up pair
/// twice the rank and alpha when it converts an adapter that named the
/// two projections apart.
#[derive(Clone, Copy, PartialEq, Debug, Serialize)]
pub struct TargetRank {
    pub target: LoraTarget,
    pub rank: usize,
    pub alpha: f64,
}

/// The adapters of a LoRA run. Part of the model: serialized with the spec,
/// so a checkpoint resumes only with the same adapters.
#[derive(Clone, PartialEq, Debug, Serialize)]
pub struct Adapters {
    /// The rank `r` of every adapter but those of [`Adapters::ranks`].
    pub rank: usize,
    /// `α`: the adapter's product is scaled by `α / r`.
    pub alpha: f64,
    /// The linear layers that get adapters (sorted).
    pub targets: Vec<LoraTarget>,
    /// The probability of zeroing an input element of an adapter in a
    /// training step (0: no dropout).
    pub dropout: f64,
    /// How the frozen base is stored.
    pub base: BaseStorage,
    /// Targets with a rank and alpha of their own (most runs: none).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub ranks: Vec<TargetRank>,
}

impl Adapters {
    /// Adapters of rank `rank` with `α = alpha` on `targets`, no dropout, the base in the model's dtype.
    pub fn new(rank: usize, alpha: f64, targets: Vec<LoraTarget>) -> Result<Adapters> {
        let a = Adapters { rank, alpha, targets, dropout: 0.0, base: BaseStorage::Model, ranks: Vec::new() };
        a.validate()?;
        Ok(a)
    }

    /// The scale of the adapters' product, `α / r` (of a target without a
    /// rank of its own).
    pub fn scale(&self) -> f64 {
        self.alpha / self.rank as f64
    }

    /// The rank and alpha of `target`'s adapters.
    pub fn rank_of(&self, target: LoraTarget) -> (usize, f64) {
        self.ranks.iter().find(|r| r.target == target).map_or((self.rank, self.alpha), |r| (r.rank, r.alpha))
    }

    /// The rank and scale (`α / r`) of the adapter of the layer `layer`
    /// (a trace prefix).
    pub fn rank_and_scale(&self, layer: &str) -> (usize, f64) {
        let (rank, alpha) = LoraTarget::of_layer(layer).map_or((self.rank, self.alpha), |t| self.rank_of(t));
        (rank, alpha / rank as f64)
    }

    /// Whether the linear layer with trace prefix `prefix` gets an adapter.
    pub fn adapts(&self, prefix: &str) -> bool {
        LoraTarget::of_layer(prefix).is_some_and(|t| self.targets.contains(&t))
    }

    /// Checks the settings, naming the one that is wrong.
    pub fn validate(&self) -> Result<()> {
        let bad = |reason: String| Err(Error::Input { name: "adapters".into(), reason });
        if self.rank == 0 {
            return bad("the adapter rank (--lora-rank) must be at least 1".into());
        }
        if !(self.alpha.is_finite() && self.alpha > 0.0) {
            return bad(format!("the adapter alpha (--lora-alpha) must be positive and finite, got {}", self.alpha));
        }
        if !(0.0..1.0).contains(&self.dropout) {
            return bad(format!("the adapter dropout (--lora-dropout) must be in [0, 1), got {}", self.dropout));
        }
        if self.targets.is_empty() {
            return bad("adapters need at least one target layer (--lora-targets)".into());
        }
        for r in &self.ranks {
            let name = r.target.short();
            if !self.targets.contains(&r.target) {
                return bad(format!("a rank is given for `{name}`, which the adapters do not target"));
            }
            if r.rank == 0 || !(r.alpha.is_finite() && r.alpha > 0.0) {
                return bad(format!("`{name}`'s own rank {} and alpha {} must be positive", r.rank, r.alpha));
            }
        }
        Ok(())
    }
}

/// Whether the weight `name` is an adapter's matrix (`*.lora_A.weight`,
/// `*.lora_B.weight`): a parameter no model folder holds.
pub fn is_adapter_weight(name: &str) -> bool {
    name.ends_with(".lora_A.weight") || name.ends_with(".lora_B.weight")
}

/// Which of an adapter's output rows (its `B`'s rows) belong to a base
/// weight: all of them, or for the experts' gate and up pair, whose one
/// adapter covers both, the first half (gate) or the second (up).
#[derive(Copy, Clone, PartialEq, Eq, Debug)]
pub enum AdapterRows {
    All,
    Half(usize),
}

/// The base weights the adapter of the layer `layer` (a trace prefix)
/// adds to: a linear layer's own weight, or for the experts' `gate_up_proj`
/// the gate weight and the up weight, each with its half of the rows.
pub fn adapted_weights(layer: &str) -> Vec<(String, AdapterRows)> {
    match layer.strip_suffix(&format!(".{}", LoraTarget::ExpertsGateUp.module())) {
        Some(block) => vec![
            (format!("{block}.experts.gate_proj.weight"), AdapterRows::Half(0)),
            (format!("{block}.experts.up_proj.weight"), AdapterRows::Half(1)),
        ],
        None => vec![(format!("{layer}.weight"), AdapterRows::All)],
    }
}

/// The prefixes of the layers `trace` adapts (`model.layers.0.self_attn.q_proj`,
/// `model.layers.1.mlp.experts.gate_up_proj`), from its adapter parameters.
pub fn adapted_layers(trace: &Trace) -> Vec<String> {
    trace
        .params()
        .filter_map(|p| trace.value(p).kind.leaf_name()?.strip_suffix(".lora_A.weight").map(str::to_string))
        .collect()
}

/// The weight of an adapted layer with its adapter merged in:
/// `W + scale·B·A` for `W: [out, in]`, `A: [rank, in]`, `B: [out, rank]`,
/// each element summed in f64 and rounded once to `W`'s dtype (what
/// `peft`'s `merge_and_unload` computes, up to that rounding). Rows in
/// parallel: a Llama-3-8B layer's MLP weight is 58 million elements.
pub fn merged_weight(w: &HostTensor, a: &HostTensor, b: &HostTensor, scale: f64) -> Result<HostTensor> {
    merged_weight_rows(w, a, b, scale, AdapterRows::All)
}

/// [`merged_weight`] for the rows `rows` of `B`, and for stacked experts:
/// `W: [E, out, in]`, `A: [E, rank, in]`, `B: [E, out·parts, rank]`, each
/// expert's adapter merged into its weight.
pub fn merged_weight_rows(
    w: &HostTensor,
    a: &HostTensor,
    b: &HostTensor,
    scale: f64,
    rows: AdapterRows,
) -> Result<HostTensor> {
    let (ws, as_, bs) = (&w.ty.shape, &a.ty.shape, &b.ty.shape);
    let (parts, part) = match rows {
        AdapterRows::All => (1, 0),
        AdapterRows::Half(h) => (2, h),
    };
    let n = ws.len();
    let fits = (n == 2 || n == 3)
        && as_.len() == n
        && bs.len() == n
        && ws[..n - 2] == as_[..n - 2]
        && ws[..n - 2] == bs[..n - 2]
        && as_[n - 1] == ws[n - 1]
        && bs[n - 2] == parts * ws[n - 2]
        && bs[n - 1] == as_[n - 2]
        && part < parts;
    if !fits {
        return Err(Error::Input {
            name: "adapter".into(),
            reason: format!("A {} and B {} do not fit the weight {}", a.ty, b.ty, w.ty),
        });
    }
    let (out, inp, rank) = (ws[n - 2], ws[n - 1], as_[n - 2]);
    let (wv, av, bv) = (w.to_f64(), a.to_f64(), b.to_f64());
    let mut merged = vec![0.0f64; wv.len()];
    merged.par_chunks_mut(inp.max(1)).enumerate().for_each(|(row, m_row)| {
        // Row `row` of the stacked weight: expert `e`, output `o`.
        let (e, o) = (row / out, row % out);
        let b_row = (e * parts * out + part * out + o) * rank;
        let brow = &bv[b_row..b_row + rank];
        let a_e = &av[e * rank * inp..(e + 1) * rank * inp];
        for (i, m) in m_row.iter_mut().enumerate() {
            let delta: f64 = (0..rank).map(|r| brow[r] * a_e[r * inp + i]).sum();
            *m = wv[row * inp + i] + scale * delta;
        }
    });
    Ok(HostTensor::from_f64(w.ty.clone(), &merged))
}

/// A base weight stored as NF4 leaves: the weight it stands for (its name
/// and type as a model folder holds it) and the frozen leaves that hold it.
#[derive(Clone, Debug)]
pub struct QuantizedWeight {
    /// The weight's name (`model.layers.0.mlp.up_proj.weight`).
    pub name: String,
    /// Its shape and dtype as the model computes with it.
    pub ty: TensorType,
    /// The leaves (`{name}.nf4_codes`, ...), in the dequantization's input order.
    pub leaves: Vec<(String, ValueId)>,
    pub double_quant: bool,
}

/// Whether the leaf `name` holds part of an NF4 weight.
pub fn is_quantized_leaf(name: &str) -> bool {
    name.rsplit('.').next().is_some_and(|last| last.starts_with("nf4_"))
}

/// The NF4 weights of `trace`: every `dequantize_nf4` of frozen leaves.
pub fn quantized_weights(trace: &Trace) -> Vec<QuantizedWeight> {
    let mut out: Vec<QuantizedWeight> = Vec::new();
    for node in &trace.nodes {
        let Op::DequantizeNf4(op) = &node.op else { continue };
        let leaf_name = |v: ValueId| trace.value(v).kind.leaf_name().map(str::to_string);
        let Some(name) =
            leaf_name(node.inputs[0]).and_then(|n| n.strip_suffix(&format!(".{CODES_SUFFIX}")).map(str::to_string))
        else {
            continue;
        };
        if out.iter().any(|q| q.name == name) {
            continue;
        }
        let leaves = node.inputs.iter().filter_map(|&v| leaf_name(v).map(|n| (n, v))).collect();
        out.push(QuantizedWeight {
            name,
            ty: TensorType::new(op.dtype, op.shape.clone()),
            leaves,
            double_quant: op.double_quant,
        });
    }
    out
}

impl QuantizedWeight {
    /// Quantizes `value` (the weight, any float dtype) and writes its leaves.
    pub fn write(&self, weights: &mut (impl NamedParams + ?Sized), value: &HostTensor) -> Result<()> {
        if value.ty.shape != self.ty.shape {
            return Err(Error::Input {
                name: self.name.clone(),
                reason: format!("got {}, the weight is {}", value.ty, self.ty),
            });
        }
        let q = quantize_nf4(&value.to_f32(), self.double_quant)
            .map_err(|e| Error::Input { name: self.name.clone(), reason: e.to_string() })?;
        for ((name, _), (_, t)) in self.leaves.iter().zip(q.leaves()) {
            weights.write_param(name, &t)?;
        }
        Ok(())
    }

    /// The weight its leaves hold now, dequantized as the step computes it
    /// (each value rounded once to the weight's dtype).
    pub fn read(&self, weights: &mut (impl NamedParams + ?Sized)) -> Result<HostTensor> {
        let leaves: Vec<HostTensor> = self.leaves.iter().map(|(n, _)| weights.read_param(n)).collect::<Result<_>>()?;
        let q = Nf4Weight::from_leaves(&leaves)?;
        let x: Vec<f64> = dequantize_nf4(&q, self.ty.numel()).into_iter().map(f64::from).collect();
        Ok(HostTensor::from_f64(self.ty.clone(), &x))
    }
}

/// Writes every NF4 weight of `trace` as the seeded draw would start it:
/// the weight [`crate::models::init_param`] draws for its name, quantized.
/// (A base is frozen, so a drawn one only serves tests and benchmarks.)
pub fn init_quantized(weights: &mut (impl NamedParams + ?Sized), trace: &Trace, seed: u64) -> Result<usize> {
    let quantized = quantized_weights(trace);
    for q in &quantized {
        q.write(weights, &crate::models::init_param(&q.name, &q.ty, seed)?)?;
    }
    Ok(quantized.len())
}

/// Adapters held on the host, merged into base weights as they load (a
/// model that runs without adapters of its own, such as generation's).
pub struct AdapterMerge {
    /// Each adapted weight's `(A, B, rows of B, scale)` by its name (`...q_proj.weight`).
    by_weight: std::collections::HashMap<String, (HostTensor, HostTensor, AdapterRows, f64)>,
}

impl AdapterMerge {
    /// The adapter matrices `tensors` (by trace name) of `adapters`
    /// (their scales); every layer must have both its `A` and its `B`.
    pub fn new(adapters: &Adapters, tensors: &[(String, HostTensor)]) -> Result<AdapterMerge> {
        let find = |name: &str| tensors.iter().find(|(n, _)| n == name).map(|(_, t)| t.clone());
        let mut by_weight = std::collections::HashMap::new();
        let mut layers = std::collections::HashSet::new();
        for (name, _) in tensors {
            let Some(layer) = name.strip_suffix(".lora_A.weight") else { continue };
            let b = find(&format!("{layer}.lora_B.weight")).ok_or_else(|| Error::Input {
                name: name.clone(),
                reason: format!("the adapter of `{layer}` has an A matrix but no B"),
            })?;
            let a = find(name).expect("listed");
            let (_, scale) = adapters.rank_and_scale(layer);
            for (weight, rows) in adapted_weights(layer) {
                by_weight.insert(weight, (a.clone(), b.clone(), rows, scale));
            }
            layers.insert(layer.to_string());
        }
        if let Some((name, _)) =
            tensors.iter().find(|(n, _)| n.strip_suffix(".lora_B.weight").is_some_and(|l| !layers.contains(l)))
        {
            return Err(Error::Input { name: name.clone(), reason: "a B matrix without its A".into() });
        }
        Ok(AdapterMerge { by_weight })
    }

    /// The base weights adapted.
    pub fn len(&self) -> usize {
        self.by_weight.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_weight.is_empty()
    }

    /// The weight `name` with its adapter merged in, or `None` when the
    /// weight has no adapter.
    pub fn merge(&self, name: &str, weight: &HostTensor) -> Result<Option<HostTensor>> {
        match self.by_weight.get(name) {
            Some((a, b, rows, scale)) => Ok(Some(merged_weight_rows(weight, a, b, *scale, *rows)?)),
            None => Ok(None),
        }
    }
}

/// A model's weights with its adapters merged in, read through
/// [`NamedParams`] as a model folder saves them: reading an adapted
/// weight gives [`merged_weight_rows`], every other weight reads as it is
/// held. Read-only.
pub struct MergedWeights<'a, S: NamedParams + ?Sized> {
    weights: &'a mut S,
    /// The base weights stored as NF4, read dequantized.
    quantized: Vec<QuantizedWeight>,
    /// Each adapted weight's adapter (its layer prefix,
    /// `model.layers.0.self_attn.q_proj`), the rows of its `B` it takes and
    /// its scale.
    adapted: std::collections::HashMap<String, (String, AdapterRows, f64)>,
}

impl<'a, S: NamedParams + ?Sized> MergedWeights<'a, S> {
    /// The weights `weights` holds for the model `trace` (whose adapter
    /// parameters say which layers are adapted), merged at the scales of
    /// `adapters`.
    pub fn new(weights: &'a mut S, trace: &Trace, adapters: &Adapters) -> Result<Self> {
        let mut adapted = std::collections::HashMap::new();
        for layer in adapted_layers(trace) {
            let (_, scale) = adapters.rank_and_scale(&layer);
            for (weight, rows) in adapted_weights(&layer) {
                adapted.insert(weight, (layer.clone(), rows, scale));
            }
        }
        Ok(MergedWeights { weights, quantized: quantized_weights(trace), adapted })
    }
}

impl<S: NamedParams + ?Sized> NamedParams for MergedWeights<'_, S> {
    fn params_trace_name(&self) -> &str {
        self.weights.params_trace_name()
    }

    fn has_param(&self, name: &str) -> bool {
        self.weights.has_param(name) || self.quantized.iter().any(|q| q.name == name)
    }

    fn read_param(&mut self, name: &str) -> Result<HostTensor> {
        let w = match self.quantized.iter().find(|q| q.name == name) {
            Some(q) => q.read(self.weights)?,
            None => self.weights.read_param(name)?,
        };
        match self.adapted.get(name) {
            Some((layer, rows, scale)) => {
                let a = self.weights.read_param(&format!("{layer}.lora_A.weight"))?;
                let b = self.weights.read_param(&format!("{layer}.lora_B.weight"))?;
                merged_weight_rows(&w, &a, &b, *scale, *rows)
            }
            None => Ok(w),
        }
    }

    fn write_param(&mut self, name: &str, _value: &HostTensor) -> Result<()> {
        Err(Error::Input { name: name.into(), reason: "merged weights are read-only".into() })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_parse_short_and_module_names_and_all_linear() {
        assert_eq!(LoraTarget::parse_list("v,q").unwrap(), vec![LoraTarget::Q, LoraTarget::V]);
        assert_eq!(LoraTarget::parse_list("q_proj, down_proj,q").unwrap(), vec![LoraTarget::Q, LoraTarget::Down]);
        assert_eq!(LoraTarget::parse_list("all-linear").unwrap(), LoraTarget::ALL.to_vec());
        let e = LoraTarget::parse_list("q,lm_head").unwrap_err();
        assert!(e.contains("`lm_head`") && e.contains("all-linear"), "{e}");
        assert!(LoraTarget::parse_list(" , ").is_err());
    }

    #[test]
    fn a_layer_is_adapted_by_its_module_name() {
        let a = Adapters::new(8, 16.0, vec![LoraTarget::Q, LoraTarget::Down]).unwrap();
        assert!(a.adapts("model.layers.0.self_attn.q_proj"));
        assert!(a.adapts("model.layers.11.mlp.down_proj"));
        assert!(!a.adapts("model.layers.0.self_attn.k_proj") && !a.adapts("lm_head"));
        assert_eq!(a.scale(), 2.0);
    }

    #[test]
    fn merging_adds_the_scaled_product() {
        use crate::ir::{DType, TensorType};
        let t = |shape: [usize; 2], v: &[f64]| HostTensor::from_f64(TensorType::new(DType::F32, shape), v);
        let w = t([2, 3], &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
        let a = t([1, 3], &[1.0, 0.0, -1.0]);
        let b = t([2, 1], &[2.0, 0.5]);
        let m = merged_weight(&w, &a, &b, 0.5).unwrap();
        assert_eq!(m.to_f64(), [2.0, 2.0, 2.0, 4.25, 5.0, 5.75]);
        assert!(merged_weight(&w, &b, &a, 1.0).unwrap_err().to_string().contains("do not fit"));
    }

    /// Stacked experts merge expert by expert, and the gate/up pair's one
    /// adapter splits its B rows between the two weights.
    #[test]
    fn expert_adapters_merge_per_expert_and_per_half() {
        use crate::ir::{DType, TensorType};
        let t = |shape: Vec<usize>, f: &dyn Fn(usize) -> f64| {
            let n: usize = shape.iter().product();
            HostTensor::from_f64(TensorType::new(DType::F64, shape), &(0..n).map(f).collect::<Vec<_>>())
        };
        let (e, out, inp, rank) = (2, 3, 4, 2);
        let w = t(vec![e, out, inp], &|i| i as f64);
        let a = t(vec![e, rank, inp], &|i| (i % 5) as f64 - 2.0);
        let b = t(vec![e, 2 * out, rank], &|i| (i % 3) as f64 * 0.5);
        for half in 0..2 {
            let m = merged_weight_rows(&w, &a, &b, 0.5, AdapterRows::Half(half)).unwrap().to_f64();
            let (wv, av, bv) = (w.to_f64(), a.to_f64(), b.to_f64());
            for (x, o, i) in [(0, 0, 0), (1, 2, 3), (1, 1, 0)] {
                let delta: f64 = (0..rank)
                    .map(|r| bv[(x * 2 * out + half * out + o) * rank + r] * av[(x * rank + r) * inp + i])
                    .sum();
                assert_eq!(m[(x * out + o) * inp + i], wv[(x * out + o) * inp + i] + 0.5 * delta);
            }
        }
        assert!(merged_weight_rows(&w, &a, &b, 1.0, AdapterRows::All).is_err());
        let names: Vec<_> =
            adapted_weights("model.layers.1.mlp.experts.gate_up_proj").into_iter().map(|(n, _)| n).collect();
        assert_eq!(names, ["model.layers.1.mlp.experts.gate_proj.weight", "model.layers.1.mlp.experts.up_proj.weight"]);
        assert_eq!(
            adapted_weights("model.layers.1.mlp.experts.down_proj"),
            [("model.layers.1.mlp.experts.down_proj.weight".to_string(), AdapterRows::All)]
        );
    }

    #[test]
    fn expert_targets_parse_and_are_found_by_layer() {
        let both = vec![LoraTarget::ExpertsGateUp, LoraTarget::ExpertsDown];
        assert_eq!(LoraTarget::parse_list("experts").unwrap(), both);
        assert_eq!(LoraTarget::parse_list("mlp.experts.down_proj,experts_gate_up").unwrap(), both);
        assert_eq!(LoraTarget::parse_list("down_proj").unwrap(), vec![LoraTarget::Down]);
        assert_eq!(LoraTarget::of_layer("model.layers.0.mlp.experts.down_proj"), Some(LoraTarget::ExpertsDown));
        assert_eq!(LoraTarget::of_layer("model.layers.0.mlp.shared_expert.down_proj"), Some(LoraTarget::Down));
        assert_eq!(LoraTarget::parse_list("router,q").unwrap(), vec![LoraTarget::Q, LoraTarget::Router]);
        assert_eq!(LoraTarget::of_layer("model.layers.0.mlp.gate"), Some(LoraTarget::Router));
        assert_eq!(LoraTarget::of_layer("model.layers.0.mlp.shared_expert_gate"), None);
        assert!(!LoraTarget::ALL.contains(&LoraTarget::Router));
        let e = LoraTarget::parse_list("lm_head").unwrap_err();
        assert!(e.contains("experts") && e.contains("router"), "{e}");
    }

    #[test]
    fn a_target_with_its_own_rank_scales_by_its_own_alpha() {
        let own = TargetRank { target: LoraTarget::ExpertsGateUp, rank: 8, alpha: 16.0 };
        let a = Adapters { ranks: vec![own], ..Adapters::new(4, 6.0, LoraTarget::ALL.to_vec()).unwrap() };
        a.validate().unwrap();
        assert_eq!(a.rank_and_scale("model.layers.0.mlp.experts.gate_up_proj"), (8, 2.0));
        assert_eq!(a.rank_and_scale("model.layers.0.mlp.experts.down_proj"), (4, 1.5));
        let off = Adapters { targets: vec![LoraTarget::Q], ..a.clone() };
        assert!(off.validate().unwrap_err().to_string().contains("experts_gate_up"));
        let zero = Adapters { ranks: vec![TargetRank { rank: 0, ..own }], ..a };
        assert!(zero.validate().is_err());
    }

    #[test]
    fn bad_settings_are_named() {
        for (a, what) in [
            (Adapters { rank: 0, ..Adapters::new(1, 1.0, vec![LoraTarget::Q]).unwrap() }, "--lora-rank"),
            (Adapters { alpha: -1.0, ..Adapters::new(1, 1.0, vec![LoraTarget::Q]).unwrap() }, "--lora-alpha"),
            (Adapters { dropout: 1.0, ..Adapters::new(1, 1.0, vec![LoraTarget::Q]).unwrap() }, "--lora-dropout"),
            (Adapters { targets: vec![], ..Adapters::new(1, 1.0, vec![LoraTarget::Q]).unwrap() }, "--lora-targets"),
        ] {
            let e = a.validate().unwrap_err().to_string();
            assert!(e.contains(what), "{e}");
        }
    }
}
