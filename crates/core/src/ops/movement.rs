//! Shape movement: broadcast, reshape (a view), permute, slice and concat.

use super::elementwise::{broadcast_shapes, BroadcastIndex};
use super::sample::{ids, normal, Input, Sample};
use super::{expect_inputs, no_vjp, Attr, Attrs, OpDef, VjpArgs};
use crate::error::Result;
use crate::ir::DType;
use crate::ir::{Builder, TensorType, ValueId};
use crate::ops::kernel::{par_chunks, KernelIo, CHUNK};

fn ints(v: &[usize]) -> Attr {
    Attr::Ints(v.iter().map(|&d| d as i64).collect())
}

/// Copies bytes of `elem` size between element positions; every movement
/// kernel is a gather `out[i] = in[src(i)]` on raw elements of any dtype.
fn gather(io: &KernelIo, input: usize, n: usize, src: impl Fn(usize) -> usize + Sync) {
    let size = io.in_ty(input).dtype.size();
    let x = io.inputs[input].ptr as usize;
    let y = io.outputs[0].ptr as usize;
    par_chunks(n, CHUNK, |r| {
        for i in r {
            // SAFETY: movement ops never alias input and output (no in-place
            // pairs), `src(i)` is in bounds of the input and chunks are disjoint.
            unsafe { std::ptr::copy_nonoverlapping((x + src(i) * size) as *const u8, (y + i * size) as *mut u8, size) }
        }
    });
}

// ---------------------------------------------------------------- broadcast

/// Broadcasts to `shape` with numpy rules (materialised).
#[derive(Clone, PartialEq, Debug)]
pub struct Broadcast {
    pub shape: Vec<usize>,
}

impl OpDef for Broadcast {
    /// Scalars, trailing and middle broadcasts, rows of 16-byte multiples
    /// (copied in wide units on the GPU) and odd ones, no-op broadcasts.
    fn samples(d: DType) -> Vec<Sample> {
        let shapes: [(&[usize], &[usize]); 11] = [
            (&[], &[5, 7]),
            (&[1], &[1031]),
            (&[3, 1], &[2, 3, 4]),
            (&[17], &[4, 17]),
            (&[64], &[3, 64]),
            (&[4, 1, 6], &[4, 5, 6]),
            (&[1, 1], &[1, 1]),
            (&[2, 1, 8, 1], &[2, 3, 8, 5]),
            (&[1, 16], &[9, 16]),
            (&[5, 3], &[5, 3]),
            (&[3, 1], &[3, 4]),
        ];
        let mut v = Vec::new();
        for dt in movement_dtypes(d) {
            for (from, to) in shapes {
                v.push(Sample::new(Broadcast { shape: to.to_vec() }, vec![movement_input(dt, from)]));
            }
        }
        v
    }
    fn name(&self) -> &'static str {
        "broadcast"
    }
    fn infer(&self, inputs: &[&TensorType]) -> std::result::Result<Vec<TensorType>, String> {
        expect_inputs(inputs, 1)?;
        match broadcast_shapes(&inputs[0].shape, &self.shape) {
            Some(s) if s == self.shape => Ok(vec![inputs[0].with_shape(self.shape.clone())]),
            _ => Err(format!("cannot broadcast to {:?}", self.shape)),
        }
    }
    fn vjp(&self, b: &mut Builder, args: &VjpArgs) -> Result<Vec<Option<ValueId>>> {
        let Some(g) = args.cotangents[0] else { return Ok(vec![None]) };
        let shape = b.shape(args.inputs[0]).to_vec();
        Ok(vec![Some(b.sum_to(g, &shape)?)])
    }
    fn cpu(&self, io: &KernelIo) -> Result<()> {
        let map = BroadcastIndex::new(&io.in_ty(0).shape, &self.shape);
        gather(io, 0, io.out_ty(0).numel(), |i| map.map(i));
        Ok(())
    }
    fn attrs(&self) -> Vec<(&'static str, Attr)> {
        vec![("shape", ints(&self.shape))]
    }
    fn parse(name: &str, a: &mut Attrs) -> Option<Result<Self>> {
        (name == "broadcast").then(|| Ok(Broadcast { shape: a.usizes("shape")? }))
    }
}

// ---------------------------------------------------------------- reshape

/// Same elements, another shape. A view: the output is the input's storage.
#[derive(Clone, PartialEq, Debug)]
pub struct Reshape {
    pub shape: Vec<usize>,
}

impl OpDef for Reshape {
    /// Splits, merges, adding and dropping size-1 axes, scalars.
    fn samples(d: DType) -> Vec<Sample> {
        let shapes: [(&[usize], &[usize]); 6] = [
            (&[3, 4], &[6, 2]),
            (&[2, 3, 4], &[24]),
            (&[], &[1]),
            (&[1], &[]),
            (&[17], &[1, 17, 1]),
            (&[5, 211], &[211, 5]),
        ];
        let mut v = Vec::new();
        for dt in movement_dtypes(d) {
            for (from, to) in shapes {
                v.push(Sample::new(Reshape { shape: to.to_vec() }, vec![movement_input(dt, from)]));
            }
        }
        v
    }
    fn name(&self) -> &'static str {
        "reshape"
    }
    fn infer(&self, inputs: &[&TensorType]) -> std::result::Result<Vec<TensorType>, String> {
        expect_inputs(inputs, 1)?;
        let target = inputs[0].with_shape(self.shape.clone());
        if target.checked_numel() != Some(inputs[0].numel()) {
            let n = target.checked_numel().map_or("more than 2^64".to_string(), |n| n.to_string());
            return Err(format!("cannot reshape {} elements to {:?} ({n} elements)", inputs[0].numel(), self.shape));
        }
        Ok(vec![inputs[0].with_shape(self.shape.clone())])
    }
    fn vjp(&self, b: &mut Builder, args: &VjpArgs) -> Result<Vec<Option<ValueId>>> {
        let Some(g) = args.cotangents[0] else { return Ok(vec![None]) };
        let shape = b.shape(args.inputs[0]).to_vec();
        Ok(vec![Some(b.reshape(g, &shape)?)])
    }
    fn cpu(&self, io: &KernelIo) -> Result<()> {
        // Planned programs alias the two and never launch this; a program
        // without a plan for views still gets the right bytes.
        if io.inputs[0].ptr != io.outputs[0].ptr {
            let bytes = io.in_ty(0).bytes() as usize;
            // SAFETY: distinct buffers of equal size (the shape rule).
            unsafe { std::ptr::copy_nonoverlapping(io.inputs[0].ptr, io.outputs[0].ptr, bytes) };
        }
        Ok(())
    }
    fn attrs(&self) -> Vec<(&'static str, Attr)> {
        vec![("shape", ints(&self.shape))]
    }
    fn parse(name: &str, a: &mut Attrs) -> Option<Result<Self>> {
        (name == "reshape").then(|| Ok(Reshape { shape: a.usizes("shape")? }))
    }
    fn view_of(&self) -> Option<usize> {
        Some(0)
    }
}

// ---------------------------------------------------------------- permute

/// Output axis `i` is input axis `perm[i]` (materialised).
#[derive(Clone, PartialEq, Debug)]
pub struct Permute {
    pub perm: Vec<usize>,
}

impl OpDef for Permute {
    /// Ranks 0 to 8: transposes, head swaps, full reversals, size-1 axes.
    fn samples(d: DType) -> Vec<Sample> {
        let shapes: [(&[usize], &[usize]); 12] = [
            (&[], &[]),
            (&[17], &[0]),
            (&[3, 5], &[1, 0]),
            (&[2, 3, 4], &[2, 0, 1]),
            (&[4, 8, 16], &[1, 0, 2]),
            (&[4, 8, 16], &[2, 1, 0]),
            (&[2, 3, 4, 5], &[0, 2, 1, 3]),
            (&[2, 16, 4, 64], &[0, 2, 1, 3]),
            (&[3, 1, 7, 2], &[3, 2, 1, 0]),
            (&[2, 3, 2, 3, 2], &[4, 0, 3, 1, 2]),
            (&[2, 2, 3, 2, 2, 3], &[5, 3, 1, 0, 2, 4]),
            (&[2, 3, 2, 2, 3, 2, 2, 3], &[7, 6, 5, 4, 3, 2, 1, 0]),
        ];
        let mut v = Vec::new();
        for dt in movement_dtypes(d) {
            for (shape, perm) in shapes {
                v.push(Sample::new(Permute { perm: perm.to_vec() }, vec![movement_input(dt, shape)]));
            }
        }
        v
    }
    fn name(&self) -> &'static str {
        "permute"
    }
    fn infer(&self, inputs: &[&TensorType]) -> std::result::Result<Vec<TensorType>, String> {
        expect_inputs(inputs, 1)?;
        let rank = inputs[0].rank();
        let mut seen = vec![false; rank];
        if self.perm.len() != rank || self.perm.iter().any(|&p| p >= rank || std::mem::replace(&mut seen[p], true)) {
            return Err(format!("{:?} is not a permutation of {rank} axes", self.perm));
        }
        Ok(vec![inputs[0].with_shape(self.perm.iter().map(|&p| inputs[0].shape[p]).collect::<Vec<_>>())])
    }
    fn vjp(&self, b: &mut Builder, args: &VjpArgs) -> Result<Vec<Option<ValueId>>> {
        let Some(g) = args.cotangents[0] else { return Ok(vec![None]) };
        let mut inv = vec![0; self.perm.len()];
        for (i, &p) in self.perm.iter().enumerate() {
            inv[p] = i;
        }
        Ok(vec![Some(b.permute(g, &inv)?)])
    }
    fn cpu(&self, io: &KernelIo) -> Result<()> {
        let shape = &io.in_ty(0).shape;
        let mut in_strides = vec![1; shape.len()];
        for i in (0..shape.len().saturating_sub(1)).rev() {
            in_strides[i] = in_strides[i + 1] * shape[i + 1];
        }
        let out_shape: Vec<usize> = self.perm.iter().map(|&p| shape[p]).collect();
        let strides: Vec<usize> = self.perm.iter().map(|&p| in_strides[p]).collect();
        gather(io, 0, io.out_ty(0).numel(), |mut i| {
            let mut src = 0;
            for ax in (0..out_shape.len()).rev() {
                src += (i % out_shape[ax]) * strides[ax];
                i /= out_shape[ax];
            }
            src
        });
        Ok(())
    }
    fn attrs(&self) -> Vec<(&'static str, Attr)> {
        vec![("perm", ints(&self.perm))]
    }
    fn parse(name: &str, a: &mut Attrs) -> Option<Result<Self>> {
        (name == "permute").then(|| Ok(Permute { perm: a.usizes("perm")? }))
    }
}

// ---------------------------------------------------------------- slice

/// `x[..., start:end, ...]` along `axis`. With `view`, the output is
/// planned as bytes of the input's storage (no kernel runs): only for a
/// slice whose bytes are one contiguous run of the input (every axis before
/// `axis` of size 1) starting at a multiple of the arena's alignment
/// ([`Slice::can_view`]), or, with `narrow`, of [`NARROW_VIEW_ALIGN`]
/// bytes, for a slice that only ops reading inputs at such boundaries read
/// ([`crate::ops::OpDef::reads_16_byte_aligned_inputs`]);
/// `passes::slice_views` sets them where that holds.
#[derive(Clone, PartialEq, Debug)]
pub struct Slice {
    pub axis: usize,
    pub start: usize,
    pub end: usize,
    pub view: bool,
    /// The view starts on a [`NARROW_VIEW_ALIGN`]-byte boundary, not
    /// necessarily an arena one.
    pub narrow: bool,
}

/// Where a narrow slice view may start: the 16-byte boundary of the widest
/// vector loads kernels make.
pub const NARROW_VIEW_ALIGN: u64 = 16;

impl Slice {
    /// A slice that copies.
    pub fn new(axis: usize, start: usize, end: usize) -> Slice {
        Slice { axis, start, end, view: false, narrow: false }
    }

    /// The alignment this slice's view must start at: the arena's, or
    /// [`NARROW_VIEW_ALIGN`] for a narrow view.
    pub fn view_align(&self) -> u64 {
        if self.narrow {
            NARROW_VIEW_ALIGN
        } else {
            crate::ir::ARENA_ALIGN
        }
    }

    /// Byte offset of the slice's first element in an input of type `input`.
    pub fn byte_offset(&self, input: &TensorType) -> u64 {
        let (_, _, inner) = split_axis(&input.shape, self.axis);
        (self.start * inner * input.dtype.size()) as u64
    }

    /// Whether the slice of `input` can be a view: one contiguous run of
    /// the input, starting on an arena boundary (kernels and libraries read
    /// every arena tensor at such a boundary).
    pub fn can_view(&self, input: &TensorType) -> bool {
        self.can_view_at(input, crate::ir::ARENA_ALIGN)
    }

    /// Whether the slice of `input` is one contiguous run of it starting on
    /// an `align`-byte boundary.
    pub fn can_view_at(&self, input: &TensorType, align: u64) -> bool {
        let (outer, _, _) = split_axis(&input.shape, self.axis);
        outer == 1 && self.byte_offset(input).is_multiple_of(align)
    }
}

/// Splits a shape around `axis` into (outer count, axis size, inner count).
fn split_axis(shape: &[usize], axis: usize) -> (usize, usize, usize) {
    (shape[..axis].iter().product(), shape[axis], shape[axis + 1..].iter().product())
}

impl OpDef for Slice {
    /// `SLICES`.
    fn samples(d: DType) -> Vec<Sample> {
        let mut v = Vec::new();
        for dt in movement_dtypes(d) {
            for (shape, axis, start, end) in SLICES {
                v.push(Sample::new(Slice::new(axis, start, end), vec![movement_input(dt, shape)]));
            }
        }
        v
    }
    fn name(&self) -> &'static str {
        "slice"
    }
    fn infer(&self, inputs: &[&TensorType]) -> std::result::Result<Vec<TensorType>, String> {
        expect_inputs(inputs, 1)?;
        let s = &inputs[0].shape;
        if self.axis >= s.len() || self.start > self.end || self.end > s[self.axis] {
            return Err(format!("slice {}..{} of axis {} is out of range", self.start, self.end, self.axis));
        }
        if self.narrow && !self.view {
            return Err("only a view can be narrow".into());
        }
        if self.view && !self.can_view_at(inputs[0], self.view_align()) {
            return Err(format!(
                "slice {}..{} of axis {} of {} cannot be a view: not one contiguous run on a {}-byte boundary",
                self.start,
                self.end,
                self.axis,
                inputs[0],
                self.view_align()
            ));
        }
        let mut out = s.clone();
        out[self.axis] = self.end - self.start;
        Ok(vec![inputs[0].with_shape(out)])
    }
    fn vjp(&self, b: &mut Builder, args: &VjpArgs) -> Result<Vec<Option<ValueId>>> {
        let Some(g) = args.cotangents[0] else { return Ok(vec![None]) };
        let size = b.shape(args.inputs[0])[self.axis];
        let op = SliceBackward { axis: self.axis, start: self.start, size };
        Ok(vec![Some(b.push1(op.into(), &[g])?)])
    }
    fn cpu(&self, io: &KernelIo) -> Result<()> {
        // Planned programs place a view on its bytes and never launch it;
        // a program without a plan for views still gets the right bytes.
        if self.view
            && io.outputs[0].ptr.cast_const() == io.inputs[0].ptr.wrapping_add(self.byte_offset(io.in_ty(0)) as usize)
        {
            return Ok(());
        }
        let (_, full, inner) = split_axis(&io.in_ty(0).shape, self.axis);
        let len = self.end - self.start;
        let start = self.start;
        gather(io, 0, io.out_ty(0).numel(), |i| {
            let (o, rest) = (i / (len * inner), i % (len * inner));
            o * full * inner + start * inner + rest
        });
        Ok(())
    }
    fn attrs(&self) -> Vec<(&'static str, Attr)> {
        let mut a = vec![
            ("axis", Attr::Int(self.axis as i64)),
            ("start", Attr::Int(self.start as i64)),
            ("end", Attr::Int(self.end as i64)),
        ];
        if self.view {
            a.push(("view", Attr::Bool(true)));
        }
        if self.narrow {
            a.push(("narrow", Attr::Bool(true)));
        }
        a
    }
    fn parse(name: &str, a: &mut Attrs) -> Option<Result<Self>> {
        (name == "slice").then(|| {
            Ok(Slice {
                axis: a.usize("axis")?,
                start: a.usize("start")?,
                end: a.usize("end")?,
                view: a.opt_bool("view")?.unwrap_or(false),
                narrow: a.opt_bool("narrow")?.unwrap_or(false),
            })
        })
    }
    fn view_of(&self) -> Option<usize> {
        self.view.then_some(0)
    }
    fn view_offset(&self, input: &TensorType) -> u64 {
        if self.view {
            self.byte_offset(input)
        } else {
            0
        }
    }
}

/// The cotangent of a slice: `g` placed at `start` along `axis` of a zero tensor of extent `size`.
#[derive(Clone, PartialEq, Debug)]
pub struct SliceBackward {
    pub axis: usize,
    pub start: usize,
    pub size: usize,
}

impl OpDef for SliceBackward {
    /// The cotangents of `SLICES`.
    fn samples(d: DType) -> Vec<Sample> {
        let mut v = Vec::new();
        for dt in movement_dtypes(d) {
            for (shape, axis, start, end) in SLICES {
                let mut gs = shape.to_vec();
                gs[axis] = end - start;
                let op = SliceBackward { axis, start, size: shape[axis] };
                v.push(Sample::new(op, vec![movement_input(dt, &gs)]));
            }
        }
        v
    }
    fn name(&self) -> &'static str {
        "slice_backward"
    }
    fn infer(&self, inputs: &[&TensorType]) -> std::result::Result<Vec<TensorType>, String> {
        expect_inputs(inputs, 1)?;
        let s = &inputs[0].shape;
        if self.axis >= s.len() || self.start.checked_add(s[self.axis]).is_none_or(|end| end > self.size) {
            return Err(format!("cannot place axis {} at {} of extent {}", self.axis, self.start, self.size));
        }
        let mut out = s.clone();
        out[self.axis] = self.size;
        Ok(vec![inputs[0].with_shape(out)])
    }
    fn vjp(&self, _b: &mut Builder, _args: &VjpArgs) -> Result<Vec<Option<ValueId>>> {
        no_vjp(self.name())
    }
    fn cpu(&self, io: &KernelIo) -> Result<()> {
        let (_, len, inner) = split_axis(&io.in_ty(0).shape, self.axis);
        let size = io.in_ty(0).dtype.size();
        let (full, start) = (self.size, self.start);
        let x = io.inputs[0].ptr as usize;
        let y = io.outputs[0].ptr as usize;
        par_chunks(io.out_ty(0).numel(), CHUNK, |r| {
            for i in r {
                let (o, pos, rest) = (i / (full * inner), (i / inner) % full, i % inner);
                let dst = (y + i * size) as *mut u8;
                // SAFETY: disjoint chunks of the output; source in bounds; no aliasing.
                unsafe {
                    if pos >= start && pos < start + len {
                        let src = o * len * inner + (pos - start) * inner + rest;
                        std::ptr::copy_nonoverlapping((x + src * size) as *const u8, dst, size);
                    } else {
                        std::ptr::write_bytes(dst, 0, size);
                    }
                }
            }
        });
        Ok(())
    }
    fn attrs(&self) -> Vec<(&'static str, Attr)> {
        vec![
            ("axis", Attr::Int(self.axis as i64)),
            ("start", Attr::Int(self.start as i64)),
            ("size", Attr::Int(self.size as i64)),
        ]
    }
    fn parse(name: &str, a: &mut Attrs) -> Option<Result<Self>> {
        (name == "slice_backward")
            .then(|| Ok(SliceBackward { axis: a.usize("axis")?, start: a.usize("start")?, size: a.usize("size")? }))
    }
}

// ---------------------------------------------------------------- concat

/// Joins its inputs along `axis`.
#[derive(Clone, PartialEq, Debug)]
pub struct Concat {
    pub axis: usize,
}

impl OpDef for Concat {
    /// One part, several, parts of one element along the axis, first,
    /// middle and last axes, rows of 16-byte multiples.
    fn samples(d: DType) -> Vec<Sample> {
        let parts: [(&[&[usize]], usize); 8] = [
            (&[&[17]], 0),
            (&[&[3], &[17], &[1]], 0),
            (&[&[2, 3], &[4, 3]], 0),
            (&[&[2, 1, 3], &[2, 3, 3]], 1),
            (&[&[4, 8], &[4, 24], &[4, 8]], 1),
            (&[&[3, 5], &[3, 1], &[3, 7]], 1),
            (&[&[2, 1, 6], &[2, 3, 6], &[2, 2, 6], &[2, 5, 6]], 1),
            (&[&[2, 3, 64], &[2, 3, 64], &[2, 3, 64]], 2),
        ];
        let mut v = Vec::new();
        for dt in movement_dtypes(d) {
            for (shapes, axis) in parts {
                let xs = shapes.iter().map(|s| movement_input(dt, s)).collect();
                v.push(Sample::new(Concat { axis }, xs));
            }
        }
        v
    }
    fn name(&self) -> &'static str {
        "concat"
    }
    fn infer(&self, inputs: &[&TensorType]) -> std::result::Result<Vec<TensorType>, String> {
        let first = inputs.first().ok_or("needs at least one input")?;
        if self.axis >= first.rank() {
            return Err(format!("axis {} out of range for rank {}", self.axis, first.rank()));
        }
        let mut out = first.shape.clone();
        out[self.axis] = 0;
        for t in inputs {
            let same_rest =
                t.rank() == first.rank() && (0..t.rank()).all(|i| i == self.axis || t.shape[i] == first.shape[i]);
            if t.dtype != first.dtype || !same_rest {
                return Err(format!("{t} does not match {first} outside axis {}", self.axis));
            }
            out[self.axis] = out[self.axis]
                .checked_add(t.shape[self.axis])
                .ok_or_else(|| format!("the parts' extents along axis {} sum past 2^64", self.axis))?;
        }
        Ok(vec![first.with_shape(out)])
    }
    fn vjp(&self, b: &mut Builder, args: &VjpArgs) -> Result<Vec<Option<ValueId>>> {
        let Some(g) = args.cotangents[0] else { return Ok(vec![None; args.inputs.len()]) };
        let mut start = 0;
        let mut out = Vec::new();
        for &x in args.inputs {
            let len = b.shape(x)[self.axis];
            out.push(Some(b.slice(g, self.axis, start, start + len)?));
            start += len;
        }
        Ok(out)
    }
    fn cpu(&self, io: &KernelIo) -> Result<()> {
        let (_, full, inner) = split_axis(&io.out_ty(0).shape, self.axis);
        let mut start = 0;
        for k in 0..io.inputs.len() {
            let (outer, len, _) = split_axis(&io.in_ty(k).shape, self.axis);
            let size = io.in_ty(k).dtype.size();
            let (x, y) = (io.inputs[k].ptr as usize, io.outputs[0].ptr as usize);
            for o in 0..outer {
                let bytes = len * inner * size;
                // SAFETY: each input block lands in its own disjoint range of the output.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        (x + o * bytes) as *const u8,
                        (y + (o * full + start) * inner * size) as *mut u8,
                        bytes,
                    )
                }
            }
            start += len;
        }
        Ok(())
    }
    fn attrs(&self) -> Vec<(&'static str, Attr)> {
        vec![("axis", Attr::Int(self.axis as i64))]
    }
    fn parse(name: &str, a: &mut Attrs) -> Option<Result<Self>> {
        (name == "concat").then(|| Ok(Concat { axis: a.usize("axis")? }))
    }
}

impl Builder {
    pub fn broadcast(&mut self, x: ValueId, shape: &[usize]) -> Result<ValueId> {
        if self.shape(x) == shape {
            return Ok(x);
        }
        self.push1(Broadcast { shape: shape.to_vec() }.into(), &[x])
    }
    pub fn reshape(&mut self, x: ValueId, shape: &[usize]) -> Result<ValueId> {
        if self.shape(x) == shape {
            return Ok(x);
        }
        self.push1(Reshape { shape: shape.to_vec() }.into(), &[x])
    }
    pub fn permute(&mut self, x: ValueId, perm: &[usize]) -> Result<ValueId> {
        self.push1(Permute { perm: perm.to_vec() }.into(), &[x])
    }
    /// Swaps the last two axes.
    pub fn transpose(&mut self, x: ValueId) -> Result<ValueId> {
        let r = self.shape(x).len();
        let mut perm: Vec<usize> = (0..r).collect();
        if r >= 2 {
            perm.swap(r - 1, r - 2);
        }
        self.permute(x, &perm)
    }
    pub fn slice(&mut self, x: ValueId, axis: usize, start: usize, end: usize) -> Result<ValueId> {
        self.push1(Slice::new(axis, start, end).into(), &[x])
    }
    pub fn concat(&mut self, xs: &[ValueId], axis: usize) -> Result<ValueId> {
        self.push1(Concat { axis }.into(), xs)
    }
}

/// The dtypes of the movement samples of float dtype `d`: `d`, and under
/// f32 also i32, i64 and bool (movement copies bits, so one listing of the
/// other types suffices; they come after the float samples, see
/// [`super::sample`]).
fn movement_dtypes(d: DType) -> Vec<DType> {
    if d == DType::F32 {
        vec![DType::F32, DType::I32, DType::I64, DType::Bool]
    } else {
        vec![d]
    }
}

/// A movement input of type `dt`: normal floats, ids up to 2^30, or bools.
fn movement_input(dt: DType, shape: &[usize]) -> Input {
    match dt {
        DType::I32 | DType::I64 => ids(dt, shape, 1 << 30),
        DType::Bool => ids(dt, shape, 2),
        _ => normal(dt, shape),
    }
}

/// (shape, axis, start, end) of the slice samples: element-wide and
/// 16-byte copies, the whole axis, one element, first, middle and last axes.
const SLICES: [(&[usize], usize, usize, usize); 10] = [
    (&[17], 0, 3, 11),
    (&[1031], 0, 0, 1031),
    (&[3, 17], 1, 5, 12),
    (&[4, 64], 1, 16, 48),
    (&[4, 64], 0, 1, 3),
    (&[2, 4, 3], 1, 1, 3),
    (&[2, 3, 5, 7], 2, 1, 4),
    (&[2, 3, 5, 8], 3, 0, 4),
    (&[5, 3, 24], 1, 2, 3),
    (&[6, 2, 8], 2, 7, 8),
];
