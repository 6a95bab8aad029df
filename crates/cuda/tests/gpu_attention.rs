//! The fused attention kernels on the GPU beyond their samples (which
//! `gpu_basic.rs`'s sweep runs against the CPU in every dtype: every head
//! size bucket and sizes between, MHA, GQA and MQA, sequence lengths around
//! the tile sizes, the tensor-core widths, unit-scale logits, the backward
//! with and without the lse cotangent): large logits in every dtype,
//! the CUDA-core kernels forced by `STEPGRAPH_ATTENTION=simt`, bitwise
//! determinism, the W1 and W2 benchmark shapes checked on whole kv
//! groups, and the samples with sliding windows, soft-caps and packed
//! documents on every kernel family (warpgroup, `mma.sync`, CUDA-core), all
//! against the CPU reference (`stepgraph_core::testing::run_op`).
//!
//! Every test needs an NVIDIA GPU: `scripts/gpu-test.sh`.

use std::ops::Range;

use stepgraph_core::host::HostTensor;
use stepgraph_core::ir::{DType, TensorType};
use stepgraph_core::ops::attention::{Attention, AttentionBackward};
use stepgraph_core::ops::sample::normal;
use stepgraph_core::ops::{samples_by_op, Op, Sample};
use stepgraph_core::testing::{draw_input, draw_sample, run_op as cpu_run};
use stepgraph_cuda::testing::run_op as gpu_run;

mod common;
use common::{attention_grad_tol, attention_tol};

const DTYPES: [DType; 4] = [DType::F32, DType::BF16, DType::F16, DType::F64];

/// lse is stored in the stat dtype (f32, or f64 for f64 inputs).
fn stat(dtype: DType) -> DType {
    if dtype == DType::F64 {
        DType::F64
    } else {
        DType::F32
    }
}

fn lse_tol(dtype: DType) -> f64 {
    attention_tol(stat(dtype))
}

/// Largest |got − want| over max(max |want|, 1): relative to the reference's
/// scale, with a floor for outputs that are zero up to rounding (gq and gk at
/// T = 1, where p = 1 and o = v make `go·v − go·o` cancel exactly; both sides
/// then hold only rounding noise of the O(1) terms). Inputs are unit normal,
/// so the outputs are O(1). NaN counts as infinitely wrong.
fn err(got: &HostTensor, want: &HostTensor) -> f64 {
    assert_eq!(got.ty, want.ty, "output types differ");
    let (a, b) = (got.to_f64(), want.to_f64());
    let scale = b.iter().fold(1.0f64, |m, x| m.max(x.abs()));
    a.iter().zip(&b).fold(0.0f64, |m, (x, y)| {
        let d = (x - y).abs() / scale;
        if d.is_nan() {
            f64::INFINITY
        } else {
            m.max(d)
        }
    })
}

#[derive(Copy, Clone, Debug)]
struct Case {
    dtype: DType,
    b: usize,
    t: usize,
    hq: usize,
    hkv: usize,
    d: usize,
    scale: f64,
    seed: u64,
}

impl Case {
    fn new(dtype: DType, b: usize, t: usize, (hq, hkv): (usize, usize), d: usize, seed: u64) -> Case {
        Case { dtype, b, t, hq, hkv, d, scale: 1.0 / (d as f64).sqrt(), seed }
    }

    fn qkv(&self) -> Vec<HostTensor> {
        let (b, t, hq, hkv, d, dt) = (self.b, self.t, self.hq, self.hkv, self.d, self.dtype);
        let qkv = vec![normal(dt, &[b, t, hq, d]), normal(dt, &[b, t, hkv, d]), normal(dt, &[b, t, hkv, d])];
        draw_sample(&Sample::new(Attention::causal(self.scale), qkv), self.seed).unwrap()
    }

    /// The cotangents (go, glse) of (o, lse).
    fn cotangents(&self) -> (HostTensor, HostTensor) {
        let go = draw_input(&normal(self.dtype, &[self.b, self.t, self.hq, self.d]), self.seed ^ 0x5eed);
        let glse = draw_input(&normal(stat(self.dtype), &[self.b, self.hq, self.t]), self.seed ^ 0x15e);
        (go.unwrap(), glse.unwrap())
    }
}

/// Collects mismatches so one run reports every failing case.
#[derive(Default)]
struct Report(Vec<String>);

impl Report {
    fn check(&mut self, case: &Case, what: &str, got: &HostTensor, want: &HostTensor, tol: f64) {
        let e = err(got, want);
        if e.is_nan() || e > tol {
            self.0.push(format!("{case:?}: {what} off by {e:.3e} (tolerance {tol:.0e})"));
        }
    }

    fn finish(self) {
        assert!(self.0.is_empty(), "{} mismatches:\n{}", self.0.len(), self.0.join("\n"));
    }
}

fn gpu(op: &Op, inputs: &[HostTensor]) -> Vec<HostTensor> {
    gpu_run(op, inputs).unwrap_or_else(|e| panic!("GPU {}: {e}", op.name()))
}

fn cpu(op: &Op, inputs: &[HostTensor]) -> Vec<HostTensor> {
    cpu_run(op, inputs).unwrap_or_else(|e| panic!("CPU {}: {e}", op.name()))
}

/// Forward, then the backward without and with glse (on the CPU forward's
/// o and lse, so both sides see the same inputs), each against the CPU.
fn check_case(c: &Case, report: &mut Report, slack: f64) {
    let qkv = c.qkv();
    let fwd = Op::from(Attention { scale: c.scale, scores: Default::default() });
    let want = cpu(&fwd, &qkv);
    let got = gpu(&fwd, &qkv);
    report.check(c, "o", &got[0], &want[0], attention_tol(c.dtype) * slack);
    report.check(c, "lse", &got[1], &want[1], lse_tol(c.dtype) * slack);

    let (go, glse) = c.cotangents();
    let bwd = Op::from(AttentionBackward { scale: c.scale, scores: Default::default(), documents: false });
    let mut ins: Vec<HostTensor> = qkv.clone();
    ins.extend([want[0].clone(), want[1].clone(), go]);
    for with_glse in [false, true] {
        if with_glse {
            ins.push(glse.clone());
        }
        let want = cpu(&bwd, &ins);
        let got = gpu(&bwd, &ins);
        for (k, name) in ["gq", "gk", "gv"].iter().enumerate() {
            let what = format!("{name}{}", if with_glse { " (with glse)" } else { "" });
            report.check(c, &what, &got[k], &want[k], attention_grad_tol(c.dtype, c.d) * slack);
        }
    }
}

/// Logits of unit scale (not 1/√D): the running max moves often and far,
/// which exercises the online rescaling.
#[test]
#[ignore = "needs an NVIDIA GPU: scripts/gpu-test.sh"]
fn large_logits() {
    let mut report = Report::default();
    let mut seed = 8000;
    for dtype in DTYPES {
        for d in [1, 4, 16, 64, 128] {
            seed += 1;
            let c = Case { scale: 1.0, ..Case::new(dtype, 2, 200, (4, 2), d, seed) };
            check_case(&c, &mut report, 1.0);
        }
    }
    report.finish();
}

/// Same inputs, same bits: no atomics, fixed accumulation orders.
#[test]
#[ignore = "needs an NVIDIA GPU: scripts/gpu-test.sh"]
fn repeated_runs_give_identical_bits() {
    for (i, (dtype, d, heads, t)) in [
        (DType::F32, 100, (8, 2), 257),
        (DType::F32, 1, (28, 4), 300),
        (DType::BF16, 128, (4, 4), 129),
        (DType::F16, 64, (8, 1), 200),
        (DType::F64, 256, (4, 2), 70),
        (DType::F32, 16, (4, 1), 513),
        (DType::BF16, 256, (4, 1), 300),
    ]
    .into_iter()
    .enumerate()
    {
        let c = Case::new(dtype, 2, t, heads, d, 9000 + i as u64);
        let qkv = c.qkv();
        let fwd = Op::from(Attention { scale: c.scale, scores: Default::default() });
        let a = gpu(&fwd, &qkv);
        let b = gpu(&fwd, &qkv);
        assert!(a == b, "{c:?}: two forward runs differ");
        let (go, glse) = c.cotangents();
        let mut ins = qkv;
        ins.extend([a[0].clone(), a[1].clone(), go, glse]);
        let bwd = Op::from(AttentionBackward { scale: c.scale, scores: Default::default(), documents: false });
        let a = gpu(&bwd, &ins);
        let b = gpu(&bwd, &ins);
        assert!(a == b, "{c:?}: two backward runs differ");
    }
}

/// Every padded width the Hopper backward (warpgroup MMA) takes, 16-bit,
/// with T off the 64-row tiles, GQA and head sizes that are not multiples of
/// 8 (narrower copies); then the same cases on the portable `mma.sync`
/// kernels (`STEPGRAPH_PORTABLE_KERNELS=1`), which Hopper no longer runs for
/// these widths.
#[test]
#[ignore = "needs an NVIDIA GPU: scripts/gpu-test.sh"]
fn warpgroup_widths_match_cpu() {
    let mut report = Report::default();
    let mut seed = 13000;
    for portable in [false, true] {
        if portable {
            std::env::set_var("STEPGRAPH_PORTABLE_KERNELS", "1");
        }
        for dtype in [DType::BF16, DType::F16] {
            for (d, t, heads) in [
                (72, 77, (4, 2)),
                (80, 130, (2, 2)),
                // kv heads starting 0, 2, 4 and 6 columns past a 16-byte
                // boundary: the warpgroup passes' shifted tiles (grouped,
                // only the forward shifts; the backward runs mma.sync).
                (90, 200, (4, 4)),
                (90, 200, (8, 4)),
                (96, 64, (4, 1)),
                (100, 200, (4, 2)),
                (112, 65, (2, 1)),
                (120, 150, (4, 4)),
                (128, 300, (8, 2)),
                // Eight key tiles of 128: the warpgroup forward's three
                // stages wrap twice, their phase parities back to the first.
                (104, 1000, (2, 1)),
            ] {
                seed += 1;
                check_case(&Case::new(dtype, 2, t, heads, d, seed), &mut report, 1.0);
            }
        }
    }
    std::env::remove_var("STEPGRAPH_PORTABLE_KERNELS");
    report.finish();
}

/// Head sizes over 128 in 16-bit storage (Gemma's 256), which the
/// tensor-core kernels pad to 256 and whose key side splits its columns
/// over two blocks: T off the tiles, GQA, and sizes short of 256 (the
/// padding and the column halves' edges).
#[test]
#[ignore = "needs an NVIDIA GPU: scripts/gpu-test.sh"]
fn wide_heads_match_cpu() {
    let mut report = Report::default();
    let mut seed = 14000;
    for dtype in [DType::BF16, DType::F16] {
        for (d, t, heads) in
            [(256, 300, (4, 1)), (256, 64, (2, 2)), (129, 77, (4, 2)), (200, 130, (6, 3)), (255, 33, (2, 1))]
        {
            seed += 1;
            check_case(&Case::new(dtype, 2, t, heads, d, seed), &mut report, 1.0);
        }
    }
    report.finish();
}

/// Gemma-3-1B's attention: T = 8192, 4 query heads on one kv head of 256, bf16.
#[test]
#[ignore = "needs an NVIDIA GPU: scripts/gpu-test.sh"]
fn gemma3_1b_shape() {
    benchmark_shape(Case::new(DType::BF16, 1, 8192, (4, 1), 256, 15), &[0]);
}

/// Heads `range` of a tensor along `axis` (2 for [B, T, H, D], 1 for lse [B, H, T]).
fn take_heads(t: &HostTensor, axis: usize, range: Range<usize>) -> HostTensor {
    let s = &t.ty.shape;
    let (outer, n, inner) = (s[..axis].iter().product::<usize>(), s[axis], s[axis + 1..].iter().product::<usize>());
    let x = t.to_f64();
    let mut out = Vec::with_capacity(outer * range.len() * inner);
    for o in 0..outer {
        for h in range.clone() {
            let at = (o * n + h) * inner;
            out.extend_from_slice(&x[at..at + inner]);
        }
    }
    let mut shape = s.clone();
    shape[axis] = range.len();
    HostTensor::from_f64(TensorType::new(t.ty.dtype, shape), &out)
}

/// A benchmark-sized problem on the GPU, checked against the CPU on whole
/// kv groups (query heads `kv·G..(kv+1)·G` with kv head `kv` form an
/// independent problem), with the tolerance widened by √(T/256) for the
/// longer sums.
fn benchmark_shape(c: Case, kv_heads: &[usize]) {
    let g = c.hq / c.hkv;
    let slack = (c.t as f64 / 256.0).sqrt().max(1.0);
    let qkv = c.qkv();
    let fwd = Op::from(Attention { scale: c.scale, scores: Default::default() });
    let got = gpu(&fwd, &qkv);
    let (go, glse) = c.cotangents();
    let bwd = Op::from(AttentionBackward { scale: c.scale, scores: Default::default(), documents: false });
    let mut ins = qkv.clone();
    ins.extend([got[0].clone(), got[1].clone(), go, glse]);
    let gotb = gpu(&bwd, &ins);

    let mut report = Report::default();
    for &kv in kv_heads {
        let (qh, kh) = (kv * g..(kv + 1) * g, kv..kv + 1);
        let sub = Case { hq: g, hkv: 1, ..c };
        let part = |t: &HostTensor, kv_side: bool| take_heads(t, 2, if kv_side { kh.clone() } else { qh.clone() });
        let sub_qkv = vec![part(&qkv[0], false), part(&qkv[1], true), part(&qkv[2], true)];
        let want = cpu(&fwd, &sub_qkv);
        report.check(
            &sub,
            &format!("o of kv group {kv}"),
            &part(&got[0], false),
            &want[0],
            attention_tol(c.dtype) * slack,
        );
        let lse = take_heads(&got[1], 1, qh.clone());
        report.check(&sub, &format!("lse of kv group {kv}"), &lse, &want[1], lse_tol(c.dtype) * slack);

        let mut sub_ins = sub_qkv;
        sub_ins.extend([part(&ins[3], false), lse, part(&ins[5], false), take_heads(&ins[6], 1, qh.clone())]);
        let wantb = cpu(&bwd, &sub_ins);
        for (k, name) in ["gq", "gk", "gv"].iter().enumerate() {
            let g = part(&gotb[k], k > 0);
            report.check(
                &sub,
                &format!("{name} of kv group {kv}"),
                &g,
                &wantb[k],
                attention_grad_tol(c.dtype, c.d) * slack,
            );
        }
    }
    report.finish();
}

/// W1: B = 1, T = 2048, 32 heads of 100, f32.
#[test]
#[ignore = "needs an NVIDIA GPU: scripts/gpu-test.sh"]
fn w1_shape_f32() {
    benchmark_shape(Case::new(DType::F32, 1, 2048, (32, 32), 100, 11), &[0, 1, 17, 31]);
}

/// W2: T = 4096, 28 query heads on 4 kv heads of size 1.
#[test]
#[ignore = "needs an NVIDIA GPU: scripts/gpu-test.sh"]
fn w2_shape() {
    benchmark_shape(Case::new(DType::F32, 1, 4096, (28, 4), 1, 12), &[0, 3]);
    benchmark_shape(Case::new(DType::BF16, 2, 4096, (28, 4), 1, 13), &[1]);
}

/// W1-bf16: B = 1, T = 2048, 32 heads of 100 in bf16 (tensor-core kernels).
#[test]
#[ignore = "needs an NVIDIA GPU: scripts/gpu-test.sh"]
fn w1_shape_bf16() {
    benchmark_shape(Case::new(DType::BF16, 1, 2048, (32, 32), 100, 14), &[0, 13, 31]);
}

/// The CUDA-core kernels (`STEPGRAPH_ATTENTION=simt`) on head sizes the
/// tensor-core kernels would take otherwise (the sweep in `gpu_basic.rs`
/// runs those), for contrast.
#[test]
#[ignore = "needs an NVIDIA GPU: scripts/gpu-test.sh"]
fn simt_kernels_match_cpu() {
    let mut report = Report::default();
    std::env::set_var("STEPGRAPH_ATTENTION", "simt");
    for (seed, d) in [(12101, 64), (12102, 100)] {
        check_case(&Case::new(DType::BF16, 1, 200, (4, 2), d, seed), &mut report, 1.0);
    }
    std::env::remove_var("STEPGRAPH_ATTENTION");
    report.finish();
}

/// The attention samples with a window, a soft-cap or packed documents
/// (windows and documents shorter and longer than a tile, head sizes of
/// every kernel family up to 256, GQA), forward and backward, on each
/// kernel family in turn: the default (warpgroup MMA on Hopper for 16-bit
/// widths 80..=128), `mma.sync` (`STEPGRAPH_PORTABLE_KERNELS=1`) and the
/// CUDA-core kernels (`STEPGRAPH_ATTENTION=simt`), each against the CPU.
#[test]
#[ignore = "needs an NVIDIA GPU: scripts/gpu-test.sh"]
fn windows_soft_caps_and_documents_match_cpu_on_every_kernel_family() {
    let masked = |op: &Op, inputs: usize| match op {
        Op::Attention(a) => a.scores != Default::default() || inputs == 4,
        Op::AttentionBackward(a) => a.scores != Default::default() || a.documents,
        _ => false,
    };
    let mut failed = Vec::new();
    let mut checked = 0;
    for (var, value) in [(None, ""), (Some("STEPGRAPH_PORTABLE_KERNELS"), "1"), (Some("STEPGRAPH_ATTENTION"), "simt")] {
        if let Some(v) = var {
            std::env::set_var(v, value);
        }
        for dtype in [DType::BF16, DType::F16, DType::F32] {
            for (name, samples) in samples_by_op(dtype) {
                for (i, s) in samples.iter().enumerate().filter(|(_, s)| masked(&s.op, s.inputs.len())) {
                    let inputs = draw_sample(s, 7).unwrap();
                    let (got, want) = (gpu(&s.op, &inputs), cpu(&s.op, &inputs));
                    let d = inputs[0].ty.shape[3];
                    for (k, (g, w)) in got.iter().zip(&want).enumerate() {
                        let tol = match (&s.op, k) {
                            (Op::Attention(_), 0) => attention_tol(dtype),
                            (Op::Attention(_), _) => lse_tol(dtype),
                            (_, 3) => continue, // delta: the row terms, checked through gq and gk
                            _ => attention_grad_tol(dtype, d),
                        };
                        let e = err(g, w);
                        if e.is_nan() || e > tol {
                            failed.push(format!(
                                "{var:?} {name}#{i} {dtype} output {k}: off by {e:.3e} (tolerance {tol:.0e})"
                            ));
                        }
                    }
                    checked += 1;
                }
            }
        }
        if let Some(v) = var {
            std::env::remove_var(v);
        }
    }
    assert!(checked > 100, "only {checked} masked samples");
    assert!(failed.is_empty(), "{} mismatches:\n{}", failed.len(), failed.join("\n"));
}
