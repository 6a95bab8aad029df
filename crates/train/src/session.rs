//! Binding a planned step to a backend: the one place where every command
//! (train, eval, generate, compare, hf) opens its session, on the CPU
//! reference backend or on a GPU, through one [`Backend`] enum
//! ([`open_session`]). `bench`, which profiles and times the CUDA session
//! itself, opens it through [`open_cuda_session`], the GPU half of the same
//! function.
//!
//! A GPU session reads its run-time switches from [`SessionOptions`], or,
//! when none were parsed by the caller, from this process's environment at
//! the moment it opens; a CPU session reads none, so a switch meant for the
//! GPU never stops a CPU run.

use anyhow::{Context, Result};
use serde::Serialize;

use stepgraph_core::cpu::exec::CpuSession;
use stepgraph_core::ir::Trace;
use stepgraph_core::plan::MemoryPlan;
use stepgraph_core::session::Session;
use stepgraph_cuda::blas::GemmTuning;
use stepgraph_cuda::nccl::NcclGroup;
use stepgraph_cuda::session::{gpu_available, CudaOptions, CudaSession, RankOptions};
use stepgraph_cuda::Switches;

/// The backend a step runs on.
#[derive(Copy, Clone, PartialEq, Eq, Debug, Serialize)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    // Plain comments: a doc comment would become the value's help text in
    // every command that takes a backend.
    //
    // The CPU reference backend.
    Cpu,
    // The CUDA backend on one GPU.
    Cuda,
}

impl Backend {
    /// `asked`, or by default CUDA when this machine has an NVIDIA GPU and
    /// the CPU otherwise.
    pub fn or_default(asked: Option<Backend>) -> Backend {
        asked.unwrap_or_else(|| if gpu_available() { Backend::Cuda } else { Backend::Cpu })
    }
}

/// How a GPU session opens; the CPU backend has no options.
#[derive(Clone, Debug, Default)]
pub struct SessionOptions {
    /// The run-time switches; `None` reads them from the environment.
    pub switches: Option<Switches>,
    /// The GPU, and for a data-parallel step the group this session is a rank of.
    pub rank: RankOptions,
    /// f32 products on TF32 tensor cores (cuBLASLt's fast mode) instead of
    /// exact f32; `bench --tf32` measures it.
    pub tf32: bool,
}

impl SessionOptions {
    /// On GPU `device`, with no group and the given switches.
    pub fn on_device(device: usize, switches: Switches) -> Self {
        SessionOptions {
            switches: Some(switches),
            rank: RankOptions { device, ..RankOptions::default() },
            ..SessionOptions::default()
        }
    }

    /// Rank `group.rank` of a data-parallel group on GPU `device`.
    pub fn rank(device: usize, group: Option<NcclGroup>, overlap: bool, switches: Switches) -> Self {
        SessionOptions { switches: Some(switches), rank: RankOptions { device, group, overlap }, tf32: false }
    }
}

/// An opened session and, on a GPU, what cuBLASLt's tuning chose for its
/// products (which `generate --profile` prints).
pub struct Opened {
    pub session: Box<dyn Session>,
    pub gemm_tuning: Option<GemmTuning>,
}

/// Binds the planned `step` to a session of `backend`. A GPU session's
/// error names its GPU, and keeps the backend's error beneath for callers
/// that tell a plan that does not fit from other failures.
pub fn open_session(backend: Backend, step: Trace, plan: MemoryPlan, options: SessionOptions) -> Result<Opened> {
    Ok(match backend {
        Backend::Cpu => Opened { session: Box::new(CpuSession::new(step, plan)?), gemm_tuning: None },
        Backend::Cuda => {
            let s = open_cuda_session(step, plan, options)?;
            let gemm_tuning = Some(s.gemm_tuning().clone());
            Opened { session: Box::new(s), gemm_tuning }
        }
    })
}

/// The CUDA session [`open_session`] opens for [`Backend::Cuda`], as its
/// own type (profiles, memory figures, graph capture).
pub fn open_cuda_session(step: Trace, plan: MemoryPlan, options: SessionOptions) -> Result<CudaSession> {
    let device = options.rank.device;
    let switches = match options.switches {
        Some(s) => s,
        None => CudaOptions::from_env()?.switches,
    };
    let opts = CudaOptions { switches, tf32: options.tf32 };
    CudaSession::new_rank(step, plan, opts, options.rank)
        .with_context(|| format!("opening the CUDA session on GPU {device}"))
}
