//! Tests of the neural-network ops (RMSNorm, LayerNorm, rotary embedding,
//! softmax, causal grouped-query attention) and their backward ops beyond
//! their sample tables (which `tests/op_samples.rs` runs through the VJP,
//! in-place, narrow-dtype and garbage-output checks): VJPs with partial
//! cotangents, the forward samples' f64 values against naive references,
//! rope's inverse and its head-size-1 quirk against Hugging Face,
//! determinism across thread counts, trace print/parse, and shape-rule
//! errors.

use std::collections::HashMap;

use rand::rngs::StdRng;
use rand::SeedableRng;
use rand_distr::{Distribution, StandardNormal};

use stepgraph_core::host::HostTensor;
use stepgraph_core::ir::parse::parse;
use stepgraph_core::ir::print::print;
use stepgraph_core::ir::{Builder, DType, OutputKind, Phase, TensorType, Trace, ValueId};
use stepgraph_core::ops::attention::{Attention, AttentionBackward, Scores};
use stepgraph_core::ops::norm::{LayerNorm, LayerNormBackward, RmsNorm, RmsNormBackward};
use stepgraph_core::ops::rope::{Llama3Scaling, Rope, RopeScaling};
use stepgraph_core::ops::sample::{self, Input};
use stepgraph_core::ops::softmax::{Softmax, SoftmaxBackward};
use stepgraph_core::ops::{samples_by_op, Op, OpDef, Sample, VjpArgs};
use stepgraph_core::testing::{draw_input, draw_sample, interpret, max_rel_diff, run_op};

const SEEDS: [u64; 3] = [1, 2, 3];

/// The f64 samples of the forward ops this file checks against references.
fn forward_samples() -> Vec<(String, Sample)> {
    samples_by_op(DType::F64)
        .into_iter()
        .filter(|(name, _)| ["RmsNorm", "LayerNorm", "Rope", "Softmax", "Attention"].contains(name))
        .flat_map(|(name, v)| v.into_iter().enumerate().map(move |(i, s)| (format!("{name}#{i}"), s)))
        .filter(|(_, s)| !s.large)
        .collect()
}

fn normal(s: &[usize]) -> Input {
    sample::normal(DType::F64, s)
}

/// `⟨J·u, v⟩ = ⟨u, Jᵀ·v⟩` with cotangents only on the outputs in `mask`
/// (`check_vjp` gives every output one; a model gives the statistics none).
/// Returns (finite-difference side, VJP side), or `None` when the VJP
/// returned no cotangent for any input.
fn check_vjp_masked(sample: &Sample, seed: u64, mask: &[bool]) -> Option<(f64, f64)> {
    let op = &sample.op;
    let x = draw_sample(sample, seed).unwrap();
    let mut rng = StdRng::seed_from_u64(seed + 1000);
    let mut gauss = |n: usize| -> Vec<f64> { (0..n).map(|_| StandardNormal.sample(&mut rng)).collect() };
    let u: Vec<Vec<f64>> = x.iter().map(|t| gauss(t.ty.numel())).collect();

    let mut b = Builder::new("vjp_masked");
    let xs: Vec<ValueId> =
        x.iter().enumerate().map(|(i, t)| b.input(&format!("x{i}"), t.ty.clone()).unwrap()).collect();
    let ys = b.push(op.clone(), &xs).unwrap();
    let mut leaves: HashMap<String, HostTensor> =
        x.iter().enumerate().map(|(i, t)| (format!("x{i}"), t.clone())).collect();
    let mut vs = Vec::new();
    let mut v_data = Vec::new();
    for (j, &y) in ys.iter().enumerate() {
        let ty = b.ty(y).clone();
        if mask[j] {
            let d = HostTensor::from_f64(ty.clone(), &gauss(ty.numel()));
            vs.push(Some(b.input(&format!("v{j}"), ty).unwrap()));
            leaves.insert(format!("v{j}"), d.clone());
            v_data.push(Some(d));
        } else {
            vs.push(None);
            v_data.push(None);
        }
    }
    b.set_phase(Phase::Backward);
    let gs = op.vjp(&mut b, &VjpArgs { inputs: &xs, outputs: &ys, cotangents: &vs }).unwrap();
    assert_eq!(gs.len(), xs.len());
    if gs.iter().all(Option::is_none) {
        return None;
    }
    for (i, g) in gs.iter().enumerate() {
        let g = g.expect("every input of these ops is differentiable");
        b.output(OutputKind::Named(format!("g{i}")), g);
    }
    let trace = b.finish("vjp_masked").unwrap();
    let vals = run_trace(&trace, &leaves);
    let vjp: f64 = (0..xs.len()).map(|i| dot(&u[i], &vals[&format!("g{i}")])).sum();

    let eps = 1e-6;
    let shifted = |sign: f64| -> Vec<HostTensor> {
        let xs: Vec<HostTensor> = x
            .iter()
            .zip(&u)
            .map(|(t, ui)| {
                let d: Vec<f64> = t.to_f64().iter().zip(ui).map(|(a, b)| a + sign * eps * b).collect();
                HostTensor::from_f64(t.ty.clone(), &d)
            })
            .collect();
        run_op(op, &xs).unwrap()
    };
    let (plus, minus) = (shifted(1.0), shifted(-1.0));
    let mut fd = 0.0;
    for (j, v) in v_data.iter().enumerate() {
        if let Some(v) = v {
            let d: Vec<f64> =
                plus[j].to_f64().iter().zip(minus[j].to_f64()).map(|(p, m)| (p - m) / (2.0 * eps)).collect();
            fd += dot(&d, &v.to_f64());
        }
    }
    Some((fd, vjp))
}

fn dot(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// Interprets `trace` with leaves given by name; returns named outputs as f64.
fn run_trace(trace: &Trace, leaves: &HashMap<String, HostTensor>) -> HashMap<String, Vec<f64>> {
    let by_id: HashMap<ValueId, HostTensor> = trace
        .leaves()
        .map(|v| {
            let name = trace.value(v).kind.leaf_name().unwrap();
            (v, leaves[name].clone())
        })
        .collect();
    let vals = interpret(trace, &by_id).unwrap();
    trace
        .outputs
        .iter()
        .filter_map(|o| match &o.kind {
            OutputKind::Named(n) => Some((n.clone(), vals[o.value.index()].to_f64())),
            _ => None,
        })
        .collect()
}

#[test]
fn vjp_with_partial_cotangents() {
    let attn = Sample::new(
        Attention::causal(1.0 / 3f64.sqrt()),
        vec![normal(&[2, 5, 4, 3]), normal(&[2, 5, 2, 3]), normal(&[2, 5, 2, 3])],
    );
    let masked: Vec<(Sample, Vec<Vec<bool>>)> = vec![
        (
            Sample::new(RmsNorm { eps: 1e-5 }, vec![normal(&[2, 3, 8]), normal(&[8])]),
            vec![vec![true, false], vec![false, true]],
        ),
        (
            Sample::new(LayerNorm { eps: 1e-5 }, vec![normal(&[2, 3, 8]), normal(&[8]), normal(&[8])]),
            vec![vec![true, false, false], vec![false, true, false], vec![false, false, true], vec![true, false, true]],
        ),
        (attn, vec![vec![true, false], vec![false, true]]),
    ];
    let mut failures = Vec::new();
    for (c, masks) in &masked {
        let name = c.op.name();
        for mask in masks {
            for seed in SEEDS {
                let (fd, vjp) =
                    check_vjp_masked(c, seed, mask).unwrap_or_else(|| panic!("{name} mask {mask:?}: no cotangents"));
                let rel = (fd - vjp).abs() / fd.abs().max(vjp.abs()).max(1e-3);
                if rel >= 1e-6 || vjp.abs() < 1e-2 {
                    failures.push(format!("{name} mask {mask:?} seed {seed}: fd {fd} vjp {vjp}"));
                }
            }
        }
        let none = vec![false; mask_len(&c.op)];
        assert!(check_vjp_masked(c, 1, &none).is_none(), "{name}: no cotangent must give none");
    }
    assert!(failures.is_empty(), "masked VJP checks failed:\n{}", failures.join("\n"));
}

fn mask_len(op: &Op) -> usize {
    match op {
        Op::LayerNorm(_) => 3,
        _ => 2,
    }
}

// ---------------------------------------------------------------- (b) forward values in f64

fn rms_norm_ref(x: &[f64], w: &[f64], eps: f64) -> (Vec<f64>, Vec<f64>) {
    let c = w.len();
    let (mut y, mut rstd) = (Vec::new(), Vec::new());
    for row in x.chunks(c) {
        let r = 1.0 / (row.iter().map(|v| v * v).sum::<f64>() / c as f64 + eps).sqrt();
        rstd.push(r);
        y.extend(row.iter().zip(w).map(|(v, w)| v * r * w));
    }
    (y, rstd)
}

fn layer_norm_ref(x: &[f64], w: &[f64], b: &[f64], eps: f64) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let c = w.len();
    let (mut y, mut mean, mut rstd) = (Vec::new(), Vec::new(), Vec::new());
    for row in x.chunks(c) {
        let m = row.iter().sum::<f64>() / c as f64;
        let var = row.iter().map(|v| (v - m) * (v - m)).sum::<f64>() / c as f64;
        let r = 1.0 / (var + eps).sqrt();
        mean.push(m);
        rstd.push(r);
        y.extend((0..c).map(|k| (row[k] - m) * r * w[k] + b[k]));
    }
    (y, mean, rstd)
}

/// The formula of the module doc, element by element.
/// Meta's `apply_scaling` of Llama 3.1's reference code, written per band
/// (transformers' `_compute_llama3_parameters` computes the same with masks).
fn llama3_freq_ref(freq: f64, s: &Llama3Scaling) -> f64 {
    let old = s.original_max_position_embeddings as f64;
    let (low_wavelen, high_wavelen) = (old / s.low_freq_factor, old / s.high_freq_factor);
    let wavelen = 2.0 * std::f64::consts::PI / freq;
    if wavelen < high_wavelen {
        freq
    } else if wavelen > low_wavelen {
        freq / s.factor
    } else {
        let smooth = (old / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
        (1.0 - smooth) * freq / s.factor + smooth * freq
    }
}

/// Rope by its definition; `start[b]` (the op's optional second input) is
/// the position of row `b`'s first token, or `start[b·T + t]` that of each
/// token. LongRoPE's factors are the long ones when the largest position
/// reaches the original context, and its attention factor multiplies
/// both rotated parts.
fn rope_ref(x: &[f64], shape: &[usize], o: &Rope, start: Option<&[f64]>) -> Vec<f64> {
    let (n_rot, base, inverse) = (o.n_rot, o.base, o.inverse);
    let (bsz, seq, heads, d) = (shape[0], shape[1], shape[2], shape[3]);
    let per_token = start.is_some_and(|s| s.len() == bsz * seq && seq > 1);
    let position = |b: usize, t: usize| match start {
        Some(s) if per_token => s[b * seq + t],
        Some(s) => s[b] + t as f64,
        None => t as f64,
    };
    let last =
        (0..bsz).flat_map(|b| (0..seq).map(move |t| (b, t))).map(|(b, t)| position(b, t)).fold(f64::MIN, f64::max);
    let (long_factors, amplitude) = match &o.scaling {
        Some(RopeScaling::LongRope(l)) => {
            let long = last + 1.0 > l.original_max_position_embeddings as f64;
            (Some(if long { &l.long_factor } else { &l.short_factor }), l.attention_factor)
        }
        _ => (None, 1.0),
    };
    let freq = |i: usize, plain: f64| match (&o.scaling, long_factors) {
        (_, Some(f)) => 1.0 / (f[i] * base.powf(2.0 * i as f64 / n_rot as f64)),
        (Some(RopeScaling::Llama3(s)), None) => llama3_freq_ref(plain, s),
        _ => plain,
    };
    let mut y = x.to_vec();
    let half = n_rot / 2;
    let sign = if inverse { -1.0 } else { 1.0 };
    for b in 0..bsz {
        for t in 0..seq {
            let pos = position(b, t);
            for h in 0..heads {
                let o = ((b * seq + t) * heads + h) * d;
                if n_rot == 1 {
                    let tt = pos * freq(0, 1.0);
                    y[o] = x[o] * (tt.cos() - tt.sin());
                    continue;
                }
                for i in 0..half {
                    let theta = sign * pos * freq(i, 1.0 / base.powf(2.0 * i as f64 / n_rot as f64));
                    let (a, bb) = (x[o + i], x[o + i + half]);
                    y[o + i] = amplitude * (a * theta.cos() - bb * theta.sin());
                    y[o + i + half] = amplitude * (bb * theta.cos() + a * theta.sin());
                }
            }
        }
    }
    y
}

fn softmax_ref(x: &[f64], n: usize) -> Vec<f64> {
    let mut y = Vec::new();
    for row in x.chunks(n) {
        let m = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let s: f64 = row.iter().map(|v| (v - m).exp()).sum();
        y.extend(row.iter().map(|v| (v - m).exp() / s));
    }
    y
}

/// Attention by the textbook: the full masked `T×T` score matrix per (b, h),
/// softmax, times v, with kv heads repeated as Hugging Face `repeat_kv`.
/// `dk` (q, k) and `dv` (v, o) head sizes may differ. Returns (o, lse).
#[allow(clippy::too_many_arguments)]
fn attention_ref(
    q: &[f64],
    k: &[f64],
    v: &[f64],
    (bsz, seq, hq, hkv): (usize, usize, usize, usize),
    dk: usize,
    dv: usize,
    scale: f64,
    (scores_rule, positions): (Scores, Option<&[f64]>),
) -> (Vec<f64>, Vec<f64>) {
    let mut o = vec![0.0; bsz * seq * hq * dv];
    let mut lse = vec![0.0; bsz * hq * seq];
    for b in 0..bsz {
        // Key j is masked for query i after i, outside the window, or in
        // an earlier document (before i's own start, i − position).
        let visible = |i: usize, j: usize| {
            let in_window = scores_rule.window == 0 || i - j < scores_rule.window;
            let same_doc = positions.is_none_or(|p| j as f64 >= i as f64 - p[b * seq + i]);
            j <= i && in_window && same_doc
        };
        for h in 0..hq {
            let g = h / (hq / hkv);
            let mut scores = vec![vec![f64::NEG_INFINITY; seq]; seq];
            for (i, row) in scores.iter_mut().enumerate() {
                for (j, s) in row.iter_mut().enumerate().take(i + 1) {
                    if !visible(i, j) {
                        continue;
                    }
                    let qi = &q[((b * seq + i) * hq + h) * dk..][..dk];
                    let kj = &k[((b * seq + j) * hkv + g) * dk..][..dk];
                    *s = scale * dot(qi, kj);
                    if scores_rule.softcap > 0.0 {
                        *s = scores_rule.softcap * (*s / scores_rule.softcap).tanh();
                    }
                }
            }
            for (i, row) in scores.iter().enumerate() {
                let m = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let z: f64 = row.iter().map(|s| (s - m).exp()).sum();
                lse[(b * hq + h) * seq + i] = m + z.ln();
                for (j, s) in row.iter().enumerate() {
                    let p = (s - m).exp() / z;
                    for d in 0..dv {
                        o[((b * seq + i) * hq + h) * dv + d] += p * v[((b * seq + j) * hkv + g) * dv + d];
                    }
                }
            }
        }
    }
    (o, lse)
}

/// The naive reference of a forward case's outputs.
fn reference(op: &Op, x: &[HostTensor]) -> Vec<Vec<f64>> {
    let f: Vec<Vec<f64>> = x.iter().map(HostTensor::to_f64).collect();
    let shape = &x[0].ty.shape;
    match op {
        Op::RmsNorm(o) => {
            let (y, r) = rms_norm_ref(&f[0], &f[1], o.eps);
            vec![y, r]
        }
        Op::LayerNorm(o) => {
            let (y, m, r) = layer_norm_ref(&f[0], &f[1], &f[2], o.eps);
            vec![y, m, r]
        }
        Op::Rope(o) => vec![rope_ref(&f[0], shape, o, f.get(1).map(Vec::as_slice))],
        Op::Softmax(_) => vec![softmax_ref(&f[0], *shape.last().unwrap())],
        Op::Attention(o) => {
            let (b, t, hq, d) = (shape[0], shape[1], shape[2], shape[3]);
            let hkv = x[1].ty.shape[2];
            let rule = (o.scores, f.get(3).map(Vec::as_slice));
            let (out, lse) = attention_ref(&f[0], &f[1], &f[2], (b, t, hq, hkv), d, d, o.scale, rule);
            vec![out, lse]
        }
        _ => panic!("no reference for {}", op.name()),
    }
}

#[test]
fn forward_samples_match_naive_references_in_f64() {
    let mut failures = Vec::new();
    let samples = forward_samples();
    assert!(samples.len() > 30, "only {} forward samples", samples.len());
    for (name, s) in samples {
        for seed in SEEDS {
            let x = draw_sample(&s, seed).unwrap();
            let got = run_op(&s.op, &x).unwrap();
            let want = reference(&s.op, &x);
            assert_eq!(got.len(), want.len(), "{name}");
            for (k, (g, w)) in got.iter().zip(&want).enumerate() {
                let e = max_rel_diff(&g.to_f64(), w);
                if e >= 1e-12 {
                    failures.push(format!("{name} seed {seed} output {k}: rel diff {e:.3e}"));
                }
            }
        }
    }
    assert!(failures.is_empty(), "forward mismatches:\n{}", failures.join("\n"));
}

/// The scaled samples exercise every band of the Llama-3.x adjustment:
/// some pairs kept, some divided by the factor, some interpolated.
#[test]
fn rope_llama3_samples_cover_every_band() {
    let mut bands = [false; 3];
    for s in Rope::samples(DType::F64) {
        let Op::Rope(rope) = &s.op else { continue };
        let Some(RopeScaling::Llama3(scaling)) = rope.scaling else { continue };
        for i in 0..(rope.n_rot / 2).max(1) {
            let plain = Rope { scaling: None, ..rope.clone() }.inv_freq(i, 0);
            let scaled = rope.inv_freq(i, 0);
            assert_eq!(scaled, llama3_freq_ref(plain, &scaling), "pair {i} of {rope:?}");
            let band = if scaled == plain {
                0
            } else if scaled == plain / scaling.factor {
                1
            } else {
                2
            };
            bands[band] = true;
        }
    }
    assert_eq!(bands, [true; 3], "kept, divided, interpolated");
}

#[test]
fn rope_inverse_undoes_rope() {
    for (d, n_rot) in [(8, 8), (8, 4), (6, 2)] {
        let x = draw_sample(
            &Sample::new(Rope { n_rot, base: 500.0, inverse: false, scaling: None }, vec![normal(&[2, 7, 3, d])]),
            5,
        )
        .unwrap();
        let y = run_op(&Rope { n_rot, base: 500.0, inverse: false, scaling: None }.into(), &x).unwrap();
        let back = run_op(&Rope { n_rot, base: 500.0, inverse: true, scaling: None }.into(), &y).unwrap();
        let e = max_rel_diff(&back[0].to_f64(), &x[0].to_f64());
        assert!(e < 1e-14, "D={d} n_rot={n_rot}: {e:.3e}");
        assert!(max_rel_diff(&y[0].to_f64(), &x[0].to_f64()) > 1e-3, "rope must move the input");
    }
}

/// The benchmark workload W2 (head size 1, full rotary): Hugging Face and
/// litgpt compute a duplicated rotated dimension `[x(c−s), x(c−s)]`; our
/// single dimension with twice the attention scale must give the same
/// logits and the same attention output.
#[test]
fn rope_head_size_one_matches_hf_duplicated_dimension() {
    let (bsz, seq, hq, hkv) = (2, 6, 4, 2);
    let scale = 0.7;
    let qkv = vec![normal(&[bsz, seq, hq, 1]), normal(&[bsz, seq, hkv, 1]), normal(&[bsz, seq, hkv, 1])];
    let x = draw_sample(&Sample::new(Attention::causal(scale), qkv), 9).unwrap();
    let (q, k, v) = (&x[0], &x[1], &x[2]);
    for inverse in [false, true] {
        let rope: Op = Rope { n_rot: 1, base: 10000.0, inverse, scaling: None }.into();
        let qr = run_op(&rope, std::slice::from_ref(q)).unwrap()[0].to_f64();
        let kr = run_op(&rope, std::slice::from_ref(k)).unwrap()[0].to_f64();

        // Hugging Face: cos/sin of width 2 from the one frequency 1/base^0 = 1,
        // rotate_half of a width-1 vector is −x, broadcast against width 2.
        let hf = |x: &[f64], heads: usize| -> Vec<f64> {
            let mut out = Vec::new();
            for (r, &xv) in x.iter().enumerate() {
                let t = ((r / heads) % seq) as f64;
                let (cos, sin) = ([t.cos(), t.cos()], [t.sin(), t.sin()]);
                out.extend((0..2).map(|d| xv * cos[d] + (-xv) * sin[d]));
            }
            out
        };
        let (qh, kh) = (hf(&q.to_f64(), hq), hf(&k.to_f64(), hkv));
        for b in 0..bsz {
            for h in 0..hq {
                let g = h / (hq / hkv);
                for i in 0..seq {
                    for j in 0..seq {
                        let (qi, kj) = ((b * seq + i) * hq + h, (b * seq + j) * hkv + g);
                        let ours = 2.0 * scale * qr[qi] * kr[kj];
                        let theirs = scale * dot(&qh[2 * qi..2 * qi + 2], &kh[2 * kj..2 * kj + 2]);
                        assert!((ours - theirs).abs() <= 1e-12 * theirs.abs().max(1.0), "{ours} vs {theirs}");
                    }
                }
            }
        }
        let to = |d: &[f64], heads: usize| HostTensor::from_f64(TensorType::new(DType::F64, [bsz, seq, heads, 1]), d);
        let o = run_op(&Attention::causal(2.0 * scale).into(), &[to(&qr, hq), to(&kr, hkv), v.clone()]).unwrap();
        let (o_hf, lse_hf) =
            attention_ref(&qh, &kh, &v.to_f64(), (bsz, seq, hq, hkv), 2, 1, scale, (Scores::default(), None));
        assert!(max_rel_diff(&o[0].to_f64(), &o_hf) < 1e-12);
        assert!(max_rel_diff(&o[1].to_f64(), &lse_hf) < 1e-12);
    }
}

// ---------------------------------------------------------------- forward and backward runs

/// Runs the op and its VJP (cotangent on output 0 only, as in a model) in
/// `dtype` on bf16-representable inputs, so every dtype sees the same
/// values. Returns the forward outputs then the input cotangents.
fn forward_backward(sample: &Sample, dtype: DType, seed: u64) -> Vec<Vec<f64>> {
    let op = &sample.op;
    let base = draw_sample(sample, seed).unwrap();
    let convert = |t: &HostTensor| HostTensor::from_f64(t.ty.with_dtype(dtype), &t.to_f64());
    let x: Vec<HostTensor> = base.iter().map(convert).collect();
    let mut b = Builder::new("fwd_bwd");
    let xs: Vec<ValueId> =
        x.iter().enumerate().map(|(i, t)| b.input(&format!("x{i}"), t.ty.clone()).unwrap()).collect();
    let ys = b.push(op.clone(), &xs).unwrap();
    let vty = b.ty(ys[0]).clone();
    let v = draw_input(&sample::normal(DType::BF16, &vty.shape), seed + 77).unwrap();
    let vid = b.input("v", vty).unwrap();
    let mut cot = vec![None; ys.len()];
    cot[0] = Some(vid);
    b.set_phase(Phase::Backward);
    let gs = op.vjp(&mut b, &VjpArgs { inputs: &xs, outputs: &ys, cotangents: &cot }).unwrap();
    for (j, &y) in ys.iter().enumerate() {
        b.output(OutputKind::Named(format!("y{j}")), y);
    }
    for (i, g) in gs.iter().enumerate() {
        b.output(OutputKind::Named(format!("g{i}")), g.unwrap());
    }
    let trace = b.finish("fwd_bwd").unwrap();
    let mut leaves: HashMap<String, HostTensor> =
        x.into_iter().enumerate().map(|(i, t)| (format!("x{i}"), t)).collect();
    leaves.insert("v".into(), convert(&v));
    let vals = run_trace(&trace, &leaves);
    let mut out: Vec<Vec<f64>> = (0..ys.len()).map(|j| vals[&format!("y{j}")].clone()).collect();
    out.extend((0..gs.len()).map(|i| vals[&format!("g{i}")].clone()));
    out
}

// ---------------------------------------------------------------- determinism

#[test]
fn results_do_not_depend_on_thread_count() {
    let bf = |s: &[usize]| sample::normal(DType::BF16, s);
    let big = [
        Sample::new(RmsNorm { eps: 1e-6 }, vec![bf(&[3, 111, 40]), bf(&[40])]),
        Sample::new(LayerNorm { eps: 1e-6 }, vec![bf(&[3, 111, 40]), bf(&[40]), bf(&[40])]),
        Sample::new(Softmax, vec![bf(&[300, 33])]),
        Sample::new(Rope { n_rot: 12, base: 10000.0, inverse: false, scaling: None }, vec![bf(&[2, 40, 3, 16])]),
        Sample::new(Attention::causal(0.25), vec![bf(&[2, 37, 8, 16]), bf(&[2, 37, 2, 16]), bf(&[2, 37, 2, 16])]),
    ];
    for c in &big {
        let run = |threads: usize| {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            pool.install(|| forward_backward(c, DType::F32, 4))
        };
        let one = run(1);
        for threads in [2, 5] {
            let many = run(threads);
            for (k, (a, b)) in one.iter().zip(&many).enumerate() {
                let same = a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
                assert!(same, "{} result {k} differs between 1 and {threads} threads", c.op.name());
            }
        }
    }
}

// ---------------------------------------------------------------- helpers, printing, lowering

#[test]
fn builder_helpers_print_and_parse_back() {
    let f32t = |s: &[usize]| TensorType::new(DType::F32, s);
    let mut b = Builder::new("nn");
    let x = b.input("x", f32t(&[2, 5, 4, 8])).unwrap();
    let kv = b.input("kv", f32t(&[2, 5, 2, 8])).unwrap();
    let w = b.param("w", f32t(&[8])).unwrap();
    let bias = b.param("bias", f32t(&[8])).unwrap();
    let y1 = b.rms_norm(x, w, 1e-6).unwrap();
    let y2 = b.layer_norm(y1, w, bias, 1e-5).unwrap();
    let y3 = b.rope(y2, 4, 10000.0, None).unwrap();
    let y4 = b.softmax(y3).unwrap();
    let k = b.rope(kv, 4, 10000.0, None).unwrap();
    let o = b.attention(y4, k, kv, 0.125).unwrap();
    for v in [y1, y2, y3, y4, o] {
        assert_eq!(b.ty(v), &f32t(&[2, 5, 4, 8]));
    }
    let n = b.trace().nodes.len();
    let ops: Vec<Op> = b.trace().nodes.iter().map(|nd| nd.op.clone()).collect();
    b.set_phase(Phase::Backward);
    let nodes: Vec<_> = b.trace().nodes.clone();
    let g = b.input("g", f32t(&[2, 5, 4, 8])).unwrap();
    for (node, op) in nodes.iter().zip(&ops) {
        let mut cot = vec![None; node.outputs.len()];
        cot[0] = Some(g);
        let gs = op.vjp(&mut b, &VjpArgs { inputs: &node.inputs, outputs: &node.outputs, cotangents: &cot }).unwrap();
        for gi in gs.into_iter().flatten() {
            b.output(OutputKind::Named(format!("g{}", gi.index())), gi);
        }
    }
    assert!(b.trace().nodes.len() > n);
    b.output(OutputKind::Named("o".into()), o);
    let trace = b.finish("build").unwrap();
    let text = print(&trace, None);
    for needle in [
        "rms_norm",
        "layer_norm",
        "rope",
        "n_rot=4",
        "inverse=true",
        "softmax_backward",
        "attention_backward",
        "scale=0.125",
        "rms_norm_backward",
        "layer_norm_backward",
    ] {
        assert!(text.contains(needle), "printed trace lacks `{needle}`:\n{text}");
    }
    let parsed = parse(&text).unwrap();
    assert_eq!(parsed, trace);
    assert_eq!(print(&parsed, None), text);
}

// ---------------------------------------------------------------- (e) shape-rule errors

#[test]
fn shape_rule_errors_name_the_problem() {
    let t = |dt: DType, s: &[usize]| TensorType::new(dt, s);
    let f = |s: &[usize]| t(DType::F32, s);
    let cases: Vec<(Op, Vec<TensorType>, &[&str])> = vec![
        (
            Attention::causal(1.0).into(),
            vec![f(&[1, 4, 3, 8]), f(&[1, 4, 2, 8]), f(&[1, 4, 2, 8])],
            &["attention", "Hq=3", "Hkv=2"],
        ),
        (
            Attention::causal(1.0).into(),
            vec![f(&[1, 4, 2, 8]), f(&[1, 4, 2, 8]), f(&[1, 4, 2, 4])],
            &["k", "v", "same shape"],
        ),
        (Attention::causal(1.0).into(), vec![f(&[4, 2, 8]), f(&[1, 4, 2, 8]), f(&[1, 4, 2, 8])], &["q", "rank 4"]),
        (
            Attention::causal(1.0).into(),
            vec![f(&[1, 5, 2, 8]), f(&[1, 4, 2, 8]), f(&[1, 4, 2, 8])],
            &["sequence length"],
        ),
        (
            Attention::causal(1.0).into(),
            vec![f(&[1, 4, 2, 8]), t(DType::BF16, &[1, 4, 2, 8]), t(DType::BF16, &[1, 4, 2, 8])],
            &["dtype"],
        ),
        (
            AttentionBackward { scale: 1.0, scores: Default::default(), documents: false }.into(),
            vec![
                f(&[1, 4, 2, 8]),
                f(&[1, 4, 2, 8]),
                f(&[1, 4, 2, 8]),
                f(&[1, 4, 2, 8]),
                f(&[1, 4, 2]),
                f(&[1, 4, 2, 8]),
            ],
            &["lse", "f32[1,2,4]"],
        ),
        (
            Rope { n_rot: 10, base: 1e4, inverse: false, scaling: None }.into(),
            vec![f(&[1, 4, 2, 8])],
            &["rope", "n_rot=10", "D=8"],
        ),
        (
            Rope { n_rot: 3, base: 1e4, inverse: false, scaling: None }.into(),
            vec![f(&[1, 4, 2, 8])],
            &["n_rot=3", "even"],
        ),
        (Rope { n_rot: 2, base: 1e4, inverse: false, scaling: None }.into(), vec![f(&[4, 2, 8])], &["rank 4"]),
        (Rope { n_rot: 2, base: 0.0, inverse: false, scaling: None }.into(), vec![f(&[1, 4, 2, 8])], &["base"]),
        (
            Rope { n_rot: 2, base: 1e4, inverse: false, scaling: None }.into(),
            vec![t(DType::I32, &[1, 4, 2, 8])],
            &["float"],
        ),
        (RmsNorm { eps: 1e-6 }.into(), vec![f(&[2, 8]), f(&[4])], &["rms_norm", "weight", "f32[8]"]),
        (RmsNorm { eps: 1e-6 }.into(), vec![f(&[2, 8]), t(DType::BF16, &[8])], &["weight", "bf16[8]"]),
        (RmsNorm { eps: 1e-6 }.into(), vec![f(&[]), f(&[1])], &["rank >= 1"]),
        (RmsNorm { eps: 1e-6 }.into(), vec![f(&[2, 0]), f(&[0])], &["empty"]),
        (
            RmsNormBackward { eps: 1e-6, addend: false }.into(),
            vec![f(&[2, 8]), f(&[8]), t(DType::F64, &[2]), f(&[2, 8])],
            &["rstd", "f32[2]"],
        ),
        (LayerNorm { eps: 1e-6 }.into(), vec![f(&[2, 8]), f(&[8]), f(&[7])], &["layer_norm", "bias"]),
        (
            LayerNormBackward { eps: 1e-6, addend: false }.into(),
            vec![f(&[2, 8]), f(&[8]), f(&[2]), f(&[2]), f(&[2, 8]), f(&[2])],
            &["expects 5 inputs", "got 6"],
        ),
        (Softmax.into(), vec![f(&[])], &["softmax", "rank >= 1"]),
        (SoftmaxBackward.into(), vec![f(&[3, 7]), f(&[3, 6])], &["softmax_backward", "same type"]),
    ];
    for (op, types, needles) in cases {
        let mut b = Builder::new("errors");
        let ids: Vec<ValueId> =
            types.iter().enumerate().map(|(i, ty)| b.input(&format!("x{i}"), ty.clone()).unwrap()).collect();
        let err = b.push(op.clone(), &ids).expect_err(&format!("{} accepted {types:?}", op.name())).to_string();
        for needle in needles {
            assert!(err.contains(needle), "error for {} lacks `{needle}`: {err}", op.name());
        }
    }
}
