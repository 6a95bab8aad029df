//! Mistral (`MistralForCausalLM`): the Llama layout, with a sliding window
//! that a block no longer than the window never reaches.

use super::llama::{self, Variant};
use super::{ConfigKeys, Family, Holds};
use crate::error::Result;
use crate::models::config::{Config, QkNorm};
use crate::models::hf::HfJson;

/// `model_type` `mistral`.
pub struct Mistral;

impl Family for Mistral {
    fn model_type(&self) -> &'static str {
        "mistral"
    }

    fn architecture(&self) -> &'static str {
        "MistralForCausalLM"
    }

    fn read_config(&self, hf: &HfJson) -> Result<Config> {
        // transformers' MistralConfig defaults to 4096·32 positions and
        // always applies its sliding window.
        llama::read_layout(hf, self.model_type(), |_| {
            Ok(Variant {
                bias: false,
                attn_qkv_bias: false,
                default_positions: 4096 * 32,
                sliding: true,
                default_head_dim: None,
                qk_norm: QkNorm::None,
            })
        })
    }

    fn write_config(&self, config: &Config, keys: &mut ConfigKeys) {
        llama::write_layout(config, keys);
        llama::write_no_window(keys);
    }

    /// An unbiased Llama, written as `mistral` only when asked: the same
    /// network, and Llama is the default name for it. `transformers`'
    /// Mistral has no biases, so a biased config saved as `mistral` would
    /// load as another network.
    fn holds(&self, config: &Config) -> Holds {
        match llama::Llama.holds(config) {
            Holds::Chosen if config.bias || config.attn_qkv_bias => {
                Holds::Not("Mistral has no biases on its linear layers".into())
            }
            Holds::Chosen => Holds::OnRequest,
            holds => holds,
        }
    }

    #[cfg(test)]
    fn example(&self) -> Config {
        Config { rope_base: 1_000_000.0, ..llama::example_layout("mistral-example") }
    }
}
