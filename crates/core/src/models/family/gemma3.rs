//! Gemma 3's language model (`Gemma3ForCausalLM`, `model_type`
//! `gemma3_text`): the Gemma 2 layout ([`super::gemma2`]) with an RMSNorm
//! over each head of q and of k (`self_attn.q_norm`, `self_attn.k_norm`,
//! weights of the head's size, offsets from one like every Gemma norm)
//! before RoPE, no soft-caps by default, five sliding layers to one global
//! (`layer_types`, or `sliding_window_pattern`), and two RoPEs: the
//! sliding layers rotate with `rope_local_base_freq` (10000) and no
//! scaling, the global ones with `rope_theta` (1e6) and `rope_scaling`
//! (linear, by 8, from 4B up). `transformers` 5 keeps the two under
//! `rope_parameters.sliding_attention` and `rope_parameters.full_attention`;
//! both forms are read, and both written.
//!
//! The image-and-text model (`model_type` `gemma3`,
//! `Gemma3ForConditionalGeneration`, every Gemma 3 from 4B up) is refused
//! by name ([`MULTIMODAL_REFUSAL`]): its checkpoints hold a vision tower
//! and a projector beside the language model, whose tensors they name
//! `language_model.model.*` (`model.language_model.*` in newer saves), and
//! a folder saved from the language model alone would not be that
//! model's folder.

use serde_json::{json, Map, Value};

use super::gemma2::{self, Defaults};
use super::{ConfigKeys, Family, Holds};
use crate::error::Result;
use crate::models::config::{Config, QkNorm, SlidingLayers};
use crate::models::hf::{HfJson, RopeContext};
use crate::ops::rope::RopeScaling;

/// `model_type` `gemma3_text`.
pub struct Gemma3Text;

/// Why a `gemma3` folder (the image-and-text model) does not load.
pub const MULTIMODAL_REFUSAL: &str = "it is Gemma 3's image-and-text model (Gemma3ForConditionalGeneration), \
     whose weights hold a vision tower and a projector beside the language model and name the language model's \
     tensors `language_model.model.*`; a folder saved from the language model alone would not be that model's \
     folder. Only the text model, model_type `gemma3_text` (Gemma3ForCausalLM, as google/gemma-3-1b-pt), loads; \
     the named geometries gemma-3-4b, gemma-3-12b and gemma-3-27b plan and benchmark the larger models' \
     language part";

/// The RoPE scaling of the global layers: Llama-3.x or linear.
type GlobalScaling = (Option<RopeScaling>, Option<f64>);

impl Family for Gemma3Text {
    fn model_type(&self) -> &'static str {
        "gemma3_text"
    }

    fn architecture(&self) -> &'static str {
        "Gemma3ForCausalLM"
    }

    fn read_config(&self, hf: &HfJson) -> Result<Config> {
        // `transformers` builds the default layer pattern from
        // `sliding_window_pattern` (6 when absent) when `layer_types` is.
        let global_every = hf.usize_opt("sliding_window_pattern")?.unwrap_or(6);
        if global_every == 0 {
            return Err(hf.err("sliding_window_pattern 0 names no layer; every n-th layer is global for n >= 1"));
        }
        let defaults = Defaults { positions: 131072, attn_softcap: None, final_softcap: None, global_every };
        let config = gemma2::read_layout(hf, self.model_type(), &defaults)?;
        let (rope_base, rope_local_base, (rope_scaling, rope_linear_factor)) = read_rope(hf)?;
        Ok(Config {
            qk_norm: QkNorm::PerHead,
            rope_base,
            rope_scaling,
            rope_local_base: Some(rope_local_base),
            rope_linear_factor,
            // `transformers`' Gemma 3 keeps `attn_logit_softcapping` in its
            // config but its attention never reads it (Gemma 3 dropped
            // Gemma 2's attention soft-cap), so a folder that sets it
            // computes the uncapped network there; so it does here, and the
            // folder written back says null.
            attn_softcap: None,
            ..config
        })
    }

    fn write_config(&self, config: &Config, keys: &mut ConfigKeys) {
        gemma2::write_layout(config, keys);
        let local = config.rope_local_base.unwrap_or(config.rope_base);
        keys.set("rope_local_base_freq", json!(local));
        match config.sliding_layers {
            SlidingLayers::GlobalEvery(n) => keys.set("sliding_window_pattern", json!(n)),
            _ => {
                keys.top.remove("sliding_window_pattern");
            }
        }
        // The global layers' RoPE as `hf_config_json` wrote it for every
        // family (plain or Llama-3.x, with the base), or linear.
        let mut full = std::mem::take(&mut keys.rope);
        if let Some(factor) = config.rope_linear_factor {
            let linear =
                Map::from_iter([("rope_type".to_string(), json!("linear")), ("factor".to_string(), json!(factor))]);
            full.extend(linear.clone());
            keys.set("rope_scaling", Value::Object(linear));
        }
        keys.rope = Map::from_iter([
            ("full_attention".to_string(), Value::Object(full)),
            ("sliding_attention".to_string(), json!({"rope_type": "default", "rope_theta": local})),
        ]);
    }

    fn holds(&self, config: &Config) -> Holds {
        if config.attn_softcap.is_some() {
            return Holds::Not("Gemma 3's attention has no soft-cap (transformers does not apply one)".into());
        }
        match gemma2::layout_holds(config, QkNorm::PerHead, "Gemma 3") {
            Holds::Chosen if config.rope_local_base.is_none() => {
                Holds::Not("Gemma 3 rotates its sliding layers with a RoPE base of their own".into())
            }
            holds => holds,
        }
    }

    #[cfg(test)]
    fn example(&self) -> Config {
        Config {
            qk_norm: QkNorm::PerHead,
            sliding_layers: SlidingLayers::Listed(vec![true, false, false]),
            rope_local_base: Some(20000.0),
            rope_linear_factor: Some(4.0),
            attn_softcap: None,
            ..gemma2::example_layout("gemma3-example")
        }
    }
}

/// The global layers' RoPE base, the sliding layers' base, and the global
/// layers' scaling, from `rope_parameters.full_attention` and
/// `.sliding_attention` (`transformers` 5) or the older `rope_theta`,
/// `rope_local_base_freq` and `rope_scaling` (the former win where both
/// are given, as `transformers` 5 lets them).
fn read_rope(hf: &HfJson) -> Result<(f64, f64, GlobalScaling)> {
    let (mut full, mut sliding) = (None, None);
    if let Some(params) = hf.nested("rope_parameters", "rope_parameters.")? {
        if params.get("rope_type").is_some() || params.get("rope_theta").is_some() {
            return Err(hf.err(
                "rope_parameters of model_type `gemma3_text` holds one object per layer type (`full_attention`, \
                 `sliding_attention`), not one for every layer",
            ));
        }
        full = params.nested("full_attention", "rope_parameters.full_attention.")?;
        sliding = params.nested("sliding_attention", "rope_parameters.sliding_attention.")?;
    }
    for part in full.iter().chain(&sliding) {
        if let Some(fraction) = part.f64_opt("partial_rotary_factor")?.filter(|f| *f != 1.0) {
            return Err(hf.err(format!(
                "partial_rotary_factor {fraction} is not supported for model_type `gemma3_text`; Gemma 3 rotates \
                 whole heads"
            )));
        }
    }
    let theta = |part: &Option<HfJson>| part.as_ref().map(|p| p.f64_opt("rope_theta")).transpose();
    let local = theta(&sliding)?.flatten().or(hf.f64_opt("rope_local_base_freq")?).unwrap_or(10000.0);
    let global = theta(&full)?.flatten().or(hf.f64_opt("rope_theta")?).unwrap_or(1_000_000.0);
    if let Some(sliding) = &sliding {
        if let Some(kind) = rope_type(sliding)?.filter(|k| *k != "default") {
            return Err(hf.err(format!(
                "rope_parameters.sliding_attention.rope_type `{kind}` is not supported: Gemma 3's sliding layers \
                 rotate with plain RoPE"
            )));
        }
    }
    // The global layers' scaling: `full_attention`'s when it names one,
    // else the older `rope_scaling`'s.
    let named = match &full {
        Some(full) if rope_type(full)?.is_some() => Some(full),
        _ => None,
    };
    let old = hf.nested("rope_scaling", "rope_scaling.")?;
    let scaling = match named.or(old.as_ref()) {
        Some(source) => global_scaling(hf, source)?,
        None => (None, None),
    };
    Ok((global, local, scaling))
}

/// `rope_type` (or the older `type`) of a RoPE object.
fn rope_type<'a>(obj: &HfJson<'a>) -> Result<Option<&'a str>> {
    Ok(match obj.str_opt("rope_type")? {
        Some(kind) => Some(kind),
        None => obj.str_opt("type")?,
    })
}

/// The scaling a RoPE object of the global layers names: none, linear
/// (its `factor`) or Llama-3.x; any other is refused by name.
fn global_scaling(hf: &HfJson, obj: &HfJson) -> Result<GlobalScaling> {
    match rope_type(obj)? {
        None | Some("default") => Ok((None, None)),
        Some("linear") => {
            let factor = obj.f64_opt("factor")?.ok_or_else(|| obj.missing("factor"))?;
            if !(factor.is_finite() && factor > 0.0) {
                return Err(hf.err(format!("linear RoPE scaling needs a positive factor, got {factor}")));
            }
            Ok((None, Some(factor)))
        }
        Some("llama3") => {
            // Llama-3.x scaling reads nothing outside its object.
            let cx = RopeContext { positions: 0, original_positions: None, phi3_names: false };
            Ok((obj.rope_variant(&cx)?, None))
        }
        Some(other) => Err(hf.err(format!(
            "rope_type `{other}` (RoPE scaling of the global layers) is not supported for model_type \
             `gemma3_text`; only plain RoPE (`default`), `linear` and `llama3` are"
        ))),
    }
}
