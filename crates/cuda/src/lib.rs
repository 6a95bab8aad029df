//! stepgraph's CUDA backend.
//!
//! It receives a step trace and its [`stepgraph_core::plan::MemoryPlan`] and
//! runs the step on an NVIDIA GPU: one device allocation holds the persistent
//! buffer, the arena and the library workspace, laid out by the plan (host
//! tables in page-locked host memory beside it); each node lowers
//! ([`lower`], one impl per op in [`ops`]) to kernel launches of CUDA C
//! sources ([`kernels`]) compiled at run time by NVRTC ([`nvrtc`]) or to
//! cuBLASLt products ([`blas`]), with every address fixed, into one
//! [`launch::LaunchList`]. The session ([`session`]) runs that launch list
//! eagerly or captures it once into one CUDA graph ([`graph`], the only
//! module that knows graphs exist) and replays it.
//!
//! A session may be one rank of a data-parallel group: its collective nodes
//! lower ([`ops::collective`]) to NCCL calls ([`nccl`], loaded only when a step
//! has collectives) on the session's stream, captured with everything else.
//!
//! Initial weights are drawn in place by a kernel ([`init`]) that gives the
//! bits core's host generator gives.
//!
//! The `STEPGRAPH_*` switches that choose kernels, product algorithms and
//! launch merges are parsed once into [`Switches`] ([`switches`]) and
//! carried in the session's options and the lowering's [`ops::Target`].
//!
//! Everything is loaded dynamically (cudarc's `dynamic-loading`), so the
//! crate builds and its CPU-side tests run on machines without CUDA. The
//! `testing` feature adds the `testing` module, the one-op GPU harness of the
//! crate's GPU tests.

pub mod blas;
pub mod error;
pub mod graph;
pub mod init;
pub(crate) mod kernel_args;
pub mod kernel_module;
pub mod kernels;
pub mod launch;
pub mod lower;
pub mod nccl;
pub mod nvrtc;
pub mod ops;
pub mod overlap;
pub mod session;
pub mod switches;
#[cfg(feature = "testing")]
pub mod testing;

pub use error::{CudaError, Result};
/// The attention lowering keeps its old path (`stepgraph_cuda::attention`).
pub use ops::attention;
pub use switches::Switches;
