//! Checkpoints through a whole step: parameters written as a Hugging Face
//! named safetensors file, read back and loaded by name into a CPU session
//! give the same loss and gradients, bit for bit, as the parameters they
//! were written from; a checkpoint of another geometry is refused with the
//! tensor and both shapes named.

use std::path::PathBuf;

use stepgraph_core::autodiff::{build_step, StepKind, TrainOptions};
use stepgraph_core::cpu::exec::CpuSession;
use stepgraph_core::host::HostTensor;
use stepgraph_core::ir::{DType, TensorType, Trace, ValueId};
use stepgraph_core::models::checkpoint::{
    load_params, name_params, read_safetensors, reference_batch, write_safetensors_atomic,
};
use stepgraph_core::models::{build_forward, init_params, Config, LossKind, ModelSpec, Overrides};
use stepgraph_core::plan::{check_plan, plan, PlanOptions};

/// A fresh, empty directory for one test.
fn temp_dir(test: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("stepgraph-checkpoint-it-{}-{test}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// `tiny-llama` made smaller, with the given overrides on top.
fn tiny(overrides: Overrides) -> Config {
    let base = Config::named("tiny-llama")
        .unwrap()
        .with_overrides(&Overrides { n_layer: Some(2), vocab_size: Some(96), ..Overrides::default() })
        .unwrap();
    base.with_overrides(&overrides).unwrap()
}

/// A Hugging Face style `input_ids` batch: i64 [2, 8].
fn hf_ids(vocab: usize) -> HostTensor {
    let ids: Vec<f64> = (0..16).map(|i| ((i * 37 + 5) % vocab) as f64).collect();
    HostTensor::from_f64(TensorType::new(DType::I64, [2, 8]), &ids)
}

/// The `grads` step of `config` on a [2, 8] batch.
fn grads_step(config: Config, loss: LossKind) -> (Trace, Trace) {
    let spec = ModelSpec { config, batch: 2, seq: 8, dtype: DType::F32, loss, adapters: None, documents: false };
    let forward = build_forward(&spec).unwrap();
    let step = build_step(&forward, StepKind::Grads, &TrainOptions::default()).unwrap();
    (forward, step)
}

/// Runs `step` with `params` written into a fresh session and the batch
/// made from `ids`; returns every step output's bytes (loss, gradients).
fn run_step(step: &Trace, params: &[(ValueId, HostTensor)], ids: &HostTensor, loss: LossKind) -> Vec<Vec<u8>> {
    let memory = plan(step, PlanOptions::default()).unwrap();
    check_plan(step, &memory).unwrap();
    let mut session = CpuSession::new(step.clone(), memory).unwrap();
    for (param, value) in params {
        session.write(*param, value).unwrap();
    }
    for (name, value) in reference_batch(ids, loss).unwrap() {
        session.write_named(name, &value).unwrap();
    }
    session.run_eager().unwrap();
    step.outputs.iter().map(|o| session.read(o.value).bytes().to_vec()).collect()
}

#[test]
fn checkpoint_round_trip_gives_the_same_step_bit_for_bit() {
    let dir = temp_dir("round-trip");
    let untied = tiny(Overrides::default());
    let tied_qkv_bias = Config { tie_embeddings: true, attn_qkv_bias: true, ..untied.clone() };
    for (case, config, loss) in [
        ("untied-ce", untied.clone(), LossKind::CrossEntropy),
        ("untied-sum", untied, LossKind::Sum),
        ("tied-qkv-bias-ce", tied_qkv_bias, LossKind::CrossEntropy),
    ] {
        let tied = config.tie_embeddings;
        let ids = hf_ids(config.vocab_size);
        let (forward, step) = grads_step(config, loss);

        // The parameters as the forward trace's values, then in the step
        // trace's ids by name: the run every checkpoint must reproduce.
        let initial = init_params(&forward, 7);
        let direct: Vec<(ValueId, HostTensor)> = initial
            .iter()
            .map(|(v, t)| {
                let name = forward.value(*v).kind.leaf_name().unwrap();
                (step.leaf_by_name(name).unwrap(), t.clone())
            })
            .collect();
        let expected = run_step(&step, &direct, &ids, loss);

        let mut named = name_params(&forward, initial).unwrap();
        assert!(named.iter().any(|(n, _)| n == "model.layers.1.mlp.down_proj.weight"), "{case}: HF names");
        if tied {
            // What a Hugging Face state dict of a tied model holds: the head
            // as a second copy of the embedding.
            let embed = named.iter().find(|(n, _)| n == "model.embed_tokens.weight").unwrap().1.clone();
            named.push(("lm_head.weight".to_string(), embed));
        }
        let path = dir.join(format!("{case}.safetensors"));
        write_safetensors_atomic(&path, &named).unwrap();
        let read = read_safetensors(&path).unwrap();
        assert_eq!(read.len(), named.len(), "{case}");

        let loaded = load_params(&step, &read, false).unwrap();
        assert_eq!(loaded.len(), step.params().count(), "{case}");
        let got = run_step(&step, &loaded, &ids, loss);
        assert_eq!(got.len(), step.params().count() + 1, "{case}: the loss and one gradient per parameter");
        assert_eq!(got, expected, "{case}: loss or gradients differ after the checkpoint round trip");
    }
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn checkpoint_of_another_geometry_is_refused_naming_tensor_and_shapes() {
    let dir = temp_dir("geometry");
    // Written from a model 32 wide, loaded into one 28 wide.
    let (wide_fwd, _) =
        grads_step(tiny(Overrides { n_embd: Some(32), n_head: Some(2), ..Overrides::default() }), LossKind::Sum);
    let path = dir.join("wide.safetensors");
    write_safetensors_atomic(&path, &name_params(&wide_fwd, init_params(&wide_fwd, 1)).unwrap()).unwrap();
    let (_, narrow) =
        grads_step(tiny(Overrides { n_embd: Some(28), n_head: Some(2), ..Overrides::default() }), LossKind::Sum);
    let err = load_params(&narrow, &read_safetensors(&path).unwrap(), true).unwrap_err().to_string();
    assert!(err.contains("`model.embed_tokens.weight`: checkpoint has [96, 32], the model expects [96, 28]"), "{err}");
    assert!(
        err.contains("`model.layers.0.self_attn.q_proj.weight`: checkpoint has [32, 32], the model expects [28, 28]"),
        "{err}"
    );
    assert!(err.contains("more tensors of the wrong shape"), "{err}");

    // Written from a two-layer model, loaded into a one-layer one: the second
    // layer's tensors are unexpected.
    let (_, shallow) = grads_step(
        tiny(Overrides { n_embd: Some(32), n_head: Some(2), n_layer: Some(1), ..Overrides::default() }),
        LossKind::Sum,
    );
    let err = load_params(&shallow, &read_safetensors(&path).unwrap(), false).unwrap_err().to_string();
    assert!(err.contains("9 checkpoint tensors the model has no parameter for: `model.layers.1."), "{err}");
    std::fs::remove_dir_all(dir).unwrap();
}
