//! OLMo 2 (`Olmo2ForCausalLM`): the Llama layout with an RMSNorm over all
//! of q and over all of k (`self_attn.q_norm`, `self_attn.k_norm`, weights
//! of the projections' widths) before RoPE, and norms on the attention's
//! and the MLP's outputs (`post_attention_layernorm`,
//! `post_feedforward_layernorm`) instead of on their inputs; no biases.

use serde_json::json;

use super::llama::{self, Variant};
use super::{ConfigKeys, Family, Holds};
use crate::error::Result;
use crate::models::config::{Config, QkNorm};
use crate::models::hf::HfJson;

/// `model_type` `olmo2`.
pub struct Olmo2;

impl Family for Olmo2 {
    fn model_type(&self) -> &'static str {
        "olmo2"
    }

    fn architecture(&self) -> &'static str {
        "Olmo2ForCausalLM"
    }

    fn read_config(&self, hf: &HfJson) -> Result<Config> {
        let mut config = llama::read_layout(hf, self.model_type(), |hf| {
            llama::refuse_attention_bias(hf, "olmo2")?;
            Ok(Variant {
                bias: false,
                attn_qkv_bias: false,
                default_positions: 2048,
                sliding: false,
                default_head_dim: None,
                qk_norm: QkNorm::Whole,
                phi3_rope: false,
            })
        })?;
        // transformers' Olmo2Config defaults its norms' epsilon to 1e-5.
        if hf.f64_opt("rms_norm_eps")?.is_none() {
            config.norm_eps = 1e-5;
        }
        config.post_norms = true;
        Ok(config)
    }

    fn write_config(&self, config: &Config, keys: &mut ConfigKeys) {
        llama::write_layout(config, keys);
        keys.set("attention_bias", json!(false));
    }

    fn holds(&self, config: &Config) -> Holds {
        match llama::variant_layout_holds(config, QkNorm::Whole, true) {
            Holds::Chosen if config.bias || config.attn_qkv_bias => {
                Holds::Not("OLMo 2 has no biases on its linear layers".into())
            }
            Holds::Chosen if config.head_size * config.n_head != config.n_embd => {
                Holds::Not("OLMo 2's heads are the width over the heads wide".into())
            }
            holds => holds,
        }
    }

    #[cfg(test)]
    fn example(&self) -> Config {
        Config {
            qk_norm: QkNorm::Whole,
            post_norms: true,
            head_size: 8,
            norm_eps: 1e-6,
            ..llama::example_layout("olmo2-example")
        }
    }
}
