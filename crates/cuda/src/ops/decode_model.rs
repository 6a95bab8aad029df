//! A host model of the generation kernels of `kernels/decode.cu`: the
//! launches of the `kv_write`, `cached_attention` and `sample_next`
//! lowerings, run by sequential emulations that follow each kernel's
//! structure (its grid and index arithmetic, the split block's warps and
//! key tiles, the sampler's threshold search and candidate compaction) over
//! host buffers at fake addresses, must reproduce the CPU reference: the
//! cache bit for bit, the tokens and positions exactly, and the attention
//! (computed here in f64) within rounding. Addresses skewed off 16 bytes
//! change the copy units and load widths; the model asserts that every wide
//! load it emulates has the alignment the kernel's load needs.

use half::{bf16, f16};
use stepgraph_core::host::HostTensor;
use stepgraph_core::ir::{DType, TensorType};
use stepgraph_core::ops::attention::Scores;
use stepgraph_core::ops::decode::{gumbel_uniform, CachedAttention, KvWrite, SampleNext};
use stepgraph_core::ops::sample::{fixed, normal, Sample, FLOAT_DTYPES};
use stepgraph_core::ops::{samples_by_op, Op};
use stepgraph_core::testing::{draw_input, draw_sample, run_op};

use super::decode::{CachedAttentionCombineArgs, CachedAttentionSplitArgs, KvWrite2Args, KvWriteArgs, SampleNextArgs};
use super::host_model::Mem;
use super::util::UNITS;
use super::{lower_for, Target};
use crate::launch::{DevTensor, KernelLaunch, Launch};

/// Constants of decode.cu the model mirrors.
const SN_CANDIDATES: usize = 1536;
const SN_PIVOTS: u64 = 3;
const CA_WARPS: i64 = super::decode::CA_WARPS as i64;

/// Staged split launches the model has run (the attention test checks
/// that its staged lowering really staged some).
static STAGED_BLOCKS_MODELLED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// The raw bits of element `i` of a `dt` tensor at `base`.
fn bits(mem: &mut Mem, dt: DType, base: u64, i: i64) -> u64 {
    let size = dt.size();
    let b = mem.at(base + i as u64 * size as u64, size);
    let mut w = [0u8; 8];
    w[..size].copy_from_slice(b);
    u64::from_le_bytes(w)
}

/// The value of bits `b` of `dt`.
fn value(dt: DType, b: u64) -> f64 {
    match dt {
        DType::F32 => f32::from_bits(b as u32) as f64,
        DType::F64 => f64::from_bits(b),
        DType::BF16 => bf16::from_bits(b as u16).to_f64(),
        DType::F16 => f16::from_bits(b as u16).to_f64(),
        DType::I32 => b as u32 as i32 as f64,
        DType::I64 => b as i64 as f64,
        d => panic!("no model of {d} values"),
    }
}

fn load(mem: &mut Mem, dt: DType, base: u64, i: i64) -> f64 {
    value(dt, bits(mem, dt, base, i))
}

/// Stores `v` as `dt`, through f32 for the narrow types as the kernels do.
fn store(mem: &mut Mem, dt: DType, base: u64, i: i64, v: f64) {
    let bytes = match dt {
        DType::F32 => (v as f32).to_le_bytes().to_vec(),
        DType::F64 => v.to_le_bytes().to_vec(),
        DType::BF16 => bf16::from_f32(v as f32).to_le_bytes().to_vec(),
        DType::F16 => f16::from_f32(v as f32).to_le_bytes().to_vec(),
        DType::I32 => (v as i32).to_le_bytes().to_vec(),
        d => panic!("no model of {d} stores"),
    };
    mem.at(base + i as u64 * dt.size() as u64, bytes.len()).copy_from_slice(&bytes);
}

/// The dtype of a kernel named `..._<dtype>`.
fn dtype_of(f: &str) -> DType {
    match f.rsplit('_').next() {
        Some("f32") => DType::F32,
        Some("f64") => DType::F64,
        Some("bf16") => DType::BF16,
        Some("f16") => DType::F16,
        s => panic!("no dtype suffix in {f} ({s:?})"),
    }
}

fn stat(dt: DType) -> DType {
    if dt == DType::F64 {
        DType::F64
    } else {
        DType::F32
    }
}

fn emulate(k: &KernelLaunch, mem: &mut Mem) {
    let (f, a) = (k.function.as_str(), &k.args);
    if let Some(unit) = f.strip_prefix("kv_write2_") {
        // Two kv_writes, blockIdx.y = 1 (the second) first: blocks of either
        // run in any order, and the merge admits only pairs that touch
        // disjoint bytes.
        assert_eq!(k.grid.1, 2, "one grid row per write");
        let [first, second] = KvWrite2Args::from_args(a).halves();
        for half in [second, first] {
            let one = KernelLaunch {
                function: format!("kv_write_{unit}"),
                grid: (k.grid.0, 1, 1),
                args: half.args(),
                ..k.clone()
            };
            emulate(&one, mem);
        }
    } else if let Some(unit) = f.strip_prefix("kv_write_") {
        let w = UNITS.iter().find(|(_, n)| *n == unit).expect("a copy unit").0 as i64;
        let KvWriteArgs { cache, src, rows, start, last, bt_rows, seq, n, s, row_units } = KvWriteArgs::from_args(a);
        let row = |mem: &mut Mem, b| load(mem, DType::I32, rows, b) as i64;
        let first = |mem: &mut Mem, b| load(mem, DType::I32, start, b) as i64;
        // kv_slot is KvWrite::slot; a null `last` is no ring.
        let rule = KvWrite { ring: last != 0 };
        let slot_of = |mem: &mut Mem, p: i64, b: i64| -> Option<i64> {
            let l = if rule.ring { load(mem, DType::I32, last, b) as i64 } else { 0 };
            rule.slot(p, l, s.max(0) as usize).map(|slot| slot as i64)
        };
        // Blocks run in any order: the model runs them last first, so only
        // the kernel's own rule can make the later batch row win.
        for bt in (0..bt_rows).rev() {
            let (b, t) = (bt / seq, bt % seq);
            let (r, p) = (row(mem, b), first(mem, b) + t);
            let Some(slot) = slot_of(mem, p, b) else { continue };
            if !(0..n).contains(&r) {
                continue;
            }
            // kv_writes_slot, by trying every row of the later batch rows.
            let later = (b + 1..bt_rows / seq).any(|b2| {
                let start2 = first(mem, b2);
                row(mem, b2) == r && (0..seq).any(|t2| slot_of(mem, start2 + t2, b2) == Some(slot))
            });
            if !later {
                let bytes = row_units * w;
                mem.copy(
                    (cache as i64 + (r * s + slot) * bytes) as u64,
                    (src as i64 + bt * bytes) as u64,
                    bytes as usize,
                );
            }
        }
    } else if let Some(rest) = f.strip_prefix("cached_attention_split_") {
        // `h<H>_v<VW>_e<E>_s<ST>_<dtype>`
        let n: Vec<i64> = rest.split('_').take(4).map(|p| p[1..].parse().unwrap()).collect();
        split_model(k, mem, dtype_of(f), n[0], n[1], n[2], n[3]);
    } else if f.starts_with("cached_attention_combine_") {
        let dt = dtype_of(f);
        let c = CachedAttentionCombineArgs::from_args(a);
        let (part, o, rows, d, splits) = (c.partials, c.o, c.rows, c.head_size as i64, c.splits);
        let width = d + 2;
        for r in 0..rows {
            let at = |sp: i64, c: i64| (r * splits + sp) * width + c;
            let big_m = (0..splits).map(|sp| load(mem, stat(dt), part, at(sp, 0))).fold(super_empty(dt), f64::max);
            let (mut total, mut acc) = (0.0, vec![0.0; d as usize]);
            for sp in 0..splits {
                let w = (load(mem, stat(dt), part, at(sp, 0)) - big_m).exp();
                total += load(mem, stat(dt), part, at(sp, 1)) * w;
                for (dd, x) in acc.iter_mut().enumerate() {
                    *x += w * load(mem, stat(dt), part, at(sp, 2 + dd as i64));
                }
            }
            for (dd, x) in acc.iter().enumerate() {
                store(mem, dt, o, r * d + dd as i64, if total > 0.0 { x / total } else { 0.0 });
            }
        }
    } else if f.starts_with("sample_next_") {
        sample_model(k, mem, dtype_of(f));
    } else {
        panic!("no model of `{f}`");
    }
}

/// EMPTY_MAX as the stat dtype holds it.
fn super_empty(dt: DType) -> f64 {
    let e = stepgraph_core::ops::decode::EMPTY_MAX;
    if dt == DType::F64 {
        e
    } else {
        e as f32 as f64
    }
}

/// One warp's ring in the staged split pass (decode.cu's `stage`,
/// `stage_rows` and `cp_wait`): `stages` slots of 32 key rows then 32 value
/// rows, `pitch` elements apart, filled by groups of copies that land only
/// when a wait retires them. The ring starts poisoned (NaN), so a row the
/// kernel reads before its group is waited for, or one no lane copies,
/// shows in the result.
struct WarpRing {
    stages: i64,
    pitch: i64,
    vw: i64,
    packs: i64,
    slots: Vec<f64>,
    /// Committed groups not yet retired, oldest first: (ring index, value) per element.
    pending: std::collections::VecDeque<Vec<(usize, f64)>>,
}

impl WarpRing {
    fn new(stages: i64, pitch: i64, vw: i64, packs: i64) -> Self {
        let slots = vec![f64::NAN; (stages * 64 * pitch) as usize];
        WarpRing { stages, pitch, vw, packs, slots, pending: Default::default() }
    }

    /// `stage_rows`: lane u copies packs u, u + 32, ... of rows
    /// `[0, n_keys)` (row r at element `at + r·stride` of `src`) into the
    /// ring at `base`, stepping (row, pack) as the kernel does; one group.
    #[allow(clippy::too_many_arguments)]
    fn stage_rows(&mut self, mem: &mut Mem, dt: DType, src: u64, at: i64, stride: i64, n_keys: i64, base: i64) {
        let (packs, vw, pitch) = (self.packs, self.vw, self.pitch);
        let size = dt.size() as u64;
        let mut group = Vec::new();
        let mut copied = vec![0u8; (n_keys.max(0) * packs) as usize];
        for lane in 0..32 {
            let (mut r, mut pk) = (lane / packs, lane % packs);
            let (step_rows, step_packs) = (32 / packs, 32 - (32 / packs) * packs);
            while r < n_keys {
                let (from, to) = (at + r * stride + pk * vw, base + r * pitch + pk * vw);
                let addr = src + from as u64 * size;
                assert!(addr.is_multiple_of(vw as u64 * size), "a {vw}-element cp.async from {addr:#x} is misaligned");
                assert!(
                    to % vw == 0 && pk * vw + vw <= pitch,
                    "a copy to ring element {to} leaves its row or alignment"
                );
                copied[(r * packs + pk) as usize] += 1;
                for e in 0..vw {
                    group.push(((to + e) as usize, load(mem, dt, src, from + e)));
                }
                r += step_rows;
                pk += step_packs;
                if pk >= packs {
                    pk -= packs;
                    r += 1;
                }
            }
        }
        assert!(copied.iter().all(|&c| c == 1), "every pack of the tile's rows copied exactly once");
        self.pending.push_back(group);
    }

    /// `stage(i)`: tile i's keys and values (none past the split: two empty groups).
    #[allow(clippy::too_many_arguments)]
    fn stage(
        &mut self,
        mem: &mut Mem,
        dt: DType,
        kc: u64,
        vc: u64,
        i: i64,
        first: i64,
        hi: i64,
        head_at: i64,
        stride: i64,
    ) {
        let j0 = first + i * CA_WARPS * 32;
        let n_keys = if j0 < hi { (hi - j0).min(32) } else { 0 };
        let slot = (i % self.stages) * 64 * self.pitch;
        self.stage_rows(mem, dt, kc, head_at + j0 * stride, stride, n_keys, slot);
        self.stage_rows(mem, dt, vc, head_at + j0 * stride, stride, n_keys, slot + 32 * self.pitch);
    }

    /// `cp_wait<n>`: retires the oldest groups until at most `n` are in flight.
    fn wait(&mut self, n: usize) {
        while self.pending.len() > n {
            for (at, v) in self.pending.pop_front().expect("a pending group") {
                self.slots[at] = v;
            }
        }
    }

    /// Rows `[0, n)` of tile i's keys (or values), `d` elements each, as the ring holds them now.
    fn rows(&self, i: i64, values: bool, n: i64, d: i64) -> Vec<Vec<f64>> {
        let base = (i % self.stages) * 64 * self.pitch + if values { 32 * self.pitch } else { 0 };
        (0..n).map(|r| (0..d).map(|dd| self.slots[(base + r * self.pitch + dd) as usize]).collect()).collect()
    }
}

/// `cached_attention_split`: every block of the grid, its warps taking
/// 32-key tiles in turn (through their rings when staged) from the later of
/// the split's start and the sliding window's, then combined in warp order.
fn split_model(k: &KernelLaunch, mem: &mut Mem, dt: DType, heads: i64, vw: i64, e: i64, stages: i64) {
    let a = CachedAttentionSplitArgs::from_args(&k.args);
    let (q, kc, vc, rows, start, part, o) = (a.q, a.k_cache, a.v_cache, a.rows, a.start, a.partials, a.o);
    let (seq, n_rows, cache_len) = (a.seq, a.n, a.s);
    let (hq, hkv, d) = (a.q_heads as i64, a.kv_heads as i64, a.head_size as i64);
    let (splits, chunk, scale) = (a.splits, a.chunk, a.scale);
    let (window, softcap) = (a.window as i64, a.softcap);
    let cap = |s: f64| if softcap > 0.0 { softcap * (s / softcap).tanh() } else { s };
    let (group, packs, stride) = (hq / hkv, d / vw, hkv * d);
    let tiles = (group + heads - 1) / heads;
    assert_eq!(k.grid.2 as i64, hkv * tiles, "grid z: kv heads × head tiles");
    assert!(d % vw == 0 && (packs + 31) / 32 * vw <= e, "VW {vw} and E {e} for D {d}");
    let size = dt.size() as u64;
    // Staged, each warp's ring of `stages` slots of 32 key and 32 value rows
    // `pitch` apart is the block's dynamic shared memory, and every pack
    // lands aligned for its cp.async (4, 8 or 16 bytes).
    let pitch = a.pitch as i64;
    if stages > 0 {
        STAGED_BLOCKS_MODELLED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        assert_eq!(k.shared_bytes as i64, CA_WARPS * stages * 64 * pitch * size as i64, "ring bytes");
        assert!(pitch >= d && pitch % vw == 0, "pitch {pitch} for D {d} and VW {vw}");
        assert!([4, 8, 16].contains(&(vw * size as i64)), "cp.async copies 4, 8 or 16 bytes, not {}", vw * size as i64);
    } else {
        assert_eq!(k.shared_bytes, 0);
    }
    // A load of VW elements at element `i` of `base` is aligned as the kernel's Chunk.
    let check = |base: u64, i: i64| {
        let addr = base + i as u64 * size;
        assert!(addr.is_multiple_of(vw as u64 * size), "a {vw}-element load at {addr:#x} is misaligned");
    };
    let empty = super_empty(dt);
    for z in 0..k.grid.2 as i64 {
        for sp in 0..k.grid.1 as i64 {
            for bt in 0..k.grid.0 as i64 {
                let (g, tile) = (z / tiles, z % tiles);
                let (h0, nh) = (g * group + tile * heads, heads.min(group - tile * heads));
                let (b, t) = (bt / seq, bt % seq);
                let row = load(mem, DType::I32, rows, b) as i64;
                let pos = load(mem, DType::I32, start, b) as i64 + t;
                let last = if (0..n_rows).contains(&row) && pos >= 0 { pos.min(cache_len - 1) + 1 } else { 0 };
                let lo = if window > 0 { (sp * chunk).max(pos + 1 - window) } else { sp * chunk };
                let hi = ((sp + 1) * chunk).min(last);
                let head_at = if lo < hi { row * cache_len * stride } else { 0 } + g * d;
                let qs: Vec<Vec<f64>> = (0..nh)
                    .map(|hh| (0..d).map(|dd| load(mem, dt, q, (bt * hq + h0 + hh) * d + dd)).collect())
                    .collect();
                // Per warp and head: (m, l, acc).
                let mut state = vec![vec![(empty, 0.0, vec![0.0; d as usize]); nh as usize]; CA_WARPS as usize];
                for (w, st) in state.iter_mut().enumerate() {
                    let first = lo + w as i64 * 32;
                    let mut j0 = first;
                    let mut ring = (stages > 0).then(|| WarpRing::new(stages, pitch, vw, packs));
                    if let Some(ring) = &mut ring {
                        for i in 0..stages - 1 {
                            ring.stage(mem, dt, kc, vc, i, first, hi, head_at, stride);
                        }
                    }
                    let mut tile_i = 0;
                    while j0 < hi {
                        let keys: Vec<i64> = (j0..(j0 + 32).min(hi)).collect();
                        let n_keys = keys.len() as i64;
                        let (krows, vrows) = match &mut ring {
                            Some(ring) => {
                                ring.stage(mem, dt, kc, vc, tile_i + stages - 1, first, hi, head_at, stride);
                                ring.wait(2 * stages as usize - 1);
                                let krows = ring.rows(tile_i, false, n_keys, d);
                                ring.wait(2 * stages as usize - 2);
                                (krows, ring.rows(tile_i, true, n_keys, d))
                            }
                            None => {
                                let mut krows = Vec::new();
                                let mut vrows = Vec::new();
                                for &j in &keys {
                                    let at = head_at + j * stride;
                                    for pk in 0..packs {
                                        check(kc, at + pk * vw);
                                        check(vc, at + pk * vw);
                                    }
                                    krows.push((0..d).map(|dd| load(mem, dt, kc, at + dd)).collect::<Vec<_>>());
                                    vrows.push((0..d).map(|dd| load(mem, dt, vc, at + dd)).collect::<Vec<_>>());
                                }
                                (krows, vrows)
                            }
                        };
                        tile_i += 1;
                        for (hh, (m, l, acc)) in st.iter_mut().enumerate() {
                            let s: Vec<f64> = krows
                                .iter()
                                .map(|kr| cap(scale * kr.iter().zip(&qs[hh]).map(|(x, y)| x * y).sum::<f64>()))
                                .collect();
                            let m_new = s.iter().copied().fold(*m, f64::max);
                            let rescale = (*m - m_new).exp();
                            let p: Vec<f64> = s.iter().map(|x| (x - m_new).exp()).collect();
                            *l = *l * rescale + p.iter().sum::<f64>();
                            for x in acc.iter_mut() {
                                *x *= rescale;
                            }
                            for (pj, vr) in p.iter().zip(&vrows) {
                                for (x, v) in acc.iter_mut().zip(vr) {
                                    *x += pj * v;
                                }
                            }
                            *m = m_new;
                        }
                        j0 += CA_WARPS * 32;
                    }
                    if let Some(ring) = &mut ring {
                        ring.wait(0);
                    }
                }
                let width = d + 2;
                for hh in 0..nh as usize {
                    let big_m = state.iter().map(|s| s[hh].0).fold(empty, f64::max);
                    let f: Vec<f64> = state.iter().map(|s| (s[hh].0 - big_m).exp()).collect();
                    let at = ((bt * hq + h0 + hh as i64) * splits + sp) * width;
                    store(mem, stat(dt), part, at, big_m);
                    let l: f64 = state.iter().zip(&f).map(|(s, f)| s[hh].1 * f).sum();
                    store(mem, stat(dt), part, at + 1, l);
                    for dd in 0..d as usize {
                        let v: f64 = state.iter().zip(&f).map(|(s, f)| s[hh].2[dd] * f).sum();
                        store(mem, stat(dt), part, at + 2 + dd as i64, v);
                        // One split: o = acc / l here, no combine pass.
                        if splits == 1 {
                            let out = if l > 0.0 { v / l } else { 0.0 };
                            store(mem, dt, o, (bt * hq + h0 + hh as i64) * d + dd as i64, out);
                        }
                    }
                }
            }
        }
    }
}

/// decode.cu's `KeyBits`: NaN becomes −inf, −0 becomes +0, then an
/// unsigned order that is the numeric one.
fn order_key(dt: DType, raw: u64) -> u64 {
    let (width, inf) = match dt {
        DType::F32 => (32, 0x7f80_0000u64),
        DType::BF16 => (16, 0x7f80),
        DType::F16 => (16, 0x7c00),
        DType::F64 => (64, 0x7ff0_0000_0000_0000),
        d => panic!("no keys of {d}"),
    };
    let sign = 1u64 << (width - 1);
    let mask = !0u64 >> (64 - width);
    let mut u = raw;
    if u & !sign > inf {
        u = sign | inf;
    }
    if u == sign {
        u = 0;
    }
    if u & sign != 0 {
        !u & mask
    } else {
        u | sign
    }
}

fn key_value(dt: DType, k: u64) -> f64 {
    let width = if dt.size() == 2 { 16 } else { 8 * dt.size() as u32 };
    let sign = 1u64 << (width - 1);
    let mask = !0u64 >> (64 - width);
    value(dt, if k & sign != 0 { k & !sign } else { !k & mask })
}

/// A token the sampler walks: its key, z and index.
#[derive(Clone, Copy)]
struct Tok {
    key: u64,
    z: f64,
    index: usize,
}

/// `sn_search`: the largest key K in [lo, hi) with `above + Σ_{K ≤ key < hi} w ≥ need`.
fn search(src: &[Tok], mut lo: u64, mut hi: u64, mut above: f64, need: f64, weight: impl Fn(&Tok) -> f64) -> u64 {
    while hi - lo > 1 {
        let span = hi - lo;
        let n = (span - 1).min(SN_PIVOTS);
        let (part, rem) = (span / (n + 1), span % (n + 1));
        let piv: Vec<u64> = (1..=SN_PIVOTS).map(|j| if j <= n { lo + j * part + j.min(rem) } else { hi }).collect();
        let mut sums = [0.0; SN_PIVOTS as usize + 1];
        for e in src {
            if e.key <= lo || e.key >= hi {
                continue;
            }
            sums[SN_PIVOTS as usize] += 1.0;
            if e.key < piv[0] {
                continue;
            }
            let w = weight(e);
            for j in 0..SN_PIVOTS as usize {
                if e.key >= piv[j] {
                    sums[j] += w;
                }
            }
        }
        if sums[SN_PIVOTS as usize] == 0.0 {
            break;
        }
        let mut a = 0;
        while a < n as usize && above + sums[a] >= need {
            a += 1;
        }
        let new_lo = if a > 0 { piv[a - 1] } else { lo };
        if a < n as usize {
            hi = piv[a];
            above += sums[a];
        }
        lo = new_lo;
    }
    lo
}

/// `sample_rows` for one row: greedy, or the top-k search, the candidate
/// compaction, the top-p search and the Gumbel-max draw.
fn sample_row_model(toks: &[Tok], dt: DType, t: f64, top_k: f64, top_p: f64, seed: u64, position: u32) -> usize {
    let kmin = toks.iter().map(|e| e.key).min().unwrap();
    let kmax = toks.iter().map(|e| e.key).max().unwrap();
    let greedy = toks.iter().find(|e| e.key == kmax).unwrap().index;
    // Greedy for temperature ≤ 0 or NaN, as `sample_row`.
    if t <= 0.0 || t.is_nan() {
        return greedy;
    }
    let z = |k: u64| key_value(dt, k) / t;
    let mut thr = f64::NEG_INFINITY;
    let top_k_on = top_k >= 1.0 && top_k < toks.len() as f64;
    if top_k_on {
        thr = z(search(toks, kmin, kmax + 1, 0.0, (top_k as i64) as f64, |_| 1.0));
    }
    let cand: Option<Vec<Tok>> = top_k_on.then(|| toks.iter().copied().filter(|e| e.z >= thr).collect());
    let src = match &cand {
        Some(c) if c.len() <= SN_CANDIDATES => &c[..],
        _ => toks,
    };
    if top_p > 0.0 && top_p < 1.0 {
        let zmax = z(kmax);
        let kept: Vec<&Tok> = src.iter().filter(|e| e.z >= thr).collect();
        let mass: f64 = kept.iter().map(|e| (e.z - zmax).exp()).sum();
        let kept_lo = kept.iter().map(|e| e.key).min().unwrap_or(!0);
        let need = top_p * mass;
        if mass >= need {
            thr = thr.max(z(search(src, kept_lo, kmax + 1, 0.0, need, |e| (e.z - zmax).exp())));
        }
    }
    let (mut first, mut best) = (None::<(usize, bool)>, None::<(usize, f64)>);
    for e in src {
        if e.z < thr || e.z == f64::NEG_INFINITY {
            continue;
        }
        let score = e.z - (-gumbel_uniform(seed, position, e.index as u32).ln()).ln();
        first.get_or_insert((e.index, score.is_nan()));
        if !score.is_nan() && best.is_none_or(|(_, s)| score > s) {
            best = Some((e.index, score));
        }
    }
    match (first, best) {
        (None, _) => 0,
        (Some((i, true)), _) => i,
        (_, b) => b.unwrap().0,
    }
}

fn sample_model(k: &KernelLaunch, mem: &mut Mem, dt: DType) {
    let SampleNextArgs { logits, sampling, seeds, start_in, next, start_out, batch, vocab, advance } =
        SampleNextArgs::from_args(&k.args);
    for r in 0..batch {
        let toks: Vec<Tok> = (0..vocab)
            .map(|i| {
                let key = order_key(dt, bits(mem, dt, logits, r * vocab + i));
                Tok { key, z: 0.0, index: i as usize }
            })
            .collect();
        let s: Vec<f64> = (0..3).map(|c| load(mem, DType::F32, sampling, r * 3 + c)).collect();
        let toks: Vec<Tok> = toks.into_iter().map(|e| Tok { z: key_value(dt, e.key) / s[0], ..e }).collect();
        let seed = bits(mem, DType::I64, seeds, r);
        let st = load(mem, DType::I32, start_in, r) as i64;
        let position = (st + advance).clamp(0, u32::MAX as i64) as u32;
        let chosen = sample_row_model(&toks, dt, s[0], s[1], s[2], seed, position);
        store(mem, DType::I32, next, r, chosen as f64);
        store(mem, DType::I32, start_out, r, (st as i32).wrapping_add(advance as i32) as f64);
    }
}

/// Operands at consecutive 256-byte-aligned addresses from `base`, each
/// shifted by `skew` bytes.
fn place(types: &[TensorType], base: u64, skew: u64) -> Vec<DevTensor> {
    let mut at = base;
    types
        .iter()
        .map(|ty| {
            let t = DevTensor { ty: ty.clone(), ptr: at + skew };
            at = (at + ty.bytes() + 512).next_multiple_of(256);
            t
        })
        .collect()
}

/// Lowers `op` at addresses skewed by `skew` (with its in-place pairs
/// sharing storage when `aliased`), runs the launches on the model and
/// returns the outputs; `None` when the skew leaves an operand unaligned.
fn run(op: &Op, inputs: &[HostTensor], skew: u64, aliased: bool, target: Target) -> Option<Vec<HostTensor>> {
    let types: Vec<TensorType> = inputs.iter().map(|t| t.ty.clone()).collect();
    let refs: Vec<&TensorType> = types.iter().collect();
    let out_types = op.infer(&refs).unwrap();
    let ins = place(&types, 1 << 40, skew);
    let mut mem = Mem(ins.iter().zip(inputs).map(|(d, t)| (d.ptr, t.bytes().to_vec())).collect());
    let outs = if aliased {
        let pairs = op.inplace();
        (0..out_types.len())
            .map(|o| ins[pairs.iter().find(|p| p.0 == o).expect("an in-place pair").1].clone())
            .collect()
    } else {
        let outs = place(&out_types, 1 << 42, skew);
        // Garbage where nothing writes, as the session's poisoned arena.
        mem.0.extend(outs.iter().map(|d| (d.ptr, vec![0xFF; d.ty.bytes() as usize])));
        outs
    };
    let launches = match lower_for(op, &ins, &outs, None, target) {
        Ok(l) => l,
        Err(e) if e.to_string().contains("not element-aligned") => return None,
        Err(e) => panic!("{op:?}: {e}"),
    };
    for l in &launches {
        match l {
            Launch::Copy { dst, src, bytes } => mem.copy(*dst, *src, *bytes as usize),
            Launch::Kernel(k) => emulate(k, &mut mem),
            other => panic!("unexpected {other:?}"),
        }
    }
    Some(
        outs.iter()
            .map(|d| {
                let mut t = HostTensor::zeros(d.ty.clone());
                t.bytes_mut().copy_from_slice(mem.at(d.ptr, d.ty.bytes() as usize));
                t
            })
            .collect(),
    )
}

/// Every float dtype's samples of `variant` (seed 1), plus `extra`.
fn cases(variant: &str, extra: impl Fn(DType) -> Vec<Sample>) -> Vec<(String, Sample, Vec<HostTensor>)> {
    let mut v = Vec::new();
    for dt in FLOAT_DTYPES {
        let samples = samples_by_op(dt).into_iter().find(|(n, _)| *n == variant).unwrap().1;
        for (i, s) in samples.into_iter().chain(extra(dt)).enumerate() {
            let inputs = draw_sample(&s, 1).unwrap();
            v.push((format!("{variant}#{i} {dt}"), s, inputs));
        }
    }
    v
}

#[test]
fn kv_write_and_sample_next_match_the_cpu_exactly_on_the_model() {
    let i32s = |v: &[f64]| fixed(DType::I32, &[v.len()], v);
    // Two batch rows writing one slot (the later wins, as the CPU's loop),
    // and rows of odd byte counts (narrow copy units).
    let kv_extra = |d: DType| {
        vec![
            Sample::new(
                KvWrite::default(),
                vec![
                    normal(d, &[3, 6, 2, 8]),
                    normal(d, &[3, 2, 2, 8]),
                    i32s(&[1.0, 1.0, 2.0]),
                    i32s(&[0.0, 1.0, 5.0]),
                ],
            ),
            Sample::new(
                KvWrite::default(),
                vec![normal(d, &[2, 5, 1, 3]), normal(d, &[2, 2, 1, 3]), i32s(&[0.0, 1.0]), i32s(&[4.0, 0.0])],
            ),
        ]
    };
    let mut all = cases("KvWrite", kv_extra);
    all.extend(cases("SampleNext", sample_extra));
    for (what, s, inputs) in &all {
        let want = run_op(&s.op, inputs).unwrap();
        for skew in [0, 4, 8] {
            for aliased in [false, true] {
                let Some(got) = run(&s.op, inputs, skew, aliased, Target::default()) else { continue };
                for (j, (g, w)) in got.iter().zip(&want).enumerate() {
                    assert!(g.bytes() == w.bytes(), "{what} skew {skew} aliased {aliased}: output {j} differs");
                }
            }
        }
    }
}

/// Sampling beyond the core samples: ties at the thresholds, NaN, ±inf and
/// −0 logits, a fractional top_k, top-k sets too large for the candidate
/// buffer, extreme top_p, NaN and tiny temperatures, positions past i32.
fn sample_extra(d: DType) -> Vec<Sample> {
    let case = |logits: stepgraph_core::ops::sample::Input, sampling: &[f64], start: &[f64], advance: usize| {
        let b = start.len();
        let seeds: Vec<f64> = (0..b).map(|i| (77 + 1_000_003 * i) as f64).collect();
        Sample::new(
            SampleNext { advance },
            vec![
                logits,
                fixed(DType::F32, &[b, 3], sampling),
                fixed(DType::I64, &[b], &seeds),
                fixed(DType::I32, &[b], &vec![0.0; b]),
                fixed(DType::I32, &[b], start),
            ],
        )
    };
    // Coarse logits: many ties, also at the k-th largest value.
    let coarse: Vec<f64> = (0..2 * 300).map(|i| ((i * 37 % 11) as f64 - 5.0) / 2.0).collect();
    let mut special: Vec<f64> = (0..2 * 40).map(|i| ((i * 13 % 17) as f64 - 8.0) / 3.0).collect();
    for (i, x) in [(3, f64::NAN), (5, f64::INFINITY), (7, f64::NEG_INFINITY), (9, -0.0), (10, 0.0), (41, f64::NAN)] {
        special[i] = x;
    }
    let all_nan = vec![f64::NAN; 2 * 7];
    // The largest logit is −0 before +0: the first wins, as equal numbers.
    let zeros = [-1.0, -2.0, -0.0, -3.0, -1.0, 0.0, -5.0, -0.0];
    vec![
        case(fixed(d, &[2, 300], &coarse), &[1.0, 7.0, 1.0, 0.9, 2.7, 0.6], &[0.0, 5.0], 1),
        case(fixed(d, &[2, 300], &coarse), &[0.5, 0.0, 0.3, 2.0, 299.0, 0.999], &[-4.0, 2147483647.0], 3),
        case(fixed(d, &[2, 40], &special), &[1.0, 0.0, 1.0, 0.8, 0.0, 0.5], &[1.0, 2.0], 1),
        case(fixed(d, &[2, 40], &special), &[0.0, 0.0, 1.0, f64::NAN, 3.0, 0.5], &[1.0, 2.0], 1),
        case(fixed(d, &[1, 8], &zeros), &[0.0, 0.0, 1.0], &[0.0], 1),
        case(fixed(d, &[2, 8], &[zeros, zeros].concat()), &[1.0, 2.0, 1.0, 1.0, 3.0, 0.4], &[0.0, 1.0], 1),
        case(fixed(d, &[2, 7], &all_nan), &[1.0, 2.0, 0.5, 0.0, 0.0, 1.0], &[0.0, 0.0], 1),
        case(normal(d, &[2, 5000]), &[1.0, 3000.0, 0.9, 0.7, 1600.0, 0.95], &[10.0, 20.0], 1),
        case(normal(d, &[3, 4096]), &[1e-3, 0.0, 0.5, 1.0, 1.0, 0.01, 1.0, 1.0, 0.0], &[0.0, 1.0, 2.0], 2),
    ]
}

#[test]
fn cached_attention_matches_the_cpu_on_the_model() {
    let i32s = |v: &[f64]| fixed(DType::I32, &[v.len()], v);
    // Groups of more query heads than a block holds, the largest head
    // size, one not a multiple of 4, a cache of one position, and a window
    // that starts inside a warp's tile of a split with splits wholly before
    // it, soft-capped (staged where the lowering stages).
    let extra = |d: DType| {
        let case = |b: usize,
                    hq: usize,
                    hkv: usize,
                    dd: usize,
                    n: usize,
                    s: usize,
                    splits: usize,
                    rows: &[f64],
                    start: &[f64],
                    scores: Scores| {
            Sample::new(
                CachedAttention { scale: 1.0 / (dd as f64).sqrt(), splits, scores },
                vec![
                    normal(d, &[b, 2, hq, dd]),
                    normal(d, &[n, s, hkv, dd]),
                    normal(d, &[n, s, hkv, dd]),
                    i32s(rows),
                    i32s(start),
                ],
            )
        };
        let plain = Scores::default();
        vec![
            case(2, 12, 1, 16, 2, 70, 3, &[1.0, 0.0], &[68.0, 33.0], plain),
            case(1, 2, 2, 256, 1, 40, 2, &[0.0], &[37.0], plain),
            case(2, 4, 2, 130, 2, 9, 2, &[0.0, 1.0], &[3.0, 7.0], plain),
            case(1, 2, 1, 6, 1, 1, 1, &[0.0], &[0.0], plain),
            case(2, 12, 2, 64, 2, 400, 5, &[1.0, 0.0], &[397.0, 150.0], Scores { window: 203, softcap: 3.0 }),
        ]
    };
    for (what, s, inputs) in cases("CachedAttention", extra) {
        let want = run_op(&s.op, &inputs).unwrap();
        let dt = inputs[0].ty.dtype;
        let (d, splits) = (inputs[0].ty.shape[3], want[1].ty.shape[3]);
        let vmax = inputs[2].to_f64().iter().fold(1.0f64, |m, x| m.max(x.abs()));
        // f64: both sides compute in f64 in different orders; the others: the
        // CPU's f32 against the model's f64, then the output's rounding.
        let (o_tol, part_tol) = match dt {
            DType::F64 => (1e-12, 1e-12),
            DType::F32 => (2e-5, 2e-5),
            _ => (1e-2, 2e-5),
        };
        let skews: &[u64] = if s.large { &[0] } else { &[0, 2, 8] };
        // Reading the cache in place, and staging it where the lowering can.
        let staged = Target {
            switches: crate::switches::Switches { decode_staging: true, ..crate::switches::Switches::default() },
            ..Target::default()
        };
        for (&skew, target) in skews.iter().flat_map(|s| [(s, Target::default()), (s, staged)]) {
            let Some(got) = run(&s.op, &inputs, skew, false, target) else { continue };
            let (go, wo) = (got[0].to_f64(), want[0].to_f64());
            let omax = wo.iter().fold(1.0f64, |m, x| m.max(x.abs()));
            for (i, (g, w)) in go.iter().zip(&wo).enumerate() {
                assert!((g - w).abs() <= o_tol * omax, "{what} skew {skew}: o[{i}] {g} against {w}");
            }
            // Partials per split: m within its magnitude, l and acc within l·max|v|.
            let (gp, wp) = (got[1].to_f64(), want[1].to_f64());
            for (i, (g, w)) in gp.iter().zip(&wp).enumerate() {
                let (split, c) = (i / (d + 2), i % (d + 2));
                let l = wp[split * (d + 2) + 1];
                let scale = if c == 0 { w.abs().max(1.0) } else { l.max(1.0) * vmax };
                assert!(
                    (g - w).abs() <= part_tol * scale,
                    "{what} skew {skew}: partial {i} ({c} of split {split} of {splits}) {g} against {w}"
                );
            }
        }
    }
    let staged = STAGED_BLOCKS_MODELLED.load(std::sync::atomic::Ordering::Relaxed);
    assert!(staged > 0, "no sample took the staged split pass");
}

/// A layer's key and value cache writes merged into one `kv_write2` launch
/// write the same bytes as the two launches, and pairs that share bytes or
/// differ in anything but their cache and rows stay apart.
#[test]
fn merged_cache_writes_equal_the_two_launches() {
    use super::decode::merge_kv_writes;
    use crate::launch::LaunchList;
    let op = Op::from(KvWrite::default());
    let (b, t, n, s, h, d) = (3, 2, 4, 9, 2, 6);
    for dt in [DType::BF16, DType::F32] {
        let cache = TensorType::new(dt, [n, s, h, d]);
        let new = TensorType::new(dt, [b, t, h, d]);
        let idx = TensorType::new(DType::I32, [b]);
        // Caches, new rows, then rows and start (shared by both writes), apart.
        let types = [cache.clone(), new.clone(), cache.clone(), new.clone(), idx.clone(), idx.clone()];
        let at = place(&types, 1 << 40, 0);
        let mut mem = Mem(at.iter().map(|x| (x.ptr, vec![0u8; x.ty.bytes() as usize])).collect());
        for (i, x) in at.iter().enumerate().take(4) {
            let bytes: Vec<u8> = (0..x.ty.bytes()).map(|j| (j as usize * 7 + i * 31) as u8).collect();
            mem.at(x.ptr, bytes.len()).copy_from_slice(&bytes);
        }
        // Rows 0, 2, 2 (the last two write the same row: the later batch row wins) at starts 1, 7, 3.
        for (p, vals) in [(&at[4], [0i32, 2, 2]), (&at[5], [1, 7, 3])] {
            let bytes: Vec<u8> = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
            mem.at(p.ptr, bytes.len()).copy_from_slice(&bytes);
        }
        let lower_one = |cache: &DevTensor, new: &DevTensor| {
            super::lower(
                &op,
                &[cache.clone(), new.clone(), at[4].clone(), at[5].clone()],
                std::slice::from_ref(cache),
                None,
            )
            .unwrap()
        };
        let mut launches = lower_one(&at[0], &at[1]);
        launches.extend(lower_one(&at[2], &at[3]));
        assert_eq!(launches.len(), 2, "in place: one kernel each");
        let (merged, last, first) =
            merge_kv_writes(LaunchList::one_node_each(launches.clone(), vec![5, 6])).into_parts();
        assert_eq!((merged.len(), last, first), (1, vec![6], vec![5]), "{dt}");
        let Launch::Kernel(k) = &merged[0] else { panic!("a kernel") };
        assert!(k.function.starts_with("kv_write2_") && k.grid.1 == 2, "{}", k.function);
        // No sample lowers to the merged kernel: check its parameters here.
        if crate::nvrtc::available() {
            let cubin = crate::kernels::compile("decode", "sm_90").unwrap_or_else(|e| panic!("{e}"));
            super::sweep::check_signature(&format!("merged kv_write {dt}"), &cubin, k);
        } else {
            assert!(
                std::env::var_os("STEPGRAPH_REQUIRE_NVRTC").is_none(),
                "STEPGRAPH_REQUIRE_NVRTC is set but NVRTC is missing"
            );
        }
        let mut apart = Mem(mem.0.clone());
        for l in &launches {
            let Launch::Kernel(k) = l else { panic!("a kernel") };
            emulate(k, &mut apart);
        }
        emulate(k, &mut mem);
        assert_eq!(mem.0, apart.0, "{dt}: the merged launch writes what the two do");
        // A write into the other's cache, or other rows, is not merged.
        let (overlapping, _, _) = merge_kv_writes(LaunchList::one_node_each(
            [lower_one(&at[0], &at[1]), lower_one(&at[0], &at[3])].concat(),
            vec![0, 1],
        ))
        .into_parts();
        assert_eq!(overlapping.len(), 2, "{dt}: both write the first cache");
        let other_rows =
            super::lower(&op, &[at[2].clone(), at[3].clone(), at[5].clone(), at[5].clone()], &[at[2].clone()], None)
                .unwrap();
        let (apart_rows, _, _) =
            merge_kv_writes(LaunchList::one_node_each([lower_one(&at[0], &at[1]), other_rows].concat(), vec![0, 1]))
                .into_parts();
        assert_eq!(apart_rows.len(), 2, "{dt}: different rows");
    }
}

#[test]
fn the_model_reads_its_inputs_from_the_draws() {
    // Guards the helpers above: a value's bits decode as HostTensor does.
    for dt in FLOAT_DTYPES {
        let t = draw_input(&normal(dt, &[64]), 3).unwrap();
        let mut mem = Mem(vec![(1 << 20, t.bytes().to_vec())]);
        let got: Vec<f64> = (0..64).map(|i| load(&mut mem, dt, 1 << 20, i)).collect();
        assert_eq!(got, t.to_f64(), "{dt}");
        for (i, x) in t.to_f64().iter().enumerate() {
            let k = order_key(dt, bits(&mut mem, dt, 1 << 20, i as i64));
            assert_eq!(key_value(dt, k), if *x == 0.0 { 0.0 } else { *x });
        }
    }
}
