//! Dead-code elimination and the compaction it and other rewrites use to
//! drop nodes from a trace.

use crate::error::Result;
use crate::ir::{renumber, verify::debug_verify, NodeId, Trace, ValueKind};

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
