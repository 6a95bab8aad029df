//! The trace verifier, run after every pass in debug builds and on every
//! parsed trace. It checks the invariants listed in the [`crate::ir`] module doc.

use crate::error::{Error, Result};
use crate::ir::{OutputKind, Phase, Trace, ValueKind};

/// Checks every IR invariant of `trace`; the error names the first broken one.
pub fn verify(trace: &Trace) -> Result<()> {
    let fail = |reason: String| Error::Verify { trace: trace.name.clone(), reason };
    let n = trace.values.len();
    if u32::try_from(n).is_err() {
        return Err(fail(format!("{n} values, more than 2^32 ids can number")));
    }
    // Sizes first: the shape rules below multiply dimensions.
    for v in trace.value_ids() {
        trace.ty(v).check_size().map_err(|reason| fail(format!("{v}: {reason}")))?;
    }
    let mut defined = vec![false; n];
    for v in trace.leaves() {
        defined[v.index()] = true;
    }
    let mut last_phase = Phase::Forward;
    for (ni, node) in trace.nodes.iter().enumerate() {
        if node.phase < last_phase {
            return Err(fail(format!(
                "node {ni} ({}) is in phase {} after phase {}",
                node.op.name(),
                node.phase.name(),
                last_phase.name()
            )));
        }
        last_phase = node.phase;
        for &i in &node.inputs {
            if i.index() >= n {
                return Err(fail(format!("node {ni} ({}) reads {i}, which does not exist", node.op.name())));
            }
            if !defined[i.index()] {
                return Err(fail(format!("node {ni} ({}) reads {i} before it is defined", node.op.name())));
            }
        }
        let types: Vec<_> = node.inputs.iter().map(|&i| trace.ty(i)).collect();
        let inferred = node.op.infer(&types).map_err(|e| fail(format!("node {ni} ({}): {e}", node.op.name())))?;
        if inferred.len() != node.outputs.len() {
            return Err(fail(format!(
                "node {ni} ({}) has {} outputs, its op makes {}",
                node.op.name(),
                node.outputs.len(),
                inferred.len()
            )));
        }
        for (&o, t) in node.outputs.iter().zip(&inferred) {
            if o.index() >= n {
                return Err(fail(format!("node {ni} defines {o}, which does not exist")));
            }
            if defined[o.index()] {
                return Err(fail(format!("{o} is defined twice")));
            }
            defined[o.index()] = true;
            if trace.ty(o) != t {
                return Err(fail(format!("{o} has type {}, but `{}` infers {t}", trace.ty(o), node.op.name())));
            }
            if trace.value(o).kind != ValueKind::Node(crate::ir::NodeId(ni as u32)) {
                return Err(fail(format!("{o} does not name node {ni} as its producer")));
            }
        }
    }
    if let Some(v) = trace.value_ids().find(|v| !defined[v.index()]) {
        return Err(fail(format!("{v} is never defined")));
    }
    for o in &trace.outputs {
        if o.value.index() >= n {
            return Err(fail(format!("output {} does not exist", o.value)));
        }
        match o.kind {
            OutputKind::Loss if trace.ty(o.value).numel() != 1 => {
                return Err(fail(format!("loss {} is not a scalar: {}", o.value, trace.ty(o.value))));
            }
            OutputKind::Grad(p) => {
                if !matches!(trace.value(p).kind, ValueKind::Param { .. }) {
                    return Err(fail(format!("gradient {} is for {p}, which is not a parameter", o.value)));
                }
                if trace.ty(p) != trace.ty(o.value) {
                    return Err(fail(format!(
                        "gradient {} has type {}, its parameter {}",
                        o.value,
                        trace.ty(o.value),
                        trace.ty(p)
                    )));
                }
            }
            _ => {}
        }
    }
    for u in &trace.updates {
        let state = trace.value(u.state);
        if let ValueKind::Frozen { name } = &state.kind {
            return Err(fail(format!(
                "update target {} is the frozen weight `{name}`, which nothing may write",
                u.state
            )));
        }
        if !matches!(state.kind, ValueKind::Param { .. } | ValueKind::State { .. }) {
            return Err(fail(format!("update target {} is not a parameter or optimizer state", u.state)));
        }
        if state.ty != *trace.ty(u.new) || trace.value(u.new).kind.is_leaf() {
            return Err(fail(format!("update {} <- {} pairs different types or a leaf", u.state, u.new)));
        }
    }
    if trace.saved != trace.derive_saved() {
        return Err(fail("the saved-for-backward list does not match the values backward reads".into()));
    }
    Ok(())
}

/// Runs [`verify`] in debug builds only: passes call this after they run.
pub fn debug_verify(trace: &Trace) -> Result<()> {
    if cfg!(debug_assertions) {
        verify(trace)
    } else {
        Ok(())
    }
}
