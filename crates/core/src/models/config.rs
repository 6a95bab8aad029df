//! Model configurations for the GPT family that stepgraph trains.
//!
//! This module owns [`Config`], the hyper-parameters of one decoder-only
//! transformer, with the same meaning as litgpt's `Config`: the named
//! configurations (litgpt names and Hugging Face repo ids, plus small ones
//! for tests and demos), command-line style [`Overrides`], validation with
//! messages that name the model and the offending numbers, the exact
//! parameter count of the network a config describes, and reading a Hugging
//! Face `config.json` (`llama`, `mistral`, `qwen2`, `gpt_neox`).
//!
//! It only describes networks; building traces from a config lives elsewhere.

use std::path::Path;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::error::{Error, Result};

/// The normalization used before attention, before the MLP and at the end.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum NormKind {
    /// RMSNorm: a weight, no bias (LLaMA, Mistral, Qwen2).
    RmsNorm,
    /// LayerNorm: a weight and a bias (GPT-NeoX / Pythia).
    LayerNorm,
}

/// The feed-forward block of every layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum MlpKind {
    /// litgpt's `LLaMAMLP`: `down(silu(gate(x)) * up(x))`, three matrices.
    LlamaSwiGlu,
    /// litgpt's `GptNeoxMLP`: `proj(gelu(fc(x)))`, two matrices.
    Gelu {
        /// `true` for the tanh approximation of GELU, `false` for the exact
        /// erf form (what Pythia uses).
        approximate_tanh: bool,
    },
}

/// The hyper-parameters of one GPT-family model, with litgpt's meaning.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Config {
    /// The model's name, used in every error message about it.
    pub name: String,
    /// The longest sequence the model is built for (RoPE cache length).
    pub block_size: usize,
    /// The tokenizer's vocabulary size; token ids are below this.
    pub vocab_size: usize,
    /// Rows of the embedding and of the LM head; litgpt pads the vocabulary
    /// for faster matmuls, so this is at least `vocab_size`.
    pub padded_vocab_size: usize,
    /// Number of transformer blocks.
    pub n_layer: usize,
    /// Width of the residual stream.
    pub n_embd: usize,
    /// Number of query heads.
    pub n_head: usize,
    /// Number of key/value heads: `n_head` for multi-head attention, 1 for
    /// multi-query attention, anything dividing `n_head` for grouped-query.
    pub n_query_groups: usize,
    /// Width of one head; litgpt derives it as `n_embd / n_head` unless the
    /// checkpoint gives it.
    pub head_size: usize,
    /// Hidden width of the MLP.
    pub intermediate_size: usize,
    /// Which normalization every norm layer is.
    pub norm: NormKind,
    /// The epsilon of every norm layer.
    pub norm_eps: f64,
    /// Which feed-forward block every layer has.
    pub mlp: MlpKind,
    /// `x + attn(norm_1(x)) + mlp(norm_2(x))` instead of the sequential
    /// residual (GPT-NeoX).
    pub parallel_residual: bool,
    /// With a parallel residual, feed the MLP from the attention's norm and
    /// have no second norm per layer.
    pub shared_attention_norm: bool,
    /// The fraction of each head's dimensions that RoPE rotates.
    pub rotary_percentage: f64,
    /// RoPE's base (`theta`).
    pub rope_base: f64,
    /// A bias on every linear layer: q/k/v, attention output and the MLP.
    pub bias: bool,
    /// A bias on the q/k/v projections only (Qwen2), when `bias` is false.
    pub attn_qkv_bias: bool,
    /// The LM head shares its weight with the token embedding.
    pub tie_embeddings: bool,
    /// The LM head has a bias.
    pub lm_head_bias: bool,
}

/// Hyper-parameters to replace in a named config, as a command line gives
/// them; `None` keeps the config's value. See [`Config::with_overrides`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Overrides {
    /// Number of transformer blocks.
    pub n_layer: Option<usize>,
    /// Width of the residual stream; `head_size` follows as `n_embd / n_head`.
    pub n_embd: Option<usize>,
    /// Number of query heads; `head_size` follows as `n_embd / n_head`.
    pub n_head: Option<usize>,
    /// Number of key/value heads.
    pub n_query_groups: Option<usize>,
    /// Vocabulary size; sets both `vocab_size` and `padded_vocab_size`.
    pub vocab_size: Option<usize>,
    /// Longest sequence.
    pub block_size: Option<usize>,
    /// Hidden width of the MLP.
    pub intermediate_size: Option<usize>,
}

/// One named config: its litgpt name, its Hugging Face repo id when it has
/// one, and the function that builds it.
struct Named {
    name: &'static str,
    hf_repo: Option<&'static str>,
    build: fn() -> Config,
}

/// Every named config, in the order [`Config::known_names`] lists them.
const NAMED: &[Named] = &[
    Named { name: "open_llama_3b", hf_repo: Some("openlm-research/open_llama_3b"), build: open_llama_3b },
    Named { name: "Llama-2-7b-hf", hf_repo: Some("meta-llama/Llama-2-7b-hf"), build: llama_2_7b_hf },
    Named { name: "Meta-Llama-3-8B", hf_repo: Some("meta-llama/Meta-Llama-3-8B"), build: meta_llama_3_8b },
    Named { name: "Qwen2.5-7B", hf_repo: Some("Qwen/Qwen2.5-7B"), build: qwen2_5_7b },
    Named { name: "Mistral-7B-v0.1", hf_repo: Some("mistralai/Mistral-7B-v0.1"), build: mistral_7b_v0_1 },
    Named { name: "pythia-14m", hf_repo: Some("EleutherAI/pythia-14m"), build: pythia_14m },
    Named { name: "pythia-160m", hf_repo: Some("EleutherAI/pythia-160m"), build: pythia_160m },
    Named { name: "tiny-llama", hf_repo: None, build: tiny_llama },
    Named { name: "tiny-neox", hf_repo: None, build: tiny_neox },
    Named { name: "w3-llama", hf_repo: None, build: w3_llama },
];

/// Extra names that resolve to a named config: litgpt calls Meta's 8B model
/// `Llama-3-8B` while its Hugging Face repo is `Meta-Llama-3-8B`.
const ALIASES: &[(&str, &str)] = &[("Llama-3-8B", "Meta-Llama-3-8B")];

impl Named {
    /// Whether `name` is this config's name, its Hugging Face repo id
    /// (`org/name`) or the repo's name without the org, as litgpt accepts.
    fn matches(&self, name: &str) -> bool {
        if self.name == name {
            return true;
        }
        match self.hf_repo {
            Some(repo) => repo == name || repo.rsplit('/').next() == Some(name),
            None => false,
        }
    }
}

/// The litgpt LLaMA layout every LLaMA-like named config starts from:
/// Llama-2-7B's numbers, sequential residual, RMSNorm, SwiGLU, full RoPE, no
/// bias, untied head.
fn llama_base(name: &str) -> Config {
    Config {
        name: name.to_string(),
        block_size: 4096,
        vocab_size: 32000,
        padded_vocab_size: 32000,
        n_layer: 32,
        n_embd: 4096,
        n_head: 32,
        n_query_groups: 32,
        head_size: 128,
        intermediate_size: 11008,
        norm: NormKind::RmsNorm,
        norm_eps: 1e-5,
        mlp: MlpKind::LlamaSwiGlu,
        parallel_residual: false,
        shared_attention_norm: false,
        rotary_percentage: 1.0,
        rope_base: 10000.0,
        bias: false,
        attn_qkv_bias: false,
        tie_embeddings: false,
        lm_head_bias: false,
    }
}

/// litgpt's defaults for the GPT-NeoX family (Pythia): the 50254-token
/// tokenizer padded to a multiple of 128, LayerNorm, exact-erf GELU MLP of
/// width `4 * n_embd`, parallel residual, RoPE on a quarter of each head,
/// biases everywhere, untied head.
fn neox_base(name: &str, block_size: usize, n_layer: usize, n_embd: usize, n_head: usize) -> Config {
    Config {
        name: name.to_string(),
        block_size,
        vocab_size: 50254,
        padded_vocab_size: 50304,
        n_layer,
        n_embd,
        n_head,
        n_query_groups: n_head,
        head_size: n_embd / n_head,
        intermediate_size: 4 * n_embd,
        norm: NormKind::LayerNorm,
        norm_eps: 1e-5,
        mlp: MlpKind::Gelu { approximate_tanh: false },
        parallel_residual: true,
        shared_attention_norm: false,
        rotary_percentage: 0.25,
        rope_base: 10000.0,
        bias: true,
        attn_qkv_bias: false,
        tie_embeddings: false,
        lm_head_bias: false,
    }
}

fn open_llama_3b() -> Config {
    Config {
        block_size: 2048,
        n_layer: 26,
        n_embd: 3200,
        n_head: 32,
        n_query_groups: 32,
        head_size: 100,
        intermediate_size: 8640,
        norm_eps: 1e-6,
        ..llama_base("open_llama_3b")
    }
}

fn llama_2_7b_hf() -> Config {
    llama_base("Llama-2-7b-hf")
}

fn meta_llama_3_8b() -> Config {
    Config {
        block_size: 8192,
        // litgpt's numbers: 128000 regular tokens, the embedding has 128256
        // rows (the extra 256 are the special tokens).
        vocab_size: 128000,
        padded_vocab_size: 128256,
        n_query_groups: 8,
        intermediate_size: 14336,
        rope_base: 500000.0,
        ..llama_base("Meta-Llama-3-8B")
    }
}

fn qwen2_5_7b() -> Config {
    Config {
        block_size: 131072,
        vocab_size: 151643,
        padded_vocab_size: 152064,
        n_layer: 28,
        n_embd: 3584,
        n_head: 28,
        n_query_groups: 4,
        head_size: 128,
        intermediate_size: 18944,
        norm_eps: 1e-6,
        rope_base: 1000000.0,
        attn_qkv_bias: true,
        ..llama_base("Qwen2.5-7B")
    }
}

fn mistral_7b_v0_1() -> Config {
    Config {
        // The checkpoint uses a 4096-token sliding window; with blocks no
        // longer than the window that is plain causal attention.
        block_size: 4096,
        n_query_groups: 8,
        intermediate_size: 14336,
        ..llama_base("Mistral-7B-v0.1")
    }
}

fn pythia_14m() -> Config {
    neox_base("pythia-14m", 512, 6, 128, 4)
}

fn pythia_160m() -> Config {
    neox_base("pythia-160m", 2048, 12, 768, 12)
}

fn tiny_llama() -> Config {
    Config {
        block_size: 256,
        vocab_size: 256,
        padded_vocab_size: 256,
        n_layer: 2,
        n_embd: 64,
        n_head: 4,
        n_query_groups: 2,
        head_size: 16,
        intermediate_size: 128,
        ..llama_base("tiny-llama")
    }
}

fn tiny_neox() -> Config {
    Config { vocab_size: 256, padded_vocab_size: 256, ..neox_base("tiny-neox", 256, 2, 64, 4) }
}

/// Benchmark workload W3: a two-layer LLaMA 256 wide.
fn w3_llama() -> Config {
    Config {
        block_size: 2048,
        n_layer: 2,
        n_embd: 256,
        n_head: 4,
        n_query_groups: 4,
        head_size: 64,
        intermediate_size: 688,
        norm_eps: 1e-6,
        ..llama_base("w3-llama")
    }
}

/// Whether `divisor` divides `n` exactly (false for a zero divisor).
///
/// `checked_rem` rather than `usize::is_multiple_of`, which needs Rust 1.87
/// while the workspace declares 1.85.
fn divides(divisor: usize, n: usize) -> bool {
    n.checked_rem(divisor) == Some(0)
}

/// An [`Error::Config`] about `model`.
fn config_error(model: &str, reason: impl Into<String>) -> Error {
    Error::Config { model: model.to_string(), reason: reason.into() }
}

impl Config {
    /// The config called `name`: a litgpt name (`open_llama_3b`,
    /// `Llama-2-7b-hf`, `Meta-Llama-3-8B` (litgpt's `Llama-3-8B` works too),
    /// `Qwen2.5-7B`, `Mistral-7B-v0.1`, `pythia-14m`, `pythia-160m`), a
    /// Hugging Face repo id such as `Qwen/Qwen2.5-7B`, or one of the small
    /// configs `tiny-llama`, `tiny-neox` and `w3-llama`.
    ///
    /// Any other name gives [`Error::UnknownModel`] listing the known names.
    pub fn named(name: &str) -> Result<Config> {
        let target = ALIASES.iter().find(|(alias, _)| *alias == name).map_or(name, |(_, canonical)| *canonical);
        NAMED
            .iter()
            .find(|named| named.matches(target))
            .map(|named| (named.build)())
            .ok_or_else(|| Error::UnknownModel { name: name.to_string(), known: Self::known_names().join(", ") })
    }

    /// The names of every named config, in a stable order. Their Hugging
    /// Face repo ids are accepted by [`Config::named`] as well.
    pub fn known_names() -> Vec<&'static str> {
        NAMED.iter().map(|named| named.name).collect()
    }

    /// How many dimensions of each head RoPE rotates: litgpt's
    /// `rope_n_elem`, `floor(rotary_percentage * head_size)`.
    pub fn n_rot(&self) -> usize {
        // Truncation is the floor here: validated configs have a
        // non-negative `rotary_percentage`.
        (self.rotary_percentage * self.head_size as f64) as usize
    }

    /// This config with `overrides` applied, then validated.
    ///
    /// Follows litgpt, where an override replaces the value before the
    /// derived fields are computed:
    /// - `vocab_size` sets both `vocab_size` and `padded_vocab_size`;
    /// - a new `n_embd` or `n_head` recomputes `head_size = n_embd / n_head`;
    /// - without an explicit `n_query_groups`, a multi-head-attention model
    ///   (`n_query_groups == n_head`) stays multi-head with the new `n_head`,
    ///   and a grouped-query model keeps its number of groups;
    /// - without an explicit `intermediate_size`, a GELU MLP whose width was
    ///   litgpt's derived `4 * n_embd` follows a new `n_embd`.
    pub fn with_overrides(mut self, overrides: &Overrides) -> Result<Config> {
        let old_n_embd = self.n_embd;
        let was_mha = self.n_query_groups == self.n_head;
        let gelu_derived_width = matches!(self.mlp, MlpKind::Gelu { .. }) && self.intermediate_size == 4 * old_n_embd;

        if let Some(n_layer) = overrides.n_layer {
            self.n_layer = n_layer;
        }
        if let Some(block_size) = overrides.block_size {
            self.block_size = block_size;
        }
        if let Some(vocab_size) = overrides.vocab_size {
            self.vocab_size = vocab_size;
            self.padded_vocab_size = vocab_size;
        }
        if let Some(n_embd) = overrides.n_embd {
            self.n_embd = n_embd;
        }
        if let Some(n_head) = overrides.n_head {
            self.n_head = n_head;
        }
        if overrides.n_embd.is_some() || overrides.n_head.is_some() {
            // A zero `n_head` or an `n_embd` it does not divide is reported
            // by `validate` below, naming both numbers.
            if let Some(head_size) = self.n_embd.checked_div(self.n_head) {
                self.head_size = head_size;
            }
        }
        self.n_query_groups = match overrides.n_query_groups {
            Some(groups) => groups,
            None if was_mha => self.n_head,
            None => self.n_query_groups,
        };
        self.intermediate_size = match overrides.intermediate_size {
            Some(width) => width,
            None if gelu_derived_width => 4 * self.n_embd,
            None => self.intermediate_size,
        };
        self.validate()?;
        Ok(self)
    }

    /// Checks that this config describes a network that can be built, with
    /// an [`Error::Config`] naming the model and the numbers otherwise.
    pub fn validate(&self) -> Result<()> {
        let fail = |reason: String| Err(config_error(&self.name, reason));
        let dims = [
            ("block_size", self.block_size),
            ("vocab_size", self.vocab_size),
            ("padded_vocab_size", self.padded_vocab_size),
            ("n_layer", self.n_layer),
            ("n_embd", self.n_embd),
            ("n_head", self.n_head),
            ("n_query_groups", self.n_query_groups),
            ("head_size", self.head_size),
            ("intermediate_size", self.intermediate_size),
        ];
        // Zero dimensions first: the divisibility checks below divide by them.
        if let Some((what, _)) = dims.iter().find(|(_, value)| *value == 0) {
            return fail(format!("{what} must be positive, got 0"));
        }
        if !divides(self.n_head, self.n_embd) {
            return fail(format!("n_embd {} is not divisible by n_head {}", self.n_embd, self.n_head));
        }
        if !divides(self.n_query_groups, self.n_head) {
            return fail(format!("n_head {} is not divisible by n_query_groups {}", self.n_head, self.n_query_groups));
        }
        if !(self.rotary_percentage.is_finite() && self.rotary_percentage >= 0.0) {
            return fail(format!("rotary_percentage must be a finite number >= 0, got {}", self.rotary_percentage));
        }
        if self.n_rot() > self.head_size {
            return fail(format!(
                "rotary_percentage {} gives n_rot {}, more than head_size {}",
                self.rotary_percentage,
                self.n_rot(),
                self.head_size
            ));
        }
        // An odd rotary dimension only has a defined meaning (litgpt's and
        // Hugging Face's broadcast of one rotated component) when it is the
        // whole head: head size 1.
        let n_rot = self.n_rot();
        if n_rot % 2 == 1 && !(n_rot == 1 && self.head_size == 1) {
            return fail(format!(
                "rotary_percentage {} gives an odd rotary dimension n_rot {} for head_size {}; \
                 rotary embeddings need an even n_rot (or head_size 1)",
                self.rotary_percentage, n_rot, self.head_size
            ));
        }
        if self.vocab_size > self.padded_vocab_size {
            return fail(format!(
                "vocab_size {} is larger than padded_vocab_size {}",
                self.vocab_size, self.padded_vocab_size
            ));
        }
        // Written as negations so that NaN fails too.
        if !(self.norm_eps.is_finite() && self.norm_eps > 0.0) {
            return fail(format!("norm_eps must be a finite number > 0, got {}", self.norm_eps));
        }
        if !(self.rope_base.is_finite() && self.rope_base > 0.0) {
            return fail(format!("rope_base must be a finite number > 0, got {}", self.rope_base));
        }
        // litgpt refuses this combination too: without a parallel residual
        // the MLP's input is not the attention's input, so it needs its own
        // norm.
        if self.shared_attention_norm && !self.parallel_residual {
            return fail(
                "shared_attention_norm needs parallel_residual (a sequential block has no shared input to normalize once)"
                    .to_string(),
            );
        }
        Ok(())
    }

    /// The number of trainable parameters of the network this config
    /// describes, counting every weight and bias once (a tied LM head shares
    /// the embedding's weight).
    pub fn param_count(&self) -> u64 {
        let embd = self.n_embd as u64;
        let vocab = self.padded_vocab_size as u64;
        let hidden = self.intermediate_size as u64;
        let q_width = (self.n_head * self.head_size) as u64;
        let kv_width = (self.n_query_groups * self.head_size) as u64;
        let qkv_width = q_width + 2 * kv_width;

        let norm = match self.norm {
            NormKind::RmsNorm => embd,
            NormKind::LayerNorm => 2 * embd,
        };
        let norms_per_layer = if self.shared_attention_norm { 1 } else { 2 };

        let mut attention = embd * qkv_width + q_width * embd;
        if self.bias || self.attn_qkv_bias {
            attention += qkv_width;
        }
        if self.bias {
            attention += embd;
        }

        let mlp = match self.mlp {
            MlpKind::LlamaSwiGlu => {
                let biases = if self.bias { 2 * hidden + embd } else { 0 };
                3 * embd * hidden + biases
            }
            MlpKind::Gelu { .. } => {
                let biases = if self.bias { hidden + embd } else { 0 };
                2 * embd * hidden + biases
            }
        };

        let layer = norms_per_layer * norm + attention + mlp;
        let head_weight = if self.tie_embeddings { 0 } else { vocab * embd };
        // Tying shares the weight only; litgpt's head bias stays its own.
        let head_bias = if self.lm_head_bias { vocab } else { 0 };

        vocab * embd + self.n_layer as u64 * layer + norm + head_weight + head_bias
    }

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
        Self::from_hf_json(&text, &name)
    }

    /// Parses the text of a Hugging Face `config.json` into a validated
    /// config called `name`.
    ///
    /// Supports `model_type` `llama`, `mistral`, `qwen2` (LLaMA layout; Qwen2
    /// adds q/k/v biases) and `gpt_neox`. Missing optional keys take the
    /// defaults of the matching `transformers` config class. Since
    /// `config.json` does not give the tokenizer's size, `vocab_size` and
    /// `padded_vocab_size` are both its `vocab_size` (the embedding rows).
    ///
    /// Anything this config cannot express exactly (another activation, RoPE
    /// scaling, a bias layout other than the supported ones) is an
    /// [`Error::Config`] rather than a silently different network.
    pub fn from_hf_json(text: &str, name: &str) -> Result<Config> {
        let value: Value = serde_json::from_str(text)?;
        let Some(obj) = value.as_object() else {
            return Err(config_error(name, "config.json must hold a JSON object"));
        };
        let hf = HfJson { model: name, prefix: "", obj };
        let model_type = hf.str_req("model_type")?;
        let config = match model_type {
            "llama" | "mistral" | "qwen2" => hf.llama_like(model_type)?,
            "gpt_neox" => hf.gpt_neox()?,
            other => {
                return Err(hf.err(format!(
                    "model_type `{other}` is not supported (supported: llama, mistral, qwen2, gpt_neox)"
                )))
            }
        };
        config.validate()?;
        Ok(config)
    }
}

/// A JSON object from a `config.json` (or an object nested in it), with
/// typed getters whose errors name the model and the key.
struct HfJson<'a> {
    model: &'a str,
    /// `"rope_scaling."` and the like for nested objects, for messages.
    prefix: &'a str,
    obj: &'a Map<String, Value>,
}

impl<'a> HfJson<'a> {
    fn err(&self, reason: impl Into<String>) -> Error {
        config_error(self.model, reason)
    }

    /// The value of `key`; `null` counts as absent, as `transformers` writes
    /// `null` for unset optional fields.
    fn get(&self, key: &str) -> Option<&'a Value> {
        self.obj.get(key).filter(|value| !value.is_null())
    }

    fn wrong_type(&self, key: &str, expected: &str, value: &Value) -> Error {
        self.err(format!("key `{}{key}` must be {expected}, got {value}", self.prefix))
    }

    fn missing(&self, key: &str) -> Error {
        self.err(format!("missing required key `{}{key}`", self.prefix))
    }

    fn usize_opt(&self, key: &str) -> Result<Option<usize>> {
        let Some(value) = self.get(key) else {
            return Ok(None);
        };
        value
            .as_u64()
            .and_then(|n| usize::try_from(n).ok())
            .map(Some)
            .ok_or_else(|| self.wrong_type(key, "a non-negative integer", value))
    }

    fn usize_req(&self, key: &str) -> Result<usize> {
        self.usize_opt(key)?.ok_or_else(|| self.missing(key))
    }

    fn f64_opt(&self, key: &str) -> Result<Option<f64>> {
        let Some(value) = self.get(key) else {
            return Ok(None);
        };
        value.as_f64().map(Some).ok_or_else(|| self.wrong_type(key, "a number", value))
    }

    fn bool_opt(&self, key: &str) -> Result<Option<bool>> {
        let Some(value) = self.get(key) else {
            return Ok(None);
        };
        value.as_bool().map(Some).ok_or_else(|| self.wrong_type(key, "true or false", value))
    }

    fn str_opt(&self, key: &str) -> Result<Option<&'a str>> {
        let Some(value) = self.get(key) else {
            return Ok(None);
        };
        value.as_str().map(Some).ok_or_else(|| self.wrong_type(key, "a string", value))
    }

    fn str_req(&self, key: &str) -> Result<&'a str> {
        self.str_opt(key)?.ok_or_else(|| self.missing(key))
    }

    /// The object under `key`, with `prefix` naming it in messages.
    fn nested(&self, key: &str, prefix: &'a str) -> Result<Option<HfJson<'a>>> {
        let Some(value) = self.get(key) else {
            return Ok(None);
        };
        let obj = value.as_object().ok_or_else(|| self.wrong_type(key, "an object", value))?;
        Ok(Some(HfJson { model: self.model, prefix, obj }))
    }

    /// Refuses a RoPE variant other than plain RoPE: `rope_type` (or the
    /// older `type`) must be absent or `default`.
    fn check_plain_rope(&self) -> Result<()> {
        let kind = match self.str_opt("rope_type")? {
            Some(kind) => Some(kind),
            None => self.str_opt("type")?,
        };
        match kind {
            None | Some("default") => Ok(()),
            Some(other) => Err(self.err(format!(
                "{}rope_type `{other}` (RoPE scaling) is not supported; only plain RoPE is",
                self.prefix
            ))),
        }
    }

    /// The RoPE base and the rotated fraction of each head, refusing any RoPE
    /// scaling. `transformers` 5 keeps both in a `rope_parameters` object;
    /// older versions use top-level keys, tried in the order of
    /// `base_keys` and `fraction_keys`.
    fn rope(&self, base_keys: &[&str], fraction_keys: &[&str], default_fraction: f64) -> Result<(f64, f64)> {
        let mut base = None;
        let mut fraction = None;
        if let Some(params) = self.nested("rope_parameters", "rope_parameters.")? {
            params.check_plain_rope()?;
            base = params.f64_opt("rope_theta")?;
            fraction = params.f64_opt("partial_rotary_factor")?;
        }
        if let Some(scaling) = self.nested("rope_scaling", "rope_scaling.")? {
            // A non-null `rope_scaling` that does not say which kind it is
            // still changes RoPE somehow; refuse it rather than guess.
            if scaling.get("rope_type").is_none() && scaling.get("type").is_none() {
                if !scaling.obj.is_empty() {
                    return Err(self.err("rope_scaling is set but names no rope_type; RoPE scaling is not supported"));
                }
            } else {
                scaling.check_plain_rope()?;
            }
        }
        // The first key present wins.
        for key in base_keys {
            base = base.or(self.f64_opt(key)?);
        }
        for key in fraction_keys {
            fraction = fraction.or(self.f64_opt(key)?);
        }
        Ok((base.unwrap_or(10000.0), fraction.unwrap_or(default_fraction)))
    }

    /// `max_position_embeddings`, shortened to the sliding window when one
    /// applies: within a block no longer than the window, sliding-window
    /// attention is plain causal attention, which is what litgpt does for
    /// Mistral-7B-v0.1 (block 4096).
    fn block_size(&self, default_positions: usize, sliding: bool) -> Result<usize> {
        let positions = self.usize_opt("max_position_embeddings")?.unwrap_or(default_positions);
        let window = if sliding { self.usize_opt("sliding_window")? } else { None };
        Ok(window.map_or(positions, |window| positions.min(window)))
    }

    /// `llama`, `mistral` and `qwen2`: RMSNorm, SwiGLU, sequential residual.
    fn llama_like(&self, model_type: &str) -> Result<Config> {
        let n_embd = self.usize_req("hidden_size")?;
        let n_head = self.usize_req("num_attention_heads")?;
        let vocab_size = self.usize_req("vocab_size")?;
        let act = self.str_opt("hidden_act")?.unwrap_or("silu");
        if act != "silu" {
            return Err(self.err(format!(
                "hidden_act `{act}` is not supported for model_type `{model_type}`; only `silu` (the SwiGLU MLP) is"
            )));
        }

        let (bias, attn_qkv_bias) = match model_type {
            // Qwen2 always has q/k/v biases and no others.
            "qwen2" => (false, true),
            // In `transformers`, Llama's `attention_bias` covers q/k/v and the
            // output projection and `mlp_bias` the three MLP matrices; only
            // both together match this config's all-linear `bias`.
            "llama" => {
                let attention_bias = self.bool_opt("attention_bias")?.unwrap_or(false);
                let mlp_bias = self.bool_opt("mlp_bias")?.unwrap_or(false);
                match (attention_bias, mlp_bias) {
                    (false, false) => (false, false),
                    (true, true) => (true, false),
                    (true, false) => {
                        return Err(self.err(
                            "attention_bias true with mlp_bias false is not supported (it biases q/k/v and o_proj but not the MLP)",
                        ))
                    }
                    (false, true) => {
                        return Err(self.err(
                            "mlp_bias true with attention_bias false is not supported (it biases the MLP but not attention)",
                        ))
                    }
                }
            }
            _ => (false, false),
        };

        // transformers' defaults for max_position_embeddings and whether the
        // sliding window is in use.
        let (default_positions, sliding) = match model_type {
            "mistral" => (4096 * 32, true),
            "qwen2" => (32768, self.bool_opt("use_sliding_window")?.unwrap_or(false)),
            _ => (2048, false),
        };
        let (rope_base, rotary_percentage) = self.rope(&["rope_theta"], &[], 1.0)?;
        let n_query_groups = self.usize_opt("num_key_value_heads")?.unwrap_or(n_head);
        let head_size = match self.usize_opt("head_dim")? {
            Some(head_dim) => head_dim,
            // A zero `n_head` is reported by `validate`.
            None => n_embd.checked_div(n_head).unwrap_or(0),
        };

        Ok(Config {
            name: self.model.to_string(),
            block_size: self.block_size(default_positions, sliding)?,
            vocab_size,
            padded_vocab_size: vocab_size,
            n_layer: self.usize_req("num_hidden_layers")?,
            n_embd,
            n_head,
            n_query_groups,
            head_size,
            intermediate_size: self.usize_req("intermediate_size")?,
            norm: NormKind::RmsNorm,
            norm_eps: self.f64_opt("rms_norm_eps")?.unwrap_or(1e-6),
            mlp: MlpKind::LlamaSwiGlu,
            parallel_residual: false,
            shared_attention_norm: false,
            rotary_percentage,
            rope_base,
            bias,
            attn_qkv_bias,
            tie_embeddings: self.bool_opt("tie_word_embeddings")?.unwrap_or(false),
            lm_head_bias: false,
        })
    }

    /// `gpt_neox` (Pythia): LayerNorm, GELU MLP, biases everywhere.
    fn gpt_neox(&self) -> Result<Config> {
        let n_embd = self.usize_req("hidden_size")?;
        let n_head = self.usize_req("num_attention_heads")?;
        let vocab_size = self.usize_req("vocab_size")?;
        let approximate_tanh = match self.str_opt("hidden_act")?.unwrap_or("gelu") {
            "gelu" => false,
            "gelu_new" | "gelu_pytorch_tanh" => true,
            other => {
                return Err(self.err(format!(
                    "hidden_act `{other}` is not supported for model_type `gpt_neox`; only `gelu`, `gelu_new` and `gelu_pytorch_tanh` are"
                )))
            }
        };
        if !self.bool_opt("attention_bias")?.unwrap_or(true) {
            return Err(self.err(
                "attention_bias false is not supported for gpt_neox (its MLP keeps biases, and this config biases all linears or none)",
            ));
        }
        // Older configs say `rotary_emb_base`/`rotary_pct`, newer ones
        // `rope_theta`/`partial_rotary_factor`.
        let (rope_base, rotary_percentage) =
            self.rope(&["rope_theta", "rotary_emb_base"], &["partial_rotary_factor", "rotary_pct"], 0.25)?;

        Ok(Config {
            name: self.model.to_string(),
            block_size: self.block_size(2048, false)?,
            vocab_size,
            padded_vocab_size: vocab_size,
            n_layer: self.usize_req("num_hidden_layers")?,
            n_embd,
            n_head,
            // GPT-NeoX has no grouped-query attention.
            n_query_groups: n_head,
            head_size: n_embd.checked_div(n_head).unwrap_or(0),
            intermediate_size: self.usize_req("intermediate_size")?,
            norm: NormKind::LayerNorm,
            norm_eps: self.f64_opt("layer_norm_eps")?.unwrap_or(1e-5),
            mlp: MlpKind::Gelu { approximate_tanh },
            parallel_residual: self.bool_opt("use_parallel_residual")?.unwrap_or(true),
            shared_attention_norm: false,
            rotary_percentage,
            rope_base,
            bias: true,
            attn_qkv_bias: false,
            tie_embeddings: self.bool_opt("tie_word_embeddings")?.unwrap_or(false),
            lm_head_bias: false,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn named(name: &str) -> Config {
        Config::named(name).unwrap()
    }

    /// The `reason` of an [`Error::Config`], failing the test otherwise.
    fn config_reason<T: std::fmt::Debug>(result: Result<T>) -> String {
        match result {
            Err(Error::Config { reason, .. }) => reason,
            other => panic!("expected Error::Config, got {other:?}"),
        }
    }

    #[test]
    fn param_counts_match_the_real_models() {
        let expected: [(&str, u64); 7] = [
            ("open_llama_3b", 3_426_473_600),
            ("Llama-2-7b-hf", 6_738_415_616),
            ("Meta-Llama-3-8B", 8_030_261_248),
            ("Qwen2.5-7B", 7_615_616_512),
            ("Mistral-7B-v0.1", 7_241_732_096),
            ("pythia-14m", 14_067_712),
            ("pythia-160m", 162_322_944),
        ];
        for (name, count) in expected {
            assert_eq!(named(name).param_count(), count, "{name}");
        }
    }

    #[test]
    fn every_named_config_is_valid_and_named() {
        for name in Config::known_names() {
            let config = named(name);
            config.validate().unwrap();
            assert_eq!(config.name, name);
        }
    }

    #[test]
    fn hf_repo_ids_and_aliases_resolve() {
        let pairs = [
            ("openlm-research/open_llama_3b", "open_llama_3b"),
            ("meta-llama/Llama-2-7b-hf", "Llama-2-7b-hf"),
            ("meta-llama/Meta-Llama-3-8B", "Meta-Llama-3-8B"),
            ("Llama-3-8B", "Meta-Llama-3-8B"),
            ("Qwen/Qwen2.5-7B", "Qwen2.5-7B"),
            ("mistralai/Mistral-7B-v0.1", "Mistral-7B-v0.1"),
            ("EleutherAI/pythia-14m", "pythia-14m"),
            ("EleutherAI/pythia-160m", "pythia-160m"),
        ];
        for (id, name) in pairs {
            assert_eq!(named(id), named(name), "{id}");
        }
    }

    #[test]
    fn named_configs_have_the_litgpt_hyper_parameters() {
        let llama3 = named("Meta-Llama-3-8B");
        assert_eq!((llama3.vocab_size, llama3.padded_vocab_size, llama3.block_size), (128000, 128256, 8192));
        assert_eq!((llama3.n_query_groups, llama3.head_size), (8, 128));
        assert_eq!(llama3.rope_base, 500000.0);

        let qwen = named("Qwen2.5-7B");
        assert_eq!((qwen.vocab_size, qwen.padded_vocab_size), (151643, 152064));
        assert!(qwen.attn_qkv_bias && !qwen.bias);
        assert_eq!((qwen.block_size, qwen.norm_eps), (131072, 1e-6));

        let open = named("open_llama_3b");
        assert_eq!((open.head_size, open.norm_eps), (100, 1e-6));

        let pythia = named("pythia-14m");
        assert_eq!((pythia.vocab_size, pythia.padded_vocab_size), (50254, 50304));
        assert_eq!(pythia.intermediate_size, 4 * pythia.n_embd);
        assert_eq!(pythia.mlp, MlpKind::Gelu { approximate_tanh: false });
        assert_eq!((pythia.head_size, pythia.n_rot()), (32, 8));
        assert!(pythia.parallel_residual && pythia.bias && !pythia.tie_embeddings);
    }

    #[test]
    fn small_configs() {
        let tiny = named("tiny-llama");
        assert_eq!((tiny.n_layer, tiny.n_embd, tiny.n_head, tiny.n_query_groups), (2, 64, 4, 2));
        assert_eq!((tiny.head_size, tiny.intermediate_size, tiny.n_rot()), (16, 128, 16));
        assert_eq!((tiny.vocab_size, tiny.padded_vocab_size), (256, 256));
        assert_eq!(tiny.norm, NormKind::RmsNorm);

        let neox = named("tiny-neox");
        assert_eq!((neox.vocab_size, neox.padded_vocab_size), (256, 256));
        assert_eq!((neox.head_size, neox.n_rot(), neox.intermediate_size), (16, 4, 256));
        assert_eq!(neox.norm, NormKind::LayerNorm);
        assert!(neox.parallel_residual && neox.bias && !neox.tie_embeddings);

        let w3 = named("w3-llama");
        assert_eq!((w3.n_layer, w3.n_embd, w3.n_head, w3.head_size), (2, 256, 4, 64));
        assert_eq!((w3.intermediate_size, w3.vocab_size, w3.block_size), (688, 32000, 2048));
        assert_eq!((w3.norm_eps, w3.rope_base), (1e-6, 10000.0));
        // Embedding and head 2 * 32000 * 256, two layers, final norm.
        let layer = 2 * 256 + 4 * 256 * 256 + 3 * 256 * 688;
        assert_eq!(w3.param_count(), 2 * 32000 * 256 + 2 * layer + 256);
    }

    #[test]
    fn unknown_name_lists_known_names() {
        match Config::named("llama-9000") {
            Err(err @ Error::UnknownModel { .. }) => {
                let message = err.to_string();
                assert!(message.contains("llama-9000"), "{message}");
                for name in Config::known_names() {
                    assert!(message.contains(name), "{message} lacks {name}");
                }
            }
            other => panic!("expected UnknownModel, got {other:?}"),
        }
    }

    #[test]
    fn w2_overrides_give_head_size_one() {
        let overrides = Overrides { n_layer: Some(5), n_embd: Some(28), ..Overrides::default() };
        let w2 = named("Qwen2.5-7B").with_overrides(&overrides).unwrap();
        assert_eq!((w2.n_layer, w2.n_embd, w2.n_head), (5, 28, 28));
        assert_eq!((w2.head_size, w2.n_query_groups, w2.n_rot()), (1, 4, 1));
        assert_eq!(w2.intermediate_size, 18944);
        assert_eq!(w2.padded_vocab_size, 152064);
    }

    #[test]
    fn n_layer_override_keeps_the_rest() {
        let overrides = Overrides { n_layer: Some(10), ..Overrides::default() };
        let full = named("open_llama_3b");
        let short = full.clone().with_overrides(&overrides).unwrap();
        assert_eq!(short.n_layer, 10);
        assert_eq!(Config { n_layer: 26, ..short.clone() }, full);
        // 26 layers of 123_910_400 parameters each in the full model.
        assert_eq!(short.param_count(), 3_426_473_600 - 16 * 123_910_400);
    }

    #[test]
    fn head_overrides_keep_mha_and_gqa() {
        let mha = named("Llama-2-7b-hf")
            .with_overrides(&Overrides { n_embd: Some(256), n_head: Some(4), ..Overrides::default() })
            .unwrap();
        assert_eq!((mha.head_size, mha.n_query_groups), (64, 4));

        let gqa =
            named("Meta-Llama-3-8B").with_overrides(&Overrides { n_head: Some(16), ..Overrides::default() }).unwrap();
        assert_eq!((gqa.head_size, gqa.n_query_groups), (256, 8));

        let explicit =
            named("tiny-llama").with_overrides(&Overrides { n_query_groups: Some(1), ..Overrides::default() }).unwrap();
        assert_eq!((explicit.n_query_groups, explicit.head_size), (1, 16));
    }

    #[test]
    fn vocab_block_and_width_overrides() {
        let config = named("pythia-14m")
            .with_overrides(&Overrides {
                vocab_size: Some(1000),
                block_size: Some(64),
                n_embd: Some(64),
                ..Overrides::default()
            })
            .unwrap();
        assert_eq!((config.vocab_size, config.padded_vocab_size), (1000, 1000));
        assert_eq!(config.block_size, 64);
        // litgpt derives the GELU MLP width from n_embd.
        assert_eq!((config.head_size, config.intermediate_size), (16, 256));

        let explicit = named("pythia-14m")
            .with_overrides(&Overrides { n_embd: Some(64), intermediate_size: Some(100), ..Overrides::default() })
            .unwrap();
        assert_eq!(explicit.intermediate_size, 100);
    }

    #[test]
    fn indivisible_width_names_both_numbers() {
        let reason = config_reason(named("tiny-llama").with_overrides(&Overrides {
            n_embd: Some(100),
            n_head: Some(3),
            ..Overrides::default()
        }));
        assert_eq!(reason, "n_embd 100 is not divisible by n_head 3");

        let err = named("tiny-llama")
            .with_overrides(&Overrides { n_embd: Some(100), n_head: Some(3), ..Overrides::default() })
            .unwrap_err()
            .to_string();
        assert!(err.contains("tiny-llama") && err.contains("100") && err.contains('3'));
    }

    #[test]
    fn validation_errors() {
        let base = named("tiny-llama");
        let check = |config: Config, needle: &str| {
            let reason = config_reason(config.validate());
            assert!(reason.contains(needle), "`{reason}` lacks `{needle}`");
        };
        check(Config { n_layer: 0, ..base.clone() }, "n_layer must be positive, got 0");
        check(Config { n_head: 0, ..base.clone() }, "n_head must be positive");
        check(Config { n_query_groups: 3, ..base.clone() }, "n_head 4 is not divisible by n_query_groups 3");
        check(Config { rotary_percentage: 2.0, ..base.clone() }, "n_rot 32, more than head_size 16");
        check(Config { rotary_percentage: -0.5, ..base.clone() }, "rotary_percentage");
        check(Config { vocab_size: 300, ..base.clone() }, "vocab_size 300 is larger than padded_vocab_size 256");
        check(Config { norm_eps: 0.0, ..base.clone() }, "norm_eps must be a finite number > 0, got 0");
        check(Config { norm_eps: f64::NAN, ..base.clone() }, "norm_eps");
        check(Config { rope_base: -1.0, ..base.clone() }, "rope_base must be a finite number > 0, got -1");
        check(Config { shared_attention_norm: true, ..base.clone() }, "shared_attention_norm needs parallel_residual");
    }

    #[test]
    fn zero_head_override_is_an_error_not_a_panic() {
        let reason =
            config_reason(named("tiny-llama").with_overrides(&Overrides { n_head: Some(0), ..Overrides::default() }));
        assert!(reason.contains("n_head must be positive"), "{reason}");
    }

    #[test]
    fn param_count_tied_shared_and_biases() {
        let base = named("tiny-neox");
        let tied = Config { tie_embeddings: true, ..base.clone() };
        assert_eq!(base.param_count() - tied.param_count(), 256 * 64);
        let head_bias = Config { lm_head_bias: true, ..tied.clone() };
        assert_eq!(head_bias.param_count() - tied.param_count(), 256);
        let shared = Config { shared_attention_norm: true, ..base.clone() };
        // One LayerNorm (weight and bias) fewer per layer.
        assert_eq!(base.param_count() - shared.param_count(), 2 * 2 * 64);

        let llama = named("tiny-llama");
        let qkv_bias = Config { attn_qkv_bias: true, ..llama.clone() };
        // q 64 wide, k and v 2 groups of 16 each, in two layers.
        assert_eq!(qkv_bias.param_count() - llama.param_count(), 2 * (64 + 32 + 32));
        let all_bias = Config { bias: true, ..llama.clone() };
        // q/k/v, o_proj, gate and up (128 each), down.
        assert_eq!(all_bias.param_count() - llama.param_count(), 2 * (128 + 64 + 2 * 128 + 64));
    }

    #[test]
    fn serde_round_trip() {
        for name in ["Qwen2.5-7B", "pythia-14m"] {
            let config = named(name);
            let text = serde_json::to_string(&config).unwrap();
            let back: Config = serde_json::from_str(&text).unwrap();
            assert_eq!(back, config);
        }
    }

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
            "rope_scaling.rope_type `llama3` (RoPE scaling) is not supported",
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
