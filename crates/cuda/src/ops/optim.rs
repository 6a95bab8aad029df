//! Lowering of the AdamW update to the kernel of `kernels/adamw.cu`: one
//! grid-stride launch over the parameter (and its master state, with a
//! kernel of its own per [`MasterWeights`] mode), reading the learning rate and the
//! step count from device memory (so a captured graph replays with new
//! values). Invalid scalars (`lr < 0`, `step < 1`) leave the state
//! unchanged on the device; the session refuses them on the host first.
//!
//! [`merge_updates`] then turns runs of consecutive updates of one kernel
//! (all the updates after backward, e.g. under gradient clipping) into
//! multi-tensor launches of up to [`MULTI_MAX_TENSORS`] parameters each, the
//! table of addresses passed as the kernel's argument.

use stepgraph_core::ir::DType;
use stepgraph_core::ops::adamw8::{self, AdamW8bit};
use stepgraph_core::ops::optim::{AdamW, MasterWeights};

use super::util::{aligned16, float_name, launch, n64, THREADS};
use super::{Lower, LowerCx};
use crate::error::Result;
use crate::kernel_module::KernelModule;
use crate::launch::{blocks, Arg, DevTensor, KernelLaunch, Launch, LaunchList};

/// Grid cap for AdamW, whose blocks each compute the step's coefficients once.
const ADAMW_MAX_GRID: usize = 4096;

/// Elements per thread of `adamw_vec_*` (the kernel's `kVec`).
const VEC_ELEMS: usize = 8;

impl Lower for AdamW {
    const KERNELS: &'static [KernelModule] = &[KernelModule::plain("adamw", include_str!("../../kernels/adamw.cu"))];

    fn lower(&self, cx: &LowerCx) -> Result<Vec<Launch>> {
        let ins = cx.inputs;
        let (p, g, m, v, lr, step) = (&ins[0], &ins[1], &ins[2], &ins[3], &ins[4], &ins[5]);
        // The master state and its output, when the update keeps one.
        let master = match self.master {
            MasterWeights::None => None,
            _ => Some((&ins[6], &cx.outputs[3])),
        };
        let scale = ins.get(6 + master.is_some() as usize);
        let name = |t: &DevTensor| float_name("adamw", t.ty.dtype);
        // Every tensor 16-byte aligned: the kernel that moves 8 elements
        // per thread with 16-byte loads (the same arithmetic per element).
        let mut tensors = vec![p, g, m, v, &cx.outputs[0], &cx.outputs[1], &cx.outputs[2]];
        tensors.extend(master.iter().flat_map(|&(w, w_out)| [w, w_out]));
        let vec = p.ty.numel() >= VEC_ELEMS && aligned16(&tensors);
        let kind = if vec { "adamw_vec" } else { "adamw" };
        let suffix = match self.master {
            MasterWeights::F32 => "_master",
            MasterWeights::Kahan => "_kahan",
            MasterWeights::None => "",
        };
        let function = format!("{kind}_{}_{}_{}{suffix}", name(p)?, name(m)?, name(v)?);
        let is_f64 = |t: &DevTensor| Arg::I64((t.ty.dtype == DType::F64) as i64);
        let n = p.ty.numel();
        let mut args = vec![
            Arg::Ptr(p.ptr),
            Arg::Ptr(g.ptr),
            Arg::Ptr(m.ptr),
            Arg::Ptr(v.ptr),
            Arg::Ptr(lr.ptr),
            Arg::Ptr(step.ptr),
            Arg::Ptr(cx.outputs[0].ptr),
            Arg::Ptr(cx.outputs[1].ptr),
            Arg::Ptr(cx.outputs[2].ptr),
            n64(n),
            is_f64(lr),
            is_f64(step),
            Arg::F64(self.beta1),
            Arg::F64(self.beta2),
            Arg::F64(self.eps),
            Arg::F64(self.weight_decay),
            // Gradient clipping's factor, folded in (null: none).
            Arg::Ptr(scale.map_or(0, |s| s.ptr)),
        ];
        if let Some((w, w_out)) = master {
            args.extend([Arg::Ptr(w.ptr), Arg::Ptr(w_out.ptr)]);
        }
        let threads = if vec { n.div_ceil(VEC_ELEMS) } else { n };
        let grid = blocks(threads, THREADS as usize).min(ADAMW_MAX_GRID as u32);
        Ok(vec![launch("adamw", function, (grid, 1, 1), (THREADS, 1, 1), args)])
    }
}

/// Quantization blocks of an 8-bit update each launch block takes in turn
/// (the grid is capped; each block builds its code maps once).
const ADAMW8_MAX_GRID: usize = 4096;

impl Lower for AdamW8bit {
    const KERNELS: &'static [KernelModule] = AdamW::KERNELS;

    /// One launch over the parameter's quantization blocks
    /// (`adamw_8bit_<p>[_master|_kahan]`, a block of 256 threads each).
    fn lower(&self, cx: &LowerCx) -> Result<Vec<Launch>> {
        let (ins, outs) = (cx.inputs, cx.outputs);
        let p = &ins[0];
        let master = self.hyper.master != MasterWeights::None;
        let scale = ins.get(8 + master as usize);
        let suffix = match self.hyper.master {
            MasterWeights::F32 => "_master",
            MasterWeights::Kahan => "_kahan",
            MasterWeights::None => "",
        };
        let function = format!("adamw_8bit_{}{suffix}", float_name("adamw_8bit", p.ty.dtype)?);
        let is_f64 = |t: &DevTensor| Arg::I64((t.ty.dtype == DType::F64) as i64);
        let n = p.ty.numel();
        let mut args: Vec<Arg> = ins[..8].iter().map(|t| Arg::Ptr(t.ptr)).collect();
        args.extend(outs[..5].iter().map(|t| Arg::Ptr(t.ptr)));
        args.extend([
            n64(n),
            is_f64(&ins[6]),
            is_f64(&ins[7]),
            Arg::F64(self.hyper.beta1),
            Arg::F64(self.hyper.beta2),
            Arg::F64(self.hyper.eps),
            Arg::F64(self.hyper.weight_decay),
            Arg::Ptr(scale.map_or(0, |s| s.ptr)),
        ]);
        // The master state and its output, or nothing (null).
        let (w, w_out) = if master { (ins[8].ptr, outs[5].ptr) } else { (0, 0) };
        args.extend([Arg::Ptr(w), Arg::Ptr(w_out)]);
        let grid = n.div_ceil(adamw8::BLOCK).clamp(1, ADAMW8_MAX_GRID) as u32;
        Ok(vec![launch("adamw", function, (grid, 1, 1), (THREADS, 1, 1), args)])
    }
}

/// Parameters per multi-tensor launch (the table's `kMax`): the table of
/// their addresses is the kernel's argument, within the 4 KB of arguments
/// every GPU takes.
pub const MULTI_MAX_TENSORS: usize = 48;

/// Parameters per multi-tensor launch of updates with master state, whose
/// table has two more address arrays (`MultiTableMaster`).
pub const MULTI_MAX_TENSORS_MASTER: usize = 40;

/// Elements per chunk of the multi-tensor kernel (`kChunk`: 256 threads × 8 × 2).
pub const MULTI_CHUNK: usize = 2 * THREADS as usize * VEC_ELEMS;

/// The arguments of an AdamW launch that must be equal for launches to
/// share a multi-tensor launch, after the learning rate and step tensors:
/// their flags, the hyperparameters and the gradient's factor.
const SHARED_ARGS: std::ops::Range<usize> = 10..17;

/// Whether an AdamW launch carries master state (two more addresses, after
/// the shared arguments).
fn has_master(k: &KernelLaunch) -> bool {
    k.args.len() > SHARED_ARGS.end
}

/// Parameters per multi-tensor launch of `k`'s kind.
fn max_tensors(k: &KernelLaunch) -> usize {
    if has_master(k) {
        MULTI_MAX_TENSORS_MASTER
    } else {
        MULTI_MAX_TENSORS
    }
}

/// The multi-tensor kernel's table (`sg_adamw::MultiTableT`), as bytes:
/// element counts, the address arrays (p, g, m, v, the three outputs, and
/// w, w_out with master state), the running chunk counts and the count,
/// padded to 8 bytes; and the number of chunks in all.
fn multi_table(updates: &[&KernelLaunch]) -> (Vec<u8>, usize) {
    let max = max_tensors(updates[0]);
    let mut b = Vec::with_capacity(3272);
    let cols = |i: usize| -> Vec<u64> {
        let mut c: Vec<u64> = updates.iter().map(|k| ptr_arg(&k.args[i])).collect();
        c.resize(max, 0);
        c
    };
    let n: Vec<i64> = updates.iter().map(|k| elements(k) as i64).collect();
    for i in 0..max {
        b.extend(n.get(i).copied().unwrap_or(0).to_ne_bytes());
    }
    // p, g, m, v are arguments 0..4; the outputs 6..9; w and w_out 17 and 18.
    let arrays: &[usize] = if has_master(updates[0]) { &[0, 1, 2, 3, 6, 7, 8, 17, 18] } else { &[0, 1, 2, 3, 6, 7, 8] };
    for &i in arrays {
        for p in cols(i) {
            b.extend(p.to_ne_bytes());
        }
    }
    let mut end = 0i32;
    for i in 0..max {
        if let Some(&n) = n.get(i) {
            end += (n as usize).div_ceil(MULTI_CHUNK) as i32;
        }
        b.extend((if i < n.len() { end } else { 0 }).to_ne_bytes());
    }
    b.extend((updates.len() as i32).to_ne_bytes());
    b.resize(b.len().next_multiple_of(8), 0);
    (b, end as usize)
}

fn ptr_arg(a: &Arg) -> u64 {
    match a {
        Arg::Ptr(p) => *p,
        other => panic!("an AdamW launch's address argument is {other:?}"),
    }
}

/// The element count of an AdamW launch (argument 9).
fn elements(k: &KernelLaunch) -> usize {
    match k.args[9] {
        Arg::I64(n) => n as usize,
        ref other => panic!("an AdamW launch's count is {other:?}"),
    }
}

/// What must be equal for two AdamW launches to share a multi-tensor launch:
/// the kernel (dtypes and master state), the learning rate and step tensors
/// and the [`SHARED_ARGS`]. `None` for any other launch, and for updates of
/// tensors not all 16-byte aligned (the element-wise kernel).
fn merge_key(l: &Launch) -> Option<(&str, &[Arg], &[Arg])> {
    match l {
        Launch::Kernel(k) if k.module == "adamw" && k.function.starts_with("adamw_vec_") => {
            Some((k.function.as_str(), &k.args[4..6], &k.args[SHARED_ARGS]))
        }
        _ => None,
    }
}

/// Runs of two or more consecutive AdamW launches with one `merge_key`,
/// as multi-tensor launches of up to [`MULTI_MAX_TENSORS`] updates each
/// ([`MULTI_MAX_TENSORS_MASTER`] with master state),
/// with the same results bit for bit (the same arithmetic per element),
/// each merged launch's nodes spanning those of its updates.
pub fn merge_updates(list: LaunchList) -> LaunchList {
    let LaunchList { launches, last_nodes, first_nodes } = list;
    let mut out = LaunchList::default();
    let mut j = 0;
    while j < launches.len() {
        let mut end = j + 1;
        if let Some(key) = merge_key(&launches[j]) {
            while end < launches.len() && merge_key(&launches[end]) == Some(key) {
                end += 1;
            }
        }
        if end - j < 2 {
            out.push(launches[j].clone(), first_nodes[j], last_nodes[j]);
            j += 1;
            continue;
        }
        let Launch::Kernel(head) = &launches[j] else { unreachable!("merge_key admits kernels only") };
        let max = max_tensors(head);
        for start in (j..end).step_by(max) {
            let group = start..(start + max).min(end);
            let updates: Vec<&KernelLaunch> = launches[group.clone()]
                .iter()
                .map(|l| match l {
                    Launch::Kernel(k) => k,
                    _ => unreachable!("merge_key admits kernels only"),
                })
                .collect();
            let head = updates[0];
            let (table, chunks) = multi_table(&updates);
            let mut args = vec![Arg::Struct(table)];
            args.extend(head.args[4..6].iter().cloned());
            args.extend(head.args[SHARED_ARGS].iter().cloned());
            let grid = chunks.min(ADAMW_MAX_GRID) as u32;
            out.push(
                launch(
                    "adamw",
                    head.function.replacen("adamw_vec_", "adamw_multi_", 1),
                    (grid, 1, 1),
                    (THREADS, 1, 1),
                    args,
                ),
                first_nodes[group.start],
                last_nodes[group.end - 1],
            );
        }
        j = end;
    }
    out
}

#[cfg(test)]
mod tests {
    use stepgraph_core::ir::TensorType;

    use super::super::testing::{function as first_function, t};
    use super::*;

    #[test]
    fn the_kernel_is_named_by_the_parameter_and_moment_dtypes() {
        let adamw = [
            t(DType::BF16, &[4]),
            t(DType::BF16, &[4]),
            t(DType::F32, &[4]),
            t(DType::BF16, &[4]),
            t(DType::F32, &[]),
            t(DType::F64, &[]),
        ];
        assert_eq!(first_function(AdamW::default(), &adamw), "adamw_bf16_f32_bf16");
    }

    #[test]
    fn aligned_tensors_take_the_16_byte_kernel() {
        let (w, s) = (t(DType::BF16, &[64, 8]), t(DType::F32, &[]));
        let adamw = [w.clone(), w.clone(), w.clone(), w, s.clone(), s];
        let op = stepgraph_core::ops::Op::from(AdamW::default());
        let aligned = super::super::testing::lower_types(&op, &adamw, 0).unwrap();
        let k = &super::super::testing::kernels(&aligned)[0];
        assert_eq!(k.function, "adamw_vec_bf16_bf16_bf16");
        assert_eq!(k.grid.0, 1, "512 elements, 8 per thread: one block");
        let skewed = super::super::testing::lower_types(&op, &adamw, 4).unwrap();
        assert_eq!(super::super::testing::kernels(&skewed)[0].function, "adamw_bf16_bf16_bf16");
    }

    /// The AdamW launch of a bf16 parameter of `n` elements whose tensors
    /// start at `base` (16-byte aligned unless `skew`), with the learning
    /// rate at `lr`.
    fn update(n: usize, base: u64, lr: u64, skew: u64) -> Launch {
        let w = |i: u64| DevTensor { ty: TensorType::new(DType::BF16, [n]), ptr: base + i * (1 << 24) + skew };
        let s = |p: u64| DevTensor { ty: TensorType::new(DType::F32, Vec::<usize>::new()), ptr: p };
        let ins = [w(0), w(1), w(2), w(3), s(lr), s(0x100)];
        let outs = [w(0), w(2), w(3)];
        let op = stepgraph_core::ops::Op::from(AdamW::default());
        let mut l = crate::ops::lower(&op, &ins, &outs, None).unwrap();
        assert_eq!(l.len(), 1);
        l.pop().unwrap()
    }

    fn function(l: &Launch) -> &str {
        match l {
            Launch::Kernel(k) => &k.function,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn runs_of_updates_become_multi_tensor_launches() {
        let other = Launch::Kernel(KernelLaunch {
            module: "elementwise",
            function: "x".into(),
            grid: (1, 1, 1),
            block: (32, 1, 1),
            shared_bytes: 0,
            args: vec![],
        });
        let mut launches = vec![other.clone()];
        // 50 updates sharing a learning rate, one misaligned, two with another rate, then other work.
        launches.extend((0..50).map(|i| update(1000 + i, (i as u64 + 1) << 32, 0x200, 0)));
        launches.push(update(64, 60 << 32, 0x200, 2));
        launches.extend((0..2).map(|i| update(8, (70 + i as u64) << 32, 0x300, 0)));
        launches.push(update(16, 80 << 32, 0x300, 0));
        launches.push(other.clone());
        let nodes: Vec<usize> = (0..launches.len()).map(|i| 10 * i).collect();
        let (merged, last, first) =
            merge_updates(LaunchList::one_node_each(launches.clone(), nodes.clone())).into_parts();
        let names: Vec<&str> = merged.iter().map(function).collect();
        assert_eq!(
            names,
            [
                "x",
                "adamw_multi_bf16_bf16_bf16",
                "adamw_multi_bf16_bf16_bf16",
                "adamw_bf16_bf16_bf16",
                "adamw_multi_bf16_bf16_bf16",
                "x"
            ]
        );
        // 48 + 2 of the first run; the misaligned one alone; the three of the second rate.
        assert_eq!(first, [0, 10, 490, 510, 520, 550]);
        assert_eq!(last, [0, 480, 500, 510, 540, 550]);
        let Launch::Kernel(k) = &merged[1] else { unreachable!() };
        let Arg::Struct(table) = &k.args[0] else { panic!("{:?}", k.args[0]) };
        assert_eq!(table.len(), 3272, "sizeof(sg_adamw::MultiTable)");
        // The learning rate and step tensors, their flags and the hyperparameters follow.
        let Launch::Kernel(one) = &launches[1] else { unreachable!() };
        assert_eq!(k.args[1..3], one.args[4..6]);
        assert_eq!(k.args[3..], one.args[10..]);
        // Nothing to merge: the same list.
        let alone = vec![other.clone(), update(64, 1 << 32, 0x200, 0), other];
        let (same, last, first) = merge_updates(LaunchList::one_node_each(alone.clone(), vec![1, 2, 3])).into_parts();
        assert_eq!(same, alone);
        assert_eq!((last, first), (vec![1, 2, 3], vec![1, 2, 3]));
    }

    /// The kernel's walk over a table (update_multi in adamw.cu, as written
    /// there) touches every element of every tensor exactly once.
    #[test]
    fn the_multi_tensor_walk_covers_every_element_once() {
        let sizes = [8, 9, 15, 4096, 4097, 8191, 8192, 12345, 100_003, 24, 3200, 1];
        let launches: Vec<Launch> = (sizes.iter().filter(|&&n| n >= VEC_ELEMS))
            .enumerate()
            .map(|(i, &n)| update(n, (i as u64 + 1) << 32, 0x200, 0))
            .collect();
        let (merged, _, _) =
            merge_updates(LaunchList::one_node_each(launches.clone(), (0..launches.len()).collect())).into_parts();
        let [Launch::Kernel(k)] = &merged[..] else { panic!("{merged:?}") };
        let Arg::Struct(t) = &k.args[0] else { unreachable!() };
        let word = |i: usize| i64::from_ne_bytes(t[8 * i..8 * i + 8].try_into().unwrap());
        let int = |i: usize| i32::from_ne_bytes(t[i..i + 4].try_into().unwrap()) as i64;
        let max = MULTI_MAX_TENSORS;
        let count = int(8 * max + 56 * max + 4 * max) as usize;
        let chunk_end = |k: usize| int(8 * max + 56 * max + 4 * k);
        let n = |k: usize| word(k);
        let p = |k: usize| word(max + k) as u64; // the first address array: p
        assert_eq!(count, launches.len());
        let mut seen: Vec<Vec<u8>> = (0..count).map(|k| vec![0; n(k) as usize]).collect();
        let (vec, chunk, threads) = (VEC_ELEMS as i64, MULTI_CHUNK as i64, THREADS as i64);
        let total = chunk_end(count - 1);
        for block in 0..k.grid.0 as i64 {
            let mut t = 0;
            let mut ch = block;
            while ch < total {
                while chunk_end(t) <= ch {
                    t += 1;
                }
                let (n, runs) = (n(t), n(t) / vec);
                let base = (ch - if t > 0 { chunk_end(t - 1) } else { 0 }) * chunk;
                for thread in 0..threads {
                    for r in 0..chunk / (vec * threads) {
                        let j = base / vec + r * threads + thread;
                        if j >= runs {
                            break;
                        }
                        (0..vec).for_each(|e| seen[t][(j * vec + e) as usize] += 1);
                    }
                    let tail = runs * vec;
                    if tail >= base && tail < base + chunk && tail + thread < n {
                        seen[t][(tail + thread) as usize] += 1;
                    }
                }
                ch += k.grid.0 as i64;
            }
        }
        for (t, s) in seen.iter().enumerate() {
            assert!(s.iter().all(|&c| c == 1), "tensor {t} ({} elements) not covered once", s.len());
            let Launch::Kernel(one) = &launches[t] else { unreachable!() };
            assert_eq!(Arg::Ptr(p(t)), one.args[0]);
        }
    }
}
