//! GPT-NeoX (`GPTNeoXForCausalLM`, Pythia): LayerNorm, the GELU MLP, biases
//! on every linear layer, a parallel residual by default, RoPE on part of
//! each head, and its own tensor names, with q, k and v fused per head into
//! `attention.query_key_value`.

use serde_json::json;

use super::{extra_feature, ConfigKeys, Family, Holds, Join, Rule, Unlisted};
use crate::error::Result;
use crate::models::config::{llama_base, Config, MlpKind, NormKind};
use crate::models::hf::{HfJson, RopeDefaults};

/// `model_type` `gpt_neox`.
pub struct GptNeox;

/// GPT-NeoX's tensors against the trace's names.
const RULES: &[Rule] = &[
    Rule::same("gpt_neox.embed_in.weight", &["model.embed_tokens.weight"]),
    Rule::same("gpt_neox.layers.{i}.input_layernorm.weight", &["model.layers.{i}.input_layernorm.weight"]),
    Rule::same("gpt_neox.layers.{i}.input_layernorm.bias", &["model.layers.{i}.input_layernorm.bias"]),
    Rule::same(
        "gpt_neox.layers.{i}.post_attention_layernorm.weight",
        &["model.layers.{i}.post_attention_layernorm.weight"],
    ),
    Rule::same(
        "gpt_neox.layers.{i}.post_attention_layernorm.bias",
        &["model.layers.{i}.post_attention_layernorm.bias"],
    ),
    Rule {
        hf: "gpt_neox.layers.{i}.attention.query_key_value.weight",
        trace: &[
            "model.layers.{i}.self_attn.q_proj.weight",
            "model.layers.{i}.self_attn.k_proj.weight",
            "model.layers.{i}.self_attn.v_proj.weight",
        ],
        join: Join::PerHead,
    },
    Rule {
        hf: "gpt_neox.layers.{i}.attention.query_key_value.bias",
        trace: &[
            "model.layers.{i}.self_attn.q_proj.bias",
            "model.layers.{i}.self_attn.k_proj.bias",
            "model.layers.{i}.self_attn.v_proj.bias",
        ],
        join: Join::PerHead,
    },
    Rule::same("gpt_neox.layers.{i}.attention.dense.weight", &["model.layers.{i}.self_attn.o_proj.weight"]),
    Rule::same("gpt_neox.layers.{i}.attention.dense.bias", &["model.layers.{i}.self_attn.o_proj.bias"]),
    Rule::same("gpt_neox.layers.{i}.mlp.dense_h_to_4h.weight", &["model.layers.{i}.mlp.up_proj.weight"]),
    Rule::same("gpt_neox.layers.{i}.mlp.dense_h_to_4h.bias", &["model.layers.{i}.mlp.up_proj.bias"]),
    Rule::same("gpt_neox.layers.{i}.mlp.dense_4h_to_h.weight", &["model.layers.{i}.mlp.down_proj.weight"]),
    Rule::same("gpt_neox.layers.{i}.mlp.dense_4h_to_h.bias", &["model.layers.{i}.mlp.down_proj.bias"]),
    Rule::same("gpt_neox.final_layer_norm.weight", &["model.norm.weight"]),
    Rule::same("gpt_neox.final_layer_norm.bias", &["model.norm.bias"]),
    Rule::same("embed_out.weight", &["lm_head.weight"]),
];

impl Family for GptNeox {
    fn model_type(&self) -> &'static str {
        "gpt_neox"
    }

    fn architecture(&self) -> &'static str {
        "GPTNeoXForCausalLM"
    }

    fn read_config(&self, hf: &HfJson) -> Result<Config> {
        let n_embd = hf.usize_req("hidden_size")?;
        let n_head = hf.usize_req("num_attention_heads")?;
        let vocab_size = hf.usize_req("vocab_size")?;
        let approximate_tanh = match hf.str_opt("hidden_act")?.unwrap_or("gelu") {
            "gelu" => false,
            "gelu_new" | "gelu_pytorch_tanh" => true,
            other => {
                return Err(hf.err(format!(
                    "hidden_act `{other}` is not supported for model_type `gpt_neox`; only `gelu`, `gelu_new` and `gelu_pytorch_tanh` are"
                )))
            }
        };
        if !hf.bool_opt("attention_bias")?.unwrap_or(true) {
            return Err(hf.err(
                "attention_bias false is not supported for gpt_neox (its MLP keeps biases, and this config biases all linears or none)",
            ));
        }
        // Older configs say `rotary_emb_base`/`rotary_pct`, newer ones
        // `rope_theta`/`partial_rotary_factor`.
        let (rope_base, rotary_percentage, rope_scaling) = hf.rope(
            &["rope_theta", "rotary_emb_base"],
            &["partial_rotary_factor", "rotary_pct"],
            0.25,
            RopeDefaults::positions(2048),
        )?;

        Ok(Config {
            name: hf.model().to_string(),
            block_size: hf.block_size(2048, false)?,
            vocab_size,
            padded_vocab_size: vocab_size,
            n_layer: hf.usize_req("num_hidden_layers")?,
            n_embd,
            n_head,
            // GPT-NeoX has no grouped-query attention.
            n_query_groups: n_head,
            head_size: hf.head_size(n_embd, n_head)?,
            intermediate_size: hf.usize_req("intermediate_size")?,
            norm: NormKind::LayerNorm,
            norm_eps: hf.f64_opt("layer_norm_eps")?.unwrap_or(1e-5),
            mlp: MlpKind::Gelu { approximate_tanh },
            parallel_residual: hf.bool_opt("use_parallel_residual")?.unwrap_or(true),
            shared_attention_norm: false,
            rotary_percentage,
            rope_base,
            rope_scaling,
            bias: true,
            attn_qkv_bias: false,
            tie_embeddings: hf.bool_opt("tie_word_embeddings")?.unwrap_or(false),
            lm_head_bias: false,
            // None of the newer families' features.
            ..llama_base("")
        })
    }

    fn write_config(&self, config: &Config, keys: &mut ConfigKeys) {
        let act = match config.mlp {
            MlpKind::Gelu { approximate_tanh: true } => "gelu_pytorch_tanh",
            _ => "gelu",
        };
        keys.set("hidden_act", json!(act));
        keys.set("layer_norm_eps", json!(config.norm_eps));
        keys.set("use_parallel_residual", json!(config.parallel_residual));
        keys.set("rotary_emb_base", json!(config.rope_base));
        keys.set("rotary_pct", json!(config.rotary_percentage));
        keys.set("partial_rotary_factor", json!(config.rotary_percentage));
        keys.set("attention_bias", json!(true));
        keys.set_rope("partial_rotary_factor", json!(config.rotary_percentage));
    }

    fn holds(&self, config: &Config) -> Holds {
        if !(config.norm == NormKind::LayerNorm && matches!(config.mlp, MlpKind::Gelu { .. })) {
            return Holds::Other;
        }
        if let Some(feature) = extra_feature(config) {
            return Holds::Not(format!("GPT-NeoX has no {feature}"));
        }
        if !config.qk_norm.is_none() || config.post_norms {
            return Holds::Not("GPT-NeoX has neither q/k norms nor norms after the sublayers".into());
        }
        if !config.bias || config.lm_head_bias || config.shared_attention_norm {
            Holds::Not(
                "a GPT-NeoX model needs biases on every linear layer, none on the LM head, and two norms per layer"
                    .into(),
            )
        } else if config.n_query_groups != config.n_head || config.head_size * config.n_head != config.n_embd {
            Holds::Not(format!(
                "GPT-NeoX has neither grouped-query attention nor a head size other than n_embd / n_head \
                 (n_head {}, n_query_groups {}, head_size {}, n_embd {})",
                config.n_head, config.n_query_groups, config.head_size, config.n_embd
            ))
        } else {
            Holds::Chosen
        }
    }

    fn rules(&self) -> &'static [Rule] {
        RULES
    }

    fn unlisted(&self) -> Unlisted {
        Unlisted::Refused { title: "GPT-NeoX" }
    }

    fn ignored_suffixes(&self) -> &'static [&'static str] {
        // Old GPT-NeoX checkpoints (Pythia) carry the causal mask and its fill value.
        &[".rotary_emb.inv_freq", ".attention.bias", ".attention.masked_bias"]
    }

    #[cfg(test)]
    fn example(&self) -> Config {
        Config {
            name: "gpt-neox-example".into(),
            block_size: 64,
            vocab_size: 96,
            padded_vocab_size: 96,
            n_layer: 2,
            n_embd: 32,
            n_head: 4,
            n_query_groups: 4,
            head_size: 8,
            intermediate_size: 80,
            norm: NormKind::LayerNorm,
            norm_eps: 1e-6,
            mlp: MlpKind::Gelu { approximate_tanh: true },
            parallel_residual: false,
            shared_attention_norm: false,
            rotary_percentage: 0.5,
            rope_base: 20000.0,
            rope_scaling: None,
            bias: true,
            attn_qkv_bias: false,
            tie_embeddings: true,
            lm_head_bias: false,
            // None of the newer families' features.
            ..llama_base("")
        }
    }
}
