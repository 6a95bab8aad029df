//! Model configurations for the GPT family that stepgraph trains.
//!
//! This module owns [`Config`], the hyper-parameters of one decoder-only
//! transformer, with the same meaning as litgpt's `Config`: the named
//! configurations (litgpt names and Hugging Face repo ids, plus small ones
//! for tests and demos) and the closest of them to an unknown name,
//! command-line style [`Overrides`], validation with messages that name the
//! model and the offending numbers, the exact parameter count of the
//! network a config describes.
//!
//! **Invariant:** a validated config's counts are within what ids and
//! kernels can number ([`MAX_LAYERS`], [`MAX_POSITIONS`], [`MAX_VOCAB`]),
//! and every weight and the parameter count within
//! [`MAX_VALUE_BYTES`] elements, so no arithmetic on its sizes overflows;
//! a size past them is an [`Error::Size`] naming the keys it is made of.
//!
//! Reading a Hugging Face `config.json` lives in [`super::hf`].
//!
//! It only describes networks; building traces from a config lives elsewhere.

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::ir::MAX_VALUE_BYTES;
use crate::ops::attention::Scores;
use crate::ops::rope::{Llama3Scaling, LongRope, RopeScaling};

/// The normalization used before attention, before the MLP and at the end.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum NormKind {
    /// RMSNorm: a weight, no bias (LLaMA, Mistral, Qwen2).
    RmsNorm,
    /// LayerNorm: a weight and a bias (GPT-NeoX / Pythia).
    LayerNorm,
    /// RMSNorm whose weight is stored as an offset from one,
    /// `x·rstd·(1 + w)`, computed in f32 whatever the model's dtype and
    /// rounded once (Gemma 2 and 3, whose checkpoints hold `w`).
    RmsNormUnitOffset,
}

impl NormKind {
    /// Whether the norm has a bias beside its weight.
    pub fn has_bias(self) -> bool {
        self == NormKind::LayerNorm
    }
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
    /// `down(gelu(gate(x)) * up(x))`, three matrices (Gemma's GeGLU).
    GeGlu {
        /// `true` for the tanh approximation of GELU (`gelu_pytorch_tanh`,
        /// what Gemma 2 and 3 use), `false` for the exact erf form.
        approximate_tanh: bool,
    },
}

impl MlpKind {
    /// Whether the MLP is gated: a gate and an up projection, then down.
    pub fn is_gated(self) -> bool {
        matches!(self, MlpKind::LlamaSwiGlu | MlpKind::GeGlu { .. })
    }
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
    /// RoPE frequency scaling: Llama-3.x (`rope_type: "llama3"`) or
    /// LongRoPE (`"longrope"`); `None` for plain RoPE.
    #[serde(default)]
    pub rope_scaling: Option<RopeScaling>,
    /// A bias on every linear layer: q/k/v, attention output and the MLP.
    pub bias: bool,
    /// A bias on the q/k/v projections only (Qwen2), when `bias` is false.
    pub attn_qkv_bias: bool,
    /// The LM head shares its weight with the token embedding.
    pub tie_embeddings: bool,
    /// The LM head has a bias.
    pub lm_head_bias: bool,
    /// RMSNorms on q and k (`q_norm`, `k_norm`) after the projections and
    /// before RoPE: per head (Qwen3) or over the whole projection (OLMo 2).
    /// Left out of the serialized config when there are none, so the
    /// configs written before it existed read back the same.
    #[serde(default, skip_serializing_if = "QkNorm::is_none")]
    pub qk_norm: QkNorm,
    /// Norms on the attention's and the MLP's outputs before each joins
    /// the residual stream (`post_attention_layernorm`,
    /// `post_feedforward_layernorm`), and none on their inputs (OLMo 2).
    /// Left out of the serialized config when off.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub post_norms: bool,
    /// Norms on each sublayer's input and on its output (Gemma 2 and 3:
    /// `input_layernorm` and `post_attention_layernorm` around attention,
    /// `pre_feedforward_layernorm` and `post_feedforward_layernorm` around
    /// the MLP). Left out of the serialized config when off.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub sandwich_norms: bool,
    /// The hidden states leaving the embedding are multiplied by
    /// `√n_embd`, rounded to the model's dtype first (Gemma). Left out of
    /// the serialized config when off.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub scale_embeddings: bool,
    /// Attention scores are scaled by `attention_scalar^(-1/2)` instead of
    /// `head_size^(-1/2)` (Gemma's `query_pre_attn_scalar`); `None` for the
    /// head size.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attention_scalar: Option<f64>,
    /// A sliding window on the layers [`Config::sliding_layers`] names:
    /// their query `i` sees keys `i + 1 − window..=i` only (Mistral,
    /// Gemma). `None` for none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sliding_window: Option<usize>,
    /// Which layers are sliding layers (the others are global): those the
    /// window applies to, and those that rotate with
    /// [`Config::rope_local_base`]. Left out of the serialized config when
    /// every layer is one.
    #[serde(default, skip_serializing_if = "SlidingLayers::is_all")]
    pub sliding_layers: SlidingLayers,
    /// Attention scores soft-capped, `s ↦ cap·tanh(s/cap)`, after the scale
    /// and before the softmax (Gemma 2's `attn_logit_softcapping`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attn_softcap: Option<f64>,
    /// The output logits soft-capped, `x ↦ cap·tanh(x/cap)`, before the loss
    /// and before sampling (Gemma 2's `final_logit_softcapping`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub final_softcap: Option<f64>,
    /// The RoPE base of the sliding layers, which rotate without any RoPE
    /// scaling (Gemma 3's `rope_local_base_freq`); `None`: every layer uses
    /// [`Config::rope_base`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_local_base: Option<f64>,
    /// Linear RoPE scaling (`rope_type: "linear"`): positions divided by
    /// this factor on every layer that rotates with [`Config::rope_base`]
    /// (Gemma 3's global layers from 4B up).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_linear_factor: Option<f64>,
    /// A mixture of experts in place of the dense MLP on the layers it
    /// names (Mixtral, Qwen3-MoE); `None` for a dense model. Left out of
    /// the serialized config when dense.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub moe: Option<MoeConfig>,
}

/// A mixture-of-experts MLP ([`Config::moe`]). On a sparse layer each
/// token's MLP output is the weighted sum of the gated (SwiGLU) MLPs of its
/// `experts_per_token` best experts: the router is a linear layer to one
/// score per expert, then a softmax (in f32, as `transformers` computes
/// it), the `experts_per_token` largest probabilities, renormalised to sum
/// to one when `normalize_top_k`, as the weights. Routing is dropless:
/// every token reaches all of its experts.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MoeConfig {
    /// Experts per sparse layer (`num_local_experts`, `num_experts`).
    pub experts: usize,
    /// Experts each token is routed to (`num_experts_per_tok`).
    pub experts_per_token: usize,
    /// Hidden width of each expert's MLP (`moe_intermediate_size`; Mixtral's
    /// `intermediate_size`).
    pub expert_intermediate_size: usize,
    /// The chosen probabilities divided by their sum (Mixtral always;
    /// Qwen-MoE's `norm_topk_prob`).
    pub normalize_top_k: bool,
    /// Layer `i` is sparse when `(i + 1) % sparse_step == 0` and it is not
    /// one of [`MoeConfig::dense_layers`] (Qwen-MoE's
    /// `decoder_sparse_step`); 1 for every layer.
    pub sparse_step: usize,
    /// Layers that keep the dense MLP of [`Config::intermediate_size`]
    /// (Qwen-MoE's `mlp_only_layers`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub dense_layers: Vec<usize>,
    /// The load-balancing loss added to the training loss with this
    /// weight (`transformers`' `router_aux_loss_coef` when
    /// `output_router_logits` is set): `E · Σ_e f_e · P_e` over the sparse
    /// layers together, `f_e` the share of routed (token, slot) pairs that
    /// went to expert `e` and `P_e` its mean router probability
    /// ([`super::gpt`] builds it). `None`: the loss alone.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub aux_loss_coef: Option<f64>,
    /// A shared expert of this width that every token of a sparse layer
    /// passes through besides its routed ones, its output scaled by
    /// `sigmoid(x · g)` for a gate `g` of its own (Qwen2-MoE's
    /// `shared_expert_intermediate_size` and `shared_expert_gate`); `None`
    /// for none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shared_expert: Option<usize>,
    /// The router z-loss added to the training loss with this weight
    /// (ST-MoE's: the mean over tokens of the squared log-sum-exp of the
    /// router's scores, averaged over the sparse layers), which keeps the
    /// scores small; `None` for none. No Hugging Face config has it: a
    /// training choice (`--router-z-loss`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub z_loss_coef: Option<f64>,
}

impl MoeConfig {
    /// Whether layer `layer` has the experts.
    pub fn is_sparse(&self, layer: usize) -> bool {
        !self.dense_layers.contains(&layer) && divides(self.sparse_step.max(1), layer + 1)
    }

    /// How many of `n_layer` layers have the experts.
    pub fn sparse_layers(&self, n_layer: usize) -> usize {
        (0..n_layer).filter(|&l| self.is_sparse(l)).count()
    }
}

/// Which layers of a model are sliding layers ([`Config::sliding_layers`]).
/// A config read from a file holds the shortest form that describes its
/// layers ([`SlidingLayers::canonical`]), so equal layouts compare equal.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SlidingLayers {
    /// Every layer (Mistral).
    #[default]
    All,
    /// Every `n`-th layer is global, counting from one, and the others
    /// slide: layer `i` slides unless `(i + 1) % n == 0` (Gemma 2: 2,
    /// Gemma 3: 6; 1: no layer slides). `transformers`' default pattern.
    GlobalEvery(usize),
    /// Layer by layer, `true` for a sliding layer.
    Listed(Vec<bool>),
}

impl SlidingLayers {
    pub fn is_all(&self) -> bool {
        *self == SlidingLayers::All
    }

    /// Whether layer `layer` slides.
    pub fn slides(&self, layer: usize) -> bool {
        match self {
            SlidingLayers::All => true,
            SlidingLayers::GlobalEvery(n) => !divides((*n).max(1), layer + 1),
            SlidingLayers::Listed(list) => list.get(layer).copied().unwrap_or(false),
        }
    }

    /// The shortest form of these layers for a model of `n_layer`: [`All`]
    /// when every layer slides, [`GlobalEvery`] when the layers follow
    /// that pattern, the list otherwise.
    ///
    /// [`All`]: SlidingLayers::All
    /// [`GlobalEvery`]: SlidingLayers::GlobalEvery
    pub fn canonical(&self, n_layer: usize) -> SlidingLayers {
        let list: Vec<bool> = (0..n_layer).map(|l| self.slides(l)).collect();
        match list.iter().position(|slides| !slides) {
            None => SlidingLayers::All,
            Some(first_global) => {
                let pattern = SlidingLayers::GlobalEvery(first_global + 1);
                if (0..n_layer).all(|l| pattern.slides(l) == list[l]) {
                    pattern
                } else {
                    SlidingLayers::Listed(list)
                }
            }
        }
    }
}

/// The RMSNorms a model puts on q and k before RoPE ([`Config::qk_norm`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum QkNorm {
    /// None (Llama, Qwen2, Mistral, GPT-NeoX).
    #[default]
    None,
    /// Over each head, with weights of the head's size (Qwen3).
    PerHead,
    /// Over all of q (and all of k), with weights of the projection's
    /// width (OLMo 2).
    Whole,
}

impl QkNorm {
    pub fn is_none(&self) -> bool {
        *self == QkNorm::None
    }
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

/// The config keys a parameter count is made of.
pub(crate) const PARAM_KEYS: [&str; 7] =
    ["n_layer", "n_embd", "n_head", "n_query_groups", "head_size", "intermediate_size", "padded_vocab_size"];

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
    Named { name: "Qwen2.5-0.5B", hf_repo: Some("Qwen/Qwen2.5-0.5B"), build: qwen2_5_0_5b },
    Named { name: "Qwen2.5-1.5B", hf_repo: Some("Qwen/Qwen2.5-1.5B"), build: qwen2_5_1_5b },
    Named { name: "Qwen2.5-3B", hf_repo: Some("Qwen/Qwen2.5-3B"), build: qwen2_5_3b },
    Named { name: "Qwen3-0.6B", hf_repo: Some("Qwen/Qwen3-0.6B"), build: qwen3_0_6b },
    Named { name: "Qwen3-1.7B", hf_repo: Some("Qwen/Qwen3-1.7B"), build: qwen3_1_7b },
    Named { name: "Qwen3-4B", hf_repo: Some("Qwen/Qwen3-4B"), build: qwen3_4b },
    Named { name: "Qwen3-8B", hf_repo: Some("Qwen/Qwen3-8B"), build: qwen3_8b },
    Named { name: "Qwen3-14B", hf_repo: Some("Qwen/Qwen3-14B"), build: qwen3_14b },
    Named { name: "Qwen3-32B", hf_repo: Some("Qwen/Qwen3-32B"), build: qwen3_32b },
    Named { name: "Qwen3-30B-A3B", hf_repo: Some("Qwen/Qwen3-30B-A3B"), build: qwen3_30b_a3b },
    Named { name: "Mixtral-8x7B-v0.1", hf_repo: Some("mistralai/Mixtral-8x7B-v0.1"), build: mixtral_8x7b },
    Named { name: "Phi-3-mini-4k-instruct", hf_repo: Some("microsoft/Phi-3-mini-4k-instruct"), build: phi_3_mini_4k },
    Named { name: "phi-4", hf_repo: Some("microsoft/phi-4"), build: phi_4 },
    Named { name: "Phi-4-mini-instruct", hf_repo: Some("microsoft/Phi-4-mini-instruct"), build: phi_4_mini },
    Named { name: "gemma-2-2b", hf_repo: Some("google/gemma-2-2b"), build: gemma_2_2b },
    Named { name: "gemma-2-9b", hf_repo: Some("google/gemma-2-9b"), build: gemma_2_9b },
    Named { name: "gemma-2-27b", hf_repo: Some("google/gemma-2-27b"), build: gemma_2_27b },
    Named { name: "gemma-3-1b", hf_repo: Some("google/gemma-3-1b-pt"), build: gemma_3_1b },
    Named { name: "gemma-3-4b", hf_repo: Some("google/gemma-3-4b-pt"), build: gemma_3_4b },
    Named { name: "gemma-3-12b", hf_repo: Some("google/gemma-3-12b-pt"), build: gemma_3_12b },
    Named { name: "gemma-3-27b", hf_repo: Some("google/gemma-3-27b-pt"), build: gemma_3_27b },
    Named { name: "OLMo-2-0425-1B", hf_repo: Some("allenai/OLMo-2-0425-1B"), build: olmo_2_1b },
    Named { name: "OLMo-2-1124-7B", hf_repo: Some("allenai/OLMo-2-1124-7B"), build: olmo_2_7b },
    Named { name: "Llama-3.2-1B", hf_repo: Some("meta-llama/Llama-3.2-1B"), build: llama_3_2_1b },
    Named { name: "Llama-3.2-3B", hf_repo: Some("meta-llama/Llama-3.2-3B"), build: llama_3_2_3b },
    Named { name: "Llama-3.1-8B", hf_repo: Some("meta-llama/Llama-3.1-8B"), build: llama_3_1_8b },
    Named {
        name: "tiny-llama-1.1b",
        hf_repo: Some("TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T"),
        build: tiny_llama_1_1b,
    },
    Named { name: "pythia-14m", hf_repo: Some("EleutherAI/pythia-14m"), build: pythia_14m },
    Named { name: "pythia-160m", hf_repo: Some("EleutherAI/pythia-160m"), build: pythia_160m },
    Named { name: "tiny-llama", hf_repo: None, build: tiny_llama },
    Named { name: "tiny-neox", hf_repo: None, build: tiny_neox },
    Named { name: "w3-llama", hf_repo: None, build: w3_llama },
];

/// Extra names that resolve to a named config: litgpt calls Meta's 8B model
/// `Llama-3-8B` while its Hugging Face repo is `Meta-Llama-3-8B`; the
/// instruction-tuned and chat releases share their base model's geometry
/// (their repo ids resolve through the name after the org, as any repo id).
const ALIASES: &[(&str, &str)] = &[
    ("Llama-3-8B", "Meta-Llama-3-8B"),
    ("Meta-Llama-3-8B-Instruct", "Meta-Llama-3-8B"),
    ("Llama-3-8B-Instruct", "Meta-Llama-3-8B"),
    ("Meta-Llama-3.1-8B", "Llama-3.1-8B"),
    ("Llama-3.1-8B-Instruct", "Llama-3.1-8B"),
    ("Meta-Llama-3.1-8B-Instruct", "Llama-3.1-8B"),
    ("Llama-3.2-1B-Instruct", "Llama-3.2-1B"),
    ("Llama-3.2-3B-Instruct", "Llama-3.2-3B"),
    ("Qwen2.5-0.5B-Instruct", "Qwen2.5-0.5B"),
    ("Qwen2.5-1.5B-Instruct", "Qwen2.5-1.5B"),
    ("Qwen2.5-3B-Instruct", "Qwen2.5-3B"),
    ("Qwen2.5-7B-Instruct", "Qwen2.5-7B"),
    ("Mistral-7B-Instruct-v0.1", "Mistral-7B-v0.1"),
    ("gemma-2-2b-it", "gemma-2-2b"),
    ("gemma-2-9b-it", "gemma-2-9b"),
    ("gemma-2-27b-it", "gemma-2-27b"),
    ("gemma-3-1b-it", "gemma-3-1b"),
    ("gemma-3-4b-it", "gemma-3-4b"),
    ("gemma-3-12b-it", "gemma-3-12b"),
    ("gemma-3-27b-it", "gemma-3-27b"),
    ("tiny-llama-1.1b-chat", "tiny-llama-1.1b"),
    ("TinyLlama-1.1B-Chat-v1.0", "tiny-llama-1.1b"),
];

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

    /// Every spelling that names this config: its name, its repo id and
    /// the repo's name, and its aliases.
    fn spellings(&self) -> impl Iterator<Item = &'static str> + '_ {
        let repo = self.hf_repo.into_iter().flat_map(|r| [r, r.rsplit('/').next().unwrap_or(r)]);
        let aliases = ALIASES.iter().filter(|(_, c)| *c == self.name).map(|(a, _)| *a);
        std::iter::once(self.name).chain(repo).chain(aliases)
    }
}

/// Edit distance (insertions, deletions, substitutions) between `a` and
/// `b`, ignoring ASCII case.
fn edit_distance(a: &str, b: &str) -> usize {
    let a: Vec<char> = a.chars().map(|c| c.to_ascii_lowercase()).collect();
    let b: Vec<char> = b.chars().map(|c| c.to_ascii_lowercase()).collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.iter().enumerate() {
        let mut diagonal = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let next = (diagonal + usize::from(ca != cb)).min(row[j] + 1).min(row[j + 1] + 1);
            diagonal = row[j + 1];
            row[j + 1] = next;
        }
    }
    row[b.len()]
}

/// The known config names closest to `name`, best first, at most three:
/// those whose spellings (name, repo id, alias) are within a third of
/// their length in edit distance ignoring case (at least 2), and those one
/// contains the other of ignoring case (`llama-3` in `Meta-Llama-3-8B`).
/// Empty when nothing is close.
pub fn suggest_names(name: &str) -> Vec<&'static str> {
    let lower = name.to_ascii_lowercase();
    let base = lower.rsplit('/').next().unwrap_or(&lower).to_string();
    let mut scored: Vec<(usize, &'static str)> = NAMED
        .iter()
        .filter_map(|named| {
            let best = named
                .spellings()
                .filter_map(|s| {
                    let s_lower = s.to_ascii_lowercase();
                    let d = edit_distance(&base, &s_lower).min(edit_distance(&lower, &s_lower));
                    let close = d <= (s.len() / 3).max(2);
                    // A containment counts as close, ranked after near spellings.
                    let contains = base.len() >= 3 && (s_lower.contains(&base) || base.contains(&s_lower));
                    match (close, contains) {
                        (true, _) => Some(d),
                        (false, true) => Some(d + s.len()),
                        _ => None,
                    }
                })
                .min()?;
            Some((best, named.name))
        })
        .collect();
    scored.sort();
    scored.into_iter().take(3).map(|(_, n)| n).collect()
}

/// The litgpt LLaMA layout every LLaMA-like named config starts from:
/// Llama-2-7B's numbers, sequential residual, RMSNorm, SwiGLU, full RoPE, no
/// bias, untied head.
pub(crate) fn llama_base(name: &str) -> Config {
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
        rope_scaling: None,
        bias: false,
        attn_qkv_bias: false,
        tie_embeddings: false,
        lm_head_bias: false,
        qk_norm: QkNorm::None,
        post_norms: false,
        sandwich_norms: false,
        scale_embeddings: false,
        attention_scalar: None,
        sliding_window: None,
        sliding_layers: SlidingLayers::All,
        attn_softcap: None,
        final_softcap: None,
        rope_local_base: None,
        rope_linear_factor: None,
        moe: None,
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
        rope_scaling: None,
        bias: true,
        attn_qkv_bias: false,
        tie_embeddings: false,
        lm_head_bias: false,
        qk_norm: QkNorm::None,
        post_norms: false,
        sandwich_norms: false,
        scale_embeddings: false,
        attention_scalar: None,
        sliding_window: None,
        sliding_layers: SlidingLayers::All,
        attn_softcap: None,
        final_softcap: None,
        rope_local_base: None,
        rope_linear_factor: None,
        moe: None,
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

/// Mistral 7B v0.1: every layer attends over a 4096-token sliding window
/// of its 32768 positions.
fn mistral_7b_v0_1() -> Config {
    Config {
        block_size: 32768,
        n_query_groups: 8,
        intermediate_size: 14336,
        sliding_window: Some(4096),
        ..llama_base("Mistral-7B-v0.1")
    }
}

/// What Gemma 2 and 3 share: GeGLU (tanh GELU), RMSNorms of weights
/// stored as offsets from one before and after each sublayer, embeddings
/// scaled by √n_embd, heads of their own size, the LM head tied to the
/// embedding, RMSNorm epsilon 1e-6.
#[allow(clippy::too_many_arguments)]
fn gemma_base(
    name: &str,
    vocab_size: usize,
    n_layer: usize,
    n_embd: usize,
    n_head: usize,
    n_query_groups: usize,
    head_size: usize,
    intermediate_size: usize,
) -> Config {
    Config {
        vocab_size,
        padded_vocab_size: vocab_size,
        n_layer,
        n_embd,
        n_head,
        n_query_groups,
        head_size,
        intermediate_size,
        norm: NormKind::RmsNormUnitOffset,
        norm_eps: 1e-6,
        mlp: MlpKind::GeGlu { approximate_tanh: true },
        tie_embeddings: true,
        sandwich_norms: true,
        scale_embeddings: true,
        ..llama_base(name)
    }
}

/// Gemma 2: 256000 embedding rows, 8192 positions, a 4096-token window on
/// every other layer (the first slides), attention scores capped at 50
/// and logits at 30, RoPE base 10000; `query_pre_attn_scalar` is 256 for
/// 2B and the width over the heads for 9B and 27B.
#[allow(clippy::too_many_arguments)]
fn gemma_2(
    name: &str,
    n_layer: usize,
    n_embd: usize,
    n_head: usize,
    n_query_groups: usize,
    head_size: usize,
    intermediate_size: usize,
    attention_scalar: f64,
) -> Config {
    Config {
        block_size: 8192,
        attention_scalar: Some(attention_scalar),
        sliding_window: Some(4096),
        sliding_layers: SlidingLayers::GlobalEvery(2),
        attn_softcap: Some(50.0),
        final_softcap: Some(30.0),
        ..gemma_base(name, 256000, n_layer, n_embd, n_head, n_query_groups, head_size, intermediate_size)
    }
}

fn gemma_2_2b() -> Config {
    gemma_2("gemma-2-2b", 26, 2304, 8, 4, 256, 9216, 256.0)
}

fn gemma_2_9b() -> Config {
    gemma_2("gemma-2-9b", 42, 3584, 16, 8, 256, 14336, 224.0)
}

fn gemma_2_27b() -> Config {
    gemma_2("gemma-2-27b", 46, 4608, 32, 16, 128, 36864, 144.0)
}

/// Gemma 3's language models: per-head q/k norms, five sliding layers to
/// one global, RoPE base 10000 on the sliding layers and 1e6 on the global
/// ones, no soft-caps; from 4B up (the text part of the image-and-text
/// models) 262208 embedding rows, 131072 positions, a 1024-token window and
/// the global layers' RoPE scaled linearly by 8.
#[allow(clippy::too_many_arguments)]
fn gemma_3(
    name: &str,
    n_layer: usize,
    n_embd: usize,
    n_head: usize,
    n_query_groups: usize,
    head_size: usize,
    intermediate_size: usize,
    attention_scalar: f64,
) -> Config {
    Config {
        block_size: 131072,
        rope_base: 1_000_000.0,
        qk_norm: QkNorm::PerHead,
        attention_scalar: Some(attention_scalar),
        sliding_window: Some(1024),
        sliding_layers: SlidingLayers::GlobalEvery(6),
        rope_local_base: Some(10000.0),
        rope_linear_factor: Some(8.0),
        ..gemma_base(name, 262208, n_layer, n_embd, n_head, n_query_groups, head_size, intermediate_size)
    }
}

/// Gemma 3 1B, a text-only model: 262144 embedding rows, 32768 positions,
/// a 512-token window, no RoPE scaling.
fn gemma_3_1b() -> Config {
    Config {
        vocab_size: 262144,
        padded_vocab_size: 262144,
        block_size: 32768,
        sliding_window: Some(512),
        rope_linear_factor: None,
        ..gemma_3("gemma-3-1b", 26, 1152, 4, 1, 256, 6912, 256.0)
    }
}

fn gemma_3_4b() -> Config {
    gemma_3("gemma-3-4b", 34, 2560, 8, 4, 256, 10240, 256.0)
}

fn gemma_3_12b() -> Config {
    gemma_3("gemma-3-12b", 48, 3840, 16, 8, 256, 15360, 256.0)
}

fn gemma_3_27b() -> Config {
    gemma_3("gemma-3-27b", 62, 5376, 32, 16, 128, 21504, 168.0)
}

/// Qwen2.5's small models: 151936 embedding rows, grouped heads of 64 or
/// 128, biases on q/k/v, RoPE base 1e6, the LM head tied to the embedding.
fn qwen2_5_small(
    name: &str,
    n_layer: usize,
    n_embd: usize,
    n_head: usize,
    head_size: usize,
    intermediate_size: usize,
) -> Config {
    Config {
        block_size: 32768,
        vocab_size: 151643,
        padded_vocab_size: 151936,
        n_layer,
        n_embd,
        n_head,
        n_query_groups: 2,
        head_size,
        intermediate_size,
        norm_eps: 1e-6,
        rope_base: 1000000.0,
        attn_qkv_bias: true,
        tie_embeddings: true,
        ..llama_base(name)
    }
}

fn qwen2_5_0_5b() -> Config {
    qwen2_5_small("Qwen2.5-0.5B", 24, 896, 14, 64, 4864)
}

fn qwen2_5_1_5b() -> Config {
    qwen2_5_small("Qwen2.5-1.5B", 28, 1536, 12, 128, 8960)
}

fn qwen2_5_3b() -> Config {
    qwen2_5_small("Qwen2.5-3B", 36, 2048, 16, 128, 11008)
}

/// Qwen3's dense models: 151936 embedding rows, heads of 128 with 8
/// key/value groups and per-head q/k norms, no biases, RoPE base 1e6; the
/// LM head tied to the embedding below 8B.
fn qwen3(name: &str, n_layer: usize, n_embd: usize, n_head: usize, intermediate_size: usize, tied: bool) -> Config {
    Config {
        block_size: 40960,
        vocab_size: 151643,
        padded_vocab_size: 151936,
        n_layer,
        n_embd,
        n_head,
        n_query_groups: 8,
        head_size: 128,
        intermediate_size,
        norm_eps: 1e-6,
        rope_base: 1000000.0,
        tie_embeddings: tied,
        qk_norm: QkNorm::PerHead,
        ..llama_base(name)
    }
}

fn qwen3_0_6b() -> Config {
    qwen3("Qwen3-0.6B", 28, 1024, 16, 3072, true)
}

fn qwen3_1_7b() -> Config {
    qwen3("Qwen3-1.7B", 28, 2048, 16, 6144, true)
}

fn qwen3_4b() -> Config {
    qwen3("Qwen3-4B", 36, 2560, 32, 9728, true)
}

fn qwen3_8b() -> Config {
    qwen3("Qwen3-8B", 36, 4096, 32, 12288, false)
}

fn qwen3_14b() -> Config {
    qwen3("Qwen3-14B", 40, 5120, 40, 17408, false)
}

/// Qwen3-32B: 64 query heads of 128 over a width of 5120.
fn qwen3_32b() -> Config {
    qwen3("Qwen3-32B", 64, 5120, 64, 25600, false)
}

/// Qwen3-30B-A3B: 48 layers of width 2048, each with 128 experts of width
/// 768 of which every token takes 8 (their probabilities renormalised),
/// 32 query heads of 128 over 4 key/value heads.
fn qwen3_30b_a3b() -> Config {
    Config {
        n_query_groups: 4,
        moe: Some(MoeConfig {
            experts: 128,
            experts_per_token: 8,
            expert_intermediate_size: 768,
            normalize_top_k: true,
            sparse_step: 1,
            dense_layers: Vec::new(),
            aux_loss_coef: None,
            shared_expert: None,
            z_loss_coef: None,
        }),
        ..qwen3("Qwen3-30B-A3B", 48, 2048, 32, 6144, false)
    }
}

/// Mixtral 8x7B: Mistral 7B's attention (without its window) and, on every
/// layer, 8 experts of width 14336 of which every token takes 2.
fn mixtral_8x7b() -> Config {
    Config {
        block_size: 32768,
        n_query_groups: 8,
        intermediate_size: 14336,
        rope_base: 1_000_000.0,
        moe: Some(MoeConfig {
            experts: 8,
            experts_per_token: 2,
            expert_intermediate_size: 14336,
            normalize_top_k: true,
            sparse_step: 1,
            dense_layers: Vec::new(),
            aux_loss_coef: None,
            shared_expert: None,
            z_loss_coef: None,
        }),
        ..llama_base("Mixtral-8x7B-v0.1")
    }
}

/// Phi-3-mini (4k): the Llama layout (its q/k/v and gate/up stored
/// stacked), 32064 embedding rows, full multi-head attention, RMSNorm eps
/// 1e-5, a 2047-token sliding window over its 4096 positions.
fn phi_3_mini_4k() -> Config {
    Config {
        block_size: 4096,
        sliding_window: Some(2047),
        vocab_size: 32064,
        padded_vocab_size: 32064,
        n_layer: 32,
        n_embd: 3072,
        n_head: 32,
        n_query_groups: 32,
        head_size: 96,
        intermediate_size: 8192,
        norm_eps: 1e-5,
        ..llama_base("Phi-3-mini-4k-instruct")
    }
}

/// Phi-4 (14B): 40 layers of width 5120, 10 key/value groups of heads of
/// 128, RoPE base 250000, 100352 embedding rows.
fn phi_4() -> Config {
    Config {
        block_size: 16384,
        vocab_size: 100352,
        padded_vocab_size: 100352,
        n_layer: 40,
        n_embd: 5120,
        n_head: 40,
        n_query_groups: 10,
        head_size: 128,
        intermediate_size: 17920,
        norm_eps: 1e-5,
        rope_base: 250000.0,
        ..llama_base("phi-4")
    }
}

/// Phi-4-mini (3.8B): 32 layers of width 3072, 24 query heads and 8
/// key/value heads of 128, RoPE on three quarters of each head, a
/// 200064-token vocabulary tied to the head. The geometry is what `plan`
/// and `bench` need: it rotates without the LongRoPE factors its folder
/// brings (read on load), which change no size and no launch.
fn phi_4_mini() -> Config {
    Config {
        block_size: 131072,
        vocab_size: 200064,
        padded_vocab_size: 200064,
        n_layer: 32,
        n_embd: 3072,
        n_head: 24,
        n_query_groups: 8,
        head_size: 128,
        intermediate_size: 8192,
        norm_eps: 1e-5,
        rotary_percentage: 0.75,
        tie_embeddings: true,
        ..llama_base("Phi-4-mini-instruct")
    }
}

/// OLMo 2: the Llama layout with RMSNorms over all of q and of k before
/// RoPE and norms after the attention and the MLP (not before), a
/// 100352-token vocabulary, RoPE base 500000.
fn olmo_2(name: &str, n_layer: usize, n_embd: usize, n_head: usize, intermediate_size: usize) -> Config {
    Config {
        vocab_size: 100352,
        padded_vocab_size: 100352,
        n_layer,
        n_embd,
        n_head,
        n_query_groups: n_head,
        head_size: n_embd / n_head,
        intermediate_size,
        norm_eps: 1e-6,
        rope_base: 500000.0,
        qk_norm: QkNorm::Whole,
        post_norms: true,
        ..llama_base(name)
    }
}

fn olmo_2_1b() -> Config {
    olmo_2("OLMo-2-0425-1B", 16, 2048, 16, 8192)
}

fn olmo_2_7b() -> Config {
    olmo_2("OLMo-2-1124-7B", 32, 4096, 32, 11008)
}

/// Llama 3.1's RoPE: base 500000, frequencies rescaled for a context
/// `factor` times the 8192 positions it was trained on.
fn llama_3_1_rope(factor: f64) -> Option<RopeScaling> {
    Some(RopeScaling::Llama3(Llama3Scaling {
        factor,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position_embeddings: 8192,
    }))
}

/// Llama 3.1 and 3.2: Llama 3's 128256-row vocabulary and 8 kv heads.
fn llama_3_x(name: &str, n_layer: usize, n_embd: usize, n_head: usize, head_size: usize) -> Config {
    Config {
        block_size: 131072,
        vocab_size: 128000,
        padded_vocab_size: 128256,
        n_layer,
        n_embd,
        n_head,
        n_query_groups: 8,
        head_size,
        rope_base: 500000.0,
        ..llama_base(name)
    }
}

/// Llama 3.2: an 8192-wide MLP, RoPE rescaled 32 times, the head tied.
fn llama_3_2(name: &str, n_layer: usize, n_embd: usize, n_head: usize, head_size: usize) -> Config {
    Config {
        intermediate_size: 8192,
        rope_scaling: llama_3_1_rope(32.0),
        tie_embeddings: true,
        ..llama_3_x(name, n_layer, n_embd, n_head, head_size)
    }
}

fn llama_3_2_1b() -> Config {
    llama_3_2("Llama-3.2-1B", 16, 2048, 32, 64)
}

fn llama_3_2_3b() -> Config {
    llama_3_2("Llama-3.2-3B", 28, 3072, 24, 128)
}

fn llama_3_1_8b() -> Config {
    Config {
        intermediate_size: 14336,
        rope_scaling: llama_3_1_rope(8.0),
        ..llama_3_x("Llama-3.1-8B", 32, 4096, 32, 128)
    }
}

fn tiny_llama_1_1b() -> Config {
    Config {
        block_size: 2048,
        n_layer: 22,
        n_embd: 2048,
        n_head: 32,
        n_query_groups: 4,
        head_size: 64,
        intermediate_size: 5632,
        ..llama_base("tiny-llama-1.1b")
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

/// The most transformer blocks a config may have (2^22). Value ids are
/// 32-bit and a training step records hundreds of values per block, so a
/// deeper model could not be numbered; far below that its trace would not
/// fit in host memory either.
pub const MAX_LAYERS: usize = 1 << 22;

/// The most positions a sequence may have, `block_size` included: the GPU
/// kernels count positions in 32-bit integers.
pub const MAX_POSITIONS: usize = i32::MAX as usize;

/// The most rows an embedding may have: token ids are `i32` step inputs,
/// so ids from 0 to `i32::MAX`.
pub const MAX_VOCAB: usize = 1 << 31;

/// The size keys of a config, in declaration order.
pub const SIZE_KEYS: [&str; 9] = [
    "block_size",
    "vocab_size",
    "padded_vocab_size",
    "n_layer",
    "n_embd",
    "n_head",
    "n_query_groups",
    "head_size",
    "intermediate_size",
];

/// The size keys a config error's text names (as whole words), for a
/// caller that points at where they were set.
pub fn keys_named_in(reason: &str) -> Vec<&'static str> {
    let words: Vec<&str> = reason.split(|c: char| !(c.is_alphanumeric() || c == '_')).collect();
    SIZE_KEYS.into_iter().filter(|k| words.contains(k)).collect()
}

/// One factor of a size: the config key (or batch field) and its value.
pub(crate) type Factor = (&'static str, usize);

/// `factors` multiplied, times `unit` bytes, if that fits in `u64`.
fn product_bytes(factors: &[Factor], unit: u64) -> Option<u64> {
    factors.iter().try_fold(unit, |acc, &(_, value)| acc.checked_mul(u64::try_from(value).ok()?))
}

/// `key value × key value ...`, how a size error shows what it is made of.
pub(crate) fn show_factors(factors: &[Factor]) -> String {
    factors.iter().map(|(key, value)| format!("{key} {value}")).collect::<Vec<_>>().join(" × ")
}

/// `key value, key value, ...`: the sizes something depends on.
pub(crate) fn show_values(factors: &[Factor]) -> String {
    factors.iter().map(|(key, value)| format!("{key} {value}")).collect::<Vec<_>>().join(", ")
}

/// Checks that `what`, of `factors` elements of `unit` bytes each, spans
/// at most [`MAX_VALUE_BYTES`]; the [`Error::Size`] otherwise names the
/// model, the keys and their values, and the bytes.
pub(crate) fn check_bytes(model: &str, what: &str, factors: &[Factor], unit: u64) -> Result<u64> {
    match product_bytes(factors, unit) {
        Some(bytes) if bytes <= MAX_VALUE_BYTES => Ok(bytes),
        bytes => Err(Error::Size {
            keys: factors.iter().map(|(key, _)| *key).collect(),
            reason: format!(
                "model `{model}`: {what} ({}{}) {}",
                show_factors(factors),
                if unit > 1 { format!(" × {unit} bytes") } else { String::new() },
                match bytes {
                    Some(b) => format!("has {b} bytes, more than 2^60 ({MAX_VALUE_BYTES}), the most one plan can hold"),
                    None => format!("has more than 2^64 bytes; one plan holds at most 2^60 ({MAX_VALUE_BYTES})"),
                },
            ),
        }),
    }
}

/// Whether `divisor` divides `n` exactly (false for a zero divisor).
///
/// `checked_rem` rather than `usize::is_multiple_of`, which needs Rust 1.87
/// while the workspace declares 1.85.
fn divides(divisor: usize, n: usize) -> bool {
    n.checked_rem(divisor) == Some(0)
}

/// Linear RoPE scaling by `factor` (`inv_freq / factor` for every pair)
/// as the rope op's Llama-3.x scaling computes it: with an original
/// context of one position and frequency factors of 10⁹ and 2·10⁹, every
/// wavelength (at least 2π for any base of at least one) is longer than
/// the low-frequency wavelength (10⁻⁹), so every pair takes the
/// `inv_freq / factor` branch and none the interpolated one, on the CPU and
/// in the kernel alike, which compute the same f64 expression.
pub(crate) fn linear_rope(factor: f64) -> Llama3Scaling {
    Llama3Scaling { factor, low_freq_factor: 1e9, high_freq_factor: 2e9, original_max_position_embeddings: 1 }
}

/// An [`Error::Config`] about `model`.
pub(super) fn config_error(model: &str, reason: impl Into<String>) -> Error {
    Error::Config { model: model.to_string(), reason: reason.into() }
}

impl Config {
    /// Which keys layer `layer`'s queries see and how its scores are
    /// capped: the window on a sliding layer of a model with one, the
    /// attention soft-cap on every layer of a model with one; the plain
    /// causal rule otherwise.
    pub fn scores(&self, layer: usize) -> Scores {
        let window = match self.sliding_window {
            Some(window) if self.sliding_layers.slides(layer) => window,
            _ => 0,
        };
        Scores { window, softcap: self.attn_softcap.unwrap_or(0.0) }
    }

    /// The model's LongRoPE factors, if it rotates with LongRoPE.
    pub fn long_rope(&self) -> Option<&LongRope> {
        match &self.rope_scaling {
            Some(RopeScaling::LongRope(long)) => Some(long),
            _ => None,
        }
    }

    /// The RoPE base and frequency scaling of layer `layer`: a sliding
    /// layer of a model with [`Config::rope_local_base`] rotates with that
    /// base and no scaling; every other layer with [`Config::rope_base`]
    /// and the model's scaling.
    pub fn rope_of(&self, layer: usize) -> (f64, Option<RopeScaling>) {
        match self.rope_local_base {
            Some(local) if self.sliding_layers.slides(layer) => (local, None),
            _ => (self.rope_base, self.rope_scaling.clone().or(self.rope_linear_factor.map(|f| linear_rope(f).into()))),
        }
    }

    /// The factor attention scores are scaled by before the softmax
    /// (before the soft-cap): `attention_scalar^(-1/2)`, by default
    /// `head_size^(-1/2)`, computed as `transformers` computes it.
    pub fn attention_scale(&self) -> f64 {
        match self.attention_scalar {
            Some(scalar) => scalar.powf(-0.5),
            None => 1.0 / (self.head_size as f64).sqrt(),
        }
    }

    /// The factor the embedding's output is multiplied by in `dtype`
    /// ([`Config::scale_embeddings`]): `√n_embd` rounded to f32 (as
    /// `torch.tensor` makes it) and then to `dtype` by the op that holds
    /// it; exact in f64.
    pub fn embedding_scale(&self, dtype: crate::ir::DType) -> f64 {
        let scale = (self.n_embd as f64).sqrt();
        match dtype {
            crate::ir::DType::F64 => scale,
            _ => scale as f32 as f64,
        }
    }

    /// The config called `name`: a litgpt name (`open_llama_3b`,
    /// `Llama-2-7b-hf`, `Meta-Llama-3-8B` (litgpt's `Llama-3-8B` works too),
    /// `Qwen2.5-7B`, `Mistral-7B-v0.1`, `Qwen2.5-0.5B`, `Qwen2.5-1.5B`,
    /// `Qwen2.5-3B`, `Llama-3.2-1B`, `Llama-3.2-3B`, `Llama-3.1-8B`,
    /// `gemma-2-2b` to `gemma-2-27b`, `gemma-3-1b` to `gemma-3-27b`,
    /// `OLMo-2-0425-1B`, `OLMo-2-1124-7B`,
    /// `tiny-llama-1.1b`, `pythia-14m`, `pythia-160m`, and the instruction
    /// and chat releases of these), a Hugging Face repo id such as
    /// `Qwen/Qwen2.5-7B`, or one of the small configs `tiny-llama`,
    /// `tiny-neox` and `w3-llama`.
    ///
    /// A name that matches none of these exactly is looked up again
    /// ignoring case (`qwen2.5-7b`), and a repo id `org/name` by its
    /// `name` (`unsloth/Qwen2.5-7B`), each when it picks one config. Any
    /// other name gives [`Error::UnknownModel`] with the closest known
    /// names ([`suggest_names`]) and every known one.
    pub fn named(name: &str) -> Result<Config> {
        let canonical = |n: &str| ALIASES.iter().find(|(alias, _)| *alias == n).map_or(n, |(_, c)| *c).to_string();
        let exact = |n: &str| NAMED.iter().find(|named| named.matches(&canonical(n)));
        let base = name.rsplit('/').next().unwrap_or(name);
        let found = exact(name).or_else(|| exact(base)).or_else(|| {
            // Ignoring case: every spelling of every config that equals `name` or its base.
            let mut hits = NAMED.iter().filter(|named| {
                named.spellings().any(|s| s.eq_ignore_ascii_case(name) || s.eq_ignore_ascii_case(base))
            });
            match (hits.next(), hits.next()) {
                (Some(one), None) => Some(one),
                _ => None,
            }
        });
        found.map(|named| (named.build)()).ok_or_else(|| Error::UnknownModel {
            name: name.to_string(),
            suggest: suggest_names(name).into_iter().map(str::to_string).collect(),
            known: Self::known_names().join(", "),
        })
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
        let gelu_derived_width =
            matches!(self.mlp, MlpKind::Gelu { .. }) && old_n_embd.checked_mul(4) == Some(self.intermediate_size);

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
            // A zero `n_head` is reported by `validate` below; an `n_embd`
            // it does not divide here, before a head size of 0 (from a
            // head count above the width) would be reported instead.
            if self.n_head != 0 && !divides(self.n_head, self.n_embd) {
                return Err(config_error(
                    &self.name,
                    format!("n_embd {} is not divisible by n_head {}", self.n_embd, self.n_head),
                ));
            }
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
            None if gelu_derived_width => self.n_embd.checked_mul(4).ok_or_else(|| Error::Size {
                keys: vec!["n_embd"],
                reason: format!(
                    "model `{}`: n_embd {} makes the GELU MLP 4 × n_embd wide, more than 2^64",
                    self.name, self.n_embd
                ),
            })?,
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
        // Counts past what an id or a kernel's index can number.
        let limits = [
            ("n_layer", self.n_layer, MAX_LAYERS, "value ids are 32-bit and each block records hundreds of values"),
            ("block_size", self.block_size, MAX_POSITIONS, "the GPU kernels count positions in 32 bits"),
            ("vocab_size", self.vocab_size, MAX_VOCAB, "token ids are i32"),
            ("padded_vocab_size", self.padded_vocab_size, MAX_VOCAB, "token ids are i32"),
        ];
        if let Some((key, value, max, why)) = limits.into_iter().find(|(_, value, max, _)| value > max) {
            return Err(Error::Size {
                keys: vec![key],
                reason: format!(
                    "model `{}`: {key} {value} is more than {max}, the most there can be: {why}",
                    self.name
                ),
            });
        }
        if !divides(self.n_head, self.n_embd) {
            return fail(format!("n_embd {} is not divisible by n_head {}", self.n_embd, self.n_head));
        }
        if !divides(self.n_query_groups, self.n_head) {
            return fail(format!("n_head {} is not divisible by n_query_groups {}", self.n_head, self.n_query_groups));
        }
        if self.post_norms && self.parallel_residual {
            return fail("norms after the sublayers (post_norms) need the sequential residual".into());
        }
        if self.sandwich_norms && (self.post_norms || self.parallel_residual) {
            return fail(
                "norms before and after each sublayer (sandwich_norms) need the sequential residual and exclude \
                 post_norms"
                    .into(),
            );
        }
        if self.sliding_window == Some(0) {
            return fail("sliding_window must be at least one position (or none), got 0".into());
        }
        match &self.sliding_layers {
            SlidingLayers::GlobalEvery(0) => {
                return fail("sliding_layers: a global layer every 0 layers has no meaning; the least is 1".into())
            }
            SlidingLayers::Listed(list) if list.len() != self.n_layer => {
                return fail(format!("sliding_layers lists {} layers, but n_layer is {}", list.len(), self.n_layer))
            }
            _ => {}
        }
        let positive = [
            ("attention_scalar", self.attention_scalar),
            ("attn_softcap", self.attn_softcap),
            ("final_softcap", self.final_softcap),
            ("rope_local_base", self.rope_local_base),
            ("rope_linear_factor", self.rope_linear_factor),
        ];
        for (key, value) in positive {
            if let Some(v) = value {
                if !(v.is_finite() && v > 0.0) {
                    return fail(format!("{key} must be a finite number > 0, got {v}"));
                }
            }
        }
        if self.rope_linear_factor.is_some() && self.rope_scaling.is_some() {
            return fail("rope_linear_factor and rope_scaling are two RoPE scalings; a model has at most one".into());
        }
        // Every weight, and the parameters together, within what one plan
        // can hold at one byte each: the arithmetic on them below and in
        // the model builder cannot overflow. [`ModelSpec`] checks them
        // again at the bytes of the model's dtype.
        for (what, factors) in self.weight_factors() {
            check_bytes(&self.name, what, &factors, 1)?;
        }
        if self.checked_param_count().is_none_or(|n| n > MAX_VALUE_BYTES) {
            return Err(Error::Size {
                keys: PARAM_KEYS.to_vec(),
                reason: format!(
                    "model `{}`: its parameters ({}) number more than 2^60 ({MAX_VALUE_BYTES}), more than one plan \
                     can hold",
                    self.name,
                    show_values(&self.param_factors())
                ),
            });
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
        if let Some(scaling) = &self.rope_scaling {
            scaling
                .check(self.n_rot())
                .map_err(|reason| config_error(&self.name, format!("rope_scaling: {reason}")))?;
        }
        if let Some(m) = &self.moe {
            if m.experts == 0 || !(1..=m.experts).contains(&m.experts_per_token) {
                return fail(format!(
                    "moe: {} experts per token must be between 1 and the {} experts",
                    m.experts_per_token, m.experts
                ));
            }
            if m.aux_loss_coef.is_some_and(|c| !c.is_finite()) || m.z_loss_coef.is_some_and(|c| !c.is_finite()) {
                return fail("moe: the load-balancing and z-loss coefficients must be finite numbers".into());
            }
            if m.expert_intermediate_size == 0 || m.sparse_step == 0 || m.shared_expert == Some(0) {
                return fail("moe: the experts' intermediate size and the sparse step must be at least 1".into());
            }
            if let Some(l) = m.dense_layers.iter().find(|&&l| l >= self.n_layer) {
                return fail(format!("moe: dense layer {l} is not one of the {} layers", self.n_layer));
            }
            if self.mlp != MlpKind::LlamaSwiGlu || self.bias || self.parallel_residual {
                return fail(
                    "moe: experts are SwiGLU MLPs without biases in a sequential block (as Mixtral's and Qwen-MoE's)"
                        .into(),
                );
            }
            // Each of a layer's three expert matrices is one value of all experts.
            let factors = [
                ("num_experts", m.experts),
                ("moe_intermediate_size", m.expert_intermediate_size),
                ("n_embd", self.n_embd),
            ];
            check_bytes(&self.name, "an expert weight (every expert's, stacked)", &factors, 1)?;
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

    /// The largest weights of the network, each as the keys its element
    /// count is the product of: the embedding (and the LM head, the same
    /// shape), the query and key/value projections, the MLP's matrices
    /// (the output projection is the query's transpose).
    pub(crate) fn weight_factors(&self) -> [(&'static str, Vec<Factor>); 4] {
        let c = ("n_embd", self.n_embd);
        let d = ("head_size", self.head_size);
        [
            ("the embedding weight", vec![("padded_vocab_size", self.padded_vocab_size), c]),
            ("the query projection", vec![("n_head", self.n_head), d, c]),
            ("the key/value projection", vec![("n_query_groups", self.n_query_groups), d, c]),
            ("an MLP weight", vec![("intermediate_size", self.intermediate_size), c]),
        ]
    }

    /// The keys every parameter count depends on, as [`Config::param_factors`] shows them.
    pub(crate) fn param_factors(&self) -> Vec<Factor> {
        PARAM_KEYS
            .iter()
            .map(|&key| {
                let value = match key {
                    "n_layer" => self.n_layer,
                    "n_embd" => self.n_embd,
                    "n_head" => self.n_head,
                    "n_query_groups" => self.n_query_groups,
                    "head_size" => self.head_size,
                    "intermediate_size" => self.intermediate_size,
                    _ => self.padded_vocab_size,
                };
                (key, value)
            })
            .collect()
    }

    /// The number of trainable parameters of the network this config
    /// describes, counting every weight and bias once (a tied LM head shares
    /// the embedding's weight). Exact for every validated config; for one
    /// whose count passes `u64` it saturates at `u64::MAX`.
    pub fn param_count(&self) -> u64 {
        self.checked_param_count().unwrap_or(u64::MAX)
    }

    /// The expert weights a token does not use: on each sparse layer, the
    /// three matrices of the `experts − experts_per_token` experts it is
    /// not routed to (0 for a dense model). What MFU leaves out.
    pub fn idle_expert_weights(&self) -> usize {
        match &self.moe {
            Some(m) => {
                let sparse = m.sparse_layers(self.n_layer);
                let idle = m.experts.saturating_sub(m.experts_per_token);
                sparse.saturating_mul(idle).saturating_mul(3 * m.expert_intermediate_size * self.n_embd)
            }
            None => 0,
        }
    }

    /// [`Config::param_count`], or `None` when the count passes `u64`.
    pub fn checked_param_count(&self) -> Option<u64> {
        let n = |x: usize| u64::try_from(x).ok();
        let (embd, vocab, hidden) = (n(self.n_embd)?, n(self.padded_vocab_size)?, n(self.intermediate_size)?);
        let q_width = n(self.n_head)?.checked_mul(n(self.head_size)?)?;
        let kv_width = n(self.n_query_groups)?.checked_mul(n(self.head_size)?)?;
        let qkv_width = q_width.checked_add(kv_width.checked_mul(2)?)?;

        let norm = match self.norm {
            NormKind::RmsNorm | NormKind::RmsNormUnitOffset => embd,
            NormKind::LayerNorm => embd.checked_mul(2)?,
        };
        let norms_per_layer = match (self.shared_attention_norm, self.sandwich_norms) {
            (true, _) => 1,
            (false, true) => 4,
            (false, false) => 2,
        };

        let mut attention = embd.checked_mul(qkv_width)?.checked_add(q_width.checked_mul(embd)?)?;
        if self.bias || self.attn_qkv_bias {
            attention = attention.checked_add(qkv_width)?;
        }
        if self.bias {
            attention = attention.checked_add(embd)?;
        }
        attention = attention.checked_add(match self.qk_norm {
            QkNorm::None => 0,
            QkNorm::PerHead => n(self.head_size)?.checked_mul(2)?,
            QkNorm::Whole => q_width.checked_add(kv_width)?,
        })?;

        let (matrices, bias_rows) = match self.mlp {
            MlpKind::LlamaSwiGlu | MlpKind::GeGlu { .. } => (3, 2),
            MlpKind::Gelu { .. } => (2, 1),
        };
        let biases = if self.bias { hidden.checked_mul(bias_rows)?.checked_add(embd)? } else { 0 };
        let mlp = embd.checked_mul(hidden)?.checked_mul(matrices)?.checked_add(biases)?;

        let base = norm.checked_mul(norms_per_layer)?.checked_add(attention)?;
        let layer = base.checked_add(mlp)?;
        // Sparse layers: the router and each expert's three matrices instead of the MLP.
        let (sparse, sparse_layer) = match &self.moe {
            Some(m) => {
                let count = m.sparse_layers(self.n_layer);
                let expert = embd.checked_mul(n(m.expert_intermediate_size)?)?.checked_mul(3)?;
                let experts = n(m.experts)?.checked_mul(expert.checked_add(embd)?)?;
                // The shared expert's three matrices and its one-row gate.
                let shared = match m.shared_expert {
                    Some(width) => embd.checked_mul(n(width)?)?.checked_mul(3)?.checked_add(embd)?,
                    None => 0,
                };
                (n(count)?, base.checked_add(experts)?.checked_add(shared)?)
            }
            None => (0, 0),
        };
        let embedding = vocab.checked_mul(embd)?;
        let head_weight = if self.tie_embeddings { 0 } else { embedding };
        // Tying shares the weight only; litgpt's head bias stays its own.
        let head_bias = if self.lm_head_bias { vocab } else { 0 };

        n(self.n_layer)?
            .checked_sub(sparse)?
            .checked_mul(layer)?
            .checked_add(sparse.checked_mul(sparse_layer)?)?
            .checked_add(embedding)?
            .checked_add(norm)?
            .checked_add(head_weight)?
            .checked_add(head_bias)
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) fn named(name: &str) -> Config {
        Config::named(name).unwrap()
    }

    /// The `reason` of an [`Error::Config`], failing the test otherwise.
    pub(crate) fn config_reason<T: std::fmt::Debug>(result: Result<T>) -> String {
        match result {
            Err(Error::Config { reason, .. }) => reason,
            other => panic!("expected Error::Config, got {other:?}"),
        }
    }

    #[test]
    fn param_counts_match_the_real_models() {
        // The counts the models' own releases give (safetensors metadata).
        let expected: [(&str, u64); 31] = [
            ("open_llama_3b", 3_426_473_600),
            ("Llama-2-7b-hf", 6_738_415_616),
            ("Meta-Llama-3-8B", 8_030_261_248),
            ("Qwen2.5-7B", 7_615_616_512),
            ("Mistral-7B-v0.1", 7_241_732_096),
            ("Qwen2.5-0.5B", 494_032_768),
            ("Qwen2.5-1.5B", 1_543_714_304),
            ("Qwen2.5-3B", 3_085_938_688),
            ("Qwen3-0.6B", 596_049_920),
            ("Qwen3-1.7B", 1_720_574_976),
            ("Qwen3-4B", 4_022_468_096),
            ("Qwen3-8B", 8_190_735_360),
            // From their config.json geometry; the releases round them to
            // 14.8B and 32.8B.
            ("Qwen3-14B", 14_768_307_200),
            ("Qwen3-32B", 32_762_123_264),
            ("Qwen3-30B-A3B", 30_532_122_624),
            ("Mixtral-8x7B-v0.1", 46_702_792_704),
            ("Phi-3-mini-4k-instruct", 3_821_079_552),
            ("phi-4", 14_659_507_200),
            // From its config.json geometry; the release rounds it to 3.8B.
            ("Phi-4-mini-instruct", 3_836_021_760),
            ("Llama-3.2-1B", 1_235_814_400),
            ("Llama-3.2-3B", 3_212_749_824),
            ("Llama-3.1-8B", 8_030_261_248),
            ("tiny-llama-1.1b", 1_100_048_384),
            ("pythia-14m", 14_067_712),
            ("pythia-160m", 162_322_944),
            ("gemma-2-2b", 2_614_341_888),
            ("gemma-2-9b", 9_241_705_984),
            ("gemma-2-27b", 27_227_128_320),
            ("gemma-3-1b", 999_885_952),
            ("OLMo-2-0425-1B", 1_484_916_736),
            ("OLMo-2-1124-7B", 7_298_617_344),
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
            ("Qwen/Qwen2.5-0.5B-Instruct", "Qwen2.5-0.5B"),
            ("Qwen/Qwen2.5-7B-Instruct", "Qwen2.5-7B"),
            ("meta-llama/Llama-3.2-1B-Instruct", "Llama-3.2-1B"),
            ("meta-llama/Meta-Llama-3.1-8B-Instruct", "Llama-3.1-8B"),
            ("TinyLlama/TinyLlama-1.1B-Chat-v1.0", "tiny-llama-1.1b"),
            ("tiny-llama-1.1b-chat", "tiny-llama-1.1b"),
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
    fn gemma_and_mistral_layers_slide_and_rotate_as_their_models_do() {
        let mistral = named("Mistral-7B-v0.1");
        assert_eq!((mistral.block_size, mistral.sliding_window), (32768, Some(4096)));
        assert!((0..32).all(|l| mistral.scores(l) == Scores { window: 4096, softcap: 0.0 }));

        let g2 = named("gemma-2-9b");
        assert_eq!(g2.scores(0), Scores { window: 4096, softcap: 50.0 });
        assert_eq!(g2.scores(1), Scores { window: 0, softcap: 50.0 });
        assert_eq!(g2.scores(40), Scores { window: 4096, softcap: 50.0 });
        assert_eq!(g2.attention_scale(), 224f64.powf(-0.5));
        assert_eq!((g2.rope_of(0), g2.rope_of(1)), ((10000.0, None), (10000.0, None)));
        assert_eq!(named("gemma-2-27b").attention_scale(), 144f64.powf(-0.5));

        let g3 = named("gemma-3-4b");
        let global: Vec<usize> = (0..g3.n_layer).filter(|&l| g3.scores(l).window == 0).collect();
        assert_eq!(global, [5, 11, 17, 23, 29]);
        assert_eq!(g3.scores(4), Scores { window: 1024, softcap: 0.0 });
        assert_eq!(g3.rope_of(4), (10000.0, None));
        assert_eq!(g3.rope_of(5), (1e6, Some(linear_rope(8.0).into())));
        assert_eq!(named("gemma-3-1b").rope_of(5), (1e6, None));
        assert_eq!(named("gemma-3-1b").scores(0).window, 512);
        assert_eq!(named("google/gemma-3-27b-it"), named("gemma-3-27b"));
        assert_eq!(named("gemma-2-2b-it"), named("gemma-2-2b"));

        // The config files written before these fields existed read back
        // the same: none of them is serialized when off.
        let text = serde_json::to_string(&named("Qwen2.5-7B")).unwrap();
        for key in ["sliding", "softcap", "sandwich", "scale_embeddings", "attention_scalar", "rope_l"] {
            assert!(!text.contains(key), "{text}");
        }
        let back: Config = serde_json::from_str(&serde_json::to_string(&g3).unwrap()).unwrap();
        assert_eq!(back, g3);
    }

    #[test]
    fn linear_rope_scaling_divides_every_frequency_by_its_factor() {
        use crate::ops::rope::Rope;
        for (base, n_rot, factor) in [(10000.0, 256, 8.0), (1e6, 128, 8.0), (10.0, 16, 2.0), (1.5, 64, 3.0)] {
            let plain = Rope { n_rot, base, inverse: false, scaling: None };
            let linear = Rope { scaling: Some(linear_rope(factor).into()), ..plain.clone() };
            for i in 0..n_rot / 2 {
                assert_eq!(linear.inv_freq(i, 0), plain.inv_freq(i, 0) / factor, "base {base} pair {i}");
            }
        }
    }

    #[test]
    fn sliding_layers_take_their_shortest_form() {
        let list = |v: &[bool]| SlidingLayers::Listed(v.to_vec());
        assert_eq!(list(&[true, true, true]).canonical(3), SlidingLayers::All);
        assert_eq!(list(&[true, false, true, false]).canonical(4), SlidingLayers::GlobalEvery(2));
        assert_eq!(list(&[false, false]).canonical(2), SlidingLayers::GlobalEvery(1));
        assert_eq!(list(&[true, false, false]).canonical(3), list(&[true, false, false]));
        assert_eq!(SlidingLayers::GlobalEvery(6).canonical(5), SlidingLayers::All);
        let base = named("gemma-3-1b");
        let reason = config_reason(Config { sliding_layers: list(&[true]), ..base.clone() }.validate());
        assert!(reason.contains("sliding_layers lists 1 layers, but n_layer is 26"), "{reason}");
        let reason = config_reason(Config { sliding_window: Some(0), ..base.clone() }.validate());
        assert!(reason.contains("sliding_window must be at least one position"), "{reason}");
        let reason = config_reason(Config { final_softcap: Some(-2.0), ..base.clone() }.validate());
        assert!(reason.contains("final_softcap must be a finite number > 0, got -2"), "{reason}");
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
    fn names_resolve_ignoring_case_and_by_their_repo_name() {
        for (id, name) in [
            ("qwen2.5-7b", "Qwen2.5-7B"),
            ("QWEN/QWEN2.5-7B", "Qwen2.5-7B"),
            ("unsloth/Qwen2.5-7B", "Qwen2.5-7B"),
            ("meta-llama/meta-llama-3-8b", "Meta-Llama-3-8B"),
            ("llama-3-8b", "Meta-Llama-3-8B"),
            ("TINY-LLAMA", "tiny-llama"),
            ("eleutherai/Pythia-14M", "pythia-14m"),
        ] {
            assert_eq!(Config::named(id).unwrap().name, name, "{id}");
        }
    }

    #[test]
    fn unknown_names_suggest_the_closest() {
        let cases: [(&str, &[&str]); 8] = [
            ("qwen2.5-7", &["Qwen2.5-7B"]),
            ("qwen2.5-0.6b", &["Qwen2.5-0.5B"]),
            ("llama-3.2-2b", &["Llama-3.2-1B", "Llama-3.2-3B"]),
            ("Qwen2-7B", &["Qwen2.5-7B"]),
            ("pythia-14", &["pythia-14m"]),
            ("tiny_llama", &["tiny-llama"]),
            ("llama-3", &["Meta-Llama-3-8B"]),
            ("mistral", &["Mistral-7B-v0.1"]),
        ];
        for (name, want) in cases {
            let got = suggest_names(name);
            assert_eq!(&got[..want.len()], want, "{name}: {got:?}");
            let message = Config::named(name).unwrap_err().to_string();
            assert!(message.contains(&format!("did you mean `{}`", want[0])), "{message}");
        }
        assert!(suggest_names("gpt-17").is_empty(), "{:?}", suggest_names("gpt-17"));
        let message = Config::named("gpt-17").unwrap_err().to_string();
        assert!(!message.contains("did you mean"), "{message}");
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
}
