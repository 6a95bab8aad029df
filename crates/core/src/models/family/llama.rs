//! Llama (`LlamaForCausalLM`), and the Llama layout that Mistral, Qwen2 and
//! any later Llama-like family share: RMSNorm, the SwiGLU MLP, a sequential
//! residual, grouped-query attention, and the trace's own tensor names
//! (the builder names parameters after Llama's checkpoints).

use serde_json::{json, Value};

use super::{extra_feature, ConfigKeys, Family, Holds};
use crate::error::Result;
use crate::models::config::{llama_base, Config, MlpKind, NormKind, QkNorm};
use crate::models::hf::{HfJson, RopeDefaults};

/// `model_type` `llama`: Llama 1–3.x, TinyLlama, and the many models saved
/// as Llama.
pub struct Llama;

impl Family for Llama {
    fn model_type(&self) -> &'static str {
        "llama"
    }

    fn architecture(&self) -> &'static str {
        "LlamaForCausalLM"
    }

    fn read_config(&self, hf: &HfJson) -> Result<Config> {
        read_layout(hf, self.model_type(), |hf| {
            // In `transformers`, Llama's `attention_bias` covers q/k/v and the
            // output projection and `mlp_bias` the three MLP matrices; only
            // both together match this config's all-linear `bias`.
            let attention_bias = hf.bool_opt("attention_bias")?.unwrap_or(false);
            let mlp_bias = hf.bool_opt("mlp_bias")?.unwrap_or(false);
            let bias = match (attention_bias, mlp_bias) {
                (false, false) => false,
                (true, true) => true,
                (true, false) => {
                    return Err(hf.err(
                        "attention_bias true with mlp_bias false is not supported (it biases q/k/v and o_proj but not the MLP)",
                    ))
                }
                (false, true) => {
                    return Err(hf.err(
                        "mlp_bias true with attention_bias false is not supported (it biases the MLP but not attention)",
                    ))
                }
            };
            Ok(Variant {
                bias,
                attn_qkv_bias: false,
                default_positions: 2048,
                sliding: false,
                default_head_dim: None,
                qk_norm: QkNorm::None,
                phi3_rope: false,
            })
        })
    }

    fn write_config(&self, config: &Config, keys: &mut ConfigKeys) {
        write_layout(config, keys);
        keys.set("attention_bias", json!(config.bias));
        keys.set("mlp_bias", json!(config.bias));
    }

    fn holds(&self, config: &Config) -> Holds {
        match layout_holds(config) {
            Holds::Chosen if config.attn_qkv_bias && !config.bias => {
                Holds::Not("Llama biases every linear layer or none, not q/k/v alone".into())
            }
            holds => holds,
        }
    }

    #[cfg(test)]
    fn example(&self) -> Config {
        Config {
            bias: true,
            tie_embeddings: true,
            rope_scaling: Some(
                crate::ops::rope::Llama3Scaling {
                    factor: 8.0,
                    low_freq_factor: 1.0,
                    high_freq_factor: 4.0,
                    original_max_position_embeddings: 32,
                }
                .into(),
            ),
            ..example_layout("llama-example")
        }
    }
}

/// What the Llama-layout families read differently from one another.
pub struct Variant {
    /// Biases on every linear layer.
    pub bias: bool,
    /// Biases on q, k and v only.
    pub attn_qkv_bias: bool,
    /// `max_position_embeddings` when the file does not give it.
    pub default_positions: usize,
    /// Whether `sliding_window` applies (see [`HfJson::block_size`]).
    pub sliding: bool,
    /// `head_dim` when the file does not give it (`None`: the width over
    /// the heads).
    pub default_head_dim: Option<usize>,
    /// The norms on q and k ([`Config::qk_norm`]).
    pub qk_norm: QkNorm,
    /// Phi-3's reading of LongRoPE: the pre-training context defaults to
    /// 4096 at the top level, and the RoPE types `su` and `yarn` mean
    /// `longrope` ([`RopeDefaults`]).
    pub phi3_rope: bool,
}

/// Reads a Llama-layout `config.json` of `model_type`; `variant` reads the
/// family's own keys once the shared sizes and the activation are checked.
pub fn read_layout(hf: &HfJson, model_type: &str, variant: impl FnOnce(&HfJson) -> Result<Variant>) -> Result<Config> {
    let n_embd = hf.usize_req("hidden_size")?;
    let n_head = hf.usize_req("num_attention_heads")?;
    let vocab_size = hf.usize_req("vocab_size")?;
    let act = hf.str_opt("hidden_act")?.unwrap_or("silu");
    if act != "silu" {
        return Err(hf.err(format!(
            "hidden_act `{act}` is not supported for model_type `{model_type}`; only `silu` (the SwiGLU MLP) is"
        )));
    }
    let Variant { bias, attn_qkv_bias, default_positions, sliding, default_head_dim, qk_norm, phi3_rope } =
        variant(hf)?;
    let rope_defaults = RopeDefaults {
        positions: default_positions,
        original_positions: phi3_rope.then_some(4096),
        phi3_names: phi3_rope,
    };
    let (rope_base, rotary_percentage, rope_scaling) = hf.rope(&["rope_theta"], &[], 1.0, rope_defaults)?;
    let n_query_groups = hf.usize_opt("num_key_value_heads")?.unwrap_or(n_head);
    let head_size = match (hf.usize_opt("head_dim")?, default_head_dim) {
        (Some(head_dim), _) | (None, Some(head_dim)) => head_dim,
        (None, None) => hf.head_size(n_embd, n_head)?,
    };

    Ok(Config {
        name: hf.model().to_string(),
        block_size: hf.block_size(default_positions, sliding)?,
        vocab_size,
        padded_vocab_size: vocab_size,
        n_layer: hf.usize_req("num_hidden_layers")?,
        n_embd,
        n_head,
        n_query_groups,
        head_size,
        intermediate_size: hf.usize_req("intermediate_size")?,
        norm: NormKind::RmsNorm,
        norm_eps: hf.f64_opt("rms_norm_eps")?.unwrap_or(1e-6),
        mlp: MlpKind::LlamaSwiGlu,
        parallel_residual: false,
        shared_attention_norm: false,
        rotary_percentage,
        rope_base,
        rope_scaling,
        bias,
        attn_qkv_bias,
        tie_embeddings: hf.bool_opt("tie_word_embeddings")?.unwrap_or(false),
        lm_head_bias: false,
        qk_norm,
        // None of the other newer features: the families that have them
        // set them after this layout is read.
        ..llama_base("")
    })
}

/// Refuses `attention_bias: true` for the families (Qwen3, OLMo 2) whose
/// flag biases q, k, v and the output projection but not the MLP, which no
/// config here expresses.
pub fn refuse_attention_bias(hf: &HfJson, model_type: &str) -> Result<()> {
    if hf.bool_opt("attention_bias")?.unwrap_or(false) {
        return Err(hf.err(format!(
            "attention_bias true is not supported for model_type `{model_type}` (it biases q, k, v and o_proj but \
             not the MLP)"
        )));
    }
    Ok(())
}

/// Writes the keys every Llama-layout family has.
pub fn write_layout(config: &Config, keys: &mut ConfigKeys) {
    keys.set("hidden_act", json!("silu"));
    keys.set("rms_norm_eps", json!(config.norm_eps));
    keys.set("num_key_value_heads", json!(config.n_query_groups));
    keys.set("head_dim", json!(config.head_size));
}

/// Writes `sliding_window` as unset: a config these families hold has no
/// window, and one read from a file with a window is no longer than it
/// (see [`HfJson::block_size`]), where the window changes nothing.
pub fn write_no_window(keys: &mut ConfigKeys) {
    keys.set("sliding_window", Value::Null);
}

/// Whether the Llama layout holds `config`, before a family's own bias
/// rules: [`Holds::Chosen`] for any RMSNorm/SwiGLU config the layout
/// computes. A config with q/k norms or with norms after the sublayers is
/// another network (Qwen3's or OLMo 2's, which check the rest through
/// [`variant_layout_holds`]); the layout rotates whole heads (Phi-3, which
/// rotates part of each, checks the rest through [`partial_rope_layout_holds`]).
pub fn layout_holds(config: &Config) -> Holds {
    let plain = !config.qk_norm.is_none() || config.post_norms;
    if (config.norm, config.mlp) != (NormKind::RmsNorm, MlpKind::LlamaSwiGlu) || plain {
        return Holds::Other;
    }
    if let Some(feature) = extra_feature(config) {
        return Holds::Not(format!("this Llama-style family has no {feature}"));
    }
    if config.rotary_percentage != 1.0 {
        return Holds::Not("this Llama-style family's RoPE rotates whole heads".into());
    }
    if config.parallel_residual || config.lm_head_bias {
        return Holds::Not(
            "a Llama-style model with a parallel residual or an LM-head bias has no transformers class".into(),
        );
    }
    Holds::Chosen
}

/// [`layout_holds`] for the Llama layout with the q/k norms `qk_norm` and
/// norms after the sublayers when `post_norms`: [`Holds::Other`] for a
/// config without exactly those.
pub fn variant_layout_holds(config: &Config, qk_norm: QkNorm, post_norms: bool) -> Holds {
    if (config.qk_norm, config.post_norms) != (qk_norm, post_norms) {
        return Holds::Other;
    }
    layout_holds(&Config { qk_norm: QkNorm::None, post_norms: false, ..config.clone() })
}

/// [`layout_holds`] for a layout that may rotate part of each head.
pub fn partial_rope_layout_holds(config: &Config) -> Holds {
    layout_holds(&Config { rotary_percentage: 1.0, ..config.clone() })
}

/// A small Llama-layout config with the sizes a file carries set away from
/// their defaults: grouped-query attention, a head size other than
/// `n_embd / n_head`, a block shorter than any family's default.
#[cfg(test)]
pub fn example_layout(name: &str) -> Config {
    Config {
        name: name.to_string(),
        block_size: 64,
        vocab_size: 96,
        padded_vocab_size: 96,
        n_layer: 2,
        n_embd: 32,
        n_head: 4,
        n_query_groups: 2,
        head_size: 16,
        intermediate_size: 48,
        norm: NormKind::RmsNorm,
        norm_eps: 1e-5,
        mlp: MlpKind::LlamaSwiGlu,
        parallel_residual: false,
        shared_attention_norm: false,
        rotary_percentage: 1.0,
        rope_base: 500000.0,
        rope_scaling: None,
        bias: false,
        attn_qkv_bias: false,
        tie_embeddings: false,
        lm_head_bias: false,
        ..llama_base(name)
    }
}
