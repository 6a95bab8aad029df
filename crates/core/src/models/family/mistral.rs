//! Mistral (`MistralForCausalLM`): the Llama layout with a sliding window
//! on every layer (`sliding_window`, 4096 when the file does not say;
//! `null` for none): query `i` sees keys `i + 1 − window..=i`, as
//! `transformers`' `sliding_window_causal` mask has it.

use serde_json::{json, Value};

use super::llama::{self, Variant};
use super::{ConfigKeys, Family, Holds};
use crate::error::Result;
use crate::models::config::{Config, QkNorm, SlidingLayers};
use crate::models::hf::HfJson;

/// `model_type` `mistral`.
pub struct Mistral;

/// transformers' `MistralConfig.sliding_window` when the file has none.
const DEFAULT_WINDOW: usize = 4096;

/// A `sliding_window` that applies to every layer (Mistral, Mixtral,
/// Phi-3): `default` when the file has none, none for `null`; 0 is refused.
pub(super) fn read_window(hf: &HfJson, default: Option<usize>) -> Result<Option<usize>> {
    let window = hf.usize_or("sliding_window", default)?;
    if window == Some(0) {
        return Err(hf.err("sliding_window 0 leaves a query no key; use null for no window"));
    }
    Ok(window)
}

impl Family for Mistral {
    fn model_type(&self) -> &'static str {
        "mistral"
    }

    fn architecture(&self) -> &'static str {
        "MistralForCausalLM"
    }

    fn read_config(&self, hf: &HfJson) -> Result<Config> {
        // transformers' MistralConfig defaults to 4096·32 positions; its
        // window applies to every layer, whatever the block.
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
        Ok(Config { sliding_window: read_window(hf, Some(DEFAULT_WINDOW))?, ..config })
    }

    fn write_config(&self, config: &Config, keys: &mut ConfigKeys) {
        llama::write_layout(config, keys);
        keys.set("sliding_window", config.sliding_window.map_or(Value::Null, |w| json!(w)));
    }

    /// An unbiased Llama with a window on every layer, or, written as
    /// `mistral` only when asked, one without a window (the same network
    /// as Llama's, the default name for it). `transformers`' Mistral has
    /// no biases, so a biased config saved as `mistral` would load as
    /// another network.
    fn holds(&self, config: &Config) -> Holds {
        let windowed = config.sliding_window.is_some();
        if windowed && !config.sliding_layers.is_all() {
            return match llama::layout_holds(&Config { sliding_window: None, ..config.clone() }) {
                Holds::Other => Holds::Other,
                _ => Holds::Not("Mistral's window applies to every layer".into()),
            };
        }
        let unwindowed = Config { sliding_window: None, sliding_layers: SlidingLayers::All, ..config.clone() };
        match llama::layout_holds(&unwindowed) {
            Holds::Chosen if config.bias || config.attn_qkv_bias => {
                Holds::Not("Mistral has no biases on its linear layers".into())
            }
            Holds::Chosen if windowed => Holds::Chosen,
            Holds::Chosen => Holds::OnRequest,
            holds => holds,
        }
    }

    #[cfg(test)]
    fn example(&self) -> Config {
        Config { rope_base: 1_000_000.0, sliding_window: Some(5), ..llama::example_layout("mistral-example") }
    }
}
