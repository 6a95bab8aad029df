//! Lowering of shape movement (`broadcast`, `reshape`, `permute`, `slice`,
//! its backward and `concat`) to the copy kernels of `kernels/movement.cu`.
//! Index math that depends on shapes alone is done once here instead of per
//! element: size-1 axes are dropped and adjacent axes that stay contiguous
//! are merged, and every copy moves the widest unit (up to 16 bytes) that
//! divides every contiguous run and both addresses. A reshape is a view:
//! nothing runs when the plan aliased it with its source, else one copy.

use stepgraph_core::ops::movement::{Broadcast, Concat, Permute, Reshape, Slice, SliceBackward};

use super::util::{broadcast_strides, contiguous_strides, launch_1d, merge_axes, pad, unit_for, MAX_RANK};
use super::{Lower, LowerCx};
use crate::error::{CudaError, Result};
use crate::kernel_args::{kernel_args, kernel_struct};
use crate::kernel_module::KernelModule;
use crate::launch::{DevTensor, Launch};

const MOVEMENT: &[KernelModule] = &[KernelModule::plain("movement", include_str!("../../kernels/movement.cu"))];

kernel_struct! {
    /// `sg_mv::GatherShape` of movement.cu: the output's axes (`rank` of
    /// them, padded with 1) and the input's stride in copy units along each
    /// (padded with 0).
    pub(crate) struct GatherShape {
        rank: i64,
        size: [i64; MAX_RANK],
        stride: [i64; MAX_RANK],
    }
}

kernel_args! {
    /// `broadcast_<unit>` and `permute_<unit>`: `y[i] = x[offset(i)]` for
    /// the `n` units of `y`.
    pub(crate) struct GatherArgs {
        x: u64,
        y: u64,
        n: i64,
        shape: GatherShape,
    }
}

kernel_args! {
    /// `slice_<unit>`, `slice_backward_<unit>` and `concat_<unit>`, in copy
    /// units: the kernel walks the `n` units of one tensor (the output of a
    /// slice and its backward, the input of a concat) in runs of `walked`,
    /// each the window at `offset` of a run of `other` in the other tensor.
    pub(crate) struct ChunkedArgs {
        x: u64,
        y: u64,
        n: i64,
        walked: i64,
        other: i64,
        offset: i64,
    }
}

/// A strided gather (`broadcast` or `permute`): output axes `sizes`, input
/// element strides `strides` per output axis.
fn gather(
    kernel: &'static str,
    x: &DevTensor,
    y: &DevTensor,
    sizes: &[usize],
    strides: Vec<i64>,
) -> Result<Vec<Launch>> {
    let (mut sizes, mut strides) = {
        let (s, mut st) = merge_axes(sizes, &[strides]);
        (s, st.pop().expect("one operand"))
    };
    if sizes.len() > MAX_RANK {
        return Err(CudaError::lower(
            kernel,
            format!("{} axes after merging; the kernel holds {MAX_RANK}", sizes.len()),
        ));
    }
    let es = y.ty.dtype.size() as i64;
    let last = sizes.len() - 1;
    // The innermost axis is copied in wider units when it is contiguous in the
    // input (the output always is) and every other stride stays a whole number of units.
    let (w, unit) = if strides[last] == 1 {
        let mut q: Vec<u64> = vec![x.ptr, y.ptr, (sizes[last] * es) as u64];
        q.extend(strides[..last].iter().map(|s| (s * es) as u64));
        unit_for(&q)
    } else {
        unit_for(&[x.ptr, y.ptr, es as u64])
    };
    // Addresses are element-aligned (checked in `lower`), so w is a multiple of es.
    let w = w as i64;
    sizes[last] = sizes[last] * es / w;
    for s in &mut strides[..last] {
        *s = *s * es / w;
    }
    let n: i64 = sizes.iter().product();
    let shape = GatherShape { rank: sizes.len() as i64, size: pad(&sizes, 1), stride: pad(&strides, 0) };
    let args = GatherArgs { x: x.ptr, y: y.ptr, n, shape }.args();
    Ok(vec![launch_1d("movement", format!("{kernel}_{unit}"), n as usize, args)])
}

/// (outer count, axis size, inner count) of `shape` around `axis`.
fn split_axis(shape: &[usize], axis: usize) -> (usize, usize, usize) {
    (shape[..axis].iter().product(), shape[axis], shape[axis + 1..].iter().product())
}

/// A chunked copy (`slice`, `slice_backward`, `concat`) of `n` elements;
/// `chunk` holds the kernel's three chunk arguments in elements. All are
/// passed in the widest unit that divides their byte sizes and both addresses.
fn chunked(kernel: &'static str, x: &DevTensor, y: &DevTensor, es: usize, n: usize, chunk: [usize; 3]) -> Launch {
    let es = es as u64;
    let mut q = vec![x.ptr, y.ptr];
    q.extend(chunk.iter().map(|&c| c as u64 * es));
    let (w, unit) = unit_for(&q);
    let units = |c: usize| (c as u64 * es / w) as i64;
    let n_units = units(n);
    let [walked, other, offset] = chunk.map(units);
    let args = ChunkedArgs { x: x.ptr, y: y.ptr, n: n_units, walked, other, offset }.args();
    launch_1d("movement", format!("{kernel}_{unit}"), n_units as usize, args)
}

impl Lower for Broadcast {
    const KERNELS: &'static [KernelModule] = MOVEMENT;

    fn lower(&self, cx: &LowerCx) -> Result<Vec<Launch>> {
        let (x, y) = (&cx.inputs[0], &cx.outputs[0]);
        gather("broadcast", x, y, &self.shape, broadcast_strides(&x.ty.shape, &self.shape))
    }
}

impl Lower for Reshape {
    fn lower(&self, cx: &LowerCx) -> Result<Vec<Launch>> {
        // Planned programs alias a view with its source; copy only when they do not.
        let (src, dst) = (&cx.inputs[0], &cx.outputs[0]);
        Ok(if src.ptr == dst.ptr {
            vec![]
        } else {
            vec![Launch::Copy { dst: dst.ptr, src: src.ptr, bytes: src.ty.bytes() }]
        })
    }
}

impl Lower for Permute {
    const KERNELS: &'static [KernelModule] = MOVEMENT;

    fn lower(&self, cx: &LowerCx) -> Result<Vec<Launch>> {
        let (x, y) = (&cx.inputs[0], &cx.outputs[0]);
        let own = contiguous_strides(&x.ty.shape);
        gather("permute", x, y, &y.ty.shape, self.perm.iter().map(|&a| own[a]).collect())
    }
}

impl Lower for Slice {
    const KERNELS: &'static [KernelModule] = MOVEMENT;

    fn lower(&self, cx: &LowerCx) -> Result<Vec<Launch>> {
        let (x, y) = (&cx.inputs[0], &cx.outputs[0]);
        // Planned programs place a view on its bytes in the input: nothing to run.
        if self.view && y.ptr == x.ptr + self.byte_offset(&x.ty) {
            return Ok(vec![]);
        }
        let (_, full, inner) = split_axis(&x.ty.shape, self.axis);
        let len = self.end - self.start;
        // y[i] = x[(i / cy) * cx + off + i % cy]
        let chunk = [len * inner, full * inner, self.start * inner];
        Ok(vec![chunked("slice", x, y, y.ty.dtype.size(), y.ty.numel(), chunk)])
    }
}

impl Lower for SliceBackward {
    const KERNELS: &'static [KernelModule] = MOVEMENT;

    fn lower(&self, cx: &LowerCx) -> Result<Vec<Launch>> {
        let (g, y) = (&cx.inputs[0], &cx.outputs[0]);
        let (_, len, inner) = split_axis(&g.ty.shape, self.axis);
        // y[i] = x[(i / cy) * cx + j - lo] for lo <= j = i % cy < lo + cx, else 0
        let chunk = [self.size * inner, len * inner, self.start * inner];
        Ok(vec![chunked("slice_backward", g, y, y.ty.dtype.size(), y.ty.numel(), chunk)])
    }
}

impl Lower for Concat {
    const KERNELS: &'static [KernelModule] = MOVEMENT;

    fn lower(&self, cx: &LowerCx) -> Result<Vec<Launch>> {
        let y = &cx.outputs[0];
        let (_, full, inner) = split_axis(&y.ty.shape, self.axis);
        let mut start = 0;
        let mut launches = Vec::new();
        for x in cx.inputs {
            let len = x.ty.shape[self.axis];
            if x.ty.numel() > 0 {
                // y[(i / cx) * cy + off + i % cx] = x[i]
                let chunk = [len * inner, full * inner, start * inner];
                launches.push(chunked("concat", x, y, y.ty.dtype.size(), x.ty.numel(), chunk));
            }
            start += len;
        }
        Ok(launches)
    }
}

#[cfg(test)]
mod tests {
    use stepgraph_core::ir::DType;
    use stepgraph_core::ops::Op;

    use super::super::testing::{function, kernels, lower_types, t};
    use super::*;

    #[test]
    fn movement_copies_the_widest_unit() {
        // bf16 rows of 32 elements at 16-byte-aligned offsets: 16-byte units.
        assert_eq!(function(Slice::new(1, 16, 48), &[t(DType::BF16, &[4, 64])]), "slice_u128");
        // An odd run: element units.
        assert_eq!(function(Slice::new(1, 5, 12), &[t(DType::BF16, &[3, 17])]), "slice_u16");
        assert_eq!(function(Permute { perm: vec![0, 2, 1, 3] }, &[t(DType::F32, &[2, 16, 4, 64])]), "permute_u128");
        assert_eq!(function(Permute { perm: vec![1, 0] }, &[t(DType::F64, &[3, 5])]), "permute_u64");
        assert_eq!(function(Broadcast { shape: vec![4, 17] }, &[t(DType::F16, &[17])]), "broadcast_u16");
        assert_eq!(function(Broadcast { shape: vec![3, 64] }, &[t(DType::Bool, &[64])]), "broadcast_u128");
        assert_eq!(function(Broadcast { shape: vec![3, 64] }, &[t(DType::Bool, &[3, 1])]), "broadcast_u8");
        // Addresses off a 16-byte boundary narrow the unit.
        let l = lower_types(&Slice::new(1, 16, 48).into(), &[t(DType::BF16, &[4, 64])], 4).unwrap();
        assert_eq!(kernels(&l)[0].function, "slice_u32");
    }

    #[test]
    fn a_slice_view_on_its_bytes_launches_nothing() {
        use crate::launch::DevTensor;
        use stepgraph_core::ir::TensorType;
        // k of a fused [1, 1, 9600] q/k/v row: bytes 6400.. of the product's output.
        let mut op = Slice::new(2, 3200, 6400);
        op.view = true;
        let x = DevTensor { ty: TensorType::new(DType::BF16, [1, 1, 9600]), ptr: 1 << 20 };
        let y = |ptr| DevTensor { ty: TensorType::new(DType::BF16, [1, 1, 3200]), ptr };
        let placed =
            crate::ops::lower(&op.clone().into(), std::slice::from_ref(&x), &[y((1 << 20) + 6400)], None).unwrap();
        assert!(placed.is_empty());
        // Elsewhere (a program not planned for views) it copies.
        let copied = crate::ops::lower(&op.into(), &[x], &[y(1 << 24)], None).unwrap();
        assert_eq!(kernels(&copied).len(), 1);
    }

    #[test]
    fn empty_slices_and_parts_copy_nothing() {
        let op = Op::from(Slice::new(0, 2, 2));
        assert!(lower_types(&op, &[t(DType::F32, &[4])], 0).unwrap().is_empty());
        // An empty part of a concat is skipped, the others copied.
        let op = Op::from(Concat { axis: 0 });
        assert_eq!(lower_types(&op, &[t(DType::F32, &[0]), t(DType::F32, &[3])], 0).unwrap().len(), 1);
    }

    #[test]
    fn an_aliased_reshape_is_free_and_another_copies() {
        let op = Op::from(Reshape { shape: vec![6] });
        let x = DevTensor { ty: t(DType::F16, &[2, 3]), ptr: 1 << 20 };
        let y = DevTensor { ty: t(DType::F16, &[6]), ptr: 1 << 20 };
        assert!(super::super::lower(&op, std::slice::from_ref(&x), std::slice::from_ref(&y), None).unwrap().is_empty());
        let z = DevTensor { ptr: 1 << 21, ..y };
        let l = super::super::lower(&op, &[x], &[z], None).unwrap();
        assert_eq!(l, vec![Launch::Copy { dst: 1 << 21, src: 1 << 20, bytes: 12 }]);
    }
}
