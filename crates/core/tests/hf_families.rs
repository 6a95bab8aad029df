//! Mistral with a window, Gemma 2 and Gemma 3's language model, and the
//! mixtures of experts Mixtral (a window, renormalised routing) and
//! Qwen3-MoE (q/k norms, a dense layer among the sparse ones, routing
//! weights left as the softmax gives them): tiny
//! folders written here in `transformers`' layout (its tensor names, its
//! config keys) with every setting that changes the math away from its
//! default (windows shorter than the sequence, soft-caps that bite, heads
//! wider than the width over the heads, `query_pre_attn_scalar` apart from
//! the head size, two RoPE bases, linear RoPE scaling, an embedding scale
//! that rounds in bf16), then loaded and checked against a plain f64
//! implementation written here from `transformers`' modeling code: the
//! logits, the loss and the gradient of every tensor; saved with `--out`'s
//! code and read back; and generated from, greedy decoding equal to the
//! argmax of the full forward, decode logits equal to its last row.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};

use safetensors::tensor::TensorView;
use safetensors::Dtype;
use serde_json::{json, Value};
use stepgraph_core::autodiff::{build_step, StepKind, TrainOptions};
use stepgraph_core::cpu::exec::CpuSession;
use stepgraph_core::generation::{Generator, Request, Sampling};
use stepgraph_core::host::HostTensor;
use stepgraph_core::ir::{DType, OutputKind, TensorType};
use stepgraph_core::models::checkpoint::read_safetensors;
use stepgraph_core::models::generate::{build_generation, FusedWriter, GenerationProgram, GenerationSpec};
use stepgraph_core::models::gpt::{build_forward_with_logits, LOGITS_OUTPUT, TARGETS_INPUT, TOKENS_INPUT};
use stepgraph_core::models::hf_dir::{save_hf_dir, to_hf_tensors, HfFamily, HfModelDir, SaveOptions};
use stepgraph_core::models::{Config, LossKind, ModelSpec};
use stepgraph_core::ops::Op;
use stepgraph_core::pipeline::{compile_step, StepOptions};
use stepgraph_core::plan::{check_plan, plan, PlanOptions};
use stepgraph_core::session::Session;

const VOCAB: usize = 40;
/// √24 = 4.898979…: 4.90625 in bf16, another number in f32.
const HIDDEN: usize = 24;
const HEADS: usize = 4;
const KV_HEADS: usize = 2;
/// Wider than the width over the heads (6).
const HEAD_DIM: usize = 8;
const INTERMEDIATE: usize = 20;
const BATCH: usize = 2;
const SEQ: usize = 8;
/// Shorter than the sequence.
const WINDOW: usize = 3;
const IGNORE: i64 = -100;

/// Experts of a fixture and each one's width.
const EXPERTS: usize = 4;
const EXPERT_WIDTH: usize = 12;

/// The families, and what their fixtures set.
#[derive(Copy, Clone, Debug, PartialEq)]
enum Kind {
    Mistral,
    Gemma2,
    Gemma3,
    Mixtral,
    Qwen3Moe,
}

/// A fixture's mixture of experts, as the reference computes it.
#[derive(Clone, Debug)]
struct NetMoe {
    /// Experts per token.
    k: usize,
    /// Width of each expert (the dense layers keep [`INTERMEDIATE`]).
    width: usize,
    /// The chosen probabilities renormalised to sum to one.
    normalize: bool,
    /// Layers with the dense MLP.
    dense: Vec<usize>,
    /// The load-balancing loss's weight (`output_router_logits`).
    aux: Option<f64>,
    /// The router's and the experts' tensor names, `{p}` the layer's prefix
    /// and `{e}` the expert.
    router: &'static str,
    gate: &'static str,
    up: &'static str,
    down: &'static str,
}

/// The network a fixture describes, as the reference computes it.
#[derive(Clone, Debug)]
struct Net {
    kind: Kind,
    layers: usize,
    /// Per layer: a sliding layer.
    sliding: Vec<bool>,
    window: usize,
    scale: f64,
    /// `attn_logit_softcapping` as the fixture's config.json says it.
    attn_cap: Option<f64>,
    final_cap: Option<f64>,
    /// RoPE base and linear factor of global layers, base of sliding ones.
    rope_global: f64,
    rope_linear: f64,
    rope_local: f64,
    tied: bool,
    eps: f64,
    /// RMSNorms over each head of q and k (Gemma 3's offset from one, Qwen3's not).
    qk_norm: bool,
    moe: Option<NetMoe>,
}

impl Net {
    /// The attention soft-cap the network applies: `transformers`' Gemma 3
    /// keeps the config field but never applies it.
    fn applied_attn_cap(&self) -> Option<f64> {
        if self.kind == Kind::Gemma3 {
            None
        } else {
            self.attn_cap
        }
    }
}

impl Kind {
    fn gemma(self) -> bool {
        matches!(self, Kind::Gemma2 | Kind::Gemma3)
    }

    fn family(self) -> HfFamily {
        match self {
            Kind::Mistral => HfFamily::Mistral,
            Kind::Gemma2 => HfFamily::Gemma2,
            Kind::Gemma3 => HfFamily::Gemma3,
            Kind::Mixtral => HfFamily::Mixtral,
            Kind::Qwen3Moe => HfFamily::Qwen3Moe,
        }
    }

    fn net(self) -> Net {
        match self {
            Kind::Mistral => Net {
                kind: self,
                layers: 2,
                sliding: vec![true, true],
                window: WINDOW,
                scale: 1.0 / (HEAD_DIM as f64).sqrt(),
                attn_cap: None,
                final_cap: None,
                rope_global: 500.0,
                rope_linear: 1.0,
                rope_local: 500.0,
                tied: false,
                eps: 1e-5,
                qk_norm: false,
                moe: None,
            },
            // Explicit layer types: sliding, global, sliding.
            Kind::Gemma2 => Net {
                kind: self,
                layers: 3,
                sliding: vec![true, false, true],
                window: WINDOW,
                scale: 10f64.powf(-0.5),
                attn_cap: Some(2.0),
                final_cap: Some(3.0),
                rope_global: 300.0,
                rope_linear: 1.0,
                rope_local: 300.0,
                tied: true,
                eps: 1e-6,
                qk_norm: false,
                moe: None,
            },
            // The default pattern from `sliding_window_pattern` 3: two
            // sliding layers, then a global one.
            Kind::Gemma3 => Net {
                kind: self,
                layers: 4,
                sliding: vec![true, true, false, true],
                window: WINDOW,
                scale: 10f64.powf(-0.5),
                attn_cap: Some(4.0),
                final_cap: Some(5.0),
                rope_global: 2000.0,
                rope_linear: 2.0,
                rope_local: 30.0,
                tied: true,
                eps: 1e-6,
                qk_norm: true,
                moe: None,
            },
            // Mistral's window on every layer, experts on both.
            Kind::Mixtral => Net {
                moe: Some(NetMoe {
                    k: 2,
                    width: INTERMEDIATE,
                    normalize: true,
                    dense: vec![],
                    aux: Some(0.02),
                    router: "{p}.block_sparse_moe.gate.weight",
                    gate: "{p}.block_sparse_moe.experts.{e}.w1.weight",
                    up: "{p}.block_sparse_moe.experts.{e}.w3.weight",
                    down: "{p}.block_sparse_moe.experts.{e}.w2.weight",
                }),
                rope_global: 700.0,
                rope_local: 700.0,
                ..Kind::Mistral.net()
            },
            // No window; layer 1 of three dense.
            Kind::Qwen3Moe => Net {
                kind: self,
                layers: 3,
                sliding: vec![false; 3],
                window: WINDOW,
                scale: 1.0 / (HEAD_DIM as f64).sqrt(),
                attn_cap: None,
                final_cap: None,
                rope_global: 900.0,
                rope_linear: 1.0,
                rope_local: 900.0,
                tied: false,
                eps: 1e-6,
                qk_norm: true,
                moe: Some(NetMoe {
                    k: 2,
                    width: EXPERT_WIDTH,
                    normalize: false,
                    dense: vec![1],
                    aux: None,
                    router: "{p}.mlp.gate.weight",
                    gate: "{p}.mlp.experts.{e}.gate_proj.weight",
                    up: "{p}.mlp.experts.{e}.up_proj.weight",
                    down: "{p}.mlp.experts.{e}.down_proj.weight",
                }),
            },
        }
    }
}

impl NetMoe {
    fn name(pattern: &str, prefix: &str, expert: usize) -> String {
        pattern.replace("{p}", prefix).replace("{e}", &expert.to_string())
    }
}

/// The config.json `transformers` writes for the fixture.
fn config_json(kind: Kind) -> Value {
    let net = kind.net();
    let common = json!({
        "vocab_size": VOCAB, "hidden_size": HIDDEN, "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": net.layers, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM, "max_position_embeddings": 64, "rms_norm_eps": net.eps,
        "tie_word_embeddings": net.tied, "torch_dtype": "float32", "bos_token_id": 2, "eos_token_id": 1,
        "pad_token_id": 0, "attention_dropout": 0.0, "sliding_window": WINDOW,
    });
    let mut c = common.as_object().unwrap().clone();
    let mut set = |k: &str, v: Value| {
        c.insert(k.to_string(), v);
    };
    match kind {
        Kind::Mistral => {
            set("architectures", json!(["MistralForCausalLM"]));
            set("model_type", json!("mistral"));
            set("hidden_act", json!("silu"));
            set("rope_theta", json!(net.rope_global));
        }
        Kind::Gemma2 => {
            set("architectures", json!(["Gemma2ForCausalLM"]));
            set("model_type", json!("gemma2"));
            set("hidden_act", json!("gelu_pytorch_tanh"));
            set("hidden_activation", json!("gelu_pytorch_tanh"));
            set("query_pre_attn_scalar", json!(10));
            set("attn_logit_softcapping", json!(net.attn_cap));
            set("final_logit_softcapping", json!(net.final_cap));
            set("layer_types", json!(["sliding_attention", "full_attention", "sliding_attention"]));
            set("rope_theta", json!(net.rope_global));
            set("attention_bias", json!(false));
            set("cache_implementation", json!("hybrid"));
        }
        Kind::Gemma3 => {
            set("architectures", json!(["Gemma3ForCausalLM"]));
            set("model_type", json!("gemma3_text"));
            set("hidden_activation", json!("gelu_pytorch_tanh"));
            set("query_pre_attn_scalar", json!(10));
            set("attn_logit_softcapping", json!(net.attn_cap));
            set("final_logit_softcapping", json!(net.final_cap));
            set("sliding_window_pattern", json!(3));
            set("rope_theta", json!(net.rope_global));
            set("rope_local_base_freq", json!(net.rope_local));
            set("rope_scaling", json!({"rope_type": "linear", "factor": net.rope_linear}));
        }
        Kind::Mixtral => {
            set("architectures", json!(["MixtralForCausalLM"]));
            set("model_type", json!("mixtral"));
            set("hidden_act", json!("silu"));
            set("rope_theta", json!(net.rope_global));
            set("num_local_experts", json!(EXPERTS));
            set("num_experts_per_tok", json!(2));
            // The load-balancing loss joins the training loss.
            set("output_router_logits", json!(true));
            set("router_aux_loss_coef", json!(0.02));
            set("router_jitter_noise", json!(0.0));
        }
        Kind::Qwen3Moe => {
            set("architectures", json!(["Qwen3MoeForCausalLM"]));
            set("model_type", json!("qwen3_moe"));
            set("hidden_act", json!("silu"));
            set("rope_theta", json!(net.rope_global));
            set("attention_bias", json!(false));
            set("use_sliding_window", json!(false));
            set("max_window_layers", json!(3));
            // As transformers 5 writes it (released folders say num_experts).
            set("num_local_experts", json!(EXPERTS));
            set("num_experts_per_tok", json!(2));
            set("moe_intermediate_size", json!(EXPERT_WIDTH));
            set("norm_topk_prob", json!(false));
            set("decoder_sparse_step", json!(1));
            set("mlp_only_layers", json!([1]));
            set("output_router_logits", json!(false));
            set("router_aux_loss_coef", json!(0.001));
        }
    }
    Value::Object(c)
}

/// Deterministic values: `center` plus a uniform spread of `±spread`.
fn values(n: usize, seed: u64, center: f64, spread: f64) -> Vec<f64> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            // Exactly representable in f32, so the folder holds these values.
            let u = ((state >> 40) as f64 / (1u64 << 24) as f64 - 0.5) * 2.0;
            (center + u * spread) as f32 as f64
        })
        .collect()
}

/// The tensors of the fixture, as `transformers` names them: name, shape,
/// values. Projections are large enough that the soft-caps bite.
fn hf_tensors(kind: Kind) -> BTreeMap<String, (Vec<usize>, Vec<f64>)> {
    let net = kind.net();
    let mut out = BTreeMap::new();
    let mut seed = 10u64;
    let mut add = |name: String, shape: Vec<usize>, center: f64, spread: f64| {
        seed += 1;
        let n = shape.iter().product();
        out.insert(name, (shape, values(n, seed, center, spread)));
    };
    let (c, q, kv, i) = (HIDDEN, HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, INTERMEDIATE);
    // Gemma's norm weights are offsets from one.
    let norm_center = if kind.gemma() { 0.0 } else { 1.0 };
    add("model.embed_tokens.weight".into(), vec![VOCAB, c], 0.0, 0.6);
    for l in 0..net.layers {
        let p = format!("model.layers.{l}");
        add(format!("{p}.input_layernorm.weight"), vec![c], norm_center, 0.3);
        add(format!("{p}.post_attention_layernorm.weight"), vec![c], norm_center, 0.3);
        if kind.gemma() {
            add(format!("{p}.pre_feedforward_layernorm.weight"), vec![c], norm_center, 0.3);
            add(format!("{p}.post_feedforward_layernorm.weight"), vec![c], norm_center, 0.3);
        }
        add(format!("{p}.self_attn.q_proj.weight"), vec![q, c], 0.0, 0.6);
        add(format!("{p}.self_attn.k_proj.weight"), vec![kv, c], 0.0, 0.6);
        add(format!("{p}.self_attn.v_proj.weight"), vec![kv, c], 0.0, 0.4);
        add(format!("{p}.self_attn.o_proj.weight"), vec![c, q], 0.0, 0.3);
        if net.qk_norm {
            add(format!("{p}.self_attn.q_norm.weight"), vec![HEAD_DIM], norm_center, 0.3);
            add(format!("{p}.self_attn.k_norm.weight"), vec![HEAD_DIM], norm_center, 0.3);
        }
        match &net.moe {
            Some(moe) if !moe.dense.contains(&l) => {
                // A router spread wide enough that no two chosen experts tie.
                add(NetMoe::name(moe.router, &p, 0), vec![EXPERTS, c], 0.0, 1.5);
                for e in 0..EXPERTS {
                    add(NetMoe::name(moe.gate, &p, e), vec![moe.width, c], 0.0, 0.4);
                    add(NetMoe::name(moe.up, &p, e), vec![moe.width, c], 0.0, 0.4);
                    add(NetMoe::name(moe.down, &p, e), vec![c, moe.width], 0.0, 0.3);
                }
            }
            _ => {
                add(format!("{p}.mlp.gate_proj.weight"), vec![i, c], 0.0, 0.4);
                add(format!("{p}.mlp.up_proj.weight"), vec![i, c], 0.0, 0.4);
                add(format!("{p}.mlp.down_proj.weight"), vec![c, i], 0.0, 0.3);
            }
        }
    }
    add("model.norm.weight".into(), vec![c], norm_center, 0.3);
    if !net.tied {
        add("lm_head.weight".into(), vec![VOCAB, c], 0.0, 0.6);
    }
    out
}

/// Writes the fixture into a new folder `name` under `root`.
fn write_fixture(root: &Path, name: &str, kind: Kind) -> PathBuf {
    let dir = root.join(name);
    fs::create_dir_all(&dir).unwrap();
    fs::write(dir.join("config.json"), serde_json::to_string_pretty(&config_json(kind)).unwrap()).unwrap();
    let tensors = hf_tensors(kind);
    let bytes: Vec<(String, Vec<usize>, Vec<u8>)> = tensors
        .iter()
        .map(|(n, (shape, v))| (n.clone(), shape.clone(), v.iter().flat_map(|x| (*x as f32).to_le_bytes()).collect()))
        .collect();
    let views: Vec<(String, TensorView)> =
        bytes.iter().map(|(n, s, b)| (n.clone(), TensorView::new(Dtype::F32, s.clone(), b).unwrap())).collect();
    let metadata = Some(std::collections::HashMap::from([("format".to_string(), "pt".to_string())]));
    fs::write(dir.join("model.safetensors"), safetensors::serialize(views, metadata).unwrap()).unwrap();
    fs::write(dir.join("tokenizer.json"), br#"{"version": "1.0", "model": {"type": "BPE"}}"#).unwrap();
    dir
}

// ------------------------------------------------------------ the reference

/// `transformers`' RMSNorm of one row: `x·rstd·w`, Gemma's `x·rstd·(1 + w)`.
fn rms(x: &[f64], w: &[f64], eps: f64, offset: bool) -> Vec<f64> {
    let ms = x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64;
    let r = 1.0 / (ms + eps).sqrt();
    x.iter().zip(w).map(|(v, w)| v * r * if offset { 1.0 + w } else { *w }).collect()
}

/// `y = x·Wᵀ` for one row.
fn matvec(w: &[f64], x: &[f64], out: usize) -> Vec<f64> {
    let inp = x.len();
    (0..out).map(|o| (0..inp).map(|k| w[o * inp + k] * x[k]).sum()).collect()
}

fn gelu_tanh(x: f64) -> f64 {
    0.5 * x * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x * x * x)).tanh())
}

fn silu(x: f64) -> f64 {
    x / (1.0 + (-x).exp())
}

fn cap(x: f64, c: Option<f64>) -> f64 {
    match c {
        Some(c) => c * (x / c).tanh(),
        None => x,
    }
}

/// `rotate_half` RoPE of one head at position `pos`.
fn rope(x: &mut [f64], pos: usize, base: f64, factor: f64) {
    let d = x.len();
    for k in 0..d / 2 {
        let inv = base.powf(-((2 * k) as f64) / d as f64) / factor;
        let (s, c) = (pos as f64 * inv).sin_cos();
        let (a, b) = (x[k], x[k + d / 2]);
        x[k] = a * c - b * s;
        x[k + d / 2] = b * c + a * s;
    }
}

/// The logits `[B·T, V]` of the network on `ids`, in f64.
fn reference_logits(net: &Net, w: &BTreeMap<String, (Vec<usize>, Vec<f64>)>, ids: &[usize]) -> Vec<f64> {
    reference_forward(net, w, ids).0
}

/// The training loss: the cross-entropy, plus the weighted load-balancing
/// loss of a mixture of experts that adds it.
fn reference_total_loss(
    net: &Net,
    w: &BTreeMap<String, (Vec<usize>, Vec<f64>)>,
    ids: &[usize],
    targets: &[i64],
) -> f64 {
    let (logits, aux) = reference_forward(net, w, ids);
    let weight = net.moe.as_ref().and_then(|m| m.aux).unwrap_or(0.0);
    reference_loss(&logits, targets) + weight * aux
}

/// The logits and the load-balancing loss (`transformers`'
/// `load_balancing_loss_func` over every sparse layer's router at once:
/// `E · Σ_e f_e · P_e`, `f_e` the share of (token, slot) pairs routed to
/// `e`, `P_e` its mean probability; 0 for a dense network).
fn reference_forward(net: &Net, w: &BTreeMap<String, (Vec<usize>, Vec<f64>)>, ids: &[usize]) -> (Vec<f64>, f64) {
    let (mut routed, mut prob_sums, mut rows) = (vec![0.0; EXPERTS], vec![0.0; EXPERTS], 0usize);
    let t_len = ids.len() / BATCH;
    let g = |name: &str| &w[name].1;
    let gemma = net.kind.gemma();
    let norm = |x: &[f64], name: &str| rms(x, g(name), net.eps, gemma);
    let mut logits = Vec::new();
    for b in 0..BATCH {
        let scale = if gemma { (HIDDEN as f64).sqrt() } else { 1.0 };
        let mut x: Vec<Vec<f64>> = (0..t_len)
            .map(|t| {
                let id = ids[b * t_len + t];
                g("model.embed_tokens.weight")[id * HIDDEN..(id + 1) * HIDDEN].iter().map(|v| v * scale).collect()
            })
            .collect();
        for l in 0..net.layers {
            let p = format!("model.layers.{l}");
            let attn_in: Vec<Vec<f64>> = x.iter().map(|r| norm(r, &format!("{p}.input_layernorm.weight"))).collect();
            let (base, factor) =
                if net.sliding[l] { (net.rope_local, 1.0) } else { (net.rope_global, net.rope_linear) };
            // Projections, q/k norms, rotation.
            let mut q = Vec::new();
            let mut k = Vec::new();
            let mut v = Vec::new();
            for (t, h) in attn_in.iter().enumerate() {
                let mut qt = matvec(g(&format!("{p}.self_attn.q_proj.weight")), h, HEADS * HEAD_DIM);
                let mut kt = matvec(g(&format!("{p}.self_attn.k_proj.weight")), h, KV_HEADS * HEAD_DIM);
                for (heads, xt, which) in [(HEADS, &mut qt, "q"), (KV_HEADS, &mut kt, "k")] {
                    for head in 0..heads {
                        let row = &mut xt[head * HEAD_DIM..(head + 1) * HEAD_DIM];
                        if net.qk_norm {
                            let normed = rms(row, g(&format!("{p}.self_attn.{which}_norm.weight")), net.eps, gemma);
                            row.copy_from_slice(&normed);
                        }
                        rope(row, t, base, factor);
                    }
                }
                q.push(qt);
                k.push(kt);
                v.push(matvec(g(&format!("{p}.self_attn.v_proj.weight")), h, KV_HEADS * HEAD_DIM));
            }
            let mut attn_out = Vec::new();
            for (i, qi) in q.iter().enumerate() {
                let mut o = vec![0.0; HEADS * HEAD_DIM];
                for head in 0..HEADS {
                    let kvh = head / (HEADS / KV_HEADS);
                    let lo = if net.sliding[l] { (i + 1).saturating_sub(net.window) } else { 0 };
                    let scores: Vec<f64> = (lo..=i)
                        .map(|j| {
                            let dot: f64 =
                                (0..HEAD_DIM).map(|d| qi[head * HEAD_DIM + d] * k[j][kvh * HEAD_DIM + d]).sum();
                            cap(dot * net.scale, net.applied_attn_cap())
                        })
                        .collect();
                    let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let e: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
                    let z: f64 = e.iter().sum();
                    for (jj, j) in (lo..=i).enumerate() {
                        for d in 0..HEAD_DIM {
                            o[head * HEAD_DIM + d] += e[jj] / z * v[j][kvh * HEAD_DIM + d];
                        }
                    }
                }
                attn_out.push(matvec(g(&format!("{p}.self_attn.o_proj.weight")), &o, HIDDEN));
            }
            for (t, a) in attn_out.iter().enumerate() {
                let a = if gemma { norm(a, &format!("{p}.post_attention_layernorm.weight")) } else { a.clone() };
                x[t].iter_mut().zip(&a).for_each(|(x, a)| *x += a);
            }
            for xt in x.iter_mut() {
                let pre = if gemma { "pre_feedforward_layernorm" } else { "post_attention_layernorm" };
                let h = norm(xt, &format!("{p}.{pre}.weight"));
                let mlp = |gate: &str, up: &str, down: &str, width: usize| {
                    let gate = matvec(g(gate), &h, width);
                    let up = matvec(g(up), &h, width);
                    let act: Vec<f64> =
                        gate.iter().zip(&up).map(|(g, u)| if gemma { gelu_tanh(*g) } else { silu(*g) } * u).collect();
                    matvec(g(down), &act, HIDDEN)
                };
                let m = match &net.moe {
                    Some(moe) if !moe.dense.contains(&l) => {
                        // transformers' routing: softmax over the experts, the
                        // k most probable (the lower index among equals),
                        // renormalised or not, each expert's MLP weighted.
                        let scores = matvec(g(&NetMoe::name(moe.router, &p, 0)), &h, EXPERTS);
                        let top = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                        let e: Vec<f64> = scores.iter().map(|s| (s - top).exp()).collect();
                        let z: f64 = e.iter().sum();
                        let probs: Vec<f64> = e.iter().map(|x| x / z).collect();
                        let mut order: Vec<usize> = (0..EXPERTS).collect();
                        order.sort_by(|&a, &b| probs[b].partial_cmp(&probs[a]).unwrap().then(a.cmp(&b)));
                        let chosen = &order[..moe.k];
                        rows += 1;
                        for (e, p) in probs.iter().enumerate() {
                            prob_sums[e] += p;
                        }
                        for &e in chosen {
                            routed[e] += 1.0;
                        }
                        let total: f64 = if moe.normalize { chosen.iter().map(|&e| probs[e]).sum() } else { 1.0 };
                        let mut m = vec![0.0; HIDDEN];
                        for &ex in chosen {
                            let name = |pattern| NetMoe::name(pattern, &p, ex);
                            let y = mlp(&name(moe.gate), &name(moe.up), &name(moe.down), moe.width);
                            m.iter_mut().zip(&y).for_each(|(m, y)| *m += probs[ex] / total * y);
                        }
                        m
                    }
                    _ => mlp(
                        &format!("{p}.mlp.gate_proj.weight"),
                        &format!("{p}.mlp.up_proj.weight"),
                        &format!("{p}.mlp.down_proj.weight"),
                        INTERMEDIATE,
                    ),
                };
                let m = if gemma { norm(&m, &format!("{p}.post_feedforward_layernorm.weight")) } else { m };
                xt.iter_mut().zip(&m).for_each(|(x, m)| *x += m);
            }
        }
        let head = if net.tied { "model.embed_tokens.weight" } else { "lm_head.weight" };
        for xt in &x {
            let h = norm(xt, "model.norm.weight");
            logits.extend(matvec(g(head), &h, VOCAB).into_iter().map(|z| cap(z, net.final_cap)));
        }
    }
    let aux = if rows == 0 {
        0.0
    } else {
        let n = rows as f64;
        EXPERTS as f64 * routed.iter().zip(&prob_sums).map(|(f, p)| (f / n) * (p / n)).sum::<f64>()
    };
    (logits, aux)
}

/// Mean cross-entropy of `logits` against `targets` (skipping [`IGNORE`]).
fn reference_loss(logits: &[f64], targets: &[i64]) -> f64 {
    let (mut sum, mut n) = (0.0, 0);
    for (row, &t) in logits.chunks(VOCAB).zip(targets) {
        if t == IGNORE {
            continue;
        }
        let m = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let lse = m + row.iter().map(|z| (z - m).exp()).sum::<f64>().ln();
        sum += lse - row[t as usize];
        n += 1;
    }
    sum / n as f64
}

// ------------------------------------------------------------ stepgraph

fn batch() -> (Vec<usize>, Vec<i64>) {
    let ids: Vec<usize> = (0..BATCH * SEQ).map(|i| (i * 17 + 3) % VOCAB).collect();
    let mut targets: Vec<i64> = (0..BATCH * SEQ).map(|i| ((i * 11 + 5) % VOCAB) as i64).collect();
    targets[SEQ - 1] = IGNORE;
    (ids, targets)
}

fn spec(config: &Config, dtype: DType) -> ModelSpec {
    ModelSpec {
        config: config.clone(),
        batch: BATCH,
        seq: SEQ,
        dtype,
        loss: LossKind::CrossEntropy,
        adapters: None,
        documents: false,
    }
}

fn write_batch(s: &mut dyn Session) {
    let (ids, targets) = batch();
    let ty = TensorType::new(DType::I32, [BATCH, SEQ]);
    let ids: Vec<f64> = ids.iter().map(|&i| i as f64).collect();
    let targets: Vec<f64> = targets.iter().map(|&t| t as f64).collect();
    s.write_named(TOKENS_INPUT, &HostTensor::from_f64(ty.clone(), &ids)).unwrap();
    s.write_named(TARGETS_INPUT, &HostTensor::from_f64(ty, &targets)).unwrap();
}

/// stepgraph's logits and loss on the folder, in `dtype`.
fn stepgraph_forward(hf: &HfModelDir, dtype: DType) -> (Vec<f64>, f64) {
    let fwd = build_forward_with_logits(&spec(hf.config(), dtype)).unwrap();
    let step = build_step(&fwd, StepKind::Forward, &TrainOptions::default()).unwrap();
    let p = plan(&step, PlanOptions::default()).unwrap();
    check_plan(&step, &p).unwrap();
    let mut s = CpuSession::new(step.clone(), p).unwrap();
    hf.load_into(&fwd, &mut s).unwrap();
    write_batch(&mut s);
    s.run_eager().unwrap();
    let out = step.outputs.iter().find(|o| o.kind == OutputKind::Named(LOGITS_OUTPUT.into())).unwrap().value;
    (s.read(out).to_f64(), s.loss().unwrap())
}

fn rel(a: &[f64], b: &[f64]) -> f64 {
    let d: f64 = a.iter().zip(b).map(|(x, y)| (x - y) * (x - y)).sum::<f64>().sqrt();
    let n: f64 = b.iter().map(|y| y * y).sum::<f64>().sqrt();
    d / n
}

const KINDS: [Kind; 5] = [Kind::Mistral, Kind::Gemma2, Kind::Gemma3, Kind::Mixtral, Kind::Qwen3Moe];

#[test]
fn configs_read_as_the_fixture_says() {
    let root = tempfile::tempdir().unwrap();
    for kind in KINDS {
        let hf = HfModelDir::open(&write_fixture(root.path(), "m", kind)).unwrap();
        let (c, net) = (hf.config(), kind.net());
        assert_eq!(hf.family(), kind.family());
        let window = net.sliding.iter().any(|&s| s).then_some(WINDOW);
        assert_eq!((c.head_size, c.n_query_groups, c.sliding_window), (HEAD_DIM, KV_HEADS, window), "{kind:?}");
        if let Some(moe) = &net.moe {
            let m = c.moe.as_ref().unwrap_or_else(|| panic!("{kind:?}: no experts"));
            assert_eq!((m.experts, m.experts_per_token, m.expert_intermediate_size), (EXPERTS, moe.k, moe.width));
            assert_eq!((m.normalize_top_k, &m.dense_layers), (moe.normalize, &moe.dense), "{kind:?}");
        }
        for l in 0..net.layers {
            let scores = c.scores(l);
            assert_eq!(scores.window, if net.sliding[l] { WINDOW } else { 0 }, "{kind:?} layer {l}");
            assert_eq!(scores.softcap, net.applied_attn_cap().unwrap_or(0.0), "{kind:?} layer {l}");
            let (base, _) = c.rope_of(l);
            assert_eq!(base, if net.sliding[l] { net.rope_local } else { net.rope_global }, "{kind:?} layer {l}");
        }
        assert_eq!(c.attention_scale(), net.scale);
        assert_eq!(c.final_softcap, net.final_cap);
        fs::remove_dir_all(root.path().join("m")).unwrap();
    }
}

#[test]
fn logits_and_loss_match_the_f64_reference() {
    let root = tempfile::tempdir().unwrap();
    for kind in KINDS {
        let dir = write_fixture(root.path(), &format!("{kind:?}"), kind);
        let hf = HfModelDir::open(&dir).unwrap();
        let (ids, targets) = batch();
        let want = reference_logits(&kind.net(), &hf_tensors(kind), &ids);
        let want_loss = reference_total_loss(&kind.net(), &hf_tensors(kind), &ids, &targets);
        // The caps bite: some scores and logits are far along the tanh.
        let big = want.iter().filter(|z| z.abs() > 0.5 * kind.net().final_cap.unwrap_or(f64::INFINITY)).count();
        assert!(!kind.gemma() || big > 10, "{kind:?}: {big} logits near the cap");

        let (logits, loss) = stepgraph_forward(&hf, DType::F64);
        let e = rel(&logits, &want);
        assert!(e < 1e-12, "{kind:?} f64 logits: rel {e:e}");
        assert!((loss - want_loss).abs() < 1e-12 * want_loss, "{kind:?} f64 loss {loss} vs {want_loss}");

        let (logits, loss) = stepgraph_forward(&hf, DType::F32);
        let e = rel(&logits, &want);
        assert!(e < 2e-6, "{kind:?} f32 logits: rel {e:e}");
        assert!((loss - want_loss).abs() < 2e-6 * want_loss, "{kind:?} f32 loss {loss} vs {want_loss}");

        // In bf16 (the norms in f32 between two roundings), within bf16's precision.
        let (logits, loss) = stepgraph_forward(&hf, DType::BF16);
        let e = rel(&logits, &want);
        assert!(e < 3e-2, "{kind:?} bf16 logits: rel {e:e}");
        assert!((loss - want_loss).abs() < 3e-2 * want_loss, "{kind:?} bf16 loss {loss} vs {want_loss}");
    }
}

#[test]
fn every_gradient_matches_finite_differences_of_the_reference() {
    let root = tempfile::tempdir().unwrap();
    for kind in KINDS {
        let dir = write_fixture(root.path(), &format!("{kind:?}"), kind);
        let hf = HfModelDir::open(&dir).unwrap();
        let config = hf.config().clone();
        let compiled = compile_step(&spec(&config, DType::F64), &StepOptions::new(StepKind::Grads)).unwrap();
        let mut s = CpuSession::new(compiled.step.clone(), compiled.plan.clone()).unwrap();
        hf.load_into(&compiled.forward, &mut s).unwrap();
        write_batch(&mut s);
        s.run_eager().unwrap();
        let grads: BTreeMap<String, HostTensor> = to_hf_tensors(hf.family(), &compiled.forward, config.n_head, |n| {
            let trace = s.trace();
            let g = trace.grad_of(trace.leaf_by_name(n).unwrap()).unwrap();
            Ok(s.read(g))
        })
        .unwrap()
        .into_iter()
        .collect();

        let tensors = hf_tensors(kind);
        assert_eq!(grads.keys().collect::<Vec<_>>(), tensors.keys().collect::<Vec<_>>(), "{kind:?}");
        let (ids, targets) = batch();
        let net = kind.net();
        for (k, (name, (_, w))) in tensors.iter().enumerate() {
            // ⟨∇L, u⟩ against central differences of the reference along u.
            let u = values(w.len(), 1000 + k as u64, 0.0, 1.0);
            let analytic: f64 = grads[name].to_f64().iter().zip(&u).map(|(g, u)| g * u).sum();
            let eps = 1e-5;
            let at = |sign: f64| {
                let mut moved = tensors.clone();
                moved.get_mut(name).unwrap().1.iter_mut().zip(&u).for_each(|(x, u)| *x += sign * eps * u);
                reference_total_loss(&net, &moved, &ids, &targets)
            };
            let fd = (at(1.0) - at(-1.0)) / (2.0 * eps);
            let err = (fd - analytic).abs() / fd.abs().max(analytic.abs()).max(1e-8);
            assert!(err < 1e-6, "{kind:?} `{name}`: finite differences {fd} vs gradient {analytic} (rel {err:e})");
        }
    }
}

#[test]
fn the_embedding_scale_is_rounded_to_the_model_dtype() {
    let root = tempfile::tempdir().unwrap();
    let hf = HfModelDir::open(&write_fixture(root.path(), "g", Kind::Gemma2)).unwrap();
    for (dtype, want) in
        [(DType::BF16, 4.90625), (DType::F32, (HIDDEN as f64).sqrt() as f32 as f64), (DType::F64, 24f64.sqrt())]
    {
        let fwd = build_forward_with_logits(&spec(hf.config(), dtype)).unwrap();
        // The embedding's output times a scalar of the model's dtype.
        let embedding = fwd.nodes.iter().find(|n| n.op.name() == "embedding").unwrap().outputs[0];
        let scaled = fwd.nodes.iter().find(|n| n.op.name() == "mul" && n.inputs.contains(&embedding)).unwrap();
        let scalar = scaled.inputs.iter().find(|&&v| v != embedding).unwrap();
        let full = fwd.nodes.iter().find(|n| n.outputs.contains(scalar)).unwrap();
        let Op::Full(f) = &full.op else { panic!("{dtype}: the scale is no constant") };
        assert_eq!(f.ty.dtype, dtype);
        let held = match dtype {
            DType::BF16 => half::bf16::from_f64(f.value).to_f64(),
            DType::F32 => f.value as f32 as f64,
            _ => f.value,
        };
        assert_eq!(held, want, "{dtype}");
    }
}

/// The window a fixture's network has, if any.
fn net_window(kind: Kind) -> Option<usize> {
    kind.net().sliding.iter().any(|&s| s).then_some(WINDOW)
}

/// The tensors of a folder by name.
fn folder_tensors(dir: &Path) -> BTreeMap<String, HostTensor> {
    read_safetensors(&dir.join("model.safetensors")).unwrap().into_iter().collect()
}

#[test]
fn a_saved_folder_has_the_family_names_and_keys_and_reads_back() {
    let root = tempfile::tempdir().unwrap();
    for kind in KINDS {
        let dir = write_fixture(root.path(), &format!("in-{kind:?}"), kind);
        let hf = HfModelDir::open(&dir).unwrap();
        let fwd = build_forward_with_logits(&spec(hf.config(), DType::F32)).unwrap();
        let p = plan(&fwd, PlanOptions::default()).unwrap();
        let mut s = CpuSession::new(fwd.clone(), p).unwrap();
        hf.load_into(&fwd, &mut s).unwrap();
        let out = root.path().join(format!("out-{kind:?}"));
        let options = SaveOptions {
            tokenizer_from: Some(&dir),
            model_from: Some(&dir),
            max_shard_bytes: u64::MAX,
            family: Some(hf.family()),
            source_config: Some(hf.raw_config()),
        };
        save_hf_dir(&out, hf.config(), &fwd, &mut s, &options).unwrap();

        // The same tensors under the family's names, bit for bit.
        assert_eq!(folder_tensors(&out), folder_tensors(&dir), "{kind:?}");
        let written: Value = serde_json::from_str(&fs::read_to_string(out.join("config.json")).unwrap()).unwrap();
        let source = config_json(kind);
        assert_eq!(written["model_type"], source["model_type"]);
        assert_eq!(written["architectures"], source["architectures"]);
        let window = net_window(kind);
        assert_eq!(written["sliding_window"], json!(window), "{kind:?}");
        assert_eq!(written["head_dim"], json!(HEAD_DIM));
        let net = kind.net();
        if kind == Kind::Mixtral {
            assert_eq!(
                (written["num_local_experts"].clone(), written["num_experts_per_tok"].clone()),
                (json!(4), json!(2))
            );
        }
        if kind == Kind::Qwen3Moe {
            assert_eq!(written["num_experts"], json!(EXPERTS));
            assert_eq!(written["moe_intermediate_size"], json!(EXPERT_WIDTH));
            assert_eq!(written["mlp_only_layers"], json!([1]));
            assert_eq!(written["norm_topk_prob"], json!(false));
        }
        if kind.gemma() {
            let types: Vec<&str> =
                net.sliding.iter().map(|&s| if s { "sliding_attention" } else { "full_attention" }).collect();
            assert_eq!(written["layer_types"], json!(types), "{kind:?}");
            assert_eq!(written["query_pre_attn_scalar"], json!(10), "{kind:?}");
            assert_eq!(written["attn_logit_softcapping"], json!(net.applied_attn_cap()), "{kind:?}");
            assert_eq!(written["final_logit_softcapping"], json!(net.final_cap), "{kind:?}");
            assert_eq!(written["hidden_activation"], json!("gelu_pytorch_tanh"), "{kind:?}");
        }
        if kind == Kind::Gemma3 {
            assert_eq!(written["rope_local_base_freq"], json!(net.rope_local));
            assert_eq!(written["rope_theta"], json!(net.rope_global));
            assert_eq!(written["sliding_window_pattern"], json!(3));
            assert_eq!(written["rope_scaling"], json!({"rope_type": "linear", "factor": net.rope_linear}));
            let rope = &written["rope_parameters"];
            assert_eq!(rope["sliding_attention"], json!({"rope_type": "default", "rope_theta": net.rope_local}));
            assert_eq!(rope["full_attention"]["rope_type"], json!("linear"));
            assert_eq!(rope["full_attention"]["factor"], json!(net.rope_linear));
            assert_eq!(rope["full_attention"]["rope_theta"], json!(net.rope_global));
        }
        // The keys stepgraph does not read are kept.
        assert_eq!(written["pad_token_id"], json!(0));

        let again = HfModelDir::open(&out).unwrap();
        assert_eq!(again.family(), kind.family());
        assert_eq!(*again.config(), Config { name: again.config().name.clone(), ..hf.config().clone() }, "{kind:?}");
        assert_eq!(stepgraph_forward(&again, DType::F32), stepgraph_forward(&hf, DType::F32), "{kind:?}");
    }
}

// ------------------------------------------------------------ generation

fn generation(config: &Config, prompt_len: usize, context: usize) -> GenerationProgram {
    let spec = GenerationSpec {
        config: config.clone(),
        dtype: DType::F64,
        buckets: vec![1, 2],
        context,
        prompt_len,
        logits: true,
    };
    build_generation(&spec).unwrap()
}

/// A generation session holding the folder's weights.
fn generation_session(hf: &HfModelDir, p: &GenerationProgram) -> CpuSession {
    let pl = plan(&p.trace, PlanOptions::default()).unwrap();
    check_plan(&p.trace, &pl).unwrap();
    let mut s = CpuSession::new(p.trace.clone(), pl).unwrap();
    let checkpoint = p.checkpoint_params().unwrap();
    hf.check(&checkpoint).unwrap();
    let mut writer = FusedWriter::new(p);
    hf.load_into_with(&checkpoint, &mut |name, t| writer.write(&mut s, name, t)).unwrap();
    writer.finish().unwrap();
    s
}

/// The f64 reference's logits at the last position of `tokens`.
fn reference_last_logits(kind: Kind, tokens: &[u32]) -> Vec<f64> {
    // The reference runs BATCH rows: the sequence twice.
    let ids: Vec<usize> = tokens.iter().chain(tokens).map(|&t| t as usize).collect();
    let all = reference_logits(&kind.net(), &hf_tensors(kind), &ids);
    all[(tokens.len() - 1) * VOCAB..tokens.len() * VOCAB].to_vec()
}

fn argmax(x: &[f64]) -> u32 {
    let mut best = 0;
    for (i, v) in x.iter().enumerate() {
        if *v > x[best] {
            best = i;
        }
    }
    best as u32
}

#[test]
fn greedy_generation_is_the_argmax_of_the_full_forward() {
    let root = tempfile::tempdir().unwrap();
    for kind in KINDS {
        let hf = HfModelDir::open(&write_fixture(root.path(), &format!("{kind:?}"), kind)).unwrap();
        let p = generation(hf.config(), 6, 16);
        // Sliding layers keep a ring of the window's positions, the others
        // the whole context.
        for l in 0..hf.config().n_layer {
            let k = p.trace.leaf_by_name(&format!("cache.{l}.k")).unwrap();
            let want = if hf.config().scores(l).window > 0 { WINDOW } else { 16 };
            assert_eq!(p.trace.ty(k).shape[1], want, "{kind:?} layer {l}");
        }
        let (rings, per_position) = p.cache_growth();
        assert_eq!(rings + 16 * per_position, p.cache_bytes(), "{kind:?}");
        let sliding = (0..hf.config().n_layer).any(|l| hf.config().scores(l).window > 0);
        assert_eq!(rings > 0, sliding, "{kind:?}");
        let mut s = generation_session(&hf, &p);
        // Prompts longer than the window (one padded, one not), and new
        // tokens past it.
        let prompts: [&[u32]; 2] = [&[5, 17, 33, 3, 21, 8], &[1, 2, 3, 4]];
        let requests: Vec<Request> = prompts
            .iter()
            .map(|pr| Request {
                prompt: pr.to_vec(),
                max_new_tokens: 7,
                sampling: Sampling::GREEDY,
                stop_tokens: vec![],
            })
            .collect();
        let out = {
            let mut g = Generator::new(&mut s, &p);
            g.generate(&requests, &mut |_, _| false).unwrap().0
        };
        for (prompt, g) in prompts.iter().zip(&out) {
            assert_eq!(g.tokens.len(), 7);
            let mut seq = prompt.to_vec();
            for &t in &g.tokens {
                let logits = reference_last_logits(kind, &seq);
                assert_eq!(t, argmax(&logits), "{kind:?}: after {seq:?}");
                seq.push(t);
            }
        }

        // The last decode step's logits (batch 2) equal the reference's.
        let out = {
            let mut g = Generator::new(&mut s, &p);
            g.generate_batch(&requests, &mut |_, _| false).unwrap().0
        };
        let logits_v = p
            .trace
            .outputs
            .iter()
            .find(|o| matches!(&o.kind, OutputKind::Named(n) if n == "decode2.logits"))
            .unwrap()
            .value;
        let last = s.read(logits_v).to_f64();
        for (i, (r, g)) in requests.iter().zip(&out).enumerate() {
            let mut seq = r.prompt.clone();
            seq.extend(&g.tokens[..g.tokens.len() - 1]);
            let want = reference_last_logits(kind, &seq);
            let e = rel(&last[i * VOCAB..(i + 1) * VOCAB], &want);
            assert!(e < 1e-12, "{kind:?} sequence {i}: decode logits rel {e:e}");
        }
    }
}
