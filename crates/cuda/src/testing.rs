//! A test harness for kernels (built with the `testing` feature, which this
//! crate's own tests turn on): one op run on the GPU through its lowering,
//! as a one-node step, to compare with the CPU backend.

use stepgraph_core::host::HostTensor;
use stepgraph_core::ir::{Builder, Trace, ValueId};
use stepgraph_core::ops::Op;
use stepgraph_core::plan::{plan, MemoryPlan, PlanOptions};

use crate::error::Result;
use crate::session::{CudaOptions, CudaSession};

fn one_op_trace(op: &Op, inputs: &[HostTensor]) -> Result<(Trace, Vec<ValueId>, Vec<ValueId>)> {
    let mut b = Builder::new("op");
    let ids: Vec<ValueId> = inputs
        .iter()
        .enumerate()
        .map(|(i, t)| b.input(&format!("x{i}"), t.ty.clone()))
        .collect::<std::result::Result<_, _>>()?;
    let outs = b.push(op.clone(), &ids)?;
    for (k, &o) in outs.iter().enumerate() {
        b.output(stepgraph_core::ir::OutputKind::Named(format!("y{k}")), o);
    }
    let trace = b.finish("build")?;
    let ins: Vec<ValueId> = trace.inputs().collect();
    let outs: Vec<ValueId> = trace.outputs.iter().map(|o| o.value).collect();
    Ok((trace, ins, outs))
}

fn run_with_plan(
    trace: Trace,
    plan: MemoryPlan,
    ins: &[ValueId],
    outs: &[ValueId],
    inputs: &[HostTensor],
) -> Result<Vec<HostTensor>> {
    let mut s = CudaSession::new(trace, plan, CudaOptions::from_env()?)?;
    for (v, t) in ins.iter().zip(inputs) {
        // Raw writes: a single op's inputs are not step inputs with index checks.
        s.write_unchecked(*v, t)?;
    }
    s.run_eager()?;
    outs.iter().map(|&o| s.read(o)).collect()
}

/// Runs one op on the GPU through its lowering, every value in its own bytes.
pub fn run_op(op: &Op, inputs: &[HostTensor]) -> Result<Vec<HostTensor>> {
    let (trace, ins, outs) = one_op_trace(op, inputs)?;
    let p = plan(&trace, PlanOptions { reuse: false, ..PlanOptions::default() })?;
    run_with_plan(trace, p, &ins, &outs, inputs)
}

/// Like [`run_op`], with every declared in-place pair of matching types
/// sharing storage (the first pair per output and per input), as a planned
/// step may run it. An op's kernels must give the same bits either way.
pub fn run_op_aliased(op: &Op, inputs: &[HostTensor]) -> Result<Vec<HostTensor>> {
    let (trace, ins, outs) = one_op_trace(op, inputs)?;
    let mut p = plan(&trace, PlanOptions { reuse: false, ..PlanOptions::default() })?;
    let mut taken = vec![false; ins.len()];
    let mut done = vec![false; outs.len()];
    for (o, i) in op.inplace() {
        if !done[o] && !taken[i] && trace.ty(outs[o]) == trace.ty(ins[i]) {
            p.slots[outs[o].index()] = p.slots[ins[i].index()];
            done[o] = true;
            taken[i] = true;
        }
    }
    // The aliased input's bytes are also its output's: read outputs after the run.
    run_with_plan(trace, p, &ins, &outs, inputs)
}
