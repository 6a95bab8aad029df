//! Phi-3 (`Phi3ForCausalLM`: Phi-3, Phi-3.5, Phi-4 and Phi-4-mini): the
//! Llama layout with q, k and v stored stacked as one `qkv_proj` tensor and
//! the gate and up projections as one `gate_up_proj`, RoPE on a part of
//! each head when `partial_rotary_factor` says so, a sliding window on
//! every layer whenever `sliding_window` is set (query `i` sees keys
//! `i + 1 − window..=i`, as `transformers`' mask has it), and no biases.

use serde_json::{json, Value};

use super::llama::{self, Variant};
use super::{ConfigKeys, Family, Holds, Join, Rule};
use crate::error::Result;
use crate::models::config::{Config, QkNorm, SlidingLayers};
use crate::models::hf::HfJson;

/// `model_type` `phi3`.
pub struct Phi3;

/// Phi-3's stacked tensors; every other tensor has the trace's name.
const RULES: &[Rule] = &[
    Rule {
        hf: "model.layers.{i}.self_attn.qkv_proj.weight",
        trace: &[
            "model.layers.{i}.self_attn.q_proj.weight",
            "model.layers.{i}.self_attn.k_proj.weight",
            "model.layers.{i}.self_attn.v_proj.weight",
        ],
        join: Join::Rows,
    },
    Rule {
        hf: "model.layers.{i}.mlp.gate_up_proj.weight",
        trace: &["model.layers.{i}.mlp.gate_proj.weight", "model.layers.{i}.mlp.up_proj.weight"],
        join: Join::Rows,
    },
];

impl Family for Phi3 {
    fn model_type(&self) -> &'static str {
        "phi3"
    }

    fn architecture(&self) -> &'static str {
        "Phi3ForCausalLM"
    }

    fn read_config(&self, hf: &HfJson) -> Result<Config> {
        let mut config = llama::read_layout(hf, self.model_type(), |_| {
            Ok(Variant {
                bias: false,
                attn_qkv_bias: false,
                default_positions: 4096,
                sliding: false,
                default_head_dim: None,
                qk_norm: QkNorm::None,
                phi3_rope: true,
            })
        })?;
        // transformers' Phi3Config defaults its norms' epsilon to 1e-5 and
        // also takes the rotary fraction as a top-level key.
        if hf.f64_opt("rms_norm_eps")?.is_none() {
            config.norm_eps = 1e-5;
        }
        if let Some(fraction) = hf.f64_opt("partial_rotary_factor")? {
            if !(fraction > 0.0 && fraction <= 1.0) {
                return Err(hf.err(format!("partial_rotary_factor {fraction} is not in (0, 1]")));
            }
            config.rotary_percentage = fraction;
        }
        // transformers' Phi3Config has no window unless the file gives one.
        config.sliding_window = super::mistral::read_window(hf, None)?;
        Ok(config)
    }

    fn write_config(&self, config: &Config, keys: &mut ConfigKeys) {
        llama::write_layout(config, keys);
        keys.set_rope("partial_rotary_factor", json!(config.rotary_percentage));
        // At the top level too: `Phi3Config` takes a `rope_scaling` object
        // (LongRoPE's) in place of `rope_parameters` and fills its rotary
        // fraction from the top-level key, 1 when absent.
        keys.set("partial_rotary_factor", json!(config.rotary_percentage));
        keys.set("sliding_window", config.sliding_window.map_or(Value::Null, |w| json!(w)));
    }

    /// An unbiased Llama-layout model, written as `phi3` only when asked
    /// (or when it came from a Phi-3 folder): the same network as Llama's
    /// with its q/k/v and gate/up tensors stacked. Its heads are the width
    /// over the heads, as Phi-3 derives them.
    fn holds(&self, config: &Config) -> Holds {
        if config.sliding_window.is_some() && !config.sliding_layers.is_all() {
            return Holds::Not("Phi-3's window applies to every layer".into());
        }
        let unwindowed = Config { sliding_window: None, sliding_layers: SlidingLayers::All, ..config.clone() };
        match llama::partial_rope_layout_holds(&unwindowed) {
            Holds::Chosen if config.bias || config.attn_qkv_bias => {
                Holds::Not("Phi-3 has no biases on its linear layers".into())
            }
            Holds::Chosen if config.head_size * config.n_head != config.n_embd => {
                Holds::Not("Phi-3's heads are the width over the heads wide".into())
            }
            Holds::Chosen => Holds::OnRequest,
            holds => holds,
        }
    }

    fn rules(&self) -> &'static [Rule] {
        RULES
    }

    #[cfg(test)]
    fn example(&self) -> Config {
        Config {
            head_size: 8,
            rotary_percentage: 0.75,
            norm_eps: 1e-6,
            sliding_window: Some(3),
            // LongRoPE on the 6 rotated dimensions (3 pairs).
            rope_scaling: Some(crate::ops::rope::RopeScaling::LongRope(crate::ops::rope::LongRope {
                short_factor: vec![1.0, 1.25, 1.5],
                long_factor: vec![2.0, 5.0, 9.0],
                original_max_position_embeddings: 4,
                attention_factor: 1.1,
            })),
            ..llama::example_layout("phi3-example")
        }
    }
}
