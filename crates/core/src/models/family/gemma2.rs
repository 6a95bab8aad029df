//! Gemma 2 (`Gemma2ForCausalLM`), and the layout Gemma 3 shares with it:
//! RMSNorms whose weights are offsets from one (`x·(1 + w)`, computed in
//! f32), four of them per layer around the two sublayers
//! (`input_layernorm`, `post_attention_layernorm`,
//! `pre_feedforward_layernorm`, `post_feedforward_layernorm`), the GeGLU
//! MLP (`hidden_activation`, tanh GELU by default), embeddings scaled by
//! `√hidden_size`, attention scaled by `query_pre_attn_scalar^(-1/2)`,
//! sliding and global layers (`layer_types`, or `transformers`' default
//! pattern), attention and logit soft-caps, a head size of its own, the LM
//! head tied by default, and no biases. The tensor names are the trace's.
//!
//! A key that is absent takes the default of the `transformers` config
//! class; a soft-cap or the window set to `null` is off.

use serde_json::{json, Value};

use super::{ConfigKeys, Family, Holds};
use crate::error::Result;
use crate::models::config::{Config, MlpKind, NormKind, QkNorm, SlidingLayers};
use crate::models::hf::{HfJson, RopeDefaults};

/// `model_type` `gemma2`.
pub struct Gemma2;

/// What the Gemma families read differently from one another: the
/// defaults of their `transformers` config classes.
pub struct Defaults {
    /// `max_position_embeddings`.
    pub positions: usize,
    /// `attn_logit_softcapping`.
    pub attn_softcap: Option<f64>,
    /// `final_logit_softcapping`.
    pub final_softcap: Option<f64>,
    /// Every how many layers a global one comes when `layer_types` is absent.
    pub global_every: usize,
}

impl Family for Gemma2 {
    fn model_type(&self) -> &'static str {
        "gemma2"
    }

    fn architecture(&self) -> &'static str {
        "Gemma2ForCausalLM"
    }

    fn read_config(&self, hf: &HfJson) -> Result<Config> {
        let defaults =
            Defaults { positions: 8192, attn_softcap: Some(50.0), final_softcap: Some(30.0), global_every: 2 };
        let config = read_layout(hf, self.model_type(), &defaults)?;
        let (rope_base, fraction, rope_scaling) =
            hf.rope(&["rope_theta"], &[], 1.0, RopeDefaults::positions(defaults.positions))?;
        if fraction != 1.0 {
            return Err(hf.err(format!(
                "partial_rotary_factor {fraction} is not supported for model_type `gemma2`; Gemma 2 rotates whole heads"
            )));
        }
        Ok(Config { rope_base, rope_scaling, ..config })
    }

    fn write_config(&self, config: &Config, keys: &mut ConfigKeys) {
        write_layout(config, keys);
    }

    fn holds(&self, config: &Config) -> Holds {
        match layout_holds(config, QkNorm::None, "Gemma 2") {
            Holds::Chosen if config.rope_local_base.is_some() || config.rope_linear_factor.is_some() => {
                Holds::Not("Gemma 2 rotates every layer with one RoPE base and no linear scaling".into())
            }
            holds => holds,
        }
    }

    #[cfg(test)]
    fn example(&self) -> Config {
        example_layout("gemma2-example")
    }
}

/// Reads a Gemma-layout `config.json` of `model_type` (all but RoPE, which
/// differs between the families), with the class's `defaults`; the
/// sliding layers follow `layer_types`, or every
/// [`Defaults::global_every`]-th layer is global.
pub fn read_layout(hf: &HfJson, model_type: &str, defaults: &Defaults) -> Result<Config> {
    let n_embd = hf.usize_req("hidden_size")?;
    let n_head = hf.usize_req("num_attention_heads")?;
    let vocab_size = hf.usize_req("vocab_size")?;
    let n_layer = hf.usize_req("num_hidden_layers")?;
    // The MLP reads `hidden_activation`; `hidden_act`, which older files
    // carry beside it, is not read by the model.
    let approximate_tanh = match hf.str_opt("hidden_activation")?.unwrap_or("gelu_pytorch_tanh") {
        "gelu_pytorch_tanh" => true,
        "gelu" => false,
        other => {
            return Err(hf.err(format!(
                "hidden_activation `{other}` is not supported for model_type `{model_type}`; only \
                 `gelu_pytorch_tanh` and `gelu` are"
            )))
        }
    };
    for key in ["attention_bias", "use_bidirectional_attention"] {
        if hf.bool_opt(key)?.unwrap_or(false) {
            let what = match key {
                "attention_bias" => "biases on q, k, v and o_proj",
                _ => "every token attending to every other",
            };
            return Err(hf.err(format!("{key} true ({what}) is not supported for model_type `{model_type}`")));
        }
    }
    let sliding_window = hf.usize_or("sliding_window", Some(4096))?;
    if sliding_window == Some(0) {
        return Err(hf.err("sliding_window 0 leaves a query no key; use null for no window"));
    }
    let listed = match hf.strs_opt("layer_types")? {
        None => SlidingLayers::GlobalEvery(defaults.global_every),
        Some(types) => {
            if types.len() != n_layer {
                return Err(hf.err(format!(
                    "layer_types has {} entries for num_hidden_layers {n_layer}; it needs one per layer",
                    types.len()
                )));
            }
            let slides = types.iter().map(|t| match *t {
                "sliding_attention" => Ok(true),
                "full_attention" => Ok(false),
                other => Err(hf.err(format!(
                    "layer_types entry `{other}` is not supported for model_type `{model_type}`; only \
                     `sliding_attention` and `full_attention` are"
                ))),
            });
            SlidingLayers::Listed(slides.collect::<Result<Vec<_>>>()?)
        }
    };
    let cap = |key: &str, default: Option<f64>| -> Result<Option<f64>> {
        let value = hf.f64_or(key, default)?;
        match value {
            Some(v) if !(v.is_finite() && v > 0.0) => {
                Err(hf.err(format!("{key} {v} is not a positive number (null turns soft-capping off)")))
            }
            _ => Ok(value),
        }
    };
    Ok(Config {
        name: hf.model().to_string(),
        block_size: hf.usize_opt("max_position_embeddings")?.unwrap_or(defaults.positions),
        vocab_size,
        padded_vocab_size: vocab_size,
        n_layer,
        n_embd,
        n_head,
        n_query_groups: hf.usize_opt("num_key_value_heads")?.unwrap_or(4),
        head_size: hf.usize_opt("head_dim")?.unwrap_or(256),
        intermediate_size: hf.usize_req("intermediate_size")?,
        norm: NormKind::RmsNormUnitOffset,
        norm_eps: hf.f64_opt("rms_norm_eps")?.unwrap_or(1e-6),
        mlp: MlpKind::GeGlu { approximate_tanh },
        parallel_residual: false,
        shared_attention_norm: false,
        rotary_percentage: 1.0,
        rope_base: 10000.0,
        rope_scaling: None,
        bias: false,
        attn_qkv_bias: false,
        tie_embeddings: hf.bool_opt("tie_word_embeddings")?.unwrap_or(true),
        lm_head_bias: false,
        qk_norm: QkNorm::None,
        post_norms: false,
        sandwich_norms: true,
        scale_embeddings: true,
        attention_scalar: Some(hf.f64_opt("query_pre_attn_scalar")?.unwrap_or(256.0)),
        sliding_window,
        sliding_layers: listed.canonical(n_layer),
        attn_softcap: cap("attn_logit_softcapping", defaults.attn_softcap)?,
        final_softcap: cap("final_logit_softcapping", defaults.final_softcap)?,
        rope_local_base: None,
        rope_linear_factor: None,
        moe: None,
    })
}

/// A JSON number that is an integer when `x` is one: `transformers` 5
/// checks the types of integer keys (`query_pre_attn_scalar: int`).
pub fn number(x: f64) -> Value {
    if x.fract() == 0.0 && x.abs() < 9e15 {
        json!(x as i64)
    } else {
        json!(x)
    }
}

/// Writes the keys every Gemma-layout family has (RoPE aside).
pub fn write_layout(config: &Config, keys: &mut ConfigKeys) {
    let act = match config.mlp {
        MlpKind::GeGlu { approximate_tanh: false } => "gelu",
        _ => "gelu_pytorch_tanh",
    };
    keys.set("hidden_activation", json!(act));
    keys.set("hidden_act", json!(act));
    keys.set("rms_norm_eps", json!(config.norm_eps));
    keys.set("num_key_value_heads", json!(config.n_query_groups));
    keys.set("head_dim", json!(config.head_size));
    keys.set("query_pre_attn_scalar", number(config.attention_scalar.unwrap_or(config.head_size as f64)));
    keys.set("sliding_window", config.sliding_window.map_or(Value::Null, |w| json!(w)));
    let types: Vec<&str> = (0..config.n_layer)
        .map(|l| if config.sliding_layers.slides(l) { "sliding_attention" } else { "full_attention" })
        .collect();
    keys.set("layer_types", json!(types));
    let cap = |c: Option<f64>| c.map_or(Value::Null, |c| json!(c));
    keys.set("attn_logit_softcapping", cap(config.attn_softcap));
    keys.set("final_logit_softcapping", cap(config.final_softcap));
    keys.set("attention_bias", json!(false));
}

/// Whether the Gemma layout with the q/k norms `qk_norm` holds `config`,
/// before a family's own RoPE rules: [`Holds::Other`] for another kind of
/// network (its norms, MLP or q/k norms), [`Holds::Not`] naming `title` for
/// a Gemma-like config the class does not compute.
pub fn layout_holds(config: &Config, qk_norm: QkNorm, title: &str) -> Holds {
    let gemma = config.norm == NormKind::RmsNormUnitOffset && matches!(config.mlp, MlpKind::GeGlu { .. });
    if !gemma || config.qk_norm != qk_norm {
        return Holds::Other;
    }
    let not = |what: &str| Holds::Not(format!("{title} {what}"));
    if !config.sandwich_norms || config.post_norms || config.parallel_residual || config.shared_attention_norm {
        not("has a sequential residual with norms before and after each sublayer")
    } else if !config.scale_embeddings || config.attention_scalar.is_none() {
        not("scales its embeddings by √hidden_size and its attention by query_pre_attn_scalar")
    } else if config.bias || config.attn_qkv_bias || config.lm_head_bias {
        not("has no biases")
    } else if config.rotary_percentage != 1.0 {
        not("rotates whole heads")
    } else {
        Holds::Chosen
    }
}

/// A small Gemma-layout config with what a file carries set away from the
/// defaults: grouped heads wider than the width over the heads, a window
/// on every other layer, soft-caps, its own attention scale.
#[cfg(test)]
pub fn example_layout(name: &str) -> Config {
    Config {
        name: name.to_string(),
        block_size: 64,
        vocab_size: 96,
        padded_vocab_size: 96,
        n_layer: 3,
        n_embd: 32,
        n_head: 4,
        n_query_groups: 2,
        head_size: 16,
        intermediate_size: 48,
        norm: NormKind::RmsNormUnitOffset,
        norm_eps: 1e-5,
        mlp: MlpKind::GeGlu { approximate_tanh: true },
        parallel_residual: false,
        shared_attention_norm: false,
        rotary_percentage: 1.0,
        rope_base: 500000.0,
        rope_scaling: None,
        bias: false,
        attn_qkv_bias: false,
        tie_embeddings: false,
        lm_head_bias: false,
        qk_norm: QkNorm::None,
        post_norms: false,
        sandwich_norms: true,
        scale_embeddings: true,
        attention_scalar: Some(12.0),
        sliding_window: Some(6),
        sliding_layers: SlidingLayers::GlobalEvery(2),
        attn_softcap: Some(20.0),
        final_softcap: Some(15.0),
        rope_local_base: None,
        rope_linear_factor: None,
        moe: None,
    }
}
