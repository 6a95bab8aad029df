//! Lowering of the generation ops of `stepgraph_core::ops::decode` to the
//! kernels of `kernels/decode.cu`:
//!
//! * `kv_write`: a copy of the cache when the output does not alias it,
//!   then one block per new row `(b, t)` copying it into its cache slot in
//!   the widest copy unit dividing the row and the addresses.
//! * `cached_attention`: a split pass over a grid of (query row `(b, t)`,
//!   split, kv head × head tile) writing the partials, then a combine pass
//!   (one warp per query row) writing `o`. A split block serves up to
//!   [`heads_per_block`] query heads of one kv head's group, so every key
//!   and value row is read once per group, with loads of [`load_width`]
//!   elements where the cache's alignment allows. With
//!   [`Switches::decode_staging`](crate::switches::Switches::decode_staging) each warp
//!   first copies its key and value tiles into a ring in shared memory
//!   ([`staging`]), where the loads and the ring allow.
//! * `sample_next`: one block per batch row, in double (see the kernel's
//!   notes on the threshold search), writing the token and the advanced
//!   position; correct both in place and not, since a row's inputs are read
//!   before its outputs are written and no other block touches them.
//!
//! Cache rows and positions are device values: the kernels check them
//! against `[0, N) × [0, S)` before using them as addresses, as the CPU
//! skips them, so no value can make a launch read or write outside its
//! operands.

use stepgraph_core::ir::{DType, TensorType};
use stepgraph_core::ops::decode::{CachedAttention, KvWrite, SampleNext};
use stepgraph_core::ops::OpDef;

use super::util::{
    float_name, independent_pair, launch, row_grid, two_row_launch, typed_kernel, unit_for, MAX_ROW_BLOCKS, UNITS,
};
use super::{Lower, LowerCx};
use crate::error::{CudaError, Result};
use crate::kernel_args::kernel_args;
use crate::kernel_module::KernelModule;
use crate::launch::{KernelLaunch, Launch, LaunchList};

/// The module of every generation kernel.
const MODULE: &str = "decode";
const DECODE: &[KernelModule] = &[KernelModule::plain(MODULE, include_str!("../../kernels/decode.cu"))];

/// Threads of a `kv_write` block at most (its `__launch_bounds__`).
const KV_WRITE_THREADS: usize = 256;
/// `CA_THREADS` of decode.cu: four warps per split block and per combine block.
const CA_THREADS: u32 = 128;
/// `CA_MAX_D` of decode.cu: the largest head size the kernels hold.
pub const MAX_HEAD_SIZE: usize = 256;
/// `SN_THREADS` of decode.cu: one block per batch row.
const SN_THREADS: u32 = 1024;

/// Query heads one split block serves (the kernel's `H`) when each kv head
/// has `group` query heads: all of them with one (MHA: the block's
/// registers and shared memory are then a fraction of the grouped
/// kernel's, so more blocks fit an SM), else up to 8 (4 for f64, whose
/// accumulators take twice the registers), the group cut into tiles.
pub fn heads_per_block(dtype: DType, group: usize) -> usize {
    match (group, dtype) {
        (1, _) => 1,
        (_, DType::F64) => 4,
        _ => 8,
    }
}

/// `(VW, E)` of the split kernel for head size `d`: a lane accumulates at
/// most `E` elements of a head (4 up to D = 128, else 8), and key and value
/// rows are read `VW` elements at a time, the widest load (of at most 16
/// bytes, `VW ≤ E`) that divides a row and whose alignment every row start
/// has (`align`: the largest power of two dividing both cache addresses),
/// with the row's `D / VW` loads spread over 32 lanes in at most `E / VW`
/// rounds. `VW = 1` always fits, since `ceil(D / 32) ≤ E`.
pub fn load_width(dtype: DType, d: usize, align: u64) -> (usize, usize) {
    let e = if d <= 128 { 4 } else { 8 };
    let size = dtype.size();
    let vw = [8, 4, 2, 1]
        .into_iter()
        .find(|&vw| {
            let bytes = (vw * size) as u64;
            vw <= e
                && bytes <= 16
                && d.is_multiple_of(vw)
                // Every address is element-aligned (checked before lowering).
                && (vw == 1 || align.is_multiple_of(bytes))
                && (d / vw).div_ceil(32) * vw <= e
        })
        .expect("VW = 1 always fits");
    (vw, e)
}

/// `CA_WARPS` of decode.cu: warps per split block, each with its own ring.
pub(crate) const CA_WARPS: usize = 4;
/// Stages of a warp's ring when the split pass stages the cache.
const CA_STAGES: usize = 2;
/// Shared memory a block may hold on sm_90 (static and dynamic together).
const MAX_BLOCK_SHARED: usize = 227 * 1024;

/// The split kernel's static shared memory with `heads` heads per block:
/// `q_s[H][CA_MAX_D]`, `w_acc[CA_WARPS][H][CA_MAX_D]` and five `[.][H]`
/// statistics arrays of the accumulator type.
fn split_static_shared(dtype: DType, heads: usize) -> usize {
    let acc = if dtype == DType::F64 { 8 } else { 4 };
    ((1 + CA_WARPS) * heads * MAX_HEAD_SIZE + (3 * CA_WARPS + 2) * heads) * acc
}

/// How the split pass reads the cache: `(stages, pitch)`, where `stages`
/// is 0 to read key and value rows in place, or `CA_STAGES` (2) to copy each
/// warp's tiles into a ring in shared memory first (cp.async, `stages − 1`
/// tiles ahead), rows `pitch` elements apart. Staging needs loads of at
/// least 4 bytes (cp.async's smallest copy) and a ring that fits next to
/// the kernel's static shared memory. The pitch makes a row's 4-byte words
/// an odd number of loads, so 32 lanes reading one load of their own key
/// rows hit distinct banks.
pub fn staging(dtype: DType, heads: usize, d: usize, vw: usize) -> (usize, usize) {
    let size = dtype.size();
    let load_bytes = vw * size;
    if d == 0 || load_bytes < 4 {
        return (0, 0);
    }
    let (load_words, row_words) = (load_bytes / 4, d * size / 4);
    let pitch_words = if (row_words / load_words) % 2 == 1 { row_words } else { row_words + load_words };
    let pitch = pitch_words * 4 / size;
    if split_staged_bytes(dtype, pitch, CA_STAGES) + split_static_shared(dtype, heads) > MAX_BLOCK_SHARED {
        return (0, 0);
    }
    (CA_STAGES, pitch)
}

/// Dynamic shared memory of a staged split block: every warp's ring of
/// `stages` slots of 32 key rows and 32 value rows, `pitch` elements each.
pub fn split_staged_bytes(dtype: DType, pitch: usize, stages: usize) -> usize {
    CA_WARPS * stages * 64 * pitch * dtype.size()
}

kernel_args! {
    /// `kv_write_<unit>`: row `(b, t)` of the `bt_rows` rows of `src`
    /// (`seq` per batch row) into slot `(rows[b], start[b] + t)` of the
    /// `[n, s]` rows of `cache`, rows of `row_units` copy units; with `last`
    /// (not 0) into a ring (`KvWrite::slot`).
    pub(crate) struct KvWriteArgs {
        cache: u64,
        src: u64,
        rows: u64,
        start: u64,
        last: u64,
        bt_rows: i64,
        seq: i64,
        n: i64,
        s: i64,
        row_units: i64,
    }
}

kernel_args! {
    /// `kv_write2_<unit>`: two [`KvWriteArgs`] launches of the same rows
    /// and shapes, blocks with `blockIdx.y` 0 doing the first, 1 the second.
    pub(crate) struct KvWrite2Args {
        cache0: u64,
        src0: u64,
        cache1: u64,
        src1: u64,
        rows: u64,
        start: u64,
        last: u64,
        bt_rows: i64,
        seq: i64,
        n: i64,
        s: i64,
        row_units: i64,
    }
}

impl KvWrite2Args {
    /// `first` and `second` as one launch, when they write the same rows
    /// of the same shapes.
    fn pair(first: KvWriteArgs, second: KvWriteArgs) -> Option<Self> {
        let same = KvWriteArgs { cache: first.cache, src: first.src, ..second.clone() } == first;
        same.then_some(KvWrite2Args {
            cache0: first.cache,
            src0: first.src,
            cache1: second.cache,
            src1: second.src,
            rows: first.rows,
            start: first.start,
            last: first.last,
            bt_rows: first.bt_rows,
            seq: first.seq,
            n: first.n,
            s: first.s,
            row_units: first.row_units,
        })
    }

    /// The two writes this launch does, in grid-row order.
    #[cfg(test)]
    pub(crate) fn halves(&self) -> [KvWriteArgs; 2] {
        [(self.cache0, self.src0), (self.cache1, self.src1)].map(|(cache, src)| KvWriteArgs {
            cache,
            src,
            rows: self.rows,
            start: self.start,
            last: self.last,
            bt_rows: self.bt_rows,
            seq: self.seq,
            n: self.n,
            s: self.s,
            row_units: self.row_units,
        })
    }
}

kernel_args! {
    /// `cached_attention_split_h<H>_v<VW>_e<E>_s<ST>_<dtype>`: the split
    /// pass over query rows `(b, t)` (`seq` per batch row) against cache
    /// rows `rows[b]` (of `n`, `s` positions each) up to `start[b] + t`,
    /// writing each split's partials, or `o` itself with one split.
    pub(crate) struct CachedAttentionSplitArgs {
        q: u64,
        k_cache: u64,
        v_cache: u64,
        rows: u64,
        start: u64,
        partials: u64,
        o: u64,
        seq: i64,
        n: i64,
        s: i64,
        q_heads: i32,
        kv_heads: i32,
        head_size: i32,
        splits: i64,
        /// Cache positions per split.
        chunk: i64,
        scale: f64,
        /// Elements between ring rows in shared memory (0: no ring).
        pitch: i32,
        /// Which cache positions a query sees and the soft-cap (`SgKeys`
        /// of kernels/common.cuh, without positions).
        window: i32,
        softcap: f64,
    }
}

kernel_args! {
    /// `cached_attention_combine_<dtype>`: the `splits` partials of each of
    /// `rows` query rows combined into its `head_size` outputs.
    pub(crate) struct CachedAttentionCombineArgs {
        partials: u64,
        o: u64,
        rows: i64,
        head_size: i32,
        splits: i64,
    }
}

kernel_args! {
    /// `sample_next_<dtype>`: one token per batch row from its logits (of
    /// `vocab`) under its sampling settings and seed; positions advance by
    /// `advance`.
    pub(crate) struct SampleNextArgs {
        logits: u64,
        sampling: u64,
        seeds: u64,
        start_in: u64,
        next: u64,
        start_out: u64,
        batch: i64,
        vocab: i64,
        advance: i64,
    }
}

/// The bytes `kv_write_<u>`'s launch `k` writes (its cache) and reads (its
/// new rows), from its arguments.
fn kv_write_ranges(k: &KernelLaunch) -> Option<[(u64, u64); 2]> {
    let unit = UNITS.iter().find(|(_, n)| k.function.strip_prefix("kv_write_") == Some(*n))?.0;
    let a = KvWriteArgs::try_from_args(&k.args)?;
    let extent = |x: i64| x.max(0) as u64;
    let (bt, n, s, units) = (extent(a.bt_rows), extent(a.n), extent(a.s), extent(a.row_units));
    Some([(a.cache, a.cache + n * s * units * unit), (a.src, a.src + bt * units * unit)])
}

/// Consecutive `kv_write` launches of one step that differ only in their
/// cache and new rows (a layer's keys then values: the same rows,
/// positions and shapes) as one `kv_write2` launch, when neither writes
/// bytes the other reads or writes: the same copies, one launch fewer per
/// layer.
pub fn merge_kv_writes(list: LaunchList) -> LaunchList {
    list.merge_adjacent(|a, b| {
        let (ka, kb) = independent_pair(a, b, |k| kv_write_ranges(k).map(|[cache, src]| [src, cache]))?;
        let pair = KvWrite2Args::pair(KvWriteArgs::try_from_args(&ka.args)?, KvWriteArgs::try_from_args(&kb.args)?)?;
        Some(two_row_launch(ka, ka.function.replacen("kv_write_", "kv_write2_", 1), pair.args()))
    })
}

impl Lower for KvWrite {
    const KERNELS: &'static [KernelModule] = DECODE;

    fn lower(&self, cx: &LowerCx) -> Result<Vec<Launch>> {
        let (cache, new, rows, start, out) =
            (&cx.inputs[0], &cx.inputs[1], &cx.inputs[2], &cx.inputs[3], &cx.outputs[0]);
        // A ring's last positions; 0 (no ring) otherwise.
        let last = if self.ring { cx.inputs[4].ptr } else { 0 };
        let (&[n, s, h, d], &[b, t, ..]) = (&cache.ty.shape[..], &new.ty.shape[..]) else {
            return Err(CudaError::lower(
                self.name(),
                format!("cache {} and rows {} must be rank 4", cache.ty, new.ty),
            ));
        };
        // Out of place, the output starts as the cache; in place it already is.
        let mut launches = Vec::new();
        if out.ptr != cache.ptr {
            launches.push(Launch::Copy { dst: out.ptr, src: cache.ptr, bytes: cache.ty.bytes() });
        }
        let row_bytes = (h * d * cache.ty.dtype.size()) as u64;
        let bt = b * t;
        if bt == 0 || row_bytes == 0 {
            return Ok(launches);
        }
        let (unit, name) = unit_for(&[row_bytes, out.ptr, new.ptr]);
        let row_units = (row_bytes / unit) as usize;
        let threads = row_units.next_multiple_of(32).clamp(32, KV_WRITE_THREADS) as u32;
        let args = KvWriteArgs {
            cache: out.ptr,
            src: new.ptr,
            rows: rows.ptr,
            start: start.ptr,
            last,
            bt_rows: bt as i64,
            seq: t as i64,
            n: n as i64,
            s: s as i64,
            row_units: row_units as i64,
        }
        .args();
        launches.push(launch(MODULE, format!("kv_write_{name}"), row_grid(bt, MAX_ROW_BLOCKS), (threads, 1, 1), args));
        Ok(launches)
    }
}

impl Lower for CachedAttention {
    const KERNELS: &'static [KernelModule] = DECODE;

    fn lower(&self, cx: &LowerCx) -> Result<Vec<Launch>> {
        let types: Vec<&TensorType> = cx.inputs.iter().map(|t| &t.ty).collect();
        let n = self.dims(&types).map_err(|e| CudaError::lower(self.name(), e))?;
        let [q, k, v, rows, start] = cx.inputs else {
            return Err(CudaError::lower(self.name(), "expects q, k_cache, v_cache, rows, start"));
        };
        let (o, part) = (&cx.outputs[0], &cx.outputs[1]);
        let dt = q.ty.dtype;
        let sfx = float_name(self.name(), dt)?;
        let fail = |why: String| CudaError::lower(self.name(), why);
        if n.d > MAX_HEAD_SIZE {
            return Err(fail(format!("head size {} is above the kernels' {MAX_HEAD_SIZE}", n.d)));
        }
        let group = n.hq / n.hkv;
        let heads = heads_per_block(dt, group);
        let tiles = group.div_ceil(heads);
        let (rows_bt, head_blocks) = (n.b * n.t, n.hkv * tiles);
        // Grid x is the query row, y the split, z kv heads × head tiles.
        if rows_bt > i32::MAX as usize || n.splits > 65535 || head_blocks > 65535 {
            return Err(fail(format!(
                "{rows_bt} query rows, {} splits or {head_blocks} kv head tiles exceed the grid limits",
                n.splits
            )));
        }
        if n.hq > i32::MAX as usize {
            return Err(fail(format!("{} query heads do not fit the kernels' int", n.hq)));
        }
        // The alignment every row start shares: the smaller of the two caches'.
        let align = 1u64 << k.ptr.trailing_zeros().min(v.ptr.trailing_zeros()).min(8);
        let (vw, e) = load_width(dt, n.d, align);
        let (stages, pitch) = if cx.target.switches.decode_staging { staging(dt, heads, n.d, vw) } else { (0, 0) };
        let split_args = CachedAttentionSplitArgs {
            q: q.ptr,
            k_cache: k.ptr,
            v_cache: v.ptr,
            rows: rows.ptr,
            start: start.ptr,
            partials: part.ptr,
            o: o.ptr,
            seq: n.t as i64,
            n: n.n as i64,
            s: n.s as i64,
            q_heads: n.hq as i32,
            kv_heads: n.hkv as i32,
            head_size: n.d as i32,
            splits: n.splits as i64,
            chunk: n.chunk() as i64,
            scale: self.scale,
            pitch: pitch as i32,
            window: self.scores.window.min(i32::MAX as usize) as i32,
            softcap: self.scores.softcap,
        }
        .args();
        let grid = (rows_bt as u32, n.splits as u32, head_blocks as u32);
        let split = format!("cached_attention_split_h{heads}_v{vw}_e{e}_s{stages}_{sfx}");
        let mut launches = vec![Launch::Kernel(KernelLaunch {
            module: MODULE,
            function: split,
            grid,
            block: (CA_THREADS, 1, 1),
            shared_bytes: split_staged_bytes(dt, pitch, stages) as u32,
            args: split_args,
        })];
        // With D = 0 the output is empty and the partials hold (m, l) only;
        // with one split the split pass writes o itself.
        if n.d > 0 && n.splits > 1 {
            let query_rows = rows_bt * n.hq;
            let warps = (CA_THREADS / 32) as usize;
            let combine_args = CachedAttentionCombineArgs {
                partials: part.ptr,
                o: o.ptr,
                rows: query_rows as i64,
                head_size: n.d as i32,
                splits: n.splits as i64,
            }
            .args();
            launches.push(typed_kernel(
                MODULE,
                "cached_attention_combine",
                dt,
                row_grid(query_rows.div_ceil(warps), MAX_ROW_BLOCKS),
                (CA_THREADS, 1, 1),
                combine_args,
            ));
        }
        Ok(launches)
    }
}

impl Lower for SampleNext {
    const KERNELS: &'static [KernelModule] = DECODE;

    fn lower(&self, cx: &LowerCx) -> Result<Vec<Launch>> {
        let [logits, sampling, seeds, _tokens, start] = cx.inputs else {
            return Err(CudaError::lower(self.name(), "expects logits, sampling, seeds, tokens, start"));
        };
        let (next, start_out) = (&cx.outputs[0], &cx.outputs[1]);
        let (b, v) = (logits.ty.shape[0], logits.ty.shape[1]);
        float_name(self.name(), logits.ty.dtype)?;
        let advance = i64::try_from(self.advance)
            .map_err(|_| CudaError::lower(self.name(), format!("advance {} does not fit i64", self.advance)))?;
        // The tokens input is not read: its only role is to be overwritten by `next`.
        let args = SampleNextArgs {
            logits: logits.ptr,
            sampling: sampling.ptr,
            seeds: seeds.ptr,
            start_in: start.ptr,
            next: next.ptr,
            start_out: start_out.ptr,
            batch: b as i64,
            vocab: v as i64,
            advance,
        }
        .args();
        Ok(vec![typed_kernel(
            MODULE,
            "sample_next",
            logits.ty.dtype,
            row_grid(b, MAX_ROW_BLOCKS),
            (SN_THREADS, 1, 1),
            args,
        )])
    }
}

#[cfg(test)]
mod tests {
    use stepgraph_core::ops::attention::Scores;
    use stepgraph_core::ops::Op;

    use super::super::testing::{kernels, lowered, operands_of, t};
    use super::*;
    use crate::launch::DevTensor;
    use crate::ops::{lower, lower_for, Target};
    use crate::switches::Switches;

    /// A decode step's inputs: one new token per row, a cache of `s` positions per row.
    fn attention(dt: DType, b: usize, hq: usize, hkv: usize, d: usize, s: usize) -> Vec<TensorType> {
        vec![
            t(dt, &[b, 1, hq, d]),
            t(dt, &[b, s, hkv, d]),
            t(dt, &[b, s, hkv, d]),
            t(DType::I32, &[b]),
            t(DType::I32, &[b]),
        ]
    }

    #[test]
    fn load_widths_fit_the_lanes_and_the_alignment() {
        // W6: D = 100 in bf16 reads 8-byte loads (4 elements), 25 lanes busy.
        assert_eq!(load_width(DType::BF16, 100, 256), (4, 4));
        assert_eq!(load_width(DType::BF16, 128, 256), (4, 4));
        assert_eq!(load_width(DType::BF16, 256, 256), (8, 8));
        assert_eq!(load_width(DType::F32, 100, 256), (4, 4));
        assert_eq!(load_width(DType::F64, 100, 256), (2, 4));
        assert_eq!(load_width(DType::F32, 255, 256), (1, 8));
        // Skewed caches fall back to narrower loads.
        assert_eq!(load_width(DType::BF16, 128, 4), (2, 4));
        assert_eq!(load_width(DType::BF16, 128, 2), (1, 4));
        for dt in [DType::F32, DType::BF16, DType::F16, DType::F64] {
            for d in 0..=MAX_HEAD_SIZE {
                for align in [1u64, 2, 4, 8, 16, 256] {
                    let (vw, e) = load_width(dt, d, align);
                    assert!(vw <= e && d % vw == 0 && (d / vw).div_ceil(32) * vw <= e, "{dt} {d} {align}");
                    assert!(vw == 1 || align.is_multiple_of((vw * dt.size()) as u64), "{dt} {d} {align}");
                }
            }
        }
    }

    #[test]
    fn staging_pitches_spread_banks_and_rings_fit() {
        // W6: rows of 50 words read 2 at a time (25 loads, odd): no padding.
        assert_eq!(staging(DType::BF16, 1, 100, 4), (2, 100));
        // Rows of 128 bf16 in 16-byte loads: 16 loads (even), padded by one load.
        assert_eq!(staging(DType::BF16, 8, 128, 8), (2, 136));
        assert_eq!(staging(DType::BF16, 8, 128, 4), (2, 132));
        // 2-byte loads cannot be copied by cp.async; f32 rows of 128 overflow.
        assert_eq!(staging(DType::BF16, 1, 101, 1), (0, 0));
        assert_eq!(staging(DType::F32, 1, 128, 4), (0, 0));
        assert_eq!(staging(DType::F32, 8, 0, 1), (0, 0));
        for dt in [DType::F32, DType::BF16, DType::F16, DType::F64] {
            for heads in [1, heads_per_block(dt, 2)] {
                for d in 0..=MAX_HEAD_SIZE {
                    for align in [2u64, 4, 8, 16, 256] {
                        let (vw, _) = load_width(dt, d, align.max(dt.size() as u64));
                        let (stages, pitch) = staging(dt, heads, d, vw);
                        if stages == 0 {
                            continue;
                        }
                        let (load_words, pitch_words) = (vw * dt.size() / 4, pitch * dt.size() / 4);
                        assert!(pitch >= d && pitch % vw == 0, "{dt} {d} {vw}: pitch {pitch}");
                        assert_eq!(pitch_words % load_words, 0);
                        assert_eq!((pitch_words / load_words) % 2, 1, "{dt} {d} {vw}: pitch {pitch}");
                        let shared = split_staged_bytes(dt, pitch, stages) + split_static_shared(dt, heads);
                        assert!(shared <= MAX_BLOCK_SHARED, "{dt} {d}: {shared}");
                    }
                }
            }
        }
    }

    #[test]
    fn cached_attention_grids_cover_rows_splits_and_head_groups() {
        // W6-like: 32 heads of 100 in bf16, batch 4, 8 splits.
        let op = Op::from(CachedAttention { scale: 0.1, splits: 8, scores: Default::default() });
        let (_, outs, l) = lowered(&op, &attention(DType::BF16, 4, 32, 32, 100, 2048));
        let ks = kernels(&l);
        assert_eq!(ks.len(), 2);
        assert_eq!(ks[0].function, "cached_attention_split_h1_v4_e4_s0_bf16");
        assert_eq!((ks[0].grid, ks[0].block), ((4, 8, 32), (128, 1, 1)));
        let split = CachedAttentionSplitArgs::from_args(&ks[0].args);
        assert_eq!((ks[0].shared_bytes, split.pitch), (0, 0), "read in place: no ring");
        // Staged: four warps' rings of two slots of 32 key and 32 value rows of 100.
        let staged = Target { switches: Switches { decode_staging: true, ..Switches::default() }, ..Target::default() };
        let (ins, outs_s) = operands_of(&op, &attention(DType::BF16, 4, 32, 32, 100, 2048), 0).unwrap();
        let l_s = lower_for(&op, &ins, &outs_s, None, staged).unwrap();
        let k_s = kernels(&l_s)[0];
        assert_eq!(k_s.function, "cached_attention_split_h1_v4_e4_s2_bf16");
        assert_eq!((k_s.grid, k_s.shared_bytes), ((4, 8, 32), 4 * 2 * 64 * 100 * 2));
        assert_eq!(CachedAttentionSplitArgs::from_args(&k_s.args).pitch, 100);
        // Plain attention: no window, no soft-cap.
        assert_eq!((split.window, split.softcap), (0, 0.0));
        let windowed =
            Op::from(CachedAttention { scale: 0.1, splits: 8, scores: Scores { window: 4096, softcap: 50.0 } });
        let (_, _, l_w) = lowered(&windowed, &attention(DType::BF16, 4, 32, 32, 100, 2048));
        let k_w = kernels(&l_w)[0];
        let split_w = CachedAttentionSplitArgs::from_args(&k_w.args);
        assert_eq!(split_w, CachedAttentionSplitArgs { window: 4096, softcap: 50.0, ..split.clone() });
        assert_eq!((split.partials, split.o), (outs[1].ptr, outs[0].ptr));
        assert_eq!(split.chunk, 256, "chunk = ceil(2048 / 8)");
        assert_eq!(ks[1].function, "cached_attention_combine_bf16");
        assert_eq!(ks[1].grid, (32, 1, 1), "4 × 32 query rows, 4 per block");
        let combine = CachedAttentionCombineArgs::from_args(&ks[1].args);
        assert_eq!((combine.partials, combine.o), (outs[1].ptr, outs[0].ptr));
        // One split: the split pass writes o itself, no combine.
        let op1 = Op::from(CachedAttention { scale: 0.1, splits: 1, scores: Default::default() });
        let (_, _, l) = lowered(&op1, &attention(DType::BF16, 16, 32, 32, 100, 768));
        assert_eq!(
            kernels(&l).iter().map(|k| k.function.as_str()).collect::<Vec<_>>(),
            ["cached_attention_split_h1_v4_e4_s0_bf16"]
        );
        // 28 query heads on 4 kv heads: groups of 7 fit one block; in f64, two.
        let op = Op::from(CachedAttention { scale: 0.1, splits: 4, scores: Default::default() });
        let (_, _, l) = lowered(&op, &attention(DType::F16, 2, 28, 4, 128, 1024));
        assert_eq!(kernels(&l)[0].grid, (2, 4, 4));
        let (_, _, l) = lowered(&op, &attention(DType::F64, 2, 28, 4, 128, 1024));
        assert_eq!(kernels(&l)[0].grid, (2, 4, 8));
        // Staged or not, f64 rows of 128 would need a 520 KiB ring: read in place.
        assert_eq!(kernels(&l)[0].function, "cached_attention_split_h4_v2_e4_s0_f64");
        let (ins, outs) = operands_of(&op, &attention(DType::F64, 2, 28, 4, 128, 1024), 0).unwrap();
        let l = lower_for(&op, &ins, &outs, None, staged).unwrap();
        assert_eq!(
            (kernels(&l)[0].function.as_str(), kernels(&l)[0].shared_bytes),
            ("cached_attention_split_h4_v2_e4_s0_f64", 0)
        );
        // A head above the kernels' 256 is refused.
        let (ins, outs) = operands_of(&op, &attention(DType::F32, 1, 2, 2, 260, 8), 0).unwrap();
        let e = lower(&op, &ins, &outs, None).unwrap_err();
        assert!(e.to_string().contains("head size 260"), "{e}");
    }

    #[test]
    fn kv_write_copies_the_cache_only_out_of_place() {
        let types =
            [t(DType::BF16, &[2, 8, 2, 4]), t(DType::BF16, &[1, 5, 2, 4]), t(DType::I32, &[1]), t(DType::I32, &[1])];
        let op = Op::from(KvWrite::default());
        let (ins, outs, l) = lowered(&op, &types);
        assert_eq!(l[0], Launch::Copy { dst: outs[0].ptr, src: ins[0].ptr, bytes: 2 * 8 * 2 * 4 * 2 });
        let k = kernels(&l[1..])[0];
        // Rows of 16 bytes: one u128 unit each, one block per new row.
        assert_eq!((k.function.as_str(), k.grid, k.block), ("kv_write_u128", (5, 1, 1), (32, 1, 1)));
        // In place: the kernel alone, writing the cache itself.
        let aliased = [DevTensor { ty: types[0].clone(), ptr: ins[0].ptr }];
        let l = lower(&op, &ins, &aliased, None).unwrap();
        assert_eq!(l.len(), 1);
        assert_eq!(KvWriteArgs::from_args(&kernels(&l)[0].args).cache, ins[0].ptr);
    }

    #[test]
    fn sample_next_lowers_the_same_in_place_and_not() {
        let types = [
            t(DType::BF16, &[3, 152064]),
            t(DType::F32, &[3, 3]),
            t(DType::I64, &[3]),
            t(DType::I32, &[3]),
            t(DType::I32, &[3]),
        ];
        let op = Op::from(SampleNext { advance: 1 });
        let (ins, outs, l) = lowered(&op, &types);
        let k = kernels(&l)[0];
        assert_eq!((k.function.as_str(), k.grid, k.block), ("sample_next_bf16", (3, 1, 1), (1024, 1, 1)));
        let a = SampleNextArgs::from_args(&k.args);
        assert_eq!((a.next, a.start_out), (outs[0].ptr, outs[1].ptr));
        assert_eq!((a.batch, a.vocab, a.advance), (3, 152064, 1));
        // Aliased as planned in place: next over tokens, start over start.
        let aliased = [
            DevTensor { ty: ins[3].ty.clone(), ptr: ins[3].ptr },
            DevTensor { ty: ins[4].ty.clone(), ptr: ins[4].ptr },
        ];
        let l = lower(&op, &ins, &aliased, None).unwrap();
        let k = kernels(&l)[0];
        let a = SampleNextArgs::from_args(&k.args);
        assert_eq!((a.start_in, a.next, a.start_out), (ins[4].ptr, ins[3].ptr, ins[4].ptr));
    }
}
