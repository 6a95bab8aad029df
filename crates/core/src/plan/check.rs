//! The plan checker: an independent proof that a [`MemoryPlan`] is safe.
//!
//! It recomputes lifetimes from the trace (not from the planner's groups),
//! joins each view with its source into a *view class* (whose values sit at
//! one offset, or for a slice view at its offset inside its source), and
//! then checks every pair of classes whose bytes overlap:
//! their lifetimes must be disjoint, or meet at exactly one node that
//! declares an in-place pair from the dying class to the new one with the
//! same slot. Persistent values may only share bytes through a state update
//! (the state and its new value, or two links of the in-place chain the new
//! value comes from, handed over like arena values).
//! Every slot lies inside its region, arena offsets are multiples of
//! [`ARENA_ALIGN`] and persistent ones of their element size.
//!
//! Arena classes are checked by one sweep over the schedule: classes in
//! order of birth, each against the classes still alive, which are kept by
//! offset. **Invariant of the sweep:** live classes that share a byte sit at
//! the same offset (a declared hand-over), so the live classes overlapping
//! a new one are those starting inside it plus those at the one highest
//! offset below it, and a check costs what it finds, not what is live.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, HashSet};

use super::{lifetimes, update_chains, MemoryPlan, Region, UnionFind, ARENA_ALIGN};
use crate::error::{Error, Result};
use crate::ir::{Trace, ValueId, ValueKind};

#[derive(Copy, Clone)]
struct Class {
    key: usize,
    region: Region,
    offset: u64,
    bytes: u64,
    start: usize,
    end: usize,
    first: ValueId,
}

impl Class {
    /// One past its last byte; within its region, so it cannot overflow.
    fn end_byte(&self) -> u64 {
        self.offset + self.bytes
    }
}

/// Proves that no two simultaneously live values of `plan` share a byte.
pub fn check_plan(trace: &Trace, plan: &MemoryPlan) -> Result<()> {
    let n = trace.values.len();
    let fail = |m: String| Err(Error::Plan(format!("check_plan: {m}")));
    if plan.slots.len() != n {
        return fail(format!("{} slots for {n} values", plan.slots.len()));
    }
    let life = lifetimes(trace);
    let host_state = super::host_states(trace);

    // View classes, from the ops' own declarations.
    let mut views = UnionFind::new(n);
    for node in &trace.nodes {
        if let Some(i) = node.op.view_of() {
            let at = node.op.view_offset(trace.ty(node.inputs[i]));
            views.union_at(node.inputs[i].index(), node.outputs[0].index(), at);
        }
    }
    let class_of: Vec<usize> = (0..n).map(|v| views.find(v)).collect();
    let within: Vec<u64> = (0..n).map(|v| views.offset_of(v)).collect();
    // Narrow slice views, which start on their own (16-byte) boundary.
    let narrow: std::collections::HashMap<usize, u64> = (trace.nodes.iter())
        .filter_map(|node| match &node.op {
            crate::ops::Op::Slice(s) if s.view && s.narrow => Some((node.outputs[0].index(), s.view_align())),
            _ => None,
        })
        .collect();
    let mut classes: Vec<Option<Class>> = (0..n).map(|_| None).collect();
    for v in 0..n {
        let slot = plan.slots[v];
        let ty = &trace.values[v].ty;
        let limit = match slot.region {
            Region::Persistent => plan.persistent_bytes,
            Region::Arena => plan.arena_bytes,
            Region::Host => plan.host_bytes,
        };
        let fits = slot.offset.checked_add(ty.bytes()).is_some_and(|end| end <= limit);
        if slot.bytes < ty.bytes() || !fits {
            return fail(format!(
                "{} ({ty}) does not fit its slot {slot:?} in a region of {limit} bytes",
                trace.describe(ValueId(v as u32))
            ));
        }
        // Kernels and libraries read arena tensors at 256-byte boundaries
        // (narrow slice views at theirs, for the ops that allow it) and
        // persistent ones at least at their element's.
        let align = match slot.region {
            Region::Arena => narrow.get(&v).copied().unwrap_or(ARENA_ALIGN),
            Region::Persistent | Region::Host => ty.dtype.size() as u64,
        };
        if !slot.offset.is_multiple_of(align.max(1)) {
            return fail(format!(
                "{} ({ty}) sits at {:?} offset {}, which is not aligned to {align} bytes",
                trace.describe(ValueId(v as u32)),
                slot.region,
                slot.offset
            ));
        }
        let persistent = matches!(
            trace.values[v].kind,
            ValueKind::Param { .. } | ValueKind::Frozen { .. } | ValueKind::State { .. }
        );
        // Only frozen tables (`PlanOptions::host_tables`) and copies to the
        // host (the offload pass's `to_host`) may live on the host.
        let region_ok = match slot.region {
            Region::Persistent => persistent,
            Region::Arena => !persistent,
            Region::Host => {
                matches!(trace.values[v].kind, ValueKind::Frozen { .. })
                    || (trace.values[v].kind.is_leaf() && host_state[v])
                    || trace.producer(ValueId(v as u32)).is_some_and(|p| trace.node(p).op.output_on_host())
            }
        };
        if !region_ok && (trace.values[v].kind.is_leaf() || slot.region == Region::Host) {
            return fail(format!("{} is in the wrong region", trace.describe(ValueId(v as u32))));
        }
        // The class's first byte, as this value's slot places it (a slice
        // view starts `within[v]` bytes into its class).
        let key = class_of[v];
        let Some(base) = slot.offset.checked_sub(within[v]) else {
            return fail(format!(
                "{} starts {} bytes into its view class but sits at offset {}",
                trace.describe(ValueId(v as u32)),
                within[v],
                slot.offset
            ));
        };
        let c = classes[key].get_or_insert(Class {
            key,
            region: slot.region,
            offset: base,
            bytes: 0,
            start: life[v].0,
            end: life[v].1,
            first: ValueId(v as u32),
        });
        if c.region != slot.region || c.offset != base {
            return fail(format!(
                "{} is a view of {} but does not sit at its place in their shared bytes",
                trace.describe(ValueId(v as u32)),
                trace.describe(c.first)
            ));
        }
        c.bytes = c.bytes.max(within[v] + ty.bytes());
        c.start = c.start.min(life[v].0);
        c.end = c.end.max(life[v].1);
    }

    // In-place hand-overs the ops declare: (position, dying class, new
    // class), from an input at its class's start (not a slice view inside
    // it: the sweep below relies on classes that share bytes sitting at one
    // offset, and the planner hands over only such inputs).
    let mut handover = HashSet::new();
    for (pos, node) in trace.nodes.iter().enumerate() {
        for (o, i) in node.op.inplace() {
            let (i, o) = (node.inputs[i].index(), node.outputs[o].index());
            if within[i] == 0 && within[o] == 0 {
                handover.insert((pos, class_of[i], class_of[o]));
            }
        }
    }
    let updates: HashSet<(usize, usize)> =
        trace.updates.iter().map(|u| (class_of[u.state.index()], class_of[u.new.index()])).collect();

    // A class without bytes overlaps nothing.
    let in_region =
        |r: Region| -> Vec<&Class> { classes.iter().flatten().filter(|c| c.bytes > 0 && c.region == r).collect() };
    let mut arena = in_region(Region::Arena);

    // Each state's update chain (the in-place writes its new value comes
    // from), by class: the state's own class and every link's.
    let mut chain_of = std::collections::HashMap::new();
    for (v, state) in update_chains(trace) {
        chain_of.insert(class_of[v.index()], class_of[state.index()]);
        chain_of.insert(class_of[state.index()], class_of[state.index()]);
    }

    // Persistent values live across steps, so any shared byte must be a
    // state and its update, or two links of one state's update chain that
    // hand over in place (a cache written by several steps of one trace).
    // Sorted by offset, each class meets only the classes that start inside it.
    {
        let mut persistent = in_region(Region::Persistent);
        persistent.sort_by_key(|c| (c.offset, c.key));
        for (a, ca) in persistent.iter().enumerate() {
            for cb in persistent[a + 1..].iter().take_while(|cb| cb.offset < ca.end_byte()) {
                let (first, second) = by_birth(ca, cb);
                if updates.contains(&(first.key, second.key)) || updates.contains(&(second.key, first.key)) {
                    continue;
                }
                let one_chain = chain_of.get(&first.key).is_some_and(|s| chain_of.get(&second.key) == Some(s));
                let handed_over = first.end < second.start
                    || (first.end == second.start
                        && first.offset == second.offset
                        && handover.contains(&(first.end, first.key, second.key)));
                if !(one_chain && handed_over) {
                    return fail(overlap(trace, first, second));
                }
            }
        }
    }

    sweep(trace, &mut arena, &handover)?;
    // The host region: its tables live the whole step; offloaded values
    // between their copy out and their last reader, as arena values do;
    // a state from the step's start to the copy that writes its new value
    // over it (an in-place hand-over), and that value to the step's end.
    let steps = trace.nodes.len();
    let host: Vec<Class> = in_region(Region::Host)
        .into_iter()
        .map(|c| match trace.values[c.first.index()].kind {
            ValueKind::Frozen { .. } => Class { start: 0, end: steps, ..*c },
            _ => *c,
        })
        .collect();
    sweep(trace, &mut host.iter().collect(), &handover)
}

/// Checks that no two of `classes` alive together share a byte, unless one
/// hands its bytes over to the other in place at the node where it dies.
/// A sweep in order of birth (ties by class), so every pair alive together
/// is checked once, when the later-born one arrives.
fn sweep(trace: &Trace, arena: &mut Vec<&Class>, handover: &HashSet<(usize, usize, usize)>) -> Result<()> {
    arena.sort_by_key(|c| (c.start, c.key));
    let mut live: BTreeMap<(u64, usize), &Class> = BTreeMap::new();
    let mut dying: BinaryHeap<Reverse<(usize, u64, usize)>> = BinaryHeap::new();
    for &new in arena.iter() {
        while let Some(&Reverse((end, offset, key))) = dying.peek() {
            if end >= new.start {
                break;
            }
            dying.pop();
            live.remove(&(offset, key));
        }
        // Live classes starting below the new one's last byte, highest first:
        // all that start at or above its offset overlap it; of those below,
        // only the ones at the highest such offset can reach it.
        let mut below: Option<u64> = None;
        for (&(offset, _), &old) in live.range(..(new.end_byte(), 0)).rev() {
            if offset < new.offset {
                if below.is_some_and(|b| b != offset) {
                    break;
                }
                below = Some(offset);
                if old.end_byte() <= new.offset {
                    continue;
                }
            }
            // `old` is alive at `new`'s birth: sharing bytes is safe only as
            // a hand-over at that very node, in the same slot.
            let ok =
                old.end == new.start && old.offset == new.offset && handover.contains(&(old.end, old.key, new.key));
            if !ok {
                return Err(Error::Plan(format!("check_plan: {}", overlap(trace, old, new))));
            }
        }
        live.insert((new.offset, new.key), new);
        dying.push(Reverse((new.end, new.offset, new.key)));
    }
    Ok(())
}

/// The two classes, the earlier-born first (ties by class).
fn by_birth<'a>(a: &'a Class, b: &'a Class) -> (&'a Class, &'a Class) {
    if (a.start, a.key) <= (b.start, b.key) {
        (a, b)
    } else {
        (b, a)
    }
}

fn overlap(trace: &Trace, first: &Class, second: &Class) -> String {
    format!(
        "{} (live {}..={}) and {} (live {}..={}) overlap in {:?} memory at offsets {} and {}",
        trace.describe(first.first),
        first.start,
        first.end,
        trace.describe(second.first),
        second.start,
        second.end,
        first.region,
        first.offset,
        second.offset
    )
}
