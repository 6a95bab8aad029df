//! Reading a Hugging Face `config.json` into a [`Config`]: parsing the JSON
//! with typed getters whose errors name the model and the key ([`HfJson`]),
//! the RoPE, block-size and head-size rules every family shares, and the
//! `model_type` dispatch to the family that reads the rest
//! ([`super::family`]). Anything a [`Config`] cannot express exactly is an
//! error, never a silently different network.
//!
//! The entry points are [`Config::from_hf_json`] and
//! [`Config::from_hf_file`], so callers keep reaching them through
//! [`Config`].

use std::path::Path;

use serde_json::{Map, Value};

use super::config::{config_error, keys_named_in, Config};
use super::family::HfFamily;
use crate::error::{Error, Result};
use crate::ops::rope::{Llama3Scaling, LongRope, RopeScaling};

impl Config {
    /// Reads a Hugging Face `config.json` from `path` (or from
    /// `path/config.json` when `path` is a directory) with
    /// [`Config::from_hf_json`], naming the model after the directory that
    /// holds the file.
    pub fn from_hf_file(path: &Path) -> Result<Config> {
        let file = if path.is_dir() { path.join("config.json") } else { path.to_path_buf() };
        let text =
            std::fs::read_to_string(&file).map_err(|cause| Error::Io { path: file.display().to_string(), cause })?;
        let dir_name =
            file.parent().and_then(Path::file_name).and_then(|name| name.to_str()).filter(|name| !name.is_empty());
        let name = match dir_name {
            Some(name) => name.to_string(),
            None => file.display().to_string(),
        };
        // A malformed file is named once, with serde's position in it.
        serde_json::from_str::<Value>(&text)
            .map_err(|e| config_error(&name, format!("{} is not valid JSON: {e}", file.display())))?;
        // Every other error names the file too, and a size error the
        // file's keys its sizes were read from.
        let at = |keys: &[&str]| {
            let mut file_keys: Vec<&str> = Vec::new();
            for k in keys.iter().filter_map(|k| hf_key(k)) {
                if !file_keys.contains(&k) {
                    file_keys.push(k);
                }
            }
            match file_keys.is_empty() {
                true => file.display().to_string(),
                false => format!("{} (key {})", file.display(), file_keys.join(", key ")),
            }
        };
        Self::from_hf_json(&text, &name).map_err(|e| match e {
            Error::Config { model, reason } => {
                Error::Config { model, reason: format!("{}: {reason}", at(&keys_named_in(&reason))) }
            }
            Error::Size { keys, reason } => Error::Size { keys: vec![], reason: format!("{}: {reason}", at(&keys)) },
            other => other,
        })
    }

    /// Parses the text of a Hugging Face `config.json` into a validated
    /// config called `name`.
    ///
    /// Supports the `model_type` of every family in [`super::family`]
    /// (`llama`, `mistral`, `qwen2`, `qwen3`, `olmo2`, `phi3`: the LLaMA
    /// layout and its variants; `gemma2`, `gemma3_text`; `gpt_neox`), and
    /// refuses a few others by name with the reason
    /// ([`HfFamily::refusal`]). Missing optional keys take the
    /// defaults of the matching `transformers` config class. Since
    /// `config.json` does not give the tokenizer's size, `vocab_size` and
    /// `padded_vocab_size` are both its `vocab_size` (the embedding rows).
    ///
    /// RoPE scaling of type `llama3` (Llama 3.1–3.3) becomes
    /// [`Config::rope_scaling`]. Anything this config cannot express exactly
    /// (another activation, another RoPE scaling, a bias layout other than
    /// the supported ones) is an
    /// [`Error::Config`] rather than a silently different network.
    pub fn from_hf_json(text: &str, name: &str) -> Result<Config> {
        let value: Value = serde_json::from_str(text)?;
        let Some(obj) = value.as_object() else {
            return Err(config_error(name, "config.json must hold a JSON object"));
        };
        let hf = HfJson { model: name, prefix: "", obj };
        let model_type = hf.str_req("model_type")?;
        let Some(family) = HfFamily::from_model_type(model_type) else {
            if let Some(why) = HfFamily::refusal(model_type) {
                return Err(hf.err(format!("model_type `{model_type}` is not supported: {why}")));
            }
            return Err(
                hf.err(format!("model_type `{model_type}` is not supported (supported: {})", HfFamily::supported()))
            );
        };
        let config = family.family().read_config(&hf)?;
        config.validate()?;
        Ok(config)
    }
}

/// The `config.json` key that a [`Config`] size key is read from, for
/// messages that point into the file (`None` for keys that are not
/// [`Config`] sizes). Both the LLaMA-like types and `gpt_neox` use these
/// names; where a key may be absent the message says what stands in for it.
pub fn hf_key(key: &str) -> Option<&'static str> {
    Some(match key {
        "n_layer" => "num_hidden_layers",
        "n_embd" => "hidden_size",
        "n_head" => "num_attention_heads",
        "n_query_groups" => "num_key_value_heads (or num_attention_heads)",
        "head_size" => "head_dim (or hidden_size / num_attention_heads)",
        "intermediate_size" => "intermediate_size",
        "block_size" => "max_position_embeddings",
        "vocab_size" | "padded_vocab_size" => "vocab_size",
        _ => return None,
    })
}

/// A JSON object from a `config.json` (or an object nested in it), with
/// typed getters whose errors name the model and the key: what a
/// [`super::family::Family`] reads its config from.
pub struct HfJson<'a> {
    model: &'a str,
    /// `"rope_scaling."` and the like for nested objects, for messages.
    prefix: &'a str,
    obj: &'a Map<String, Value>,
}

/// A family's defaults for what a RoPE object reads outside itself
/// ([`HfJson::rope`]).
#[derive(Clone, Copy, Debug)]
pub struct RopeDefaults {
    /// `max_position_embeddings` when the config leaves it out.
    pub positions: usize,
    /// The pre-training context when the config has no top-level
    /// `original_max_position_embeddings`: Phi-3's class default (4096),
    /// which `transformers` prefers over the RoPE object's own; `None`
    /// for the object's own.
    pub original_positions: Option<usize>,
    /// Phi-3 reads the RoPE types `su` and `yarn` as `longrope`.
    pub phi3_names: bool,
}

impl RopeDefaults {
    /// A family without LongRoPE defaults of its own.
    pub fn positions(positions: usize) -> Self {
        RopeDefaults { positions, original_positions: None, phi3_names: false }
    }
}

/// What [`HfJson::rope_variant`] reads outside the RoPE object, resolved
/// from the top level and the family's [`RopeDefaults`].
#[derive(Clone, Copy, Debug)]
pub struct RopeContext {
    /// `max_position_embeddings`.
    pub positions: usize,
    /// The top-level (or class default) `original_max_position_embeddings`.
    pub original_positions: Option<usize>,
    /// Phi-3's older names for LongRoPE.
    pub phi3_names: bool,
}

impl<'a> HfJson<'a> {
    /// The model's name, which the config read from this object takes.
    pub fn model(&self) -> &'a str {
        self.model
    }

    pub fn err(&self, reason: impl Into<String>) -> Error {
        config_error(self.model, reason)
    }

    /// The value of `key`; `null` counts as absent, as `transformers` writes
    /// `null` for unset optional fields.
    pub fn get(&self, key: &str) -> Option<&'a Value> {
        self.obj.get(key).filter(|value| !value.is_null())
    }

    /// Whether `key` is present and `null`: for the keys whose default is
    /// a value and whose `null` turns the feature off (Gemma's soft-caps
    /// and window).
    pub fn is_null(&self, key: &str) -> bool {
        self.obj.get(key).is_some_and(Value::is_null)
    }

    /// The number under `key`: `default` when the key is absent, `None`
    /// when it is `null`.
    pub fn f64_or(&self, key: &str, default: Option<f64>) -> Result<Option<f64>> {
        if self.is_null(key) {
            return Ok(None);
        }
        Ok(self.f64_opt(key)?.or(default))
    }

    /// The non-negative integer under `key`: `default` when the key is
    /// absent, `None` when it is `null`.
    pub fn usize_or(&self, key: &str, default: Option<usize>) -> Result<Option<usize>> {
        if self.is_null(key) {
            return Ok(None);
        }
        Ok(self.usize_opt(key)?.or(default))
    }

    /// The strings of the array under `key`, if there is one.
    pub fn strs_opt(&self, key: &str) -> Result<Option<Vec<&'a str>>> {
        let Some(value) = self.get(key) else {
            return Ok(None);
        };
        let bad = || self.wrong_type(key, "an array of strings", value);
        let items = value.as_array().ok_or_else(bad)?;
        items.iter().map(|v| v.as_str().ok_or_else(bad)).collect::<Result<Vec<_>>>().map(Some)
    }

    fn wrong_type(&self, key: &str, expected: &str, value: &Value) -> Error {
        self.err(format!("key `{}{key}` must be {expected}, got {value}", self.prefix))
    }

    pub fn missing(&self, key: &str) -> Error {
        self.err(format!("missing required key `{}{key}`", self.prefix))
    }

    pub fn usize_opt(&self, key: &str) -> Result<Option<usize>> {
        let Some(value) = self.get(key) else {
            return Ok(None);
        };
        value
            .as_u64()
            .and_then(|n| usize::try_from(n).ok())
            .map(Some)
            .ok_or_else(|| self.wrong_type(key, "a non-negative integer", value))
    }

    pub fn usize_req(&self, key: &str) -> Result<usize> {
        self.usize_opt(key)?.ok_or_else(|| self.missing(key))
    }

    pub fn f64_opt(&self, key: &str) -> Result<Option<f64>> {
        let Some(value) = self.get(key) else {
            return Ok(None);
        };
        value.as_f64().map(Some).ok_or_else(|| self.wrong_type(key, "a number", value))
    }

    pub fn bool_opt(&self, key: &str) -> Result<Option<bool>> {
        let Some(value) = self.get(key) else {
            return Ok(None);
        };
        value.as_bool().map(Some).ok_or_else(|| self.wrong_type(key, "true or false", value))
    }

    pub fn str_opt(&self, key: &str) -> Result<Option<&'a str>> {
        let Some(value) = self.get(key) else {
            return Ok(None);
        };
        value.as_str().map(Some).ok_or_else(|| self.wrong_type(key, "a string", value))
    }

    pub fn str_req(&self, key: &str) -> Result<&'a str> {
        self.str_opt(key)?.ok_or_else(|| self.missing(key))
    }

    /// The object under `key`, with `prefix` naming it in messages.
    pub fn nested(&self, key: &str, prefix: &'a str) -> Result<Option<HfJson<'a>>> {
        let Some(value) = self.get(key) else {
            return Ok(None);
        };
        let obj = value.as_object().ok_or_else(|| self.wrong_type(key, "an object", value))?;
        Ok(Some(HfJson { model: self.model, prefix, obj }))
    }

    /// The numbers of the array under `key`, if there is one.
    pub fn f64s_opt(&self, key: &str) -> Result<Option<Vec<f64>>> {
        let Some(value) = self.get(key) else {
            return Ok(None);
        };
        let bad = || self.wrong_type(key, "an array of numbers", value);
        let items = value.as_array().ok_or_else(bad)?;
        items.iter().map(|v| v.as_f64().ok_or_else(bad)).collect::<Result<Vec<_>>>().map(Some)
    }

    /// The RoPE variant of this object (`rope_type`, or the older `type`):
    /// `None` for plain RoPE (absent or `default`), the Llama-3.x scaling for
    /// `llama3`, LongRoPE for `longrope` (and, for Phi-3, its older names
    /// `su` and `yarn`, as `transformers`' `Phi3Config` reads them); any
    /// other variant is refused.
    pub fn rope_variant(&self, cx: &RopeContext) -> Result<Option<RopeScaling>> {
        let kind = match self.str_opt("rope_type")? {
            Some(kind) => Some(kind),
            None => self.str_opt("type")?,
        };
        let named = |reason: String| self.err(format!("{}: {reason}", self.prefix.trim_end_matches('.')));
        match kind {
            None | Some("default") => Ok(None),
            Some("llama3") => {
                let scaling = Llama3Scaling {
                    factor: self.f64_opt("factor")?.ok_or_else(|| self.missing("factor"))?,
                    low_freq_factor: self.f64_opt("low_freq_factor")?.ok_or_else(|| self.missing("low_freq_factor"))?,
                    high_freq_factor: self
                        .f64_opt("high_freq_factor")?
                        .ok_or_else(|| self.missing("high_freq_factor"))?,
                    original_max_position_embeddings: self.usize_req("original_max_position_embeddings")?,
                };
                scaling.check().map_err(named)?;
                Ok(Some(RopeScaling::Llama3(scaling)))
            }
            Some("longrope") => self.long_rope(cx).map(Some),
            Some("su" | "yarn") if cx.phi3_names => self.long_rope(cx).map(Some),
            Some(other) => Err(self.err(format!(
                "{}rope_type `{other}` (RoPE scaling) is not supported; only plain RoPE (`default`), `llama3` and \
                 `longrope` are",
                self.prefix
            ))),
        }
    }

    /// LongRoPE's factors from this object, as `transformers`'
    /// `_compute_longrope_parameters` resolves them: the original context
    /// from the top level when [`RopeContext`] has one, else this object's,
    /// else `max_position_embeddings`; `factor`, when absent, the context
    /// over the original one; the attention factor, when absent,
    /// `√(1 + ln factor / ln original)` (1 for a factor up to 1).
    fn long_rope(&self, cx: &RopeContext) -> Result<RopeScaling> {
        let short_factor = self.f64s_opt("short_factor")?.ok_or_else(|| self.missing("short_factor"))?;
        let long_factor = self.f64s_opt("long_factor")?.ok_or_else(|| self.missing("long_factor"))?;
        let original = match cx.original_positions {
            Some(original) => original,
            None => self.usize_opt("original_max_position_embeddings")?.unwrap_or(cx.positions),
        };
        if original == 0 {
            return Err(self.err("longrope RoPE scaling needs a positive original_max_position_embeddings"));
        }
        let factor = match self.f64_opt("factor")? {
            Some(factor) => factor,
            None => cx.positions as f64 / original as f64,
        };
        let attention_factor = match self.f64_opt("attention_factor")? {
            Some(a) => a,
            None if factor <= 1.0 => 1.0,
            None => (1.0 + factor.ln() / (original as f64).ln()).sqrt(),
        };
        Ok(RopeScaling::LongRope(LongRope {
            short_factor,
            long_factor,
            original_max_position_embeddings: original,
            attention_factor,
        }))
    }

    /// The RoPE base, the rotated fraction of each head and the frequency
    /// scaling (Llama-3.x or LongRoPE), refusing any other RoPE scaling.
    /// `transformers` 5 keeps all three in a `rope_parameters` object;
    /// older versions use top-level keys, tried in the order of `base_keys`
    /// and `fraction_keys`, and a `rope_scaling` object. `defaults` holds
    /// the family's defaults for what LongRoPE reads outside its object.
    pub fn rope(
        &self,
        base_keys: &[&str],
        fraction_keys: &[&str],
        default_fraction: f64,
        defaults: RopeDefaults,
    ) -> Result<(f64, f64, Option<RopeScaling>)> {
        let cx = RopeContext {
            positions: self.usize_opt("max_position_embeddings")?.unwrap_or(defaults.positions),
            original_positions: self.usize_opt("original_max_position_embeddings")?.or(defaults.original_positions),
            phi3_names: defaults.phi3_names,
        };
        let mut base = None;
        let mut fraction = None;
        let mut scaling = None;
        if let Some(params) = self.nested("rope_parameters", "rope_parameters.")? {
            scaling = params.rope_variant(&cx)?;
            base = params.f64_opt("rope_theta")?;
            fraction = params.f64_opt("partial_rotary_factor")?;
        }
        if let Some(old) = self.nested("rope_scaling", "rope_scaling.")? {
            // A non-null `rope_scaling` that does not say which kind it is
            // still changes RoPE somehow; refuse it rather than guess.
            if old.get("rope_type").is_none() && old.get("type").is_none() {
                if !old.obj.is_empty() {
                    return Err(self.err(
                        "rope_scaling is set but names no rope_type; only plain RoPE, `llama3` and `longrope` \
                         scaling are supported",
                    ));
                }
            } else if let Some(old_scaling) = old.rope_variant(&cx)? {
                if scaling.as_ref().is_some_and(|s| *s != old_scaling) {
                    return Err(self.err("rope_scaling and rope_parameters give different RoPE scaling"));
                }
                scaling = Some(old_scaling);
            }
        }
        // The first key present wins.
        for key in base_keys {
            base = base.or(self.f64_opt(key)?);
        }
        for key in fraction_keys {
            fraction = fraction.or(self.f64_opt(key)?);
        }
        Ok((base.unwrap_or(10000.0), fraction.unwrap_or(default_fraction), scaling))
    }

    /// `max_position_embeddings`, shortened to the sliding window when one
    /// applies: within a block no longer than the window, sliding-window
    /// attention is plain causal attention, which is what litgpt does for
    /// Mistral-7B-v0.1 (block 4096). The families whose windows the model
    /// computes (Mistral, Gemma) read the window into
    /// [`Config::sliding_window`] instead; Qwen2, Qwen3 and Phi-3 still
    /// shorten their block.
    pub fn block_size(&self, default_positions: usize, sliding: bool) -> Result<usize> {
        let positions = self.usize_opt("max_position_embeddings")?.unwrap_or(default_positions);
        let window = if sliding { self.usize_opt("sliding_window")? } else { None };
        Ok(window.map_or(positions, |window| positions.min(window)))
    }

    /// `hidden_size / num_attention_heads`, refusing a width the heads do
    /// not divide (which would leave a head size of 0 for more heads than
    /// the width); a zero `n_head` is reported by `validate`.
    pub fn head_size(&self, n_embd: usize, n_head: usize) -> Result<usize> {
        match n_embd.checked_rem(n_head) {
            Some(r) if r != 0 => {
                Err(self.err(format!("hidden_size {n_embd} is not divisible by num_attention_heads {n_head}")))
            }
            _ => Ok(n_embd.checked_div(n_head).unwrap_or(0)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models::config::tests::{config_reason, named};
    use crate::models::config::{MlpKind, Overrides, SlidingLayers};

    const LLAMA_2_7B_JSON: &str = r#"{
      "architectures": ["LlamaForCausalLM"],
      "bos_token_id": 1,
      "eos_token_id": 2,
      "hidden_act": "silu",
      "hidden_size": 4096,
      "initializer_range": 0.02,
      "intermediate_size": 11008,
      "max_position_embeddings": 4096,
      "model_type": "llama",
      "num_attention_heads": 32,
      "num_hidden_layers": 32,
      "num_key_value_heads": 32,
      "pretraining_tp": 1,
      "rms_norm_eps": 1e-05,
      "rope_scaling": null,
      "tie_word_embeddings": false,
      "torch_dtype": "float16",
      "transformers_version": "4.31.0.dev0",
      "use_cache": true,
      "vocab_size": 32000
    }"#;

    const LLAMA_3_8B_JSON: &str = r#"{
      "architectures": ["LlamaForCausalLM"],
      "attention_bias": false,
      "attention_dropout": 0.0,
      "bos_token_id": 128000,
      "eos_token_id": 128001,
      "hidden_act": "silu",
      "hidden_size": 4096,
      "initializer_range": 0.02,
      "intermediate_size": 14336,
      "max_position_embeddings": 8192,
      "model_type": "llama",
      "num_attention_heads": 32,
      "num_hidden_layers": 32,
      "num_key_value_heads": 8,
      "pretraining_tp": 1,
      "rms_norm_eps": 1e-05,
      "rope_scaling": null,
      "rope_theta": 500000.0,
      "tie_word_embeddings": false,
      "torch_dtype": "bfloat16",
      "transformers_version": "4.40.0.dev0",
      "use_cache": true,
      "vocab_size": 128256
    }"#;

    // The config.json files of Qwen/Qwen2.5-0.5B and meta-llama/Llama-3.2-1B.
    const QWEN2_5_0_5B_JSON: &str = r#"{
      "architectures": ["Qwen2ForCausalLM"],
      "attention_dropout": 0.0,
      "bos_token_id": 151643,
      "eos_token_id": 151643,
      "hidden_act": "silu",
      "hidden_size": 896,
      "initializer_range": 0.02,
      "intermediate_size": 4864,
      "max_position_embeddings": 32768,
      "max_window_layers": 24,
      "model_type": "qwen2",
      "num_attention_heads": 14,
      "num_hidden_layers": 24,
      "num_key_value_heads": 2,
      "rms_norm_eps": 1e-06,
      "rope_theta": 1000000.0,
      "sliding_window": 32768,
      "tie_word_embeddings": true,
      "torch_dtype": "bfloat16",
      "transformers_version": "4.40.1",
      "use_cache": true,
      "use_mrope": false,
      "use_sliding_window": false,
      "vocab_size": 151936
    }"#;
    const LLAMA_3_2_1B_JSON: &str = r#"{
      "architectures": ["LlamaForCausalLM"],
      "attention_bias": false,
      "attention_dropout": 0.0,
      "bos_token_id": 128000,
      "eos_token_id": 128001,
      "head_dim": 64,
      "hidden_act": "silu",
      "hidden_size": 2048,
      "initializer_range": 0.02,
      "intermediate_size": 8192,
      "max_position_embeddings": 131072,
      "mlp_bias": false,
      "model_type": "llama",
      "num_attention_heads": 32,
      "num_hidden_layers": 16,
      "num_key_value_heads": 8,
      "pretraining_tp": 1,
      "rms_norm_eps": 1e-05,
      "rope_scaling": {
        "factor": 32.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3"
      },
      "rope_theta": 500000.0,
      "tie_word_embeddings": true,
      "torch_dtype": "bfloat16",
      "transformers_version": "4.45.0.dev0",
      "use_cache": true,
      "vocab_size": 128256
    }"#;

    const QWEN2_5_7B_JSON: &str = r#"{
      "architectures": ["Qwen2ForCausalLM"],
      "attention_dropout": 0.0,
      "bos_token_id": 151643,
      "eos_token_id": 151643,
      "hidden_act": "silu",
      "hidden_size": 3584,
      "initializer_range": 0.02,
      "intermediate_size": 18944,
      "max_position_embeddings": 131072,
      "max_window_layers": 28,
      "model_type": "qwen2",
      "num_attention_heads": 28,
      "num_hidden_layers": 28,
      "num_key_value_heads": 4,
      "rms_norm_eps": 1e-06,
      "rope_theta": 1000000.0,
      "sliding_window": 131072,
      "tie_word_embeddings": false,
      "torch_dtype": "bfloat16",
      "transformers_version": "4.43.1",
      "use_cache": true,
      "use_mrope": false,
      "use_sliding_window": false,
      "vocab_size": 152064
    }"#;

    /// What `transformers` writes for `Qwen2Config(hidden_size=28,
    /// num_attention_heads=28, num_key_value_heads=4, num_hidden_layers=5,
    /// ...)` saved with `save_pretrained`: no `head_dim`.
    const QWEN2_W2_JSON: &str = r#"{
      "architectures": ["Qwen2ForCausalLM"],
      "attention_dropout": 0.0,
      "bos_token_id": 151643,
      "eos_token_id": 151643,
      "hidden_act": "silu",
      "hidden_size": 28,
      "initializer_range": 0.02,
      "intermediate_size": 18944,
      "layer_types": ["full_attention", "full_attention", "full_attention", "full_attention", "full_attention"],
      "max_position_embeddings": 131072,
      "max_window_layers": 28,
      "model_type": "qwen2",
      "num_attention_heads": 28,
      "num_hidden_layers": 5,
      "num_key_value_heads": 4,
      "rms_norm_eps": 1e-06,
      "rope_scaling": null,
      "rope_theta": 1000000.0,
      "sliding_window": null,
      "tie_word_embeddings": false,
      "torch_dtype": "float32",
      "transformers_version": "4.56.1",
      "use_cache": true,
      "use_sliding_window": false,
      "vocab_size": 152064
    }"#;

    const MISTRAL_7B_JSON: &str = r#"{
      "architectures": ["MistralForCausalLM"],
      "bos_token_id": 1,
      "eos_token_id": 2,
      "hidden_act": "silu",
      "hidden_size": 4096,
      "initializer_range": 0.02,
      "intermediate_size": 14336,
      "max_position_embeddings": 32768,
      "model_type": "mistral",
      "num_attention_heads": 32,
      "num_hidden_layers": 32,
      "num_key_value_heads": 8,
      "rms_norm_eps": 1e-05,
      "rope_theta": 10000.0,
      "sliding_window": 4096,
      "tie_word_embeddings": false,
      "torch_dtype": "bfloat16",
      "transformers_version": "4.34.0.dev0",
      "use_cache": true,
      "vocab_size": 32000
    }"#;

    const PYTHIA_14M_JSON: &str = r#"{
      "architectures": ["GPTNeoXForCausalLM"],
      "bos_token_id": 0,
      "eos_token_id": 0,
      "hidden_act": "gelu",
      "hidden_size": 128,
      "initializer_range": 0.02,
      "intermediate_size": 512,
      "layer_norm_eps": 1e-05,
      "max_position_embeddings": 2048,
      "model_type": "gpt_neox",
      "num_attention_heads": 4,
      "num_hidden_layers": 6,
      "rotary_emb_base": 10000,
      "rotary_pct": 0.25,
      "tie_word_embeddings": false,
      "torch_dtype": "float16",
      "transformers_version": "4.24.0",
      "use_cache": true,
      "use_parallel_residual": true,
      "vocab_size": 50304
    }"#;

    fn from_json(text: &str) -> Result<Config> {
        Config::from_hf_json(text, "test-model")
    }

    /// `text` parsed as JSON with `key` set to `value` (`null` removes it).
    fn edit(text: &str, key: &str, value: Value) -> String {
        let mut json: Value = serde_json::from_str(text).unwrap();
        let obj = json.as_object_mut().unwrap();
        if value.is_null() {
            obj.remove(key);
        } else {
            obj.insert(key.to_string(), value);
        }
        json.to_string()
    }

    #[test]
    fn hf_json_matches_named_configs() {
        let llama2 = Config::from_hf_json(LLAMA_2_7B_JSON, "Llama-2-7b-hf").unwrap();
        assert_eq!(llama2, named("Llama-2-7b-hf"));

        let mistral = Config::from_hf_json(MISTRAL_7B_JSON, "Mistral-7B-v0.1").unwrap();
        assert_eq!(mistral, named("Mistral-7B-v0.1"));

        // config.json only knows the embedding rows, so vocab_size is the
        // padded size; everything else matches litgpt.
        let llama3 = Config::from_hf_json(LLAMA_3_8B_JSON, "Meta-Llama-3-8B").unwrap();
        assert_eq!(llama3, Config { vocab_size: 128256, ..named("Meta-Llama-3-8B") });
        assert_eq!(llama3.param_count(), 8_030_261_248);

        let qwen = Config::from_hf_json(QWEN2_5_7B_JSON, "Qwen2.5-7B").unwrap();
        assert_eq!(qwen, Config { vocab_size: 152064, ..named("Qwen2.5-7B") });
        assert_eq!(qwen.param_count(), 7_615_616_512);

        let qwen_small = Config::from_hf_json(QWEN2_5_0_5B_JSON, "Qwen2.5-0.5B").unwrap();
        assert_eq!(qwen_small, Config { vocab_size: 151936, ..named("Qwen2.5-0.5B") });
        assert_eq!(qwen_small.param_count(), 494_032_768);

        let llama32 = Config::from_hf_json(LLAMA_3_2_1B_JSON, "Llama-3.2-1B").unwrap();
        assert_eq!(llama32, Config { vocab_size: 128256, ..named("Llama-3.2-1B") });
        assert_eq!(llama32.param_count(), 1_235_814_400);

        let pythia = Config::from_hf_json(PYTHIA_14M_JSON, "pythia-14m").unwrap();
        assert_eq!(pythia, Config { vocab_size: 50304, block_size: 2048, ..named("pythia-14m") });
        assert_eq!(pythia.param_count(), 14_067_712);
    }

    #[test]
    fn hf_json_qwen2_w2_geometry() {
        let config = from_json(QWEN2_W2_JSON).unwrap();
        assert_eq!(config.name, "test-model");
        assert_eq!((config.n_embd, config.n_head, config.n_query_groups), (28, 28, 4));
        assert_eq!((config.head_size, config.n_rot(), config.n_layer), (1, 1, 5));
        assert!(config.attn_qkv_bias && !config.bias);
        assert_eq!(config.block_size, 131072);

        let w2 = named("Qwen2.5-7B")
            .with_overrides(&Overrides { n_layer: Some(5), n_embd: Some(28), ..Overrides::default() })
            .unwrap();
        assert_eq!(config.param_count(), w2.param_count());
    }

    #[test]
    fn hf_json_defaults_and_variants() {
        // No num_key_value_heads, rope_theta or tie_word_embeddings: MHA,
        // base 10000, untied; an explicit head_dim wins.
        let minimal = r#"{"model_type": "llama", "vocab_size": 100, "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": null, "head_dim": 32}"#;
        let config = from_json(minimal).unwrap();
        assert_eq!((config.n_query_groups, config.head_size), (4, 32));
        assert_eq!((config.rope_base, config.norm_eps, config.block_size), (10000.0, 1e-6, 2048));
        assert!(!config.tie_embeddings);

        let tied = from_json(&edit(minimal, "tie_word_embeddings", Value::Bool(true))).unwrap();
        assert!(tied.tie_embeddings);

        let biased = edit(&edit(minimal, "attention_bias", Value::Bool(true)), "mlp_bias", Value::Bool(true));
        let biased = from_json(&biased).unwrap();
        assert!(biased.bias && !biased.attn_qkv_bias);

        // transformers 5 keeps the RoPE base under rope_parameters.
        let v5 = edit(minimal, "rope_parameters", serde_json::json!({"rope_type": "default", "rope_theta": 500000.0}));
        assert_eq!(from_json(&v5).unwrap().rope_base, 500000.0);

        let tanh = from_json(&edit(PYTHIA_14M_JSON, "hidden_act", "gelu_new".into())).unwrap();
        assert_eq!(tanh.mlp, MlpKind::Gelu { approximate_tanh: true });
        let sequential = edit(PYTHIA_14M_JSON, "use_parallel_residual", Value::Bool(false));
        assert!(!from_json(&sequential).unwrap().parallel_residual);
        let newer_rope =
            edit(&edit(PYTHIA_14M_JSON, "rotary_pct", Value::Null), "partial_rotary_factor", serde_json::json!(0.5));
        assert_eq!(from_json(&newer_rope).unwrap().n_rot(), 16);
    }

    #[test]
    fn hf_json_llama3_rope_scaling() {
        let llama31 = Llama3Scaling {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192,
        };
        let v4 = edit(
            LLAMA_3_8B_JSON,
            "rope_scaling",
            serde_json::json!({"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192, "rope_type": "llama3"}),
        );
        assert_eq!(from_json(&v4).unwrap().rope_scaling, Some(llama31.into()));
        // transformers 5: everything under rope_parameters, theta included.
        let v5 = edit(
            &edit(LLAMA_3_8B_JSON, "rope_theta", Value::Null),
            "rope_parameters",
            serde_json::json!({"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192, "rope_type": "llama3", "rope_theta": 500000.0}),
        );
        let config = from_json(&v5).unwrap();
        assert_eq!((config.rope_scaling, config.rope_base), (Some(llama31.into()), 500000.0));
        assert_eq!(from_json(LLAMA_3_8B_JSON).unwrap().rope_scaling, None);
    }

    /// A Phi-3.5-mini-shaped `config.json` (48 rotated pairs) with
    /// `rope_scaling` set to `scaling`, and `extra` keys on top.
    fn phi3_longrope_json(model_type: &str, scaling: Value, extra: &[(&str, Value)]) -> String {
        let mut json = serde_json::json!({
            "architectures": ["Phi3ForCausalLM"], "model_type": model_type, "hidden_size": 3072,
            "intermediate_size": 8192, "num_attention_heads": 32, "num_hidden_layers": 32,
            "num_key_value_heads": 32, "vocab_size": 32064, "max_position_embeddings": 131072,
            "original_max_position_embeddings": 4096, "rope_theta": 10000.0, "rms_norm_eps": 1e-5,
            "rope_scaling": scaling,
        });
        for (key, value) in extra {
            if value.is_null() {
                json.as_object_mut().unwrap().remove(*key);
            } else {
                json[*key] = value.clone();
            }
        }
        json.to_string()
    }

    fn long_rope_of(config: &Config) -> LongRope {
        match &config.rope_scaling {
            Some(RopeScaling::LongRope(l)) => l.clone(),
            other => panic!("expected LongRoPE, got {other:?}"),
        }
    }

    #[test]
    fn hf_json_longrope_resolves_as_transformers_does() {
        let short: Vec<f64> = (0..48).map(|i| 1.0 + 0.01 * i as f64).collect();
        let long: Vec<f64> = (0..48).map(|i| 1.0 + 0.5 * i as f64).collect();
        let scaling = |kind: &str| serde_json::json!({"type": kind, "short_factor": short, "long_factor": long});
        // Phi-3.5-mini: the attention factor from 131072 / 4096 = 32.
        let config = from_json(&phi3_longrope_json("phi3", scaling("longrope"), &[])).unwrap();
        let l = long_rope_of(&config);
        assert_eq!((l.short_factor.clone(), l.long_factor.clone()), (short.clone(), long.clone()));
        assert_eq!(l.original_max_position_embeddings, 4096);
        assert_eq!(l.attention_factor, (1.0 + 32f64.ln() / 4096f64.ln()).sqrt());
        assert_eq!((config.n_rot(), config.block_size), (96, 131072));
        // Phi-3's older names for the same scaling.
        for old in ["su", "yarn"] {
            assert_eq!(from_json(&phi3_longrope_json("phi3", scaling(old), &[])).unwrap(), config);
        }
        // An attention factor (and a factor) given wins over the derived one.
        let mut given = scaling("longrope");
        given["attention_factor"] = serde_json::json!(1.25);
        let l = long_rope_of(&from_json(&phi3_longrope_json("phi3", given, &[])).unwrap());
        assert_eq!(l.attention_factor, 1.25);
        let mut given = scaling("longrope");
        given["factor"] = serde_json::json!(16.0);
        let l = long_rope_of(&from_json(&phi3_longrope_json("phi3", given, &[])).unwrap());
        assert_eq!(l.attention_factor, (1.0 + 16f64.ln() / 4096f64.ln()).sqrt());
        // The original context: the top level's; for Phi-3 without one its
        // class default 4096 wins over the object's; for Llama the object's.
        let mut own = scaling("longrope");
        own["original_max_position_embeddings"] = serde_json::json!(2048);
        let no_top = [("original_max_position_embeddings", Value::Null)];
        let phi3 = long_rope_of(&from_json(&phi3_longrope_json("phi3", own.clone(), &no_top)).unwrap());
        assert_eq!(phi3.original_max_position_embeddings, 4096);
        let llama = long_rope_of(&from_json(&phi3_longrope_json("llama", own, &no_top)).unwrap());
        assert_eq!(llama.original_max_position_embeddings, 2048);
        assert_eq!(llama.attention_factor, (1.0 + 64f64.ln() / 2048f64.ln()).sqrt());
        // The same keys in transformers 5's `rope_parameters`.
        let mut v5 = scaling("longrope");
        v5["rope_theta"] = serde_json::json!(10000.0);
        let moved = [("rope_parameters", v5), ("rope_scaling", Value::Null)];
        assert_eq!(from_json(&phi3_longrope_json("phi3", Value::Null, &moved)).unwrap(), config);
    }

    #[test]
    fn hf_json_longrope_errors() {
        let pairs = |n: usize| serde_json::json!(vec![1.0; n]);
        let check = |model_type: &str, scaling: Value, needle: &str| {
            let reason = config_reason(from_json(&phi3_longrope_json(model_type, scaling, &[])));
            assert!(reason.contains(needle), "`{reason}` lacks `{needle}`");
        };
        check(
            "phi3",
            serde_json::json!({"type": "longrope", "short_factor": pairs(47), "long_factor": pairs(48)}),
            "one short_factor per rotated pair (48 for 96 rotated dimensions), got 47",
        );
        check(
            "phi3",
            serde_json::json!({"type": "longrope", "short_factor": pairs(48), "long_factor": [1.0, "x"]}),
            "key `rope_scaling.long_factor` must be an array of numbers",
        );
        check(
            "phi3",
            serde_json::json!({"type": "longrope", "short_factor": pairs(48)}),
            "missing required key `rope_scaling.long_factor`",
        );
        let mut negative = vec![1.0; 48];
        negative[3] = -2.0;
        check(
            "phi3",
            serde_json::json!({"type": "longrope", "short_factor": negative, "long_factor": pairs(48)}),
            "short_factor must be positive finite numbers, got -2",
        );
        // `su` is Phi-3's name only.
        check(
            "llama",
            serde_json::json!({"type": "su", "short_factor": pairs(48), "long_factor": pairs(48)}),
            "rope_type `su` (RoPE scaling) is not supported",
        );
    }

    #[test]
    fn hf_json_errors() {
        let check = |text: &str, needle: &str| {
            let reason = config_reason(from_json(text));
            assert!(reason.contains(needle), "`{reason}` lacks `{needle}`");
        };
        check(&edit(LLAMA_2_7B_JSON, "model_type", "gpt2".into()), "model_type `gpt2` is not supported");
        check(&edit(LLAMA_2_7B_JSON, "model_type", Value::Null), "missing required key `model_type`");
        check(&edit(LLAMA_2_7B_JSON, "hidden_size", Value::Null), "missing required key `hidden_size`");
        check(&edit(PYTHIA_14M_JSON, "num_hidden_layers", Value::Null), "missing required key `num_hidden_layers`");
        check(&edit(LLAMA_2_7B_JSON, "hidden_size", "4096".into()), "key `hidden_size` must be a non-negative integer");
        check(&edit(LLAMA_2_7B_JSON, "hidden_act", "gelu".into()), "hidden_act `gelu` is not supported");
        check(
            &edit(LLAMA_2_7B_JSON, "mlp_bias", Value::Bool(true)),
            "mlp_bias true with attention_bias false is not supported",
        );
        check(
            &edit(LLAMA_2_7B_JSON, "attention_bias", Value::Bool(true)),
            "attention_bias true with mlp_bias false is not supported",
        );
        check(
            &edit(LLAMA_3_8B_JSON, "rope_scaling", serde_json::json!({"factor": 8.0, "rope_type": "llama3"})),
            "missing required key `rope_scaling.low_freq_factor`",
        );
        check(
            &edit(LLAMA_3_8B_JSON, "rope_scaling", serde_json::json!({"factor": 8.0, "rope_type": "yarn"})),
            "rope_scaling.rope_type `yarn` (RoPE scaling) is not supported; only plain RoPE (`default`), `llama3` and `longrope` are",
        );
        check(
            &edit(
                LLAMA_3_8B_JSON,
                "rope_scaling",
                serde_json::json!({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0,
                    "high_freq_factor": 1.0, "original_max_position_embeddings": 8192}),
            ),
            "needs high_freq_factor (1) above low_freq_factor (4)",
        );
        check(&edit(LLAMA_2_7B_JSON, "rope_scaling", serde_json::json!({"factor": 2.0, "type": "linear"})), "`linear`");
        check(
            &edit(PYTHIA_14M_JSON, "hidden_act", "relu".into()),
            "hidden_act `relu` is not supported for model_type `gpt_neox`",
        );
        check(
            &edit(LLAMA_2_7B_JSON, "num_key_value_heads", serde_json::json!(5)),
            "n_head 32 is not divisible by n_query_groups 5",
        );
        check("[1, 2]", "must hold a JSON object");

        assert!(matches!(from_json("{not json"), Err(Error::Json(_))));
    }

    // The config.json files of google/gemma-2-9b and google/gemma-3-1b-pt.
    const GEMMA_2_9B_JSON: &str = r#"{
      "architectures": ["Gemma2ForCausalLM"],
      "attention_bias": false,
      "attention_dropout": 0.0,
      "attn_logit_softcapping": 50.0,
      "bos_token_id": 2,
      "cache_implementation": "hybrid",
      "eos_token_id": 1,
      "final_logit_softcapping": 30.0,
      "head_dim": 256,
      "hidden_act": "gelu_pytorch_tanh",
      "hidden_activation": "gelu_pytorch_tanh",
      "hidden_size": 3584,
      "initializer_range": 0.02,
      "intermediate_size": 14336,
      "max_position_embeddings": 8192,
      "model_type": "gemma2",
      "num_attention_heads": 16,
      "num_hidden_layers": 42,
      "num_key_value_heads": 8,
      "pad_token_id": 0,
      "query_pre_attn_scalar": 224,
      "rms_norm_eps": 1e-06,
      "rope_theta": 10000.0,
      "sliding_window": 4096,
      "sliding_window_size": 4096,
      "torch_dtype": "float32",
      "transformers_version": "4.42.0.dev0",
      "use_cache": true,
      "vocab_size": 256000
    }"#;

    const GEMMA_3_1B_JSON: &str = r#"{
      "architectures": ["Gemma3ForCausalLM"],
      "attention_bias": false,
      "attention_dropout": 0.0,
      "attn_logit_softcapping": null,
      "bos_token_id": 2,
      "cache_implementation": "hybrid",
      "eos_token_id": [1, 106],
      "final_logit_softcapping": null,
      "head_dim": 256,
      "hidden_activation": "gelu_pytorch_tanh",
      "hidden_size": 1152,
      "initializer_range": 0.02,
      "intermediate_size": 6912,
      "max_position_embeddings": 32768,
      "model_type": "gemma3_text",
      "num_attention_heads": 4,
      "num_hidden_layers": 26,
      "num_key_value_heads": 1,
      "pad_token_id": 0,
      "query_pre_attn_scalar": 256,
      "rms_norm_eps": 1e-06,
      "rope_local_base_freq": 10000,
      "rope_scaling": null,
      "rope_theta": 1000000,
      "sliding_window": 512,
      "sliding_window_pattern": 6,
      "torch_dtype": "bfloat16",
      "transformers_version": "4.50.0.dev0",
      "use_cache": true,
      "vocab_size": 262144
    }"#;

    #[test]
    fn gemma_and_mistral_files_match_the_named_configs() {
        let gemma2 = Config::from_hf_json(GEMMA_2_9B_JSON, "gemma-2-9b").unwrap();
        assert_eq!(gemma2, named("gemma-2-9b"));
        let gemma3 = Config::from_hf_json(GEMMA_3_1B_JSON, "gemma-3-1b").unwrap();
        assert_eq!(gemma3, named("gemma-3-1b"));
        // Without `layer_types` or `sliding_window_pattern`, transformers'
        // default patterns: every other layer global, one in six.
        let no_pattern = edit(GEMMA_3_1B_JSON, "sliding_window_pattern", Value::Null);
        assert_eq!(from_json(&no_pattern).unwrap().sliding_layers, SlidingLayers::GlobalEvery(6));
        let listed = edit(
            GEMMA_2_9B_JSON,
            "layer_types",
            serde_json::json!((0..42)
                .map(|l| if l % 2 == 0 { "sliding_attention" } else { "full_attention" })
                .collect::<Vec<_>>()),
        );
        assert_eq!(from_json(&listed).unwrap(), Config { name: "test-model".into(), ..gemma2.clone() });
        let odd: Vec<&str> = (0..42).map(|l| if l == 3 { "full_attention" } else { "sliding_attention" }).collect();
        let odd = from_json(&edit(GEMMA_2_9B_JSON, "layer_types", serde_json::json!(odd))).unwrap();
        assert!(matches!(&odd.sliding_layers, SlidingLayers::Listed(l) if !l[3] && l[4]));

        // `null` turns a default-on setting off; absence keeps the default.
        let uncapped =
            edit(&edit(GEMMA_2_9B_JSON, "final_logit_softcapping", Value::Null), "sliding_window", Value::Null);
        let uncapped = from_json(&uncapped).unwrap();
        assert_eq!((uncapped.final_softcap, uncapped.sliding_window), (Some(30.0), Some(4096)));
        let mut json: Value = serde_json::from_str(GEMMA_2_9B_JSON).unwrap();
        json["final_logit_softcapping"] = Value::Null;
        json["sliding_window"] = Value::Null;
        let off = from_json(&json.to_string()).unwrap();
        assert_eq!((off.final_softcap, off.sliding_window, off.attn_softcap), (None, None, Some(50.0)));

        // transformers 5 keeps Gemma 3's two RoPEs under rope_parameters.
        let mut v5: Value = serde_json::from_str(GEMMA_3_1B_JSON).unwrap();
        for key in ["rope_theta", "rope_local_base_freq", "rope_scaling"] {
            v5.as_object_mut().unwrap().remove(key);
        }
        v5["rope_parameters"] = serde_json::json!({
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}});
        let v5 = from_json(&v5.to_string()).unwrap();
        assert_eq!((v5.rope_base, v5.rope_local_base, v5.rope_linear_factor), (1e6, Some(1e4), Some(8.0)));
        assert_eq!(v5.rope_of(0), (1e4, None));
        assert_eq!(v5.rope_of(5), (1e6, Some(crate::models::config::linear_rope(8.0).into())));

        // Mistral's window applies whatever the block; null is none.
        let mistral = Config::from_hf_json(MISTRAL_7B_JSON, "Mistral-7B-v0.1").unwrap();
        assert_eq!((mistral.block_size, mistral.sliding_window), (32768, Some(4096)));
        assert_eq!(
            from_json(&edit(MISTRAL_7B_JSON, "sliding_window", Value::Null)).unwrap().sliding_window,
            Some(4096)
        );
        let mut json: Value = serde_json::from_str(MISTRAL_7B_JSON).unwrap();
        json["sliding_window"] = Value::Null;
        assert_eq!(from_json(&json.to_string()).unwrap().sliding_window, None);
    }

    #[test]
    fn gemma_and_mistral_settings_without_a_meaning_here_are_refused_by_name() {
        let check = |text: &str, needle: &str| {
            let reason = config_reason(from_json(text));
            assert!(reason.contains(needle), "`{reason}` lacks `{needle}`");
        };
        let image_and_text = serde_json::json!({"model_type": "gemma3", "text_config": {"model_type": "gemma3_text"}});
        check(
            &image_and_text.to_string(),
            "model_type `gemma3` is not supported: it is Gemma 3's image-and-text model",
        );
        check(&image_and_text.to_string(), "`gemma3_text`");
        check(&edit(GEMMA_2_9B_JSON, "attention_bias", Value::Bool(true)), "attention_bias true");
        check(&edit(GEMMA_3_1B_JSON, "use_bidirectional_attention", Value::Bool(true)), "use_bidirectional_attention");
        check(&edit(GEMMA_2_9B_JSON, "hidden_activation", "relu".into()), "hidden_activation `relu` is not supported");
        check(
            &edit(GEMMA_2_9B_JSON, "layer_types", serde_json::json!(["sliding_attention", "full_attention"])),
            "layer_types has 2 entries for num_hidden_layers 42",
        );
        check(
            &edit(GEMMA_3_1B_JSON, "layer_types", serde_json::json!(vec!["chunked_attention"; 26])),
            "layer_types entry `chunked_attention` is not supported",
        );
        check(
            &edit(GEMMA_3_1B_JSON, "rope_scaling", serde_json::json!({"rope_type": "yarn", "factor": 8.0})),
            "rope_type `yarn` (RoPE scaling of the global layers) is not supported",
        );
        check(
            &edit(
                GEMMA_3_1B_JSON,
                "rope_parameters",
                serde_json::json!({"sliding_attention": {"rope_type": "linear", "factor": 2.0}}),
            ),
            "rope_parameters.sliding_attention.rope_type `linear` is not supported",
        );
        check(
            &edit(GEMMA_3_1B_JSON, "rope_parameters", serde_json::json!({"rope_type": "default", "rope_theta": 1e6})),
            "holds one object per layer type",
        );
        check(
            &edit(GEMMA_2_9B_JSON, "rope_parameters", serde_json::json!({"rope_type": "linear", "factor": 2.0})),
            "rope_parameters.rope_type `linear` (RoPE scaling) is not supported",
        );
        check(&edit(GEMMA_2_9B_JSON, "attn_logit_softcapping", serde_json::json!(-1.0)), "attn_logit_softcapping -1");
        check(&edit(GEMMA_3_1B_JSON, "sliding_window_pattern", serde_json::json!(0)), "sliding_window_pattern 0");
        check(&edit(MISTRAL_7B_JSON, "sliding_window", serde_json::json!(0)), "sliding_window 0");
    }

    #[test]
    fn hf_file_reads_a_file_or_directory() {
        let dir = std::env::temp_dir().join(format!("stepgraph-config-test-{}/pythia-14m", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("config.json");
        std::fs::write(&file, PYTHIA_14M_JSON).unwrap();

        let from_file = Config::from_hf_file(&file).unwrap();
        assert_eq!(from_file.name, "pythia-14m");
        assert_eq!(from_file.param_count(), 14_067_712);
        assert_eq!(Config::from_hf_file(&dir).unwrap(), from_file);

        let missing = dir.join("absent.json");
        match Config::from_hf_file(&missing) {
            Err(Error::Io { path, .. }) => assert!(path.ends_with("absent.json"), "{path}"),
            other => panic!("expected Error::Io, got {other:?}"),
        }
        std::fs::remove_dir_all(dir.parent().unwrap()).unwrap();
    }
}
