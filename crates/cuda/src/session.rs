//! A planned step bound to one GPU.
//!
//! [`CudaSession::new`] checks that the plan fits the device before
//! allocating anything, then makes **one** device allocation laid out as
//! `[persistent | arena | cuBLASLt workspace]` (and, for a plan with host
//! tables, one page-locked host allocation mapped into the device's
//! address space), compiles (or loads from the
//! disk cache) the kernel modules the step needs, lowers every node to
//! launches over fixed addresses and plans every matrix product once. The
//! step then runs eagerly ([`CudaSession::run_eager`], launch by launch on
//! one stream) or as one captured CUDA graph ([`CudaSession::capture`],
//! [`CudaSession::replay`]) over the identical launch list. Between steps
//! only step inputs are written and outputs read.
//!
//! A session may be one rank of a data-parallel group
//! ([`CudaSession::new_rank`]): it runs on the GPU [`RankOptions::device`],
//! its step's collectives must be for the group's size (checked before
//! anything is allocated), and it joins the group's NCCL communicator once
//! its device context exists. Collectives are issued on the session's one
//! stream like every other launch, so eager runs and graph capture order
//! them identically.
//!
//! [`CudaSession::new_rank`] builds a session in named stages, each a
//! function below: check the rank, open the device, allocate (after
//! checking that the plan fits), lower, make the collectives' side stream,
//! load the kernel modules, plan the matrix products, join the group.
//! The session also implements core's backend-neutral
//! [`stepgraph_core::session::Session`].
//!
//! Each stage is timed ([`CudaSession::startup`]: kernel load and cuBLASLt
//! tuning among them), and the session draws its own initial weights in
//! place ([`CudaSession::init_params`], the host generator's bits) and
//! zeroes the optimizer state with memsets, so a billion-parameter model
//! starts without a host copy of its weights.
//!
//! Device memory is measured, not assumed: the driver's used memory
//! (total − free) is sampled against a baseline taken right after the
//! context exists, and reported next to the plan ([`MemoryReport`]).

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::sys::{CUevent, CUevent_flags, CUevent_wait_flags, CUfunction_attribute};
use cudarc::driver::{result as dr, CudaContext, CudaModule, CudaStream};
use serde::Serialize;

use stepgraph_core::cpu::exec::{id_checks, validate_ids, IdCheck};
use stepgraph_core::host::HostTensor;
use stepgraph_core::ir::{Builder, Trace, ValueId, ValueKind};
use stepgraph_core::models::lora::{init_quantized, is_quantized_leaf};
use stepgraph_core::ops::collective::world_of;
use stepgraph_core::ops::Op;
use stepgraph_core::plan::{plan, MemoryPlan, PlanOptions, Region, Slot, ARENA_ALIGN};
use stepgraph_core::session::{InitReport, Session, SessionMemory, StartupPhase};
use stepgraph_core::Result as CoreResult;

use crate::blas::Blas;
use crate::error::{CudaError, Result};
use crate::graph::StepGraph;
use crate::launch::{DevTensor, KernelLaunch, Launch};
use crate::lower::{lower_for, GroupRank, Target};
use crate::nccl::{Nccl, NcclComm, NcclGroup};
use crate::nvrtc;
use crate::switches::Switches;

/// Backend options. [`Default`] has every switch at its default; the
/// commands and tests that open sessions use [`CudaOptions::from_env`].
#[derive(Clone, Debug, Default)]
pub struct CudaOptions {
    /// Let cuBLASLt use TF32 for f32 products (off by default: f32 means f32).
    pub tf32: bool,
    /// The run-time switches, parsed once where the session's caller
    /// started ([`Switches::from_env`]) and read from here, never from the
    /// environment.
    pub switches: Switches,
}

impl CudaOptions {
    /// The defaults with the switches of this process's environment.
    pub fn from_env() -> Result<Self> {
        Ok(CudaOptions { switches: Switches::from_env()?, ..CudaOptions::default() })
    }
}

/// Where a session runs: its GPU and, for a data-parallel step, its rank.
#[derive(Clone, Debug, Default)]
pub struct RankOptions {
    /// CUDA device ordinal (rank `r` of a launcher uses device `r`).
    pub device: usize,
    /// The group this session is one rank of; needed by steps with collectives.
    pub group: Option<NcclGroup>,
    /// Run the collectives on a second stream, so they overlap the compute
    /// that does not touch their bytes ([`crate::overlap`]); off: they run
    /// in order on the compute stream.
    pub overlap: bool,
}

/// Planned and measured device memory of a session, in bytes.
#[derive(Clone, Debug, Default, Serialize)]
pub struct MemoryReport {
    /// Persistent buffer plus arena, from the plan.
    pub planned_peak_bytes: u64,
    /// cuBLASLt's workspace, inside the one allocation.
    pub workspace_bytes: u64,
    /// The one device allocation: plan plus workspace.
    pub allocation_bytes: u64,
    /// Driver-reported use right after the context was created.
    pub baseline_bytes: u64,
    /// Growth from loading the kernel modules.
    pub modules_bytes: u64,
    /// Growth from creating cuBLASLt and planning its products.
    pub blas_bytes: u64,
    /// Growth from capturing and instantiating the step graph (0 before capture).
    pub graph_bytes: u64,
    /// Growth from joining the NCCL communicator (0 without collectives);
    /// NCCL may allocate more at its first collective, which the peak shows.
    pub comm_bytes: u64,
    /// The most device memory this process held above the baseline.
    pub device_peak_bytes: u64,
    /// Wall milliseconds spent autotuning cuBLASLt algorithms while the
    /// session was built (0 when off); not bytes, but a build cost reported
    /// with the others. Per shape: [`CudaSession::gemm_tuning`].
    pub gemm_tune_ms: f64,
}

/// A resolved launch: functions looked up, arguments encoded.
enum Prepared {
    Kernel { func: cudarc::driver::sys::CUfunction, launch: KernelLaunch, args: Vec<Vec<u8>> },
    Gemm(crate::launch::GemmCall),
    Memset { ptr: u64, bytes: u64, value: u8 },
    Copy { dst: u64, src: u64, bytes: u64 },
    Collective(crate::launch::CollectiveCall),
}

/// A planned step bound to device memory. See the module doc.
pub struct CudaSession {
    trace: Trace,
    plan: MemoryPlan,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    base: u64,
    /// Where each region of the plan starts.
    bases: Bases,
    /// The page-locked host allocation of [`Region::Host`] (0 without one).
    host: u64,
    prepared: Vec<Prepared>,
    blas: Blas,
    /// Kernel modules, kept as long as the session: the step's, and the
    /// initial weights' once [`CudaSession::init_params`] has run.
    modules: HashMap<&'static str, Arc<CudaModule>>,
    /// How long each stage of building the session took, in order.
    startup: Vec<StartupPhase>,
    graph: Option<StepGraph>,
    /// The node of every launch of `prepared` (ascending: launches are in
    /// node order); for a multi-tensor update, its last parameter's node.
    launch_nodes: Vec<usize>,
    /// The first node of every launch (its first parameter's, for a
    /// multi-tensor update; else as `launch_nodes`): node ranges must not cut one.
    launch_first_nodes: Vec<usize>,
    /// Graphs of node ranges ([`CudaSession::replay_nodes`]), with the device
    /// memory each one's capture took.
    segment_graphs: HashMap<(usize, usize), (StepGraph, u64)>,
    id_checks: Vec<IdCheck>,
    memory: MemoryReport,
    total_device_bytes: u64,
    pub arch: String,
    /// The CUDA device ordinal the session runs on.
    device: usize,
    /// This session's rank, when it is one rank of a group.
    group: Option<GroupRank>,
    /// The group's communicator, when the step has collectives.
    comm: Option<NcclComm>,
    /// The collectives' own stream, when they overlap compute.
    side: Option<SideStream>,
    /// Kernels launch with programmatic dependent launch
    /// ([`crate::launch::pdl_on`]).
    pdl: bool,
}

/// A stream for the collectives and the events that order it with the
/// compute stream ([`crate::overlap`]).
struct SideStream {
    stream: Arc<CudaStream>,
    /// Recorded on the compute stream right before each collective.
    fork: CUevent,
    /// Recorded on the side stream after each collective, by launch index.
    done: HashMap<usize, CUevent>,
    joins: crate::overlap::Joins,
}

/// Is there a usable NVIDIA GPU (the driver library and at least one device)?
pub fn gpu_available() -> bool {
    // SAFETY: `is_culib_present` only tries to dlopen the driver library;
    // it has no precondition and touches no CUDA state.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return false;
    }
    dr::init().is_ok() && dr::device::get_count().map(|n| n > 0).unwrap_or(false)
}

/// Number of GPUs the driver shows (after `CUDA_VISIBLE_DEVICES`).
pub fn device_count() -> Result<usize> {
    // SAFETY: as in `gpu_available`: a dlopen attempt with no precondition.
    // Without the driver library there is no GPU.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Ok(0);
    }
    dr::init()?;
    Ok(dr::device::get_count()? as usize)
}

/// Free memory of GPU `device` as the driver reports it, measured inside a
/// context of its own (a session's context takes its share first, as here).
pub fn free_device_memory(device: usize) -> Result<u64> {
    let _ctx = CudaContext::new(device)?;
    let (free, _) = dr::mem_get_info()?;
    Ok(free as u64)
}

/// The name the driver gives GPU `device` ("NVIDIA H200").
pub fn device_name(device: usize) -> Result<String> {
    // SAFETY: as in `gpu_available`: a dlopen attempt with no precondition.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err(CudaError::Driver("no NVIDIA driver library (libcuda.so)".into()));
    }
    dr::init()?;
    Ok(dr::device::get_name(dr::device::get(device as i32)?)?)
}

/// Does a session of `trace` load NCCL? Only a step with collectives (a
/// data-parallel rank's) does; a one-device step never touches the library.
pub fn step_needs_nccl(trace: &Trace) -> bool {
    trace.nodes.iter().any(|n| world_of(&n.op).is_some())
}

fn used_bytes() -> Result<(u64, u64)> {
    let (free, total) = dr::mem_get_info()?;
    Ok(((total - free) as u64, total as u64))
}

fn align(x: u64) -> u64 {
    x.div_ceil(ARENA_ALIGN) * ARENA_ALIGN
}

/// An opened GPU: its context and compute stream, its architecture, and the
/// driver's used and total memory right after the context exists (the
/// baseline the session's memory is measured against).
struct Device {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    arch: String,
    baseline: u64,
    total: u64,
}

/// Where each region of a plan starts, as device addresses.
#[derive(Copy, Clone, Debug)]
pub struct Bases {
    pub persistent: u64,
    pub arena: u64,
    /// The device address of the page-locked host allocation (0 without one).
    pub host: u64,
}

impl Bases {
    fn of(&self, region: Region) -> u64 {
        match region {
            Region::Persistent => self.persistent,
            Region::Arena => self.arena,
            Region::Host => self.host,
        }
    }
}

/// The session's one device allocation, `[persistent | arena | workspace]`,
/// and the host tables' page-locked host memory, mapped into the device's
/// address space.
struct Allocation {
    base: u64,
    /// The host allocation (its host pointer), or 0.
    host: u64,
    bases: Bases,
    /// Arena bytes (the plan's, aligned).
    arena: u64,
    workspace_base: u64,
    /// cuBLASLt workspace bytes.
    workspace: u64,
    /// The whole allocation.
    bytes: u64,
}

/// A lowered step resolved against its kernel modules.
struct Loaded {
    prepared: Vec<Prepared>,
    /// Every matrix product of the step, in launch order, for cuBLASLt planning.
    gemms: Vec<crate::launch::GemmCall>,
    /// The modules the step's kernels live in, kept as long as the session.
    modules: HashMap<&'static str, Arc<CudaModule>>,
}

/// Stage 1, before the GPU is touched: the session's rank checked against
/// every collective of `trace` ([`check_group`]), and NCCL loaded when the
/// step has collectives (so a missing library fails before any allocation).
fn check_rank(trace: &Trace, rank: &RankOptions) -> Result<(Option<GroupRank>, Option<&'static Nccl>)> {
    let group = check_group(trace, rank.group.as_ref())?;
    let nccl = if step_needs_nccl(trace) { Some(crate::nccl::nccl()?) } else { None };
    Ok((group, nccl))
}

/// Stage 2: opens GPU `device` (after `CUDA_VISIBLE_DEVICES`): its context
/// with event tracking off, one compute stream, its architecture, and the
/// memory baseline.
fn open_device(device: usize) -> Result<Device> {
    if !gpu_available() {
        return Err(CudaError::Missing { lib: "cuda", hint: "no NVIDIA driver or no GPU on this machine".into() });
    }
    let devices = device_count()?;
    if device >= devices {
        return Err(CudaError::Rank(format!(
            "GPU {device} asked for, but this machine shows {devices} (CUDA_VISIBLE_DEVICES may hide some)"
        )));
    }
    let ctx = CudaContext::new(device)?;
    // Event tracking makes captured launches fail with STREAM_CAPTURE_ISOLATION;
    // the session orders everything itself: on one stream, or with its
    // own events for the collectives' side stream (`RankOptions::overlap`).
    // SAFETY: the contract is that the caller synchronises streams itself
    // for every slice created from now on: none is freed, read or written on
    // one stream while another still uses it. The session makes no
    // `CudaSlice` (its memory is one raw allocation), and its launches run in
    // order on one stream, or with its own events for the side stream.
    unsafe { ctx.disable_event_tracking() };
    let stream = ctx.new_stream()?;
    let (major, minor) = ctx.compute_capability()?;
    let arch = format!("sm_{major}{minor}");
    let (baseline, total) = used_bytes()?;
    Ok(Device { ctx, stream, arch, baseline, total })
}

/// Stage 3: checks that the plan plus the cuBLASLt workspace fits the
/// device's free memory (refusing before allocating anything), makes the one
/// allocation, and poisons the arena with 0xFF so that a kernel reading
/// memory nothing wrote shows up as NaN in tests.
fn allocate(plan: &MemoryPlan, stream: &CudaStream, baseline: u64, total: u64) -> Result<Allocation> {
    let workspace = Blas::WORKSPACE_BYTES as u64;
    let persistent = align(plan.persistent_bytes);
    let arena = align(plan.arena_bytes);
    let bytes = persistent + arena + workspace;
    let free = total - baseline;
    if bytes > free {
        return Err(CudaError::DoesNotFit {
            needed: bytes,
            needed_gb: bytes as f64 / 1e9,
            free,
            free_gb: free as f64 / 1e9,
        });
    }
    // SAFETY: a plain device allocation in the current context (bound by
    // `open_device`); the session frees it in Drop, once its stream is idle.
    let base = unsafe { dr::malloc_sync(bytes as usize) }?;
    let (persistent_base, arena_base) = (base, base + persistent);
    // SAFETY: `[arena_base, arena_base + arena)` lies inside the allocation
    // just made, and nothing else uses it yet.
    unsafe { dr::memset_d8_async(arena_base, 0xFF, arena as usize, stream.cu_stream()) }?;
    let (host, host_base) = match allocate_host(plan.host_bytes) {
        Ok(h) => h,
        Err(e) => {
            // SAFETY: the allocation just made, not yet used by anything.
            let _ = unsafe { dr::free_sync(base) };
            return Err(e);
        }
    };
    let bases = Bases { persistent: persistent_base, arena: arena_base, host: host_base };
    Ok(Allocation { base, host, bases, arena, workspace_base: arena_base + arena, workspace, bytes })
}

/// Page-locked host memory of `bytes` for the plan's host tables, mapped
/// into the device's address space: `(host pointer, device address)`, or
/// zeros for none. Kernels read it over the bus; copies to and from it go
/// through its device address like any other slot's.
fn allocate_host(bytes: u64) -> Result<(u64, u64)> {
    if bytes == 0 {
        return Ok((0, 0));
    }
    // SAFETY: a page-locked allocation in the current context, freed once
    // by the session's Drop (or right below on failure).
    let host =
        unsafe { dr::malloc_host(bytes as usize, cudarc::driver::sys::CU_MEMHOSTALLOC_DEVICEMAP) }.map_err(|e| {
            CudaError::Driver(format!(
                "allocating {:.3} GB of page-locked host memory for the frozen embedding tables: {e}",
                bytes as f64 / 1e9
            ))
        })?;
    let mut device = 0;
    // SAFETY: `host` is the mapped allocation just made; flags must be 0.
    let mapped = unsafe { cudarc::driver::sys::cuMemHostGetDevicePointer_v2(&mut device, host, 0) }.result();
    if let Err(e) = mapped {
        // SAFETY: the allocation made above, not yet used by anything.
        let _ = unsafe { dr::free_host(host) };
        return Err(e.into());
    }
    Ok((host as u64, device))
}

/// Stage 5, with `RankOptions::overlap`: the collectives' own stream, one
/// event to fork it from the compute stream and one per collective to join
/// it back, and where each collective rejoins ([`crate::overlap::joins`]).
/// `None` for a step without collectives.
fn side_stream(
    ctx: &Arc<CudaContext>,
    trace: &Trace,
    plan: &MemoryPlan,
    alloc: &Allocation,
    launches: &[Launch],
    launch_nodes: &[usize],
) -> Result<Option<SideStream>> {
    if !launches.iter().any(|l| matches!(l, Launch::Collective(_))) {
        return Ok(None);
    }
    let ranges = node_ranges(trace, plan, alloc.bases);
    let joins = crate::overlap::joins(launches, launch_nodes, &ranges);
    let event = || dr::event::create(CUevent_flags::CU_EVENT_DISABLE_TIMING);
    let mut done = HashMap::new();
    for (j, l) in launches.iter().enumerate() {
        if matches!(l, Launch::Collective(_)) {
            done.insert(j, event()?);
        }
    }
    Ok(Some(SideStream { stream: ctx.new_stream()?, fork: event()?, done, joins }))
}

/// Stage 6: compiles (or loads from the disk cache) and loads every kernel
/// module the launches use, looks each kernel up once (opting it in to the
/// most dynamic shared memory its launches ask for), and
/// encodes every launch's arguments.
fn load_launches(ctx: &Arc<CudaContext>, arch: &str, launches: Vec<Launch>) -> Result<Loaded> {
    let mut modules: HashMap<&'static str, Arc<CudaModule>> = HashMap::new();
    // Each function with the dynamic shared bytes it is opted in to.
    let mut functions: HashMap<(String, String), (cudarc::driver::sys::CUfunction, u32)> = HashMap::new();
    let mut prepared = Vec::with_capacity(launches.len());
    let mut gemms = Vec::new();
    for l in launches {
        prepared.push(match l {
            Launch::Kernel(k) => {
                if !modules.contains_key(k.module) {
                    let cubin = nvrtc::compile(k.module, arch)?;
                    let module = ctx.load_module(cudarc::nvrtc::Ptx::from_binary(cubin))?;
                    modules.insert(k.module, module);
                }
                let key = (k.module.to_string(), k.function.clone());
                let (func, opted_in) = match functions.get(&key) {
                    Some(&f) => f,
                    None => {
                        let f = modules[k.module].load_function(&k.function).map_err(|e| {
                            CudaError::Driver(format!("kernel `{}` in module `{}`: {e:?}", k.function, k.module))
                        })?;
                        (f.cu_function(), 0)
                    }
                };
                // Kernels whose static and dynamic shared memory together
                // pass the default 48 KiB must opt in to the dynamic part
                // (a small ring next to large static arrays too: the driver
                // rejects such a launch as an invalid argument). Opting in
                // is harmless below 48 KiB, so every launch with dynamic
                // shared memory does, to the largest any launch of the
                // function asks for. The function stays loaded with its
                // module, which the session keeps.
                if k.shared_bytes > opted_in {
                    // SAFETY: `func` is a function of a module loaded above
                    // and kept in `modules` for the session's life; the
                    // attribute is a documented one whose value is a byte
                    // count (the driver rejects one above the device's
                    // limit with an error).
                    unsafe {
                        dr::function::set_function_attribute(
                            func,
                            CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                            k.shared_bytes as i32,
                        )
                    }?;
                }
                functions.insert(key, (func, opted_in.max(k.shared_bytes)));
                let args = k.args.iter().map(|a| a.bytes()).collect();
                Prepared::Kernel { func, launch: k, args }
            }
            Launch::Gemm(g) => {
                gemms.push(g.clone());
                Prepared::Gemm(g)
            }
            Launch::Memset { ptr, bytes, value } => Prepared::Memset { ptr, bytes, value },
            Launch::Copy { dst, src, bytes } => Prepared::Copy { dst, src, bytes },
            Launch::Collective(c) => Prepared::Collective(c),
        });
    }
    Ok(Loaded { prepared, gemms, modules })
}

/// Stage 7: creates cuBLASLt over the allocation's workspace, plans every
/// product once, and autotunes the algorithms (unless
/// [`Switches::gemm_autotune`] is off), then waits for the stream.
fn plan_gemms(
    alloc: &Allocation,
    opts: &CudaOptions,
    gemms: &[crate::launch::GemmCall],
    stream: &Arc<CudaStream>,
    arch: &str,
) -> Result<Blas> {
    let ctx = stream.context();
    let mut blas = Blas::new(alloc.workspace_base, alloc.workspace as usize, opts.tf32, &opts.switches, ctx, arch)?;
    blas.plan_all(gemms)?;
    // Autotuning runs products on their real addresses. Nothing holds data
    // yet (weights and inputs are written after construction), and a
    // matmul output is never persistent (not a leaf, no in-place or view
    // pair), so only the arena is offered: tuning writes nowhere else.
    let arena = alloc.bases.arena..alloc.bases.arena + alloc.arena;
    blas.autotune(gemms, arena, stream)?;
    if !blas.tuning().shapes.is_empty() {
        // Re-poison what the timing runs overwrote, as `allocate` does.
        // SAFETY: the arena lies inside the session's allocation, and the
        // timing runs that wrote it were enqueued on this same stream.
        unsafe { dr::memset_d8_async(alloc.bases.arena, 0xFF, alloc.arena as usize, stream.cu_stream()) }?;
    }
    stream.synchronize()?;
    Ok(blas)
}

/// Stage 8: joins the group's NCCL communicator, blocking until every rank
/// has; `None` for a step without collectives.
fn join_group(nccl: Option<&'static Nccl>, group: Option<&NcclGroup>) -> Result<Option<NcclComm>> {
    match (nccl, group) {
        (Some(nccl), Some(g)) => Ok(Some(NcclComm::init(nccl, g)?)),
        _ => Ok(None),
    }
}

/// [`CudaSession::startup`]'s stage names.
pub const STAGE_CHECK_RANK: &str = "check rank";
pub const STAGE_OPEN_DEVICE: &str = "open device";
pub const STAGE_ALLOCATE: &str = "allocate";
pub const STAGE_LOWER: &str = "lower";
pub const STAGE_KERNEL_LOAD: &str = "kernel load";
pub const STAGE_GEMM_PLANS: &str = "GEMM plans";
pub const STAGE_GEMM_TUNING: &str = "GEMM tuning";
pub const STAGE_JOIN_GROUP: &str = "join group";

/// Times consecutive stages: each ends where the next begins.
struct StageClock {
    last: Instant,
    stages: Vec<StartupPhase>,
}

impl StageClock {
    fn start() -> Self {
        StageClock { last: Instant::now(), stages: Vec::new() }
    }

    /// Ends the stage `name`, which began where the previous one ended.
    fn stage(&mut self, name: &'static str) {
        let now = Instant::now();
        self.stages.push(StartupPhase::new(name, now - self.last));
        self.last = now;
    }

    /// Ends a stage of two parts, `first` then `second`, of which the
    /// second took `second_took` (measured inside the stage).
    fn split_stage(&mut self, first: &'static str, second: &'static str, second_took: Duration) {
        let now = Instant::now();
        let whole = now - self.last;
        let second_took = second_took.min(whole);
        self.stages.push(StartupPhase::new(first, whole - second_took));
        self.stages.push(StartupPhase::new(second, second_took));
        self.last = now;
    }
}

impl CudaSession {
    /// Binds `trace` planned by `plan` to GPU 0. Refuses, before allocating
    /// anything, a plan that does not fit the device's free memory.
    pub fn new(trace: Trace, plan: MemoryPlan, opts: CudaOptions) -> Result<Self> {
        Self::new_rank(trace, plan, opts, RankOptions::default())
    }

    /// Binds `trace` to GPU `rank.device` as rank `rank.group` of a
    /// data-parallel group. Checks the step's collectives against the group
    /// and loads NCCL (when the step has collectives) before touching the
    /// GPU; joins the group's communicator (blocking until every rank has)
    /// after the step's memory is allocated.
    ///
    /// The stages, in order (private functions of this module but
    /// [`lower_step`]): `check_rank`, `open_device`, `allocate` (which
    /// checks that the plan fits first), [`lower_step`], `side_stream`,
    /// `load_launches`, `plan_gemms` and `join_group`; device memory is
    /// sampled between them for the [`MemoryReport`].
    pub fn new_rank(trace: Trace, plan: MemoryPlan, opts: CudaOptions, rank: RankOptions) -> Result<Self> {
        let mut clock = StageClock::start();
        let (group, nccl) = check_rank(&trace, &rank)?;
        clock.stage(STAGE_CHECK_RANK);
        let Device { ctx, stream, arch, baseline, total } = open_device(rank.device)?;
        clock.stage(STAGE_OPEN_DEVICE);
        let alloc = allocate(&plan, &stream, baseline, total)?;
        let mut memory = MemoryReport {
            planned_peak_bytes: plan.planned_peak_bytes(),
            workspace_bytes: alloc.workspace,
            allocation_bytes: alloc.bytes,
            baseline_bytes: baseline,
            ..MemoryReport::default()
        };
        let after_alloc = used_bytes()?.0;
        clock.stage(STAGE_ALLOCATE);

        let target = Target::of_arch(&arch, opts.switches);
        let (launches, launch_nodes) = lower_step(&trace, &plan, alloc.bases, group, target)?;
        let (launches, launch_nodes, launch_first_nodes) = multi_tensor_updates(launches, launch_nodes, &opts.switches);
        let side =
            if rank.overlap { side_stream(&ctx, &trace, &plan, &alloc, &launches, &launch_nodes)? } else { None };
        clock.stage(STAGE_LOWER);
        let Loaded { prepared, gemms, modules } = load_launches(&ctx, &arch, launches)?;
        let after_modules = used_bytes()?.0;
        clock.stage(STAGE_KERNEL_LOAD);
        let blas = plan_gemms(&alloc, &opts, &gemms, &stream, &arch)?;
        memory.gemm_tune_ms = blas.tuning().wall_ms;
        // Planning and tuning are one stage; the tuning's own wall time splits them.
        let tuning = Duration::from_secs_f64(blas.tuning().wall_ms.max(0.0) / 1e3);
        clock.split_stage(STAGE_GEMM_PLANS, STAGE_GEMM_TUNING, tuning);
        let after_blas = used_bytes()?.0;
        memory.modules_bytes = after_modules.saturating_sub(after_alloc);
        memory.blas_bytes = after_blas.saturating_sub(after_modules);
        let comm = join_group(nccl, rank.group.as_ref())?;
        let after_comm = used_bytes()?.0;
        memory.comm_bytes = after_comm.saturating_sub(after_blas);
        memory.device_peak_bytes = after_comm.saturating_sub(baseline);
        clock.stage(STAGE_JOIN_GROUP);
        let id_checks = id_checks(&trace);
        let pdl = crate::launch::pdl_on(&arch, &opts.switches);
        Ok(CudaSession {
            trace,
            plan,
            ctx,
            stream,
            base: alloc.base,
            bases: alloc.bases,
            host: alloc.host,
            prepared,
            blas,
            modules,
            startup: clock.stages,
            graph: None,
            launch_nodes,
            launch_first_nodes,
            segment_graphs: HashMap::new(),
            id_checks,
            memory,
            total_device_bytes: total,
            arch,
            device: rank.device,
            group,
            comm,
            side,
            pdl,
        })
    }

    /// How long each stage of building this session took, in order:
    /// [`STAGE_CHECK_RANK`] (loading NCCL when the step has collectives),
    /// [`STAGE_OPEN_DEVICE`], [`STAGE_ALLOCATE`], [`STAGE_LOWER`],
    /// [`STAGE_KERNEL_LOAD`] (NVRTC or the disk cache, and module loads),
    /// [`STAGE_GEMM_PLANS`], [`STAGE_GEMM_TUNING`] (cuBLASLt autotuning)
    /// and [`STAGE_JOIN_GROUP`]. Graph capture is not among them: it
    /// happens at the first replay ([`CudaSession::capture`] returns its time).
    pub fn startup(&self) -> &[StartupPhase] {
        &self.startup
    }

    /// Writes every weight's initial value for `seed` in place, one
    /// kernel launch per parameter ([`crate::init`]): the bits of
    /// [`stepgraph_core::models::init_params`], with no host copy. Loads
    /// the kernel module on first use (its device memory is counted with
    /// the other modules').
    pub fn init_params(&mut self, seed: u64) -> Result<InitReport> {
        let start = Instant::now();
        self.ctx.bind_to_thread()?;
        let mut launches = Vec::new();
        let (mut tensors, mut bytes) = (0, 0);
        for p in self.trace.weights() {
            let name = self.trace.value(p).kind.leaf_name().unwrap_or_default();
            // NF4 leaves hold a drawn weight quantized on the host, below.
            if is_quantized_leaf(name) {
                continue;
            }
            let out = dev_tensor(&self.trace, &self.plan, self.bases, p);
            tensors += 1;
            bytes += out.ty.bytes();
            launches.extend(crate::init::init_launch(name, &out, seed)?);
        }
        let module = self.init_module()?;
        let mut functions: HashMap<String, cudarc::driver::sys::CUfunction> = HashMap::new();
        for l in &launches {
            let func = match functions.get(&l.function) {
                Some(f) => *f,
                None => {
                    let f = module.load_function(&l.function).map_err(|e| {
                        CudaError::Driver(format!("kernel `{}` in module `{}`: {e:?}", l.function, l.module))
                    })?;
                    functions.insert(l.function.clone(), f.cu_function());
                    f.cu_function()
                }
            };
            let args: Vec<Vec<u8>> = l.args.iter().map(|a| a.bytes()).collect();
            let mut params: Vec<*mut c_void> = args.iter().map(|a| a.as_ptr() as *mut c_void).collect();
            // SAFETY: `func` belongs to the init module, which the session
            // keeps; the arguments match `init_param_<dt>`'s signature
            // (checked against the CUBIN in `init`'s tests) and the pointer
            // is a parameter's planned slot, inside the session's allocation,
            // of exactly `n` elements of the kernel's dtype. `args` outlives
            // the call, which copies the argument values.
            unsafe { dr::launch_kernel(func, l.grid, l.block, l.shared_bytes, self.stream.cu_stream(), &mut params) }
                .map_err(|e| CudaError::Driver(format!("launching `{}`: {e:?}", l.function)))?;
        }
        self.stream.synchronize()?;
        let trace = self.trace.clone();
        tensors += init_quantized(self, &trace, seed)?;
        self.sample()?;
        Ok(InitReport { tensors, bytes, on_device: true, elapsed: start.elapsed() })
    }

    /// The initial weights' kernel module, loaded (from the NVRTC disk
    /// cache, or compiled) the first time.
    fn init_module(&mut self) -> Result<Arc<CudaModule>> {
        let name = crate::init::MODULE.name;
        if let Some(m) = self.modules.get(name) {
            return Ok(m.clone());
        }
        let before = used_bytes()?.0;
        let cubin = nvrtc::compile(name, &self.arch)?;
        let module = self.ctx.load_module(cudarc::nvrtc::Ptx::from_binary(cubin))?;
        self.memory.modules_bytes += used_bytes()?.0.saturating_sub(before);
        self.modules.insert(name, module.clone());
        Ok(module)
    }

    /// Writes zeros into every optimizer state leaf with device memsets (no
    /// host buffer): all-zero bytes are 0.0 in every float type.
    pub fn zero_state(&mut self) -> Result<()> {
        self.ctx.bind_to_thread()?;
        for v in self.trace.leaves() {
            if matches!(self.trace.value(v).kind, ValueKind::State { .. }) {
                let ptr = self.slot_ptr(self.plan.slot(v));
                let bytes = self.trace.ty(v).bytes() as usize;
                // SAFETY: the state's planned slot, exactly `bytes` long,
                // inside the session's allocation; ordered on the session's stream.
                unsafe { dr::memset_d8_async(ptr, 0, bytes, self.stream.cu_stream()) }?;
            }
        }
        self.stream.synchronize()?;
        Ok(())
    }

    /// This session's rank and group size (`None` outside a group).
    pub fn group(&self) -> Option<GroupRank> {
        self.group
    }

    pub fn trace(&self) -> &Trace {
        &self.trace
    }

    /// The memory report, with the peak sampled now included.
    pub fn memory(&mut self) -> Result<MemoryReport> {
        self.sample()?;
        Ok(self.memory.clone())
    }

    pub fn total_device_bytes(&self) -> u64 {
        self.total_device_bytes
    }

    fn sample(&mut self) -> Result<()> {
        let used = used_bytes()?.0;
        self.memory.device_peak_bytes =
            self.memory.device_peak_bytes.max(used.saturating_sub(self.memory.baseline_bytes));
        Ok(())
    }

    fn slot_ptr(&self, s: Slot) -> u64 {
        self.bases.of(s.region) + s.offset
    }

    /// Writes a leaf (parameter, optimizer state or step input).
    pub fn write(&mut self, v: ValueId, data: &HostTensor) -> Result<()> {
        let val = self.trace.value(v);
        if !val.kind.is_leaf() {
            return Err(stepgraph_core::Error::Input {
                name: self.trace.describe(v),
                reason: "only leaves can be written".into(),
            }
            .into());
        }
        if data.ty != val.ty {
            return Err(stepgraph_core::Error::Input {
                name: self.trace.describe(v),
                reason: format!("expected {}, got {}", val.ty, data.ty),
            }
            .into());
        }
        validate_ids(&self.id_checks, v, data)?;
        let ptr = self.slot_ptr(self.plan.slot(v));
        // SAFETY: the slot holds exactly the tensor's bytes; synchronised below
        // so the host buffer may go away after return.
        unsafe { dr::memcpy_htod_async(ptr, data.bytes(), self.stream.cu_stream()) }?;
        self.stream.synchronize()?;
        Ok(())
    }

    pub fn write_named(&mut self, name: &str, data: &HostTensor) -> Result<()> {
        let v = self.trace.leaf_by_name(name).ok_or_else(|| stepgraph_core::Error::Input {
            name: name.into(),
            reason: format!("trace `{}` has no leaf of that name", self.trace.name),
        })?;
        self.write(v, data)
    }

    /// Reads any value after the step (leaves and step outputs are meaningful).
    pub fn read(&mut self, v: ValueId) -> Result<HostTensor> {
        let mut t = HostTensor::zeros(self.trace.ty(v).clone());
        let ptr = self.slot_ptr(self.plan.slot(v));
        // SAFETY: the slot holds exactly the tensor's bytes, inside the
        // session's allocation; `t` outlives the copy, which is complete
        // when the synchronisation below returns.
        unsafe { dr::memcpy_dtoh_async(t.bytes_mut(), ptr, self.stream.cu_stream()) }?;
        self.stream.synchronize()?;
        Ok(t)
    }

    pub fn loss(&mut self) -> Result<f64> {
        let l = self.trace.loss().ok_or_else(|| CudaError::lower("loss", "the trace has no loss"))?;
        Ok(self.read(l)?.to_f64()[0])
    }

    fn enqueue(&self) -> Result<()> {
        // Ranks in threads of one process each use their own device.
        self.ctx.bind_to_thread()?;
        let s = self.stream.cu_stream();
        let Some(side) = &self.side else {
            return self.enqueue_list(&self.prepared, s);
        };
        let wait = |stream, event| {
            // SAFETY: a live event of this context and a stream of it.
            unsafe { dr::stream::wait_event(stream, event, CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT) }
        };
        let ss = side.stream.cu_stream();
        for (j, p) in self.prepared.iter().enumerate() {
            for k in &side.joins.before[j] {
                wait(s, side.done[k])?;
            }
            if matches!(p, Prepared::Collective(_)) {
                // Fork: the side stream starts after everything enqueued so far.
                // SAFETY: live events and streams of this context.
                unsafe { dr::event::record(side.fork, s) }?;
                wait(ss, side.fork)?;
                self.enqueue_list(std::slice::from_ref(p), ss)?;
                // SAFETY: as above.
                unsafe { dr::event::record(side.done[&j], ss) }?;
            } else {
                self.enqueue_list(std::slice::from_ref(p), s)?;
            }
        }
        for k in &side.joins.at_end {
            wait(s, side.done[k])?;
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
        if self.side.is_some() {
            return Err(CudaError::lower(
                "segment",
                "node ranges run on the compute stream only: open the session without collective overlap",
            ));
        }
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
        self.enqueue_list(&self.prepared[launches], self.stream.cu_stream())?;
        self.stream.synchronize()?;
        self.sample()
    }

    /// Replays the nodes `nodes` from their own CUDA graph, captured over
    /// the same launches at the first call (run them eagerly once before,
    /// so the modules are warm), and waits for it.
    pub fn replay_nodes(&mut self, nodes: std::ops::Range<usize>) -> Result<()> {
        let key = (nodes.start, nodes.end);
        if !self.segment_graphs.contains_key(&key) {
            let launches = self.launch_range(&nodes)?;
            self.ctx.bind_to_thread()?;
            let (graph, grew) = self.capture_with(|s| s.enqueue_list(&s.prepared[launches], s.stream.cu_stream()))?;
            self.memory.graph_bytes += grew;
            self.segment_graphs.insert(key, (graph, grew));
            self.sample()?;
        }
        self.segment_graphs[&key].0.replay()?;
        self.stream.synchronize()?;
        Ok(())
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

    /// What cuBLASLt autotuning chose per product shape when the session
    /// was built (`STEPGRAPH_GEMM_AUTOTUNE=0` turns it off).
    pub fn gemm_tuning(&self) -> &crate::blas::GemmTuning {
        self.blas.tuning()
    }

    /// Number of device operations in one step.
    pub fn launch_count(&self) -> usize {
        self.prepared.len()
    }
}

impl Drop for CudaSession {
    fn drop(&mut self) {
        let _ = self.stream.synchronize();
        if let Some(side) = self.side.take() {
            let _ = side.stream.synchronize();
            for e in std::iter::once(side.fork).chain(side.done.into_values()) {
                // SAFETY: an event of this session, no longer waited on (both streams idle).
                let _ = unsafe { dr::event::destroy(e) };
            }
        }
        self.graph = None;
        self.segment_graphs.clear();
        // After the graph that may reference it, before the memory it reduced.
        self.comm = None;
        // SAFETY: `base` is the allocation made by `allocate`, freed once:
        // both streams are idle, and the graph and the communicator that
        // could still reference it were dropped above.
        let _ = unsafe { dr::free_sync(self.base) };
        if self.host != 0 {
            // SAFETY: the host allocation of `allocate_host`, freed once,
            // with every stream that read it idle.
            let _ = unsafe { dr::free_host(self.host as *mut std::ffi::c_void) };
        }
        let _ = &self.ctx;
    }
}

/// A CUDA error seen through the backend-neutral [`Session`]: a core error
/// stays one, anything else is passed through with its message.
impl From<CudaError> for stepgraph_core::Error {
    fn from(e: CudaError) -> Self {
        match e {
            CudaError::Core(core) => core,
            other => stepgraph_core::Error::Backend(Box::new(other)),
        }
    }
}

/// The neutral view of the session; the richer [`MemoryReport`],
/// [`CudaSession::profile`] and the tuning report stay inherent.
impl Session for CudaSession {
    fn trace(&self) -> &Trace {
        &self.trace
    }

    fn plan(&self) -> &MemoryPlan {
        &self.plan
    }

    fn device(&self) -> String {
        format!("GPU {} ({})", self.device, self.arch)
    }

    fn write(&mut self, v: ValueId, data: &HostTensor) -> CoreResult<()> {
        Ok(CudaSession::write(self, v, data)?)
    }

    /// Drawn in place by a kernel: no host copy.
    fn init_params(&mut self, seed: u64) -> CoreResult<InitReport> {
        Ok(CudaSession::init_params(self, seed)?)
    }

    /// Memsets on the device.
    fn zero_state(&mut self) -> CoreResult<()> {
        Ok(CudaSession::zero_state(self)?)
    }

    fn startup_phases(&self) -> Vec<StartupPhase> {
        self.startup.clone()
    }

    fn run_eager(&mut self) -> CoreResult<()> {
        Ok(CudaSession::run_eager(self)?)
    }

    /// Captures the CUDA graph; run one eager step first, so that kernel
    /// modules are warm and NCCL has connected the ranks.
    fn prepare_replay(&mut self) -> CoreResult<Duration> {
        Ok(self.capture()?)
    }

    fn replay_label(&self) -> &'static str {
        "step graph captured"
    }

    fn replay(&mut self) -> CoreResult<()> {
        Ok(CudaSession::replay(self)?)
    }

    fn run_nodes(&mut self, nodes: std::ops::Range<usize>) -> CoreResult<()> {
        Ok(CudaSession::run_nodes(self, nodes)?)
    }

    /// One CUDA graph per node range, captured at its first replay.
    fn replay_nodes(&mut self, nodes: std::ops::Range<usize>) -> CoreResult<()> {
        Ok(CudaSession::replay_nodes(self, nodes)?)
    }

    fn segment_graph_bytes(&self, nodes: std::ops::Range<usize>) -> Option<u64> {
        CudaSession::segment_graph_bytes(self, nodes)
    }

    fn profile_nodes(&mut self, nodes: std::ops::Range<usize>) -> CoreResult<Vec<(String, usize, f64)>> {
        Ok(CudaSession::profile_nodes(self, nodes)?)
    }

    fn read(&mut self, v: ValueId) -> CoreResult<HostTensor> {
        Ok(CudaSession::read(self, v)?)
    }

    fn loss(&mut self) -> CoreResult<f64> {
        Ok(CudaSession::loss(self)?)
    }

    /// Held is the device peak measured above the context's baseline.
    fn memory(&mut self) -> CoreResult<SessionMemory> {
        let m = CudaSession::memory(self)?;
        Ok(SessionMemory {
            planned_bytes: m.planned_peak_bytes,
            held_bytes: m.device_peak_bytes,
            comm_bytes: m.comm_bytes,
            measured: true,
            baseline_bytes: m.baseline_bytes,
        })
    }
}

fn dev_tensor(trace: &Trace, plan: &MemoryPlan, bases: Bases, v: ValueId) -> DevTensor {
    let s = plan.slot(v);
    DevTensor { ty: trace.ty(v).clone(), ptr: bases.of(s.region) + s.offset }
}

/// The step's AdamW updates merged into multi-tensor launches where they run
/// back to back ([`crate::ops::optim::merge_updates`]), a layer's two
/// cache writes into one launch ([`crate::ops::decode::merge_kv_writes`])
/// and its q and k rotations into one ([`crate::ops::rope::merge_ropes`]),
/// unless the step has collectives (whose joins are computed per node) or
/// [`Switches::multi_tensor`] is off (for comparisons). Returns the
/// launches, each one's last node and each one's first node.
fn multi_tensor_updates(
    launches: Vec<Launch>,
    nodes: Vec<usize>,
    switches: &Switches,
) -> (Vec<Launch>, Vec<usize>, Vec<usize>) {
    if !switches.multi_tensor || launches.iter().any(|l| matches!(l, Launch::Collective(_))) {
        let first = nodes.clone();
        return (launches, nodes, first);
    }
    let (launches, last, first) = crate::ops::optim::merge_updates(launches, nodes);
    let (launches, last, first) = crate::ops::decode::merge_kv_writes(launches, last, first);
    crate::ops::rope::merge_ropes(launches, last, first)
}

/// Stage 4 of [`CudaSession::new_rank`], public for tests and tools that
/// inspect a step's launches without a GPU.
///
/// The launch list of a whole step: every node lowered over the plan's
/// addresses (each region's slots from its base in `bases`) for `group`'s
/// rank and a device of `target`, with the node
/// of every launch. Data only: nothing calls the CUDA driver.
pub fn lower_step(
    trace: &Trace,
    plan: &MemoryPlan,
    bases: Bases,
    group: Option<GroupRank>,
    target: Target,
) -> Result<(Vec<Launch>, Vec<usize>)> {
    let view = |v: ValueId| dev_tensor(trace, plan, bases, v);
    let (mut launches, mut nodes) = (Vec::new(), Vec::new());
    for (n, node) in trace.nodes.iter().enumerate() {
        let ins: Vec<DevTensor> = node.inputs.iter().map(|&v| view(v)).collect();
        let outs: Vec<DevTensor> = node.outputs.iter().map(|&v| view(v)).collect();
        let l = lower_for(&node.op, &ins, &outs, group, target)?;
        nodes.extend(std::iter::repeat_n(n, l.len()));
        launches.extend(l);
    }
    Ok((launches, nodes))
}

/// A step's launches as a session makes them, each with the last node it
/// belongs to (a merged launch spans several), from [`step_launches`].
#[derive(Clone, Debug)]
pub struct LoweredStep {
    pub launches: Vec<Launch>,
    pub last_nodes: Vec<usize>,
}

impl LoweredStep {
    /// The launches of the nodes `nodes` (one segment of a trace that holds
    /// several programs, such as a generation bucket's decode step).
    pub fn of_nodes(&self, nodes: std::ops::Range<usize>) -> Vec<&Launch> {
        self.launches.iter().zip(&self.last_nodes).filter(|(_, n)| nodes.contains(n)).map(|(l, _)| l).collect()
    }
}

/// The launches one step of `trace` makes on a device of architecture
/// `arch` (`sm_90`, ...) under `switches`, exactly as a session lowers and
/// merges them (persistent and arena storage at fixed stand-in bases,
/// without the CUDA driver): how many kernels a step is, before any GPU is at hand.
pub fn step_launches(trace: &Trace, plan: &MemoryPlan, arch: &str, switches: &Switches) -> Result<LoweredStep> {
    // Bases far apart and 2 MiB aligned, like the driver's allocations.
    let bases = Bases { persistent: 1u64 << 40, arena: 1u64 << 44, host: 1u64 << 45 };
    let target = Target::of_arch(arch, *switches);
    let (launches, nodes) = lower_step(trace, plan, bases, None, target)?;
    let (launches, last_nodes, _) = multi_tensor_updates(launches, nodes, switches);
    Ok(LoweredStep { launches, last_nodes })
}

/// The device bytes `[start, end)` each node's inputs and outputs occupy.
pub fn node_ranges(trace: &Trace, plan: &MemoryPlan, bases: Bases) -> Vec<Vec<(u64, u64)>> {
    trace
        .nodes
        .iter()
        .map(|node| {
            node.inputs
                .iter()
                .chain(&node.outputs)
                .map(|&v| {
                    let t = dev_tensor(trace, plan, bases, v);
                    (t.ptr, t.ptr + t.ty.bytes())
                })
                .collect()
        })
        .collect()
}

/// The session's rank, checked against every collective of `trace`: each
/// must be for the group's size, and a step with collectives needs a group.
fn check_group(trace: &Trace, group: Option<&NcclGroup>) -> Result<Option<GroupRank>> {
    if let Some(g) = group {
        if g.world == 0 || g.rank >= g.world {
            return Err(CudaError::Rank(format!("rank {} is outside a group of {}", g.rank, g.world)));
        }
    }
    for (i, node) in trace.nodes.iter().enumerate() {
        let Some(world) = world_of(&node.op) else { continue };
        match group {
            None => {
                return Err(CudaError::Rank(format!(
                    "the step `{}` has `{}` (node {i}) for {world} ranks: a data-parallel step runs as one rank \
                     of a group (CudaSession::new_rank with RankOptions::group)",
                    trace.name,
                    node.op.name()
                )))
            }
            Some(g) if g.world != world => {
                return Err(CudaError::Rank(format!(
                    "`{}` (node {i}) of the step `{}` is for {world} ranks, but this session is rank {} of {}: \
                     build each rank's step for the group's size",
                    node.op.name(),
                    trace.name,
                    g.rank,
                    g.world
                )))
            }
            Some(_) => {}
        }
    }
    Ok(group.map(|g| GroupRank { rank: g.rank, world: g.world }))
}

fn one_op_trace(op: &Op, inputs: &[HostTensor]) -> Result<(Trace, Vec<ValueId>, Vec<ValueId>)> {
    let mut b = Builder::new("op");
    let ids: Vec<ValueId> = inputs
        .iter()
        .enumerate()
        .map(|(i, t)| b.input(&format!("x{i}"), t.ty.clone()))
        .collect::<std::result::Result<_, _>>()?;
    let outs = b.push(op.clone(), &ids)?;
    for (k, &o) in outs.iter().enumerate() {
        b.output(stepgraph_core::ir::OutputKind::Named(format!("y{k}")), o);
    }
    let trace = b.finish("build")?;
    let ins: Vec<ValueId> = trace.inputs().collect();
    let outs: Vec<ValueId> = trace.outputs.iter().map(|o| o.value).collect();
    Ok((trace, ins, outs))
}

fn run_with_plan(
    trace: Trace,
    plan: MemoryPlan,
    ins: &[ValueId],
    outs: &[ValueId],
    inputs: &[HostTensor],
) -> Result<Vec<HostTensor>> {
    let mut s = CudaSession::new(trace, plan, CudaOptions::from_env()?)?;
    for (v, t) in ins.iter().zip(inputs) {
        // Raw writes: a single op's inputs are not step inputs with index checks.
        let ptr = s.slot_ptr(s.plan.slot(*v));
        // SAFETY: the slot holds exactly the tensor's bytes, inside the
        // session's allocation; `inputs` outlives the copy, which the
        // stream finishes before `run_eager` below returns.
        unsafe { dr::memcpy_htod_async(ptr, t.bytes(), s.stream.cu_stream()) }?;
    }
    s.run_eager()?;
    outs.iter().map(|&o| s.read(o)).collect()
}

/// Runs one op on the GPU through its lowering, every value in its own bytes.
pub fn run_op(op: &Op, inputs: &[HostTensor]) -> Result<Vec<HostTensor>> {
    let (trace, ins, outs) = one_op_trace(op, inputs)?;
    let p = plan(&trace, PlanOptions { reuse: false, ..PlanOptions::default() })?;
    run_with_plan(trace, p, &ins, &outs, inputs)
}

/// Like [`run_op`], with every declared in-place pair of matching types
/// sharing storage (the first pair per output and per input), as a planned
/// step may run it. An op's kernels must give the same bits either way.
pub fn run_op_aliased(op: &Op, inputs: &[HostTensor]) -> Result<Vec<HostTensor>> {
    let (trace, ins, outs) = one_op_trace(op, inputs)?;
    let mut p = plan(&trace, PlanOptions { reuse: false, ..PlanOptions::default() })?;
    let mut taken = vec![false; ins.len()];
    let mut done = vec![false; outs.len()];
    for (o, i) in op.inplace() {
        if !done[o] && !taken[i] && trace.ty(outs[o]) == trace.ty(ins[i]) {
            p.slots[outs[o].index()] = p.slots[ins[i].index()];
            done[o] = true;
            taken[i] = true;
        }
    }
    // The aliased input's bytes are also its output's: read outputs after the run.
    run_with_plan(trace, p, &ins, &outs, inputs)
}

#[cfg(test)]
mod tests {
    use stepgraph_core::autodiff::{build_step, StepKind, TrainOptions};
    use stepgraph_core::dist::{data_parallel, DataParallel};
    use stepgraph_core::models::{build_forward, LossKind, ModelSpec};

    use super::*;
    use crate::nccl::NcclId;

    /// tiny-llama's step of `kind` on `batch` rows of 8 tokens, cross-entropy.
    fn tiny_step(kind: StepKind, batch: usize, dtype: stepgraph_core::ir::DType) -> Trace {
        let sp = ModelSpec::named("tiny-llama", batch, 8, dtype, LossKind::CrossEntropy).unwrap();
        build_step(&build_forward(&sp).unwrap(), kind, &TrainOptions::default()).unwrap()
    }

    fn rank_step(world: usize) -> Trace {
        let step = tiny_step(StepKind::Train, 2, stepgraph_core::ir::DType::F32);
        data_parallel(&step, &DataParallel::new(world)).unwrap()
    }

    /// Every node of a real rank step lowers over its real plan: one NCCL
    /// group per bucket (the loss too), all-reduces in place where the plan
    /// aliased them, ZeRO-1's shards copied at the rank's offset, and every
    /// NCCL call in place or on disjoint buffers (checked by the lowering).
    #[test]
    fn rank_steps_lower_to_one_nccl_group_per_collective_node() {
        use crate::launch::{CollectiveOp, NcclRed};
        use stepgraph_core::ops::collective::world_of;
        let step = tiny_step(StepKind::Train, 4, stepgraph_core::ir::DType::BF16);
        for zero1 in [false, true] {
            for world in [1, 2, 4] {
                let dp = DataParallel { zero1, bucket_bytes: 16 << 10, ..DataParallel::new(world) };
                let t = data_parallel(&step, &dp).unwrap();
                let p = plan(&t, PlanOptions::default()).unwrap();
                let persistent = 1u64 << 40;
                let bases =
                    Bases { persistent, arena: persistent + p.persistent_bytes.div_ceil(256) * 256, host: 1u64 << 45 };
                let collectives = t.nodes.iter().filter(|n| world_of(&n.op).is_some()).count();
                let shards = t.nodes.iter().filter(|n| matches!(n.op, Op::LocalShard(_))).count();
                for rank in 0..world {
                    let (l, nodes) =
                        lower_step(&t, &p, bases, Some(GroupRank { rank, world }), Target::default()).unwrap();
                    assert_eq!(nodes.len(), l.len());
                    // With overlap every collective rejoins the compute stream
                    // exactly once: before a launch touching its bytes, or at the end.
                    let j = crate::overlap::joins(&l, &nodes, &node_ranges(&t, &p, bases));
                    let mut joined: Vec<usize> = j.before.iter().flatten().chain(&j.at_end).copied().collect();
                    joined.sort();
                    let colls: Vec<usize> = (0..l.len()).filter(|&i| matches!(l[i], Launch::Collective(_))).collect();
                    assert_eq!(joined, colls);
                    // Every reduced gradient is read by the optimizer: those
                    // collectives rejoin before it, never only at the end.
                    if zero1 {
                        let rs = CollectiveOp::ReduceScatter(NcclRed::Avg);
                        assert!(j.at_end.iter().all(|&k| !matches!(&l[k], Launch::Collective(c) if c.op == rs)));
                    }
                    let calls: Vec<_> = l
                        .iter()
                        .filter_map(|x| match x {
                            Launch::Collective(c) => Some(c),
                            _ => None,
                        })
                        .collect();
                    assert_eq!(calls.len(), collectives - shards, "zero1 {zero1} world {world}");
                    assert!(calls.iter().all(|c| c.world == world));
                    let gathers = calls.iter().filter(|c| c.op == CollectiveOp::AllGather).count();
                    let scatters = calls.iter().filter(|c| c.op == CollectiveOp::ReduceScatter(NcclRed::Avg)).count();
                    let reduces = calls.iter().filter(|c| c.op == CollectiveOp::AllReduce(NcclRed::Avg)).count();
                    if zero1 {
                        assert!(shards > 0 && gathers > 0 && scatters > 1, "{gathers} {scatters}");
                        assert_eq!(reduces, 1, "only the loss is all-reduced under ZeRO-1");
                    } else {
                        assert!(reduces > 2 && shards == 0 && gathers == 0 && scatters == 0);
                        // The plan gives every in-place all-reduce its input's bytes.
                        assert!(calls.iter().flat_map(|c| &c.parts).all(|p| p.send == p.recv));
                    }
                }
                let e = lower_step(&t, &p, bases, None, Target::default()).unwrap_err().to_string();
                assert!(e.contains("one rank of a group"), "{e}");
            }
        }
    }

    #[test]
    fn stages_follow_each_other_and_a_split_never_goes_negative() {
        let mut clock = StageClock::start();
        std::thread::sleep(Duration::from_millis(5));
        clock.stage(STAGE_OPEN_DEVICE);
        // A part claimed longer than its whole stage is capped at the whole.
        clock.split_stage(STAGE_GEMM_PLANS, STAGE_GEMM_TUNING, Duration::from_secs(100));
        let names: Vec<&str> = clock.stages.iter().map(|s| s.name).collect();
        assert_eq!(names, [STAGE_OPEN_DEVICE, STAGE_GEMM_PLANS, STAGE_GEMM_TUNING]);
        assert!(clock.stages[0].ms >= 5.0, "{:?}", clock.stages);
        assert_eq!(clock.stages[1].ms, 0.0);
        assert!(clock.stages[2].ms < 5.0, "{:?}", clock.stages);
    }

    fn group(rank: usize, world: usize) -> NcclGroup {
        NcclGroup { id: NcclId([7; 128]), rank, world }
    }

    #[test]
    fn the_group_must_fit_the_steps_collectives() {
        let step = rank_step(2);
        assert_eq!(check_group(&step, Some(&group(1, 2))).unwrap(), Some(GroupRank { rank: 1, world: 2 }));
        let e = check_group(&step, None).unwrap_err().to_string();
        assert!(e.contains("all_reduce_mean") && e.contains("for 2 ranks") && e.contains("new_rank"), "{e}");
        let e = check_group(&step, Some(&group(0, 4))).unwrap_err().to_string();
        assert!(e.contains("for 2 ranks, but this session is rank 0 of 4"), "{e}");
        let e = check_group(&step, Some(&group(2, 2))).unwrap_err().to_string();
        assert!(e.contains("rank 2 is outside a group of 2"), "{e}");
        // A step without collectives runs with or without a group.
        let plain = tiny_step(StepKind::Grads, 1, stepgraph_core::ir::DType::F32);
        assert_eq!(check_group(&plain, None).unwrap(), None);
        assert!(check_group(&plain, Some(&group(0, 1))).unwrap().is_some());
    }

    #[test]
    fn a_rank_session_fails_clearly_without_nccl_or_gpu() {
        // On CI neither NCCL nor a GPU exists; on a GPU machine this is a real session.
        let step = rank_step(1);
        let p = plan(&step, PlanOptions::default()).unwrap();
        let err = match crate::nccl::nccl() {
            Err(_) => CudaSession::new_rank(
                step,
                p,
                CudaOptions::default(),
                RankOptions { device: 0, group: Some(group(0, 1)), overlap: false },
            )
            .err()
            .expect("no NCCL, no session"),
            Ok(_) if !gpu_available() => CudaSession::new_rank(
                step,
                p,
                CudaOptions::default(),
                RankOptions { device: 0, group: Some(group(0, 1)), overlap: false },
            )
            .err()
            .expect("no GPU, no session"),
            Ok(_) => return,
        };
        let msg = err.to_string();
        let nccl_missing = msg.contains("libnccl") && msg.contains("LD_LIBRARY_PATH");
        assert!(nccl_missing || msg.contains("no GPU"), "{msg}");
    }
}
