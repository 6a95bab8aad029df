//! stepgraph's CUDA backend.
//!
//! It receives a step trace and its [`stepgraph_core::plan::MemoryPlan`] and
//! runs the step on an NVIDIA GPU: one device allocation holds the persistent
//! buffer, the arena and the library workspace, laid out by the plan; each
//! node lowers ([`lower`]) to kernel launches of CUDA C sources compiled at
//! run time by NVRTC ([`nvrtc`]) or to cuBLASLt products ([`blas`]), with
//! every address fixed. The session ([`session`]) runs that launch list
//! eagerly or captures it once into one CUDA graph ([`graph`], the only
//! module that knows graphs exist) and replays it.
//!
//! A session may be one rank of a data-parallel group: its collective nodes
//! lower ([`lower_dist`]) to NCCL calls ([`nccl`], loaded only when a step
//! has collectives) on the session's stream, captured with everything else.
//!
//! Everything is loaded dynamically (cudarc's `dynamic-loading`), so the
//! crate builds and its CPU-side tests run on machines without CUDA.

pub mod attention;
pub mod blas;
pub mod error;
pub mod graph;
pub mod kernels;
pub mod launch;
pub mod lower;
pub mod lower_basic;
pub mod lower_dist;
pub mod lower_nn;
pub mod nccl;
pub mod nvrtc;
pub mod overlap;
pub mod session;

pub use error::{CudaError, Result};
