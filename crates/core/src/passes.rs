//! Trace-to-trace passes. Each is a pure function that returns a new,
//! verified (in debug builds) trace whose header names the pass.

use crate::error::Result;
use crate::ir::{renumber, verify::debug_verify, Builder, NodeId, Phase, Trace, ValueId, ValueKind};
use crate::ops::Op;

/// Dead-code elimination: drops nodes none of whose outputs reach an output
/// or a state update. Leaves are kept (a parameter stays a parameter even if
/// the loss ignores it).
pub fn dce(trace: &Trace) -> Result<Trace> {
    let mut live = vec![false; trace.values.len()];
    for o in &trace.outputs {
        live[o.value.index()] = true;
    }
    for u in &trace.updates {
        live[u.new.index()] = true;
    }
    let mut keep = vec![false; trace.nodes.len()];
    for (ni, node) in trace.nodes.iter().enumerate().rev() {
        if node.outputs.iter().any(|o| live[o.index()]) {
            keep[ni] = true;
            for i in &node.inputs {
                live[i.index()] = true;
            }
        }
    }
    let mut out = compact(trace, &keep);
    out.pass = "dce".into();
    debug_verify(&out)?;
    Ok(out)
}

/// The trace with only the nodes marked in `keep` (and the values they
/// define, plus every leaf), renumbered.
pub fn compact(trace: &Trace, keep: &[bool]) -> Trace {
    let mut node_map = vec![None; trace.nodes.len()];
    let mut nodes = Vec::new();
    for (ni, node) in trace.nodes.iter().enumerate() {
        if keep[ni] {
            node_map[ni] = Some(NodeId(nodes.len() as u32));
            nodes.push(node.clone());
        }
    }
    // Values of dropped nodes are removed by renumbering through a filtered copy.
    let mut t = trace.clone();
    t.nodes = nodes;
    for v in t.values.iter_mut() {
        if let ValueKind::Node(n) = v.kind {
            if let Some(m) = node_map[n.index()] {
                v.kind = ValueKind::Node(m);
            }
        }
    }
    // `renumber` keeps leaves and the outputs of the remaining nodes, so the
    // values of dropped nodes disappear with them.
    t.saved.clear();
    let mut t = renumber(t);
    t.saved = t.derive_saved();
    t
}

/// Slice views: every slice that [`crate::ops::movement::Slice::can_view`]
/// allows (one aligned run of its input), of an input a node produces,
/// becomes a view the planner places on those bytes, so no copy runs; so
/// does a run on a 16-byte boundary that only ops reading inputs at such
/// boundaries read (a narrow view: SwiGLU's `up` part at one row)
/// (generation's q/k/v and gate/up parts of one fused product at one row
/// per sequence). Node order and values are unchanged. Returns the trace
/// and how many slices became views.
pub fn slice_views(trace: &Trace) -> Result<(Trace, usize)> {
    use crate::ops::movement::NARROW_VIEW_ALIGN;
    // Whether only ops that read inputs at any 16-byte boundary read `v`
    // (and the step hands it nowhere).
    let mut narrow_ok = vec![true; trace.values.len()];
    for node in &trace.nodes {
        if !node.op.reads_16_byte_aligned_inputs() {
            for i in &node.inputs {
                narrow_ok[i.index()] = false;
            }
        }
    }
    for o in &trace.outputs {
        narrow_ok[o.value.index()] = false;
    }
    for u in &trace.updates {
        narrow_ok[u.new.index()] = false;
    }
    let mut out = trace.clone();
    let mut marked = 0;
    for node in &mut out.nodes {
        let Op::Slice(s) = &mut node.op else { continue };
        let input = node.inputs[0];
        if s.view || trace.values[input.index()].kind.is_leaf() {
            continue;
        }
        if s.can_view(trace.ty(input)) {
            s.view = true;
            marked += 1;
        } else if narrow_ok[node.outputs[0].index()] && s.can_view_at(trace.ty(input), NARROW_VIEW_ALIGN) {
            (s.view, s.narrow) = (true, true);
            marked += 1;
        }
    }
    out.pass = "slice_views".into();
    debug_verify(&out)?;
    Ok((out, marked))
}

/// How a step computes its f32 matrix products.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum F32Products {
    /// Exact f32 products (on the GPU: CUDA-core SGEMM), as PyTorch's default.
    #[default]
    Exact,
    /// Each f32 product as three TF32 tensor-core products of split operands
    /// ([`split_f32_products`]): about f32 accuracy, several times faster on
    /// a GPU with TF32 tensor cores, with the split operands' bytes planned
    /// for the moments they live.
    #[serde(rename = "3xtf32")]
    Split3xTf32,
}

/// Nodes after a value's split within which a later product of the same
/// phase reuses it (the q, k and v products of one input, a weight read by
/// two products in a row), instead of splitting again; further apart, the
/// parts would be held across the work between.
const SPLIT_REUSE_NODES: usize = 16;

/// 3xTF32 products: every f32 `matmul` `c = op(a)·op(b) (+ r)` becomes
/// `split_tf32` of each operand (`x ≈ x_hi + x_lo`, both TF32 values,
/// [`crate::ops::matmul::SplitTf32`]) and three TF32 products, the small
/// terms first, each adding the last: `p = a_lo·b_hi (+ r)`,
/// `p = a_hi·b_lo + p`, `c = a_hi·b_hi + p`. The dropped `a_lo·b_lo` is
/// about 2^-22 of `|a|·|b|` and the rounding of each `lo` about as small,
/// so `c` is within a few f32 roundings of the exact product: NVIDIA's
/// 3xTF32, as CUTLASS does it (both parts rounded, so a tensor core reads
/// them unchanged). Runs after autodiff (split parts have no VJP). Returns
/// the trace and how many products it split.
pub fn split_f32_products(trace: &Trace) -> Result<(Trace, usize)> {
    use crate::ops::matmul::MatMul;
    let mut b = Builder::new(trace.name.clone());
    let mut map = b.copy_leaves(trace)?;
    let m = |map: &[Option<ValueId>], v: ValueId| map[v.index()].expect("defined before use");
    // Each split value's parts, the node that split it and its phase.
    let mut splits: std::collections::HashMap<ValueId, (ValueId, ValueId, usize, Phase)> = Default::default();
    let mut split_count = 0;
    for (n, node) in trace.nodes.iter().enumerate() {
        b.set_phase(node.phase);
        let inputs: Vec<ValueId> = node.inputs.iter().map(|&v| m(&map, v)).collect();
        let product = match &node.op {
            Op::MatMul(mm) if !mm.tf32 && trace.ty(node.outputs[0]).dtype == crate::ir::DType::F32 => Some(mm.clone()),
            _ => None,
        };
        let Some(mm) = product else {
            let outs = b.push(node.op.clone(), &inputs)?;
            for (&o, v) in node.outputs.iter().zip(outs) {
                map[o.index()] = Some(v);
            }
            continue;
        };
        let mut parts = |b: &mut Builder, x: ValueId| -> Result<(ValueId, ValueId)> {
            match splits.get(&x) {
                Some(&(hi, lo, at, phase)) if phase == node.phase && n - at <= SPLIT_REUSE_NODES => Ok((hi, lo)),
                _ => {
                    let (hi, lo) = b.split_tf32(x)?;
                    splits.insert(x, (hi, lo, n, node.phase));
                    Ok((hi, lo))
                }
            }
        };
        let (a_hi, a_lo) = parts(&mut b, inputs[0])?;
        let (b_hi, b_lo) = parts(&mut b, inputs[1])?;
        let tf32 = |addend| MatMul { addend, tf32: true, ..mm.clone() };
        let mut first = vec![a_lo, b_hi];
        first.extend(inputs.get(2));
        let p = b.push1(tf32(mm.addend).into(), &first)?;
        let p = b.push1(tf32(true).into(), &[a_hi, b_lo, p])?;
        let c = b.push1(tf32(true).into(), &[a_hi, b_hi, p])?;
        map[node.outputs[0].index()] = Some(c);
        split_count += 1;
    }
    Ok((b.finish_rewrite(trace, &map, "split_f32_products")?, split_count))
}
