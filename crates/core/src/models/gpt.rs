//! The GPT-family model builder: records the forward pass and loss of a
//! [`Config`] on symbolic tensors into a [`Trace`], with litgpt's
//! architecture choices (RMSNorm or LayerNorm, SwiGLU or GELU MLP, parallel
//! or sequential residual, partial rotary, grouped-query attention, q/k/v
//! biases, tied or untied head).
//!
//! Parameters carry Hugging Face Llama-style names (`model.embed_tokens.weight`,
//! `model.layers.0.self_attn.q_proj.weight`, `lm_head.weight`, ...) so
//! checkpoints map onto them by name; a GELU MLP uses `mlp.up_proj` and
//! `mlp.down_proj`. Activations stay in the `[batch, tokens, heads, head]`
//! layout that comes out of the projections: no permutes anywhere.

use super::config::{Config, MlpKind, NormKind};
use crate::error::{Error, Result};
use crate::ir::{Builder, DType, OutputKind, TensorType, Trace, ValueId};
use crate::ops::linear_ce::{default_chunk, Reduction};
use crate::ops::UnaryFn;

/// The loss the forward trace ends with.
#[derive(Copy, Clone, PartialEq, Eq, Debug)]
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

/// One forward workload: a model and the shape of its batch.
#[derive(Clone, Debug)]
pub struct ModelSpec {
    pub config: Config,
    pub batch: usize,
    pub seq: usize,
    pub dtype: DType,
    pub loss: LossKind,
}

impl ModelSpec {
    /// The named model (litgpt or Hugging Face name, see [`Config::named`])
    /// on batches of `batch` × `seq` tokens.
    pub fn named(name: &str, batch: usize, seq: usize, dtype: DType, loss: LossKind) -> Result<Self> {
        Ok(ModelSpec { config: Config::named(name)?, batch, seq, dtype, loss })
    }

    fn check(&self) -> Result<()> {
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
        Ok(())
    }
}

struct Gpt<'a> {
    b: Builder,
    cfg: &'a Config,
    dtype: DType,
}

impl Gpt<'_> {
    fn param(&mut self, name: &str, shape: &[usize]) -> Result<ValueId> {
        self.b.param(name, TensorType::new(self.dtype, shape))
    }

    fn linear_params(
        &mut self,
        prefix: &str,
        inp: usize,
        out: usize,
        bias: bool,
    ) -> Result<(ValueId, Option<ValueId>)> {
        let w = self.param(&format!("{prefix}.weight"), &[out, inp])?;
        let bias = if bias { Some(self.param(&format!("{prefix}.bias"), &[out])?) } else { None };
        Ok((w, bias))
    }

    fn linear(&mut self, x: ValueId, prefix: &str, inp: usize, out: usize, bias: bool) -> Result<ValueId> {
        let (w, bias) = self.linear_params(prefix, inp, out, bias)?;
        self.b.linear(x, w, bias)
    }

    fn norm(&mut self, x: ValueId, prefix: &str) -> Result<ValueId> {
        let c = self.cfg.n_embd;
        let w = self.param(&format!("{prefix}.weight"), &[c])?;
        match self.cfg.norm {
            NormKind::RmsNorm => self.b.rms_norm(x, w, self.cfg.norm_eps),
            NormKind::LayerNorm => {
                let bias = self.param(&format!("{prefix}.bias"), &[c])?;
                self.b.layer_norm(x, w, bias, self.cfg.norm_eps)
            }
        }
    }

    fn attention(&mut self, x: ValueId, prefix: &str, batch: usize, seq: usize) -> Result<ValueId> {
        let cfg = self.cfg;
        let (hq, hkv, d, c) = (cfg.n_head, cfg.n_query_groups, cfg.head_size, cfg.n_embd);
        let qkv_bias = cfg.bias || cfg.attn_qkv_bias;
        let q = self.linear(x, &format!("{prefix}.q_proj"), c, hq * d, qkv_bias)?;
        let k = self.linear(x, &format!("{prefix}.k_proj"), c, hkv * d, qkv_bias)?;
        let v = self.linear(x, &format!("{prefix}.v_proj"), c, hkv * d, qkv_bias)?;
        let mut q = self.b.reshape(q, &[batch, seq, hq, d])?;
        let mut k = self.b.reshape(k, &[batch, seq, hkv, d])?;
        let v = self.b.reshape(v, &[batch, seq, hkv, d])?;
        let n_rot = cfg.n_rot();
        if n_rot > 0 {
            q = self.b.rope(q, n_rot, cfg.rope_base, cfg.rope_scaling)?;
            k = self.b.rope(k, n_rot, cfg.rope_base, cfg.rope_scaling)?;
        }
        // litgpt and Hugging Face scale by the configured head size. With a
        // rotary dimension of 1 (head size 1, as in workload W2) both
        // duplicate the rotated component through a broadcast in their rope,
        // which doubles every score; `rope` computes one copy and the scale
        // carries the factor 2 (see ops/rope.rs).
        let mut scale = 1.0 / (d as f64).sqrt();
        if n_rot == 1 {
            scale *= 2.0;
        }
        let o = self.b.attention(q, k, v, scale)?;
        let o = self.b.reshape(o, &[batch, seq, hq * d])?;
        self.linear(o, &format!("{prefix}.o_proj"), hq * d, c, cfg.bias)
    }

    fn mlp(&mut self, x: ValueId, prefix: &str) -> Result<ValueId> {
        let (c, i, bias) = (self.cfg.n_embd, self.cfg.intermediate_size, self.cfg.bias);
        match self.cfg.mlp {
            MlpKind::LlamaSwiGlu => {
                let gate = self.linear(x, &format!("{prefix}.gate_proj"), c, i, bias)?;
                let up = self.linear(x, &format!("{prefix}.up_proj"), c, i, bias)?;
                // One op, so backward keeps gate and up but not silu(gate).
                let h = self.b.swiglu(gate, up)?;
                self.linear(h, &format!("{prefix}.down_proj"), i, c, bias)
            }
            MlpKind::Gelu { approximate_tanh } => {
                let h = self.linear(x, &format!("{prefix}.up_proj"), c, i, bias)?;
                let f = if approximate_tanh { UnaryFn::GeluTanh } else { UnaryFn::GeluErf };
                let h = self.b.unary(f, h)?;
                self.linear(h, &format!("{prefix}.down_proj"), i, c, bias)
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

/// Records the forward pass and loss of `spec` into a trace named `forward`,
/// a cross-entropy through the fused head ([`HeadLoss::default`]).
pub fn build_forward(spec: &ModelSpec) -> Result<Trace> {
    build_forward_with(spec, HeadLoss::default())
}

/// [`build_forward`] with the head of a cross-entropy loss recorded as `head_loss` says.
pub fn build_forward_with(spec: &ModelSpec, head_loss: HeadLoss) -> Result<Trace> {
    record_forward(spec, head_loss, false)
}

/// [`build_forward`] with the logits `[batch, seq, vocab]` as an extra
/// output named [`LOGITS_OUTPUT`], kept to be read after the step: for
/// checking a model against another implementation's logits. The logits
/// are materialised, so the loss is the unfused one. A training step built
/// from it drops the extra output (see `autodiff::build_step`).
pub fn build_forward_with_logits(spec: &ModelSpec) -> Result<Trace> {
    record_forward(spec, HeadLoss::Materialised, true)
}

fn record_forward(spec: &ModelSpec, head_loss: HeadLoss, logits_output: bool) -> Result<Trace> {
    spec.check()?;
    if let HeadLoss::Fused { chunk: Some(0) } = head_loss {
        return Err(Error::Config {
            model: spec.config.name.clone(),
            reason: "the loss chunk must be at least one vocabulary column, got 0".into(),
        });
    }
    let cfg = &spec.config;
    let (bsz, seq) = (spec.batch, spec.seq);
    let mut g = Gpt { b: Builder::new("forward"), cfg, dtype: spec.dtype };
    let tokens = g.b.input(TOKENS_INPUT, TensorType::new(DType::I32, [bsz, seq]))?;
    let targets = match spec.loss {
        LossKind::CrossEntropy => Some(g.b.input(TARGETS_INPUT, TensorType::new(DType::I32, [bsz, seq]))?),
        LossKind::Sum => None,
    };
    let wte = g.param("model.embed_tokens.weight", &[cfg.padded_vocab_size, cfg.n_embd])?;
    let mut x = g.b.embedding(tokens, wte)?;
    for layer in 0..cfg.n_layer {
        let p = format!("model.layers.{layer}");
        let h = g.norm(x, &format!("{p}.input_layernorm"))?;
        let a = g.attention(h, &format!("{p}.self_attn"), bsz, seq)?;
        if cfg.parallel_residual {
            let h2 = if cfg.shared_attention_norm { h } else { g.norm(x, &format!("{p}.post_attention_layernorm"))? };
            let m = g.mlp(h2, &format!("{p}.mlp"))?;
            let am = g.b.add(a, m)?;
            x = g.b.add(am, x)?;
        } else {
            x = g.b.add(a, x)?;
            let h2 = g.norm(x, &format!("{p}.post_attention_layernorm"))?;
            let m = g.mlp(h2, &format!("{p}.mlp"))?;
            x = g.b.add(m, x)?;
        }
    }
    let x = g.norm(x, "model.norm")?;
    let head = if cfg.tie_embeddings { wte } else { g.param("lm_head.weight", &[cfg.padded_vocab_size, cfg.n_embd])? };
    let head_bias = if cfg.lm_head_bias { Some(g.param("lm_head.bias", &[cfg.padded_vocab_size])?) } else { None };
    let fused_chunk = match head_loss {
        HeadLoss::Fused { chunk } if head_bias.is_none() => Some(chunk),
        _ => None,
    };
    let loss = match (targets, fused_chunk) {
        (None, _) => {
            let logits = g.b.linear(x, head, head_bias)?;
            if logits_output {
                g.b.output(OutputKind::Named(LOGITS_OUTPUT.into()), logits);
            }
            g.b.sum_all(logits)?
        }
        // The head and the loss as one op: the [tokens, vocab] logits are
        // never held, only one chunk of vocabulary columns at a time.
        (Some(t), Some(chunk)) => {
            let (rows, v) = (bsz * seq, cfg.padded_vocab_size);
            let x2 = g.b.reshape(x, &[rows, cfg.n_embd])?;
            let t2 = g.b.reshape(t, &[rows])?;
            let chunk = chunk.unwrap_or_else(|| default_chunk(rows, v, spec.dtype));
            g.b.linear_cross_entropy(x2, head, t2, chunk, Reduction::Mean, IGNORE_INDEX)?
        }
        // Asked for, or a head bias (which has no fused form).
        (Some(t), None) => {
            let logits = g.b.linear(x, head, head_bias)?;
            if logits_output {
                g.b.output(OutputKind::Named(LOGITS_OUTPUT.into()), logits);
            }
            let v = cfg.padded_vocab_size;
            let l2 = g.b.reshape(logits, &[bsz * seq, v])?;
            let t2 = g.b.reshape(t, &[bsz * seq])?;
            g.b.cross_entropy(l2, t2, IGNORE_INDEX)?
        }
    };
    g.b.output(OutputKind::Loss, loss);
    g.b.finish("build")
}
