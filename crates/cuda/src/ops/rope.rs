//! Lowering of the rotary embedding to the kernels of `kernels/rope.cu`.
//! Positions on axis 1 (one input): one block per position of
//! `[B, T, H, D]`, rotating that position's row of every batch row with the
//! angles it computes once. Per-row start positions (a second input, for
//! generation) or per-token positions (packed documents): one block per
//! row `(b, t)`, since rows at different positions share no angles. Either
//! way a 2-D block whose x lanes cover one chunk of a head's rotated pairs
//! and y lanes the heads; frequency scaling (Llama-3.x, LongRoPE's factors)
//! passed as one struct argument. The identity in place (no rotated dims,
//! output aliasing input) launches nothing.
//!
//! [`merge_ropes`] then makes a layer's two rotations (q then k, forward or
//! inverse, at the same positions) one `rope2` (`rope2_at`) launch whose
//! grid's second dimension picks the tensor.

use stepgraph_core::ops::rope::{LongRope, Rope, RopeScaling};
use stepgraph_core::ops::OpDef;

use super::util::{independent_pair, n64, ptr, row_grid, two_row_launch, typed_kernel, MAX_ROW_BLOCKS};
use super::{Lower, LowerCx};
use crate::error::{CudaError, Result};
use crate::kernel_module::KernelModule;
use crate::launch::{Arg, KernelLaunch, Launch, LaunchList, StructArg};

/// `ROPE_CHUNK` of rope.cu: pairs whose angles a rope block holds at once.
const ROPE_CHUNK: usize = 256;
/// Rope blocks do little per element; smaller blocks spread the B·T rows.
const ROPE_MAX_THREADS: usize = 256;
/// `ROPE_LONG_PAIRS` of rope.cu: the most rotated pairs LongRoPE factors
/// travel for (heads up to 256 rotated dimensions).
const ROPE_LONG_PAIRS: usize = 128;

/// The kernels' `RopeScale` argument for `rope`: the kind (0 plain, 1
/// Llama-3.x, 2 LongRoPE), the Llama-3.x numbers, the attention factor, the
/// original context and both LongRoPE factor sets (zeros the kernel never
/// reads where the kind has none).
fn scale_arg(rope: &Rope) -> Result<Arg> {
    let (mut llama3, mut long) = ([0.0; 4], None);
    let kind = match &rope.scaling {
        None => 0,
        Some(RopeScaling::Llama3(s)) => {
            llama3 = [s.factor, s.low_freq_factor, s.high_freq_factor, s.original_max_position_embeddings as f64];
            1
        }
        Some(RopeScaling::LongRope(s)) => {
            if s.short_factor.len().max(s.long_factor.len()) > ROPE_LONG_PAIRS {
                return Err(CudaError::lower(
                    rope.name(),
                    format!(
                        "LongRoPE on {} rotated dimensions: the kernels take at most {}",
                        rope.n_rot,
                        2 * ROPE_LONG_PAIRS
                    ),
                ));
            }
            long = Some(s);
            2
        }
    };
    let factors = |pick: fn(&LongRope) -> &Vec<f64>| {
        let mut v = long.map_or_else(Vec::new, |s| pick(s).clone());
        v.resize(ROPE_LONG_PAIRS, 0.0);
        v
    };
    let mut arg = StructArg::default().i64(kind);
    for x in llama3 {
        arg = arg.f64(x);
    }
    arg = arg.f64(long.map_or(1.0, |s| s.attention_factor));
    arg = arg.i64(long.map_or(0, |s| s.original_max_position_embeddings as i64));
    for x in factors(|s| &s.short_factor).into_iter().chain(factors(|s| &s.long_factor)) {
        arg = arg.f64(x);
    }
    Ok(arg.build())
}

impl Lower for Rope {
    const KERNELS: &'static [KernelModule] = &[KernelModule::plain("rope", include_str!("../../kernels/rope.cu"))];

    fn lower(&self, cx: &LowerCx) -> Result<Vec<Launch>> {
        let (x, y) = (&cx.inputs[0], &cx.outputs[0]);
        let [batch, seq, heads, dim] = x.ty.shape[..] else {
            return Err(CudaError::lower(self.name(), format!("x must be [B, T, H, D], got {}", x.ty)));
        };
        let row = heads * dim;
        if x.ty.numel() == 0 || (self.n_rot == 0 && x.ptr == y.ptr) {
            // Nothing to write: no element, or the identity in place.
            return Ok(vec![]);
        }
        // In-row offsets are 32-bit in the kernel (its per-element divisions are cheaper so).
        let int = |v: usize, what: &str| {
            i32::try_from(v)
                .map_err(|_| CudaError::lower(self.name(), format!("{what} = {v} exceeds the kernel's 32-bit range")))
        };
        let (heads_i, dim_i, n_rot_i) = (int(heads, "H")?, int(dim, "D")?, int(self.n_rot, "n_rot")?);
        int(row, "H·D")?;
        // A 2-D block of ROPE_MAX_THREADS: x over a chunk's pairs of one head
        // (rounded up to whole warps), y over heads; n_rot ≤ 1 walks rows flat.
        let pairs = (self.n_rot / 2).min(ROPE_CHUNK);
        let block_x = if pairs > 0 { pairs.next_multiple_of(32).min(ROPE_MAX_THREADS) } else { ROPE_MAX_THREADS };
        let block = (block_x as u32, (ROPE_MAX_THREADS / block_x) as u32, 1);
        let bt = batch * seq;
        let start = cx.inputs.get(1);
        let mut args = vec![ptr(x), ptr(y)];
        args.extend(start.map(ptr));
        // `rope_at` puts row (b, t) at start[b] + t: positions per token are
        // that with every row its own "batch row" of one token.
        let per_token = start.is_some_and(|s| s.ty.rank() == 2);
        args.extend([
            n64(bt),
            n64(if per_token { 1 } else { seq }),
            Arg::I32(heads_i),
            Arg::I32(dim_i),
            Arg::I32(n_rot_i),
            Arg::F64(self.base),
            Arg::I32(self.inverse as i32),
        ]);
        args.push(scale_arg(self)?);
        Ok(vec![match start {
            // One block per position: it rotates that position's row of every batch row.
            None => typed_kernel("rope", "rope", x.ty.dtype, row_grid(seq, MAX_ROW_BLOCKS), block, args),
            // One block per row, each at its own position.
            Some(_) => typed_kernel("rope", "rope_at", x.ty.dtype, row_grid(bt, MAX_ROW_BLOCKS), block, args),
        }])
    }
}

/// The bytes `[start, end)` a `rope_<dt>` or `rope_at_<dt>` launch reads
/// (x) and writes (y); `None` for any other launch.
fn rope_ranges(k: &KernelLaunch) -> Option<[(u64, u64); 2]> {
    // `rope_at` has the positions after x and y; its sizes follow them.
    let (dtype, sizes) = match k.function.strip_prefix("rope_at_") {
        Some(dtype) => (dtype, 3),
        None => (k.function.strip_prefix("rope_")?, 2),
    };
    let elem = match dtype {
        "f32" => 4,
        "bf16" | "f16" => 2,
        "f64" => 8,
        _ => return None,
    };
    let (Arg::Ptr(x), Arg::Ptr(y), Arg::I64(rows), Arg::I32(heads), Arg::I32(dim)) =
        (&k.args[0], &k.args[1], &k.args[sizes], &k.args[sizes + 2], &k.args[sizes + 3])
    else {
        return None;
    };
    let bytes = (*rows).max(0) as u64 * (*heads).max(0) as u64 * (*dim).max(0) as u64 * elem;
    Some([(*x, x + bytes), (*y, y + bytes)])
}

/// Consecutive rotations that differ only in their tensors and head counts
/// (a layer's q and k: the same rows, head size, angles, direction and, for
/// `rope_at_<dt>`, positions) as one `rope2_<dt>` / `rope2_at_<dt>` launch,
/// block row `blockIdx.y` rotating the first tensor or the second, when the
/// second reads or writes nothing the first writes and writes nothing it
/// reads: the same arithmetic per element, one launch fewer per layer and
/// pass.
pub fn merge_ropes(list: LaunchList) -> LaunchList {
    list.merge_adjacent(|a, b| {
        let (ka, kb) = independent_pair(a, b, rope_ranges)?;
        // Arguments after x and y: [positions,] rows, seq, heads, dim, ...
        let sizes = if ka.function.starts_with("rope_at_") { 3 } else { 2 };
        let heads = sizes + 2;
        if ka.args[2..heads] != kb.args[2..heads] || ka.args[heads + 1..] != kb.args[heads + 1..] {
            return None;
        }
        let mut args = vec![ka.args[0].clone(), ka.args[1].clone(), kb.args[0].clone(), kb.args[1].clone()];
        args.extend(ka.args[2..heads].iter().cloned());
        args.extend([ka.args[heads].clone(), kb.args[heads].clone()]);
        args.extend(ka.args[heads + 1..].iter().cloned());
        Some(two_row_launch(ka, ka.function.replacen("rope_", "rope2_", 1), args))
    })
}

#[cfg(test)]
mod tests {
    use stepgraph_core::ir::{DType, TensorType};
    use stepgraph_core::ops::Op;

    use super::*;
    use crate::launch::DevTensor;
    use crate::ops::lower;

    /// The sizes the lowering assumes are rope.cu's.
    #[test]
    fn the_launch_sizes_are_the_kernels() {
        let source = include_str!("../../kernels/rope.cu");
        let define = |name: &str| -> usize {
            source
                .lines()
                .find_map(|l| l.strip_prefix("#define ").and_then(|rest| rest.strip_prefix(name)))
                .and_then(|rest| rest.split_whitespace().next())
                .and_then(|v| v.parse().ok())
                .unwrap_or_else(|| panic!("rope.cu defines {name}"))
        };
        assert_eq!((define("ROPE_CHUNK"), define("ROPE_LONG_PAIRS")), (ROPE_CHUNK, ROPE_LONG_PAIRS));
    }

    #[test]
    fn rope_in_place_identity_is_free_and_out_of_place_copies() {
        let op = Op::Rope(Rope { n_rot: 0, base: 10000.0, inverse: false, scaling: None });
        let ty = TensorType::new(DType::BF16, [1, 2, 3, 4]);
        let x = DevTensor { ty: ty.clone(), ptr: 4096 };
        assert!(lower(&op, std::slice::from_ref(&x), std::slice::from_ref(&x), None).unwrap().is_empty());
        let y = DevTensor { ty, ptr: 8192 };
        assert_eq!(lower(&op, &[x], &[y], None).unwrap().len(), 1);
    }

    /// A layer's q and k rotations (grouped heads: 4 and 2) merge into one
    /// `rope2` launch carrying both tensors and head counts; rotations that
    /// share bytes or differ in direction do not.
    #[test]
    fn a_layers_q_and_k_rotations_are_one_launch() {
        let rope = |inverse| Op::Rope(Rope { n_rot: 64, base: 10000.0, inverse, scaling: None });
        let t = |heads| TensorType::new(DType::BF16, [2, 16, heads, 64]);
        let at = |ptr, heads| DevTensor { ty: t(heads), ptr };
        let one = |op: &Op, x: DevTensor, y: DevTensor| lower(op, &[x], &[y], None).unwrap();
        let (q, qr, k, kr) = (at(1 << 20, 4), at(2 << 20, 4), at(3 << 20, 2), at(4 << 20, 2));
        let launches = [one(&rope(false), q.clone(), qr.clone()), one(&rope(false), k.clone(), kr.clone())].concat();
        let (merged, last, first) = merge_ropes(LaunchList::one_node_each(launches.clone(), vec![7, 8])).into_parts();
        assert_eq!((merged.len(), last, first), (1, vec![8], vec![7]));
        let (Launch::Kernel(m), Launch::Kernel(a)) = (&merged[0], &launches[0]) else { panic!("kernels") };
        assert_eq!((m.function.as_str(), m.grid, m.block), ("rope2_bf16", (a.grid.0, 2, 1), a.block));
        let ptrs = [Arg::Ptr(q.ptr), Arg::Ptr(qr.ptr), Arg::Ptr(k.ptr), Arg::Ptr(kr.ptr)];
        assert_eq!(m.args[..4], ptrs);
        assert_eq!(m.args[4..8], [Arg::I64(32), Arg::I64(16), Arg::I32(4), Arg::I32(2)]);
        assert_eq!(m.args[8..], a.args[5..], "head size onwards as each launch has them");
        // No sample lowers to the merged kernel: check its parameters here.
        if crate::nvrtc::available() {
            let cubin = crate::kernels::compile("rope", "sm_90").unwrap_or_else(|e| panic!("{e}"));
            crate::ops::sweep::check_signature("merged rope", &cubin, m);
        } else {
            assert!(
                std::env::var_os("STEPGRAPH_REQUIRE_NVRTC").is_none(),
                "STEPGRAPH_REQUIRE_NVRTC is set but NVRTC is missing"
            );
        }
        // Each rotated in place: still one launch.
        let in_place = [one(&rope(true), q.clone(), q.clone()), one(&rope(true), k.clone(), k.clone())].concat();
        assert_eq!(merge_ropes(LaunchList::one_node_each(in_place, vec![0, 1])).into_parts().0.len(), 1);
        // The second reads what the first writes: apart.
        let chained =
            [one(&rope(false), q.clone(), qr.clone()), one(&rope(false), qr.clone(), at(5 << 20, 4))].concat();
        assert_eq!(merge_ropes(LaunchList::one_node_each(chained, vec![0, 1])).into_parts().0.len(), 2);
        // Opposite directions: apart.
        let mixed = [one(&rope(false), q.clone(), qr.clone()), one(&rope(true), k.clone(), kr.clone())].concat();
        assert_eq!(merge_ropes(LaunchList::one_node_each(mixed, vec![0, 1])).into_parts().0.len(), 2);
    }

    /// Rotations at per-token positions (packed documents) or per-row
    /// starts (generation) merge as `rope2_at`, when both read the same
    /// positions; not across different positions.
    #[test]
    fn positioned_q_and_k_rotations_are_one_launch() {
        let op = Op::Rope(Rope { n_rot: 32, base: 10000.0, inverse: false, scaling: None });
        let t = |heads| TensorType::new(DType::F32, [2, 16, heads, 32]);
        let at = |ptr, heads| DevTensor { ty: t(heads), ptr };
        let positions = |ptr| DevTensor { ty: TensorType::new(DType::I32, [2, 16]), ptr };
        let one = |x: DevTensor, p: DevTensor, y: DevTensor| lower(&op, &[x, p], &[y], None).unwrap();
        let (q, qr, k, kr, p) = (at(1 << 20, 8), at(2 << 20, 8), at(3 << 20, 2), at(4 << 20, 2), positions(5 << 20));
        let launches = [one(q.clone(), p.clone(), qr.clone()), one(k.clone(), p.clone(), kr.clone())].concat();
        let (merged, _, _) = merge_ropes(LaunchList::one_node_each(launches.clone(), vec![0, 1])).into_parts();
        assert_eq!(merged.len(), 1);
        let (Launch::Kernel(m), Launch::Kernel(a)) = (&merged[0], &launches[0]) else { panic!("kernels") };
        assert_eq!((m.function.as_str(), m.grid), ("rope2_at_f32", (a.grid.0, 2, 1)));
        let ptrs = [Arg::Ptr(q.ptr), Arg::Ptr(qr.ptr), Arg::Ptr(k.ptr), Arg::Ptr(kr.ptr), Arg::Ptr(p.ptr)];
        assert_eq!(m.args[..5], ptrs);
        // Per-token positions: B·T rows, each its own row of one token.
        assert_eq!(m.args[5..9], [Arg::I64(32), Arg::I64(1), Arg::I32(8), Arg::I32(2)]);
        assert_eq!(m.args[9..], a.args[6..], "head size onwards as each launch has them");
        if crate::nvrtc::available() {
            let cubin = crate::kernels::compile("rope", "sm_90").unwrap_or_else(|e| panic!("{e}"));
            crate::ops::sweep::check_signature("merged positioned rope", &cubin, m);
        } else {
            assert!(
                std::env::var_os("STEPGRAPH_REQUIRE_NVRTC").is_none(),
                "STEPGRAPH_REQUIRE_NVRTC is set but NVRTC is missing"
            );
        }
        // Other positions: apart.
        let other = [one(q.clone(), p.clone(), qr.clone()), one(k.clone(), positions(6 << 20), kr.clone())].concat();
        assert_eq!(merge_ropes(LaunchList::one_node_each(other, vec![0, 1])).into_parts().0.len(), 2);
    }

    #[test]
    fn positioned_rope_takes_one_block_per_row() {
        let op = Op::Rope(Rope { n_rot: 100, base: 10000.0, inverse: false, scaling: None });
        let x = DevTensor { ty: TensorType::new(DType::BF16, [16, 1, 32, 100]), ptr: 4096 };
        let start = DevTensor { ty: TensorType::new(DType::I32, [16]), ptr: 1 << 20 };
        let l = lower(&op, &[x.clone(), start], std::slice::from_ref(&x), None).unwrap();
        let Launch::Kernel(k) = &l[0] else { panic!("expected a kernel, got {l:?}") };
        assert_eq!((k.function.as_str(), k.grid), ("rope_at_bf16", (16, 1, 1)));
        // 50 pairs round up to 64 lanes, four heads' worth of rows per block.
        assert_eq!(k.block, (64, 4, 1));
        assert_eq!(k.args[..4], [Arg::Ptr(4096), Arg::Ptr(4096), Arg::Ptr(1 << 20), Arg::I64(16)]);
        // Positions on axis 1: one block per position, shared by the batch rows.
        let l = lower(&op, std::slice::from_ref(&x), std::slice::from_ref(&x), None).unwrap();
        let Launch::Kernel(k) = &l[0] else { panic!("expected a kernel, got {l:?}") };
        assert_eq!((k.function.as_str(), k.grid), ("rope_bf16", (1, 1, 1)));
    }
}
