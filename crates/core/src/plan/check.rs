//! The plan checker: an independent proof that a [`MemoryPlan`] is safe.
//!
//! It recomputes lifetimes from the trace (not from the planner's groups),
//! joins each view with its source into a *view class* (which must sit at
//! one offset), and then checks every pair of classes whose bytes overlap:
//! their lifetimes must be disjoint, or meet at exactly one node that
//! declares an in-place pair from the dying class to the new one with the
//! same slot. Persistent values may only share bytes through a state update.

use std::collections::HashMap;

use super::{lifetimes, MemoryPlan, Region};
use crate::error::{Error, Result};
use crate::ir::{Trace, ValueId, ValueKind};

struct Class {
    region: Region,
    offset: u64,
    bytes: u64,
    start: usize,
    end: usize,
    first: ValueId,
}

/// Proves that no two simultaneously live values of `plan` share a byte.
pub fn check_plan(trace: &Trace, plan: &MemoryPlan) -> Result<()> {
    let n = trace.values.len();
    let fail = |m: String| Err(Error::Plan(format!("check_plan: {m}")));
    if plan.slots.len() != n {
        return fail(format!("{} slots for {n} values", plan.slots.len()));
    }
    let life = lifetimes(trace);

    // View classes, from the ops' own declarations.
    let mut class_of: Vec<usize> = (0..n).collect();
    for node in &trace.nodes {
        if let Some(i) = node.op.view_of() {
            let src = class_of[node.inputs[i].index()];
            let out = node.outputs[0].index();
            let old = class_of[out];
            for c in class_of.iter_mut() {
                if *c == old {
                    *c = src;
                }
            }
        }
    }
    let mut classes: HashMap<usize, Class> = HashMap::new();
    for v in 0..n {
        let slot = plan.slots[v];
        let ty = &trace.values[v].ty;
        let limit = match slot.region {
            Region::Persistent => plan.persistent_bytes,
            Region::Arena => plan.arena_bytes,
        };
        if slot.bytes < ty.bytes() || slot.offset + ty.bytes() > limit {
            return fail(format!(
                "{} ({ty}) does not fit its slot {slot:?} in a region of {limit} bytes",
                trace.describe(ValueId(v as u32))
            ));
        }
        let persistent = matches!(trace.values[v].kind, ValueKind::Param { .. } | ValueKind::State { .. });
        if persistent != (slot.region == Region::Persistent) && trace.values[v].kind.is_leaf() {
            return fail(format!("{} is in the wrong region", trace.describe(ValueId(v as u32))));
        }
        let c = classes.entry(class_of[v]).or_insert(Class {
            region: slot.region,
            offset: slot.offset,
            bytes: ty.bytes(),
            start: life[v].0,
            end: life[v].1,
            first: ValueId(v as u32),
        });
        if c.region != slot.region || c.offset != slot.offset {
            return fail(format!(
                "{} is a view of {} but does not share its bytes",
                trace.describe(ValueId(v as u32)),
                trace.describe(c.first)
            ));
        }
        c.bytes = c.bytes.max(ty.bytes());
        c.start = c.start.min(life[v].0);
        c.end = c.end.max(life[v].1);
    }

    // In-place hand-overs the ops declare: (position, dying class, new class).
    let mut handover = std::collections::HashSet::new();
    for (pos, node) in trace.nodes.iter().enumerate() {
        for (o, i) in node.op.inplace() {
            handover.insert((pos, class_of[node.inputs[i].index()], class_of[node.outputs[o].index()]));
        }
    }
    let updates: std::collections::HashSet<(usize, usize)> =
        trace.updates.iter().map(|u| (class_of[u.state.index()], class_of[u.new.index()])).collect();

    let mut list: Vec<(&usize, &Class)> = classes.iter().collect();
    list.sort_by_key(|(k, c)| (c.region as u8, c.offset, **k));
    for a in 0..list.len() {
        let (ka, ca) = list[a];
        for &(kb, cb) in &list[a + 1..] {
            if cb.region != ca.region || cb.offset >= ca.offset + ca.bytes {
                break;
            }
            if cb.bytes == 0 || ca.bytes == 0 {
                continue;
            }
            // Overlapping bytes: order the two by birth.
            let (first, kf, second, ks) =
                if (ca.start, *ka) <= (cb.start, *kb) { (ca, *ka, cb, *kb) } else { (cb, *kb, ca, *ka) };
            let ok = if ca.region == Region::Persistent {
                updates.contains(&(kf, ks)) || updates.contains(&(ks, kf)) || chained_update(&updates, kf, ks)
            } else if first.end < second.start {
                true
            } else {
                first.end == second.start && first.offset == second.offset && handover.contains(&(first.end, kf, ks))
            };
            if !ok {
                return fail(format!(
                    "{} (live {}..={}) and {} (live {}..={}) overlap in {:?} memory at offsets {} and {}",
                    trace.describe(first.first),
                    first.start,
                    first.end,
                    trace.describe(second.first),
                    second.start,
                    second.end,
                    ca.region,
                    first.offset,
                    second.offset
                ));
            }
        }
    }
    Ok(())
}

/// Two classes that are both the new value of one state (never happens) or
/// share a state through an update: allowed only via a direct update edge.
fn chained_update(updates: &std::collections::HashSet<(usize, usize)>, a: usize, b: usize) -> bool {
    updates.iter().any(|&(s, n)| (s == a && n == b) || (s == b && n == a))
}
