//! Running a bound step: enqueueing its launches on the session's stream
//! (with the collectives' side stream and its events), eagerly or under
//! graph capture, whole or a range of nodes, and timing each launch for
//! profiles.

use std::collections::HashMap;
use std::ffi::c_void;
use std::time::Duration;

use cudarc::driver::result as dr;
use cudarc::driver::sys::CUevent_wait_flags;

use super::{used_bytes, CudaSession, Prepared};
use crate::error::{CudaError, Result};
use crate::graph::StepGraph;

impl CudaSession {
    fn enqueue(&self) -> Result<()> {
        // Ranks in threads of one process each use their own device.
        self.ctx.bind_to_thread()?;
        self.enqueue_launches(0..self.prepared.len())
    }

    /// Enqueues the launches `range` on the compute stream, and those the
    /// side stream runs there, forked and joined as [`crate::overlap`]
    /// says; every side launch of the range is joined by its end, so a
    /// range is complete (and capturable) on its own.
    fn enqueue_launches(&self, range: std::ops::Range<usize>) -> Result<()> {
        let s = self.stream.cu_stream();
        let Some(side) = &self.side else {
            return self.enqueue_list(&self.prepared[range], s);
        };
        let wait = |stream, event| {
            // SAFETY: a live event of this context and a stream of it.
            unsafe { dr::stream::wait_event(stream, event, CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT) }
        };
        let ss = side.stream.cu_stream();
        // Side launches of the range the compute stream has not waited for yet.
        let mut unjoined = vec![false; range.len()];
        for j in range.clone() {
            // Side launches of earlier ranges were joined when those ended.
            for k in side.joins.before[j].iter().filter(|k| range.contains(k)) {
                wait(s, side.done[k])?;
                unjoined[k - range.start] = false;
            }
            let p = std::slice::from_ref(&self.prepared[j]);
            if let Some(&done) = side.done.get(&j) {
                // Fork: the side stream starts after everything enqueued so far.
                // SAFETY: live events and streams of this context.
                unsafe { dr::event::record(side.fork, s) }?;
                wait(ss, side.fork)?;
                self.enqueue_list(p, ss)?;
                // SAFETY: as above.
                unsafe { dr::event::record(done, ss) }?;
                unjoined[j - range.start] = true;
            } else {
                self.enqueue_list(p, s)?;
            }
        }
        for (k, _) in unjoined.iter().enumerate().filter(|(_, &u)| u) {
            wait(s, side.done[&(range.start + k)])?;
        }
        Ok(())
    }

    fn enqueue_list(&self, list: &[Prepared], s: cudarc::driver::sys::CUstream) -> Result<()> {
        for p in list {
            match p {
                Prepared::Kernel { func, launch, args } => {
                    let mut params: Vec<*mut c_void> = args.iter().map(|a| a.as_ptr() as *mut c_void).collect();
                    // SAFETY: `func` belongs to a module the session keeps; the
                    // arguments match the kernel's signature (the lowering's
                    // contract) and point into the session's allocation; every
                    // stepgraph kernel begins with `sg_pdl_entry()` (kernels.rs tests).
                    unsafe {
                        crate::launch::launch_kernel(
                            *func,
                            launch.grid,
                            launch.block,
                            launch.shared_bytes,
                            s,
                            &mut params,
                            self.pdl,
                        )
                    }
                    .map_err(|e| CudaError::Driver(format!("launching `{}`: {e:?}", launch.function)))?;
                }
                Prepared::Gemm(g) => self.blas.run(g, s)?,
                Prepared::Memset { ptr, bytes, value } => {
                    // SAFETY: the lowering's contract: `[ptr, ptr + bytes)` is a
                    // planned slice of the session's allocation.
                    unsafe { dr::memset_d8_async(*ptr, *value, *bytes as usize, s) }?
                }
                Prepared::Copy { dst, src, bytes } => {
                    // SAFETY: the lowering's contract: both ranges are planned
                    // slices of the session's allocation (a view the plan did
                    // not alias, or a rank's shard); the plan gives the source
                    // and the destination, two live values, disjoint bytes.
                    unsafe { dr::memcpy_dtod_async(*dst, *src, *bytes as usize, s) }?
                }
                Prepared::HostCopy { dst, src, bytes } => {
                    // SAFETY: the lowering's contract: one range is a planned
                    // slot of the device allocation, the other of the mapped
                    // page-locked host allocation (by its device address,
                    // which unified addressing resolves); two live values,
                    // disjoint bytes.
                    unsafe { cudarc::driver::sys::cuMemcpyAsync(*dst, *src, *bytes as usize, s) }.result()?
                }
                Prepared::Collective(c) => {
                    let comm = self.comm.as_ref().ok_or_else(|| {
                        CudaError::Rank(format!("{} needs the group's communicator", c.op.nccl_name()))
                    })?;
                    // SAFETY: the parts are planned slices of the session's allocation
                    // and `s` is the session's stream, on the communicator's device.
                    unsafe { comm.issue(c, s) }?
                }
            }
        }
        Ok(())
    }

    /// Runs one step launch by launch and waits for it.
    pub fn run_eager(&mut self) -> Result<()> {
        self.enqueue()?;
        self.stream.synchronize()?;
        self.sample()
    }

    /// Captures the step into one CUDA graph (once); returns capture + instantiate time.
    pub fn capture(&mut self) -> Result<Duration> {
        let (graph, grew) = self.capture_with(|s| s.enqueue())?;
        let t = graph.capture_time;
        self.graph = Some(graph);
        self.memory.graph_bytes = grew;
        self.sample()?;
        Ok(t)
    }

    /// A graph of what `enqueue` issues on the stream, and the device
    /// memory its capture and instantiation took.
    fn capture_with(&self, enqueue: impl FnOnce(&Self) -> Result<()>) -> Result<(StepGraph, u64)> {
        let before = used_bytes()?.0;
        let graph = StepGraph::capture(&self.stream, || enqueue(self))?;
        self.stream.synchronize()?;
        Ok((graph, used_bytes()?.0.saturating_sub(before)))
    }

    /// Replays the captured step (capturing first if needed) and waits for it.
    pub fn replay(&mut self) -> Result<()> {
        if self.graph.is_none() {
            self.capture()?;
        }
        self.graph.as_ref().expect("captured above").replay()?;
        self.stream.synchronize()?;
        Ok(())
    }

    /// The launches of the nodes `nodes`, a range of `prepared`.
    fn launch_range(&self, nodes: &std::ops::Range<usize>) -> Result<std::ops::Range<usize>> {
        stepgraph_core::cpu::exec::check_node_range(nodes, self.trace.nodes.len())?;
        let first = self.launch_nodes.partition_point(|&n| n < nodes.start);
        let end = self.launch_nodes.partition_point(|&n| n < nodes.end);
        if self.launch_first_nodes[first..end].iter().any(|&n| n < nodes.start) {
            return Err(CudaError::lower(
                "segment",
                format!(
                    "nodes {nodes:?} cut a merged launch (multi-tensor AdamW, or a layer's two cache writes): \
                     open the session with STEPGRAPH_MULTI_TENSOR=0"
                ),
            ));
        }
        Ok(first..end)
    }

    /// Runs the nodes `nodes` launch by launch and waits for them: one
    /// segment of a trace holding several programs over one plan.
    pub fn run_nodes(&mut self, nodes: std::ops::Range<usize>) -> Result<()> {
        let launches = self.launch_range(&nodes)?;
        self.ctx.bind_to_thread()?;
        self.enqueue_launches(launches)?;
        self.stream.synchronize()?;
        self.sample()
    }

    /// Replays the nodes `nodes` from their own CUDA graph, captured over
    /// the same launches at the first call (run them eagerly once before,
    /// so the modules are warm), and waits for it.
    pub fn replay_nodes(&mut self, nodes: std::ops::Range<usize>) -> Result<()> {
        let key = (nodes.start, nodes.end);
        self.capture_nodes(nodes)?;
        self.segment_graphs[&key].0.replay()?;
        self.stream.synchronize()?;
        Ok(())
    }

    /// Captures the graph of the nodes `nodes` that
    /// [`CudaSession::replay_nodes`] replays (once); returns capture +
    /// instantiate time (zero when it exists).
    pub fn capture_nodes(&mut self, nodes: std::ops::Range<usize>) -> Result<Duration> {
        let key = (nodes.start, nodes.end);
        if self.segment_graphs.contains_key(&key) {
            return Ok(Duration::ZERO);
        }
        let launches = self.launch_range(&nodes)?;
        self.ctx.bind_to_thread()?;
        let (graph, grew) = self.capture_with(|s| s.enqueue_launches(launches))?;
        let took = graph.capture_time;
        self.memory.graph_bytes += grew;
        self.segment_graphs.insert(key, (graph, grew));
        self.sample()?;
        Ok(took)
    }

    /// The device memory the capture of the graph of `nodes` took (`None`
    /// before [`CudaSession::replay_nodes`] captured it).
    pub fn segment_graph_bytes(&self, nodes: std::ops::Range<usize>) -> Option<u64> {
        self.segment_graphs.get(&(nodes.start, nodes.end)).map(|g| g.1)
    }

    /// Runs one step eagerly with a timing event after every launch and
    /// returns, per kernel name (cuBLASLt products as `gemm`), the launch
    /// count and total milliseconds, slowest first. For finding where a
    /// step's time goes; the events perturb timing slightly.
    pub fn profile(&mut self) -> Result<Vec<(String, usize, f64)>> {
        self.profile_launches(0..self.prepared.len())
    }

    /// [`CudaSession::profile`] of the nodes `nodes` only (one segment).
    pub fn profile_nodes(&mut self, nodes: std::ops::Range<usize>) -> Result<Vec<(String, usize, f64)>> {
        let range = self.launch_range(&nodes)?;
        self.profile_launches(range)
    }

    /// Runs the launches `range` on the compute stream, each timed.
    fn profile_launches(&mut self, range: std::ops::Range<usize>) -> Result<Vec<(String, usize, f64)>> {
        use cudarc::driver::sys::CUevent_flags;
        let s = self.stream.cu_stream();
        let mut events = Vec::with_capacity(range.len() + 1);
        let new_event = || self.ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT));
        let first = new_event()?;
        first.record(&self.stream)?;
        for p in &self.prepared[range.clone()] {
            let one = std::slice::from_ref(p);
            self.enqueue_list(one, s)?;
            let e = new_event()?;
            e.record(&self.stream)?;
            events.push(e);
        }
        self.stream.synchronize()?;
        let mut totals: HashMap<String, (usize, f64)> = HashMap::new();
        let mut prev = &first;
        for (p, e) in self.prepared[range].iter().zip(&events) {
            let ms = prev.elapsed_ms(e)? as f64;
            let name = match p {
                Prepared::Kernel { launch, .. } => launch.function.clone(),
                // Per shape and transposition, so a slow product shape stands out.
                Prepared::Gemm(g) => crate::blas::shape_name(g),
                Prepared::Memset { .. } => "memset".into(),
                Prepared::Copy { .. } => "copy".into(),
                Prepared::HostCopy { .. } => "host_copy".into(),
                Prepared::Collective(c) => c.op.nccl_name().into(),
            };
            let t = totals.entry(name).or_insert((0, 0.0));
            t.0 += 1;
            t.1 += ms;
            prev = e;
        }
        let mut out: Vec<(String, usize, f64)> = totals.into_iter().map(|(k, (n, ms))| (k, n, ms)).collect();
        out.sort_by(|a, b| b.2.partial_cmp(&a.2).unwrap_or(std::cmp::Ordering::Equal));
        Ok(out)
    }
}
