//! The IR's text form: print → parse → print is stable, parsed traces are
//! verified, and bad traces (hand-built or textual) get errors that name the
//! problem.

use stepgraph_core::ir::parse::parse;
use stepgraph_core::ir::{Builder, DType, OutputKind, Phase, TensorType};
use stepgraph_core::ops::UnaryFn;

fn small_trace() -> stepgraph_core::ir::Trace {
    let mut b = Builder::new("small");
    let x = b.input("x", TensorType::new(DType::F32, [2, 3])).unwrap();
    let w = b.param("layer.weight", TensorType::new(DType::F32, [4, 3])).unwrap();
    let y = b.linear(x, w, None).unwrap();
    let y = b.unary(UnaryFn::Pow(2.5), y).unwrap();
    let y = b.unary(UnaryFn::GeluTanh, y).unwrap();
    let s = b.sum_all(y).unwrap();
    b.set_phase(Phase::Backward);
    let one = b.full(1e-6, TensorType::scalar(DType::F32)).unwrap();
    let s2 = b.mul(s, one).unwrap();
    b.output(OutputKind::Loss, s2);
    b.output(OutputKind::Named("activations".into()), y);
    b.finish("build").unwrap()
}

#[test]
fn print_parse_print_is_stable() {
    let t = small_trace();
    let text = t.to_string();
    let parsed = parse(&text).unwrap();
    assert_eq!(parsed, t);
    assert_eq!(parsed.to_string(), text);
    assert!(text.starts_with("# after: build\ntrace small\n"), "{text}");
    assert!(text.contains("= pow %"), "{text}");
    assert!(text.contains("{exponent=2.5}"), "{text}");
    assert!(text.contains("saved %"), "{text}");
}

#[test]
fn comments_and_blank_lines_are_ignored() {
    let t = small_trace();
    let text = t.to_string().replace("\n== forward ==\n", "\n\n# a comment\n== forward ==  # trailing\n");
    assert_eq!(parse(&text).unwrap(), t);
}

#[test]
fn hand_built_shape_mismatch_names_op_and_shapes() {
    let mut b = Builder::new("bad");
    let x = b.input("x", TensorType::new(DType::F32, [2, 3])).unwrap();
    let w = b.param("w", TensorType::new(DType::F32, [5, 4])).unwrap();
    let err = b.linear(x, w, None).unwrap_err().to_string();
    assert!(err.contains("matmul"), "{err}");
    assert!(err.contains("f32[2,3]") && err.contains("f32[5,4]"), "{err}");
    assert!(err.contains("contraction sizes differ: 3 and 4"), "{err}");
}

#[test]
fn malformed_trace_text_gets_a_line_number() {
    let good = small_trace().to_string();
    let cases = [
        (good.replace("= pow", "= pow_wrong"), "no such op"),
        (good.replace("{exponent=2.5}", "{exponent=2.5, bogus=1}"), "unknown attribute `bogus`"),
        (good.replace("{exponent=2.5}", "{}"), "missing attribute `exponent`"),
        (good.replace("f32[2,3]", "f33[2,3]"), "unknown dtype `f33`"),
        (good.replacen("trace small", "trace small\nfrobnicate %1", 1), "cannot parse `frobnicate %1`"),
        (good.replace("== forward ==", "== sideways =="), "unknown phase `sideways`"),
    ];
    for (text, want) in cases {
        let err = parse(&text).unwrap_err().to_string();
        assert!(err.contains("line"), "{err}");
        assert!(err.contains(want), "expected `{want}` in: {err}");
    }
    // A type that contradicts the op's shape rule fails verification.
    let lines: Vec<&str> = good.lines().collect();
    let i = lines.iter().position(|l| l.contains("= matmul")).unwrap();
    let bad_line = lines[i].replacen("f32[2,4]", "f32[2,5]", 1);
    let text = good.replace(lines[i], &bad_line);
    let err = parse(&text).unwrap_err().to_string();
    assert!(err.contains("infers f32[2,4]"), "{err}");
}
