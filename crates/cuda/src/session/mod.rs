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
//! The parts: this module builds the session and moves data in and out;
//! `device` opens the GPU and makes its memory (stages 2 and 3); `run`
//! enqueues the launches, eagerly, under capture or for a range of nodes,
//! and times them for profiles. The launch list itself, built and merged
//! without a device, is [`crate::lower`]'s; the one-op test harness is
//! `crate::testing` module's (the `testing` feature).
//!
//! Device memory is measured, not assumed: the driver's used memory
//! (total − free) is sampled against a baseline taken right after the
//! context exists, and reported next to the plan ([`MemoryReport`]).

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::sys::{CUevent, CUevent_flags, CUfunction_attribute};
use cudarc::driver::{result as dr, CudaContext, CudaModule, CudaStream};
use serde::Serialize;

use stepgraph_core::cpu::exec::{id_checks, validate_ids, IdCheck};
use stepgraph_core::host::HostTensor;
use stepgraph_core::ir::{Trace, ValueId, ValueKind};
use stepgraph_core::models::lora::{init_quantized, is_quantized_leaf};
use stepgraph_core::ops::collective::world_of;
use stepgraph_core::plan::{MemoryPlan, Slot, ARENA_ALIGN};
use stepgraph_core::session::{InitReport, Session, SessionMemory, StartupPhase};
use stepgraph_core::Result as CoreResult;

use crate::blas::Blas;
use crate::error::{CudaError, Result};
use crate::graph::StepGraph;
use crate::launch::{KernelLaunch, Launch, LaunchList};
use crate::lower::{dev_tensor, lower_step, merge_launches, node_ranges, Bases, GroupRank, Target};
use crate::nccl::{Nccl, NcclComm, NcclGroup};
use crate::switches::Switches;

mod device;
mod run;

use device::{allocate, measure_host_link, open_device, Allocation, Device};

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
    Kernel {
        func: cudarc::driver::sys::CUfunction,
        launch: KernelLaunch,
        args: Vec<Vec<u8>>,
    },
    Gemm(crate::launch::GemmCall),
    Memset {
        ptr: u64,
        bytes: u64,
        value: u8,
    },
    Copy {
        dst: u64,
        src: u64,
        bytes: u64,
    },
    /// Between device memory and the plan's page-locked host memory.
    HostCopy {
        dst: u64,
        src: u64,
        bytes: u64,
    },
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
    /// The stream of host copies and overlapped collectives, when the step has any.
    side: Option<SideStream>,
    /// Kernels launch with programmatic dependent launch
    /// ([`crate::switches::pdl_on`]).
    pdl: bool,
    /// Bytes per second of host copies, measured while opening a session
    /// whose plan offloads values.
    host_link: Option<f64>,
}

/// A stream for host copies and overlapped collectives, and the events
/// that order it with the compute stream ([`crate::overlap`]).
struct SideStream {
    stream: Arc<CudaStream>,
    /// Recorded on the compute stream right before each side launch.
    fork: CUevent,
    /// Recorded on the side stream after each side launch, by launch index:
    /// which launches run there.
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

/// Stage 5: the side stream of host copies and (with
/// `RankOptions::overlap`) collectives, one event to fork it from the
/// compute stream and one per side launch to join it back, and where each
/// rejoins ([`crate::overlap::joins`]). `None` for a step with no launch
/// on the side.
fn side_stream(
    ctx: &Arc<CudaContext>,
    trace: &Trace,
    plan: &MemoryPlan,
    alloc: &Allocation,
    launches: &[Launch],
    launch_nodes: &[usize],
    overlap: bool,
) -> Result<Option<SideStream>> {
    let on_side = crate::overlap::on_side(launches, overlap);
    if !on_side.contains(&true) {
        return Ok(None);
    }
    let ranges = node_ranges(trace, plan, alloc.bases);
    let joins = crate::overlap::joins(&on_side, launch_nodes, &ranges);
    let event = || dr::event::create(CUevent_flags::CU_EVENT_DISABLE_TIMING);
    let mut done = HashMap::new();
    for (j, _) in on_side.iter().enumerate().filter(|(_, &s)| s) {
        done.insert(j, event()?);
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
                    let cubin = crate::kernels::compile(k.module, arch)?;
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
                let args = k.args.iter().map(|a| a.bytes()).collect::<std::result::Result<_, _>>()?;
                Prepared::Kernel { func, launch: k, args }
            }
            Launch::Gemm(g) => {
                gemms.push(g.clone());
                Prepared::Gemm(g)
            }
            Launch::Memset { ptr, bytes, value } => Prepared::Memset { ptr, bytes, value },
            Launch::Copy { dst, src, bytes } => Prepared::Copy { dst, src, bytes },
            Launch::HostCopy { dst, src, bytes } => Prepared::HostCopy { dst, src, bytes },
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
        let host_link = measure_host_link(&ctx, &plan, &alloc, &stream)?;
        let after_alloc = used_bytes()?.0;
        clock.stage(STAGE_ALLOCATE);

        let target = Target::of_arch(&arch, opts.switches);
        let list = merge_launches(lower_step(&trace, &plan, alloc.bases, group, target)?, &opts.switches);
        let LaunchList { launches, last_nodes: launch_nodes, first_nodes: launch_first_nodes } = list;
        let side = side_stream(&ctx, &trace, &plan, &alloc, &launches, &launch_nodes, rank.overlap)?;
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
        let pdl = crate::switches::pdl_on(&arch, &opts.switches);
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
            host_link,
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
            let rule = stepgraph_core::models::param_init(&self.trace, p);
            launches.extend(crate::init::init_launch(rule, name, &out, seed)?);
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
            let args: Vec<Vec<u8>> = l.args.iter().map(|a| a.bytes()).collect::<std::result::Result<_, _>>()?;
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
        let cubin = crate::kernels::compile(name, &self.arch)?;
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

    /// Bytes per second of copies between host and device memory,
    /// measured while opening (`None` when the plan offloads nothing).
    pub fn host_link_bytes_per_second(&self) -> Option<f64> {
        self.host_link
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

    /// Writes the bytes of any value, without a step input's checks (the
    /// inputs of a one-op session: [`crate::testing`]).
    #[cfg(feature = "testing")]
    pub(crate) fn write_unchecked(&mut self, v: ValueId, data: &HostTensor) -> Result<()> {
        let ptr = self.slot_ptr(self.plan.slot(v));
        if data.bytes().len() as u64 != self.plan.slot(v).bytes {
            return Err(CudaError::lower(
                "write",
                format!("{} bytes for a slot of {}", data.bytes().len(), self.plan.slot(v).bytes),
            ));
        }
        // SAFETY: the slot holds exactly the tensor's bytes (checked above),
        // inside the session's memory; the copy finishes before it returns.
        unsafe { dr::memcpy_htod_async(ptr, data.bytes(), self.stream.cu_stream()) }?;
        self.stream.synchronize()?;
        Ok(())
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

    fn prepare_replay_nodes(&mut self, nodes: std::ops::Range<usize>) -> CoreResult<Duration> {
        Ok(self.capture_nodes(nodes)?)
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

    fn host_link_bytes_per_second(&self) -> Option<f64> {
        self.host_link
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

#[cfg(test)]
mod tests {
    use stepgraph_core::autodiff::{build_step, StepKind, TrainOptions};
    use stepgraph_core::dist::{data_parallel, DataParallel};
    use stepgraph_core::models::{build_forward, LossKind, ModelSpec};

    use stepgraph_core::ops::Op;
    use stepgraph_core::plan::{plan, PlanOptions};

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
                let bases = Bases::STAND_IN;
                let collectives = t.nodes.iter().filter(|n| world_of(&n.op).is_some()).count();
                let shards = t.nodes.iter().filter(|n| matches!(n.op, Op::LocalShard(_))).count();
                for rank in 0..world {
                    let list = lower_step(&t, &p, bases, Some(GroupRank { rank, world }), Target::default()).unwrap();
                    let (l, nodes) = (list.launches, list.last_nodes);
                    assert_eq!(nodes.len(), l.len());
                    // With overlap every collective rejoins the compute stream
                    // exactly once: before a launch touching its bytes, or at the end.
                    let side = crate::overlap::on_side(&l, true);
                    let j = crate::overlap::joins(&side, &nodes, &node_ranges(&t, &p, bases));
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
