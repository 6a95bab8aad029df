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
//!
//! **Which keys a query sees** ([`Scores`], and an optional `positions`
//! input): query row `i` attends to the keys `lo_i..=i` of its row, where
//! `lo_i` is the largest of 0, `i + 1 − window` (a sliding window) and
//! `i − positions[b, i]` (the start of the query's document, when packed
//! documents restart their positions at 0), and at most `i`. So causal,
//! sliding-window and document masks are one rule, no `T×T` mask exists
//! anywhere, and a kernel skips every key tile wholly outside `lo..=i`.
//! `lo_i` never decreases along a row (positions count up by one within a
//! document); the CPU reference refuses positions that break this, since
//! the GPU kernels find a key tile's query rows by it.
//! With `softcap > 0` scores are soft-capped, `s ↦ softcap·tanh(s/softcap)`,
//! after the scale and before the softmax (Gemma 2).

use num_traits::{Float as _, Zero};
use rayon::prelude::*;

use super::norm::stat_dtype;
use super::sample::{fixed, normal, Input, Sample};
use super::{expect_float, no_vjp, Attr, Attrs, OpDef, VjpArgs};
use crate::error::{Error, Result};
use crate::ir::DType;
use crate::ir::{Builder, TensorType, ValueId};
use crate::ops::kernel::{c, Float, KernelIo, SendPtr};
use crate::with_float;

/// `o_i = Σ_{lo_i≤j≤i} softmax_j(cap(scale·q_i·k_j))·v_j` per batch and query
/// head; inputs `(q, k, v[, positions])`, outputs `(o, lse)`. See the module
/// doc for `lo_i` and `cap`.
#[derive(Clone, PartialEq, Debug)]
pub struct Attention {
    pub scale: f64,
    pub scores: Scores,
}

impl Attention {
    /// Plain causal attention with logits `scale·q·k`.
    pub fn causal(scale: f64) -> Self {
        Attention { scale, scores: Scores::default() }
    }
}

/// How scores are formed and which keys are kept, beyond causal
/// `softmax(scale·q·k)`; the default changes nothing. Printed in a trace
/// only where set, so traces of plain attention read as before.
#[derive(Copy, Clone, PartialEq, Debug, Default)]
pub struct Scores {
    /// A sliding window: query `i` sees keys `i + 1 − window..=i`; 0 for
    /// every earlier key.
    pub window: usize,
    /// Logit soft-capping `s ↦ softcap·tanh(s/softcap)`; 0 for none.
    pub softcap: f64,
}

impl Scores {
    pub(crate) fn attrs(&self, into: &mut Vec<(&'static str, Attr)>) {
        if self.window > 0 {
            into.push(("window", Attr::Int(self.window as i64)));
        }
        if self.softcap != 0.0 {
            into.push(("softcap", Attr::Float(self.softcap)));
        }
    }

    pub(crate) fn parse(a: &mut Attrs) -> Result<Self> {
        let window = if a.map.contains_key("window") { a.usize("window")? } else { 0 };
        let softcap = if a.map.contains_key("softcap") { a.float("softcap")? } else { 0.0 };
        let s = Scores { window, softcap };
        s.check().map_err(|e| Error::op(&a.op, e))?;
        Ok(s)
    }

    /// Why these settings cannot be used, if they cannot.
    pub fn check(&self) -> std::result::Result<(), String> {
        if !(self.softcap.is_finite() && self.softcap >= 0.0) {
            return Err(format!("the logit soft-cap must be a positive number or 0 (none), got {}", self.softcap));
        }
        Ok(())
    }

    /// The first key query `i` sees, given its position in its document
    /// (`None`: the row is one document).
    pub fn first_key(&self, i: usize, position: Option<i32>) -> usize {
        let mut lo = if self.window > 0 { (i + 1).saturating_sub(self.window) } else { 0 };
        if let Some(p) = position {
            let doc = i as i64 - p as i64;
            lo = lo.max(doc.clamp(0, i as i64) as usize);
        }
        lo.min(i)
    }

    /// The score of a scaled product `s`: soft-capped when asked.
    pub(crate) fn cap<A: num_traits::Float + num_traits::FromPrimitive>(&self, s: A) -> A {
        if self.softcap > 0.0 {
            let cap: A = c(self.softcap);
            cap * (s / cap).tanh()
        } else {
            s
        }
    }

    /// `∂cap(s)/∂s` at the capped score `capped`.
    fn cap_slope<A: num_traits::Float + num_traits::FromPrimitive>(&self, capped: A) -> A {
        if self.softcap > 0.0 {
            let r = capped / c(self.softcap);
            A::one() - r * r
        } else {
            A::one()
        }
    }
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

/// Checks the optional positions input: `i32[B, T]`.
fn check_positions(p: &TensorType, d: &Dims) -> std::result::Result<(), String> {
    if p.dtype != DType::I32 || p.shape != [d.b, d.t] {
        return Err(format!("positions must be i32[{}, {}] (one per query row), got {p}", d.b, d.t));
    }
    Ok(())
}

/// The first key of every query row (`[B·T]`, see the module doc), or
/// why the positions do not give non-decreasing first keys.
fn first_keys(scores: &Scores, n: &Dims, positions: Option<&[i32]>) -> std::result::Result<Vec<usize>, String> {
    let mut lo = Vec::with_capacity(n.b * n.t);
    for b in 0..n.b {
        for i in 0..n.t {
            let first = scores.first_key(i, positions.map(|p| p[b * n.t + i]));
            if i > 0 && first < lo[b * n.t + i - 1] {
                let p = positions.map_or(0, |p| p[b * n.t + i]);
                return Err(format!(
                    "positions must count up by one within a document and restart at 0: row {b} has position {p} at token {i}, \
                     which would let it see keys that token {} does not",
                    i - 1
                ));
            }
            lo.push(first);
        }
    }
    Ok(lo)
}

fn lse_type(q: &TensorType, d: &Dims) -> TensorType {
    TensorType::new(stat_dtype(q.dtype), [d.b, d.hq, d.t])
}

struct Fwd<'a, T: Float> {
    q: &'a [T],
    k: &'a [T],
    v: &'a [T],
    /// The first key of each query row, `[B·T]`.
    lo: &'a [usize],
    o: SendPtr<T>,
    lse: SendPtr<T::Acc>,
}

/// One task per query row `(b, i, h)`, in the memory order of `o`.
fn attention_fwd<T: Float>(a: Fwd<T>, n: Dims, scale: f64, scores: Scores) {
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
            let lo = a.lo[b * n.t + i];
            let mut m = T::Acc::neg_infinity();
            for (j, sj) in s.iter_mut().enumerate().take(i + 1).skip(lo) {
                let ko = n.row(b, j, g, n.hkv);
                let dot = qa.iter().zip(&a.k[ko..ko + n.d]).fold(zero, |s, (x, y)| s + *x * y.acc());
                *sj = scores.cap(scale * dot);
                m = m.max(*sj);
            }
            acc.fill(zero);
            let mut sum = zero;
            for (j, sj) in s.iter().enumerate().take(i + 1).skip(lo) {
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
            .map(|c| Sample::new(Attention { scale: c.scale, scores: c.scores }, c.inputs(d)).large_over(4000))
            .collect()
    }
    fn name(&self) -> &'static str {
        "attention"
    }
    fn infer(&self, inputs: &[&TensorType]) -> std::result::Result<Vec<TensorType>, String> {
        if inputs.len() != 3 && inputs.len() != 4 {
            return Err(format!("expects 3 inputs (q, k, v) or 4 (.., positions), got {}", inputs.len()));
        }
        let d = check_qkv(inputs[0], inputs[1], inputs[2])?;
        if let Some(p) = inputs.get(3) {
            check_positions(p, &d)?;
        }
        self.scores.check()?;
        Ok(vec![inputs[0].clone(), lse_type(inputs[0], &d)])
    }
    fn vjp(&self, b: &mut Builder, args: &VjpArgs) -> Result<Vec<Option<ValueId>>> {
        let (go, glse) = (args.cotangents[0], args.cotangents[1]);
        let documents = args.inputs.len() == 4;
        let none = vec![None; args.inputs.len()];
        if go.is_none() && glse.is_none() {
            return Ok(none);
        }
        let go = match go {
            Some(g) => g,
            None => {
                let ty = b.ty(args.outputs[0]).clone();
                b.full(0.0, ty)?
            }
        };
        // Positions (step inputs, which get no gradient) come with q, k, v.
        let mut ins = args.inputs.to_vec();
        ins.extend([args.outputs[0], args.outputs[1], go]);
        ins.extend(glse);
        let bwd = AttentionBackward { scale: self.scale, scores: self.scores, documents };
        let g = b.push(bwd.into(), &ins)?;
        let mut grads = none;
        for (slot, g) in grads.iter_mut().zip(&g[..3]) {
            *slot = Some(*g);
        }
        Ok(grads)
    }
    fn cpu(&self, io: &KernelIo) -> Result<()> {
        let n = check_qkv(io.in_ty(0), io.in_ty(1), io.in_ty(2)).map_err(|e| Error::op("attention", e))?;
        let positions = (io.inputs.len() == 4).then(|| io.input::<i32>(3));
        let lo = first_keys(&self.scores, &n, positions).map_err(|e| Error::op("attention", e))?;
        with_float!(io.in_ty(0).dtype, T => {
            let a = Fwd::<T> {
                q: io.input(0),
                k: io.input(1),
                v: io.input(2),
                lo: &lo,
                o: SendPtr(io.output::<T>(0).as_mut_ptr()),
                lse: SendPtr(io.output::<<T as Float>::Acc>(1).as_mut_ptr()),
            };
            attention_fwd(a, n, self.scale, self.scores);
            Ok(())
        })
    }
    fn attrs(&self) -> Vec<(&'static str, Attr)> {
        let mut v = vec![("scale", Attr::Float(self.scale))];
        self.scores.attrs(&mut v);
        v
    }
    fn parse(name: &str, a: &mut Attrs) -> Option<Result<Self>> {
        (name == "attention").then(|| Ok(Attention { scale: a.float("scale")?, scores: Scores::parse(a)? }))
    }
}

/// The backward of [`Attention`]: inputs `(q, k, v[, positions], o, lse,
/// go[, glse])` (positions when `documents`), outputs `(gq, gk, gv, delta)`. Probabilities are recomputed from the saved
/// log-sum-exp: `p_ij = exp(s_ij − lse_i)`, `D_i = go_i·o_i`,
/// `ds_ij = p_ij·(go_i·v_j − D_i)`, `gq_i = scale·Σ_j ds_ij·k_j`,
/// `gk_j = scale·Σ_i ds_ij·q_i`, `gv_j = Σ_i p_ij·go_i`, over the keys
/// `lo_i..=i` each query sees. A cotangent of lse (`∂lse_i/∂s_ij = p_ij`)
/// enters as `D_i − glse_i`. With a soft-cap `s_ij` is the capped score and
/// `ds_ij` is multiplied by its slope `1 − (s_ij/softcap)²`.
///
/// `delta` holds those row terms `D_i − glse_i` (`[B, Hq, T]`, lse's
/// dtype): the GPU computes them once on the query side and hands them to
/// the key side, which would otherwise recompute them for every key block.
/// As an output the buffer is planned like any value (it dies with the
/// node: nothing reads it), and every backend writes it.
#[derive(Clone, PartialEq, Debug)]
pub struct AttentionBackward {
    pub scale: f64,
    pub scores: Scores,
    /// Input 3 is the forward's positions.
    pub documents: bool,
}

impl AttentionBackward {
    /// The index of `o` among the inputs; `lse`, `go` and `glse` follow it.
    pub fn saved(&self) -> usize {
        3 + usize::from(self.documents)
    }
}

struct Bwd<'a, T: Float> {
    q: &'a [T],
    k: &'a [T],
    v: &'a [T],
    o: &'a [T],
    lse: &'a [T::Acc],
    go: &'a [T],
    glse: Option<&'a [T::Acc]>,
    /// The first key of each query row, `[B·T]`.
    lo: &'a [usize],
    gq: SendPtr<T>,
    gk: SendPtr<T>,
    gv: SendPtr<T>,
    delta: SendPtr<T::Acc>,
}

/// One task per `(b, kv head)`: it alone writes that kv head's gk and gv
/// rows and the gq rows of its query heads, accumulating in a fixed order
/// (query head, then query row, then key row) in accumulator buffers that
/// are rounded once at the end.
fn attention_bwd<T: Float>(a: Bwd<T>, n: Dims, scale: f64, scores: Scores) {
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
                for j in a.lo[b * n.t + i]..=i {
                    let ko = n.row(b, j, g, n.hkv);
                    let (kr, vr) = (&a.k[ko..ko + n.d], &a.v[ko..ko + n.d]);
                    let (mut dot, mut dp) = (zero, zero);
                    for dd in 0..n.d {
                        dot = dot + qa[dd] * kr[dd].acc();
                        dp = dp + goa[dd] * vr[dd].acc();
                    }
                    let s = scores.cap(scale * dot);
                    let p = (s - l).exp();
                    let sds = scale * p * (dp - di) * scores.cap_slope(s);
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
            let documents = c.positions.is_some();
            let bwd = AttentionBackward { scale: c.scale, scores: c.scores, documents };
            let s = Sample::new(bwd, c.qkv(d));
            let mut args = vec![s.earlier(0), s.earlier(1), s.earlier(2)];
            let s = match c.positions_input() {
                Some(p) => {
                    let s = s.with(p);
                    args.push(s.earlier(3));
                    s
                }
                None => s,
            };
            let fwd = Attention { scale: c.scale, scores: c.scores };
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
        let at = self.saved();
        if inputs.len() != at + 3 && inputs.len() != at + 4 {
            let pos = if self.documents { ", positions" } else { "" };
            return Err(format!(
                "expects {} inputs (q, k, v{pos}, o, lse, go) or {} (.., glse), got {}",
                at + 3,
                at + 4,
                inputs.len()
            ));
        }
        let (q, k, v) = (inputs[0], inputs[1], inputs[2]);
        let d = check_qkv(q, k, v)?;
        if self.documents {
            check_positions(inputs[3], &d)?;
        }
        self.scores.check()?;
        let lse = lse_type(q, &d);
        for (i, want, what) in [
            (at, q, "o"),
            (at + 1, &lse, "lse"),
            (at + 2, q, "the cotangent of o"),
            (at + 3, &lse, "the cotangent of lse"),
        ] {
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
        let positions = self.documents.then(|| io.input::<i32>(3));
        let lo = first_keys(&self.scores, &n, positions).map_err(|e| Error::op("attention_backward", e))?;
        let at = self.saved();
        with_float!(io.in_ty(0).dtype, T => {
            let a = Bwd::<T> {
                q: io.input(0),
                k: io.input(1),
                v: io.input(2),
                o: io.input(at),
                lse: io.input(at + 1),
                go: io.input(at + 2),
                glse: (io.inputs.len() > at + 3).then(|| io.input(at + 3)),
                lo: &lo,
                gq: SendPtr(io.output::<T>(0).as_mut_ptr()),
                gk: SendPtr(io.output::<T>(1).as_mut_ptr()),
                gv: SendPtr(io.output::<T>(2).as_mut_ptr()),
                delta: SendPtr(io.output::<<T as Float>::Acc>(3).as_mut_ptr()),
            };
            attention_bwd(a, n, self.scale, self.scores);
            Ok(())
        })
    }
    fn attrs(&self) -> Vec<(&'static str, Attr)> {
        let mut v = vec![("scale", Attr::Float(self.scale))];
        self.scores.attrs(&mut v);
        if self.documents {
            v.push(("documents", Attr::Bool(true)));
        }
        v
    }
    fn parse(name: &str, a: &mut Attrs) -> Option<Result<Self>> {
        (name == "attention_backward").then(|| {
            Ok(AttentionBackward {
                scale: a.float("scale")?,
                scores: Scores::parse(a)?,
                documents: a.opt_bool("documents")?.unwrap_or(false),
            })
        })
    }
}

impl Builder {
    /// Causal grouped-query attention of `q: [B, T, Hq, D]` over `k, v: [B, T, Hkv, D]`
    /// with logits `scale·q·k`; returns `o: [B, T, Hq, D]` (lse stays in the trace for backward).
    pub fn attention(&mut self, q: ValueId, k: ValueId, v: ValueId, scale: f64) -> Result<ValueId> {
        Ok(self.push(Attention::causal(scale).into(), &[q, k, v])?[0])
    }

    /// [`Builder::attention`] with `scores`' window and soft-cap, and, with
    /// `positions: i32[B, T]` (each token's position in its document), no
    /// query attending to a key of an earlier document.
    pub fn attention_with(
        &mut self,
        q: ValueId,
        k: ValueId,
        v: ValueId,
        scale: f64,
        scores: Scores,
        positions: Option<ValueId>,
    ) -> Result<ValueId> {
        let mut ins = vec![q, k, v];
        ins.extend(positions);
        Ok(self.push(Attention { scale, scores }.into(), &ins)?[0])
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
    scores: Scores,
    /// The document lengths of every row (they sum to `t`), for a
    /// `positions` input.
    positions: Option<Vec<usize>>,
}

impl AttentionCase {
    fn new(b: usize, t: usize, (hq, hkv): (usize, usize), d: usize) -> Self {
        AttentionCase { b, t, hq, hkv, d, scale: 1.0 / (d as f64).sqrt(), scores: Scores::default(), positions: None }
    }

    fn window(self, window: usize) -> Self {
        AttentionCase { scores: Scores { window, ..self.scores }, ..self }
    }

    fn softcap(self, softcap: f64) -> Self {
        AttentionCase { scores: Scores { softcap, ..self.scores }, ..self }
    }

    /// Rows packed with documents of these lengths (repeated to fill `t`).
    fn documents(self, lengths: &[usize]) -> Self {
        AttentionCase { positions: Some(lengths.to_vec()), ..self }
    }

    fn positions_input(&self) -> Option<Input> {
        let lengths = self.positions.as_ref()?;
        let mut p = Vec::with_capacity(self.b * self.t);
        for row in 0..self.b {
            // Each row starts its cycle of lengths somewhere else.
            let mut docs = lengths.iter().cycle().skip(row);
            let (mut pos, mut len) = (0, *docs.next().unwrap_or(&usize::MAX));
            for _ in 0..self.t {
                if pos == len {
                    (pos, len) = (0, *docs.next().unwrap_or(&usize::MAX));
                }
                p.push(pos as f64);
                pos += 1;
            }
        }
        Some(fixed(DType::I32, &[self.b, self.t], &p))
    }

    fn inputs(&self, dt: DType) -> Vec<Input> {
        let mut v = self.qkv(dt);
        v.extend(self.positions_input());
        v
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
    // Windows, soft-caps and packed documents, alone and together: small
    // ones for the CPU suite, then around every tile size of the kernels
    // (windows and documents shorter and longer than a tile, boundaries on
    // and off tile edges), at head sizes of every kernel family up to 256.
    v.push(AttentionCase::new(2, 7, (4, 2), 8).window(3));
    v.push(AttentionCase::new(2, 7, (4, 2), 8).softcap(0.5));
    v.push(AttentionCase::new(2, 9, (4, 2), 8).documents(&[3, 1, 4]));
    v.push(AttentionCase::new(1, 9, (2, 1), 3).documents(&[5, 2]).window(2).softcap(1.0));
    for d in [4, 16, 64, 100, 128, 256] {
        for t in [65, 200] {
            v.push(AttentionCase::new(2, t, (4, 2), d).window(17));
            v.push(AttentionCase::new(1, t, (4, 2), d).window(64).softcap(2.0));
            v.push(AttentionCase { scale: 1.0, ..AttentionCase::new(1, t, (4, 1), d).softcap(5.0) });
            v.push(AttentionCase::new(2, t, (6, 3), d).documents(&[100, 1, 31, 64, 7]));
            v.push(AttentionCase::new(1, t, (4, 2), d).documents(&[150, 40, 33]).window(50).softcap(30.0));
        }
    }
    v
}
