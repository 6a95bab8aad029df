//! The interface every op's CPU reference kernel is written against
//! ([`crate::ops::OpDef::cpu`]): the storage types a kernel is generic over
//! ([`Float`]), the buffers of one call ([`KernelIo`], [`TensorView`]), the
//! communicator a collective kernel meets its peers through
//! ([`Communicator`]), and the fixed-chunk parallel loop kernels split
//! their work with. The CPU backend ([`crate::cpu`]) hands these to the
//! kernels; it lives there and depends on the ops, never the other way.
//!
//! **Invariants:** kernels never read their outputs before writing them
//! (arena memory is reused and holds garbage); kernel results depend only on
//! input values and shapes, never on addresses or thread timing.

use std::fmt::Debug;
use std::iter::Sum;
use std::sync::Arc;

use bytemuck::Pod;
use half::{bf16, f16};
use num_traits::{Float as NumFloat, FromPrimitive, ToPrimitive};
use rayon::prelude::*;

use crate::error::{Error, Result};
use crate::host::HostTensor;
use crate::ir::{DType, TensorType};

/// A floating storage type. Arithmetic happens in `Acc`: f32 for f32, bf16
/// and f16 (stored narrow, computed in f32), f64 for f64.
pub trait Float: Pod + Send + Sync + Debug + 'static {
    type Acc: NumFloat + FromPrimitive + Sum + Send + Sync + Debug + 'static;
    const DTYPE: DType;
    fn acc(self) -> Self::Acc;
    fn from_acc(a: Self::Acc) -> Self;
    fn from_f64(x: f64) -> Self {
        Self::from_acc(c(x))
    }
}

impl Float for f32 {
    type Acc = f32;
    const DTYPE: DType = DType::F32;
    fn acc(self) -> f32 {
        self
    }
    fn from_acc(a: f32) -> f32 {
        a
    }
}
impl Float for f64 {
    type Acc = f64;
    const DTYPE: DType = DType::F64;
    fn acc(self) -> f64 {
        self
    }
    fn from_acc(a: f64) -> f64 {
        a
    }
}
impl Float for bf16 {
    type Acc = f32;
    const DTYPE: DType = DType::BF16;
    fn acc(self) -> f32 {
        self.to_f32()
    }
    fn from_acc(a: f32) -> bf16 {
        bf16::from_f32(a)
    }
}
impl Float for f16 {
    type Acc = f32;
    const DTYPE: DType = DType::F16;
    fn acc(self) -> f32 {
        self.to_f32()
    }
    fn from_acc(a: f32) -> f16 {
        f16::from_f32(a)
    }
}

/// A constant in the accumulator type.
#[inline]
pub fn c<A: FromPrimitive>(x: f64) -> A {
    A::from_f64(x).expect("constant representable in the accumulator type")
}

/// Runs `$body` with `$T` bound to the storage type of float dtype `$dt`.
/// `$body` must evaluate to `Result<()>`.
#[macro_export]
macro_rules! with_float {
    ($dt:expr, $T:ident => $body:expr) => {
        match $dt {
            $crate::ir::DType::F32 => {
                type $T = f32;
                $body
            }
            $crate::ir::DType::F64 => {
                type $T = f64;
                $body
            }
            $crate::ir::DType::BF16 => {
                type $T = half::bf16;
                $body
            }
            $crate::ir::DType::F16 => {
                type $T = half::f16;
                $body
            }
            d => Err($crate::error::Error::Cpu(format!("expected a float dtype, got {d}"))),
        }
    };
}

/// A tensor in host memory as a kernel sees it.
#[derive(Clone, Debug)]
pub struct TensorView {
    pub ty: TensorType,
    pub ptr: *mut u8,
}

// SAFETY: a view is a plain address; the executor guarantees that the memory
// outlives every kernel that receives it and that concurrent kernels never
// write the same bytes.
unsafe impl Send for TensorView {}
unsafe impl Sync for TensorView {}

impl TensorView {
    fn byte_range(&self) -> (usize, usize) {
        let start = self.ptr as usize;
        (start, start + self.ty.bytes() as usize)
    }

    fn overlaps(&self, other: &TensorView) -> bool {
        let (a0, a1) = self.byte_range();
        let (b0, b1) = other.byte_range();
        a0 < b1 && b0 < a1
    }
}

/// A raw pointer that may cross threads; kernels use it to write disjoint parts of one output.
#[derive(Copy, Clone, Debug)]
pub struct SendPtr<T>(pub *mut T);
// SAFETY: a `SendPtr` is an address with no ownership; every dereference goes
// through the unsafe `read`/`write`, whose callers promise in-bounds indices
// that no other thread touches at the same time (kernels split outputs into
// disjoint chunks), so moving or sharing the address itself cannot race.
unsafe impl<T> Send for SendPtr<T> {}
unsafe impl<T> Sync for SendPtr<T> {}

impl<T> SendPtr<T> {
    /// # Safety
    /// `i` must be in bounds and no other thread may access element `i` concurrently.
    #[inline]
    pub unsafe fn read(self, i: usize) -> T {
        self.0.add(i).read()
    }
    /// # Safety
    /// As for [`SendPtr::read`].
    #[inline]
    pub unsafe fn write(self, i: usize, v: T) {
        self.0.add(i).write(v)
    }
}

/// The inputs and outputs of one kernel call, and the communicator of the
/// rank that runs it (collective ops need one; every other kernel ignores it).
///
/// Outputs may alias inputs only for `(output, input)` pairs the op declares
/// in [`crate::ops::OpDef::inplace`]; [`KernelIo::input`] and
/// [`KernelIo::output`] check that the slices they hand out do not alias,
/// and [`KernelIo::inplace`] serves the declared pairs.
pub struct KernelIo<'a> {
    pub inputs: &'a [TensorView],
    pub outputs: &'a [TensorView],
    pub comm: Option<&'a dyn Communicator>,
}

impl<'a> KernelIo<'a> {
    /// A kernel call outside any group of ranks.
    pub fn new(inputs: &'a [TensorView], outputs: &'a [TensorView]) -> Self {
        KernelIo { inputs, outputs, comm: None }
    }

    /// The communicator, or an error naming the collective `op` that needs one.
    pub fn comm(&self, op: &str) -> Result<&'a dyn Communicator> {
        self.comm.ok_or_else(|| {
            Error::Collective(format!(
                "`{op}` needs a communicator: run the step in a rank session (CpuSession::set_comm, cpu::comm::run_ranks)"
            ))
        })
    }

    pub fn in_ty(&self, i: usize) -> &TensorType {
        &self.inputs[i].ty
    }

    pub fn out_ty(&self, i: usize) -> &TensorType {
        &self.outputs[i].ty
    }

    fn check_elem<T>(view: &TensorView, what: &str) {
        assert_eq!(
            std::mem::size_of::<T>(),
            view.ty.dtype.size(),
            "{what}: element type does not match dtype {}",
            view.ty.dtype
        );
    }

    /// Input `i` as a slice. Panics if it aliases an output.
    pub fn input<T: Pod>(&self, i: usize) -> &'a [T] {
        let v = &self.inputs[i];
        Self::check_elem::<T>(v, "input");
        assert!(
            !self.outputs.iter().any(|o| o.overlaps(v)),
            "input {i} aliases an output: the kernel must use `inplace`"
        );
        // SAFETY: the executor hands out live, initialised memory of
        // `ty.bytes()` bytes, aligned for every dtype; no output overlaps it.
        unsafe { std::slice::from_raw_parts(v.ptr as *const T, v.ty.numel()) }
    }

    /// Output `i` as a mutable slice. Panics if it aliases an input or another output.
    #[allow(clippy::mut_from_ref)]
    pub fn output<T: Pod>(&self, i: usize) -> &'a mut [T] {
        let v = &self.outputs[i];
        Self::check_elem::<T>(v, "output");
        assert!(
            !self.inputs.iter().any(|x| x.overlaps(v)),
            "output {i} aliases an input: the kernel must use `inplace`"
        );
        assert!(
            !self.outputs.iter().enumerate().any(|(j, o)| j != i && o.overlaps(v)),
            "output {i} aliases another output"
        );
        // SAFETY: as for `input`; each kernel takes each output once.
        unsafe { std::slice::from_raw_parts_mut(v.ptr as *mut T, v.ty.numel()) }
    }

    /// Output `out`, holding the contents of input `inp` (copied there unless
    /// the two share storage), for kernels that update in place.
    #[allow(clippy::mut_from_ref)]
    pub fn inplace<T: Pod>(&self, out: usize, inp: usize) -> &'a mut [T] {
        let (o, x) = (&self.outputs[out], &self.inputs[inp]);
        Self::check_elem::<T>(o, "output");
        assert_eq!(o.ty.bytes(), x.ty.bytes(), "in-place pair of different sizes");
        if o.ptr != x.ptr {
            assert!(!o.overlaps(x), "in-place pair partially overlaps");
            // SAFETY: distinct, non-overlapping buffers of equal size.
            unsafe { std::ptr::copy_nonoverlapping(x.ptr, o.ptr, x.ty.bytes() as usize) };
        }
        // SAFETY: the slice covers exactly output `out`; the kernel must not
        // take input `inp` as a slice as well (it would alias).
        unsafe { std::slice::from_raw_parts_mut(o.ptr as *mut T, o.ty.numel()) }
    }

    /// Raw pointer to input `i` for kernels that tolerate aliasing.
    pub fn input_ptr<T: Pod>(&self, i: usize) -> SendPtr<T> {
        Self::check_elem::<T>(&self.inputs[i], "input");
        SendPtr(self.inputs[i].ptr as *mut T)
    }

    /// Raw pointer to output `i` for kernels that tolerate aliasing.
    pub fn output_ptr<T: Pod>(&self, i: usize) -> SendPtr<T> {
        Self::check_elem::<T>(&self.outputs[i], "output");
        SendPtr(self.outputs[i].ptr as *mut T)
    }

    /// Integer input `i` (i32 or i64) widened to i64.
    pub fn ids(&self, i: usize) -> Result<Vec<i64>> {
        match self.in_ty(i).dtype {
            DType::I32 => Ok(self.input::<i32>(i).iter().map(|&x| x as i64).collect()),
            DType::I64 => Ok(self.input::<i64>(i).to_vec()),
            d => Err(Error::Cpu(format!("expected integer ids, got {d}"))),
        }
    }

    /// A float scalar input read as f64 (learning rate, step count, a cotangent seed).
    pub fn scalar(&self, i: usize) -> Result<f64> {
        let v = &self.inputs[i];
        if v.ty.numel() != 1 {
            return Err(Error::Cpu(format!("expected a scalar, got {}", v.ty)));
        }
        let mut out = 0.0;
        with_float!(v.ty.dtype, T => {
            // SAFETY: a one-element input, read by value.
            let x: T = unsafe { self.input_ptr::<T>(i).read(0) };
            out = x.acc().to_f64().unwrap_or(f64::NAN);
            Ok(())
        })?;
        Ok(out)
    }
}

/// Elements per parallel work item for pointwise kernels: large enough that
/// scheduling cost is negligible, small enough to spread over cores.
pub const CHUNK: usize = 1 << 14;

/// Parallel loop over `n` items in fixed chunks. The split depends only on `n`,
/// so results never depend on the thread count or timing.
pub fn par_chunks(n: usize, chunk: usize, f: impl Fn(std::ops::Range<usize>) + Sync) {
    let chunks = n.div_ceil(chunk.max(1));
    if chunks <= 1 {
        f(0..n);
        return;
    }
    (0..chunks).into_par_iter().for_each(|c| f(c * chunk..((c + 1) * chunk).min(n)));
}

/// One rank's view of a group of ranks.
pub trait Communicator: Send + Sync {
    /// This rank, in `0..world`.
    fn rank(&self) -> usize;
    /// Number of ranks in the group.
    fn world(&self) -> usize;
    /// A rendezvous of every rank: each contributes `data` under `tag` (the
    /// collective and its operand types, which must agree on every rank) and
    /// receives every rank's contribution, indexed by rank.
    fn exchange(&self, tag: &str, data: Vec<HostTensor>) -> Result<Arc<Vec<Vec<HostTensor>>>>;
    /// Fails every pending and future exchange of the group with `reason`
    /// (called by a rank whose step failed, so its peers do not wait for it).
    fn abort(&self, reason: &str);
}
