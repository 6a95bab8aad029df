//! Lowering of `matmul` to a [`GemmCall`]: a (batched) row-major product
//! that [`crate::blas::Blas`] runs through cuBLASLt. Batched operands are
//! contiguous `[batch, rows, cols]`; an unbatched one is shared across the
//! batch with stride 0, or, when it is the right operand of untransposed
//! row blocks, the blocks are stacked into one taller product. An addend
//! (`matmul`'s third input) becomes cuBLASLt's `beta = 1` with the addend as
//! C, or its bias epilogue for a row vector.

use stepgraph_core::ir::DType;
use stepgraph_core::ops::matmul::{AddendKind, MatMul};

use super::{Lower, LowerCx};
use crate::error::{CudaError, Result};
use crate::launch::{DevTensor, GemmAddend, GemmCall, GemmType, Launch};

impl Lower for MatMul {
    fn lower(&self, cx: &LowerCx) -> Result<Vec<Launch>> {
        let (a, b, c) = (&cx.inputs[0], &cx.inputs[1], &cx.outputs[0]);
        let ty = match c.ty.dtype {
            DType::F32 if self.tf32 => GemmType::Tf32,
            DType::F32 => GemmType::F32,
            DType::BF16 => GemmType::BF16,
            DType::F16 => GemmType::F16,
            d => return Err(CudaError::unsupported("matmul", format!("no cuBLASLt product for {d}"))),
        };
        let (sa, sb, sc) = (&a.ty.shape, &b.ty.shape, &c.ty.shape);
        let (mut m, n) = (sc[sc.len() - 2], sc[sc.len() - 1]);
        let k = if self.trans_a { sa[sa.len() - 2] } else { sa[sa.len() - 1] };
        let mut batch: usize = sc[..sc.len() - 2].iter().product();
        // A batch of row blocks times one shared matrix (a linear layer on
        // [B, T, C]) is one product of B·T rows: `a` and `c` are contiguous,
        // so their blocks stack into taller matrices. One GEMM reads the
        // shared operand once, where a batch of B products reads it B times
        // (at T = 1, a decode step, that is B matrix-vector products).
        let fold = batch > 1 && sa.len() > 2 && sb.len() == 2 && !self.trans_a;
        if fold {
            m *= batch;
            batch = 1;
        }
        let batched = |s: &[usize]| !fold && s.len() > 2;
        let addend = gemm_addend("matmul", c, cx.inputs.get(2))?;
        Ok(vec![Launch::Gemm(GemmCall {
            ty,
            batch,
            m,
            n,
            k,
            trans_a: self.trans_a,
            trans_b: self.trans_b,
            a: a.ptr,
            b: b.ptr,
            c: c.ptr,
            stride_a: if batched(sa) { (m * k) as i64 } else { 0 },
            stride_b: if batched(sb) { (k * n) as i64 } else { 0 },
            stride_c: (m * n) as i64,
            addend,
            fp8_scales: None,
        })])
    }
}

/// What a product `c` adds in its epilogue: the addend `x`, a tensor of
/// `c`'s type or a row of it, or nothing.
pub(super) fn gemm_addend(op: &str, c: &DevTensor, x: Option<&DevTensor>) -> Result<GemmAddend> {
    Ok(match x {
        None => GemmAddend::None,
        Some(x) => match MatMul::addend_kind(&c.ty, &x.ty) {
            Some(AddendKind::Full) => GemmAddend::Full(x.ptr),
            Some(AddendKind::Bias) => GemmAddend::Bias(x.ptr),
            None => return Err(CudaError::lower(op, format!("addend {} for a product {}", x.ty, c.ty))),
        },
    })
}

#[cfg(test)]
mod tests {
    use stepgraph_core::ir::DType;
    use stepgraph_core::ops::Op;

    use super::super::testing::{lower_types, t};
    use super::*;

    #[test]
    fn a_batched_product_shares_an_unbatched_operand() {
        let op = Op::from(MatMul::new(false, true));
        let l = lower_types(&op, &[t(DType::BF16, &[4, 8]), t(DType::BF16, &[3, 5, 8])], 0).unwrap();
        let [Launch::Gemm(g)] = &l[..] else { panic!("expected one product, got {l:?}") };
        assert_eq!((g.ty, g.batch, g.m, g.n, g.k), (GemmType::BF16, 3, 4, 5, 8));
        assert_eq!((g.stride_a, g.stride_b, g.stride_c), (0, 40, 20));
        assert!(lower_types(&op, &[t(DType::F64, &[4, 8]), t(DType::F64, &[5, 8])], 0).is_err());
    }

    #[test]
    fn a_batch_of_row_blocks_times_a_shared_matrix_is_one_product() {
        let op = Op::from(MatMul::new(false, true));
        let l = lower_types(&op, &[t(DType::BF16, &[16, 1, 3200]), t(DType::BF16, &[8640, 3200])], 0).unwrap();
        let [Launch::Gemm(g)] = &l[..] else { panic!("expected one product, got {l:?}") };
        assert_eq!((g.batch, g.m, g.n, g.k), (1, 16, 8640, 3200));
        // A transposed batched `a` is not a stack of row blocks: it stays batched.
        let op = Op::from(MatMul::new(true, false));
        let l = lower_types(&op, &[t(DType::F32, &[3, 8, 4]), t(DType::F32, &[8, 5])], 0).unwrap();
        let [Launch::Gemm(g)] = &l[..] else { panic!("expected one product, got {l:?}") };
        assert_eq!((g.batch, g.m, g.stride_b), (3, 4, 0));
    }
}
