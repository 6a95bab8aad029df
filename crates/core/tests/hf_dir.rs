//! Hugging Face model folders in and out (`models::hf_dir`): tiny folders in
//! every supported family, written here the way `transformers` writes them
//! (its names, its fused GPT-NeoX layout, sharded or not, tied or not), then
//! loaded, run, saved and reloaded; every bad input's error; and a save
//! killed with SIGKILL mid-write.
//!
//! The fixtures are built from the `transformers` layout directly, not from
//! the name table under test, so a wrong table fails here.

use std::collections::BTreeMap;
use std::fs;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use safetensors::tensor::TensorView;
use safetensors::Dtype;
use serde_json::{json, Value};
use stepgraph_core::autodiff::StepKind;
use stepgraph_core::cpu::exec::CpuSession;
use stepgraph_core::error::Error;
use stepgraph_core::host::HostTensor;
use stepgraph_core::ir::{DType, TensorType};
use stepgraph_core::models::checkpoint::{load_params, read_safetensors};
use stepgraph_core::models::gpt::{TARGETS_INPUT, TOKENS_INPUT};
use stepgraph_core::models::hf_dir::{
    from_hf_tensors, save_hf_dir, to_hf_tensors, HfFamily, HfModelDir, SaveOptions, INDEX_FILE, SINGLE_FILE,
};
use stepgraph_core::models::{init_params, Config, LossKind, ModelSpec};
use stepgraph_core::pipeline::{compile_step, CompiledStep, StepOptions};
use stepgraph_core::session::Session;

const VOCAB: usize = 64;
const HIDDEN: usize = 16;
const HEADS: usize = 4;
const LAYERS: usize = 2;
const BATCH: usize = 2;
const SEQ: usize = 8;
/// Qwen3's head size, twice the width over the heads.
const QWEN3_HEAD_DIM: usize = 8;

/// A tiny model of one family, as `transformers` would save it.
#[derive(Clone, Copy, Debug)]
struct Fixture {
    family: HfFamily,
    tied: bool,
    /// Number of weight files: 1 writes `model.safetensors`, more an index.
    shards: usize,
    dtype: Dtype,
    /// Llama-3.x RoPE scaling in config.json.
    llama3_rope: bool,
}

impl Fixture {
    fn new(family: HfFamily) -> Fixture {
        Fixture { family, tied: false, shards: 1, dtype: Dtype::F32, llama3_rope: false }
    }
}

/// Deterministic values around `center` (a few percent spread).
fn values(n: usize, seed: u64, center: f32) -> Vec<f32> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            center + ((state >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.2
        })
        .collect()
}

fn le_bytes(data: &[f32], dtype: Dtype) -> Vec<u8> {
    match dtype {
        Dtype::F32 => data.iter().flat_map(|x| x.to_le_bytes()).collect(),
        Dtype::BF16 => data.iter().flat_map(|x| half::bf16::from_f32(*x).to_le_bytes()).collect(),
        Dtype::F16 => data.iter().flat_map(|x| half::f16::from_f32(*x).to_le_bytes()).collect(),
        Dtype::I64 => data.iter().flat_map(|x| (*x as i64).to_le_bytes()).collect(),
        other => panic!("no fixture dtype {other:?}"),
    }
}

/// The config.json `transformers` writes for the fixture.
fn config_json(f: &Fixture) -> Value {
    let mut c = match f.family {
        HfFamily::GptNeox => json!({
            "architectures": ["GPTNeoXForCausalLM"], "model_type": "gpt_neox", "attention_bias": true,
            "bos_token_id": 0, "eos_token_id": 0, "hidden_act": "gelu", "hidden_size": HIDDEN,
            "intermediate_size": 4 * HIDDEN, "layer_norm_eps": 1e-5, "max_position_embeddings": 32,
            "num_attention_heads": HEADS, "num_hidden_layers": LAYERS, "rotary_emb_base": 10000,
            "rotary_pct": 0.5, "tie_word_embeddings": f.tied, "torch_dtype": "float32",
            "use_parallel_residual": true, "vocab_size": VOCAB
        }),
        family => {
            let (arch, model_type) = match family {
                HfFamily::Llama => ("LlamaForCausalLM", "llama"),
                HfFamily::Mistral => ("MistralForCausalLM", "mistral"),
                HfFamily::Qwen3 => ("Qwen3ForCausalLM", "qwen3"),
                HfFamily::Olmo2 => ("Olmo2ForCausalLM", "olmo2"),
                HfFamily::Phi3 => ("Phi3ForCausalLM", "phi3"),
                _ => ("Qwen2ForCausalLM", "qwen2"),
            };
            let mut c = json!({
                "architectures": [arch], "model_type": model_type, "bos_token_id": 1, "eos_token_id": 2,
                "hidden_act": "silu", "hidden_size": HIDDEN, "intermediate_size": 24,
                "max_position_embeddings": 32, "num_attention_heads": HEADS, "num_key_value_heads": 2,
                "num_hidden_layers": LAYERS, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
                "sliding_window": null, "tie_word_embeddings": f.tied, "torch_dtype": "float32",
                "vocab_size": VOCAB
            });
            if family == HfFamily::Phi3 {
                // RoPE on half of each head.
                c["partial_rotary_factor"] = json!(0.5);
            }
            if family == HfFamily::Qwen3 {
                // A head wider than the width over the heads, as Qwen3's are.
                c["head_dim"] = json!(QWEN3_HEAD_DIM);
                c["attention_bias"] = json!(false);
                c["use_sliding_window"] = json!(false);
            }
            c
        }
    };
    if f.llama3_rope {
        c["rope_scaling"] = json!({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8});
    }
    c
}

/// The tensors `transformers` saves for the fixture: name, shape, values.
fn hf_tensors(f: &Fixture) -> Vec<(String, Vec<usize>, Vec<f32>)> {
    let mut out: Vec<(String, Vec<usize>, Vec<f32>)> = Vec::new();
    let mut seed = 1u64;
    let mut add = |name: String, shape: Vec<usize>, center: f32| {
        seed += 1;
        let n = shape.iter().product();
        out.push((name, shape, values(n, seed, center)));
    };
    let (c, v) = (HIDDEN, VOCAB);
    match f.family {
        HfFamily::GptNeox => {
            let i = 4 * c;
            add("gpt_neox.embed_in.weight".into(), vec![v, c], 0.0);
            for l in 0..LAYERS {
                let p = format!("gpt_neox.layers.{l}");
                for norm in ["input_layernorm", "post_attention_layernorm"] {
                    add(format!("{p}.{norm}.weight"), vec![c], 1.0);
                    add(format!("{p}.{norm}.bias"), vec![c], 0.0);
                }
                add(format!("{p}.attention.query_key_value.weight"), vec![3 * c, c], 0.0);
                add(format!("{p}.attention.query_key_value.bias"), vec![3 * c], 0.0);
                add(format!("{p}.attention.dense.weight"), vec![c, c], 0.0);
                add(format!("{p}.attention.dense.bias"), vec![c], 0.0);
                add(format!("{p}.mlp.dense_h_to_4h.weight"), vec![i, c], 0.0);
                add(format!("{p}.mlp.dense_h_to_4h.bias"), vec![i], 0.0);
                add(format!("{p}.mlp.dense_4h_to_h.weight"), vec![c, i], 0.0);
                add(format!("{p}.mlp.dense_4h_to_h.bias"), vec![c], 0.0);
                // A buffer old Pythia checkpoints carry.
                add(format!("{p}.attention.rotary_emb.inv_freq"), vec![2], 0.5);
            }
            add("gpt_neox.final_layer_norm.weight".into(), vec![c], 1.0);
            add("gpt_neox.final_layer_norm.bias".into(), vec![c], 0.0);
            if !f.tied {
                add("embed_out.weight".into(), vec![v, c], 0.0);
            }
        }
        family => {
            let head = if family == HfFamily::Qwen3 { QWEN3_HEAD_DIM } else { c / HEADS };
            let (q, kv, i) = (HEADS * head, 2 * head, 24);
            add("model.embed_tokens.weight".into(), vec![v, c], 0.0);
            for l in 0..LAYERS {
                let p = format!("model.layers.{l}");
                if family != HfFamily::Olmo2 {
                    add(format!("{p}.input_layernorm.weight"), vec![c], 1.0);
                }
                if family == HfFamily::Phi3 {
                    add(format!("{p}.self_attn.qkv_proj.weight"), vec![q + 2 * kv, c], 0.0);
                } else {
                    add(format!("{p}.self_attn.q_proj.weight"), vec![q, c], 0.0);
                    add(format!("{p}.self_attn.k_proj.weight"), vec![kv, c], 0.0);
                    add(format!("{p}.self_attn.v_proj.weight"), vec![kv, c], 0.0);
                }
                if family == HfFamily::Qwen2 {
                    add(format!("{p}.self_attn.q_proj.bias"), vec![c], 0.0);
                    add(format!("{p}.self_attn.k_proj.bias"), vec![kv], 0.0);
                    add(format!("{p}.self_attn.v_proj.bias"), vec![kv], 0.0);
                }
                if family == HfFamily::Qwen3 {
                    add(format!("{p}.self_attn.q_norm.weight"), vec![head], 1.0);
                    add(format!("{p}.self_attn.k_norm.weight"), vec![head], 1.0);
                }
                if family == HfFamily::Olmo2 {
                    add(format!("{p}.self_attn.q_norm.weight"), vec![q], 1.0);
                    add(format!("{p}.self_attn.k_norm.weight"), vec![kv], 1.0);
                    add(format!("{p}.post_feedforward_layernorm.weight"), vec![c], 1.0);
                }
                add(format!("{p}.self_attn.o_proj.weight"), vec![c, q], 0.0);
                add(format!("{p}.post_attention_layernorm.weight"), vec![c], 1.0);
                if family == HfFamily::Phi3 {
                    add(format!("{p}.mlp.gate_up_proj.weight"), vec![2 * i, c], 0.0);
                } else {
                    add(format!("{p}.mlp.gate_proj.weight"), vec![i, c], 0.0);
                    add(format!("{p}.mlp.up_proj.weight"), vec![i, c], 0.0);
                }
                add(format!("{p}.mlp.down_proj.weight"), vec![c, i], 0.0);
            }
            add("model.norm.weight".into(), vec![c], 1.0);
            if !f.tied {
                add("lm_head.weight".into(), vec![v, c], 0.0);
            }
        }
    }
    out
}

/// Writes the tensors as safetensors files in `dir`: one `model.safetensors`,
/// or `shards` files named as `transformers` names them, with the index.
fn write_weights(dir: &Path, tensors: &[(String, Vec<usize>, Vec<f32>)], dtype: Dtype, shards: usize) {
    let bytes: Vec<Vec<u8>> = tensors.iter().map(|(_, _, data)| le_bytes(data, dtype)).collect();
    let per_shard = tensors.len().div_ceil(shards);
    let mut weight_map = serde_json::Map::new();
    for (k, chunk) in tensors.chunks(per_shard).enumerate() {
        let file = if shards == 1 {
            SINGLE_FILE.to_string()
        } else {
            format!("model-{:05}-of-{shards:05}.safetensors", k + 1)
        };
        let views: Vec<(String, TensorView)> = chunk
            .iter()
            .enumerate()
            .map(|(j, (name, shape, _))| {
                (name.clone(), TensorView::new(dtype, shape.clone(), &bytes[k * per_shard + j]).unwrap())
            })
            .collect();
        let metadata = Some(std::collections::HashMap::from([("format".to_string(), "pt".to_string())]));
        fs::write(dir.join(&file), safetensors::serialize(views, metadata).unwrap()).unwrap();
        for (name, _, _) in chunk {
            weight_map.insert(name.clone(), json!(file));
        }
    }
    if shards > 1 {
        let index = json!({"metadata": {"total_size": 0}, "weight_map": weight_map});
        fs::write(dir.join(INDEX_FILE), serde_json::to_string_pretty(&index).unwrap()).unwrap();
    }
}

/// Writes the fixture into a new folder `name` under `root`.
fn write_fixture(root: &Path, name: &str, f: &Fixture) -> PathBuf {
    let dir = root.join(name);
    fs::create_dir_all(&dir).unwrap();
    fs::write(dir.join("config.json"), serde_json::to_string_pretty(&config_json(f)).unwrap()).unwrap();
    write_weights(&dir, &hf_tensors(f), f.dtype, f.shards);
    fs::write(dir.join("tokenizer.json"), br#"{"version": "1.0", "model": {"type": "BPE"}}"#).unwrap();
    fs::write(dir.join("tokenizer_config.json"), br#"{"model_max_length": 32}"#).unwrap();
    dir
}

fn compile(config: &Config) -> CompiledStep {
    let spec = ModelSpec {
        config: config.clone(),
        batch: BATCH,
        seq: SEQ,
        dtype: DType::F32,
        loss: LossKind::CrossEntropy,
        adapters: None,
        documents: false,
    };
    compile_step(&spec, &StepOptions::new(StepKind::Forward)).unwrap()
}

fn open_session(c: &CompiledStep) -> CpuSession {
    CpuSession::new(c.step.clone(), c.plan.clone()).unwrap()
}

/// Writes a fixed batch and runs the forward step; the loss.
fn forward_loss(s: &mut dyn Session) -> f64 {
    let ty = TensorType::new(DType::I32, [BATCH, SEQ]);
    let ids: Vec<f64> = (0..BATCH * SEQ).map(|i| ((i * 29 + 3) % VOCAB) as f64).collect();
    let targets: Vec<f64> = (0..BATCH * SEQ).map(|i| ((i * 13 + 5) % VOCAB) as f64).collect();
    s.write_named(TOKENS_INPUT, &HostTensor::from_f64(ty.clone(), &ids)).unwrap();
    s.write_named(TARGETS_INPUT, &HostTensor::from_f64(ty, &targets)).unwrap();
    s.run_eager().unwrap();
    s.loss().unwrap()
}

/// The fixture's tensors under the trace's Llama-style names, converted by
/// hand from the `transformers` layout (the existing `load_params` path).
fn as_trace_names(f: &Fixture, dir: &Path) -> Vec<(String, HostTensor)> {
    let mut tensors = Vec::new();
    for entry in fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "safetensors") {
            tensors.extend(read_safetensors(&path).unwrap());
        }
    }
    if f.family == HfFamily::Phi3 {
        // The stacked tensors cut into their parts by rows.
        let (q, kv, i) = (HIDDEN, 2 * (HIDDEN / HEADS), 24);
        let mut out = Vec::new();
        for (name, t) in tensors {
            let parts: &[(&str, usize)] = if name.ends_with("qkv_proj.weight") {
                &[("q_proj", q), ("k_proj", kv), ("v_proj", kv)]
            } else if name.ends_with("gate_up_proj.weight") {
                &[("gate_proj", i), ("up_proj", i)]
            } else {
                out.push((name, t));
                continue;
            };
            let fused = name.rsplit('.').nth(1).unwrap();
            let row = t.bytes().len() / t.ty.shape[0];
            let mut start = 0;
            for (part, rows) in parts {
                let mut p = HostTensor::zeros(TensorType::new(t.ty.dtype, vec![*rows, HIDDEN]));
                p.bytes_mut().copy_from_slice(&t.bytes()[start * row..(start + rows) * row]);
                start += rows;
                out.push((name.replace(fused, part), p));
            }
        }
        return out;
    }
    if f.family != HfFamily::GptNeox {
        return tensors;
    }
    let d = HIDDEN / HEADS;
    let mut out = Vec::new();
    for (name, t) in tensors {
        if name.ends_with("inv_freq") {
            continue;
        }
        if name.contains("query_key_value") {
            // [n_head, 3, d, ...] → q, k, v of [n_head·d, ...] each.
            let row = t.bytes().len() / (3 * HIDDEN);
            let kind = if name.ends_with("weight") { "weight" } else { "bias" };
            let layer = name.split('.').nth(2).unwrap();
            for (j, part) in ["q_proj", "k_proj", "v_proj"].iter().enumerate() {
                let mut shape = t.ty.shape.clone();
                shape[0] = HIDDEN;
                let mut p = HostTensor::zeros(TensorType::new(t.ty.dtype, shape));
                for h in 0..HEADS {
                    let src = &t.bytes()[(h * 3 + j) * d * row..][..d * row];
                    p.bytes_mut()[h * d * row..][..d * row].copy_from_slice(src);
                }
                out.push((format!("model.layers.{layer}.self_attn.{part}.{kind}"), p));
            }
            continue;
        }
        let renamed = name
            .replace("gpt_neox.embed_in", "model.embed_tokens")
            .replace("gpt_neox.final_layer_norm", "model.norm")
            .replace("gpt_neox.layers", "model.layers")
            .replace("attention.dense", "self_attn.o_proj")
            .replace("mlp.dense_h_to_4h", "mlp.up_proj")
            .replace("mlp.dense_4h_to_h", "mlp.down_proj")
            .replace("embed_out", "lm_head");
        out.push((renamed, t));
    }
    out
}

/// The parameter `name` read back from the session.
fn read_param(s: &mut dyn Session, name: &str) -> HostTensor {
    let v = s.trace().leaf_by_name(name).unwrap();
    s.read(v).unwrap()
}

fn message<T>(r: Result<T, Error>) -> String {
    match r {
        Ok(_) => panic!("expected an error"),
        Err(e) => e.to_string(),
    }
}

fn assert_contains(text: &str, needles: &[&str]) {
    for needle in needles {
        assert!(text.contains(needle), "`{text}` lacks `{needle}`");
    }
}

/// Every fixture variant this suite loads.
fn all_fixtures() -> Vec<Fixture> {
    let mut v = Vec::new();
    for family in [
        HfFamily::Llama,
        HfFamily::Mistral,
        HfFamily::Qwen2,
        HfFamily::Qwen3,
        HfFamily::Olmo2,
        HfFamily::Phi3,
        HfFamily::GptNeox,
    ] {
        for (tied, shards) in [(false, 1), (true, 1), (false, 3), (true, 2)] {
            v.push(Fixture { tied, shards, ..Fixture::new(family) });
        }
    }
    v.push(Fixture { llama3_rope: true, shards: 2, ..Fixture::new(HfFamily::Llama) });
    v
}

#[test]
fn every_family_loads_and_matches_the_existing_path() {
    let root = tempfile::tempdir().unwrap();
    for (k, f) in all_fixtures().iter().enumerate() {
        let dir = write_fixture(root.path(), &format!("model{k}"), f);
        let hf = HfModelDir::open(&dir).unwrap();
        assert_eq!(hf.family(), f.family, "{f:?}");
        assert_eq!(hf.config().tie_embeddings, f.tied, "{f:?}");
        assert_eq!(hf.config().rope_scaling.is_some(), f.llama3_rope, "{f:?}");
        let c = compile(hf.config());
        hf.check(&c.forward).unwrap();
        let mut loaded = open_session(&c);
        hf.load_into(&c.forward, &mut loaded).unwrap();
        let loss = forward_loss(&mut loaded);

        // The same weights through `load_params` by Llama-style name.
        let mut reference = open_session(&c);
        for (v, t) in load_params(&c.forward, &as_trace_names(f, &dir), false).unwrap() {
            reference.write_named(c.forward.value(v).kind.leaf_name().unwrap(), &t).unwrap();
        }
        let want = forward_loss(&mut reference);
        assert!(loss.is_finite() && loss > 0.0, "{f:?}: {loss}");
        assert_eq!(loss.to_bits(), want.to_bits(), "{f:?}: {loss} vs {want}");
    }
}

#[test]
fn llama3_rope_scaling_changes_the_network() {
    let root = tempfile::tempdir().unwrap();
    let plain = Fixture { shards: 1, ..Fixture::new(HfFamily::Llama) };
    let scaled = Fixture { llama3_rope: true, ..plain };
    let mut losses = Vec::new();
    for (name, f) in [("plain", plain), ("scaled", scaled)] {
        let hf = HfModelDir::open(&write_fixture(root.path(), name, &f)).unwrap();
        let c = compile(hf.config());
        let mut s = open_session(&c);
        hf.load_into(&c.forward, &mut s).unwrap();
        losses.push(forward_loss(&mut s));
    }
    // The same weights: only the rotary frequencies differ.
    assert_ne!(losses[0], losses[1]);
}

/// The tensors of the folder `dir` by name, as read by the reference reader.
fn folder_tensors(dir: &Path) -> BTreeMap<String, HostTensor> {
    let mut out = BTreeMap::new();
    for entry in fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "safetensors") {
            let bytes = fs::read(&path).unwrap();
            // The reference library accepts every file we write.
            safetensors::SafeTensors::deserialize(&bytes).unwrap();
            out.extend(read_safetensors(&path).unwrap());
        }
    }
    out
}

#[test]
fn load_save_load_round_trips_bit_exactly() {
    let root = tempfile::tempdir().unwrap();
    for (k, f) in all_fixtures().iter().enumerate() {
        let dir = write_fixture(root.path(), &format!("in{k}"), f);
        let hf = HfModelDir::open(&dir).unwrap();
        let c = compile(hf.config());
        let mut s = open_session(&c);
        hf.load_into(&c.forward, &mut s).unwrap();

        // Small shards for half the cases: several files and an index.
        let max_shard_bytes = if k % 2 == 0 { 3000 } else { u64::MAX };
        let out = root.path().join(format!("out{k}"));
        let options = SaveOptions {
            tokenizer_from: Some(&dir),
            model_from: None,
            max_shard_bytes,
            family: Some(hf.family()),
            source_config: Some(hf.raw_config()),
        };
        let report = save_hf_dir(&out, hf.config(), &c.forward, &mut s, &options).unwrap();
        assert_eq!(report.tokenizer_files, vec!["tokenizer.json", "tokenizer_config.json"], "{f:?}");
        assert_eq!(fs::read(out.join("tokenizer.json")).unwrap(), fs::read(dir.join("tokenizer.json")).unwrap());
        if max_shard_bytes == u64::MAX {
            assert_eq!(report.shards, vec![SINGLE_FILE.to_string()]);
            assert!(!out.join(INDEX_FILE).exists());
        } else {
            let n = report.shards.len();
            assert!(n > 1, "{f:?}: {n} shards");
            assert_eq!(report.shards[0], format!("model-00001-of-{n:05}.safetensors"));
            let index: Value = serde_json::from_str(&fs::read_to_string(out.join(INDEX_FILE)).unwrap()).unwrap();
            assert_eq!(index["metadata"]["total_size"], json!(report.tensor_bytes));
            assert_eq!(index["weight_map"].as_object().unwrap().len(), report.tensors);
        }

        // The same tensors under the same names, bit for bit (buffers aside).
        let mut original = folder_tensors(&dir);
        original.retain(|name, _| !name.ends_with("inv_freq"));
        assert_eq!(folder_tensors(&out), original, "{f:?}");
        // Assembled in memory (as gradients are for comparisons), the same again.
        let assembled = to_hf_tensors(hf.family(), &c.forward, hf.config().n_head, |name| Ok(read_param(&mut s, name)));
        let assembled = assembled.unwrap();
        assert_eq!(assembled.iter().cloned().collect::<BTreeMap<_, _>>(), original, "{f:?}");
        // And split back (as references for comparisons are read), each parameter as loaded.
        let split = from_hf_tensors(hf.family(), hf.config(), assembled).unwrap();
        let params: BTreeMap<String, HostTensor> = c
            .forward
            .params()
            .map(|v| c.forward.value(v).kind.leaf_name().unwrap().to_string())
            .map(|name| (name.clone(), read_param(&mut s, &name)))
            .collect();
        assert_eq!(split.into_iter().collect::<BTreeMap<_, _>>(), params, "{f:?}");

        // The config says the same network, and keeps the keys stepgraph does not read.
        let again = HfModelDir::open(&out).unwrap();
        assert_eq!(again.family(), f.family);
        assert_eq!(*again.config(), Config { name: again.config().name.clone(), ..hf.config().clone() }, "{f:?}");
        let written: Value = serde_json::from_str(&fs::read_to_string(out.join("config.json")).unwrap()).unwrap();
        assert_eq!(written["bos_token_id"], config_json(f)["bos_token_id"]);
        assert_eq!(written["architectures"], config_json(f)["architectures"]);
        assert_eq!(written["torch_dtype"], json!("float32"));
        let mut s2 = open_session(&c);
        again.load_into(&c.forward, &mut s2).unwrap();
        assert_eq!(forward_loss(&mut s2).to_bits(), forward_loss(&mut s).to_bits(), "{f:?}");
    }
}

#[test]
fn a_nan_or_an_infinity_in_the_weights_is_named_before_it_is_written() {
    let root = tempfile::tempdir().unwrap();
    let cases = [
        (HfFamily::Llama, Dtype::F32, "model.layers.0.self_attn.q_proj.weight", 17, f32::NAN, "NaN"),
        (HfFamily::Qwen2, Dtype::BF16, "model.norm.weight", 3, f32::INFINITY, "inf"),
        (HfFamily::Mistral, Dtype::F16, "lm_head.weight", 0, f32::NEG_INFINITY, "-inf"),
        (HfFamily::GptNeox, Dtype::F32, "gpt_neox.layers.1.attention.query_key_value.weight", 40, f32::NAN, "NaN"),
    ];
    for (k, (family, dtype, bad, at, x, shown)) in cases.into_iter().enumerate() {
        let f = Fixture { dtype, ..Fixture::new(family) };
        let dir = root.path().join(format!("damaged{k}"));
        fs::create_dir_all(&dir).unwrap();
        fs::write(dir.join("config.json"), serde_json::to_string_pretty(&config_json(&f)).unwrap()).unwrap();
        let mut tensors = hf_tensors(&f);
        let n = {
            let (_, shape, data) = tensors.iter_mut().find(|(name, _, _)| name == bad).unwrap();
            data[at] = x;
            shape.iter().product::<usize>()
        };
        write_weights(&dir, &tensors, dtype, 1);
        let hf = HfModelDir::open(&dir).unwrap();
        let c = compile(hf.config());
        let mut s = open_session(&c);
        let text = message(hf.load_into(&c.forward, &mut s));
        assert_contains(
            &text,
            &[
                &dir.join(SINGLE_FILE).display().to_string(),
                &format!("tensor `{bad}` holds {shown} at element {at} of {n}"),
                "the folder is damaged",
            ],
        );
    }
}

/// The files beside the weights of folders `transformers` saves
/// (`save_pretrained` of a model and its tokenizer), by tokenizer kind:
/// a fast tokenizer with its template in `chat_template.jinja`, a
/// SentencePiece one (`tokenizer.model`), and a GPT-2 style BPE with the
/// older `chat_template.json` and added tokens.
fn loader_files(kind: usize) -> Vec<(&'static str, Vec<u8>)> {
    let generation = br#"{"bos_token_id": 1, "eos_token_id": 2, "do_sample": true, "temperature": 0.6}"#.to_vec();
    let special = br#"{"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}"#.to_vec();
    let template = b"{% for m in messages %}<|{{ m.role }}|>{{ m.content }}</s>{% endfor %}".to_vec();
    let mut files = vec![("generation_config.json", generation), ("special_tokens_map.json", special)];
    match kind {
        0 => {
            files.push(("tokenizer.json", br#"{"version": "1.0", "model": {"type": "BPE"}}"#.to_vec()));
            files.push(("tokenizer_config.json", br#"{"model_max_length": 32}"#.to_vec()));
            files.push(("chat_template.jinja", template));
        }
        1 => {
            files.push(("tokenizer.json", br#"{"version": "1.0", "model": {"type": "Unigram"}}"#.to_vec()));
            files.push(("tokenizer_config.json", br#"{"legacy": false}"#.to_vec()));
            // SentencePiece's protobuf: binary, not UTF-8.
            files.push(("tokenizer.model", vec![0x0a, 0x0b, 0xff, 0x00, 0x80, 0x3c, 0x73, 0x3e]));
            files.push(("chat_template.jinja", template));
        }
        _ => {
            files.push(("vocab.json", br#"{"a": 0, "b": 1, "ab": 2}"#.to_vec()));
            files.push(("merges.txt", b"#version: 0.2\na b\n".to_vec()));
            files.push(("added_tokens.json", br#"{"<|im_end|>": 3}"#.to_vec()));
            files.push(("tokenizer_config.json", br#"{"tokenizer_class": "GPT2Tokenizer"}"#.to_vec()));
            files
                .push(("chat_template.json", serde_json::to_vec(&json!({"chat_template": "{{ messages }}"})).unwrap()));
        }
    }
    files
}

#[test]
fn every_tokenizer_template_and_generation_file_survives_a_save() {
    let root = tempfile::tempdir().unwrap();
    for kind in 0..3 {
        let dir = root.path().join(format!("src{kind}"));
        fs::create_dir_all(&dir).unwrap();
        let f = Fixture::new(HfFamily::Llama);
        fs::write(dir.join("config.json"), serde_json::to_string_pretty(&config_json(&f)).unwrap()).unwrap();
        write_weights(&dir, &hf_tensors(&f), f.dtype, 1);
        let files = loader_files(kind);
        for (name, bytes) in &files {
            fs::write(dir.join(name), bytes).unwrap();
        }
        let hf = HfModelDir::open(&dir).unwrap();
        let c = compile(hf.config());
        let mut s = open_session(&c);
        hf.load_into(&c.forward, &mut s).unwrap();
        let options = SaveOptions {
            tokenizer_from: Some(&dir),
            model_from: None,
            family: Some(hf.family()),
            source_config: Some(hf.raw_config()),
            ..SaveOptions::default()
        };
        let out = root.path().join(format!("out{kind}"));
        let report = save_hf_dir(&out, hf.config(), &c.forward, &mut s, &options).unwrap();
        for (name, bytes) in &files {
            assert_eq!(fs::read(out.join(name)).ok().as_ref(), Some(bytes), "{name} of kind {kind}");
            assert!(
                report.tokenizer_files.iter().any(|f| f == name),
                "{name} not reported: {:?}",
                report.tokenizer_files
            );
        }
        // Saved back into the folder it came from, nothing of it is lost.
        save_hf_dir(&dir, hf.config(), &c.forward, &mut s, &options).unwrap();
        for (name, bytes) in &files {
            assert_eq!(
                fs::read(dir.join(name)).ok().as_ref(),
                Some(bytes),
                "{name} of kind {kind} after saving in place"
            );
        }
        assert!(HfModelDir::open(&dir).is_ok());
    }
}

#[test]
fn a_model_from_a_named_config_saves_in_its_family() {
    let root = tempfile::tempdir().unwrap();
    for name in ["tiny-llama", "tiny-neox"] {
        let config = Config::named(name).unwrap();
        let c = compile(&config);
        let mut s = open_session(&c);
        for (v, t) in init_params(&c.forward, 3) {
            s.write_named(c.forward.value(v).kind.leaf_name().unwrap(), &t).unwrap();
        }
        let out = root.path().join(name);
        save_hf_dir(&out, &config, &c.forward, &mut s, &SaveOptions::default()).unwrap();
        let hf = HfModelDir::open(&out).unwrap();
        let want = HfFamily::of_config(&config).unwrap();
        assert_eq!(hf.family(), want);
        assert_eq!(
            *hf.config(),
            Config { name: name.to_string(), vocab_size: config.padded_vocab_size, ..config.clone() }
        );
        let mut again = open_session(&c);
        hf.load_into(&c.forward, &mut again).unwrap();
        for v in c.forward.params() {
            let name = c.forward.value(v).kind.leaf_name().unwrap();
            let a = read_param(&mut s, name);
            let b = read_param(&mut again, name);
            assert_eq!(a, b, "{name}");
        }
    }
    // A Llama layout may be saved as mistral, not as gpt_neox.
    let config = Config::named("tiny-llama").unwrap();
    let c = compile(&config);
    let mut s = open_session(&c);
    let wrong = SaveOptions { family: Some(HfFamily::GptNeox), ..SaveOptions::default() };
    let text = message(save_hf_dir(&root.path().join("x"), &config, &c.forward, &mut s, &wrong));
    assert_contains(&text, &["cannot save as model_type `gpt_neox`", "layout of `llama`"]);
    assert!(!root.path().join("x").exists());
}

#[test]
fn a_bf16_checkpoint_casts_to_f32_exactly() {
    let root = tempfile::tempdir().unwrap();
    let f = Fixture { dtype: Dtype::BF16, ..Fixture::new(HfFamily::Qwen2) };
    let dir = write_fixture(root.path(), "bf16", &f);
    let hf = HfModelDir::open(&dir).unwrap();
    let c = compile(hf.config());
    let mut s = open_session(&c);
    hf.load_into(&c.forward, &mut s).unwrap();
    let name = "model.layers.1.self_attn.k_proj.bias";
    let got = read_param(&mut s, name);
    let (_, _, data) = hf_tensors(&f).into_iter().find(|(n, _, _)| n == name).unwrap();
    let want: Vec<f64> = data.iter().map(|x| half::bf16::from_f32(*x).to_f64()).collect();
    assert_eq!(got.to_f64(), want);
}

#[test]
fn tied_heads_load_when_absent_or_equal_and_fail_when_different() {
    let root = tempfile::tempdir().unwrap();
    for family in [HfFamily::Llama, HfFamily::GptNeox] {
        let f = Fixture { tied: true, ..Fixture::new(family) };
        let (embed, head) = if family == HfFamily::GptNeox {
            ("gpt_neox.embed_in.weight", "embed_out.weight")
        } else {
            ("model.embed_tokens.weight", "lm_head.weight")
        };
        let mut tensors = hf_tensors(&f);
        let embed_values = tensors.iter().find(|(n, _, _)| n == embed).unwrap().clone();
        tensors.push((head.to_string(), embed_values.1.clone(), embed_values.2.clone()));
        let equal = root.path().join(format!("{family:?}-equal"));
        fs::create_dir_all(&equal).unwrap();
        fs::write(equal.join("config.json"), config_json(&f).to_string()).unwrap();
        write_weights(&equal, &tensors, Dtype::F32, 1);
        let hf = HfModelDir::open(&equal).unwrap();
        let c = compile(hf.config());
        hf.check(&c.forward).unwrap();

        let different = root.path().join(format!("{family:?}-different"));
        fs::create_dir_all(&different).unwrap();
        fs::write(different.join("config.json"), config_json(&f).to_string()).unwrap();
        tensors.last_mut().unwrap().2[0] += 1.0;
        write_weights(&different, &tensors, Dtype::F32, 1);
        let text = message(HfModelDir::open(&different).unwrap().check(&c.forward));
        assert_contains(&text, &[SINGLE_FILE, &format!("tensor `{head}` differs from `{embed}`"), "ties"]);
    }
}

/// A fixture folder whose tensors `edit` changes before they are written.
fn edited(
    root: &Path,
    name: &str,
    f: &Fixture,
    edit: impl FnOnce(&mut Vec<(String, Vec<usize>, Vec<f32>)>),
) -> PathBuf {
    let dir = root.join(name);
    fs::create_dir_all(&dir).unwrap();
    fs::write(dir.join("config.json"), config_json(f).to_string()).unwrap();
    let mut tensors = hf_tensors(f);
    edit(&mut tensors);
    write_weights(&dir, &tensors, f.dtype, f.shards);
    dir
}

#[test]
fn bad_folders_are_errors_naming_the_file_and_the_tensor() {
    let root = tempfile::tempdir().unwrap();
    let f = Fixture { shards: 2, ..Fixture::new(HfFamily::GptNeox) };
    let good = HfModelDir::open(&write_fixture(root.path(), "good", &f)).unwrap();
    let c = compile(good.config());
    let qkv = "gpt_neox.layers.1.attention.query_key_value.weight";

    // Wrong shape.
    let dir = edited(root.path(), "shape", &f, |t| {
        let e = t.iter_mut().find(|(n, _, _)| n == qkv).unwrap();
        e.1 = vec![3 * HIDDEN - 3, HIDDEN];
        e.2.truncate((3 * HIDDEN - 3) * HIDDEN);
    });
    let text = message(HfModelDir::open(&dir).unwrap().check(&c.forward));
    assert_contains(&text, &["model-0000", &format!("tensor `{qkv}` has shape [45, 16], the model expects [48, 16]")]);

    // An integer tensor.
    let dir = root.path().join("int");
    fs::create_dir_all(&dir).unwrap();
    fs::write(dir.join("config.json"), config_json(&f).to_string()).unwrap();
    let tensors = hf_tensors(&f);
    let bytes: Vec<Vec<u8>> = tensors
        .iter()
        .map(|(n, _, d)| le_bytes(d, if n == "gpt_neox.final_layer_norm.bias" { Dtype::I64 } else { Dtype::F32 }))
        .collect();
    let views: Vec<(String, TensorView)> = tensors
        .iter()
        .zip(&bytes)
        .map(|((n, s, _), b)| {
            let dtype = if n == "gpt_neox.final_layer_norm.bias" { Dtype::I64 } else { Dtype::F32 };
            (n.clone(), TensorView::new(dtype, s.clone(), b).unwrap())
        })
        .collect();
    fs::write(dir.join(SINGLE_FILE), safetensors::serialize(views, None).unwrap()).unwrap();
    let text = message(HfModelDir::open(&dir).unwrap().check(&c.forward));
    assert_contains(
        &text,
        &[SINGLE_FILE, "tensor `gpt_neox.final_layer_norm.bias` has dtype I64, which does not cast to the model's f32"],
    );

    // Missing and extra tensors, both reported.
    let dir = edited(root.path(), "missing", &f, |t| {
        t.retain(|(n, _, _)| n != "gpt_neox.layers.0.mlp.dense_4h_to_h.bias");
        t.push(("gpt_neox.layers.0.mlp.surprise.weight".into(), vec![2], vec![0.0, 1.0]));
    });
    let hf = HfModelDir::open(&dir).unwrap();
    let text = message(hf.check(&c.forward));
    assert_contains(
        &text,
        &[
            &dir.display().to_string(),
            "tensor `gpt_neox.layers.0.mlp.dense_4h_to_h.bias` (parameter `model.layers.0.mlp.down_proj.bias`) is missing",
            "tensor `gpt_neox.layers.0.mlp.surprise.weight` has no parameter in the model",
        ],
    );
    // load_into checks before it writes anything.
    let mut s = open_session(&c);
    assert_contains(&message(hf.load_into(&c.forward, &mut s)), &["is missing"]);

    // A truncated shard, found when the folder is opened.
    let dir = write_fixture(root.path(), "truncated", &f);
    let last = dir.join("model-00002-of-00002.safetensors");
    let bytes = fs::read(&last).unwrap();
    fs::write(&last, &bytes[..bytes.len() - 100]).unwrap();
    let text = message(HfModelDir::open(&dir));
    assert_contains(&text, &["model-00002-of-00002.safetensors", "truncated", "cuts tensor `gpt_neox.layers.1."]);
    // Cut inside the header.
    fs::write(&last, &bytes[..20]).unwrap();
    assert_contains(&message(HfModelDir::open(&dir)), &["model-00002-of-00002.safetensors", "truncated?"]);

    // An index naming a shard that is not there.
    let dir = write_fixture(root.path(), "lost-shard", &f);
    fs::remove_file(dir.join("model-00001-of-00002.safetensors")).unwrap();
    let text = message(HfModelDir::open(&dir));
    assert_contains(
        &text,
        &[INDEX_FILE, "names shard `model-00001-of-00002.safetensors`", "gpt_neox.", "does not exist"],
    );

    // An index that puts a tensor in the wrong shard, or one no shard has.
    let dir = write_fixture(root.path(), "bad-index", &f);
    let index_path = dir.join(INDEX_FILE);
    let mut index: Value = serde_json::from_str(&fs::read_to_string(&index_path).unwrap()).unwrap();
    index["weight_map"]["ghost.weight"] = json!("model-00001-of-00002.safetensors");
    fs::write(&index_path, index.to_string()).unwrap();
    let text = message(HfModelDir::open(&dir));
    assert_contains(&text, &["model-00001-of-00002.safetensors", "lacks tensor `ghost.weight`"]);
    index["weight_map"].as_object_mut().unwrap().remove("ghost.weight");
    index["weight_map"]["embed_out.weight"] = json!("model-00001-of-00002.safetensors");
    fs::write(&index_path, index.to_string()).unwrap();
    let text = message(HfModelDir::open(&dir));
    assert_contains(
        &text,
        &["model-00002-of-00002.safetensors", "holds tensor `embed_out.weight`", "the index puts it in"],
    );

    // Bad JSON: the index, then config.json.
    fs::write(&index_path, "{\"weight_map\": ").unwrap();
    assert_contains(&message(HfModelDir::open(&dir)), &[INDEX_FILE, "is not valid JSON"]);
    let dir = write_fixture(root.path(), "bad-config", &f);
    fs::write(dir.join("config.json"), "{\"model_type\": \"llama\",").unwrap();
    assert_contains(&message(HfModelDir::open(&dir)), &["config.json", "is not valid JSON"]);

    // No weights at all.
    let dir = root.path().join("empty");
    fs::create_dir_all(&dir).unwrap();
    fs::write(dir.join("config.json"), config_json(&f).to_string()).unwrap();
    assert_contains(
        &message(HfModelDir::open(&dir)),
        &["has neither model.safetensors nor model.safetensors.index.json"],
    );

    // A cast that overflows names the file and tensor.
    let half_fixture = Fixture { shards: 1, ..Fixture::new(HfFamily::Llama) };
    let dir = edited(root.path(), "overflow", &half_fixture, |t| t[0].2[3] = 1e6);
    let hf = HfModelDir::open(&dir).unwrap();
    let spec = ModelSpec {
        config: hf.config().clone(),
        batch: 1,
        seq: 4,
        dtype: DType::F16,
        loss: LossKind::Sum,
        adapters: None,
        documents: false,
    };
    let c16 = compile_step(&spec, &StepOptions::new(StepKind::Forward)).unwrap();
    let mut s16 = open_session(&c16);
    let text = message(hf.load_into(&c16.forward, &mut s16));
    assert_contains(&text, &[SINGLE_FILE, "tensor `model.embed_tokens.weight`", "overflows: element 3 is 1000000"]);
}

// ------------------------------------------------------------ atomic saves

/// The environment variable that turns [`child_saves_until_killed`] on: the
/// folder it saves to, again and again.
const CHILD_ENV: &str = "STEPGRAPH_HF_SAVE_CHILD_OUT";

/// A model of a few MB, so a save takes long enough to be killed inside it.
fn saver_config() -> Config {
    let overrides = stepgraph_core::models::Overrides {
        vocab_size: Some(2048),
        n_embd: Some(128),
        n_layer: Some(2),
        ..Default::default()
    };
    Config::named("tiny-llama").unwrap().with_overrides(&overrides).unwrap()
}

/// A session holding `init_params(seed)` of [`saver_config`].
fn saver_session(c: &CompiledStep, seed: u64) -> CpuSession {
    let mut s = open_session(c);
    for (v, t) in init_params(&c.forward, seed) {
        s.write_named(c.forward.value(v).kind.leaf_name().unwrap(), &t).unwrap();
    }
    s
}

fn saver_compile() -> CompiledStep {
    let spec = ModelSpec {
        config: saver_config(),
        batch: 1,
        seq: 4,
        dtype: DType::F32,
        loss: LossKind::Sum,
        adapters: None,
        documents: false,
    };
    compile_step(&spec, &StepOptions::new(StepKind::Forward)).unwrap()
}

/// Run by [`a_killed_save_leaves_the_old_or_the_new_folder`] in a child
/// process: saves seeds 1 and 2 alternately, with small shards, printing a
/// line after each save, until it is killed.
#[test]
#[ignore = "a helper process of a_killed_save_leaves_the_old_or_the_new_folder"]
fn child_saves_until_killed() {
    let out = PathBuf::from(std::env::var(CHILD_ENV).expect("run by the parent test, which sets the folder"));
    let c = saver_compile();
    let mut sessions = [saver_session(&c, 1), saver_session(&c, 2)];
    let options = SaveOptions { max_shard_bytes: 1 << 20, ..SaveOptions::default() };
    for k in 0usize.. {
        save_hf_dir(&out, &c.spec.config, &c.forward, &mut sessions[k % 2], &options).unwrap();
        println!("saved {k}");
    }
}

/// Which of seeds 1 and 2 the folder holds, every tensor from the same one.
fn saved_seed(out: &Path, c: &CompiledStep, expected: &[(u64, BTreeMap<String, HostTensor>)]) -> u64 {
    let hf = HfModelDir::open(out).unwrap_or_else(|e| panic!("the destination is not a complete save: {e}"));
    let mut s = open_session(c);
    hf.load_into(&c.forward, &mut s).unwrap();
    let got: BTreeMap<String, HostTensor> = c
        .forward
        .params()
        .map(|v| {
            let name = c.forward.value(v).kind.leaf_name().unwrap().to_string();
            let t = read_param(&mut s, &name);
            (name, t)
        })
        .collect();
    expected
        .iter()
        .find(|(_, want)| *want == got)
        .map(|(seed, _)| *seed)
        .unwrap_or_else(|| panic!("the folder mixes tensors of different saves"))
}

#[test]
fn a_killed_save_leaves_the_old_or_the_new_folder() {
    let root = tempfile::tempdir().unwrap();
    let out = root.path().join("model");
    let c = saver_compile();
    let expected: Vec<(u64, BTreeMap<String, HostTensor>)> = [1u64, 2]
        .iter()
        .map(|&seed| {
            let params = init_params(&c.forward, seed)
                .into_iter()
                .map(|(v, t)| (c.forward.value(v).kind.leaf_name().unwrap().to_string(), t))
                .collect();
            (seed, params)
        })
        .collect();
    // A complete first save, so every kill has an old folder to keep.
    let options = SaveOptions { max_shard_bytes: 1 << 20, ..SaveOptions::default() };
    save_hf_dir(&out, &c.spec.config, &c.forward, &mut saver_session(&c, 2), &options).unwrap();
    assert_eq!(saved_seed(&out, &c, &expected), 2);

    let exe = std::env::current_exe().unwrap();
    let mut seen = Vec::new();
    for (round, delay_ms) in [0u64, 3, 7, 13, 29, 41].into_iter().enumerate() {
        let mut child = Command::new(&exe)
            .args(["--exact", "child_saves_until_killed", "--ignored", "--nocapture", "--test-threads=1"])
            .env(CHILD_ENV, &out)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        // Wait for `round + 1` complete saves, then kill somewhere inside the next.
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let mut saves = 0;
        while saves <= round {
            let line = lines.next().expect("the child saves").unwrap();
            if line.starts_with("saved ") {
                saves += 1;
            }
        }
        std::thread::sleep(Duration::from_millis(delay_ms));
        child.kill().unwrap(); // SIGKILL
        child.wait().unwrap();
        // A leftover temporary folder shows the kill landed inside a save.
        let torn = fs::read_dir(root.path())
            .unwrap()
            .any(|e| e.unwrap().file_name().to_string_lossy().starts_with(".model.tmp-"));
        seen.push((saved_seed(&out, &c, &expected), torn));
    }
    // The child does nothing but save, so kills land inside saves.
    assert!(seen.iter().any(|(_, torn)| *torn), "no kill interrupted a save: {seen:?}");
    // Leftovers of killed saves never hide the folder, and the next save removes them.
    save_hf_dir(&out, &c.spec.config, &c.forward, &mut saver_session(&c, 1), &options).unwrap();
    assert_eq!(saved_seed(&out, &c, &expected), 1);
    let names: Vec<String> =
        fs::read_dir(root.path()).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    assert_eq!(names, vec!["model".to_string()], "after kills at {seen:?}");
}

#[test]
fn a_temporary_folder_is_refused() {
    let root = tempfile::tempdir().unwrap();
    let f = Fixture::new(HfFamily::Llama);
    let dir = write_fixture(root.path(), ".model.tmp-123-0", &f);
    assert_contains(&message(HfModelDir::open(&dir)), &["temporary folder of an interrupted or replaced save"]);
}

/// The state a kill between the two renames of the fallback swap leaves
/// (no destination, the previous save set aside, the new one at its
/// temporary name): nothing opens as the model, and the next save
/// completes and leaves only the destination.
#[test]
fn a_save_after_a_torn_fallback_swap_cleans_up() {
    let root = tempfile::tempdir().unwrap();
    let c = compile(&Config::named("tiny-llama").unwrap());
    let mut s = open_session(&c);
    for (v, t) in init_params(&c.forward, 4) {
        s.write_named(c.forward.value(v).kind.leaf_name().unwrap(), &t).unwrap();
    }
    let out = root.path().join("model");
    save_hf_dir(&out, &c.spec.config, &c.forward, &mut s, &SaveOptions::default()).unwrap();
    fs::rename(&out, root.path().join(".model.old-1-0")).unwrap();
    fs::create_dir(root.path().join(".model.tmp-1-1")).unwrap();
    fs::write(root.path().join(".model.tmp-1-1").join("config.json"), b"{").unwrap();
    assert_contains(&message(HfModelDir::open(&out)), &["not a directory"]);
    assert_contains(&message(HfModelDir::open(&root.path().join(".model.old-1-0"))), &["temporary folder"]);

    save_hf_dir(&out, &c.spec.config, &c.forward, &mut s, &SaveOptions::default()).unwrap();
    HfModelDir::open(&out).unwrap().check(&c.forward).unwrap();
    let names: Vec<String> =
        fs::read_dir(root.path()).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    assert_eq!(names, vec!["model".to_string()]);
}
