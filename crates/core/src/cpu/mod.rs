//! The CPU backend: the numerical reference for every other backend.
//!
//! It owns the host arena (one allocation for persistent state and one for
//! the planned arena), eager execution and the replay executor (the CPU
//! analogue of a CUDA graph: the launch list is recorded once with fixed
//! addresses and replayed), and the communicators of its ranks. The kernels
//! it runs are the ops' own ([`crate::ops::OpDef::cpu`]), written against
//! [`crate::ops::kernel`]: the backend depends on the ops, not they on it.
//!
//! **Invariants:** kernels never read their outputs before writing them
//! (arena memory is reused and holds garbage); kernel results depend only on
//! input values and shapes, never on addresses or thread timing, so planned
//! and unplanned runs, and replay and eager runs, agree bit for bit.

pub mod comm;
pub mod exec;
