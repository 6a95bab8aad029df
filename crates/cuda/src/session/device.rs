//! The device side of building a session: opening the GPU (stage 2) and
//! making the session's memory (stage 3), the one device allocation and
//! the host tables' page-locked memory.

use std::sync::Arc;

use cudarc::driver::{result as dr, CudaContext, CudaStream};

use stepgraph_core::plan::MemoryPlan;

use super::{align, device_count, gpu_available, used_bytes};
use crate::blas::Blas;
use crate::error::{CudaError, Result};
use crate::lower::Bases;

/// The GPU a session runs on, as stage 2 leaves it.
pub(super) struct Device {
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    pub arch: String,
    pub baseline: u64,
    pub total: u64,
}

/// The session's one device allocation, `[persistent | arena | workspace]`,
/// and the host tables' page-locked host memory, mapped into the device's
/// address space.
pub(super) struct Allocation {
    pub base: u64,
    /// The host allocation (its host pointer), or 0.
    pub host: u64,
    pub bases: Bases,
    /// Arena bytes (the plan's, aligned).
    pub arena: u64,
    pub workspace_base: u64,
    /// cuBLASLt workspace bytes.
    pub workspace: u64,
    /// The whole allocation.
    pub bytes: u64,
}

/// Stage 2: opens GPU `device` (after `CUDA_VISIBLE_DEVICES`): its context
/// with event tracking off, one compute stream, its architecture, and the
/// memory baseline.
pub(super) fn open_device(device: usize) -> Result<Device> {
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
pub(super) fn allocate(plan: &MemoryPlan, stream: &CudaStream, baseline: u64, total: u64) -> Result<Allocation> {
    // Page-locked host memory is refused before anything is allocated too.
    stepgraph_core::host::memory::check_fits(plan.host_bytes, "the plan's page-locked host memory")?;
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

/// Page-locked host memory of `bytes` for the plan's host region, mapped
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
                "allocating {:.3} GB of page-locked host memory (host tables and offloaded values): {e}",
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

/// How fast copies between the plan's page-locked host memory and the
/// device run here, in bytes per second (the slower direction), when the
/// plan offloads values or states; `None` when it does not. Times one copy
/// each way of up to 256 MiB between the start of the host region and the
/// start of the arena (after one untimed pair, which maps the pages): the
/// second copy writes back the bytes the first read, and nothing has been
/// written to either yet; the arena bytes are poisoned again after.
pub(super) fn measure_host_link(
    ctx: &Arc<CudaContext>,
    plan: &MemoryPlan,
    alloc: &Allocation,
    stream: &CudaStream,
) -> Result<Option<f64>> {
    use cudarc::driver::sys::{cuMemcpyAsync, CUevent_flags};
    if plan.host_bytes <= plan.host_table_bytes {
        return Ok(None);
    }
    let bytes = plan.host_bytes.min(alloc.arena).min(256 << 20);
    if bytes == 0 {
        return Ok(None);
    }
    let (host, device) = (alloc.bases.host, alloc.bases.arena);
    let s = stream.cu_stream();
    let copy = |dst: u64, src: u64| {
        // SAFETY: `[host, host + bytes)` lies inside the page-locked
        // allocation and `[device, device + bytes)` inside the arena,
        // neither written yet.
        unsafe { cuMemcpyAsync(dst, src, bytes as usize, s) }.result()
    };
    copy(device, host)?;
    copy(host, device)?;
    let event = || ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT));
    let (start, down, up) = (event()?, event()?, event()?);
    start.record(stream)?;
    copy(device, host)?;
    down.record(stream)?;
    copy(host, device)?;
    up.record(stream)?;
    stream.synchronize()?;
    let slower = (start.elapsed_ms(&down)? as f64).max(down.elapsed_ms(&up)? as f64);
    // SAFETY: the arena bytes just written, inside the allocation.
    unsafe { dr::memset_d8_async(device, 0xFF, bytes as usize, s) }?;
    stream.synchronize()?;
    Ok(Some(bytes as f64 / (slower.max(1e-6) / 1e3)))
}
