//! 3xTF32 products: each f32 matrix product as three TF32 tensor-core
//! products of split operands, for steps that ask for them
//! ([`F32Products::Split3xTf32`]).

use super::{Pass, PassContext};
use crate::error::Result;
use crate::ir::{Builder, Phase, Trace, ValueId};
use crate::ops::Op;

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

/// [`split_f32_products`] as a pass; the report counts the products split.
/// It moves no node across another, but adds nodes, so it refuses a trace
/// run in segments.
#[derive(Copy, Clone, Debug, Default)]
pub struct SplitF32Products;

impl Pass for SplitF32Products {
    fn name(&self) -> &'static str {
        "split_f32_products"
    }

    fn run(&self, trace: &Trace, cx: &mut PassContext) -> Result<Trace> {
        cx.refuse_segments(self.name())?;
        let (out, split) = split_f32_products(trace)?;
        cx.report.split_products = Some(split);
        Ok(out)
    }
}
