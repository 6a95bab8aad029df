//! Causal scaled-dot-product attention with grouped-query heads
//! ([`Attention`]), its flash-attention-style backward
//! ([`AttentionBackward`]) and the [`Builder::attention`] helper.
//!
//! Layout is the one the projections produce, so a model needs no permutes:
//! `q: [B, T, Hq, D]`, `k, v: [B, T, Hkv, D]`, output `o: [B, T, Hq, D]`.
//! Query head `h` reads kv head `h / (Hq/Hkv)` (consecutive groups, as
//! Hugging Face `repeat_kv` and litgpt). Nothing `T×T` is ever materialised:
//! the forward keeps one length-T score row per query row and saves only the
//! per-row log-sum-exp (`lse: [B, Hq, T]`, stat dtype); the backward
//! recomputes the probabilities from it.

use num_traits::{Float as _, Zero};
use rayon::prelude::*;

use super::norm::stat_dtype;
use super::sample::{normal, Input, Sample};
use super::{expect_float, no_vjp, Attr, Attrs, OpDef, VjpArgs};
use crate::error::{Error, Result};
use crate::ir::DType;
use crate::ir::{Builder, TensorType, ValueId};
use crate::ops::kernel::{c, Float, KernelIo, SendPtr};
use crate::with_float;

/// `o_i = Σ_{j≤i} softmax_j(scale·q_i·k_j)·v_j` per batch and query head; outputs `(o, lse)`.
#[derive(Clone, PartialEq, Debug)]
pub struct Attention {
    pub scale: f64,
}

/// Sizes of one attention problem.
#[derive(Copy, Clone, Debug)]
struct Dims {
    b: usize,
    t: usize,
    hq: usize,
    hkv: usize,
    d: usize,
}

impl Dims {
    /// Query heads per kv head.
    fn group(&self) -> usize {
        self.hq / self.hkv
    }
    /// Offset of row `(b, t, head)` in a `[B, T, heads, D]` tensor.
    fn row(&self, b: usize, t: usize, head: usize, heads: usize) -> usize {
        ((b * self.t + t) * heads + head) * self.d
    }
    /// Index of `(b, h, t)` in `lse: [B, Hq, T]`.
    fn stat(&self, b: usize, h: usize, t: usize) -> usize {
        (b * self.hq + h) * self.t + t
    }
}

/// Checks q, k, v and returns their sizes.
fn check_qkv(q: &TensorType, k: &TensorType, v: &TensorType) -> std::result::Result<Dims, String> {
    expect_float(q, "q")?;
    for (x, what) in [(q, "q"), (k, "k"), (v, "v")] {
        if x.rank() != 4 {
            return Err(format!("{what} must be [B, T, heads, D] (rank 4), got {x}"));
        }
    }
    if k.dtype != q.dtype || v.dtype != q.dtype {
        return Err(format!("q, k and v must share a dtype, got {q}, {k}, {v}"));
    }
    if k != v {
        return Err(format!("k {k} and v {v} must have the same shape"));
    }
    let (qs, ks) = (&q.shape, &k.shape);
    if qs[0] != ks[0] || qs[1] != ks[1] || qs[3] != ks[3] {
        return Err(format!("q {q} and k {k} must agree in batch, sequence length and head size"));
    }
    let (hq, hkv) = (qs[2], ks[2]);
    if hkv == 0 || hq % hkv != 0 {
        return Err(format!(
            "query heads Hq={hq} must be a positive multiple of kv heads Hkv={hkv} (grouped-query attention)"
        ));
    }
    Ok(Dims { b: qs[0], t: qs[1], hq, hkv, d: qs[3] })
}

fn lse_type(q: &TensorType, d: &Dims) -> TensorType {
    TensorType::new(stat_dtype(q.dtype), [d.b, d.hq, d.t])
}

struct Fwd<'a, T: Float> {
    q: &'a [T],
    k: &'a [T],
    v: &'a [T],
    o: SendPtr<T>,
    lse: SendPtr<T::Acc>,
}

/// One task per query row `(b, i, h)`, in the memory order of `o`.
fn attention_fwd<T: Float>(a: Fwd<T>, n: Dims, scale: f64) {
    let scale: T::Acc = c(scale);
    let zero = T::Acc::zero();
    let (o, lse) = (a.o, a.lse);
    (0..n.b * n.t * n.hq).into_par_iter().with_min_len(4).for_each_init(
        || (vec![zero; n.t], vec![zero; n.d], vec![zero; n.d]),
        |(s, qa, acc), r| {
            let (h, bi) = (r % n.hq, r / n.hq);
            let (i, b) = (bi % n.t, bi / n.t);
            let g = h / n.group();
            let qo = n.row(b, i, h, n.hq);
            for (x, y) in qa.iter_mut().zip(&a.q[qo..qo + n.d]) {
                *x = y.acc();
            }
            let mut m = T::Acc::neg_infinity();
            for (j, sj) in s[..=i].iter_mut().enumerate() {
                let ko = n.row(b, j, g, n.hkv);
                let dot = qa.iter().zip(&a.k[ko..ko + n.d]).fold(zero, |s, (x, y)| s + *x * y.acc());
                *sj = scale * dot;
                m = m.max(*sj);
            }
            acc.fill(zero);
            let mut sum = zero;
            for (j, sj) in s[..=i].iter().enumerate() {
                let p = (*sj - m).exp();
                sum = sum + p;
                let vo = n.row(b, j, g, n.hkv);
                for (x, y) in acc.iter_mut().zip(&a.v[vo..vo + n.d]) {
                    *x = *x + p * y.acc();
                }
            }
            // SAFETY: row r of o and entry (b, h, i) of lse belong to this task alone.
            unsafe {
                for (dd, x) in acc.iter().enumerate() {
                    o.write(qo + dd, T::from_acc(*x / sum));
                }
                lse.write(n.stat(b, h, i), m + sum.ln());
            }
        },
    );
}

impl OpDef for Attention {
    /// `attention_cases`.
    fn samples(d: DType) -> Vec<Sample> {
        attention_cases()
            .into_iter()
            .map(|c| Sample::new(Attention { scale: c.scale }, c.qkv(d)).large_over(4000))
            .collect()
    }
    fn name(&self) -> &'static str {
        "attention"
    }
    fn infer(&self, inputs: &[&TensorType]) -> std::result::Result<Vec<TensorType>, String> {
        if inputs.len() != 3 {
            return Err(format!("expects 3 inputs (q, k, v), got {}", inputs.len()));
        }
        let d = check_qkv(inputs[0], inputs[1], inputs[2])?;
        Ok(vec![inputs[0].clone(), lse_type(inputs[0], &d)])
    }
    fn vjp(&self, b: &mut Builder, args: &VjpArgs) -> Result<Vec<Option<ValueId>>> {
        let (go, glse) = (args.cotangents[0], args.cotangents[1]);
        if go.is_none() && glse.is_none() {
            return Ok(vec![None, None, None]);
        }
        let go = match go {
            Some(g) => g,
            None => {
                let ty = b.ty(args.outputs[0]).clone();
                b.full(0.0, ty)?
            }
        };
        let mut ins = args.inputs.to_vec();
        ins.extend([args.outputs[0], args.outputs[1], go]);
        ins.extend(glse);
        let g = b.push(AttentionBackward { scale: self.scale }.into(), &ins)?;
        Ok(vec![Some(g[0]), Some(g[1]), Some(g[2])])
    }
    fn cpu(&self, io: &KernelIo) -> Result<()> {
        let n = check_qkv(io.in_ty(0), io.in_ty(1), io.in_ty(2)).map_err(|e| Error::op("attention", e))?;
        with_float!(io.in_ty(0).dtype, T => {
            let a = Fwd::<T> {
                q: io.input(0),
                k: io.input(1),
                v: io.input(2),
                o: SendPtr(io.output::<T>(0).as_mut_ptr()),
                lse: SendPtr(io.output::<<T as Float>::Acc>(1).as_mut_ptr()),
            };
            attention_fwd(a, n, self.scale);
            Ok(())
        })
    }
    fn attrs(&self) -> Vec<(&'static str, Attr)> {
        vec![("scale", Attr::Float(self.scale))]
    }
    fn parse(name: &str, a: &mut Attrs) -> Option<Result<Self>> {
        (name == "attention").then(|| Ok(Attention { scale: a.float("scale")? }))
    }
}

/// The backward of [`Attention`]: inputs `(q, k, v, o, lse, go[, glse])`,
/// outputs `(gq, gk, gv, delta)`. Probabilities are recomputed from the saved
/// log-sum-exp: `p_ij = exp(s_ij − lse_i)`, `D_i = go_i·o_i`,
/// `ds_ij = p_ij·(go_i·v_j − D_i)`, `gq_i = scale·Σ_j ds_ij·k_j`,
/// `gk_j = scale·Σ_i ds_ij·q_i`, `gv_j = Σ_i p_ij·go_i`. A cotangent of lse
/// (`∂lse_i/∂s_ij = p_ij`) enters as `D_i − glse_i`.
///
/// `delta` holds those row terms `D_i − glse_i` (`[B, Hq, T]`, lse's
/// dtype): the GPU computes them once on the query side and hands them to
/// the key side, which would otherwise recompute them for every key block.
/// As an output the buffer is planned like any value (it dies with the
/// node: nothing reads it), and every backend writes it.
#[derive(Clone, PartialEq, Debug)]
pub struct AttentionBackward {
    pub scale: f64,
}

struct Bwd<'a, T: Float> {
    q: &'a [T],
    k: &'a [T],
    v: &'a [T],
    o: &'a [T],
    lse: &'a [T::Acc],
    go: &'a [T],
    glse: Option<&'a [T::Acc]>,
    gq: SendPtr<T>,
    gk: SendPtr<T>,
    gv: SendPtr<T>,
    delta: SendPtr<T::Acc>,
}

/// One task per `(b, kv head)`: it alone writes that kv head's gk and gv
/// rows and the gq rows of its query heads, accumulating in a fixed order
/// (query head, then query row, then key row) in accumulator buffers that
/// are rounded once at the end.
fn attention_bwd<T: Float>(a: Bwd<T>, n: Dims, scale: f64) {
    let scale: T::Acc = c(scale);
    let zero = T::Acc::zero();
    let a = &a;
    (0..n.b * n.hkv).into_par_iter().for_each(|task| {
        let (b, g) = (task / n.hkv, task % n.hkv);
        let mut gk = vec![zero; n.t * n.d];
        let mut gv = vec![zero; n.t * n.d];
        let (mut qa, mut goa, mut gq) = (vec![zero; n.d], vec![zero; n.d], vec![zero; n.d]);
        for h in g * n.group()..(g + 1) * n.group() {
            for i in 0..n.t {
                let qo = n.row(b, i, h, n.hq);
                let mut di = zero;
                for dd in 0..n.d {
                    qa[dd] = a.q[qo + dd].acc();
                    goa[dd] = a.go[qo + dd].acc();
                    di = di + goa[dd] * a.o[qo + dd].acc();
                }
                let st = n.stat(b, h, i);
                if let Some(gl) = a.glse {
                    di = di - gl[st];
                }
                // SAFETY: query head h belongs to this task's group only.
                unsafe { a.delta.write(st, di) };
                let l = a.lse[st];
                gq.fill(zero);
                for j in 0..=i {
                    let ko = n.row(b, j, g, n.hkv);
                    let (kr, vr) = (&a.k[ko..ko + n.d], &a.v[ko..ko + n.d]);
                    let (mut dot, mut dp) = (zero, zero);
                    for dd in 0..n.d {
                        dot = dot + qa[dd] * kr[dd].acc();
                        dp = dp + goa[dd] * vr[dd].acc();
                    }
                    let p = (scale * dot - l).exp();
                    let sds = scale * p * (dp - di);
                    let (gkj, gvj) = (&mut gk[j * n.d..(j + 1) * n.d], &mut gv[j * n.d..(j + 1) * n.d]);
                    for dd in 0..n.d {
                        gvj[dd] = gvj[dd] + p * goa[dd];
                        gq[dd] = gq[dd] + sds * kr[dd].acc();
                        gkj[dd] = gkj[dd] + sds * qa[dd];
                    }
                }
                for (dd, x) in gq.iter().enumerate() {
                    // SAFETY: query head h belongs to this task's group only.
                    unsafe { a.gq.write(qo + dd, T::from_acc(*x)) };
                }
            }
        }
        for j in 0..n.t {
            let ko = n.row(b, j, g, n.hkv);
            for dd in 0..n.d {
                // SAFETY: kv head g of batch b belongs to this task only.
                unsafe {
                    a.gk.write(ko + dd, T::from_acc(gk[j * n.d + dd]));
                    a.gv.write(ko + dd, T::from_acc(gv[j * n.d + dd]));
                }
            }
        }
    });
}

impl OpDef for AttentionBackward {
    /// `attention_cases` without and with the lse cotangent, o and lse
    /// from the forward.
    fn samples(d: DType) -> Vec<Sample> {
        let mut v = Vec::new();
        for c in attention_cases() {
            let s = Sample::new(AttentionBackward { scale: c.scale }, c.qkv(d));
            let args = vec![s.earlier(0), s.earlier(1), s.earlier(2)];
            let fwd = Attention { scale: c.scale };
            let s = s.with_output(fwd.clone(), args.clone(), 0).with_output(fwd, args, 1);
            let s = s.with(normal(d, &[c.b, c.t, c.hq, c.d])).large_over(4000);
            v.push(s.clone());
            v.push(s.with(normal(stat_dtype(d), &[c.b, c.hq, c.t])));
        }
        v
    }
    fn name(&self) -> &'static str {
        "attention_backward"
    }
    fn infer(&self, inputs: &[&TensorType]) -> std::result::Result<Vec<TensorType>, String> {
        if inputs.len() != 6 && inputs.len() != 7 {
            return Err(format!("expects 6 inputs (q, k, v, o, lse, go) or 7 (.., glse), got {}", inputs.len()));
        }
        let (q, k, v) = (inputs[0], inputs[1], inputs[2]);
        let d = check_qkv(q, k, v)?;
        let lse = lse_type(q, &d);
        for (i, want, what) in
            [(3, q, "o"), (4, &lse, "lse"), (5, q, "the cotangent of o"), (6, &lse, "the cotangent of lse")]
        {
            match inputs.get(i) {
                Some(got) if *got != want => return Err(format!("{what} must be {want}, got {got}")),
                _ => {}
            }
        }
        Ok(vec![q.clone(), k.clone(), v.clone(), lse])
    }
    fn vjp(&self, _b: &mut Builder, _args: &VjpArgs) -> Result<Vec<Option<ValueId>>> {
        no_vjp(self.name())
    }
    fn cpu(&self, io: &KernelIo) -> Result<()> {
        let n = check_qkv(io.in_ty(0), io.in_ty(1), io.in_ty(2)).map_err(|e| Error::op("attention_backward", e))?;
        with_float!(io.in_ty(0).dtype, T => {
            let a = Bwd::<T> {
                q: io.input(0),
                k: io.input(1),
                v: io.input(2),
                o: io.input(3),
                lse: io.input(4),
                go: io.input(5),
                glse: (io.inputs.len() > 6).then(|| io.input(6)),
                gq: SendPtr(io.output::<T>(0).as_mut_ptr()),
                gk: SendPtr(io.output::<T>(1).as_mut_ptr()),
                gv: SendPtr(io.output::<T>(2).as_mut_ptr()),
                delta: SendPtr(io.output::<<T as Float>::Acc>(3).as_mut_ptr()),
            };
            attention_bwd(a, n, self.scale);
            Ok(())
        })
    }
    fn attrs(&self) -> Vec<(&'static str, Attr)> {
        vec![("scale", Attr::Float(self.scale))]
    }
    fn parse(name: &str, a: &mut Attrs) -> Option<Result<Self>> {
        (name == "attention_backward").then(|| Ok(AttentionBackward { scale: a.float("scale")? }))
    }
}

impl Builder {
    /// Causal grouped-query attention of `q: [B, T, Hq, D]` over `k, v: [B, T, Hkv, D]`
    /// with logits `scale·q·k`; returns `o: [B, T, Hq, D]` (lse stays in the trace for backward).
    pub fn attention(&mut self, q: ValueId, k: ValueId, v: ValueId, scale: f64) -> Result<ValueId> {
        Ok(self.push(Attention { scale }.into(), &[q, k, v])?[0])
    }
}

/// One attention problem of the samples: `q [b, t, hq, d]`, `k` and `v
/// [b, t, hkv, d]`.
struct AttentionCase {
    b: usize,
    t: usize,
    hq: usize,
    hkv: usize,
    d: usize,
    scale: f64,
}

impl AttentionCase {
    fn new(b: usize, t: usize, (hq, hkv): (usize, usize), d: usize) -> Self {
        AttentionCase { b, t, hq, hkv, d, scale: 1.0 / (d as f64).sqrt() }
    }

    fn qkv(&self, dt: DType) -> Vec<Input> {
        let (b, t, hq, hkv, d) = (self.b, self.t, self.hq, self.hkv, self.d);
        vec![normal(dt, &[b, t, hq, d]), normal(dt, &[b, t, hkv, d]), normal(dt, &[b, t, hkv, d])]
    }
}

/// The attention problems: MHA, GQA (2:1, 7:1) and MQA on every head-size
/// bucket of the GPU kernels, sequence lengths around their tiles, batch 1
/// and 2; head sizes between the buckets with sequence lengths around
/// every tile size (16, 32, 64, 128 rows); the tensor-core widths (17 to
/// 128); logits of unit scale (not 1/√D), which move the running max often
/// and far. The small ones are the CPU suite's.
fn attention_cases() -> Vec<AttentionCase> {
    let mut v = Vec::new();
    for (hq, hkv, d) in [(4, 4, 8), (4, 2, 3), (4, 1, 16), (28, 4, 1)] {
        v.push(AttentionCase::new(2, 5, (hq, hkv), d));
    }
    for d in [1, 3, 16, 64, 100, 128, 256] {
        for heads in [(4, 4), (4, 2), (8, 1), (28, 4)] {
            for t in [1, 5, 64, 65, 257] {
                for b in [1, 2] {
                    v.push(AttentionCase::new(b, t, heads, d));
                }
            }
        }
    }
    for d in [2, 5, 15, 17, 31, 33, 63, 65, 127, 129, 200, 255] {
        for t in [2, 16, 17, 31, 33, 127, 129, 130] {
            v.push(AttentionCase::new(1, t, (6, 3), d));
        }
    }
    for d in [17, 32, 40, 64, 80, 96, 100, 112, 128] {
        for (heads, t, b) in [((4, 4), 1, 1), ((4, 2), 31, 2), ((8, 2), 64, 1), ((4, 1), 65, 1), ((6, 3), 200, 2)] {
            v.push(AttentionCase::new(b, t, heads, d));
        }
        v.push(AttentionCase { scale: 1.0, ..AttentionCase::new(1, 130, (4, 2), d) });
    }
    for d in [1, 4, 16, 64, 128] {
        v.push(AttentionCase { scale: 1.0, ..AttentionCase::new(2, 200, (4, 2), d) });
    }
    v
}
