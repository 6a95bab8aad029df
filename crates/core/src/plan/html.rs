//! The memory timeline: one self-contained HTML page (inline SVG, a little
//! inline script, no network) that shows a [`MemoryPlan`] over its schedule.
//!
//! It owns the classification of planned bytes into what a user reasons
//! about — parameters, optimizer state, gradients, saved activations,
//! recomputed values and temporaries — and the page drawn from it: bytes
//! live at every schedule position stacked by category, the planned peak and
//! the position where live bytes peak with the largest values there, the
//! forward/backward/optimizer phases, a hover read-out per position, and a
//! sortable, filterable table of every allocation (name, type, category,
//! producing op, lifetime, bytes).
//!
//! Bytes are counted per storage group, as the planner allocates them: a
//! view and its source, or an in-place hand-over, are one allocation, shown
//! once under the category of its most telling member (a gradient output
//! over a temporary that became it). The chart is drawn from exact per-
//! position totals; schedules longer than [`MAX_COLUMNS`] are drawn in
//! buckets of consecutive positions, each bucket showing the breakdown at
//! the position where its total is largest, so no peak is ever smoothed away.

use std::collections::HashSet;
use std::fmt::Write as _;

use super::{MemoryPlan, Region};
use crate::ir::{NodeId, OutputKind, Phase, Trace, ValueId, ValueKind};

/// The most chart columns drawn; longer schedules are bucketed (see the module doc).
pub const MAX_COLUMNS: usize = 1600;

/// What an allocation holds, in stacking order (bottom first).
#[derive(Copy, Clone, PartialEq, Eq, Debug, PartialOrd, Ord, Hash)]
pub enum Category {
    Parameters,
    OptimizerState,
    Gradients,
    SavedActivations,
    Recomputed,
    Temporaries,
}

impl Category {
    pub const ALL: [Category; 6] = [
        Category::Parameters,
        Category::OptimizerState,
        Category::Gradients,
        Category::SavedActivations,
        Category::Recomputed,
        Category::Temporaries,
    ];

    pub fn label(self) -> &'static str {
        match self {
            Category::Parameters => "parameters",
            Category::OptimizerState => "optimizer state",
            Category::Gradients => "gradients",
            Category::SavedActivations => "saved activations",
            Category::Recomputed => "recomputed values",
            Category::Temporaries => "temporaries",
        }
    }

    fn color(self) -> &'static str {
        match self {
            Category::Parameters => "#4e79a7",
            Category::OptimizerState => "#76b7b2",
            Category::Gradients => "#f28e2b",
            Category::SavedActivations => "#e15759",
            Category::Recomputed => "#b07aa1",
            Category::Temporaries => "#d4b83a",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// What the page is about, besides the plan.
#[derive(Clone, Debug, Default)]
pub struct TimelineOptions {
    /// The heading: model, dtype, batch × tokens, step kind.
    pub title: String,
    /// Nodes a recomputation pass emitted into backward: their values are
    /// "recomputed values" rather than temporaries.
    pub recomputed: Vec<NodeId>,
}

/// One allocation of the plan, classified.
#[derive(Clone, Debug, PartialEq)]
pub struct Allocation {
    pub name: String,
    pub ty: String,
    pub category: Category,
    /// The op that produces the allocation's first member, or the leaf kind.
    pub producer: String,
    pub start: usize,
    pub end: usize,
    pub bytes: u64,
}

/// The plan as the page shows it: allocations and exact per-position totals.
#[derive(Clone, Debug)]
pub struct Timeline {
    /// Device allocations, largest first.
    pub allocations: Vec<Allocation>,
    /// `live[p][c]`: device bytes of category `c` live at schedule position `p`.
    pub live: Vec<[u64; 6]>,
    /// What the plan keeps in page-locked host memory, largest first: the
    /// page's host band. Tables (a frozen embedding under a budget) live
    /// over the whole step; offloaded values between their copy to the
    /// host and their copy back.
    pub host: Vec<Allocation>,
    /// `host_live[p]`: host bytes live at schedule position `p`.
    pub host_live: Vec<u64>,
}

impl Timeline {
    /// Classifies every allocation of `plan` and sums live bytes per position.
    pub fn new(trace: &Trace, plan: &MemoryPlan, recomputed: &[NodeId]) -> Timeline {
        let recomputed: HashSet<NodeId> = recomputed.iter().copied().collect();
        // Gradients: the outputs of a gradients step, and in a train step
        // what backward hands to the optimizer.
        let mut grads: HashSet<ValueId> =
            trace.outputs.iter().filter(|o| matches!(o.kind, OutputKind::Grad(_))).map(|o| o.value).collect();
        // (The optimizer may run inside backward: an update's gradient is its second input.)
        for node in
            trace.nodes.iter().filter(|n| matches!(n.op, crate::ops::Op::AdamW(_) | crate::ops::Op::AdamW8bit(_)))
        {
            if let Some(&g) = node.inputs.get(1) {
                if matches!(trace.value(g).kind, ValueKind::Node(_)) {
                    grads.insert(g);
                }
            }
        }
        for node in trace.nodes.iter().filter(|n| n.phase == Phase::Optimizer) {
            for &i in &node.inputs {
                if let ValueKind::Node(p) = trace.value(i).kind {
                    if trace.node(p).phase == Phase::Backward {
                        grads.insert(i);
                    }
                }
            }
        }
        let saved: HashSet<ValueId> = trace.saved.iter().copied().collect();
        let steps = plan.steps.max(1);
        let category_of = |v: ValueId| match &trace.value(v).kind {
            ValueKind::Param { .. } | ValueKind::Frozen { .. } => Category::Parameters,
            ValueKind::State { .. } => Category::OptimizerState,
            ValueKind::Input { .. } => Category::Temporaries,
            ValueKind::Node(_) if grads.contains(&v) => Category::Gradients,
            ValueKind::Node(n) if recomputed.contains(n) => Category::Recomputed,
            // A value back from host memory is a saved value, where backward reads it.
            ValueKind::Node(n) if matches!(trace.node(*n).op, crate::ops::Op::HostCopy(_)) => {
                Category::SavedActivations
            }
            ValueKind::Node(_) if saved.contains(&v) => Category::SavedActivations,
            ValueKind::Node(_) => Category::Temporaries,
        };
        let mut allocations = Vec::with_capacity(plan.groups.len());
        let mut host = Vec::new();
        // Difference arrays: +bytes at start, -bytes after end, per category.
        let mut delta = vec![[0i128; 6]; steps + 1];
        let mut host_delta = vec![0i128; steps + 1];
        for g in &plan.groups {
            if g.members.is_empty() || g.bytes == 0 {
                continue;
            }
            // The most telling member decides: leaves and gradients over
            // saved values over recomputed ones over temporaries.
            let category = g.members.iter().map(|&v| category_of(v)).min().unwrap_or(Category::Temporaries);
            let shown = g.members.iter().copied().find(|&v| category_of(v) == category).unwrap_or(g.members[0]);
            let whole_step = match g.region {
                Region::Persistent => true,
                Region::Host => trace.value(g.members[0]).kind.is_leaf(),
                Region::Arena => false,
            };
            let (start, end) = if whole_step { (0, steps - 1) } else { (g.start.min(steps - 1), g.end.min(steps - 1)) };
            let producer = match &trace.value(shown).kind {
                ValueKind::Node(n) => {
                    let node = trace.node(*n);
                    format!("{} ({})", node.op.name(), node.phase.name())
                }
                ValueKind::Param { .. } => "parameter".into(),
                ValueKind::Frozen { .. } => "frozen weight".into(),
                ValueKind::State { .. } => "optimizer state".into(),
                ValueKind::Input { .. } => "step input".into(),
            };
            let name = match trace.value(shown).kind.leaf_name() {
                Some(n) => n.to_string(),
                None => trace.describe(shown),
            };
            let members = if g.members.len() > 1 {
                format!(" (+{} sharing its bytes)", g.members.len() - 1)
            } else {
                String::new()
            };
            let allocation = Allocation {
                name: format!("{name}{members}"),
                ty: trace.ty(shown).to_string(),
                category,
                producer,
                start,
                end,
                bytes: g.bytes,
            };
            // The chart is device memory: host memory gets its own band.
            if g.region == Region::Host {
                host_delta[start] += g.bytes as i128;
                host_delta[end + 1] -= g.bytes as i128;
                host.push(allocation);
                continue;
            }
            delta[start][category.index()] += g.bytes as i128;
            delta[end + 1][category.index()] -= g.bytes as i128;
            allocations.push(allocation);
        }
        let mut live = Vec::with_capacity(steps);
        let mut running = [0i128; 6];
        for d in delta.iter().take(steps) {
            for c in 0..6 {
                running[c] += d[c];
            }
            live.push(running.map(|b| b.max(0) as u64));
        }
        let host_live: Vec<u64> = host_delta
            .iter()
            .take(steps)
            .scan(0i128, |running, d| {
                *running += d;
                Some((*running).max(0) as u64)
            })
            .collect();
        allocations.sort_by(|a, b| b.bytes.cmp(&a.bytes).then(a.start.cmp(&b.start)));
        host.sort_by_key(|a| std::cmp::Reverse(a.bytes));
        Timeline { allocations, live, host, host_live }
    }

    /// The most bytes live in host memory at any one position.
    pub fn host_bytes(&self) -> u64 {
        self.host_live.iter().copied().max().unwrap_or(0)
    }

    /// Total live bytes at position `p`.
    pub fn total(&self, p: usize) -> u64 {
        self.live[p].iter().sum()
    }
}

fn human(bytes: u64) -> String {
    let b = bytes as f64;
    if b >= 1e9 {
        format!("{:.3} GB", b / 1e9)
    } else if b >= 1e6 {
        format!("{:.1} MB", b / 1e6)
    } else if b >= 1e3 {
        format!("{:.1} kB", b / 1e3)
    } else {
        format!("{bytes} B")
    }
}

fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

/// A JSON string literal that is also safe inside a `<script>` element.
fn js_string(s: &str) -> String {
    serde_json::to_string(s).unwrap_or_else(|_| "\"\"".into()).replace("</", "<\\/")
}

/// An axis label: as few decimals as the tick step needs, in GB, MB or kB.
fn tick_label(bytes: f64, step: f64) -> String {
    let (unit, name) = if step >= 1e8 {
        (1e9, "GB")
    } else if step >= 1e5 {
        (1e6, "MB")
    } else if step >= 100.0 {
        (1e3, "kB")
    } else {
        (1.0, "B")
    };
    let decimals = if step / unit >= 1.0 {
        0
    } else if step / unit >= 0.1 {
        1
    } else {
        2
    };
    format!("{:.*} {name}", decimals, bytes / unit)
}

/// A "nice" tick step (1, 2 or 5 × 10^k) giving about `target` ticks up to `max`.
fn tick_step(max: f64, target: f64) -> f64 {
    let raw = (max / target).max(1.0);
    let magnitude = 10f64.powf(raw.log10().floor());
    let unit = [1.0, 2.0, 5.0, 10.0].into_iter().find(|m| m * magnitude >= raw).unwrap_or(10.0);
    unit * magnitude
}

/// Chart geometry, in SVG user units.
/// The fill of the host-memory band.
const HOST_COLOR: &str = "#d8cce8";

const LEFT: f64 = 78.0;
const TOP: f64 = 40.0;
const WIDTH: f64 = 840.0;
const HEIGHT: f64 = 360.0;

/// Writes the page for `trace` planned by `plan`.
pub fn memory_timeline_html(trace: &Trace, plan: &MemoryPlan, options: &TimelineOptions) -> String {
    let timeline = Timeline::new(trace, plan, &options.recomputed);
    let steps = timeline.live.len();
    let planned_peak = plan.planned_peak_bytes();
    let peak_position = plan.peak_position.min(steps.saturating_sub(1));

    // Columns: every position, or buckets showing each bucket's fullest position.
    let per_column = steps.div_ceil(MAX_COLUMNS).max(1);
    let columns: Vec<(usize, usize)> = (0..steps)
        .step_by(per_column)
        .map(|first| {
            let last = (first + per_column).min(steps);
            let fullest = (first..last).max_by_key(|&p| (timeline.total(p), std::cmp::Reverse(p))).unwrap_or(first);
            (first, fullest)
        })
        .collect();
    let n_cols = columns.len().max(1);
    let live_max = (0..steps).map(|p| timeline.total(p)).max().unwrap_or(0);
    let y_max = (planned_peak.max(live_max) as f64 * 1.08).max(1.0);
    let x_of = |col: usize| LEFT + WIDTH * col as f64 / n_cols as f64;
    let y_of = |bytes: f64| TOP + HEIGHT - HEIGHT * bytes / y_max;

    let mut svg = String::new();
    // Host tables, when the plan has them, as a band of their own below the axis.
    let host_bytes = timeline.host_bytes();
    let band_top = TOP + HEIGHT + 46.0;
    let total_h = if host_bytes > 0 { band_top + 52.0 } else { band_top };
    let _ = write!(
        svg,
        r#"<svg id="chart" viewBox="0 0 {w} {h}" width="{w}" height="{h}" role="img" aria-label="bytes live over the schedule">"#,
        w = LEFT + WIDTH + 20.0,
        h = total_h
    );
    // Phase bands along the top.
    let mut bands: Vec<(Phase, usize, usize)> = Vec::new();
    for (col, &(_, p)) in columns.iter().enumerate() {
        let phase = trace.nodes.get(p).map(|n| n.phase).unwrap_or(Phase::Forward);
        match bands.last_mut() {
            Some((ph, _, end)) if *ph == phase => *end = col + 1,
            _ => bands.push((phase, col, col + 1)),
        }
    }
    for (phase, a, b) in &bands {
        let fill = match phase {
            Phase::Forward => "#eef3f8",
            Phase::Backward => "#f8f0ee",
            Phase::Optimizer => "#eef6ee",
        };
        let _ = write!(
            svg,
            r#"<rect class="phase" x="{x:.1}" y="{y:.1}" width="{w:.1}" height="{h:.1}" fill="{fill}"/>"#,
            x = x_of(*a),
            y = TOP,
            w = x_of(*b) - x_of(*a),
            h = HEIGHT
        );
        if x_of(*b) - x_of(*a) > 60.0 {
            let _ = write!(
                svg,
                r##"<text x="{x:.1}" y="{y:.1}" class="phase-label">{name}</text>"##,
                x = x_of(*a) + 4.0,
                y = TOP + 14.0,
                name = phase.name()
            );
        }
    }
    // Y axis grid and labels.
    let step = tick_step(y_max, 6.0);
    let mut tick = 0.0;
    while tick <= y_max {
        let y = y_of(tick);
        let _ = write!(
            svg,
            r##"<line x1="{l}" x2="{r}" y1="{y:.1}" y2="{y:.1}" class="grid"/><text x="{tx}" y="{ty:.1}" class="axis" text-anchor="end">{label}</text>"##,
            l = LEFT,
            r = LEFT + WIDTH,
            tx = LEFT - 6.0,
            ty = y + 4.0,
            label = tick_label(tick, step)
        );
        tick += step;
    }
    // Stacked areas, bottom category first.
    let mut base = vec![0u64; n_cols];
    for cat in Category::ALL {
        let tops: Vec<u64> =
            columns.iter().enumerate().map(|(i, &(_, p))| base[i] + timeline.live[p][cat.index()]).collect();
        if tops.iter().zip(&base).all(|(t, b)| t == b) {
            continue;
        }
        let mut d = String::new();
        for (i, &t) in tops.iter().enumerate() {
            let y = y_of(t as f64);
            let cmd = if i == 0 { 'M' } else { 'L' };
            let _ = write!(d, "{cmd}{:.2},{:.2}L{:.2},{:.2}", x_of(i), y, x_of(i + 1), y);
        }
        for i in (0..n_cols).rev() {
            let y = y_of(base[i] as f64);
            let _ = write!(d, "L{:.2},{:.2}L{:.2},{:.2}", x_of(i + 1), y, x_of(i), y);
        }
        d.push('Z');
        let _ = write!(
            svg,
            r#"<path class="area" data-category="{label}" d="{d}" fill="{color}"><title>{label}</title></path>"#,
            label = cat.label(),
            color = cat.color()
        );
        base = tops;
    }
    // The planned peak (persistent + arena, fragmentation included) and the live peak.
    let yp = y_of(planned_peak as f64);
    let _ = write!(
        svg,
        r##"<line id="planned-peak" x1="{l}" x2="{r}" y1="{yp:.1}" y2="{yp:.1}" class="planned"/><text x="{tx}" y="{ty:.1}" class="marker" text-anchor="end">planned peak {pk} (persistent + arena)</text>"##,
        l = LEFT,
        r = LEFT + WIDTH,
        tx = LEFT + WIDTH - 4.0,
        ty = yp + 15.0,
        pk = human(planned_peak)
    );
    let peak_col = columns.iter().position(|&(first, _)| first + per_column > peak_position).unwrap_or(0);
    let xp = (x_of(peak_col) + x_of(peak_col + 1)) / 2.0;
    let anchor = if xp > LEFT + WIDTH * 0.6 { "end" } else { "start" };
    let dx = if anchor == "end" { -6.0 } else { 6.0 };
    let _ = write!(
        svg,
        r##"<line id="peak" x1="{xp:.1}" x2="{xp:.1}" y1="{t}" y2="{b}" class="peak"/><text x="{lx:.1}" y="{ly:.1}" class="marker" text-anchor="{anchor}">peak at node {peak_position}: {live} live</text>"##,
        t = TOP - 18.0,
        b = TOP + HEIGHT,
        lx = xp + dx,
        ly = TOP - 8.0,
        live = human(timeline.total(peak_position))
    );
    // X axis.
    let _ = write!(
        svg,
        r##"<line x1="{l}" x2="{r}" y1="{y}" y2="{y}" class="axisline"/><text x="{l}" y="{ty}" class="axis">0</text><text x="{r}" y="{ty}" class="axis" text-anchor="end">{steps} nodes</text><text x="{mid}" y="{ty2}" class="axis" text-anchor="middle">schedule position (node){bucket}</text>"##,
        l = LEFT,
        r = LEFT + WIDTH,
        y = TOP + HEIGHT,
        ty = TOP + HEIGHT + 16.0,
        ty2 = TOP + HEIGHT + 34.0,
        mid = LEFT + WIDTH / 2.0,
        bucket = if per_column > 1 {
            format!(", {per_column} nodes per column, each drawn at its fullest node")
        } else {
            String::new()
        }
    );
    if host_bytes > 0 {
        // The band's height at each column is its share of the most host
        // bytes live at once: flat for tables alone, rising through forward
        // and falling through backward where values are offloaded.
        let mut area = format!("M{:.1},{:.1}", x_of(0), band_top + 24.0);
        for (col, &(first, _)) in columns.iter().enumerate() {
            let last = columns.get(col + 1).map_or(steps, |c| c.0);
            let bytes = timeline.host_live[first..last].iter().copied().max().unwrap_or(0);
            let y = band_top + 24.0 - 24.0 * bytes as f64 / host_bytes as f64;
            let _ = write!(area, " L{:.1},{y:.1} L{:.1},{y:.1}", x_of(col), x_of(col + 1));
        }
        let _ = write!(area, " L{:.1},{:.1} Z", x_of(n_cols), band_top + 24.0);
        // Tables by name; offloaded values by count (their names are trace ids).
        let whole_step = |a: &&Allocation| a.start == 0 && a.end + 1 >= steps;
        let tables: Vec<&str> = timeline.host.iter().filter(whole_step).take(3).map(|a| a.name.as_str()).collect();
        let offloaded = timeline.host.len() - timeline.host.iter().filter(whole_step).count();
        let mut what = Vec::new();
        if !tables.is_empty() {
            what.push(format!("live over the whole step: {}", tables.join(", ")));
        }
        if offloaded > 0 {
            what.push(format!("{offloaded} values offloaded between forward and backward"));
        }
        let _ = write!(
            svg,
            r##"<rect id="host-band" x="{l}" y="{y}" width="{w}" height="24" fill="#f4f0f8"><title>host memory</title></rect><path id="host-live" d="{area}" fill="{HOST_COLOR}"/><text x="{l}" y="{ty}" class="host-label">host memory (page-locked), at most {bytes} at once; {what}</text>"##,
            l = LEFT,
            y = band_top,
            w = WIDTH,
            ty = band_top + 40.0,
            bytes = human(host_bytes),
            what = escape(&what.join("; "))
        );
    }
    let _ = write!(
        svg,
        r##"<line id="cursor" x1="0" x2="0" y1="{t}" y2="{b}" visibility="hidden"/><rect id="hover" x="{l}" y="{t}" width="{w}" height="{h}" fill="transparent"/></svg>"##,
        t = TOP,
        b = TOP + HEIGHT,
        l = LEFT,
        w = WIDTH,
        h = HEIGHT
    );

    // Legend with the breakdown at the peak, and the largest values there.
    let at_peak = timeline.live[peak_position];
    let mut legend = String::new();
    for cat in Category::ALL {
        let _ = write!(
            legend,
            r#"<li class="legend-item" data-category="{label}"><span class="swatch" style="background:{color}"></span>{label}<span class="num">{bytes}</span></li>"#,
            label = cat.label(),
            color = cat.color(),
            bytes = human(at_peak[cat.index()])
        );
    }
    let mut largest: Vec<&Allocation> = timeline
        .allocations
        .iter()
        .filter(|a| {
            a.start <= peak_position
                && peak_position <= a.end
                && a.category != Category::Parameters
                && a.category != Category::OptimizerState
        })
        .collect();
    largest.sort_by_key(|a| std::cmp::Reverse(a.bytes));
    let mut peak_list = String::new();
    for a in largest.iter().take(8) {
        let _ = write!(
            peak_list,
            r#"<li><span class="swatch" style="background:{color}"></span><span class="num">{bytes}</span> {ty} <span class="dim">{name}</span></li>"#,
            color = a.category.color(),
            bytes = human(a.bytes),
            ty = escape(&a.ty),
            name = escape(&a.name)
        );
    }

    // Data for the hover read-out and the table.
    let mut cols_js = String::from("[");
    for (i, &(first, p)) in columns.iter().enumerate() {
        if i > 0 {
            cols_js.push(',');
        }
        let node = trace.nodes.get(p);
        let label = node.map(|n| format!("{} ({})", n.op.name(), n.phase.name())).unwrap_or_default();
        let live = timeline.live[p];
        let _ = write!(
            cols_js,
            "[{first},{p},{},[{}]]",
            js_string(&label),
            live.iter().map(|b| b.to_string()).collect::<Vec<_>>().join(",")
        );
    }
    cols_js.push(']');
    // The table lists host tables too, their producer saying where they live.
    let mut rows_js = String::from("[");
    let rows = timeline.allocations.iter().map(|a| (a, "")).chain(timeline.host.iter().map(|a| (a, " in host memory")));
    for (i, (a, place)) in rows.enumerate() {
        if i > 0 {
            rows_js.push(',');
        }
        let _ = write!(
            rows_js,
            "[{},{},{},{},{},{},{}]",
            js_string(&a.name),
            js_string(&a.ty),
            a.category.index(),
            js_string(&format!("{}{place}", a.producer)),
            a.start,
            a.end,
            a.bytes
        );
    }
    rows_js.push(']');
    let cats_js = format!(
        "[{}]",
        Category::ALL
            .iter()
            .map(|c| format!("[{},{}]", js_string(c.label()), js_string(c.color())))
            .collect::<Vec<_>>()
            .join(",")
    );

    let title =
        if options.title.is_empty() { format!("memory plan of `{}`", trace.name) } else { options.title.clone() };
    let host_note = if host_bytes > 0 {
        format!("; page-locked host memory up to {} at once, outside the device peak", human(host_bytes))
    } else {
        String::new()
    };
    let summary = format!(
        "planned peak <b id=\"planned-peak-value\">{}</b> ({} B) = persistent {} + arena {}; live bytes peak at node {} with {}; {} nodes, {} allocations{host_note}",
        human(planned_peak),
        planned_peak,
        human(plan.persistent_bytes),
        human(plan.arena_bytes),
        peak_position,
        human(timeline.total(peak_position)),
        steps,
        timeline.allocations.len()
    );
    let mut page = String::with_capacity(svg.len() + rows_js.len() + 8192);
    let _ = write!(
        page,
        r##"<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{title_esc} — stepgraph memory timeline</title>
<style>
body {{ font: 14px/1.4 system-ui, -apple-system, "Segoe UI", sans-serif; margin: 20px 28px; color: #222; background: #fff; }}
h1 {{ font-size: 20px; margin: 0 0 4px; }}
.summary {{ color: #444; margin: 0 0 14px; }}
.top {{ display: flex; gap: 22px; align-items: flex-start; flex-wrap: wrap; }}
.side {{ width: 380px; }}
.side h2 {{ font-size: 14px; margin: 4px 0 6px; }}
ul {{ list-style: none; padding: 0; margin: 0 0 14px; }}
li {{ padding: 2px 0; white-space: nowrap; overflow: hidden; text-overflow: ellipsis; }}
.swatch {{ display: inline-block; width: 11px; height: 11px; margin-right: 6px; border-radius: 2px; vertical-align: -1px; }}
.num {{ font-variant-numeric: tabular-nums; float: right; margin-left: 12px; }}
#peak-values .num {{ float: none; margin: 0 6px 0 0; display: inline-block; min-width: 70px; text-align: right; }}
.dim {{ color: #777; }}
svg text {{ font: 12px system-ui, sans-serif; fill: #333; }}
.grid {{ stroke: #ddd; stroke-width: 1; }}
.axisline {{ stroke: #888; }}
.phase-label {{ fill: #8a8a8a; font-size: 11px; }}
.host-label {{ fill: #3d2a57; font-size: 12px; }}
.planned {{ stroke: #222; stroke-dasharray: 6 4; stroke-width: 1.3; }}
.peak {{ stroke: #c00; stroke-width: 1.5; }}
.marker {{ fill: #222; font-weight: 600; }}
#cursor {{ stroke: #333; stroke-width: 1; stroke-dasharray: 2 2; }}
#tooltip {{ position: fixed; pointer-events: none; background: rgba(255,255,255,.96); border: 1px solid #bbb; border-radius: 4px; padding: 6px 8px; font-size: 12px; display: none; box-shadow: 0 2px 6px rgba(0,0,0,.15); }}
table {{ border-collapse: collapse; margin-top: 8px; font-size: 12.5px; }}
th, td {{ padding: 3px 8px; border-bottom: 1px solid #eee; text-align: left; }}
th {{ cursor: pointer; background: #f6f6f6; position: sticky; top: 0; }}
td.n {{ text-align: right; font-variant-numeric: tabular-nums; }}
.controls {{ margin-top: 18px; }}
input[type=search] {{ width: 280px; padding: 3px 6px; }}
</style></head>
<body>
<h1>{title_esc}</h1>
<p class="summary">{summary}</p>
<div class="top">
{svg}
<div class="side">
<h2>at the peak (node {peak_position}), by category</h2>
<ul id="legend">{legend}</ul>
<h2>largest values live at the peak</h2>
<ul id="peak-values">{peak_list}</ul>
</div>
</div>
<div id="tooltip"></div>
<div class="controls"><b>Allocations</b> (one row per planned allocation; click a heading to sort) —
<input type="search" id="filter" placeholder="filter by name, type, op or category">
<label>show <select id="limit"><option>100</option><option>1000</option><option value="0">all</option></select></label>
<span id="shown" class="dim"></span></div>
<table id="values"><thead><tr><th data-k="0">name</th><th data-k="1">type</th><th data-k="2">category</th><th data-k="3">produced by</th><th data-k="4">first node</th><th data-k="5">last node</th><th data-k="6">bytes</th></tr></thead><tbody></tbody></table>
<script>
"use strict";
const CATS = {cats_js};
const COLS = {cols_js};
const ROWS = {rows_js};
const GEOM = {{left: {left}, width: {width}, ncols: {ncols}}};
function human(b) {{
  if (b >= 1e9) return (b / 1e9).toFixed(3) + " GB";
  if (b >= 1e6) return (b / 1e6).toFixed(1) + " MB";
  if (b >= 1e3) return (b / 1e3).toFixed(1) + " kB";
  return b + " B";
}}
const svg = document.getElementById("chart");
const tip = document.getElementById("tooltip");
const cursor = document.getElementById("cursor");
document.getElementById("hover").addEventListener("mousemove", (e) => {{
  const pt = svg.createSVGPoint(); pt.x = e.clientX; pt.y = e.clientY;
  const p = pt.matrixTransform(svg.getScreenCTM().inverse());
  const i = Math.max(0, Math.min(GEOM.ncols - 1, Math.floor((p.x - GEOM.left) / GEOM.width * GEOM.ncols)));
  const c = COLS[i];
  const x = GEOM.left + GEOM.width * (i + 0.5) / GEOM.ncols;
  cursor.setAttribute("x1", x); cursor.setAttribute("x2", x); cursor.setAttribute("visibility", "visible");
  let total = 0; let lines = "";
  for (let k = CATS.length - 1; k >= 0; k--) {{
    total += c[3][k];
    if (c[3][k] > 0) lines += `<div><span class="swatch" style="background:${{CATS[k][1]}}"></span>${{CATS[k][0]}}: ${{human(c[3][k])}}</div>`;
  }}
  tip.innerHTML = `<b>node ${{c[1]}}</b> ${{c[2].replace(/</g, "&lt;")}}<br>${{human(total)}} live${{lines}}`;
  tip.style.display = "block";
  tip.style.left = Math.min(e.clientX + 14, window.innerWidth - 260) + "px";
  tip.style.top = (e.clientY + 14) + "px";
}});
document.getElementById("hover").addEventListener("mouseleave", () => {{ tip.style.display = "none"; cursor.setAttribute("visibility", "hidden"); }});
let sortKey = 6, sortDesc = true;
function render() {{
  const q = document.getElementById("filter").value.toLowerCase();
  const limit = Number(document.getElementById("limit").value);
  let rows = ROWS.filter(r => !q || (r[0] + " " + r[1] + " " + r[3] + " " + CATS[r[2]][0]).toLowerCase().includes(q));
  rows.sort((a, b) => {{
    const x = sortKey === 2 ? CATS[a[2]][0] : a[sortKey], y = sortKey === 2 ? CATS[b[2]][0] : b[sortKey];
    const o = x < y ? -1 : x > y ? 1 : 0; return sortDesc ? -o : o;
  }});
  const total = rows.length;
  if (limit > 0) rows = rows.slice(0, limit);
  const esc = s => String(s).replace(/&/g, "&amp;").replace(/</g, "&lt;");
  document.querySelector("#values tbody").innerHTML = rows.map(r =>
    `<tr><td>${{esc(r[0])}}</td><td>${{esc(r[1])}}</td><td><span class="swatch" style="background:${{CATS[r[2]][1]}}"></span>${{CATS[r[2]][0]}}</td><td>${{esc(r[3])}}</td><td class="n">${{r[4]}}</td><td class="n">${{r[5]}}</td><td class="n" title="${{r[6]}} B">${{human(r[6])}}</td></tr>`).join("");
  document.getElementById("shown").textContent = `${{rows.length}} of ${{total}} shown`;
}}
document.querySelectorAll("#values th").forEach(th => th.addEventListener("click", () => {{
  const k = Number(th.dataset.k); sortDesc = k === sortKey ? !sortDesc : (k === 6); sortKey = k; render();
}}));
document.getElementById("filter").addEventListener("input", render);
document.getElementById("limit").addEventListener("change", render);
render();
</script>
</body></html>
"##,
        title_esc = escape(&title),
        left = LEFT,
        width = WIDTH,
        ncols = n_cols,
    );
    page
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::autodiff::StepKind;
    use crate::ir::{DType, NodeId};
    use crate::models::{LossKind, ModelSpec};
    use crate::pipeline::{compile_step, StepOptions};

    fn tiny(kind: StepKind) -> crate::pipeline::CompiledStep {
        let spec = ModelSpec::named("tiny-llama", 1, 8, DType::F32, LossKind::CrossEntropy).unwrap();
        compile_step(&spec, &StepOptions::new(kind)).unwrap()
    }

    #[test]
    fn live_bytes_add_up_to_the_plan() {
        let c = tiny(StepKind::Train);
        let t = Timeline::new(&c.step, &c.plan, &[]);
        assert_eq!(t.live.len(), c.step.nodes.len());
        // Persistent bytes are live everywhere; arena bytes never exceed the arena.
        for p in 0..t.live.len() {
            let persistent = t.live[p][Category::Parameters.index()] + t.live[p][Category::OptimizerState.index()];
            assert_eq!(persistent, c.plan.persistent_bytes, "position {p}");
            assert!(t.total(p) - persistent <= c.plan.arena_bytes, "position {p}");
        }
        // At the planner's peak position, live arena bytes are its floor.
        let p = c.plan.peak_position;
        assert_eq!(t.total(p) - c.plan.persistent_bytes, c.plan.arena_floor_bytes);
        let grads: u64 = t.allocations.iter().filter(|a| a.category == Category::Gradients).map(|a| a.bytes).sum();
        assert!(grads > 0);
        assert!(t.allocations.iter().any(|a| a.category == Category::SavedActivations));
        assert!(t.allocations.windows(2).all(|w| w[0].bytes >= w[1].bytes));
    }

    /// A frozen embedding moved to host memory under a budget is a band of
    /// its own, not part of the device chart, and a row of the table.
    #[test]
    fn host_tables_are_a_band_of_their_own() {
        use crate::models::{Adapters, LoraTarget};
        use crate::passes::recompute::RecomputePolicy;
        let mut spec = ModelSpec::named("tiny-llama", 1, 8, DType::F32, LossKind::CrossEntropy).unwrap();
        spec.adapters = Some(Adapters::new(2, 4.0, LoraTarget::ALL.to_vec()).unwrap());
        let plain = compile_step(&spec, &StepOptions::new(StepKind::Train)).unwrap();
        let budget = StepOptions {
            recompute: RecomputePolicy::Budget(plain.planned_peak_bytes() - 1),
            ..StepOptions::new(StepKind::Train)
        };
        let c = compile_step(&spec, &budget).unwrap();
        assert!(c.plan.host_bytes > 0);
        let t = Timeline::new(&c.step, &c.plan, &[]);
        assert_eq!(t.host_bytes(), c.plan.host_bytes);
        assert_eq!(t.host[0].name, "model.embed_tokens.weight");
        // The device chart holds the persistent bytes alone, host ones apart.
        let p = t.live.len() / 2;
        let persistent = t.live[p][Category::Parameters.index()] + t.live[p][Category::OptimizerState.index()];
        assert_eq!(persistent, c.plan.persistent_bytes);
        let html = memory_timeline_html(&c.step, &c.plan, &TimelineOptions::default());
        assert!(html.contains(r#"id="host-band""#) && html.contains("host memory (page-locked)"));
        assert!(html.contains(&human(c.plan.host_bytes)));
        assert!(html.contains("frozen weight in host memory"));
        let plain_html = memory_timeline_html(&plain.step, &plain.plan, &TimelineOptions::default());
        assert!(!plain_html.contains("host-band"));
    }

    /// Offloaded values are in the host band for their lifetimes only: the
    /// band rises through forward and falls through backward.
    #[test]
    fn offloaded_values_fill_the_host_band_between_forward_and_backward() {
        use crate::passes::recompute::RecomputePolicy;
        let o = crate::models::Overrides { n_layer: Some(8), block_size: Some(2048), ..Default::default() };
        let config = crate::models::Config::named("tiny-llama").unwrap().with_overrides(&o).unwrap();
        let spec = ModelSpec {
            config,
            batch: 1,
            seq: 2048,
            ..ModelSpec::named("tiny-llama", 1, 8, DType::F32, LossKind::CrossEntropy).unwrap()
        };
        let grads = StepOptions::new(StepKind::Grads);
        let least = match compile_step(&spec, &StepOptions { recompute: RecomputePolicy::Budget(1), ..grads.clone() }) {
            Err(crate::Error::MemoryBudget { least, .. }) => least,
            other => panic!("{:?}", other.map(|c| c.planned_peak_bytes())),
        };
        let c = compile_step(&spec, &StepOptions { recompute: RecomputePolicy::Budget(least), ..grads }).unwrap();
        let t = Timeline::new(&c.step, &c.plan, &[]);
        // Leaves kept in host memory (weights, states) are there all along;
        // the values only between forward and backward.
        let whole = |a: &&Allocation| a.start == 0 && a.end + 1 >= t.live.len();
        let values: Vec<&Allocation> = t.host.iter().filter(|a| !whole(a)).collect();
        assert!(!values.is_empty() && values.iter().all(|a| a.start > 0 && a.end + 1 < t.live.len()));
        let leaves: u64 = t.host.iter().filter(whole).map(|a| a.bytes).sum();
        let (first, last) = (t.host_live[0], *t.host_live.last().unwrap());
        assert_eq!(
            (first, last),
            (leaves, leaves),
            "no value is offloaded before forward writes it or after backward reads it"
        );
        assert!(t.host_bytes() > 0 && t.host_bytes() <= c.plan.host_bytes);
        let html = memory_timeline_html(&c.step, &c.plan, &TimelineOptions::default());
        assert!(html.contains(r#"id="host-live""#) && html.contains("values offloaded between forward and backward"));
    }

    #[test]
    fn recomputed_nodes_get_their_own_category() {
        let c = tiny(StepKind::Grads);
        let backward: Vec<NodeId> = (0..c.step.nodes.len())
            .map(|i| NodeId(i as u32))
            .filter(|n| c.step.node(*n).phase == Phase::Backward)
            .take(3)
            .collect();
        let t = Timeline::new(&c.step, &c.plan, &backward);
        assert!(t.allocations.iter().any(|a| a.category == Category::Recomputed));
        let plain = Timeline::new(&c.step, &c.plan, &[]);
        assert!(!plain.allocations.iter().any(|a| a.category == Category::Recomputed));
    }

    #[test]
    fn the_page_is_self_contained_and_marks_the_peak() {
        let c = tiny(StepKind::Train);
        let html = memory_timeline_html(
            &c.step,
            &c.plan,
            &TimelineOptions { title: "tiny <test>".into(), recomputed: vec![] },
        );
        assert!(html.starts_with("<!DOCTYPE html>"));
        assert!(html.contains("tiny &lt;test&gt;"));
        assert!(html.contains(r#"id="peak""#) && html.contains(r#"id="planned-peak""#));
        assert!(html.contains(&format!("({} B)", c.plan.planned_peak_bytes())));
        for cat in Category::ALL {
            assert!(html.contains(cat.label()), "{}", cat.label());
        }
        assert!(!html.contains("http://") && !html.contains("https://") && !html.contains("src="), "no network");
    }

    fn columns_of(html: &str) -> Vec<serde_json::Value> {
        let cols = html.split("const COLS = ").nth(1).unwrap().split(";\n").next().unwrap();
        serde_json::from_str::<serde_json::Value>(cols).unwrap().as_array().unwrap().clone()
    }

    #[test]
    fn short_schedules_draw_every_node() {
        assert_eq!(tick_step(1e9, 5.0), 2e8);
        assert_eq!(tick_step(7.3e9, 6.0), 2e9);
        let c = tiny(StepKind::Train);
        let html = memory_timeline_html(&c.step, &c.plan, &TimelineOptions::default());
        assert_eq!(columns_of(&html).len(), c.step.nodes.len());
    }

    #[test]
    fn long_schedules_are_bucketed_at_their_fullest_node() {
        let mut spec = ModelSpec::named("tiny-llama", 1, 8, DType::F32, LossKind::CrossEntropy).unwrap();
        spec.config.n_layer = 120;
        let c = compile_step(&spec, &StepOptions::new(StepKind::Train)).unwrap();
        let steps = c.step.nodes.len();
        assert!(steps > MAX_COLUMNS, "{steps} nodes");
        let t = Timeline::new(&c.step, &c.plan, &[]);
        let html = memory_timeline_html(&c.step, &c.plan, &TimelineOptions::default());
        let cols = columns_of(&html);
        assert!(cols.len() <= MAX_COLUMNS);
        let per = steps.div_ceil(MAX_COLUMNS);
        for col in &cols {
            let first = col[0].as_u64().unwrap() as usize;
            let shown = col[1].as_u64().unwrap() as usize;
            let best = (first..(first + per).min(steps)).map(|p| t.total(p)).max().unwrap();
            assert_eq!(t.total(shown), best, "column from node {first}");
        }
        // The planner's peak survives bucketing.
        let drawn_max = cols.iter().map(|c| t.total(c[1].as_u64().unwrap() as usize)).max().unwrap();
        assert_eq!(drawn_max, (0..steps).map(|p| t.total(p)).max().unwrap());
    }
}
