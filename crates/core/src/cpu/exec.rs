//! Running a planned program on the CPU.
//!
//! A [`CpuSession`] owns one host buffer for persistent state and one for the
//! arena, laid out exactly as the [`MemoryPlan`] says. It runs the step
//! eagerly (walking the trace, resolving each value's address from the plan
//! at every node) or by replay: [`CpuSession::record`] resolves every kernel
//! call's addresses once into a launch list, and [`CpuSession::replay`] runs
//! that list, the CPU analogue of a CUDA graph. Both run the same kernels on
//! the same addresses and so give the same bits.
//!
//! Before allocating, a session refuses a plan larger than the host memory
//! available, naming both numbers ([`memory`]); its buffers are allocated
//! fallibly, so a failed allocation is an error rather than an abort.
//!
//! Between steps only step inputs are written and outputs read; token ids are
//! checked against the tables and vocabularies that consume them before the
//! step runs.
//!
//! A session of a data-parallel step is one rank: [`CpuSession::set_comm`]
//! gives it the communicator its collective kernels use, and a step that
//! fails on this rank aborts the group so the other ranks do not wait for it.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::host::memory;
use crate::host::HostTensor;
use crate::ir::{DType, Trace, ValueId, ValueKind};
use crate::ops::kernel::Communicator;
use crate::ops::kernel::{KernelIo, TensorView};
use crate::ops::Op;
use crate::plan::{MemoryPlan, Region};
use crate::session::{Session, SessionMemory};

/// Host memory aligned to 64 bytes (whole cache lines, and more than any dtype needs).
struct HostBuffer {
    words: Vec<[u64; 8]>,
    len: usize,
}

impl HostBuffer {
    /// A buffer of `len` bytes filled with 0xFF (NaN for every float type),
    /// so a kernel that reads memory it never wrote shows up in tests; an
    /// allocation that fails is an error naming `what`.
    fn new(len: u64, what: &str) -> Result<Self> {
        // Within `usize` on every host that can hold a plan (the plan's
        // sizes are at most 2^60); a 32-bit host refuses larger ones here.
        let len = usize::try_from(len).map_err(|_| Error::Allocation { what: what.to_string(), bytes: len })?;
        Ok(HostBuffer { words: memory::try_vec(len.div_ceil(64).max(1), [u64::MAX; 8], what)?, len })
    }

    fn base(&mut self) -> *mut u8 {
        self.words.as_mut_ptr() as *mut u8
    }
}

/// One recorded kernel call: the node and the addresses of its operands.
struct Launch {
    node: usize,
    inputs: Vec<TensorView>,
    outputs: Vec<TensorView>,
}

/// A planned step program bound to host memory.
pub struct CpuSession {
    trace: Trace,
    plan: MemoryPlan,
    persistent: HostBuffer,
    arena: HostBuffer,
    /// [`Region::Host`]: on the CPU, host memory like the rest.
    host: HostBuffer,
    launches: Option<Vec<Launch>>,
    /// Step inputs that index something, checked when written.
    id_checks: Vec<IdCheck>,
    /// This rank's communicator, for steps with collective ops.
    comm: Option<Arc<dyn Communicator>>,
}

impl CpuSession {
    /// Allocates host memory for `plan`, after refusing a plan larger than
    /// the host memory available ([`memory::check_fits`]).
    pub fn new(trace: Trace, plan: MemoryPlan) -> Result<Self> {
        if plan.slots.len() != trace.values.len() {
            return Err(Error::Cpu("the plan does not belong to this trace".into()));
        }
        memory::check_fits(plan.planned_peak_bytes() + plan.host_bytes, &format!("the planned step `{}`", trace.name))?;
        let id_checks = id_checks(&trace);
        Ok(CpuSession {
            persistent: HostBuffer::new(
                plan.persistent_bytes,
                "the persistent buffer (parameters and optimizer state)",
            )?,
            arena: HostBuffer::new(plan.arena_bytes, "the arena")?,
            host: HostBuffer::new(plan.host_bytes, "the host tables and offloaded values")?,
            trace,
            plan,
            launches: None,
            id_checks,
            comm: None,
        })
    }

    /// Makes this session one rank of `comm`'s group. Every collective of the
    /// trace must be for a group of that size.
    pub fn set_comm(&mut self, comm: Arc<dyn Communicator>) -> Result<()> {
        for node in &self.trace.nodes {
            if let Some(world) = crate::ops::collective::world_of(&node.op) {
                if world != comm.world() {
                    return Err(Error::Collective(format!(
                        "`{}` is for {world} ranks, but the communicator has {}",
                        node.op.name(),
                        comm.world()
                    )));
                }
            }
        }
        self.comm = Some(comm);
        Ok(())
    }

    /// The rank of this session (0 without a communicator).
    pub fn rank(&self) -> usize {
        self.comm.as_ref().map_or(0, |c| c.rank())
    }

    pub fn trace(&self) -> &Trace {
        &self.trace
    }

    pub fn plan(&self) -> &MemoryPlan {
        &self.plan
    }

    /// Bytes of host memory this session holds for the step.
    pub fn held_bytes(&self) -> u64 {
        (self.persistent.len + self.arena.len) as u64
    }

    fn ptr(&mut self, v: ValueId) -> *mut u8 {
        let slot = self.plan.slot(v);
        let base = match slot.region {
            Region::Persistent => self.persistent.base(),
            Region::Arena => self.arena.base(),
            Region::Host => self.host.base(),
        };
        // SAFETY: the planner keeps every slot inside its region (check_plan verifies it).
        unsafe { base.add(slot.offset as usize) }
    }

    fn view(&mut self, v: ValueId) -> TensorView {
        TensorView { ty: self.trace.ty(v).clone(), ptr: self.ptr(v) }
    }

    /// Writes a leaf (parameter, optimizer state or step input).
    pub fn write(&mut self, v: ValueId, data: &HostTensor) -> Result<()> {
        let val = self.trace.value(v);
        if !val.kind.is_leaf() {
            return Err(Error::Input { name: self.trace.describe(v), reason: "only leaves can be written".into() });
        }
        if data.ty != val.ty {
            return Err(Error::Input {
                name: self.trace.describe(v),
                reason: format!("expected {}, got {}", val.ty, data.ty),
            });
        }
        validate_ids(&self.id_checks, v, data)?;
        let p = self.ptr(v);
        // SAFETY: the slot holds exactly `ty.bytes()` bytes.
        unsafe { std::ptr::copy_nonoverlapping(data.bytes().as_ptr(), p, data.bytes().len()) };
        Ok(())
    }

    /// Writes the leaf called `name`.
    pub fn write_named(&mut self, name: &str, data: &HostTensor) -> Result<()> {
        let v = self.trace.leaf_by_name(name).ok_or_else(|| Error::Input {
            name: name.into(),
            reason: format!("trace `{}` has no leaf of that name", self.trace.name),
        })?;
        self.write(v, data)
    }

    /// Reads any value (meaningful for leaves and step outputs after a step).
    pub fn read(&mut self, v: ValueId) -> HostTensor {
        let mut t = HostTensor::zeros(self.trace.ty(v).clone());
        let p = self.ptr(v);
        let n = t.bytes().len();
        // SAFETY: the slot holds exactly `n` bytes.
        unsafe { std::ptr::copy_nonoverlapping(p, t.bytes_mut().as_mut_ptr(), n) };
        t
    }

    /// The loss of the last step, as f64.
    pub fn loss(&mut self) -> Result<f64> {
        let l = self.trace.loss().ok_or_else(|| Error::Cpu("the trace has no loss".into()))?;
        Ok(self.read(l).to_f64()[0])
    }

    /// Runs one step kernel by kernel, resolving addresses from the plan at each node.
    pub fn run_eager(&mut self) -> Result<()> {
        let r = self.eager_nodes();
        self.abort_on_error(r)
    }

    /// Runs the nodes `nodes` of the trace eagerly: one segment of a
    /// program of several (see [`Session::run_nodes`]).
    pub fn run_nodes(&mut self, nodes: std::ops::Range<usize>) -> Result<()> {
        check_node_range(&nodes, self.trace.nodes.len())?;
        let r = self.eager_range(nodes);
        self.abort_on_error(r)
    }

    /// Runs the recorded launches of the nodes `nodes` (recording first if
    /// needed): a segment's replay.
    pub fn replay_nodes(&mut self, nodes: std::ops::Range<usize>) -> Result<()> {
        check_node_range(&nodes, self.trace.nodes.len())?;
        if self.launches.is_none() {
            self.record();
        }
        let launches = self.launches.as_ref().expect("recorded above");
        // Launches are in node order: the range's are one run of them.
        let first = launches.partition_point(|l| l.node < nodes.start);
        let end = launches.partition_point(|l| l.node < nodes.end);
        let comm = self.comm.as_deref();
        let r = launches[first..end]
            .iter()
            .try_for_each(|l| run_node(&self.trace.nodes[l.node].op, &l.inputs, &l.outputs, comm));
        self.abort_on_error(r)
    }

    fn eager_nodes(&mut self) -> Result<()> {
        self.eager_range(0..self.trace.nodes.len())
    }

    fn eager_range(&mut self, nodes: std::ops::Range<usize>) -> Result<()> {
        for ni in nodes {
            let node = &self.trace.nodes[ni];
            if node.op.view_of().is_some() {
                continue;
            }
            let (ins, outs) = (node.inputs.clone(), node.outputs.clone());
            let inputs: Vec<TensorView> = ins.iter().map(|&v| self.view(v)).collect();
            let outputs: Vec<TensorView> = outs.iter().map(|&v| self.view(v)).collect();
            run_node(&self.trace.nodes[ni].op, &inputs, &outputs, self.comm.as_deref())?;
        }
        Ok(())
    }

    /// A failed step on one rank fails the whole group: its peers would
    /// otherwise wait at their next collective.
    fn abort_on_error(&self, r: Result<()>) -> Result<()> {
        if let (Err(e), Some(c)) = (&r, &self.comm) {
            c.abort(&e.to_string());
        }
        r
    }

    /// Records the launch list with fixed addresses (once); returns the time it took.
    pub fn record(&mut self) -> Duration {
        let t0 = Instant::now();
        let mut launches = Vec::new();
        for ni in 0..self.trace.nodes.len() {
            let node = &self.trace.nodes[ni];
            if node.op.view_of().is_some() {
                continue;
            }
            let (ins, outs) = (node.inputs.clone(), node.outputs.clone());
            let inputs = ins.iter().map(|&v| self.view(v)).collect();
            let outputs = outs.iter().map(|&v| self.view(v)).collect();
            launches.push(Launch { node: ni, inputs, outputs });
        }
        self.launches = Some(launches);
        t0.elapsed()
    }

    /// Runs the recorded launch list. Records it first if needed.
    pub fn replay(&mut self) -> Result<()> {
        if self.launches.is_none() {
            self.record();
        }
        let launches = self.launches.as_ref().expect("recorded above");
        let comm = self.comm.as_deref();
        let r = launches.iter().try_for_each(|l| run_node(&self.trace.nodes[l.node].op, &l.inputs, &l.outputs, comm));
        self.abort_on_error(r)
    }
}

impl Session for CpuSession {
    fn trace(&self) -> &Trace {
        &self.trace
    }

    fn plan(&self) -> &MemoryPlan {
        &self.plan
    }

    fn device(&self) -> String {
        "the CPU".into()
    }

    fn write(&mut self, v: ValueId, data: &HostTensor) -> Result<()> {
        CpuSession::write(self, v, data)
    }

    fn run_eager(&mut self) -> Result<()> {
        CpuSession::run_eager(self)
    }

    fn prepare_replay(&mut self) -> Result<Duration> {
        Ok(self.record())
    }

    fn replay_label(&self) -> &'static str {
        "launch list recorded"
    }

    fn replay(&mut self) -> Result<()> {
        CpuSession::replay(self)
    }

    fn run_nodes(&mut self, nodes: std::ops::Range<usize>) -> Result<()> {
        CpuSession::run_nodes(self, nodes)
    }

    fn replay_nodes(&mut self, nodes: std::ops::Range<usize>) -> Result<()> {
        CpuSession::replay_nodes(self, nodes)
    }

    /// The launch list is one for the whole trace: recorded once, for every range.
    fn prepare_replay_nodes(&mut self, nodes: std::ops::Range<usize>) -> Result<Duration> {
        check_node_range(&nodes, self.trace.nodes.len())?;
        match self.launches {
            Some(_) => Ok(Duration::ZERO),
            None => Ok(self.record()),
        }
    }

    fn read(&mut self, v: ValueId) -> Result<HostTensor> {
        Ok(CpuSession::read(self, v))
    }

    fn loss(&mut self) -> Result<f64> {
        CpuSession::loss(self)
    }

    /// Host buffers are allocated, not measured: held is what the session allocated.
    fn memory(&mut self) -> Result<SessionMemory> {
        Ok(SessionMemory {
            planned_bytes: self.plan.planned_peak_bytes(),
            held_bytes: self.held_bytes(),
            comm_bytes: 0,
            measured: false,
            baseline_bytes: 0,
        })
    }
}

/// A node range of a trace of `len` nodes must lie inside it.
pub fn check_node_range(nodes: &std::ops::Range<usize>, len: usize) -> Result<()> {
    if nodes.start > nodes.end || nodes.end > len {
        return Err(Error::Input {
            name: "nodes".into(),
            reason: format!("{}..{} is not a range of the trace's {len} nodes", nodes.start, nodes.end),
        });
    }
    Ok(())
}

fn run_node(op: &Op, inputs: &[TensorView], outputs: &[TensorView], comm: Option<&dyn Communicator>) -> Result<()> {
    op.cpu(&KernelIo { inputs, outputs, comm })
}

/// A step input used as indices: token ids of an embedding (bounded by its
/// rows) or targets of a cross-entropy (bounded by the vocabulary, with its
/// ignore index allowed). Every backend checks these on the host before a
/// step, because a kernel cannot report an out-of-range index.
#[derive(Clone, Debug, PartialEq)]
pub struct IdCheck {
    pub input: ValueId,
    pub rows: i64,
    pub ignore: Option<i64>,
    pub what: &'static str,
}

/// Checks `data`, about to be written to `input`, against every check for it.
pub fn validate_ids(checks: &[IdCheck], input: ValueId, data: &HostTensor) -> Result<()> {
    for c in checks.iter().filter(|c| c.input == input) {
        check_ids(c.what, data, c.rows, c.ignore)?;
    }
    Ok(())
}

/// The index checks of `trace`'s step inputs, followed through reshapes.
pub fn id_checks(trace: &Trace) -> Vec<IdCheck> {
    let mut checks = Vec::new();
    for input in trace.inputs() {
        if !trace.ty(input).dtype.is_int() {
            continue;
        }
        // The input and every view of it.
        let mut aliases = vec![input];
        for node in &trace.nodes {
            if let Some(i) = node.op.view_of() {
                if aliases.contains(&node.inputs[i]) {
                    aliases.push(node.outputs[0]);
                }
            }
        }
        for node in &trace.nodes {
            match &node.op {
                Op::Embedding(_) if aliases.contains(&node.inputs[0]) => {
                    checks.push(IdCheck {
                        input,
                        rows: trace.ty(node.inputs[1]).shape[0] as i64,
                        ignore: None,
                        what: "token id",
                    });
                }
                Op::CrossEntropy(ce) if aliases.contains(&node.inputs[1]) => {
                    let vocab = *trace.ty(node.inputs[0]).shape.last().unwrap_or(&0) as i64;
                    checks.push(IdCheck { input, rows: vocab, ignore: Some(ce.ignore_index), what: "target" });
                }
                // The fused head: the weight is [classes, features].
                Op::LinearCrossEntropy(ce) if aliases.contains(&node.inputs[2]) => {
                    let vocab = trace.ty(node.inputs[1]).shape[0] as i64;
                    checks.push(IdCheck { input, rows: vocab, ignore: Some(ce.ignore_index), what: "target" });
                }
                _ => {}
            }
        }
    }
    checks
}

fn check_ids(what: &str, data: &HostTensor, rows: i64, ignore: Option<i64>) -> Result<()> {
    let ids: Vec<i64> = match data.ty.dtype {
        DType::I32 => bytemuck::cast_slice::<u8, i32>(data.bytes()).iter().map(|&x| x as i64).collect(),
        DType::I64 => bytemuck::cast_slice::<u8, i64>(data.bytes()).to_vec(),
        d => return Err(Error::Input { name: format!("{what}s"), reason: format!("ids must be i32 or i64, got {d}") }),
    };
    for (pos, &id) in ids.iter().enumerate() {
        if Some(id) != ignore && !(0..rows).contains(&id) {
            return Err(Error::Input {
                name: format!("{what}s"),
                reason: format!("{what} {id} at position {pos} is out of range [0, {rows})"),
            });
        }
    }
    Ok(())
}

/// The leaves a step needs written, by kind, for callers that initialise them.
pub fn leaves_of(trace: &Trace, pred: impl Fn(&ValueKind) -> bool) -> Vec<ValueId> {
    trace.leaves().filter(|v| pred(&trace.value(*v).kind)).collect()
}

/// A scalar step input (learning rate, step count) as a host tensor.
pub fn scalar_input(value: f64) -> HostTensor {
    HostTensor::from_f64(crate::ir::TensorType::scalar(DType::F32), &[value])
}
