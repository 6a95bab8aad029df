//! Plan reports: byte counts by category and the values live at the peak,
//! as a struct that prints as text and serialises to JSON.

use serde::Serialize;

use super::{MemoryPlan, Region};
use crate::ir::{OutputKind, Trace, ValueKind};

/// One value live at the peak.
#[derive(Clone, Debug, Serialize)]
pub struct LiveValue {
    pub value: String,
    pub bytes: u64,
    pub ty: String,
}

/// What `stepgraph plan` reports.
#[derive(Clone, Debug, Serialize)]
pub struct PlanReport {
    pub trace: String,
    pub nodes: usize,
    pub values: usize,
    /// Trained parameters.
    pub param_bytes: u64,
    /// Frozen weights (the base model under adapters).
    pub frozen_bytes: u64,
    /// How the frozen weights are stored (`bf16`, `nf4`), when there are any.
    pub frozen_storage: Option<String>,
    pub optimizer_state_bytes: u64,
    /// Of `optimizer_state_bytes`, what the plan keeps in page-locked host
    /// memory (the offload pass).
    pub optimizer_state_host_bytes: u64,
    /// Of `param_bytes` and of `frozen_bytes`, the weights the plan keeps
    /// in page-locked host memory and copies to the device for forward and
    /// for backward (the offload pass).
    pub param_host_bytes: u64,
    pub frozen_host_bytes: u64,
    pub persistent_bytes: u64,
    pub gradient_bytes: u64,
    pub saved_for_backward_bytes: u64,
    pub arena_bytes: u64,
    pub arena_floor_bytes: u64,
    /// Page-locked host memory ([`super::Region::Host`]), not part of
    /// the persistent bytes or the planned peak: frozen embedding tables
    /// and values offloaded between forward and backward.
    pub host_bytes: u64,
    /// Of `host_bytes`, the frozen embedding tables (part of `frozen_bytes`).
    pub host_table_bytes: u64,
    /// Values copied to host memory after forward writes them and back
    /// before backward reads them (the offload pass), and the
    /// bytes those copies move per step, both directions together.
    pub offloaded_values: usize,
    pub copied_bytes_per_step: u64,
    /// Of `offloaded_values`, optimizer states kept in host memory and
    /// copied to the device around their update.
    pub offloaded_states: usize,
    /// Of `offloaded_values`, weights kept in host memory.
    pub offloaded_weights: usize,
    pub planned_peak_bytes: u64,
    pub floor_bytes: u64,
    /// `planned_peak_bytes / floor_bytes - 1`: what the placement loses to fragmentation.
    pub overhead_vs_floor: f64,
    pub peak_position: usize,
    pub largest_at_peak: Vec<LiveValue>,
}

/// Summarises `plan` for `trace`, listing the `top` largest values live at the peak.
pub fn plan_report(trace: &Trace, plan: &MemoryPlan, top: usize) -> PlanReport {
    let param_bytes = trace.leaf_bytes(|k| matches!(k, ValueKind::Param { .. }));
    let frozen_bytes = trace.leaf_bytes(|k| matches!(k, ValueKind::Frozen { .. }));
    let frozen_storage = frozen_storage(trace);
    let optimizer_state_bytes = trace.leaf_bytes(|k| matches!(k, ValueKind::State { .. }));
    // A value may be listed more than once, so these sums may pass the
    // plan's cap on distinct bytes: they saturate rather than wrap.
    let gradient_bytes = trace
        .outputs
        .iter()
        .filter(|o| matches!(o.kind, OutputKind::Grad(_)))
        .map(|o| trace.ty(o.value).bytes())
        .fold(0, u64::saturating_add);
    let saved_for_backward_bytes = trace.saved.iter().map(|v| trace.ty(*v).bytes()).fold(0, u64::saturating_add);
    // The largest first, then described: describing each of the thousands
    // live at a deep model's peak would cost a scan of the outputs apiece.
    let mut live: Vec<&super::Group> = plan
        .groups
        .iter()
        .filter(|g| g.region == Region::Arena && g.start <= plan.peak_position && plan.peak_position <= g.end)
        .collect();
    live.sort_by_key(|g| std::cmp::Reverse(g.bytes));
    live.truncate(top);
    let live: Vec<LiveValue> = live
        .into_iter()
        .map(|g| {
            let v = g.members[0];
            LiveValue { value: trace.describe(v), bytes: g.bytes, ty: trace.ty(v).to_string() }
        })
        .collect();
    let floor = plan.floor_bytes();
    let copies: Vec<_> = trace.nodes.iter().filter(|n| matches!(n.op, crate::ops::Op::HostCopy(_))).collect();
    // Forward values copied out (not into a leaf), and the leaves kept on the host.
    let copied_out =
        copies.iter().filter(|n| matches!(&n.op, crate::ops::Op::HostCopy(h) if h.to_host && !h.into_state)).count();
    let host_leaves: Vec<&crate::ir::Value> = (super::host_states(trace).iter().enumerate())
        .filter(|(_, &host)| host)
        .map(|(v, _)| &trace.values[v])
        .collect();
    let host_leaf_bytes = |kind: fn(&ValueKind) -> bool| -> u64 {
        host_leaves.iter().filter(|v| kind(&v.kind)).map(|v| v.ty.bytes()).fold(0, u64::saturating_add)
    };
    let param_host_bytes = host_leaf_bytes(|k| matches!(k, ValueKind::Param { .. }));
    let frozen_host_bytes = host_leaf_bytes(|k| matches!(k, ValueKind::Frozen { .. }));
    let offloaded_states = host_leaves.iter().filter(|v| matches!(v.kind, ValueKind::State { .. })).count();
    let offloaded_weights = host_leaves.len() - offloaded_states;
    let offloaded_values = copied_out + host_leaves.len();
    let copied_bytes_per_step = copies.iter().map(|n| trace.ty(n.outputs[0]).bytes()).fold(0, u64::saturating_add);
    PlanReport {
        trace: trace.name.clone(),
        nodes: trace.nodes.len(),
        values: trace.values.len(),
        param_bytes,
        frozen_bytes,
        frozen_storage,
        optimizer_state_bytes,
        optimizer_state_host_bytes: plan.host_state_bytes,
        param_host_bytes,
        frozen_host_bytes,
        persistent_bytes: plan.persistent_bytes,
        gradient_bytes,
        saved_for_backward_bytes,
        arena_bytes: plan.arena_bytes,
        arena_floor_bytes: plan.arena_floor_bytes,
        host_bytes: plan.host_bytes,
        host_table_bytes: plan.host_table_bytes,
        offloaded_values,
        copied_bytes_per_step,
        offloaded_states,
        offloaded_weights,
        planned_peak_bytes: plan.planned_peak_bytes(),
        floor_bytes: floor,
        overhead_vs_floor: plan.planned_peak_bytes() as f64 / floor.max(1) as f64 - 1.0,
        peak_position: plan.peak_position,
        largest_at_peak: live,
    }
}

/// How a trace's frozen weights are stored: `nf4` when its matrices are
/// 4-bit codes (leaves named `*.nf4_codes`), else the dtype of its matrices
/// (of any frozen leaf when there are none); `None` without frozen weights.
fn frozen_storage(trace: &Trace) -> Option<String> {
    let frozen: Vec<_> = trace.frozen().collect();
    if frozen.iter().any(|&v| trace.value(v).kind.leaf_name().is_some_and(|n| n.ends_with(".nf4_codes"))) {
        return Some("nf4".into());
    }
    let matrix = frozen.iter().find(|&&v| trace.ty(v).rank() == 2).or(frozen.first());
    matrix.map(|&v| trace.ty(v).dtype.to_string())
}

fn gb(b: u64) -> String {
    format!("{:.3} GB", b as f64 / 1e9)
}

impl PlanReport {
    /// The report without the floor and the values live at the peak (IR
    /// ids a user rarely needs): bytes by kind and the planned peak. The
    /// full report is the `Display` of the report itself.
    pub fn brief(&self) -> impl std::fmt::Display + '_ {
        Brief(self)
    }

    /// What waits in host memory, by kind: values between forward and
    /// backward, optimizer states, weights.
    fn offloaded_parts(&self) -> String {
        let values = self.offloaded_values - self.offloaded_states - self.offloaded_weights;
        let parts = [
            (values, "values wait there between forward and backward"),
            (self.offloaded_states, "optimizer states, copied to the device around their update"),
            (self.offloaded_weights, "weights, copied to the device for forward and again for backward"),
        ];
        let said: Vec<String> = parts.iter().filter(|(n, _)| *n > 0).map(|(n, what)| format!("{n} {what}")).collect();
        said.join("; ")
    }

    fn write_bytes(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "plan for `{}`: {} nodes, {} values", self.trace, self.nodes, self.values)?;
        writeln!(f, "  persistent       {:>14} B  {}", self.persistent_bytes, gb(self.persistent_bytes))?;
        match &self.frozen_storage {
            Some(storage) => {
                let base = format!("base ({storage})");
                let on_device = self.frozen_bytes.saturating_sub(self.host_table_bytes + self.frozen_host_bytes);
                match self.frozen_host_bytes {
                    0 => writeln!(f, "    {base:<15}{on_device:>14} B  {}  (frozen)", gb(on_device))?,
                    host => writeln!(
                        f,
                        "    {base:<15}{on_device:>14} B  {}  (frozen; and {host} B in host memory)",
                        gb(on_device)
                    )?,
                }
                writeln!(f, "    adapters       {:>14} B  {}", self.param_bytes, gb(self.param_bytes))?;
            }
            None => {
                let on_device = self.param_bytes.saturating_sub(self.param_host_bytes);
                match self.param_host_bytes {
                    0 => writeln!(f, "    parameters     {on_device:>14} B  {}", gb(on_device))?,
                    host => writeln!(
                        f,
                        "    parameters     {on_device:>14} B  {}  (and {host} B in host memory)",
                        gb(on_device)
                    )?,
                }
            }
        }
        let on_device = self.optimizer_state_bytes.saturating_sub(self.optimizer_state_host_bytes);
        match self.optimizer_state_host_bytes {
            0 => writeln!(f, "    optimizer      {on_device:>14} B  {}", gb(on_device))?,
            host => {
                writeln!(f, "    optimizer      {on_device:>14} B  {}  (and {host} B in host memory)", gb(on_device))?
            }
        }
        writeln!(f, "  arena            {:>14} B  {}", self.arena_bytes, gb(self.arena_bytes))?;
        writeln!(
            f,
            "    gradients      {:>14} B  {}  (outputs, planned in the arena)",
            self.gradient_bytes,
            gb(self.gradient_bytes)
        )?;
        writeln!(
            f,
            "    saved for bwd  {:>14} B  {}",
            self.saved_for_backward_bytes,
            gb(self.saved_for_backward_bytes)
        )?;
        writeln!(f, "  planned peak     {:>14} B  {}", self.planned_peak_bytes, gb(self.planned_peak_bytes))?;
        if self.host_table_bytes > 0 {
            writeln!(
                f,
                "  host tables      {:>14} B  {}  (frozen embedding, page-locked host memory read one row per token; not in the peak)",
                self.host_table_bytes,
                gb(self.host_table_bytes)
            )?;
        }
        if self.offloaded_values > 0 {
            let offloaded = self.host_bytes.saturating_sub(self.host_table_bytes);
            writeln!(
                f,
                "  host offload     {:>14} B  {}  ({}; page-locked host memory, not in the peak)",
                offloaded,
                gb(offloaded),
                self.offloaded_parts()
            )?;
            writeln!(
                f,
                "    copied/step    {:>14} B  {}  (between host and device, on a copy stream beside the compute)",
                self.copied_bytes_per_step,
                gb(self.copied_bytes_per_step)
            )?;
        }
        Ok(())
    }
}

struct Brief<'a>(&'a PlanReport);

impl std::fmt::Display for Brief<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.write_bytes(f)
    }
}

impl std::fmt::Display for PlanReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.write_bytes(f)?;
        writeln!(
            f,
            "  floor            {:>14} B  {}  (planned peak is {:+.2}% over it)",
            self.floor_bytes,
            gb(self.floor_bytes),
            self.overhead_vs_floor * 100.0
        )?;
        writeln!(f, "  largest values live at the peak (node {}):", self.peak_position)?;
        for l in &self.largest_at_peak {
            writeln!(f, "    {:>12} B  {:<22} {}", l.bytes, l.ty, l.value)?;
        }
        Ok(())
    }
}
