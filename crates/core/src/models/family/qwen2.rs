//! Qwen2 (`Qwen2ForCausalLM`, Qwen2 and Qwen2.5): the Llama layout with
//! biases on q, k and v and on no other linear layer.

use serde_json::json;

use super::llama::{self, Variant};
use super::{ConfigKeys, Family, Holds};
use crate::error::Result;
use crate::models::config::{Config, QkNorm};
use crate::models::hf::HfJson;

/// `model_type` `qwen2`.
pub struct Qwen2;

impl Family for Qwen2 {
    fn model_type(&self) -> &'static str {
        "qwen2"
    }

    fn architecture(&self) -> &'static str {
        "Qwen2ForCausalLM"
    }

    fn read_config(&self, hf: &HfJson) -> Result<Config> {
        llama::read_layout(hf, self.model_type(), |hf| {
            // Qwen2 always has q/k/v biases and no others; its window
            // applies only when `use_sliding_window` says so.
            let sliding = hf.bool_opt("use_sliding_window")?.unwrap_or(false);
            Ok(Variant {
                bias: false,
                attn_qkv_bias: true,
                default_positions: 32768,
                sliding,
                default_head_dim: None,
                qk_norm: QkNorm::None,
                phi3_rope: false,
            })
        })
    }

    fn write_config(&self, config: &Config, keys: &mut ConfigKeys) {
        llama::write_layout(config, keys);
        keys.set("use_sliding_window", json!(false));
        llama::write_no_window(keys);
    }

    fn holds(&self, config: &Config) -> Holds {
        match llama::layout_holds(config) {
            Holds::Chosen if !config.attn_qkv_bias || config.bias => {
                Holds::Not("Qwen2 has biases on q, k and v and on no other linear layer".into())
            }
            holds => holds,
        }
    }

    #[cfg(test)]
    fn example(&self) -> Config {
        Config { attn_qkv_bias: true, tie_embeddings: true, norm_eps: 1e-5, ..llama::example_layout("qwen2-example") }
    }
}
