//! Schedule, lifetimes and the memory plan.
//!
//! Stages, in order:
//! 1. **Schedule**: the trace's node order (already topological, with
//!    backward in reverse forward order, which frees activations as soon as
//!    their gradients exist).
//! 2. **Storage groups**: values that must share bytes are grouped: a view
//!    (reshape) with its source; an in-place output with an input that dies
//!    at that node (where the op declares the pair, the types match and no
//!    other input reads the same storage); a state update's new value with
//!    its persistent leaf.
//! 3. **Lifetimes**: a group lives from the position of its first producer
//!    to its last use; step outputs (loss, gradients) live to the end of the
//!    step; step inputs from its start.
//! 4. **Placement**: parameters and optimizer state are persistent, packed
//!    with no padding; every other group gets an offset in one arena, greedy
//!    by size (largest first, lowest offset that conflicts with no placed
//!    group whose lifetime intersects).
//!
//! [`check_plan`] re-derives lifetimes from the trace and proves that no
//! two values whose lifetimes intersect share a byte, except a view and its
//! source or an in-place hand-over the op declared.
//!
//! **Invariant:** gradients are arena values, born at the node that
//! produces them and alive to the end of the step; they reuse memory that
//! activations freed.

mod check;
mod report;

pub use check::check_plan;
pub use report::{plan_report, LiveValue, PlanReport};

use crate::error::{Error, Result};
use crate::ir::{Trace, ValueId, ValueKind};

/// Alignment of every arena offset, in bytes (what GPU libraries want).
pub const ARENA_ALIGN: u64 = 256;

/// Where a value's bytes live.
#[derive(Copy, Clone, PartialEq, Eq, Debug, serde::Serialize)]
pub enum Region {
    /// Parameters and optimizer state: one buffer that outlives every step.
    Persistent,
    /// Everything else: one buffer whose bytes are reused within a step.
    Arena,
}

/// The bytes of one value.
#[derive(Copy, Clone, PartialEq, Eq, Debug)]
pub struct Slot {
    pub region: Region,
    pub offset: u64,
    pub bytes: u64,
}

/// Values sharing one allocation, alive over `[start, end]` (schedule positions).
#[derive(Clone, Debug)]
pub struct Group {
    pub members: Vec<ValueId>,
    pub region: Region,
    pub start: usize,
    pub end: usize,
    pub bytes: u64,
    pub offset: u64,
}

/// Planner settings.
#[derive(Copy, Clone, PartialEq, Eq, Debug)]
pub struct PlanOptions {
    /// Reuse memory: share arena bytes between values with disjoint
    /// lifetimes and let in-place ops write over dying inputs. Off gives
    /// every value its own bytes (the "unplanned" reference).
    pub reuse: bool,
}

impl Default for PlanOptions {
    fn default() -> Self {
        PlanOptions { reuse: true }
    }
}

/// The result of planning: a slot for every value.
#[derive(Clone, Debug)]
pub struct MemoryPlan {
    pub slots: Vec<Slot>,
    /// Group index of every value.
    pub group_of: Vec<usize>,
    pub groups: Vec<Group>,
    /// Schedule length: positions run `0..steps`, and `steps` means "end of step".
    pub steps: usize,
    pub persistent_bytes: u64,
    pub arena_bytes: u64,
    /// The largest sum of live arena bytes at any position: no arena can be smaller.
    pub arena_floor_bytes: u64,
    /// The position where live arena bytes peak.
    pub peak_position: usize,
}

impl MemoryPlan {
    pub fn slot(&self, v: ValueId) -> Slot {
        self.slots[v.index()]
    }

    /// Persistent buffer plus arena: what a device must hold for this step.
    pub fn planned_peak_bytes(&self) -> u64 {
        self.persistent_bytes + self.arena_bytes
    }

    /// The floor of the whole step: persistent bytes plus the arena floor.
    pub fn floor_bytes(&self) -> u64 {
        self.persistent_bytes + self.arena_floor_bytes
    }
}

/// Value lifetimes: `(start, end)` schedule positions, `end == steps` for step outputs.
pub fn lifetimes(trace: &Trace) -> Vec<(usize, usize)> {
    let steps = trace.nodes.len();
    let mut life: Vec<(usize, usize)> = trace
        .values
        .iter()
        .map(|v| match v.kind {
            ValueKind::Node(n) => (n.index(), n.index()),
            _ => (0, 0),
        })
        .collect();
    for (pos, node) in trace.nodes.iter().enumerate() {
        for i in &node.inputs {
            life[i.index()].1 = life[i.index()].1.max(pos);
        }
    }
    for o in &trace.outputs {
        life[o.value.index()].1 = steps;
    }
    for u in &trace.updates {
        life[u.new.index()].1 = steps;
    }
    life
}

struct UnionFind(Vec<usize>);

impl UnionFind {
    fn find(&mut self, x: usize) -> usize {
        let mut r = x;
        while self.0[r] != r {
            r = self.0[r];
        }
        let mut y = x;
        while self.0[y] != r {
            let next = self.0[y];
            self.0[y] = r;
            y = next;
        }
        r
    }
    /// Makes `b`'s root a child of `a`'s root.
    fn union(&mut self, a: usize, b: usize) {
        let (ra, rb) = (self.find(a), self.find(b));
        if ra != rb {
            self.0[rb] = ra;
        }
    }
}

fn is_persistent(kind: &ValueKind) -> bool {
    matches!(kind, ValueKind::Param { .. } | ValueKind::State { .. })
}

/// Plans `trace` (whose node order is the schedule).
pub fn plan(trace: &Trace, opts: PlanOptions) -> Result<MemoryPlan> {
    let n = trace.values.len();
    let steps = trace.nodes.len();
    let life = lifetimes(trace);
    let mut uf = UnionFind((0..n).collect());
    // Per root: merged lifetime.
    let mut span: Vec<(usize, usize)> = life.clone();

    for node in &trace.nodes {
        if let Some(i) = node.op.view_of() {
            uf.union(node.inputs[i].index(), node.outputs[0].index());
        }
    }
    // Lifetimes of view groups.
    for v in 0..n {
        let r = uf.find(v);
        span[r] = (span[r].0.min(life[v].0), span[r].1.max(life[v].1));
    }

    let mut pinned = vec![false; n];
    for v in trace.leaves() {
        pinned[uf.find(v.index())] = true;
    }
    let update_of: std::collections::HashMap<ValueId, ValueId> =
        trace.updates.iter().map(|u| (u.new, u.state)).collect();
    for (pos, node) in trace.nodes.iter().enumerate() {
        let pairs = node.op.inplace();
        for (oi, ii) in pairs.iter().copied() {
            let (o, i) = (node.outputs[oi], node.inputs[ii]);
            let (ro, ri) = (uf.find(o.index()), uf.find(i.index()));
            if ro == ri {
                continue;
            }
            let is_update = update_of.get(&o) == Some(&i);
            // Leaves (and views of them) are never overwritten, except by their own update.
            let allowed = is_update || (opts.reuse && !pinned[ri]);
            if !allowed {
                continue;
            }
            // The input's storage must die here, the types must match, and no
            // other input of this node may read the same storage.
            let dies_here = span[ri].1 == pos;
            let same_type = trace.ty(o) == trace.ty(i);
            let shared_read = node
                .inputs
                .iter()
                .enumerate()
                .any(|(j, &x)| j != ii && x != i && uf.find(x.index()) == ri);
            let output_fresh = span[ro].0 == pos;
            if dies_here && same_type && !shared_read && output_fresh {
                uf.union(i.index(), o.index());
                span[ri] = (span[ri].0.min(span[ro].0), span[ri].1.max(span[ro].1));
            }
        }
    }
    for u in &trace.updates {
        if uf.find(u.new.index()) != uf.find(u.state.index()) {
            return Err(Error::Plan(format!(
                "the update of {} cannot run in place: {} is read after the optimizer writes it, or its op has no in-place form",
                trace.describe(u.state),
                trace.describe(u.state)
            )));
        }
    }

    // Build groups.
    let mut group_index = vec![usize::MAX; n];
    let mut groups: Vec<Group> = Vec::new();
    let mut group_of = vec![0; n];
    for v in 0..n {
        let r = uf.find(v);
        if group_index[r] == usize::MAX {
            group_index[r] = groups.len();
            groups.push(Group {
                members: vec![],
                region: Region::Arena,
                start: span[r].0,
                end: span[r].1,
                bytes: 0,
                offset: 0,
            });
        }
        let g = &mut groups[group_index[r]];
        g.members.push(ValueId(v as u32));
        g.bytes = g.bytes.max(trace.values[v].ty.bytes());
        if is_persistent(&trace.values[v].kind) {
            g.region = Region::Persistent;
        }
        group_of[v] = group_index[r];
    }

    // Persistent: big, 256-aligned buffers first so the small ones pack at the end with no padding.
    let mut pers: Vec<usize> = (0..groups.len()).filter(|&g| groups[g].region == Region::Persistent).collect();
    pers.sort_by_key(|&g| (groups[g].bytes % ARENA_ALIGN != 0, std::cmp::Reverse(groups[g].bytes), g));
    let mut off = 0u64;
    for &g in &pers {
        let align = if groups[g].bytes % ARENA_ALIGN == 0 { ARENA_ALIGN } else { 8 };
        off = off.div_ceil(align) * align;
        groups[g].offset = off;
        off += groups[g].bytes;
    }
    let persistent_bytes = off;

    let arena: Vec<usize> = (0..groups.len()).filter(|&g| groups[g].region == Region::Arena).collect();
    let intervals: Vec<(usize, usize, u64)> = arena.iter().map(|&g| (groups[g].start, groups[g].end, groups[g].bytes)).collect();
    let offsets = if opts.reuse { assign_offsets(&intervals) } else { assign_disjoint(&intervals) };
    let mut arena_bytes = 0;
    for (k, &g) in arena.iter().enumerate() {
        groups[g].offset = offsets[k];
        arena_bytes = arena_bytes.max(offsets[k] + align_up(groups[g].bytes));
    }

    // Floor: live bytes per position (a difference array over [start, end]).
    let mut delta = vec![0i128; steps + 2];
    for &(s, e, b) in &intervals {
        delta[s] += b as i128;
        delta[e + 1] -= b as i128;
    }
    let (mut live, mut floor, mut peak_position) = (0i128, 0i128, 0usize);
    for (pos, d) in delta.iter().enumerate().take(steps + 1) {
        live += d;
        if live > floor {
            floor = live;
            peak_position = pos;
        }
    }

    let slots = (0..n)
        .map(|v| {
            let g = &groups[group_of[v]];
            Slot { region: g.region, offset: g.offset, bytes: trace.values[v].ty.bytes() }
        })
        .collect();
    Ok(MemoryPlan {
        slots,
        group_of,
        groups,
        steps,
        persistent_bytes,
        arena_bytes,
        arena_floor_bytes: floor as u64,
        peak_position,
    })
}

pub fn align_up(b: u64) -> u64 {
    b.div_ceil(ARENA_ALIGN) * ARENA_ALIGN
}

/// Greedy-by-size offset assignment over `(start, end, bytes)` intervals:
/// largest first; each at the lowest aligned offset that overlaps no placed
/// interval alive at the same time.
pub fn assign_offsets(items: &[(usize, usize, u64)]) -> Vec<u64> {
    let mut order: Vec<usize> = (0..items.len()).collect();
    order.sort_by_key(|&i| (std::cmp::Reverse(items[i].2), items[i].0, i));
    let mut offsets = vec![0u64; items.len()];
    let mut placed: Vec<usize> = Vec::with_capacity(items.len());
    let mut busy: Vec<(u64, u64)> = Vec::new();
    for &i in &order {
        let (s, e, b) = items[i];
        let size = align_up(b);
        busy.clear();
        busy.extend(
            placed
                .iter()
                .filter(|&&j| items[j].0 <= e && s <= items[j].1)
                .map(|&j| (offsets[j], offsets[j] + align_up(items[j].2))),
        );
        busy.sort_unstable();
        let mut candidate = 0u64;
        for &(lo, hi) in &busy {
            if candidate + size <= lo {
                break;
            }
            candidate = candidate.max(hi);
        }
        offsets[i] = candidate;
        placed.push(i);
    }
    offsets
}

/// Every interval its own bytes: the unplanned reference layout.
fn assign_disjoint(items: &[(usize, usize, u64)]) -> Vec<u64> {
    let mut off = 0;
    items
        .iter()
        .map(|&(_, _, b)| {
            let o = off;
            off += align_up(b);
            o
        })
        .collect()
}
