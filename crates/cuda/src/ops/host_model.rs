//! A host model of the index-only kernels, of f64 arithmetic kernels and of
//! the mixture-of-experts kernels (routing, grouped products):
//! the lowering's arguments, run through a sequential emulation of each
//! kernel (as its `.cu` file reads them) over host buffers at the fake
//! addresses, must give the CPU reference's bytes. This checks every shape,
//! stride, chunk and copy unit the lowerings compute, without a GPU.

use stepgraph_core::host::HostTensor;
use stepgraph_core::ir::{DType, TensorType};
use stepgraph_core::ops::elementwise::Binary;
use stepgraph_core::ops::embedding::{Embedding, EmbeddingBackward};
use stepgraph_core::ops::movement::{Broadcast, Concat, Permute, Slice, SliceBackward};
use stepgraph_core::ops::reduce::{MaxBackward, Reduce, ReduceKind};
use stepgraph_core::ops::sample::{ids, normal};
use stepgraph_core::ops::{BinaryFn, Op};
use stepgraph_core::testing::{draw_input, run_op};

use super::elementwise::BinaryArgs;
use super::embedding::{EmbeddingArgs, EmbeddingBackwardArgs};
use super::lower;
use super::moe::{
    ExpertSortArgs, GroupedMatmulArgs, GroupedMatmulWeightGradArgs, TopKArgs, TopKBackwardArgs, SORT_MAX_EXPERTS,
};
use super::movement::{ChunkedArgs, GatherArgs};
use super::reduce::{MaxBackwardArgs, ReduceArgs, ReduceShape};
use super::testing::operands;
use super::util::UNITS;
use crate::launch::Launch;
use stepgraph_core::ops::moe::ranks_before;

/// Host memory standing in for the device: one buffer per operand at its
/// fake address.
pub(super) struct Mem(pub(super) Vec<(u64, Vec<u8>)>);

impl Mem {
    pub(super) fn at(&mut self, addr: u64, len: usize) -> &mut [u8] {
        let (base, buf) = self.0.iter_mut().find(|(b, v)| *b <= addr && addr < *b + v.len() as u64).expect("mapped");
        let o = (addr - *base) as usize;
        &mut buf[o..o + len]
    }
    pub(super) fn copy(&mut self, dst: u64, src: u64, len: usize) {
        let v = self.at(src, len).to_vec();
        self.at(dst, len).copy_from_slice(&v);
    }
    fn f64(&mut self, addr: u64) -> f64 {
        f64::from_le_bytes(self.at(addr, 8).try_into().unwrap())
    }
    fn set_f64(&mut self, addr: u64, v: f64) {
        self.at(addr, 8).copy_from_slice(&v.to_le_bytes());
    }
    fn id(&mut self, addr: u64, i32s: bool) -> i64 {
        if i32s {
            i32::from_le_bytes(self.at(addr, 4).try_into().unwrap()) as i64
        } else {
            i64::from_le_bytes(self.at(addr, 8).try_into().unwrap())
        }
    }
}

/// Offset of `idx` in a row-major walk of axes `size` with `stride`.
fn walk(mut idx: i64, size: &[i64], stride: &[i64]) -> i64 {
    let mut off = 0;
    for d in (0..size.len()).rev() {
        off += idx % size[d] * stride[d];
        idx /= size[d];
    }
    off
}

/// The (address, value) of the `count` f64 elements of `x` that output `o`
/// of a reduction of `shape` reads, in the kernel's order.
fn reduced_elements(mem: &mut Mem, x: u64, shape: &ReduceShape, o: i64, count: i64) -> Vec<(u64, f64)> {
    let (kept, reduced) = (shape.kept as usize, shape.reduced as usize);
    let base = walk(o, &shape.kept_size[..kept], &shape.kept_stride[..kept]);
    (0..count)
        .map(|r| {
            let addr =
                x + ((base + walk(r, &shape.reduced_size[..reduced], &shape.reduced_stride[..reduced])) * 8) as u64;
            (addr, mem.f64(addr))
        })
        .collect()
}

/// Runs a launch the way its kernel (see the `.cu` file) reads its
/// arguments, sequentially, for the index-only kernels and for f64 data
/// (whose arithmetic is the CPU's): a model of the device that checks
/// every shape, stride, chunk and unit the lowering computes.
fn emulate(l: &Launch, mem: &mut Mem) {
    let k = match l {
        Launch::Memset { ptr, bytes, value } => return mem.at(*ptr, *bytes as usize).fill(*value),
        Launch::Kernel(k) => k,
        other => panic!("unexpected {other:?}"),
    };
    let f = k.function.as_str();
    let a = &k.args;
    let unit = |f: &str| -> usize {
        let w = UNITS.iter().find(|(_, n)| f.ends_with(&format!("_{n}")) || f.contains(&format!("_{n}_"))).unwrap();
        w.0 as usize
    };
    if f.starts_with("broadcast_") || f.starts_with("permute_") {
        let (w, g) = (unit(f), GatherArgs::from_args(a));
        let rank = g.shape.rank as usize;
        let (size, stride) = (&g.shape.size[..rank], &g.shape.stride[..rank]);
        for i in 0..g.n {
            mem.copy(g.y + (i as u64) * w as u64, g.x + walk(i, size, stride) as u64 * w as u64, w);
        }
    } else if f.starts_with("slice_backward_") {
        // The output walked in runs of the full axis; the gradient's run is the window.
        let (w, c) = (unit(f) as u64, ChunkedArgs::from_args(a));
        for i in 0..c.n {
            let j = i % c.walked;
            let dst = c.y + i as u64 * w;
            if j >= c.offset && j < c.offset + c.other {
                mem.copy(dst, c.x + ((i / c.walked) * c.other + j - c.offset) as u64 * w, w as usize);
            } else {
                mem.at(dst, w as usize).fill(0);
            }
        }
    } else if f.starts_with("slice_") {
        let (w, c) = (unit(f) as u64, ChunkedArgs::from_args(a));
        for i in 0..c.n {
            let src = c.x + ((i / c.walked) * c.other + c.offset + i % c.walked) as u64 * w;
            mem.copy(c.y + i as u64 * w, src, w as usize);
        }
    } else if f.starts_with("concat_") {
        let (w, c) = (unit(f) as u64, ChunkedArgs::from_args(a));
        for i in 0..c.n {
            let dst = c.y + ((i / c.walked) * c.other + c.offset + i % c.walked) as u64 * w;
            mem.copy(dst, c.x + i as u64 * w, w as usize);
        }
    } else if f.starts_with("embedding_backward_f64") {
        let i32s = f.ends_with("i32");
        let e = EmbeddingBackwardArgs::from_args(a);
        let isz = if i32s { 4 } else { 8 };
        for row in 0..e.rows {
            let hits: Vec<i64> = (0..e.n).filter(|&p| mem.id(e.ids + (p * isz) as u64, i32s) == row).collect();
            for c in 0..e.width {
                let dst = e.gt + ((row * e.width + c) * 8) as u64;
                match hits[..] {
                    [] => mem.set_f64(dst, 0.0),
                    [p] => mem.copy(dst, e.gy + ((p * e.width + c) * 8) as u64, 8),
                    _ => {
                        let sum = hits.iter().fold(0.0, |acc, p| acc + mem.f64(e.gy + ((p * e.width + c) * 8) as u64));
                        mem.set_f64(dst, sum)
                    }
                }
            }
        }
    } else if f.starts_with("embedding_") {
        let (w, i32s) = (unit(f) as i64, f.ends_with("i32"));
        let e = EmbeddingArgs::from_args(a);
        let row_bytes = e.row_units * w;
        for p in 0..e.n {
            let id = mem.id(e.ids + (p * if i32s { 4 } else { 8 }) as u64, i32s);
            assert!((0..e.rows).contains(&id));
            mem.copy(e.y + (p * row_bytes) as u64, e.table + (id * row_bytes) as u64, row_bytes as usize);
        }
    } else if f.starts_with("max_backward_") {
        let m = MaxBackwardArgs::from_args(a);
        for o in 0..m.nout {
            let xs = reduced_elements(mem, m.x, &m.shape, o, m.count);
            let top = mem.f64(m.y + o as u64 * 8);
            let ties = xs.iter().filter(|v| v.1 == top).count().max(1);
            let share = mem.f64(m.gy + o as u64 * 8) / ties as f64;
            for (addr, v) in xs {
                mem.set_f64(m.gx + (addr - m.x), if v == top { share } else { 0.0 });
            }
        }
    } else if f.starts_with("sum_") || f.starts_with("max_") {
        let r = ReduceArgs::from_args(a);
        for o in 0..r.nout {
            let xs = reduced_elements(mem, r.x, &r.shape, o, r.count);
            let v = if f.starts_with("max_") {
                xs.iter().fold(f64::NEG_INFINITY, |m, v| m.max(v.1))
            } else {
                let s = xs.iter().fold(0.0, |acc, v| acc + v.1);
                if r.mean == 1 {
                    s / r.count as f64
                } else {
                    s
                }
            };
            mem.set_f64(r.y + o as u64 * 8, v);
        }
    } else if ["add_f64", "sub_f64", "mul_f64", "div_f64"].contains(&f) {
        let b = BinaryArgs::from_args(a);
        let rank = b.shape.rank as usize;
        let size = &b.shape.size[..rank];
        let (sa, sb) = (&b.shape.stride_a[..rank], &b.shape.stride_b[..rank]);
        for i in 0..b.n {
            let x = mem.f64(b.a + walk(i, size, sa) as u64 * 8);
            let y = mem.f64(b.b + walk(i, size, sb) as u64 * 8);
            let v = match &f[..3] {
                "add" => x + y,
                "sub" => x - y,
                "mul" => x * y,
                _ => x / y,
            };
            mem.set_f64(b.y + i as u64 * 8, v);
        }
    } else if !emulate_moe(f, a, k.block.0 as i64, mem) {
        panic!("no model of `{f}`");
    }
}

/// The kernels of moe.cu, as each thread computes (f64 data, i32 indices);
/// `false` when `f` is none of them.
fn emulate_moe(f: &str, a: &[crate::launch::Arg], threads: i64, mem: &mut Mem) -> bool {
    let i32_at = |mem: &mut Mem, base: u64, i: i64| mem.id(base + i as u64 * 4, true);
    let set_i32 = |mem: &mut Mem, base: u64, i: i64, v: i64| {
        mem.at(base + i as u64 * 4, 4).copy_from_slice(&(v as i32).to_le_bytes());
    };
    if f == "top_k_f64" {
        let t = TopKArgs::from_args(a);
        for r in 0..t.rows {
            for s in 0..t.k {
                let taken: Vec<i64> = (0..s).map(|q| i32_at(mem, t.indices, r * t.k + q)).collect();
                let mut best: Option<(i64, f64)> = None;
                for i in (0..t.width).filter(|i| !taken.contains(i)) {
                    let v = mem.f64(t.x + ((r * t.width + i) * 8) as u64);
                    if best.is_none_or(|(bi, bv)| ranks_before(v, i as usize, bv, bi as usize)) {
                        best = Some((i, v));
                    }
                }
                let (bi, bv) = best.expect("k <= width");
                set_i32(mem, t.indices, r * t.k + s, bi);
                mem.set_f64(t.values + ((r * t.k + s) * 8) as u64, bv);
            }
        }
    } else if f == "top_k_backward_f64" {
        let t = TopKBackwardArgs::from_args(a);
        for e in 0..t.rows * t.width {
            let (r, c) = (e / t.width, e % t.width);
            let mut v = 0.0;
            for s in 0..t.k {
                if i32_at(mem, t.indices, r * t.k + s) == c {
                    v = mem.f64(t.g + ((r * t.k + s) * 8) as u64);
                }
            }
            mem.set_f64(t.gx + (e * 8) as u64, v);
        }
    } else if let Some(id) = f.strip_prefix("expert_sort_") {
        let s = ExpertSortArgs::from_args(a);
        let expert = |mem: &mut Mem, i: i64| mem.id(s.ids + i as u64 * if id == "i32" { 4 } else { 8 }, id == "i32");
        let experts = s.experts;
        let clamped = |mem: &mut Mem, i: i64| expert(mem, i).clamp(0, experts - 1);
        // The block's warps, each over its own segment of the pairs in
        // rounds of 32 (the warp's lanes in order), at most SORT_MAX_EXPERTS
        // counts in all.
        let segments = (threads / 32).min(SORT_MAX_EXPERTS as i64 / experts);
        assert!(segments >= 1, "{experts} experts overflow the sort's shared counts");
        let rounds = (s.pairs + 32 * segments - 1) / (32 * segments);
        let segment = |w: i64| (w * rounds * 32).min(s.pairs)..((w + 1) * rounds * 32).min(s.pairs);
        let mut seg = vec![0i64; (segments * experts) as usize];
        for w in 0..segments {
            for i in segment(w) {
                seg[(w * experts + clamped(mem, i)) as usize] += 1;
            }
        }
        // Each expert's segments in order, then the experts in order.
        let mut before = 0;
        for e in 0..experts {
            set_i32(mem, s.offsets, e, before);
            let mut total = 0;
            for w in 0..segments {
                let c = std::mem::replace(&mut seg[(w * experts + e) as usize], before + total);
                total += c;
            }
            mem.at(s.counts + e as u64 * 4, 4).copy_from_slice(&(total as f32).to_le_bytes());
            before += total;
        }
        set_i32(mem, s.offsets, experts, before);
        for w in 0..segments {
            for i in segment(w) {
                let next = &mut seg[(w * experts + clamped(mem, i)) as usize];
                set_i32(mem, s.tokens, *next, i / s.k);
                set_i32(mem, s.position, i, *next);
                *next += 1;
            }
        }
    } else if f == "grouped_matmul_f64" {
        let g = GroupedMatmulArgs::from_args(a);
        for o in 0..g.m * g.n {
            let (p, j) = (o / g.n, o % g.n);
            // The last expert whose first row is at or before p.
            let e = (0..g.experts).rev().find(|&e| i32_at(mem, g.offsets, e) <= p).unwrap_or(0);
            let we = g.w + (e * g.k * g.n * 8) as u64;
            let mut acc = 0.0;
            for i in 0..g.k {
                let wi = if g.trans_w == 1 { i * g.n + j } else { j * g.k + i };
                acc += mem.f64(g.x + ((p * g.k + i) * 8) as u64) * mem.f64(we + (wi * 8) as u64);
            }
            mem.set_f64(g.y + (o * 8) as u64, acc);
        }
    } else if f == "grouped_matmul_weight_grad_f64" {
        let g = GroupedMatmulWeightGradArgs::from_args(a);
        for o in 0..g.experts * g.na * g.nb {
            let (e, i, j) = (o / (g.na * g.nb), (o / g.nb) % g.na, o % g.nb);
            let lo = i32_at(mem, g.offsets, e).clamp(0, g.m);
            let hi = i32_at(mem, g.offsets, e + 1).clamp(lo, g.m);
            let mut acc = 0.0;
            for p in lo..hi {
                acc += mem.f64(g.a + ((p * g.na + i) * 8) as u64) * mem.f64(g.b + ((p * g.nb + j) * 8) as u64);
            }
            mem.set_f64(g.out + (o * 8) as u64, acc);
        }
    } else {
        return false;
    }
    true
}

/// Lowers `op` over `inputs` at fake addresses skewed by `skew` bytes,
/// runs the launches on the host model and returns the outputs.
fn run_model(op: &Op, inputs: &[HostTensor], skew: u64) -> Vec<HostTensor> {
    let types: Vec<TensorType> = inputs.iter().map(|t| t.ty.clone()).collect();
    let refs: Vec<&TensorType> = types.iter().collect();
    let out_types = op.infer(&refs).unwrap();
    let (ins, outs) = (operands(&types, 1 << 40, skew), operands(&out_types, 1 << 41, skew));
    let mut mem = Mem(Vec::new());
    for (d, t) in ins.iter().zip(inputs) {
        mem.0.push((d.ptr, t.bytes().to_vec()));
    }
    for d in &outs {
        // Garbage (NaN) where nothing writes, as the session's poisoned arena.
        mem.0.push((d.ptr, vec![0xFF; d.ty.bytes() as usize]));
    }
    for l in lower(op, &ins, &outs, None).unwrap_or_else(|e| panic!("{op:?}: {e}")) {
        emulate(&l, &mut mem);
    }
    outs.iter()
        .map(|d| {
            let mut t = HostTensor::zeros(d.ty.clone());
            t.bytes_mut().copy_from_slice(mem.at(d.ptr, d.ty.bytes() as usize));
            t
        })
        .collect()
}

fn input(shape: &[usize], dt: DType, seed: u64) -> HostTensor {
    let spec = match dt {
        DType::I32 | DType::I64 | DType::Bool => ids(dt, shape, if dt == DType::Bool { 2 } else { 1 << 30 }),
        _ => normal(dt, shape),
    };
    draw_input(&spec, seed).expect("a drawable input")
}

/// The lowering's arguments, run through a host model of each kernel,
/// give the CPU reference's bytes: movement and embedding for every
/// dtype (bit copies), binary maps and reductions in f64 (whose
/// arithmetic the model shares with the CPU), at aligned and skewed
/// addresses (which change the copy units).
#[test]
fn lowered_arguments_reproduce_the_cpu_on_a_host_model() {
    let all = [DType::F32, DType::BF16, DType::F16, DType::F64, DType::I32, DType::I64, DType::Bool];
    let mut cases: Vec<(Op, Vec<HostTensor>)> = Vec::new();
    for (k, dt) in all.into_iter().enumerate() {
        let seed = k as u64;
        let bc: [(&[usize], &[usize]); 6] = [
            (&[], &[5, 7]),
            (&[3, 1], &[2, 3, 4]),
            (&[64], &[3, 64]),
            (&[4, 1, 6], &[4, 5, 6]),
            (&[2, 1, 8, 1], &[2, 3, 8, 5]),
            (&[1, 16], &[9, 16]),
        ];
        for (from, to) in bc {
            cases.push((Broadcast { shape: to.to_vec() }.into(), vec![input(from, dt, seed)]));
        }
        let perms: [(&[usize], &[usize]); 6] = [
            (&[4, 8, 16], &[1, 0, 2]),
            (&[4, 8, 16], &[2, 1, 0]),
            (&[2, 16, 4, 64], &[0, 2, 1, 3]),
            (&[3, 1, 7, 2], &[3, 2, 1, 0]),
            (&[2, 3, 2, 3, 2], &[4, 0, 3, 1, 2]),
            (&[2, 3, 2, 2, 3, 2, 2, 3], &[7, 6, 5, 4, 3, 2, 1, 0]),
        ];
        for (shape, perm) in perms {
            cases.push((Permute { perm: perm.to_vec() }.into(), vec![input(shape, dt, seed)]));
        }
        let slices: [(&[usize], usize, usize, usize); 6] = [
            (&[17], 0, 3, 11),
            (&[3, 17], 1, 5, 12),
            (&[4, 64], 1, 16, 48),
            (&[4, 64], 0, 1, 3),
            (&[2, 3, 5, 8], 3, 0, 4),
            (&[5, 3, 24], 1, 2, 3),
        ];
        for (shape, axis, start, end) in slices {
            cases.push((Slice::new(axis, start, end).into(), vec![input(shape, dt, seed)]));
            let mut gs = shape.to_vec();
            gs[axis] = end - start;
            cases.push((SliceBackward { axis, start, size: shape[axis] }.into(), vec![input(&gs, dt, seed)]));
        }
        let parts: [(&[&[usize]], usize); 3] = [
            (&[&[3], &[17], &[1]], 0),
            (&[&[4, 8], &[4, 24], &[4, 8]], 1),
            (&[&[2, 1, 6], &[2, 3, 6], &[2, 0, 6], &[2, 5, 6]], 1),
        ];
        for (shapes, axis) in parts {
            cases.push((Concat { axis }.into(), shapes.iter().map(|s| input(s, dt, seed)).collect()));
        }
        if dt.is_float() {
            for (ids_dt, n, rows, width) in [(DType::I32, 7, 5, 3), (DType::I64, 37, 50, 24), (DType::I32, 30, 11, 64)]
            {
                let ids = draw_input(&ids(ids_dt, &[n], rows as i64), seed).expect("drawable ids");
                cases.push((Embedding.into(), vec![ids.clone(), input(&[rows, width], dt, seed)]));
                if dt == DType::F64 {
                    let op = EmbeddingBackward { num_rows: rows };
                    cases.push((op.into(), vec![ids, input(&[n, width], dt, seed)]));
                }
            }
        }
    }
    let f64s = |s: &[usize], seed| input(s, DType::F64, seed);
    let pairs: [(&[usize], &[usize]); 6] = [
        (&[4, 5], &[5]),
        (&[5], &[4, 5]),
        (&[4, 1], &[1, 5]),
        (&[2, 3, 17], &[]),
        (&[7, 1, 9], &[1, 8, 1]),
        (&[2, 1, 3, 4], &[1, 5, 1, 4]),
    ];
    for (sa, sb) in pairs {
        for f in [BinaryFn::Add, BinaryFn::Sub, BinaryFn::Mul, BinaryFn::Div] {
            cases.push((Binary { f }.into(), vec![f64s(sa, 1), f64s(sb, 2)]));
        }
    }
    let reductions: [(&[usize], &[usize]); 12] = [
        (&[17], &[0]),
        (&[33, 17], &[1]),
        (&[5, 1000], &[1]),
        (&[1000, 7], &[0]),
        (&[3, 5, 7], &[1]),
        (&[3, 5, 7], &[0, 2]),
        (&[2, 3, 4, 5], &[1, 3]),
        (&[4, 6, 8, 10], &[0, 2]),
        (&[3, 1, 5], &[1]),
        (&[3, 4], &[]),
        (&[], &[]),
        (&[0, 3], &[0]),
    ];
    for (shape, axes) in reductions {
        let x = f64s(shape, 3);
        for kind in [ReduceKind::Sum, ReduceKind::Mean, ReduceKind::Max] {
            cases.push((Reduce { kind, axes: axes.to_vec(), keepdim: false }.into(), vec![x.clone()]));
        }
        if !shape.contains(&0) {
            let max = Op::from(Reduce { kind: ReduceKind::Max, axes: axes.to_vec(), keepdim: true });
            // Coarse values: ties.
            let xt = HostTensor::from_f64(x.ty.clone(), &x.to_f64().iter().map(|v| v.round()).collect::<Vec<_>>());
            let y = run_op(&max, std::slice::from_ref(&xt)).unwrap().remove(0);
            let g = f64s(&y.ty.shape, 4);
            cases.push((MaxBackward { axes: axes.to_vec() }.into(), vec![xt, y, g]));
        }
    }
    // The mixture-of-experts kernels on every sample (f64 data; the routing
    // sort has integer inputs only, listed under f32).
    for dt in [DType::F64, DType::F32] {
        for (name, samples) in stepgraph_core::ops::samples_by_op(dt) {
            let moe = ["TopK", "TopKBackward", "ExpertSort", "GroupedMatmul", "GroupedMatmulWeightGrad"];
            if !moe.contains(&name) {
                continue;
            }
            for s in samples.iter().filter(|s| dt == DType::F64 || s.input_types().iter().all(|t| !t.dtype.is_float()))
            {
                cases.push((s.op.clone(), stepgraph_core::testing::draw_sample(s, 11).expect("a drawable sample")));
            }
        }
    }
    for (op, inputs) in &cases {
        let want = run_op(op, inputs).unwrap();
        for skew in [0, 8] {
            let got = run_model(op, inputs, skew);
            for (j, (g, w)) in got.iter().zip(&want).enumerate() {
                let same = g.ty == w.ty
                    && (g.bytes() == w.bytes()
                        || (w.ty.dtype == DType::F64
                            && g.to_f64()
                                .iter()
                                .zip(w.to_f64())
                                .all(|(a, b)| a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()))));
                assert!(
                    same,
                    "{op:?} on {:?} (skew {skew}): output {j} differs from the CPU",
                    inputs.iter().map(|t| &t.ty).collect::<Vec<_>>()
                );
            }
        }
    }
}
