//! Lowering of copies between device memory and page-locked host memory
//! ([`stepgraph_core::ops::offload::HostCopy`]): one DMA copy, which the
//! session issues on its copy stream ([`crate::overlap`]).

use stepgraph_core::ops::offload::HostCopy;

use super::{Lower, LowerCx};
use crate::error::Result;
use crate::launch::Launch;

impl Lower for HostCopy {
    fn lower(&self, cx: &LowerCx) -> Result<Vec<Launch>> {
        let (src, dst) = (&cx.inputs[self.source()], &cx.outputs[0]);
        Ok(vec![Launch::HostCopy { dst: dst.ptr, src: src.ptr, bytes: src.ty.bytes() }])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::launch::DevTensor;
    use stepgraph_core::ir::{DType, TensorType};
    use stepgraph_core::ops::Op;

    #[test]
    fn a_copy_is_one_host_copy_of_the_whole_value() {
        let ty = TensorType::new(DType::BF16, [3, 5]);
        let input = [DevTensor { ty: ty.clone(), ptr: 1 << 20 }];
        let output = [DevTensor { ty, ptr: 1 << 45 }];
        let l =
            crate::ops::lower(&Op::from(HostCopy { to_host: true, into_state: false }), &input, &output, None).unwrap();
        assert_eq!(l, vec![Launch::HostCopy { dst: 1 << 45, src: 1 << 20, bytes: 30 }]);
    }
}
