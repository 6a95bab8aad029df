//! The epilogue pass: an `add` folded into the node that produces one of
//! its operands, when that node's op can add a tensor to its output inside
//! its own kernel ([`crate::ops::OpDef::with_addend`]); and a `mul` by a
//! one-element factor folded into the node that reads its result, when that
//! op can scale the input as it reads it
//! ([`crate::ops::OpDef::with_input_scale`]: gradient clipping's factor
//! into AdamW, which then reads each gradient once instead of three times).
//!
//! A transformer step is full of such adds: the residual add after every
//! attention and MLP output product, the gradient of a value read by two or
//! three products (q, k and v read the same normed input; gate and up
//! another), the residual stream's gradient added to each norm's input
//! gradient, a bias after a linear layer, the sum of gradient-accumulation
//! micro-batches. Each is a kernel that reads two activations and writes a
//! third. Folded, the product adds its addend in its epilogue (cuBLASLt's
//! `beta = 1`, or its bias epilogue), and the norm backward adds it before
//! it stores gx: one launch and a full round trip through memory fewer, and
//! the sum is rounded once instead of twice.
//!
//! **Rules.** `y = add(u, r)` folds into `u`'s producer `p` when `u` has no
//! reader but this add (and is no output of the step), `u` has the add's
//! type (a broadcast operand never becomes the result's storage), `r` is not
//! `u`, and `p`'s op takes `r` as an addend of that output. The folded node
//! writes `y` in place of `u`; both must be in the same phase (a backward
//! add of a forward value would otherwise be made, and held, in forward).
//! It stays where `p` was when `r` exists there already; otherwise it moves
//! down to the add, when no node in between reads another output of `p`,
//! and never across a segment ([`fold_segments`]). Chains fold
//! one link at a time (`add(add(m1, m2), m3)` becomes two products, each
//! adding the previous sum). The result is checked like any pass.
//!
//! `y = mul(x, s)` (or `mul(s, x)`) with `s` of one element and `x` of
//! `y`'s type folds into `y`'s only reader when that reader takes the
//! scale; the folded node stays where it was.
//!
//! **Invariant:** the folded step computes the same values as the unfolded
//! one up to the rounding of the intermediate sum it no longer stores (a
//! folded scale rounds as the `mul` did: the same bits).

use std::collections::BTreeMap;
use std::ops::Range;

use serde::Serialize;

use super::{Pass, PassContext};
use crate::error::Result;
use crate::ir::{renumber, verify::debug_verify, Node, NodeId, Trace, ValueKind};
use crate::ops::{BinaryFn, Op};

/// Whether [`crate::pipeline`] runs the epilogue pass ([`Fold`]).
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Epilogues {
    /// Fold adds into the products and norm backwards that produce them.
    #[default]
    On,
    /// Keep every add a node of its own.
    Off,
}

/// What the pass folded, by the op that absorbed it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct FusionReport {
    /// Adds folded, by the name of the op that absorbed them.
    pub folded: BTreeMap<String, usize>,
    /// Multiplications by a one-element factor folded, by the name of the op that reads them.
    pub scales: BTreeMap<String, usize>,
}

impl FusionReport {
    /// Adds folded in all.
    pub fn total(&self) -> usize {
        self.folded.values().sum()
    }
}

impl std::fmt::Display for FusionReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let list = |m: &BTreeMap<String, usize>| m.iter().map(|(k, n)| format!("{n} into {k}")).collect::<Vec<_>>();
        let (adds, scales) = (list(&self.folded), list(&self.scales));
        write!(f, "epilogues: {} adds folded", self.total())?;
        if !adds.is_empty() {
            write!(f, " ({})", adds.join(", "))?;
        }
        if !scales.is_empty() {
            write!(f, ", {} scales folded ({})", self.scales.values().sum::<usize>(), scales.join(", "))?;
        }
        Ok(())
    }
}

/// The epilogue pass ([`fold`], or [`fold_segments`] over the context's
/// segments, which it keeps current); the report says what it folded.
#[derive(Copy, Clone, Debug, Default)]
pub struct Fold;

impl Pass for Fold {
    fn name(&self) -> &'static str {
        "epilogues"
    }

    fn run(&self, trace: &Trace, cx: &mut PassContext) -> Result<Trace> {
        let (out, report) = match cx.segments.take() {
            Some(segments) => {
                let (out, report, moved) = fold_segments(trace, &segments)?;
                cx.segments = Some(moved);
                (out, report)
            }
            None => fold(trace)?,
        };
        cx.report.fusion = report;
        Ok(out)
    }
}

/// Folds every foldable `add` and scale of `trace` (see the module doc).
pub fn fold(trace: &Trace) -> Result<(Trace, FusionReport)> {
    let all = 0..trace.nodes.len();
    fold_segments(trace, std::slice::from_ref(&all)).map(|(t, report, _)| (t, report))
}

/// [`fold`] for a trace run in segments (node ranges a session runs on
/// their own, as generation's prefill and decode buckets): nothing folds
/// across a segment boundary, and the segments' ranges in the folded trace
/// come back in the same order.
pub fn fold_segments(trace: &Trace, segments: &[Range<usize>]) -> Result<(Trace, FusionReport, Vec<Range<usize>>)> {
    let mut t = trace.clone();
    let n_nodes = t.nodes.len();
    // The segment of each node (None outside every segment).
    let mut segment_of: Vec<Option<usize>> = vec![None; n_nodes];
    for (si, r) in segments.iter().enumerate() {
        for s in &mut segment_of[r.start.min(n_nodes)..r.end.min(n_nodes)] {
            *s = Some(si);
        }
    }
    let mut nodes: Vec<Option<Node>> = t.nodes.drain(..).map(Some).collect();
    // Readers of every value (node inputs, counted with multiplicity) and
    // values the step hands out (outputs, updates), which must stay.
    let mut readers = vec![0usize; t.values.len()];
    for node in nodes.iter().flatten() {
        for i in &node.inputs {
            readers[i.index()] += 1;
        }
    }
    let mut pinned = vec![false; t.values.len()];
    for o in &t.outputs {
        pinned[o.value.index()] = true;
    }
    for u in &t.updates {
        pinned[u.new.index()] = true;
    }
    // Position of the node defining each value (leaves: none).
    let mut def: Vec<Option<usize>> = vec![None; t.values.len()];
    for (pos, node) in nodes.iter().enumerate() {
        for o in &node.as_ref().expect("all nodes present").outputs {
            def[o.index()] = Some(pos);
        }
    }
    let mut report = FusionReport::default();

    for at in 0..n_nodes {
        let Some(add) = nodes[at].as_ref() else { continue };
        if !matches!(&add.op, Op::Binary(b) if b.f == BinaryFn::Add) {
            continue;
        }
        let (y, phase) = (add.outputs[0], add.phase);
        let operands = [add.inputs[0], add.inputs[1]];
        // Prefer the operand produced last: its producer is nearest the add.
        let mut order = [(operands[0], operands[1]), (operands[1], operands[0])];
        if def[operands[0].index()] < def[operands[1].index()] {
            order.swap(0, 1);
        }
        for (u, r) in order {
            let Some(p) = def[u.index()] else { continue };
            let same_segment = segment_of[p] == segment_of[at];
            if u == r || readers[u.index()] != 1 || pinned[u.index()] || t.ty(u) != t.ty(y) || !same_segment {
                continue;
            }
            let producer = nodes[p].as_ref().expect("a defined value's node is present");
            // A backward add of a forward value stays in backward: folded,
            // its sum would be made (and held) in forward.
            if producer.phase != phase {
                continue;
            }
            let Some(slot) = producer.outputs.iter().position(|&o| o == u) else { continue };
            let in_types: Vec<_> = producer.inputs.iter().map(|&v| t.ty(v)).collect();
            let Some((op, addend_at)) = producer.op.with_addend(slot, &in_types, t.ty(r)) else { continue };
            // Where the folded node goes: at the producer when the addend is
            // ready there, else down at the add.
            let ready_at_producer = def[r.index()].is_none_or(|d| d < p);
            let place = if ready_at_producer {
                p
            } else {
                let others_read_between = producer
                    .outputs
                    .iter()
                    .filter(|&&o| o != u)
                    .any(|&o| nodes[p + 1..at].iter().flatten().any(|n| n.inputs.contains(&o)));
                if others_read_between {
                    continue;
                }
                at
            };
            let mut inputs = producer.inputs.clone();
            inputs.insert(addend_at, r);
            let mut outputs = producer.outputs.clone();
            outputs[slot] = y;
            report.folded.entry(op.name().to_string()).and_modify(|n| *n += 1).or_insert(1);
            let folded = Node { op, inputs, outputs, phase: producer.phase };
            for o in &folded.outputs {
                def[o.index()] = Some(place);
            }
            readers[u.index()] = 0;
            nodes[p] = None;
            nodes[at] = None;
            nodes[place] = Some(folded);
            break;
        }
    }

    // Scales: `mul(x, s)` read only by a node that takes the factor.
    for at in 0..n_nodes {
        let Some(reader) = nodes[at].as_ref() else { continue };
        for slot in 0..reader.inputs.len() {
            let y = reader.inputs[slot];
            let Some(p) = def[y.index()] else { continue };
            if readers[y.index()] != 1 || pinned[y.index()] || segment_of[p] != segment_of[at] {
                continue;
            }
            let Some(mul) = nodes[p].as_ref() else { continue };
            if !matches!(&mul.op, Op::Binary(b) if b.f == BinaryFn::Mul) {
                continue;
            }
            let (a, b) = (mul.inputs[0], mul.inputs[1]);
            let (x, s) = if t.ty(b).numel() == 1 && t.ty(a) == t.ty(y) {
                (a, b)
            } else if t.ty(a).numel() == 1 && t.ty(b) == t.ty(y) {
                (b, a)
            } else {
                continue;
            };
            let in_types: Vec<_> = reader.inputs.iter().map(|&v| t.ty(v)).collect();
            let Some((op, scale_at)) = reader.op.with_input_scale(slot, &in_types, t.ty(s)) else { continue };
            let mut inputs = reader.inputs.clone();
            inputs[slot] = x;
            inputs.insert(scale_at, s);
            report.scales.entry(op.name().to_string()).and_modify(|n| *n += 1).or_insert(1);
            let folded = Node { op, inputs, outputs: reader.outputs.clone(), phase: reader.phase };
            readers[y.index()] = 0;
            nodes[p] = None;
            nodes[at] = Some(folded);
            break;
        }
    }

    // Nodes that remain before each old position: where a range starts and ends now.
    let mut kept_before = Vec::with_capacity(n_nodes + 1);
    kept_before.push(0);
    for n in &nodes {
        kept_before.push(kept_before.last().copied().unwrap_or(0) + n.is_some() as usize);
    }
    let ranges = segments.iter().map(|r| kept_before[r.start.min(n_nodes)]..kept_before[r.end.min(n_nodes)]).collect();
    t.nodes = nodes.into_iter().flatten().collect();
    for (ni, node) in t.nodes.iter().enumerate() {
        for o in &node.outputs {
            t.values[o.index()].kind = ValueKind::Node(NodeId(ni as u32));
        }
    }
    // `renumber` keeps leaves and the outputs of the remaining nodes, so the
    // sums the folded nodes no longer write disappear with their adds.
    t.saved.clear();
    let mut t = renumber(t);
    t.saved = t.derive_saved();
    t.pass = "epilogues".into();
    debug_verify(&t)?;
    Ok((t, report, ranges))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::{Builder, DType, OutputKind, TensorType};

    /// `y = add(matmul(x, w), r)` with the product and the add in separate nodes.
    fn product_then_add() -> Trace {
        let mut b = Builder::new("t");
        let ty = TensorType::new(DType::F32, [4, 4]);
        let (x, w, r) =
            (b.param("x", ty.clone()).unwrap(), b.param("w", ty.clone()).unwrap(), b.param("r", ty).unwrap());
        let m = b.matmul(x, w, false, false).unwrap();
        let y = b.add(m, r).unwrap();
        b.output(OutputKind::Named("y".into()), y);
        b.finish("build").unwrap()
    }

    #[test]
    fn nothing_folds_across_a_segment_and_the_ranges_follow_the_nodes() {
        let t = product_then_add();
        let whole = 0..2;
        let (same, report, ranges) = fold_segments(&t, std::slice::from_ref(&whole)).unwrap();
        assert_eq!((report.total(), same.nodes.len(), ranges.len(), ranges[0].clone()), (1, 1, 1, 0..1));
        assert!(matches!(same.nodes[0].op, Op::MatMul(ref m) if m.addend));
        let (split, report, ranges) = fold_segments(&t, &[0..1, 1..2]).unwrap();
        assert_eq!((report.total(), split.nodes.len(), ranges), (0, 2, vec![0..1, 1..2]));
    }

    #[test]
    fn an_output_of_the_step_is_not_folded_away() {
        let mut t = product_then_add();
        // The product's own value handed out too: it must stay.
        let m = t.nodes[0].outputs[0];
        t.outputs.push(crate::ir::Output { kind: OutputKind::Named("m".into()), value: m });
        let (kept, report) = fold(&t).unwrap();
        assert_eq!((report.total(), kept.nodes.len()), (0, 2));
    }
}
