//! The lowering entry point: each node of the step, with the fixed
//! addresses of its operands, becomes a list of [`crate::launch::Launch`]es.
//! The dispatch, generated from core's op list, and every op's lowering
//! live in [`crate::ops`]; this module keeps the path the session uses.

pub use crate::ops::{lower, lower_for, GroupRank, Target};
