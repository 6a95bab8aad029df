//! Packed documents (`ModelSpec::documents`): a row holding several
//! documents, each token given its position in its document, trains
//! exactly as the documents would one by one: the packed loss is the
//! token-weighted mean of the documents' losses and every gradient the same
//! mix of theirs. Checked in f64 on the CPU backend, so "exactly" means to
//! rounding.

use std::collections::BTreeMap;

use stepgraph_core::autodiff::StepKind;
use stepgraph_core::cpu::exec::CpuSession;
use stepgraph_core::host::HostTensor;
use stepgraph_core::ir::{DType, TensorType};
use stepgraph_core::models::gpt::{IGNORE_INDEX, POSITIONS_INPUT, TARGETS_INPUT, TOKENS_INPUT};
use stepgraph_core::models::{init_params, Config, LossKind, ModelSpec, Overrides};
use stepgraph_core::pipeline::{compile_step, StepOptions};
use stepgraph_core::session::Session;
use stepgraph_core::testing::{grads_by_name, max_rel_diff};

/// A small grouped-query model with RoPE (the positions matter).
fn config() -> Config {
    let o = Overrides {
        n_layer: Some(2),
        n_embd: Some(32),
        n_head: Some(4),
        n_query_groups: Some(2),
        ..Overrides::default()
    };
    Config::named("tiny-llama").unwrap().with_overrides(&o).unwrap()
}

/// The tokens of document `d` of length `len`.
fn document(d: usize, len: usize, vocab: usize) -> Vec<f64> {
    (0..len).map(|i| ((d * 31 + i * 17 + 3) % vocab) as f64).collect()
}

/// Each token's next token within its document; the last predicts nothing.
fn targets_of(doc: &[f64]) -> Vec<f64> {
    let mut t: Vec<f64> = doc[1..].to_vec();
    t.push(IGNORE_INDEX as f64);
    t
}

/// The loss and every gradient of one f64 CPU step on `rows` (tokens,
/// targets and, for a packed spec, positions; each `batch × seq`).
fn step(
    spec: &ModelSpec,
    tokens: &[f64],
    targets: &[f64],
    positions: Option<&[f64]>,
) -> (f64, BTreeMap<String, Vec<f64>>) {
    let c = compile_step(spec, &StepOptions::new(StepKind::Grads)).unwrap();
    let mut s = CpuSession::new(c.step.clone(), c.plan.clone()).unwrap();
    for (v, value) in init_params(&c.forward, 5) {
        s.write_named(c.forward.value(v).kind.leaf_name().unwrap(), &value).unwrap();
    }
    let ty = TensorType::new(DType::I32, [spec.batch, spec.seq]);
    s.write_named(TOKENS_INPUT, &HostTensor::from_f64(ty.clone(), tokens)).unwrap();
    s.write_named(TARGETS_INPUT, &HostTensor::from_f64(ty.clone(), targets)).unwrap();
    if let Some(p) = positions {
        s.write_named(POSITIONS_INPUT, &HostTensor::from_f64(ty, p)).unwrap();
    }
    Session::run_eager(&mut s).unwrap();
    let loss = Session::loss(&mut s).unwrap();
    (loss, grads_by_name(&c.step, |v| Session::read(&mut s, v).unwrap().to_f64()))
}

#[test]
fn a_packed_batch_trains_as_its_documents_one_by_one() {
    let config = config();
    let vocab = config.vocab_size;
    // Two rows of 12 tokens: documents of 5, 4 and 3 tokens, then 7 and 5.
    let rows: [&[usize]; 2] = [&[5, 4, 3], &[7, 5]];
    let seq = 12;
    let (mut tokens, mut targets, mut positions, mut docs) = (vec![], vec![], vec![], vec![]);
    for lengths in rows {
        for &len in lengths {
            let doc = document(docs.len(), len, vocab);
            tokens.extend(&doc);
            targets.extend(targets_of(&doc));
            positions.extend((0..len).map(|p| p as f64));
            docs.push(doc);
        }
    }
    let spec = |batch, seq, documents| ModelSpec {
        config: config.clone(),
        batch,
        seq,
        dtype: DType::F64,
        loss: LossKind::CrossEntropy,
        adapters: None,
        documents,
    };
    let (packed_loss, packed_grads) = step(&spec(2, seq, true), &tokens, &targets, Some(&positions));

    // One by one, weighted by their targets (the packed loss is the mean
    // over every target of the batch).
    let total: usize = docs.iter().map(|d| d.len() - 1).sum();
    let mut loss = 0.0;
    let mut grads: BTreeMap<String, Vec<f64>> = BTreeMap::new();
    for doc in &docs {
        let (l, g) = step(&spec(1, doc.len(), false), doc, &targets_of(doc), None);
        let w = (doc.len() - 1) as f64 / total as f64;
        loss += w * l;
        for (name, g) in g {
            let acc = grads.entry(name).or_insert_with(|| vec![0.0; g.len()]);
            for (a, x) in acc.iter_mut().zip(g) {
                *a += w * x;
            }
        }
    }
    assert!((packed_loss - loss).abs() <= 1e-12 * loss.abs(), "packed loss {packed_loss} vs one by one {loss}");
    assert_eq!(packed_grads.keys().collect::<Vec<_>>(), grads.keys().collect::<Vec<_>>());
    for (name, want) in &grads {
        let e = max_rel_diff(&packed_grads[name], want);
        assert!(e < 1e-10, "{name}: packed gradient {e:e} from the documents' one by one");
    }

    // Without the positions the documents see each other: a different loss.
    let (stream_loss, _) = step(&spec(2, seq, false), &tokens, &targets, None);
    assert!((stream_loss - loss).abs() > 1e-6 * loss.abs(), "the stream loss {stream_loss} should differ from {loss}");
}
