//! What the GPU test files share: the tolerances by which CUDA results may
//! differ from the CPU reference (each documented where the bound comes
//! from) and the input draws. Included by each test binary with `mod common;`,
//! so a binary may leave some of it unused.
#![allow(dead_code)]

use stepgraph_core::host::HostTensor;
use stepgraph_core::ir::{DType, TensorType};
use stepgraph_core::ops::sample;
use stepgraph_core::testing::draw_input;

/// Relative tolerance of results that differ only by the rounding of
/// library functions (exp, tanh, erf, pow) in pointwise ops.
pub fn basic_tol(dt: DType) -> f64 {
    match dt {
        DType::F32 => 1e-5,
        DType::F64 => 1e-12,
        DType::BF16 => 1e-2,
        DType::F16 => 2e-3,
        _ => 0.0,
    }
}

/// Relative tolerance of the row-wise network ops and matmul, reducing over
/// `reduced` elements: a different summation order's rounding grows about
/// as the square root of the number of terms.
pub fn row_tol(dt: DType, reduced: usize) -> f64 {
    let widen = (reduced as f64 / 1024.0).sqrt().max(1.0);
    match dt {
        DType::F32 => 1e-5 * widen,
        DType::F64 => 1e-11 * widen,
        DType::BF16 => 1e-2,
        DType::F16 => 2e-3,
        // Integer and bool outputs must match exactly.
        _ => 0.0,
    }
}

/// Tolerance of attention's o (and, in the stat dtype, lse), relative to
/// max(max |cpu|, 1): inputs are unit normal, so the outputs are O(1), and
/// the floor covers outputs that are zero up to rounding.
pub fn attention_tol(dtype: DType) -> f64 {
    match dtype {
        DType::F32 => 1e-5,
        DType::BF16 => 2e-2,
        DType::F16 => 5e-3,
        DType::F64 => 1e-11,
        d => panic!("no tolerance for {d}"),
    }
}

/// Tolerance of gq, gk, gv. In f32, `ds = p·(go·v − D_i)` subtracts two sums
/// of D products that nearly cancel when p sits on one key (at T = 1 exactly:
/// o = v), which amplifies rounding by about √D·ε: up to 7e-6 at D = 256
/// against an f64 reference on the CPU emulator of these kernels.
///
/// The f32 tensor-core kernels (3xTF32, head sizes 17..=128) round each
/// product operand's remainder to TF32 and drop the remainder·remainder
/// term: about 2⁻²² relative per product instead of f32's 2⁻²⁴, measured up
/// to 2.6e-5 on unit-scale logits at D = 96..128 (peaked p, cancelling ds).
pub fn attention_grad_tol(dtype: DType, d: usize) -> f64 {
    if dtype == DType::F32 {
        if stepgraph_cuda::attention::mma_width(&stepgraph_cuda::Switches::from_env().unwrap(), dtype, d).is_some() {
            5e-5
        } else {
            2e-5
        }
    } else {
        attention_tol(dtype)
    }
}

pub fn tensor(dtype: DType, shape: &[usize], data: &[f64]) -> HostTensor {
    HostTensor::from_f64(TensorType::new(dtype, shape.to_vec()), data)
}

pub fn scalar(dtype: DType, x: f64) -> HostTensor {
    tensor(dtype, &[], &[x])
}

/// Standard normal values of `shape` in `dtype`, as the samples draw them.
pub fn normal(shape: &[usize], dtype: DType, seed: u64) -> HostTensor {
    draw_input(&sample::normal(dtype, shape), seed).unwrap()
}

/// Values in [0.5, 2) of `shape` in `dtype`, as the samples draw them.
pub fn positive(shape: &[usize], dtype: DType, seed: u64) -> HostTensor {
    draw_input(&sample::positive(dtype, shape), seed).unwrap()
}
