//! Prints a trace as readable text that [`super::parse`] reads back.
//!
//! ```text
//! # after: autodiff
//! trace grads
//! input %0: i32[1,8] tokens
//! param %1: f32[256,64] model.embed_tokens.weight
//! == forward ==
//! %5: f32[1,8,64] = embedding %0, %1
//! %6: f32[1,8,64], %7: f32[1,8] = rms_norm %5, %2 {eps=1e-6}
//! == backward ==
//! saved %5, %6
//! ...
//! output loss %20
//! output grad %31 model.embed_tokens.weight
//! update %1 <- %40
//! ```

use std::fmt::{self, Write};

use crate::ir::{OutputKind, Trace, ValueKind};

/// Optional per-value annotations appended as comments (the memory plan uses this).
pub type Annotate<'a> = &'a dyn Fn(crate::ir::ValueId) -> Option<String>;

impl fmt::Display for Trace {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&print(self, None))
    }
}

/// The trace as text; `annotate` adds a `# ...` comment after values it knows.
pub fn print(trace: &Trace, annotate: Option<Annotate>) -> String {
    let mut s = String::new();
    let note = |v| annotate.and_then(|a| a(v)).map(|n| format!("  # {n}")).unwrap_or_default();
    writeln!(s, "# after: {}", trace.pass).unwrap();
    writeln!(s, "trace {}", trace.name).unwrap();
    for v in trace.leaves() {
        let val = trace.value(v);
        let (kind, name) = match &val.kind {
            ValueKind::Input { name } => ("input", name),
            ValueKind::Param { name } => ("param", name),
            ValueKind::Frozen { name } => ("frozen", name),
            ValueKind::State { name } => ("state", name),
            ValueKind::Node(_) => unreachable!("leaves only"),
        };
        writeln!(s, "{kind} {v}: {} {name}{}", val.ty, note(v)).unwrap();
    }
    let mut phase = None;
    for node in &trace.nodes {
        if phase != Some(node.phase) {
            writeln!(s, "== {} ==", node.phase.name()).unwrap();
            if phase.is_some() && !trace.saved.is_empty() && node.phase == crate::ir::Phase::Backward {
                let list: Vec<String> = trace.saved.iter().map(|v| v.to_string()).collect();
                writeln!(s, "saved {}", list.join(", ")).unwrap();
            }
            phase = Some(node.phase);
        }
        let outs: Vec<String> = node.outputs.iter().map(|&o| format!("{o}: {}", trace.ty(o))).collect();
        let ins: Vec<String> = node.inputs.iter().map(|i| i.to_string()).collect();
        write!(s, "{} = {}", outs.join(", "), node.op.name()).unwrap();
        if !ins.is_empty() {
            write!(s, " {}", ins.join(", ")).unwrap();
        }
        let attrs = node.op.attrs();
        if !attrs.is_empty() {
            let a: Vec<String> = attrs.iter().map(|(k, v)| format!("{k}={v}")).collect();
            write!(s, " {{{}}}", a.join(", ")).unwrap();
        }
        let notes: String = node.outputs.iter().map(|&o| note(o)).collect();
        writeln!(s, "{notes}").unwrap();
    }
    for o in &trace.outputs {
        match &o.kind {
            OutputKind::Loss => writeln!(s, "output loss {}", o.value),
            OutputKind::Grad(p) => {
                let name = trace.value(*p).kind.leaf_name().unwrap_or("?");
                writeln!(s, "output grad {} {name}", o.value)
            }
            OutputKind::Named(n) => writeln!(s, "output value {} {n}", o.value),
        }
        .unwrap();
    }
    for u in &trace.updates {
        writeln!(s, "update {} <- {}", u.state, u.new).unwrap();
    }
    s
}
