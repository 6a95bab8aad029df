//! Hugging Face model families, one file each: everything that differs
//! between `model_type`s lives behind the [`Family`] trait, and the list in
//! `for_each_family!` is the only place that names the families.
//!
//! A family owns its `model_type` and `architectures` strings, how it reads
//! a `config.json` into a [`Config`] and writes one back (the keys that are
//! its own; the keys every family shares are written by
//! [`super::hf_dir::hf_config_json`]), which configs its `transformers`
//! class computes ([`Family::holds`]), and the table that maps its tensor
//! names to the trace's parameter names ([`Rule`]), with the layout of any
//! tensor it stores fused ([`Join`]). Reading JSON ([`super::hf`]) and
//! folders and shards ([`super::hf_dir`]) are family-independent and call
//! through the trait.
//!
//! **Invariants.** For every family and every config it holds, writing the
//! config and reading it back gives the same config, and every parameter
//! name maps to a Hugging Face name and back to itself, fused tensors split
//! into the parts they were joined from. The tests at the end of this file
//! are generated from the list, so a new family is checked by them without
//! writing a test.
//!
//! # Adding a family
//!
//! 1. Write `models/family/<name>.rs`: a unit struct implementing
//!    [`Family`] (its strings, `read_config`, `write_config`, `holds`, its
//!    [`Rule`] table when its tensor names are not the trace's, and the
//!    `example` config the generated tests round-trip). A Llama-layout
//!    family reuses the helpers of [`llama`].
//! 2. Add `mod <name>;` below and one line `Variant(<name>::Struct)` to
//!    `for_each_family!`.
//!
//! That is all: [`HfFamily`] gains the variant, `model_type` dispatch and
//! the supported list in error messages include it, saving picks it for the
//! configs it holds, and the round-trip tests cover it. `test_family.rs`
//! (compiled for tests only) is such a family.

use serde_json::{Map, Value};

use super::config::Config;
use super::hf::HfJson;
use crate::error::Result;

mod gemma2;
mod gemma3;
mod gpt_neox;
pub mod llama;
mod mistral;
mod mixtral;
mod olmo2;
mod phi3;
mod qwen2;
mod qwen2_moe;
mod qwen3;
mod qwen3_moe;
#[cfg(test)]
mod test_family;

/// The family list, written once. `for_each_family!(callback)` expands to
/// `callback! { Variant(path::To::FamilyStruct), ... }` with every family
/// in list order, which is the order of the supported list in messages and
/// the order saving tries families in. [`HfFamily`], its dispatch and the
/// per-family tests are generated from it.
macro_rules! for_each_family {
    ($callback:ident) => {
        $callback! {
            Llama(llama::Llama),
            Mistral(mistral::Mistral),
            Qwen2(qwen2::Qwen2),
            Qwen3(qwen3::Qwen3),
            Olmo2(olmo2::Olmo2),
            Phi3(phi3::Phi3),
            Gemma2(gemma2::Gemma2),
            Gemma3(gemma3::Gemma3Text),
            Mixtral(mixtral::Mixtral),
            Qwen2Moe(qwen2_moe::Qwen2Moe),
            Qwen3Moe(qwen3_moe::Qwen3Moe),
            GptNeox(gpt_neox::GptNeox),
            #[cfg(test)]
            TestRenamed(test_family::TestRenamed),
        }
    };
}

/// Declares [`HfFamily`] from the family list, with its dispatch.
macro_rules! family_list {
    ($($(#[$attr:meta])* $variant:ident($ty:path)),* $(,)?) => {
        /// The model families whose folders load and save, by `model_type`:
        /// one variant per [`Family`] in `for_each_family!`.
        #[derive(Copy, Clone, PartialEq, Eq, Debug)]
        pub enum HfFamily {
            $($(#[$attr])* $variant,)*
        }

        impl HfFamily {
            /// Every family, in list order.
            pub const ALL: &'static [HfFamily] = &[$($(#[$attr])* HfFamily::$variant,)*];

            /// The family's definition.
            pub fn family(self) -> &'static dyn Family {
                match self {
                    $($(#[$attr])* HfFamily::$variant => &$ty,)*
                }
            }
        }
    };
}

for_each_family!(family_list);

impl HfFamily {
    /// The family of a `config.json` `model_type`.
    pub fn from_model_type(model_type: &str) -> Option<HfFamily> {
        HfFamily::ALL.iter().copied().find(|f| f.model_type() == model_type)
    }

    /// Why a `model_type` that names no family here is refused, when it is
    /// one people meet beside the supported ones and a reason helps more
    /// than the list (the image-and-text Gemma 3).
    pub fn refusal(model_type: &str) -> Option<&'static str> {
        match model_type {
            "gemma3" => Some(gemma3::MULTIMODAL_REFUSAL),
            _ => None,
        }
    }

    /// The supported `model_type`s, in list order, for messages.
    pub fn supported() -> String {
        HfFamily::ALL.iter().map(|f| f.model_type()).collect::<Vec<_>>().join(", ")
    }

    /// `config.json`'s `model_type`.
    pub fn model_type(self) -> &'static str {
        self.family().model_type()
    }

    /// `config.json`'s `architectures` entry: the class
    /// `AutoModelForCausalLM` instantiates.
    pub fn architecture(self) -> &'static str {
        self.family().architecture()
    }

    /// The family whose `transformers` model computes the network `config`
    /// describes (the first in list order that [`Holds::Chosen`] it), or
    /// why there is none: the reason of the first family that has the
    /// config's kind of network but not this variant of it.
    pub fn of_config(config: &Config) -> std::result::Result<HfFamily, String> {
        let mut reason = None;
        for &f in HfFamily::ALL {
            match f.family().holds(config) {
                Holds::Chosen => return Ok(f),
                Holds::Not(why) => {
                    reason.get_or_insert(why);
                }
                Holds::OnRequest | Holds::Other => {}
            }
        }
        Err(reason.unwrap_or_else(|| {
            format!("no transformers model family has {:?} with the {:?} MLP", config.norm, config.mlp)
        }))
    }

    /// Whether this family's `transformers` class computes `config`'s
    /// network, chosen by default or only on request (a Llama-layout config
    /// saved as `mistral`).
    pub fn can_hold(self, config: &Config) -> bool {
        matches!(self.family().holds(config), Holds::Chosen | Holds::OnRequest)
    }
}

/// Whether a family's `transformers` class computes a config's network.
#[derive(Clone, PartialEq, Eq, Debug)]
pub enum Holds {
    /// It does, and a save picks this family when none is asked for.
    Chosen,
    /// It does, but a save writes this family only when asked to (Mistral
    /// without a window computes what Llama computes; Llama is the
    /// default).
    OnRequest,
    /// The config has this family's kind of network (its norm and MLP) but
    /// a variant the class does not compute: why.
    Not(String),
    /// Another kind of network.
    Other,
}

/// The first feature of `config` that the families of the Llama and
/// GPT-NeoX layouts lack (a window, soft-caps, Gemma's scales and norms,
/// per-layer RoPE), named for a [`Holds::Not`] reason; `None` when it has
/// none of them. A family that writes a config with such a feature left
/// out would save another network.
pub(crate) fn extra_feature(config: &Config) -> Option<&'static str> {
    let features = [
        (config.sliding_window.is_some(), "sliding window"),
        (!config.sliding_layers.is_all(), "split into sliding and global layers"),
        (config.attn_softcap.is_some(), "attention soft-capping"),
        (config.final_softcap.is_some(), "logit soft-capping"),
        (config.attention_scalar.is_some(), "attention scale of its own (query_pre_attn_scalar)"),
        (config.scale_embeddings, "embedding scale"),
        (config.sandwich_norms, "norms both before and after each sublayer"),
        (config.rope_local_base.is_some(), "RoPE base of its own on sliding layers"),
        (config.rope_linear_factor.is_some(), "linear RoPE scaling"),
        (config.moe.is_some(), "mixture of experts"),
    ];
    features.into_iter().find(|(has, _)| *has).map(|(_, what)| what)
}

/// What parameters a family's [`Rule`] table does not list become.
#[derive(Copy, Clone, PartialEq, Eq, Debug)]
pub enum Unlisted {
    /// Stored under the trace's name (the Llama-style families, whose
    /// names the trace's builder uses).
    AsTheyAre,
    /// A parameter no rule names is an error naming the family (`title`),
    /// since its tensor would be written under a name the class ignores.
    Refused { title: &'static str },
}

/// One Hugging Face model family. See the module doc for what it owns and
/// how to add one.
pub trait Family: Sync {
    /// `config.json`'s `model_type`.
    fn model_type(&self) -> &'static str;

    /// `config.json`'s `architectures` entry.
    fn architecture(&self) -> &'static str;

    /// The [`Config`] a `config.json` of this family describes (named
    /// after `hf`'s model, validated by the caller). Missing optional keys
    /// take the defaults of the family's `transformers` config class;
    /// anything a [`Config`] cannot express exactly is an error.
    fn read_config(&self, hf: &HfJson) -> Result<Config>;

    /// Writes the family's own `config.json` keys for `config` (one the
    /// family [`Family::holds`]); the keys every family shares are already
    /// in `keys`.
    fn write_config(&self, config: &Config, keys: &mut ConfigKeys);

    /// Whether the family's `transformers` class computes `config`'s network.
    fn holds(&self, config: &Config) -> Holds;

    /// The family's tensor names against the trace's; empty when they are
    /// the trace's names.
    fn rules(&self) -> &'static [Rule] {
        &[]
    }

    /// What parameters [`Family::rules`] does not list become.
    fn unlisted(&self) -> Unlisted {
        Unlisted::AsTheyAre
    }

    /// Name endings of checkpoint tensors that are buffers, not parameters:
    /// skipped on load.
    fn ignored_suffixes(&self) -> &'static [&'static str] {
        &[".rotary_emb.inv_freq"]
    }

    /// A config of this family with every field its `config.json` carries
    /// set away from the defaults, for the generated round-trip tests.
    #[cfg(test)]
    fn example(&self) -> Config;

    /// The rule that holds the parameter `name`, with the layer number its
    /// `{i}` stands for.
    fn rule_for_param(&self, name: &str) -> Option<(&'static Rule, Option<usize>)> {
        self.rules().iter().find_map(|rule| rule.trace.iter().find_map(|p| match_pattern(p, name)).map(|l| (rule, l)))
    }

    /// The rule that makes the Hugging Face tensor `name`, with its layer.
    fn rule_for_hf(&self, name: &str) -> Option<(&'static Rule, Option<usize>)> {
        self.rules().iter().find_map(|rule| match_pattern(rule.hf, name).map(|l| (rule, l)))
    }

    /// The Hugging Face tensor that holds the parameter `name` (the first
    /// expert's for a parameter stacking experts), or `None` for an
    /// unlisted parameter of a family that refuses those.
    fn hf_name(&self, name: &str) -> Option<String> {
        match self.rule_for_param(name) {
            Some((rule, layer)) if rule.join == Join::Experts => Some(instantiate_expert(rule.hf, layer, 0)),
            Some((rule, layer)) => Some(instantiate(rule.hf, layer)),
            None if self.unlisted() == Unlisted::AsTheyAre => Some(name.to_string()),
            None => None,
        }
    }

    /// The parameters the Hugging Face tensor `name` holds, in the order
    /// its join takes them; an unlisted name is its own parameter.
    fn param_names(&self, name: &str) -> Vec<String> {
        match self.rule_for_hf(name) {
            Some((rule, layer)) => rule.trace.iter().map(|p| instantiate(p, layer)).collect(),
            None => vec![name.to_string()],
        }
    }
}

/// The `config.json` a family writes into: the top-level keys and the
/// `rope_parameters` object (`transformers` 5's home for RoPE settings).
#[derive(Clone, Debug, Default)]
pub struct ConfigKeys {
    pub top: Map<String, Value>,
    pub rope: Map<String, Value>,
}

impl ConfigKeys {
    /// Sets a top-level key.
    pub fn set(&mut self, key: &str, value: Value) {
        self.top.insert(key.to_string(), value);
    }

    /// Sets a key of `rope_parameters`.
    pub fn set_rope(&mut self, key: &str, value: Value) {
        self.rope.insert(key.to_string(), value);
    }
}

/// How the trace parameters of one rule make its Hugging Face tensor.
#[derive(Copy, Clone, PartialEq, Eq, Debug)]
pub enum Join {
    /// One parameter, stored as it is.
    Same,
    /// Parts (q, k and v, `[n_head·d, ...]` each) interleaved per head, as
    /// GPT-NeoX's `query_key_value` is viewed: `[n_head, parts, d, ...]`.
    PerHead,
    /// Parts stacked along the first axis, in order, each its own number
    /// of rows (Phi-3's `qkv_proj` and `gate_up_proj`).
    Rows,
    /// The other way round: one parameter stacking every expert's matrix
    /// along a new first axis (`[experts, ...]`), each expert stored as a
    /// tensor of its own, whose name has `{e}` for the expert's number
    /// (Mixtral's `block_sparse_moe.experts.{e}.w1.weight`).
    Experts,
}

impl Join {
    /// The bytes of the tensor joined from `parts`, in order, as slices of
    /// the parts: the part itself, or for a per-head join head 0 of every
    /// part, then head 1, and so on.
    pub fn chunks<'a>(self, parts: &[&'a [u8]], heads: usize) -> Vec<&'a [u8]> {
        match self {
            // An expert's tensor is its slice of the stack (the caller cuts it).
            Join::Same | Join::Experts => vec![parts[0]],
            Join::Rows => parts.to_vec(),
            Join::PerHead => {
                let block = parts[0].len() / heads;
                (0..heads).flat_map(|h| parts.iter().map(move |part| &part[h * block..][..block])).collect()
            }
        }
    }

    /// The bytes of part `k` of a tensor joined from parts of `sizes`
    /// bytes each, block by block in the part's order: the whole tensor
    /// for [`Join::Same`]; for a per-head join (`[heads, parts, rows, ...]`)
    /// part k of head h is block `h·parts + k`; for a join of rows, the
    /// part's run after the parts before it.
    pub fn part<'a>(self, joined: &'a [u8], heads: usize, sizes: &[usize], k: usize) -> Vec<&'a [u8]> {
        match self {
            Join::Same | Join::Experts => vec![joined],
            Join::PerHead => {
                let parts = sizes.len();
                let block = joined.len() / (heads * parts);
                (0..heads).map(|h| &joined[(h * parts + k) * block..][..block]).collect()
            }
            Join::Rows => {
                let start: usize = sizes[..k].iter().sum();
                vec![&joined[start..][..sizes[k]]]
            }
        }
    }
}

/// One row of a family's name table: a Hugging Face tensor and the trace
/// parameters it holds; `{i}` stands for the layer number and, in the
/// Hugging Face name of a [`Join::Experts`] rule, `{e}` for the expert's.
#[derive(Debug)]
pub struct Rule {
    pub hf: &'static str,
    pub trace: &'static [&'static str],
    pub join: Join,
}

impl Rule {
    /// A tensor that is one parameter (`trace` has one name) under another name.
    pub const fn same(hf: &'static str, trace: &'static [&'static str]) -> Rule {
        Rule { hf, trace, join: Join::Same }
    }
}

/// The layer number if `name` is `pattern` with `{i}` (and `{e}`)
/// replaced by numbers (`Some(None)` for a pattern without `{i}` equal to
/// `name`).
fn match_pattern(pattern: &str, name: &str) -> Option<Option<usize>> {
    match_numbers(pattern, name).map(|(layer, _)| layer)
}

/// The layer (`{i}`) and expert (`{e}`) numbers if `name` is `pattern`
/// with its placeholders replaced by numbers.
pub fn match_numbers(pattern: &str, name: &str) -> Option<(Option<usize>, Option<usize>)> {
    let (mut layer, mut expert) = (None, None);
    let mut rest = name;
    let mut pat = pattern;
    loop {
        let next = ["{i}", "{e}"].iter().filter_map(|p| pat.find(p).map(|at| (at, *p))).min();
        let Some((at, placeholder)) = next else {
            return (rest == pat).then_some((layer, expert));
        };
        rest = rest.strip_prefix(&pat[..at])?;
        let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
        if digits == 0 {
            return None;
        }
        let number = rest[..digits].parse().ok()?;
        if placeholder == "{i}" {
            layer = Some(number);
        } else {
            expert = Some(number);
        }
        rest = &rest[digits..];
        pat = &pat[at + placeholder.len()..];
    }
}

/// `pattern` with `{i}` replaced by `layer`.
pub fn instantiate(pattern: &str, layer: Option<usize>) -> String {
    match layer {
        Some(layer) => pattern.replace("{i}", &layer.to_string()),
        None => pattern.to_string(),
    }
}

/// `pattern` with `{i}` replaced by `layer` and `{e}` by `expert`.
pub fn instantiate_expert(pattern: &str, layer: Option<usize>, expert: usize) -> String {
    instantiate(pattern, layer).replace("{e}", &expert.to_string())
}

/// One test module per family, generated from the list: a family added to
/// it is round-tripped here without a test of its own.
#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::HfFamily;
    use crate::host::HostTensor;
    use crate::ir::DType;
    use crate::models::config::Config;
    use crate::models::gpt::{build_forward, LossKind, ModelSpec};
    use crate::models::hf_dir::{from_hf_tensors, hf_config_json, to_hf_tensors};
    use crate::models::init_params;

    macro_rules! family_tests {
        ($($(#[$attr:meta])* $variant:ident($ty:path)),* $(,)?) => {
            $(
                $(#[$attr])*
                #[allow(non_snake_case)]
                mod $variant {
                    use super::super::HfFamily;

                    #[test]
                    fn config_round_trips() {
                        super::config_round_trips(HfFamily::$variant);
                    }

                    #[test]
                    fn tensor_names_round_trip() {
                        super::tensor_names_round_trip(HfFamily::$variant);
                    }
                }
            )*
        };
    }

    for_each_family!(family_tests);

    /// Reading `config.json` text as `name`.
    fn read(json: &serde_json::Value, name: &str) -> Config {
        Config::from_hf_json(&json.to_string(), name).unwrap_or_else(|e| panic!("{json}: {e}"))
    }

    /// Qwen3's and OLMo 2's `attention_bias` biases the output projection
    /// too, which no config expresses: refused, naming the key.
    #[test]
    fn an_attention_bias_of_qwen3_or_olmo2_is_refused() {
        for family in [HfFamily::Qwen3, HfFamily::Olmo2] {
            let mut json = hf_config_json(&family.family().example(), family, DType::F32, None);
            json["attention_bias"] = serde_json::json!(true);
            let err = Config::from_hf_json(&json.to_string(), "m").unwrap_err().to_string();
            assert!(err.contains("attention_bias true is not supported") && err.contains(family.model_type()), "{err}");
        }
    }

    /// `read(write(c)) == c` for the family's example, written alone and
    /// over every family's `config.json` (whose other keys a save keeps).
    fn config_round_trips(family: HfFamily) {
        let config = family.family().example();
        config.validate().unwrap();
        assert!(family.can_hold(&config), "{family:?} does not hold its own example");

        // The example sets what a file carries away from the defaults, so
        // a key the writer forgets cannot pass unnoticed.
        let bare = serde_json::json!({
            "model_type": family.model_type(), "vocab_size": config.vocab_size,
            "hidden_size": config.n_embd, "intermediate_size": config.intermediate_size,
            "num_hidden_layers": config.n_layer, "num_attention_heads": config.n_head,
        });
        let defaults = read(&bare, &config.name);
        assert_ne!(defaults.norm_eps, config.norm_eps, "{family:?}: norm_eps is the default");
        assert_ne!(defaults.rope_base, config.rope_base, "{family:?}: rope_base is the default");
        assert_ne!(defaults.block_size, config.block_size, "{family:?}: block_size is the default");

        for dtype in [DType::F32, DType::BF16] {
            let json = hf_config_json(&config, family, dtype, None);
            assert_eq!(json["model_type"], family.model_type());
            assert_eq!(json["architectures"][0], family.architecture());
            assert_eq!(read(&json, &config.name), config, "{family:?} as {dtype}");
        }
        for &other in HfFamily::ALL {
            let source = hf_config_json(&other.family().example(), other, DType::F32, None);
            let json = hf_config_json(&config, family, DType::F32, source.as_object());
            assert_eq!(read(&json, &config.name), config, "{family:?} written over a {other:?} config.json");
        }
    }

    /// Every parameter of the example's trace maps to a Hugging Face name
    /// and back to itself, and its values survive the joins and splits.
    fn tensor_names_round_trip(family: HfFamily) {
        let f = family.family();
        let config = f.example();
        let n_head = config.n_head;
        let spec = ModelSpec {
            config: config.clone(),
            batch: 1,
            seq: 4,
            dtype: DType::F32,
            loss: LossKind::CrossEntropy,
            adapters: None,
            documents: false,
        };
        let trace = build_forward(&spec).unwrap();
        let params: BTreeMap<String, HostTensor> = init_params(&trace, 7)
            .into_iter()
            .map(|(v, t)| (trace.value(v).kind.leaf_name().unwrap().to_string(), t))
            .collect();
        assert!(!params.is_empty());
        for name in params.keys() {
            let hf = f.hf_name(name).unwrap_or_else(|| panic!("{family:?}: `{name}` has no Hugging Face name"));
            assert!(f.param_names(&hf).contains(name), "{family:?}: `{name}` -> `{hf}` does not map back");
        }

        let hf = to_hf_tensors(family, &trace, n_head, |name| Ok(params[name].clone())).unwrap();
        let mut hf_names: Vec<&str> = hf.iter().map(|(n, _)| n.as_str()).collect();
        hf_names.sort_unstable();
        hf_names.dedup();
        assert_eq!(hf_names.len(), hf.len(), "{family:?}: two parameters share a Hugging Face tensor");
        for (name, _) in &hf {
            for part in f.param_names(name) {
                // An expert's tensor names its parameter's first expert's tensor but for its number.
                let expected = match f.rule_for_hf(name) {
                    Some((rule, layer)) if rule.join == super::Join::Experts => {
                        super::instantiate_expert(rule.hf, layer, 0)
                    }
                    _ => name.clone(),
                };
                assert_eq!(f.hf_name(&part), Some(expected), "{family:?}: `{name}` -> `{part}`");
            }
        }
        let back: BTreeMap<String, HostTensor> = from_hf_tensors(family, &config, hf).unwrap().into_iter().collect();
        assert_eq!(back, params, "{family:?}: the parameters do not survive the round trip");
    }

    /// A family that says it holds a config writes a `config.json` that
    /// reads back as that config: saving as a family on request never
    /// writes a file that loads as another network.
    #[test]
    fn every_family_round_trips_the_configs_it_holds() {
        for &other in HfFamily::ALL {
            let config = other.family().example();
            for &family in HfFamily::ALL.iter().filter(|f| f.can_hold(&config)) {
                let json = hf_config_json(&config, family, DType::F32, None);
                assert_eq!(read(&json, &config.name), config, "{other:?}'s example saved as {family:?}");
            }
        }
    }

    #[test]
    fn dispatch_and_messages_name_every_family() {
        let supported = HfFamily::supported();
        for &family in HfFamily::ALL {
            assert_eq!(HfFamily::from_model_type(family.model_type()), Some(family));
            assert!(supported.contains(family.model_type()), "{supported}");
        }
        assert_eq!(HfFamily::from_model_type("gpt2"), None);
        let text = serde_json::json!({"model_type": "gpt2"}).to_string();
        let reason = crate::models::config::tests::config_reason(Config::from_hf_json(&text, "m"));
        assert!(reason.contains(&format!("(supported: {supported})")), "{reason}");
    }

    #[test]
    fn saving_picks_one_family_for_each_kind_of_network() {
        for name in ["tiny-llama", "tiny-neox", "Qwen2.5-0.5B"] {
            let config = Config::named(name).unwrap();
            let chosen = HfFamily::of_config(&config).unwrap();
            assert!(chosen.can_hold(&config));
            let json = hf_config_json(&config, chosen, DType::F32, None);
            assert_eq!(read(&json, &config.name), Config { vocab_size: config.padded_vocab_size, ..config.clone() });
        }
        assert_eq!(HfFamily::of_config(&Config::named("Qwen2.5-0.5B").unwrap()), Ok(HfFamily::Qwen2));
        assert_eq!(HfFamily::of_config(&Config::named("tiny-llama").unwrap()), Ok(HfFamily::Llama));
    }
}
