//! Batched, strided matrix products for the CPU reference kernels.
//!
//! This module owns every dense matrix multiply the CPU reference backend
//! performs: `C[b] = op(A[b]) · op(B[b])` over a batch of row-major,
//! contiguous matrices, with optional transposition of either operand and an
//! optional broadcast `B`, for `f32`, `f64`, `bf16` and `f16`. The arithmetic
//! is delegated to the `gemm` crate; this module decides the strides, the
//! threading and the 16-bit storage policy, and guarantees that results are
//! bit-reproducible.
//!
//! # Numerics
//!
//! * `C` is write-only: it is never read, so garbage (NaNs included) left in
//!   reused memory cannot leak into the result.
//! * `bf16` and `f16` are storage formats only: inputs are widened to `f32`
//!   (exactly), multiplied with `f32` accumulation, and each output is rounded
//!   once to the 16-bit type, round-to-nearest-even.
//! * `k == 0` yields `C = 0`.
//!
//! # Determinism
//!
//! Results are bit-identical from run to run and independent of where the
//! buffers live in memory and of the rayon thread count. This module only
//! ever parallelizes over whole products (the batch) or lets `gemm` split one
//! product over output tiles; a `k` reduction is never split across threads,
//! and every decision below is taken from the shape alone.
//!
//! What `gemm` 0.19 itself does (read from `gemm-common` 0.19.0, `gemm.rs`,
//! `microkernel.rs`, `gemv.rs`, `gevv.rs`, `horizontal_microkernel.rs`, and
//! confirmed by experiment with buffers offset by 1, 3, 7 and 13 elements and
//! with 1, 2, 3 and 7 threads):
//!
//! * The kernel variant (scalar, AVX2+FMA, AVX-512 only with gemm's `x86-v4`
//!   feature, NEON) is picked once from CPU features, and the blocking (`kc`, `mc`, `nc`) from the shape and
//!   the detected cache sizes. Special paths (small-output "horizontal"
//!   kernel, `k <= 2`, matrix-vector) are selected from `m`, `n`, `k` and the
//!   strides. None of these look at pointer values.
//! * SIMD loads and stores go through `[T; N]` array types (alignment of `T`)
//!   or `read`/`write_unaligned`, so there is no alignment peeling and no
//!   alignment-dependent code path: no aligned scratch copy is needed.
//! * Threads split the output into `MR x NR` tiles; each tile accumulates its
//!   whole `k` range in a fixed order (sequential `kc` blocks, each block's
//!   result folded into `C` before the next). The thread count changes only
//!   which thread computes a tile and whether operands are packed (copied)
//!   first, never the arithmetic of an element; `Parallelism::None` vs
//!   `Rayon` changes the column block width, always a multiple of `NR`, so
//!   tiles and their arithmetic stay the same.
//! * With `read_dst == false` every path forces the `dst` coefficient to zero
//!   and stores `beta * acc` without loading `dst`.
//! * gemm's global tunables (`set_threading_threshold`, packing thresholds)
//!   change only thread counts and operand packing (copies), not the
//!   arithmetic; this module leaves them at their defaults.
//!
//! Consequently the bits can differ between machines (different SIMD width,
//! FMA availability or cache sizes change the blocking), but not between runs
//! on one machine.

use ::gemm::Parallelism;
use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};
use rayon::prelude::*;

/// Describes `C[b] = op(A[b]) · op(B[b])` for `b in 0..batch`, all row-major
/// contiguous.
///
/// `C[b]` is `[m, n]`. Batches are laid out back to back: `A[b]` starts at
/// `b * m * k`, `B[b]` at `b * k * n` (or at 0 for every `b` when
/// `broadcast_b`), `C[b]` at `b * m * n`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GemmDesc {
    /// Number of independent products.
    pub batch: usize,
    /// Rows of `op(A)` and of `C`.
    pub m: usize,
    /// Columns of `op(B)` and of `C`.
    pub n: usize,
    /// Shared (reduction) dimension.
    pub k: usize,
    /// `A[b]` is stored as `[k, m]` row-major when true, else `[m, k]`.
    pub trans_a: bool,
    /// `B[b]` is stored as `[n, k]` row-major when true, else `[k, n]`.
    pub trans_b: bool,
    /// `B` has no batch dimension: the same `B` is used for every `b`.
    pub broadcast_b: bool,
}

impl GemmDesc {
    /// Number of elements `A` must hold: `batch * m * k`.
    ///
    /// # Panics
    /// Panics if the count overflows `usize`.
    pub fn a_len(&self) -> usize {
        checked_len(&[self.batch, self.m, self.k], "A")
    }

    /// Number of elements `B` must hold: `k * n`, times `batch` unless
    /// `broadcast_b`.
    ///
    /// # Panics
    /// Panics if the count overflows `usize`.
    pub fn b_len(&self) -> usize {
        let batch = if self.broadcast_b { 1 } else { self.batch };
        checked_len(&[batch, self.k, self.n], "B")
    }

    /// Number of elements `C` must hold: `batch * m * n`.
    ///
    /// # Panics
    /// Panics if the count overflows `usize`.
    pub fn c_len(&self) -> usize {
        checked_len(&[self.batch, self.m, self.n], "C")
    }

    /// Panics with a descriptive message unless the slice lengths match.
    /// Shapes are validated by the caller, so a mismatch is a backend bug.
    fn check_lengths(&self, a: usize, b: usize, c: usize, dtype: &str) {
        let expected = (self.a_len(), self.b_len(), self.c_len());
        assert!(
            (a, b, c) == expected,
            "gemm_{dtype}: slice lengths (A, B, C) = {:?} do not match {self:?}, which needs {expected:?}",
            (a, b, c),
        );
    }

    /// True when there is no output element to produce.
    fn is_empty_output(&self) -> bool {
        self.batch == 0 || self.m == 0 || self.n == 0
    }
}

fn checked_len(dims: &[usize], what: &str) -> usize {
    dims.iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d))
        .unwrap_or_else(|| panic!("gemm: element count of {what} overflows usize: {dims:?}"))
}

/// A product with at least this many multiply-adds (`m * n * k`) is handed to
/// `gemm` with rayon parallelism. Below it, splitting one product across
/// threads costs more in synchronization than it saves; `gemm` itself does not
/// spawn work below 48·48·256 ≈ 2^19.2 multiply-adds per `k` block either.
const PRODUCT_PARALLEL_MIN_WORK: usize = 1 << 19;

/// Below this total (`batch * m * n * k`) a whole call runs on the calling
/// thread: for tiny products, rayon's task overhead (microseconds) would
/// dominate the arithmetic.
const BATCH_PARALLEL_MIN_WORK: usize = 1 << 16;

/// Above this many elements, 16-bit <-> `f32` conversions are split over
/// rayon in chunks of this size. Conversions are elementwise, so the split
/// cannot affect the result.
const CONVERT_CHUNK: usize = 1 << 16;

/// How a call is scheduled. Chosen from the shape only (never from pointers
/// or thread counts), although per the module docs the bits would not change
/// with the schedule anyway.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Schedule {
    /// Everything on the calling thread: the work is too small to share.
    Serial,
    /// Products spread over rayon, each single-threaded: for many small
    /// products, where per-product threading would be mostly overhead.
    BatchParallel,
    /// Products one after another, each split over rayon by `gemm`.
    ProductParallel,
}

fn schedule(desc: &GemmDesc) -> Schedule {
    let work = desc.m.saturating_mul(desc.n).saturating_mul(desc.k);
    if work >= PRODUCT_PARALLEL_MIN_WORK {
        Schedule::ProductParallel
    } else if desc.batch > 1 && work.saturating_mul(desc.batch) >= BATCH_PARALLEL_MIN_WORK {
        Schedule::BatchParallel
    } else {
        Schedule::Serial
    }
}

/// The element types `gemm` computes in natively.
trait Native: Copy + Send + Sync + 'static {
    const ZERO: Self;
    const ONE: Self;
}

impl Native for f32 {
    const ZERO: Self = 0.0;
    const ONE: Self = 1.0;
}

impl Native for f64 {
    const ZERO: Self = 0.0;
    const ONE: Self = 1.0;
}

/// Strides, in elements, of one product's operands as `gemm` wants them
/// (`cs` = step to the next column, `rs` = step to the next row of the
/// logical, already-transposed operand).
struct Strides {
    lhs_cs: isize,
    lhs_rs: isize,
    rhs_cs: isize,
    rhs_rs: isize,
    dst_cs: isize,
    dst_rs: isize,
}

impl Strides {
    fn new(desc: &GemmDesc) -> Self {
        // Only called with m, n, k >= 1 and validated slices of m*k, k*n and
        // m*n elements; a slice never exceeds isize::MAX elements, so each
        // dimension fits in isize and these casts are lossless.
        let (m, n, k) = (desc.m as isize, desc.n as isize, desc.k as isize);
        // op(A)[i, p]: A is [m, k] -> i * k + p; A is [k, m] -> p * m + i.
        let (lhs_cs, lhs_rs) = if desc.trans_a { (m, 1) } else { (1, k) };
        // op(B)[p, j]: B is [k, n] -> p * n + j; B is [n, k] -> j * k + p.
        let (rhs_cs, rhs_rs) = if desc.trans_b { (k, 1) } else { (1, n) };
        Strides { lhs_cs, lhs_rs, rhs_cs, rhs_rs, dst_cs: 1, dst_rs: n }
    }
}

/// One product `c = op(a) · op(b)`; operands are exactly one batch element.
fn product<T: Native>(desc: &GemmDesc, strides: &Strides, a: &[T], b: &[T], c: &mut [T], parallelism: Parallelism) {
    let (m, n, k) = (desc.m, desc.n, desc.k);
    // These hold by construction in `gemm_native`; the unsafe call below
    // relies on them, so keep them checked even in release builds.
    assert!(
        a.len() == m * k && b.len() == k * n && c.len() == m * n,
        "gemm: per-product slice lengths do not match {desc:?}"
    );
    // gemm 0.19 computes dst := alpha * dst + beta * (lhs · rhs): unlike BLAS,
    // `alpha` scales the old destination and `beta` the product. We pass
    // read_dst = false (gemm then forces alpha to 0 and no path loads dst),
    // alpha = 0 for good measure, beta = 1.
    //
    // SAFETY: `a` holds m*k elements and the strides address op(A)[i, p] at
    // offsets < m*k for i < m, p < k (both layouts); likewise `b` (k*n) and
    // `c` (m*n, row-major). `c` is a unique borrow, so it cannot alias the
    // inputs. `T` is f32 or f64, both of which `gemm` supports (it panics on
    // other types rather than misbehaving).
    unsafe {
        ::gemm::gemm(
            m,
            n,
            k,
            c.as_mut_ptr(),
            strides.dst_cs,
            strides.dst_rs,
            false,
            a.as_ptr(),
            strides.lhs_cs,
            strides.lhs_rs,
            b.as_ptr(),
            strides.rhs_cs,
            strides.rhs_rs,
            T::ZERO,
            T::ONE,
            false,
            false,
            false,
            parallelism,
        );
    }
}

/// Batched driver for the native types; lengths must already be validated.
fn gemm_native<T: Native>(desc: &GemmDesc, a: &[T], b: &[T], c: &mut [T]) {
    if desc.is_empty_output() {
        return;
    }
    if desc.k == 0 {
        // An empty sum; done here so no path depends on gemm's k == 0 case.
        c.fill(T::ZERO);
        return;
    }
    let strides = Strides::new(desc);
    let a_step = desc.m * desc.k;
    let b_step = if desc.broadcast_b { 0 } else { desc.k * desc.n };
    let b_len = desc.k * desc.n;
    let c_step = desc.m * desc.n;
    let run = |i: usize, c: &mut [T], parallelism: Parallelism| {
        let a = &a[i * a_step..][..a_step];
        let b = &b[i * b_step..][..b_len];
        product(desc, &strides, a, b, c, parallelism);
    };
    match schedule(desc) {
        Schedule::Serial => c.chunks_mut(c_step).enumerate().for_each(|(i, c)| run(i, c, Parallelism::None)),
        // `Rayon(0)` lets gemm use the current pool's thread count; that
        // count affects only which thread computes which output tile.
        Schedule::ProductParallel => {
            c.chunks_mut(c_step).enumerate().for_each(|(i, c)| run(i, c, Parallelism::Rayon(0)))
        }
        Schedule::BatchParallel => c.par_chunks_mut(c_step).enumerate().for_each(|(i, c)| run(i, c, Parallelism::None)),
    }
}

/// Computes `C[b] = op(A[b]) · op(B[b])` in `f32`, overwriting `c`.
///
/// # Panics
/// Panics if `a`, `b` or `c` does not have the length `desc` implies
/// ([`GemmDesc::a_len`], [`GemmDesc::b_len`], [`GemmDesc::c_len`]).
pub fn gemm_f32(desc: &GemmDesc, a: &[f32], b: &[f32], c: &mut [f32]) {
    desc.check_lengths(a.len(), b.len(), c.len(), "f32");
    gemm_native(desc, a, b, c);
}

/// Computes `C[b] = op(A[b]) · op(B[b])` in `f64`, overwriting `c`.
///
/// # Panics
/// Panics if `a`, `b` or `c` does not have the length `desc` implies
/// ([`GemmDesc::a_len`], [`GemmDesc::b_len`], [`GemmDesc::c_len`]).
pub fn gemm_f64(desc: &GemmDesc, a: &[f64], b: &[f64], c: &mut [f64]) {
    desc.check_lengths(a.len(), b.len(), c.len(), "f64");
    gemm_native(desc, a, b, c);
}

/// 16-bit storage types, computed in `f32`.
trait Half: Copy + Send + Sync {
    fn widen(src: &[Self], dst: &mut [f32]);
    fn narrow(src: &[f32], dst: &mut [Self]);
}

impl Half for bf16 {
    fn widen(src: &[Self], dst: &mut [f32]) {
        src.convert_to_f32_slice(dst);
    }
    fn narrow(src: &[f32], dst: &mut [Self]) {
        dst.convert_from_f32_slice(src);
    }
}

impl Half for f16 {
    fn widen(src: &[Self], dst: &mut [f32]) {
        src.convert_to_f32_slice(dst);
    }
    fn narrow(src: &[f32], dst: &mut [Self]) {
        dst.convert_from_f32_slice(src);
    }
}

/// Widens to a fresh `f32` buffer (exact for both 16-bit types).
fn widen<T: Half>(src: &[T]) -> Vec<f32> {
    let mut dst = vec![0.0f32; src.len()];
    if src.len() > CONVERT_CHUNK {
        src.par_chunks(CONVERT_CHUNK).zip(dst.par_chunks_mut(CONVERT_CHUNK)).for_each(|(s, d)| T::widen(s, d));
    } else {
        T::widen(src, &mut dst);
    }
    dst
}

/// Rounds `src` into `dst`, round-to-nearest-even per `half`.
fn narrow<T: Half>(src: &[f32], dst: &mut [T]) {
    if src.len() > CONVERT_CHUNK {
        src.par_chunks(CONVERT_CHUNK).zip(dst.par_chunks_mut(CONVERT_CHUNK)).for_each(|(s, d)| T::narrow(s, d));
    } else {
        T::narrow(src, dst);
    }
}

fn gemm_half<T: Half>(desc: &GemmDesc, a: &[T], b: &[T], c: &mut [T], dtype: &str) {
    desc.check_lengths(a.len(), b.len(), c.len(), dtype);
    if desc.is_empty_output() {
        return;
    }
    // Widening is exact, so the only roundings are gemm's f32 accumulation and
    // the final one per output element. The f32 scratch is private, so the
    // f32 driver's "never read C" guarantee carries over.
    let mut c32 = vec![0.0f32; c.len()];
    gemm_half_wide(desc, a, b, &mut c32, dtype);
    narrow(&c32, c);
}

/// The `f32` product of 16-bit operands, not rounded to storage: what a
/// caller adds an epilogue to (an addend) before the one final rounding.
fn gemm_half_wide<T: Half>(desc: &GemmDesc, a: &[T], b: &[T], c32: &mut [f32], dtype: &str) {
    desc.check_lengths(a.len(), b.len(), c32.len(), dtype);
    if desc.is_empty_output() {
        return;
    }
    gemm_native(desc, &widen(a), &widen(b), c32);
}

/// Computes `C[b] = op(A[b]) · op(B[b])` for `bf16` operands into an `f32`
/// `c32`, unrounded (the product [`gemm_bf16`] rounds).
///
/// # Panics
/// As [`gemm_bf16`].
pub fn gemm_bf16_wide(desc: &GemmDesc, a: &[bf16], b: &[bf16], c32: &mut [f32]) {
    gemm_half_wide(desc, a, b, c32, "bf16");
}

/// As [`gemm_bf16_wide`] for `f16` operands.
///
/// # Panics
/// As [`gemm_f16`].
pub fn gemm_f16_wide(desc: &GemmDesc, a: &[f16], b: &[f16], c32: &mut [f32]) {
    gemm_half_wide(desc, a, b, c32, "f16");
}

/// Computes `C[b] = op(A[b]) · op(B[b])` for `bf16` storage with `f32`
/// accumulation, overwriting `c` with the `f32` result rounded to nearest-even.
///
/// # Panics
/// Panics if `a`, `b` or `c` does not have the length `desc` implies
/// ([`GemmDesc::a_len`], [`GemmDesc::b_len`], [`GemmDesc::c_len`]).
pub fn gemm_bf16(desc: &GemmDesc, a: &[bf16], b: &[bf16], c: &mut [bf16]) {
    gemm_half(desc, a, b, c, "bf16");
}

/// Computes `C[b] = op(A[b]) · op(B[b])` for `f16` storage with `f32`
/// accumulation, overwriting `c` with the `f32` result rounded to nearest-even.
///
/// # Panics
/// Panics if `a`, `b` or `c` does not have the length `desc` implies
/// ([`GemmDesc::a_len`], [`GemmDesc::b_len`], [`GemmDesc::c_len`]).
pub fn gemm_f16(desc: &GemmDesc, a: &[f16], b: &[f16], c: &mut [f16]) {
    gemm_half(desc, a, b, c, "f16");
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    const SIZES: [usize; 5] = [1, 3, 17, 65, 130];
    const TRANS: [(bool, bool); 4] = [(false, false), (false, true), (true, false), (true, true)];

    fn desc(batch: usize, m: usize, n: usize, k: usize, ta: bool, tb: bool, bb: bool) -> GemmDesc {
        GemmDesc { batch, m, n, k, trans_a: ta, trans_b: tb, broadcast_b: bb }
    }

    /// Uniform values in [-1, 1).
    fn random(len: usize, seed: u64) -> Vec<f64> {
        let mut rng = StdRng::seed_from_u64(seed);
        (0..len).map(|_| rng.gen_range(-1.0..1.0)).collect()
    }

    /// Naive triple loop in f64. Returns (C, sum over p of |A||B|) per
    /// element; the latter scales the error bounds so that cancellation in
    /// C does not make a relative tolerance meaningless.
    fn reference(d: &GemmDesc, a: &[f64], b: &[f64]) -> (Vec<f64>, Vec<f64>) {
        let (m, n, k) = (d.m, d.n, d.k);
        let mut c = vec![0.0; d.c_len()];
        let mut scale = vec![0.0; d.c_len()];
        for bi in 0..d.batch {
            let a = &a[bi * m * k..];
            let b = if d.broadcast_b { b } else { &b[bi * k * n..] };
            for i in 0..m {
                for j in 0..n {
                    let (mut acc, mut abs) = (0.0, 0.0);
                    for p in 0..k {
                        let x = if d.trans_a { a[p * m + i] } else { a[i * k + p] };
                        let y = if d.trans_b { b[j * k + p] } else { b[p * n + j] };
                        acc += x * y;
                        abs += (x * y).abs();
                    }
                    c[bi * m * n + i * n + j] = acc;
                    scale[bi * m * n + i * n + j] = abs;
                }
            }
        }
        (c, scale)
    }

    /// Runs one desc for every dtype against the f64 reference. C starts as
    /// NaN everywhere, so any read of C would show up as a failure.
    fn check_all_dtypes(d: &GemmDesc, seed: u64) {
        let a = random(d.a_len(), seed);
        let b = random(d.b_len(), seed ^ 0x9e37_79b9);
        let ctx = format!("{d:?}");

        // f32: inputs rounded to f32 first so only the product's error counts.
        let a32: Vec<f32> = a.iter().map(|&x| x as f32).collect();
        let b32: Vec<f32> = b.iter().map(|&x| x as f32).collect();
        let (want, scale) = reference(
            d,
            &a32.iter().map(|&x| x as f64).collect::<Vec<_>>(),
            &b32.iter().map(|&x| x as f64).collect::<Vec<_>>(),
        );
        let mut c32 = vec![f32::NAN; d.c_len()];
        gemm_f32(d, &a32, &b32, &mut c32);
        for (idx, (&got, (&w, &s))) in c32.iter().zip(want.iter().zip(&scale)).enumerate() {
            // k * eps32 ≈ 7.7e-6 at k = 130 bounds the worst-case error.
            let tol = 1e-5 * s;
            assert!((got as f64 - w).abs() <= tol, "f32 {ctx} at {idx}: got {got}, want {w}, tol {tol}");
        }

        // f64.
        let (want, scale) = reference(d, &a, &b);
        let mut c64 = vec![f64::NAN; d.c_len()];
        gemm_f64(d, &a, &b, &mut c64);
        for (idx, (&got, (&w, &s))) in c64.iter().zip(want.iter().zip(&scale)).enumerate() {
            let tol = 1e-12 * s;
            assert!((got - w).abs() <= tol, "f64 {ctx} at {idx}: got {got}, want {w}, tol {tol}");
        }

        check_half(d, &a, &b, bf16::from_f64, bf16::to_f64, gemm_bf16, "bf16");
        check_half(d, &a, &b, f16::from_f64, f16::to_f64, gemm_f16, "f16");
    }

    /// 16-bit check: the expected value is the exact product of the rounded
    /// inputs, rounded once. The f32 accumulation may move a near-tie across
    /// a rounding boundary, so allow ~1 ulp (relative 1e-2 covers one bf16 or
    /// f16 ulp) plus the f32 accumulation error for cancelling sums.
    #[allow(clippy::too_many_arguments)]
    fn check_half<T: Copy + std::fmt::Debug>(
        d: &GemmDesc,
        a: &[f64],
        b: &[f64],
        from: fn(f64) -> T,
        to: fn(T) -> f64,
        run: fn(&GemmDesc, &[T], &[T], &mut [T]),
        name: &str,
    ) {
        let ah: Vec<T> = a.iter().map(|&x| from(x)).collect();
        let bh: Vec<T> = b.iter().map(|&x| from(x)).collect();
        let (want, scale) = reference(
            d,
            &ah.iter().map(|&x| to(x)).collect::<Vec<_>>(),
            &bh.iter().map(|&x| to(x)).collect::<Vec<_>>(),
        );
        let mut c = vec![from(f64::NAN); d.c_len()];
        run(d, &ah, &bh, &mut c);
        for (idx, (&got, (&w, &s))) in c.iter().zip(want.iter().zip(&scale)).enumerate() {
            let w = to(from(w));
            let got = to(got);
            let tol = 1e-2 * w.abs() + 1e-5 * s;
            assert!((got - w).abs() <= tol, "{name} {d:?} at {idx}: got {got}, want {w}, tol {tol}");
        }
    }

    #[test]
    fn matches_reference_all_shapes_and_transposes() {
        let mut seed = 1;
        for &m in &SIZES {
            for &n in &SIZES {
                for &k in &SIZES {
                    for &(ta, tb) in &TRANS {
                        seed += 1;
                        check_all_dtypes(&desc(1, m, n, k, ta, tb, false), seed);
                    }
                }
            }
        }
    }

    #[test]
    fn matches_reference_batched_and_broadcast() {
        // Covers all three schedules: sequential single-threaded (tiny),
        // batch-parallel (many small products) and per-product parallel
        // (130^3 >= PRODUCT_PARALLEL_MIN_WORK).
        let shapes = [
            (3, 3, 17, 65),
            (4, 17, 1, 130),
            (5, 17, 65, 65),
            (3, 65, 130, 3),
            (6, 1, 65, 17),
            (2, 130, 3, 1),
            (7, 65, 17, 130),
            (2, 130, 130, 130),
        ];
        let mut seed = 1000;
        for &(batch, m, n, k) in &shapes {
            for &(ta, tb) in &TRANS {
                for bb in [false, true] {
                    seed += 1;
                    check_all_dtypes(&desc(batch, m, n, k, ta, tb, bb), seed);
                }
            }
        }
    }

    #[test]
    fn schedules_cover_all_paths() {
        assert_eq!(schedule(&desc(1, 3, 3, 3, false, false, false)), Schedule::Serial);
        assert_eq!(schedule(&desc(5, 17, 65, 65, false, false, false)), Schedule::BatchParallel);
        assert_eq!(schedule(&desc(2, 130, 130, 130, false, false, false)), Schedule::ProductParallel);
    }

    #[test]
    fn zero_sized_dims() {
        for &(ta, tb) in &TRANS {
            for bb in [false, true] {
                // k == 0: C = 0 even over NaN garbage.
                let d = desc(3, 4, 5, 0, ta, tb, bb);
                let mut c = vec![f32::NAN; d.c_len()];
                gemm_f32(&d, &[], &[], &mut c);
                assert!(c.iter().all(|&x| x.to_bits() == 0));
                let mut c = vec![f64::NAN; d.c_len()];
                gemm_f64(&d, &[], &[], &mut c);
                assert!(c.iter().all(|&x| x.to_bits() == 0));
                let mut c = vec![bf16::NAN; d.c_len()];
                gemm_bf16(&d, &[], &[], &mut c);
                assert!(c.iter().all(|&x| x.to_bits() == 0));
                let mut c = vec![f16::NAN; d.c_len()];
                gemm_f16(&d, &[], &[], &mut c);
                assert!(c.iter().all(|&x| x.to_bits() == 0));

                // m == 0, n == 0, batch == 0: nothing to write, inputs may
                // still be non-empty.
                for d in [desc(2, 0, 5, 3, ta, tb, bb), desc(2, 4, 0, 3, ta, tb, bb), desc(0, 4, 5, 3, ta, tb, bb)] {
                    let a = vec![1.0f32; d.a_len()];
                    let b = vec![1.0f32; d.b_len()];
                    let mut c = vec![0.0f32; d.c_len()];
                    assert!(c.is_empty());
                    gemm_f32(&d, &a, &b, &mut c);
                    let a: Vec<f16> = a.iter().map(|&x| f16::from_f32(x)).collect();
                    let b: Vec<f16> = b.iter().map(|&x| f16::from_f32(x)).collect();
                    gemm_f16(&d, &a, &b, &mut []);
                }
            }
        }
    }

    /// C full of NaN (and infinities) must be fully overwritten on every
    /// gemm path: the small-output kernel (m*n <= 256), k <= 2, both
    /// matrix-vector forms, the tiled kernel with several k blocks (k > 512,
    /// where later blocks accumulate into C) and the threaded path.
    #[test]
    fn nan_garbage_in_c_never_leaks() {
        let shapes = [
            (1, 4, 4, 9),
            (1, 17, 65, 2),
            (1, 1, 130, 65),
            (1, 130, 1, 65),
            (1, 65, 17, 1100),
            (3, 70, 70, 1100),
            (1, 130, 130, 130),
        ];
        for &(batch, m, n, k) in &shapes {
            for &(ta, tb) in &TRANS {
                let d = desc(batch, m, n, k, ta, tb, false);
                let a = random(d.a_len(), 7);
                let b = random(d.b_len(), 8);
                let mut c = vec![f64::NAN; d.c_len()];
                c.iter_mut().step_by(3).for_each(|x| *x = f64::INFINITY);
                gemm_f64(&d, &a, &b, &mut c);
                assert!(c.iter().all(|x| x.is_finite()), "f64 {d:?}");

                let a: Vec<f32> = a.iter().map(|&x| x as f32).collect();
                let b: Vec<f32> = b.iter().map(|&x| x as f32).collect();
                let mut c = vec![f32::NAN; d.c_len()];
                c.iter_mut().step_by(3).for_each(|x| *x = f32::NEG_INFINITY);
                gemm_f32(&d, &a, &b, &mut c);
                assert!(c.iter().all(|x| x.is_finite()), "f32 {d:?}");

                let ah: Vec<bf16> = a.iter().map(|&x| bf16::from_f32(x)).collect();
                let bh: Vec<bf16> = b.iter().map(|&x| bf16::from_f32(x)).collect();
                let mut c = vec![bf16::NAN; d.c_len()];
                gemm_bf16(&d, &ah, &bh, &mut c);
                assert!(c.iter().all(|x| x.is_finite()), "bf16 {d:?}");

                let ah: Vec<f16> = a.iter().map(|&x| f16::from_f32(x)).collect();
                let bh: Vec<f16> = b.iter().map(|&x| f16::from_f32(x)).collect();
                let mut c = vec![f16::NAN; d.c_len()];
                gemm_f16(&d, &ah, &bh, &mut c);
                assert!(c.iter().all(|x| x.is_finite()), "f16 {d:?}");
            }
        }
    }

    /// Copies `data` into a larger buffer at `offset`, so the same values sit
    /// at a different address (and a different alignment).
    fn placed<T: Copy>(data: &[T], offset: usize, fill: T) -> Vec<T> {
        let mut buf = vec![fill; data.len() + offset + 9];
        buf[offset..offset + data.len()].copy_from_slice(data);
        buf
    }

    /// Runs `run` with A, B and C placed at `offset` inside bigger buffers
    /// and returns C's bits.
    fn run_at<T: Copy>(
        d: &GemmDesc,
        a: &[T],
        b: &[T],
        offset: usize,
        garbage: T,
        run: fn(&GemmDesc, &[T], &[T], &mut [T]),
    ) -> Vec<T> {
        let abuf = placed(a, offset, garbage);
        let bbuf = placed(b, offset, garbage);
        let mut cbuf = vec![garbage; d.c_len() + offset + 9];
        run(d, &abuf[offset..offset + a.len()], &bbuf[offset..offset + b.len()], &mut cbuf[offset..offset + d.c_len()]);
        cbuf[offset..offset + d.c_len()].to_vec()
    }

    fn assert_deterministic<T: Copy + Send + Sync, B: PartialEq + std::fmt::Debug>(
        d: &GemmDesc,
        a: &[T],
        b: &[T],
        garbage: T,
        run: fn(&GemmDesc, &[T], &[T], &mut [T]),
        bits: fn(T) -> B,
        name: &str,
    ) {
        let as_bits = |v: Vec<T>| v.into_iter().map(bits).collect::<Vec<B>>();
        let first = as_bits(run_at(d, a, b, 0, garbage, run));
        for offset in [1, 7, 0, 3, 1, 7] {
            let again = as_bits(run_at(d, a, b, offset, garbage, run));
            assert!(first == again, "{name} {d:?}: offset {offset} changed bits");
        }
        // Thread count must not matter either: gemm only distributes output
        // tiles, and the batch split is per whole product.
        for threads in [1, 3] {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            let again = as_bits(pool.install(|| run_at(d, a, b, 7, garbage, run)));
            assert!(first == again, "{name} {d:?}: {threads} threads changed bits");
        }
    }

    #[test]
    fn bit_identical_across_offsets_runs_and_threads() {
        let shapes = [
            (1, 1, 130, 65, false),
            (1, 130, 1, 65, true),
            (1, 5, 7, 9, false),
            (6, 17, 65, 65, true),
            (3, 65, 17, 1100, false),
            (2, 130, 130, 130, true),
            (1, 200, 150, 300, false),
        ];
        for &(batch, m, n, k, bb) in &shapes {
            for &(ta, tb) in &TRANS {
                let d = desc(batch, m, n, k, ta, tb, bb);
                let a = random(d.a_len(), 11);
                let b = random(d.b_len(), 12);
                assert_deterministic(&d, &a, &b, f64::NAN, gemm_f64, f64::to_bits, "f64");
                let a: Vec<f32> = a.iter().map(|&x| x as f32).collect();
                let b: Vec<f32> = b.iter().map(|&x| x as f32).collect();
                assert_deterministic(&d, &a, &b, f32::NAN, gemm_f32, f32::to_bits, "f32");
                let ah: Vec<bf16> = a.iter().map(|&x| bf16::from_f32(x)).collect();
                let bh: Vec<bf16> = b.iter().map(|&x| bf16::from_f32(x)).collect();
                assert_deterministic(&d, &ah, &bh, bf16::NAN, gemm_bf16, bf16::to_bits, "bf16");
                let ah: Vec<f16> = a.iter().map(|&x| f16::from_f32(x)).collect();
                let bh: Vec<f16> = b.iter().map(|&x| f16::from_f32(x)).collect();
                assert_deterministic(&d, &ah, &bh, f16::NAN, gemm_f16, f16::to_bits, "f16");
            }
        }
    }

    #[test]
    fn large_half_conversion_is_parallel_and_correct() {
        // A, B and C all exceed CONVERT_CHUNK, exercising the chunked
        // parallel widening/rounding; checked against the reference.
        let d = desc(1, 300, 260, 260, false, true, false);
        assert!(d.a_len() > CONVERT_CHUNK && d.b_len() > CONVERT_CHUNK);
        assert!(d.c_len() > CONVERT_CHUNK);
        check_half(&d, &random(d.a_len(), 21), &random(d.b_len(), 22), bf16::from_f64, bf16::to_f64, gemm_bf16, "bf16");
    }

    #[test]
    #[should_panic(expected = "gemm_f32: slice lengths (A, B, C) = (6, 6, 5)")]
    fn wrong_c_length_panics() {
        // A (2*3) and B (3*2) are right; C should hold 2*2, not 5.
        let d = desc(1, 2, 2, 3, false, false, false);
        gemm_f32(&d, &[0.0; 6], &[0.0; 6], &mut [0.0; 5]);
    }

    #[test]
    #[should_panic(expected = "gemm_bf16: slice lengths")]
    fn wrong_b_length_panics_for_half() {
        let d = desc(2, 2, 2, 3, false, false, true);
        let a = vec![bf16::ZERO; d.a_len()];
        // Broadcast B needs k*n = 6, not batch*k*n = 12.
        let b = vec![bf16::ZERO; 12];
        let mut c = vec![bf16::ZERO; d.c_len()];
        gemm_bf16(&d, &a, &b, &mut c);
    }
}
