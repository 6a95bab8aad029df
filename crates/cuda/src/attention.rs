//! (being written)
use stepgraph_core::ops::Op;
use crate::error::Result;
use crate::launch::{DevTensor, Launch};
pub fn lower(op: &Op, _inputs: &[DevTensor], _outputs: &[DevTensor]) -> Result<Vec<Launch>> {
    Err(crate::lower::not_routed(op))
}
