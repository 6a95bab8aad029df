//! Collective ops: communication between the ranks of a data-parallel step.
//!
//! - [`AllReduce`]: a bucket of tensors summed (or averaged, the `1/world`
//!   folded in) over the ranks, in place; every rank gets the result.
//! - [`ReduceScatter`]: a bucket of tensors summed or averaged over the
//!   ranks, each rank keeping only its shard of every tensor (ZeRO-1).
//! - [`AllGather`]: every rank's shard of a bucket of tensors concatenated
//!   into the full tensors, written over the tensors named as destinations
//!   (the parameters, updated in place under ZeRO-1).
//! - [`LocalShard`]: no communication: a copy of this rank's shard of a
//!   tensor, the one op whose result depends on the rank.
//!
//! One node is one bucket: a backend issues it as one grouped library call
//! (NCCL: `ncclGroupStart`, one call per tensor, `ncclGroupEnd`). Every op
//! carries the group size `world` it was built for (a session of another
//! size refuses the program), and the bucket ops their tensor count.
//!
//! **Shards** are flat element ranges: a tensor of `n` elements splits into
//! `world` shards of `n / world` elements (a `[n / world]` tensor), rank `r`
//! owning elements `[r·n/world, (r+1)·n/world)`. Every rank's buffer in a
//! collective thus has the same size, as NCCL requires; a tensor whose
//! element count `world` does not divide cannot be sharded (the shape rule
//! says so).
//!
//! **No VJP:** [`crate::dist::data_parallel`] inserts collectives into a
//! finished step trace, after autodiff. They are never differentiated.
//!
//! **CPU semantics** (the reference): each rank exchanges its operands
//! through its [`crate::ops::kernel::Communicator`], then reduces them itself
//! in rank order (rank 0 first) in the accumulator type, multiplies by
//! `1/world` for a mean and rounds once to the storage type. Every rank so
//! gets identical bits. NCCL sums in another order (and in the storage type
//! for bf16/f16), so GPU results agree with these up to reduction-order
//! rounding.

use super::sample::{normal, Sample};
use super::{expect_float, Attr, Attrs, OpDef, VjpArgs};
use crate::error::{Error, Result};
use crate::host::HostTensor;
use crate::ir::DType;
use crate::ir::{Builder, TensorType, ValueId};
use crate::ops::kernel::{c, par_chunks, Float, KernelIo, CHUNK};
use crate::with_float;

/// How a reduction combines the ranks' values.
#[derive(Copy, Clone, PartialEq, Eq, Debug)]
pub enum ReduceOp {
    Sum,
    /// The sum times `1/world`: gradients of a mean loss over the global batch.
    Mean,
}

/// What a backend must do for a collective node: data for the lowering.
#[derive(Copy, Clone, PartialEq, Eq, Debug)]
pub enum CollectiveKind {
    /// In place, output `i` over input `i` (NCCL `ncclAllReduce`, `ncclSum` or `ncclAvg`).
    AllReduce(ReduceOp),
    /// Input `i` (full) to output `i` (this rank's shard) (NCCL `ncclReduceScatter`).
    ReduceScatter(ReduceOp),
    /// Inputs `k..2k` (shards) to outputs `0..k`, which live in inputs `0..k` (NCCL `ncclAllGather`).
    AllGather,
    /// No communication: a device copy from the rank's offset of the input.
    LocalShard,
}

fn world_attr(a: &mut Attrs) -> Result<usize> {
    a.usize("world")
}

fn check_world(world: usize) -> std::result::Result<(), String> {
    if world == 0 {
        return Err("world must be at least 1 rank".into());
    }
    Ok(())
}

/// The shard type of `t` over `world` ranks, or why it has none.
pub fn shard_type(t: &TensorType, world: usize) -> std::result::Result<TensorType, String> {
    check_world(world)?;
    let n = t.numel();
    if !n.is_multiple_of(world) {
        return Err(format!(
            "{t} has {n} elements, which do not split into {world} equal shards \
             (shards are flat element ranges of equal size)"
        ));
    }
    Ok(t.with_shape(vec![n / world]))
}

fn no_vjp(name: &str) -> Result<Vec<Option<ValueId>>> {
    Err(Error::NotDifferentiable {
        op: name.to_string(),
        reason: "is a collective: data_parallel inserts collectives into a finished step, after autodiff, \
                 so they have no VJP rule"
            .into(),
    })
}

/// The bucket's tensor count, checked against the inputs.
fn check_count(inputs: &[&TensorType], tensors: usize, per_tensor: usize) -> std::result::Result<(), String> {
    if tensors == 0 {
        return Err("a bucket needs at least one tensor".into());
    }
    if inputs.len() != tensors * per_tensor {
        return Err(format!(
            "expects {} inputs for a bucket of {tensors} tensors, got {}",
            tensors * per_tensor,
            inputs.len()
        ));
    }
    Ok(())
}

/// The exchange tag: the op and its operand types, which every rank must agree on.
fn tag(name: &str, types: &[&TensorType]) -> String {
    let t: Vec<String> = types.iter().map(|t| t.to_string()).collect();
    format!("{name} {}", t.join(", "))
}

/// The communicator of `io`, checked against the op's group size.
fn comm<'a>(io: &KernelIo<'a>, name: &str, world: usize) -> Result<&'a dyn crate::ops::kernel::Communicator> {
    let comm = io.comm(name)?;
    if comm.world() != world {
        return Err(Error::Collective(format!(
            "`{name}` is for {world} ranks, but this rank's communicator has {}",
            comm.world()
        )));
    }
    Ok(comm)
}

/// A copy of input `i`'s bytes (read before any output is written, so it may alias one).
fn snapshot(io: &KernelIo, i: usize) -> HostTensor {
    let v = &io.inputs[i];
    let mut h = HostTensor::zeros(v.ty.clone());
    let n = h.bytes().len();
    // SAFETY: the executor hands out live memory of `ty.bytes()` bytes for every input.
    unsafe { std::ptr::copy_nonoverlapping(v.ptr, h.bytes_mut().as_mut_ptr(), n) };
    h
}

/// The CPU side of a bucket reduction: exchanges this rank's inputs and
/// writes output `i` as the reduction of every rank's input `i`, whole
/// (all-reduce) or only this rank's shard of it (`scatter`, reduce-scatter).
fn reduce_bucket(io: &KernelIo, name: &str, world: usize, op: ReduceOp, scatter: bool) -> Result<()> {
    let comm = comm(io, name, world)?;
    let types: Vec<&TensorType> = io.inputs.iter().map(|v| &v.ty).collect();
    let local: Vec<HostTensor> = (0..io.inputs.len()).map(|i| snapshot(io, i)).collect();
    let all = comm.exchange(&tag(name, &types), local)?;
    for (i, out) in io.outputs.iter().enumerate() {
        let parts: Vec<&HostTensor> = all.iter().map(|rank| &rank[i]).collect();
        let k = out.ty.numel();
        let first = if scatter { comm.rank() * k } else { 0 };
        with_float!(out.ty.dtype, T => {
            reduce_into::<T>(&parts, first, k, op, world, out.ptr);
            Ok(())
        })?;
    }
    Ok(())
}

/// `out[j] = op over ranks of parts[r][offset + j]`, in rank order, for `j < len`.
fn reduce_into<T: Float>(parts: &[&HostTensor], offset: usize, len: usize, op: ReduceOp, world: usize, out: *mut u8) {
    let parts: Vec<&[T]> = parts.iter().map(|h| bytemuck::cast_slice::<u8, T>(h.bytes())).collect();
    let scale: T::Acc = c(1.0 / world as f64);
    let out = crate::ops::kernel::SendPtr(out as *mut T);
    par_chunks(len, CHUNK, |r| {
        for j in r {
            let mut acc = parts[0][offset + j].acc();
            for p in &parts[1..] {
                acc = acc + p[offset + j].acc();
            }
            if op == ReduceOp::Mean {
                acc = acc * scale;
            }
            // SAFETY: `j < len`, the output's element count; chunks are disjoint.
            unsafe { out.write(j, T::from_acc(acc)) };
        }
    });
}

// ---------------------------------------------------------------- all-reduce

/// All-reduce of a bucket of `tensors` float tensors, in place: output `i`
/// has input `i`'s type and may share its storage.
#[derive(Clone, PartialEq, Debug)]
pub struct AllReduce {
    pub op: ReduceOp,
    pub world: usize,
    pub tensors: usize,
}

impl OpDef for AllReduce {
    /// Sum and mean over one rank and over larger groups, buckets of one
    /// and two tensors.
    fn samples(d: DType) -> Vec<Sample> {
        let cases: [(ReduceOp, usize, &[&[usize]]); 4] = [
            (ReduceOp::Sum, 1, &[&[3, 4]]),
            (ReduceOp::Mean, 1, &[&[3, 4], &[5]]),
            (ReduceOp::Sum, 2, &[&[4, 6]]),
            (ReduceOp::Mean, 4, &[&[8], &[2, 3]]),
        ];
        cases
            .into_iter()
            .map(|(op, world, shapes)| {
                let xs = shapes.iter().map(|s| normal(d, s)).collect();
                Sample::new(AllReduce { op, world, tensors: shapes.len() }, xs)
            })
            .collect()
    }
    fn name(&self) -> &'static str {
        match self.op {
            ReduceOp::Sum => "all_reduce_sum",
            ReduceOp::Mean => "all_reduce_mean",
        }
    }
    fn infer(&self, inputs: &[&TensorType]) -> std::result::Result<Vec<TensorType>, String> {
        check_world(self.world)?;
        check_count(inputs, self.tensors, 1)?;
        for (i, t) in inputs.iter().enumerate() {
            expect_float(t, &format!("tensor {i}"))?;
        }
        Ok(inputs.iter().map(|t| (*t).clone()).collect())
    }
    fn vjp(&self, _b: &mut Builder, _args: &VjpArgs) -> Result<Vec<Option<ValueId>>> {
        no_vjp(self.name())
    }
    fn cpu(&self, io: &KernelIo) -> Result<()> {
        reduce_bucket(io, self.name(), self.world, self.op, false)
    }
    fn attrs(&self) -> Vec<(&'static str, Attr)> {
        vec![("world", Attr::Int(self.world as i64)), ("tensors", Attr::Int(self.tensors as i64))]
    }
    fn parse(name: &str, a: &mut Attrs) -> Option<Result<Self>> {
        let op = match name {
            "all_reduce_sum" => ReduceOp::Sum,
            "all_reduce_mean" => ReduceOp::Mean,
            _ => return None,
        };
        Some((|| Ok(AllReduce { op, world: world_attr(a)?, tensors: a.usize("tensors")? }))())
    }
    fn inplace(&self) -> Vec<(usize, usize)> {
        (0..self.tensors).map(|i| (i, i)).collect()
    }
}

// ---------------------------------------------------------------- reduce-scatter

/// Reduce-scatter of a bucket of `tensors` float tensors: output `i` is this
/// rank's shard ([`shard_type`]) of the reduction of input `i`.
#[derive(Clone, PartialEq, Debug)]
pub struct ReduceScatter {
    pub op: ReduceOp,
    pub world: usize,
    pub tensors: usize,
}

impl OpDef for ReduceScatter {
    /// Sum and mean over one rank and over larger groups, buckets of one
    /// and two tensors.
    fn samples(d: DType) -> Vec<Sample> {
        let cases: [(ReduceOp, usize, &[&[usize]]); 4] = [
            (ReduceOp::Sum, 1, &[&[3, 4]]),
            (ReduceOp::Mean, 1, &[&[5]]),
            (ReduceOp::Mean, 2, &[&[4, 6], &[2]]),
            (ReduceOp::Sum, 4, &[&[8, 3]]),
        ];
        cases
            .into_iter()
            .map(|(op, world, shapes)| {
                let xs = shapes.iter().map(|s| normal(d, s)).collect();
                Sample::new(ReduceScatter { op, world, tensors: shapes.len() }, xs)
            })
            .collect()
    }
    fn name(&self) -> &'static str {
        match self.op {
            ReduceOp::Sum => "reduce_scatter_sum",
            ReduceOp::Mean => "reduce_scatter_mean",
        }
    }
    fn infer(&self, inputs: &[&TensorType]) -> std::result::Result<Vec<TensorType>, String> {
        check_world(self.world)?;
        check_count(inputs, self.tensors, 1)?;
        inputs
            .iter()
            .enumerate()
            .map(|(i, t)| {
                expect_float(t, &format!("tensor {i}"))?;
                shard_type(t, self.world).map_err(|e| format!("tensor {i}: {e}"))
            })
            .collect()
    }
    fn vjp(&self, _b: &mut Builder, _args: &VjpArgs) -> Result<Vec<Option<ValueId>>> {
        no_vjp(self.name())
    }
    fn cpu(&self, io: &KernelIo) -> Result<()> {
        reduce_bucket(io, self.name(), self.world, self.op, true)
    }
    fn attrs(&self) -> Vec<(&'static str, Attr)> {
        vec![("world", Attr::Int(self.world as i64)), ("tensors", Attr::Int(self.tensors as i64))]
    }
    fn parse(name: &str, a: &mut Attrs) -> Option<Result<Self>> {
        let op = match name {
            "reduce_scatter_sum" => ReduceOp::Sum,
            "reduce_scatter_mean" => ReduceOp::Mean,
            _ => return None,
        };
        Some((|| Ok(ReduceScatter { op, world: world_attr(a)?, tensors: a.usize("tensors")? }))())
    }
}

// ---------------------------------------------------------------- all-gather

/// All-gather of a bucket of `tensors` tensors. Inputs: the `tensors`
/// destinations (full tensors, whose contents are not read: they name the
/// storage the result is written to, a parameter under ZeRO-1), then one
/// shard per destination. Output `i` has destination `i`'s type and may
/// share its storage; it holds every rank's shard `i` in rank order.
#[derive(Clone, PartialEq, Debug)]
pub struct AllGather {
    pub world: usize,
    pub tensors: usize,
}

impl OpDef for AllGather {
    /// One rank and larger groups, buckets of one and two tensors.
    fn samples(d: DType) -> Vec<Sample> {
        let cases: [(usize, &[&[usize]]); 3] = [(1, &[&[3, 4]]), (2, &[&[4, 6], &[2]]), (4, &[&[8]])];
        cases
            .into_iter()
            .map(|(world, shapes)| {
                let mut xs: Vec<_> = shapes.iter().map(|s| normal(d, s)).collect();
                xs.extend(shapes.iter().map(|s| normal(d, &[s.iter().product::<usize>() / world])));
                Sample::new(AllGather { world, tensors: shapes.len() }, xs)
            })
            .collect()
    }
    fn name(&self) -> &'static str {
        "all_gather"
    }
    fn infer(&self, inputs: &[&TensorType]) -> std::result::Result<Vec<TensorType>, String> {
        check_world(self.world)?;
        check_count(inputs, self.tensors, 2)?;
        let (full, shards) = inputs.split_at(self.tensors);
        for (i, (f, s)) in full.iter().zip(shards).enumerate() {
            let want = shard_type(f, self.world).map_err(|e| format!("destination {i}: {e}"))?;
            if **s != want {
                return Err(format!(
                    "shard {i} is {s}, but destination {i} {f} over {} ranks needs {want}",
                    self.world
                ));
            }
        }
        Ok(full.iter().map(|t| (*t).clone()).collect())
    }
    fn vjp(&self, _b: &mut Builder, _args: &VjpArgs) -> Result<Vec<Option<ValueId>>> {
        no_vjp(self.name())
    }
    fn cpu(&self, io: &KernelIo) -> Result<()> {
        let comm = comm(io, self.name(), self.world)?;
        let k = self.tensors;
        let types: Vec<&TensorType> = io.inputs[k..].iter().map(|v| &v.ty).collect();
        let local: Vec<HostTensor> = (k..2 * k).map(|i| snapshot(io, i)).collect();
        let all = comm.exchange(&tag(self.name(), &types), local)?;
        for (i, out) in io.outputs.iter().enumerate() {
            let shard_bytes = io.inputs[k + i].ty.bytes() as usize;
            for (r, rank) in all.iter().enumerate() {
                // SAFETY: the output holds `world` shards of `shard_bytes`
                // (the shape rule) and no shard exchanged aliases it.
                unsafe {
                    std::ptr::copy_nonoverlapping(rank[i].bytes().as_ptr(), out.ptr.add(r * shard_bytes), shard_bytes)
                };
            }
        }
        Ok(())
    }
    fn attrs(&self) -> Vec<(&'static str, Attr)> {
        vec![("world", Attr::Int(self.world as i64)), ("tensors", Attr::Int(self.tensors as i64))]
    }
    fn parse(name: &str, a: &mut Attrs) -> Option<Result<Self>> {
        (name == "all_gather").then(|| Ok(AllGather { world: world_attr(a)?, tensors: a.usize("tensors")? }))
    }
    fn inplace(&self) -> Vec<(usize, usize)> {
        (0..self.tensors).map(|i| (i, i)).collect()
    }
}

// ---------------------------------------------------------------- local shard

/// This rank's shard of a tensor ([`shard_type`]), copied out. No
/// communication, but the result depends on the rank, so it needs a
/// communicator like the collectives.
#[derive(Clone, PartialEq, Debug)]
pub struct LocalShard {
    pub world: usize,
}

impl OpDef for LocalShard {
    /// One rank and larger groups.
    fn samples(d: DType) -> Vec<Sample> {
        let cases: [(usize, &[usize]); 3] = [(1, &[3, 4]), (2, &[4, 6]), (4, &[16])];
        cases.into_iter().map(|(world, s)| Sample::new(LocalShard { world }, vec![normal(d, s)])).collect()
    }
    fn name(&self) -> &'static str {
        "local_shard"
    }
    fn infer(&self, inputs: &[&TensorType]) -> std::result::Result<Vec<TensorType>, String> {
        super::expect_inputs(inputs, 1)?;
        Ok(vec![shard_type(inputs[0], self.world)?])
    }
    fn vjp(&self, _b: &mut Builder, _args: &VjpArgs) -> Result<Vec<Option<ValueId>>> {
        no_vjp(self.name())
    }
    fn cpu(&self, io: &KernelIo) -> Result<()> {
        let comm = comm(io, self.name(), self.world)?;
        let bytes = io.out_ty(0).bytes() as usize;
        // SAFETY: the input holds `world` shards of `bytes` bytes (the shape
        // rule), rank < world, and input and output never alias (no in-place pair).
        unsafe { std::ptr::copy_nonoverlapping(io.inputs[0].ptr.add(comm.rank() * bytes), io.outputs[0].ptr, bytes) };
        Ok(())
    }
    fn attrs(&self) -> Vec<(&'static str, Attr)> {
        vec![("world", Attr::Int(self.world as i64))]
    }
    fn parse(name: &str, a: &mut Attrs) -> Option<Result<Self>> {
        (name == "local_shard").then(|| Ok(LocalShard { world: world_attr(a)? }))
    }
}

/// The group size a collective op was built for; `None` for other ops.
pub fn world_of(op: &super::Op) -> Option<usize> {
    use super::Op;
    match op {
        Op::AllReduce(o) => Some(o.world),
        Op::ReduceScatter(o) => Some(o.world),
        Op::AllGather(o) => Some(o.world),
        Op::LocalShard(o) => Some(o.world),
        _ => None,
    }
}

impl Builder {
    /// One all-reduce over the bucket `xs`; returns the reduced tensors.
    pub fn all_reduce(&mut self, op: ReduceOp, world: usize, xs: &[ValueId]) -> Result<Vec<ValueId>> {
        self.push(AllReduce { op, world, tensors: xs.len() }.into(), xs)
    }

    /// One reduce-scatter over the bucket `xs`; returns this rank's shards.
    pub fn reduce_scatter(&mut self, op: ReduceOp, world: usize, xs: &[ValueId]) -> Result<Vec<ValueId>> {
        self.push(ReduceScatter { op, world, tensors: xs.len() }.into(), xs)
    }

    /// One all-gather of `shards` into the storage of `dests`; returns the full tensors.
    pub fn all_gather(&mut self, world: usize, dests: &[ValueId], shards: &[ValueId]) -> Result<Vec<ValueId>> {
        if dests.len() != shards.len() {
            return Err(Error::op("all_gather", format!("{} destinations but {} shards", dests.len(), shards.len())));
        }
        let inputs: Vec<ValueId> = dests.iter().chain(shards).copied().collect();
        self.push(AllGather { world, tensors: dests.len() }.into(), &inputs)
    }

    /// This rank's shard of `x`.
    pub fn local_shard(&mut self, world: usize, x: ValueId) -> Result<ValueId> {
        self.push1(LocalShard { world }.into(), &[x])
    }
}
