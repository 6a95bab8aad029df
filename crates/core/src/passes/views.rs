//! Slice views: slices that read one run of their input become views the
//! planner places on the input's bytes, so no copy runs.

use super::{Pass, PassContext};
use crate::error::Result;
use crate::ir::{verify::debug_verify, Trace};
use crate::ops::Op;

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

/// [`slice_views`] as a pass; the report counts the slices that became views.
/// Node order is unchanged, so segments and plans of a trace with the same
/// nodes stand; the plan itself changes (a view owns no bytes).
#[derive(Copy, Clone, Debug, Default)]
pub struct SliceViews;

impl Pass for SliceViews {
    fn name(&self) -> &'static str {
        "slice_views"
    }

    fn run(&self, trace: &Trace, cx: &mut PassContext) -> Result<Trace> {
        let (out, marked) = slice_views(trace)?;
        cx.report.slice_views = Some(marked);
        Ok(out)
    }
}
