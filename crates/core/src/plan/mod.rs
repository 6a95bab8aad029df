//! Schedule, lifetimes and the memory plan.
//!
//! Stages, in order:
//! 1. **Schedule**: the trace's node order (already topological, with
//!    backward in reverse forward order, which frees activations as soon as
//!    their gradients exist).
//! 2. **Storage groups**: values that must share bytes are grouped: a view
//!    with its source (a reshape at the source's start; a slice marked a
//!    view, one aligned run of its source, at its offset inside it, so a
//!    group's values sit at offsets from the group's start); an in-place
//!    output (at its input's place) with an input that dies
//!    at that node (where the op declares the pair, the types match and no
//!    other input reads the same storage); a state update's new value with
//!    its persistent leaf.
//! 3. **Lifetimes**: a group lives from the position of its first producer
//!    to its last use; step outputs (loss, gradients) live to the end of the
//!    step; step inputs from its start.
//! 4. **Placement**: parameters and optimizer state are persistent, packed
//!    with no padding; with [`PlanOptions::host_tables`], frozen embedding
//!    tables go to the host region instead (packed the same way); every
//!    other group gets an offset in one arena, greedy by size (largest
//!    first, lowest offset that conflicts with no placed group whose
//!    lifetime intersects).
//!
//! [`check_plan`] re-derives lifetimes from the trace and proves that no
//! two values whose lifetimes intersect share a byte, except a view and its
//! source or an in-place hand-over the op declared.
//!
//! **Invariant:** gradients are arena values, born at the node that
//! produces them and alive to the end of the step; they reuse memory that
//! activations freed.

mod check;
mod html;
mod occupancy;
mod report;

pub use check::check_plan;
pub use html::{memory_timeline_html, Allocation, Category, Timeline, TimelineOptions};
pub use report::{plan_report, LiveValue, PlanReport};

use crate::error::{Error, Result};
use crate::ir::{Trace, ValueId, ValueKind};
use occupancy::Occupancy;

pub use crate::ir::ARENA_ALIGN;

/// Where a value's bytes live.
#[derive(Copy, Clone, PartialEq, Eq, Debug, serde::Serialize)]
pub enum Region {
    /// Parameters and optimizer state: one buffer that outlives every step.
    Persistent,
    /// Everything else: one buffer whose bytes are reused within a step.
    Arena,
    /// Page-locked host memory, not device memory: frozen tables that only
    /// embedding lookups read ([`PlanOptions::host_tables`]), which the
    /// device reads over the bus one row per token and which outlive every
    /// step as persistent memory does; above them, values offloaded by
    /// the offload pass between their copy to the host and their
    /// last copy back, whose bytes are reused within a step as the arena's.
    Host,
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
#[derive(Copy, Clone, PartialEq, Eq, Debug, serde::Serialize)]
pub struct PlanOptions {
    /// Reuse memory: share arena bytes between values with disjoint
    /// lifetimes and let in-place ops write over dying inputs. Off gives
    /// every value its own bytes (the "unplanned" reference).
    pub reuse: bool,
    /// Keep frozen weights that only embedding lookups read (the token
    /// table of a model trained through adapters) in [`Region::Host`]: a
    /// step reads one row per token of them (32 MB of Llama-3-8B's 1.05 GB
    /// table at 4096 tokens), so they need not hold device memory. Off by
    /// default; [`crate::pipeline::compile_step`] turns it on under a
    /// memory budget the step does not meet without recomputation.
    /// Not serialized: where a frozen table lives changes no value, so it
    /// is no part of a run's resume identity.
    #[serde(skip)]
    pub host_tables: bool,
}

impl Default for PlanOptions {
    fn default() -> Self {
        PlanOptions { reuse: true, host_tables: false }
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
    /// Bytes of [`Region::Host`] (host tables and offloaded values): not
    /// device memory, not in the planned peak.
    pub host_bytes: u64,
    /// Of `host_bytes`, the frozen tables ([`PlanOptions::host_tables`]).
    pub host_table_bytes: u64,
    /// Of `host_bytes`, optimizer states kept there by the offload pass.
    pub host_state_bytes: u64,
    /// The largest sum of live arena bytes at any position: no arena can be smaller.
    pub arena_floor_bytes: u64,
    /// The position where live arena bytes peak.
    pub peak_position: usize,
}

impl MemoryPlan {
    pub fn slot(&self, v: ValueId) -> Slot {
        self.slots[v.index()]
    }

    /// Persistent buffer plus arena: what a device must hold for this step
    /// (host tables are not device memory).
    pub fn planned_peak_bytes(&self) -> u64 {
        self.persistent_bytes + self.arena_bytes
    }

    /// The floor of the whole step: persistent bytes plus the arena floor.
    pub fn floor_bytes(&self) -> u64 {
        self.persistent_bytes + self.arena_floor_bytes
    }
}

/// Nodes after a copy to the host ([`crate::ops::offload::HostCopy`])
/// during which its source keeps its device bytes: the copy runs on a copy
/// stream beside those nodes, so the compute stream rarely waits for it
/// before writing over them.
pub const COPY_OUT_NODES: usize = 16;

/// Value lifetimes: `(start, end)` schedule positions, `end == steps` for
/// step outputs and for inputs.
///
/// Inputs live the whole step: an input's slot is never
/// handed to a later value, so running the step again without rewriting its
/// inputs (a graph replay right after the eager step that preceded the
/// capture, a re-run after a failure) reads the same inputs and computes the
/// same step. Inputs are token ids, targets and scalars: kilobytes.
pub fn lifetimes(trace: &Trace) -> Vec<(usize, usize)> {
    let steps = trace.nodes.len();
    let mut life: Vec<(usize, usize)> = trace
        .values
        .iter()
        .map(|v| match v.kind {
            ValueKind::Node(n) => (n.index(), n.index()),
            ValueKind::Input { .. } => (0, steps),
            // Parameters and state end at their last read: their updates
            // write them in place there.
            _ => (0, 0),
        })
        .collect();
    for (pos, node) in trace.nodes.iter().enumerate() {
        for i in &node.inputs {
            life[i.index()].1 = life[i.index()].1.max(pos);
        }
    }
    // A value being copied to the host keeps its bytes while the copy
    // runs beside the next nodes ([`COPY_OUT_NODES`]).
    for (pos, node) in trace.nodes.iter().enumerate() {
        if let crate::ops::Op::HostCopy(copy @ crate::ops::offload::HostCopy { to_host: true, .. }) = &node.op {
            let i = node.inputs[copy.source()].index();
            life[i].1 = life[i].1.max((pos + COPY_OUT_NODES).min(steps.saturating_sub(1)));
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

/// Values that share storage, each at a byte offset from its class's first
/// byte (a slice view starts inside its source; everything else at 0).
struct UnionFind {
    parent: Vec<usize>,
    /// Bytes from the parent's start to this value's start.
    offset: Vec<u64>,
}

impl UnionFind {
    fn new(n: usize) -> UnionFind {
        UnionFind { parent: (0..n).collect(), offset: vec![0; n] }
    }
    fn find(&mut self, x: usize) -> usize {
        // The root, and x's offset from it.
        let (mut r, mut total) = (x, 0);
        while self.parent[r] != r {
            total += self.offset[r];
            r = self.parent[r];
        }
        // Compress: every value on the path points at the root, with its
        // offset from it (the remaining sum at that step).
        let mut y = x;
        while self.parent[y] != r && self.parent[y] != y {
            let (next, own) = (self.parent[y], self.offset[y]);
            self.parent[y] = r;
            self.offset[y] = total;
            total -= own;
            y = next;
        }
        r
    }
    /// Bytes from the start of `x`'s class to `x`'s start.
    fn offset_of(&mut self, x: usize) -> u64 {
        self.find(x);
        if self.parent[x] == x {
            0
        } else {
            self.offset[x]
        }
    }
    /// Joins `b`'s class to `a`'s, with `b` starting `delta` bytes after `a`.
    /// `b`'s class may not start before `a`'s: its root is `b` itself or
    /// starts at `b`'s own start (true of every join the planner makes: a
    /// view's output is new at its node, and an in-place output or an
    /// update's value is at the start of its own views).
    fn union_at(&mut self, a: usize, b: usize, delta: u64) {
        let (ra, rb) = (self.find(a), self.find(b));
        if ra != rb {
            debug_assert_eq!(self.offset_of(b), 0, "a class joined after its start");
            self.offset[rb] = self.offset_of(a) + delta;
            self.parent[rb] = ra;
        }
    }
    fn union(&mut self, a: usize, b: usize) {
        self.union_at(a, b, 0);
    }
}

/// Packs the groups of `region` (persistent or host) that `take` accepts from offset 0:
/// 256-byte multiples first (aligned, no padding), then the small
/// odd-sized ones by falling element size, each aligned to its element, so
/// the buffer holds exactly the bytes of its values. Returns its size.
fn pack(trace: &Trace, groups: &mut [Group], region: Region, take: impl Fn(&Group) -> bool) -> u64 {
    let elem = |g: &Group| trace.ty(g.members[0]).dtype.size() as u64;
    let mut order: Vec<usize> = (0..groups.len()).filter(|&g| groups[g].region == region && take(&groups[g])).collect();
    order.sort_by_key(|&g| {
        let gr = &groups[g];
        (!gr.bytes.is_multiple_of(ARENA_ALIGN), std::cmp::Reverse(elem(gr)), std::cmp::Reverse(gr.bytes), g)
    });
    let mut off = 0u64;
    for &g in &order {
        let align = if groups[g].bytes.is_multiple_of(ARENA_ALIGN) { ARENA_ALIGN } else { elem(&groups[g]) };
        off = off.div_ceil(align) * align;
        groups[g].offset = off;
        off += groups[g].bytes;
    }
    off
}

/// Values that may live in [`Region::Host`]: frozen leaves that no node
/// reads but as the table of an embedding lookup (so no product, no
/// gradient and no update ever touches them).
pub fn host_tables(trace: &Trace) -> Vec<bool> {
    let mut host: Vec<bool> = trace.values.iter().map(|v| matches!(v.kind, ValueKind::Frozen { .. })).collect();
    for node in &trace.nodes {
        for (k, &i) in node.inputs.iter().enumerate() {
            if !(matches!(node.op, crate::ops::Op::Embedding(_)) && k == 1) {
                host[i.index()] = false;
            }
        }
    }
    for o in &trace.outputs {
        host[o.value.index()] = false;
    }
    host
}

/// Optimizer states and weights the offload pass keeps in host memory:
/// leaves of those kinds that only copies read (to the device before they
/// are read, and as the storage the updated value is copied back into).
pub fn host_states(trace: &Trace) -> Vec<bool> {
    // Per value: read by a copy, read by anything else. A state nothing
    // reads stays where states live.
    let mut by_copy = vec![false; trace.values.len()];
    let mut by_other = vec![false; trace.values.len()];
    for node in &trace.nodes {
        let copy = matches!(node.op, crate::ops::Op::HostCopy(_));
        for &i in &node.inputs {
            if copy {
                by_copy[i.index()] = true;
            } else {
                by_other[i.index()] = true;
            }
        }
    }
    (trace.values.iter().enumerate())
        .map(|(v, value)| is_persistent(&value.kind) && by_copy[v] && !by_other[v])
        .collect()
}

fn is_persistent(kind: &ValueKind) -> bool {
    matches!(kind, ValueKind::Param { .. } | ValueKind::Frozen { .. } | ValueKind::State { .. })
}

/// The values that become a state's new value, each with its state: the
/// update's own value, and the chain of in-place writes it comes from. A
/// state written in place several times in one trace (a KV cache that the
/// prefill and every decode step write: `c1 = kv_write(cache, …)`,
/// `c2 = kv_write(c1, …)`, update `cache ← c2`) keeps every link in the
/// state's storage.
fn update_chains(trace: &Trace) -> std::collections::HashMap<ValueId, ValueId> {
    let mut chain = std::collections::HashMap::new();
    for u in &trace.updates {
        let mut v = u.new;
        // Back through in-place pairs until the state (or a value that is
        // not written in place: then the update fails in `plan`).
        while v != u.state && chain.insert(v, u.state).is_none() {
            let Some(n) = trace.producer(v) else { break };
            let node = trace.node(n);
            let Some(oi) = node.outputs.iter().position(|&o| o == v) else { break };
            let Some(&(_, ii)) = node.op.inplace().iter().find(|&&(o, _)| o == oi) else { break };
            v = node.inputs[ii];
        }
    }
    chain
}

/// Plans `trace` (whose node order is the schedule).
pub fn plan(trace: &Trace, opts: PlanOptions) -> Result<MemoryPlan> {
    let n = trace.values.len();
    let steps = trace.nodes.len();
    let life = lifetimes(trace);
    let mut uf = UnionFind::new(n);
    // Per root: merged lifetime.
    let mut span: Vec<(usize, usize)> = life.clone();

    for node in &trace.nodes {
        if let Some(i) = node.op.view_of() {
            let at = node.op.view_offset(trace.ty(node.inputs[i]));
            uf.union_at(node.inputs[i].index(), node.outputs[0].index(), at);
        }
    }
    // Lifetimes of view groups.
    for (v, &(start, end)) in life.iter().enumerate() {
        let r = uf.find(v);
        span[r] = (span[r].0.min(start), span[r].1.max(end));
    }

    let mut pinned = vec![false; n];
    for v in trace.leaves() {
        pinned[uf.find(v.index())] = true;
    }
    let update_of = update_chains(trace);
    for (pos, node) in trace.nodes.iter().enumerate() {
        let pairs = node.op.inplace();
        for (oi, ii) in pairs.iter().copied() {
            let (o, i) = (node.outputs[oi], node.inputs[ii]);
            let (ro, ri) = (uf.find(o.index()), uf.find(i.index()));
            if ro == ri {
                continue;
            }
            // The value is on its state's update chain, and the input is
            // that state or an earlier link of the chain (whose storage
            // is the state's already).
            let is_update = update_of.get(&o).is_some_and(|&s| uf.find(s.index()) == ri);
            // Leaves (and views of them) are never overwritten, except by their own update.
            // An input inside its class (a slice view off the class's start)
            // hands over nothing: the checker's sweep needs classes that
            // share bytes at one offset.
            let allowed = (is_update || (opts.reuse && !pinned[ri])) && uf.offset_of(i.index()) == 0;
            if !allowed {
                continue;
            }
            // The input's storage must die here, the types must match, and no
            // other input of this node may read the same storage.
            let dies_here = span[ri].1 == pos;
            let same_type = trace.ty(o) == trace.ty(i);
            let shared_read =
                node.inputs.iter().enumerate().any(|(j, &x)| j != ii && x != i && uf.find(x.index()) == ri);
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

    let host_table = if opts.host_tables { host_tables(trace) } else { vec![false; n] };
    let host_state = host_states(trace);
    // Build groups.
    let mut group_index = vec![usize::MAX; n];
    let mut groups: Vec<Group> = Vec::new();
    let mut group_of = vec![0; n];
    #[allow(clippy::needless_range_loop)] // `v` indexes three tables at once
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
        let at = uf.offset_of(v);
        let g = &mut groups[group_index[r]];
        g.members.push(ValueId(v as u32));
        g.bytes = g.bytes.max(at + trace.values[v].ty.bytes());
        if is_persistent(&trace.values[v].kind) {
            g.region =
                if (opts.host_tables && host_table[v]) || host_state[v] { Region::Host } else { Region::Persistent };
        } else if trace.producer(ValueId(v as u32)).is_some_and(|p| trace.node(p).op.output_on_host()) {
            g.region = Region::Host;
        }
        group_of[v] = group_index[r];
    }

    // Persistent and arena bytes together stay within the cap, which keeps
    // every sum below from overflowing.
    let all: Vec<(usize, usize, u64)> = groups.iter().map(|g| (g.start, g.end, g.bytes)).collect();
    if let Some(k) = first_past_cap(&all) {
        return Err(Error::Size {
            keys: vec![],
            reason: format!(
                "memory plan: `{}` needs more than {MAX_PLAN_BYTES} bytes (2^60), the most one plan can hold: its \
                 values' sizes pass that sum at {} ({} bytes)",
                trace.name,
                trace.describe(groups[k].members[0]),
                groups[k].bytes
            ),
        });
    }

    let persistent_bytes = pack(trace, &mut groups, Region::Persistent, |_| true);
    // Host tables and states first, packed; offloaded values above them,
    // their bytes reused between lifetimes as the arena's are.
    let tables = pack(trace, &mut groups, Region::Host, |g| trace.values[g.members[0].index()].kind.is_leaf());
    let offloaded: Vec<usize> = (0..groups.len())
        .filter(|&g| groups[g].region == Region::Host && !trace.values[groups[g].members[0].index()].kind.is_leaf())
        .collect();
    let offloaded_intervals: Vec<(usize, usize, u64)> =
        offloaded.iter().map(|&g| (groups[g].start, groups[g].end, groups[g].bytes)).collect();
    let offloaded_offsets =
        if opts.reuse { assign_offsets(&offloaded_intervals)? } else { assign_disjoint(&offloaded_intervals) };
    // Host leaves by what they are: frozen tables that embeddings read in
    // place, optimizer states (weights that copies bring to the device are
    // the rest).
    let host_leaf_bytes = |wanted: fn(&ValueKind, bool) -> bool| {
        (groups.iter())
            .filter(|g| g.region == Region::Host)
            .filter(|g| {
                let v = g.members[0].index();
                wanted(&trace.values[v].kind, host_state[v])
            })
            .map(|g| g.bytes)
            .sum::<u64>()
    };
    let host_table_bytes = host_leaf_bytes(|k, copied| matches!(k, ValueKind::Frozen { .. }) && !copied);
    let host_state_bytes = host_leaf_bytes(|k, _| matches!(k, ValueKind::State { .. }));
    let base = align_up(tables);
    let mut host_bytes = tables;
    for (k, &g) in offloaded.iter().enumerate() {
        groups[g].offset = base + offloaded_offsets[k];
        host_bytes = host_bytes.max(groups[g].offset + align_up(groups[g].bytes));
    }

    let arena: Vec<usize> = (0..groups.len()).filter(|&g| groups[g].region == Region::Arena).collect();
    let intervals: Vec<(usize, usize, u64)> =
        arena.iter().map(|&g| (groups[g].start, groups[g].end, groups[g].bytes)).collect();
    let offsets = if opts.reuse { assign_offsets(&intervals)? } else { assign_disjoint(&intervals) };
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
            Slot { region: g.region, offset: g.offset + uf.offset_of(v), bytes: trace.values[v].ty.bytes() }
        })
        .collect();
    Ok(MemoryPlan {
        slots,
        group_of,
        groups,
        steps,
        persistent_bytes,
        arena_bytes,
        host_bytes,
        host_table_bytes,
        host_state_bytes,
        arena_floor_bytes: floor as u64,
        peak_position,
    })
}

/// `b` rounded up to [`ARENA_ALIGN`]; sizes within [`MAX_PLAN_BYTES`]
/// never come near the top of `u64`, and above it the result saturates at
/// the largest aligned `u64` rather than wrapping.
pub fn align_up(b: u64) -> u64 {
    b.checked_next_multiple_of(ARENA_ALIGN).unwrap_or(u64::MAX - (ARENA_ALIGN - 1))
}

/// The most bytes one plan may hold, summed over every value (1 EiB).
/// Checked once before placement; below it no offset, size or ceiling the
/// placement computes can overflow (the largest is under 3 times this).
pub const MAX_PLAN_BYTES: u64 = crate::ir::MAX_VALUE_BYTES;

/// The first of `items` whose aligned size brings the running sum past
/// [`MAX_PLAN_BYTES`], if one does.
fn first_past_cap(items: &[(usize, usize, u64)]) -> Option<usize> {
    let mut total = 0u64;
    for (k, &(_, _, bytes)) in items.iter().enumerate() {
        match bytes.checked_next_multiple_of(ARENA_ALIGN).and_then(|b| total.checked_add(b)) {
            Some(t) if t <= MAX_PLAN_BYTES => total = t,
            _ => return Some(k),
        }
    }
    None
}

/// Offset assignment over `(start, end, bytes)` intervals, trying two
/// strategies and keeping the smaller arena:
/// - greedy by size: largest first, each at the lowest aligned offset that
///   overlaps no placed interval alive at the same time;
/// - outputs on top: intervals alive to the end of the step (`end ==
///   last`, the gradients) stacked downward from a ceiling in birth order,
///   the rest greedy by size below and between them. Activations then grow
///   and shrink like a stack from the bottom while gradients grow from the
///   top, the shape of a backward pass. The ceiling is swept upward from
///   the floor until the rest fits under it.
///
/// Fails only when the aligned sizes sum past [`MAX_PLAN_BYTES`].
pub fn assign_offsets(items: &[(usize, usize, u64)]) -> Result<Vec<u64>> {
    Ok(sweep_ceilings(items, true)?.0)
}

/// [`assign_offsets`], with or without stopping each placement once it
/// reaches the best extent so far (which changes no offset: such a
/// placement can neither win nor fit under its ceiling); also the number
/// of placements stopped.
fn sweep_ceilings(items: &[(usize, usize, u64)], stop_early: bool) -> Result<(Vec<u64>, usize)> {
    if let Some(k) = first_past_cap(items) {
        let (start, end, bytes) = items[k];
        return Err(Error::Size {
            keys: vec![],
            reason: format!(
                "memory plan: interval {k} (live {start}..={end}, {bytes} bytes) brings the arena past \
                 {MAX_PLAN_BYTES} bytes (2^60), the most one plan can hold"
            ),
        });
    }
    let last = items.iter().map(|i| i.1).max().unwrap_or(0);
    let mut occupancy = Occupancy::new(last + 1);
    let by_size = greedy(items, &[], Order::Size, &mut occupancy, u64::MAX).expect("no limit");
    let mut best = (extent(items, &by_size), by_size);
    let tail: Vec<usize> = {
        let mut t: Vec<usize> = (0..items.len()).filter(|&i| items[i].1 == last && items[i].0 < last).collect();
        t.sort_by_key(|&i| (items[i].0, i));
        t
    };
    if tail.is_empty() {
        return Ok((best.1, 0));
    }
    let mut stopped = 0;
    let floor = live_floor(items);
    for k in 0..=40u64 {
        // floor * (1 + k / 400), in u128 so the product cannot overflow.
        let ceiling = align_up((u128::from(floor) + u128::from(floor) * u128::from(k) / 400) as u64);
        if ceiling >= best.0 {
            break;
        }
        let mut fixed = Vec::with_capacity(tail.len());
        let mut top = ceiling;
        let mut fits = true;
        for &i in &tail {
            let size = align_up(items[i].2);
            if size > top {
                fits = false;
                break;
            }
            top -= size;
            fixed.push((i, top));
        }
        if !fits {
            continue;
        }
        let mut done = false;
        for order in [Order::Size, Order::Birth] {
            // A placement that reaches the best extent so far can neither
            // replace it nor fit under this ceiling (below it): stop there.
            let limit = if stop_early { best.0 } else { u64::MAX };
            let Some(offsets) = greedy(items, &fixed, order, &mut occupancy, limit) else {
                stopped += 1;
                continue;
            };
            let e = extent(items, &offsets);
            if e < best.0 {
                best = (e, offsets);
            }
            done |= e <= ceiling;
        }
        if done {
            break;
        }
    }
    Ok((best.1, stopped))
}

/// The largest sum of aligned sizes alive at one position.
fn live_floor(items: &[(usize, usize, u64)]) -> u64 {
    let last = items.iter().map(|i| i.1).max().unwrap_or(0);
    let mut delta = vec![0i128; last + 2];
    for &(s, e, b) in items {
        delta[s] += align_up(b) as i128;
        delta[e + 1] -= align_up(b) as i128;
    }
    let (mut live, mut best) = (0i128, 0i128);
    for d in delta {
        live += d;
        best = best.max(live);
    }
    best as u64
}

fn extent(items: &[(usize, usize, u64)], offsets: &[u64]) -> u64 {
    items.iter().zip(offsets).map(|(i, o)| o + align_up(i.2)).max().unwrap_or(0)
}

/// The order in which [`greedy`] places intervals.
#[derive(Copy, Clone)]
enum Order {
    /// Largest first.
    Size,
    /// In allocation order, as a first-fit allocator would see them.
    Birth,
}

/// Places every interval not in `fixed` (item, offset) at the lowest aligned
/// offset free over its lifetime, in `order`. `occupancy` is scratch space
/// (cleared first) covering every position of `items`. `None` as soon as an
/// interval ends at or above `limit` (the extent only grows as more are
/// placed).
fn greedy(
    items: &[(usize, usize, u64)],
    fixed: &[(usize, u64)],
    order_by: Order,
    occupancy: &mut Occupancy,
    limit: u64,
) -> Option<Vec<u64>> {
    occupancy.clear();
    let mut offsets = vec![0u64; items.len()];
    let mut is_fixed = vec![false; items.len()];
    for &(i, o) in fixed {
        offsets[i] = o;
        is_fixed[i] = true;
        let (s, e, b) = items[i];
        occupancy.insert(s, e, o, o + align_up(b));
    }
    let mut order: Vec<usize> = (0..items.len()).filter(|&i| !is_fixed[i]).collect();
    match order_by {
        Order::Size => order.sort_by_key(|&i| (std::cmp::Reverse(items[i].2), items[i].0, i)),
        Order::Birth => order.sort_by_key(|&i| (items[i].0, std::cmp::Reverse(items[i].2), i)),
    }
    for &i in &order {
        let (s, e, b) = items[i];
        let size = align_up(b);
        let offset = occupancy.lowest_free(s, e, size);
        if offset + size >= limit {
            return None;
        }
        offsets[i] = offset;
        occupancy.insert(s, e, offset, offset + size);
    }
    Some(offsets)
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

#[cfg(test)]
mod tests {
    use super::{sweep_ceilings, UnionFind};

    #[test]
    fn stopping_placements_at_the_best_extent_changes_no_offset() {
        let mut next = super::occupancy::below(0x9e37_79b9_7f4a_7c15);
        let mut stopped = 0;
        for round in 0..60 {
            let last = 4 + next(60) as usize;
            let n = 8 + next(150) as usize;
            let items: Vec<(usize, usize, u64)> = (0..n)
                .map(|_| {
                    let start = next(last as u64) as usize;
                    // About a third live to the end of the step: the
                    // gradients the ceiling sweep stacks from the top.
                    let end = if next(3) == 0 { last } else { (start + next(1 + last as u64 / 2) as usize).min(last) };
                    (start, end, (1 + next(5000)) * if next(4) == 0 { 97 } else { 1 })
                })
                .collect();
            let (fast, n_stopped) = sweep_ceilings(&items, true).unwrap();
            let (full, none) = sweep_ceilings(&items, false).unwrap();
            assert_eq!(fast, full, "round {round}");
            assert_eq!(none, 0);
            stopped += n_stopped;
        }
        assert!(stopped > 0, "no placement was stopped: the check above checked nothing");
    }

    #[test]
    fn view_classes_keep_each_values_offset_through_compression() {
        let mut uf = UnionFind::new(6);
        // 0 ⊃ 1 at 256 ⊃ 2 at 512 more (a view of a view), 3 a view of 2 at 0.
        uf.union_at(0, 1, 256);
        uf.union_at(1, 2, 512);
        uf.union_at(2, 3, 0);
        // 4 hands over in place to 5; then 4's class joins 0's at 1024.
        uf.union(4, 5);
        uf.union_at(0, 4, 1024);
        for _ in 0..2 {
            // Twice: the second reads the compressed paths.
            let at: Vec<u64> = (0..6).map(|v| uf.offset_of(v)).collect();
            assert_eq!(at, [0, 256, 768, 768, 1024, 1024]);
            assert!((0..6).all(|v| uf.find(v) == uf.find(0)));
        }
    }
}
