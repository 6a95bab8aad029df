//! The basic ops' CUDA kernels (fills, pointwise maps, casts, reductions,
//! movement, embedding, AdamW) against the CPU reference, on random inputs
//! from several seeds, every float dtype (and, for movement, i32, i64 and
//! bool) and odd shapes.
//!
//! Each test gathers its cases, one node each with every value in its own
//! bytes (as `session::run_op`), into one trace and one `CudaSession`, runs
//! it twice (the runs must agree bit for bit: no atomics) and compares every
//! output with `stepgraph_core::testing::run_op`; a batch that fails is
//! re-run case by case through `session::run_op` to name the culprit. The
//! same batch with every declared in-place pair sharing storage (as
//! `session::run_op_aliased`) must give the same bits as without.
//!
//! Tolerances: ops whose GPU formula is the CPU's sequence of correctly
//! rounded operations (binary maps, casts, fills, max, max_backward,
//! movement, embedding and its backward) must match bit for bit. Library
//! functions (exp, tanh, erf, pow) and summation order differ by rounding:
//! f32 1e-5, f64 1e-12, bf16 1e-2 (about one bf16 ulp), f16 2e-3, relative to
//! the largest magnitude of the output (for sums: of the summed |x|).
//! Run on a GPU machine with `scripts/gpu-test.sh`.

use stepgraph_core::host::HostTensor;
use stepgraph_core::ir::{Builder, DType, OutputKind, TensorType};
use stepgraph_core::ops::elementwise::{Binary, Cast, Full, Unary, UnaryBackward};
use stepgraph_core::ops::embedding::{Embedding, EmbeddingBackward};
use stepgraph_core::ops::movement::{Broadcast, Concat, Permute, Slice, SliceBackward};
use stepgraph_core::ops::optim::AdamW;
use stepgraph_core::ops::reduce::{MaxBackward, Reduce, ReduceKind};
use stepgraph_core::ops::{BinaryFn, Op, UnaryFn};
use stepgraph_core::plan::{plan, PlanOptions};
use stepgraph_core::testing::{draw_inputs, Arg};
use stepgraph_cuda::session::{CudaOptions, CudaSession};

const FLOATS: [DType; 4] = [DType::F32, DType::BF16, DType::F16, DType::F64];
const SEEDS: [u64; 2] = [1, 2];

// ---------------------------------------------------------------- harness

/// How a case's GPU outputs must match the CPU's.
#[derive(Clone)]
enum Cmp {
    Exact,
    /// Within the dtype's tolerance of the largest magnitude of each output.
    Close,
    /// Output 0 within `rtol * scale[i]` per element (sums: the summed |x|).
    Scaled(Vec<f64>, f64),
}

/// One op on fixed inputs.
struct Case {
    what: String,
    op: Op,
    inputs: Vec<HostTensor>,
    cmp: Cmp,
}

fn case(what: impl Into<String>, op: impl Into<Op>, inputs: Vec<HostTensor>, cmp: Cmp) -> Case {
    Case { what: what.into(), op: op.into(), inputs, cmp }
}

fn cpu(op: &Op, inputs: &[HostTensor]) -> Vec<HostTensor> {
    stepgraph_core::testing::run_op(op, inputs).unwrap_or_else(|e| panic!("{}: CPU run failed: {e}", op.name()))
}

/// Runs every case as one node of one trace on the GPU, every value in its
/// own bytes (`aliased`: each node's declared in-place pairs of matching
/// types share storage, the first pair per output and per input, as
/// `session::run_op_aliased` does for one op). One session per batch instead
/// of one per case keeps the test fast. The step runs `runs` times; every
/// run must give the same bits (no atomics). Returns each case's outputs.
fn try_batch(cases: &[Case], aliased: bool, runs: usize) -> Result<Vec<Vec<HostTensor>>, String> {
    let err = |e: &dyn std::fmt::Display| e.to_string();
    let mut b = Builder::new("gpu_basic");
    // The case of every trace output, in output order.
    let mut owner = Vec::new();
    for (c, k) in cases.iter().enumerate() {
        let ids = k
            .inputs
            .iter()
            .enumerate()
            .map(|(j, t)| b.input(&format!("c{c}_x{j}"), t.ty.clone()))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| err(&e))?;
        let outs = b.push(k.op.clone(), &ids).map_err(|e| format!("{}: {e}", k.what))?;
        for (j, &o) in outs.iter().enumerate() {
            b.output(OutputKind::Named(format!("c{c}_y{j}")), o);
            owner.push(c);
        }
    }
    let trace = b.finish("gpu_basic").map_err(|e| err(&e))?;
    let mut p = plan(&trace, PlanOptions { reuse: false }).map_err(|e| err(&e))?;
    if aliased {
        for node in &trace.nodes {
            let mut taken = vec![false; node.inputs.len()];
            let mut done = vec![false; node.outputs.len()];
            for (o, i) in node.op.inplace() {
                let (ov, iv) = (node.outputs[o], node.inputs[i]);
                if !done[o] && !taken[i] && trace.ty(ov) == trace.ty(iv) {
                    p.slots[ov.index()] = p.slots[iv.index()];
                    done[o] = true;
                    taken[i] = true;
                }
            }
        }
    }
    let mut s = CudaSession::new(trace.clone(), p, CudaOptions::default()).map_err(|e| err(&e))?;
    let mut first: Option<Vec<HostTensor>> = None;
    for run in 0..runs {
        for (c, k) in cases.iter().enumerate() {
            for (j, t) in k.inputs.iter().enumerate() {
                s.write_named(&format!("c{c}_x{j}"), t).map_err(|e| format!("{}: {e}", k.what))?;
            }
        }
        s.run_eager().map_err(|e| err(&e))?;
        let outs: Vec<HostTensor> =
            trace.outputs.iter().map(|o| s.read(o.value)).collect::<Result<_, _>>().map_err(|e| err(&e))?;
        match &first {
            None => first = Some(outs),
            Some(f) => {
                for (&c, (a, b)) in owner.iter().zip(f.iter().zip(&outs)) {
                    assert_exact(&format!("{}: run {run} against run 0", cases[c].what), b, a);
                }
            }
        }
    }
    let mut per_case: Vec<Vec<HostTensor>> = cases.iter().map(|_| Vec::new()).collect();
    for (&c, t) in owner.iter().zip(first.expect("at least one run")) {
        per_case[c].push(t);
    }
    Ok(per_case)
}

/// [`try_batch`], and when the batch fails, each case alone through
/// `session::run_op` (or `run_op_aliased`) to name the one that fails.
fn gpu_batch(cases: &[Case], aliased: bool, runs: usize) -> Vec<Vec<HostTensor>> {
    match try_batch(cases, aliased, runs) {
        Ok(outs) => outs,
        Err(batch_err) => {
            for k in cases {
                let r = if aliased {
                    stepgraph_cuda::session::run_op_aliased(&k.op, &k.inputs)
                } else {
                    stepgraph_cuda::session::run_op(&k.op, &k.inputs)
                };
                if let Err(e) = r {
                    panic!("{}: GPU run failed: {e}", k.what);
                }
            }
            panic!("a batch of {} cases failed ({batch_err}), though each case alone runs", cases.len());
        }
    }
}

/// Runs `cases` on the GPU (twice, which must agree bit for bit) and on the
/// CPU, and compares every output as the case asks. Returns the GPU outputs.
fn check_all(cases: &[Case]) -> Vec<Vec<HostTensor>> {
    let gpu = gpu_batch(cases, false, 2);
    for (k, g) in cases.iter().zip(&gpu) {
        let c = cpu(&k.op, &k.inputs);
        assert_eq!(g.len(), c.len(), "{}: output count", k.what);
        for (j, (g, c)) in g.iter().zip(&c).enumerate() {
            let what = format!("{} output {j} {}", k.what, c.ty);
            match &k.cmp {
                Cmp::Exact => assert_exact(&what, g, c),
                Cmp::Close => assert_close(&what, g, c, tol(c.ty.dtype)),
                Cmp::Scaled(scale, rtol) => assert_close_scaled(&what, g, c, scale, *rtol),
            }
        }
    }
    gpu
}

/// The cases with their in-place pairs sharing storage give the same bits
/// as `plain` (their out-of-place GPU outputs).
fn check_aliased(cases: &[Case], plain: &[Vec<HostTensor>]) {
    let aliased = gpu_batch(cases, true, 1);
    for (k, (a, p)) in cases.iter().zip(aliased.iter().zip(plain)) {
        for (j, (a, p)) in a.iter().zip(p).enumerate() {
            assert_exact(&format!("{} in place, output {j}", k.what), a, p);
        }
    }
}

/// Relative tolerance for results that differ only by rounding.
fn tol(dt: DType) -> f64 {
    match dt {
        DType::F32 => 1e-5,
        DType::F64 => 1e-12,
        DType::BF16 => 1e-2,
        DType::F16 => 2e-3,
        _ => 0.0,
    }
}

/// Same type and the same bits, except that any NaN equals any NaN (NaN
/// payloads of narrowing conversions are not specified).
fn assert_exact(what: &str, got: &HostTensor, want: &HostTensor) {
    assert_eq!(got.ty, want.ty, "{what}: type");
    if !want.ty.dtype.is_float() {
        assert!(got.bytes() == want.bytes(), "{what}: bytes differ");
        return;
    }
    let (g, w) = (got.to_f64(), want.to_f64());
    for (i, (a, b)) in g.iter().zip(&w).enumerate() {
        // Widening to f64 is exact and keeps the sign of zero, so equal bits
        // here are equal bits in the dtype.
        assert!(a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()), "{what}: element {i}: GPU {a:e}, CPU {b:e}");
    }
}

/// Same type, NaN and infinities in the same places, and every finite
/// element within `rtol * scale[i]`.
fn assert_close_scaled(what: &str, got: &HostTensor, want: &HostTensor, scale: &[f64], rtol: f64) {
    assert_eq!(got.ty, want.ty, "{what}: type");
    let (g, w) = (got.to_f64(), want.to_f64());
    let mut worst = (0.0f64, 0usize);
    for (i, (a, b)) in g.iter().zip(&w).enumerate() {
        if b.is_nan() || a.is_nan() {
            assert!(a.is_nan() && b.is_nan(), "{what}: element {i}: GPU {a:e}, CPU {b:e}");
            continue;
        }
        if b.is_infinite() || a.is_infinite() {
            assert_eq!(a, b, "{what}: element {i}");
            continue;
        }
        let err = (a - b).abs() / scale[i].max(1e-30);
        if err > worst.0 {
            worst = (err, i);
        }
    }
    let i = worst.1;
    assert!(
        worst.0 <= rtol,
        "{what}: element {i} differs by {:e} (relative), over {rtol:e}: GPU {:e}, CPU {:e}",
        worst.0,
        g[i],
        w[i]
    );
}

/// Within `rtol` of the largest finite magnitude of `want`.
fn assert_close(what: &str, got: &HostTensor, want: &HostTensor, rtol: f64) {
    let scale = want.to_f64().iter().filter(|x| x.is_finite()).fold(0.0f64, |m, x| m.max(x.abs()));
    assert_close_scaled(what, got, want, &vec![scale; want.ty.numel()], rtol);
}

fn tensor(dtype: DType, shape: &[usize], data: &[f64]) -> HostTensor {
    HostTensor::from_f64(TensorType::new(dtype, shape.to_vec()), data)
}

fn normal(shape: &[usize], dtype: DType, seed: u64) -> HostTensor {
    draw_inputs(&[Arg::Normal(shape.to_vec())], dtype, seed).remove(0)
}

fn positive(shape: &[usize], dtype: DType, seed: u64) -> HostTensor {
    draw_inputs(&[Arg::Positive(shape.to_vec())], dtype, seed).remove(0)
}

fn ids(dtype: DType, shape: &[usize], max: i64, seed: u64) -> HostTensor {
    draw_inputs(&[Arg::Ids { dtype, shape: shape.to_vec(), max }], DType::F32, seed).remove(0)
}

// ---------------------------------------------------------------- pointwise

#[test]
#[ignore = "needs an NVIDIA GPU: scripts/gpu-test.sh"]
fn full_fills_every_dtype_exactly() {
    let mut cases = Vec::new();
    for dt in FLOATS {
        // +0.0 lowers to a memset, the rest to the fill kernel (1e-3 and 0.1
        // round through f32 to bf16/f16, as on the CPU).
        for value in [0.0, -0.0, 1.5, 1e-3, 0.1, -7.25e3, f64::INFINITY, f64::NAN] {
            for shape in [&[][..], &[1], &[17], &[3, 1031]] {
                let op = Full { value, ty: TensorType::new(dt, shape.to_vec()) };
                cases.push(case(format!("full {value} {dt}{shape:?}"), op, vec![], Cmp::Exact));
            }
        }
    }
    check_all(&cases);
}

/// Every UnaryFn, with whether it needs positive inputs.
fn unary_fns() -> Vec<(UnaryFn, bool)> {
    vec![
        (UnaryFn::Neg, false),
        (UnaryFn::Exp, false),
        (UnaryFn::Log, true),
        (UnaryFn::Sqrt, true),
        (UnaryFn::Rsqrt, true),
        (UnaryFn::Tanh, false),
        (UnaryFn::Sigmoid, false),
        (UnaryFn::Silu, false),
        (UnaryFn::GeluTanh, false),
        (UnaryFn::GeluErf, false),
        (UnaryFn::Pow(2.0), false),
        (UnaryFn::Pow(3.0), false),
        (UnaryFn::Pow(0.5), true),
        (UnaryFn::Pow(-1.5), true),
    ]
}

const POINTWISE_SHAPES: [&[usize]; 5] = [&[], &[1], &[3], &[17], &[5, 211]];

fn unary_cases(backward: bool) -> Vec<Case> {
    let mut cases = Vec::new();
    for (f, pos) in unary_fns() {
        for dt in FLOATS {
            for (k, shape) in POINTWISE_SHAPES.iter().enumerate() {
                for seed in SEEDS {
                    let seed = seed * 10 + k as u64 + backward as u64 * 1000;
                    let x = if pos { positive(shape, dt, seed) } else { normal(shape, dt, seed) };
                    if backward {
                        let gy = normal(shape, dt, seed + 500);
                        let what = format!("{} {dt}{shape:?} seed {seed}", f.backward_name());
                        cases.push(case(what, UnaryBackward { f }, vec![x, gy], Cmp::Close));
                    } else {
                        let what = format!("{} {dt}{shape:?} seed {seed}", f.name());
                        cases.push(case(what, Unary { f }, vec![x], Cmp::Close));
                    }
                }
            }
        }
    }
    cases
}

#[test]
#[ignore = "needs an NVIDIA GPU: scripts/gpu-test.sh"]
fn unary_matches_cpu_and_runs_in_place() {
    let cases = unary_cases(false);
    let plain = check_all(&cases);
    check_aliased(&cases, &plain);
}

#[test]
#[ignore = "needs an NVIDIA GPU: scripts/gpu-test.sh"]
fn unary_backward_matches_cpu_and_runs_in_place() {
    // In place, the cotangent's storage becomes the output's.
    let cases = unary_cases(true);
    let plain = check_all(&cases);
    check_aliased(&cases, &plain);
}

#[test]
#[ignore = "needs an NVIDIA GPU: scripts/gpu-test.sh"]
fn binary_broadcasts_exactly_and_runs_in_place() {
    // (a, b): same shape, trailing broadcast either way, outer products,
    // scalars, rank 3 and 4 with broadcasts in the middle. In place, the
    // output takes a's storage when a has its shape, else b's, else none.
    let shapes: [(&[usize], &[usize]); 10] = [
        (&[], &[]),
        (&[1031], &[1031]),
        (&[4, 5], &[5]),
        (&[5], &[4, 5]),
        (&[4, 1], &[1, 5]),
        (&[2, 3, 17], &[]),
        (&[], &[3]),
        (&[7, 1, 9], &[1, 8, 1]),
        (&[2, 1, 3, 4], &[1, 5, 1, 4]),
        (&[6, 1, 33], &[6, 16, 33]),
    ];
    let mut cases = Vec::new();
    for f in [BinaryFn::Add, BinaryFn::Sub, BinaryFn::Mul, BinaryFn::Div] {
        for dt in FLOATS {
            for (k, (sa, sb)) in shapes.iter().enumerate() {
                let seed = k as u64;
                let inputs = vec![normal(sa, dt, seed), normal(sb, dt, seed + 50)];
                // One correctly rounded operation in acc_t and one rounding to storage: exact.
                cases.push(case(format!("{} {dt} {sa:?} {sb:?}", f.name()), Binary { f }, inputs, Cmp::Exact));
            }
        }
    }
    let plain = check_all(&cases);
    check_aliased(&cases, &plain);
}

#[test]
#[ignore = "needs an NVIDIA GPU: scripts/gpu-test.sh"]
fn cast_is_exact_between_every_pair() {
    // Rounding ties for bf16 and f16 (and f64 values just off an f32 tie,
    // which f64 -> f32 -> bf16 rounds twice, as the CPU does), f16 overflow
    // and subnormals, f32 overflow, signed zero, infinities and NaN.
    let special = [
        0.0,
        -0.0,
        1.0,
        1.00390625,
        1.01171875,
        1.0 + 2f64.powi(-11),
        1.0 + 3.0 * 2f64.powi(-11),
        1.0 + 2f64.powi(-24),
        1.0 + 2f64.powi(-24) + 2f64.powi(-40),
        1.00390625 + 2f64.powi(-30),
        65504.0,
        65520.0,
        1e5,
        6e-8,
        1e-8,
        1e-40,
        3.4e38,
        1e39,
        -2.5e-3,
        f64::INFINITY,
        f64::NEG_INFINITY,
        f64::NAN,
    ];
    let mut cases = Vec::new();
    for src in FLOATS {
        for dst in FLOATS {
            let what = format!("cast {src} -> {dst}");
            let x = tensor(src, &[special.len()], &special);
            cases.push(case(format!("{what} special values"), Cast { dtype: dst }, vec![x], Cmp::Exact));
            for (k, shape) in [&[][..], &[3], &[17, 61]].iter().enumerate() {
                let x = normal(shape, src, k as u64);
                cases.push(case(format!("{what} {shape:?}"), Cast { dtype: dst }, vec![x], Cmp::Exact));
            }
        }
    }
    check_all(&cases);
}

// ---------------------------------------------------------------- reductions

/// (shape, axes): the innermost axis reduced with short rows (a warp per
/// output) and long rows (a block per output, wide when outputs are few),
/// the innermost kept (column layout), first/middle/last/all/non-adjacent
/// axes, size-1 axes, no axes at all.
fn reduce_shapes() -> Vec<(Vec<usize>, Vec<usize>)> {
    let c = |s: &[usize], a: &[usize]| (s.to_vec(), a.to_vec());
    vec![
        c(&[1], &[0]),
        c(&[17], &[0]),
        c(&[1031], &[0]),
        c(&[5000], &[0]),
        c(&[33, 17], &[1]),
        c(&[1000, 3], &[1]),
        c(&[5, 1000], &[1]),
        c(&[300, 300], &[1]),
        c(&[3, 4100], &[1]),
        c(&[1000, 7], &[0]),
        c(&[3, 700], &[0]),
        c(&[3, 5, 7], &[0]),
        c(&[3, 5, 7], &[1]),
        c(&[3, 5, 7], &[2]),
        c(&[3, 5, 7], &[0, 2]),
        c(&[8, 9, 10], &[0, 1, 2]),
        c(&[2, 3, 4, 5], &[1, 3]),
        c(&[4, 6, 8, 10], &[0, 2]),
        c(&[2, 3, 4, 5], &[0, 1, 2]),
        c(&[3, 1, 5], &[1]),
        c(&[3, 1, 5], &[0, 1]),
        c(&[3, 4], &[]),
        c(&[], &[]),
    ]
}

/// Σ|x| (mean |x| for a mean) of every output group: the scale of the
/// rounding differences a different summation order makes.
fn abs_reduce(kind: ReduceKind, x: &HostTensor, axes: &[usize], keepdim: bool) -> Vec<f64> {
    let abs: Vec<f64> = x.to_f64().iter().map(|v| v.abs()).collect();
    let xa = HostTensor::from_f64(x.ty.with_dtype(DType::F64), &abs);
    cpu(&Op::from(Reduce { kind, axes: axes.to_vec(), keepdim }), &[xa]).remove(0).to_f64()
}

#[test]
#[ignore = "needs an NVIDIA GPU: scripts/gpu-test.sh"]
fn reductions_match_cpu_over_any_axes() {
    let mut cases = Vec::new();
    for (shape, axes) in reduce_shapes() {
        for dt in FLOATS {
            for keepdim in [false, true] {
                let x = normal(&shape, dt, shape.len() as u64 * 2 + keepdim as u64);
                for kind in [ReduceKind::Sum, ReduceKind::Mean, ReduceKind::Max] {
                    let op = Reduce { kind, axes: axes.clone(), keepdim };
                    let what = format!("{} {dt}{shape:?} axes {axes:?} keepdim {keepdim}", Op::from(op.clone()).name());
                    // max picks an element: exact. Sums differ in order only.
                    let cmp = match kind {
                        ReduceKind::Max => Cmp::Exact,
                        _ => Cmp::Scaled(abs_reduce(kind, &x, &axes, keepdim), tol(dt)),
                    };
                    cases.push(case(what, op, vec![x.clone()], cmp));
                }
            }
        }
    }
    check_all(&cases);
}

/// Values on a coarse grid, so that groups hold many ties for the max.
fn tied(shape: &[usize], dt: DType, seed: u64) -> HostTensor {
    let x = normal(shape, DType::F64, seed).to_f64();
    tensor(dt, shape, &x.iter().map(|v| (v * 1.5).round()).collect::<Vec<_>>())
}

#[test]
#[ignore = "needs an NVIDIA GPU: scripts/gpu-test.sh"]
fn max_backward_shares_ties_exactly() {
    let mut cases = Vec::new();
    for (shape, axes) in reduce_shapes() {
        for dt in FLOATS {
            for ties in [false, true] {
                let seed = 7 + ties as u64;
                let x = if ties { tied(&shape, dt, seed) } else { normal(&shape, dt, seed) };
                let max = Op::from(Reduce { kind: ReduceKind::Max, axes: axes.clone(), keepdim: true });
                let y = cpu(&max, std::slice::from_ref(&x)).remove(0);
                let g = normal(&y.ty.shape, dt, seed + 1);
                let what = format!("max_backward {dt}{shape:?} axes {axes:?} ties {ties}");
                cases.push(case(what, MaxBackward { axes: axes.clone() }, vec![x, y, g], Cmp::Exact));
            }
        }
    }
    check_all(&cases);
}

// ---------------------------------------------------------------- movement

/// Movement copies bits: floats of every width plus i32, i64 and bool.
const MOVEMENT_DTYPES: [DType; 7] =
    [DType::F32, DType::BF16, DType::F16, DType::F64, DType::I32, DType::I64, DType::Bool];

fn movement_input(shape: &[usize], dt: DType, seed: u64) -> HostTensor {
    match dt {
        DType::I32 | DType::I64 => ids(dt, shape, 1 << 30, seed),
        DType::Bool => {
            let n: usize = shape.iter().product();
            let bits: Vec<f64> = (0..n).map(|i| (i as u64 * 7 + seed).is_multiple_of(3) as u8 as f64).collect();
            tensor(dt, shape, &bits)
        }
        _ => normal(shape, dt, seed),
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: scripts/gpu-test.sh"]
fn broadcast_is_exact() {
    // Scalars, trailing and middle broadcasts, rows of 16-byte multiples
    // (copied in wide units) and odd ones.
    let shapes: [(&[usize], &[usize]); 10] = [
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
    ];
    let mut cases = Vec::new();
    for dt in MOVEMENT_DTYPES {
        for (k, (from, to)) in shapes.iter().enumerate() {
            let op = Broadcast { shape: to.to_vec() };
            let x = movement_input(from, dt, k as u64);
            cases.push(case(format!("broadcast {dt}{from:?} -> {to:?}"), op, vec![x], Cmp::Exact));
        }
    }
    check_all(&cases);
}

#[test]
#[ignore = "needs an NVIDIA GPU: scripts/gpu-test.sh"]
fn permute_is_exact_up_to_rank_8() {
    let shapes: [(&[usize], &[usize]); 11] = [
        (&[], &[]),
        (&[17], &[0]),
        (&[3, 5], &[1, 0]),
        (&[4, 8, 16], &[1, 0, 2]),
        (&[4, 8, 16], &[2, 1, 0]),
        (&[2, 3, 4, 5], &[0, 2, 1, 3]),
        (&[2, 16, 4, 64], &[0, 2, 1, 3]),
        (&[3, 1, 7, 2], &[3, 2, 1, 0]),
        (&[2, 3, 2, 3, 2], &[4, 0, 3, 1, 2]),
        (&[2, 2, 3, 2, 2, 3], &[5, 3, 1, 0, 2, 4]),
        (&[2, 3, 2, 2, 3, 2, 2, 3], &[7, 6, 5, 4, 3, 2, 1, 0]),
    ];
    let mut cases = Vec::new();
    for dt in MOVEMENT_DTYPES {
        for (k, (shape, perm)) in shapes.iter().enumerate() {
            let op = Permute { perm: perm.to_vec() };
            let x = movement_input(shape, dt, k as u64);
            cases.push(case(format!("permute {dt}{shape:?} {perm:?}"), op, vec![x], Cmp::Exact));
        }
    }
    check_all(&cases);
}

#[test]
#[ignore = "needs an NVIDIA GPU: scripts/gpu-test.sh"]
fn slice_and_its_backward_are_exact() {
    // (shape, axis, start, end): element-wide copies and 16-byte ones, the
    // whole axis, one element, first/middle/last axes.
    let slices: [(&[usize], usize, usize, usize); 9] = [
        (&[17], 0, 3, 11),
        (&[1031], 0, 0, 1031),
        (&[3, 17], 1, 5, 12),
        (&[4, 64], 1, 16, 48),
        (&[4, 64], 0, 1, 3),
        (&[2, 3, 5, 7], 2, 1, 4),
        (&[2, 3, 5, 8], 3, 0, 4),
        (&[5, 3, 24], 1, 2, 3),
        (&[6, 2, 8], 2, 7, 8),
    ];
    let mut cases = Vec::new();
    for dt in MOVEMENT_DTYPES {
        for (k, (shape, axis, start, end)) in slices.iter().enumerate() {
            let (axis, start, end) = (*axis, *start, *end);
            let what = format!("slice {dt}{shape:?} axis {axis} {start}..{end}");
            let x = movement_input(shape, dt, k as u64);
            cases.push(case(what.clone(), Slice { axis, start, end }, vec![x], Cmp::Exact));
            let mut gs = shape.to_vec();
            gs[axis] = end - start;
            let g = movement_input(&gs, dt, k as u64 + 100);
            let op = SliceBackward { axis, start, size: shape[axis] };
            cases.push(case(format!("{what} backward"), op, vec![g], Cmp::Exact));
        }
    }
    check_all(&cases);
}

#[test]
#[ignore = "needs an NVIDIA GPU: scripts/gpu-test.sh"]
fn concat_is_exact() {
    // (shapes of the parts, axis)
    let parts: [(&[&[usize]], usize); 7] = [
        (&[&[17]], 0),
        (&[&[3], &[17], &[1]], 0),
        (&[&[2, 3], &[4, 3]], 0),
        (&[&[4, 8], &[4, 24], &[4, 8]], 1),
        (&[&[3, 5], &[3, 1], &[3, 7]], 1),
        (&[&[2, 1, 6], &[2, 3, 6], &[2, 2, 6], &[2, 5, 6]], 1),
        (&[&[2, 3, 64], &[2, 3, 64], &[2, 3, 64]], 2),
    ];
    let mut cases = Vec::new();
    for dt in MOVEMENT_DTYPES {
        for (k, (shapes, axis)) in parts.iter().enumerate() {
            let xs: Vec<HostTensor> =
                shapes.iter().enumerate().map(|(j, s)| movement_input(s, dt, (k * 10 + j) as u64)).collect();
            cases.push(case(format!("concat {dt} {shapes:?} axis {axis}"), Concat { axis: *axis }, xs, Cmp::Exact));
        }
    }
    check_all(&cases);
}

// ---------------------------------------------------------------- embedding

/// (ids shape, table rows, width): narrow and wide rows, rows of 16-byte
/// multiples, a width needing two column passes in the backward (5000 >
/// 512 threads x 8 columns), more ids than one scan tile, ids repeated
/// many times.
fn embedding_shapes() -> Vec<(Vec<usize>, usize, usize)> {
    vec![
        (vec![1], 1, 1),
        (vec![7], 5, 3),
        (vec![2, 37], 50, 24),
        (vec![4, 16], 11, 64),
        (vec![3000], 7, 8),
        (vec![300], 40, 1000),
        (vec![2, 50], 9, 5000),
    ]
}

#[test]
#[ignore = "needs an NVIDIA GPU: scripts/gpu-test.sh"]
fn embedding_gathers_rows_exactly() {
    let mut cases = Vec::new();
    for (ids_shape, rows, width) in embedding_shapes() {
        for id_dt in [DType::I32, DType::I64] {
            for dt in FLOATS {
                for seed in SEEDS {
                    let i = ids(id_dt, &ids_shape, rows as i64, seed);
                    let table = normal(&[rows, width], dt, seed + 20);
                    let what = format!("embedding {id_dt}{ids_shape:?} table {dt}[{rows}, {width}] seed {seed}");
                    cases.push(case(what, Embedding, vec![i, table], Cmp::Exact));
                }
            }
        }
    }
    check_all(&cases);
}

#[test]
#[ignore = "needs an NVIDIA GPU: scripts/gpu-test.sh"]
fn embedding_backward_sums_repeated_ids_exactly() {
    let mut cases = Vec::new();
    for (ids_shape, rows, width) in embedding_shapes() {
        for id_dt in [DType::I32, DType::I64] {
            for dt in FLOATS {
                for seed in SEEDS {
                    // Ids from the first half of the rows only: the others must come out zero.
                    let i = ids(id_dt, &ids_shape, rows.div_ceil(2) as i64, seed);
                    let mut gs = ids_shape.clone();
                    gs.push(width);
                    let gy = normal(&gs, dt, seed + 30);
                    let what = format!("embedding_backward {id_dt}{ids_shape:?} {dt}[{rows}, {width}] seed {seed}");
                    // Each row sums its positions in ascending order in acc_t, as the CPU.
                    cases.push(case(what, EmbeddingBackward { num_rows: rows }, vec![i, gy], Cmp::Exact));
                }
            }
        }
    }
    check_all(&cases);
}

/// Ids outside the table cannot be reported by a kernel: the session checks
/// step inputs on the host. A single op run (raw writes) may refuse them or
/// run the kernels, which must then stay in bounds: a zero row forward, no
/// contribution backward.
#[test]
#[ignore = "needs an NVIDIA GPU: scripts/gpu-test.sh"]
fn embedding_kernels_stay_in_bounds_for_bad_ids() {
    let (rows, width) = (6, 10);
    let raw = [0.0, -1.0, 5.0, 6.0, 2.0, 1e6, 2.0, -7.0];
    let valid = |id: f64| id >= 0.0 && id < rows as f64;
    let table = normal(&[rows, width], DType::F32, 3);
    let gy = normal(&[raw.len(), width], DType::F32, 4);
    for id_dt in [DType::I32, DType::I64] {
        let i = tensor(id_dt, &[raw.len()], &raw);
        if let Ok(y) = stepgraph_cuda::session::run_op(&Op::from(Embedding), &[i.clone(), table.clone()]) {
            let (y, t) = (y[0].to_f64(), table.to_f64());
            for (p, &id) in raw.iter().enumerate() {
                for c in 0..width {
                    let want = if valid(id) { t[id as usize * width + c] } else { 0.0 };
                    assert_eq!(y[p * width + c], want, "embedding {id_dt}: position {p} (id {id}) column {c}");
                }
            }
        }
        let op = Op::from(EmbeddingBackward { num_rows: rows });
        if let Ok(gt) = stepgraph_cuda::session::run_op(&op, &[i.clone(), gy.clone()]) {
            let g = gy.to_f64();
            let mut want = vec![0.0f64; rows * width];
            for (p, &id) in raw.iter().enumerate().filter(|(_, &id)| valid(id)) {
                for c in 0..width {
                    want[id as usize * width + c] += g[p * width + c];
                }
            }
            let want = tensor(DType::F32, &[rows, width], &want);
            assert_close(&format!("embedding_backward {id_dt} with bad ids"), &gt[0], &want, 1e-6);
        }
    }
}

// ---------------------------------------------------------------- AdamW

fn scalar(dt: DType, x: f64) -> HostTensor {
    tensor(dt, &[], &[x])
}

/// (parameter dtype, first moment, second moment, lr and step dtype)
const ADAMW_TYPES: [(DType, DType, DType, DType); 8] = [
    (DType::F32, DType::F32, DType::F32, DType::F32),
    (DType::BF16, DType::BF16, DType::BF16, DType::F32),
    (DType::BF16, DType::F32, DType::F32, DType::F32),
    (DType::BF16, DType::F32, DType::BF16, DType::F32),
    (DType::F16, DType::F16, DType::F32, DType::F32),
    (DType::F16, DType::F32, DType::F32, DType::F64),
    (DType::F64, DType::F64, DType::F64, DType::F64),
    (DType::F64, DType::F32, DType::F32, DType::F32),
];

/// Three AdamW steps of every dtype combination against the CPU, each side
/// carrying its own state forward; each step also in place.
#[test]
#[ignore = "needs an NVIDIA GPU: scripts/gpu-test.sh"]
fn adamw_three_steps_match_cpu_and_run_in_place() {
    let hypers = [
        AdamW::default(),
        // 1 - beta1 >= 0.5 takes lerp's other branch; larger decay and eps.
        AdamW { beta1: 0.3, beta2: 0.95, eps: 1e-6, weight_decay: 0.1 },
    ];
    let shapes: [&[usize]; 4] = [&[], &[1], &[17], &[33, 65]];
    // (label, op, lr/step dtype, CPU state, GPU state) per configuration.
    let mut configs = Vec::new();
    for (pt, mt, vt, st) in ADAMW_TYPES {
        for (h, hyper) in hypers.iter().enumerate() {
            for (k, shape) in shapes.iter().enumerate() {
                let seed = (h * 10 + k) as u64;
                let p0 = normal(shape, pt, seed);
                // Zero state (a first step) with the default hyperparameters, random state otherwise.
                let (m0, v0) = if h == 0 {
                    (
                        HostTensor::zeros(TensorType::new(mt, shape.to_vec())),
                        HostTensor::zeros(TensorType::new(vt, shape.to_vec())),
                    )
                } else {
                    (normal(shape, mt, seed + 1), positive(shape, vt, seed + 2))
                };
                let label = format!("adamw p {pt} m {mt} v {vt} scalars {st} hyper {h} {shape:?}");
                let state = vec![p0, m0, v0];
                configs.push((label, Op::from(hyper.clone()), st, state.clone(), state));
            }
        }
    }
    for (step, lr) in [(1.0, 1e-3), (2.0, 5e-4), (3.0, 2e-2)] {
        let mut cases = Vec::new();
        let mut cpu_inputs = Vec::new();
        for (n, (label, op, st, cs, gs)) in configs.iter().enumerate() {
            let grad = normal(&gs[0].ty.shape, gs[0].ty.dtype, 1000 * step as u64 + n as u64);
            let args = |s: &[HostTensor]| {
                vec![s[0].clone(), grad.clone(), s[1].clone(), s[2].clone(), scalar(*st, lr), scalar(*st, step)]
            };
            cases.push(case(format!("{label} step {step}"), op.clone(), args(gs), Cmp::Close));
            cpu_inputs.push(args(cs));
        }
        let gpu = gpu_batch(&cases, false, 1);
        for ((k, g), (config, ci)) in cases.iter().zip(&gpu).zip(configs.iter_mut().zip(&cpu_inputs)) {
            let c = cpu(&k.op, ci);
            for (j, name) in ["p", "m", "v"].iter().enumerate() {
                assert_close(&format!("{}: {name}", k.what), &g[j], &c[j], tol(c[j].ty.dtype));
            }
            (config.3, config.4) = (c, g.clone());
        }
        // p, m and v each in their own input's storage.
        check_aliased(&cases, &gpu);
    }
}

/// lr < 0 or step < 1 is refused by the host in a step; should a single op
/// run let it through, the kernel leaves the state unchanged.
#[test]
#[ignore = "needs an NVIDIA GPU: scripts/gpu-test.sh"]
fn adamw_with_invalid_scalars_leaves_the_state_unchanged() {
    let shape = [3, 7];
    let op = Op::from(AdamW::default());
    for (lr, step) in [(-1e-3, 1.0), (1e-3, 0.0), (f64::NAN, 1.0), (1e-3, f64::INFINITY)] {
        let inputs = vec![
            normal(&shape, DType::F32, 1),
            normal(&shape, DType::F32, 2),
            normal(&shape, DType::F32, 3),
            positive(&shape, DType::F32, 4),
            scalar(DType::F32, lr),
            scalar(DType::F32, step),
        ];
        if let Ok(out) = stepgraph_cuda::session::run_op(&op, &inputs) {
            for (j, i) in [(0, 0), (1, 2), (2, 3)] {
                assert_exact(&format!("adamw lr {lr} step {step}: output {j}"), &out[j], &inputs[i]);
            }
        }
    }
}
