//! The lowering sweep: every sample case core declares for every op
//! (`stepgraph_core::ops::samples_by_op`), in every float dtype, lowered at
//! fake 256-byte-aligned addresses, and each launch checked for what the
//! device would otherwise only show as a fault or garbage: kernels named in
//! a module the op declares, grids and blocks within the hardware's limits,
//! every address inside the operand it belongs to; and, where NVRTC is
//! installed, every kernel present in its module's CUBIN for sm_90 with
//! exactly the parameters (count, sizes, C layout) its arguments fill and a
//! `__launch_bounds__` that admits its block.
//!
//! A sample whose dtype an op has no CUDA kernel for
//! ([`CudaError::Unsupported`], e.g. f64 products) is reported and skipped;
//! every other lowering error fails, and every op with samples must lower
//! in at least one dtype.

use std::collections::HashMap;

use stepgraph_core::ir::TensorType;
use stepgraph_core::ops::collective::world_of;
use stepgraph_core::ops::sample::FLOAT_DTYPES;
use stepgraph_core::ops::{samples_by_op, Op};

use super::{kernels_of, lower, GroupRank};
use crate::error::{CudaError, Result};
use crate::launch::{Arg, CollectiveOp, DevTensor, KernelLaunch, Launch};

/// Largest dynamic shared memory a block may ask for on sm_90.
const MAX_SHARED_BYTES: u32 = 227 * 1024;

/// Operands at consecutive 256-byte-aligned addresses, a gap between each
/// (so an address one past an operand is in none).
struct Addresses(u64);

impl Addresses {
    fn place(&mut self, types: &[TensorType]) -> Vec<DevTensor> {
        types
            .iter()
            .map(|ty| {
                let t = DevTensor { ty: ty.clone(), ptr: self.0 };
                self.0 = (self.0 + ty.bytes() + 256).next_multiple_of(256);
                t
            })
            .collect()
    }
}

/// Does `[ptr, ptr + bytes)` lie inside one of `ts`?
fn inside(ptr: u64, bytes: u64, ts: &[DevTensor]) -> bool {
    ts.iter().any(|t| ptr >= t.ptr && ptr + bytes <= t.ptr + t.ty.bytes())
}

/// Bytes of a (batched) GEMM operand: the last entry's offset plus one matrix.
fn gemm_bytes(elem: u64, batch: usize, stride: i64, rows: usize, cols: usize) -> u64 {
    ((batch.max(1) as u64 - 1) * stride.max(0) as u64 + (rows * cols) as u64) * elem
}

/// Checks one launch of a node over `ins` and `outs`; `what` names the case.
fn check_launch(what: &str, op: &Op, l: &Launch, ins: &[DevTensor], outs: &[DevTensor]) {
    let all: Vec<DevTensor> = ins.iter().chain(outs).cloned().collect();
    match l {
        Launch::Kernel(k) => {
            assert!(kernels_of(op).iter().any(|m| m.name == k.module), "{what}: module `{}` is not declared", k.module);
            let (g, b) = (k.grid, k.block);
            assert!(g.0 >= 1 && g.1 >= 1 && g.2 >= 1, "{what}: `{}` empty grid {g:?}", k.function);
            assert!(g.0 < 1 << 31 && g.1 <= 65535 && g.2 <= 65535, "{what}: `{}` grid {g:?}", k.function);
            assert!(b.0 >= 1 && b.1 >= 1 && b.2 >= 1, "{what}: `{}` empty block {b:?}", k.function);
            assert!(b.0 * b.1 * b.2 <= 1024 && b.2 <= 64, "{what}: `{}` block {b:?}", k.function);
            assert!(k.shared_bytes <= MAX_SHARED_BYTES, "{what}: `{}` shared {}", k.function, k.shared_bytes);
            for a in &k.args {
                if let Arg::Ptr(p) = *a {
                    // Null is an absent optional input; an empty operand's address is its own.
                    let known = p == 0 || all.iter().any(|t| p == t.ptr) || inside(p, 1, &all);
                    assert!(known, "{what}: `{}` pointer {p:#x} is in no operand", k.function);
                }
            }
        }
        Launch::Gemm(c) => {
            let (ar, ac) = if c.trans_a { (c.k, c.m) } else { (c.m, c.k) };
            let (br, bc) = if c.trans_b { (c.n, c.k) } else { (c.k, c.n) };
            // Operands are read from the inputs or from an output the node
            // wrote first (a workspace: the fused head's chunk of logits).
            let e = c.ty.operand_bytes();
            let (a_bytes, b_bytes) =
                (gemm_bytes(e, c.batch, c.stride_a, ar, ac), gemm_bytes(e, c.batch, c.stride_b, br, bc));
            assert!(inside(c.a, a_bytes, &all), "{what}: A outside the operands");
            assert!(inside(c.b, b_bytes, &all), "{what}: B outside the operands");
            assert!(
                inside(c.c, gemm_bytes(c.ty.out_bytes(), c.batch, c.stride_c, c.m, c.n), outs),
                "{what}: C outside the outputs"
            );
        }
        Launch::Memset { ptr, bytes, .. } => {
            assert!(inside(*ptr, *bytes, outs), "{what}: memset outside the outputs")
        }
        Launch::Copy { dst, src, bytes } | Launch::HostCopy { dst, src, bytes } => {
            assert!(inside(*src, *bytes, ins), "{what}: copy from outside the inputs");
            assert!(inside(*dst, *bytes, outs), "{what}: copy to outside the outputs");
        }
        Launch::Collective(c) => {
            assert_eq!(Some(c.world), world_of(op), "{what}: group size");
            for p in &c.parts {
                let n = p.count as u64 * p.ty.size();
                let w = c.world as u64;
                let (send, recv) = match c.op {
                    CollectiveOp::AllReduce(_) => (n, n),
                    CollectiveOp::ReduceScatter(_) => (w * n, n),
                    CollectiveOp::AllGather => (n, w * n),
                };
                assert!(p.count > 0, "{what}: an empty NCCL call");
                assert!(inside(p.send, send, ins), "{what}: send buffer outside the inputs");
                assert!(inside(p.recv, recv, outs), "{what}: receive buffer outside the outputs");
            }
        }
    }
}

/// What a CUBIN says about one kernel.
#[derive(Debug, Default)]
struct KernelInfo {
    /// `(size, offset)` of every parameter, in parameter order.
    params: Vec<(usize, usize)>,
    /// The `__launch_bounds__` thread limit, if declared.
    max_threads: Option<u64>,
}

/// Reads the `.nv.info.<function>` section of an sm_90 CUBIN (ELF64): a
/// list of attributes `(format, id, value)`; the ones used here are
/// KPARAM_INFO (0x17: index u32, ordinal u16, offset u16, flags u32 with the
/// size in bits 18..32) and MAX_THREADS (0x05). `None`: no such kernel.
fn kernel_info(cubin: &[u8], function: &str) -> Option<KernelInfo> {
    let u16_at = |o: usize| u16::from_le_bytes(cubin[o..o + 2].try_into().unwrap()) as usize;
    let u32_at = |o: usize| u32::from_le_bytes(cubin[o..o + 4].try_into().unwrap()) as usize;
    let u64_at = |o: usize| u64::from_le_bytes(cubin[o..o + 8].try_into().unwrap()) as usize;
    assert_eq!(&cubin[..4], b"\x7fELF", "not an ELF file");
    // ELF64 section headers: offset at 0x28, entry size/count/names index at 0x3a.
    let (shoff, shentsize, shnum, shstrndx) = (u64_at(0x28), u16_at(0x3a), u16_at(0x3c), u16_at(0x3e));
    let header = |i: usize| shoff + i * shentsize;
    let strtab = u64_at(header(shstrndx) + 0x18);
    let want = format!(".nv.info.{function}");
    let section = (0..shnum).find(|&i| {
        let name = strtab + u32_at(header(i));
        let end = name + cubin[name..].iter().position(|&b| b == 0).unwrap();
        cubin[name..end] == *want.as_bytes()
    })?;
    let (off, len) = (u64_at(header(section) + 0x18), u64_at(header(section) + 0x20));
    let d = &cubin[off..off + len];
    let mut params = Vec::new();
    let mut info = KernelInfo::default();
    let mut i = 0;
    while i + 2 <= d.len() {
        let (format, attr) = (d[i], d[i + 1]);
        // Formats: 1 no value, 2 one byte, 3 two bytes, 4 a u16 length then that many bytes.
        let (value, next) = match format {
            // 0: padding after a two-byte entry, to the next four bytes.
            0 | 1 => (&d[i..i], i + 2),
            2 | 3 => (&d[i + 2..i + 4], i + 4),
            4 => {
                let n = u16::from_le_bytes([d[i + 2], d[i + 3]]) as usize;
                (&d[i + 4..i + 4 + n], i + 4 + n)
            }
            f => panic!("{function}: unknown .nv.info format {f}"),
        };
        match (format, attr) {
            (4, 0x17) => {
                let ordinal = u16::from_le_bytes([value[4], value[5]]) as usize;
                let offset = u16::from_le_bytes([value[6], value[7]]) as usize;
                let size = (u32::from_le_bytes(value[8..12].try_into().unwrap()) >> 18) as usize;
                params.push((ordinal, size, offset));
            }
            (4, 0x05) => {
                let dims = value.chunks_exact(4).map(|c| u32::from_le_bytes(c.try_into().unwrap()) as u64);
                info.max_threads = Some(dims.product());
            }
            _ => {}
        }
        i = next;
    }
    params.sort();
    info.params = params.into_iter().map(|(_, s, o)| (s, o)).collect();
    Some(info)
}

/// Checks `k` against its kernel in `cubin`: present, with the parameters
/// its arguments fill in the C layout, and a launch bound admitting its block.
pub(crate) fn check_signature(what: &str, cubin: &[u8], k: &KernelLaunch) {
    let info = kernel_info(cubin, &k.function)
        .unwrap_or_else(|| panic!("{what}: no kernel `{}` in module `{}`", k.function, k.module));
    // C layout: each at the first multiple of its alignment past the one
    // before. Alignments above 8 (tensor maps) hold relative to where the
    // parameters start in the constant bank, so for them only the order is
    // checked.
    let mut end = 0usize;
    let passed: Vec<(usize, usize)> = k
        .args
        .iter()
        .zip(info.params.iter().chain(std::iter::repeat(&(0, 0))))
        .map(|(a, &(_, at_cubin))| {
            let (n, align) = a.layout();
            let at = if align <= 8 { end.next_multiple_of(align) } else { at_cubin.max(end) };
            end = at + n;
            (n, at)
        })
        .collect();
    assert_eq!(passed, info.params, "{what}: `{}` arguments (size, offset) against its parameters", k.function);
    if let Some(max) = info.max_threads {
        let threads = k.block.0 as u64 * k.block.1 as u64 * k.block.2 as u64;
        assert!(threads <= max, "{what}: `{}` launched with {threads} threads, bound {max}", k.function);
    }
}

/// Lowers `op` on inputs of `types` (outputs from the shape rule) at fake
/// addresses and checks every launch; with `cubins`, also against the
/// kernels NVRTC builds (compiled once per module). Returns the launch
/// count, or the error when the backend has no kernel for the case.
fn check_case(
    what: &str,
    op: &Op,
    types: &[TensorType],
    cubins: Option<&mut HashMap<&'static str, Vec<u8>>>,
) -> Result<usize> {
    let refs: Vec<&TensorType> = types.iter().collect();
    let out_types = op.infer(&refs).unwrap_or_else(|e| panic!("{what}: shape rule: {e}"));
    let mut addr = Addresses(1 << 30);
    let (ins, outs) = (addr.place(types), addr.place(&out_types));
    let group = world_of(op).map(|world| GroupRank { rank: 0, world });
    let lowered = match lower(op, &ins, &outs, group) {
        Err(e @ CudaError::Unsupported { .. }) => return Err(e),
        other => other.unwrap_or_else(|e| panic!("{what}: {e}")),
    };
    let mut cubins = cubins;
    for l in &lowered {
        check_launch(what, op, l, &ins, &outs);
        if let (Some(cubins), Launch::Kernel(k)) = (cubins.as_deref_mut(), l) {
            let cubin = cubins
                .entry(k.module)
                .or_insert_with(|| crate::kernels::compile(k.module, "sm_90").unwrap_or_else(|e| panic!("{e}")));
            check_signature(what, cubin, k);
        }
    }
    Ok(lowered.len())
}

/// Every sample of every op lowers, and every launch is well formed (see
/// the module doc). Passes with empty sample tables; fails on any sample
/// that does not lower.
#[test]
fn every_sample_of_every_op_lowers_to_well_formed_launches() {
    let nvrtc = crate::nvrtc::available();
    if !nvrtc {
        eprintln!("NVRTC not found: kernel signature checks skipped");
        assert!(
            std::env::var_os("STEPGRAPH_REQUIRE_NVRTC").is_none(),
            "STEPGRAPH_REQUIRE_NVRTC is set but NVRTC is missing"
        );
    }
    let mut cubins: HashMap<&str, Vec<u8>> = HashMap::new();
    let (mut samples, mut launches) = (0, 0);
    // Per op: (samples, samples lowered).
    let mut per_op: HashMap<&str, (usize, usize)> = HashMap::new();
    for dtype in FLOAT_DTYPES {
        for (variant, cases) in samples_by_op(dtype) {
            for (i, s) in cases.iter().enumerate() {
                let types = s.input_types();
                let what = format!("{variant} sample {i} in {dtype} ({:?} on {types:?})", s.op);
                let counts = per_op.entry(variant).or_default();
                counts.0 += 1;
                match check_case(&what, &s.op, &types, nvrtc.then_some(&mut cubins)) {
                    Ok(n) => {
                        launches += n;
                        samples += 1;
                        counts.1 += 1;
                    }
                    Err(e) => eprintln!("skipped {what}: {e}"),
                }
            }
        }
    }
    for (variant, (declared, lowered)) in &per_op {
        assert!(*lowered > 0, "{variant}: none of its {declared} samples has a CUDA kernel");
    }
    eprintln!("{samples} samples lowered to {launches} launches");
}

#[test]
fn a_dtype_without_a_kernel_is_reported_not_lowered() {
    use stepgraph_core::ir::DType;
    use stepgraph_core::ops::matmul::MatMul;
    let op = Op::from(MatMul::new(false, false));
    let types = |dt| [TensorType::new(dt, [2, 3]), TensorType::new(dt, [3, 4])];
    let e = check_case("matmul in f64", &op, &types(DType::F64), None).unwrap_err();
    assert!(matches!(e, CudaError::Unsupported { .. }), "{e}");
    assert_eq!(check_case("matmul in f32", &op, &types(DType::F32), None).unwrap(), 1);
}
