//! The GPT-family model builder: records the forward pass and loss of a
//! [`Config`] on symbolic tensors into a [`Trace`], with litgpt's
//! architecture choices (RMSNorm or LayerNorm, SwiGLU or GELU MLP, parallel
//! or sequential residual, partial rotary, grouped-query attention, q/k/v
//! biases, tied or untied head) and the ones Mistral and Gemma add (sliding
//! windows on some layers, each layer its own RoPE base, attention and
//! logit soft-caps, norms before and after each sublayer, RMSNorm weights
//! stored as offsets from one, GeGLU, scaled embeddings).
//!
//! A final logit soft-cap is applied inside the fused head and loss
//! (`linear_cross_entropy`'s `softcap`), so a model that caps its logits
//! does not hold them either; the materialised path
//! ([`HeadLoss::Materialised`], [`build_forward_with_logits`]) caps them in
//! their own dtype, then takes the loss.
//!
//! Parameters carry Hugging Face Llama-style names (`model.embed_tokens.weight`,
//! `model.layers.0.self_attn.q_proj.weight`, `lm_head.weight`, ...) so
//! checkpoints map onto them by name; a GELU MLP uses `mlp.up_proj` and
//! `mlp.down_proj`. Activations stay in the `[batch, tokens, heads, head]`
//! layout that comes out of the projections: no permutes anywhere.
//!
//! **MLP row tiling** ([`ForwardOptions::mlp_tiles`], as Arctic Long-Sequence
//! Training's TiledMLP): the MLP treats every token on its own, so its input
//! rows can be split into tiles (`slice`), each tile run through the whole
//! MLP, and the results joined (`concat`). The values are the same; what
//! changes is that autodiff then differentiates tile by tile, and with the
//! tiles' intermediates recomputed, backward holds one tile's
//! `[rows/tiles, intermediate]` tensors at a time instead of the layer's.
//! One tile (the default) records the untiled MLP, op for op.

use super::config::{check_bytes, show_values, Config, Factor, MlpKind, MoeConfig, NormKind, QkNorm, PARAM_KEYS};
use super::init::param_stream;
use super::lora::{Adapters, BaseStorage, LoraTarget};
use crate::autodiff::{ROUTER_AUX_LOSS_OUTPUT, ROUTER_Z_LOSS_OUTPUT, STEP_INPUT};
use crate::error::{Error, Result};
use crate::ir::{Builder, DType, OutputKind, TensorType, Trace, ValueId, MAX_VALUE_BYTES};
use crate::ops::attention::Scores;
use crate::ops::glu::GateFn;
use crate::ops::linear_ce::{default_chunk, LinearCrossEntropy, Reduction};
use crate::ops::nf4::Nf4Weight;
use crate::ops::reduce::ReduceKind;
use crate::ops::{stat_dtype, UnaryFn};

/// The loss the forward trace ends with.
#[derive(Copy, Clone, PartialEq, Eq, Debug, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum LossKind {
    /// `sum(logits)`: the benchmark workloads W1/W3 (no targets).
    Sum,
    /// Mean cross-entropy against the `targets` input, ignoring [`IGNORE_INDEX`]:
    /// the head and the loss are one fused op (`linear_cross_entropy`) that
    /// never holds the `[tokens, vocab]` logits, unless the head has a bias.
    CrossEntropy,
}

impl LossKind {
    pub fn parse(s: &str) -> Option<LossKind> {
        match s {
            "sum" => Some(LossKind::Sum),
            "ce" | "cross-entropy" | "cross_entropy" => Some(LossKind::CrossEntropy),
            _ => None,
        }
    }
}

/// Targets equal to this are skipped by the loss (PyTorch's default).
pub const IGNORE_INDEX: i64 = -100;
/// Name of the token-id step input.
pub const TOKENS_INPUT: &str = "input_ids";
/// Name of the target step input (cross-entropy only).
pub const TARGETS_INPUT: &str = "targets";
/// Name of the step input of each token's position in its document
/// (`i32[batch, seq]`, [`ModelSpec::documents`]), as Hugging Face's
/// `position_ids`: 0 at each document's first token in the row.
pub const POSITIONS_INPUT: &str = "position_ids";

/// One forward workload: a model and the shape of its batch.
#[derive(Clone, Debug, serde::Serialize)]
pub struct ModelSpec {
    pub config: Config,
    pub batch: usize,
    pub seq: usize,
    pub dtype: DType,
    pub loss: LossKind,
    /// Low-rank adapters over a frozen base ([`super::lora`]); `None`
    /// trains every weight. Left out of the serialization when `None`, so
    /// what full runs record is unchanged.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub adapters: Option<Adapters>,
    /// Rows are packed with documents that must not see each other: the
    /// step takes each token's position in its document
    /// ([`POSITIONS_INPUT`]), which RoPE rotates by and attention masks
    /// by. Left out of the serialization when off.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub documents: bool,
}

impl ModelSpec {
    /// The named model (litgpt or Hugging Face name, see [`Config::named`])
    /// on batches of `batch` × `seq` tokens.
    pub fn named(name: &str, batch: usize, seq: usize, dtype: DType, loss: LossKind) -> Result<Self> {
        Ok(ModelSpec { config: Config::named(name)?, batch, seq, dtype, loss, adapters: None, documents: false })
    }

    /// Checks the config, the batch and every size the model records: each
    /// weight and activation, and the parameters together, within
    /// [`MAX_VALUE_BYTES`], or an [`Error::Size`] naming the keys of the
    /// first that is not. Building a trace checks this first.
    pub fn validate(&self) -> Result<()> {
        let bad = |reason: String| Err(Error::Config { model: self.config.name.clone(), reason });
        self.config.validate()?;
        if self.batch == 0 || self.seq == 0 {
            return bad(format!("batch ({}) and sequence length ({}) must be positive", self.batch, self.seq));
        }
        if self.seq > self.config.block_size {
            return bad(format!("sequence length {} exceeds the block size {}", self.seq, self.config.block_size));
        }
        if !self.dtype.is_float() {
            return bad(format!("the model dtype must be a float type, not {}", self.dtype));
        }
        self.check_sizes()
    }

    /// Every tensor the model records spans at most [`MAX_VALUE_BYTES`],
    /// and so do its parameters together; an [`Error::Size`] names the
    /// config keys and batch fields of the first that does not. Counted at
    /// four bytes or more per element: a step keeps float32 copies of
    /// some (the loss's statistics, the AdamW moments of f16 parameters).
    fn check_sizes(&self) -> Result<()> {
        let cfg = &self.config;
        let name = cfg.name.as_str();
        let unit = self.dtype.size().max(4) as u64;
        let (b, s) = (("batch", self.batch), ("seq", self.seq));
        check_bytes(name, &format!("the `{TOKENS_INPUT}` input"), &[b, s], DType::I32.size() as u64)?;
        for (what, factors) in cfg.weight_factors() {
            check_bytes(name, what, &factors, unit)?;
        }
        let activations: [(&str, &[Factor]); 5] = [
            ("the hidden states", &[b, s, ("n_embd", cfg.n_embd)]),
            ("the queries", &[b, s, ("n_head", cfg.n_head), ("head_size", cfg.head_size)]),
            ("the attention statistics", &[b, s, ("n_head", cfg.n_head)]),
            ("the MLP activations", &[b, s, ("intermediate_size", cfg.intermediate_size)]),
            ("the logits", &[b, s, ("padded_vocab_size", cfg.padded_vocab_size)]),
        ];
        for (what, factors) in activations {
            check_bytes(name, what, factors, unit)?;
        }
        // Validated: the count itself is at most 2^60.
        let params = cfg.param_count();
        if params.checked_mul(unit).is_none_or(|bytes| bytes > MAX_VALUE_BYTES) {
            return Err(Error::Size {
                keys: PARAM_KEYS.to_vec(),
                reason: format!(
                    "model `{name}`: its {params} parameters ({}) at {unit} bytes each pass 2^60 bytes \
                     ({MAX_VALUE_BYTES}), the most one plan can hold",
                    show_values(&cfg.param_factors())
                ),
            });
        }
        Ok(())
    }
}

/// The model builder: the trace being recorded and the model it records.
/// The generation builder ([`super::generate`]) records its programs with
/// the same layers.
pub(crate) struct Gpt<'a> {
    pub(crate) b: Builder,
    pub(crate) cfg: &'a Config,
    pub(crate) dtype: DType,
    /// Row tiles of every MLP (see the module doc); 1 for none.
    pub(crate) mlp_tiles: usize,
    /// Parameters made so far, by name: a trace that records the model more
    /// than once (generation's prefill and decode steps) shares one leaf
    /// per weight.
    pub(crate) params: std::collections::HashMap<String, ValueId>,
    /// Record q, k and v (and an MLP's gate and up) as one product each, of
    /// a fused weight whose rows are the parts' ([`FusedParam`]); the
    /// parts are sliced from its output, or, at several rows with parts of
    /// one size, it is a batch of one product per part whose outputs are
    /// contiguous blocks ([`Gpt::projections`]). Generation does: at one
    /// row per sequence a product's time is mostly fixed cost, so one
    /// product of three weights beats three. Training keeps the model's own
    /// weights.
    pub(crate) fuse_projections: bool,
    /// The fused weights made so far, in creation order.
    pub(crate) fused: Vec<FusedParam>,
    /// Each `start` input (row positions, `[B]`) given twice, `[2B]`, made
    /// once per trace segment's first use: the rows of q and k rotated
    /// together (see [`Gpt::attention`]).
    doubled_starts: Vec<(ValueId, ValueId)>,
    /// Low-rank adapters: every base weight is then a frozen leaf, and the
    /// adapted linear layers get their adapters ([`Gpt::linear`]).
    pub(crate) adapters: Option<Adapters>,
    /// With adapter dropout in a training step: the step-count input its
    /// masks are drawn from.
    pub(crate) dropout_step: Option<ValueId>,
    /// Each sparse layer's router probabilities `[N, E]` and per-expert
    /// counts `[E]`, kept for the load-balancing loss when the model has
    /// one ([`MoeConfig::aux_loss_coef`]).
    pub(crate) router_stats: Vec<(ValueId, ValueId)>,
    /// Each sparse layer's router scores `[N, E]` (in the statistics'
    /// dtype), kept for the router z-loss when the model has one
    /// ([`MoeConfig::z_loss_coef`]).
    pub(crate) router_scores: Vec<ValueId>,
    /// Mark the linear layers (not the router) for FP8 products
    /// ([`ForwardOptions::fp8_products`]).
    pub(crate) fp8_products: bool,
}

/// A parameter made of other parameters' rows, in order: how a checkpoint's
/// tensors (named as the parts) load into it.
#[derive(Clone, Debug, PartialEq)]
pub struct FusedParam {
    /// The fused parameter's name (e.g. `model.layers.0.self_attn.qkv_proj.weight`).
    pub name: String,
    /// Each part's name and type (its leading dimension is its rows).
    pub parts: Vec<(String, TensorType)>,
}

/// How a block's attention gets from its rotated `q, k, v` and scale to
/// `[B, T, Hq, D]` (see [`Gpt::layers`]); called with the layer index.
pub(crate) type Attend<'f, 'a> =
    dyn FnMut(&mut Gpt<'a>, usize, ValueId, ValueId, ValueId, f64, Scores) -> Result<ValueId> + 'f;

impl<'a> Gpt<'a> {
    pub(crate) fn new(name: &str, cfg: &'a Config, dtype: DType, mlp_tiles: usize) -> Self {
        Gpt {
            b: Builder::new(name),
            cfg,
            dtype,
            mlp_tiles,
            params: Default::default(),
            fuse_projections: false,
            fused: Vec::new(),
            doubled_starts: Vec::new(),
            adapters: None,
            dropout_step: None,
            router_stats: Vec::new(),
            router_scores: Vec::new(),
            fp8_products: false,
        }
    }

    /// The model weight `name`: a trained parameter, or with adapters a
    /// frozen leaf (the base).
    pub(crate) fn param(&mut self, name: &str, shape: &[usize]) -> Result<ValueId> {
        if let Some(&p) = self.params.get(name) {
            return Ok(p);
        }
        let ty = TensorType::new(self.dtype, shape);
        let p = if self.adapters.is_some() { self.b.frozen(name, ty)? } else { self.b.param(name, ty)? };
        self.params.insert(name.to_string(), p);
        Ok(p)
    }

    /// The frozen weight `name` stored as NF4 leaves (`{name}.nf4_codes`,
    /// ...; see [`crate::ops::nf4`]), dequantized to the model's dtype
    /// where it is used; made once, and the dequantized value shared by
    /// every use in the forward pass (recomputation makes it again for
    /// backward rather than keep it).
    fn nf4_weight(&mut self, name: &str, shape: &[usize], double_quant: bool) -> Result<ValueId> {
        if let Some(&w) = self.params.get(name) {
            return Ok(w);
        }
        let types = Nf4Weight::leaf_types(shape, double_quant).map_err(|e| Error::Config {
            model: self.cfg.name.clone(),
            reason: format!("`{name}` cannot be stored as nf4 (--base-dtype nf4): {e}"),
        })?;
        let mut leaves = Vec::with_capacity(types.len());
        for (suffix, ty) in types {
            leaves.push(self.b.frozen(&format!("{name}.{suffix}"), ty)?);
        }
        let w = self.b.dequantize_nf4(&leaves, shape, double_quant, self.dtype)?;
        self.params.insert(name.to_string(), w);
        Ok(w)
    }

    /// The trained parameter `name` (an adapter's matrix), made once.
    fn adapter_param(&mut self, name: &str, shape: &[usize]) -> Result<ValueId> {
        if let Some(&p) = self.params.get(name) {
            return Ok(p);
        }
        let p = self.b.param(name, TensorType::new(self.dtype, shape))?;
        self.params.insert(name.to_string(), p);
        Ok(p)
    }

    fn linear_params(
        &mut self,
        prefix: &str,
        inp: usize,
        out: usize,
        bias: bool,
    ) -> Result<(ValueId, Option<ValueId>)> {
        let w = match self.adapters.as_ref().map(|a| a.base) {
            // The router stays in the model's dtype, as QLoRA leaves it.
            Some(BaseStorage::Nf4 { double_quant })
                if LoraTarget::of_layer(prefix).is_some_and(|t| t != LoraTarget::Router) =>
            {
                self.nf4_weight(&format!("{prefix}.weight"), &[out, inp], double_quant)?
            }
            _ => self.param(&format!("{prefix}.weight"), &[out, inp])?,
        };
        let bias = if bias { Some(self.param(&format!("{prefix}.bias"), &[out])?) } else { None };
        Ok((w, bias))
    }

    /// The linear layer `prefix` of `x: [..., inp]`, with its adapter
    /// beside it when the layer is adapted ([`super::lora`]).
    pub(crate) fn linear(&mut self, x: ValueId, prefix: &str, inp: usize, out: usize, bias: bool) -> Result<ValueId> {
        let (w, bias) = self.linear_params(prefix, inp, out, bias)?;
        // The router's scores decide which experts run: kept exact, as the
        // output head is (which never comes through here).
        let fp8 = self.fp8_products && LoraTarget::of_layer(prefix) != Some(LoraTarget::Router);
        let y = self.b.linear_marked(x, w, bias, fp8)?;
        match &self.adapters {
            Some(a) if a.adapts(prefix) => {
                let (rank, scale) = a.rank_and_scale(prefix);
                self.adapter(x, y, prefix, inp, out, rank, scale)
            }
            _ => Ok(y),
        }
    }

    /// `y + scale·(x·Aᵀ)·Bᵀ`: the adapter of the layer `prefix` added to
    /// its base output `y`. The scale multiplies the narrow `[..., rank]`
    /// product.
    #[allow(clippy::too_many_arguments)]
    fn adapter(
        &mut self,
        x: ValueId,
        y: ValueId,
        prefix: &str,
        inp: usize,
        out: usize,
        rank: usize,
        scale: f64,
    ) -> Result<ValueId> {
        self.check_parameter_dropout(prefix)?;
        let a = self.adapter_param(&format!("{prefix}.lora_A.weight"), &[rank, inp])?;
        let b = self.adapter_param(&format!("{prefix}.lora_B.weight"), &[out, rank])?;
        // Dropout on the adapter's input only, as peft applies it; each
        // layer draws its own masks (its stream is its name's).
        let x = match (self.dropout_step, self.adapters.as_ref().map_or(0.0, |a| a.dropout)) {
            (Some(step), p) if p > 0.0 => self.b.dropout(x, step, p, param_stream(0, prefix))?,
            _ => x,
        };
        let down = self.b.linear(x, a, None)?;
        let s = self.b.full(scale, TensorType::scalar(self.dtype))?;
        let down = self.b.mul(down, s)?;
        let up = self.b.linear(down, b, None)?;
        self.b.add(y, up)
    }

    /// The projections `parts` (`(prefix, out)` each, all from `inp`) of
    /// `x: [..., inp]`: with [`Gpt::fuse_projections`] one product of the
    /// fused weight `{fused_prefix}.weight` (and bias), its output sliced
    /// into the parts along the last axis, or, for several rows and parts
    /// of one size, a batch of one product per part; otherwise one product
    /// each.
    fn projections(
        &mut self,
        x: ValueId,
        fused_prefix: &str,
        parts: &[(String, usize)],
        inp: usize,
        bias: bool,
    ) -> Result<Vec<ValueId>> {
        if !self.fuse_projections {
            return parts.iter().map(|(prefix, out)| self.linear(x, prefix, inp, *out, bias)).collect();
        }
        let shape = self.b.shape(x).to_vec();
        let lead = &shape[..shape.len() - 1];
        let rows: usize = lead.iter().product();
        if rows > 1 && !bias && parts.iter().all(|p| p.1 == parts[0].1) {
            let y = self.part_batch(x, fused_prefix, parts, inp)?;
            let mut part_shape = lead.to_vec();
            part_shape.push(parts[0].1);
            return (0..parts.len())
                .map(|p| {
                    let block = self.b.slice(y, 0, p, p + 1)?;
                    self.b.reshape(block, &part_shape)
                })
                .collect();
        }
        let y = self.fused_product(x, fused_prefix, parts, inp, bias)?;
        let axis = self.b.shape(y).len() - 1;
        let mut at = 0;
        let mut out = Vec::with_capacity(parts.len());
        for (_, rows) in parts {
            out.push(self.b.slice(y, axis, at, at + rows)?);
            at += rows;
        }
        Ok(out)
    }

    /// Several rows and parts of one size (gate and up; q, k and v without
    /// grouped heads): the fused weight read as a batch of parts, one
    /// product per part sharing `x: [..., inp]`, giving `[parts, rows, n]`.
    /// Each part's output is one contiguous block, a view at an aligned
    /// offset, where the column slices of one product would each be a copy.
    fn part_batch(&mut self, x: ValueId, fused_prefix: &str, parts: &[(String, usize)], inp: usize) -> Result<ValueId> {
        let rows: usize = self.b.shape(x)[..self.b.shape(x).len() - 1].iter().product();
        let (w, _) = self.fused_params(fused_prefix, parts, inp, false)?;
        let w = self.b.reshape(w, &[parts.len(), parts[0].1, inp])?;
        let x = self.b.reshape(x, &[rows, inp])?;
        self.b.matmul(x, w, false, true)
    }

    /// `start` given twice (`[2B]`), made once per `start`.
    fn doubled_start(&mut self, start: ValueId) -> Result<ValueId> {
        if let Some(&(_, twice)) = self.doubled_starts.iter().find(|(s, _)| *s == start) {
            return Ok(twice);
        }
        let twice = self.b.concat(&[start, start], 0)?;
        self.doubled_starts.push((start, twice));
        Ok(twice)
    }

    /// The one product of the fused weight `{fused_prefix}.weight` (and
    /// bias) that stands for the projections `parts`, whose outputs lie side
    /// by side along its last axis.
    fn fused_product(
        &mut self,
        x: ValueId,
        fused_prefix: &str,
        parts: &[(String, usize)],
        inp: usize,
        bias: bool,
    ) -> Result<ValueId> {
        let (w, b) = self.fused_params(fused_prefix, parts, inp, bias)?;
        self.b.linear(x, w, b)
    }

    /// The fused weight `{fused_prefix}.weight` `[Σ out, inp]` (and bias)
    /// standing for the projections `parts`, registered once with its parts.
    fn fused_params(
        &mut self,
        fused_prefix: &str,
        parts: &[(String, usize)],
        inp: usize,
        bias: bool,
    ) -> Result<(ValueId, Option<ValueId>)> {
        let total: usize = parts.iter().map(|p| p.1).sum();
        let fuse = |g: &mut Self, suffix: &str, shape_of: &dyn Fn(usize) -> Vec<usize>| {
            let name = format!("{fused_prefix}.{suffix}");
            if !g.fused.iter().any(|f| f.name == name) {
                let parts = parts
                    .iter()
                    .map(|(prefix, out)| (format!("{prefix}.{suffix}"), TensorType::new(g.dtype, shape_of(*out))))
                    .collect();
                g.fused.push(FusedParam { name: name.clone(), parts });
            }
            g.param(&name, &shape_of(total))
        };
        let w = fuse(self, "weight", &|rows| vec![rows, inp])?;
        let b = if bias { Some(fuse(self, "bias", &|rows| vec![rows])?) } else { None };
        Ok((w, b))
    }

    pub(crate) fn norm(&mut self, x: ValueId, prefix: &str) -> Result<ValueId> {
        let c = self.cfg.n_embd;
        let w = self.param(&format!("{prefix}.weight"), &[c])?;
        match self.cfg.norm {
            NormKind::RmsNorm | NormKind::RmsNormUnitOffset => self.rms_norm(x, w),
            NormKind::LayerNorm => {
                let bias = self.param(&format!("{prefix}.bias"), &[c])?;
                self.b.layer_norm(x, w, bias, self.cfg.norm_eps)
            }
        }
    }

    /// The model's RMSNorm of `x` with the weight `w` (a LayerNorm model's
    /// q/k norms are RMSNorms too): `x·rstd·w`, or for a weight stored as
    /// an offset from one `x·rstd·(1 + w)` computed as `transformers`'
    /// Gemma RMSNorm computes it, on `x` and `w` widened to f32, `1 + w` in
    /// f32, the result rounded once to `x`'s dtype.
    fn rms_norm(&mut self, x: ValueId, w: ValueId) -> Result<ValueId> {
        let eps = self.cfg.norm_eps;
        if self.cfg.norm != NormKind::RmsNormUnitOffset {
            return self.b.rms_norm(x, w, eps);
        }
        let dtype = self.b.dtype(x);
        let wide = if dtype.size() < 4 { DType::F32 } else { dtype };
        let xw = self.b.cast(x, wide)?;
        let ww = self.b.cast(w, wide)?;
        let one = self.b.full(1.0, TensorType::scalar(wide))?;
        let ww = self.b.add(ww, one)?;
        let y = self.b.rms_norm(xw, ww, eps)?;
        self.b.cast(y, dtype)
    }

    /// The embedding's output `x`, multiplied by `√n_embd` rounded to the
    /// model's dtype when the model scales its embeddings (Gemma).
    pub(crate) fn scale_embedding(&mut self, x: ValueId) -> Result<ValueId> {
        if !self.cfg.scale_embeddings {
            return Ok(x);
        }
        let dtype = self.b.dtype(x);
        let s = self.b.full(self.cfg.embedding_scale(dtype), TensorType::scalar(dtype))?;
        self.b.mul(x, s)
    }

    /// The logits `x`, soft-capped as `cap·tanh(x/cap)` in their own dtype,
    /// one rounding per step as `transformers` computes it, when the model
    /// caps them (Gemma 2); as they are otherwise.
    pub(crate) fn cap_logits(&mut self, x: ValueId) -> Result<ValueId> {
        let Some(cap) = self.cfg.final_softcap else {
            return Ok(x);
        };
        let dtype = self.b.dtype(x);
        let c = self.b.full(cap, TensorType::scalar(dtype))?;
        let y = self.b.div(x, c)?;
        let y = self.b.unary(UnaryFn::Tanh, y)?;
        self.b.mul(y, c)
    }

    /// Every block of the model on `x: [B, T, C]`, each attention's core
    /// (from rotated q, k, v, the scale and the layer's [`Scores`] to
    /// `[B, T, Hq, D]`) recorded by `attend(g, layer, q, k, v, scale,
    /// scores)`: training attends over the
    /// sequence itself, generation writes a KV cache and attends over it.
    /// Row `b`'s tokens sit at positions `start[b] + t` when `start` is
    /// `i32[B]`, at `start[b, t]` when it is `i32[B, T]` (packed
    /// documents), at `t` when it is `None`.
    pub(crate) fn layers(
        &mut self,
        mut x: ValueId,
        batch: usize,
        seq: usize,
        start: Option<ValueId>,
        attend: &mut Attend<'_, 'a>,
    ) -> Result<ValueId> {
        let cfg = self.cfg;
        for layer in 0..cfg.n_layer {
            let p = format!("model.layers.{layer}");
            if cfg.sandwich_norms {
                // Each sublayer between two norms of its own, its normalised
                // output joining the stream (Gemma 2 and 3).
                let h = self.norm(x, &format!("{p}.input_layernorm"))?;
                let a = self.attention(h, layer, batch, seq, start, attend)?;
                let a = self.norm(a, &format!("{p}.post_attention_layernorm"))?;
                x = self.b.add(a, x)?;
                let h = self.norm(x, &format!("{p}.pre_feedforward_layernorm"))?;
                let m = self.feed_forward(h, layer, &format!("{p}.mlp"))?;
                let m = self.norm(m, &format!("{p}.post_feedforward_layernorm"))?;
                x = self.b.add(m, x)?;
                continue;
            }
            if cfg.post_norms {
                // Each sublayer reads the stream as it is and its output is
                // normalised before it joins (OLMo 2).
                let a = self.attention(x, layer, batch, seq, start, attend)?;
                let a = self.norm(a, &format!("{p}.post_attention_layernorm"))?;
                x = self.b.add(a, x)?;
                let m = self.feed_forward(x, layer, &format!("{p}.mlp"))?;
                let m = self.norm(m, &format!("{p}.post_feedforward_layernorm"))?;
                x = self.b.add(m, x)?;
                continue;
            }
            let h = self.norm(x, &format!("{p}.input_layernorm"))?;
            let a = self.attention(h, layer, batch, seq, start, attend)?;
            if cfg.parallel_residual {
                let h2 =
                    if cfg.shared_attention_norm { h } else { self.norm(x, &format!("{p}.post_attention_layernorm"))? };
                let m = self.feed_forward(h2, layer, &format!("{p}.mlp"))?;
                let am = self.b.add(a, m)?;
                x = self.b.add(am, x)?;
            } else {
                x = self.b.add(a, x)?;
                let h2 = self.norm(x, &format!("{p}.post_attention_layernorm"))?;
                let m = self.feed_forward(h2, layer, &format!("{p}.mlp"))?;
                x = self.b.add(m, x)?;
            }
        }
        Ok(x)
    }

    /// One attention block on `x: [B, T, C]`: projections, rotation (at
    /// `start`'s positions when given), `attend`, output projection.
    fn attention(
        &mut self,
        x: ValueId,
        layer: usize,
        batch: usize,
        seq: usize,
        start: Option<ValueId>,
        attend: &mut Attend<'_, 'a>,
    ) -> Result<ValueId> {
        let cfg = self.cfg;
        let prefix = format!("model.layers.{layer}.self_attn");
        let (hq, hkv, d, c) = (cfg.n_head, cfg.n_query_groups, cfg.head_size, cfg.n_embd);
        let qkv_bias = cfg.bias || cfg.attn_qkv_bias;
        let parts = [
            (format!("{prefix}.q_proj"), hq * d),
            (format!("{prefix}.k_proj"), hkv * d),
            (format!("{prefix}.v_proj"), hkv * d),
        ];
        let n_rot = cfg.n_rot();
        let (base, scaling) = cfg.rope_of(layer);
        let rotate = |g: &mut Self, x: ValueId| match start {
            Some(s) => g.b.rope_at(x, s, n_rot, base, scaling.clone()),
            None => g.b.rope(x, n_rot, base, scaling.clone()),
        };
        // Per-head q/k norms go between the projections and the rotation,
        // which the fused paths below join: those are for models without.
        let (q, k, v) = if self.fuse_projections && batch * seq == 1 && n_rot > 0 && cfg.qk_norm.is_none() {
            // One row (decode at batch 1): q and k lie side by side in the
            // fused product's output, so one rotation covers both heads'
            // sets; the parts are then runs of single rows, which the
            // slice-views pass makes views.
            let y = self.fused_product(x, &format!("{prefix}.qkv_proj"), &parts, c, qkv_bias)?;
            let qk = self.b.slice(y, 2, 0, (hq + hkv) * d)?;
            let qk = self.b.reshape(qk, &[1, 1, hq + hkv, d])?;
            let qk = rotate(self, qk)?;
            let v = self.b.slice(y, 2, (hq + hkv) * d, (hq + 2 * hkv) * d)?;
            (self.b.slice(qk, 2, 0, hq)?, self.b.slice(qk, 2, hq, hq + hkv)?, self.b.reshape(v, &[1, 1, hkv, d])?)
        } else if self.fuse_projections
            && batch * seq > 1
            && n_rot > 0
            && hq == hkv
            && !qkv_bias
            && cfg.qk_norm.is_none()
        {
            // Several rows without grouped heads: q, k and v are a batch of
            // three products, blocks [3, B·T, H·D] (`part_batch`), so q and
            // k together are [2B, T, H, D], rotated in one launch (row b of
            // either at start[b] + t: the start positions given twice).
            let y = self.part_batch(x, &format!("{prefix}.qkv_proj"), &parts, c)?;
            let qk = self.b.slice(y, 0, 0, 2)?;
            let qk = self.b.reshape(qk, &[2 * batch, seq, hq, d])?;
            let qk = match start {
                Some(s) => {
                    let twice = self.doubled_start(s)?;
                    self.b.rope_at(qk, twice, n_rot, base, scaling.clone())?
                }
                None => self.b.rope(qk, n_rot, base, scaling.clone())?,
            };
            let v = self.b.slice(y, 0, 2, 3)?;
            let q = self.b.slice(qk, 0, 0, batch)?;
            let k = self.b.slice(qk, 0, batch, 2 * batch)?;
            (q, k, self.b.reshape(v, &[batch, seq, hkv, d])?)
        } else {
            let [mut q, mut k, v] = self.projections(x, &format!("{prefix}.qkv_proj"), &parts, c, qkv_bias)?[..] else {
                unreachable!("three parts give three projections")
            };
            if cfg.qk_norm == QkNorm::Whole {
                let wq = self.param(&format!("{prefix}.q_norm.weight"), &[hq * d])?;
                let wk = self.param(&format!("{prefix}.k_norm.weight"), &[hkv * d])?;
                q = self.rms_norm(q, wq)?;
                k = self.rms_norm(k, wk)?;
            }
            let mut q = self.b.reshape(q, &[batch, seq, hq, d])?;
            let mut k = self.b.reshape(k, &[batch, seq, hkv, d])?;
            let v = self.b.reshape(v, &[batch, seq, hkv, d])?;
            if cfg.qk_norm == QkNorm::PerHead {
                let wq = self.param(&format!("{prefix}.q_norm.weight"), &[d])?;
                let wk = self.param(&format!("{prefix}.k_norm.weight"), &[d])?;
                q = self.rms_norm(q, wq)?;
                k = self.rms_norm(k, wk)?;
            }
            if n_rot > 0 {
                q = rotate(self, q)?;
                k = rotate(self, k)?;
            }
            (q, k, v)
        };
        // litgpt and Hugging Face scale by the configured head size (Gemma
        // by its `query_pre_attn_scalar`). With a rotary dimension of 1
        // (head size 1, as in workload W2) both duplicate the rotated
        // component through a broadcast in their rope, which doubles every
        // score; `rope` computes one copy and the scale carries the factor 2
        // (see ops/rope.rs).
        let mut scale = cfg.attention_scale();
        if n_rot == 1 {
            scale *= 2.0;
        }
        let o = attend(self, layer, q, k, v, scale, cfg.scores(layer))?;
        let o = self.b.reshape(o, &[batch, seq, hq * d])?;
        self.linear(o, &format!("{prefix}.o_proj"), hq * d, c, cfg.bias)
    }

    /// The MLP of `x: [..., n_embd]`, in [`Gpt::mlp_tiles`] row tiles.
    pub(crate) fn mlp(&mut self, x: ValueId, prefix: &str) -> Result<ValueId> {
        let shape = self.b.shape(x).to_vec();
        let c = self.cfg.n_embd;
        let rows = shape.iter().product::<usize>() / c.max(1);
        // No tile is empty: at most one per row.
        let tiles = self.mlp_tiles.clamp(1, rows.max(1));
        if tiles == 1 {
            return self.mlp_rows(x, prefix);
        }
        let x2 = self.b.reshape(x, &[rows, c])?;
        let mut parts = Vec::with_capacity(tiles);
        for t in 0..tiles {
            // Tiles of rows/tiles rows; the first rows % tiles get one more.
            let (start, end) = (t * rows / tiles, (t + 1) * rows / tiles);
            let xt = self.b.slice(x2, 0, start, end)?;
            parts.push(self.mlp_rows(xt, prefix)?);
        }
        let y = self.b.concat(&parts, 0)?;
        self.b.reshape(y, &shape)
    }

    /// Layer `layer`'s feed-forward block on `x`: its experts on a sparse
    /// layer of a mixture-of-experts model, the MLP otherwise.
    fn feed_forward(&mut self, x: ValueId, layer: usize, prefix: &str) -> Result<ValueId> {
        match self.cfg.moe.as_ref().filter(|m| m.is_sparse(layer)) {
            Some(moe) => self.experts(x, prefix, moe),
            None => self.mlp(x, prefix),
        }
    }

    /// The mixture of experts on `x: [..., C]` ([`MoeConfig`]), dropless:
    /// the router's probabilities (softmax in f32, or f64 for an f64
    /// model), each token's `k` best experts and their weights; the
    /// `tokens × k` routed rows sorted by expert and gathered; each
    /// expert's SwiGLU MLP on its rows as grouped products; the outputs
    /// gathered back to their tokens and summed with the weights.
    /// Weights: `{prefix}.gate.weight` `[E, C]` (the router),
    /// `{prefix}.experts.{gate,up}_proj.weight` `[E, F, C]` and
    /// `{prefix}.experts.down_proj.weight` `[E, C, F]`; with a shared
    /// expert, `{prefix}.shared_expert.{gate,up,down}_proj.weight` and its
    /// gate `{prefix}.shared_expert_gate.weight` `[1, C]`.
    fn experts(&mut self, x: ValueId, prefix: &str, moe: &MoeConfig) -> Result<ValueId> {
        let shape = self.b.shape(x).to_vec();
        let c = self.cfg.n_embd;
        let tokens = shape.iter().product::<usize>() / c.max(1);
        let (e, k, f) = (moe.experts, moe.experts_per_token, moe.expert_intermediate_size);
        let x2 = self.b.reshape(x, &[tokens, c])?;
        let logits = self.linear(x2, &format!("{prefix}.gate"), c, e, false)?;
        let logits = self.b.cast(logits, stat_dtype(self.dtype))?;
        if moe.z_loss_coef.is_some() {
            self.router_scores.push(logits);
        }
        let probs = self.b.softmax(logits)?;
        let (weights, chosen) = self.b.top_k(probs, k)?;
        let weights = if moe.normalize_top_k {
            let total = self.b.sum(weights, &[1], true)?;
            self.b.div(weights, total)?
        } else {
            weights
        };
        let weights = self.b.cast(weights, self.dtype)?;
        let [rows, position, offsets, counts] = self.b.expert_sort(chosen, e)?;
        if moe.aux_loss_coef.is_some() {
            self.router_stats.push((probs, counts));
        }
        let routed = self.b.embedding(rows, x2)?;
        let w_gate = self.expert_weight(&format!("{prefix}.experts.gate_proj.weight"), &[e, f, c])?;
        let w_up = self.expert_weight(&format!("{prefix}.experts.up_proj.weight"), &[e, f, c])?;
        let w_down = self.expert_weight(&format!("{prefix}.experts.down_proj.weight"), &[e, c, f])?;
        let mut gate = self.b.grouped_matmul(routed, w_gate, offsets, false)?;
        let mut up = self.b.grouped_matmul(routed, w_up, offsets, false)?;
        let gate_up = format!("{prefix}.{}", LoraTarget::ExpertsGateUp.module());
        if let Some(low) = self.expert_adapter_input(routed, offsets, &gate_up, e, c)? {
            // One adapter over the pair, as `transformers` stores the pair
            // (`gate_up_proj`, gate rows first): its B's halves give each
            // product's share.
            let rank = self.b.shape(low)[1];
            let b = self.adapter_param(&format!("{gate_up}.lora_B.weight"), &[e, 2 * f, rank])?;
            for (half, y) in [&mut gate, &mut up].into_iter().enumerate() {
                let b_half = self.b.slice(b, 1, half * f, (half + 1) * f)?;
                let delta = self.b.grouped_matmul(low, b_half, offsets, false)?;
                *y = self.b.add(*y, delta)?;
            }
        }
        let h = self.b.swiglu(gate, up)?;
        let mut out = self.b.grouped_matmul(h, w_down, offsets, false)?;
        let down = format!("{prefix}.{}", LoraTarget::ExpertsDown.module());
        if let Some(low) = self.expert_adapter_input(h, offsets, &down, e, f)? {
            let rank = self.b.shape(low)[1];
            let b = self.adapter_param(&format!("{down}.lora_B.weight"), &[e, c, rank])?;
            let delta = self.b.grouped_matmul(low, b, offsets, false)?;
            out = self.b.add(out, delta)?;
        }
        // Back in (token, slot) order, weighted and summed over the slots.
        let slots = self.b.embedding(position, out)?;
        let slots = self.b.reshape(slots, &[tokens, k, c])?;
        let weights = self.b.reshape(weights, &[tokens, k, 1])?;
        let weighted = self.b.mul(slots, weights)?;
        let mut y = self.b.sum(weighted, &[1], false)?;
        if let Some(width) = moe.shared_expert {
            // Every token through the shared expert too, scaled by its gate.
            let gate_w = self.param(&format!("{prefix}.shared_expert_gate.weight"), &[1, c])?;
            let gate = self.b.linear(x2, gate_w, None)?;
            let gate = self.b.unary(UnaryFn::Sigmoid, gate)?;
            let shared = format!("{prefix}.shared_expert");
            let g = self.linear(x2, &format!("{shared}.gate_proj"), c, width, false)?;
            let u = self.linear(x2, &format!("{shared}.up_proj"), c, width, false)?;
            let h = self.b.swiglu(g, u)?;
            let out = self.linear(h, &format!("{shared}.down_proj"), width, c, false)?;
            let scaled = self.b.mul(out, gate)?;
            y = self.b.add(y, scaled)?;
        }
        self.b.reshape(y, &shape)
    }

    /// The routed experts' stacked weight `name` (`[E, out, in]`): as
    /// [`Gpt::param`] gives it, or for QLoRA stored as NF4 like the linear
    /// layers of the blocks.
    fn expert_weight(&mut self, name: &str, shape: &[usize]) -> Result<ValueId> {
        match self.adapters.as_ref().map(|a| a.base) {
            Some(BaseStorage::Nf4 { double_quant }) => self.nf4_weight(name, shape, double_quant),
            _ => self.param(name, shape),
        }
    }

    /// For the experts' product `layer` (`{prefix}.experts.gate_up_proj`)
    /// when it is adapted: its adapter's first half, `scale·(rows·A_eᵀ)`
    /// of the routed `rows: [R, inp]` with each row's expert's
    /// `A_e: [rank, inp]` (`{layer}.lora_A.weight`, `[E, rank, inp]`),
    /// giving `[R, rank]`; `None` when the product has no adapter. One
    /// adapter per expert, as `peft` gives a targeted expert parameter.
    fn expert_adapter_input(
        &mut self,
        rows: ValueId,
        offsets: ValueId,
        layer: &str,
        experts: usize,
        inp: usize,
    ) -> Result<Option<ValueId>> {
        let Some(a) = self.adapters.as_ref().filter(|a| a.adapts(layer)) else { return Ok(None) };
        let (rank, scale) = a.rank_and_scale(layer);
        self.check_parameter_dropout(layer)?;
        let a = self.adapter_param(&format!("{layer}.lora_A.weight"), &[experts, rank, inp])?;
        let low = self.b.grouped_matmul(rows, a, offsets, false)?;
        let s = self.b.full(scale, TensorType::scalar(self.dtype))?;
        Ok(Some(self.b.mul(low, s)?))
    }

    /// Refuses adapter dropout on the layer `layer` when `peft` reaches it
    /// as a parameter (the experts, the router): `peft` takes no dropout
    /// there, so an adapter trained with it could not be loaded.
    fn check_parameter_dropout(&self, layer: &str) -> Result<()> {
        let dropout = self.adapters.as_ref().map_or(0.0, |a| a.dropout);
        match LoraTarget::of_layer(layer).filter(|t| t.is_parameter()) {
            Some(t) if dropout > 0.0 => Err(Error::Config {
                model: self.cfg.name.clone(),
                reason: format!(
                    "adapters on `{}` (`{layer}`) take no dropout (--lora-dropout {dropout}), as peft's adapters \
                     on parameters (target_parameters) take none: use --lora-dropout 0, or leave the experts and \
                     the router out (--lora-targets q,k,v,o,gate,up,down)",
                    t.short()
                ),
            }),
            _ => Ok(()),
        }
    }

    /// The MLP of the rows `x` (all of them, or one tile).
    fn mlp_rows(&mut self, x: ValueId, prefix: &str) -> Result<ValueId> {
        let (c, i, bias) = (self.cfg.n_embd, self.cfg.intermediate_size, self.cfg.bias);
        // The first tile makes each projection right before its product (as
        // the untiled MLP always did); later tiles get the same leaves back
        // from `param`.
        let linear = |g: &mut Self, x: ValueId, name: &str, inp: usize, out: usize| {
            g.linear(x, &format!("{prefix}.{name}"), inp, out, bias)
        };
        match self.cfg.mlp {
            MlpKind::LlamaSwiGlu => {
                let parts = [(format!("{prefix}.gate_proj"), i), (format!("{prefix}.up_proj"), i)];
                let [gate, up] = self.projections(x, &format!("{prefix}.gate_up_proj"), &parts, c, bias)?[..] else {
                    unreachable!("two parts give two projections")
                };
                // One op, so backward keeps gate and up but not silu(gate).
                let h = self.b.swiglu(gate, up)?;
                linear(self, h, "down_proj", i, c)
            }
            MlpKind::GeGlu { approximate_tanh } => {
                let parts = [(format!("{prefix}.gate_proj"), i), (format!("{prefix}.up_proj"), i)];
                let [gate, up] = self.projections(x, &format!("{prefix}.gate_up_proj"), &parts, c, bias)?[..] else {
                    unreachable!("two parts give two projections")
                };
                // One op, so backward keeps gate and up but not gelu(gate).
                let f = if approximate_tanh { GateFn::GeluTanh } else { GateFn::GeluErf };
                let h = self.b.glu(f, gate, up)?;
                linear(self, h, "down_proj", i, c)
            }
            MlpKind::Gelu { approximate_tanh } => {
                let h = linear(self, x, "up_proj", c, i)?;
                let f = if approximate_tanh { UnaryFn::GeluTanh } else { UnaryFn::GeluErf };
                let h = self.b.unary(f, h)?;
                linear(self, h, "down_proj", i, c)
            }
        }
    }
}

/// How a cross-entropy loss records the LM head (a `sum(logits)` loss
/// always materialises the logits).
#[derive(Copy, Clone, PartialEq, Eq, Debug)]
pub enum HeadLoss {
    /// One `linear_cross_entropy` op over chunks of `chunk` vocabulary
    /// columns (`None`: [`default_chunk`]); a head with a bias falls back
    /// to [`HeadLoss::Materialised`].
    Fused { chunk: Option<usize> },
    /// The `[tokens, vocab]` logits, then `cross_entropy`: the reference
    /// the fused op is tested against.
    Materialised,
}

impl Default for HeadLoss {
    fn default() -> Self {
        HeadLoss::Fused { chunk: None }
    }
}

/// Name of the logits output of [`build_forward_with_logits`].
pub const LOGITS_OUTPUT: &str = "logits";

/// How the forward trace is recorded, beyond the model and its batch:
/// choices that change the ops, never the values they compute.
#[derive(Copy, Clone, PartialEq, Eq, Debug)]
pub struct ForwardOptions {
    /// How a cross-entropy loss records the LM head.
    pub head_loss: HeadLoss,
    /// Row tiles of every MLP (see the module doc): 1 records the plain
    /// MLP; more split its `batch × seq` rows into that many tiles (at
    /// most one per row).
    pub mlp_tiles: usize,
    /// The forward pass of a training step: adapter dropout is recorded
    /// (reading the step count, [`crate::autodiff::STEP_INPUT`], so each
    /// step draws its own masks). Evaluation and generation leave it out.
    pub training: bool,
    /// Mark the decoder layers' linear layers for FP8 products
    /// ([`crate::ops::matmul::MatMul::fp8`]; the router stays unmarked).
    /// The marks change no value; `passes::fp8` makes the FP8 products.
    pub fp8_products: bool,
}

impl Default for ForwardOptions {
    fn default() -> Self {
        ForwardOptions { head_loss: HeadLoss::default(), mlp_tiles: 1, training: false, fp8_products: false }
    }
}

/// Records the forward pass and loss of `spec` into a trace named `forward`,
/// a cross-entropy through the fused head ([`HeadLoss::default`]).
pub fn build_forward(spec: &ModelSpec) -> Result<Trace> {
    build_forward_opts(spec, &ForwardOptions::default())
}

/// [`build_forward`] with the head of a cross-entropy loss recorded as `head_loss` says.
pub fn build_forward_with(spec: &ModelSpec, head_loss: HeadLoss) -> Result<Trace> {
    build_forward_opts(spec, &ForwardOptions { head_loss, ..ForwardOptions::default() })
}

/// [`build_forward`] recorded as `opts` says.
pub fn build_forward_opts(spec: &ModelSpec, opts: &ForwardOptions) -> Result<Trace> {
    record_forward(spec, opts, false)
}

/// [`build_forward`] with the logits `[batch, seq, vocab]` as an extra
/// output named [`LOGITS_OUTPUT`], kept to be read after the step: for
/// checking a model against another implementation's logits. The logits
/// are materialised, so the loss is the unfused one. A training step built
/// from it drops the extra output (see `autodiff::build_step`).
pub fn build_forward_with_logits(spec: &ModelSpec) -> Result<Trace> {
    record_forward(spec, &ForwardOptions { head_loss: HeadLoss::Materialised, ..ForwardOptions::default() }, true)
}

fn record_forward(spec: &ModelSpec, opts: &ForwardOptions, logits_output: bool) -> Result<Trace> {
    spec.validate()?;
    let head_loss = opts.head_loss;
    if opts.mlp_tiles == 0 {
        return Err(Error::Config {
            model: spec.config.name.clone(),
            reason: "the MLP needs at least one row tile, got 0".into(),
        });
    }
    if let HeadLoss::Fused { chunk: Some(0) } = head_loss {
        return Err(Error::Config {
            model: spec.config.name.clone(),
            reason: "the loss chunk must be at least one vocabulary column, got 0".into(),
        });
    }
    let cfg = &spec.config;
    let (bsz, seq) = (spec.batch, spec.seq);
    let mut g = Gpt::new("forward", cfg, spec.dtype, opts.mlp_tiles);
    g.fp8_products = opts.fp8_products;
    if let Some(a) = &spec.adapters {
        a.validate()?;
        g.adapters = Some(a.clone());
        if opts.training && a.dropout > 0.0 {
            g.dropout_step = Some(g.b.input(STEP_INPUT, TensorType::scalar(DType::F32))?);
        }
    }
    let tokens = g.b.input(TOKENS_INPUT, TensorType::new(DType::I32, [bsz, seq]))?;
    let targets = match spec.loss {
        LossKind::CrossEntropy => Some(g.b.input(TARGETS_INPUT, TensorType::new(DType::I32, [bsz, seq]))?),
        LossKind::Sum => None,
    };
    let positions = match spec.documents {
        true => Some(g.b.input(POSITIONS_INPUT, TensorType::new(DType::I32, [bsz, seq]))?),
        false => None,
    };
    let wte = g.param("model.embed_tokens.weight", &[cfg.padded_vocab_size, cfg.n_embd])?;
    let x = g.b.embedding(tokens, wte)?;
    let x = g.scale_embedding(x)?;
    // Causal attention over the sequence itself (each document over itself).
    let x = g.layers(x, bsz, seq, positions, &mut |g, _, q, k, v, scale, scores| {
        g.b.attention_with(q, k, v, scale, scores, positions)
    })?;
    let x = g.norm(x, "model.norm")?;
    let head = if cfg.tie_embeddings { wte } else { g.param("lm_head.weight", &[cfg.padded_vocab_size, cfg.n_embd])? };
    let head_bias = if cfg.lm_head_bias { Some(g.param("lm_head.bias", &[cfg.padded_vocab_size])?) } else { None };
    // A soft-cap of the logits (Gemma 2) is the fused op's own; only a head
    // bias, which it has no form for, materialises the logits.
    let fused_chunk = match head_loss {
        HeadLoss::Fused { chunk } if head_bias.is_none() => Some(chunk),
        _ => None,
    };
    let loss = match (targets, fused_chunk) {
        (None, _) => {
            let logits = g.b.linear(x, head, head_bias)?;
            let logits = g.cap_logits(logits)?;
            if logits_output {
                g.b.output(OutputKind::Named(LOGITS_OUTPUT.into()), logits);
            }
            g.b.sum_all(logits)?
        }
        // The head (and its soft-cap) and the loss as one op: the
        // [tokens, vocab] logits are never held, only one chunk of
        // vocabulary columns at a time.
        (Some(t), Some(chunk)) => {
            let (rows, v) = (bsz * seq, cfg.padded_vocab_size);
            let x2 = g.b.reshape(x, &[rows, cfg.n_embd])?;
            let t2 = g.b.reshape(t, &[rows])?;
            let chunk = chunk.unwrap_or_else(|| default_chunk(rows, v, spec.dtype));
            let softcap = cfg.final_softcap.unwrap_or(0.0);
            let op = LinearCrossEntropy { chunk, reduction: Reduction::Mean, ignore_index: IGNORE_INDEX, softcap };
            g.b.linear_cross_entropy_with(op, x2, head, t2)?
        }
        // Asked for (the logits as an output among them), or a head bias
        // (which has no fused form).
        (Some(t), None) => {
            let logits = g.b.linear(x, head, head_bias)?;
            let logits = g.cap_logits(logits)?;
            if logits_output {
                g.b.output(OutputKind::Named(LOGITS_OUTPUT.into()), logits);
            }
            let v = cfg.padded_vocab_size;
            let l2 = g.b.reshape(logits, &[bsz * seq, v])?;
            let t2 = g.b.reshape(t, &[bsz * seq])?;
            g.b.cross_entropy(l2, t2, IGNORE_INDEX)?
        }
    };
    let loss = match (targets, cfg.moe.as_ref().and_then(|m| m.aux_loss_coef)) {
        (Some(_), Some(coef)) => {
            let aux = g.load_balancing_loss(bsz * seq)?;
            g.b.output(OutputKind::Named(ROUTER_AUX_LOSS_OUTPUT.into()), aux);
            let w = g.b.full(coef, g.b.ty(aux).clone())?;
            let weighted = g.b.mul(aux, w)?;
            let aux = g.b.cast(weighted, g.b.dtype(loss))?;
            g.b.add(loss, aux)?
        }
        _ => loss,
    };
    let loss = match (targets, cfg.moe.as_ref().and_then(|m| m.z_loss_coef)) {
        (Some(_), Some(coef)) => {
            let z = g.router_z_loss()?;
            g.b.output(OutputKind::Named(ROUTER_Z_LOSS_OUTPUT.into()), z);
            let w = g.b.full(coef, g.b.ty(z).clone())?;
            let weighted = g.b.mul(z, w)?;
            let z = g.b.cast(weighted, g.b.dtype(loss))?;
            g.b.add(loss, z)?
        }
        _ => loss,
    };
    if let Some(a) = &spec.adapters {
        g.check_adapted(a)?;
    }
    g.b.output(OutputKind::Loss, loss);
    g.b.finish("build")
}

impl Gpt<'_> {
    /// Refuses adapters that adapt nothing the user asked for: a target
    /// named in the list that no layer of this model has (the experts of a
    /// dense model, a gate projection of GPT-NeoX), or, for `all-linear`,
    /// a model with no layer to adapt at all.
    fn check_adapted(&self, a: &Adapters) -> Result<()> {
        let adapted: std::collections::BTreeSet<LoraTarget> = self
            .params
            .keys()
            .filter_map(|n| n.strip_suffix(".lora_A.weight"))
            .filter_map(LoraTarget::of_layer)
            .collect();
        let missing = if a.targets == LoraTarget::ALL {
            adapted.is_empty().then(|| "all-linear: no layer of the model takes an adapter".to_string())
        } else {
            a.targets.iter().find(|t| !adapted.contains(t)).map(|t| {
                format!(
                    "the adapter target `{}` matches no layer of the model{} (--lora-targets)",
                    t.short(),
                    if t.is_experts() { ": it has no routed experts" } else { "" }
                )
            })
        };
        match missing {
            Some(reason) => Err(Error::Config { model: self.cfg.name.clone(), reason }),
            None => Ok(()),
        }
    }

    /// The router z-loss of the sparse layers recorded so far: for each,
    /// the mean over its tokens of `logsumexp(scores)²` (the log-sum-exp
    /// taken stably, from the row's maximum), then the mean over layers.
    fn router_z_loss(&mut self) -> Result<ValueId> {
        let scores = std::mem::take(&mut self.router_scores);
        let mut total: Option<ValueId> = None;
        for &s in &scores {
            let top = self.b.reduce(ReduceKind::Max, s, &[1], true)?;
            let shifted = self.b.sub(s, top)?;
            let e = self.b.unary(UnaryFn::Exp, shifted)?;
            let sum = self.b.sum(e, &[1], true)?;
            let log = self.b.unary(UnaryFn::Log, sum)?;
            let lse = self.b.add(log, top)?;
            let sq = self.b.mul(lse, lse)?;
            let mean = self.b.reduce(ReduceKind::Mean, sq, &[0, 1], false)?;
            total = Some(match total {
                Some(t) => self.b.add(t, mean)?,
                None => mean,
            });
        }
        let Some(total) = total else {
            return Err(Error::Config {
                model: self.cfg.name.clone(),
                reason: "a router z-loss needs at least one sparse layer".into(),
            });
        };
        let layers = self.b.full(1.0 / scores.len() as f64, self.b.ty(total).clone())?;
        self.b.mul(total, layers)
    }

    /// The load-balancing loss of the sparse layers recorded so far over
    /// `tokens` tokens each, as `transformers`' `load_balancing_loss_func`
    /// computes it over the layers' routers together:
    /// `E · Σ_e f_e · P_e`, with `f_e` the routed (token, slot) pairs that
    /// went to expert `e` over all layers, divided by `layers · tokens`, and
    /// `P_e` expert `e`'s router probability summed over every layer's
    /// tokens, divided by the same. Only `P` carries a gradient.
    fn load_balancing_loss(&mut self, tokens: usize) -> Result<ValueId> {
        let stats = std::mem::take(&mut self.router_stats);
        let (mut counts, mut probs): (Option<ValueId>, Option<ValueId>) = (None, None);
        let acc = |b: &mut Builder, total: Option<ValueId>, x: ValueId| match total {
            Some(t) => b.add(t, x),
            None => Ok(x),
        };
        let experts = self.cfg.moe.as_ref().map_or(1, |m| m.experts);
        for &(p, c) in &stats {
            let p_sum = self.b.sum(p, &[0], false)?;
            let c = self.b.cast(c, self.b.dtype(p_sum))?;
            probs = Some(acc(&mut self.b, probs, p_sum)?);
            counts = Some(acc(&mut self.b, counts, c)?);
        }
        let (Some(counts), Some(probs)) = (counts, probs) else {
            return Err(Error::Config {
                model: self.cfg.name.clone(),
                reason: "a load-balancing loss needs at least one sparse layer".into(),
            });
        };
        let product = self.b.mul(counts, probs)?;
        let total = self.b.sum_all(product)?;
        let rows = (stats.len() * tokens) as f64;
        let scale = self.b.full(experts as f64 / (rows * rows), self.b.ty(total).clone())?;
        self.b.mul(total, scale)
    }
}
