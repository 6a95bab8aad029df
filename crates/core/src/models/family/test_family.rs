//! A family that exists for the tests only, written as a new family would
//! be: this file and one line in the family list. It is the Llama layout
//! under tensor names of its own, so the generated tests exercise a rule
//! table, and saving never picks it unless asked.

use super::llama::{self, Variant};
use super::{ConfigKeys, Family, Holds, Rule, Unlisted};
use crate::error::Result;
use crate::models::config::{Config, QkNorm};
use crate::models::hf::HfJson;

/// `model_type` `stepgraph_test`.
pub struct TestRenamed;

const RULES: &[Rule] = &[
    Rule::same("transformer.wte.weight", &["model.embed_tokens.weight"]),
    Rule::same("transformer.h.{i}.ln_1.weight", &["model.layers.{i}.input_layernorm.weight"]),
    Rule::same("transformer.h.{i}.attn.q.weight", &["model.layers.{i}.self_attn.q_proj.weight"]),
    Rule::same("transformer.h.{i}.attn.k.weight", &["model.layers.{i}.self_attn.k_proj.weight"]),
    Rule::same("transformer.h.{i}.attn.v.weight", &["model.layers.{i}.self_attn.v_proj.weight"]),
    Rule::same("transformer.h.{i}.attn.o.weight", &["model.layers.{i}.self_attn.o_proj.weight"]),
    Rule::same("transformer.h.{i}.ln_2.weight", &["model.layers.{i}.post_attention_layernorm.weight"]),
    Rule::same("transformer.h.{i}.mlp.gate.weight", &["model.layers.{i}.mlp.gate_proj.weight"]),
    Rule::same("transformer.h.{i}.mlp.up.weight", &["model.layers.{i}.mlp.up_proj.weight"]),
    Rule::same("transformer.h.{i}.mlp.down.weight", &["model.layers.{i}.mlp.down_proj.weight"]),
    Rule::same("transformer.ln_f.weight", &["model.norm.weight"]),
    Rule::same("lm_head.weight", &["lm_head.weight"]),
];

impl Family for TestRenamed {
    fn model_type(&self) -> &'static str {
        "stepgraph_test"
    }

    fn architecture(&self) -> &'static str {
        "StepgraphTestForCausalLM"
    }

    fn read_config(&self, hf: &HfJson) -> Result<Config> {
        llama::read_layout(hf, self.model_type(), |_| {
            Ok(Variant {
                bias: false,
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
        llama::write_layout(config, keys);
    }

    fn holds(&self, config: &Config) -> Holds {
        match llama::layout_holds(config) {
            Holds::Chosen if config.bias || config.attn_qkv_bias => Holds::Other,
            Holds::Chosen => Holds::OnRequest,
            _ => Holds::Other,
        }
    }

    fn rules(&self) -> &'static [Rule] {
        RULES
    }

    fn unlisted(&self) -> Unlisted {
        Unlisted::Refused { title: "stepgraph_test" }
    }

    fn example(&self) -> Config {
        Config { tie_embeddings: false, norm_eps: 1e-4, ..llama::example_layout("test-example") }
    }
}
