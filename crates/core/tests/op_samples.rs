//! The op table's CPU tests: every op's samples (`OpDef::samples`, listed
//! by `samples_by_op`) through the VJP finite-difference check in f64 (or,
//! for backward ops, collectives and the optimizer, the refusal to be
//! differentiated), in-place kernels against out-of-place runs in every
//! float dtype, f32/bf16/f16 kernels against f64 on the same values, and
//! kernels that write every output element whatever the output buffers
//! held. Samples marked `large` are left to the GPU sweeps.
//!
//! Each test collects every failure and reports them together, each named
//! by op variant, sample index and dtype.

use stepgraph_core::host::HostTensor;
use stepgraph_core::ir::DType;
use stepgraph_core::ops::sample::FLOAT_DTYPES;
use stepgraph_core::ops::{samples_by_op, Input, Sample, OP_VARIANTS};
use stepgraph_core::testing::{check_vjp, draw_sample, run_op, run_op_aliased, run_op_filled};
use stepgraph_core::Error;

/// The samples of `dtype` the CPU suite runs, named `Variant#index`.
fn cpu_samples(dtype: DType) -> Vec<(String, Sample)> {
    samples_by_op(dtype)
        .into_iter()
        .flat_map(|(name, samples)| {
            samples.into_iter().enumerate().filter(|(_, s)| !s.large).map(move |(i, s)| (format!("{name}#{i}"), s))
        })
        .collect()
}

fn report(what: &str, failures: &[String]) {
    assert!(failures.is_empty(), "{what}: {} failures:\n{}", failures.len(), failures.join("\n"));
}

/// The names of the ops that have no sample in any float dtype.
fn ops_without_samples() -> Vec<&'static str> {
    let tables: Vec<Vec<(&'static str, Vec<Sample>)>> = FLOAT_DTYPES.iter().map(|&d| samples_by_op(d)).collect();
    OP_VARIANTS
        .iter()
        .copied()
        .filter(|name| {
            tables.iter().all(|t| t.iter().find(|(n, _)| n == name).is_none_or(|(_, samples)| samples.is_empty()))
        })
        .collect()
}

#[test]
fn every_op_has_samples() {
    let missing = ops_without_samples();
    assert!(missing.is_empty(), "ops without samples in any float dtype: {}", missing.join(", "));
    let listed: Vec<&str> = samples_by_op(DType::F32).iter().map(|(n, _)| *n).collect();
    assert_eq!(listed, OP_VARIANTS, "samples_by_op must list every op of the op list, in order");
}

/// Sample `i` of a narrow dtype is sample `i` of f64 with other float
/// types (the narrow-vs-f64 test pairs them); a narrow dtype may list more
/// only where those extra samples have no float input or are of a form f64
/// cannot take (TF32 products, 8-bit optimizer state). Every sample passes
/// its op's shape rule, and every sample of an op is the op itself.
#[test]
fn sample_tables_line_up_across_dtypes() {
    let wide = samples_by_op(DType::F64);
    let mut failures = Vec::new();
    for d in FLOAT_DTYPES {
        for ((name, samples), (_, wide)) in samples_by_op(d).iter().zip(&wide) {
            if samples.len() < wide.len() {
                failures.push(format!("{name} {d}: {} samples, f64 has {}", samples.len(), wide.len()));
            }
            for (i, s) in samples.iter().enumerate() {
                let types = s.input_types();
                if let Err(e) = s.op.infer(&types.iter().collect::<Vec<_>>()) {
                    failures.push(format!("{name}#{i} {d}: rejected by its shape rule: {e}"));
                }
                if !format!("{:?}", s.op).starts_with(&format!("{name}(")) {
                    failures.push(format!("{name}#{i} {d}: lists another op, {:?}", s.op));
                }
                match wide.get(i) {
                    Some(w) => {
                        let shapes = |s: &Sample| s.input_types().into_iter().map(|t| t.shape).collect::<Vec<_>>();
                        if w.op.name() != s.op.name() || shapes(w) != shapes(s) || w.large != s.large {
                            failures.push(format!("{name}#{i} {d}: differs from f64's {:?}", w.op));
                        }
                    }
                    // A narrow-only sample with float inputs: only for a
                    // form of the op that f64 cannot take (TF32 products,
                    // their operand split, 8-bit optimizer state).
                    None if s.input_types().iter().any(|t| t.dtype.is_float()) => {
                        let in_f64: Vec<_> = types
                            .iter()
                            .map(|t| if t.dtype.is_float() { t.with_dtype(DType::F64) } else { t.clone() })
                            .collect();
                        if s.op.infer(&in_f64.iter().collect::<Vec<_>>()).is_ok() {
                            failures.push(format!("{name}#{i} {d}: a narrow-only sample of a form f64 takes too"))
                        }
                    }
                    None => {}
                }
            }
        }
    }
    report("sample tables", &failures);
}

/// Are all outputs of the op on this sample f64 (or integer) and finite?
/// The f64 check needs f64 outputs (a cast to bf16 has no useful finite
/// difference) and finite ones (the NaN loss of a batch with every row
/// ignored has no derivative).
fn checkable(sample: &Sample) -> bool {
    let Ok(x) = draw_sample(sample, 0) else { return false };
    let Ok(y) = run_op(&sample.op, &x) else { return false };
    y.iter().all(|t| t.ty.dtype.is_int() || (t.ty.dtype == DType::F64 && t.to_f64().iter().all(|v| v.is_finite())))
        && sample.inputs.iter().any(|i| i.differentiable())
}

#[test]
fn every_vjp_matches_finite_differences_in_f64() {
    let (mut failures, mut checked, mut refused) = (Vec::new(), 0, 0);
    let (mut skipped, mut zero_jacobians) = (Vec::new(), Vec::new());
    for (name, s) in cpu_samples(DType::F64) {
        // An op's own VJP rule says whether it is differentiable: backward
        // ops, the optimizer and collectives refuse with `NotDifferentiable`
        // naming themselves; any other error is a failure below.
        match check_vjp(&s, 0) {
            Err(Error::NotDifferentiable { op, .. }) if op == s.op.name() => {
                refused += 1;
                continue;
            }
            Err(Error::NotDifferentiable { op, .. }) => {
                failures.push(format!("{name}: the refusal names `{op}`, not `{}`", s.op.name()));
                continue;
            }
            _ => {}
        }
        if !checkable(&s) {
            skipped.push(name);
            continue;
        }
        let (mut signal, mut vjp) = (0.0f64, 0.0f64);
        for seed in 0..3 {
            match check_vjp(&s, seed) {
                Ok(r) if r.rel_err() < 1e-6 => (signal, vjp) = (signal.max(r.jvp_fd.abs()), vjp.max(r.vjp.abs())),
                Ok(r) => failures.push(format!("{name} seed {seed}: {r:?} (rel err {:.3e})", r.rel_err())),
                Err(e) => failures.push(format!("{name} seed {seed}: {e}")),
            }
        }
        // A vanishing product would pass any comparison: require a signal,
        // unless the Jacobian is zero (the VJP rule gives exactly zero and
        // the differences agree), as for a softmax over rows of one element.
        if vjp == 0.0 && signal < 1e-9 {
            zero_jacobians.push(name);
        } else if signal < 1e-3 {
            failures.push(format!("{name}: ⟨J·u, v⟩ is below 1e-3 for every seed, the check is degenerate"));
        }
        checked += 1;
    }
    println!(
        "VJP: {checked} samples checked, {refused} refused, skipped {skipped:?}, zero Jacobians {zero_jacobians:?}"
    );
    report("VJP checks", &failures);
    // Only samples without f64 outputs, without finite outputs or without
    // differentiable inputs are skipped: casts to narrow types, fills, the
    // all-ignored cross-entropy, top-k over rows of ties (which no small
    // step leaves in place). A handful, not whole ops.
    assert!(checked > 300 && refused > 100, "checked {checked}, refused {refused}");
    assert!(skipped.len() < 64, "skipped {} samples: {skipped:?}", skipped.len());
    assert!(zero_jacobians.len() <= 2, "zero Jacobians: {zero_jacobians:?}");
}

#[test]
fn in_place_kernels_match_out_of_place() {
    let mut failures = Vec::new();
    let mut runs = 0;
    for d in FLOAT_DTYPES {
        for (name, s) in cpu_samples(d) {
            if s.op.inplace().is_empty() {
                continue;
            }
            let x = draw_sample(&s, 7).unwrap_or_else(|e| panic!("{name} {d}: {e}"));
            let plain = run_op(&s.op, &x).unwrap_or_else(|e| panic!("{name} {d}: {e}"));
            let aliased = run_op_aliased(&s.op, &x).unwrap_or_else(|e| panic!("{name} {d}: in place: {e}"));
            for (k, (p, a)) in plain.iter().zip(&aliased).enumerate() {
                if p.bytes() != a.bytes() {
                    failures.push(format!("{name} {d}: output {k} differs in place"));
                }
            }
            runs += 1;
        }
    }
    report("in-place runs", &failures);
    assert!(runs > 200, "only {runs} in-place runs");
}

/// Relative tolerance of a dtype's kernels against f64 on the same values,
/// relative to the largest magnitude of each output.
fn narrow_tol(d: DType) -> f64 {
    match d {
        DType::F32 => 1e-5,
        DType::BF16 => 3e-2,
        DType::F16 => 5e-3,
        _ => 0.0,
    }
}

/// NaN where and only where `want` is NaN, the same infinities, and the
/// finite elements within `tol` of the largest finite |want|.
fn compare(got: &HostTensor, want: &HostTensor, tol: f64) -> Result<(), String> {
    if got.ty.shape != want.ty.shape {
        return Err(format!("shape {:?}, want {:?}", got.ty.shape, want.ty.shape));
    }
    let (g, w) = (got.to_f64(), want.to_f64());
    let scale = w.iter().filter(|x| x.is_finite()).fold(0.0f64, |m, x| m.max(x.abs())).max(1e-30);
    for (i, (a, b)) in g.iter().zip(&w).enumerate() {
        let ok = if b.is_nan() || a.is_nan() {
            a.is_nan() && b.is_nan()
        } else if b.is_infinite() || a.is_infinite() {
            a == b
        } else {
            (a - b).abs() <= tol * scale
        };
        if !ok {
            return Err(format!("element {i}: {a:e}, f64 gives {b:e} (max |f64| {scale:e})"));
        }
    }
    Ok(())
}

#[test]
fn narrow_dtypes_track_f64() {
    let wide: Vec<(&str, Vec<Sample>)> = samples_by_op(DType::F64);
    let mut failures = Vec::new();
    let mut runs = 0;
    for d in [DType::F32, DType::BF16, DType::F16] {
        for ((name, samples), (_, wide)) in samples_by_op(d).iter().zip(&wide) {
            for (i, (s, w)) in samples.iter().zip(wide).enumerate().filter(|(_, (s, _))| !s.large) {
                // The f64 run sees exactly the narrow values, so only the
                // kernels' arithmetic differs.
                let x = draw_sample(s, 3).unwrap_or_else(|e| panic!("{name}#{i} {d}: {e}"));
                let xw: Vec<HostTensor> =
                    x.iter().zip(&w.inputs).map(|(t, wi)| HostTensor::from_f64(wi.ty().clone(), &t.to_f64())).collect();
                let got = run_op(&s.op, &x).unwrap_or_else(|e| panic!("{name}#{i} {d}: {e}"));
                let want = run_op(&w.op, &xw).unwrap_or_else(|e| panic!("{name}#{i} f64: {e}"));
                for (k, (g, r)) in got.iter().zip(&want).enumerate() {
                    if let Err(e) = compare(g, r, narrow_tol(d)) {
                        failures.push(format!("{name}#{i} {d} output {k}: {e}"));
                    }
                }
                runs += 1;
            }
        }
    }
    report("narrow dtypes against f64", &failures);
    assert!(runs > 1000, "only {runs} runs");
}

#[test]
fn kernels_write_every_output_element() {
    let mut failures = Vec::new();
    for d in FLOAT_DTYPES {
        for (name, s) in cpu_samples(d) {
            let x = draw_sample(&s, 5).unwrap_or_else(|e| panic!("{name} {d}: {e}"));
            let zeros = run_op_filled(&s.op, &x, 0x00).unwrap_or_else(|e| panic!("{name} {d}: {e}"));
            let ones = run_op_filled(&s.op, &x, 0xFF).unwrap_or_else(|e| panic!("{name} {d}: {e}"));
            for (k, (a, b)) in zeros.iter().zip(&ones).enumerate() {
                if a.bytes() != b.bytes() {
                    failures.push(format!("{name} {d}: output {k} depends on what its buffer held"));
                }
            }
        }
    }
    report("outputs over garbage", &failures);
}

/// From one seed, every dtype's drawn inputs are the f64 sample's drawn
/// inputs rounded to its types (computed inputs aside, which the narrow
/// kernels compute from those rounded values).
#[test]
fn every_dtype_draws_the_f64_values_rounded() {
    let wide = samples_by_op(DType::F64);
    let mut compared = 0;
    for d in [DType::F32, DType::BF16, DType::F16] {
        for ((name, samples), (_, wide)) in samples_by_op(d).iter().zip(&wide) {
            for (i, (s, w)) in samples.iter().zip(wide).enumerate().filter(|(_, (s, _))| !s.large) {
                let (x, xw) = (draw_sample(s, 11).unwrap(), draw_sample(w, 11).unwrap());
                for (k, ((a, b), input)) in x.iter().zip(&xw).zip(&s.inputs).enumerate() {
                    if matches!(input, Input::Output { .. }) {
                        continue;
                    }
                    let rounded = HostTensor::from_f64(a.ty.clone(), &b.to_f64());
                    assert!(a.bytes() == rounded.bytes(), "{name}#{i} {d} input {k}: not the f64 draw rounded");
                    compared += 1;
                }
            }
        }
    }
    assert!(compared > 3000, "only {compared} inputs compared");
}

/// Every sample's op, alone in a trace, prints as text that parses back to
/// a trace printing the same: each attribute (lists of numbers included)
/// survives. (Text, not the traces, is compared: a NaN fill value is
/// itself but not equal to itself.)
#[test]
fn every_sample_op_prints_and_parses_back() {
    use stepgraph_core::ir::{parse::parse, Builder, OutputKind};
    let mut failures = Vec::new();
    for dtype in FLOAT_DTYPES {
        for (name, sample) in cpu_samples(dtype) {
            let mut b = Builder::new("op");
            let inputs: Vec<_> = sample
                .input_types()
                .into_iter()
                .enumerate()
                .map(|(i, ty)| b.input(&format!("x{i}"), ty).unwrap())
                .collect();
            let Ok(outs) = b.push(sample.op.clone(), &inputs) else { continue };
            for (i, v) in outs.into_iter().enumerate() {
                b.output(OutputKind::Named(format!("y{i}")), v);
            }
            let text = b.finish("build").unwrap().to_string();
            match parse(&text) {
                Ok(back) if back.to_string() == text => {}
                Ok(_) => failures.push(format!("{name} {dtype}: parses back as another trace")),
                Err(e) => failures.push(format!("{name} {dtype}: {e}")),
            }
        }
    }
    report("print and parse", &failures);
}
