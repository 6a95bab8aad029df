//! FP8 products (`--fp8 products`): every product the model marked
//! ([`MatMul::fp8`]: the decoder layers' linear layers, forward and
//! backward; the output head, the router and attention stay in the model's
//! dtype) becomes a product of two quantized operands
//! ([`crate::ops::fp8`]), where its shape allows one.
//!
//! A marked product `c = op(a)·op(b) (+ r)` qualifies when it is one matrix
//! product after folding rows: `b` two-dimensional, and `a` either
//! `[..., m, k]` (its leading axes folded into rows) or a transposed `[k,
//! m]`; and when `m`, `n` and `k` are multiples of 16 (cuBLASLt's FP8
//! layout). Each operand is quantized with the contracted axis contiguous:
//! `a` as it is, or transposed when stored `[k, m]`; `b` as it is when
//! stored `[n, k]`, transposed when `[k, n]`. So the forward `x·Wᵀ` reads
//! `x` and `W` as they are, the input gradient `g·W` reads `Wᵀ`, and the
//! weight gradient `gᵀ·x` reads both transposed. The formats are the
//! marks': e4m3 for activations and weights, e5m2 for gradients.
//!
//! Work is shared: a value's scale is computed once per format for the
//! whole step (through reshapes, which keep its elements, and the copies
//! recomputation makes, which compute the same bits), so the forward's
//! scale of an activation serves its backward products too; its codes are
//! reused by a later product of the same phase within [`CODES_REUSE_NODES`]
//! nodes (q, k and v read one input; gate and up another; the three weight
//! gradients of q, k and v read one transposed input), further apart they
//! are made again rather than held. A value that a later product within
//! that distance reads in the other layout (a gradient `g`: plain in the
//! input gradient `g·W`, transposed in the weight gradient `gᵀ·x`) is
//! quantized in both layouts by one pass over it.
//!
//! The pass runs after recomputation and offload (their choices see the
//! products as the model has them), and the pipeline checks the planned
//! peak against a memory budget after it: the codes are transient bytes
//! the budget search did not see.

use std::collections::HashMap;

use serde::Serialize;

use super::{Pass, PassContext};
use crate::error::Result;
use crate::ir::{Builder, Phase, Trace, ValueId};
use crate::ops::fp8::{fp8_rows_cols, Fp8Format, MatMulFp8};
use crate::ops::matmul::MatMul;
use crate::ops::Op;

/// Nodes after a value's quantization within which a later product of the
/// same phase reuses its codes.
pub const CODES_REUSE_NODES: usize = 16;

/// The multiple every dimension of an FP8 product must be.
pub const FP8_DIM_MULTIPLE: usize = 16;

/// What the pass did.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Fp8Report {
    /// Marked products that became FP8 products.
    pub products: usize,
    /// Marked products left in the model's dtype: their shapes do not
    /// qualify (see the module doc).
    pub kept: usize,
    /// Quantizations made (each a pass over an operand), those of them
    /// that wrote both layouts at once, and scales.
    pub quantizations: usize,
    pub both_layouts: usize,
    pub scales: usize,
}

/// The operand layout of a qualifying product: its `m` and `n`, and
/// whether each operand is quantized transposed.
#[derive(Clone, Copy)]
struct Layout {
    m: usize,
    n: usize,
    transpose_a: bool,
    transpose_b: bool,
}

/// The layout of `mm` on operands shaped `sa` and `sb`, if it qualifies.
fn layout(mm: &MatMul, sa: &[usize], sb: &[usize]) -> Option<Layout> {
    if sb.len() != 2 || sa.len() < 2 || (mm.trans_a && sa.len() != 2) {
        return None;
    }
    let (m, k) = if mm.trans_a { (sa[1], sa[0]) } else { (sa[..sa.len() - 1].iter().product(), sa[sa.len() - 1]) };
    let (n, kb) = if mm.trans_b { (sb[0], sb[1]) } else { (sb[1], sb[0]) };
    let fits = |d: usize| d > 0 && d.is_multiple_of(FP8_DIM_MULTIPLE);
    (k == kb && fits(m) && fits(n) && fits(k)).then_some(Layout {
        m,
        n,
        transpose_a: mm.trans_a,
        transpose_b: !mm.trans_b,
    })
}

/// Each value's representative among the values that hold the same
/// elements because a later node repeats a forward node (the same op on the
/// same values: recomputation's copies): the forward's value, or the value
/// itself. The kernels are deterministic, so a repeat computes the same bits
/// and shares the forward's scale.
fn forward_twins(trace: &Trace) -> Vec<ValueId> {
    let mut twin: Vec<ValueId> = (0..trace.values.len()).map(|i| ValueId(i as u32)).collect();
    // Forward nodes by their first input's representative.
    let mut forward: HashMap<ValueId, Vec<usize>> = HashMap::new();
    for (n, node) in trace.nodes.iter().enumerate() {
        let Some(&first) = node.inputs.first() else { continue };
        let first = twin[first.index()];
        if node.phase == Phase::Forward {
            forward.entry(first).or_default().push(n);
            continue;
        }
        let repeats = |&&f: &&usize| {
            let earlier = &trace.nodes[f];
            earlier.op == node.op
                && earlier.outputs.len() == node.outputs.len()
                && earlier.inputs.len() == node.inputs.len()
                && earlier.inputs.iter().zip(&node.inputs).all(|(a, b)| twin[a.index()] == twin[b.index()])
        };
        if let Some(&f) = forward.get(&first).and_then(|c| c.iter().find(repeats)) {
            for (o, e) in node.outputs.iter().zip(&trace.nodes[f].outputs) {
                twin[o.index()] = twin[e.index()];
            }
        }
    }
    twin
}

/// The value whose elements `v` holds in the same order: `v` itself, or
/// what a chain of reshapes made it from.
fn reshape_root(trace: &Trace, mut v: ValueId) -> ValueId {
    while let Some(n) = trace.producer(v) {
        match &trace.node(n).op {
            Op::Reshape(_) => v = trace.node(n).inputs[0],
            _ => break,
        }
    }
    v
}

/// One operand a qualifying product quantizes: the original value, its
/// format and layout.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
struct Operand {
    value: ValueId,
    format: Fp8Format,
    transpose: bool,
}

/// A qualifying marked product once rewritten: its layout and the two
/// operands it quantizes.
type Fp8Product = (Layout, [Operand; 2]);

/// Each node's phase, and what it quantizes if it is a qualifying marked
/// product.
fn fp8_products_of(trace: &Trace) -> Vec<(Phase, Option<Fp8Product>)> {
    trace
        .nodes
        .iter()
        .map(|node| {
            let product = match &node.op {
                Op::MatMul(mm) => mm.fp8.and_then(|(fa, fb)| {
                    let (sa, sb) = (&trace.ty(node.inputs[0]).shape, &trace.ty(node.inputs[1]).shape);
                    layout(mm, sa, sb).map(|l| {
                        let a = Operand { value: node.inputs[0], format: fa, transpose: l.transpose_a };
                        (l, [a, Operand { value: node.inputs[1], format: fb, transpose: l.transpose_b }])
                    })
                }),
                _ => None,
            };
            (node.phase, product)
        })
        .collect()
}

/// A later operand (of a node of `phase` within [`CODES_REUSE_NODES`] after
/// node `n`) that reads the elements of `op.value` in the other layout and
/// the same format, so that one pass can write both layouts: the same
/// reshape root and the same `[rows, cols]` view.
fn other_layout_reader(
    trace: &Trace,
    products: &[(Phase, Option<Fp8Product>)],
    n: usize,
    op: Operand,
) -> Option<Operand> {
    let root = reshape_root(trace, op.value);
    let view = fp8_rows_cols(&trace.ty(op.value).shape);
    let phase = products[n].0;
    products[n + 1..products.len().min(n + 1 + CODES_REUSE_NODES)]
        .iter()
        .filter(|(p, _)| *p == phase)
        .flat_map(|(_, product)| product.iter().flat_map(|(_, ops)| ops.iter().copied()))
        .find(|o| {
            o.format == op.format
                && o.transpose != op.transpose
                && reshape_root(trace, o.value) == root
                && fp8_rows_cols(&trace.ty(o.value).shape) == view
        })
}

/// Rewrites every qualifying marked product as an FP8 product (module doc).
pub fn fp8_products(trace: &Trace) -> Result<(Trace, Fp8Report)> {
    let mut b = Builder::new(trace.name.clone());
    let mut map = b.copy_leaves(trace)?;
    let m = |map: &[Option<ValueId>], v: ValueId| map[v.index()].expect("defined before use");
    let mut report = Fp8Report::default();
    let products = fp8_products_of(trace);
    let twins = forward_twins(trace);
    // Scales by (the original value's reshape root's forward twin, format).
    let mut scales: HashMap<(ValueId, Fp8Format), ValueId> = HashMap::new();
    // Codes by original operand: the codes, where made, which phase.
    let mut codes: HashMap<Operand, (ValueId, usize, Phase)> = HashMap::new();
    for (n, node) in trace.nodes.iter().enumerate() {
        b.set_phase(node.phase);
        let inputs: Vec<ValueId> = node.inputs.iter().map(|&v| m(&map, v)).collect();
        let (Op::MatMul(mm), Some((l, [oa, ob]))) = (&node.op, products[n].1) else {
            if matches!(&node.op, Op::MatMul(mm) if mm.fp8.is_some()) {
                report.kept += 1;
            }
            let outs = b.push(node.op.clone(), &inputs)?;
            for (&o, v) in node.outputs.iter().zip(outs) {
                map[o.index()] = Some(v);
            }
            continue;
        };
        let mut operand = |b: &mut Builder, i: usize, op: Operand| -> Result<(ValueId, ValueId)> {
            let x = inputs[i];
            let root = twins[reshape_root(trace, op.value).index()];
            let scale = match scales.get(&(root, op.format)) {
                Some(&s) => s,
                None => {
                    let s = b.fp8_scale(x, op.format)?;
                    report.scales += 1;
                    scales.insert((root, op.format), s);
                    s
                }
            };
            let q = match codes.get(&op) {
                Some(&(q, at, phase)) if phase == node.phase && n - at <= CODES_REUSE_NODES => q,
                _ => {
                    // A folded `[..., m, k]` is quantized as its rows; where a
                    // product soon reads the other layout, both in one pass.
                    let q = match other_layout_reader(trace, &products, n, op) {
                        Some(other) => {
                            let (t, plain) = b.fp8_quantize_both(x, scale, op.format)?;
                            let (q, q_other) = if op.transpose { (t, plain) } else { (plain, t) };
                            codes.insert(other, (q_other, n, node.phase));
                            report.both_layouts += 1;
                            q
                        }
                        None => b.fp8_quantize(x, scale, op.format, op.transpose)?,
                    };
                    report.quantizations += 1;
                    codes.insert(op, (q, n, node.phase));
                    q
                }
            };
            Ok((q, scale))
        };
        let (qa, sa) = operand(&mut b, 0, oa)?;
        let (qb, sb) = operand(&mut b, 1, ob)?;
        let out_ty = trace.ty(node.outputs[0]).clone();
        let mut args = vec![qa, qb, sa, sb];
        if mm.addend {
            let r = inputs[2];
            // A full addend has the output's (possibly batched) shape: as rows.
            let r = if b.shape(r).len() > 2 { b.reshape(r, &[l.m, l.n])? } else { r };
            args.push(r);
        }
        let op = MatMulFp8 { a: oa.format, b: ob.format, out: out_ty.dtype, addend: mm.addend };
        let c = b.push1(op.into(), &args)?;
        let c = if out_ty.shape != [l.m, l.n] { b.reshape(c, &out_ty.shape)? } else { c };
        map[node.outputs[0].index()] = Some(c);
        report.products += 1;
    }
    Ok((b.finish_rewrite(trace, &map, "fp8_products")?, report))
}

/// [`fp8_products`] as a pass; the report says what it did. It adds nodes,
/// so it refuses a trace run in segments.
#[derive(Copy, Clone, Debug, Default)]
pub struct Fp8Products;

impl Pass for Fp8Products {
    fn name(&self) -> &'static str {
        "fp8_products"
    }

    fn run(&self, trace: &Trace, cx: &mut PassContext) -> Result<Trace> {
        cx.refuse_segments(self.name())?;
        let (out, report) = fp8_products(trace)?;
        cx.report.fp8 = Some(report);
        Ok(out)
    }
}
