//! Matrix products through cuBLASLt.
//!
//! [`lower_matmul`] turns a `matmul` node into a [`GemmCall`] (data);
//! [`Blas`] executes calls, with one cached cuBLASLt plan (descriptors and
//! the heuristic's algorithm) per distinct shape, so nothing is re-planned
//! per step and the calls capture into a graph. Row-major products are run
//! as the column-major product `Cᵀ = op(B)ᵀ · op(A)ᵀ`, which needs no copies.
//! f32 is computed in full f32 unless TF32 is asked for; bf16/f16 multiply
//! with f32 accumulation.

use stepgraph_core::ir::DType;
use stepgraph_core::ops::matmul::MatMul;

use crate::error::{CudaError, Result};
use crate::launch::{DevTensor, GemmCall, GemmType, Launch};

/// The [`GemmCall`] of a matmul node over fixed addresses.
pub fn lower_matmul(op: &MatMul, inputs: &[DevTensor], outputs: &[DevTensor]) -> Result<Launch> {
    let (a, b, c) = (&inputs[0], &inputs[1], &outputs[0]);
    let ty = match c.ty.dtype {
        DType::F32 => GemmType::F32,
        DType::BF16 => GemmType::BF16,
        DType::F16 => GemmType::F16,
        d => return Err(CudaError::lower("matmul", format!("no cuBLASLt product for {d}"))),
    };
    let (sa, sb, sc) = (&a.ty.shape, &b.ty.shape, &c.ty.shape);
    let (m, n) = (sc[sc.len() - 2], sc[sc.len() - 1]);
    let k = if op.trans_a { sa[sa.len() - 2] } else { sa[sa.len() - 1] };
    let batch: usize = sc[..sc.len() - 2].iter().product();
    let batched = |s: &[usize]| s.len() > 2;
    Ok(Launch::Gemm(GemmCall {
        ty,
        batch,
        m,
        n,
        k,
        trans_a: op.trans_a,
        trans_b: op.trans_b,
        a: a.ptr,
        b: b.ptr,
        c: c.ptr,
        stride_a: if batched(sa) { (m * k) as i64 } else { 0 },
        stride_b: if batched(sb) { (k * n) as i64 } else { 0 },
        stride_c: (m * n) as i64,
    }))
}
