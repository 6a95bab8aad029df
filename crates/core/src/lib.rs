//! stepgraph core: the step compiler and the CPU reference backend.
//!
//! The pipeline: a model builder ([`models`]) records ops on symbolic tensors
//! into a forward [`ir::Trace`]; [`autodiff`] turns it into a step trace
//! (forward, loss, backward and optionally the optimizer); [`passes`]
//! rewrite it (folded adds, the optimizer in backward, recomputation), all
//! through one [`passes::run_passes`]; [`plan`] schedules the step and
//! assigns every value an offset in one arena or a persistent buffer;
//! [`cpu`] runs the planned program with the ops' own kernels ([`ops`]).
//! [`dist`] turns a step into the step of one rank of a data-parallel group
//! (collectives inserted after autodiff), which [`cpu::comm`] runs in
//! threads. [`pipeline`] assembles those stages, from a model spec to a
//! checked plan, for every caller, and [`session::Session`] is the
//! interface every backend's session offers. [`train_program`] joins a
//! training step and the forward that validates it into one program over
//! one plan. Nothing here knows about CUDA.

pub mod autodiff;
pub mod cpu;
pub mod dist;
pub mod error;
pub mod generation;
pub mod host;
pub mod ir;
pub mod models;
pub mod ops;
pub mod passes;
pub mod pipeline;
pub mod plan;
pub mod session;
pub mod testing;
pub mod train_program;
pub mod types;

pub use error::{Error, Result};
