//! Qwen2-MoE (`Qwen2MoeForCausalLM`: Qwen1.5-MoE, Qwen2-MoE): Qwen2's
//! attention (biases on q, k and v when `qkv_bias`, as by default) and on
//! the sparse layers a mixture of SwiGLU experts beside a shared expert:
//! the router `mlp.gate`, each expert's `mlp.experts.{e}.{gate,up,down}_proj`
//! stored as tensors of their own (stacked here into one parameter per
//! matrix), and `mlp.shared_expert` (of `shared_expert_intermediate_size`)
//! whose output every token takes, scaled by `sigmoid` of the one-row
//! `mlp.shared_expert_gate`. The dense layers (`mlp_only_layers`, or off the
//! `decoder_sparse_step`) keep the MLP of `intermediate_size`.

use serde_json::json;

use super::llama::{self, Variant};
use super::qwen3_moe::{read_qwen_moe, write_qwen_moe, QWEN_EXPERT_RULES};
use super::{ConfigKeys, Family, Holds, Rule};
use crate::error::Result;
use crate::models::config::{Config, MoeConfig, QkNorm};
use crate::models::hf::HfJson;

/// `model_type` `qwen2_moe`.
pub struct Qwen2Moe;

impl Family for Qwen2Moe {
    fn model_type(&self) -> &'static str {
        "qwen2_moe"
    }

    fn architecture(&self) -> &'static str {
        "Qwen2MoeForCausalLM"
    }

    fn read_config(&self, hf: &HfJson) -> Result<Config> {
        let config = llama::read_layout(hf, self.model_type(), |hf| {
            let sliding = hf.bool_opt("use_sliding_window")?.unwrap_or(false);
            Ok(Variant {
                bias: false,
                // transformers 4 always biases q, k and v; 5 says so in `qkv_bias`.
                attn_qkv_bias: hf.bool_opt("qkv_bias")?.unwrap_or(true),
                default_positions: 32768,
                sliding,
                default_head_dim: None,
                qk_norm: QkNorm::None,
                phi3_rope: false,
            })
        })?;
        let moe = MoeConfig {
            shared_expert: Some(hf.usize_opt("shared_expert_intermediate_size")?.unwrap_or(5632)),
            ..read_qwen_moe(hf, [60, 4, 1408])?
        };
        Ok(Config { moe: Some(moe), ..config })
    }

    fn write_config(&self, config: &Config, keys: &mut ConfigKeys) {
        llama::write_layout(config, keys);
        keys.set("qkv_bias", json!(config.attn_qkv_bias));
        keys.set("use_sliding_window", json!(false));
        llama::write_no_window(keys);
        if let Some(moe) = &config.moe {
            write_qwen_moe(moe, keys);
            keys.set("shared_expert_intermediate_size", json!(moe.shared_expert));
        }
    }

    /// Qwen2's attention (with or without the q/k/v biases) and experts
    /// beside a shared expert.
    fn holds(&self, config: &Config) -> Holds {
        let Some(moe) = &config.moe else { return Holds::Other };
        if moe.shared_expert.is_none() || !config.qk_norm.is_none() {
            return Holds::Other;
        }
        match llama::layout_holds(&Config { moe: None, ..config.clone() }) {
            Holds::Chosen if config.bias => Holds::Not("Qwen2-MoE biases q, k and v only".into()),
            holds => holds,
        }
    }

    fn rules(&self) -> &'static [Rule] {
        QWEN_EXPERT_RULES
    }

    #[cfg(test)]
    fn example(&self) -> Config {
        Config {
            attn_qkv_bias: true,
            norm_eps: 1e-5,
            moe: Some(MoeConfig {
                experts: 5,
                experts_per_token: 2,
                expert_intermediate_size: 16,
                normalize_top_k: true,
                sparse_step: 2,
                dense_layers: Vec::new(),
                aux_loss_coef: Some(0.01),
                shared_expert: Some(40),
                z_loss_coef: None,
            }),
            ..llama::example_layout("qwen2-moe-example")
        }
    }
}
