//! Mixtral (`MixtralForCausalLM`): Mistral's attention (its window only when
//! `sliding_window` gives one) and, on every layer, a mixture of SwiGLU
//! experts in place of the MLP: the router `block_sparse_moe.gate` and each
//! expert's `w1` (gate), `w3` (up) and `w2` (down) stored as tensors of
//! their own, stacked here into one parameter per matrix. Each token takes
//! its `num_experts_per_tok` best experts, their probabilities renormalised.

use serde_json::{json, Value};

use super::llama::{self, Variant};
use super::{ConfigKeys, Family, Holds, Join, Rule};
use crate::error::Result;
use crate::models::config::{Config, MoeConfig, QkNorm};
use crate::models::hf::HfJson;

/// `model_type` `mixtral`.
pub struct Mixtral;

/// The router and the experts; every other tensor has the trace's name.
const RULES: &[Rule] = &[
    Rule::same("model.layers.{i}.block_sparse_moe.gate.weight", &["model.layers.{i}.mlp.gate.weight"]),
    Rule {
        hf: "model.layers.{i}.block_sparse_moe.experts.{e}.w1.weight",
        trace: &["model.layers.{i}.mlp.experts.gate_proj.weight"],
        join: Join::Experts,
    },
    Rule {
        hf: "model.layers.{i}.block_sparse_moe.experts.{e}.w3.weight",
        trace: &["model.layers.{i}.mlp.experts.up_proj.weight"],
        join: Join::Experts,
    },
    Rule {
        hf: "model.layers.{i}.block_sparse_moe.experts.{e}.w2.weight",
        trace: &["model.layers.{i}.mlp.experts.down_proj.weight"],
        join: Join::Experts,
    },
];

/// `transformers`' default `router_aux_loss_coef`.
const DEFAULT_AUX_LOSS_COEF: f64 = 0.001;

/// What Mixtral's and Qwen-MoE's configs share about training the router:
/// the load-balancing loss's weight when `output_router_logits` adds it to
/// the training loss (`router_aux_loss_coef`), and no noise on the router
/// (which is refused: a step here computes none).
pub(super) fn router_training_terms(hf: &HfJson) -> Result<Option<f64>> {
    if hf.f64_opt("router_jitter_noise")?.is_some_and(|x| x != 0.0) {
        return Err(
            hf.err("router_jitter_noise other than 0 (noise on the router's inputs in training) is not supported")
        );
    }
    if !hf.bool_opt("output_router_logits")?.unwrap_or(false) {
        return Ok(None);
    }
    Ok(Some(hf.f64_opt("router_aux_loss_coef")?.unwrap_or(DEFAULT_AUX_LOSS_COEF)))
}

/// Writes the router keys a saved folder carries: experts per token, and
/// the load-balancing loss on or off with its weight.
pub(super) fn write_router_keys(moe: &MoeConfig, keys: &mut ConfigKeys) {
    keys.set("num_experts_per_tok", json!(moe.experts_per_token));
    keys.set("output_router_logits", json!(moe.aux_loss_coef.is_some()));
    keys.set("router_aux_loss_coef", json!(moe.aux_loss_coef.unwrap_or(DEFAULT_AUX_LOSS_COEF)));
}

impl Family for Mixtral {
    fn model_type(&self) -> &'static str {
        "mixtral"
    }

    fn architecture(&self) -> &'static str {
        "MixtralForCausalLM"
    }

    fn read_config(&self, hf: &HfJson) -> Result<Config> {
        let config = llama::read_layout(hf, self.model_type(), |_| {
            Ok(Variant {
                bias: false,
                attn_qkv_bias: false,
                default_positions: 4096 * 32,
                sliding: false,
                default_head_dim: None,
                qk_norm: QkNorm::None,
                phi3_rope: false,
            })
        })?;
        let aux_loss_coef = router_training_terms(hf)?;
        let sliding_window = super::mistral::read_window(hf, None)?;
        let moe = MoeConfig {
            experts: hf.usize_opt("num_local_experts")?.unwrap_or(8),
            experts_per_token: hf.usize_opt("num_experts_per_tok")?.unwrap_or(2),
            expert_intermediate_size: config.intermediate_size,
            normalize_top_k: true,
            sparse_step: 1,
            dense_layers: Vec::new(),
            aux_loss_coef,
            shared_expert: None,
            z_loss_coef: None,
        };
        Ok(Config { sliding_window, moe: Some(moe), ..config })
    }

    fn write_config(&self, config: &Config, keys: &mut ConfigKeys) {
        llama::write_layout(config, keys);
        keys.set("sliding_window", config.sliding_window.map_or(Value::Null, |w| json!(w)));
        if let Some(moe) = &config.moe {
            keys.set("num_local_experts", json!(moe.experts));
            keys.set("router_jitter_noise", json!(0.0));
            write_router_keys(moe, keys);
        }
    }

    /// A Mistral-like model (window or none) whose every layer has experts
    /// as wide as its `intermediate_size`, renormalised.
    fn holds(&self, config: &Config) -> Holds {
        let Some(moe) = &config.moe else { return Holds::Other };
        let dense = Config { moe: None, sliding_window: None, ..config.clone() };
        match llama::layout_holds(&dense) {
            Holds::Chosen if config.bias || config.attn_qkv_bias => {
                Holds::Not("Mixtral has no biases on its linear layers".into())
            }
            Holds::Chosen if config.sliding_window.is_some() && !config.sliding_layers.is_all() => {
                Holds::Not("Mixtral's window applies to every layer".into())
            }
            Holds::Chosen if !moe.normalize_top_k || moe.sparse_step != 1 || !moe.dense_layers.is_empty() => {
                Holds::Not("Mixtral renormalises its routing weights and has experts on every layer".into())
            }
            Holds::Chosen if moe.shared_expert.is_some() => Holds::Not("Mixtral has no shared expert".into()),
            Holds::Chosen if moe.expert_intermediate_size != config.intermediate_size => {
                Holds::Not("Mixtral's experts are as wide as its intermediate_size".into())
            }
            holds => holds,
        }
    }

    fn rules(&self) -> &'static [Rule] {
        RULES
    }

    #[cfg(test)]
    fn example(&self) -> Config {
        let layout = llama::example_layout("mixtral-example");
        Config {
            rope_base: 1_000_000.0,
            sliding_window: Some(5),
            moe: Some(MoeConfig {
                experts: 4,
                experts_per_token: 2,
                expert_intermediate_size: layout.intermediate_size,
                normalize_top_k: true,
                sparse_step: 1,
                dense_layers: Vec::new(),
                aux_loss_coef: Some(0.02),
                shared_expert: None,
                z_loss_coef: None,
            }),
            ..layout
        }
    }
}
