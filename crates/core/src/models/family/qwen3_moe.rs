//! Qwen3-MoE (`Qwen3MoeForCausalLM`): Qwen3's attention (an RMSNorm over
//! each head of q and of k) and a mixture of SwiGLU experts on the sparse
//! layers (every `decoder_sparse_step`-th, except `mlp_only_layers`, which
//! keep the dense MLP of `intermediate_size`): the router `mlp.gate`, and
//! each expert's `mlp.experts.{e}.{gate,up,down}_proj` stored as tensors of
//! their own, stacked here into one parameter per matrix. Each token takes
//! its `num_experts_per_tok` best experts, their probabilities renormalised
//! when `norm_topk_prob`.

use serde_json::json;

use super::llama::{self, Variant};
use super::mixtral::{router_training_terms, write_router_keys};
use super::{ConfigKeys, Family, Holds, Join, Rule};
use crate::error::Result;
use crate::models::config::{Config, MoeConfig, QkNorm};
use crate::models::hf::HfJson;

/// `model_type` `qwen3_moe`.
pub struct Qwen3Moe;

/// The experts of Qwen's mixtures (Qwen2-MoE's and Qwen3-MoE's), one
/// tensor per expert; the router, a shared expert and the dense layers'
/// MLPs have the trace's names.
pub(super) const QWEN_EXPERT_RULES: &[Rule] = &[
    Rule {
        hf: "model.layers.{i}.mlp.experts.{e}.gate_proj.weight",
        trace: &["model.layers.{i}.mlp.experts.gate_proj.weight"],
        join: Join::Experts,
    },
    Rule {
        hf: "model.layers.{i}.mlp.experts.{e}.up_proj.weight",
        trace: &["model.layers.{i}.mlp.experts.up_proj.weight"],
        join: Join::Experts,
    },
    Rule {
        hf: "model.layers.{i}.mlp.experts.{e}.down_proj.weight",
        trace: &["model.layers.{i}.mlp.experts.down_proj.weight"],
        join: Join::Experts,
    },
];

/// The routing keys Qwen's mixtures of experts share (Qwen2-MoE and
/// Qwen3-MoE), with the family's defaults `[experts, per token, width]`
/// for absent ones; no shared expert (Qwen2-MoE sets its own).
pub(super) fn read_qwen_moe(hf: &HfJson, [experts, per_token, width]: [usize; 3]) -> Result<MoeConfig> {
    // transformers 5 writes `num_local_experts` (reading `num_experts` as
    // another name for it); released folders give `num_experts`.
    let experts = match (hf.usize_opt("num_experts")?, hf.usize_opt("num_local_experts")?) {
        (Some(a), Some(b)) if a != b => {
            return Err(hf.err(format!("num_experts {a} and num_local_experts {b} disagree")));
        }
        (Some(n), _) | (None, Some(n)) => n,
        (None, None) => experts,
    };
    Ok(MoeConfig {
        experts,
        experts_per_token: hf.usize_opt("num_experts_per_tok")?.unwrap_or(per_token),
        expert_intermediate_size: hf.usize_opt("moe_intermediate_size")?.unwrap_or(width),
        normalize_top_k: hf.bool_opt("norm_topk_prob")?.unwrap_or(false),
        sparse_step: hf.usize_opt("decoder_sparse_step")?.unwrap_or(1),
        dense_layers: read_dense_layers(hf)?,
        aux_loss_coef: router_training_terms(hf)?,
        shared_expert: None,
        z_loss_coef: None,
    })
}

/// Writes the keys [`read_qwen_moe`] reads.
pub(super) fn write_qwen_moe(moe: &MoeConfig, keys: &mut ConfigKeys) {
    // Both names: transformers 4 reads the first, 5 writes the second.
    keys.set("num_experts", json!(moe.experts));
    keys.set("num_local_experts", json!(moe.experts));
    keys.set("moe_intermediate_size", json!(moe.expert_intermediate_size));
    keys.set("norm_topk_prob", json!(moe.normalize_top_k));
    keys.set("decoder_sparse_step", json!(moe.sparse_step));
    keys.set("mlp_only_layers", json!(moe.dense_layers));
    write_router_keys(moe, keys);
}

/// `mlp_only_layers`: the layers that keep the dense MLP (none when absent).
pub(super) fn read_dense_layers(hf: &HfJson) -> Result<Vec<usize>> {
    Ok(match hf.get("mlp_only_layers") {
        None | Some(serde_json::Value::Null) => Vec::new(),
        Some(serde_json::Value::Array(list)) => list
            .iter()
            .map(|v| {
                v.as_u64()
                    .map(|l| l as usize)
                    .ok_or_else(|| hf.err(format!("mlp_only_layers must list layer numbers, got {v}")))
            })
            .collect::<Result<Vec<usize>>>()?,
        Some(other) => return Err(hf.err(format!("mlp_only_layers must be a list, got {other}"))),
    })
}

impl Family for Qwen3Moe {
    fn model_type(&self) -> &'static str {
        "qwen3_moe"
    }

    fn architecture(&self) -> &'static str {
        "Qwen3MoeForCausalLM"
    }

    fn read_config(&self, hf: &HfJson) -> Result<Config> {
        let config = llama::read_layout(hf, self.model_type(), |hf| {
            llama::refuse_attention_bias(hf, "qwen3_moe")?;
            let sliding = hf.bool_opt("use_sliding_window")?.unwrap_or(false);
            Ok(Variant {
                bias: false,
                attn_qkv_bias: false,
                default_positions: 32768,
                sliding,
                // transformers' Qwen3-MoE has no head_dim default: the
                // width over the heads unless the file gives one.
                default_head_dim: None,
                qk_norm: QkNorm::PerHead,
                phi3_rope: false,
            })
        })?;
        let moe = read_qwen_moe(hf, [128, 8, 768])?;
        Ok(Config { moe: Some(moe), ..config })
    }

    fn write_config(&self, config: &Config, keys: &mut ConfigKeys) {
        llama::write_layout(config, keys);
        keys.set("attention_bias", json!(false));
        keys.set("use_sliding_window", json!(false));
        llama::write_no_window(keys);
        if let Some(moe) = &config.moe {
            write_qwen_moe(moe, keys);
        }
    }

    fn holds(&self, config: &Config) -> Holds {
        let Some(moe) = &config.moe else { return Holds::Other };
        if moe.shared_expert.is_some() {
            // Qwen2-MoE's kind of layer, on Qwen3's attention.
            return if config.qk_norm.is_none() {
                Holds::Other
            } else {
                Holds::Not("Qwen3-MoE has no shared expert".into())
            };
        }
        match llama::variant_layout_holds(&Config { moe: None, ..config.clone() }, QkNorm::PerHead, false) {
            Holds::Chosen if config.bias || config.attn_qkv_bias => {
                Holds::Not("Qwen3-MoE has no biases on its linear layers".into())
            }
            holds => holds,
        }
    }

    fn rules(&self) -> &'static [Rule] {
        QWEN_EXPERT_RULES
    }

    #[cfg(test)]
    fn example(&self) -> Config {
        Config {
            qk_norm: QkNorm::PerHead,
            norm_eps: 1e-5,
            moe: Some(MoeConfig {
                experts: 6,
                experts_per_token: 2,
                expert_intermediate_size: 20,
                normalize_top_k: false,
                sparse_step: 1,
                dense_layers: vec![1],
                aux_loss_coef: None,
                shared_expert: None,
                z_loss_coef: None,
            }),
            ..llama::example_layout("qwen3-moe-example")
        }
    }
}
