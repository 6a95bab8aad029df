//! Every op's samples (`stepgraph_core::ops::samples_by_op`) on the CUDA
//! backend against the CPU reference (`stepgraph_core::testing::run_op`),
//! in every float dtype, on two seeds (one for large samples); plus the
//! basic ops' special cases: fills of every special value, ids outside the
//! embedding table, AdamW over three steps carrying its state, and AdamW
//! with invalid scalars. Collectives need a group session: `gpu_dist.rs`
//! covers them.
//!
//! The sweep gathers an op's samples of one dtype and seed, one node each
//! with every value in its own bytes (as `testing::run_op`), into one trace
//! and one `CudaSession`, runs it twice (the runs must agree bit for bit:
//! no atomics) and compares every output with the CPU; a batch that fails
//! is re-run case by case through `testing::run_op` to name the culprit.
//! The same batch with every declared in-place pair sharing storage (as
//! `testing::run_op_aliased`) must give the same bits as without.
//!
//! Tolerances ([`comparison`], by op kind and output dtype): ops whose GPU
//! formula is the CPU's sequence of correctly rounded operations (binary
//! maps, casts, fills, max, max_backward, movement, embedding and its
//! backward, dropout, NF4 dequantization) must match bit for bit. Library functions (exp, tanh, erf,
//! pow) and summation order differ by rounding: f32 1e-5, f64 1e-12, bf16
//! 1e-2 (about one bf16 ulp), f16 2e-3, relative to the largest magnitude
//! of the output (for sums: of the summed |x|). The row-wise network ops
//! use f64 1e-11 and widen f32 and f64 by √(n/1024) for reductions over
//! n > 1024 elements, since the CPU adds rows serially and its own rounding
//! error grows with the row. Attention uses the tolerances of its kernels'
//! arithmetic (see [`attention_tol`]); cached attention's split partials
//! are scaled per split (see [`cached_attention_cmp`]). The generation ops'
//! cache writes and sampled tokens must match exactly.
//!
//! An output that is a difference of terms that (nearly) cancel has a
//! rounding error set by the terms, not by the result: the norms' input
//! gradient (RMSNorm: `rstd·w·gy·eps/(x² + eps)` on rows of one element;
//! LayerNorm: `rstd·(g − mean(g))`). For those outputs each element may
//! also differ by [`TERM_ROUNDINGS`] roundings of the arithmetic's unit
//! roundoff times the sum of the magnitudes of its terms, computed in f64
//! from the inputs ([`rms_gx_terms`], [`ln_gx_terms`]). Where nothing
//! cancels, that floor adds at most about 15% to the f32 tolerance (rows
//! of 7 elements), about 5% for rows of 33 to 128 and under 3% for longer
//! rows; in the other dtypes it adds about 1e-4 of the tolerance.
//!
//! Run on a GPU machine with `scripts/gpu-test.sh`.

use stepgraph_core::host::HostTensor;
use stepgraph_core::ir::{Builder, DType, OutputKind, TensorType};
use stepgraph_core::ops::elementwise::Full;
use stepgraph_core::ops::embedding::{Embedding, EmbeddingBackward};
use stepgraph_core::ops::fp8::Fp8Format;
use stepgraph_core::ops::norm::{LN_ADDEND, RMS_ADDEND};
use stepgraph_core::ops::optim::{AdamW, MasterWeights};
use stepgraph_core::ops::reduce::{Reduce, ReduceKind};
use stepgraph_core::ops::sample::FLOAT_DTYPES;
use stepgraph_core::ops::{samples_by_op, stat_dtype, Op, Sample};
use stepgraph_core::plan::{plan, PlanOptions};
use stepgraph_core::testing::draw_sample;
use stepgraph_cuda::launch::DevTensor;
use stepgraph_cuda::session::{CudaOptions, CudaSession};
use stepgraph_cuda::CudaError;

mod common;
use common::{attention_grad_tol, attention_tol, basic_tol, normal, positive, row_tol, scalar, tensor};

const FLOATS: [DType; 4] = FLOAT_DTYPES;

// ---------------------------------------------------------------- harness

/// How a case's GPU outputs must match the CPU's.
#[derive(Clone)]
enum Cmp {
    Exact,
    /// Output `k` within tolerance `k`.
    Close(Vec<Tol>),
}

/// A tolerance of one output: element `i` may differ by
/// `rtol · scale_i + floor_i`.
#[derive(Clone)]
struct Tol {
    rtol: f64,
    scale: Scale,
    /// Absolute allowance per element (empty: none), for cancelling outputs.
    floor: Vec<f64>,
}

#[derive(Clone)]
enum Scale {
    /// The largest finite |cpu| of the output, at least `min`.
    MaxAbs { min: f64 },
    /// Per element (sums: the summed |x|).
    PerElement(Vec<f64>),
}

impl Tol {
    /// `rtol` of the largest finite |cpu|.
    fn of(rtol: f64) -> Tol {
        Tol { rtol, scale: Scale::MaxAbs { min: 1e-30 }, floor: Vec::new() }
    }
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
/// `testing::run_op_aliased` does for one op). One session per batch instead
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
    let mut p = plan(&trace, PlanOptions { reuse: false, ..PlanOptions::default() }).map_err(|e| err(&e))?;
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
    let mut s = CudaSession::new(trace.clone(), p, CudaOptions::from_env().unwrap()).map_err(|e| err(&e))?;
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
/// `testing::run_op` (or `run_op_aliased`) to name the one that fails.
fn gpu_batch(cases: &[Case], aliased: bool, runs: usize) -> Vec<Vec<HostTensor>> {
    match try_batch(cases, aliased, runs) {
        Ok(outs) => outs,
        Err(batch_err) => {
            for k in cases {
                let r = if aliased {
                    stepgraph_cuda::testing::run_op_aliased(&k.op, &k.inputs)
                } else {
                    stepgraph_cuda::testing::run_op(&k.op, &k.inputs)
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
                Cmp::Close(tols) => assert_within(&what, g, c, &tols[j]),
            }
        }
    }
    gpu
}

/// The cases with their in-place pairs sharing storage give the same bits
/// as `plain` (their out-of-place GPU outputs). FP8 products only agree
/// within their tolerance: the aliased session plans its product for other
/// operand addresses, and cuBLASLt may pick another FP8 algorithm there,
/// which sums in another order (one unit in the last place seen on an H100).
fn check_aliased(cases: &[Case], plain: &[Vec<HostTensor>]) {
    let aliased = gpu_batch(cases, true, 1);
    for (k, (a, p)) in cases.iter().zip(aliased.iter().zip(plain)) {
        for (j, (a, p)) in a.iter().zip(p).enumerate() {
            let what = format!("{} in place, output {j}", k.what);
            match (&k.op, &k.cmp) {
                (Op::MatMulFp8(_), Cmp::Close(tols)) => assert_within(&what, a, p, &tols[j]),
                _ => assert_exact(&what, a, p),
            }
        }
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
/// element within its tolerance.
fn assert_within(what: &str, got: &HostTensor, want: &HostTensor, tol: &Tol) {
    assert_eq!(got.ty, want.ty, "{what}: type");
    let (g, w) = (got.to_f64(), want.to_f64());
    let scale: Vec<f64> = match &tol.scale {
        Scale::MaxAbs { min } => {
            vec![w.iter().filter(|x| x.is_finite()).fold(*min, |m, x| m.max(x.abs())); w.len()]
        }
        Scale::PerElement(s) => s.clone(),
    };
    // The worst difference as a fraction of what element i is allowed.
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
        let allowed = (tol.rtol * scale[i] + tol.floor.get(i).copied().unwrap_or(0.0)).max(1e-300);
        if (a - b).abs() / allowed > worst.0 {
            worst = ((a - b).abs() / allowed, i);
        }
    }
    let (ratio, i) = worst;
    assert!(
        ratio <= 1.0,
        "{what}: element {i} differs by {:e}, over {:.1e} relative of {:e}{}: GPU {:e}, CPU {:e}",
        (g[i] - w[i]).abs(),
        tol.rtol,
        scale[i],
        tol.floor.get(i).map(|f| format!(" plus the term floor {f:e}")).unwrap_or_default(),
        g[i],
        w[i]
    );
}

/// Within `rtol` of the largest finite magnitude of `want`.
fn assert_close(what: &str, got: &HostTensor, want: &HostTensor, rtol: f64) {
    assert_within(what, got, want, &Tol::of(rtol));
}

// ---------------------------------------------------------------- the sweep

/// Every op's samples in every float dtype, on seeds 1 and 2 (large samples
/// on seed 1 only), batched per op, dtype and seed, against the CPU and,
/// where the op declares in-place pairs, in place against out of place.
/// A failing batch does not stop the sweep: every batch runs, and the test
/// fails at the end naming each one that failed (its message printed where
/// it failed).
#[test]
#[ignore = "needs an NVIDIA GPU: scripts/gpu-test.sh"]
fn every_sample_matches_cpu() {
    // `STEPGRAPH_TEST_OPS=matmul_fp8,fp8_quantize` checks those ops only.
    let only = std::env::var("STEPGRAPH_TEST_OPS").ok();
    let mut failed = Vec::new();
    for dt in FLOATS {
        for (name, samples) in samples_by_op(dt) {
            let op_name = samples.first().map_or("", |s| s.op.name());
            if only.as_deref().is_some_and(|ops| !ops.split(',').any(|o| o.trim() == op_name || o.trim() == name)) {
                continue;
            }
            for seed in [1, 2] {
                let mut cases = Vec::new();
                for (i, s) in samples.iter().enumerate() {
                    // Collectives need a group session of several ranks:
                    // gpu_dist.rs runs them.
                    if stepgraph_core::ops::collective::world_of(&s.op).is_some() || (s.large && seed != 1) {
                        continue;
                    }
                    // Cases the CUDA backend declines (f64 products: cuBLASLt
                    // has none) are the lowering sweep's to report, not a failure.
                    if !lowers(s) {
                        continue;
                    }
                    let inputs = draw_sample(s, seed).unwrap_or_else(|e| panic!("{name}#{i} {dt}: {e}"));
                    let cmp = comparison(&s.op, &inputs);
                    cases.push(case(format!("{name}#{i} {dt} seed {seed}"), s.op.clone(), inputs, cmp));
                }
                if cases.is_empty() {
                    continue;
                }
                let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    let plain = check_all(&cases);
                    if cases.iter().any(|c| !c.op.inplace().is_empty()) {
                        check_aliased(&cases, &plain);
                    }
                }));
                if run.is_err() {
                    failed.push(format!("{name} {dt} seed {seed}"));
                }
            }
        }
    }
    assert!(failed.is_empty(), "{} batches failed (messages above): {}", failed.len(), failed.join("; "));
}

/// Does the CUDA backend lower `s`, or decline it as unsupported? Any
/// other lowering error is a failure.
fn lowers(s: &Sample) -> bool {
    let dev = |tys: &[TensorType], base: u64| -> Vec<DevTensor> {
        tys.iter().enumerate().map(|(i, t)| DevTensor { ty: t.clone(), ptr: base + ((i as u64) << 32) }).collect()
    };
    let ins = s.input_types();
    let refs: Vec<&TensorType> = ins.iter().collect();
    let outs = s.op.infer(&refs).unwrap_or_else(|e| panic!("{}: {e}", s.op.name()));
    match stepgraph_cuda::ops::lower(&s.op, &dev(&ins, 1 << 40), &dev(&outs, 1 << 48), None) {
        Ok(_) => true,
        Err(CudaError::Unsupported { .. }) => false,
        Err(e) => panic!("{}: {e}", s.op.name()),
    }
}

/// How the GPU outputs of `op` on `inputs` must match the CPU's (see the
/// module doc). Ops not named get the pointwise rule (the last arm), which
/// a new op that reduces over many terms fails until it gets its own arm.
fn comparison(op: &Op, inputs: &[HostTensor]) -> Cmp {
    let types: Vec<&TensorType> = inputs.iter().map(|t| &t.ty).collect();
    let outs = op.infer(&types).unwrap_or_else(|e| panic!("{}: {e}", op.name()));
    let per_output = |f: &dyn Fn(&TensorType) -> Tol| Cmp::Close(outs.iter().map(f).collect());
    let dt = inputs.first().map(|t| t.ty.dtype);
    let cols = |t: &HostTensor| t.ty.shape.last().copied().unwrap_or(1);
    let rows = |t: &HostTensor| t.ty.numel() / cols(t).max(1);
    match op {
        Op::Full(_)
        | Op::Binary(_)
        | Op::Cast(_)
        | Op::MaxBackward(_)
        | Op::Broadcast(_)
        | Op::Reshape(_)
        | Op::Permute(_)
        | Op::Slice(_)
        | Op::SliceBackward(_)
        | Op::Concat(_)
        | Op::Embedding(_)
        // Each row sums its positions in ascending order in acc_t, as the CPU.
        | Op::EmbeddingBackward(_)
        // Bit copies of rows into the cache.
        | Op::KvWrite(_)
        // Token ids and positions: the kernel computes in double with the
        // CPU's noise (decode.cu), so the tokens are the CPU's.
        | Op::SampleNext(_)
        // `cvt.rna.tf32.f32` rounds as the CPU's `tf32_round`, both parts.
        | Op::SplitTf32(_)
        // The same integer mask and one correctly rounded product.
        | Op::Dropout(_)
        // One f32 product (after the absmax's `_rn` operations), rounded once.
        | Op::DequantizeNf4(_)
        // The update one `_rn` operation at a time, the block maxima (exact
        // in any order), the maps from the same f64 constants, the codes by
        // the same search.
        | Op::AdamW8bit(_)
        // An exact max, one correctly rounded division; one correctly
        // rounded multiply and the same saturating conversion per code.
        | Op::Fp8Scale(_)
        | Op::Fp8Quantize(_) => Cmp::Exact,
        // Exact products of codes summed in f32 in another order; the
        // e4m3 × e4m3 products with Hopper's fast accumulation, which keeps
        // fewer bits of the running sum: 2.4e-3 of the largest magnitude
        // measured on an H100 at a depth of 3200.
        Op::MatMulFp8(m) => {
            let k = inputs[0].ty.shape[1] * 4;
            let fast = (m.a, m.b) == (Fp8Format::E4M3, Fp8Format::E4M3);
            per_output(&|t| Tol::of(if fast { row_tol(t.dtype, k).max(6e-3) } else { row_tol(t.dtype, k) }))
        }
        Op::Reduce(r) => match r.kind {
            ReduceKind::Max => Cmp::Exact,
            kind => {
                let scale = abs_reduce(kind, &inputs[0], &r.axes, r.keepdim);
                Cmp::Close(vec![Tol { rtol: basic_tol(outs[0].dtype), scale: Scale::PerElement(scale), floor: vec![] }])
            }
        },
        // TF32 products of samples that are not TF32 values: the CPU rounds
        // each operand to nearest, a tensor core truncates the f32 data it
        // reads: up to a TF32 unit (2^-10) per operand. (3xTF32's split
        // operands are TF32 values, read alike: `gpu_step` checks those.)
        Op::MatMul(m) if m.tf32 => per_output(&|_| Tol::of(4e-3)),
        Op::MatMul(m) => {
            let a = &inputs[0].ty.shape;
            let k = if m.trans_a { a[a.len() - 2] } else { a[a.len() - 1] };
            per_output(&|t| Tol::of(row_tol(t.dtype, k)))
        }
        Op::RmsNorm(_) | Op::LayerNorm(_) | Op::Softmax(_) | Op::SoftmaxBackward(_) => {
            let c = cols(&inputs[0]);
            per_output(&|t| Tol::of(row_tol(t.dtype, c)))
        }
        Op::Rope(_) => per_output(&|t| Tol::of(row_tol(t.dtype, 1))),
        // Products over the rows' width (the weight gradient: over an
        // expert's rows); 16-bit ones on tensor cores sum in another order.
        Op::GroupedMatmul(_) => per_output(&|t| Tol::of(row_tol(t.dtype, inputs[0].ty.shape[1]))),
        Op::GroupedMatmulWeightGrad(_) => per_output(&|t| Tol::of(row_tol(t.dtype, rows(&inputs[0])))),
        // Each tensor's squares summed in f32 by runs and trees on the GPU,
        // in f64 on the CPU; the workspace is zero on both.
        Op::SquaredNorms(_) => {
            let longest = inputs.iter().map(|t| t.ty.numel()).max().unwrap_or(1);
            per_output(&|t| Tol::of(row_tol(t.dtype, longest)))
        }
        Op::RmsNormBackward(_) | Op::LayerNormBackward(_) => {
            // The weight gradient sums over every row: the longest reduction.
            let reduced = cols(&inputs[0]).max(rows(&inputs[0]));
            let terms = match op {
                Op::RmsNormBackward(n) => rms_gx_terms(inputs, n.addend),
                Op::LayerNormBackward(n) => ln_gx_terms(inputs, n.addend),
                _ => unreachable!("matched above"),
            };
            let mut tols: Vec<Tol> = outs.iter().map(|t| Tol::of(row_tol(t.dtype, reduced))).collect();
            tols[0].floor = term_floor(outs[0].dtype, terms);
            Cmp::Close(tols)
        }
        Op::CrossEntropy(_) => {
            let (r, c) = (rows(&inputs[0]), cols(&inputs[0]));
            per_output(&|t| Tol::of(row_tol(t.dtype, c.max(r))))
        }
        Op::CrossEntropyBackward(_) => {
            let c = cols(&inputs[0]);
            per_output(&|t| Tol::of(row_tol(t.dtype, c)))
        }
        Op::LinearCrossEntropy(_) | Op::LinearCrossEntropyBackward(_) => {
            // Products over the features and the rows, sums over the classes;
            // and each backend recomputes the logits and rounds them to the
            // data dtype itself, so a narrow logit may differ by one unit in
            // the last place, which moves its softmax by |logit| · 2^-8 in
            // bf16: the CPU's own narrow-versus-f64 tolerance (op_samples.rs).
            let (rows, feats, classes) = (inputs[0].ty.shape[0], inputs[0].ty.shape[1], inputs[1].ty.shape[0]);
            let reduced = rows.max(feats).max(classes);
            per_output(&|t| {
                Tol::of(match t.dtype {
                    DType::BF16 => 3e-2,
                    DType::F16 => 5e-3,
                    d => row_tol(d, reduced),
                })
            })
        }
        Op::Attention(_) => {
            let dt = dt.expect("attention has inputs");
            Cmp::Close(vec![
                Tol { rtol: attention_tol(dt), scale: Scale::MaxAbs { min: 1.0 }, floor: vec![] },
                Tol { rtol: attention_tol(stat_dtype(dt)), scale: Scale::MaxAbs { min: 1.0 }, floor: vec![] },
            ])
        }
        Op::CachedAttention(_) => cached_attention_cmp(op, inputs),
        Op::AttentionBackward(_) => {
            let dt = dt.expect("attention has inputs");
            let d = cols(&inputs[0]);
            per_output(&|_| Tol { rtol: attention_grad_tol(dt, d), scale: Scale::MaxAbs { min: 1.0 }, floor: vec![] })
        }
        Op::AllReduce(_) | Op::ReduceScatter(_) | Op::AllGather(_) | Op::LocalShard(_) => {
            panic!("{}: collectives are gpu_dist.rs's", op.name())
        }
        // Pointwise ops (unary maps, AdamW, SwiGLU, and any new op until it
        // says otherwise here): each element within its dtype's rounding of
        // the largest magnitude, the library functions (exp, tanh, ...) being
        // the only difference. An op that sums or multiplies out more terms
        // fails this and must add its own arm above.
        _ => per_output(&|t| Tol::of(basic_tol(t.dtype))),
    }
}

/// Cached attention: `o` as attention's. The partials (`m`, `l`,
/// `acc[D]` of each split, in the stat dtype) get a tolerance of their own
/// split, not the largest |partial| of the output, which an empty split's
/// `EMPTY_MAX` (−3e38) would make meaningless: `m` within its magnitude
/// (at least 1), `l` and `acc` within `max(l, 1)·max|v|`, the largest that
/// a split's Σ p·v can be, since both sides sum the same terms in f32 (f64)
/// in different orders.
fn cached_attention_cmp(op: &Op, inputs: &[HostTensor]) -> Cmp {
    let dt = inputs[0].ty.dtype;
    let width = inputs[0].ty.shape[3] + 2;
    let vmax = inputs[2].to_f64().iter().fold(1.0f64, |m, x| m.max(x.abs()));
    let part = cpu(op, inputs).remove(1).to_f64();
    let scale = (0..part.len())
        .map(|i| if i % width == 0 { part[i].abs().max(1.0) } else { part[i - i % width + 1].max(1.0) * vmax })
        .collect();
    Cmp::Close(vec![
        Tol { rtol: attention_tol(dt), scale: Scale::MaxAbs { min: 1.0 }, floor: vec![] },
        Tol { rtol: attention_tol(stat_dtype(dt)), scale: Scale::PerElement(scale), floor: vec![] },
    ])
}

/// Σ|x| (mean |x| for a mean) of every output group: the scale of the
/// rounding differences a different summation order makes.
fn abs_reduce(kind: ReduceKind, x: &HostTensor, axes: &[usize], keepdim: bool) -> Vec<f64> {
    let abs: Vec<f64> = x.to_f64().iter().map(|v| v.abs()).collect();
    let xa = HostTensor::from_f64(x.ty.with_dtype(DType::F64), &abs);
    cpu(&Op::from(Reduce { kind, axes: axes.to_vec(), keepdim }), &[xa]).remove(0).to_f64()
}

/// How many roundings of the sum of its terms' magnitudes a cancelling
/// result may differ by between the backends: each side rounds every
/// product and partial sum of the terms and the two order (and fuse) them
/// differently. The CPU's f32 result on rows of one element is within 1.5
/// such roundings of its f64 result; 8 leaves room for both sides' errors.
const TERM_ROUNDINGS: f64 = 8.0;

/// The unit roundoff of the arithmetic of `dtype`'s kernels: f32 for the
/// 16-bit types and f32 (their statistics' dtype), f64 for f64.
fn unit_roundoff(dtype: DType) -> f64 {
    if stat_dtype(dtype) == DType::F64 {
        f64::EPSILON / 2.0
    } else {
        f64::from(f32::EPSILON) / 2.0
    }
}

/// The absolute floor of a cancelling output of `dtype` whose elements sum
/// terms of magnitudes `terms` (per element, summed).
fn term_floor(dtype: DType, terms: Vec<f64>) -> Vec<f64> {
    let unit = TERM_ROUNDINGS * unit_roundoff(dtype);
    terms.into_iter().map(|t| unit * t).collect()
}

/// Per element of the RMSNorm backward's `gx` (inputs `x, w, rstd, gy[,
/// addend][, grstd]`), the sum of the magnitudes of the terms it adds up:
/// `rstd·|w·gy| + |x|·rstd³·(Σ_row |x·w·gy| + |grstd|)/C (+ |addend|)`.
fn rms_gx_terms(ins: &[HostTensor], addend: bool) -> Vec<f64> {
    let (x, w, rstd, gy) = (ins[0].to_f64(), ins[1].to_f64(), ins[2].to_f64(), ins[3].to_f64());
    let grstd = ins.get(4 + addend as usize).map(HostTensor::to_f64);
    let add = addend.then(|| ins[RMS_ADDEND].to_f64());
    let c = w.len();
    let mut terms = Vec::with_capacity(x.len());
    for (r, (xr, gyr)) in x.chunks(c).zip(gy.chunks(c)).enumerate() {
        let rs = rstd[r];
        let dot: f64 = xr.iter().zip(&w).zip(gyr).map(|((x, w), g)| (x * w * g).abs()).sum();
        let gs = grstd.as_ref().map_or(0.0, |g| g[r].abs());
        let coef = rs.powi(3) * (dot + gs) / c as f64;
        terms.extend(xr.iter().zip(&w).zip(gyr).map(|((x, w), g)| rs * (w * g).abs() + x.abs() * coef));
    }
    with_addend(terms, add)
}

/// `terms` plus the magnitude of the addend's element, when there is one.
fn with_addend(terms: Vec<f64>, add: Option<Vec<f64>>) -> Vec<f64> {
    match add {
        Some(a) => terms.iter().zip(a).map(|(t, a)| t + a.abs()).collect(),
        None => terms,
    }
}

/// Per element of the LayerNorm backward's `gx` (inputs `x, w, mean, rstd,
/// gy[, addend][, gmean, grstd]`), the sum of the magnitudes of the terms it
/// adds up: with `g = gy·w` and `x̂ = (x − mean)·rstd`,
/// `rstd·(|g| + mean|g| + |x̂|·mean|g·x̂|) + |gmean|/C + |grstd|·rstd²·|x̂|/C (+ |addend|)`.
fn ln_gx_terms(ins: &[HostTensor], addend: bool) -> Vec<f64> {
    let (x, w, mean, rstd, gy) = (ins[0].to_f64(), ins[1].to_f64(), ins[2].to_f64(), ins[3].to_f64(), ins[4].to_f64());
    let extra = addend as usize;
    let (gmean, grstd) = (ins.get(5 + extra).map(HostTensor::to_f64), ins.get(6 + extra).map(HostTensor::to_f64));
    let add = addend.then(|| ins[LN_ADDEND].to_f64());
    let c = w.len();
    let n = c as f64;
    let mut terms = Vec::with_capacity(x.len());
    for (r, (xr, gyr)) in x.chunks(c).zip(gy.chunks(c)).enumerate() {
        let (m, rs) = (mean[r], rstd[r]);
        let g: Vec<f64> = gyr.iter().zip(&w).map(|(gy, w)| (gy * w).abs()).collect();
        let xh: Vec<f64> = xr.iter().map(|x| (x - m).abs() * rs).collect();
        let mean_g = g.iter().sum::<f64>() / n;
        let mean_gx = g.iter().zip(&xh).map(|(g, xh)| g * xh).sum::<f64>() / n;
        let shift = gmean.as_ref().map_or(0.0, |v| v[r].abs()) / n;
        let stat_coef = grstd.as_ref().map_or(0.0, |v| v[r].abs()) * rs * rs / n;
        terms.extend(g.iter().zip(&xh).map(|(g, xh)| rs * (g + mean_g + xh * mean_gx) + shift + stat_coef * xh));
    }
    with_addend(terms, add)
}

// ---------------------------------------------------------------- special cases

/// 3xTF32's operands are TF32 values (both parts of `split_tf32`), which a
/// tensor core reads unchanged whether it truncates f32 data or a kernel
/// rounds it first. A product of depth 1 is then exact in f32, so
/// cuBLASLt's TF32 products of split parts, and their chain with addends
/// as the 3xTF32 pass builds it, equal the CPU's bit for bit. (Operands
/// that are not TF32 values are read within a TF32 unit:
/// `every_sample_matches_cpu`.)
#[test]
#[ignore = "needs an NVIDIA GPU: scripts/gpu-test.sh"]
fn tf32_products_of_split_parts_equal_the_cpu() {
    use stepgraph_core::ops::matmul::{MatMul, SplitTf32};
    let split = |x: HostTensor| {
        let mut parts = cpu(&Op::SplitTf32(SplitTf32), &[x]);
        let lo = parts.pop().unwrap();
        (parts.pop().unwrap(), lo)
    };
    let (a_hi, a_lo) = split(normal(&[64, 1], DType::F32, 11));
    let (b_hi, b_lo) = split(normal(&[1, 48], DType::F32, 12));
    let tf32 = |addend| MatMul { trans_a: false, trans_b: false, addend, tf32: true, fp8: None };
    let mut cases = Vec::new();
    for (what, a, b) in [("lo·hi", &a_lo, &b_hi), ("hi·lo", &a_hi, &b_lo), ("hi·hi", &a_hi, &b_hi)] {
        cases.push(case(format!("tf32 {what}"), tf32(false), vec![a.clone(), b.clone()], Cmp::Exact));
    }
    // The pass's chain: each product added to the last, one rounding each.
    let p = cpu(&Op::MatMul(tf32(false)), &[a_lo.clone(), b_hi.clone()]).pop().unwrap();
    cases.push(case("tf32 hi·lo + p", tf32(true), vec![a_hi.clone(), b_lo.clone(), p.clone()], Cmp::Exact));
    let p = cpu(&Op::MatMul(tf32(true)), &[a_hi.clone(), b_lo.clone(), p]).pop().unwrap();
    cases.push(case("tf32 hi·hi + p", tf32(true), vec![a_hi.clone(), b_hi.clone(), p], Cmp::Exact));
    check_all(&cases);
}

/// Every special value, checked on its own: signed zeros (a memset for
/// +0.0), values rounding through f32, infinity and NaN.
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
        if let Ok(y) = stepgraph_cuda::testing::run_op(&Op::from(Embedding), &[i.clone(), table.clone()]) {
            let (y, t) = (y[0].to_f64(), table.to_f64());
            for (p, &id) in raw.iter().enumerate() {
                for c in 0..width {
                    let want = if valid(id) { t[id as usize * width + c] } else { 0.0 };
                    assert_eq!(y[p * width + c], want, "embedding {id_dt}: position {p} (id {id}) column {c}");
                }
            }
        }
        let op = Op::from(EmbeddingBackward { num_rows: rows });
        if let Ok(gt) = stepgraph_cuda::testing::run_op(&op, &[i.clone(), gy.clone()]) {
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
        AdamW { beta1: 0.3, beta2: 0.95, eps: 1e-6, weight_decay: 0.1, ..AdamW::default() },
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
                let state = vec![p0.clone(), m0.clone(), v0.clone()];
                configs.push((label.clone(), Op::from(hyper.clone()), st, state.clone(), state));
                // 16-bit parameters also with each kind of master state, from zero.
                if matches!(pt, DType::BF16 | DType::F16) {
                    for master in [MasterWeights::F32, MasterWeights::Kahan] {
                        let w = HostTensor::zeros(TensorType::new(master.state_dtype(pt).unwrap(), shape.to_vec()));
                        let state = vec![p0.clone(), m0.clone(), v0.clone(), w];
                        let op = Op::from(AdamW { master, ..hyper.clone() });
                        configs.push((format!("{label} {}", master.name()), op, st, state.clone(), state));
                    }
                }
            }
        }
    }
    for (step, lr) in [(1.0, 1e-3), (2.0, 5e-4), (3.0, 2e-2)] {
        let mut cases = Vec::new();
        let mut cpu_inputs = Vec::new();
        for (n, (label, op, st, cs, gs)) in configs.iter().enumerate() {
            let grad = normal(&gs[0].ty.shape, gs[0].ty.dtype, 1000 * step as u64 + n as u64);
            let args = |s: &[HostTensor]| {
                let mut a =
                    vec![s[0].clone(), grad.clone(), s[1].clone(), s[2].clone(), scalar(*st, lr), scalar(*st, step)];
                a.extend(s.get(3).cloned());
                a
            };
            let cmp = Cmp::Close(gs.iter().map(|t| Tol::of(basic_tol(t.ty.dtype))).collect());
            cases.push(case(format!("{label} step {step}"), op.clone(), args(gs), cmp));
            cpu_inputs.push(args(cs));
        }
        let gpu = gpu_batch(&cases, false, 1);
        for ((k, g), (config, ci)) in cases.iter().zip(&gpu).zip(configs.iter_mut().zip(&cpu_inputs)) {
            let c = cpu(&k.op, ci);
            for (j, name) in ["p", "m", "v", "master state"].iter().enumerate().take(c.len()) {
                assert_close(&format!("{}: {name}", k.what), &g[j], &c[j], basic_tol(c[j].ty.dtype));
            }
            // The master-state kernels do the CPU's operations in its order: the same bits.
            if matches!(&k.op, Op::AdamW(h) if h.master != MasterWeights::None) {
                for (j, t) in c.iter().enumerate() {
                    assert_exact(&format!("{}: output {j}", k.what), &g[j], t);
                }
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
        if let Ok(out) = stepgraph_cuda::testing::run_op(&op, &inputs) {
            for (j, i) in [(0, 0), (1, 2), (2, 3)] {
                assert_exact(&format!("adamw lr {lr} step {step}: output {j}"), &out[j], &inputs[i]);
            }
        }
    }
}
