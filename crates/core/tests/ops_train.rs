//! Tests of the training ops beyond their sample tables (which
//! `tests/op_samples.rs` runs through the VJP, in-place, narrow-dtype and
//! garbage-output checks): embedding (and its scatter-add backward),
//! cross-entropy (and its in-place backward) and the AdamW update. The VJP
//! rules' choice of backward ops by the cotangents given, forward and
//! backward values against naive references, low-precision kernels against
//! those references, AdamW against PyTorch's formula, user-facing errors
//! and the determinism of the scatter-add.

use std::collections::HashMap;

use half::bf16;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, StandardNormal};

use stepgraph_core::host::HostTensor;
use stepgraph_core::ir::parse::parse;
use stepgraph_core::ir::{Builder, DType, OutputKind, Phase, TensorType, ValueId};
use stepgraph_core::ops::embedding::{Embedding, EmbeddingBackward};
use stepgraph_core::ops::loss::{CrossEntropy, CrossEntropyBackward};
use stepgraph_core::ops::optim::{AdamW, MasterWeights};
use stepgraph_core::ops::{Op, VjpArgs};
use stepgraph_core::testing::{interpret, max_rel_diff, run_op};
use stepgraph_core::Error;

const IGNORE: i64 = -100;

fn tensor(dtype: DType, shape: &[usize], data: &[f64]) -> HostTensor {
    HostTensor::from_f64(TensorType::new(dtype, shape), data)
}

fn normal(n: usize, rng: &mut StdRng) -> Vec<f64> {
    (0..n).map(|_| StandardNormal.sample(rng)).collect()
}

fn scalar(dtype: DType, x: f64) -> HostTensor {
    HostTensor::from_f64(TensorType::scalar(dtype), &[x])
}

/// Rounds through `dtype` (so low-precision runs and f64 references see the same inputs).
fn rounded(dtype: DType, data: &[f64]) -> Vec<f64> {
    tensor(dtype, &[data.len()], data).to_f64()
}

/// Per input, its cotangent's values (if any); per backward node, its op name
/// and input count.
type VjpValues = (Vec<Option<Vec<f64>>>, Vec<(String, usize)>);

/// The cotangents `op`'s VJP rule gives its inputs for the given output
/// cotangents (`None`: no cotangent for that output), run on the CPU kernels.
/// Also returns the number of inputs of every backward node, by op name.
fn vjp_values(op: &Op, inputs: &[HostTensor], cotangents: &[Option<HostTensor>]) -> Result<VjpValues, Error> {
    let mut b = Builder::new("vjp");
    let xs: Vec<ValueId> =
        inputs.iter().enumerate().map(|(i, t)| b.input(&format!("x{i}"), t.ty.clone())).collect::<Result<_, _>>()?;
    let ys = b.push(op.clone(), &xs)?;
    let mut vs = Vec::new();
    for (j, c) in cotangents.iter().enumerate() {
        vs.push(match c {
            Some(c) => Some(b.input(&format!("v{j}"), c.ty.clone())?),
            None => None,
        });
    }
    b.set_phase(Phase::Backward);
    let gs = op.vjp(&mut b, &VjpArgs { inputs: &xs, outputs: &ys, cotangents: &vs })?;
    for (i, g) in gs.iter().enumerate() {
        if let Some(g) = g {
            b.output(OutputKind::Named(format!("g{i}")), *g);
        }
    }
    let trace = b.finish("vjp")?;
    let mut leaves = HashMap::new();
    for v in trace.leaves() {
        let name = trace.value(v).kind.leaf_name().unwrap().to_string();
        let k: usize = name[1..].parse().unwrap();
        let t = if name.starts_with('x') { inputs[k].clone() } else { cotangents[k].clone().unwrap() };
        leaves.insert(v, t);
    }
    let vals = interpret(&trace, &leaves)?;
    let mut out = vec![None; inputs.len()];
    for o in &trace.outputs {
        if let OutputKind::Named(n) = &o.kind {
            out[n[1..].parse::<usize>().unwrap()] = Some(vals[o.value.index()].to_f64());
        }
    }
    let nodes = trace
        .nodes
        .iter()
        .filter(|n| n.phase == Phase::Backward)
        .map(|n| (n.op.name().to_string(), n.inputs.len()))
        .collect();
    Ok((out, nodes))
}

// ------------------------------------------------------------------ (a) VJP rules

#[test]
fn cross_entropy_vjp_uses_only_the_cotangents_it_gets() {
    let mut rng = StdRng::seed_from_u64(11);
    let (n, v) = (5, 7);
    let logits = tensor(DType::F64, &[n, v], &normal(n * v, &mut rng));
    let t = [1.0, -100.0, 6.0, 0.0, 3.0];
    let targets = tensor(DType::I64, &[n], &t);
    let op: Op = CrossEntropy { ignore_index: IGNORE }.into();
    let outs = run_op(&op, &[logits.clone(), targets.clone()]).unwrap();
    let lse = outs[1].to_f64();
    let x = logits.to_f64();
    let softmax = |r: usize, j: usize| (x[r * v + j] - lse[r]).exp();

    // Loss cotangent only: the 4-input backward.
    let g = 0.7;
    let (grads, nodes) =
        vjp_values(&op, &[logits.clone(), targets.clone()], &[Some(scalar(DType::F64, g)), None]).unwrap();
    assert_eq!(nodes, vec![("cross_entropy_backward".to_string(), 4)]);
    assert!(grads[1].is_none(), "targets get no cotangent");
    let got = grads[0].clone().unwrap();
    let kept = 4.0;
    for r in 0..n {
        for j in 0..v {
            let want = if t[r] == -100.0 { 0.0 } else { g / kept * (softmax(r, j) - (j as f64 == t[r]) as u8 as f64) };
            assert!((got[r * v + j] - want).abs() < 1e-12, "row {r} col {j}: {} vs {want}", got[r * v + j]);
        }
    }

    // Lse cotangent only: a zero loss cotangent and the 5-input backward;
    // ignored rows get the lse gradient too (their lse is computed).
    let glse = normal(n, &mut rng);
    let (grads, nodes) = vjp_values(&op, &[logits, targets], &[None, Some(tensor(DType::F64, &[n], &glse))]).unwrap();
    assert_eq!(nodes, vec![("full".to_string(), 0), ("cross_entropy_backward".to_string(), 5)]);
    let got = grads[0].clone().unwrap();
    for r in 0..n {
        for j in 0..v {
            let want = glse[r] * softmax(r, j);
            assert!((got[r * v + j] - want).abs() < 1e-12, "row {r} col {j}: {} vs {want}", got[r * v + j]);
        }
    }

    // No cotangent at all: nothing is emitted.
    let (grads, nodes) =
        vjp_values(&op, &[tensor(DType::F64, &[1, 2], &[0.0, 1.0]), tensor(DType::I64, &[1], &[0.0])], &[None, None])
            .unwrap();
    assert!(grads.iter().all(Option::is_none) && nodes.is_empty());
}

// ------------------------------------------------------------------ (b) values at f64

#[test]
fn embedding_gathers_rows_exactly() {
    let mut rng = StdRng::seed_from_u64(1);
    let table = normal(5 * 4, &mut rng);
    let ids = [4.0, 0.0, 4.0, 2.0, 1.0, 3.0];
    for id_dtype in [DType::I32, DType::I64] {
        let out =
            run_op(&Embedding.into(), &[tensor(id_dtype, &[2, 3], &ids), tensor(DType::F64, &[5, 4], &table)]).unwrap();
        assert_eq!(out[0].ty, TensorType::new(DType::F64, [2, 3, 4]));
        let want: Vec<f64> = ids.iter().flat_map(|&i| table[i as usize * 4..i as usize * 4 + 4].to_vec()).collect();
        assert_eq!(out[0].to_f64(), want);
    }
}

/// Scatter-add in position order, in f64.
fn naive_scatter(ids: &[f64], gy: &[f64], rows: usize, width: usize) -> Vec<f64> {
    let mut out = vec![0.0; rows * width];
    for (p, &id) in ids.iter().enumerate() {
        for c in 0..width {
            out[id as usize * width + c] += gy[p * width + c];
        }
    }
    out
}

#[test]
fn embedding_backward_sums_repeated_rows() {
    let mut rng = StdRng::seed_from_u64(2);
    let ids = [2.0, 2.0, 0.0, 5.0, 2.0, 0.0, 3.0, 2.0];
    let (rows, width) = (7, 3);
    let gy = normal(ids.len() * width, &mut rng);
    let out = run_op(
        &EmbeddingBackward { num_rows: rows }.into(),
        &[tensor(DType::I32, &[2, 4], &ids), tensor(DType::F64, &[2, 4, width], &gy)],
    )
    .unwrap();
    assert_eq!(out[0].ty, TensorType::new(DType::F64, [rows, width]));
    let want = naive_scatter(&ids, &gy, rows, width);
    let got = out[0].to_f64();
    // Rows 1, 4 and 6 are never selected: exactly zero, not leftover memory.
    for r in [1, 4, 6] {
        assert!(got[r * width..(r + 1) * width].iter().all(|&x| x == 0.0));
    }
    assert!(max_rel_diff(&got, &want) < 1e-12, "{got:?} vs {want:?}");
}

/// Naive mean cross-entropy via log-softmax, plus the unshifted log-sum-exp per row.
fn naive_ce(x: &[f64], t: &[f64], v: usize, ignore: f64) -> (f64, Vec<f64>) {
    let n = t.len();
    let lse: Vec<f64> = (0..n).map(|r| x[r * v..(r + 1) * v].iter().map(|a| a.exp()).sum::<f64>().ln()).collect();
    let (mut sum, mut kept) = (0.0, 0.0);
    for r in 0..n {
        if t[r] != ignore {
            let log_softmax = x[r * v + t[r] as usize] - lse[r];
            sum -= log_softmax;
            kept += 1.0;
        }
    }
    (sum / kept, lse)
}

#[test]
fn cross_entropy_matches_log_softmax_formula() {
    let mut rng = StdRng::seed_from_u64(3);
    let (n, v) = (6, 11);
    let x = normal(n * v, &mut rng);
    let t = [3.0, -100.0, 10.0, 0.0, -100.0, 7.0];
    for tdt in [DType::I32, DType::I64] {
        let out = run_op(
            &CrossEntropy { ignore_index: IGNORE }.into(),
            &[tensor(DType::F64, &[n, v], &x), tensor(tdt, &[n], &t)],
        )
        .unwrap();
        assert_eq!(out[0].ty, TensorType::scalar(DType::F64));
        assert_eq!(out[1].ty, TensorType::new(DType::F64, [n]));
        let (loss, lse) = naive_ce(&x, &t, v, -100.0);
        let got = out[0].to_f64()[0];
        assert!((got - loss).abs() <= 1e-12 * loss.abs(), "{got} vs {loss}");
        assert!(max_rel_diff(&out[1].to_f64(), &lse) < 1e-12);
    }
}

#[test]
fn cross_entropy_is_stable_for_large_logits() {
    // exp(1000) overflows: only a shifted log-sum-exp gets these right.
    let x = [1000.0, 999.0, 998.0, -1000.0, -1001.0, -1002.0];
    let out = run_op(
        &CrossEntropy { ignore_index: IGNORE }.into(),
        &[tensor(DType::F64, &[2, 3], &x), tensor(DType::I64, &[2], &[1.0, 2.0])],
    )
    .unwrap();
    let lse0 = 1000.0 + (1.0 + (-1.0f64).exp() + (-2.0f64).exp()).ln();
    let lse1 = -1000.0 + (1.0 + (-1.0f64).exp() + (-2.0f64).exp()).ln();
    let lse = out[1].to_f64();
    assert!((lse[0] - lse0).abs() < 1e-12 * 1000.0 && (lse[1] - lse1).abs() < 1e-12 * 1000.0, "{lse:?}");
    let loss = ((lse0 - 999.0) + (lse1 + 1002.0)) / 2.0;
    assert!((out[0].to_f64()[0] - loss).abs() < 1e-9, "{:?} vs {loss}", out[0].to_f64());
}

#[test]
fn cross_entropy_with_every_row_ignored_is_nan() {
    let x = [0.5, -1.0, 2.0, 0.0, 1.0, 3.0];
    let ins = [tensor(DType::F64, &[2, 3], &x), tensor(DType::I64, &[2], &[-100.0, -100.0])];
    let out = run_op(&CrossEntropy { ignore_index: IGNORE }.into(), &ins).unwrap();
    assert!(out[0].to_f64()[0].is_nan(), "PyTorch gives NaN (0/0), got {:?}", out[0].to_f64());
    // The lse is still computed for ignored rows.
    let (_, lse) = naive_ce(&x, &[0.0, 0.0], 3, -100.0);
    assert!(max_rel_diff(&out[1].to_f64(), &lse) < 1e-12);
    // And the gradient is zero everywhere (PyTorch's too), not NaN.
    let back = run_op(
        &CrossEntropyBackward { ignore_index: IGNORE }.into(),
        &[ins[0].clone(), ins[1].clone(), out[1].clone(), scalar(DType::F64, 1.0)],
    )
    .unwrap();
    assert_eq!(back[0].to_f64(), vec![0.0; 6]);
}

#[test]
fn cross_entropy_backward_matches_softmax_formula() {
    let mut rng = StdRng::seed_from_u64(4);
    let (n, v) = (5, 9);
    let x = normal(n * v, &mut rng);
    let t = [8.0, 0.0, -100.0, 4.0, 4.0];
    let ins = [tensor(DType::F64, &[n, v], &x), tensor(DType::I64, &[n], &t)];
    let fwd = run_op(&CrossEntropy { ignore_index: IGNORE }.into(), &ins).unwrap();
    let glse = normal(n, &mut rng);
    let g = -1.3;
    let back = run_op(
        &CrossEntropyBackward { ignore_index: IGNORE }.into(),
        &[ins[0].clone(), ins[1].clone(), fwd[1].clone(), scalar(DType::F64, g), tensor(DType::F64, &[n], &glse)],
    )
    .unwrap();
    let got = back[0].to_f64();
    let (_, lse) = naive_ce(&x, &t, v, -100.0);
    for r in 0..n {
        for j in 0..v {
            let p = (x[r * v + j] - lse[r]).exp();
            let mut want = glse[r] * p;
            if t[r] != -100.0 {
                want += g / 4.0 * (p - (j as f64 == t[r]) as u8 as f64);
            }
            assert!((got[r * v + j] - want).abs() < 1e-12, "row {r} col {j}: {} vs {want}", got[r * v + j]);
        }
    }
}

// ------------------------------------------------------------------ (c) low precision vs f64

#[test]
fn embedding_low_precision_tracks_f64() {
    let mut rng = StdRng::seed_from_u64(5);
    let (rows, width, n) = (9, 16, 64);
    let ids: Vec<f64> = (0..n).map(|_| rng.gen_range(0..rows) as f64).collect();
    let table = normal(rows * width, &mut rng);
    let gy = normal(n * width, &mut rng);
    // f32: tolerance of a few f32 roundings; bf16: one bf16 rounding of the
    // f32-accumulated sums (2^-8 relative) on top of the inputs' own rounding.
    for (dt, tol) in [(DType::F32, 1e-6), (DType::BF16, 4e-3)] {
        let (table_r, gy_r) = (rounded(dt, &table), rounded(dt, &gy));
        let fwd =
            run_op(&Embedding.into(), &[tensor(DType::I64, &[n], &ids), tensor(dt, &[rows, width], &table_r)]).unwrap();
        assert_eq!(fwd[0].ty.dtype, dt);
        // A gather copies: exact in every dtype.
        let want: Vec<f64> =
            ids.iter().flat_map(|&i| table_r[i as usize * width..(i as usize + 1) * width].to_vec()).collect();
        assert_eq!(fwd[0].to_f64(), want, "{dt}");
        let back = run_op(
            &EmbeddingBackward { num_rows: rows }.into(),
            &[tensor(DType::I64, &[n], &ids), tensor(dt, &[n, width], &gy_r)],
        )
        .unwrap();
        assert_eq!(back[0].ty.dtype, dt);
        let err = max_rel_diff(&back[0].to_f64(), &naive_scatter(&ids, &gy_r, rows, width));
        assert!(err < tol, "{dt}: max rel diff {err:e} > {tol:e}");
    }
}

#[test]
fn cross_entropy_low_precision_tracks_f64() {
    let mut rng = StdRng::seed_from_u64(6);
    // Wide rows and enough of them to split into several parallel tasks.
    let (n, v) = (40, 1500);
    let x: Vec<f64> = normal(n * v, &mut rng).iter().map(|a| 3.0 * a).collect();
    let t: Vec<f64> = (0..n).map(|r| if r % 7 == 3 { -100.0 } else { rng.gen_range(0..v) as f64 }).collect();
    let g = 0.9;
    // Statistics are f32 for every narrow dtype, so the loss and lse of f32
    // and bf16 logits both meet f32 tolerances; the bf16 gradient is
    // rounded to bf16 (2^-8 relative of the largest entry).
    for (dt, stat_tol, grad_tol) in [(DType::F32, 1e-5, 1e-5), (DType::BF16, 1e-5, 4e-3)] {
        let xr = rounded(dt, &x);
        let run = |dtype: DType| {
            let ins = [tensor(dtype, &[n, v], &xr), tensor(DType::I32, &[n], &t)];
            let fwd = run_op(&CrossEntropy { ignore_index: IGNORE }.into(), &ins).unwrap();
            let st = fwd[0].ty.dtype;
            let back = run_op(
                &CrossEntropyBackward { ignore_index: IGNORE }.into(),
                &[ins[0].clone(), ins[1].clone(), fwd[1].clone(), scalar(st, g)],
            )
            .unwrap();
            (fwd[0].to_f64(), fwd[1].to_f64(), back[0].clone())
        };
        let (loss64, lse64, d64) = run(DType::F64);
        let (loss, lse, d) = run(dt);
        assert_eq!(d.ty.dtype, dt);
        let err = max_rel_diff(&loss, &loss64);
        assert!(err < stat_tol, "{dt} loss: {err:e}");
        let err = max_rel_diff(&lse, &lse64);
        assert!(err < stat_tol, "{dt} lse: {err:e}");
        let err = max_rel_diff(&d.to_f64(), &d64.to_f64());
        assert!(err < grad_tol, "{dt} dlogits: {err:e}");
    }
}

#[test]
fn cross_entropy_outputs_f32_statistics_for_narrow_logits() {
    for dt in [DType::F32, DType::BF16, DType::F16] {
        let out = Op::from(CrossEntropy { ignore_index: IGNORE })
            .infer(&[&TensorType::new(dt, [3, 4]), &TensorType::new(DType::I64, [3])])
            .unwrap();
        assert_eq!(out, vec![TensorType::scalar(DType::F32), TensorType::new(DType::F32, [3])]);
    }
}

// ------------------------------------------------------------------ (d) AdamW vs PyTorch's formula

/// `torch.optim.AdamW` (single-tensor, non-amsgrad) for one element, in f64,
/// written as the documented math.
fn adamw_reference(p: &mut f64, g: f64, m: &mut f64, v: &mut f64, lr: f64, t: f64, h: &AdamW) {
    *p *= 1.0 - lr * h.weight_decay;
    *m = h.beta1 * *m + (1.0 - h.beta1) * g;
    *v = h.beta2 * *v + (1.0 - h.beta2) * g * g;
    let bias_correction1 = 1.0 - h.beta1.powf(t);
    let bias_correction2 = 1.0 - h.beta2.powf(t);
    let step_size = lr / bias_correction1;
    let denom = v.sqrt() / bias_correction2.sqrt() + h.eps;
    *p -= step_size * *m / denom;
}

/// The same update as PyTorch evaluates it for float32 tensors: Python-float
/// (f64) scalars rounded to f32 when they meet a tensor, every tensor op in
/// f32 in `_single_tensor_adamw`'s order, `lerp` as ATen's scalar `lerp`.
/// `store` rounds the parameter to its storage once per step.
#[allow(clippy::too_many_arguments)] // one element's full AdamW state and step
fn adamw_reference_f32(
    p: &mut f32,
    g: f32,
    m: &mut f32,
    v: &mut f32,
    lr: f64,
    t: f64,
    h: &AdamW,
    store: impl Fn(f32) -> f32,
) {
    let decay = (1.0 - lr * h.weight_decay) as f32;
    let w = (1.0 - h.beta1) as f32;
    let bc1 = 1.0 - h.beta1.powf(t);
    let bc2_sqrt = (1.0 - h.beta2.powf(t)).sqrt();
    let pd = *p * decay;
    *m = if w.abs() < 0.5 { *m + w * (g - *m) } else { g - (g - *m) * (1.0 - w) };
    *v = *v * h.beta2 as f32 + (1.0 - h.beta2) as f32 * g * g;
    let denom = v.sqrt() / bc2_sqrt as f32 + h.eps as f32;
    *p = store(pd + (-(lr / bc1)) as f32 * *m / denom);
}

#[test]
fn adamw_matches_pytorch_formula_over_three_steps_f64() {
    let mut rng = StdRng::seed_from_u64(9);
    let len = 50;
    for wd in [0.0, 0.1] {
        let h = AdamW { weight_decay: wd, ..AdamW::default() };
        let lr = 0.01;
        let p_start = normal(len, &mut rng);
        let mut p = p_start.clone();
        let (mut m, mut v) = (vec![0.0; len], vec![0.0; len]);
        let (mut rp, mut rm, mut rv) = (p.clone(), m.clone(), v.clone());
        for step in 1..=3 {
            let g = normal(len, &mut rng);
            let out = run_op(
                &h.clone().into(),
                &[
                    tensor(DType::F64, &[len], &p),
                    tensor(DType::F64, &[len], &g),
                    tensor(DType::F64, &[len], &m),
                    tensor(DType::F64, &[len], &v),
                    scalar(DType::F64, lr),
                    scalar(DType::F64, step as f64),
                ],
            )
            .unwrap();
            for i in 0..len {
                adamw_reference(&mut rp[i], g[i], &mut rm[i], &mut rv[i], lr, step as f64, &h);
            }
            (p, m, v) = (out[0].to_f64(), out[1].to_f64(), out[2].to_f64());
            for (name, got, want) in [("p", &p, &rp), ("m", &m, &rm), ("v", &v, &rv)] {
                for i in 0..len {
                    let err = (got[i] - want[i]).abs() / want[i].abs().max(1e-300);
                    assert!(err < 1e-12, "wd {wd} step {step} {name}[{i}]: {} vs {} ({err:e})", got[i], want[i]);
                }
            }
        }
        // Not a no-op: each step moves a parameter by about lr (Adam's
        // normalised step), so on average by a good fraction of 0.01.
        let mean_move = p.iter().zip(&p_start).map(|(a, b)| (a - b).abs()).sum::<f64>() / len as f64;
        assert!(mean_move > 3e-3, "parameters barely moved: mean |Δp| = {mean_move:e}");
    }
}

#[test]
fn adamw_bf16_params_with_f32_state_over_three_steps() {
    let mut rng = StdRng::seed_from_u64(10);
    let len = 300;
    for wd in [0.0, 0.1] {
        let h = AdamW { weight_decay: wd, ..AdamW::default() };
        // Large enough that every step moves bf16 parameters by several ulps.
        let lr = 0.05f32 as f64;
        let p0 = rounded(DType::BF16, &normal(len, &mut rng));
        let mut p = p0.clone();
        let (mut m, mut v) = (vec![0.0; len], vec![0.0; len]);
        // Exact-order f32 reference and an f64 reference (rounding p to bf16 per step).
        let mut p32: Vec<f32> = p0.iter().map(|&x| x as f32).collect();
        let (mut m32, mut v32) = (vec![0.0f32; len], vec![0.0f32; len]);
        let (mut p64, mut m64, mut v64) = (p0.clone(), vec![0.0; len], vec![0.0; len]);
        for step in 1..=3 {
            let g = rounded(DType::BF16, &normal(len, &mut rng));
            let out = run_op(
                &h.clone().into(),
                &[
                    tensor(DType::BF16, &[len], &p),
                    tensor(DType::BF16, &[len], &g),
                    tensor(DType::F32, &[len], &m),
                    tensor(DType::F32, &[len], &v),
                    scalar(DType::F32, lr),
                    scalar(DType::F32, step as f64),
                ],
            )
            .unwrap();
            assert_eq!([out[0].ty.dtype, out[1].ty.dtype, out[2].ty.dtype], [DType::BF16, DType::F32, DType::F32]);
            for i in 0..len {
                let to_bf16 = |x: f32| bf16::from_f32(x).to_f32();
                adamw_reference_f32(&mut p32[i], g[i] as f32, &mut m32[i], &mut v32[i], lr, step as f64, &h, to_bf16);
                adamw_reference(&mut p64[i], g[i], &mut m64[i], &mut v64[i], lr, step as f64, &h);
                p64[i] = bf16::from_f64(p64[i]).to_f64();
            }
            (p, m, v) = (out[0].to_f64(), out[1].to_f64(), out[2].to_f64());
            // The moments are sums with cancellation: bound their f32 error by
            // the scale of the whole tensor, not by each (possibly tiny) entry.
            let scale = |x: &[f64]| x.iter().fold(0.0f64, |a, b| a.max(b.abs()));
            let (m_scale, v_scale) = (scale(&m64), scale(&v64));
            for i in 0..len {
                // Bit for bit against PyTorch's f32 operation order.
                assert_eq!(p[i], p32[i] as f64, "wd {wd} step {step} p[{i}]");
                assert_eq!(m[i], m32[i] as f64, "wd {wd} step {step} m[{i}]");
                assert_eq!(v[i], v32[i] as f64, "wd {wd} step {step} v[{i}]");
                // And within f32 / bf16 precision of the f64 math: moments to
                // 1e-6 of their scale, parameters to one bf16 ulp (2^-7 relative).
                assert!((m[i] - m64[i]).abs() <= 1e-6 * m_scale, "m[{i}]: {} vs {}", m[i], m64[i]);
                assert!((v[i] - v64[i]).abs() <= 1e-6 * v_scale, "v[{i}]: {} vs {}", v[i], v64[i]);
                assert!((p[i] - p64[i]).abs() <= p64[i].abs() * 2f64.powi(-7), "p[{i}]: {} vs {}", p[i], p64[i]);
            }
        }
        let moved = p.iter().zip(&p0).filter(|(a, b)| a != b).count();
        assert!(moved > len * 9 / 10, "only {moved} of {len} bf16 parameters changed");
    }
}

#[test]
fn adamw_f32_follows_pytorch_operation_order_bit_for_bit() {
    // f32 parameters show every last-bit difference that bf16 storage would
    // round away, so this pins the order of the f32 operations.
    let mut rng = StdRng::seed_from_u64(15);
    let len = 500;
    for wd in [0.0, 0.1] {
        let h = AdamW { weight_decay: wd, ..AdamW::default() };
        let lr = 3e-3f32 as f64;
        let mut p = rounded(DType::F32, &normal(len, &mut rng));
        let (mut m, mut v) = (vec![0.0; len], vec![0.0; len]);
        let mut p32: Vec<f32> = p.iter().map(|&x| x as f32).collect();
        let (mut m32, mut v32) = (vec![0.0f32; len], vec![0.0f32; len]);
        for step in 1..=3 {
            let g = rounded(DType::F32, &normal(len, &mut rng));
            let out = run_op(
                &h.clone().into(),
                &[
                    tensor(DType::F32, &[len], &p),
                    tensor(DType::F32, &[len], &g),
                    tensor(DType::F32, &[len], &m),
                    tensor(DType::F32, &[len], &v),
                    scalar(DType::F32, lr),
                    scalar(DType::F32, step as f64),
                ],
            )
            .unwrap();
            (p, m, v) = (out[0].to_f64(), out[1].to_f64(), out[2].to_f64());
            for i in 0..len {
                adamw_reference_f32(&mut p32[i], g[i] as f32, &mut m32[i], &mut v32[i], lr, step as f64, &h, |x| x);
                assert_eq!(
                    [p[i], m[i], v[i]],
                    [p32[i] as f64, m32[i] as f64, v32[i] as f64],
                    "wd {wd} step {step} element {i}"
                );
            }
        }
    }
}

#[test]
fn adamw_f32_tracks_f64() {
    let mut rng = StdRng::seed_from_u64(12);
    let len = 200;
    let h = AdamW { weight_decay: 0.1, ..AdamW::default() };
    let lr = 1e-3f32 as f64;
    let (p, g) = (rounded(DType::F32, &normal(len, &mut rng)), rounded(DType::F32, &normal(len, &mut rng)));
    let m = rounded(DType::F32, &normal(len, &mut rng).iter().map(|x| 0.1 * x).collect::<Vec<_>>());
    let v = rounded(DType::F32, &normal(len, &mut rng).iter().map(|x| 0.01 * x * x).collect::<Vec<_>>());
    let run = |dt: DType| {
        run_op(
            &h.clone().into(),
            &[
                tensor(dt, &[len], &p),
                tensor(dt, &[len], &g),
                tensor(dt, &[len], &m),
                tensor(dt, &[len], &v),
                scalar(dt, lr),
                scalar(dt, 7.0),
            ],
        )
        .unwrap()
    };
    let (a, b) = (run(DType::F32), run(DType::F64));
    for k in 0..3 {
        let err = max_rel_diff(&a[k].to_f64(), &b[k].to_f64());
        assert!(err < 1e-6, "output {k}: {err:e}");
    }
}

#[test]
fn adamw_defaults_are_pytorchs() {
    assert_eq!(
        AdamW::default(),
        AdamW { beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.01, master: MasterWeights::None }
    );
}

// ------------------------------------------------------------------ (e) errors

fn input_error(r: Result<Vec<HostTensor>, Error>) -> (String, String) {
    match r {
        Err(Error::Input { name, reason }) => (name, reason),
        other => panic!("expected an input error, got {other:?}"),
    }
}

#[test]
fn out_of_range_token_id_names_id_and_position() {
    let table = tensor(DType::F32, &[5, 2], &[0.0; 10]);
    for (ids, bad, pos) in [(vec![0.0, 4.0, 5.0, 9.0], 5, 2), (vec![-1.0, 0.0], -1, 0)] {
        for dt in [DType::I32, DType::I64] {
            let n = ids.len();
            let (name, reason) = input_error(run_op(&Embedding.into(), &[tensor(dt, &[n], &ids), table.clone()]));
            assert_eq!(name, "token ids");
            assert_eq!(
                reason,
                format!("token id {bad} at position {pos} is out of range for an embedding table of 5 rows")
            );
            // The backward checks too rather than writing out of bounds.
            let gy = tensor(DType::F32, &[n, 2], &vec![1.0; n * 2]);
            let (name, reason) =
                input_error(run_op(&EmbeddingBackward { num_rows: 5 }.into(), &[tensor(dt, &[n], &ids), gy]));
            assert_eq!(name, "token ids");
            assert!(reason.contains(&format!("token id {bad} at position {pos}")), "{reason}");
        }
    }
}

#[test]
fn out_of_range_target_names_value_and_position() {
    let logits = tensor(DType::F32, &[3, 5], &[0.0; 15]);
    for (t, bad, pos) in [([1.0, -100.0, 5.0], 5, 2), ([-1.0, 0.0, 0.0], -1, 0)] {
        let targets = tensor(DType::I64, &[3], &t);
        let (name, reason) =
            input_error(run_op(&CrossEntropy { ignore_index: IGNORE }.into(), &[logits.clone(), targets.clone()]));
        assert_eq!(name, "targets");
        assert!(reason.contains(&format!("target {bad} at position {pos} is out of range for 5 classes")), "{reason}");
        let lse = tensor(DType::F32, &[3], &[0.0; 3]);
        let (name, _) = input_error(run_op(
            &CrossEntropyBackward { ignore_index: IGNORE }.into(),
            &[logits.clone(), targets, lse, scalar(DType::F32, 1.0)],
        ));
        assert_eq!(name, "targets");
    }
}

#[test]
fn shape_mismatches_get_clear_messages() {
    let mut b = Builder::new("shapes");
    let logits = b.input("logits", TensorType::new(DType::F32, [4, 5])).unwrap();
    let targets = b.input("targets", TensorType::new(DType::I64, [3])).unwrap();
    let err = b.cross_entropy(logits, targets, IGNORE).unwrap_err().to_string();
    assert_eq!(
        err,
        "op `cross_entropy`: targets i64[3] must have one entry per logits row, but logits f32[4,5] have 4 rows \
         (inputs: f32[4,5], i64[3])"
    );
    let t2 = b.input("targets2", TensorType::new(DType::F32, [4])).unwrap();
    let err = b.cross_entropy(logits, t2, IGNORE).unwrap_err().to_string();
    assert!(err.contains("targets must be a 1-D i32 or i64 tensor, got f32[4]"), "{err}");

    let ids = b.input("ids", TensorType::new(DType::I32, [2, 3])).unwrap();
    let table3 = b.input("table3", TensorType::new(DType::F32, [4, 5, 6])).unwrap();
    let err = b.embedding(ids, table3).unwrap_err().to_string();
    assert!(err.contains("table must be [rows, width], got f32[4,5,6]"), "{err}");
    let err = b.embedding(logits, logits).unwrap_err().to_string();
    assert!(err.contains("ids must be an i32 or i64 tensor, got f32[4,5]"), "{err}");

    let ty = |d: DType, s: &[usize]| TensorType::new(d, s);
    let adamw = |p: TensorType, m: TensorType, lr: TensorType| {
        Op::from(AdamW::default()).infer(&[&p, &p, &m, &m, &lr, &TensorType::scalar(DType::F32)]).unwrap_err()
    };
    let err = adamw(ty(DType::F32, &[3, 4]), ty(DType::F32, &[4, 3]), TensorType::scalar(DType::F32));
    assert!(err.contains("first moment f32[4,3] must have the parameter's shape"), "{err}");
    let err = adamw(ty(DType::F32, &[3]), ty(DType::BF16, &[3]), TensorType::scalar(DType::F32));
    assert!(err.contains("the parameter's dtype or f32 (parameter f32[3])"), "{err}");
    let err = adamw(ty(DType::F32, &[3]), ty(DType::F32, &[3]), ty(DType::F32, &[2]));
    assert!(err.contains("lr must be a one-element f32 or f64 tensor, got f32[2]"), "{err}");
    let err = Op::from(AdamW { beta1: 1.0, ..AdamW::default() })
        .infer(
            &[&ty(DType::F32, &[3]); 4].iter().copied().chain([&TensorType::scalar(DType::F32); 2]).collect::<Vec<_>>(),
        )
        .unwrap_err();
    assert!(err.contains("beta1 must be in [0, 1), got 1"), "{err}");
}

#[test]
fn adamw_rejects_bad_step_and_lr_values() {
    let x = tensor(DType::F32, &[2], &[1.0, 2.0]);
    let run = |lr: f64, step: f64| {
        run_op(
            &AdamW::default().into(),
            &[x.clone(), x.clone(), x.clone(), x.clone(), scalar(DType::F32, lr), scalar(DType::F32, step)],
        )
    };
    let (name, reason) = input_error(run(1e-3, 0.0));
    assert_eq!(name, "step");
    assert!(reason.contains("at least 1"), "{reason}");
    let (name, _) = input_error(run(-1.0, 1.0));
    assert_eq!(name, "lr");
    assert!(run(1e-3, 1.0).is_ok());
}

#[test]
fn training_ops_refuse_to_be_differentiated() {
    let mut b = Builder::new("vjp");
    let f = |b: &mut Builder, n: &str, d: DType, s: &[usize]| b.input(n, TensorType::new(d, s)).unwrap();
    let p = f(&mut b, "p", DType::F32, &[3]);
    let lr = f(&mut b, "lr", DType::F32, &[]);
    let step = f(&mut b, "step", DType::F32, &[]);
    let outs = b.push(AdamW::default().into(), &[p, p, p, p, lr, step]).unwrap();
    let ct: Vec<_> = outs.iter().map(|&o| Some(o)).collect();
    let err = Op::from(AdamW::default())
        .vjp(&mut b, &VjpArgs { inputs: &[p, p, p, p, lr, step], outputs: &outs, cotangents: &ct })
        .unwrap_err();
    assert!(matches!(err, Error::NotDifferentiable { .. }) && err.to_string().contains("not differentiable"), "{err}");
    for op in [Op::from(EmbeddingBackward { num_rows: 3 }), CrossEntropyBackward { ignore_index: IGNORE }.into()] {
        let err = op.vjp(&mut b, &VjpArgs { inputs: &[], outputs: &[], cotangents: &[] }).unwrap_err();
        assert!(matches!(err, Error::NotDifferentiable { .. }), "{err}");
    }
}

// ------------------------------------------------------------------ (f) determinism

#[test]
fn embedding_backward_is_deterministic_with_many_repeats() {
    let mut rng = StdRng::seed_from_u64(13);
    let (n, rows, width) = (4096, 7, 64);
    // Mostly row 3, so one row sums thousands of f32 values: any change of
    // order would show in the low bits.
    let ids: Vec<f64> = (0..n).map(|_| if rng.gen_bool(0.8) { 3.0 } else { rng.gen_range(0..rows) as f64 }).collect();
    let gy = normal(n * width, &mut rng);
    let args = [tensor(DType::I32, &[n], &ids), tensor(DType::F32, &[n, width], &gy)];
    let op: Op = EmbeddingBackward { num_rows: rows }.into();
    let first = run_op(&op, &args).unwrap();
    for threads in [1, 2, 3, 8] {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
        for _ in 0..3 {
            let again = pool.install(|| run_op(&op, &args)).unwrap();
            assert_eq!(again[0].bytes(), first[0].bytes(), "{threads} threads: different bits");
        }
    }
    // The bits are those of summing each row's positions in ascending order in f32.
    let mut want = vec![0.0f32; rows * width];
    for (p, &id) in ids.iter().enumerate() {
        for c in 0..width {
            want[id as usize * width + c] += gy[p * width + c] as f32;
        }
    }
    let got = first[0].to_f64();
    assert!(got.iter().zip(&want).all(|(a, b)| *a == *b as f64), "not the ascending-order f32 sum");
}

// ------------------------------------------------------------------ op plumbing

#[test]
fn training_ops_print_parse_and_lower() {
    let mut b = Builder::new("train_ops");
    let ids = b.input("ids", TensorType::new(DType::I32, [2, 3])).unwrap();
    let targets = b.input("targets", TensorType::new(DType::I64, [6])).unwrap();
    let lr = b.input("lr", TensorType::scalar(DType::F32)).unwrap();
    let step = b.input("step", TensorType::scalar(DType::F32)).unwrap();
    let table = b.param("wte", TensorType::new(DType::BF16, [7, 6])).unwrap();
    let m = b.state("wte.exp_avg", TensorType::new(DType::F32, [7, 6])).unwrap();
    let v = b.state("wte.exp_avg_sq", TensorType::new(DType::F32, [7, 6])).unwrap();
    let x = b.embedding(ids, table).unwrap();
    let x = b.reshape(x, &[6, 6]).unwrap();
    let ce = b.push(CrossEntropy { ignore_index: IGNORE }.into(), &[x, targets]).unwrap();
    let (loss, lse) = (ce[0], ce[1]);
    b.output(OutputKind::Loss, loss);
    b.set_phase(Phase::Backward);
    let gx = b.push1(CrossEntropyBackward { ignore_index: IGNORE }.into(), &[x, targets, lse, loss]).unwrap();
    let gx = b.reshape(gx, &[2, 3, 6]).unwrap();
    let gt = b.push1(EmbeddingBackward { num_rows: 7 }.into(), &[ids, gx]).unwrap();
    b.set_phase(Phase::Optimizer);
    let h = AdamW { beta1: 0.85, beta2: 0.95, eps: 1e-6, weight_decay: 0.0, ..AdamW::default() };
    let (p2, m2, v2, _) = b.adamw(table, gt, m, v, lr, step, None, &h).unwrap();
    for (s, n) in [(table, p2), (m, m2), (v, v2)] {
        b.update(s, n);
    }
    let trace = b.finish("build").unwrap();
    let text = trace.to_string();
    for needle in ["{ignore_index=-100}", "{num_rows=7}", "{beta1=0.85, beta2=0.95, eps=1e-6, weight_decay=0.0}"] {
        assert!(text.contains(needle), "missing `{needle}` in\n{text}");
    }
    assert_eq!(parse(&text).unwrap(), trace);

    assert_eq!(Op::from(AdamW::default()).inplace(), vec![(0, 0), (1, 2), (2, 3)]);
    assert_eq!(Op::from(CrossEntropyBackward { ignore_index: 0 }).inplace(), vec![(0, 0)]);
}
