//! Qwen3 (`Qwen3ForCausalLM`): the Llama layout with an RMSNorm over each
//! head of q and of k (`self_attn.q_norm`, `self_attn.k_norm`, weights of
//! the head's size) before RoPE, a `head_dim` of its own (128 when the file
//! does not say), and no biases.

use serde_json::json;

use super::llama::{self, Variant};
use super::{ConfigKeys, Family, Holds};
use crate::error::Result;
use crate::models::config::{Config, QkNorm};
use crate::models::hf::HfJson;

/// `model_type` `qwen3`.
pub struct Qwen3;

impl Family for Qwen3 {
    fn model_type(&self) -> &'static str {
        "qwen3"
    }

    fn architecture(&self) -> &'static str {
        "Qwen3ForCausalLM"
    }

    fn read_config(&self, hf: &HfJson) -> Result<Config> {
        llama::read_layout(hf, self.model_type(), |hf| {
            llama::refuse_attention_bias(hf, "qwen3")?;
            // Its window applies only when `use_sliding_window` says so.
            let sliding = hf.bool_opt("use_sliding_window")?.unwrap_or(false);
            Ok(Variant {
                bias: false,
                attn_qkv_bias: false,
                default_positions: 32768,
                sliding,
                default_head_dim: Some(128),
                qk_norm: QkNorm::PerHead,
                phi3_rope: false,
            })
        })
    }

    fn write_config(&self, config: &Config, keys: &mut ConfigKeys) {
        llama::write_layout(config, keys);
        keys.set("attention_bias", json!(false));
        keys.set("use_sliding_window", json!(false));
        llama::write_no_window(keys);
    }

    fn holds(&self, config: &Config) -> Holds {
        match llama::variant_layout_holds(config, QkNorm::PerHead, false) {
            Holds::Chosen if config.bias || config.attn_qkv_bias => {
                Holds::Not("Qwen3 has no biases on its linear layers".into())
            }
            holds => holds,
        }
    }

    #[cfg(test)]
    fn example(&self) -> Config {
        Config {
            qk_norm: QkNorm::PerHead,
            tie_embeddings: true,
            norm_eps: 1e-5,
            ..llama::example_layout("qwen3-example")
        }
    }
}
