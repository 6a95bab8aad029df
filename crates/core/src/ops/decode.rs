//! The ops of generation: writing a KV cache ([`KvWrite`]), attention of
//! new queries over it ([`CachedAttention`]), and drawing the next token
//! inside the trace ([`SampleNext`]), with their [`Builder`] helpers.
//!
//! **The cache** of one layer is two tensors `[N, S, Hkv, D]` (N sequences
//! of S positions; the layout the projections produce, so a write is a row
//! copy). Batch row `b` of a step lives in cache row `rows[b]`, and its
//! first new token sits at position `start[b]`: both are device values, so
//! one recorded step serves sequences of different lengths, and one replay
//! after another advances them without the host. Writes and reads outside
//! `[0, N) × [0, S)` are skipped (a kernel cannot report an error; the
//! host checks lengths before it runs a step).
//!
//! **Split-K attention** ("flash-decoding"): a query at position `p`
//! attends to cache positions `0..=p` (`p + 1 − window..=p` with a sliding
//! window, [`Scores`], whose soft-cap applies as in training), which are cut into `splits` chunks
//! of `ceil(S / splits)` positions. Each chunk yields a partial result —
//! the largest scaled score `m`, `l = Σ exp(s − m)` and `acc = Σ exp(s − m)·v`
//! — kept as the op's second output (so the GPU's partials live in the
//! plan like every other value), and the output combines them:
//! `o = Σ_c acc_c·e^{m_c − M} / Σ_c l_c·e^{m_c − M}` with `M = max_c m_c`.
//! A chunk without a position to attend to has `m = EMPTY_MAX`, `l = 0`,
//! `acc = 0`; a query with none at all (an invalid row) outputs zeros.
//!
//! **Sampling** ([`SampleNext`]): greedy (temperature ≤ 0: the first
//! largest logit), or the Gumbel-max trick on `logit / temperature` over
//! the tokens that top-k and top-p keep: the next token is the argmax of
//! `z_i + g_i`, with `g_i = −ln(−ln u_i)` and `u_i` a counter-based uniform
//! of (seed, position, token) ([`gumbel_uniform`]). That is an exact draw
//! from the filtered softmax, needs no sort and no prefix sum, and every
//! backend computes the same noise, so a seed gives the same text on the
//! CPU and the GPU. Top-k keeps logits at least the k-th largest (ties
//! included); top-p keeps logits at least `τ`, the largest logit whose
//! tokens at or above it hold probability `≥ top_p` (within the top-k set).

use num_traits::Float as _;
use rayon::prelude::*;

use super::attention::Scores;
use super::norm::stat_dtype;
use super::sample::{fixed, normal, Sample};
use super::{expect_float, expect_inputs, Attr, Attrs, OpDef, VjpArgs};
use crate::error::{Error, Result};
use crate::ir::{Builder, DType, TensorType, ValueId};
use crate::ops::kernel::{c, Float, KernelIo, SendPtr};
use crate::with_float;

/// The `m` of a split that attends to nothing: finite (so partials compare
/// as numbers), below every real score, and `exp(EMPTY_MAX − M)` is 0.
pub const EMPTY_MAX: f64 = -3.0e38;

fn inference_only(op: &str) -> Result<Vec<Option<ValueId>>> {
    Err(Error::NotDifferentiable {
        op: op.to_string(),
        reason: "is an inference op (generation has no backward)".into(),
    })
}

fn expect_index_vector(t: &TensorType, batch: usize, what: &str) -> std::result::Result<(), String> {
    if t.dtype != DType::I32 || t.shape != [batch] {
        return Err(format!("{what} must be i32[{batch}] (one per batch row), got {t}"));
    }
    Ok(())
}

/// Checks a `[N, S, H, D]` cache against `[B, T, H', D']` rows.
fn expect_cache(cache: &TensorType, what: &str) -> std::result::Result<(), String> {
    expect_float(cache, what)?;
    if cache.rank() != 4 {
        return Err(format!("{what} must be [N, S, H, D] (rank 4), got {cache}"));
    }
    Ok(())
}

// ------------------------------------------------------------------ kv_write

/// `cache[rows[b], start[b] + t] = new[b, t]` for every `(b, t)` inside the
/// cache; inputs `(cache [N,S,H,D], new [B,T,H,D], rows i32[B], start i32[B])`,
/// output the cache (in place).
///
/// **Ring** (`ring: true`): the cache keeps only the last S positions of a
/// sequence, position `p` in slot `p mod S` (a sliding-window layer needs
/// no more). A fifth input `last: i32[B]` is each row's last valid
/// position (a right-padded prompt's length − 1; a decode step's own
/// position): row `(b, t)` is written when its position `p` has
/// `last[b] − S < p ≤ last[b]` and `p ≥ 0`, so no two writes of one call
/// meet in a slot and padding never displaces a real key. Cached attention
/// over a ring with one query per row at position `p` then attends every
/// written slot, `0..=min(p, S − 1)`, which hold positions
/// `p − S + 1..=p` exactly (see [`CachedAttention`]).
#[derive(Clone, PartialEq, Debug, Default)]
pub struct KvWrite {
    pub ring: bool,
}

impl KvWrite {
    /// The slot of position `p` of a row whose write is `start..start + t`
    /// with last valid position `last`, in a cache of `s` positions; `None`
    /// when the row is not written.
    pub fn slot(&self, p: i64, last: i64, s: usize) -> Option<usize> {
        let s = s as i64;
        if p < 0 || s == 0 {
            return None;
        }
        if !self.ring {
            return (p < s).then_some(p as usize);
        }
        (p <= last && p > last - s).then_some((p % s) as usize)
    }
}

impl OpDef for KvWrite {
    /// A prompt's rows, single tokens of a batch at different positions,
    /// writes that run past the cache's end or name a row outside it; ring
    /// writes of a padded prompt longer than the ring and shorter, of
    /// decode steps past the ring's length, and of two batch rows into the
    /// same cache row.
    fn samples(d: DType) -> Vec<Sample> {
        let i32s = |v: &[f64]| fixed(DType::I32, &[v.len()], v);
        let plain = KvWrite::default();
        let ring = KvWrite { ring: true };
        vec![
            Sample::new(
                plain.clone(),
                vec![normal(d, &[2, 8, 2, 4]), normal(d, &[1, 5, 2, 4]), i32s(&[1.0]), i32s(&[0.0])],
            ),
            Sample::new(
                plain.clone(),
                vec![
                    normal(d, &[4, 6, 3, 8]),
                    normal(d, &[3, 1, 3, 8]),
                    i32s(&[2.0, 0.0, 1.0]),
                    i32s(&[5.0, 0.0, 3.0]),
                ],
            ),
            Sample::new(
                plain,
                vec![
                    normal(d, &[3, 4, 1, 16]),
                    normal(d, &[3, 3, 1, 16]),
                    i32s(&[0.0, 7.0, 2.0]),
                    i32s(&[2.0, 0.0, -1.0]),
                ],
            ),
            // A 12-token padded prompt of 9 real tokens into a ring of 5, and
            // one of 3 real tokens.
            Sample::new(
                ring.clone(),
                vec![normal(d, &[2, 5, 2, 4]), normal(d, &[1, 12, 2, 4]), i32s(&[1.0]), i32s(&[0.0]), i32s(&[8.0])],
            ),
            Sample::new(
                ring.clone(),
                vec![normal(d, &[2, 5, 2, 4]), normal(d, &[1, 12, 2, 4]), i32s(&[0.0]), i32s(&[0.0]), i32s(&[2.0])],
            ),
            // Decode steps at positions before, at and far past the ring's
            // length; a row outside the cache; a negative position; two
            // batch rows into cache row 1 at positions a ring apart, so into
            // one slot (the later batch row wins, as without the ring).
            Sample::new(
                ring,
                vec![
                    normal(d, &[3, 6, 1, 16]),
                    normal(d, &[6, 1, 1, 16]),
                    i32s(&[0.0, 2.0, 1.0, 5.0, 0.0, 1.0]),
                    i32s(&[3.0, 6.0, 40.0, 1.0, -1.0, 46.0]),
                    i32s(&[3.0, 6.0, 40.0, 1.0, -1.0, 46.0]),
                ],
            ),
        ]
    }
    fn name(&self) -> &'static str {
        "kv_write"
    }
    fn infer(&self, inputs: &[&TensorType]) -> std::result::Result<Vec<TensorType>, String> {
        expect_inputs(inputs, if self.ring { 5 } else { 4 })?;
        let (cache, new) = (inputs[0], inputs[1]);
        expect_cache(cache, "the cache")?;
        if new.rank() != 4 || new.dtype != cache.dtype || new.shape[2..] != cache.shape[2..] {
            return Err(format!(
                "new rows must be [B, T, {}, {}] of {}, got {new}",
                cache.shape[2], cache.shape[3], cache.dtype
            ));
        }
        expect_index_vector(inputs[2], new.shape[0], "rows")?;
        expect_index_vector(inputs[3], new.shape[0], "start")?;
        if self.ring {
            expect_index_vector(inputs[4], new.shape[0], "last")?;
        }
        Ok(vec![cache.clone()])
    }
    fn vjp(&self, _b: &mut Builder, _args: &VjpArgs) -> Result<Vec<Option<ValueId>>> {
        inference_only(self.name())
    }
    fn cpu(&self, io: &KernelIo) -> Result<()> {
        let (cs, ns) = (io.out_ty(0).shape.clone(), io.in_ty(1).shape.clone());
        let (n, s, row) = (cs[0], cs[1], cs[2] * cs[3]);
        let (b, t) = (ns[0], ns[1]);
        let rows = io.input::<i32>(2).to_vec();
        let start = io.input::<i32>(3).to_vec();
        let last = if self.ring { io.input::<i32>(4).to_vec() } else { vec![0; b] };
        with_float!(io.out_ty(0).dtype, T => {
            let new = io.input::<T>(1);
            let cache = io.inplace::<T>(0, 0);
            for bi in 0..b {
                for ti in 0..t {
                    let (r, p) = (rows[bi] as i64, start[bi] as i64 + ti as i64);
                    if !(0..n as i64).contains(&r) {
                        continue;
                    }
                    if let Some(slot) = self.slot(p, last[bi] as i64, s) {
                        let dst = (r as usize * s + slot) * row;
                        let src = (bi * t + ti) * row;
                        cache[dst..dst + row].copy_from_slice(&new[src..src + row]);
                    }
                }
            }
            Ok(())
        })
    }
    fn attrs(&self) -> Vec<(&'static str, Attr)> {
        Attr::flag("ring", self.ring)
    }
    fn parse(name: &str, a: &mut Attrs) -> Option<Result<Self>> {
        (name == "kv_write").then(|| Ok(KvWrite { ring: a.opt_bool("ring")?.unwrap_or(false) }))
    }
    fn inplace(&self) -> Vec<(usize, usize)> {
        vec![(0, 0)]
    }
}

// --------------------------------------------------------- cached_attention

/// Attention of `q: [B, T, Hq, D]` over cached keys and values
/// `[N, S, Hkv, D]`: query `(b, t)` sits at position `start[b] + t` of cache
/// row `rows[b]` and attends to positions `0..=start[b] + t` there
/// (grouped-query heads as [`super::attention::Attention`]); positions
/// past the cache's end read as its last, so over a ring cache
/// ([`KvWrite`]'s `ring`) a single query at position `p` attends all
/// `min(p + 1, S)` written slots, the ring's window (its recorder gives
/// the op no window of its own: the ring is one). Inputs
/// `(q, k_cache, v_cache, rows, start)`; outputs `(o, partials)` with
/// `partials: [B, T, Hq, splits, D + 2]` in the stat dtype holding each
/// split's `(m, l, acc[D])` (see the module doc).
#[derive(Clone, PartialEq, Debug)]
pub struct CachedAttention {
    pub scale: f64,
    pub splits: usize,
    pub scores: Scores,
}

/// Sizes of one cached-attention problem.
#[derive(Copy, Clone, Debug)]
pub struct CachedDims {
    pub b: usize,
    pub t: usize,
    pub hq: usize,
    pub hkv: usize,
    pub d: usize,
    pub n: usize,
    pub s: usize,
    pub splits: usize,
}

impl CachedDims {
    /// Positions per split.
    pub fn chunk(&self) -> usize {
        self.s.div_ceil(self.splits)
    }
}

impl CachedAttention {
    /// The sizes of the problem on these inputs, or why they do not fit.
    pub fn dims(&self, inputs: &[&TensorType]) -> std::result::Result<CachedDims, String> {
        expect_inputs(inputs, 5)?;
        let (q, k, v) = (inputs[0], inputs[1], inputs[2]);
        expect_float(q, "q")?;
        if q.rank() != 4 {
            return Err(format!("q must be [B, T, Hq, D] (rank 4), got {q}"));
        }
        expect_cache(k, "the key cache")?;
        if k != v || k.dtype != q.dtype {
            return Err(format!(
                "the key cache {k} and value cache {v} must match each other and q's dtype {}",
                q.dtype
            ));
        }
        let (hq, hkv) = (q.shape[2], k.shape[2]);
        if q.shape[3] != k.shape[3] {
            return Err(format!("q {q} and the cache {k} must have the same head size"));
        }
        if hkv == 0 || hq % hkv != 0 {
            return Err(format!("query heads Hq={hq} must be a positive multiple of kv heads Hkv={hkv}"));
        }
        expect_index_vector(inputs[3], q.shape[0], "rows")?;
        expect_index_vector(inputs[4], q.shape[0], "start")?;
        let s = k.shape[1];
        if self.splits == 0 || self.splits > s.max(1) {
            return Err(format!("splits={} must be between 1 and the cache length S={s}", self.splits));
        }
        Ok(CachedDims { b: q.shape[0], t: q.shape[1], hq, hkv, d: q.shape[3], n: k.shape[0], s, splits: self.splits })
    }

    /// A good split count for a step: enough (batch row, head, split)
    /// blocks to fill `blocks` GPU units, each split at least 64 positions.
    pub fn auto_splits(batch_rows: usize, kv_heads: usize, cache_len: usize, blocks: usize) -> usize {
        let work = (batch_rows * kv_heads).max(1);
        blocks.div_ceil(work).clamp(1, cache_len.div_ceil(64).max(1))
    }
}

struct CachedIo<'a, T: Float> {
    q: &'a [T],
    k: &'a [T],
    v: &'a [T],
    rows: &'a [i32],
    start: &'a [i32],
    o: SendPtr<T>,
    part: SendPtr<T::Acc>,
}

/// One task per query row `(b, t, h)`: its splits, then their combination.
fn cached_attention_cpu<T: Float>(a: CachedIo<T>, n: CachedDims, scale: f64, scores: Scores) {
    let scale: T::Acc = c(scale);
    let zero: T::Acc = c(0.0);
    let empty: T::Acc = c(EMPTY_MAX);
    let (chunk, width) = (n.chunk(), n.d + 2);
    let group = n.hq / n.hkv;
    (0..n.b * n.t * n.hq).into_par_iter().with_min_len(4).for_each_init(
        || (vec![zero; n.d], vec![zero; n.d]),
        |(qa, acc), r| {
            let (h, bt) = (r % n.hq, r / n.hq);
            let b = bt / n.t;
            let t = bt % n.t;
            let g = h / group;
            let qo = r * n.d;
            for (x, y) in qa.iter_mut().zip(&a.q[qo..qo + n.d]) {
                *x = y.acc();
            }
            let row = a.rows[b] as i64;
            let pos = a.start[b] as i64 + t as i64;
            // Keys 0..=pos of a valid row (the window's of them), within the cache.
            let last = if (0..n.n as i64).contains(&row) && pos >= 0 { (pos as usize).min(n.s - 1) + 1 } else { 0 };
            let first = if scores.window > 0 && pos >= 0 { scores.first_key(pos as usize, None) } else { 0 };
            let kv_at = |j: usize| ((row as usize * n.s + j) * n.hkv + g) * n.d;
            let (mut big_m, mut parts) = (empty, Vec::with_capacity(n.splits));
            for sp in 0..n.splits {
                let (lo, hi) = ((sp * chunk).max(first), ((sp + 1) * chunk).min(last));
                let (mut m, mut l) = (empty, zero);
                acc.fill(zero);
                for j in lo..hi.max(lo) {
                    let ko = kv_at(j);
                    let dot = qa.iter().zip(&a.k[ko..ko + n.d]).fold(zero, |s, (x, y)| s + *x * y.acc());
                    let score = scores.cap(scale * dot);
                    // Online softmax within the split.
                    let m_new = if score > m { score } else { m };
                    let rescale = (m - m_new).exp();
                    let p = (score - m_new).exp();
                    l = l * rescale + p;
                    let vo = kv_at(j);
                    for (x, y) in acc.iter_mut().zip(&a.v[vo..vo + n.d]) {
                        *x = *x * rescale + p * y.acc();
                    }
                    m = m_new;
                }
                let po = (r * n.splits + sp) * width;
                // SAFETY: split `sp` of query row `r` belongs to this task alone.
                unsafe {
                    a.part.write(po, m);
                    a.part.write(po + 1, l);
                    for (dd, x) in acc.iter().enumerate() {
                        a.part.write(po + 2 + dd, *x);
                    }
                }
                if m > big_m {
                    big_m = m;
                }
                parts.push((m, l, po));
            }
            let mut total = zero;
            acc.fill(zero);
            for &(m, l, po) in &parts {
                let w = (m - big_m).exp();
                total = total + l * w;
                for (dd, x) in acc.iter_mut().enumerate() {
                    // SAFETY: written by this task above.
                    *x = *x + w * unsafe { a.part.read(po + 2 + dd) };
                }
            }
            for (dd, x) in acc.iter().enumerate() {
                let y = if total > zero { *x / total } else { zero };
                // SAFETY: row r of o belongs to this task alone.
                unsafe { a.o.write(qo + dd, T::from_acc(y)) };
            }
        },
    );
}

impl OpDef for CachedAttention {
    /// One token per sequence at different positions (the decode step),
    /// grouped-query heads, several new tokens per sequence (causal among
    /// them), a split per position and one split over everything, a row
    /// outside the cache and positions past its end; sliding windows and
    /// soft-caps.
    fn samples(d: DType) -> Vec<Sample> {
        let i32s = |v: &[f64]| fixed(DType::I32, &[v.len()], v);
        let plain = Scores::default();
        let window = |window| Scores { window, softcap: 0.0 };
        let case = |b: usize,
                    t: usize,
                    hq: usize,
                    hkv: usize,
                    dd: usize,
                    n: usize,
                    s: usize,
                    splits: usize,
                    rows: &[f64],
                    start: &[f64],
                    scores: Scores| {
            let scale = 1.0 / (dd as f64).sqrt();
            Sample::new(
                CachedAttention { scale, splits, scores },
                vec![
                    normal(d, &[b, t, hq, dd]),
                    normal(d, &[n, s, hkv, dd]),
                    normal(d, &[n, s, hkv, dd]),
                    i32s(rows),
                    i32s(start),
                ],
            )
            .large_over(200_000)
        };
        vec![
            case(3, 1, 4, 4, 8, 4, 16, 4, &[0.0, 2.0, 3.0], &[0.0, 7.0, 15.0], plain),
            case(2, 1, 8, 2, 16, 2, 40, 3, &[1.0, 0.0], &[39.0, 12.0], plain),
            case(2, 3, 4, 1, 8, 3, 12, 2, &[2.0, 0.0], &[0.0, 5.0], plain),
            case(1, 4, 2, 2, 4, 1, 9, 9, &[0.0], &[3.0], plain),
            case(2, 1, 2, 1, 32, 2, 20, 1, &[0.0, 1.0], &[19.0, 4.0], plain),
            case(3, 1, 2, 2, 8, 2, 10, 2, &[5.0, 1.0, 0.0], &[2.0, 30.0, -1.0], plain),
            case(4, 1, 32, 32, 100, 4, 768, 8, &[0.0, 1.0, 2.0, 3.0], &[511.0, 600.0, 767.0, 0.0], plain),
            case(2, 1, 28, 4, 128, 2, 1024, 4, &[1.0, 0.0], &[1000.0, 64.0], plain),
            // Sliding windows shorter than a split and longer, reaching
            // before position 0 and not; soft-caps that bite.
            case(3, 1, 4, 2, 8, 3, 40, 4, &[0.0, 1.0, 2.0], &[0.0, 7.0, 39.0], window(5)),
            case(2, 3, 4, 1, 8, 3, 12, 2, &[2.0, 0.0], &[0.0, 5.0], window(3)),
            case(2, 1, 4, 4, 16, 2, 64, 3, &[1.0, 0.0], &[63.0, 30.0], Scores { window: 40, softcap: 1.0 }),
            case(2, 1, 8, 2, 64, 2, 300, 4, &[0.0, 1.0], &[299.0, 100.0], Scores { window: 0, softcap: 2.0 }),
            case(2, 1, 8, 4, 256, 2, 600, 4, &[0.0, 1.0], &[599.0, 200.0], Scores { window: 128, softcap: 50.0 }),
        ]
    }
    fn name(&self) -> &'static str {
        "cached_attention"
    }
    fn infer(&self, inputs: &[&TensorType]) -> std::result::Result<Vec<TensorType>, String> {
        let n = self.dims(inputs)?;
        let part = TensorType::new(stat_dtype(inputs[0].dtype), [n.b, n.t, n.hq, n.splits, n.d + 2]);
        Ok(vec![inputs[0].clone(), part])
    }
    fn vjp(&self, _b: &mut Builder, _args: &VjpArgs) -> Result<Vec<Option<ValueId>>> {
        inference_only(self.name())
    }
    fn cpu(&self, io: &KernelIo) -> Result<()> {
        let types: Vec<&TensorType> = io.inputs.iter().map(|v| &v.ty).collect();
        let n = self.dims(&types).map_err(|e| Error::op(self.name(), e))?;
        with_float!(io.in_ty(0).dtype, T => {
            let a = CachedIo::<T> {
                q: io.input(0),
                k: io.input(1),
                v: io.input(2),
                rows: io.input(3),
                start: io.input(4),
                o: SendPtr(io.output::<T>(0).as_mut_ptr()),
                part: SendPtr(io.output::<<T as Float>::Acc>(1).as_mut_ptr()),
            };
            cached_attention_cpu(a, n, self.scale, self.scores);
            Ok(())
        })
    }
    fn attrs(&self) -> Vec<(&'static str, Attr)> {
        let mut v = vec![("scale", Attr::Float(self.scale)), ("splits", Attr::Int(self.splits as i64))];
        self.scores.attrs(&mut v);
        v
    }
    fn parse(name: &str, a: &mut Attrs) -> Option<Result<Self>> {
        (name == "cached_attention").then(|| {
            Ok(CachedAttention { scale: a.float("scale")?, splits: a.usize("splits")?, scores: Scores::parse(a)? })
        })
    }
}

// ---------------------------------------------------------------- sample_next

/// Columns of the per-sequence sampling settings `[B, 3]` (f32).
pub const SAMPLING_COLUMNS: [&str; 3] = ["temperature", "top_k", "top_p"];

/// Draws each sequence's next token from its logits and advances its
/// position. Inputs `(logits [B, V] float, sampling f32[B, 3], seeds i64[B],
/// tokens i32[B], start i32[B])`; outputs `(next i32[B], start + advance)`,
/// written over `tokens` and `start` (in place), so a decode step's state
/// (last token, position) updates inside the trace. The token drawn sits
/// at position `start[b] + advance`, which is also the counter of its
/// noise. `sampling[b] = (temperature, top_k, top_p)`: temperature ≤ 0 is
/// greedy; top_k < 1 or ≥ V keeps every token; top_p outside (0, 1) keeps
/// every token. See the module doc.
#[derive(Clone, PartialEq, Debug)]
pub struct SampleNext {
    pub advance: usize,
}

/// splitmix64's finaliser: a bijection of u64 that mixes every bit.
pub fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The uniform in (0, 1) of token `token` at position `position` for
/// `seed`: 53 bits of `splitmix64(seed ^ splitmix64(position << 32 | token))`,
/// centred in their interval. The GPU kernel computes the same bits.
pub fn gumbel_uniform(seed: u64, position: u32, token: u32) -> f64 {
    let h = splitmix64(seed ^ splitmix64(((position as u64) << 32) | token as u64));
    ((h >> 11) as f64 + 0.5) * (1.0 / (1u64 << 53) as f64)
}

/// The next token of one row (see [`SampleNext`]); `logits` as f64.
pub fn sample_row(logits: &[f64], temperature: f64, top_k: f64, top_p: f64, seed: u64, position: u32) -> usize {
    let v = logits.len();
    // NaN logits never win.
    let key = |x: f64| if x.is_nan() { f64::NEG_INFINITY } else { x };
    // NaN and non-positive temperatures are greedy.
    if temperature.is_nan() || temperature <= 0.0 {
        let mut best = 0;
        for i in 1..v {
            if key(logits[i]) > key(logits[best]) {
                best = i;
            }
        }
        return best;
    }
    let z: Vec<f64> = logits.iter().map(|&x| key(x) / temperature).collect();
    let mut threshold = f64::NEG_INFINITY;
    if top_k >= 1.0 && top_k < v as f64 {
        let mut sorted = z.clone();
        sorted.sort_by(|a, b| b.total_cmp(a));
        threshold = sorted[top_k as usize - 1];
    }
    if top_p > 0.0 && top_p < 1.0 {
        let zmax = z.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let mut kept: Vec<f64> = z.iter().copied().filter(|&x| x >= threshold).collect();
        kept.sort_by(|a, b| b.total_cmp(a));
        let total: f64 = kept.iter().map(|&x| (x - zmax).exp()).sum();
        // The largest τ whose tokens at or above it hold ≥ top_p of the mass:
        // walk down the sorted logits, a run of equal values at a time.
        let mut mass = 0.0;
        let mut i = 0;
        while i < kept.len() {
            let x = kept[i];
            while i < kept.len() && kept[i] == x {
                mass += (kept[i] - zmax).exp();
                i += 1;
            }
            if mass >= top_p * total {
                threshold = threshold.max(x);
                break;
            }
        }
    }
    let mut best = None::<(usize, f64)>;
    for (i, &zi) in z.iter().enumerate() {
        if zi < threshold || zi == f64::NEG_INFINITY {
            continue;
        }
        let u = gumbel_uniform(seed, position, i as u32);
        let score = zi - (-u.ln()).ln();
        if best.is_none_or(|(_, s)| score > s) {
            best = Some((i, score));
        }
    }
    best.map_or(0, |(i, _)| i)
}

impl OpDef for SampleNext {
    /// Greedy, temperature alone, top-k, top-p, both, rows that differ in
    /// every setting, a vocabulary larger than a GPU block's threads.
    fn samples(d: DType) -> Vec<Sample> {
        let case = |b: usize, v: usize, sampling: &[f64], advance: usize| {
            let seeds: Vec<f64> = (0..b).map(|i| (1234 + 977 * i) as f64).collect();
            let tokens: Vec<f64> = (0..b).map(|i| i as f64).collect();
            let start: Vec<f64> = (0..b).map(|i| (3 * i + 1) as f64).collect();
            Sample::new(
                SampleNext { advance },
                vec![
                    normal(d, &[b, v]),
                    fixed(DType::F32, &[b, 3], sampling),
                    fixed(DType::I64, &[b], &seeds),
                    fixed(DType::I32, &[b], &tokens),
                    fixed(DType::I32, &[b], &start),
                ],
            )
        };
        vec![
            case(2, 50, &[0.0, 0.0, 1.0, -1.0, 5.0, 0.5], 1),
            case(3, 64, &[1.0, 0.0, 1.0, 0.7, 0.0, 1.0, 1.3, 0.0, 1.0], 1),
            case(2, 100, &[1.0, 5.0, 1.0, 0.8, 1.0, 1.0], 1),
            case(2, 100, &[1.0, 0.0, 0.9, 0.6, 0.0, 0.5], 4),
            case(4, 33, &[1.0, 10.0, 0.8, 0.0, 3.0, 0.5, 2.0, 40.0, 0.95, 0.5, 2.0, 0.3], 1),
            case(2, 5000, &[1.0, 50.0, 0.9, 1.0, 0.0, 0.95], 1),
        ]
    }
    fn name(&self) -> &'static str {
        "sample_next"
    }
    fn infer(&self, inputs: &[&TensorType]) -> std::result::Result<Vec<TensorType>, String> {
        expect_inputs(inputs, 5)?;
        let logits = inputs[0];
        expect_float(logits, "logits")?;
        if logits.rank() != 2 || logits.shape[1] == 0 {
            return Err(format!("logits must be [B, V] with V > 0, got {logits}"));
        }
        let b = logits.shape[0];
        if inputs[1].dtype != DType::F32 || inputs[1].shape != [b, 3] {
            return Err(format!("sampling must be f32[{b}, 3] (temperature, top_k, top_p), got {}", inputs[1]));
        }
        if inputs[2].dtype != DType::I64 || inputs[2].shape != [b] {
            return Err(format!("seeds must be i64[{b}], got {}", inputs[2]));
        }
        expect_index_vector(inputs[3], b, "tokens")?;
        expect_index_vector(inputs[4], b, "start")?;
        if logits.shape[1] > i32::MAX as usize {
            return Err(format!("a vocabulary of {} does not fit i32 token ids", logits.shape[1]));
        }
        Ok(vec![inputs[3].clone(), inputs[4].clone()])
    }
    fn vjp(&self, _b: &mut Builder, _args: &VjpArgs) -> Result<Vec<Option<ValueId>>> {
        inference_only(self.name())
    }
    fn cpu(&self, io: &KernelIo) -> Result<()> {
        let (b, v) = (io.in_ty(0).shape[0], io.in_ty(0).shape[1]);
        let sampling = io.input::<f32>(1).to_vec();
        let seeds = io.input::<i64>(2).to_vec();
        let mut logits = vec![0.0f64; b * v];
        with_float!(io.in_ty(0).dtype, T => {
            for (x, y) in logits.iter_mut().zip(io.input::<T>(0)) {
                *x = num_traits::ToPrimitive::to_f64(&y.acc()).unwrap_or(f64::NAN);
            }
            Ok(())
        })?;
        let start = io.inplace::<i32>(1, 4);
        let next: Vec<i32> = (0..b)
            .into_par_iter()
            .map(|r| {
                let s = &sampling[r * 3..r * 3 + 3];
                let position = (start[r] as i64 + self.advance as i64).clamp(0, u32::MAX as i64) as u32;
                sample_row(
                    &logits[r * v..(r + 1) * v],
                    s[0] as f64,
                    s[1] as f64,
                    s[2] as f64,
                    seeds[r] as u64,
                    position,
                ) as i32
            })
            .collect();
        for x in start.iter_mut() {
            *x = x.wrapping_add(self.advance as i32);
        }
        io.inplace::<i32>(0, 3).copy_from_slice(&next);
        Ok(())
    }
    fn attrs(&self) -> Vec<(&'static str, Attr)> {
        vec![("advance", Attr::Int(self.advance as i64))]
    }
    fn parse(name: &str, a: &mut Attrs) -> Option<Result<Self>> {
        (name == "sample_next").then(|| Ok(SampleNext { advance: a.usize("advance")? }))
    }
    fn inplace(&self) -> Vec<(usize, usize)> {
        vec![(0, 3), (1, 4)]
    }
}

impl Builder {
    /// Writes `new: [B, T, H, D]` into `cache: [N, S, H, D]` at rows `rows`
    /// from positions `start`; returns the written cache.
    pub fn kv_write(&mut self, cache: ValueId, new: ValueId, rows: ValueId, start: ValueId) -> Result<ValueId> {
        self.push1(KvWrite::default().into(), &[cache, new, rows, start])
    }

    /// [`KvWrite`] into a ring cache: rows at positions `last − S + 1..=last` only.
    pub fn kv_write_ring(
        &mut self,
        cache: ValueId,
        new: ValueId,
        rows: ValueId,
        start: ValueId,
        last: ValueId,
    ) -> Result<ValueId> {
        self.push1(KvWrite { ring: true }.into(), &[cache, new, rows, start, last])
    }

    /// Attention of `q` over the caches (see [`CachedAttention`]); returns `o`.
    #[allow(clippy::too_many_arguments)]
    pub fn cached_attention(
        &mut self,
        q: ValueId,
        k_cache: ValueId,
        v_cache: ValueId,
        rows: ValueId,
        start: ValueId,
        scale: f64,
        splits: usize,
        scores: Scores,
    ) -> Result<ValueId> {
        Ok(self.push(CachedAttention { scale, splits, scores }.into(), &[q, k_cache, v_cache, rows, start])?[0])
    }

    /// The next token of each row and the advanced positions (see [`SampleNext`]).
    pub fn sample_next(
        &mut self,
        logits: ValueId,
        sampling: ValueId,
        seeds: ValueId,
        tokens: ValueId,
        start: ValueId,
        advance: usize,
    ) -> Result<(ValueId, ValueId)> {
        let out = self.push(SampleNext { advance }.into(), &[logits, sampling, seeds, tokens, start])?;
        Ok((out[0], out[1]))
    }
}
